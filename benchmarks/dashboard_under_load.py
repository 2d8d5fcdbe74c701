"""One command for a dashboard recording under load: serve a model, stream requests at it, record.

    python benchmarks/dashboard_under_load.py --model DIR --out DIR [--seconds 40] [--streams 4] [serve flags...]

Starts `python -m freetoken serve --model DIR [serve flags...]` on a free port, records its
dashboard data with benchmarks/dashboard_record.py for `--seconds` while `--streams` clients each
send streamed completions one after another (the load starts `--lead` seconds into the
recording, so the picture shows it arrive), then stops the server. Writes into --out:
`dashboard.jsonl` (the recording, for `dashboard_screenshot.py --replay`), `server.log`, and
`run.json` (the command, the machine and commit, the requests the clients completed). Needs only
httpx and the standard library besides freetoken, so it runs on a machine with no browser.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.dashboard_record import record  # noqa: E402
from benchmarks.server_process import ServerProcess, machine  # noqa: E402

PROMPT = "Explain, step by step, how a cache of experts that follows the router decides what to keep:"


class Load:
    """`streams` threads, each streaming one completion after another until `stop` is set."""

    def __init__(self, url: str, model: str, streams: int, max_tokens: int) -> None:
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.completed, self.chunks, self.errors = 0, 0, []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(streams)]

    def _client(self, index: int) -> None:
        body = {"model": self.model, "prompt": f"{PROMPT} ({index})", "max_tokens": self.max_tokens,
                "temperature": 0.7, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=httpx.Timeout(30.0, read=300.0)) as client:
            while not self.stop.is_set():
                try:
                    chunks, failure = 0, None
                    with client.stream("POST", "/v1/completions", json=body) as response:
                        response.raise_for_status()
                        for line in response.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            event = json.loads(line[len("data: "):])
                            if "error" in event:  # after the headers went out, errors travel in the stream
                                failure = f"stream error: {event['error'].get('message', event['error'])}"[:300]
                            else:
                                chunks += 1
                    with self.lock:
                        if failure is None:
                            self.completed += 1
                        else:
                            self.errors.append(failure)
                        self.chunks += chunks
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                    self.stop.wait(1.0)  # a failing server is not hammered

    def start_after(self, seconds: float) -> None:
        def later() -> None:
            if not self.stop.wait(seconds):
                for thread in self.threads:
                    thread.start()

        threading.Thread(target=later, daemon=True).start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            if thread.is_alive():
                thread.join(300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint directory, GGUF file, or demo")
    parser.add_argument("--out", type=Path, required=True, help="the directory to write into")
    parser.add_argument("--seconds", type=float, default=40.0, help="how long to record")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streaming clients")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per completion")
    parser.add_argument("--lead", type=float, default=3.0, help="seconds of recording before the load starts")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds the server may take to start")
    args, serve_flags = parser.parse_known_args()
    if args.streams < 1 or args.seconds <= args.lead:
        parser.error("--streams must be >= 1 and --seconds longer than --lead")
    args.out.mkdir(parents=True, exist_ok=True)
    recording = args.out / "dashboard.jsonl"
    with ServerProcess(["--model", args.model, *serve_flags], startup_timeout_s=args.startup_timeout,
                       log=args.out / "server.log") as server:
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        load = Load(server.url, model, args.streams, args.max_tokens)
        load.start_after(args.lead)
        try:
            end = record(server.url, args.seconds, recording, command=sys.argv)
        finally:
            load.finish()
        served = server.command
    run = {"command": [sys.executable, *sys.argv], "serve": served, "machine": machine(), "seconds": args.seconds,
           "streams": args.streams, "max_tokens": args.max_tokens, "requests_completed": load.completed,
           "stream_chunks": load.chunks, "client_errors": load.errors[:20], "recording": end}
    (args.out / "run.json").write_text(json.dumps(run, indent=2) + "\n")
    print(f"wrote {recording} ({end['events']} events, {end['snapshots']} snapshots); "
          f"{load.completed} requests completed, {len(load.errors)} client errors")
    if not load.completed:
        raise SystemExit("no request completed under load: see server.log")


if __name__ == "__main__":
    main()
