# LATTE on the embedded ViT-backbone detector: 67% of its 10 global softmax attention layers
# (6 DINOv3-style ViT blocks with RoPE at 1,024 tokens, 1 AIFI, 3 decoder self-attention; found by
# one probe forward) linear. Deformable cross-attention stays exact.
#   python tools/calibrate.py configs/mmdet/embedded/deimv2_vit6_synthetic_latte.py \
#       --checkpoint checkpoints/deimv2_vit6_synthetic.pth --eval
_base_ = './deimv2_vit6_synthetic.py'

custom_hooks = [dict(type='LinearizeHook', candidates=['auto'], ratio=0.67, variant='latte', num_images=16)]
