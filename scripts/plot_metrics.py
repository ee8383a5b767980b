"""Plot a run's metrics (JSONL or TensorBoard) as PNG charts; several runs share each chart.

    python scripts/plot_metrics.py outputs/run_a outputs/run_b --label fsdp --label fsdp+tp --out plots/

Each RUN is a run's ``job.dump_folder`` (its ``metrics/rank_<r>.jsonl``, or else its TensorBoard
folder ``<tb_folder>/rank_<r>``), a ``.jsonl`` file, or a TensorBoard log folder. The charts, one
line per run, over the training step:

- loss: the training loss (solid) and the validation loss (dashed, markers);
- lr, grad_norm, tokens_per_s, mfu (skipped when no run knows its MFU);
- memory: peak (solid) and current (dotted) memory in GiB (CUDA: allocated, and the reserved
  peak dash-dotted; CPU: RSS, and the C heap in use dashed), at every step when the run has a
  per-step memory trace (``<dump>/memory/rank_<r>.jsonl``), with the warm-up steps shaded.

Written: ``<out>/metrics.png`` (all charts in one figure) and ``<out>/<chart>.png`` each.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[int, float]]]
"""metric name -> [(step, value)], sorted by step."""

# chart name -> [(metric key, line style, legend suffix)]
CHARTS: dict[str, list[tuple[str, str, str]]] = {
    "loss": [("loss", "-", ""), ("validation/loss", "--o", " (validation)")],
    "lr": [("lr", "-", "")],
    "grad_norm": [("grad_norm", "-", "")],
    "tokens_per_s": [("tokens_per_s", "-", "")],
    "mfu": [("mfu", "-", "")],
    "memory": [
        ("memory/peak_gib", "-", " peak"),
        ("memory/current_gib", ":", " current"),
        ("memory/heap_gib", "--", " heap in use"),
        ("memory/peak_reserved_gib", "-.", " reserved peak"),
    ],
}
_TRACE = "memory_trace/"
"""Prefix of the per-step memory trace's series (they replace memory/* on the memory chart)."""
_YLABEL = {
    "loss": "loss",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "tokens_per_s": "tokens/s per device",
    "mfu": "MFU (%)",
    "memory": "GiB",
}


def _add(series: Series, step: int, key: str, value: Any) -> None:
    if not isinstance(value, (int, float)):
        return  # null (unknown) values are not plotted; booleans count as 0/1
    if value != value:  # NaN
        return
    series.setdefault(key, []).append((int(step), float(value)))


def _finish(series: Series) -> Series:
    """Sort by step; a step logged twice (a resumed run) keeps its last value."""
    out: Series = {}
    for key, points in series.items():
        by_step = dict(points)
        out[key] = sorted(by_step.items())
    return out


def load_jsonl(path: str | Path) -> Series:
    series: Series = {}
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        step = record.pop("step")
        for key, value in record.items():
            _add(series, step, key, value)
    return _finish(series)


def load_tensorboard(log_dir: str | Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    series: Series = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            _add(series, event.step, tag, event.value)
    return _finish(series)


def load_run(path: str | Path, rank: int = 0) -> Series:
    """Metrics of one run from any of the layouts in the module docstring."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".jsonl":
            return load_jsonl(p)
        return load_tensorboard(p.parent)
    jsonl = p / "metrics" / f"rank_{rank}.jsonl"
    trace = p / "memory" / f"rank_{rank}.jsonl"
    if jsonl.exists():
        series = load_jsonl(jsonl)
        if trace.exists():
            series.update({_TRACE + k: v for k, v in load_jsonl(trace).items()})
        return series
    if list(p.glob("events.out.tfevents.*")):
        return load_tensorboard(p)
    for tb in sorted(p.glob(f"*/rank_{rank}")):
        if list(tb.glob("events.out.tfevents.*")):
            return load_tensorboard(tb)
    raise FileNotFoundError(
        f"{p}: no metrics/rank_{rank}.jsonl, TensorBoard events or <tb>/rank_{rank} folder"
    )


def charts_with_data(runs: dict[str, Series]) -> list[str]:
    return [
        c for c, lines in CHARTS.items() if any(k in s for s in runs.values() for k, *_ in lines)
    ]


def draw_chart(ax: Any, chart: str, runs: dict[str, Series]) -> None:
    import matplotlib.pyplot as plt

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, series) in enumerate(runs.items()):
        color = colors[i % len(colors)]
        per_step = chart == "memory" and _TRACE + "current_gib" in series
        if per_step:
            warm = [step for step, flag in series.get(_TRACE + "warmup", []) if flag]
            if warm:
                ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, color=color, alpha=0.1)
                ax.text(max(warm) + 0.5, 0.02, " warm-up", transform=ax.get_xaxis_transform())
        for key, style, suffix in CHARTS[chart]:
            if per_step:
                key = key.replace("memory/", _TRACE)
            points = series.get(key)
            if not points:
                continue
            steps, values = zip(*points)
            marker = "o" if "o" in style else None
            ax.plot(
                steps,
                values,
                linestyle=style.replace("o", "") or "-",
                marker=marker,
                markersize=3,
                color=color,
                label=f"{label}{suffix}",
            )
    ax.set_title(chart)
    ax.set_xlabel("step")
    ax.set_ylabel(_YLABEL[chart])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def build_figure(runs: dict[str, Series]) -> tuple[Any, dict[str, Any]]:
    """One figure with a chart per metric group that has data; returns (figure, {chart: axes})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts = charts_with_data(runs)
    if not charts:
        raise ValueError("none of the runs has a metric to plot")
    cols = 2 if len(charts) > 1 else 1
    rows = (len(charts) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 3.6 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    by_chart = {}
    for chart, ax in zip(charts, flat):
        draw_chart(ax, chart, runs)
        by_chart[chart] = ax
    for ax in flat[len(charts) :]:
        ax.set_visible(False)
    fig.tight_layout()
    return fig, by_chart


def plot_runs(runs: dict[str, Series], out_dir: str | Path) -> list[Path]:
    """Write metrics.png and one PNG per chart under ``out_dir``; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, by_chart = build_figure(runs)
    written = [out / "metrics.png"]
    fig.savefig(written[0], dpi=110)
    plt.close(fig)
    for chart in by_chart:
        single, ax = plt.subplots(figsize=(7, 4))
        draw_chart(ax, chart, runs)
        single.tight_layout()
        path = out / f"{chart.replace('/', '_')}.png"
        single.savefig(path, dpi=110)
        plt.close(single)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="dump folders, .jsonl files or TensorBoard dirs")
    parser.add_argument("--label", action="append", default=[], help="legend name, per run")
    parser.add_argument("--rank", type=int, default=0, help="which rank's metrics (default 0)")
    parser.add_argument("--out", default="plots", help="output folder (default ./plots)")
    args = parser.parse_args(argv)
    if args.label and len(args.label) != len(args.runs):
        parser.error(f"{len(args.label)} --label for {len(args.runs)} runs")
    labels = args.label or [Path(r).name or str(r) for r in args.runs]
    if len(set(labels)) != len(labels):
        labels = [f"{i}: {label}" for i, label in enumerate(labels)]
    runs = {label: load_run(path, args.rank) for label, path in zip(labels, args.runs)}
    for path in plot_runs(runs, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
