"""An HTML report of one training, readable without MLflow: the comparison tables and plots.

Plots (PNG, embedded): regret CDF per selector on each grouped split; the chosen
selector's confusion of chosen vs best schedule family; a map of the best schedule family
over token count and compute/communication ratio; feature importance of the chosen model.
And, where ``benchmarks/adapt_curve.py`` has written one, ``ficco adapt``'s learning curve
(``adapt_curve``). Input: what ``ficco_select.train.run.train`` writes to its output folder (``evaluation.json``,
``choices.parquet``, ``importance.json``); ``write_report(folder)`` renders ``report.html``.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ficco_select.train.metrics import comparison_table


def family_of(schedule: str) -> str:
    """Coarse schedule family for plots: none, shard, ring/a2a at d, with the engine."""
    parts = str(schedule).split(".")
    if parts[0] in ("none", "shard"):
        return f"{parts[0]}.{parts[-1]}"
    return f"{parts[2]}.{parts[1]}.{parts[-1]}" if len(parts) == 6 else str(schedule)


def coarse_family(schedule: str) -> str:
    """Four classes for the map: baseline, shard ring, finer ring, finer a2a."""
    parts = str(schedule).split(".")
    if parts[0] == "none":
        return "baseline"
    if parts[0] == "shard":
        return "shard ring"
    return f"finer {parts[2]}" if len(parts) == 6 else str(schedule)


def _png(fig, path: Path | None = None) -> str:
    """The figure as base64 PNG for embedding; also saved to `path` (an MLflow artifact)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    if path is not None:
        path.write_bytes(buf.getvalue())
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def regret_cdf(choices: pd.DataFrame, split: str):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, g in choices[choices["split"] == split].groupby("selector", sort=False):
        r = np.sort(g["regret"].dropna().to_numpy())
        if len(r):
            ax.step(r, np.arange(1, len(r) + 1) / len(r), where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("t(chosen) / t(best)")
    ax.set_ylabel("fraction of scenarios")
    ax.set_title(f"regret CDF, {split} hold-out")
    ax.legend(fontsize=7)
    return fig


def confusion(choices: pd.DataFrame, split: str, selector: str):
    import matplotlib.pyplot as plt

    g = choices[(choices["split"] == split) & (choices["selector"] == selector)]
    table = pd.crosstab(g["best"].map(family_of), g["chosen"].map(family_of))
    fig, ax = plt.subplots(figsize=(7, 6))
    ax.imshow(table.to_numpy(), cmap="Blues")
    ax.set_xticks(range(table.shape[1]), table.columns, rotation=70, fontsize=7)
    ax.set_yticks(range(table.shape[0]), table.index, fontsize=7)
    for (i, j), v in np.ndenumerate(table.to_numpy()):
        if v:
            ax.text(j, i, str(v), ha="center", va="center", fontsize=6)
    ax.set_xlabel(f"chosen by {selector}")
    ax.set_ylabel("fastest measured")
    ax.set_title(f"chosen vs best, {split} hold-out")
    return fig


def best_map(choices: pd.DataFrame):
    import matplotlib.pyplot as plt

    first = choices.drop_duplicates("scenario_id")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"baseline": "tab:gray", "shard ring": "tab:blue", "finer ring": "tab:orange", "finer a2a": "tab:red"}
    for fam, g in first.groupby(first["best"].map(coarse_family)):
        ax.scatter(g["m"], g["comp_comm_ratio"], s=8, label=fam, color=colors.get(fam), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens m")
    ax.set_ylabel("T_comp / T_comm (each alone)")
    ax.set_title("fastest schedule over token count and compute/communication ratio")
    ax.legend(fontsize=7, markerscale=2)
    return fig


def importance_plot(importance: dict[str, float]):
    import matplotlib.pyplot as plt

    top = sorted(importance.items(), key=lambda kv: kv[1], reverse=True)[:15]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.barh([k for k, _ in top][::-1], [v for _, v in top][::-1])
    ax.set_xlabel("gain")
    ax.set_title("feature importance of the chosen model")
    return fig


def adapt_curve(curve: pd.DataFrame):
    """``ficco adapt``'s learning curve: near-opt@2% on the unmeasured rest against the
    fraction of the grid measured, one panel per machine: the active and the random choice,
    the full retrain and the ceiling (a perfect selector on the same labels) as level lines."""
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(curve["preset"]))
    fig, axes = plt.subplots(1, len(presets), figsize=(3.2 * len(presets), 3.2), sharey=True, squeeze=False)
    for ax, preset in zip(axes[0], presets):
        rows = curve[curve["preset"] == preset]
        for strategy, style in (("active", "o-"), ("random", "s--")):
            r = rows[rows["strategy"] == strategy]
            if not r.empty:
                ax.plot(100 * r["fraction"], r["near_opt_2"], style, label=strategy)
        full = rows[rows["strategy"] == "full"]["near_opt_2"]
        if len(full):
            ax.axhline(float(full.iloc[0]), color="gray", lw=1, label="full retrain (80%)")
        ax.axhline(float(curve_ceiling(rows).mean()), color="black", lw=0.8, ls="-.", label="ceiling")
        ax.axhline(0.95, color="red", lw=0.6, ls=":")
        ax.set_title(preset, fontsize=9)
        ax.set_xlabel("% of grid measured")
    axes[0][0].set_ylabel("near-opt@2% on the rest")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def curve_ceiling(curve: pd.DataFrame) -> pd.Series:
    """Each curve row's ceiling (near-opt@2% of a perfect selector on its labels): the row's
    own where it has one (measured runs: the repeat oracle), else 1 (noise-free sim truth)."""
    if "ceiling_near_opt_2" not in curve:
        return pd.Series(1.0, index=curve.index)
    return curve["ceiling_near_opt_2"].fillna(1.0)


