#!/usr/bin/env python
"""Records the kernel scalars ``(m, rho)`` of every linear layer of calibrated checkpoints, for
the 16-bit kernel tests (``tests/test_triton_kernel.py``): they must hold for the scalars real
calibrations produce, not only for hand-picked ones.

    python -m experiments.record_scalars NAME=CKPT [NAME=CKPT ...] [--out tests/data/calibrated_scalars.json]

CKPT is a calibrated checkpoint (``tools/calibrate.py`` or ``experiments/main_job.py``'s
``latte_calibrated.pth``); NAME prefixes its layers in the file.
"""
from __future__ import annotations

import argparse
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def linear_layer_scalars(path: str) -> list[dict]:
    """``[{layer, m, rho}]`` (per head) of the checkpoint's layers in a non-exact mode."""
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    out = []
    for key, mode in state.items():
        if not key.endswith(".latte.mode_id") or int(mode) == 0:
            continue
        prefix = key[: -len("mode_id")]
        out.append({"layer": prefix[: -len(".latte.")], "m": state[prefix + "m"].double().tolist(),
                    "rho": state[prefix + "log_rho"].double().exp().tolist()})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoints", nargs="+", metavar="NAME=CKPT", help="a name and a calibrated checkpoint")
    p.add_argument("--out", default=os.path.join(ROOT, "tests", "data", "calibrated_scalars.json"))
    a = p.parse_args(argv)
    from latte_plugin.storage import CheckpointError, atomic_write_json, check_readable

    rows = []
    for item in a.checkpoints:
        name, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"error: {item!r} is not NAME=CKPT")
        try:
            check_readable(path)
        except CheckpointError as e:
            raise SystemExit(f"error: {e}") from None
        layers = linear_layer_scalars(path)
        if not layers:
            raise SystemExit(f"error: {path} has no linear LATTE layer; pass a calibrated checkpoint")
        rows += [dict(name=f"{name}:{r['layer']}", checkpoint=os.path.relpath(path, ROOT), **r) for r in layers]
    result = {"command": "python -m experiments.record_scalars " + " ".join(a.checkpoints), "layers": rows}
    atomic_write_json(result, a.out)
    print(f"{len(rows)} linear layers -> {a.out} (rho from {min(min(r['rho']) for r in rows):.3g} "
          f"to {max(max(r['rho']) for r in rows):.3g})")
    return result


if __name__ == "__main__":
    main()
