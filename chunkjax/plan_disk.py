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

import dataclasses
import math

from chunkjax import predict as pr
from chunkjax.errors import PlanError, format_bytes, format_moved_bytes
from chunkjax.host_memory import storage_host_bytes
from chunkjax.storage.tier import IO_THREADS
from chunkjax.schedule import HOST_UPDATE, STORAGE_UPDATE, STREAMED_UPDATE, Schedule

#: A step writes a new version of every storage chunk's file before the old one goes (the
#: two-phase commit of :mod:`chunkjax.storage.files`): disk use is up to twice the state
#: (``StorageOptions(keep_previous=False)``: once).
DISK_VERSIONS = 2


def disk_chunks_fit(disk_budget: int, file_bytes: int, versions: int, workers: int) -> int:
    """Storage chunks whose files fit ``disk_budget`` bytes. With ``versions`` 2 (the two-phase
    commit) every chunk's new file is written before its old one goes: ``versions`` files a chunk.
    With 1 (``StorageOptions(keep_previous=False)``) each worker's :data:`~chunkjax.storage.tier.IO_THREADS`
    writes in flight each hold a new file beside its committed one: those files are counted too
    (session 21: GPT3_18B with 108 chunk files planned in exactly the directory's free bytes
    stopped its first step with ENOSPC).

    Args:
      disk_budget: bytes the storage directories may hold.
      file_bytes: one chunk file's bytes (:func:`chunkjax.predict.disk_file_bytes`).
      versions: :data:`DISK_VERSIONS` or 1.
      workers: near-storage worker processes (one :class:`~chunkjax.storage.tier.DiskTier` each).

    Returns:
      the number of chunks, >= 0."""
    n = disk_budget // (versions * max(1, file_bytes))
    if versions == 1:
        n -= IO_THREADS * max(1, workers)
    return max(0, int(n))


_MSG_HOST_DISK = ("host budget {host} bytes is below the host need of every plan tried at a device budget of {dev} "
                  "bytes with {d} storage director{ies} (disk budget {disk}); the least is {need} bytes, the plan of "
                  "{tiers}{why}: use host_budget >= {need_size}, more storage directories or disk space, a larger "
                  "device_budget, or more micro_batches (smaller activations leave the device room for more chunks)")
#: Why a plan of least host need keeps no chunk on disk (appended to :data:`_MSG_HOST_DISK`).
_WHY_NO_DISK = (" (moving chunks to disk does not lower it: the storage workers' staging buffers cost more host than "
                "the chunks the disk budget holds save)")


def place_on_disk(s: Schedule, cb: pr.ChunkBytes, *, chunk_size: int, traces, tide, disk: tuple, rates,
                  flops_per_step: float, micro_batches: int = 1, streamed_early: bool = False,
                  host_bytes_of=None) -> Schedule:
    """Move the fewest offloaded chunks (``host`` or ``streamed``) of ``s`` to ``storage`` so
    that its ``predicted.host_bytes`` fit the host budget: streamed chunks first, then host
    chunks whose gradients complete last (their host updates are the least overlapped with the
    backward). A master-fetch host chunk (:mod:`chunkjax.host_forms`) moved to disk gets its
    compute copy back (its master params are on disk).

    Args:
      s: a schedule of one device after :func:`chunkjax.host_forms.assign_host_forms`.
      cb: one chunk's bytes.
      chunk_size, traces, tide, rates, flops_per_step, micro_batches, streamed_early: as
        :func:`chunkjax.predict.predict`.
      disk: ``(host_budget, disk_budget, storage_devices, disk_versions[, storage_workers])``:
        host bytes for model data and the working set; bytes the storage directories may hold
        (None: unbounded); storage devices (distinct filesystems, >= 1); versions of each chunk
        file a step holds (:data:`DISK_VERSIONS`, 1 with ``StorageOptions(keep_previous=False)``);
        near-storage workers, one per storage directory (default: ``storage_devices``).
      host_bytes_of: ``schedule -> bytes`` compared with the host budget (default
        ``predicted.host_bytes``; :func:`chunkjax.plan.plan_schedule`'s measure).

    Returns:
      ``s`` when it fits the host (or has nothing to move), else the schedule with the fewest
      storage chunks that fits; when none fits, the one of least host need among those tried
      (``s`` itself included: the workers' staging buffers can cost more host than a few
      storage chunks save, and the measure falls by steps), which the caller's host check
      refuses and its error names (:func:`host_disk_error`).
    """
    host_budget, disk_budget, devices, versions, *rest = disk
    workers = rest[0] if rest and rest[0] is not None else devices
    hb = host_bytes_of or (lambda x: x.predicted.host_bytes)
    if host_budget is None or hb(s) <= host_budget:
        return s
    T = len(tide.moments)
    done = pr.grad_done_moments(traces, tide)
    loc0 = s.update_locations
    order = sorted((c for c, u in enumerate(loc0) if u in (HOST_UPDATE, STREAMED_UPDATE)),
                   key=lambda c: (loc0[c] != STREAMED_UPDATE, -done.get(c, T), c))
    if disk_budget is not None:
        order = order[:disk_chunks_fit(disk_budget, pr.disk_file_bytes(cb), versions, workers)]
    if not order:
        return s
    device_part = [b - e for b, e in zip(s.predicted.device_bytes_per_moment,
                                         pr.master_fetch_extra(cb, s.fetch, s.prefetch, s.master_fetch))]

    def at(j):
        moved = set(order[:j])
        loc = tuple(STORAGE_UPDATE if c in moved else u for c, u in enumerate(loc0))
        mf = tuple(c for c in s.master_fetch if c not in moved)
        moments = [b + e for b, e in zip(device_part, pr.master_fetch_extra(cb, s.fetch, s.prefetch, mf))]
        pred = pr.predict(chunk_size, traces, tide, cb, s.param_kinds, loc, s.fetch, s.segments, moments,
                          flops_per_step=flops_per_step, rates=rates, master_fetch=mf, micro_batches=micro_batches,
                          streamed_early=streamed_early, storage_devices=devices, storage_early=streamed_early,
                          storage_workers=workers)
        return dataclasses.replace(s, update_locations=loc, master_fetch=mf, predicted=pred)

    staging = storage_host_bytes(pr.disk_file_bytes(cb), workers, pr.STORAGE_STAGING_BUFFERS)
    j = min(len(order), max(1, math.ceil((hb(s) + staging - host_budget) / max(1, cb.state))))
    out = at(j)
    tried = [(hb(s), 0, s), (hb(out), j, out)]
    while tried[-1][0] > host_budget and j < len(order):
        j += 1
        out = at(j)
        tried.append((hb(out), j, out))
    if tried[-1][0] > host_budget:
        return min(tried, key=lambda x: x[:2])[2]  # the least need, ties to the fewer storage chunks
    # the fewest that fit: the estimate may overshoot when the measure falls by steps (the
    # runtime's pinned pool halves as chunks leave it); the measure falls as j grows, so bisect
    lo = 0
    while j - lo > 1:
        mid = (lo + j) // 2
        cand = at(mid)
        if hb(cand) <= host_budget:
            j, out = mid, cand
        else:
            lo = mid
    return out


