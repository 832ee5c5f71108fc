"""Atomic writes: a crash mid-write never leaves a half-written report or checkpoint."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

__all__ = ["atomic_write_json", "atomic_torch_save", "save_checkpoint", "save_calibrated_checkpoint"]


def _atomic(path: str, write) -> None:
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
    _atomic(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=False).encode()))


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` through a temporary file and a rename. Save only tensors and plain types,
    so the file loads with ``torch.load(..., weights_only=True)``."""
    _atomic(path, lambda f: torch.save(obj, f))


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
