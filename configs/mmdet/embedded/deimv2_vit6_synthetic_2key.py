# The embedded ViT-backbone detector trained on the two-key data, where both key colours are in
# most images and each object takes the colour of the key nearer to it, so no image-wide average
# names the class: the backbone's attention has to find the right key.
#   python -m latte_plugin.data.synthetic data/synthetic_512_2key --train 4000 --val 300 --size 512 --two-keys 0.75
#   python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_synthetic_2key.py
# Recipe: deimv2_vit6_synthetic_vitpath.py's (1-channel CNN adapter, the ViT at 5x the rate), 3 epochs.
_base_ = ['./deimv2_vit6_synthetic_vitpath.py']

_root = 'data/synthetic_512_2key/'
train_dataloader = dict(dataset=dict(data_root=_root))
val_dataloader = dict(dataset=dict(data_root=_root))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator
