#!/usr/bin/env python
"""Worked example: LATTE on an HF ``transformers`` ViT with the framework-free entry point.

    python examples/linearize_hf_vit.py [--out results/example_hf_vit.txt]

The ViT is built from a config (random weights: nothing is downloaded; with your own
weights use ``ViTModel.from_pretrained(local_dir)``). Calibration batches are unlabeled
images; here, smooth random images. 67% of the 6 attention layers go linear, with the
package defaults: every image is fitted on, the selection and each layer's output correction
are chosen by cross-fitting (no image judges a fit it took part in), and the report's figures
are cross-fitted ones. The last line measures the hybrid on new images that nothing saw.
``--image-size`` and ``--width`` shrink it (the test suite runs it at 32 px, width 32).
"""

import torch

import latte_plugin
from latte_plugin.nn.install import find_latte_layers, set_modes
from latte_plugin.console import first_paragraph


def images(n: int, seed: int, size: int = 224) -> torch.Tensor:
    """``n`` smooth random images ``(n, 3, size, size)`` (attention over them is not uniform)."""
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(n, 3, 14, 14, generator=g)
    return torch.nn.functional.interpolate(low, size=size, mode="bilinear", align_corners=False)


def main(argv=None) -> dict:
    import argparse

    from transformers import ViTConfig, ViTModel

    out = argparse.ArgumentParser(description=first_paragraph(__doc__))
    out.add_argument("--out", help="also write the printed lines to this file (the README shows it)")
    out.add_argument("--image-size", type=int, default=224, help="input side in pixels (patches of 16)")
    out.add_argument("--width", type=int, default=384, help="hidden size (6 heads)")
    args = out.parse_args(argv)
    lines: list[str] = []
    say = lines.append

    torch.manual_seed(0)
    model = ViTModel(ViTConfig(num_hidden_layers=6, hidden_size=args.width, num_attention_heads=6 if args.width % 6 == 0
                               else 4, intermediate_size=4 * args.width, image_size=args.image_size)).eval()
    calib = [{"pixel_values": images(2, seed, args.image_size)} for seed in range(16)]  # 32 unlabeled images
    model, report = latte_plugin.linearize(model, calib, candidates=["layers.*.attention"], ratio=0.67,
                                           num_images=16, log=lambda s: None)
    x = images(4, 999, args.image_size)
    layers = find_latte_layers(model)
    with torch.no_grad():
        set_modes(layers, [])
        exact = model(pixel_values=x).pooler_output
        set_modes(layers, report["linearized"])
        hybrid = model(pixel_values=x).pooler_output
    cos = torch.nn.functional.cosine_similarity(exact, hybrid).mean()
    say(f"linear layers ({len(report['linearized'])}/{len(report['candidates'])}): {report['linearized']}")
    for n in report["candidates"]:
        p, f = report["params"][n], report["fit"][n]
        say(f"  {n}: alpha={p['alpha']:.3f} delta={p['delta_q']:.3g} steps={f['steps']} "
            f"fit mse {f['mse_initial']:.3e} -> {f['mse_final']:.3e} ({f['correction']})")
    say(f"attention GFLOPs per image: exact {report['attention_gflops']['exact']:.4f} -> "
        f"hybrid {report['attention_gflops']['linearized']:.4f}")
    say(f"cross-fitted output distortion {report['selection']['heldout_distortion']:.3e} "
        f"({report['selection'].get('configuration')}); "
        f"cosine(exact, hybrid) of the pooled output on new images: {float(cos):.4f}")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return report


if __name__ == "__main__":
    main()
