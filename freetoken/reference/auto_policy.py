"""`--moe-policy auto` while serving: which of transfer, hybrid and cpu the live split amounts to.

A hybrid plan at r = 1 makes exactly transfer's decisions (q* fetches every miss, so neither
the recurring nor the free-slot rule adds one, and nothing is left for the background), and at
r = 0 exactly cpu's (q* fetches none, and both rules need r > 0): tested on the plan's twin in
tests/property/test_auto_policy.py. So auto runs one plan kernel and picks among the three by
the r it writes: 1, 0, or the estimator's r (reference/split_estimator.py). It takes an end
once the estimator's r comes within ENTER of it, and leaves it only once r is LEAVE away: a
split near an end flips between the two no more than its estimates really move. Switches
happen between steps (the word is written there), never inside one.
"""

from __future__ import annotations

from freetoken.reference.expert_cache import Q16, share_q16

TRANSFER, HYBRID, CPU = "transfer", "hybrid", "cpu"
ENTER = 0.04
LEAVE = 0.08


def choose(previous: str, ratio: float) -> str:
    """The policy the split amounts to, given the last choice and the estimator's r in [0, 1]."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio: the PCIe share must be in [0, 1], got {ratio}")
    if previous not in (TRANSFER, HYBRID, CPU):
        raise ValueError(f"previous: one of {TRANSFER}, {HYBRID}, {CPU}; got {previous!r}")
    if ratio >= 1.0 - (LEAVE if previous == TRANSFER else ENTER):
        return TRANSFER
    if ratio <= (LEAVE if previous == CPU else ENTER):
        return CPU
    return HYBRID


def word_for(choice: str, ratio: float) -> int:
    """The Q16 r the plans read under `choice`."""
    return Q16 if choice == TRANSFER else 0 if choice == CPU else share_q16(ratio)