def tiers_line(s: Schedule) -> str:
    """Where ``s`` keeps its chunks' state, in words: ``"135 device / 129 host / 100 disk chunks"``
    (``/ N streamed`` where some are streamed; frozen chunks not counted)."""
    n = {u: sum(x == u for x in s.update_locations) for u in ("device", HOST_UPDATE, STREAMED_UPDATE, STORAGE_UPDATE)}
    streamed = f" / {n[STREAMED_UPDATE]} streamed" if n[STREAMED_UPDATE] else ""
    return f"{n['device']} device / {n[HOST_UPDATE]} host{streamed} / {n[STORAGE_UPDATE]} disk chunks"


def host_disk_error(host_budget: int, least: Schedule, need: int, device_budget: int, storage_dirs: int,
                    disk_budget: int | None, disk_chunks_max: int | None = None) -> PlanError:
    """The one-line error of a host budget that no plan tried with the disk tier fits: the least
    host need among them (``need``, bytes, the measure the plan compared with ``host_budget``), the
    plan that needs it (``least``: its chunks per tier) and what to change.

    Args:
      host_budget, device_budget: the budgets planned for (bytes).
      least: the plan of least host need; need: its host measure (bytes).
      storage_dirs: storage directories (one near-storage worker each).
      disk_budget: bytes the directories may hold (None: unbounded).
      disk_chunks_max: chunk files the disk budget holds (None: unbounded), to say why the
        least plan keeps no chunk on disk.

    Returns:
      a :class:`~chunkjax.errors.PlanError` with ``host_need_bytes`` = ``need``.
    """
    why = ""
    if not least.predicted.storage_chunks:
        why = (" (the disk budget holds no chunk file)" if disk_chunks_max == 0 else _WHY_NO_DISK)
    msg = _MSG_HOST_DISK.format(host=host_budget, dev=device_budget, d=storage_dirs,
                                ies="y" if storage_dirs == 1 else "ies",
                                disk="unbounded" if disk_budget is None else f"{disk_budget} bytes",
                                need=int(need), tiers=tiers_line(least), why=why,
                                need_size=format_bytes(need, up=True))
    return PlanError(msg, 0, False, int(need))


def storage_line(schedule: Schedule, storage_devices: int, host_budget: int | None) -> str | None:
    """One line on the disk tier of a plan made with ``storage_devices`` directories: ``"storage
    not needed: ..."`` when every chunk fits without it, else the chunks on disk and the disk
    bytes and time per step; None without storage directories."""
    if not storage_devices:
        return None
    p = schedule.predicted
    if not p.storage_chunks:
        held = "an unbounded host budget" if host_budget is None else f"the host budget of {format_bytes(host_budget)}"
        return (f"storage not needed: the plan's {format_bytes(p.host_bytes)} of host memory fits {held} "
                f"({schedule.counts()})")
    return (f"storage: {p.storage_chunks} of {schedule.n_chunks} chunks' master params and optimizer state on "
            f"{storage_devices} storage director{'y' if storage_devices == 1 else 'ies'}; disk "
            f"{format_moved_bytes(p.disk_bytes_per_step)}/step read+written, predicted disk time "
            f"{p.time.storage_update_s:.2f} s/step of which {p.time.storage_exposed_s:.2f} s after the backward "
            f"(the rest behind the step's and the next step's compute), a {p.time.step_s:.2f} s step; host memory "
            f"{format_bytes(p.host_bytes)}")
