"""Live bandwidth estimates from work the engine timed anyway: slot fills and CPU expert calls.

A sample is one piece of timed work: the bytes it moved (a fill: experts copied into slots) or
read (a CPU call: distinct experts computed from the host banks), the nanoseconds it took, and
when it ended. The estimate of a link is the median of its samples' rates over a recent window,
so one call the OS descheduled, or one warm-up fill, does not move it. Who feeds which link, on
which path, is said where the samples are taken (cache/offloaded_moe.py, engine/decode_graphs.py)
and in `LiveBandwidths.sources`.

The estimates here are for display (the status, /metrics, the dashboard): whether the machine
still does what the profile measured. Every sample is also forwarded, as it is taken, to a
listener: hybrid's live split (moe/live_split.py) folds them per decode step.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

WINDOW_S = 30.0  # samples older than this no longer count: the estimate follows the current load
KEEP = 512  # samples kept per link (a big model's decode step gives one per MoE layer)
LINKS = ("pcie_fill", "cpu_expert")


@dataclass(frozen=True)
class Sample:
    nbytes: int
    ns: int
    at_s: float  # when the work ended (time.time())


@dataclass(frozen=True)
class Estimate:
    bytes_per_s: float  # the median of the samples' rates
    samples: int  # how many samples the window held
    window_s: float  # from the oldest sample's end to the newest's

    def as_dict(self) -> dict:
        return {"bytes_per_s": self.bytes_per_s, "samples": self.samples, "window_s": self.window_s}


def estimate(samples: Iterable[Sample], now_s: float, window_s: float = WINDOW_S) -> Estimate | None:
    """The median rate of the samples that ended within `window_s` before `now_s`; None when no
    sample there moved any bytes (samples of zero bytes or zero time say nothing about a rate)."""
    recent = [s for s in samples if now_s - window_s <= s.at_s <= now_s and s.nbytes > 0 and s.ns > 0]
    if not recent:
        return None
    rate = statistics.median(s.nbytes * 1e9 / s.ns for s in recent)
    return Estimate(rate, len(recent), max(s.at_s for s in recent) - min(s.at_s for s in recent))


class LinkTimings:
    """The recent samples of one link; `add` may be called from any thread."""

    def __init__(self, keep: int = KEEP, forward: Callable[[int, int], None] | None = None) -> None:
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self.total = 0  # samples ever added (tells "none yet" from "none lately")
        self._forward = forward  # told (bytes, ns) of each sample

    def add(self, nbytes: int, ns: int, at_s: float | None = None) -> None:
        if nbytes < 0 or ns < 0:
            raise ValueError(f"a timing sample needs bytes >= 0 and ns >= 0, got {nbytes} bytes in {ns} ns")
        with self._lock:
            self._samples.append(Sample(int(nbytes), int(ns), time.time() if at_s is None else at_s))
            self.total += 1
        if self._forward is not None:
            self._forward(int(nbytes), int(ns))

    def estimate(self, now_s: float | None = None, window_s: float = WINDOW_S) -> Estimate | None:
        with self._lock:
            samples = list(self._samples)
        return estimate(samples, time.time() if now_s is None else now_s, window_s)


class LiveBandwidths:
    """Both links' samples, and where this engine's samples come from (set by whoever feeds them)."""

    def __init__(self, keep: int = KEEP) -> None:
        self.pcie_fill = LinkTimings(keep, lambda nbytes, ns: self._tell("pcie_fill", nbytes, ns))
        self.cpu_expert = LinkTimings(keep, lambda nbytes, ns: self._tell("cpu_expert", nbytes, ns))
        self.sources = {link: "nothing timed on this path" for link in LINKS}
        self.listener: Callable[[str, int, int], None] | None = None  # told (link, bytes, ns) of each sample

    def _tell(self, link: str, nbytes: int, ns: int) -> None:
        if self.listener is not None:
            self.listener(link, nbytes, ns)

    def status(self, now_s: float | None = None) -> dict:
        """{link: {"bytes_per_s", "samples", "window_s"} or None, "samples_total", "source"} per link."""
        now_s = time.time() if now_s is None else now_s
        out = {}
        for link in LINKS:
            timings: LinkTimings = getattr(self, link)
            found = timings.estimate(now_s)
            out[link] = {"estimate": None if found is None else found.as_dict(), "samples_total": timings.total,
                         "source": self.sources[link]}
        return out


def link_gauges(live: dict, profile: dict | None) -> list[tuple[dict, float | None]]:
    """One labelled gauge's series, {"link", "figure": live | profile} -> bytes/s, from a
    `LiveBandwidths.status()` and the profile's figures ({"pcie_fill_bytes_per_s", ...} or None);
    a figure that is not there is None (left out of /metrics)."""
    series = []
    for link in LINKS:
        found = live[link]["estimate"]
        series.append(({"link": link, "figure": "live"}, None if found is None else found["bytes_per_s"]))
        figure = None if profile is None else profile[f"{link}_bytes_per_s"]
        series.append(({"link": link, "figure": "profile"}, figure))
    return series
