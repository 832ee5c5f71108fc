# LW-DETR tiny: LATTE on 67% of its 3 global ViT blocks + 3 decoder self-attention; the 3 windowed blocks stay exact.
#   python tools/calibrate.py configs/mmdet/hf_lw_detr_tiny_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='lw_detr', hf_config='lw_detr_tiny', pretrained='checkpoints/hf/lw_detr_tiny',
             data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]))
