"""Span, counter and instant recorder with a Chrome Trace Event (Perfetto-loadable) writer.

Why one recorder: overlap and stalls between actors and data-plane workers (plan, CPU experts,
PCIe copies, GPU GEMMs) are only visible on one shared timeline. A track is a name (an actor,
a worker thread); it becomes one named thread row in Perfetto.

Recording must be cheap and thread-safe: data-plane workers record from their own threads,
and when tracing is off every call returns after one attribute check.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

_PID = 1


class Span:
    """One timed region on a track: a context manager, or a handle from `TraceRecorder.begin`."""

    __slots__ = ("_rec", "track", "name", "args", "start_ns")

    def __init__(self, rec: TraceRecorder, track: str, name: str, args: dict[str, Any]) -> None:
        self._rec = rec
        self.track = track
        self.name = name
        self.args = args
        self.start_ns = 0

    def __enter__(self) -> Span:
        self.start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            # A span that ends in an exception says so on the timeline.
            self.args["error"] = exc_type.__name__
        self._rec._complete(self, time.perf_counter_ns())


class _NullSpan(Span):
    """What a disabled recorder hands out: one shared object whose enter and exit do nothing."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return self

    def __exit__(self, *_: object) -> None:
        return None


class TraceRecorder:
    """Collects events in memory (under a lock: cheap uncontended) until `write_perfetto`."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        # (phase, track, name, ts_ns, dur_ns or counter value, args)
        self._events: list[tuple[str, str, str, int, float, dict[str, Any] | None]] = []
        self._t0 = time.perf_counter_ns()

    def span(self, track: str, name: str, **args: Any) -> Span:
        """`with rec.span("gpu_runner", "decode", batch=8): ...` records one complete event."""
        if not self.enabled:
            return _NULL_SPAN
        return Span(self, track, name, args)

    def begin(self, track: str, name: str, **args: Any) -> Span:
        """Start a span that `end` closes, possibly from another thread."""
        if not self.enabled:
            return _NULL_SPAN
        return Span(self, track, name, args).__enter__()

    def end(self, span: Span, **args: Any) -> None:
        if span is _NULL_SPAN:
            return
        span.args.update(args)
        self._complete(span, time.perf_counter_ns())

    def complete(self, track: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        """A span whose times were taken elsewhere (perf_counter_ns clock)."""
        if self.enabled:
            self._add("X", track, name, start_ns, end_ns - start_ns, args or None)

    def counter(self, track: str, name: str, value: float) -> None:
        if self.enabled:
            self._add("C", track, name, time.perf_counter_ns(), value, None)

    def instant(self, track: str, name: str, **args: Any) -> None:
        if self.enabled:
            self._add("i", track, name, time.perf_counter_ns(), 0, args or None)

    def _complete(self, span: Span, end_ns: int) -> None:
        self._add("X", span.track, span.name, span.start_ns, end_ns - span.start_ns, span.args or None)

    def _add(self, ph: str, track: str, name: str, ts: int, val: float, args: dict[str, Any] | None) -> None:
        with self._lock:
            self._events.append((ph, track, name, ts, val, args))

    def recent_spans(self, limit: int) -> list[dict[str, Any]]:
        """The last `limit` spans, oldest first, as {"track", "name", "start_ms", "dur_ms", "args"}
        (milliseconds since the recorder started): what a live view draws as a timeline."""
        with self._lock:
            spans = [e for e in self._events[-4 * limit :] if e[0] == "X"][-limit:]
        return [
            {"track": track, "name": name, "start_ms": (ts - self._t0) / 1e6, "dur_ms": dur / 1e6, "args": args or {}}
            for _, track, name, ts, dur, args in spans
        ]

    def clear(self) -> None:
        with self._lock:
            self._events.clear()

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome Trace Event document: one process, one thread id per track."""
        with self._lock:
            events = list(self._events)
        tids: dict[str, int] = {}

        def meta(kind: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
            return {"ph": "M", "name": kind, "pid": _PID, "tid": tid, "args": args}

        out = [meta("process_name", 0, {"name": "freetoken"})]
        body: list[dict[str, Any]] = []
        for ph, track, name, ts_ns, val, args in sorted(events, key=lambda e: e[3]):
            tid = tids.get(track)
            if tid is None:
                tid = tids[track] = len(tids) + 1
                out.append(meta("thread_name", tid, {"name": track}))
                out.append(meta("thread_sort_index", tid, {"sort_index": tid}))
            ts = (ts_ns - self._t0) / 1e3  # microseconds since the recorder started
            ev: dict[str, Any] = {"ph": ph, "name": name, "pid": _PID, "tid": tid, "ts": ts}
            if ph == "X":
                ev["dur"] = val / 1e3
            elif ph == "C":
                # Counters are per process in this format; the track prefix keeps them apart.
                ev["name"] = f"{track}/{name}"
                ev["args"] = {"value": val}
            elif ph == "i":
                ev["s"] = "t"
            if args and ph != "C":
                ev["args"] = args
            body.append(ev)
        return {"traceEvents": out + body, "displayTimeUnit": "ms"}

    def write_perfetto(self, path: str | Path) -> None:
        """Write a JSON file that ui.perfetto.dev and chrome://tracing open directly."""
        Path(path).write_text(json.dumps(self.to_chrome(), default=repr))


_NULL_SPAN = _NullSpan(TraceRecorder(enabled=False), "", "", {})

# The recorder every component uses unless tracing is requested: records nothing.
NULL_RECORDER = TraceRecorder(enabled=False)
