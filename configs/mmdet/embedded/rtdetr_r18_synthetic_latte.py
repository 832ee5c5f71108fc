# LATTE on the embedded RT-DETR: 5 of its 7 attention layers (1 AIFI + 6 decoder self-attention)
# linear, the paper's 67%.
#   python tools/calibrate.py configs/mmdet/embedded/rtdetr_r18_synthetic_latte.py \
#       --checkpoint checkpoints/rtdetr_r18_synthetic.pth --eval
_base_ = './rtdetr_r18_synthetic.py'

custom_hooks = [
    dict(
        type='LinearizeHook',
        candidates=['hf.model.encoder.aifi.*.layers.*.self_attn', 'hf.model.decoder.layers.*.self_attn'],
        ratio=0.67,
        variant='latte',
        num_images=32,
    )
]
