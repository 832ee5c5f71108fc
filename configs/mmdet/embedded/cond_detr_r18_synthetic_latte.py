# LATTE on the embedded Conditional DETR: 67% of the 6 encoder self-attention layers linear.
#   python tools/calibrate.py configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py \
#       --checkpoint checkpoints/cond_detr_r18_synthetic.pth --eval
_base_ = './cond_detr_r18_synthetic.py'

custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

custom_hooks = [
    dict(
        type='LinearizeHook',
        candidates=['encoder.layers.*.self_attn'],
        ratio=0.67,
        variant='latte',
        num_images=32,  # 32 keeps the main job within 10 minutes on 2 cores
    )
]
