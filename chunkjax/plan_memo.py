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
    """A hashable key equal for calls :func:`chunkjax.predict.predict` answers alike: sequences
    as tuples, ``master_fetch`` as a sorted tuple (predict reads it as a set)."""
    chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes = args
    kw = dict(kw)
    if "master_fetch" in kw:
        kw["master_fetch"] = tuple(sorted(set(kw["master_fetch"])))
    return (int(chunk_size), tuple(traces), tide, cb, tuple(param_kinds), tuple(update_locations),
            tuple(tuple(f) for f in fetch), tuple(segments), tuple(moment_bytes), tuple(sorted(kw.items())))


def predictor() -> Callable[..., Prediction]:
    """:func:`chunkjax.predict.predict` (same arguments, all of them hashable once sequences are
    tuples: traces, tide, ``ChunkBytes`` and ``Rates`` are frozen dataclasses) that computes each
    distinct call once; the memo lives as long as the returned function (at most
    :data:`MAX_ENTRIES` predictions)."""
    memo: dict[tuple, Prediction] = {}

    def predict(chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes,
                **kw) -> Prediction:
        args = (chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes)
        key = _key(args, kw)
        out = memo.get(key)
        if out is None:
            if len(memo) >= MAX_ENTRIES:
                memo.clear()
            out = memo[key] = pr.predict(*args, **kw)
        return out
    return predict
