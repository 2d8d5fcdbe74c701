"""The benchmark commands run end to end on a tiny checkpoint and write their JSON (no timing asserts)."""

from __future__ import annotations

import json
import re

import pytest

from freetoken.__main__ import main


def test_bench_decode_and_prefill_write_results(make_checkpoint, tmp_path):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    decode_out, prefill_out = tmp_path / "decode.json", tmp_path / "prefill.json"
    assert main(["bench", "decode", "--model", model, "--device", "cpu", "--moe-cache-slots", "12", "--moe-param",
                 "ratio=0.5", "--decode-tokens", "4", "--warmup-tokens", "2", "--cpu-threads", "1",
                 "--out", str(decode_out), "--trace", str(tmp_path / "trace.json"),
                 "--plot", str(tmp_path / "decode.png")]) == 0
    # one timeline per policy, named after it
    for policy in ("resident", "transfer", "cpu", "static", "hybrid"):
        assert json.loads((tmp_path / f"trace-{policy}.json").read_text())["traceEvents"]
    report = json.loads(decode_out.read_text())
    assert [r["policy"] for r in report["results"]] == ["resident", "transfer", "cpu", "static", "hybrid"]
    by = {r["policy"]: r for r in report["results"]}
    assert by["resident"]["hit_rate"] == 1.0 and by["cpu"]["fetched_per_step"] == 0
    assert by["transfer"]["cpu_experts_per_step"] == 0 and all(r["floor_ms_per_token"] > 0 for r in by.values())
    for r in by.values():  # the steps' spread and the host's interference, per run
        assert 0 < r["step_ms_median"] <= r["step_ms_max"] and 0 <= r["slow_steps"] <= 4
        assert r["involuntary_switches"] is None or r["involuntary_switches"] >= 0
    assert main(["bench", "prefill", "--model", model, "--device", "cpu", "--lengths", "80,200", "--moe-cache-slots",
                 "16", "--moe-param", "ratio=0.5", "--prefill-chunk", "128", "--out", str(prefill_out),
                 "--plot", str(tmp_path / "prefill.png")]) == 0
    assert [r["prompt_tokens"] for r in json.loads(prefill_out.read_text())["results"]] == [80, 200]
    from PIL import Image

    for plot in ("decode.png", "prefill.png"):
        with Image.open(tmp_path / plot) as png:
            assert png.format == "PNG" and png.size == (720, 440)


def test_bench_prefill_refuses_a_length_beyond_the_context(make_checkpoint, tmp_path, capsys):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", model, "--device", "cpu", "--lengths", "64,100000",
                 "--out", str(out)]) == 2
    assert "--lengths 100000 is longer than the model's context" in capsys.readouterr().err
    assert not out.exists()


