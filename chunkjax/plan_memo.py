"""Each distinct candidate schedule predicted once within one plan.

The tide policy's searches (:func:`chunkjax.plan.plan_schedule`) meet the same candidate many
times: a placement's own prediction is the first candidate of its update split
(:func:`chunkjax.plan_split.split_updates`), both ways of choosing the streamed chunks end at the
same all-streamed one, and the program-cut search (:func:`chunkjax.program_cut.choose_program_cut`)
times again the cuts and placements the split and the early-start placements revisit.

:func:`predictor` gives :func:`chunkjax.predict.predict` with a memo owned by the caller: the
planner makes one per :func:`~chunkjax.plan.plan_schedule` call and drops it with the call, so
nothing is kept between plans. :func:`chunkjax.predict.predict` is a pure function of its
arguments and its :class:`~chunkjax.schedule.Prediction` is immutable, so a repeat gets the very
prediction the first call made.
"""
from __future__ import annotations

from typing import Callable

from chunkjax import predict as pr
from chunkjax.schedule import Prediction

#: Predictions one memo holds at most (a GPT3_6B plan of 164 chunks asks for about 700); past
#: it the memo is cleared and fills again (bounded memory, never a different result).
MAX_ENTRIES = 1 << 14


def _key(args: tuple, kw: dict) -> tuple:
    """A hashable key equal for calls :func:`chunkjax.predict.predict` answers alike: the plan's
    traces, tide and chunk bytes by identity (the same objects throughout a plan; hashing their
    contents on every call cost as much as a tenth of a large plan), the rest by value: sequences
    as tuples, ``master_fetch`` as a sorted tuple (predict reads it as a set)."""
    chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes = args
    kw = dict(kw)
    if "master_fetch" in kw:
        kw["master_fetch"] = tuple(sorted(set(kw["master_fetch"])))
    return (int(chunk_size), id(traces), id(tide), id(cb), tuple(param_kinds), tuple(update_locations),
            tuple(tuple(f) for f in fetch), tuple(segments), tuple(moment_bytes), tuple(sorted(kw.items())))


def predictor(**defaults) -> Callable[..., Prediction]:
    """:func:`chunkjax.predict.predict` (same arguments) that computes each distinct call once
    (:func:`_key`; traces, tide and chunk bytes are never mutated: frozen dataclasses and tuples);
    the memo lives as long as the returned function (at most :data:`MAX_ENTRIES` predictions).
    ``defaults``: keyword arguments of every call (e.g. ``cross_step=True, prefetch=1``)."""
    memo: dict[tuple, Prediction] = {}
    held: dict[int, object] = {}  # the objects keyed by identity, kept alive so that no id is reused

    def predict(chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes,
                **kw) -> Prediction:
        args = (chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes)
        kw = defaults | kw
        key = _key(args, kw)
        out = memo.get(key)
        if out is None:
            if len(memo) >= MAX_ENTRIES:
                memo.clear()
            for x in (traces, tide, cb):
                held.setdefault(id(x), x)
            out = memo[key] = pr.predict(*args, **kw)
        return out
    return predict
