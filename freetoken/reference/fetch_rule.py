"""How many of a layer's cache misses a plan fetches over PCIe: the one number the planners
(the reference twin and the plan kernel) take from the placement policy.

The values are the plan kernel's `fetch_mode` argument, so they are plain ints.
"""

from __future__ import annotations

from enum import IntEnum


class FetchRule(IntEnum):
    NONE = 0  # every miss runs on the CPU (cpu, static)
    ALL = 1  # every miss is fetched and waited for (resident, transfer)
    QSTAR = 2  # q*'s share is fetched, the rest runs on the CPU (hybrid, q* alone)
    QSTAR_RECURRING = 3  # q*, raised to the recurring misses and the free slots (hybrid)
    QSTAR_BACKGROUND = 4  # as QSTAR_RECURRING, but only q*'s share is waited for (hybrid's default)
