"""Converts a checkpoint of the original RT-DETR repository (lyuwenyu/RT-DETR, PyTorch) into an

The command lives in the package (``latte_plugin.cli.convert_rtdetr_original``; also ``python -m latte_plugin.cli.convert_rtdetr_original``),
so an installed wheel has it too: ``python tools/convert_rtdetr_original.py --help``.
"""
from latte_plugin.cli.convert_rtdetr_original import main

if __name__ == "__main__":
    main()
