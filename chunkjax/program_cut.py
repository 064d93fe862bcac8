"""Where the step's backward is cut into programs, and how many programs' host gradients may
exist at once (the gradient window): chosen by the cost model's timeline (issue 23).

A pipelined step (:class:`chunkjax.ChunkedStep`) runs one jitted program per segment; as each
ends, its host chunks' gradients go to the host thread and its streamed chunks' to the streamed
pipeline. The cut decides when the host can start and how much it gets at once; the window
(``Schedule.grad_window``) how far the device may run ahead of the host
(:meth:`chunkjax.updaters.HostWork.hand_over`) and so how many host gradients sit in pinned
host memory at once (:func:`chunkjax.predict.grad_window_bytes`, counted in the host bytes).
:func:`choose_program_cut` times every candidate on one timeline
(:func:`chunkjax.cost.program_timeline`) and keeps the fastest that fits both budgets:

* the doubling cut (:func:`auto_segments`): the backward cut from its end in sizes 1, 2, 4, ...;
* uniform cuts: the backward in equal programs (:data:`UNIFORM_PROGRAMS`);
* host-balanced cuts (:func:`chunkjax.host_forms.host_balanced_segments`): equal numbers of host
  gradients per program;

each with a window of 2 to :data:`MAX_WINDOW` programs and, where the step allows it
(:func:`chunkjax.streamed.starts_early`), streamed updates started as their gradients are ready.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from chunkjax import predict as pr
from chunkjax.host_forms import host_balanced_segments
from chunkjax.plan_split import split_updates
from chunkjax.schedule import DEVICE_UPDATE, HOST_UPDATE, STREAMED_UPDATE, Schedule

#: Programs at most in a candidate cut (each program is one more compile and launch).
MAX_PROGRAMS = 12
#: Largest gradient window tried (programs).
MAX_WINDOW = 8
#: Resident counts below the fastest plan's tried with the early streamed pipeline's bytes
#: reserved during the backward (:func:`cut_and_start`).
EARLY_RESIDENT_STEPS = 3
#: A candidate replaces the planned cut only when predicted faster by more than this fraction
#: (the cost model's resolution; fewer programs compile faster).
CUT_GAIN = 0.005


def auto_segments(n_moments: int, n_stages: int, max_programs: int = 8) -> tuple[int, ...]:
    """Program starts for a pipelined step: the first program holds the forward pass and the
    fused head; the backward is cut from its end in sizes 1, 2, 4, ... (at most ``max_programs``
    programs), the rest of it being one program. The host thread updates a program's chunks
    while the next ones run; the last program's are the update that cannot overlap."""
    starts, size, end = [], 1, n_moments
    first_bwd = n_stages  # moments 0..n-2 forward, n-1 fused, n.. backward
    while len(starts) < max_programs - 2 and end - size >= first_bwd:
        starts.append(end - size)
        end -= size
        size *= 2
    if end > first_bwd:  # the host starts on the head's gradients while the backward runs
        starts.append(first_bwd)
    return tuple([0] + sorted(set(starts)))


def uniform_segments(n_moments: int, n_stages: int, size: int) -> tuple[int, ...]:
    """Program starts: the forward and the fused head one program, the backward in programs of
    ``size`` moments (>= 1), the last one shorter when ``size`` does not divide it."""
    first_bwd = n_stages
    return tuple([0] + list(range(first_bwd, n_moments, max(1, int(size)))))


#: Backward programs of the uniform cuts tried, and programs of the host-balanced ones (each at
#: most :data:`MAX_PROGRAMS` with the forward's).
UNIFORM_PROGRAMS = (2, 3, 4, 5, 6, 8, 11)
BALANCED_PROGRAMS = (4, 6, 8, 12)


