import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors under Triton's interpreter; set before anything (inductor,
    # transformers) imports triton, which reads it once (tests/test_triton_kernel.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one worker per core (tools/test.sh): torch, and the processes a test starts, on one thread each,
    # so two workers do not fight over the two cores
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    """Modules with a long test (``@pytest.mark.timeout(>= 600)``) run first, each module kept whole
    (its module fixtures are built once): under ``--dist worksteal`` the last tests are then short
    ones, so the two workers finish together instead of one waiting on a long test."""
    def heavy(item) -> bool:
        mark = item.get_closest_marker("timeout")
        return bool(mark and mark.args and mark.args[0] >= 600)

    heavy_modules = {item.module.__name__ for item in items if heavy(item)}
    items.sort(key=lambda item: item.module.__name__ not in heavy_modules)  # stable: order kept inside


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def qkv(b=2, h=4, n=37, m=None, d=16, dv=None, dtype=torch.float32, scale=1.0):
    m = n if m is None else m
    dv = d if dv is None else dv
    g = torch.Generator().manual_seed(1234)
    q = torch.randn(b, h, n, d, generator=g) * scale
    k = torch.randn(b, h, m, d, generator=g) * scale
    v = torch.randn(b, h, m, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


#: Optional frameworks: when one of these (top-level) modules is absent, its tests skip.
OPTIONAL = {"detectron2": "detectron2 is not installed (bash tools/test.sh installs it from LATTE_DETECTRON2_SRC "
                          "or its official repository: README, 'The two commands')",
            "mmdet": "mmdet is not installed", "mmcv": "mmcv is not installed", "mmengine": "mmengine is not installed",
            "transformers": "transformers is not installed"}


def require(module: str):
    """Imports an optional framework, or skips the calling test module with the reason.

    Only an ``ImportError`` raised while importing the framework itself skips: the framework is
    missing, or installed so that it cannot be imported (a build without its C extension, a
    missing dependency). Anything else propagates and fails the run: another exception type
    (a bug), a name that is not an optional framework, and every import error in our own
    adapters, which test modules import after ``require``. Under CI (``CI=true``) the README's
    set-up installs the mmdet stack, so a missing one there is a failure, not a skip.
    """
    import importlib

    top = module.split(".")[0]
    if top not in OPTIONAL:
        raise ValueError(f"{module!r} is not an optional framework ({', '.join(OPTIONAL)}); import it directly")
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") and top in ("mmdet", "mmcv", "mmengine"):
            pytest.fail(f"{module} must be installed in CI (tools/setup_env.sh installs it): {e}", pytrace=False)
        missing = isinstance(e, ModuleNotFoundError) and e.name == top
        reason = OPTIONAL[top] if missing else f"{module} cannot be imported ({e}): {OPTIONAL[top]}"
        pytest.skip(reason, allow_module_level=True)


#: The paper's protocol (score selection, sigma correction, no compensation, no signal) for the tests
#: of the frameworks' plumbing: the adaptive defaults' searches are what tests/test_configurations.py,
#: tests/test_core_calibration.py and the two-process launches cover.
PAPER = dict(selection="score", correction="sigma", compensate="never", signal=False)

TINY_CFG = os.path.join(ROOT, "configs", "mmdet", "detr_tiny_latte_synthetic.py")


@pytest.fixture(scope="session")
def synthetic_data(tmp_path_factory):
    from latte_plugin.data.synthetic import make_synthetic_coco

    return make_synthetic_coco(str(tmp_path_factory.mktemp("synthetic")), num_train=8, num_val=4, size=128, seed=0)


def tiny_cfg(data_root, work_dir, path: str = TINY_CFG, **hook):
    """A tiny config (DETR by default) pointed at ``data_root``, with LinearizeHook settings
    overridden; ``data_root`` / ``work_dir`` ``None`` keep the config's."""
    from mmengine.config import Config

    from latte_plugin.mmdet.workflow import unformatted

    cfg = unformatted(Config.fromfile(path))  # as the tools load it: no yapf pass over its text
    if data_root is not None:
        root = data_root.rstrip("/") + "/"
        for key in ("train_dataloader", "val_dataloader", "test_dataloader"):
            cfg[key]["dataset"]["data_root"] = root
        for key in ("val_evaluator", "test_evaluator"):
            cfg[key]["ann_file"] = root + "annotations/instances_val.json"
    cfg.custom_hooks[0].update(hook)
    if work_dir is not None:
        cfg.work_dir = work_dir
    cfg.default_hooks.checkpoint = None
    return cfg


def lively(model: torch.nn.Module) -> torch.nn.Module:
    """Re-initialises every conv with He's normal init, in place. transformers' own random init of
    some detectors (D-FINE's HGNetV2 + hybrid encoder) shrinks the signal to ~1e-12 by the
    encoder: every token then scores alike, the two-stage top-k picks among exact ties, and tests
    compare tie-breaking rather than computation. Trained weights are not like that."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Conv2d):
            torch.nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
    return model
