# RT-DETRv2-S (PekingU/rtdetr_v2_r18vd): LATTE on 67% of its 4 global attention layers (AIFI + 3 decoder self-attention).
#   python tools/calibrate.py configs/mmdet/hf_rt_detr_v2_r18vd_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='rt_detr_v2', hf_config='rt_detr_v2_r18vd', pretrained='checkpoints/hf/rt_detr_v2_r18vd')
