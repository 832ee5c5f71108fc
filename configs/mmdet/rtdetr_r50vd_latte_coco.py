# RT-DETR-R50vd on COCO with LATTE on 5 of its 7 attention layers (the AIFI encoder layer and
# the 6 decoder self-attention layers over 300 queries), the paper's protocol.
# The model is HF transformers' RTDetrForObjectDetection wrapped as an mmdet detector
# (latte_plugin.mmdet.HFRTDETR), loaded offline from a local HF weights directory
# (config.json + model.safetensors, e.g. a copy of PekingU/rtdetr_r50vd).
#   python tools/calibrate.py configs/mmdet/rtdetr_r50vd_latte_coco.py --eval
#   python $MMDET/.mim/tools/test.py configs/mmdet/rtdetr_r50vd_latte_coco.py work_dirs/.../latte_calibrated.pth
_base_ = ['mmdet::_base_/datasets/coco_detection.py', 'mmdet::_base_/default_runtime.py']

custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

model = dict(
    type='HFRTDETR',
    pretrained='checkpoints/hf/rtdetr_r50vd',  # local HF directory; nothing is downloaded
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[0, 0, 0], std=[255, 255, 255],
                           bgr_to_rgb=True, pad_size_divisor=32),
    test_cfg=dict(max_per_img=100))

backend_args = None
test_pipeline = [  # RT-DETR's own evaluation transform: 640 x 640, aspect not kept
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='Resize', scale=(640, 640), keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_pipeline = [  # used for training only; calibration takes train images through test_pipeline
    dict(type='LoadImageFromFile', backend_args=backend_args),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale=(640, 640), keep_ratio=False),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader

# The training schedule (RT-DETR's: AdamW 1e-4, backbone at 0.1x, 72 epochs). mmengine needs
# train_dataloader, train_cfg and optim_wrapper together, and the base sets train_dataloader.
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=72, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={'hf.model.backbone': dict(lr_mult=0.1)}))
param_scheduler = [dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=2000)]

custom_hooks = [
    dict(
        type='LinearizeHook',
        candidates=['hf.model.encoder.aifi.*.layers.*.self_attn', 'hf.model.decoder.layers.*.self_attn'],
        ratio=0.67,  # 5 of 7
        variant='latte',
        num_images=64,
    )
]
