"""The planner's error: no placement fits the budgets (the message says what would).

Its own module so that every layer that refuses a plan (:mod:`chunkjax.memory`'s pinned-host cap,
the policies of :mod:`chunkjax.plan`, the drop-in optimizer) raises the one type without importing
the planner.
"""
from __future__ import annotations


def gib_ceil(n: int) -> float:
    """``n`` bytes in GiB rounded *up* to the 3 decimals the messages print (rounding to nearest
    could suggest a budget below ``n``, which then fails again)."""
    return -(-n * 1000 // 2**30) / 1000


class PlanError(ValueError):
    """No placement fits the device (or host) budget.

    Attributes:
      min_budget_bytes: the smallest device budget (bytes) that works, where known (0 otherwise).
      activations_alone: the non-model bytes (activations and temporaries) alone exceed the budget.
    """

    def __init__(self, msg: str, min_budget_bytes: int, activations_alone: bool):
        super().__init__(msg)
        self.min_budget_bytes = min_budget_bytes
        self.activations_alone = activations_alone


class HostBudgetError(PlanError):
    """No placement's host bytes fit the host budget (the device budget would fit one)."""


class PinnedLimitError(HostBudgetError):
    """Every placement's pinned host bytes exceed the process's limit on pinned host memory."""
