"""The HTTP fuzz at scale: N requests (tests/reliability/http_cases.py's, seeded) against a real
`freetoken serve` subprocess on the demo model. Every answer is checked as in the CI fuzz (no
5xx, errors in the path's API shape, streams that end properly); unlike the test it does not
stop at the first problem but counts them all, then checks the server is alive and still serves.

    python -m benchmarks.fuzz --requests 2000 --out benchmarks/results/fuzz-cpu.json [--seed 0] \\
        [-- SERVE ARGS...]   (default serve args: --model demo --max-model-len 512)

Writes JSON: counts by status, 5xx count, problems (first ones quoted), requests with no answer
(the connection failed or timed out), crashes (a dead server), the command and the machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

import httpx
from hypothesis import HealthCheck, given, seed, settings

from benchmarks.server_process import ServerProcess, machine
from tests.reliability.http_cases import Case, http_cases, problems

MODEL = "demo"
# A short context bounds a fuzzed request that drops max_tokens (it then runs to the context's end).
SERVE_ARGS = ["--model", MODEL, "--max-model-len", "512"]
QUOTED_PROBLEMS = 20


def run(server: ServerProcess, requests: int, fuzz_seed: int) -> dict:
    statuses: collections.Counter[str] = collections.Counter()
    found: list[str] = []
    transport_errors: list[str] = []
    # Generous: a fuzzed request without max_tokens runs to the end of the context, slowly on a busy machine.
    with httpx.Client(base_url=server.url, timeout=600) as http:

        @seed(fuzz_seed)
        @settings(max_examples=requests, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=http_cases(MODEL))
        def one(case: Case) -> None:
            try:
                response = case.send(http)
            except httpx.TransportError as exc:
                transport_errors.append(f"{case!r}: {type(exc).__name__}: {exc}")
                statuses["no answer"] += 1
                return
            statuses[str(response.status_code)] += 1
            found.extend(f"{case!r}: {p}" for p in problems(case, response))

        started = time.perf_counter()
        one()
        elapsed = time.perf_counter() - started
        after = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    return {
        "requests": sum(statuses.values()),
        "by_status": dict(sorted(statuses.items())),
        "status_5xx": sum(n for s, n in statuses.items() if s.isdigit() and int(s) >= 500),
        "problems": len(found),
        "first_problems": found[:QUOTED_PROBLEMS],
        "no_answer": len(transport_errors),  # the connection failed or timed out
        "first_transport_errors": transport_errors[:QUOTED_PROBLEMS],
        "crashes": 0 if server.alive() else 1,
        "server_alive_after": server.alive(),
        "valid_request_after": after.status_code,
        "seconds": round(elapsed, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="the JSON result file")
    parser.add_argument("serve_args", nargs="*", default=SERVE_ARGS, help="after --: `serve` arguments")
    args = parser.parse_args(argv)
    where = machine()  # before the run: the commit the server starts from
    with ServerProcess(args.serve_args) as server:
        result = run(server, args.requests, args.seed)
        exit_status = server.stop()
    report = {"command": "python -m benchmarks.fuzz " + " ".join(sys.argv[1:]), "serve": server.command[1:],
              "machine": where, "server_exit_status": exit_status, **result}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    summary = ("requests", "by_status", "status_5xx", "problems", "no_answer", "crashes")
    print(json.dumps({k: report[k] for k in summary}))
    clean = not (result["status_5xx"] or result["problems"] or result["no_answer"] or result["crashes"])
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
