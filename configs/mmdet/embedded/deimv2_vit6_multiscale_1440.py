# Stage 4 of the embedded ViT DEIMv2's multi-scale fine-tune: from the 512-1,024 px weights
# (checkpoints/deimv2_vit6_multiscale.pth, exact bbox mAP 0.264 at 1,440 px) to 1,440 px
# (8,101 ViT tokens). Data generated natively at 1,440 px (the speed job's main split):
#   python -m latte_plugin.data.synthetic data/synthetic_1440_2key --train 400 --val 150 --size 1440 --two-keys 0.75 --seed 1440
# Every iteration resizes its batch to one random side in [1024, 1440], so the weights keep
# the sizes they already hold at the top of their range while they learn the new one.
# Train (resumable; a checkpoint every 25 iterations):
#   python $MMDET/.mim/tools/train.py configs/mmdet/embedded/deimv2_vit6_multiscale_1440.py --work-dir work_dirs/vit_ms4 [--resume]
# Recipe and log: checkpoints/README.md.
_base_ = ['./deimv2_vit6_multiscale.py']

load_from = '{{fileDirname}}/../../../checkpoints/deimv2_vit6_multiscale.pth'

model = dict(data_preprocessor=dict(
    batch_augments=[dict(type='BatchSyncRandomResize', random_size_range=(1024, 1440), size_divisor=32, interval=1)]))

_root = 'data/synthetic_1440_2key/'
_size = (1440, 1440)
train_dataloader = dict(batch_size=2, dataset=dict(
    data_root=_root,
    pipeline=[dict(type='LoadImageFromFile', backend_args=None), dict(type='LoadAnnotations', with_bbox=True),
              dict(type='RandomFlip', prob=0.5), dict(type='Resize', scale=_size, keep_ratio=False),
              dict(type='PackDetInputs')]))
_test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None), dict(type='Resize', scale=_size, keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]
val_dataloader = dict(batch_size=1, dataset=dict(data_root=_root, pipeline=_test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

# A short fine-tune at half the stage-3 rate, decaying linearly to 5% of it (one pass at 1,440 px
# costs about 4 s per image here, a training step about three times that). No validation inside
# the run: the speed job's exact row measures the slimmed fp16 weights on the val split.
max_iters = 150
train_cfg = dict(max_iters=max_iters, val_interval=max_iters + 1)
optim_wrapper = dict(optimizer=dict(lr=5e-5))
param_scheduler = [dict(type='LinearLR', start_factor=1.0, end_factor=0.05, by_epoch=False, begin=0, end=max_iters)]
default_hooks = dict(checkpoint=dict(interval=25))
randomness = dict(seed=4)
