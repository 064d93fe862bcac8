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


class TransferWindow:
    """At most ``depth`` host-to-memory-kind transfers in flight while a loop places chunks.

    ``jax.device_put`` of a numpy buffer returns before the copy is done, and on a GPU the runtime
    stages each pending copy in host memory it keeps for the process's lifetime. A loop that puts
    hundreds of chunks without waiting left that staging at the size of every copy queued at once
    (issue 24: GPT3_15B's init put its 137 device chunks, 29 GB of float32, and RssAnon grew by
    ~16 GB that was never returned; blocking each put left a fixed ~3.7 GB, measured by
    ``experiments/gpu_checks/put_anon_probe.py``). :meth:`add` records a placed array (or pytree
    of arrays) and waits for the oldest once more than ``depth`` are pending, so staging stays
    at ``depth`` chunks. Costs nothing on the CPU (puts there are done when they return)."""

    def __init__(self, depth: int = 2):
        if depth < 1:
            raise ValueError(f"TransferWindow depth={depth}: use at least 1 transfer in flight")
        self.depth, self._pending = depth, []

    def add(self, x):
        """Record ``x`` (arrays or a pytree; non-arrays ignored) as in flight; returns ``x``."""
        leaves = [a for a in jax.tree.leaves(x) if isinstance(a, jax.Array)]
        if leaves:
            self._pending.append(leaves)
        while len(self._pending) > self.depth:
            jax.block_until_ready(self._pending.pop(0))
        return x
