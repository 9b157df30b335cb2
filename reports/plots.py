"""Figures as base64 PNG strings, drawn with matplotlib's Agg canvas (no pyplot, no global state).

One colour per modality everywhere (:data:`reports.html.MODALITY_COLORS`); every figure has a
title, labelled axes and units.
"""

from __future__ import annotations

import base64
import io
import math

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, PercentFormatter

from reports.formatting import si
from reports.html import MODALITY_COLORS
from reports.pareto import COSTS

DPI = 100
WIDTH = 11.0
CAPABILITY_COLORS = {"understanding": "#332288", "generation": "#DDAA33"}
VERDICT_COLORS = {"regression": "#c62828", "improvement": "#2e7d32"}


def color_of(group: str) -> str:
    """The colour of a modality or capability (grey for anything else)."""
    return MODALITY_COLORS.get(group) or CAPABILITY_COLORS.get(group) or "#777777"


def _png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def retention_lines(
    ax,
    groups: pd.DataFrame,
    names: list[str],
    x_of: dict[str, int],
    color: dict,
    *,
    spread: float = 0.06,
    capsize: float = 3,
    lw: float = 1.8,
) -> None:
    """One line per group of ``groups`` (``group, subnet, rel, ci_low, ci_high``) on ``ax``: its retention
    at each subnet's x position (``x_of``) with the 95 % interval, groups side by side by ``spread``."""
    for j, name in enumerate(names):
        g = groups[(groups["group"] == name) & groups["subnet"].isin(x_of)]
        g = g.assign(x=g["subnet"].map(x_of)).sort_values("x")
        x = g["x"].to_numpy(float) + (j - (len(names) - 1) / 2) * spread
        err = np.vstack([(g["rel"] - g["ci_low"]).to_numpy(float), (g["ci_high"] - g["rel"]).to_numpy(float)])
        ax.errorbar(
            x,
            g["rel"],
            yerr=np.nan_to_num(err),
            marker="o",
            capsize=capsize,
            lw=lw,
            color=color[name],
            label=name,
        )


