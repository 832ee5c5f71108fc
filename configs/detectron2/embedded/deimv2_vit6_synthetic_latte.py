# LATTE on the embedded ViT-backbone DEIMv2 in detectron2: 67% of its 10 global softmax attention
# layers (found by one probe forward) linear, by dotted overrides of the exact config; or, with
# model.latte.speedup=1.4, per-layer modes for a predicted 1.4x end to end.
#   python -m latte_plugin.cli.calibrate configs/detectron2/embedded/deimv2_vit6_synthetic_latte.py --eval
from .deimv2_vit6_synthetic import dataloader, model, train

model.latte = dict(candidates=["auto"], ratio=0.67, variant="latte", num_images=16)
train.output_dir = "work_dirs/d2_deimv2_vit6_latte"
