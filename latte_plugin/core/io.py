"""Atomic writes: a crash mid-write never leaves a half-written report or checkpoint."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch

__all__ = ["atomic_write_json", "atomic_torch_save"]


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
