"""Host memory: what a run needs of it, and the check made before anything is allocated.

Issue 21, item 4: the main job was killed by the kernel (an out-of-memory kill with a `.partial`
folder left) instead of refusing a model whose model data could not fit the machine's RAM. Every
path that builds a step or an optimizer from a budget (:func:`chunkjax.fit.fit_step`, the
drop-in :class:`chunkjax.ChunkedOptimizer`) compares the host bytes it plans (pinned compute
params and gradients, pageable master params and optimizer state, on the CPU the device's bytes,
the process's own need) with ``MemAvailable`` and refuses in one line before allocating.
"""
from __future__ import annotations

from chunkjax.errors import PlanError

#: Host memory the process needs beyond the planned model data: the JAX runtime and the XLA
#: compiler's working memory (measured: the CPU demo, ``python -m experiments.train``, peaked at
#: 1.61 GiB RSS, 0.91 GiB above its 0.70 GiB of chunks and accounted device bytes). Initialising
#: the state adds two float32 chunks (see :func:`chunkjax.fit.host_need`).
PROCESS_HOST_BYTES = 2**30

_MSG_HOST = ("host memory: {what} needs {need_gib:.1f} GiB ({parts}) but this machine has {avail_gib:.1f} GiB "
             "available (MemAvailable in /proc/meminfo): {fix}")


class HostMemoryError(PlanError):
    """The plan's host memory exceeds what the machine has available; nothing was allocated.

    Attributes:
      need_bytes: host bytes the run needs (model data in host memory, device memory that is host
        memory on the CPU, the process's own need).
      available_bytes: ``MemAvailable`` when checked.
    """

    def __init__(self, msg: str, need_bytes: int, available_bytes: int):
        super().__init__(msg, 0, False)
        self.need_bytes, self.available_bytes = int(need_bytes), int(available_bytes)


def host_memory_available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (what the kernel can give without swapping),
    None where it cannot be read (the host check is then skipped)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_bytes(layout) -> int:
    """Host bytes of the process itself: :data:`PROCESS_HOST_BYTES` plus initialisation's two
    float32 chunk buffers of ``layout`` (a :class:`chunkjax.ChunkLayout`)."""
    return PROCESS_HOST_BYTES + 2 * 4 * layout.chunk_size


def schedule_host_need(schedule, cb, *, layout, n_ranks: int = 1, zero_stage: int | None = None,
                       platform: str = "cpu", micro_batches: int = 1) -> dict:
    """Host bytes a run of ``schedule`` (a :class:`chunkjax.schedule.Schedule`) needs, all ranks
    of this process together, split by kind (bytes):

    ``pinned_host_bytes``: compute params of offloaded chunks (ZeRO stages 1/2: each local
    device's replica), a master-fetch chunk's float32 master params instead
    (:mod:`chunkjax.host_forms`), master params and optimizer state of ``streamed`` chunks, their
    gradients, and the host-updated chunks' gradients: on one device the working set of
    :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS` programs (``predicted.host_working_bytes``),
    on a mesh every one. ``pageable_bytes``: master params (of copy-keeping chunks) and
    optimizer state of ``host``-updated chunks (numpy), with micro-batches their float32 sums
    and means. ``device_on_host_bytes``: on the CPU the device's memory is host memory (each
    rank's predicted peak). ``process_bytes``: :func:`process_bytes`. ``need_bytes``: their sum.
    On one device ``pinned_host_bytes + pageable_bytes`` is ``predicted.host_bytes``.

    Args:
      cb: one whole chunk's bytes (:class:`chunkjax.predict.ChunkBytes`).
      layout: the chunk layout; n_ranks, zero_stage: the mesh (1, None: one device).
      platform: ``jax.default_backend()``.
      micro_batches: gradient accumulation.
    """
    reps = n_ranks if zero_stage in (1, 2) else 1
    mf, pred = set(schedule.master_fetch), schedule.predicted
    pinned = pageable = n_host = 0
    for c, (k, u) in enumerate(zip(schedule.param_kinds, schedule.update_locations)):
        if u == "none":  # a frozen chunk: its params only
            pinned += reps * cb.params_of(c) if k == "pinned_host" else 0
            continue
        if u == "device":
            continue
        if c in mf:
            pinned += cb.master
            pageable += cb.opt
        elif u == "host":
            pinned += reps * cb.params
            pageable += cb.state
        elif u == "storage":  # master params and state on disk: its params, its gradient whole
            pinned += reps * cb.params + cb.grad
        else:
            pinned += reps * cb.params + cb.state + cb.grad
        n_host += u == "host"
    pageable += pred.disk_staging_bytes  # the near-storage workers' staging buffers (chunkjax.plan_disk)
    sums = n_host * (cb.master + cb.grad) if micro_batches > 1 else 0
    if n_ranks == 1:
        pinned += max(0, pred.host_working_bytes - sums)
        pageable += sums
    else:
        pinned += n_host * cb.grad
    dev = n_ranks * pred.peak_device_bytes if platform == "cpu" else 0
    proc = process_bytes(layout)
    return {"pinned_host_bytes": int(pinned), "pageable_bytes": int(pageable), "device_on_host_bytes": int(dev),
            "process_bytes": int(proc), "need_bytes": int(pinned + pageable + dev + proc)}


