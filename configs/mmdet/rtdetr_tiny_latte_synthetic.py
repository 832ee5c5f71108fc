# A tiny random RT-DETR (HF RTDetrForObjectDetection via HFRTDETR) with LATTE on its 7
# attention layers (1 AIFI + 6 decoder self-attention), on the generated synthetic data.
# For tests and quick checks only (random weights unless a checkpoint is given).
_base_ = './embedded/rtdetr_r18_synthetic.py'

model = dict(
    hf_config='{{fileDirname}}/../hf/rtdetr_tiny.json',  # transformers.RTDetrConfig keywords
    test_cfg=dict(max_per_img=30))
train_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False)
val_dataloader = dict(batch_size=4)
test_dataloader = val_dataloader

custom_hooks = [
    dict(
        type='LinearizeHook',
        candidates=['hf.model.encoder.aifi.*.layers.*.self_attn', 'hf.model.decoder.layers.*.self_attn'],
        ratio=0.67,  # 5 of 7, the paper's protocol
        variant='latte',
        num_images=8,
        steps=10,
    )
]
default_hooks = dict(logger=dict(interval=10))
