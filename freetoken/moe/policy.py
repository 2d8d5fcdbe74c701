"""Placement policies: what the engine does with a layer's cache misses, as typed values.

Every question the rest of the engine asks about a policy is answered here, once: does it route
experts to the CPU, is its placement fixed at start, does a long prefill chunk stream whole expert
layers, which layers it places before serving, and which fetch rule its plans follow. A policy's
own parameters (hybrid's split ratio and refinements) are fields with their defaults, validated
when the policy is built; `--moe-param key=value` strings are converted here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

import msgspec

from freetoken.errors import ConfigError
from freetoken.reference.fetch_rule import FetchRule


class Policy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One placement policy; subclasses name it and answer the engine's questions."""

    name: ClassVar[str]
    summary: ClassVar[str]
    routes_to_cpu: ClassVar[bool] = False  # its plans may hand routes to the CPU expert executor
    fixed_placement: ClassVar[bool] = False  # slots keep the experts placed at start; nothing fills while serving
    every_expert: ClassVar[bool] = False  # needs a device slot for every routable expert
    fetch_rule: ClassVar[FetchRule]  # how many of a layer's misses its plans fetch (a property where parameters decide)

    @property
    def streams_prefill(self) -> bool:
        """Long prefill chunks stream whole expert layers through a double buffer instead of the
        slots: only where the slots change while serving (a fixed placement has nothing to stream)."""
        return not self.fixed_placement

    def gpu_layers(self, sparse_layers: list[int], num_slots: int, num_experts: int) -> list[int]:
        """The MoE layers whose experts are placed on the device before serving (the dynamic
        policies place none: the cache warms up from use)."""
        return []

    def params(self) -> dict[str, object]:
        """The policy's parameters, for status reports and logs."""
        return {f: getattr(self, f) for f in self.__struct_fields__}

    def describe(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.params().items())
        return f"{self.name}({params})" if params else self.name


