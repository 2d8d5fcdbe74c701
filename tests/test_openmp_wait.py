"""The OpenMP wait policy freetoken sets for the runtime torch and Numba share (freetoken/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os, freetoken; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _env_after_import(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", SHOW], env={**clean, **env}, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "None PASSIVE"),  # idle threads sleep by default
    ({"GOMP_SPINCOUNT": "77"}, "77 None"),  # the user's spin count stays
    ({"OMP_WAIT_POLICY": "ACTIVE"}, "None ACTIVE"),  # and so does the user's wait policy
])
def test_importing_freetoken_makes_idle_openmp_threads_sleep_unless_the_user_chose(env, expected):
    assert _env_after_import(**env) == expected
