#!/usr/bin/env python
"""Converts a checkpoint of the original RT-DETR repository (lyuwenyu/RT-DETR, PyTorch) into an
HF ``RTDetrForObjectDetection`` directory (``config.json`` + ``model.safetensors``), which the
plugin's RT-DETR configs load with ``model.pretrained=DIR``.

    python tools/convert_rtdetr_original.py rtdetr_r50vd_6x_coco_from_paddle.pth OUT_DIR [--arch r50vd]
    python tools/calibrate.py configs/mmdet/rtdetr_r50vd_latte_coco.py --cfg-options model.pretrained=OUT_DIR

The key correspondence is the one transformers' own conversion script
(``convert_rt_detr_original_pytorch_checkpoint_to_hf.py``) defines, written here as rules
from today's HF names to the original names (transformers has since renamed a few modules:
``encoder.aifi``, ``o_proj``, ``mlp.fc1``). One table, used both ways: :func:`hf_to_original`
names the original key of every HF key, and the fused ``in_proj`` of the original
``nn.MultiheadAttention`` is split into q/k/v. Every HF key must be filled and every
original key used (``num_batches_tracked`` aside), or the conversion stops and names them.
"""
from __future__ import annotations

import argparse
import re
from typing import Callable, Optional

import torch
from latte_plugin.console import first_paragraph


