# LATTE on the embedded Conditional DETR in detectron2: the exact config plus dotted overrides.
# With a plain checkpoint the model calibrates itself on 32 train images at the first
# evaluation forward; with a calibrated checkpoint (tools/calibrate.py) it uses it as is.
#   python $DETECTRON2/tools/lazyconfig_train_net.py --eval-only \
#       --config-file configs/detectron2/embedded/cond_detr_r18_synthetic_latte.py \
#       train.init_checkpoint=work_dirs/main_job/cond_detr/latte_calibrated.pth
from .cond_detr_r18_synthetic import dataloader, model, train

model.latte = dict(candidates=["encoder.layers.*.self_attn"], ratio=0.67, variant="latte", num_images=32)
train.output_dir = "work_dirs/d2_cond_detr_latte"
