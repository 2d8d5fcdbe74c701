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
