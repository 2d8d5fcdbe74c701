"""Bandwidth profiles per expert format: the profile key both sides use, `bench bw --format` on
random block and MXFP4 banks, hybrid's split from the pool's format's profile, and the decode floor's bytes."""

from __future__ import annotations

import argparse
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from freetoken.bench.bw import add_bench_bw_arguments, format_keys, run_bench_bw
from freetoken.bench.bw_banks import random_banks
from freetoken.bench.decode import layer_read_bytes
from freetoken.kernels.cpu.cpu_kernel import kernel_for
from freetoken.moe.bandwidth_profile import DEFAULT_CPU_BPS, DEFAULT_PCIE_BPS, load_ratio, save_profile
from freetoken.moe.block_format import BlockQuantFormat
from freetoken.moe.expert_format import BF16, FLOAT32
from freetoken.moe.factory import split_ratio
from freetoken.moe.mxfp4_format import Mxfp4ExpertFormat
from freetoken.moe.policy import make_policy
from freetoken.moe.profile_key import canonical_key, pair_key, parse_profile_key, profile_key
from freetoken.quant.ggml_blocks import GGMLType, dequantize
from freetoken.quant.random_blocks import random_rows
from freetoken.reference.expert_cache import pcie_share
from tests.mxfp4_banks import error_bound, twin

Q8_0, Q4_K, Q5_K, Q6_K = GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K


def _blocks(*layer_types) -> BlockQuantFormat:
    return BlockQuantFormat(tuple(layer_types), hidden=256, inter=256)


def test_profile_keys_name_uniform_types_file_mixes_and_other_pairs():
    assert profile_key(BF16) == "bf16"
    assert profile_key(FLOAT32) == "fp32"
    assert profile_key(_blocks((Q8_0, Q8_0), (Q8_0, Q8_0))) == "Q8_0"
    assert profile_key(_blocks((Q6_K, Q6_K))) == "Q6_K"
    # A Q4_K_M file: Q4_K down projections in some layers, Q6_K in others -> the file's mix.
    assert profile_key(_blocks((Q4_K, Q4_K), (Q4_K, Q6_K), (Q4_K, Q4_K))) == "Q4_K_M"
    assert profile_key(_blocks((Q5_K, Q6_K), (Q5_K, Q5_K))) == "Q5_K_M"
    # the widest type of each bank, whatever layer it comes from
    assert profile_key(_blocks((Q8_0, Q4_K), (Q4_K, Q6_K))) == "Q8_0/Q6_K"
    assert profile_key(Mxfp4ExpertFormat(64, 64, torch.bfloat16)) == "mxfp4+bias"


def test_the_mxfp4_key_is_read_in_any_case_and_saved_as_the_format_names_it():
    assert canonical_key(" MXFP4+Bias ") == "mxfp4+bias"
    assert format_keys(["MXFP4+BIAS,bf16", "mxfp4+bias"]) == ["mxfp4+bias", "bf16"]
    with pytest.raises(ValueError, match="not a pair of GGML block types"):
        parse_profile_key("mxfp4+bias")