def _refuse_host(need: dict, avail: int, what: str, fix: str):
    gib = lambda b: b / 2**30  # noqa: E731
    parts = [f"{gib(need['pinned_host_bytes']):.1f} GiB pinned", f"{gib(need['pageable_bytes']):.1f} GiB pageable"]
    if need.get("device_on_host_bytes"):
        parts.append(f"{gib(need['device_on_host_bytes']):.1f} GiB of device memory, host memory on the CPU")
    parts.append(f"{gib(need['process_bytes']):.1f} GiB for the process")
    raise HostMemoryError(_MSG_HOST.format(what=what, need_gib=gib(need["need_bytes"]), parts=" + ".join(parts),
                                           avail_gib=gib(avail), fix=fix), need["need_bytes"], avail)


def check_host_need(need: dict, what: str, platform: str, available: int | None = None) -> dict:
    """Refuse ``need`` (a :func:`chunkjax.fit.host_need`-shaped dict of bytes: ``pinned_host_bytes``,
    ``pageable_bytes``, ``device_on_host_bytes``, ``process_bytes``, ``need_bytes``) when it
    exceeds ``available`` (default :func:`host_memory_available_bytes`); returns it with
    ``available_bytes``. Used by every path that builds a step or optimizer from a budget.

    Raises:
      HostMemoryError: one line saying what to change.
    """
    avail = host_memory_available_bytes() if available is None else available
    if avail is not None and need["need_bytes"] > avail:
        _refuse_host(need, avail, what, _host_fix(platform))
    return dict(need, available_bytes=avail)


def _host_fix(platform: str) -> str:
    if platform == "cpu":
        return "train a smaller model (on the CPU all model data is host memory) or free host memory"
    return "give the device a larger budget, train a smaller model, or free host memory"


def check_host_lower_bound(layout, cb, platform: str, n_ranks: int = 1,
                           device_budget=None, available: int | None = None) -> None:
    """Refuse before tracing when even the best plan cannot fit host memory: on the CPU every
    chunk's compute params, master params and optimizer state are host memory; elsewhere what the
    devices' budgets cannot hold is.

    Raises:
      HostMemoryError: the lower bound plus the process's own need exceeds ``available``.
    """
    if available is None:
        return
    model = cb.model_bytes(layout.n_chunks)
    if platform == "cpu":
        low = model
    elif isinstance(device_budget, int):
        low = max(0, model - n_ranks * device_budget)
    else:
        return
    need = {"pinned_host_bytes": 0, "pageable_bytes": int(low), "device_on_host_bytes": 0,
            "process_bytes": process_bytes(layout)}
    need["need_bytes"] = int(low) + need["process_bytes"]
    if need["need_bytes"] > available:
        _refuse_host(need, available, f"the model data alone ({model / 2**30:.1f} GiB in {layout.n_chunks} chunks)",
                     _host_fix(platform))