def retention_plot(groups: pd.DataFrame, order: list[str], labels: dict[str, str], title: str) -> str:
    """Group score (with 95% interval) per subnet, subnets from largest to smallest, one line per group."""
    fig = Figure(figsize=(WIDTH, 4.6))
    ax = fig.add_subplot()
    x_of = {s: i for i, s in enumerate(order)}
    names = list(dict.fromkeys(groups["group"]))
    retention_lines(ax, groups, names, x_of, {n: color_of(n) for n in names})
    ax.axhline(1.0, color="#444", lw=0.8)
    ax.axhline(0.95, color="#999", lw=0.8, ls="--", label="95% retention")
    ax.set_xticks(range(len(order)), [labels.get(s, s) for s in order], fontsize=9)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("Subnet (largest to smallest; % of the full model's active parameters)")
    ax.set_ylabel("Relative score vs full (retention)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=9)
    return _png(fig)


def change_heatmap(rel: pd.DataFrame, order: list[str], task_modality: dict[str, str]) -> str:
    """Subnet x task heatmap of relative change vs the full model, in percent."""
    tasks = sorted(
        task_modality,
        key=lambda t: (
            list(MODALITY_COLORS).index(task_modality[t]) if task_modality[t] in MODALITY_COLORS else 9,
            t,
        ),
    )
    grid = rel.pivot_table(index="subnet", columns="task", values="rel", aggfunc="first")
    grid = grid.reindex(index=order, columns=tasks)
    change = (grid.to_numpy(float) - 1.0) * 100.0
    finite = np.abs(change[np.isfinite(change)])
    lim = float(min(max(finite.max() if finite.size else 1.0, 1.0), 50.0))
    fig = Figure(figsize=(min(max(6.0, 0.9 * len(tasks) + 3.0), 14.0), 1.4 + 0.45 * len(order)))
    ax = fig.add_subplot()
    cmap = colormaps["RdBu"].with_extremes(bad="#dddddd")
    im = ax.imshow(np.ma.masked_invalid(change), cmap=cmap, norm=TwoSlopeNorm(0.0, -lim, lim), aspect="auto")
    for i in range(len(order)):
        for j in range(len(tasks)):
            v = change[i, j]
            ax.text(
                j,
                i,
                "n/a" if not np.isfinite(v) else f"{v:+.1f}",
                ha="center",
                va="center",
                fontsize=8,
                color="white" if np.isfinite(v) and abs(v) > 0.6 * lim else "black",
            )
    ax.set_yticks(range(len(order)), order, fontsize=9)
    ax.set_xticks(
        range(len(tasks)),
        tasks,
        rotation=35 if len(tasks) > 6 else 0,
        ha="right" if len(tasks) > 6 else "center",
        fontsize=9,
    )
    for label, task in zip(ax.get_xticklabels(), tasks):
        label.set_color(color_of(task_modality[task]))
    ax.set_title(
        "Relative change vs full model (%; blue better, red worse; task labels coloured by modality)"
    )
    ax.set_xlabel("Task (primary metric)")
    ax.set_ylabel("Subnet")
    fig.colorbar(im, ax=ax, label="% change vs full", shrink=0.9)
    return _png(fig)


def seesaw_bars(index: pd.DataFrame, order: list[str]) -> str:
    """Seesaw index per subnet; each bar coloured by the modality that kept the least."""
    rows = index.set_index("subnet").reindex([s for s in order if s in set(index["subnet"])])
    fig = Figure(figsize=(WIDTH, 3.4))
    ax = fig.add_subplot()
    values = rows["seesaw_index"].to_numpy(float)
    ax.bar(range(len(rows)), np.nan_to_num(values), color=[color_of(w) for w in rows["worst"]])
    for i, (v, worst) in enumerate(zip(values, rows["worst"])):
        ax.text(
            i,
            np.nan_to_num(v),
            "n/a" if math.isnan(v) else f"{100 * v:.1f} pts\n(worst: {worst})",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)), list(rows.index), fontsize=9)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{100 * v:.0f} pts"))
    ax.set_ylim(0, max(0.05, float(np.nanmax(values)) * 1.35 if np.isfinite(values).any() else 0.05))
    ax.set_xlabel("Subnet")
    ax.set_ylabel("Seesaw index (max - min retention)")
    ax.set_title(
        "Seesaw index: how unevenly the modalities degrade (0 = evenly; bar colour = worst modality)"
    )
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def pareto_plot(table: pd.DataFrame, groups: pd.DataFrame) -> str:
    """Aggregate score (black, frontier joined) and per-modality scores against each recorded cost."""
    costs = [c for c in COSTS if pd.to_numeric(table[c], errors="coerce").notna().any()]
    n_cols = 2
    n_rows = max(1, math.ceil(len(costs) / n_cols))
    fig = Figure(figsize=(WIDTH, 4.0 * n_rows))
    per_mod = groups.pivot_table(index="subnet", columns="group", values="rel", aggfunc="first")
    for k, cost in enumerate(costs):
        ax = fig.add_subplot(n_rows, n_cols, k + 1)
        t = table.assign(x=pd.to_numeric(table[cost], errors="coerce")).dropna(subset=["x", "score"])
        for modality in per_mod.columns:
            y = t["subnet"].map(per_mod[modality])
            ax.scatter(t["x"], y, s=22, color=color_of(modality), alpha=0.7, label=modality)
        ax.scatter(t["x"], t["score"], s=46, color="black", zorder=3, label="aggregate")
        front = t[t[f"front_{cost}"]].sort_values("x")
        ax.plot(front["x"], front["score"], color="black", lw=1.2, ls="--", zorder=2, label="Pareto frontier")
        for _, r in t.iterrows():
            ax.annotate(
                str(r["subnet"]), (r["x"], r["score"]), xytext=(4, 4), textcoords="offset points", fontsize=8
            )
        if len(t) and t["x"].max() / max(t["x"].min(), 1e-12) > 20:
            ax.set_xscale("log")
        if cost != "decode_ms_per_token":
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: si(v)))
        title, unit = COSTS[cost]
        ax.set_xlabel(f"{title} ({unit}; lower is cheaper)")
        ax.set_ylabel("Relative score vs full")
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        ax.set_title(f"Score vs {title.lower()}")
        ax.grid(alpha=0.3)
        if k == 0:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Efficiency trade-offs (black: aggregate = mean over modalities; dashed: Pareto frontier)")
    fig.tight_layout()
    return _png(fig)


def frequency_plot(freq: pd.DataFrame, layers: list[int]) -> str:
    """Expert activation frequency (group x expert) at the given layers."""
    fig = Figure(figsize=(WIDTH, 1.6 + 0.5 * max(1, freq["group"].nunique())), layout="constrained")
    vmax = float(freq["frequency"].max()) if len(freq) else 1.0
    im = None
    axes = fig.subplots(1, len(layers), sharey=True, squeeze=False)[0]
    for ax, layer in zip(axes, layers):
        grid = freq[freq["layer"] == layer].pivot_table(index="group", columns="expert", values="frequency")
        im = ax.imshow(grid.to_numpy(float), cmap="viridis", vmin=0, vmax=vmax, aspect="auto")
        ax.set_yticks(range(len(grid.index)), list(grid.index), fontsize=9)
        for label in ax.get_yticklabels():
            label.set_color(color_of(label.get_text()))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("Expert index")
        ax.set_title(f"Layer {layer}")
    if im is not None:
        fig.colorbar(im, ax=list(axes), label="Share of routed tokens", shrink=0.9)
    fig.suptitle("Expert activation frequency per modality (first / middle / last MoE layer)")
    return _png(fig)


