# LATTE on the embedded Conditional DETR: 67% of the 6 encoder self-attention layers linear.
#   python tools/calibrate.py configs/mmdet/embedded/cond_detr_r18_synthetic_latte.py \
#       --checkpoint checkpoints/cond_detr_r18_synthetic.pth --eval
_base_ = ['./cond_detr_r18_synthetic.py', '../_base_/latte_detr_encoder.py']

# the base's hook (encoder self-attention, 67%, latte) with 32 images: the main job's budget
custom_hooks = [dict(type='LinearizeHook', candidates=['encoder.layers.*.self_attn'], num_images=32)]
