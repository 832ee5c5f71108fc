"""``LATTEAttention``: a registry drop-in for mmcv's ``MultiheadAttention``."""
from __future__ import annotations

from mmcv.cnn.bricks.transformer import MultiheadAttention
from mmdet.registry import MODELS

from ..nn.mha import LatteMultiheadAttention

__all__ = ["LATTEAttention"]


@MODELS.register_module()
class LATTEAttention(MultiheadAttention):
    """mmcv ``MultiheadAttention`` whose inner ``nn.MultiheadAttention`` has a LATTE core.

    Same constructor arguments and forward signature as mmcv's; the residual is added
    inside, as mmcv does. Parameter names are unchanged (``attn.in_proj_weight``, ...), so a
    pretrained checkpoint loads as is; the LATTE state lives in ``attn.latte.*``. In exact
    mode the output is mmcv's own.

    Note: mmdet's DETR layers build ``MultiheadAttention`` directly, not through the
    registry, so configs of those models use :class:`LinearizeHook`'s candidate patterns.
    This class serves models that build ``self_attn_cfg`` through ``MODELS``.

    Args:
        variant: LATTE variant (``qtvit``, ``jpn_only``, ``tte_only``, ``latte``).
        Other args: as mmcv's ``MultiheadAttention``.
    """

    def __init__(self, *args, variant: str = "latte", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.attn = LatteMultiheadAttention.from_torch(self.attn, variant=variant)

    @property
    def latte(self):
        return self.attn.latte
