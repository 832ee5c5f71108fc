# The one-epoch pilot of checkpoints/README.md (not the committed checkpoint's recipe): the committed
# model's ViT stayed near its random start beside DEIMv2's CNN spatial tuning adapter. This shrinks
# the adapter to 1 channel per stage, so the neck must read the ViT, and trains the ViT at 5x the base
# rate (1e-3). Its ViT attention sharpened, but its uniform control still kept 99.6% after one epoch.
# Train:  python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_synthetic_vitpath.py
_base_ = ['./deimv2_vit6_synthetic.py']

model = dict(hf_overrides=dict(spatial_tuning_adapter_inplanes=1))
# bypass_duplicate: DEIMv2 shares some head modules across decoder layers (one parameter, several names)
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=5.0)}, bypass_duplicate=True))
