"""LATTE layers for inference, torch only: one layer's state and dispatch (:mod:`.params`),
finding and setting layers in a model (:mod:`.install`), the ``nn.MultiheadAttention`` drop-in
(:mod:`.mha`). Nothing here knows calibration or a framework."""
from .install import find_latte_layers, layer_states, match_candidates, restore_layer_states, set_backend, set_modes
from .mha import LatteMultiheadAttention, latte_mha_forward, project_mha, swap_mha
from .params import MODES, LatteParams, merge_heads

__all__ = ["MODES", "LatteParams", "merge_heads", "find_latte_layers", "match_candidates", "set_modes", "set_backend",
           "layer_states", "restore_layer_states", "LatteMultiheadAttention", "latte_mha_forward", "project_mha",
           "swap_mha"]
