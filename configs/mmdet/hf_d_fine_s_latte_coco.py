# D-FINE-S (ustc-community/dfine-small-coco, HGNetV2-B0): LATTE on 67% of AIFI + 3 decoder self-attention layers.
#   python tools/calibrate.py configs/mmdet/hf_d_fine_s_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='d_fine', hf_config='d_fine_s', pretrained='checkpoints/hf/d_fine_s')
