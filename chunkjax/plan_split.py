"""Update placement by rate: which host-updated chunks of a tide plan stream their update through
the device instead (ZeRO-Offload++ / ZenFlow's split of the update between GPU and CPU), part of
the one planner (:func:`chunkjax.plan.plan_schedule`). Pure: nothing is allocated.
"""
from __future__ import annotations

import dataclasses

from chunkjax import predict as pr
from chunkjax.cost import Rates
from chunkjax.predict import ChunkBytes
from chunkjax.schedule import HOST_UPDATE, STREAMED_UPDATE
from chunkjax.tide import Tide

#: predicted step times within this fraction of the fastest count as a tie
NEAR_TIE = 0.02


def split_updates(chunk_size: int, traces, tide: Tide, cb: ChunkBytes, budget: int, param_kinds, update_locations,
                  fetch, segments, moment_bytes, *, rates: Rates, flops_per_step: float, streamed_early: bool = False,
                  window: int = pr.GRAD_WINDOW_PROGRAMS, predict=pr.predict, fits=None):
    """Update placement by rate (ZeRO-Offload++ / ZenFlow's split of the update between GPU and
    CPU): move some host-updated chunks to ``streamed`` (state moved through the device by
    :mod:`chunkjax.streamed`, both PCIe directions in flight, while the host thread runs) in the
    number that minimises the predicted step time, ``fwd + bwd + device updates + max(host tail,
    streamed tail)`` (:class:`chunkjax.cost.PipelinedStepTime`).

    Two ways of choosing ``j`` chunks are searched: the ``j`` whose gradients complete last, and
    ``j`` spread evenly over the order in which gradients complete (host thread and pipeline
    then both work from the first programs on). For each, the host tail shrinks and the streamed
    tail grows with ``j``, so the best count is found by bisection on where they cross, among the
    counts whose peak fits ``budget``; counts within :data:`NEAR_TIE` of the fastest go to the
    fewest chunks moved (fewer bytes over PCIe), and no chunk moves when that is itself within
    :data:`NEAR_TIE`. With ``streamed_early`` both ways of running the streamed chunks are
    searched too, from the end of the program completing each gradient (the pipeline's bytes on
    the device from the first such program's end: a higher peak) and from the backward's end.
    The fastest wins (ties: after the backward, the last-completing chunks).

    Args:
      chunk_size, traces, tide, cb, param_kinds, fetch, segments, moment_bytes, rates,
        flops_per_step: as :func:`chunkjax.predict.predict`.
      budget: the device budget (bytes): a split whose peak passes it is not taken.
      update_locations: per chunk; its ``"host"`` chunks are the candidates.
      streamed_early: the step may start streamed updates early
        (:func:`chunkjax.streamed.starts_early`).
      window: the step's gradient window (``Schedule.grad_window``).
      predict: :func:`chunkjax.predict.predict` or the plan's memo of it
        (:func:`chunkjax.plan_memo.predictor`).
      fits: ``(update_locations, prediction) -> bool``, the caller's host check (None: none): the
        counts whose split it refuses are not taken (a streamed chunk's state is pinned and
        written back beside the old one, so the host bytes grow with the count).

    Returns:
      ``(update_locations, prediction, early)`` of the fastest split (the input's when no chunk
      moves; ``early``: the streamed chunks start as their program ends).
    """
    T = len(tide.moments)
    done = pr.grad_done_moments(traces, tide)
    first = sorted((c for c, u in enumerate(update_locations) if u == HOST_UPDATE), key=lambda c: (done.get(c, T), c))
    m = len(first)
    picks = (lambda j: first[m - j:],  # the last to complete
             lambda j: [first[(2 * i + 1) * m // (2 * j)] for i in range(j)])  # spread over the backward
    best = None
    for early in (False, True) if streamed_early else (False,):
        for pick in picks:
            loc, pred = _split_one(chunk_size, traces, tide, cb, budget, param_kinds, update_locations, fetch, segments,
                                   moment_bytes, m, pick, rates, flops_per_step, early, window, predict, fits)
            if best is None or pred.time.step_s < best[1].time.step_s:
                best = loc, pred, early and STREAMED_UPDATE in loc
    return best


def _split_one(chunk_size, traces, tide, cb, budget, param_kinds, update_locations, fetch, segments, moment_bytes,
               m, pick, rates, flops_per_step, early, window=pr.GRAD_WINDOW_PROGRAMS, predict=pr.predict, fits=None):
    """:func:`split_updates` for one way of choosing ``j`` of the ``m`` host chunks (``pick(j)``)
    and one way of running the streamed chunks."""
    memo: dict = {}

    def at(j):
        if j not in memo:
            moved = set(pick(j)) if j else set()
            loc = tuple(STREAMED_UPDATE if c in moved else u for c, u in enumerate(update_locations))
            memo[j] = loc, predict(chunk_size, traces, tide, cb, param_kinds, loc, fetch, segments, moment_bytes,
                                   flops_per_step=flops_per_step, rates=rates, streamed_early=early, window=window)
        return memo[j]

    def ok(j):  # the device peak and the host bytes grow with j: the most chunks that fit
        loc, pred = at(j)
        return pred.peak_device_bytes <= budget and (fits is None or fits(loc, pred))

    base = at(0)
    top = m
    if top and not ok(top):
        a, b = 0, top
        while a < b:
            mid = (a + b + 1) // 2
            a, b = (mid, b) if ok(mid) else (a, mid - 1)
        top = a
    if top == 0:
        return base
    lo, hi = 1, top  # the smallest j whose streamed tail reaches the host tail
    while lo < hi:
        mid = (lo + hi) // 2
        t = at(mid)[1].time
        if t.streamed_update_s + (t.device_update_s if t.cross_step else 0.0) >= _host_side(t):
            hi = mid
        else:
            lo = mid + 1
    cands = {j: at(j) for j in {lo - 1, lo} - {0}}
    fastest = min(c[1].time.step_s for c in cands.values())
    tie = fastest * (1 + NEAR_TIE)
    if base[1].time.step_s <= tie:
        return base
    a, b = 1, max(j for j, c in cands.items() if c[1].time.step_s == fastest)
    while a < b:  # near-ties go to the fewest streamed chunks (fewest bytes moved): the time falls up to b
        mid = (a + b) // 2
        if at(mid)[1].time.step_s <= tie:
            b = mid
        else:
            a = mid + 1
    return at(a)


def split_schedule(s, chunk_size: int, traces, tide: Tide, cb: ChunkBytes, moment_bytes, *, rates: Rates,
                   flops_per_step: float, streamed_early: bool = False, predict=pr.predict, fits=None):
    """:func:`split_updates` of a :class:`~chunkjax.schedule.Schedule` ``s`` (its placement, fetches,
    cut, window and ``budget_bytes``; ``moment_bytes`` without the early pipeline's bytes): ``s``
    with the fastest split's update locations, prediction and streamed start. ``fits``:
    ``schedule -> bool``, the caller's host check of each count tried (None: none)."""
    ok = None if fits is None else (lambda loc, pred: fits(dataclasses.replace(s, update_locations=loc, predicted=pred)))
    loc, pred, early = split_updates(chunk_size, traces, tide, cb, s.budget_bytes, s.param_kinds, s.update_locations,
                                     s.fetch, s.segments, moment_bytes, rates=rates, flops_per_step=flops_per_step,
                                     streamed_early=streamed_early, window=s.grad_window, predict=predict, fits=ok)
    return dataclasses.replace(s, update_locations=loc, predicted=pred, streamed_early=early)


def _host_side(t) -> float:
    """The host's share of a step's tail (:class:`chunkjax.cost.PipelinedStepTime`): its exposed
    update and, with cross-step overlap, the seconds by which its whole work outlasts the forward,
    the backward and the window's stalls (the step is never shorter than the host thread's work,
    so a split that only hides the host tail behind the next forward still shortens a host-bound
    step)."""
    if not t.cross_step:
        return t.host_update_exposed_s
    return max(t.host_update_exposed_s, t.host_update_s - t.forward_s - t.backward_s - t.window_stall_s)
