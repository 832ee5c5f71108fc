# DETR-R50 on COCO with LATTE: 67% of the encoder self-attention layers (4 of 6) linear.
# A diff over mmdet's own config; only the LATTE keys change.
#   python tools/calibrate.py configs/mmdet/detr_r50_latte_coco.py --checkpoint detr_r50.pth --eval
#   python $(python -c "import mmdet,os;print(os.path.dirname(mmdet.__file__))")/.mim/tools/test.py \
#       configs/mmdet/detr_r50_latte_coco.py work_dirs/detr_r50_latte_coco/latte_calibrated.pth
_base_ = 'mmdet::detr/detr_r50_8xb2-150e_coco.py'

custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

custom_hooks = [
    dict(
        type='LinearizeHook',
        candidates=['encoder.layers.*.self_attn'],
        ratio=0.67,
        variant='latte',
        num_images=64,
    )
]
