"""Rewrites an mmdet checkpoint (a model-zoo file or a Runner's ``epoch_N.pth``) as

The command lives in the package (``latte_plugin.cli.slim_checkpoint``; also ``python -m latte_plugin.cli.slim_checkpoint``),
so an installed wheel has it too: ``python tools/slim_checkpoint.py --help``.
"""
from latte_plugin.cli.slim_checkpoint import main

if __name__ == "__main__":
    main()