@pytest.mark.parametrize("text", ["bf16", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M", "Q5_K_M", "Q8_0/Q6_K"])
def test_every_key_parses_back_to_itself(text):
    pair = parse_profile_key(text)
    assert (pair_key(*pair) if pair else "bf16") == text
    assert canonical_key(text.lower()) == text


@pytest.mark.parametrize("text", ["Q3_K", "fp32", "bf16/Q4_K", "Q4_K/Q6_K/Q8_0", "F16", ""])
def test_a_format_the_bench_cannot_measure_is_refused_by_name(text):
    with pytest.raises(ValueError, match="accepted: bf16, Q8_0, Q4_K, Q5_K, Q6_K, Q4_K_M, Q5_K_M"):
        parse_profile_key(text)


def test_format_flag_takes_repeats_and_comma_lists_once_each():
    assert format_keys(None) == ["bf16"]
    assert format_keys(["q4_k_m,Q8_0", "bf16", "Q4_K_M"]) == ["Q4_K_M", "Q8_0", "bf16"]
    with pytest.raises(ValueError, match="'Q2_K'"):
        format_keys(["Q8_0,Q2_K"])


@pytest.mark.parametrize("qtype", [Q8_0, Q4_K, Q5_K, Q6_K])
def test_random_block_rows_dequantize_to_modest_finite_values(qtype):
    rows = random_rows(qtype, 3, 512, np.random.default_rng(0)).reshape(3, -1)
    values = dequantize(qtype, rows, 512)
    assert values.shape == (3, 512) and np.isfinite(values).all() and np.abs(values).max() < 100


def _bench(tmp_path, *flags) -> tuple[int, object]:
    path = tmp_path / "profiles.json"
    parser = argparse.ArgumentParser()
    add_bench_bw_arguments(parser)
    args = parser.parse_args(["--hidden", "256", "--intermediate", "256", "--top-k", "2", "--experts", "4",
                              "--repeats", "2", "--read-mib", "1", "--threads", "1", "--out", str(path), *flags])
    return run_bench_bw(args), path


def test_bench_bw_measures_each_format_under_its_key(tmp_path):
    rc, path = _bench(tmp_path, "--format", "Q4_K_M,Q8_0")
    assert rc == 0
    (gpu,) = json.loads(path.read_text()).keys()
    profiles = json.loads(path.read_text())[gpu]
    assert sorted(profiles) == ["Q4_K_M", "Q8_0"]
    H = I = 256
    # bank rows: gate + up Q4_K rows, down Q6_K rows (both whole multiples of 16 bytes here)
    assert profiles["Q4_K_M"]["shape"]["expert_bytes"] == 2 * I * (H // 256 * 144) + H * (I // 256 * 210)
    assert profiles["Q8_0"]["shape"]["expert_bytes"] == 3 * H * I // 32 * 34
    for key, prof in profiles.items():
        assert prof["expert_format"] == key and prof["cpu_expert_Bps"] > 0
        assert f"--format {key}" in prof["command"]
        _, cpu, source = load_ratio(path, gpu, key)
        cpu_measured = (prof["concurrent"] or {}).get("cpu_expert_Bps") or prof["cpu_expert_Bps"]
        assert cpu == cpu_measured and f"[{key}]" in source


def test_bench_bw_refuses_an_unknown_format_and_a_shape_the_format_cannot_hold(tmp_path, capsys):
    assert _bench(tmp_path, "--format", "Q3_K")[0] == 2
    assert "--format: unknown expert format 'Q3_K'" in capsys.readouterr().err
    parser = argparse.ArgumentParser()
    add_bench_bw_arguments(parser)
    args = parser.parse_args(["--hidden", "96", "--intermediate", "256", "--experts", "4", "--top-k", "2",
                              "--format", "Q4_K", "--out", str(tmp_path / "p.json")])
    assert run_bench_bw(args) == 2
    assert "bench bw --format Q4_K:" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_bench_bw_measures_mxfp4_experts_under_their_key(tmp_path):
    rc, path = _bench(tmp_path, "--format", "MXFP4+bias", "--hidden", "64", "--intermediate", "64")
    assert rc == 0
    (gpu,) = json.loads(path.read_text()).keys()
    prof = json.loads(path.read_text())[gpu]["mxfp4+bias"]
    assert prof["expert_format"] == "mxfp4+bias" and "--format mxfp4+bias" in prof["command"]
    fmt = Mxfp4ExpertFormat(64, 64, torch.bfloat16)  # bf16 biases, as the released checkpoints
    assert prof["shape"]["expert_bytes"] == fmt.slot_bytes(None, torch.bfloat16) == fmt.expert_bytes(None)
    assert prof["cpu_expert_Bps"] > 0
    pcie, cpu, source = load_ratio(path, gpu, "mxfp4+bias")
    cpu_measured = (prof["concurrent"] or {}).get("cpu_expert_Bps") or prof["cpu_expert_Bps"]
    assert cpu == cpu_measured and "[mxfp4+bias]" in source and not source.startswith("defaults")


def test_bench_mxfp4_banks_are_the_pools_rows_the_cpu_kernel_computes():
    H, I, E = 64, 96, 4
    banks = random_banks(np.random.default_rng(0), "mxfp4+bias", E, H, I, pinned=False)
    fmt = Mxfp4ExpertFormat(H, I, torch.bfloat16)
    assert [b.shape for b in (banks.w13, banks.w2)] == [(E, *bank.row_shape) for bank in fmt.banks(None)]
    assert banks.w13.dtype == banks.w2.dtype == np.uint8 and banks.w13_t is None
    assert banks.layout == fmt.cpu_layout(SimpleNamespace(num_experts=E))
    assert banks.w13[0].nbytes + banks.w2[0].nbytes == fmt.slot_bytes(None, torch.bfloat16)
    # the rows the format dequantizes are the rows the kernel reads (biases and all)
    x = np.random.default_rng(1).standard_normal((1, H)).astype(np.float32) * 20
    weights, ids = np.array([[0.5, 0.5]], np.float32), np.array([[1, 3]], np.int64)
    out = np.empty_like(x)
    kernel_for(banks.w13, banks.w2, banks.layout).run(x, weights, ids, out)
    want = twin(x, weights, ids, banks.w13, banks.w2, fmt)
    assert np.all(np.abs(out - want) <= error_bound(x, weights, ids, banks.w13, banks.w2, fmt))
    assert np.abs(want).max() > 0 and banks.w13[0, fmt.gate_up.bias_at:fmt.gate_up.end].any()  # bf16 biases


def test_bench_bw_refuses_mxfp4_experts_of_a_size_not_whole_blocks(tmp_path, capsys):
    rc, path = _bench(tmp_path, "--format", "mxfp4+bias", "--hidden", "80", "--intermediate", "64")
    assert rc == 2 and not path.exists()
    assert ("bench bw --format mxfp4+bias: mxfp4+bias experts are blocks of 32 values: --hidden and "
            "--intermediate must be multiples of 32, got 80 and 64") in capsys.readouterr().err
    with pytest.raises(ValueError, match="mxfp4\\+bias experts are blocks of 32"):
        random_banks(np.random.default_rng(0), "mxfp4+bias", 4, 64, 48, pinned=False)


def _profile(gpu: str, key: str, pcie: float, cpu: float) -> dict:
    return {"gpu": gpu, "expert_format": key, "pcie_fill_Bps": pcie, "cpu_expert_Bps": cpu, "concurrent": None,
            "date": "today"}


def test_hybrid_splits_by_the_pool_formats_profile(tmp_path):
    path = tmp_path / "profiles.json"
    save_profile(path, _profile("cpu", "bf16", 10e9, 10e9))
    save_profile(path, _profile("cpu", "Q4_K_M", 10e9, 30e9))
    ratio, source = split_ratio(make_policy("hybrid"), str(path), "cpu", "Q4_K_M")
    assert ratio == pcie_share(10e9, 30e9) and "[cpu][Q4_K_M]" in source
    assert split_ratio(make_policy("hybrid", {"ratio": "0.25"}), str(path), "cpu", "Q4_K_M") == (0.25,
                                                                                                "moe param ratio")
    assert split_ratio(make_policy("transfer"), str(path), "cpu", "Q4_K_M") == (None, "")


def test_a_missing_format_profile_warns_once_naming_the_command_and_uses_the_defaults(tmp_path, caplog):
    path = tmp_path / "profiles.json"
    save_profile(path, _profile("cpu", "bf16", 10e9, 10e9))  # another format's figures do not stand in
    with caplog.at_level(logging.WARNING, logger="freetoken.moe.bandwidth_profile"):
        ratio, source = split_ratio(make_policy("hybrid"), str(path), "cpu", "Q8_0")
    assert ratio == pcie_share(DEFAULT_PCIE_BPS, DEFAULT_CPU_BPS)
    assert source.startswith("defaults") and "no Q8_0 profile" in source and "has bf16 only" in source
    (record,) = caplog.records
    assert "\n" not in record.getMessage()
    assert "`python -m freetoken bench bw --format Q8_0`" in record.getMessage()


def test_the_decode_floor_counts_each_layers_own_rows_of_a_block_pool():
    class Config:
        num_layers = 2

    fmt = _blocks((Q4_K, Q4_K), (Q4_K, Q6_K))
    narrow, wide = 3 * 256 // 256 * 144 * 256, 2 * 256 * 144 + 256 * 210
    assert layer_read_bytes(fmt, Config, expert_bytes=wide) == [narrow, wide]
    assert layer_read_bytes(BF16, Config, expert_bytes=1234) == [1234, 1234]


def test_the_profile_keys_spell_the_block_formats_types():
    from freetoken.moe.block_format import BLOCK_QUANT_TYPES
    from freetoken.moe.profile_key import BLOCK_TYPE_NAMES

    assert set(BLOCK_TYPE_NAMES) == {t.name for t in BLOCK_QUANT_TYPES}
