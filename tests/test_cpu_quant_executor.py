"""The CPU executor and both doorbell pollers over GGUF-quantized banks: the executor's answers
are a direct `cpu_moe_quant` call's bit for bit, the pollers' within the kernel's bound of the
twin (compiled into the poller, LLVM may fuse and order the fp32 arithmetic differently, so an
act value on a rounding edge may take the neighbouring code: the bound covers either)."""

from __future__ import annotations

import numpy as np
import pytest

from freetoken.kernels.cpu.executor import CpuExpertExecutor
from freetoken.kernels.cpu.quant_experts import Q4_K, Q6_K, Q8_0, cpu_moe_quant
from freetoken.reference.quant_moe import quant_moe_experts
from tests.quant_banks import make_quant_banks
from tests.test_cpu_quant_experts import assert_within_code_bound
from tests.test_doorbell import answers_through_poller

E, H, I, K = 3, 256, 256, 2
LAYER_TYPES = [(Q4_K, Q6_K), (Q8_0, Q4_K)]  # mixed per layer; the second layer's w2 rows are padded


def quant_case(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, H)).astype(np.float32)
    weights = rng.random((n, K)).astype(np.float32)
    ids = rng.integers(-1, len(LAYER_TYPES) * E, (n, K)).astype(np.int32)
    return x, weights, ids


@pytest.fixture(scope="module")
def banks():
    return make_quant_banks(LAYER_TYPES, E, H, I, np.random.default_rng(7))


def test_submit_and_inline_match_the_kernel_and_twin(banks):
    w13, w2, layout = banks
    x, weights, ids = quant_case(3, 1)
    ids[0, 0] = 4  # at least one route
    direct = np.empty_like(x)
    cpu_moe_quant(x, weights, ids, w13, w2, layout, direct)
    twin = quant_moe_experts(x, weights, ids, w13, w2, layout.layer_types, E, I)
    assert_within_code_bound(direct, twin, x, weights, ids, w13, w2, layout)
    with CpuExpertExecutor(w13, w2, threads=2, layout=layout) as ex:
        assert ex.kernel.name == "gguf" and ex.hidden == H
        np.testing.assert_array_equal(ex.submit(x, weights, ids, np.empty_like(x)).wait(), direct)
        np.testing.assert_array_equal(ex.run_inline(x, weights, ids, np.empty_like(x)), direct)


@pytest.mark.parametrize("poller", ["team", "per-call"])
def test_pollers_answer_with_the_kernels_result(banks, poller):
    w13, w2, layout = banks
    layers = [(layer, *quant_case(n, layer + 10)) for layer, n in enumerate((1, 4, 2))]
    results = answers_through_poller(w13, w2, layout, poller, layers, rows=4, top_k=K, hidden=H)
    for (_, x, weights, ids), got in zip(layers, results, strict=True):
        twin = quant_moe_experts(x, weights, ids, w13, w2, layout.layer_types, E, I)
        assert_within_code_bound(got, twin, x, weights, ids, w13, w2, layout)


def test_banks_that_do_not_fit_the_layout_are_refused(banks):
    w13, w2, layout = banks
    with pytest.raises(ValueError, match="do not fit the layout"):
        CpuExpertExecutor(w13[:, :-1].copy(), w2, layout=layout)
    with pytest.raises(ValueError, match="uint8"):
        CpuExpertExecutor(w13.view(np.uint16), w2, layout=layout)
    with pytest.raises(ValueError, match="uint16"):
        CpuExpertExecutor(w13, w2)  # quantized banks without their layout