def curve_table(curve: pd.DataFrame) -> pd.DataFrame:
    """Near-opt@2% per (preset, strategy) by fraction measured, with the ceiling beside it."""
    table = curve.pivot_table(index=["preset", "strategy"], columns="fraction", values="near_opt_2")
    table["ceiling"] = curve_ceiling(curve).groupby([curve["preset"], curve["strategy"]]).mean()
    return table


def plot_curve(curve: pd.DataFrame, path: str | Path) -> Path:
    """``adapt_curve`` saved as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    _png(adapt_curve(curve), Path(path))
    return Path(path)


ADAPT_CURVE = Path("out/adapt_curve/curve.csv")
"""Where ``benchmarks/adapt_curve.py`` writes the learning curve; the report shows it from there."""


def adapt_section(curve_csv: Path, folder: Path) -> list[str]:
    """The report's learning-curve section: the table and plot of `curve_csv`, or how to make it."""
    parts = ["<h2>New hardware in a few measurements: ficco adapt's learning curve</h2>"]
    if not curve_csv.exists():
        return parts + [f"<p>No learning curve at {html.escape(str(curve_csv))}: "
                        "<code>python benchmarks/adapt_curve.py</code> makes it.</p>"]
    curve = pd.read_csv(curve_csv)
    table = curve_table(curve)
    parts.append(f"<p>From {html.escape(str(curve_csv))}: near-opt@2% on the unmeasured rest of each held-out "
                 "machine's grid, by fraction measured (0: zero-shot); full retrain at 0.8.</p>")
    parts.append(table.to_html(float_format=lambda x: f"{x:.3f}"))
    parts.append(f'<img src="data:image/png;base64,{_png(adapt_curve(curve), folder / "adapt_curve.png")}">')
    return parts


def write_report(folder: str | Path, title: str = "ficco-select training", *,
                 adapt_curve_csv: str | Path = ADAPT_CURVE) -> Path:
    """`folder`'s ``report.html``; with ``ficco adapt``'s learning curve from `adapt_curve_csv`
    (``benchmarks/adapt_curve.py``'s output) where it exists."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    folder = Path(folder)
    results = json.loads((folder / "evaluation.json").read_text())
    choices = pd.read_parquet(folder / "choices.parquet")
    meta = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    importance = json.loads((folder / "importance.json").read_text()) if (folder / "importance.json").exists() else {}
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if meta:
        parts.append("<p>" + ", ".join(f"<b>{html.escape(str(k))}</b>: {html.escape(str(v))}"
                                       for k, v in meta.items()) + "</p>")
    for split, block in results["splits"].items():
        table = comparison_table(block["mean"])
        parts.append(f"<h2>{html.escape(split)} hold-out ({len(block['folds'])} folds)</h2>")
        parts.append(table.to_html(float_format=lambda x: f"{x:.3f}"))
        for value, by_selector in [*block.get("by_backend", {}).items(), *block.get("by_dtype", {}).items(),
                                   *block.get("by_op", {}).items()]:
            parts.append(f"<h3>{html.escape(split)} hold-out, {html.escape(value)} scenarios only</h3>")
            parts.append(comparison_table(by_selector).to_html(float_format=lambda x: f"{x:.3f}"))
        if split in set(choices["split"]):
            png = _png(regret_cdf(choices, split), folder / f"regret_cdf_{split}.png")
            parts.append(f'<img src="data:image/png;base64,{png}">')
    if (folder / "abstention.csv").exists() and (folder / "abstention.csv").stat().st_size > 1:
        abstentions = pd.read_csv(folder / "abstention.csv")
        if not abstentions.empty:
            parts.append("<h2>Where the shipped policy's model stepped aside, and what ran</h2>")
            parts.append(abstentions.to_html(index=False, float_format=lambda x: f"{x:.3f}"))
    if (folder / "measured_holdout.csv").exists():
        holdout = pd.read_csv(folder / "measured_holdout.csv")
        parts.append("<h2>Measured machines held out (zero-shot on the spec; judged on the second sweep; "
                     "ceiling = repeat oracle)</h2>")
        for machine, table in holdout.groupby("machine", sort=False):
            parts.append(f"<h3>{html.escape(str(machine))}</h3>")
            parts.append(table.drop(columns="machine").to_html(index=False, float_format=lambda x: f"{x:.3f}"))
    chosen = meta.get("chosen")
    grouped = [s for s in ("family", "hardware") if s in set(choices["split"])]
    if chosen and grouped:
        parts.append(f'<h2>{html.escape(chosen)}: chosen vs best</h2>')
        png = _png(confusion(choices, grouped[0], chosen), folder / "confusion.png")
        parts.append(f'<img src="data:image/png;base64,{png}">')
    parts.append("<h2>Where each schedule family wins</h2>")
    parts.append(f'<img src="data:image/png;base64,{_png(best_map(choices), folder / "best_schedule_map.png")}">')
    if importance:
        parts.append("<h2>Feature importance</h2>")
        png = _png(importance_plot(importance), folder / "feature_importance.png")
        parts.append(f'<img src="data:image/png;base64,{png}">')
    parts += adapt_section(Path(adapt_curve_csv), folder)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>ficco-select report</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse;"
            "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}img{max-width:100%}"
            "</style></head><body>"
            + "\n".join(parts) + "</body></html>")
    out = folder / "report.html"
    out.write_text(page)
    return out
