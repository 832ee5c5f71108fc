"""Plots users would rather look at than read (matplotlib, headless)."""
from __future__ import annotations

import os
from typing import Optional


def plot_sensitivity(report: dict, path: str, title: Optional[str] = None) -> Optional[str]:
    """Bar chart of each candidate layer's sensitivity score, linearized layers highlighted.

    Returns the path written, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - optional dependency
        return None
    names = report["candidates"]
    scores = [report["sensitivity"][n] for n in names]
    colors = ["tab:blue" if n in report["linearized"] else "tab:gray" for n in names]
    fig, ax = plt.subplots(figsize=(max(5, 0.7 * len(names) + 2), 3.4))
    ax.bar(range(len(names)), scores, color=colors)
    ax.set_xticks(range(len(names)), [n.replace(".self_attn", "").replace("layers.", "") for n in names],
                  rotation=45, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("sensitivity I_l (log)")
    ax.set_title(title or f"LATTE per-layer sensitivity ({report['variant']}; blue = linear)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_kept(metrics: dict, path: str) -> Optional[str]:
    """Bar chart of the % of exact bbox mAP each row keeps (the main job's rows)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    names = [n for n in metrics if n not in ("linearized",)]
    kept = [100 * metrics[n]["retained"] for n in names]
    fig, ax = plt.subplots(figsize=(max(5, 0.75 * len(names) + 2), 3.6))
    colors = ["tab:green" if n == "exact" else "tab:red" if n == "uniform" else "tab:blue" for n in names]
    ax.bar(range(len(names)), kept, color=colors)
    for i, k in enumerate(kept):
        ax.text(i, k + 1, f"{k:.0f}", ha="center", fontsize=8)
    ax.axhline(95, ls="--", color="k", lw=0.8)
    ax.text(len(names) - 0.5, 96, "paper: 95%", ha="right", fontsize=8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("% of exact bbox mAP kept")
    ax.set_ylim(0, 110)
    ax.set_title("LATTE: share of the exact model's bbox mAP kept")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speed_front(speed: dict, path: str, marks: Optional[dict] = None, title: Optional[str] = None) -> Optional[str]:
    """The judged speed-accuracy front of a ``speedup=`` / ``choose_for='speed'`` calibration: each
    judged assignment's cross-fitted loss against its predicted speed-up, the chosen one starred,
    the report's marks (the paper's protocol) and ``marks`` (``{label: (speed-up, loss)}``) beside it.

    Returns the path written, or None when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    front = sorted(speed["front"], key=lambda p: p["predicted_speedup"])
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    ax.plot([p["predicted_speedup"] for p in front], [p["judged"] for p in front], "o-", color="tab:blue",
            label="judged assignments")
    chosen = speed["chosen"]
    ax.plot([chosen["predicted_speedup"]], [chosen["judged"]], "*", ms=16, color="tab:red",
            label=f"chosen (measured {speed.get('measured_speedup', float('nan')):.2f}x)")
    points = {k: (p["predicted_speedup"], p["judged"]) for k, p in speed.get("marks", {}).items()}
    for (label, (x, y)), marker in zip({**points, **(marks or {})}.items(), "sDv^P"):
        ax.plot([x], [y], marker, ms=8, ls="none", label=label)
    ax.set_xlabel("predicted end-to-end speed-up (x)")
    ax.set_ylabel(f"cross-fitted {speed.get('measure', 'loss')}")
    ax.set_title(title or "LATTE: modes chosen for speed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