def forward_cut(segments: Sequence[int], n_stages: int, programs: int) -> tuple[int, ...]:
    """``segments`` with the forward (moments ``0 .. n_stages - 2``) cut into ``programs`` equal
    programs (cross-step overlap: each waits only for the previous step's host chunks it takes,
    :mod:`chunkjax.cross_step`)."""
    n_fwd = n_stages - 1
    size = max(1, -(-n_fwd // max(1, int(programs))))
    return tuple(sorted(set(segments) | set(range(0, n_fwd, size))))


#: Forward programs of the cuts tried with cross-step overlap (:func:`forward_cut`).
FORWARD_PROGRAMS = (2, 4, 8)
#: ``(forward, backward)`` levels of the turn cuts tried with cross-step overlap (:func:`turn_cut`).
TURN_LEVELS = ((0, 1), (0, 2), (0, 3), (1, 0), (2, 0), (3, 0), (1, 1), (2, 2), (2, 3), (3, 3))


def turn_cut(segments: Sequence[int], n_moments: int, n_stages: int, forward_levels: int,
             backward_levels: int) -> tuple[int, ...]:
    """``segments`` cut finer at the step's turn, where the forward ends and the backward begins:
    the forward's last programs end in sizes 1, 2, 4, ... moments (``forward_levels`` new
    starts; the fused head, moment ``n_stages - 1``, stays with the forward's last moment) and the
    backward's first programs (from moment ``n_stages``) in sizes 1, 2, 4, ... (``backward_levels``
    new starts).

    Why (cross-step overlap, :mod:`chunkjax.cross_step`): when the host kernel is the bottleneck,
    the host thread idles from its last update of a step (the chunks the next forward reads last)
    until the next backward's first host gradients: the rest of the forward program that waited
    for that update, the head, and the backward's first program. Small programs there shorten
    that idle time; the cost model times it (:func:`chunkjax.cost.cross_step_wait`,
    :func:`chunkjax.cost.program_timeline`), so the search keeps a turn cut only where it predicts
    a faster step. PatrickStar (arXiv 2108.05818) section 5: the CPU's chunk updates overlap the
    GPU's work.
    """
    extra = set()
    end, size = n_stages - 1, 1
    for _ in range(max(0, int(forward_levels))):
        if end - size <= 0:
            break
        end -= size
        extra.add(end)
        size *= 2
    start, size = n_stages, 1
    for _ in range(max(0, int(backward_levels))):
        start += size
        if start >= n_moments:
            break
        extra.add(start)
        size *= 2
    return tuple(sorted(set(segments) | extra))


def candidate_cuts(n_moments: int, n_stages: int, done_moments: Sequence[int],
                   max_programs: int = MAX_PROGRAMS) -> list[tuple[int, ...]]:
    """The cuts :func:`choose_program_cut` tries, without repeats, the doubling cut first: uniform
    cuts of :data:`UNIFORM_PROGRAMS` backward programs and host-balanced cuts of
    :data:`BALANCED_PROGRAMS` programs (``done_moments``: per host-updated chunk, the moment its
    gradient completes), none of more than ``max_programs`` programs."""
    out = [auto_segments(n_moments, n_stages)]
    n_bwd = n_moments - n_stages
    if n_bwd > 0:
        out += [uniform_segments(n_moments, n_stages, -(-n_bwd // p)) for p in UNIFORM_PROGRAMS]
    out += [cut for p in BALANCED_PROGRAMS
            if (cut := host_balanced_segments(n_moments, n_stages, done_moments, max_programs=p)) is not None]
    return [c for i, c in enumerate(out) if c not in out[:i] and len(c) <= max_programs]


def _windows_of(windows: Sequence[int], n_programs: int) -> list[int]:
    """The ``windows`` that time a cut of ``n_programs`` programs differently, in order: a window
    of at least ``n_programs`` never holds a program back and counts every program's host
    gradients (:func:`chunkjax.cost.program_timeline`, :func:`chunkjax.predict.grad_window_bytes`),
    so after the first such window the others predict the same step and are not tried (the
    search keeps the first of equal times)."""
    out, whole = [], False
    for w in windows:
        if w >= n_programs:
            if whole:
                continue
            whole = True
        out.append(w)
    return out


def choose_program_cut(s: Schedule, cb: pr.ChunkBytes, *, chunk_size: int, traces, tide, rates,
                       flops_per_step: float, fits: Callable[[Schedule], bool], micro_batches: int = 1,
                       streamed_early: bool = False, split: bool = False,
                       windows: Sequence[int] = range(2, MAX_WINDOW + 1), predict=pr.predict,
                       cross_step: bool = False, turn: bool = True) -> Schedule:
    """The schedule ``s`` (one device, its placement and host forms decided) with the program
    cut, gradient window and streamed start that the cost model predicts fastest
    (:mod:`chunkjax.program_cut`), among those whose device peak stays within
    ``s.budget_bytes`` and that ``fits`` (the caller's host check: the window's gradients are
    host bytes). With ``split`` (and no master-fetch chunk) the update work is split again
    between host and streamed chunks for the best cut found
    (:func:`chunkjax.plan_split.split_updates`) and the cut searched once more. ``s`` itself
    when no candidate is faster by :data:`CUT_GAIN`, or when it has no host chunk or a storage
    chunk. Micro-batches run every program once per pass (``micro_batches`` passes: per
    micro-batch, or in-program groups): the cut is chosen on the last pass's timeline and the
    forward cuts shorten the wait of the next step's first pass
    (:func:`chunkjax.cost.predict_pipelined_step` ``passes``).

    Args:
      s: the planned :class:`~chunkjax.schedule.Schedule`.
      cb: one chunk's bytes.
      chunk_size, traces, tide, rates, flops_per_step, micro_batches: as :func:`chunkjax.predict.predict`.
      fits: ``schedule -> bool``, the host budget check.
      streamed_early: the step may start streamed updates early (:func:`chunkjax.streamed.starts_early`).
      split: the update locations may be re-split between ``host`` and ``streamed``.
      windows: gradient windows tried (programs, each >= 1).
      predict: :func:`chunkjax.predict.predict` or the plan's memo of it
        (:func:`chunkjax.plan_memo.predictor`).
      cross_step: the step runs with cross-step overlap: the best cut's forward is also tried cut
        into :data:`FORWARD_PROGRAMS` programs (:func:`forward_cut`; ``predict`` must time the
        step that way), then the best cut so far cut finer at the turn (:data:`TURN_LEVELS`,
        :func:`turn_cut`) when ``turn``.
      turn: try the turn cuts (with ``cross_step``; False: the cuts before them, for comparisons).

    Returns:
      a :class:`~chunkjax.schedule.Schedule` (``segments``, ``grad_window``, ``streamed_early``,
      ``update_locations`` and the prediction redone).
    """
    host = [c for c, u in enumerate(s.update_locations) if u == HOST_UPDATE]
    if not host or s.predicted.storage_chunks:
        return s
    T, n = len(tide.moments), len(traces)
    done = pr.grad_done_moments(traces, tide)
    # the device bytes without the early pipeline's (predict adds them back for the cut it is given)
    early_x = pr.streamed_early_extra(chunk_size, cb, traces, tide, s.param_kinds, s.update_locations, s.segments,
                                      s.streamed_early)
    base = [b - e for b, e in zip(s.predicted.device_bytes_per_moment, early_x)]

    def search(x: Schedule, best: Schedule, best_t: float) -> tuple[Schedule, float]:
        has_streamed = STREAMED_UPDATE in x.update_locations
        starts = sorted({bool(x.streamed_early), bool(streamed_early and has_streamed)})
        hosts = [c for c, u in enumerate(x.update_locations) if u == HOST_UPDATE]
        cuts = candidate_cuts(T, n, [done[c] for c in hosts if c in done])

        def candidates():  # read ``best`` as the search has it when each is made
            yield from cuts
            if cross_step:
                for programs in FORWARD_PROGRAMS:  # the best cut so far, its forward cut
                    yield forward_cut(best.segments, n, programs)
                if turn:  # the best cut so far, cut finer at the turn
                    base = tuple(best.segments)
                    yield from (c for c in (turn_cut(base, T, n, *lv) for lv in TURN_LEVELS) if c != base)

        for segs in candidates():
            for w in _windows_of(windows, len(segs)):
                for early in starts:
                    pred = predict(chunk_size, traces, tide, cb, x.param_kinds, x.update_locations, x.fetch, segs,
                                   base, flops_per_step=flops_per_step, rates=rates, master_fetch=x.master_fetch,
                                   micro_batches=micro_batches, streamed_early=early, window=w)
                    if pred.time.step_s >= best_t or pred.peak_device_bytes > x.budget_bytes:
                        continue
                    cand = dataclasses.replace(x, segments=tuple(segs), grad_window=int(w), streamed_early=early,
                                               predicted=pred)
                    if fits(cand):
                        best, best_t = cand, pred.time.step_s
        return best, best_t

    # ``s`` timed as the candidates are (its prediction may come from a re-plan without the
    # cross-step overlap: the host forms' with micro-batches), so the first of equal times stays
    s = dataclasses.replace(s, predicted=predict(
        chunk_size, traces, tide, cb, s.param_kinds, s.update_locations, s.fetch, s.segments, base,
        flops_per_step=flops_per_step, rates=rates, master_fetch=s.master_fetch, micro_batches=micro_batches,
        streamed_early=s.streamed_early, window=s.grad_window))
    best, best_t = search(s, s, s.predicted.time.step_s * (1 - CUT_GAIN))
    if split and not s.master_fetch:
        loc0 = tuple(HOST_UPDATE if u == STREAMED_UPDATE else u for u in s.update_locations)
        loc, pred, early = split_updates(chunk_size, traces, tide, cb, s.budget_bytes, s.param_kinds, loc0, s.fetch,
                                         best.segments, base, rates=rates, flops_per_step=flops_per_step,
                                         streamed_early=streamed_early, window=best.grad_window,
                                         predict=lambda *a, **k: predict(*a, micro_batches=micro_batches, **k),
                                         fits=lambda loc, pred: fits(dataclasses.replace(best, update_locations=loc,
                                                                                         predicted=pred)))
        again = dataclasses.replace(best, update_locations=loc, streamed_early=early, predicted=pred)
        if pred.peak_device_bytes <= s.budget_bytes and fits(again):
            if pred.time.step_s < best_t:
                best, best_t = again, pred.time.step_s
            best, best_t = search(again, best, best_t)
    return best


def cut_and_start(best: Schedule, one, cb: pr.ChunkBytes, *, layout, traces, tide, rates, flops_per_step, fits,
                   micro_batches: int, streamed_early: bool, split: bool, predict=pr.predict,
                   cross_step: bool = False, turn: bool = True) -> Schedule:
    """``best`` (the planner's fastest tide schedule, one device) with the program cut and
    gradient window chosen on the step's timeline (:func:`choose_program_cut`); with
    ``streamed_early`` and ``split`` also the placements of ``best``'s resident count and the
    next :data:`EARLY_RESIDENT_STEPS` fewer with the early streamed pipeline's device bytes left
    free during the backward
    (``one(budget, resident, split=True, streamed_early=True, reserve=bytes)``), each with its
    own cut; the fastest that fits (others only when faster by :data:`CUT_GAIN`).

    Args:
      best: the :class:`~chunkjax.schedule.Schedule`.
      one: ``one(budget, resident, *, split, streamed_early, reserve) -> Schedule | None``: the
        planner's tide schedule of one resident set (host forms assigned; None: does not fit).
      cb, layout, traces, tide, rates, flops_per_step, micro_batches: the plan's.
      fits: ``schedule -> bool``, the host budget check.
      streamed_early: the step may start streamed updates early.
      split: the update work may be re-split between host and streamed chunks.
      predict: :func:`chunkjax.predict.predict` or the plan's memo of it
        (:func:`chunkjax.plan_memo.predictor`).
      cross_step, turn: :func:`choose_program_cut`'s.
    """
    def cut(s):
        return choose_program_cut(s, cb, chunk_size=layout.chunk_size, traces=traces, tide=tide, rates=rates,
                                  flops_per_step=flops_per_step, fits=fits, micro_batches=micro_batches,
                                  streamed_early=streamed_early, split=split, predict=predict, cross_step=cross_step,
                                  turn=turn)
    best = cut(best)
    if not (streamed_early and split) or best.streamed_early:
        return best
    k = sum(u == DEVICE_UPDATE for u in best.update_locations)
    reserve = pr.streamed_pipeline_bytes(layout.chunk_size, cb)
    for r in range(k, max(-1, k - 1 - EARLY_RESIDENT_STEPS), -1):
        e = one(best.budget_bytes, set(range(r)), split=True, streamed_early=True, reserve=reserve)
        if e is None or not fits(e):
            continue
        e = cut(e)
        if e.streamed_early and e.predicted.time.step_s < best.predicted.time.step_s * (1 - CUT_GAIN):
            best = e
    return best


def retime(s: Schedule, cb: pr.ChunkBytes, *, chunk_size: int, traces, tide, rates, flops_per_step: float,
           micro_batches: int = 1, segments: Sequence[int] | None = None, window: int | None = None,
           streamed_early: bool | None = None, cross_step: bool = False, norm_wait: bool = False,
           speculation_params: float | None = None, backup_bytes_per_param: float = 0.0) -> pr.Prediction:
    """The prediction of schedule ``s`` (one device) at other ``rates`` (e.g. a measured compute
    rate), and with another cut, window or streamed start where given (default: ``s``'s), with or
    without cross-step overlap (:mod:`chunkjax.cross_step`), with host updates from the backward's
    end when ``norm_wait`` (clipping fires: :mod:`chunkjax.clip_plan`), else with the speculation
    bounded to ``speculation_params`` parameters (None: unbounded) with ``backup_bytes_per_param``
    (:func:`chunkjax.cost.predict_pipelined_step`). Everything else (placement, update locations,
    host forms) is ``s``'s."""
    early_x = pr.streamed_early_extra(chunk_size, cb, traces, tide, s.param_kinds, s.update_locations, s.segments,
                                      s.streamed_early)
    base = [b - e for b, e in zip(s.predicted.device_bytes_per_moment, early_x)]
    return pr.predict(chunk_size, traces, tide, cb, s.param_kinds, s.update_locations, s.fetch,
                      s.segments if segments is None else tuple(segments), base, flops_per_step=flops_per_step,
                      rates=rates, master_fetch=s.master_fetch, micro_batches=micro_batches,
                      streamed_early=s.streamed_early if streamed_early is None else bool(streamed_early),
                      window=s.grad_window if window is None else int(window), cross_step=cross_step,
                      prefetch=s.prefetch, norm_wait=norm_wait, speculation_params=speculation_params,
                      backup_bytes_per_param=backup_bytes_per_param)
