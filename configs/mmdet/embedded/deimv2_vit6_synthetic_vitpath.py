# A retrain recipe candidate for the ViT detector (a pilot, not the committed checkpoint's recipe):
# the committed model's ViT stayed near its random start while DEIMv2's CNN spatial tuning adapter
# carried boxes and shapes (checkpoints/README.md). This shrinks the adapter to 1 channel per stage,
# so the neck must read the ViT, and trains the ViT at 5x the base rate (1e-3).
# Train:  python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_synthetic_vitpath.py
_base_ = ['./deimv2_vit6_synthetic.py']

model = dict(hf_overrides=dict(spatial_tuning_adapter_inplanes=1))
# bypass_duplicate: DEIMv2 shares some head modules across decoder layers (one parameter, several names)
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=5.0)}, bypass_duplicate=True))
