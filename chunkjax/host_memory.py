"""Host memory: what a run needs of it, and the check made before anything is allocated.

Issue 21, item 4: the main job was killed by the kernel (an out-of-memory kill with a `.partial`
folder left) instead of refusing a model whose model data could not fit the machine's RAM. Every
path that builds a step or an optimizer from a budget (:func:`chunkjax.fit.fit_step`, the
drop-in :class:`chunkjax.ChunkedOptimizer`) compares the host bytes it plans (pinned compute
params and gradients, pageable master params and optimizer state, on the CPU the device's bytes,
the process's own need) with ``MemAvailable`` and refuses in one line before allocating.
"""
from __future__ import annotations

import dataclasses

from chunkjax.errors import PlanError

#: Host memory the process needs beyond the planned model data on the CPU: the JAX runtime and
#: the XLA compiler's working memory (measured: the CPU demo, ``python -m experiments.train``,
#: peaked at 1.61 GiB RSS, 0.91 GiB above its 0.70 GiB of chunks and accounted device bytes).
#: Initialising the state adds two float32 chunks (see :func:`process_bytes`).
PROCESS_HOST_BYTES = 2**30
#: The same on a GPU: the CUDA context, the compiler's working memory for the step's programs,
#: numba and Python (measured on the lent H200, ``experiments/results/host_growth_s10.json``, a 3B
#: decoder at batch 8: RSS 71.4 GiB = 11.2 GiB of the user's model + 22.7 GiB pageable model data
#: + a 32 GiB pinned pool + 5.4 GiB).
GPU_PROCESS_HOST_BYTES = int(5.5 * 2**30)
#: Host bytes the init's guard leaves available beyond :func:`init_reserve_bytes`' parts (the kernel's
#: own need, page tables, what the first step allocates that no plan counts).
INIT_MIN_FREE_BYTES = 2**29

#: Environment variables the GPU runtime reads, when the backend starts, for its pinned-host pool
#: (XLA's ``GetGpuHostAllocator``: a BFC allocator named ``xla_gpu_host_bfc``): the cap in GiB
#: (default 64; 16 when preallocated) and whether the pool is allocated whole at start.
PINNED_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
PINNED_HOST_PREALLOCATE_ENV = "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"
DEFAULT_PINNED_HOST_LIMIT_GIB = 64
DEFAULT_PREALLOCATED_PINNED_HOST_GIB = 16


def _env(env):
    import os
    return os.environ if env is None else env


def pinned_pool_preallocated(env=None) -> bool:
    """Whether ``$XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` asks for the whole pool at start."""
    return str(_env(env).get(PINNED_HOST_PREALLOCATE_ENV, "")).strip().lower() in ("1", "true", "yes")


def pinned_host_limit_bytes(platform: str, env=None) -> int | None:
    """Bytes of ``pinned_host`` memory one process may hold: on a GPU the runtime's pool cap
    (``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB; 64 GiB when unset, 16 GiB when unset and
    preallocated; read when the backend starts); None elsewhere (on the CPU ``pinned_host`` is
    ordinary memory, capped by RAM only).

    Args:
      platform: ``jax.default_backend()`` ("gpu", "cpu", "tpu").
      env: the environment to read (default ``os.environ``).
    """
    if platform != "gpu":
        return None
    env = _env(env)
    default = DEFAULT_PREALLOCATED_PINNED_HOST_GIB if pinned_pool_preallocated(env) else DEFAULT_PINNED_HOST_LIMIT_GIB
    raw = env.get(PINNED_HOST_LIMIT_ENV)
    try:
        gib = int(raw) if raw not in (None, "") else default
    except ValueError:
        gib = default  # the runtime logs the bad value and keeps its default
    return gib * 2**30


#: Share of the pinned pool's cap a plan may not use: the runtime's BFC pool fragments (freed
#: gradients between resident masters and params), so a plan whose pinned peak was 0.95 of the cap
#: failed to allocate a 101 MiB chunk with ~1.5 GB of the pool free (GPT3_15B on the H200, session
#: 15: ``experiments/results/largest_s15_15b_pinned.json``).
PINNED_POOL_FRAGMENTATION = 0.10


