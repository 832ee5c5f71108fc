# The DETR-style evaluation transform of transformers' DETR / YOLOS image processors: shortest
# edge 800, longest 1333, aspect kept, no padding beyond the batch (pixel_mask marks it).
_base_ = ['./hf_detector_coco.py']

model = dict(data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                                    pad_size_divisor=1))
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='Resize', scale=(1333, 800), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
