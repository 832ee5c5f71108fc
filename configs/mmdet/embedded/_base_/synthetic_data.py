# The generated "key-colour" data (python -m latte_plugin.data.synthetic data/synthetic --train 4000
# --val 300) with mmdet's CocoDataset and CocoMetric: the data part of every embedded config.
#
# Everything sits under one key, `synthetic`, so this file can be a base next to an mmdet model
# config (mmengine refuses the same top-level key from two bases) and a config picks what it
# needs by reference, e.g.  dataset={{_base_.synthetic.keep_ratio.train}}.
# Two pipelines: `keep_ratio` (mmdet's DETR test transform) and `square` (RT-DETR's: the
# network size, aspect ratio not kept).
_root = 'data/synthetic/'
_resize = {name: dict(type='Resize', scale=(256, 256), keep_ratio=keep) for name, keep in
           (('keep_ratio', True), ('square', False))}
_load = dict(type='LoadImageFromFile', backend_args=None)
_pack_test = dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
_split = dict(
    train=dict(ann_file='annotations/instances_train.json', data_prefix=dict(img='train/')),
    val=dict(ann_file='annotations/instances_val.json', data_prefix=dict(img='val/'), test_mode=True))
_dataset = dict(type='CocoDataset', data_root=_root,
                metainfo=dict(classes=('square-red', 'square-blue', 'disc-red', 'disc-blue')))

synthetic = dict(
    val_evaluator=dict(type='CocoMetric', ann_file=_root + 'annotations/instances_val.json', metric='bbox',
                       backend_args=None),
    **{name: dict(
        train=dict(_dataset, **_split['train'], pipeline=[
            _load, dict(type='LoadAnnotations', with_bbox=True), dict(type='RandomFlip', prob=0.5), resize,
            dict(type='PackDetInputs')]),
        val=dict(_dataset, **_split['val'], pipeline=[
            _load, resize, dict(type='LoadAnnotations', with_bbox=True), _pack_test]),
    ) for name, resize in _resize.items()})
del _root, _resize, _load, _pack_test, _split, _dataset
