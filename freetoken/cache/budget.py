"""How many expert slots the device gets: pure arithmetic, so it is easy to test and to explain.

The budget is what the device has free after the dense weights and the KV cache are placed,
minus a headroom for activations and the allocator; slots take the rest, never more than the
pool has experts. An explicit slot count or pool fraction overrides the budget (and fails
loudly if it cannot fit).
"""

from __future__ import annotations


def decide_slots(
    *,
    every_expert: bool,
    pool_experts: int,
    slot_bytes: int,
    free_bytes: int | None,
    headroom_bytes: int,
    slots: int | None = None,
    rate: float | None = None,
) -> tuple[int, str]:
    """The slot count and why. every_expert: the policy needs a slot for every expert;
    pool_experts: routable experts (MoE layers x experts); slot_bytes: one slot's bytes on the
    device; free_bytes: device memory still free (None on CPU: no limit)."""
    if slots is not None and rate is not None:
        raise ValueError("give the expert cache as a slot count or as a rate, not both")
    budget = None if free_bytes is None else max(0, free_bytes - headroom_bytes) // slot_bytes
    if slots is not None:
        want, reason = slots, f"{slots} slots asked for"
    elif rate is not None:
        if not 0 < rate <= 1:
            raise ValueError(f"the expert cache rate must be in (0, 1], got {rate}")
        want, reason = max(1, round(rate * pool_experts)), f"{rate:.0%} of the pool asked for"
    elif every_expert or budget is None:
        want, reason = pool_experts, "every expert"
    else:
        want, reason = min(pool_experts, budget), "free device memory"
    want = min(want, pool_experts)
    if want < 1:
        raise ValueError(f"no device memory left for expert slots ({reason}); lower --max-model-len or the headroom")
    if budget is not None and want > budget:
        raise ValueError(
            f"{want} expert slots ({want * slot_bytes / 2**30:.1f} GiB) do not fit the "
            f"{(free_bytes - headroom_bytes) / 2**30:.1f} GiB free after the headroom"
        )
    if every_expert and want < pool_experts:
        raise ValueError(f"the policy needs all {pool_experts} experts on the device; only {want} slots")
    return want, reason
