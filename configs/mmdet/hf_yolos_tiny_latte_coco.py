# YOLOS-tiny (hustvl/yolos-tiny): LATTE on 67% of its 12 global ViT blocks (patches + 100 detection tokens).
#   python tools/calibrate.py configs/mmdet/hf_yolos_tiny_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco_800.py']

model = dict(family='yolos', hf_config='yolos_tiny', pretrained='checkpoints/hf/yolos_tiny')
