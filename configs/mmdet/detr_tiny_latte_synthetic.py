# A tiny DETR (ResNet-18 cut after stage 3, d=64, 6 encoder layers) on the generated
# synthetic COCO-format data (python -m latte_plugin.data.synthetic data/synthetic).
# Random weights unless a checkpoint is given: for tests and the quick demo only.
_base_ = ['mmdet::detr/detr_r50_8xb2-150e_coco.py', './embedded/_base_/synthetic_data.py',
          './_base_/latte_detr_encoder.py']

embed_dims = 64
model = dict(
    num_queries=20,
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(depth=18, num_stages=3, strides=(1, 2, 2), dilations=(1, 1, 1), out_indices=(2, ),
                  frozen_stages=-1, init_cfg=None),
    neck=dict(in_channels=[256], out_channels=embed_dims),
    encoder=dict(
        num_layers=6,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128, ffn_drop=0.0))),
    decoder=dict(
        num_layers=2,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
            cross_attn_cfg=dict(embed_dims=embed_dims, num_heads=4, dropout=0.0),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=128, ffn_drop=0.0))),
    positional_encoding=dict(num_feats=embed_dims // 2),
    bbox_head=dict(num_classes=4, embed_dims=embed_dims),
    test_cfg=dict(max_per_img=20))

train_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False,
                        dataset={{_base_.synthetic.keep_ratio.train}})
val_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False,
                      dataset={{_base_.synthetic.keep_ratio.val}})
test_dataloader = val_dataloader
val_evaluator = {{_base_.synthetic.val_evaluator}}
test_evaluator = val_evaluator

# the base's hook with a test-sized budget
custom_hooks = [dict(type='LinearizeHook', candidates=['encoder.layers.*.self_attn'], num_images=16, steps=15)]
default_hooks = dict(logger=dict(interval=10))
randomness = dict(seed=0)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