def test_generate_writes_a_perfetto_trace_of_the_hierarchy(make_checkpoint, tmp_path, capsys):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    trace, routing = tmp_path / "trace.json", tmp_path / "routing.jsonl"
    assert main(["generate", "--model", model, "--device", "cpu", "--prompt", "trace me", "--max-tokens", "6",
                 "--moe-policy", "hybrid", "--moe-cache-slots", "6", "--cpu-threads", "1",
                 "--trace", str(trace), "--record-routing", str(routing)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = {e["name"] for e in events if e["ph"] == "X"}
    assert {"gpu_runner", "cpu_executor", "scheduler"} <= tracks
    assert {"plan", "gpu_experts", "cpu_moe", "prefill", "decode"} <= spans
    assert any(e["ph"] == "C" and "hits" in e["name"] for e in events)
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")
    records = [json.loads(line) for line in routing.read_text().splitlines()]
    assert {r["phase"] for r in records} == {"prefill", "decode"} and all(r["layer"] in (0, 1) for r in records)


def test_engine_flags_reach_the_engine_config():
    from freetoken.__main__ import build_parser
    from freetoken.cli_args import engine_config_from as _engine_config

    for command in ("serve", "generate"):
        prompt = ["--prompt", "p"] if command == "generate" else []
        args = build_parser().parse_args([command, "--model", "m", "--dense-kernels", "reference", "--eager",
                                          "--no-pdl", "--moe-gemm", "torch", "--cpu-threads", "3"] + prompt)
        config = _engine_config(args)
        assert config.kernels.dense == "reference" and config.graphs.eager and not config.kernels.pdl
        assert config.kernels.moe_gemm == "torch" and config.moe.cpu_threads == 3
        default = _engine_config(build_parser().parse_args([command, "--model", "m"] + prompt))
        assert default.kernels.dense == "fused" and default.moe.params == {}
        for experiment in ("--copy-fill-depth", "--moe-ratio", "--cpu-poller", "--split-misses"):
            with pytest.raises(SystemExit):  # hybrid's parameters and A/B switches are not serve flags
                build_parser().parse_args([command, "--model", "m", experiment, "1"] + prompt)


def test_flag_defaults_are_the_configs():
    from freetoken.__main__ import build_parser
    from freetoken.cli_args import engine_config_from, server_config_from
    from freetoken.config import EngineConfig, ServerConfig

    assert engine_config_from(build_parser().parse_args(["serve"])) == EngineConfig()
    assert engine_config_from(build_parser().parse_args(["generate", "--prompt", "p"])) == EngineConfig()
    assert server_config_from(build_parser().parse_args(["serve"])) == ServerConfig()
    args = build_parser().parse_args(["serve", "--no-prefix-reuse", "--moe-policy", "cpu", "--moe-cache-rate", "0.5",
                                      "--max-model-len", "64", "--port", "9", "--allow-origin", "http://a"])
    config = engine_config_from(args)
    assert not config.scheduler.prefix_reuse and config.moe.policy == "cpu" and config.moe.cache_rate == 0.5
    assert config.max_model_len == 64 and config.moe.cache_slots is None
    assert server_config_from(args).port == 9 and server_config_from(args).allow_origins == ("http://a",)
    for refused in (["--moe-cache-slots", "4", "--moe-cache-rate", "0.5"], ["--moe-policy", "nope"],
                    ["--device", "tpu"], ["--max-model-len", "x"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve"] + refused)


def test_serve_help_lists_at_most_twenty_product_flags():
    from freetoken.__main__ import build_parser

    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    flags = {g.title: [o for a in g._group_actions for o in a.option_strings if o.startswith("--") and o != "--help"]
             for g in serve._action_groups}
    assert set(flags["diagnostics"]) == {"--eager", "--no-pdl", "--dense-kernels", "--moe-gemm", "--trace",
                                         "--record-routing", "--routing-replay", "--log-format", "--state-anchor-gb",
                                         "--anchor-min-gap"}
    assert sum(len(v) for title, v in flags.items() if title != "diagnostics") <= 20


def test_moe_params_are_validated():
    from freetoken.bench.moe_params import moe_config_fields

    assert moe_config_fields(["ratio=0.25", "fetch_recurring=off", "copy_fill_depth=6", "cpu_branch=inline"]) == {
        "params": {"ratio": 0.25, "fetch_recurring": False, "copy_fill_depth": 6}, "cpu_branch": "inline"}
    for bad, why in (("nope=1", "no parameter nope"), ("ratio", "expected key=value"), ("ratio=2", "[0, 1]"),
                     ("copy_fill_depth=0", "at least 1"), ("background_fills=yes", "on or off"), ("ratio=x", "$.ratio"),
                     ("cpu_branch=x", "worker or inline")):
        with pytest.raises(ValueError, match=re.escape(why)):
            moe_config_fields([bad])


def test_bench_decode_records_a_trajectory_every_policy_replays(make_checkpoint, tmp_path, capsys):
    """--record-routing writes one run's routing; replayed, every policy decodes the same routes,
    so their figures compare like for like."""
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    common = ["bench", "decode", "--model", model, "--device", "cpu", "--moe-cache-slots", "8", "--moe-param",
              "ratio=0.5", "--decode-tokens", "4", "--warmup-tokens", "2", "--cpu-threads", "1"]
    routing, out = tmp_path / "own.jsonl", tmp_path / "replayed.json"
    assert main(common + ["--policies", "resident", "--record-routing", str(routing)]) == 0
    records = [json.loads(line) for line in routing.read_text().splitlines()]
    assert {r["phase"] for r in records} == {"prefill", "decode"}
    assert main(common + ["--policies", "transfer,hybrid", "--moe-param", "fetch_recurring=off", "--routing-replay",
                          str(routing), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["policy"], r["policy_params"].get("fetch_recurring")) for r in results] == [
        ("transfer", None), ("hybrid", False)]
    capsys.readouterr()
    assert main(common + ["--policies", "transfer,hybrid", "--record-routing", str(tmp_path / "x.jsonl")]) == 2
    assert "one policy" in capsys.readouterr().err


def test_decode_host_gap_idles_before_each_step_and_says_so(make_checkpoint, tmp_path, monkeypatch):
    import time

    from benchmarks import decode_host_gap

    model = str(make_checkpoint("qwen3_moe", "tiny"))
    out = tmp_path / "gap.json"
    sleeps = []
    real_sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: (sleeps.append(s), real_sleep(s)))
    args = ["0.003", "bench", "decode", "--model", model, "--device", "cpu", "--policies", "transfer",
            "--moe-cache-slots", "12", "--decode-tokens", "3", "--warmup-tokens", "1", "--out", str(out)]
    assert decode_host_gap.main(args) == 0
    assert sleeps.count(0.003) == 4  # one idle gap before each decode step, warm-up included
    report = json.loads(out.read_text())
    assert report["host_gap_s"] == 0.003
    assert report["command"] == "python benchmarks/decode_host_gap.py " + " ".join(args)
    assert decode_host_gap.main(["-1", "bench"]) == 2
    from freetoken.engine.model_runner import ModelRunner

    assert ModelRunner.set_context.__name__ == "set_context"  # the gap is gone after the run


def test_bench_decode_repeats_take_turns_and_report_the_median(make_checkpoint, tmp_path, capsys):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    out = tmp_path / "decode.json"
    common = ["bench", "decode", "--model", model, "--device", "cpu", "--moe-cache-slots", "8", "--moe-param",
              "ratio=0.5", "--decode-tokens", "3", "--warmup-tokens", "1", "--cpu-threads", "1"]
    assert main(common + ["--policies", "transfer,hybrid", "--repeats", "3", "--out", str(out)]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[bench] ") and "tok/s" in line]
    # the runs take turns: transfer, hybrid, transfer, ...; then one median line per run
    assert [line.split()[1] for line in lines] == ["transfer", "hybrid"] * 4
    assert all("(repeat" in line for line in lines[:6]) and all("(median of 3" in line for line in lines[6:])
    results = json.loads(out.read_text())["results"]
    assert [r["policy"] for r in results] == ["transfer", "hybrid"]
    for r in results:
        samples = r["tok_per_s_samples"]
        assert r["repeats"] == 3 and len(samples) == 3
        assert r["tok_per_s"] == sorted(samples)[1]
        assert len(r["step_ms_max_samples"]) == 3 and len(r["involuntary_switches_samples"]) == 3
    assert main(common + ["--repeats", "2", "--trace", str(tmp_path / "t.json")]) == 2
    assert main(common + ["--repeats", "0"]) == 2


def test_median_run_keeps_one_repetition_whole():
    from freetoken.bench.decode import median_run

    runs = [{"tok_per_s": t, "hit_rate": h} for t, h in ((3.0, 0.1), (1.0, 0.2), (2.0, 0.3), (4.0, 0.4))]
    assert median_run(runs) == {"tok_per_s": 2.0, "hit_rate": 0.3, "repeats": 4,
                                "tok_per_s_samples": [3.0, 1.0, 2.0, 4.0]}
    assert median_run(runs[:1]) == runs[0]
    timed = [{"tok_per_s": t, "device_ms_per_step": 1 / t, "cpu_answer_ms_per_step": t / 10} for t in (3.0, 1.0, 2.0)]
    r = median_run(timed)
    assert r["device_ms_samples"] == [1 / 3, 1.0, 0.5] and r["cpu_answer_ms_samples"] == [0.3, 0.1, 0.2]
    assert r["cpu_answer_ms_per_step"] == 0.2  # the median turn's own figure


def test_bench_decode_refuses_a_bad_moe_param(make_checkpoint, capsys):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    for bad in ("copy_fill_depth=0", "depth=4", "ratio"):
        assert main(["bench", "decode", "--model", model, "--device", "cpu", "--moe-param", bad]) == 2
        assert "--moe-param" in capsys.readouterr().err


def test_a_step_reads_the_head_whole_and_the_embedding_table_by_rows():
    import torch

    from freetoken.models.weights import ModelWeights

    embed, head = torch.zeros(10, 4, dtype=torch.bfloat16), torch.ones(10, 4, dtype=torch.bfloat16)
    norm = torch.zeros(4)
    assert ModelWeights(embed, [], norm, head).step_read_bytes() == norm.nbytes + head.nbytes
    assert ModelWeights(embed, [], norm, embed).step_read_bytes() == embed.nbytes + norm.nbytes  # tied: the head


def test_bench_decode_times_auto_and_says_which_modes_its_timed_steps_ran(make_checkpoint, tmp_path, capsys):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    out = tmp_path / "auto.json"
    assert main(["bench", "decode", "--model", model, "--device", "cpu", "--moe-cache-slots", "8", "--policies",
                 "auto", "--decode-tokens", "12", "--warmup-tokens", "40", "--cpu-threads", "1", "--prompt-tokens", "8",
                 "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    live = result["live_policy"]
    assert result["policy"] == "auto" and live["probes"] >= 1
    assert sum(live["timed_mode_steps"].values()) == 12
    assert sum(live["mode_steps"].values()) == 40 + 12
    captured = capsys.readouterr()
    assert "[bench] auto (" in captured.out + captured.err  # (the progress line)
    assert main(["bench", "decode", "--model", model, "--device", "cpu", "--policies", "autoo"]) == 2
