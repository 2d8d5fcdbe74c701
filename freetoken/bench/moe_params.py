"""`bench --moe-param key=value`: the expert hierarchy's parameters, which are not serve flags.

The keys are hybrid's parameters (moe/policy.py, `Hybrid`, with its defaults) and the eager path's
`cpu_branch`. Switches take on or off. A run over several policies gives the parameters to the
ones that have them (hybrid, and auto where it picks hybrid); an unknown key or a bad value is
refused, naming the keys there are.
"""

from __future__ import annotations

import argparse

from freetoken.errors import ConfigError
from freetoken.moe.policy import Hybrid, make_policy, params_for, parse_params

CPU_BRANCHES = ("worker", "inline")  # MoeConfig.cpu_branch
HYBRID_KEYS = Hybrid.__struct_fields__


def add_moe_param_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe-param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"an expert-hierarchy parameter (repeatable): hybrid's {', '.join(HYBRID_KEYS)} "
                        f"(moe/policy.py says what each does), or cpu_branch ({' or '.join(CPU_BRANCHES)})")


def moe_config_fields(pairs: list[str]) -> dict[str, object]:
    """--moe-param's values -> MoeConfig keyword arguments (`params`, `cpu_branch`);
    ValueError names a bad one."""
    try:
        params: dict[str, object] = dict(parse_params(pairs))
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    fields: dict[str, object] = {}
    branch = params.pop("cpu_branch", None)
    if branch is not None:
        if branch not in CPU_BRANCHES:
            raise ValueError(f"--moe-param cpu_branch={branch}: takes {' or '.join(CPU_BRANCHES)}")
        fields["cpu_branch"] = branch
    defaults = zip(HYBRID_KEYS, Hybrid.__struct_defaults__, strict=True)
    switches = {key for key, default in defaults if isinstance(default, bool)}
    for key in switches & params.keys():
        if params[key] not in ("on", "off"):
            raise ValueError(f"--moe-param {key}={params[key]}: takes on or off")
        params[key] = params[key] == "on"
    try:
        hybrid = make_policy(Hybrid.name, params)
    except ConfigError as exc:
        raise ValueError(f"--moe-param: {exc}") from None
    fields["params"] = {key: getattr(hybrid, key) for key in params}  # converted to their types
    return fields


def for_policy(policy: str, fields: dict[str, object]) -> dict[str, object]:
    """`fields` for a run of `policy`: hybrid's parameters go only where hybrid may run."""
    return {**fields, "params": params_for(policy, fields.get("params", {}))}
