"""A `freetoken serve` subprocess for the HTTP benchmarks (fuzz.py, soak.py): started on a free
port, awaited until /health answers, its resident memory read from /proc, stopped with SIGTERM.

    with ServerProcess(["--model", "demo"]) as server:
        httpx.get(server.url + "/health"); server.rss_bytes(); server.alive()
"""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine() -> dict[str, Any]:
    """The machine a result came from, and the commit it ran."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(), "commit": commit}


class ServerProcess:
    """`python -m freetoken serve ARGS --port P` as a child process (see the module doc)."""

    def __init__(self, args: list[str], *, startup_timeout_s: float = 300.0, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "freetoken", "serve", *args, "--port", str(self.port)]
        self._startup_timeout_s = startup_timeout_s
        self._log = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (closed in stop)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + self._startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not answer /health within {self._startup_timeout_s} s")
            time.sleep(0.2)  # polling a child process's startup, not synchronising threads

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int:
        """The server's resident set size (VmRSS), in bytes."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def stop(self) -> int | None:
        """SIGTERM, then wait (SIGKILL after 30 s); the exit status."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return None if self.proc is None else self.proc.returncode
