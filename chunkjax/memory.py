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
