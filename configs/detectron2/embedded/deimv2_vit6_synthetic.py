# The embedded ViT-backbone DEIMv2 in detectron2: the same model (transformers'
# Deimv2ForObjectDetection through latte_plugin.detectron2.LatteHFDetector, no mmdet or mmcv) and
# checkpoint as configs/mmdet/embedded/deimv2_vit6_synthetic.py, detectron2's own data loader and
# COCOEvaluator on the generated two-key data at 512 px:
#   python -m latte_plugin.data.synthetic data/synthetic_512_2key --train 4000 --val 300 --size 512 --two-keys 0.75
# Exact attention; LATTE: deimv2_vit6_synthetic_latte.py.
import os
import detectron2.data.transforms as T
from detectron2.config import LazyCall as L

from latte_plugin.detectron2 import LatteHFDetector, register_synthetic

from .cond_detr_r18_synthetic import dataloader, model as _cond_detr, train

train_set, val_set = register_synthetic("data/synthetic_512_2key")
dataloader.train.dataset.names = train_set
dataloader.test.dataset.names = val_set
dataloader.evaluator.dataset_name = val_set
# mmdet's test pipeline: Resize(scale=(512, 512), keep_ratio=False)
test_augmentations = [L(T.Resize)(shape=(512, 512))]
dataloader.test.mapper.augmentations = test_augmentations
dataloader.train.mapper.augmentations = [L(T.Resize)(shape=(512, 512)), L(T.RandomFlip)(horizontal=True)]
model = L(LatteHFDetector)(
    family="deimv2",
    # transformers.Deimv2Config keywords, the same file the mmdet config reads
    hf_config=os.path.join(os.path.dirname(__file__), "..", "..", "hf", "deimv2_vit6_synthetic.json"),
    max_per_img=100,
    latte=None,
    calibration_loader=_cond_detr.calibration_loader,
)
model.calibration_loader.dataset.names = train_set
model.calibration_loader.mapper.augmentations = test_augmentations
train.init_checkpoint = "checkpoints/deimv2_vit6_synthetic.pth"
train.output_dir = "work_dirs/d2_deimv2_vit6"
