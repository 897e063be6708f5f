"""Pictures of a projection (matplotlib, ``freescale.plotting``): ETTR against GPU count with
where the lost time went, and throughput over time on one trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from freescale.plotting import pyplot
from freescale.sim.engine import Outcome

COLORS = {"sync + checkpoint restart": "#c0392b", "torchft-like": "#e67e22", "freescale": "#2471a3"}
STYLES: dict[str, str] = {}
"""Line styles by policy (solid unless named)."""


def _gpus_label(n: int) -> str:
    return f"{n // 1024}K" if n in (1024, 2048, 4096, 8192) else f"{round(n / 1000)}K" if n >= 1000 else str(n)


def plot_projection(curve: list[dict[str, Any]], path: Path, title: str) -> Path:
    """Left: ETTR vs GPUs per policy.  Right: the largest scale's breakdown of lost time."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    policies = list(dict.fromkeys(r["policy"] for r in curve))
    for policy in policies:
        rows = sorted((r for r in curve if r["policy"] == policy), key=lambda r: r["gpus"])
        ax.plot([r["gpus"] for r in rows], [100 * r["ettr"] for r in rows], marker="o", label=policy,
                color=COLORS.get(policy), ls=STYLES.get(policy, "-"))
        outside = [r for r in rows if not r.get("validated", True)]
        ax.plot([r["gpus"] for r in outside], [100 * r["ettr"] for r in outside], "o", mfc="white",
                color=COLORS.get(policy), label="lambda*stall > 0.5 (outside the validated range)" if outside else None)
    gpus = sorted({r["gpus"] for r in curve})
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [_gpus_label(g) for g in gpus])
    ax.set_xlim(gpus[0] / 1.3, gpus[-1] * 1.8)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    lasts = sorted((max((r for r in curve if r["policy"] == p), key=lambda r: r["gpus"]) for p in policies),
                   key=lambda r: r["ettr"])
    label_y = -10.0
    for last in lasts:  # the largest scale's values, spaced so close ones stay readable
        label_y = max(100 * last["ettr"], label_y + 4.5)
        ax.annotate(f"{100 * last['ettr']:.1f}%", (last["gpus"], 100 * last["ettr"]), xytext=(last["gpus"] * 1.12, label_y),
                    textcoords="data", fontsize=8, va="center", color=COLORS.get(last["policy"]))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="lower left", fontsize=8)
    ax.set_title("effective training time ratio")

    largest = [r for r in curve if r["gpus"] == gpus[-1]]
    reasons = sorted({k for r in largest for k in r["breakdown"] if k != "useful"},
                     key=lambda k: -max(r["breakdown"].get(k, 0) for r in largest))
    palette = [c for i, c in enumerate(plt.get_cmap("tab20").colors) if i not in (4, 5)]  # no greens: useful is green
    for i, r in enumerate(largest):
        left = 100 * r["breakdown"]["useful"]
        bx.barh(i, left, color="#7dcea0", label="useful" if i == 0 else None)
        for j, reason in enumerate(reasons):
            width = 100 * r["breakdown"].get(reason, 0.0)
            bx.barh(i, width, left=left, color=palette[j % len(palette)], label=reason if i == 0 else None)
            left += width
    bx.set_yticks(range(len(largest)), [r["policy"] for r in largest])
    bx.set_xlim(0, 100)
    bx.set_xlabel("share of GPU x wall time (%)")
    bx.set_title(f"where the time went at {_gpus_label(gpus[-1])} GPUs")
    bx.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(outcomes: list[Outcome], path: Path, title: str) -> Path:
    """Work done per time bin (share of the whole cluster) for each policy on the same trace."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12, 4))
    for out in outcomes:
        hours = [t / 3600 for t in out.series_t_s]
        ax.plot(hours, [100 * r for r in out.series_rate], label=f"{out.policy} (ETTR {100 * out.ettr:.1f}%)",
                color=COLORS.get(out.policy), ls=STYLES.get(out.policy, "-"), lw=1.2)
    ax.set_xlabel("hours")
    ax.set_ylabel("throughput (% of the healthy cluster)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
