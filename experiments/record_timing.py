#!/usr/bin/env python
"""Runs a command, measures its wall time, and records it in ``results/timings.json``.

    python -m experiments.record_timing --machine "fresh cache, 2 cores" [--note TEXT] -- bash tools/test.sh
    python -m experiments.record_timing --machine ... --seconds 812 -- bash tools/demo.sh   # timed by the shell

The row is keyed by (command, machine): a new measurement replaces the old one. The README's
timings table is generated from this file (``experiments/readme_tables.py``). The command's output
passes through; its exit status is returned (and a failed run is not recorded).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from latte_plugin.console import first_paragraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("--machine", required=True, help="what the run had: e.g. 'fresh cache, 2 cores'")
    p.add_argument("--note", default="", help="anything a reader needs to weigh the figure")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "timings.json"))
    p.add_argument("--seconds", type=float,
                   help="record a wall time measured outside (e.g. by the shell's `time`) instead of running the command")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("give the command after --")
    t0 = time.time()
    rc = 0 if a.seconds is not None else subprocess.call(cmd)
    seconds = a.seconds if a.seconds is not None else time.time() - t0
    if rc != 0:
        print(f"[record_timing] exit {rc}: not recorded", file=sys.stderr)
        return rc
    from latte_plugin.storage import atomic_write_json

    data = json.load(open(a.out)) if os.path.exists(a.out) else {"rows": []}
    # the user-visible command: the environment that matters is in 'machine'
    shown = shlex.join(cmd)
    data["rows"] = [r for r in data["rows"] if (r["command"], r["machine"]) != (shown, a.machine)]
    data["rows"].append({"command": shown, "machine": a.machine, "seconds": round(seconds, 1), "note": a.note,
                         "date": time.strftime("%Y-%m-%d")})
    atomic_write_json(data, a.out)
    print(f"[record_timing] {shown}: {seconds / 60:.1f} min -> {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
