"""The piecewise kernel's tables (``docs/method.md#piecewise``), registered in
:data:`experiments.readme_tables.TABLES`: per-layer errors, the ViT detector with its ViT blocks
non-exact on three splits, the main jobs with ``kernel=auto``, and attention speed."""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIT_SPLITS = {"main": "piecewise_vit6.json", "seed 1111": "piecewise_vit6_seed1111.json",
              "seed 1212": "piecewise_vit6_seed1212.json"}
ROW_NAMES = {"exact": "exact", "ours:auto": "LATTE (the defaults)", "ours:kernel=piecewise": "piecewise",
             "ours:kernel=auto": "auto (per layer)"}


def _load(name: str) -> dict:
    with open(os.path.join(ROOT, "results", name), encoding="utf-8") as f:
        return json.load(f)


def _table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def layers_table(name: str = "piecewise_layers_deimv2_vit.json") -> str:
    """results/piecewise_layers_deimv2_vit.json: held-out relative error per ViT block."""
    res = _load(name)
    tokens, similar = res["orders"]["tokens"], res["orders"]["similarity"]
    tops = list(next(iter(similar.values()))["piecewise"]["latte"])
    rows = []
    for name, row in similar.items():
        t4 = tokens[name]["piecewise"]
        rows.append([name.split(".")[-2], row["tokens"], f"{row['latte']:.3f}",
                     f"{t4['blockmean']['4']['heldout']:.3f} / {t4['latte']['4']['heldout']:.3f}",
                     f"{row['piecewise']['blockmean']['4']['heldout']:.3f}",
                     *(f"{row['piecewise']['latte'][t]['heldout']:.3f}" for t in tops)])
    head = ["ViT block", "tokens", "LATTE", "consecutive blocks @4: blockmean / latte rest", "similar blocks @4: blockmean rest",
            *(f"similar blocks, latte rest @{t}" for t in tops)]
    return (_table(head, rows) + f"\n\nRelative MSE of the attention output (no output correction; exact = 0) on "
            f"{res['measure_images']} train images that fitted nothing ({res['fit_images']} others fitted LATTE's "
            f"scalars and each gamma); blocks of {res['block']} tokens, `@t` = exact key blocks per query block. "
            f"`{res['command']}` ({res['seconds'] / 60:.1f} min).")


def layers_1440_table() -> str:
    """results/piecewise_layers_deimv2_vit_1440.json: the same at 1,440 px (8,101 tokens)."""
    name = "piecewise_layers_deimv2_vit_1440.json"
    return layers_table(name) if os.path.isfile(os.path.join(ROOT, "results", name)) else "Not measured yet."


def _kernels(res: dict, row: str) -> str:
    layers = (res.get("choices", {}).get(row) or {}).get("layers", {})
    linear = set(res["rows"][row]["linearized"])
    kinds = [(f["kernel"] or {}) for n, f in layers.items() if n in linear]
    if not kinds or not any(kinds):
        return "latte" if row != "exact" else "-"
    return ", ".join("latte" if k.get("kernel") != "piecewise" else f"@{k['top']}" for k in kinds)


def _vit_results() -> list[tuple[str, dict]]:
    """``[(split, results)]`` of the ViT splits whose results are committed."""
    return [(split, _load(name)) for split, name in VIT_SPLITS.items()
            if os.path.isfile(os.path.join(ROOT, "results", name))]


def vit_table() -> str:
    """results/piecewise_vit6*.json: the ViT detector with its 6 ViT blocks non-exact, per split."""
    rows, commands = [], []
    for split, res in _vit_results():
        commands.append(f"`{res['command']}`")
        for row, m in res["metrics"].items():
            if row not in ROW_NAMES:
                continue
            kept = "" if m.get("retained") is None else f"{100 * m['retained']:.1f}"
            ratio = m.get("encoder_latency_ratio")
            rows.append([split, ROW_NAMES[row], f"{m['bbox_mAP']:.3f}", kept, f"{m['attention_gflops']:.3f}",
                         "" if ratio is None else f"{ratio:.2f}", _kernels(res, row)])
    head = ["split", "ViT blocks", "bbox mAP", "% kept", "attn GFLOPs", "ViT backbone speed-up vs exact",
            "kernel per ViT block (@t: piecewise, t exact key blocks)"]
    return _table(head, rows) + "\n\n" + "; ".join(commands) + "."


