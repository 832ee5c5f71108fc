"""Checkpoints and reports: atomic writes (a crash mid-write never leaves a half-written file),
the one place their names are defined, and the checks that a checkpoint fits a model."""
from __future__ import annotations

import copy
import json
import os
import tempfile
from typing import Any, Iterable

import torch

__all__ = ["atomic_write", "atomic_write_json", "read_json", "atomic_torch_save", "save_checkpoint", "save_calibrated_checkpoint",
           "REPORT_NAME", "CKPT_NAME", "CheckpointError", "check_readable", "check_keys", "check_checkpoint",
           "key_mismatch", "shape_mismatch", "ALLOWED_MISMATCH", "latte_layers_in", "check_latte_candidates",
           "checkpoint_state"]

#: File names the tools write into a work dir.
REPORT_NAME = "latte_report.json"
CKPT_NAME = "latte_calibrated.pth"
#: Keys that may be absent from a checkpoint or present without a model counterpart: LATTE's
#: own buffers (a plain checkpoint into a LATTE model, or a calibrated one into an exact model).
ALLOWED_MISMATCH = (".latte.",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model (the message says which and why)."""


def check_readable(path: str) -> None:
    """Raises :class:`CheckpointError` naming ``path`` unless ``torch.load(weights_only=True)`` reads it."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file; check the path")
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any failure means the same to the user
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason}); pass a .pth file written by "
                              "torch.save (mmdet, detectron2 or tools/calibrate.py)") from None


def checkpoint_state(checkpoint: Any) -> dict:
    """The state dict inside a checkpoint (mmengine's ``state_dict``, detectron2's ``model``, or a bare one)."""
    if isinstance(checkpoint, dict):
        for key in ("state_dict", "model"):
            if isinstance(checkpoint.get(key), dict):
                return checkpoint[key]
    return checkpoint if isinstance(checkpoint, dict) else {}


