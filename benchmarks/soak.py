"""The soak: C concurrent streaming clients against a real `freetoken serve` subprocess on the
demo model for N minutes; 10% of the streams are abandoned mid-stream (the client closes the
connection after a few events). The server's resident memory is sampled throughout.

    python -m benchmarks.soak --minutes 10 --streams 64 --out benchmarks/results/soak-cpu.json \\
        [--abandon 0.1] [--warmup-fraction 0.2] [-- SERVE ARGS...]
        (default serve args: --model demo --max-model-len 512 --max-running-requests 64)

A stream fails if it is not a 200, ends other than its API says ([DONE], message_stop), carries
an error event, or the connection breaks (abandoned ones excepted). Writes JSON: streams done,
abandoned and failed (first failures quoted), RSS at the end of warm-up and at the end, its
growth in percent, the samples, the command and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import httpx

from benchmarks.server_process import ServerProcess, machine

MODEL = "demo"
# Every stream admitted at once (batched decode), rather than queued behind the default 4.
SERVE_ARGS = ["--model", MODEL, "--max-model-len", "512", "--max-running-requests", "64"]
RSS_EVERY_S = 5.0
QUOTED_FAILURES = 20
_WORDS = "the a cache expert token stream model layer route slot page prefix decode prompt".split()


def _request(rng: random.Random) -> tuple[str, dict]:
    content = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))
    max_tokens = rng.randint(8, 48)
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                        "max_tokens": max_tokens, "stream": True, "temperature": 0.8,
                                        "seed": rng.randrange(1 << 31)}
    return "/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "stream": True, "temperature": 0.8}


def _stream_failure(path: str, events: list[str]) -> str | None:
    for e in events:
        if e != "[DONE]":
            try:
                json.loads(e)
            except ValueError:
                return f"an event that is not JSON: {e[:200]!r}"
    if path.startswith("/v1/chat"):
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        ended = bool(events) and events[-1] == "[DONE]"
    else:
        errors = [e for e in events if json.loads(e).get("type") == "error"]
        ended = bool(events) and json.loads(events[-1]).get("type") == "message_stop"
    if errors:
        return f"error event: {errors[0][:200]}"
    return None if ended else f"stream ended with {(events or [''])[-1][:200]!r}"


class Tally:
    def __init__(self) -> None:
        self.done = self.abandoned = 0
        self.failures: list[str] = []


async def _client(http: httpx.AsyncClient, rng: random.Random, abandon: float, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        path, body = _request(rng)
        leave_after = rng.randint(1, 6) if rng.random() < abandon else None
        events: list[str] = []
        try:
            async with http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    tally.failures.append(f"{path}: HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                    continue
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: "):])
                        if leave_after is not None and len(events) >= leave_after:
                            break
        except httpx.HTTPError as exc:
            tally.failures.append(f"{path}: {type(exc).__name__}: {exc}")
            continue
        if leave_after is not None and len(events) >= leave_after:
            tally.abandoned += 1
        elif (failure := _stream_failure(path, events)) is not None:
            tally.failures.append(f"{path}: {failure}")
        else:
            tally.done += 1


async def soak(server: ServerProcess, minutes: float, streams: int, abandon: float, seed: int) -> dict:
    started = time.monotonic()
    until = started + minutes * 60
    tally = Tally()
    samples: list[tuple[float, int]] = []
    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as http:
        clients = [asyncio.create_task(_client(http, random.Random(seed * 1000 + i), abandon, until, tally))
                   for i in range(streams)]
        while not all(c.done() for c in clients):
            samples.append((round(time.monotonic() - started, 1), server.rss_bytes()))
            await asyncio.wait(clients, timeout=RSS_EVERY_S)
        for c in clients:
            c.result()
    samples.append((round(time.monotonic() - started, 1), server.rss_bytes()))
    return {"done": tally.done, "abandoned": tally.abandoned, "failures": len(tally.failures),
            "first_failures": tally.failures[:QUOTED_FAILURES], "rss_samples": samples,
            "seconds": round(time.monotonic() - started, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--abandon", type=float, default=0.1, help="the share of streams closed mid-stream")
    parser.add_argument("--warmup-fraction", type=float, default=0.2,
                        help="RSS growth is measured from the first sample after this share of the run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the JSON result file")
    parser.add_argument("serve_args", nargs="*", default=SERVE_ARGS, help="after --: `serve` arguments")
    args = parser.parse_args(argv)
    where = machine()  # before the run: the commit the server starts from
    with ServerProcess(args.serve_args) as server:
        result = asyncio.run(soak(server, args.minutes, args.streams, args.abandon, args.seed))
        alive = server.alive()
        exit_status = server.stop()
    warm_from = args.minutes * 60 * args.warmup_fraction
    warm = next(rss for t, rss in result["rss_samples"] if t >= warm_from)
    end = result["rss_samples"][-1][1]
    report = {"command": "python -m benchmarks.soak " + " ".join(sys.argv[1:]), "serve": server.command[1:],
              "machine": where, "streams": args.streams, "minutes": args.minutes, "abandon": args.abandon,
              "server_alive_at_end": alive, "server_exit_status": exit_status,
              "rss_warm_bytes": warm, "rss_end_bytes": end, "rss_growth_pct": round((end - warm) / warm * 100, 2),
              **result}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("done", "abandoned", "failures", "rss_warm_bytes", "rss_end_bytes",
                                             "rss_growth_pct")}))
    return 0 if report["failures"] == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
