"""Per-rank planning of a ZeRO run (issue 5, item 4): one rank's chunk bytes and schedule.

Every chunk is sharded over the ``N`` ranks of a ``data`` mesh (the step:
``chunkjax.make_chunked_step(..., mesh=data_mesh(), zero_stage=...)``, :mod:`chunkjax.topology`),
so each rank plans its own device memory: :func:`rank_chunk_bytes` gives one rank's bytes of a
chunk and :func:`plan_zero_schedule` runs :func:`chunkjax.schedule.plan_schedule` with them.
"""
from __future__ import annotations

import dataclasses

from chunkjax.plan import ChunkBytes
from chunkjax.schedule import Schedule, plan_schedule


def rank_chunk_bytes(cb: ChunkBytes, n_ranks: int, zero_stage: int = 3) -> ChunkBytes:
    """Bytes of one chunk on one rank, for planning each rank's device memory with
    :func:`chunkjax.schedule.plan_schedule` (the planner's ``params`` figure is what a fetched or
    resident chunk occupies while read).

    Master params, optimizer state and gradients: the rank's 1/N (rounded up). Compute params:
    stage 3, the gathered full chunk plus the rank's shard (a conservative figure: a resident
    chunk holds only its shard between reads); stages 1/2, the full chunk.

    Raises:
      ValueError: ``n_ranks < 1`` or a stage other than 1/2/3.
    """
    if n_ranks < 1 or zero_stage not in (1, 2, 3):
        raise ValueError(f"need n_ranks >= 1 and zero_stage in 1/2/3, got {n_ranks}, {zero_stage}")
    shard = lambda b: -(-int(b) // n_ranks)  # noqa: E731
    params = cb.params + shard(cb.params) if zero_stage == 3 else cb.params
    return ChunkBytes(params=params, grad=shard(cb.grad), master=shard(cb.master), opt=shard(cb.opt))


def plan_zero_schedule(layout, traces, cb: ChunkBytes, device_budget_bytes: int, n_ranks: int,
                       zero_stage: int = 3, **kw) -> Schedule:
    """:func:`chunkjax.schedule.plan_schedule` for every rank of a ZeRO run (issue 5, item 4).

    Args:
      layout: the (ZeRO) chunk layout.
      traces: stage traces of the *per-rank* batch (B / N rows): its non-model bytes are one
        rank's.
      cb: whole-chunk bytes (:func:`chunkjax.chunk_bytes`).
      device_budget_bytes: each rank's device budget (bytes).
      n_ranks, zero_stage: the mesh size and ZeRO stage.
      **kw: passed to ``plan_schedule`` (flops_per_step of one rank, host_update, rates, ...).

    Returns:
      The schedule; its predicted peak is each rank's (with :func:`rank_chunk_bytes`), and its
      predicted bytes moved are per rank: a fetch moves the rank's shard (stage 3) or the chunk,
      an offloaded gradient leaves as the rank's shard.

    Raises:
      chunkjax.PlanError: no placement fits a rank's budget.
    """
    s = plan_schedule(layout, traces, rank_chunk_bytes(cb, n_ranks, zero_stage), device_budget_bytes, **kw)
    shard = lambda b: -(-int(b) // n_ranks)  # noqa: E731
    unit = shard(cb.params) if zero_stage == 3 else cb.params
    off = sum(u != "device" for u in s.update_locations)
    p = s.predicted
    pred = dataclasses.replace(p, h2d_bytes_per_step=p.n_fetches * unit, fetch_bytes_per_step=p.n_fetches * unit,
                               d2h_bytes_per_step=off * shard(cb.grad),
                               host_model_bytes=off * (unit + shard(cb.state) + shard(cb.grad)))
    return dataclasses.replace(s, predicted=pred)
