# DETR-R50 on COCO with LATTE: 67% of the encoder self-attention layers (4 of 6) linear.
# A diff over mmdet's own config; only the LATTE keys change.
#   python tools/calibrate.py configs/mmdet/detr_r50_latte_coco.py --checkpoint detr_r50.pth --eval
#   python $(python -c "import mmdet,os;print(os.path.dirname(mmdet.__file__))")/.mim/tools/test.py \
#       configs/mmdet/detr_r50_latte_coco.py work_dirs/detr_r50_latte_coco/latte_calibrated.pth
# The LATTE part is the second base: custom_imports and the LinearizeHook (64 calibration images,
# the default; override with --num-images or --cfg-options).
_base_ = ['mmdet::detr/detr_r50_8xb2-150e_coco.py', './_base_/latte_detr_encoder.py']
