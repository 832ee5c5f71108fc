# The embedded ViT-backbone detector: transformers' Deimv2ForObjectDetection with a 6-block
# DINOv3-style ViT (global attention, RoPE, patch 16: 1,024 tokens at 512x512), wrapped as the
# mmdet detector latte_plugin.mmdet.HFDetector and trained from scratch with mmdet's own loop on
# the generated two-key data at 512 px, where 3 in 4 images hold a red and a blue key and each
# object takes the colour of the nearer one (no image-wide average names the class):
#   python -m latte_plugin.data.synthetic data/synthetic_512_2key --train 4000 --val 300 --size 512 --two-keys 0.75
# Train:  python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_synthetic.py
# LATTE:  see deimv2_vit6_synthetic_latte.py
_base_ = ['./rtdetr_r18_synthetic.py']

model = dict(
    _delete_=True,
    type='HFDetector',
    family='deimv2',
    # transformers.Deimv2Config keywords, in a JSON file that detectron2's LatteHFDetector reads too
    hf_config='{{fileDirname}}/../../hf/deimv2_vit6_synthetic.json',
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                           bgr_to_rgb=True, pad_size_divisor=32),
    test_cfg=dict(max_per_img=100))

_root = 'data/synthetic_512_2key/'
_size = (512, 512)
train_dataloader = dict(dataset=dict(
    data_root=_root,
    pipeline=[dict(type='LoadImageFromFile', backend_args=None), dict(type='LoadAnnotations', with_bbox=True),
              dict(type='RandomFlip', prob=0.5), dict(type='Resize', scale=_size, keep_ratio=False),
              dict(type='PackDetInputs')]))
_test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None), dict(type='Resize', scale=_size, keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
val_dataloader = dict(dataset=dict(data_root=_root, pipeline=_test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

# The RT-DETR recipe (AdamW 2e-4, nothing is pretrained; 300-iteration warm-up, then constant;
# batch 8; clipping 0.1), 3 epochs of 4000 images (1500 iterations, about 70 min on 2 idle cores),
# with the ViT at 5x the base rate (1e-3): its blocks start from random weights and must learn
# to look for the nearer key. The CNN adapter beside it has 1 channel per stage (in the JSON).
max_epochs = 3
train_cfg = dict(max_epochs=max_epochs)
# bypass_duplicate: DEIMv2 shares some head modules across decoder layers (one parameter, several names)
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=5.0)}, bypass_duplicate=True))
