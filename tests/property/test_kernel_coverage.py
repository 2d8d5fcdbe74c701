"""Every @triton.jit function under freetoken/kernels is exercised through a registered pair (its
twin comparison, tests/property/test_kernels.py), or computes nothing a twin could compare and
says where it is checked instead."""

from __future__ import annotations

from freetoken.kernels.specs import load_all_specs

REGISTRY = load_all_specs()

# Every @triton.jit function is exercised through a registry entry (its twin comparison);
# a new kernel must be added here and to the registry, or this test fails.
COVERED_BY = {
    "_plan_kernel": "plan",
    "_fill_kernel": "slot_fill",
    "_copy_row": "slot_fill",
    "_landing": "moe_slots_gemm",  # (cases with a fill list; it decides only which programs wait)
    "_act_kernel": "moe_slots_gemm",
    "_down_kernel": "moe_slots_gemm",
    "rne_bf16": "bf16_round",
    "store_rounded": "bf16_round",
    "round_activation": "decode_attention",  # (and rotary)
    "_round_kernel": "bf16_round",
    "_rms_norm_kernel": "rms_norm",
    "_rotary_kernel": "rotary",
    "_post_kernel": "cpu_handoff",
    "_ring_post": "plan_post",  # (and cpu_handoff's one-program ring)
    "_add_kernel": "cpu_handoff",
    "_fence_system": "cpu_handoff",  # in the fused ring/wait modes, run end to end by tests/gpu
    "_post_rows": "cpu_handoff",
    "_add_rows": "cpu_handoff",
    "_cpu_routes": "cpu_handoff",  # whether a fused layer rings at all
    "_await_fill_tickets": "cpu_handoff",  # a satisfied wait; the blocking one runs in tests/gpu's decode
    "_ticket_ahead": "cpu_handoff",
    "_number_fills": "cpu_handoff",
    "_host_copy_kernel": "host_read",
    "_gather_rows_kernel": "host_embedding",
    "_write_flag": "stream_flags",
    "_wait_flag": "stream_flags",
    "_wait_word_kernel": "stream_flags",
    "_route_kernel": "route",
    "_qkv_prep_kernel": "decode_attention",
    "normed_rotated": "decode_attention",
    "_attention_kernel": "decode_attention",
    "_combine_kernel": "decode_attention",
    "_linear_kernel": "decode_linear",
    "_norm_linear_kernel": "norm_linear",
    "_f16": "dequantize_rows",
    "_k_quant_groups": "dequantize_rows",
    "dequant_groups": "dequantize_rows",
    "_dequant_rows_kernel": "dequantize_rows",
    "_quant_act_kernel": "quant_slots_gemm",
    "_quant_down_kernel": "quant_slots_gemm",
    "_low_f16": "quant_slots_gemm",
    "_small_to_f32": "quant_slots_gemm",
    "_k_scale_min": "quant_slots_gemm",
    "_k_quant_dots": "quant_slots_gemm",
    "_q6_k_dots": "quant_slots_gemm",
    "_q8_0_dots": "quant_slots_gemm",
    "block_dots": "quant_slots_gemm",
    "_mxfp4_dots": "mxfp4_slots_gemm",
    "_mxfp4_bias": "mxfp4_slots_gemm",
    "_mxfp4_act_kernel": "mxfp4_slots_gemm",
    "_mxfp4_down_kernel": "mxfp4_slots_gemm",
    "_mxfp4_dequant_kernel": "mxfp4_dequant",
    "_l2_normalize_rows": "gated_delta_chunked",
    "_unit_lower_inverse": "gated_delta_chunked",
    "_merge_blocks": "gated_delta_chunked",
    "_recurrent_kernel": "gated_delta_recurrent",
    "_gates_kernel": "delta_gates",
    "_chunk_prepare_kernel": "gated_delta_chunked",
    "_chunk_scan_kernel": "gated_delta_chunked",
    "_input_at": "causal_conv",
    "_causal_conv_kernel": "causal_conv",
}
# Triton functions that compute nothing a twin could compare, each with where it is checked.
NOT_A_COMPUTATION = {
    "_stamp_kernel": "reads the device clock; tests/gpu/test_kernels_cuda.py checks stream order and the host mapping",
    "globaltimer": "reads the device clock, for the stamp kernel and the slot fill's own stamps; "
                   "tests/gpu/test_kernels_cuda.py checks both against stamps launched around them",
    "enter": "orders kernel starts (programmatic dependent launch); tests/gpu/test_pdl_cuda.py checks captured "
             "steps give the same logits bit for bit with it on and off",
    "signal": "enter's first half (the weight tile of decode_linear loads between the two; the slot fill calls "
              "it after wait); checked as enter is",
    "wait": "enter's second half; checked as enter is",
}


def test_every_triton_function_is_covered_by_a_registered_pair():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2] / "freetoken" / "kernels"
    found = set()
    for path in root.rglob("*.py"):
        found |= set(re.findall(r"@triton\.jit[^\n]*\n(?:@[^\n]*\n)*def\s+(\w+)", path.read_text()))
    listed = set(COVERED_BY) | set(NOT_A_COMPUTATION)
    assert found == listed, f"uncovered: {found - listed}, stale: {listed - found}"
    assert set(COVERED_BY.values()) <= set(REGISTRY)
