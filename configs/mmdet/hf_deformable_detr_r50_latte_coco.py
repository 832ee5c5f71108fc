# Deformable DETR-R50 (SenseTime/deformable-detr): its 6 decoder self-attention layers; the deformable encoder and cross-attention stay exact.
#   python tools/calibrate.py configs/mmdet/hf_deformable_detr_r50_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco_800.py']

model = dict(family='deformable_detr', hf_config='deformable_detr_r50', pretrained='checkpoints/hf/deformable_detr_r50')