#: Architectures as transformers' conversion script configures them (from RTDetrConfig's defaults = r50vd).
ARCHS: dict[str, dict] = {
    "r18vd": dict(backbone=dict(hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic"),
                  encoder_in_channels=[128, 256, 512], hidden_expansion=0.5, decoder_layers=3),
    "r34vd": dict(backbone=dict(hidden_sizes=[64, 128, 256, 512], depths=[3, 4, 6, 3], layer_type="basic"),
                  encoder_in_channels=[128, 256, 512], hidden_expansion=0.5, decoder_layers=4),
    "r50vd": dict(),
    "r101vd": dict(backbone=dict(depths=[3, 4, 23, 3]), encoder_ffn_dim=2048, encoder_hidden_dim=384,
                   decoder_in_channels=[384, 384, 384]),
}

_BB = r"model\.backbone\.model\."
_BRANCH = "abc"
#: (HF name pattern, original name) rules, first match wins; ``{n+1}``-style shifts are functions.
RULES: list[tuple[str, "str | Callable[[re.Match], str]"]] = [
    (_BB + r"embedder\.embedder\.(\d+)\.convolution\.(.+)", lambda m: f"backbone.conv1.conv1_{int(m[1]) + 1}.conv.{m[2]}"),
    (_BB + r"embedder\.embedder\.(\d+)\.normalization\.(.+)", lambda m: f"backbone.conv1.conv1_{int(m[1]) + 1}.norm.{m[2]}"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.0\.shortcut\.convolution\.(.+)", r"backbone.res_layers.\1.blocks.0.short.conv.\2"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.0\.shortcut\.normalization\.(.+)", r"backbone.res_layers.\1.blocks.0.short.norm.\2"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.0\.shortcut\.1\.convolution\.(.+)",
     r"backbone.res_layers.\1.blocks.0.short.conv.conv.\2"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.0\.shortcut\.1\.normalization\.(.+)",
     r"backbone.res_layers.\1.blocks.0.short.conv.norm.\2"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.(\d+)\.layer\.(\d)\.convolution\.(.+)",
     lambda m: f"backbone.res_layers.{m[1]}.blocks.{m[2]}.branch2{_BRANCH[int(m[3])]}.conv.{m[4]}"),
    (_BB + r"encoder\.stages\.(\d+)\.layers\.(\d+)\.layer\.(\d)\.normalization\.(.+)",
     lambda m: f"backbone.res_layers.{m[1]}.blocks.{m[2]}.branch2{_BRANCH[int(m[3])]}.norm.{m[4]}"),
    # AIFI (the transformer encoder layer of the hybrid encoder)
    (r"model\.encoder\.aifi\.(\d+)\.layers\.0\.self_attn\.o_proj\.(.+)", r"encoder.encoder.\1.layers.0.self_attn.out_proj.\2"),
    (r"model\.encoder\.aifi\.(\d+)\.layers\.0\.mlp\.fc([12])\.(.+)", r"encoder.encoder.\1.layers.0.linear\2.\3"),
    (r"model\.encoder\.aifi\.(\d+)\.layers\.0\.self_attn_layer_norm\.(.+)", r"encoder.encoder.\1.layers.0.norm1.\2"),
    (r"model\.encoder\.aifi\.(\d+)\.layers\.0\.final_layer_norm\.(.+)", r"encoder.encoder.\1.layers.0.norm2.\2"),
    (r"model\.encoder_input_proj\.(.+)", r"encoder.input_proj.\1"),
    (r"model\.encoder\.(fpn_blocks|pan_blocks|lateral_convs|downsample_convs)\.(.+)", r"encoder.\1.\2"),
    # decoder
    (r"model\.decoder\.layers\.(\d+)\.self_attn\.o_proj\.(.+)", r"decoder.decoder.layers.\1.self_attn.out_proj.\2"),
    (r"model\.decoder\.layers\.(\d+)\.encoder_attn\.(.+)", r"decoder.decoder.layers.\1.cross_attn.\2"),
    (r"model\.decoder\.layers\.(\d+)\.self_attn_layer_norm\.(.+)", r"decoder.decoder.layers.\1.norm1.\2"),
    (r"model\.decoder\.layers\.(\d+)\.encoder_attn_layer_norm\.(.+)", r"decoder.decoder.layers.\1.norm2.\2"),
    (r"model\.decoder\.layers\.(\d+)\.final_layer_norm\.(.+)", r"decoder.decoder.layers.\1.norm3.\2"),
    (r"model\.decoder\.layers\.(\d+)\.mlp\.fc([12])\.(.+)", r"decoder.decoder.layers.\1.linear\2.\3"),
    (r"(?:model\.decoder\.)?class_embed\.(\d+)\.(.+)", r"decoder.dec_score_head.\1.\2"),
    (r"(?:model\.decoder\.)?bbox_embed\.(\d+)\.(.+)", r"decoder.dec_bbox_head.\1.\2"),
    (r"model\.decoder_input_proj\.(\d+)\.0\.(.+)", r"decoder.input_proj.\1.conv.\2"),
    (r"model\.decoder_input_proj\.(\d+)\.1\.(.+)", r"decoder.input_proj.\1.norm.\2"),
    (r"model\.denoising_class_embed\.(.+)", r"decoder.denoising_class_embed.\1"),
    (r"model\.decoder\.query_pos_head\.(.+)", r"decoder.query_pos_head.\1"),
    (r"model\.(enc_output|enc_score_head|enc_bbox_head)\.(.+)", r"decoder.\1.\2"),
]
#: q/k/v projections: the original keeps them fused as nn.MultiheadAttention's in_proj.
QKV = [(r"model\.encoder\.aifi\.(\d+)\.layers\.0\.self_attn\.([qkv])_proj\.(weight|bias)",
        r"encoder.encoder.\1.layers.0.self_attn.in_proj_\3"),
       (r"model\.decoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)",
        r"decoder.decoder.layers.\1.self_attn.in_proj_\3")]


def hf_to_original(key: str) -> Optional[tuple[str, Optional[int]]]:
    """The original key of an HF key, and for q/k/v the index (0, 1, 2) of its third of ``in_proj``."""
    for pat, rep in QKV:
        m = re.fullmatch(pat, key)
        if m:
            return m.expand(rep), "qkv".index(m[2])
    for pat, rep in RULES:
        m = re.fullmatch(pat, key)
        if m:
            return (rep(m) if callable(rep) else m.expand(rep)), None
    return None


def original_state(checkpoint: dict) -> dict:
    """The model weights inside an original checkpoint: its EMA weights if present, else ``model``."""
    for path in (("ema", "module"), ("model",), ()):
        node = checkpoint
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and node and all(isinstance(v, torch.Tensor) for v in node.values()):
            return node
    raise ValueError("no weights found: expected checkpoint['ema']['module'] or checkpoint['model'] (the original "
                     "RT-DETR repository's format)")


def convert_state(orig: dict, hf_keys: list[str]) -> dict:
    """HF state dict from the original one. Raises ``KeyError`` listing HF keys without a source
    and original keys left unused (``num_batches_tracked`` may be absent or unused)."""
    out, used, missing = {}, set(), []
    for key in hf_keys:
        hit = hf_to_original(key)
        if hit is None or hit[0] not in orig:
            if not key.endswith("num_batches_tracked"):
                missing.append(key)
            continue
        src, third = hit
        t = orig[src]
        if third is not None:
            size = t.shape[0] // 3
            t = t[third * size:(third + 1) * size]
        out[key] = t.clone()
        used.add(src)
    unused = [k for k in orig if k not in used and not k.endswith("num_batches_tracked")
              and not k.startswith(("decoder.anchors", "decoder.valid_mask"))]  # buffers HF recomputes
    if missing or unused:
        raise KeyError(f"the checkpoint does not match the RT-DETR architecture: {len(missing)} HF key(s) without "
                       f"a source (e.g. {missing[:3]}), {len(unused)} original key(s) unused (e.g. {unused[:3]}); "
                       "check --arch")
    return out


def to_original(hf_state: dict) -> dict:
    """The inverse (for tests): the original checkpoint's state dict of an HF state dict."""
    out: dict = {}
    parts: dict = {}
    for key, t in hf_state.items():
        hit = hf_to_original(key)
        if hit is None:
            continue
        src, third = hit
        if third is None:
            out[src] = t.clone()
        else:
            parts.setdefault(src, {})[third] = t
    for src, ts in parts.items():
        out[src] = torch.cat([ts[i] for i in range(3)])
    return out


def build_config(arch: str):
    """``RTDetrConfig`` of an architecture, with COCO's 80 labels in mmdet's (sorted-id) order."""
    from transformers import RTDetrConfig

    from latte_plugin.data.synthetic import COCO_CATEGORIES

    spec = dict(ARCHS[arch])
    config = RTDetrConfig()
    for k, v in spec.pop("backbone", {}).items():
        setattr(config.backbone_config, k, v)
    for k, v in spec.items():
        setattr(config, k, v)
    config.num_labels = 80
    config.id2label = {i: name for i, (_, name) in enumerate(COCO_CATEGORIES)}
    config.label2id = {v: k for k, v in config.id2label.items()}
    return config


def convert(src: str, out_dir: str, arch: str = "r50vd") -> str:
    """Writes the HF directory for an original checkpoint; returns ``out_dir``."""
    from transformers import RTDetrForObjectDetection

    from latte_plugin.storage import check_readable

    check_readable(src)
    model = RTDetrForObjectDetection(build_config(arch)).eval()
    state = convert_state(original_state(torch.load(src, map_location="cpu", weights_only=True)),
                          list(model.state_dict()))
    result = model.load_state_dict(state, strict=False)
    left = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
    if left or result.unexpected_keys:
        raise KeyError(f"conversion incomplete: missing {left[:3]}, unexpected {result.unexpected_keys[:3]}")
    model.save_pretrained(out_dir)
    return out_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=first_paragraph(__doc__))
    p.add_argument("checkpoint", help="the original repository's .pth (its 'ema' weights are used when present)")
    p.add_argument("out_dir", help="HF directory to write (config.json + model.safetensors)")
    p.add_argument("--arch", choices=list(ARCHS), default="r50vd")
    a = p.parse_args(argv)
    try:
        print(convert(a.checkpoint, a.out_dir, a.arch))
    except (KeyError, ValueError) as e:
        raise SystemExit(f"error: {a.checkpoint}: {e}") from None


if __name__ == "__main__":
    main()
