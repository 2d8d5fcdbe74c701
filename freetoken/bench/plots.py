"""`bench decode --plot` / `bench prefill --plot`: a run's tok/s as bars, measured/floor above each."""

from __future__ import annotations

from pathlib import Path

from freetoken.plot import bar_plot


def _run_name(r: dict) -> str:
    """A decode run's bar label: its policy, and its mode and PDL where those vary."""
    name = f"{r['policy']}\n{r['mode']}"
    return name + ("\nno PDL" if r.get("pdl") is False else "")


def plot_decode(report: dict, path: str | Path) -> Path:
    """tok/s per policy run of a `bench decode` report, measured/floor written over each bar."""
    runs = report["results"]
    return bar_plot(
        path,
        {_run_name(r): r["tok_per_s"] for r in runs},
        title=f"decode tok/s per policy  ({Path(report['model']['dir']).name}, batch {report['batch']})",
        y_label="tokens/s",
        notes={_run_name(r): f"{r['measured_over_floor']:.2f}x floor" for r in runs},
    )


def plot_prefill(report: dict, path: str | Path) -> Path:
    """tok/s per prompt length of a `bench prefill` report, measured/floor written over each bar."""
    runs = report["results"]
    return bar_plot(
        path,
        {f"{r['prompt_tokens']} tokens": r["tok_per_s"] for r in runs},
        title=f"prefill tok/s  (policy {report['policy']}, {report['slots']} slots)",
        y_label="tokens/s",
        notes={f"{r['prompt_tokens']} tokens": f"{r['measured_over_floor']:.2f}x floor" for r in runs},
    )
