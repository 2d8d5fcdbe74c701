"""The config tree: every leaf has one default (on its field) and one flag or a no_flag marker; the
flags of serve, generate and the bench commands are generated from those leaves; a config
round-trips through msgspec's builtins and JSON."""

from __future__ import annotations

import argparse
from typing import Annotated

import msgspec
import pytest

from freetoken.__main__ import build_parser
from freetoken.config import (
    EngineConfig,
    GraphConfig,
    KernelConfig,
    KvConfig,
    MoeConfig,
    SchedulerConfig,
    ServerConfig,
    TraceConfig,
)
from freetoken.config_tree import is_config, leaves, nested, no_flag, value_at


def _subparser(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings}


def test_every_leaf_has_a_default_and_one_flag_or_a_no_flag_marker():
    engine, server = leaves(EngineConfig), leaves(ServerConfig)
    flags = [leaf.flag for leaf in engine + server if leaf.flag is not None]
    assert len(flags) == len(set(flags)), "a flag on two leaves"
    dests = [leaf.dest for leaf in engine + server if leaf.flag is not None]
    assert len(dests) == len(set(dests))
    paths = [leaf.path for leaf in engine]
    assert {p.partition(".")[0] for p in paths if "." in p} == {"kv", "scheduler", "moe", "graphs", "kernels", "trace"}
    for leaf in engine:  # the default a leaf reports is the one a bare config holds
        assert value_at(EngineConfig(), leaf.path) == leaf.default, leaf.path
    for field in msgspec.structs.fields(EngineConfig):  # a sub-config's defaults are its own fields'
        assert not is_config(field.type) or field.default_factory is field.type, field.name


def test_a_leaf_without_a_marker_or_a_default_is_refused():
    class Unmarked(msgspec.Struct, frozen=True, kw_only=True):
        size: int = 1

    class NoDefault(msgspec.Struct, frozen=True, kw_only=True):
        size: Annotated[int, no_flag("tests")]

    with pytest.raises(TypeError, match="Unmarked.size: mark the field"):
        leaves(Unmarked)
    with pytest.raises(TypeError, match="NoDefault.size: a config leaf needs a default"):
        leaves(NoDefault)


@pytest.mark.parametrize("command", [("serve",), ("generate",), ("bench", "decode"), ("bench", "prefill")])
def test_each_commands_engine_flags_are_the_fields(command):
    """Flag, default and help come from the leaf; bench prefill alone starts from hybrid (what it measures).
    The bench commands' own --model (required) and --trace (a file per run) are theirs, not the engine's."""
    from freetoken.bench import decode, prefill

    options = _options(_subparser(build_parser(), *command))
    flags = [leaf for leaf in leaves(EngineConfig) if leaf.flag is not None]
    if command[0] == "bench":
        generated = (decode if command[1] == "decode" else prefill).ENGINE_FLAGS
        assert {leaf.flag for leaf in flags if leaf.flag in options} - set(generated) == {"--model", "--trace"}
        flags = [leaf for leaf in flags if leaf.flag in generated]
    for leaf in flags:
        action = options[leaf.flag]
        assert action.dest == leaf.dest
        expected = "hybrid" if command == ("bench", "prefill") and leaf.flag == "--moe-policy" else leaf.default
        assert action.default == expected, leaf.flag
        if command[0] != "bench":
            assert action.help == leaf.help, leaf.flag


def test_bench_flags_reach_the_engine_config():
    from freetoken.bench.decode import ENGINE_FLAGS
    from freetoken.cli_args import engine_config_from

    args = build_parser().parse_args(["bench", "decode", "--model", "m", "--device", "cpu", "--moe-cache-rate", "0.25",
                                      "--cpu-threads", "2", "--moe-gemm", "torch", "--routing-replay", "r.jsonl"])
    config = engine_config_from(args, ENGINE_FLAGS)
    assert (config.device, config.moe.cache_rate, config.moe.cpu_threads) == ("cpu", 0.25, 2)
    assert config.kernels.moe_gemm == "torch" and config.trace.routing_replay == "r.jsonl"
    assert config.model == EngineConfig().model  # bench's own --model is not the engine's flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "decode", "--model", "m", "--moe-cache-slots", "4",
                                   "--moe-cache-rate", "1"])


def test_the_tree_round_trips():
    config = EngineConfig(
        model="m", device="cpu", dtype="float32", max_model_len=64, max_running_requests=2,
        kv=KvConfig(tokens=512, page_size=8), scheduler=SchedulerConfig(prefill_chunk=32, prefix_reuse=False),
        moe=MoeConfig(policy="hybrid", params={"ratio": 0.5}, cache_slots=8, cpu_threads=1, cpu_branch="inline",
                      prefill_stream_min_tokens=None),
        graphs=GraphConfig(eager=True, batch_sizes=(1, 2), watchdog_s=1.0),
        kernels=KernelConfig(pdl=False, dense="reference", moe_gemm="torch"),
        trace=TraceConfig(timeline="t.json", record_routing="r.jsonl"), served_model_name="x",
    )
    for cfg in (EngineConfig(), config):
        as_dict = msgspec.to_builtins(cfg)
        assert as_dict["moe"]["cache_slots"] == cfg.moe.cache_slots
        assert msgspec.convert(as_dict, EngineConfig) == cfg
        assert msgspec.json.decode(msgspec.json.encode(cfg), type=EngineConfig) == cfg
    assert msgspec.convert(nested({"kv.tokens": 512, "moe.policy": "cpu"}), EngineConfig) == EngineConfig(
        kv=KvConfig(tokens=512), moe=MoeConfig(policy="cpu"))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.kernels\.dense"):
        msgspec.convert({"kernels": {"dense": "nope"}}, EngineConfig)
