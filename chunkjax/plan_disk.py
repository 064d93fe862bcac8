"""Disk as a placement of the one plan: which offloaded chunks keep their master params and
optimizer state on storage (update location ``storage``) when the host cannot hold them.

Smart-Infinity (Jang et al., HPCA 2024, arXiv 2403.06664) keeps the optimizer state on storage
and updates it next to the storage device (SmartUpdate); ZeRO-Infinity keeps it there when host
memory runs out. Here the tide plan (:func:`chunkjax.plan.plan_schedule`) first places chunks on
the device and in host memory; when the host budget cannot hold the offloaded chunks' state, the
fewest of them move to ``storage``: their compute params stay in pinned host memory (fetched as
any host chunk's), their gradients leave the device as a host chunk's do, and their master
params and state (12 bytes per AdamW parameter) live in chunk files on the storage directories
(:mod:`chunkjax.storage.files`), read and written once per step by the near-storage workers
(:mod:`chunkjax.storage.updater`). Each moved chunk saves its state on the host and costs its
state twice on the disk link (:mod:`chunkjax.predict`: ``disk_bytes_per_step``, the storage time
of :class:`chunkjax.cost.PipelinedStepTime`). Pure: nothing is allocated or written.
"""
from __future__ import annotations

import math

from chunkjax import predict as pr
from chunkjax.errors import PlanError, gib_ceil
from chunkjax.schedule import HOST_UPDATE, STORAGE_UPDATE, STREAMED_UPDATE, Schedule

#: A step writes a new version of every storage chunk's file before the old one goes (the
#: two-phase commit of :mod:`chunkjax.storage.files`): disk use is up to twice the state
#: (``StorageOptions(keep_previous=False)``: once).
DISK_VERSIONS = 2

_MSG_HOST_DISK = ("host budget {host} bytes is below the {need} bytes the host must hold even with {n} chunks' "
                  "master params and optimizer state on {d} storage director{ies} (disk budget {disk}): use "
                  "host_budget >= {need_gib:.3f}GiB, more disk space or a larger device budget")


def place_on_disk(chunk_size: int, traces, tide, cb: pr.ChunkBytes, param_kinds, update_locations, fetch,
                  segments, moment_bytes, prediction, *, host_budget: int, disk_budget: int | None,
                  storage_devices: int, rates, flops_per_step: float, disk_versions: int = DISK_VERSIONS):
    """Move the fewest offloaded chunks (``host`` or ``streamed``) to ``storage`` so that the
    prediction's host bytes fit ``host_budget``: streamed chunks first, then host chunks whose
    gradients complete last (their host updates are the least overlapped with the backward).

    Args:
      chunk_size, traces, tide, cb, param_kinds, update_locations, fetch, segments, moment_bytes,
        rates, flops_per_step: as :func:`chunkjax.predict.predict`.
      prediction: the prediction of ``update_locations`` (returned when it already fits).
      host_budget: host bytes for model data (bytes).
      disk_budget: bytes the storage directories may hold (None: unbounded); a step holds
        ``disk_versions`` versions of each storage chunk (:data:`DISK_VERSIONS`).
      storage_devices: storage directories (>= 1).

    Returns:
      ``(update_locations, prediction)``: the fitting placement, or the one with the most chunks
      on disk that the disk budget allows when none fits (the caller's host check rejects it).
    """
    if prediction.host_model_bytes <= host_budget:
        return tuple(update_locations), prediction
    T = len(tide.moments)
    done = pr.grad_done_moments(traces, tide)
    order = sorted((c for c, u in enumerate(update_locations) if u in (HOST_UPDATE, STREAMED_UPDATE)),
                   key=lambda c: (update_locations[c] != STREAMED_UPDATE, -done.get(c, T), c))
    if disk_budget is not None:
        order = order[:max(0, disk_budget // (disk_versions * max(1, pr.disk_file_bytes(cb))))]
    if not order:
        return tuple(update_locations), prediction

    def at(j):
        moved = set(order[:j])
        loc = tuple(STORAGE_UPDATE if c in moved else u for c, u in enumerate(update_locations))
        return loc, pr.predict(chunk_size, traces, tide, cb, param_kinds, loc, fetch, segments, moment_bytes,
                               flops_per_step=flops_per_step, rates=rates, storage_devices=storage_devices)

    staging = storage_devices * pr.STORAGE_STAGING_BUFFERS * pr.disk_file_bytes(cb)
    j = min(len(order), max(1, math.ceil((prediction.host_model_bytes + staging - host_budget) / max(1, cb.state))))
    loc, pred = at(j)
    while pred.host_model_bytes > host_budget and j < len(order):
        j += 1
        loc, pred = at(j)
    return loc, pred


def host_disk_error(host_budget: int, need: int, n_chunks: int, storage_devices: int,
                    disk_budget: int | None) -> PlanError:
    """The one-line error of a host budget too small even with the disk tier at its fullest."""
    return PlanError(_MSG_HOST_DISK.format(host=host_budget, need=need, n=n_chunks, d=storage_devices,
                                           ies="y" if storage_devices == 1 else "ies",
                                           disk="unbounded" if disk_budget is None else f"{disk_budget} bytes",
                                           need_gib=gib_ceil(need)), 0, False)


def storage_line(schedule: Schedule, storage_devices: int, host_budget: int | None) -> str | None:
    """One line on the disk tier of a plan made with ``storage_devices`` directories: ``"storage
    not needed: ..."`` when every chunk fits without it, else the chunks on disk and the disk
    bytes and time per step; None without storage directories."""
    if not storage_devices:
        return None
    p = schedule.predicted
    gb = lambda b: b / 1e9  # noqa: E731
    if not p.storage_chunks:
        held = "an unbounded host budget" if host_budget is None else f"the host budget of {gb(host_budget):.2f} GB"
        return (f"storage not needed: the plan's {gb(p.host_model_bytes):.2f} GB of host model data fits {held} "
                f"({schedule.counts()})")
    return (f"storage: {p.storage_chunks} of {schedule.n_chunks} chunks' master params and optimizer state on "
            f"{storage_devices} storage director{'y' if storage_devices == 1 else 'ies'}; disk "
            f"{gb(p.disk_bytes_per_step):.2f} GB/step read+written, predicted disk update "
            f"{p.time.storage_update_s:.2f} s of a {p.time.step_s:.2f} s step; host model data "
            f"{gb(p.host_model_bytes):.2f} GB")