def key_mismatch(model_keys: list[str], ckpt_keys: list[str]) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)`` keys beyond :data:`ALLOWED_MISMATCH` (a ``module.`` prefix ignored)."""
    ckpt = {k[len("module."):] if k.startswith("module.") else k for k in ckpt_keys}
    ours = set(model_keys)
    allowed = lambda k: any(a in k for a in ALLOWED_MISMATCH)  # noqa: E731
    return (sorted(k for k in ours - ckpt if not allowed(k)), sorted(k for k in ckpt - ours if not allowed(k)))


def shape_mismatch(model_state: dict, ckpt_state: dict) -> list[str]:
    """``'key: checkpoint (shape) vs model (shape)'`` for every key both hold with another shape
    (a ``module.`` prefix ignored; LATTE's buffers included: theirs follow the model's widths)."""
    out = []
    for k, v in ckpt_state.items():
        k = k[len("module."):] if k.startswith("module.") else k
        ours = model_state.get(k)
        if ours is not None and hasattr(v, "shape") and tuple(v.shape) != tuple(ours.shape):
            out.append(f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(ours.shape)}")
    return sorted(out)


def latte_layers_in(keys: Iterable[str]) -> set[str]:
    """The layers holding LATTE state among state-dict ``keys``: each key's part before
    ``.latte.`` (a ``module.`` prefix ignored)."""
    keys = (k[len("module."):] if k.startswith("module.") else k for k in keys)
    return {k.rsplit(".latte.", 1)[0] for k in keys if ".latte." in k}


def check_latte_candidates(model_keys: Iterable[str], checkpoint_keys: Iterable[str], path: str) -> None:
    """The one rule of both frameworks: a checkpoint that holds LATTE state was calibrated for
    this config's candidates only if it holds that state for exactly the layers this model has
    LATTE layers in; a checkpoint without LATTE state (the pretrained model) always fits.

    Raises:
        CheckpointError: one line naming ``path``, the layers that differ and what to do.
    """
    ours, theirs = latte_layers_in(model_keys), latte_layers_in(checkpoint_keys)
    if not theirs or theirs == ours:
        return
    extra, missing = sorted(theirs - ours), sorted(ours - theirs)
    raise CheckpointError(
        f"{path} was calibrated for other LATTE candidates ({len(extra)} calibrated layer(s) this config does not "
        f"name, e.g. {', '.join(extra[:2]) or '-'}; {len(missing)} named layer(s) without state, e.g. "
        f"{', '.join(missing[:2]) or '-'}): it comes from another model or config; re-run tools/calibrate.py for "
        "this config")


def check_keys(model: torch.nn.Module, checkpoint: Any, path: str, hint: str = "allow_partial_load=True") -> None:
    """Raises :class:`CheckpointError` when the checkpoint does not fit the model: keys that do
    not match (beyond LATTE's buffers) or tensors of another shape (e.g. another ``num_classes``
    or ``embed_dims``, which mmengine would skip with a warning). It comes from another model or config."""
    model_state, state = model.state_dict(), checkpoint_state(checkpoint)
    missing, unexpected = key_mismatch(list(model_state), list(state))
    if missing or unexpected:
        raise CheckpointError(mismatch_message(path, missing, unexpected, hint))
    shapes = shape_mismatch(model_state, state)
    if shapes:
        raise CheckpointError(f"{path} does not fit this model: {len(shapes)} tensor(s) of another shape (e.g. "
                              f"{'; '.join(shapes[:2])}); it is a checkpoint of another model or config (another "
                              f"num_classes or width?); pass the right one, or set {hint} to load it partially")


def check_checkpoint(model: torch.nn.Module, path: str, hint: str = "allow_partial_load=True") -> None:
    """Reads the checkpoint file at ``path`` and checks it against ``model`` (:func:`check_readable`,
    :func:`check_keys`): every tool that loads a checkpoint calls this first.

    Raises:
        CheckpointError: one line naming ``path`` and what to do.
    """
    check_readable(path)
    check_keys(model, torch.load(path, map_location="cpu", weights_only=True, mmap=True), path, hint)


def mismatch_message(path: str, missing: list[str], unexpected: list[str], hint: str) -> str:
    return (f"{path} does not fit this model: {len(missing)} model key(s) missing from it (e.g. "
            f"{', '.join(missing[:3]) or '-'}) and {len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3]) or '-'}); "
            f"it is a checkpoint of another model or config; pass the right one, or set {hint} to load it partially")


def atomic_write(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.basename(path), dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(obj: Any, path: str) -> None:
    """Writes ``obj`` as indented JSON to ``path`` via a temporary file and a rename."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=False).encode()))


def read_json(path: str, missing: Any = None) -> Any:
    """The parsed JSON at ``path``, or a copy of ``missing`` where there is no file yet (a job's first run)."""
    if not path or not os.path.isfile(path):
        return copy.deepcopy(missing)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary file and a rename. Save only tensors and plain types,
    so the file loads with ``torch.load(..., weights_only=True)``."""
    atomic_write(path, lambda f: torch.save(obj, f))


def save_checkpoint(state_dict: dict, meta: dict, path: str) -> None:
    """Writes ``{'meta', 'state_dict', 'model'}`` atomically: ``state_dict`` is mmengine's key and
    ``model`` detectron2's, the same tensors stored once, so one file loads in both frameworks
    (and with ``weights_only=True``: tensors and plain types only)."""
    state = {k: v.detach().cpu() for k, v in state_dict.items()}
    atomic_torch_save({"meta": meta, "state_dict": state, "model": state}, path)


def save_calibrated_checkpoint(model: torch.nn.Module, report: dict, path: str) -> None:
    """The calibrated checkpoint of a bare (unwrapped) model, with the LATTE settings in ``meta``."""
    meta = {"latte": {k: report[k] for k in ("variant", "candidates", "linearized", "config")}}
    save_checkpoint(model.state_dict(), meta, path)
