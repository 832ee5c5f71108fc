"""latte-plugin: training-free LATTE attention linearization for MMDetection and Detectron2."""
from setuptools import find_packages, setup

setup(
    name="latte-plugin",
    version="0.1.0",
    description="Plug-and-play calibrated linear attention (LATTE) for pretrained DETR-family detectors",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["latte_plugin", "latte_plugin.*"]),
    # read at run time through importlib.resources (latte_plugin/resources/__init__.py)
    package_data={"latte_plugin.resources": ["architectures/*.json"]},
    install_requires=["torch>=2.1", "numpy", "safetensors"],
    extras_require={
        # mmcv 2.1.0 must be compiled with ops from source: see tools/setup_env.sh.
        "mmdet": ["mmengine==0.10.7", "mmcv>=2.0.0rc4,<2.2.0", "mmdet==3.3.0", "pycocotools"],
        # detectron2 is not on PyPI: install it from its official source repository.
        # plus detectron2 itself, from its official source (README); RT-DETR needs transformers, not mmdet
        "detectron2": ["pycocotools", "transformers>=5.0"],
        "hf": ["transformers>=5.0"],  # the HF adapter uses the attention-interface dispatch (tested: 5.24)
        "plots": ["matplotlib"],
        "onnx": ["onnx", "onnxruntime"],  # latte_plugin.export_onnx, tools/export_onnx.py
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "matplotlib", "rich"],
    },
)
