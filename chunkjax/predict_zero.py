"""ZeRO accounting per rank: what one rank of a data mesh moves, holds and sends per step.

A ZeRO schedule (Rajbhandari et al., SC 2020, stages 1-3; :func:`chunkjax.plan.plan_schedule` with
``ranks`` and ``zero_stage``) is planned with one rank's chunk bytes
(:meth:`chunkjax.predict.ChunkBytes.per_rank`), so its peak and step time are already the rank's;
:func:`per_rank` turns its bytes moved and held into the rank's, and :func:`collective_bytes` gives
the all-gather / reduce-scatter / all-reduce bytes the rank sends (ring algorithms; accounted, not
timed). Pure functions of shapes: nothing is allocated.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.predict import F32_BYTES, ChunkBytes, shard_bytes
from chunkjax.schedule import DEVICE_UPDATE, HOST_UPDATE, NO_UPDATE, STREAMED_UPDATE, Prediction, Schedule
from chunkjax.tide import Tide
from chunkjax.trace import StageTrace


def per_rank(pred: Prediction, cb: ChunkBytes, ranks: int, zero_stage: int, update_locations,
             param_kinds=None) -> Prediction:
    """One rank's bytes moved and held for a schedule planned with ``cb.per_rank(ranks, zero_stage)``
    (whose peak and step time are already the rank's): a fetch moves the rank's shard (stage 3) or
    the whole chunk (stages 1/2), an offloaded chunk's gradient leaves as the rank's shard, and
    the host holds the rank's shard of state and gradient (bytes; ``cb`` is the whole chunk's).
    A frozen chunk (update ``none``) holds its params' shard on the host when ``param_kinds``
    puts them there."""
    unit = shard_bytes(cb.params, ranks) if zero_stage == 3 else cb.params
    off = sum(u in (HOST_UPDATE, STREAMED_UPDATE) for u in update_locations)
    frozen = sum((shard_bytes(cb.params_of(c), ranks) if zero_stage == 3 else cb.params_of(c))
                 for c, u in enumerate(update_locations)
                 if u == NO_UPDATE and (param_kinds is None or param_kinds[c] == PINNED_HOST))
    host = off * (unit + shard_bytes(cb.state, ranks) + shard_bytes(cb.grad, ranks)) + frozen
    shard_elems, n = shard_bytes(cb.master, ranks) // F32_BYTES, len(update_locations)
    return dataclasses.replace(pred, h2d_bytes_per_step=pred.n_fetches * unit,
                               fetch_bytes_per_step=pred.n_fetches * unit,
                               d2h_bytes_per_step=off * shard_bytes(cb.grad, ranks),
                               host_model_bytes=host, host_bytes=host, host_working_bytes=0,  # every gradient counted
                               host_bytes_per_param=host / (n * shard_elems) if n and shard_elems else 0.0,
                               host_resident_bytes_per_param=(host - frozen) / (off * shard_elems) if off else 0.0)


def collective_bytes(s: Schedule, traces: Sequence[StageTrace], tide: Tide, chunk_size: int, ranks: int,
                     zero_stage: int = 3, itemsize: int = 2) -> dict[str, int]:
    """Bytes one rank sends per step by collective for a ZeRO schedule, for ring algorithms (an
    all-gather or reduce-scatter of a C-byte chunk moves ``(N-1)/N * C`` per rank, an all-reduce
    twice that; scalar reductions left out). Stage 3 gathers a chunk at every fetch and a
    device-resident chunk at every moment that reads it; stages 1/2 gather the new params of each
    device- or streamed-updated chunk once. Every chunk a stage reads has its gradient
    reduce-scattered (stages 2/3) or all-reduced (stage 1). Accounted, not timed.

    Args:
      s: the schedule; traces, tide: its stage traces and tide.
      chunk_size: elements per chunk; ranks: N; zero_stage: 1, 2 or 3.
      itemsize: bytes per compute-dtype element (bf16: 2).

    Returns:
      ``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` (bytes per step per rank).
    """
    cbytes = chunk_size * itemsize
    part = lambda k: (k * (ranks - 1) * cbytes) // ranks  # noqa: E731
    if zero_stage == 3:
        gathers = sum(sum(1 for c in m.chunks if s.param_kinds[c] == DEVICE) + len(s.fetch[t])
                      for t, m in enumerate(tide.moments))
    else:
        gathers = sum(u in (DEVICE_UPDATE, STREAMED_UPDATE) for u in s.update_locations)
    graded = len({c for t in traces for c in t.chunks if s.update_locations[c] != NO_UPDATE})
    out = {"all_gather": part(gathers), "reduce_scatter": part(graded) if zero_stage != 1 else 0,
           "all_reduce": 2 * part(graded) if zero_stage == 1 else 0}
    out["total"] = sum(out.values())
    return out
