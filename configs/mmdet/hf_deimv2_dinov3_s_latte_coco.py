# DEIMv2-S (Intellindust/DEIMv2_DINOv3_S_COCO): LATTE on 67% of 17 layers: the 12 DINOv3 ViT blocks (RoPE), AIFI, 4 decoder self-attention.
#   python tools/calibrate.py configs/mmdet/hf_deimv2_dinov3_s_latte_coco.py --eval --cfg-options model.pretrained=DIR
# DIR: an HF directory of this model (config.json + model.safetensors, e.g. save_pretrained's).
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='deimv2', hf_config='deimv2_dinov3_s', pretrained='checkpoints/hf/deimv2_dinov3_s',
             data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]))
