# LATTE on a DETR-family encoder, for inheritance: the plugin imported through custom_imports and
# its LinearizeHook on the encoder's self-attention layers, 67% linear (the paper's bar). Every
# other LatteConfig field keeps the package default (tools/calibrate.py --help lists them).
custom_imports = dict(imports=['latte_plugin.mmdet'], allow_failed_imports=False)

custom_hooks = [
    dict(type='LinearizeHook', candidates=['encoder.layers.*.self_attn'], ratio=0.67, variant='latte'),
]
