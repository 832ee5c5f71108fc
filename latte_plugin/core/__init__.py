"""Framework-free LATTE: kernels, per-layer state, calibration, selection, FLOPs, I/O.

Imports torch only; the mmdet and detectron2 adapters import this, never the reverse.
"""
from .calibration import LayerRecorder, fit_layer, reconstruction_error
from .settings import LatteConfig
from .flow import calibrate_model, calibrate_model_ratios
from .layer import find_latte_layers, match_candidates, set_modes
from .io import atomic_write_json, atomic_torch_save
from .kernels import VARIANTS
from .layer import MODES, LatteParams
from .mha import LatteMultiheadAttention, latte_mha_forward, project_mha, swap_mha
from .selection import greedy_select, naive_sensitivity_score, num_linear_layers, select_by_score

__all__ = [
    "VARIANTS", "MODES", "LatteParams", "LatteConfig", "LayerRecorder", "calibrate_model", "calibrate_model_ratios", "fit_layer",
    "reconstruction_error", "find_latte_layers", "match_candidates", "set_modes", "latte_mha_forward",
    "project_mha", "greedy_select", "naive_sensitivity_score", "num_linear_layers", "select_by_score",
    "atomic_write_json", "atomic_torch_save", "LatteMultiheadAttention", "swap_mha",
]
