# The embedded default: a small Conditional DETR (mmdet's DetrTransformerEncoder, 6 layers)
# trained from scratch with mmdet's own loop on the generated "key-colour" data
# (python -m latte_plugin.data.synthetic data/synthetic --train 4000 --val 300).
# Train:  python $MMDET/.mim/tools/train.py configs/mmdet/embedded/cond_detr_r18_synthetic.py
# LATTE:  see cond_detr_r18_synthetic_latte.py
_base_ = ['mmdet::conditional_detr/conditional-detr_r50_8xb2-50e_coco.py', './_base_/synthetic_data.py']

embed_dims = 256  # mmdet's ConditionalDETR hard-codes a 256-d reference-point embedding
num_heads = 8
ffn = 512
model = dict(
    num_queries=20,
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(depth=18, num_stages=3, strides=(1, 2, 2), dilations=(1, 1, 1), out_indices=(2, ),
                  base_channels=32, frozen_stages=-1, norm_cfg=dict(type='BN', requires_grad=True),
                  norm_eval=False, init_cfg=None),
    neck=dict(in_channels=[128], out_channels=embed_dims),
    encoder=dict(
        num_layers=6,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=num_heads, dropout=0.0),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=ffn, ffn_drop=0.0))),
    decoder=dict(
        num_layers=3,
        layer_cfg=dict(
            self_attn_cfg=dict(embed_dims=embed_dims, num_heads=num_heads, attn_drop=0.0),
            cross_attn_cfg=dict(embed_dims=embed_dims, num_heads=num_heads, attn_drop=0.0),
            ffn_cfg=dict(embed_dims=embed_dims, feedforward_channels=ffn, ffn_drop=0.0))),
    positional_encoding=dict(num_feats=embed_dims // 2),
    bbox_head=dict(num_classes=4, embed_dims=embed_dims),
    test_cfg=dict(max_per_img=20))

train_dataloader = dict(batch_size=8, num_workers=1, persistent_workers=True,
                        dataset={{_base_.synthetic.keep_ratio.train}})
val_dataloader = dict(batch_size=8, num_workers=0, persistent_workers=False,
                      dataset={{_base_.synthetic.keep_ratio.val}})
test_dataloader = val_dataloader
val_evaluator = {{_base_.synthetic.val_evaluator}}
test_evaluator = val_evaluator

max_epochs = 3  # 3 x 500 iterations of 8 images: about 40 minutes on 2 cores
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=2e-4, weight_decay=1e-4),
    clip_grad=dict(max_norm=0.1, norm_type=2),
    paramwise_cfg=dict(custom_keys={'backbone': dict(lr_mult=1.0)}))  # from scratch: full rate
train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=1)
param_scheduler = [  # warm-up, then a constant learning rate
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=300),
]
auto_scale_lr = dict(enable=False, base_batch_size=8)
default_hooks = dict(logger=dict(interval=50), checkpoint=dict(interval=1, max_keep_ckpts=2))
randomness = dict(seed=0, deterministic=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
