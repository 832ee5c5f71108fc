# The embedded RT-DETR: HF transformers' RTDetrForObjectDetection (small ResNet, 1 AIFI layer,
# 6 decoder layers, 300 queries) wrapped as an mmdet detector (latte_plugin.mmdet.HFRTDETR) and
# trained from scratch with mmdet's own loop on the generated "key-colour" data
# (python -m latte_plugin.data.synthetic data/synthetic --train 4000 --val 300).
# Train:  python $MMDET/.mim/tools/train.py configs/mmdet/embedded/rtdetr_r18_synthetic.py
# LATTE:  see rtdetr_r18_synthetic_latte.py
_base_ = ['mmdet::_base_/default_runtime.py', './_base_/synthetic_data.py']

custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

model = dict(
    type='HFRTDETR',
    # transformers.RTDetrConfig keywords (small ResNet, 1 AIFI layer, 6 decoder layers, 300 queries),
    # in a JSON file that detectron2's LatteRTDETR reads too
    hf_config='{{fileDirname}}/../../hf/rtdetr_r18_synthetic.json',
    # RT-DETR takes RGB in [0, 1]
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[0, 0, 0], std=[255, 255, 255],
                           bgr_to_rgb=True, pad_size_divisor=32),
    test_cfg=dict(max_per_img=100))

# RT-DETR's own evaluation transform: the network size, aspect ratio not kept
train_dataloader = dict(batch_size=8, num_workers=1, persistent_workers=True,
                        dataset={{_base_.synthetic.square.train}})
val_dataloader = dict(batch_size=8, num_workers=0, persistent_workers=False,
                      dataset={{_base_.synthetic.square.val}})
test_dataloader = val_dataloader
val_evaluator = {{_base_.synthetic.val_evaluator}}
test_evaluator = val_evaluator

max_epochs = 4
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2))
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=300)]
auto_scale_lr = dict(enable=False, base_batch_size=8)
default_hooks = dict(logger=dict(interval=50), checkpoint=dict(interval=1, max_keep_ckpts=2))
randomness = dict(seed=0, deterministic=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
