"""Eviction by furthest next use (Belady's rule) over a chunk access trace.

PatrickStar (arXiv 2108.05818, section 4.3, ``eviction_policy.py``) evicts the chunk whose next
use lies furthest in the future, using moments recorded in a warm-up iteration. chunkjax knows
the whole access trace before the first step (:mod:`chunkjax.tide`), so the rule is applied
exactly: with equal-sized chunks, evicting the resident chunk used furthest ahead (or never
again) minimises the number of fetches (Belady 1966, "A study of replacement algorithms for a
virtual-storage computer", IBM Systems Journal 5(2)).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

_MSG_TOO_SMALL = ("moment {t} reads {need} chunks at once but only {cap} chunk buffers fit there: "
                  "raise the device budget or lower the batch")


class CapacityError(ValueError):
    """A moment needs more chunk buffers than fit on the device at that moment."""


@dataclasses.dataclass(frozen=True)
class EvictionPlan:
    """Fetches and evictions per moment.

    Attributes:
      fetch: per moment, chunk ids moved to the device just before it.
      evict: per moment, chunk ids dropped from the device before its fetches.
      resident_after: per moment, chunk ids on the device after it runs.
    """

    fetch: tuple[tuple[int, ...], ...]
    evict: tuple[tuple[int, ...], ...]
    resident_after: tuple[frozenset, ...]

    @property
    def n_fetches(self) -> int:
        return sum(len(f) for f in self.fetch)


def belady(accesses: Sequence[Sequence[int]], capacity: Sequence[int] | int,
           resident: Sequence[int] = ()) -> EvictionPlan:
    """Plan fetches and evictions of equal-sized chunks.

    Args:
      accesses: per moment, the chunk ids read (must be on the device during the moment).
      capacity: chunk buffers that fit at each moment (an int for all moments).
      resident: chunk ids already on the device before moment 0.

    Returns:
      an :class:`EvictionPlan`; ties in next use are broken by the smaller chunk id.

    Raises:
      CapacityError: some moment reads more chunks than its capacity.
    """
    T = len(accesses)
    caps = [capacity] * T if isinstance(capacity, int) else list(capacity)
    if len(caps) != T:
        raise ValueError(f"capacity has {len(caps)} entries for {T} moments")
    # next use of each chunk after each moment
    next_use: list[dict[int, int]] = [dict() for _ in range(T)]
    upcoming: dict[int, int] = {}
    for t in range(T - 1, -1, -1):
        next_use[t] = dict(upcoming)
        for c in accesses[t]:
            upcoming[c] = t
    res = set(resident)
    fetch, evict, after = [], [], []
    for t in range(T):
        need = set(accesses[t])
        if len(need) > caps[t]:
            raise CapacityError(_MSG_TOO_SMALL.format(t=t, need=len(need), cap=caps[t]))
        missing = sorted(need - res)
        out = []
        while len(res) + len(missing) > caps[t]:
            victims = sorted(res - need, key=lambda c: (-next_use[t].get(c, float("inf")), c))
            v = victims[0]
            res.discard(v)
            out.append(v)
        res.update(missing)
        fetch.append(tuple(missing))
        evict.append(tuple(out))
        after.append(frozenset(res))
    return EvictionPlan(tuple(fetch), tuple(evict), tuple(after))

