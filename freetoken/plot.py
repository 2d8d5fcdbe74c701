"""Line and bar charts written as PNG files with matplotlib's Agg backend (no display needed).

matplotlib is imported on first use, so commands that plot nothing do not pay for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

_DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def line_plot(
    path: str | Path,
    series: dict[str, Sequence[tuple[float, float] | None]],
    title: str = "",
    x_label: str = "",
    y_label: str = "",
    x_range: tuple[float, float] = (0.0, 1.0),
    y_range: tuple[float, float] = (0.0, 1.0),
    width: int = 720,
    height: int = 440,
    x_percent: bool = False,
) -> Path:
    """Plot each series (points in x order; None breaks the line) and write a PNG of width x height pixels."""
    plt = _pyplot()
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    try:
        for name, points in series.items():
            xs = [float("nan") if p is None else p[0] for p in points]
            ys = [float("nan") if p is None else p[1] for p in points]
            ax.plot(xs, ys, marker="s", markersize=3, linewidth=1.8, label=name)
        ax.set(title=title, xlabel=x_label, ylabel=y_label, xlim=x_range, ylim=y_range)
        if x_percent:
            ax.xaxis.set_major_formatter(PercentFormatter(1.0))
        ax.grid(True, color="#dddddd")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=_DPI, format="png")
    finally:
        plt.close(fig)
    return path


def bar_plot(
    path: str | Path,
    bars: dict[str, float],
    title: str = "",
    y_label: str = "",
    notes: dict[str, str] | None = None,
    width: int = 720,
    height: int = 440,
) -> Path:
    """One bar per name (in order), `notes[name]` written above its bar; a PNG of width x height pixels."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    try:
        names = list(bars)
        drawn = ax.bar(names, [bars[n] for n in names], color="#4f8fd9")
        if notes:
            ax.bar_label(drawn, labels=[notes.get(n, "") for n in names], padding=3, fontsize=9)
        ax.set(title=title, ylabel=y_label)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", color="#dddddd")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=_DPI, format="png")
    finally:
        plt.close(fig)
    return path


def grouped_bar_plot(
    path: str | Path,
    groups: dict[str, dict[str, float]],
    title: str = "",
    y_label: str = "",
    width: int = 900,
    height: int = 440,
) -> Path:
    """Bars grouped along x (`groups[group][member]`, members in first-seen order, one colour each,
    a missing member left out); the value written above each bar; a PNG of width x height pixels."""
    plt = _pyplot()
    members = list(dict.fromkeys(m for bars in groups.values() for m in bars))
    step = 0.8 / max(1, len(members))
    fig, ax = plt.subplots(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    try:
        for i, member in enumerate(members):
            xs = [g for g, bars in enumerate(groups.values()) if member in bars]
            values = [bars[member] for bars in groups.values() if member in bars]
            drawn = ax.bar([x - 0.4 + step * (i + 0.5) for x in xs], values, width=step, label=member)
            ax.bar_label(drawn, labels=[f"{v:.0f}" for v in values], padding=2, fontsize=7)
        ax.set_xticks(range(len(groups)), list(groups))
        ax.set(title=title, ylabel=y_label)
        ax.margins(y=0.15)
        ax.grid(True, axis="y", color="#dddddd")
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=_DPI, format="png")
    finally:
        plt.close(fig)
    return path
