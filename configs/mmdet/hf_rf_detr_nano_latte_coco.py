# RF-DETR Nano (DINOv2-S, windowed): LATTE on 67% of its 3 global ViT blocks + 2 decoder self-attention; windowed blocks stay exact.
#   python tools/calibrate.py configs/mmdet/hf_rf_detr_nano_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='rf_detr', hf_config='rf_detr_nano', pretrained='checkpoints/hf/rf_detr_nano',
             data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]))

test_pipeline = [  # RF-DETR Nano's image processor: 384 x 384
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='Resize', scale=(384, 384), keep_ratio=False),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
