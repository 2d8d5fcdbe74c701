"""GET /metrics: an engine's `metrics()` dict as prometheus_client metric families.

The dict (see engine/metrics.py):

    {
        "counters":   {"requests_total": 12, ...},
        "gauges":     {"expert_slots": 48, ...},
        "histograms": {"time_to_first_token_seconds":
                           {"buckets": [(0.05, 3), (0.1, 7), ...], "sum": 1.9, "count": 12}},
        "help":       {"requests_total": "Requests submitted.", ...},
    }

Every name gets the `freetoken_` prefix (unless it already has it). Histogram bucket counts are
cumulative (the count of observations <= le); the `+Inf` bucket is added from "count" when the
buckets do not end with one. A counter or gauge may instead hold a list of `(labels, value)` pairs,
and a histogram a list of histogram dicts with a "labels" key, for labelled series; the series of
one metric share their label names. A value of None is left out (e.g. a hit rate before the first
lookup); a metric with no series left is left out whole. prometheus_client names a counter's
sample `<name>_total`, so counter names end in `_total` (those that do not get it added).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

PREFIX = "freetoken_"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_BAD_NAME = re.compile(r"[^a-zA-Z0-9_:]")
_BAD_LABEL = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(name: str) -> str:
    """`name` as a Prometheus metric name with the freetoken_ prefix."""
    name = _BAD_NAME.sub("_", name)
    return name if name.startswith(PREFIX) else PREFIX + name


def _label_name(name: Any) -> str:
    name = _BAD_LABEL.sub("_", str(name))
    return "_" + name if not name or name[0].isdigit() else name


def _label_names(metric: str, label_sets: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """The label names every series of `metric` carries; series that disagree are a bug in the engine."""
    names = [list(map(_label_name, labels or {})) for labels in label_sets]
    if any(sorted(n) != sorted(names[0]) for n in names[1:]):
        raise ValueError(f"metric {metric}: its series carry different label names {names}")
    return names[0] if names else []


def _series(value: Any) -> list[tuple[Mapping[str, Any] | None, Any]]:
    """(labels, value) for a counter or gauge: a plain number, or a list of (labels, value) pairs."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [(labels, v) for labels, v in value if v is not None]
    return [] if value is None else [(None, value)]


def _values(labels: Mapping[str, Any] | None, names: list[str]) -> list[str]:
    by_name = {_label_name(k): str(v) for k, v in (labels or {}).items()}
    return [by_name[n] for n in names]


def _counter_or_gauge(kind: str, name: str, doc: str, value: Any) -> Metric | None:
    series = _series(value)
    if not series:
        return None
    names = _label_names(name, [labels for labels, _ in series])
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc, labels=names)
    for labels, v in series:
        family.add_metric(_values(labels, names), float(v))
    return family


def _histogram(name: str, doc: str, value: Any) -> Metric | None:
    hists = [h for h in ([value] if isinstance(value, Mapping) else list(value or ())) if h is not None]
    if not hists:
        return None
    names = _label_names(name, [h.get("labels") for h in hists])
    family = HistogramMetricFamily(name, doc, labels=names)
    for hist in hists:
        buckets = sorted(((float(le), n) for le, n in hist.get("buckets", ())), key=lambda b: b[0])
        count = hist.get("count")
        if count is None:
            count = buckets[-1][1] if buckets else 0
        if not buckets or not math.isinf(buckets[-1][0]):
            buckets.append((math.inf, count))
        family.add_metric(
            _values(hist.get("labels"), names),
            [(floatToGoString(le), float(n)) for le, n in buckets],
            float(hist.get("sum", 0)),
        )
    return family


class EngineCollector(Collector):
    """Collects one metrics() dict; a fresh one per scrape, so nothing is registered globally."""

    def __init__(self, metrics: Mapping[str, Any]):
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        helps: Mapping[str, str] = self.metrics.get("help") or {}
        seen: set[str] = set()
        for section, kind in (("counters", "counter"), ("gauges", "gauge"), ("histograms", "histogram")):
            for raw, value in (self.metrics.get(section) or {}).items():
                name = metric_name(raw)
                if name in seen:
                    continue
                doc = helps.get(raw) or helps.get(name) or ""
                if kind == "histogram":
                    family = _histogram(name, doc, value)
                else:
                    family = _counter_or_gauge(kind, name, doc, value)
                if family is not None:
                    seen.add(name)
                    yield family


def render_prometheus(metrics: Mapping[str, Any]) -> str:
    """The Prometheus text exposition (version 0.0.4) of an engine's metrics() dict (see the module doc)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(metrics))
    return generate_latest(registry).decode()