def vit_summary_table() -> str:
    """The README's view of :func:`vit_table`: one line per split."""
    rows = []
    for split, res in _vit_results():
        m = res["metrics"]
        cell = lambda r: f"{m[r]['bbox_mAP']:.3f} ({100 * m[r]['retained']:.1f}%)"  # noqa: E731
        time = " / ".join(f"{m[r]['encoder_latency_ratio']:.2f}" for r in ("ours:auto", "ours:kernel=piecewise",
                                                                           "ours:kernel=auto"))
        rows.append([split, f"{m['exact']['bbox_mAP']:.3f}", cell("ours:auto"), cell("ours:kernel=piecewise"),
                     cell("ours:kernel=auto"), _kernels(res, "ours:kernel=piecewise"), time])
    goal = [f"{split} {100 * res['metrics']['ours:kernel=piecewise']['retained']:.1f}%" for split, res in _vit_results()]
    met = all(float(g.split()[-1][:-1]) >= 97.0 for g in goal)
    head = ["split", "exact mAP", "LATTE mAP (kept)", "piecewise", "auto (per layer)",
            "exact key blocks per ViT block (of 16)", "ViT backbone speed-up vs exact (LATTE / piecewise / auto)"]
    return (_table(head, rows) + f"\n\nGoal, piecewise keeps >= 97% on every split: {'met' if met else 'missed'} "
            f"({', '.join(goal)}). Speed: " + _speed_goals(_load("attention_piecewise_cpu.json")) + " Every row, "
            "the commands and the attention timings: [docs/results.md](docs/results.md#piecewise).")


def attention_speed_table() -> str:
    """results/attention_piecewise_cpu.json: SDPA, LATTE and the piecewise kernel side by side."""
    res = _load("attention_piecewise_cpu.json")
    tops = sorted({k.split("@")[1][:-3] for r in res["rows"] for k in r if k.startswith("piecewise@") and k.endswith("_ms")},
                  key=int)
    rows = [[r["dtype"], f"{r['n']:,}", f"{r['sdpa_ms']:.2f}", f"{r['latte_ms']:.2f} ({r['speedup_vs_sdpa']:.1f}x)",
             *(f"{r[f'piecewise@{t}_ms']:.2f} ({r[f'speedup_piecewise@{t}_vs_sdpa']:.1f}x)" for t in tops),
             f"{r['memcpy_ms']:.3f}"] for r in res["rows"]]
    head = ["dtype", "tokens", "SDPA ms", "LATTE ms (vs SDPA)", *(f"piecewise @{t} ms (vs SDPA)" for t in tops),
            "memcpy of q, k, v, o ms"]
    return (_table(head, rows) + f"\n\nBatch 1, {res['heads']} heads of {res['head_dim']}, {res['threads']} CPU "
            f"threads, best of the timed repetitions; piecewise: {res['piecewise_order']} blocks, {res['piecewise_rest']} rest. "
            f"`{res['command']}`.\n\n" + _speed_goals(res))


def _speed_goals(res: dict) -> str:
    """The speed goals (>= 3x SDPA at 1k tokens, >= 10x at 8k) at the counts the ViT's calibration chose."""
    chosen = sorted({k["top"] for k in _chosen_kernels() if k})
    if not chosen:
        return ""
    out = []
    for n, goal in ((1024, 3.0), (8192, 10.0)):
        for r in (r for r in res["rows"] if r["n"] == n):
            got = [r.get(f"speedup_piecewise@{t}_vs_sdpa") for t in chosen]
            if None in got:
                continue
            worst = min(got)
            out.append(f"{r['dtype']} at {n:,} tokens: {worst:.1f}x at @{chosen[got.index(worst)]} for a goal of "
                       f"{goal:.0f}x ({'met' if worst >= goal else 'missed'})")
    return (f"the piecewise layer against SDPA at the counts the ViT's calibration chose (@{', @'.join(map(str, chosen))}): "
            + "; ".join(out) + ".")


def _chosen_kernels() -> list:
    res = _load(VIT_SPLITS["main"])
    layers = res["choices"]["ours:kernel=piecewise"]["layers"]
    return [f.get("kernel") for f in layers.values()]


def kernel_auto_table() -> str:
    """results/kernel_auto_*.json: the default main-job rows against kernel=auto on the three models."""
    rows = []
    for model in ("cond_detr", "rtdetr", "deimv2_vit"):
        name = f"kernel_auto_{model}.json"
        if not os.path.isfile(os.path.join(ROOT, "results", name)):
            continue
        res = _load(name)
        for row, m in res["metrics"].items():
            if row == "linearized" or row == "exact":
                continue
            rows.append([model, row, m["linear"], f"{m['bbox_mAP']:.3f}", f"{100 * m['retained']:.1f}",
                         f"{m['attention_gflops']:.3f}", _kernels(res, row)])
    head = ["model", "row", "linear", "bbox mAP", "% kept", "attn GFLOPs", "kernel per linear layer"]
    return _table(head, rows)


TABLES = {"piecewise_layers": layers_table, "piecewise_layers_1440": layers_1440_table, "piecewise_vit": vit_table,
          "piecewise_vit_summary": vit_summary_table, "attention_piecewise": attention_speed_table,
          "kernel_auto": kernel_auto_table}


def main(argv=None) -> None:
    """Lists the tables (experiments/readme_tables.py renders them; run that one)."""
    import argparse

    p = argparse.ArgumentParser(description="The piecewise kernel's README tables (rendered by python -m "
                                            "experiments.readme_tables, which imports this file); lists them.")
    p.parse_args(argv)
    for name, fn in TABLES.items():
        print(f"{name}: {fn.__doc__.splitlines()[0]}")


if __name__ == "__main__":
    main()
