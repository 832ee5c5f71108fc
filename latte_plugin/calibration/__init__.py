"""Training-free calibration, framework-free (torch only). Modules by job, each importing only
the ones above it in this list (``docs/architecture.md``):

config (settings, vocabularies, defaults) -> state (calibrate or apply) -> context (one typed
run) -> taps -> record -> corrections -> fit -> measures -> judge -> select -> report ->
compensate -> signal -> flow (the steps, top-down).
"""
from .config import LatteConfig, num_linear_layers
from .context import Host
from .fit import fit_layer
from .corrections import reconstruction_error
from .flow import calibrate_model, calibrate_model_ratios
from .record import LayerRecorder
from .select import greedy_select, naive_sensitivity_score, select_by_score
from .state import apply_inference_settings, needs_calibration

__all__ = ["LatteConfig", "Host", "calibrate_model", "calibrate_model_ratios", "LayerRecorder", "fit_layer",
           "reconstruction_error", "num_linear_layers", "greedy_select", "naive_sensitivity_score", "select_by_score",
           "needs_calibration", "apply_inference_settings"]
