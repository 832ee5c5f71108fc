"""Calibrate LATTE on a detector config, write a calibrated checkpoint and a report.

The command lives in the package (``latte_plugin.cli.calibrate``; also ``python -m latte_plugin.cli.calibrate``),
so an installed wheel has it too: ``python tools/calibrate.py --help``.
"""
from latte_plugin.cli.calibrate import main

if __name__ == "__main__":
    main()
