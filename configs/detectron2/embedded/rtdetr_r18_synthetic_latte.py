# LATTE on the embedded RT-DETR in detectron2: 5 of its 7 attention layers (1 AIFI + 6 decoder
# self-attention) linear, by dotted overrides of the exact config.
from .rtdetr_r18_synthetic import dataloader, model, train

model.latte = dict(candidates=["hf.model.encoder.aifi.*.layers.*.self_attn", "hf.model.decoder.layers.*.self_attn"],
                   ratio=0.67, variant="latte", num_images=32)
train.output_dir = "work_dirs/d2_rtdetr_latte"
