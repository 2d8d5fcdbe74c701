"""The second start on a machine: every process after the first loads the CPU kernels from
Numba's on-disk cache (the starts that crashed with a segmentation fault in the CPU executor's
first kernel call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from freetoken.loader.synth import write_synthetic_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-m", "freetoken", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}: {proc.stderr[-4000:]}"
    return proc


def _generate_hybrid(model_dir: Path, cache_dir: Path, profile: Path | None = None) -> list[int]:
    args = ["generate", "--model", str(model_dir), "--prompt", "the second start", "--max-tokens", "12",
            "--ignore-eos", "--moe-policy", "hybrid", "--moe-cache-rate", "0.3", "--json"]
    if profile is not None:
        args += ["--bw-profile", str(profile)]
    return json.loads(_run(args, cache_dir).stdout)["token_ids"]


def test_generate_hybrid_twice_in_a_row(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=3)
    first = _generate_hybrid(model_dir, tmp_path / "numba")
    assert _generate_hybrid(model_dir, tmp_path / "numba") == first


def test_bench_bw_then_generate(tmp_path):
    model_dir = write_synthetic_checkpoint(tmp_path / "m", "qwen3_moe", "tiny", seed=3)
    profile = tmp_path / "profile.json"
    _run(["bench", "bw", "--experts", "16", "--repeats", "3", "--read-mib", "64", "--out", str(profile)],
         tmp_path / "numba")
    assert len(_generate_hybrid(model_dir, tmp_path / "numba", profile)) == 12
