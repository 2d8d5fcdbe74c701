"""A child process's JSON-line records, taken as it prints them, under a hard timeout (the
contention run's children, benchmarks/cpu_interference.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

CHILD_CWD = Path(__file__).resolve().parents[1]  # the repository root: children run as `-m benchmarks.<name>`


def json_line_records(cmd: list[str], timeout: float, env: dict, on_record: Callable[[dict], None] | None,
                      failed_record: dict) -> list[dict]:
    """The JSON lines `cmd` prints, taken as they come: a record reaches `on_record` (which writes
    the report) when the child prints it, so a child killed here, or a run killed from outside,
    keeps every record printed before. A child that fails or outlives `timeout` adds
    `failed_record` with the reason (its stderr's tail)."""
    records: list[dict] = []

    def keep(record: dict) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    with tempfile.TemporaryFile(mode="w+") as stderr, subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=CHILD_CWD, env=env
    ) as proc:
        timed_out = threading.Event()  # (a child the kernel kills, out of memory, is not a timeout)

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            for line in proc.stdout:
                if line.startswith("{"):
                    keep(json.loads(line))
            proc.wait()
        finally:
            timer.cancel()
        stderr.seek(0)
        tail = stderr.read()[-2000:]
    if timed_out.is_set():
        keep({**failed_record, "failed": f"timeout: killed after {timeout} s", "stderr": tail})
    elif proc.returncode:
        keep({**failed_record, "failed": f"exit {proc.returncode}: {tail}"})
    return records
