# The embedded ViT DEIMv2 fine-tuned from its 512 px checkpoint to hold its mAP from 512 to
# 1,024 px (1,025 to 4,097 ViT tokens), with mmdet's own loop. Data generated natively at 1,024 px
# (objects and keys scale with the image, so a 1,024 px image downsampled is a 512 px one):
#   python -m latte_plugin.data.synthetic data/synthetic_1024_2key --train 4000 --val 300 --size 1024 --two-keys 0.75 --seed 1024
# Every iteration resizes its batch to one random side in [512, 1024] (multiples of 32:
# mmdet's BatchSyncRandomResize), so each size trains on the same weights.
# Train (resumable; a checkpoint every 50 iterations):
#   python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_multiscale.py --work-dir work_dirs/vit_ms [--resume]
# Recipe and log: checkpoints/README.md.
_base_ = ['./deimv2_vit6_synthetic.py']

load_from = '{{fileDirname}}/../../../checkpoints/deimv2_vit6_synthetic.pth'

model = dict(data_preprocessor=dict(
    batch_augments=[dict(type='BatchSyncRandomResize', random_size_range=(512, 1024), size_divisor=32, interval=1)]))

_root = 'data/synthetic_1024_2key/'
_size = (1024, 1024)
train_dataloader = dict(batch_size=4, dataset=dict(
    data_root=_root,
    pipeline=[dict(type='LoadImageFromFile', backend_args=None), dict(type='LoadAnnotations', with_bbox=True),
              dict(type='RandomFlip', prob=0.5), dict(type='Resize', scale=_size, keep_ratio=False),
              dict(type='PackDetInputs')]))
_test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None), dict(type='Resize', scale=_size, keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
val_dataloader = dict(batch_size=2, dataset=dict(data_root=_root, pipeline=_test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

# A fine-tune, not a training: AdamW at half the base rate everywhere (the ViT already reads the
# keys), a 30-iteration warm-up, an iteration loop (validation only at the end: one pass at
# 1,024 px costs minutes here), a checkpoint every 50 iterations for --resume.
max_iters = 600
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=1e-4), paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=1.0)}))
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=30)]
default_hooks = dict(logger=dict(interval=10), checkpoint=dict(by_epoch=False, interval=50, max_keep_ckpts=2))
log_processor = dict(by_epoch=False)
