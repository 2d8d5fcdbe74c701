"""Every Triton kernel paired with its twin, an input strategy and a stated guarantee.

A `KernelSpec` says: draw a case from `strategy()`, run `kernel(case, device)` and
`twin(case)`, and `compare` the two outputs under `guarantee` ("bit-exact" or a
`Tolerance`). `check_kernel` runs Hypothesis over the spec and returns a `CheckReport` with
the shrunk counterexample when one fails; `python -m freetoken kernels check`
(kernels/check_cli.py) and the property tests both go through it.

Importing this module is cheap: torch, triton and hypothesis are imported inside the
functions. Under `--device cpu` the kernels run in Triton's interpreter, which must be switched
on (TRITON_INTERPRET=1) before a kernel module is first imported; `check_kernel` does that.
The built-in pairs are in kernels/specs/, each next to its case type; this module knows none of
them (the specs import it to register), and `freetoken.kernels.specs.load_all_specs()` is how
a caller gets the registry with every built-in pair in it.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BIT_EXACT = "bit-exact"


@dataclass(frozen=True)
class Tolerance:
    """Elementwise |got - want| <= rel * |want| + abs * max|want|; NaN exactly where want is NaN."""

    rel: float
    abs: float

    def __str__(self) -> str:
        return f"|d| <= {self.rel:.3g}*|twin| + {self.abs:.3g}*max|twin|"


Guarantee = str | Tolerance  # BIT_EXACT or a Tolerance


@dataclass(frozen=True)
class KernelSpec:
    name: str
    strategy: Callable[[], Any]  # () -> hypothesis SearchStrategy of cases
    kernel: Callable[[Any, str], Any]  # (case, device) -> outputs (on the CPU)
    twin: Callable[[Any], Any]  # case -> outputs
    guarantee: Guarantee
    compare: Callable[[Any, Any, Guarantee], str | None] | None = None  # None: `compare_outputs`
    max_examples: int = 20
    doc: str = ""


REGISTRY: dict[str, KernelSpec] = {}


def register_kernel(spec: KernelSpec) -> KernelSpec:
    if spec.name in REGISTRY:
        raise ValueError(f"kernel {spec.name!r} registered twice")
    REGISTRY[spec.name] = spec
    return spec


@dataclass
class CheckReport:
    name: str
    device: str
    guarantee: str
    passed: bool
    runs: int  # kernel/twin comparisons made, shrinking included
    seconds: float
    counterexample: Any = None
    message: str | None = None

    def summary(self) -> str:
        head = f"{self.name} [{self.guarantee}] on {self.device}: "
        if self.passed:
            return head + f"ok ({self.runs} cases, {self.seconds:.1f} s)"
        return (head + f"FAILED after {self.runs} runs\n"
                f"  counterexample: {self.counterexample!r}\n  {self.message}")


def compare_outputs(got: Any, want: Any, guarantee: Guarantee, path: str = "out") -> str | None:
    """The first difference between two nested outputs (dicts, lists, tensors, scalars), or None."""
    if isinstance(want, dict):
        if set(got) != set(want):
            return f"{path}: keys {sorted(got)} != twin's {sorted(want)}"
        found = (compare_outputs(got[k], want[k], guarantee, f"{path}.{k}") for k in want)
        return next((m for m in found if m), None)
    if isinstance(want, list | tuple):
        if len(got) != len(want):
            return f"{path}: length {len(got)} != twin's {len(want)}"
        pairs = enumerate(zip(got, want, strict=True))
        found = (compare_outputs(g, w, guarantee, f"{path}[{i}]") for i, (g, w) in pairs)
        return next((m for m in found if m), None)
    if hasattr(want, "dtype") and hasattr(want, "shape"):
        return _compare_tensors(got, want, guarantee, path)
    return None if got == want else f"{path}: kernel {got!r}, twin {want!r}"


def _compare_tensors(got: Any, want: Any, guarantee: Guarantee, path: str) -> str | None:
    import torch

    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{path}: kernel {got.dtype}{tuple(got.shape)}, twin {want.dtype}{tuple(want.shape)}"
    got, want = got.cpu(), want.cpu()
    if guarantee == BIT_EXACT:
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        bad = got.view(bits) != want.view(bits)
        if want.is_floating_point():
            bad &= ~(got.isnan() & want.isnan())  # NaN payloads differ between CPU and GPU casts
    else:
        g, w = got.double(), want.double()
        scale = w.nan_to_num(0.0, 0.0, 0.0).abs().max() if w.numel() else 0.0
        bound = guarantee.rel * w.abs() + guarantee.abs * scale
        bad = ~((g - w).abs() <= bound) & ~(g.isnan() & w.isnan())
        bad |= g.isinf() & w.isinf() & (g != w)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{path}{list(idx)}: kernel {got[idx].item()!r}, twin {want[idx].item()!r} "
            f"({int(bad.sum())} elements differ)")


def check_case(name: str, case: Any, device: str = "cpu") -> str | None:
    """Run one case through kernel and twin; the first difference (or exception), or None."""
    spec = REGISTRY[name]
    compare = spec.compare or compare_outputs
    try:
        return compare(spec.kernel(case, device), spec.twin(case), spec.guarantee)
    except Exception as exc:  # a crash is a failure to shrink like any other
        return f"raised {type(exc).__name__}: {exc}"


def prepare_device(device: str) -> None:
    """On the CPU, switch Triton's interpreter on, and refuse kernels compiled without it."""
    if device != "cpu":
        return
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("freetoken.kernels.triton."):
            for value in vars(module).values():
                if type(value).__name__ == "JITFunction":
                    raise RuntimeError(f"{mod_name} was imported without TRITON_INTERPRET=1, so its "
                                       "kernels cannot run on the CPU; set it before importing kernels")
    os.environ["TRITON_INTERPRET"] = "1"


def check_kernel(name: str, device: str = "cpu", max_examples: int | None = None,
                 seed: int | None = None) -> CheckReport:
    """Hypothesis over one registered pair; the report holds the shrunk counterexample if any."""
    from hypothesis import find, settings
    from hypothesis.errors import NoSuchExample

    spec = REGISTRY[name]
    prepare_device(device)
    runs = 0

    def fails(case: Any) -> bool:
        nonlocal runs
        runs += 1
        return check_case(name, case, device) is not None

    start = time.perf_counter()
    config = settings(max_examples=max_examples or spec.max_examples, deadline=None, database=None)
    try:
        rng = None if seed is None else random.Random(seed)
        case = find(spec.strategy(), fails, settings=config, random=rng)
    except NoSuchExample:
        return CheckReport(name, device, str(spec.guarantee), True, runs, time.perf_counter() - start)
    return CheckReport(name, device, str(spec.guarantee), False, runs, time.perf_counter() - start,
                       counterexample=case, message=check_case(name, case, device))