class Resident(Policy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: ClassVar[str] = "resident"
    summary: ClassVar[str] = "every expert on the device"
    fixed_placement: ClassVar[bool] = True
    every_expert: ClassVar[bool] = True
    fetch_rule: ClassVar[FetchRule] = FetchRule.ALL  # (there are no misses)

    def gpu_layers(self, sparse_layers: list[int], num_slots: int, num_experts: int) -> list[int]:
        if num_slots < len(sparse_layers) * num_experts:
            raise ValueError(f"policy 'resident' needs {len(sparse_layers) * num_experts} slots (every expert), "
                             f"got {num_slots}")
        return list(sparse_layers)


class Transfer(Policy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: ClassVar[str] = "transfer"
    summary: ClassVar[str] = "an LRU cache; every miss is copied over PCIe"
    fetch_rule: ClassVar[FetchRule] = FetchRule.ALL


class Cpu(Policy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: ClassVar[str] = "cpu"
    summary: ClassVar[str] = "an LRU cache that never fills; every miss runs on the CPU"
    routes_to_cpu: ClassVar[bool] = True
    fetch_rule: ClassVar[FetchRule] = FetchRule.NONE


class Static(Policy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: ClassVar[str] = "static"
    summary: ClassVar[str] = "whole layers on the device, the first ones on the CPU (llama.cpp's --n-cpu-moe)"
    routes_to_cpu: ClassVar[bool] = True
    fixed_placement: ClassVar[bool] = True
    fetch_rule: ClassVar[FetchRule] = FetchRule.NONE

    def gpu_layers(self, sparse_layers: list[int], num_slots: int, num_experts: int) -> list[int]:
        fit = min(len(sparse_layers), num_slots // num_experts)
        return sparse_layers[len(sparse_layers) - fit:] if fit else []


class Hybrid(Policy, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Each layer's misses split between PCIe fills and the CPU by q* (reference/expert_cache.py).

    ratio: the PCIe share r in [0, 1]; None: from the machine's bandwidth profile.
    fetch_recurring: a miss that plain LRU would still hold is fetched whatever q* says, so
        experts that recur end up cached; off: q* alone.
    background_fills: with fetch_recurring, a layer waits only for q*'s fetches; the ones the
        recurring rule adds run on the CPU this step while their slots fill for later steps.
    copy_fill_depth: captured decode, 512 KiB chunks of background fills that may stream in at
        once (deeper: faster fills, slower CPU hand-offs, whose reads share the link).
    adaptive: the profile's r is where the split starts; the engine's own timings of both links
        move it while serving (moe/live_split.py); off (the default until its contention
        benchmark has run on a GPU): the profile's r throughout. A `ratio` given as a parameter
        is always kept as given.
    """

    name: ClassVar[str] = "hybrid"
    summary: ClassVar[str] = "misses split between PCIe fills and CPU execution by the measured bandwidths"
    routes_to_cpu: ClassVar[bool] = True
    ratio: float | None = None
    fetch_recurring: bool = True
    background_fills: bool = True
    copy_fill_depth: int = 4
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.ratio is not None and not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"ratio: the PCIe share must be in [0, 1], got {self.ratio}")
        if self.copy_fill_depth < 1:
            raise ValueError(f"copy_fill_depth: must be at least 1, got {self.copy_fill_depth}")

    @property
    def fetch_rule(self) -> FetchRule:
        if not self.fetch_recurring:
            return FetchRule.QSTAR
        return FetchRule.QSTAR_BACKGROUND if self.background_fills else FetchRule.QSTAR_RECURRING


POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Resident, Transfer, Cpu, Static, Hybrid)}
AUTO = "auto"  # resident where every expert fits, else hybrid's plan, its share chosen live (moe/factory.py)


def parse_params(items: Iterable[str]) -> dict[str, str]:
    """`key=value` strings (as `--moe-param` takes them) into a dict; a repeated key is an error."""
    params: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--moe-param {item!r}: expected key=value")
        if key in params:
            raise ConfigError(f"--moe-param {key}: given twice")
        params[key] = value.strip()
    return params


def sim_policy(name: str, fetch_recurring: bool = True, background_fills: bool = True) -> Policy:
    """A policy by name, with hybrid's two refinements as given (the simulators' and cost models'
    arguments; the other policies have none)."""
    params = {"fetch_recurring": fetch_recurring, "background_fills": background_fills} if name == Hybrid.name else {}
    return make_policy(name, params)


def params_for(name: str, params: Mapping[str, object]) -> dict[str, object]:
    """Of parameters meant for several policies (a benchmark's runs over each), the ones `name`
    has: hybrid's for hybrid and auto, none for the others."""
    cls = POLICIES[Hybrid.name] if name == AUTO else POLICIES.get(name)
    return {k: v for k, v in params.items() if cls is not None and k in cls.__struct_fields__}


def configured_policy(name: str, params: Mapping[str, object] | None = None) -> Policy | None:
    """The policy a config names, with its parameters; None for `auto`, whose parameters are
    hybrid's (auto picks resident where every expert fits, else hybrid's plan, whose share it
    chooses live among hybrid's, transfer's and cpu's): they are checked now."""
    if name == AUTO:
        make_policy(Hybrid.name, params)
        return None
    return make_policy(name, params)


def make_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """The policy `name` with `params` (strings are converted to each field's type); ConfigError
    names the policy, the parameter and what it accepts."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"unknown MoE policy {name!r}; one of {AUTO}, {', '.join(POLICIES)}")
    params = dict(params or {})
    fields = cls.__struct_fields__
    unknown = sorted(set(params) - set(fields))
    if unknown:
        accepted = ", ".join(fields) if fields else "none"
        raise ConfigError(f"policy {name!r} has no parameter {', '.join(unknown)}; its parameters: {accepted}")
    try:
        return msgspec.convert(params, cls, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"policy {name!r}: {exc}") from None