def iou_plot(ious: pd.DataFrame, layers: list[int]) -> str:
    """IoU of the top-25% experts between groups, one heatmap per layer (stacked when there are
    many groups, with cell values only where they stay legible)."""
    n_groups = ious["a"].nunique()
    annotate = n_groups <= 8
    stacked = n_groups > 5
    rows, cols = (len(layers), 1) if stacked else (1, len(layers))
    side = 3.2 + 0.38 * n_groups
    fig = Figure(
        figsize=(WIDTH if not stacked else side + 2.5, 4.2 if not stacked else side * rows),
        layout="constrained",
    )
    for k, layer in enumerate(layers):
        ax = fig.add_subplot(rows, cols, k + 1)
        grid = ious[ious["layer"] == layer].pivot_table(index="a", columns="b", values="iou", aggfunc="first")
        names = list(grid.index)
        grid = grid.reindex(index=names, columns=names)
        image = ax.imshow(grid.to_numpy(float), cmap="Blues", vmin=0, vmax=1)
        if annotate:
            for i in range(len(names)):
                for j in range(len(names)):
                    v = grid.iloc[i, j]
                    ax.text(
                        j,
                        i,
                        "n/a" if pd.isna(v) else f"{v:.2f}",
                        ha="center",
                        va="center",
                        fontsize=8,
                        color="white" if not pd.isna(v) and v > 0.6 else "black",
                    )
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(f"Layer {layer}")
        if not annotate:
            fig.colorbar(image, ax=ax, shrink=0.8, label="IoU")
    fig.suptitle("IoU of the top-25% most activated experts (1 = same experts, 0 = disjoint)")
    return _png(fig)


def entropy_plot(entropy: pd.DataFrame) -> str:
    """Normalised routing entropy per layer, one line per group."""
    fig = Figure(figsize=(WIDTH, 3.8))
    ax = fig.add_subplot()
    for name, g in entropy.groupby("group", sort=False):
        g = g.sort_values("layer")
        ax.plot(g["layer"], g["entropy"], marker="o", lw=1.8, color=color_of(str(name)), label=str(name))
    ax.set_ylim(0, 1.05)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("MoE layer index")
    ax.set_ylabel("Normalised entropy (0-1)")
    ax.set_title("Normalised routing entropy per layer (1 = tokens spread evenly over all experts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    return _png(fig)


def delta_plot(cells: pd.DataFrame) -> str:
    """Forest plot of each compared cell's change (new vs base, % of base) with its 95% interval."""
    cells = cells.reset_index(drop=True)
    fig = Figure(figsize=(WIDTH, 1.2 + 0.28 * max(1, len(cells))))
    ax = fig.add_subplot()
    y = np.arange(len(cells))[::-1]
    base = cells["base_value"].abs().replace(0, np.nan).to_numpy(float)
    rel = cells["delta"].to_numpy(float) / base
    err = (
        np.vstack(
            [
                (cells["delta"] - cells["ci_low"]).to_numpy(float),
                (cells["ci_high"] - cells["delta"]).to_numpy(float),
            ]
        )
        / base
    )
    colors = [VERDICT_COLORS.get(v, "#78849a") for v in cells["verdict"]]
    ax.errorbar(rel, y, xerr=np.nan_to_num(err), fmt="none", ecolor="#999", capsize=2)
    ax.scatter(rel, y, c=colors, zorder=3, s=24)
    ax.axvline(0, color="#444", lw=0.8)
    ax.set_yticks(
        y,
        [f"{s} / {t} / {m}" for s, t, m in zip(cells["subnet"], cells["task"], cells["metric"])],
        fontsize=8,
    )
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("Change of the metric, new vs base (% of the base value; raw metric direction)")
    ax.set_title("Per-cell change with 95% paired interval (red: significant regression; green: improvement)")
    ax.grid(axis="x", alpha=0.3)
    return _png(fig)


def rl_curves(arms: dict[str, pd.DataFrame]) -> str:
    """Reward and token entropy per RL step of every arm (columns ``step``, ``reward``, ``entropy``,
    already smoothed by the caller), side by side."""
    fig = Figure(figsize=(WIDTH, 3.6))
    reward_ax, entropy_ax = fig.subplots(1, 2)
    for name, frame in arms.items():
        reward_ax.plot(frame["step"], frame["reward"], lw=1.6, label=name)
        entropy_ax.plot(frame["step"], frame["entropy"], lw=1.6, label=name)
    reward_ax.set(title="Reward (5-step moving mean)", xlabel="RL step", ylabel="Mean reward")
    entropy_ax.set(title="Token entropy (5-step moving mean)", xlabel="RL step", ylabel="Entropy (nats)")
    for ax in (reward_ax, entropy_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    reward_ax.legend(fontsize=8)
    return _png(fig)
