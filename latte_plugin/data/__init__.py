"""Generated, offline detection data (COCO format) for the embedded default and the tests."""
from .synthetic import make_synthetic_coco

__all__ = ["make_synthetic_coco"]
