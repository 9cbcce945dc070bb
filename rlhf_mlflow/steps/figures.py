"""Figures a person would rather look at than read: per-family curves and bars (matplotlib only)."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from rlhf_mlflow.core import shortcut_rules as SR  # noqa: E402
from rlhf_mlflow.core import vocab as V  # noqa: E402


def family_curves(history: list[tuple[int, dict]], names=("proxy", "kl", "top_token_share", "entropy")):
    """One panel per metric, one line per family (balanced dashed)."""
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.4))
    steps = [s for s, _ in history]
    for ax, name in zip(axes, names):
        for f in V.FAMILIES + ["balanced"]:
            key = f"{name}/{f}"
            ys = [m.get(key) for _, m in history]
            if all(y is not None for y in ys):
                ax.plot(steps, ys, label=f, linestyle="--" if f == "balanced" else "-",
                        color="black" if f == "balanced" else None)
        ax.set_title(name)
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def family_bars(metrics: dict, names=("proxy", "kl"), title: str = ""):
    """Per-family bars of `<name>/<family>` values."""
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.2))
    for ax, name in zip(axes, names):
        fams = [f for f in V.FAMILIES if f"{name}/{f}" in metrics]
        ax.bar(fams, [metrics[f"{name}/{f}"] for f in fams], color="tab:blue")
        if f"{name}/balanced" in metrics:
            ax.axhline(metrics[f"{name}/balanced"], color="black", linestyle="--", label="balanced")
        if f"{name}/pilot" in metrics:
            ax.axhline(metrics[f"{name}/pilot"], color="tab:red", linestyle=":", label="pilot")
        ax.set_title(name)
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def diagnostic_bars(result: dict):
    """Per-family risk, and the top feature's premium per occurrence against the margin its family's
    clean features allow."""
    fams = list(result["families"])
    risks = [result["families"][f]["risk"] for f in fams]
    top = [result["families"][f]["evidence"][0] for f in fams]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    axes[0].bar(fams, risks, color=["tab:red" if result["families"][f]["flag"] else "tab:blue" for f in fams])
    axes[0].axhline(0.5, color="black", linestyle="--")
    axes[0].set_title("shortcut risk (flag at 0.5)")
    axes[1].bar(fams, [c["premium"] for c in top], color="tab:gray")
    axes[1].scatter(fams, [c["margin"] * (1 if c["premium"] >= 0 else -1) for c in top], marker="_", s=400,
                    color="black", zorder=3)
    for x, c in enumerate(top):
        axes[1].annotate(SR.describe(c), (x, c["premium"]), ha="center", va="bottom", fontsize=7)
    axes[1].set_title("top feature: reward-model premium per occurrence (bar: its margin)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    return fig


def certification_plot(report: dict, truth: dict | None = None):
    """Certified quality per family with its interval beside the reference's mean; refused families
    are marked. `truth` ({family: value}) adds the oracle's numbers, for benchmarks only."""
    import numpy as np
    fams = list(report["families"]) + ["balanced"]
    rows = list(report["families"].values()) + [report["balanced"]]
    x = np.arange(len(fams))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    reference = [np.nan if r["reference"] is None else r["reference"] for r in rows]  # None: no expert set
    ax.scatter(x - 0.12, reference, marker="_", s=300, color="gray", label="reference")
    for i, r in enumerate(rows):
        if r["certifiable"]:
            ax.errorbar(i + 0.12, r["estimate"], yerr=[[r["estimate"] - r["lo"]], [r["hi"] - r["estimate"]]],
                        fmt="o", color="tab:blue", capsize=4, label="certified (90%)" if i == 0 else None)
        else:
            ax.text(i + 0.12, np.nan_to_num(reference[i]), "refused", rotation=90, ha="center", va="bottom", color="tab:red")
    if truth:
        ax.scatter(x + 0.3, [truth.get(f, np.nan) for f in fams], marker="x", color="black", label="oracle truth")
    ax.set_xticks(x, fams)
    ax.set_ylabel("true quality")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def gao_fits(points: list, fits: dict[str, dict], fired: dict[str, int], title: str | None = None):
    """One panel per family: the watch's estimated gain against d = sqrt(KL) with error bars (1 se),
    the Gao-form fit (its form: RL's d (alpha - beta log d) or best-of-n's d (alpha - beta d)) over the
    points the expert set vouches for (the others hollow), its peak, and the point where the family was
    called past its peak. `points`: the watch's WatchPoints
    (step, kl, gain, se per family)."""
    import numpy as np

    from rlhf_mlflow.decisions.gao import gao_curve, peak_in_range
    fams = list(fits)
    fig, axes = plt.subplots(1, len(fams), figsize=(3.2 * len(fams), 3.2), squeeze=False)
    for ax, f in zip(axes[0], fams):
        d = np.sqrt([p.kl[f] for p in points])
        g = np.array([p.gain[f] for p in points])
        ok = np.array([p.vouched.get(f, True) for p in points])
        ax.errorbar(d[ok], g[ok], yerr=np.array([p.se[f] for p in points])[ok], fmt="o", ms=3, capsize=2,
                    color="tab:blue")
        if (~ok).any():  # what the reward model believes where the expert set cannot reach: not a quality
            ax.scatter(d[~ok], g[~ok], s=12, facecolors="none", edgecolors="gray", label="not vouched for")
        fit, max_kl = fits[f], max(p.kl[f] for p in points)
        if fit["alpha"] is not None:  # the curve over what was seen, and on to its peak only when in range
            in_range = peak_in_range(fit, max_kl)
            grid = np.linspace(0, max(d.max(), fit["peak_d"] if in_range else 0, 1e-3) * 1.05, 100)
            ax.plot(grid, gao_curve(fit, grid), color="black", lw=1)
            if in_range:
                ax.axvline(fit["peak_d"], color="tab:green", ls=":", label=f"fitted peak KL {fit['peak_kl']:.2g}")
            else:
                ax.text(0.02, 0.02, "no peak in range", transform=ax.transAxes, fontsize=7, color="gray")
        if f in fired:
            i = [p.step for p in points].index(fired[f])
            ax.scatter([d[i]], [g[i]], s=80, facecolors="none", edgecolors="tab:red",
                       label=f"past peak @ step {fired[f]}", zorder=3)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_title(f)
        ax.set_xlabel("d = sqrt(KL)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    axes[0][0].set_ylabel("estimated true gain")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
