# RT-DETR-R50vd on COCO with LATTE on 5 of its 7 attention layers (the AIFI encoder layer and
# the 6 decoder self-attention layers over 300 queries, found from the model), the paper's protocol.
# The model is HF transformers' RTDetrForObjectDetection wrapped as an mmdet detector
# (latte_plugin.mmdet.HFDetector, family rt_detr), loaded offline from a local HF weights directory
# (config.json + model.safetensors, e.g. a copy of PekingU/rtdetr_r50vd).
#   python tools/calibrate.py configs/mmdet/rtdetr_r50vd_latte_coco.py --eval
#   python $MMDET/.mim/tools/test.py configs/mmdet/rtdetr_r50vd_latte_coco.py work_dirs/.../latte_calibrated.pth
_base_ = ['./_base_/hf_detector_coco.py']

model = dict(family='rt_detr', pretrained='checkpoints/hf/rtdetr_r50vd')  # nothing is downloaded

# RT-DETR's schedule: 72 epochs (AdamW 1e-4, backbone at 0.1x, from the base)
train_cfg = dict(max_epochs=72)
