"""Export a calibrated mmdet detector (the DETR family or ``HFRTDETR``) to ONNX, and check it.

The command lives in the package (``latte_plugin.cli.export_onnx``; also ``python -m latte_plugin.cli.export_onnx``),
so an installed wheel has it too: ``python tools/export_onnx.py --help``.
"""
from latte_plugin.cli.export_onnx import main

if __name__ == "__main__":
    main()
