"""The planner's error: no placement fits the budgets (the message says what would).

Its own module so that every layer that refuses a plan (:mod:`chunkjax.memory`'s pinned-host cap,
the policies of :mod:`chunkjax.plan`, the drop-in optimizer) raises the one type without importing
the planner.
"""
from __future__ import annotations

import math


#: Units of the byte counts that messages print, largest first (IEC, as :func:`chunkjax.parse_bytes` reads them).
BYTE_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_bytes(n: int | float, *, up: bool = False) -> str:
    """``n`` bytes in the largest unit it reaches, 3 decimals, no space: ``"2.000GiB"``,
    ``"304.130KiB"``, ``"512B"`` (below 1 KiB: whole bytes). The budget hints of the planner's
    errors and the sizes the tools print go through it, so a tiny model's need reads
    ``"304.130KiB"``, not ``"0.001GiB"``; :func:`chunkjax.parse_bytes` reads every form back.

    Args:
      n: bytes (int or float; negative values keep their sign).
      up: round *up* to the printed precision: a suggested budget is never below ``n`` (rounding
        to nearest could suggest a budget that fails again).
    """
    sign, n = ("-", -n) if n < 0 else ("", n)
    for name, k in BYTE_UNITS:  # the largest unit whose printed value is at least 1.000
        milli = -(-math.ceil(n) * 1000 // k) if up else round(n * 1000 / k)
        if milli >= 1000:
            return f"{sign}{milli / 1000:.3f}{name}"
    return f"{sign}{math.ceil(n) if up else round(n)}B"


#: Units of bytes *moved* (per step: h2d, d2h, disk), largest first: decimal (SI), as link rates
#: (GB/s) and the benchmarks' ``GB/step`` columns are; bytes *held* (budgets, peaks, host memory)
#: print in :data:`BYTE_UNITS`, as budgets are given.
MOVED_UNITS = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))


def format_moved_bytes(n: int | float) -> str:
    """``n`` bytes moved (per step, over a link) in the largest decimal unit it reaches, 3
    decimals, no space: ``"47.186MB"``, ``"1.200GB"``, ``"512B"``. Bytes held (a budget, a peak,
    host memory) go through :func:`format_bytes` (binary units) instead."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    for name, k in MOVED_UNITS:
        if round(n * 1000 / k) >= 1000:
            return f"{sign}{round(n * 1000 / k) / 1000:.3f}{name}"
    return f"{sign}{round(n)}B"


def format_step_seconds(s: float) -> str:
    """A predicted step or time in a summary line: milliseconds with one decimal (``"1523.4 ms"``),
    microseconds below 0.05 ms (a small model's step: ``"37.2 µs"``, not ``"0.0 ms"``)."""
    return f"{s * 1e3:.1f} ms" if abs(s) * 1e3 >= 0.05 else f"{s * 1e6:.1f} µs"


def format_flops(f: float) -> str:
    """FLOPs (per step) in the largest unit from TFLOP down that it reaches, one decimal:
    ``"304.3 TFLOP"``, ``"12.6 MFLOP"`` (a small model's, not ``"0.0 TFLOP"``), ``"512 FLOP"``."""
    for name, k in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(f) >= k * 0.95:
            return f"{f / k:.1f} {name}"
    return f"{f:.0f} FLOP"


def complex_param_error(name: str, dtype) -> ValueError:
    """The one-line refusal of a complex leaf left trainable (the layout's default ``trainable``,
    the front door's filter): chunks train real floating leaves only, and freezing it unasked would
    train another model than the plain loop (which differentiates complex leaves) without a word."""
    return ValueError(f"parameter '{name}' is {dtype}: chunkjax trains real floating parameters only (float32 "
                      "master weights), so it would stay frozen while nnx.Optimizer trains it; hold it as two "
                      "real parameters (real and imaginary parts), or leave it out of trainable= to freeze it")


class PlanError(ValueError):
    """No placement fits the device (or host) budget.

    Attributes:
      min_budget_bytes: the smallest device budget (bytes) that works, where known (0 otherwise).
      activations_alone: the non-model bytes (activations and temporaries) alone exceed the budget.
      host_need_bytes: a refusal for lack of host memory: the least host bytes the plan needs (as
        compared with the host budget), else None.
    """

    def __init__(self, msg: str, min_budget_bytes: int, activations_alone: bool, host_need_bytes: int | None = None):
        super().__init__(msg)
        self.min_budget_bytes = min_budget_bytes
        self.activations_alone = activations_alone
        self.host_need_bytes = host_need_bytes

    def at_headroom(self, headroom: float) -> "PlanError":
        """This device refusal with the budget it tells the user to give raised to its need over
        ``headroom`` (0 < headroom <= 1): the fit path's compiled check holds the compiled step to
        that fraction of the budget (:data:`chunkjax.fit.HEADROOM`), so a budget at the planner's
        need would fail it (:func:`chunkjax.fit.min_budget` gives the same figure). ``self`` where
        it names no such figure (a host refusal, no known need); ``min_budget_bytes`` stays the
        planner's need."""
        if type(self) is not PlanError or not self.min_budget_bytes:
            return self
        old = f"use device_budget >= {format_bytes(self.min_budget_bytes, up=True)}"
        if old not in str(self):
            return self
        fix = format_bytes(int(math.ceil(self.min_budget_bytes / headroom)), up=True)
        return PlanError(str(self).replace(old, f"use device_budget >= {fix} (that need over the compiled check's "
                                                f"{headroom:.0%} headroom; device_budget='min' gives it)"),
                         self.min_budget_bytes, self.activations_alone, self.host_need_bytes)


class HostBudgetError(PlanError):
    """No placement's host bytes fit the host budget (the device budget would fit one)."""


class PinnedLimitError(HostBudgetError):
    """Every placement's pinned host bytes exceed the process's limit on pinned host memory."""
