"""The placement policies as typed values: their answers, their parameters and their errors."""

from __future__ import annotations

import pytest

from freetoken.errors import ConfigError
from freetoken.moe.policy import POLICIES, Hybrid, make_policy, parse_params
from freetoken.reference.fetch_rule import FetchRule


def test_answers_per_policy():
    answers = {name: (cls.routes_to_cpu, cls.fixed_placement, cls.every_expert, make_policy(name).streams_prefill,
                      make_policy(name).fetch_rule) for name, cls in POLICIES.items()}
    assert answers == {
        "resident": (False, True, True, False, FetchRule.ALL),
        "transfer": (False, False, False, True, FetchRule.ALL),
        "cpu": (True, False, False, True, FetchRule.NONE),
        "static": (True, True, False, False, FetchRule.NONE),
        "hybrid": (True, False, False, True, FetchRule.QSTAR_BACKGROUND),
    }


def test_hybrid_parameters_choose_its_fetch_rule():
    assert Hybrid(fetch_recurring=False).fetch_rule is FetchRule.QSTAR
    assert Hybrid(background_fills=False).fetch_rule is FetchRule.QSTAR_RECURRING
    assert Hybrid(fetch_recurring=False, background_fills=False).fetch_rule is FetchRule.QSTAR


def test_params_from_strings():
    policy = make_policy("hybrid", parse_params(["ratio=0.25", "fetch-recurring=false", "copy_fill_depth = 8"]))
    assert policy == Hybrid(ratio=0.25, fetch_recurring=False, copy_fill_depth=8)
    assert policy.describe() == ("hybrid(ratio=0.25, fetch_recurring=False, background_fills=True, copy_fill_depth=8, "
                                 "adaptive=False)")
    assert make_policy("transfer").describe() == "transfer"


@pytest.mark.parametrize(("name", "items", "message"), [
    ("hybrid", ["ratio=1.5"], "ratio: the PCIe share must be in [0, 1]"),
    ("hybrid", ["copy_fill_depth=0"], "copy_fill_depth: must be at least 1"),
    ("hybrid", ["copy_fill_depth=x"], "Expected `int`"),
    ("hybrid", ["speed=11"], "has no parameter speed; its parameters: ratio, fetch_recurring"),
    ("transfer", ["ratio=0.5"], "its parameters: none"),
    ("lru", [], "unknown MoE policy 'lru'"),
])
def test_bad_params_are_clear_errors(name, items, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        make_policy(name, parse_params(items))


@pytest.mark.parametrize("item", ["ratio", "=3"])
def test_malformed_pairs(item):
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_params([item])
    with pytest.raises(ConfigError, match="given twice"):
        parse_params(["ratio=0.1", "ratio=0.2"])


def test_initial_layers():
    sparse = [0, 1, 2, 3]
    assert make_policy("resident").gpu_layers(sparse, 16, 4) == sparse
    with pytest.raises(ValueError, match="needs 16 slots"):
        make_policy("resident").gpu_layers(sparse, 15, 4)
    assert make_policy("static").gpu_layers(sparse, 9, 4) == [2, 3]
    assert make_policy("static").gpu_layers(sparse, 3, 4) == []
    assert make_policy("hybrid").gpu_layers(sparse, 16, 4) == []
