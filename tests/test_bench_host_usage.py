"""The host figures bench reports carry: checkpoint sizes on disk and the process's peak RSS."""

from __future__ import annotations

import pytest

from freetoken.bench.host_usage import checkpoint_bytes, peak_rss_bytes


def test_checkpoint_bytes_of_a_directory_counts_every_file(tmp_path):
    (tmp_path / "config.json").write_bytes(b"x" * 10)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.safetensors").write_bytes(b"y" * 1000)
    assert checkpoint_bytes(tmp_path) == 1010


def test_checkpoint_bytes_of_a_split_gguf_sums_its_parts(tmp_path):
    for i, size in enumerate((300, 200, 50), start=1):
        (tmp_path / f"m-{i:05d}-of-00003.gguf").write_bytes(b"z" * size)
    (tmp_path / "other.gguf").write_bytes(b"w" * 7)
    assert checkpoint_bytes(tmp_path / "m-00001-of-00003.gguf") == 550
    assert checkpoint_bytes(tmp_path / "other.gguf") == 7


def test_checkpoint_bytes_of_a_split_gguf_with_a_part_missing_fails(tmp_path):
    (tmp_path / "m-00001-of-00002.gguf").write_bytes(b"z")
    with pytest.raises(FileNotFoundError):
        checkpoint_bytes(tmp_path / "m-00001-of-00002.gguf")


def test_peak_rss_grows_with_an_allocation():
    before = peak_rss_bytes()
    block = bytearray(64 << 20)
    block[:: 4096] = b"\x01" * len(block[:: 4096])  # touch every page so it is resident
    assert peak_rss_bytes() >= before
    assert peak_rss_bytes() > 64 << 20
