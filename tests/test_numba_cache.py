"""drop_stale_cache: a module's Numba cache files go when a module it calls changed."""

from __future__ import annotations

from freetoken.kernels.cpu.numba_cache import drop_stale_cache


def test_cache_files_go_when_a_dependency_changes(tmp_path, monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    module, dep = tmp_path / "poller.py", tmp_path / "helpers.py"
    module.write_text("# uses helpers\n")
    dep.write_text("CONSTANT = 1\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()

    def cached_files():
        for name in ("poller.serve-10.py311.nbi", "poller.serve-10.py311.1.nbc"):
            (cache / name).write_bytes(b"compiled")
        (cache / "other.serve-3.py311.nbi").write_bytes(b"another module's")

    cached_files()
    drop_stale_cache(str(module), [str(dep)])  # no digest recorded yet: not to be trusted
    assert sorted(p.name for p in cache.iterdir()) == ["other.serve-3.py311.nbi", "poller.deps"]
    cached_files()
    drop_stale_cache(str(module), [str(dep)])  # same sources: the cache stays
    assert (cache / "poller.serve-10.py311.nbi").exists()
    dep.write_text("CONSTANT = 2\n")
    drop_stale_cache(str(module), [str(dep)])
    assert not (cache / "poller.serve-10.py311.nbi").exists() and not (cache / "poller.serve-10.py311.1.nbc").exists()
    assert (cache / "other.serve-3.py311.nbi").exists()


def _names_used(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def test_no_compiled_function_calls_a_cached_one():
    """A cached compiled function called from compiled code loads its own cache entry apart from
    its caller's; written by different processes, the two crashed the second process to start
    (numba/numba#8578). Only functions called from Python may be cached."""
    import importlib
    import pkgutil

    from numba.core.registry import CPUDispatcher

    import freetoken.kernels.cpu as cpu_package
    from tests.cached_kernels_run import cached_dispatchers

    cached = set(map(id, cached_dispatchers().values()))
    assert cached, "expected cached compiled functions in freetoken.kernels.cpu"
    offenders = []
    for info in pkgutil.iter_modules(cpu_package.__path__):
        module = importlib.import_module(f"{cpu_package.__name__}.{info.name}")
        for name, fn in vars(module).items():
            if not isinstance(fn, CPUDispatcher) or fn.__module__ != module.__name__:
                continue
            for used in _names_used(fn.py_func.__code__):
                if id(fn.py_func.__globals__.get(used)) in cached:
                    offenders.append(f"{module.__name__}.{name} calls cached {used}")
    assert not offenders, offenders


def test_every_cached_function_runs_from_two_fresh_processes(tmp_path):
    """Two processes in turn on one cache directory, each calling every cached compiled function
    and checking its result: the first compiles and writes the cache, the second loads every
    function from it (the start that crashed)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    turns = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-m", "tests.cached_kernels_run"], cwd=root, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        turns.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    first, second = turns
    assert first.keys() == second.keys() and first
    for name in first:
        assert first[name]["hits"] + first[name]["misses"] > 0, f"{name} was not called"
        assert second[name]["hits"] > 0 and second[name]["misses"] == 0, f"{name}: {second[name]} (not from the cache)"
