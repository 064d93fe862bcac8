"""Memory kinds: the one place that builds shardings for ``device`` and ``pinned_host``.

JAX places an array in a memory kind through its sharding
(``SingleDeviceSharding(d, memory_kind=...)``); moving between kinds is an explicit
``jax.device_put`` (an op that mixes kinds fails at trace time). On the CPU backend the kinds
exist but moves compile to nothing, so placement is only *proven* on a GPU.
"""
from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding

DEVICE = "device"
PINNED_HOST = "pinned_host"
MEMORY_KINDS = (DEVICE, PINNED_HOST)


def sharding(kind: str, device: jax.Device | None = None) -> SingleDeviceSharding:
    """Single-device sharding in memory kind ``kind`` ("device" or "pinned_host").

    Raises:
      ValueError: unknown kind, or the device has no such memory.
    """
    if kind not in MEMORY_KINDS:
        raise ValueError(f"memory kind {kind!r} is not one of {MEMORY_KINDS}")
    d = device or jax.devices()[0]
    kinds = {m.kind for m in d.addressable_memories()}
    if kind not in kinds:
        raise ValueError(f"device {d} has no {kind!r} memory (it has {sorted(kinds)})")
    return SingleDeviceSharding(d, memory_kind=kind)


def put(x, kind: str, device: jax.Device | None = None):
    """Eager move of a pytree to memory kind ``kind``."""
    s = sharding(kind, device)
    return jax.tree.map(lambda a: jax.device_put(a, s), x)


def kind_of(x: jax.Array) -> str:
    """Memory kind of a concrete array."""
    return x.sharding.memory_kind


def ordered_after(anchor, x):
    """Return ``x`` ordered after ``anchor`` is computed (``jax.lax.optimization_barrier``).

    Tying a fetch ``device_put(ordered_after(anchor, chunk), device)`` to the activation of an
    earlier stage keeps XLA from hoisting every fetch to the program start (gpu_facts.md).
    ``anchor=None`` returns ``x`` unchanged."""
    if anchor is None:
        return x
    _, x = jax.lax.optimization_barrier((anchor, x))
    return x


#: Environment variable the GPU runtime reads for its pinned-host pool cap, in GiB
#: (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` x 2**30 bytes; default 64: gpu_facts.md, XLA's
#: ``GetGpuHostAllocator``).
PINNED_HOST_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_PINNED_HOST_LIMIT_GIB = 64


def pinned_host_limit_bytes(platform: str, env=None) -> int | None:
    """Bytes of ``pinned_host`` memory one process may hold: on a GPU the runtime's pool cap
    (``$XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` GiB, 64 GiB when unset, read when the backend starts);
    None elsewhere (on the CPU ``pinned_host`` is ordinary memory, capped by RAM only).

    Args:
      platform: ``jax.default_backend()`` ("gpu", "cpu", "tpu").
      env: the environment to read (default ``os.environ``).
    """
    import os
    if platform != "gpu":
        return None
    env = os.environ if env is None else env
    raw = env.get(PINNED_HOST_LIMIT_ENV)
    try:
        gib = int(raw) if raw not in (None, "") else DEFAULT_PINNED_HOST_LIMIT_GIB
    except ValueError:
        gib = DEFAULT_PINNED_HOST_LIMIT_GIB  # the runtime logs the bad value and keeps its default
    return gib * 2**30


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
      chunkjax.PlanError: ``need_bytes`` exceeds :func:`pinned_host_limit_bytes`; the message
        names the cap, where it comes from, and the value of the variable to set.
    """
    import os

    from chunkjax.errors import PlanError
    limit = pinned_host_limit_bytes(platform, env)
    if limit is None or need_bytes <= limit:
        return
    env = os.environ if env is None else env
    src = (f"{PINNED_HOST_LIMIT_ENV}={env[PINNED_HOST_LIMIT_ENV]}" if env.get(PINNED_HOST_LIMIT_ENV)
           else f"the default, {PINNED_HOST_LIMIT_ENV} unset")
    want = -(-int(need_bytes * 1.1) // 2**30)
    raise PlanError(f"this plan keeps {need_bytes} bytes ({need_bytes / 2**30:.1f} GiB) in pinned host memory, above the "
                    f"GPU runtime's pinned-host cap of {limit // 2**30} GiB ({src}): set {PINNED_HOST_LIMIT_ENV}={want} "
                    "(GiB, at most the machine's RAM) before JAX starts, or give the device a larger budget",
                    0, False)
