"""Serve a recorded dashboard run (benchmarks/dashboard_record.py) to the packaged page, locally.

    with ReplayServer(load_recording(Path("run.jsonl")), speed=10) as server:
        ...open server.url + "/dashboard" in a browser...; server.events_sent

The page's files are the package's own (freetoken/server/dashboard_page/, served with the same
headers as `serve` does), unchanged. The endpoints are the page's: `GET /v1/dashboard/events`
sends the recorded events in recorded order and spacing (divided by `speed`) from the moment the
page connects, then holds the stream open (so the page stays on the last one); `GET
/v1/dashboard/snapshot` answers the recorded snapshot current at that moment of the replay.
Anything else is a 404.
"""

from __future__ import annotations

import gzip
import json
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from freetoken.server import dashboard


@dataclass
class Recording:
    meta: dict
    snapshots: list[tuple[float, dict]] = field(default_factory=list)  # (seconds since the start, JSON)
    events: list[tuple[float, dict]] = field(default_factory=list)


def load_recording(path: Path) -> Recording:
    """The recording in `path` (`.jsonl`, or gzipped `.jsonl.gz` as committed results keep them),
    its lines in time order; ValueError for a file that is not one."""
    raw = Path(path).read_bytes()
    text = (gzip.decompress(raw) if str(path).endswith(".gz") else raw).decode()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not lines or lines[0].get("kind") != "meta":
        raise ValueError(f"{path}: not a dashboard recording (its first line is not the meta line)")
    recording = Recording(lines[0])
    for line in lines[1:]:
        if line.get("kind") in ("snapshot", "event"):
            (recording.snapshots if line["kind"] == "snapshot" else recording.events).append((line["t"], line["data"]))
    recording.snapshots.sort(key=lambda item: item[0])
    recording.events.sort(key=lambda item: item[0])
    if not recording.events:
        raise ValueError(f"{path}: the recording holds no dashboard event to replay")
    return recording


class ReplayServer:
    """The replay on 127.0.0.1 (a free port), in a thread, while the block runs."""

    def __init__(self, recording: Recording, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        self.recording, self.speed = recording, speed
        self.events_sent = 0  # by the last events stream opened
        self._started = time.monotonic()
        self._closing = threading.Event()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._http.shutdown()
        self._http.server_close()

    def snapshot_now(self) -> dict:
        """The last recorded snapshot at the replay's present (the first before any)."""
        now = (time.monotonic() - self._started) * self.speed
        current = self.recording.snapshots[0][1] if self.recording.snapshots else self.recording.events[0][1]
        for t, data in self.recording.snapshots:
            if t > now:
                break
            current = data
        return current

    def _handler(self):
        replay = self
        pages = {dashboard.PAGE_PATH: "index.html", **{f"{dashboard.PAGE_PATH}/{n}": n for n in dashboard.ASSETS}}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet: a screenshot run prints its own lines
                pass

            def _send(self, body: bytes, media_type: str, headers: dict | None = None) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", media_type)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                path = self.path.split("?", 1)[0]
                if path in pages:
                    name = pages[path]
                    self._send(dashboard.asset(name), dashboard.ASSETS[name], dashboard.ASSET_HEADERS)
                elif path == "/v1/dashboard/snapshot":
                    self._send(json.dumps(replay.snapshot_now()).encode(), "application/json")
                elif path == "/v1/dashboard/events":
                    self._events()
                else:
                    self.send_error(HTTPStatus.NOT_FOUND, "not part of a dashboard replay")

            def _events(self) -> None:
                self.send_response(HTTPStatus.OK)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                start, first = time.monotonic(), replay.recording.events[0][0]
                replay.events_sent = 0
                try:
                    for t, data in replay.recording.events:
                        # the recorded spacing, sped up: the replay's pace, not a synchronisation
                        if replay._closing.wait(max(0.0, start + (t - first) / replay.speed - time.monotonic())):
                            return
                        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
                        self.wfile.flush()
                        replay.events_sent += 1
                    replay._closing.wait()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the page went away

        return Handler
