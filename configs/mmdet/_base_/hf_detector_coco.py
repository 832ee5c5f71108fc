# The base of the transformers detectors on COCO (latte_plugin.mmdet.HFDetector): COCO 2017 from
# mmdet's own dataset base, CocoMetric, the family's evaluation transform, and LATTE on 67% of the
# global softmax attention layers the model has (candidates='auto': found by one probe forward,
# ViT backbone blocks included; windowed and deformable attention stay exact).
# Each family's config sets model.family, its weights and its normalisation.
_base_ = ['mmdet::_base_/datasets/coco_detection.py', 'mmdet::_base_/default_runtime.py']

custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

model = dict(
    type='HFDetector',
    family='rt_detr',
    pretrained=None,  # a local HF directory (config.json + model.safetensors); nothing is downloaded
    data_preprocessor=dict(type='DetDataPreprocessor', mean=[0, 0, 0], std=[255, 255, 255],
                           bgr_to_rgb=True, pad_size_divisor=32),
    test_cfg=dict(max_per_img=100))

backend_args = None
test_pipeline = [  # the RT-DETR-style evaluation transform: 640 x 640, aspect not kept
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

# A fine-tuning schedule (AdamW 1e-4, backbone at 0.1x): mmengine needs train_dataloader,
# train_cfg and optim_wrapper together, and the base sets train_dataloader.
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=12, val_interval=1)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=0.1)}))
param_scheduler = [dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=2000)]

custom_hooks = [dict(type='LinearizeHook', candidates=['auto'], ratio=0.67, variant='latte', num_images=64)]