def pinned_usable_bytes(platform: str, env=None) -> int | None:
    """Pinned bytes a plan may keep in the runtime's pool: its cap
    (:func:`pinned_host_limit_bytes`) less :data:`PINNED_POOL_FRAGMENTATION`; None off the GPU."""
    cap = pinned_host_limit_bytes(platform, env)
    return None if cap is None else int(cap * (1 - PINNED_POOL_FRAGMENTATION))


def pinned_pool_bytes(pinned_bytes: int, platform: str, env=None) -> int:
    """Host bytes the runtime's pinned pool holds when a run's pinned buffers peak at
    ``pinned_bytes`` (bytes; RSS, since pinned pages are resident).

    On the CPU ``pinned_host`` is ordinary memory: ``pinned_bytes``. On a GPU the pool is a BFC
    allocator: preallocated, it holds its whole cap from the start; otherwise it grows by regions
    whose size doubles each time (2 MiB, 4 MiB, ...; a request larger than the next region gets
    the next power of two above it) and never returns them. The pool fragments
    (:data:`PINNED_POOL_FRAGMENTATION`): a peak above that share of the pool does not fit in it and
    the pool adds its next region, doubling. So it reaches the power of two at or above
    ``pinned_bytes / (1 - PINNED_POOL_FRAGMENTATION)``, capped by :func:`pinned_host_limit_bytes`.
    Measured on the lent H200: a 3B decoder with 15.9 GiB of pinned chunks between steps and a
    larger in-step peak held a 32 GiB pool (``experiments/results/host_growth_s10.json``); GPT3_6B
    with remat="auto" (30.6 GiB pinned peak, 17.7 GB of it offloaded activations, 95 % of its
    32 GiB pool) was killed by the kernel in its first step, when the pool grew its next 32 GiB
    region with 20.5 GB available (session 17, ``/work/notes/gpu_s17/r/auto.log``; the old model
    rounded the bare peak and predicted 32 GiB).
    """
    pinned_bytes = int(pinned_bytes)
    if platform != "gpu":
        return pinned_bytes
    limit = pinned_host_limit_bytes(platform, env)
    if pinned_pool_preallocated(env):
        return max(limit, pinned_bytes)
    held = -(-pinned_bytes * 100 // round(100 * (1 - PINNED_POOL_FRAGMENTATION)))  # the pool it fits in
    pow2 = 1 << max(0, held - 1).bit_length() if pinned_bytes > 0 else 0
    return max(pinned_bytes, min(limit, pow2))


def check_pinned_host(need_bytes: int, platform: str, env=None) -> None:
    """Refuse, before anything is allocated, a plan whose ``pinned_host`` buffers exceed the GPU
    runtime's pinned-host cap (reported case 10: hand-sized pinned buffers exhausted the pool
    deep inside a step).

    Args:
      need_bytes: pinned host bytes the plan allocates (compute params and gradient chunks of
        host-resident chunks, master params and optimizer state kept in ``pinned_host``).
      platform: ``jax.default_backend()``.
      env: the environment (default ``os.environ``).

    Raises:
      chunkjax.PlanError: ``need_bytes`` exceeds :func:`pinned_usable_bytes` (the cap less the
        pool's fragmentation); the message names the cap, where it comes from, and the value of
        the variable to set.
    """
    limit, usable = pinned_host_limit_bytes(platform, env), pinned_usable_bytes(platform, env)
    if limit is None or need_bytes <= usable:
        return
    env = _env(env)
    src = (f"{PINNED_HOST_LIMIT_ENV}={env[PINNED_HOST_LIMIT_ENV]}" if env.get(PINNED_HOST_LIMIT_ENV)
           else f"the default, {PINNED_HOST_LIMIT_ENV} unset")
    want = -(-int(need_bytes / (1 - PINNED_POOL_FRAGMENTATION)) // 2**30)
    raise PlanError(f"this plan keeps {need_bytes} bytes ({need_bytes / 2**30:.1f} GiB) in pinned host memory, above "
                    f"{1 - PINNED_POOL_FRAGMENTATION:.0%} of the GPU runtime's pinned-host cap of {limit // 2**30} GiB "
                    f"({src}; the pool fragments): set {PINNED_HOST_LIMIT_ENV}={want} "
                    "(GiB, at most the machine's RAM) before JAX starts, or give the device a larger budget",
                    0, False)


def held_pinned_pool_bytes(platform: str, env=None) -> int:
    """Bytes of the runtime's pinned pool already taken from the machine when the backend has
    started: on a GPU with ``$XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` the whole cap (``MemAvailable``
    no longer counts it, and every host need counts it again), else 0 (the pool grows with use)."""
    return pinned_host_limit_bytes(platform, env) if platform == "gpu" and pinned_pool_preallocated(env) else 0


def available_for_plan(platform: str, env=None) -> int | None:
    """Host bytes a plan may need in all (bytes): ``MemAvailable`` plus what the process already
    holds of the pinned pool (:func:`held_pinned_pool_bytes`), None where ``MemAvailable`` cannot be
    read."""
    avail = host_memory_available_bytes()
    return None if avail is None else avail + held_pinned_pool_bytes(platform, env)


def host_need(pinned: int, pageable: int, device_on_host: int, process: int, platform: str, env=None,
              system: bool = False) -> dict:
    """The host bytes of a run, by kind, and their sum as the machine sees it (bytes):
    ``pinned_host_bytes`` (what the plan keeps pinned, its peak), ``pinned_pool_bytes`` (what the
    runtime's pool holds for it: :func:`pinned_pool_bytes`), ``pageable_bytes``,
    ``device_on_host_bytes`` (on the CPU the device's memory), ``process_bytes``,
    ``system_bytes`` (with ``system``, a run's whole plan: what the rest of the machine grows by
    beside it, :func:`system_host_bytes` of the rest; else 0) and ``need_bytes`` = pool + pageable +
    device-on-host + process + system."""
    pool = pinned_pool_bytes(pinned, platform, env)
    run = pool + pageable + device_on_host + process
    system = system_host_bytes(run, platform) if system else 0
    return {"pinned_host_bytes": int(pinned), "pinned_pool_bytes": int(pool), "pageable_bytes": int(pageable),
            "device_on_host_bytes": int(device_on_host), "process_bytes": int(process), "system_bytes": system,
            "need_bytes": int(run + system)}


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


def process_bytes(layout, platform: str = "cpu") -> int:
    """Host bytes of the process itself: :data:`PROCESS_HOST_BYTES` (on a GPU
    :data:`GPU_PROCESS_HOST_BYTES`) plus initialisation's two float32 chunk buffers of ``layout``
    (a :class:`chunkjax.ChunkLayout`)."""
    return (GPU_PROCESS_HOST_BYTES if platform == "gpu" else PROCESS_HOST_BYTES) + 2 * 4 * layout.chunk_size


def schedule_host_parts(schedule, cb, *, n_ranks: int = 1, zero_stage: int | None = None,
                        platform: str = "cpu", micro_batches: int = 1) -> dict[str, int]:
    """The host bytes of a run of ``schedule`` by what holds them (bytes, all ranks of this
    process; the ledger's accounted parts, :class:`chunkjax.host_ledger.HostLedger`). Pinned:
    ``pinned_params`` (compute params of offloaded chunks, ZeRO stages 1/2 each local replica;
    frozen chunks' params), ``pinned_masters`` (float32 master params of master-fetch host chunks,
    :mod:`chunkjax.host_forms`), ``streamed_state`` (master params and optimizer state of
    ``streamed`` chunks), ``pinned_gradients`` (streamed and storage chunks' gradients, the
    host-updated chunks' gradient working set: :data:`chunkjax.predict.GRAD_WINDOW_PROGRAMS`
    programs on one device, every one on a mesh), ``pinned_activations`` (remat ``"offload"``: the
    activations offloaded in the forward, all held at its end). Pageable (numpy): ``host_masters`` (master
    params of copy-keeping host chunks), ``optimizer_state`` (of host-updated chunks: Adam m and
    v), ``micro_batch_sums`` (float32 sums of host, streamed and storage chunks with
    micro-batches), ``storage_workers`` (the near-storage workers' staging buffers:
    :func:`storage_host_bytes`). And
    ``device_on_host`` (on the CPU the device's memory, each rank's predicted peak).

    Args:
      schedule: a :class:`chunkjax.schedule.Schedule`.
      cb: one whole chunk's bytes (:class:`chunkjax.predict.ChunkBytes`).
      n_ranks, zero_stage: the mesh (1, None: one device).
      platform: ``jax.default_backend()``.
      micro_batches: gradient accumulation outside the programs (1: none).
    """
    reps = n_ranks if zero_stage in (1, 2) else 1
    mf, pred = set(schedule.master_fetch), schedule.predicted
    parts = dict.fromkeys(("pinned_params", "pinned_masters", "streamed_state", "pinned_gradients",
                           "pinned_activations", "host_masters", "optimizer_state", "micro_batch_sums",
                           "storage_workers", "device_on_host"), 0)
    n_host = 0
    for c, (k, u) in enumerate(zip(schedule.param_kinds, schedule.update_locations)):
        if u == "none":  # a frozen chunk: its params only
            parts["pinned_params"] += reps * cb.params_of(c) if k == "pinned_host" else 0
        elif u == "device":
            continue
        elif c in mf:
            parts["pinned_masters"] += cb.master
            parts["optimizer_state"] += cb.opt
        elif u == "host":
            parts["pinned_params"] += reps * cb.params
            parts["host_masters"] += cb.master
            parts["optimizer_state"] += cb.opt
        elif u == "storage":  # master params and state on disk: its params, its gradient whole
            parts["pinned_params"] += reps * cb.params
            parts["pinned_gradients"] += cb.grad
        else:
            parts["pinned_params"] += reps * cb.params
            parts["streamed_state"] += cb.state
            parts["pinned_gradients"] += cb.grad
        n_host += u == "host"
    parts["storage_workers"] = int(pred.storage_host_bytes)  # the near-storage workers (chunkjax.plan_disk)
    # float32 micro-batch sums of host-updated, streamed and storage chunks (numpy, the mean written over
    # each: chunkjax.accumulate.HostSums); on a mesh every host-updated chunk's gradient instead
    summed = sum(u in ("host", "streamed", "storage") for u in schedule.update_locations)
    sums = summed * cb.master if micro_batches > 1 else 0
    if n_ranks == 1:  # the working set less the offloaded activations (remat "offload": one pass's, held at once)
        act = int(pred.time.activation_bytes) // max(1, micro_batches)
        parts["pinned_gradients"] += max(0, pred.host_working_bytes - sums - act)
        parts["pinned_activations"] = act
        parts["micro_batch_sums"] = sums
    else:
        parts["pinned_gradients"] += n_host * cb.grad
    parts["device_on_host"] = n_ranks * pred.peak_device_bytes if platform == "cpu" else 0
    return {k: int(v) for k, v in parts.items()}


#: The parts of :func:`schedule_host_parts` held in pinned host memory (the rest is pageable,
#: ``device_on_host`` aside).
PINNED_PARTS = ("pinned_params", "pinned_masters", "streamed_state", "pinned_gradients", "pinned_activations")


def schedule_host_need(schedule, cb, *, layout, n_ranks: int = 1, zero_stage: int | None = None,
                       platform: str = "cpu", micro_batches: int = 1, env=None) -> dict:
    """Host bytes a run of ``schedule`` (a :class:`chunkjax.schedule.Schedule`) needs, all ranks
    of this process together, split by kind (bytes): the sums of :func:`schedule_host_parts`.

    ``pinned_host_bytes``: its :data:`PINNED_PARTS` (compute params of offloaded chunks, a
    master-fetch chunk's float32 master params instead, master params and optimizer state of
    ``streamed`` chunks, their gradients, the host-updated chunks' gradient working set).
    ``pageable_bytes``: master params (of copy-keeping chunks) and optimizer state of
    ``host``-updated chunks (numpy), the micro-batch sums, the disk tier's staging buffers.
    ``device_on_host_bytes``: on the CPU the device's memory is host memory (each rank's
    predicted peak). ``process_bytes``: :func:`process_bytes`. ``pinned_pool_bytes``: what the
    runtime's pinned pool holds for the pinned bytes (:func:`pinned_pool_bytes`; ``env``: the
    environment it reads, default ``os.environ``). ``process_bytes``: :func:`process_bytes` and the
    near-storage workers' own (:func:`storage_process_bytes`). ``need_bytes``: pool + pageable +
    device-on-host + process + the rest of the system's share (:func:`host_need`, ``system_bytes``:
    :func:`system_host_bytes`). On one device ``pinned_host_bytes +
    pageable_bytes`` is ``predicted.host_bytes``.

    Args:
      cb: one whole chunk's bytes (:class:`chunkjax.predict.ChunkBytes`).
      layout: the chunk layout; n_ranks, zero_stage: the mesh (1, None: one device).
      platform: ``jax.default_backend()``.
      micro_batches: gradient accumulation.
    """
    parts = schedule_host_parts(schedule, cb, n_ranks=n_ranks, zero_stage=zero_stage, platform=platform,
                                micro_batches=micro_batches)
    pinned = sum(parts[k] for k in PINNED_PARTS)
    pageable = sum(v for k, v in parts.items() if k not in PINNED_PARTS and k != "device_on_host")
    process = process_bytes(layout, platform) + storage_process_bytes(schedule.predicted.storage_workers, cb.grad)
    return host_need(pinned, pageable, parts["device_on_host"], process, platform, env, system=True)


@dataclasses.dataclass(frozen=True)
class InitReserve:
    """Host bytes a run still needs after :meth:`chunkjax.ChunkedStep.init` has placed the state,
    what the init's host guard keeps available (:func:`check_materialise`), read when it checks.

    ``pageable_bytes`` always stay needed (on the CPU the host gradients' working set and the
    device's predicted peak). ``pinned_bytes`` (on a GPU the host gradients' working set: they
    leave their programs into ``pinned_host``) come from the runtime's pinned pool, which grows
    by doubling regions up to its cap (:func:`pinned_pool_bytes`): once the pool holds nearly its
    cap, what the working set still takes from the machine is at most ``pinned_cap`` minus the
    pool already resident (``RssShmem``), not the whole working set (issue 24: GPT3_15B's init was
    refused at its last host chunk for a first step whose 7.6 GiB of gradients its already-grown
    40 GiB pool held). ``pinned_cap``: the pool's cap (:func:`pinned_host_limit_bytes`), None on
    the CPU. ``platform``: where the run is; on a GPU the guard adds the rest of the system's
    share of what it reserves (:meth:`need_bytes`), as the plan's need does (:func:`host_need`)."""
    pageable_bytes: int
    pinned_bytes: int = 0
    pinned_cap: int | None = None
    platform: str = "cpu"

    def bytes_now(self, shmem_bytes: int | None = None) -> int:
        """The reserve now (bytes): ``pageable_bytes`` + the pinned pool's growth still possible
        for ``pinned_bytes`` + :data:`INIT_MIN_FREE_BYTES`. ``shmem_bytes``: the process's
        ``RssShmem`` (default: read from ``/proc/self/status``; unreadable: the whole
        ``pinned_bytes`` is reserved)."""
        grow = self.pinned_bytes
        if self.pinned_cap is not None:
            shm = _rss_shmem_bytes() if shmem_bytes is None else shmem_bytes
            if shm is not None:
                grow = min(grow, max(0, self.pinned_cap - shm))
        return int(self.pageable_bytes + grow + INIT_MIN_FREE_BYTES)

    def need_bytes(self, nbytes: int, shmem_bytes: int | None = None) -> int:
        """``MemAvailable`` that placing ``nbytes`` more needs now (bytes), counted as the plan
        counts a run's need (:func:`host_need`): the ``nbytes``, the reserve (:meth:`bytes_now`
        less :data:`INIT_MIN_FREE_BYTES`) and the rest of the system's share of both
        (:func:`system_host_bytes`: :data:`SYSTEM_HOST_SHARE` on a GPU), then
        :data:`INIT_MIN_FREE_BYTES`."""
        run = int(nbytes) + self.bytes_now(shmem_bytes) - INIT_MIN_FREE_BYTES
        return int(run + system_host_bytes(run, self.platform) + INIT_MIN_FREE_BYTES)


def _rss_shmem_bytes() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("RssShmem:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def init_reserve_bytes(schedule, platform: str, env=None) -> InitReserve | int:
    """What the init's host guard keeps available (:class:`InitReserve`): the host gradients'
    working set (``predicted.host_working_bytes``; pinned on a GPU, where the pinned pool's cap
    bounds what it still takes) and on the CPU the device's predicted peak. 0 without a
    schedule. ``env``: the environment the pool's cap is read from (default ``os.environ``)."""
    if schedule is None:
        return 0
    pred = schedule.predicted
    if platform == "gpu":
        return InitReserve(0, int(pred.host_working_bytes), pinned_host_limit_bytes(platform, env), platform)
    return InitReserve(int(pred.host_working_bytes + (pred.peak_device_bytes if platform == "cpu" else 0)))


def check_materialise(nbytes: int, reserve_bytes, what: str) -> None:
    """Refuse to touch ``nbytes`` more host bytes (``what``, e.g. one chunk's optimizer state)
    when ``MemAvailable`` would fall below ``reserve_bytes`` (bytes, or an :class:`InitReserve`
    read now: :func:`init_reserve_bytes`, with the system's share as the plan counts it:
    :meth:`InitReserve.need_bytes`): the state is made resident at init, so a plan that
    over-commits the host stops here, in one line, instead of at the first step by the kernel's
    OOM killer.

    Raises:
      HostMemoryError: ``MemAvailable`` below that need (``nbytes + reserve_bytes`` for bytes).
    """
    need = reserve_bytes.need_bytes(nbytes) if isinstance(reserve_bytes, InitReserve) else int(nbytes) + int(reserve_bytes)
    avail = host_memory_available_bytes()
    if avail is None or avail >= need:
        return
    gib = lambda b: b / 2**30  # noqa: E731
    raise HostMemoryError(
        f"host memory: initialising {what} needs {gib(nbytes):.2f} GiB more, and the first step and the rest of the "
        f"system {gib(need - int(nbytes)):.1f} GiB after it, but only {gib(avail):.1f} GiB is available (MemAvailable): "
        "the plan's host accounting missed memory this process holds (see the host ledger); lower the host budget, give the device a larger budget or "
        "storage directories, or free host memory", need, avail)


def _refuse_host(need: dict, avail: int, what: str, fix: str):
    gib = lambda b: b / 2**30  # noqa: E731
    pool = need.get("pinned_pool_bytes", need["pinned_host_bytes"])
    pinned = f"{gib(need['pinned_host_bytes']):.1f} GiB pinned" + (
        f" (a {gib(pool):.1f} GiB pinned pool)" if pool > need["pinned_host_bytes"] else "")
    parts = [pinned, f"{gib(need['pageable_bytes']):.1f} GiB pageable"]
    if need.get("device_on_host_bytes"):
        parts.append(f"{gib(need['device_on_host_bytes']):.1f} GiB of device memory, host memory on the CPU")
    parts.append(f"{gib(need['process_bytes']):.1f} GiB for the process")
    if need.get("system_bytes"):
        parts.append(f"{gib(need['system_bytes']):.1f} GiB for the rest of the system")
    raise HostMemoryError(_MSG_HOST.format(what=what, need_gib=gib(need["need_bytes"]), parts=" + ".join(parts),
                                           avail_gib=gib(avail), fix=fix), need["need_bytes"], avail)


def check_host_need(need: dict, what: str, platform: str, available: int | None = None) -> dict:
    """Refuse ``need`` (a :func:`host_need` dict of bytes: ``pinned_host_bytes``,
    ``pinned_pool_bytes``, ``pageable_bytes``, ``device_on_host_bytes``, ``process_bytes``,
    ``need_bytes``) when it
    exceeds ``available`` (default :func:`available_for_plan`); returns it with
    ``available_bytes``. Used by every path that builds a step or optimizer from a budget.

    Raises:
      HostMemoryError: one line saying what to change.
    """
    avail = available_for_plan(platform) if available is None else available
    if avail is not None and need["need_bytes"] > avail:
        _refuse_host(need, avail, what, _host_fix(platform, need, avail))
    return dict(need, available_bytes=avail)


def _host_fix(platform: str, need: dict | None = None, avail: int | None = None) -> str:
    if platform == "cpu":
        return "train a smaller model (on the CPU all model data is host memory) or free host memory"
    fix = ("give the device a larger budget, give storage directories (the disk tier: master params and optimizer "
           "state of the chunks the host cannot hold), train a smaller model, or free host memory")
    if need and avail is not None and need.get("pinned_pool_bytes", 0) > need["pinned_host_bytes"]:
        # GiB, what check_pinned_host lets the pinned bytes use (the pool fragments)
        want = -(-int(need["pinned_host_bytes"] / (1 - PINNED_POOL_FRAGMENTATION)) // 2**30)
        if need["need_bytes"] - need["pinned_pool_bytes"] + want * 2**30 <= avail:
            fix = (f"start with {PINNED_HOST_PREALLOCATE_ENV}=true {PINNED_HOST_LIMIT_ENV}={want} (the pinned pool "
                   f"then holds {want} GiB from the start instead of growing by doubling), or " + fix)
    return fix


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
    # a preallocated pinned pool may hold part of the model data: the least total is the larger
    need = host_need(0, max(0, int(low) - held_pinned_pool_bytes(platform)), 0, process_bytes(layout, platform),
                     platform)
    if need["need_bytes"] > available:
        _refuse_host(need, available, f"the model data alone ({model / 2**30:.1f} GiB in {layout.n_chunks} chunks)",
                     _host_fix(platform))


#: Host bytes of one near-storage worker process beyond its buffers (:mod:`chunkjax.storage.worker`:
#: the interpreter, numpy, numba and the compiled AdamW kernels). Measured RssAnon intercept on
#: the CPU: 97.6 MB (``experiments/storage_host_memory.py`` at 2 and 8 Mi-element chunks,
#: docs/setup_time.md); 128 MiB leaves room for other numba / numpy builds.
STORAGE_WORKER_BASE_BYTES = 2**27
#: Compute-dtype chunks a worker holds beside its staging buffers: the gradient it received and
#: the pipe's buffer it was unpickled from, the new params it sends and their pickled copy
#: (measured: 6.5 bytes per element in bfloat16 beyond the staging buffers, 3.25 chunks).
STORAGE_WORKER_MESSAGES = 4
#: The same on the trainer's side of the pipes: a gradient's numpy copy and its pickled bytes on
#: the sender thread, a received params message and its buffer.
STORAGE_TRAINER_MESSAGES = 4
#: Share of a GPU run's host need that the rest of the machine takes as the run grows (page
#: tables, the driver's bookkeeping of pinned pages, other processes; not in any RSS of the run):
#: on the lent H200 the memory outside the largest process grew by 1.7 GB over GPT3_15B's 127.5 GB
#: (1.3 %) and, less the near-storage worker, by 3.7 GB over GPT3_18B's 126.6 GB with the disk
#: tier (2.9 %; ``/work/notes/gpu_s16``, docs/setup_time.md). 0 on the CPU.
SYSTEM_HOST_SHARE = 0.03


def storage_host_bytes(file_bytes: int, storage_devices: int, staging_buffers: int = 3) -> int:
    """Host bytes of the disk tier's staging buffers (bytes; a plan's ``host_bytes``, held to the
    host budget): per storage directory one worker's ``staging_buffers`` chunk files of
    ``file_bytes`` each. The rest of each worker and the messages are a fixed number of chunks
    whatever the number of storage chunks, counted with the process (:func:`storage_process_bytes`).

    Args:
      file_bytes: one storage chunk file (:func:`chunkjax.predict.disk_file_bytes`).
      storage_devices: storage directories (one worker each).
      staging_buffers: staging buffers per worker (``StorageOptions.staging_buffers``).
    """
    return int(max(0, storage_devices) * staging_buffers * file_bytes)


def storage_process_bytes(workers: int, grad_bytes: int) -> int:
    """Host bytes of the disk tier beside its staging buffers (bytes; a plan's ``process_bytes``,
    like the trainer's own): per worker process :data:`STORAGE_WORKER_BASE_BYTES` and
    :data:`STORAGE_WORKER_MESSAGES` chunks of ``grad_bytes`` in flight, and the trainer's
    messages (:data:`STORAGE_TRAINER_MESSAGES` chunks); 0 without workers.

    Args:
      workers: near-storage worker processes (one per storage directory).
      grad_bytes: one chunk's compute-dtype gradient (bytes; the params sent back are as large).
    """
    if workers <= 0:
        return 0
    return int(workers * (STORAGE_WORKER_BASE_BYTES + STORAGE_WORKER_MESSAGES * grad_bytes)
               + STORAGE_TRAINER_MESSAGES * grad_bytes)


def system_host_bytes(run_bytes: int, platform: str) -> int:
    """The rest of the machine's growth beside a run needing ``run_bytes`` of host memory (bytes):
    :data:`SYSTEM_HOST_SHARE` of it on a GPU, 0 elsewhere."""
    return int(SYSTEM_HOST_SHARE * run_bytes) if platform == "gpu" else 0
