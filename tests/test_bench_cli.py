"""The benchmark commands run end to end on a tiny checkpoint and write their JSON (no timing asserts)."""

from __future__ import annotations

import json

from freetoken.__main__ import main


def test_bench_decode_and_prefill_write_results(make_checkpoint, tmp_path):
    model = str(make_checkpoint("qwen3_moe", "tiny"))
    decode_out, prefill_out = tmp_path / "decode.json", tmp_path / "prefill.json"
    assert main(["bench", "decode", "--model", model, "--device", "cpu", "--moe-cache-slots", "12", "--moe-ratio",
                 "0.5", "--decode-tokens", "4", "--warmup-tokens", "2", "--cpu-threads", "1",
                 "--out", str(decode_out)]) == 0
    report = json.loads(decode_out.read_text())
    assert [r["policy"] for r in report["results"]] == ["resident", "transfer", "cpu", "static", "hybrid"]
    by = {r["policy"]: r for r in report["results"]}
    assert by["resident"]["hit_rate"] == 1.0 and by["cpu"]["fetched_per_step"] == 0
    assert by["transfer"]["cpu_experts_per_step"] == 0 and all(r["floor_ms_per_token"] > 0 for r in by.values())
    assert main(["bench", "prefill", "--model", model, "--device", "cpu", "--lengths", "80,200", "--moe-cache-slots",
                 "16", "--moe-ratio", "0.5", "--prefill-chunk", "128", "--out", str(prefill_out)]) == 0
    assert [r["prompt_tokens"] for r in json.loads(prefill_out.read_text())["results"]] == [80, 200]
