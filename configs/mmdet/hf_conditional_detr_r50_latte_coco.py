# Conditional DETR-R50 as transformers has it (microsoft/conditional-detr-resnet-50): 6 encoder + 6 decoder self-attention; cross-attention exact.
#   python tools/calibrate.py configs/mmdet/hf_conditional_detr_r50_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco_800.py']

model = dict(family='conditional_detr', hf_config='conditional_detr_r50', pretrained='checkpoints/hf/conditional_detr_r50')
