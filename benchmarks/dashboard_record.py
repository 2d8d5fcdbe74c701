"""Record a running server's dashboard data to JSON lines, for a screenshot taken elsewhere.

    python benchmarks/dashboard_record.py --url http://127.0.0.1:8000 --seconds 40 --out run.jsonl

For a machine with no browser: while a load runs there, this polls `GET /v1/dashboard/snapshot`
(every `--poll` seconds) and follows the SSE stream `GET /v1/dashboard/events` for `--seconds`,
writing each answer as it came; `dashboard_screenshot.py --replay run.jsonl OUT.png` later serves
them to the packaged page in the same order and spacing. Needs only httpx and the standard library.

Lines (JSON, one object each):

    {"kind": "meta", "url": ..., "started": unix s, "seconds": ..., "poll_s": ..., "events_interval_s": ...,
     "command": [...]}
    {"kind": "snapshot" | "event", "t": seconds since the start, "data": the endpoint's JSON, unchanged}
    {"kind": "end", "t": ..., "snapshots": n, "events": n, "errors": [...]}
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx


def base_url(url: str) -> str:
    """The server's root from its URL or its dashboard's URL."""
    url = url.rstrip("/")
    return url[: -len("/dashboard")] if url.endswith("/dashboard") else url


class _Writer:
    """One JSON line at a time from several threads, stamped with the seconds since `start`."""

    def __init__(self, out, start: float) -> None:
        self.out, self.start, self.lock = out, start, threading.Lock()
        self.counts = {"snapshot": 0, "event": 0}

    def write(self, kind: str, data) -> None:
        line = json.dumps({"kind": kind, "t": round(time.monotonic() - self.start, 4), "data": data})
        with self.lock:
            self.out.write(line + "\n")
            self.out.flush()
            self.counts[kind] += 1


def _poll_snapshots(client: httpx.Client, writer: _Writer, stop: threading.Event, poll_s: float,
                    errors: list[str]) -> None:
    while not stop.is_set():
        try:
            response = client.get("/v1/dashboard/snapshot")
            response.raise_for_status()
            writer.write("snapshot", response.json())
        except httpx.HTTPError as exc:
            errors.append(f"snapshot: {type(exc).__name__}: {exc}")
        stop.wait(poll_s)  # the recording's own pace, not a synchronisation


def _follow_events(client: httpx.Client, writer: _Writer, stop: threading.Event, interval_s: float,
                   errors: list[str]) -> None:
    """The SSE stream's `data:` payloads, one event per blank-line-ended block."""
    while not stop.is_set():
        try:
            with client.stream("GET", "/v1/dashboard/events", params={"interval": interval_s},
                               timeout=httpx.Timeout(10.0, read=max(30.0, 5 * interval_s))) as response:
                response.raise_for_status()
                data: list[str] = []
                for line in response.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: "):
                        data.append(line[len("data: "):])
                    elif not line and data:
                        writer.write("event", json.loads("\n".join(data)))
                        data = []
        except httpx.HTTPError as exc:
            errors.append(f"events: {type(exc).__name__}: {exc}")
            stop.wait(1.0)  # a dropped stream is reconnected, as the page does


def record(url: str, seconds: float, out: Path, *, api_key: str | None = None, poll_s: float = 0.5,
           events_interval_s: float = 0.5, command: list[str] | None = None) -> dict:
    """Record for `seconds` into `out` (see the module doc); returns the end line's counts."""
    root = base_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    errors: list[str] = []
    stop = threading.Event()
    with open(out, "w") as f, httpx.Client(base_url=root, headers=headers, timeout=10.0) as snaps, \
            httpx.Client(base_url=root, headers=headers) as events:
        f.write(json.dumps({"kind": "meta", "url": root, "started": time.time(), "seconds": seconds,
                            "poll_s": poll_s, "events_interval_s": events_interval_s,
                            "command": command or sys.argv}) + "\n")
        writer = _Writer(f, time.monotonic())
        threads = [threading.Thread(target=_poll_snapshots, args=(snaps, writer, stop, poll_s, errors), daemon=True),
                   threading.Thread(target=_follow_events, args=(events, writer, stop, events_interval_s, errors),
                                    daemon=True)]
        for thread in threads:
            thread.start()
        stop.wait(seconds)
        stop.set()
        for thread in threads:
            thread.join(max(10.0, 3 * events_interval_s))
        end = {"kind": "end", "t": round(time.monotonic() - writer.start, 4), "snapshots": writer.counts["snapshot"],
               "events": writer.counts["event"], "errors": errors}
        with writer.lock:
            f.write(json.dumps(end) + "\n")
    if not end["events"]:
        raise RuntimeError(f"no dashboard event was recorded from {root} in {seconds} s: {errors[-3:]}")
    return end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server (or its dashboard) URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--seconds", type=float, required=True, help="how long to record")
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    parser.add_argument("--api-key", help="the server's API key, if it has one")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between snapshot requests")
    parser.add_argument("--events-interval", type=float, default=0.5, help="the SSE stream's interval, seconds")
    args = parser.parse_args()
    end = record(args.url, args.seconds, args.out, api_key=args.api_key, poll_s=args.poll,
                 events_interval_s=args.events_interval)
    print(f"wrote {args.out}: {end['snapshots']} snapshots, {end['events']} events, {len(end['errors'])} errors")


if __name__ == "__main__":
    main()
