"""The drop-in optimizer's update cost and the split it is chosen by: each offloaded chunk's bytes
each way over PCIe, the host kernel's seconds and the host memory both share, four lanes in
parallel (:func:`predict_update_parts`), and the division of the offloaded chunks between the
streamed update and the host kernel that the least predicted update gives (:func:`split_offloaded`;
ZeRO-Offload++ / ZenFlow's GPU-CPU split). :mod:`chunkjax.dropin` places the chunks with it;
``docs/dropin.md`` ("Host memory bandwidth") derives the rates from the recorded GPU runs."""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from chunkjax.cost import Rates
from chunkjax.duplex import DEFAULT_PIPELINE_DEPTH
from chunkjax.host_contention import step_host_s_per_param
from chunkjax.layout import ChunkLayout

_MSG_HOST_CHUNKS = ("host_chunks={n} but {have} chunk(s) have their state in pinned host memory: "
                    "use 0 <= host_chunks <= {have}")

#: The drop-in's default rates (:class:`chunkjax.cost.Rates`, the H200's) with both PCIe directions
#: together at 76 GB/s, the rate measured beside the host kernel (71-80 GB/s on three lent H200
#: boxes, :mod:`chunkjax.host_contention`'s load probe), not the 94 of the two transfer threads
#: alone: a drop-in update runs its kernel beside its transfers. With the host memory lane
#: (``Rates.host_memory_bytes_per_s``) this splits the probe's 93 offloaded chunks 64 streamed /
#: 29 host, and 72 / 21 with streamed chunks moving their state only (``docs/dropin.md``, "Host
#: memory bandwidth").
DEFAULT_RATES = Rates(duplex_bytes_per_s=76e9)


class UpdateTime(NamedTuple):
    """Predicted seconds of the offloaded part of one update (:func:`predict_update_parts`).

    Attributes:
      h2d_s, d2h_s: each PCIe direction's busy time (both directions in flight together).
      kernel_s: the host kernel's time (its arithmetic on its threads).
      host_memory_s: the host memory's time: the kernel's bytes and both directions' DMA bytes at
        ``rates.host_memory_bytes_per_s`` (0 when that rate is 0: not modelled).
      total_s: the update's time: the longest of the four (they run in parallel).
    """

    h2d_s: float
    d2h_s: float
    kernel_s: float
    host_memory_s: float
    total_s: float


def host_kernel_bytes(state_bytes: int, grad_bytes: int, param_bytes: int, chunk_size: int) -> int:
    """Host memory bytes of one host chunk's kernel step: its gradient read, its float32 master
    and moments (``state_bytes``) read and written back, and for params narrower than float32 the
    params buffer written (for float32 params the master is the params buffer): 28 bytes per
    param for AdamW with float32 gradients and params (:func:`host_chunk_step`)."""
    return int(grad_bytes + 2 * state_bytes + (param_bytes if param_bytes < 4 * chunk_size else 0))


def predict_update_parts(n_streamed: int, n_host: int, chunk_size: int, state_bytes: int, grad_bytes: int,
                         param_bytes: int, rates: Rates, depth: int = DEFAULT_PIPELINE_DEPTH,
                         streamed_bytes: int | None = None) -> UpdateTime:
    """Predicted seconds of the offloaded part of one update and its parts: each direction's
    PCIe time (streamed chunks move ``state_bytes`` each way; host chunks send ``grad_bytes``
    down and get ``param_bytes`` back; each direction at most half of
    ``rates.duplex_bytes_per_s``, the two-thread duplex rate of :mod:`chunkjax.duplex`) and the
    host kernel's time (``chunk_size`` elements per host chunk at
    :func:`chunkjax.host_contention.step_host_s_per_param`: the kernel beside the transfers where
    measured, else ``rates.host_update_s_per_param``) and the host memory's time (the kernel's
    bytes, :func:`host_kernel_bytes`, and every DMA byte of both directions, at
    ``rates.host_memory_bytes_per_s``: the kernel and the transfers share the host's memory, so a
    host chunk costs 36 bytes of it per AdamW param and a streamed one 24); the four run in
    parallel, so the update takes the longest. With a pipeline of one chunk (``depth=1``) a
    streamed chunk's two directions take turns (counted in both directions' time).

    Args:
      n_streamed, n_host: chunks at each location.
      chunk_size: elements per chunk.
      state_bytes: one chunk's float32 master params + optimizer state (bytes).
      grad_bytes, param_bytes: one chunk's gradient and compute params (bytes).
      rates: :class:`chunkjax.cost.Rates`.
      depth: the streamed pipeline's depth.
      streamed_bytes: what a streamed chunk moves each way (default ``state_bytes``; the
        optimizer state alone for float32 chunks, :func:`lean_chunks`).
    """
    moved = state_bytes if streamed_bytes is None else streamed_bytes
    h2d = n_streamed * moved + n_host * param_bytes
    d2h = n_streamed * moved + n_host * grad_bytes
    half = rates.duplex_bytes_per_s / 2  # both directions at once: each at most half the duplex total
    h2d_s, d2h_s = h2d / min(rates.h2d_bytes_per_s, half), d2h / min(rates.d2h_bytes_per_s, half)
    if depth <= 1:  # no fetch while a write-back runs
        turns = n_streamed * moved * (1 / rates.h2d_bytes_per_s + 1 / rates.d2h_bytes_per_s)
        h2d_s, d2h_s = max(h2d_s, turns), max(d2h_s, turns)
    kernel_s = n_host * chunk_size * step_host_s_per_param(rates)  # beside the transfers where measured so
    bw = float(getattr(rates, "host_memory_bytes_per_s", 0.0) or 0.0)
    mem_s = (n_host * host_kernel_bytes(state_bytes, grad_bytes, param_bytes, chunk_size) + h2d + d2h) / bw \
        if bw > 0 else 0.0
    return UpdateTime(h2d_s, d2h_s, kernel_s, mem_s, max(h2d_s, d2h_s, kernel_s, mem_s))


def predict_update_s(n_streamed: int, n_host: int, chunk_size: int, state_bytes: int, grad_bytes: int,
                     param_bytes: int, rates: Rates, depth: int = DEFAULT_PIPELINE_DEPTH,
                     streamed_bytes: int | None = None) -> float:
    """Predicted seconds of the offloaded part of one update: :func:`predict_update_parts`'s
    ``total_s`` (same arguments)."""
    return predict_update_parts(n_streamed, n_host, chunk_size, state_bytes, grad_bytes, param_bytes, rates,
                                depth, streamed_bytes).total_s


def split_offloaded(offloaded: Sequence[int], chunk_size: int, state_bytes: int, grad_bytes: int,
                    param_bytes: int, rates: Rates | None = None, host_chunks: int | None = None,
                    depth: int = DEFAULT_PIPELINE_DEPTH,
                    streamed_bytes: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Divide the chunks whose state is in pinned host memory between the streamed update and
    the host kernel.

    Args:
      offloaded: chunk ids (layout order).
      chunk_size, state_bytes, grad_bytes, param_bytes, streamed_bytes: as :func:`predict_update_s`.
      rates: measured rates (default :data:`DEFAULT_RATES`, the H200's beside the host kernel).
      host_chunks: how many chunks the host kernel updates; None picks the count with the
        least :func:`predict_update_s` (the fewest on a tie).
      depth: the streamed pipeline's depth.

    Returns:
      ``(streamed, host)``: chunk ids; the host takes the last ``host_chunks`` of ``offloaded``
      (the streamed ones go first: their update programs start while the host gradients travel).

    Raises:
      ValueError: ``host_chunks`` outside ``[0, len(offloaded)]``.
    """
    rates = rates or DEFAULT_RATES
    n = len(offloaded)
    if host_chunks is None:
        host_chunks = min(range(n + 1), key=lambda h: (predict_update_s(
            n - h, h, chunk_size, state_bytes, grad_bytes, param_bytes, rates, depth, streamed_bytes), h))
    elif isinstance(host_chunks, bool) or not isinstance(host_chunks, int) or not 0 <= host_chunks <= n:
        raise ValueError(_MSG_HOST_CHUNKS.format(n=host_chunks, have=n))
    return tuple(offloaded[:n - host_chunks]), tuple(offloaded[n - host_chunks:])


def lean_chunks(lay: ChunkLayout, streamed: Sequence[int]) -> frozenset:
    """The streamed chunks whose master need not move (:attr:`chunkjax.dropin.ChunkPrograms.update_lean`): those of
    float32 params, whose compute params are the float32 master bit for bit, so the params the
    optimizer returned last (on the device) are the master."""
    return frozenset(c for c in streamed if np.dtype(lay.chunk_dtypes[c]) == np.float32)


def streamed_bytes(lay: ChunkLayout, cb, lean: bool) -> int:
    """Bytes a streamed chunk moves each way: its optimizer state alone where ``lean`` and every
    chunk is float32 (:func:`lean_chunks`), else its master + state (``cb.state``)."""
    f32 = all(np.dtype(d) == np.float32 for d in lay.chunk_dtypes)
    return int(cb.state - 4 * lay.chunk_size) if lean and f32 else int(cb.state)


__all__ = ["DEFAULT_RATES", "UpdateTime", "host_kernel_bytes", "lean_chunks", "predict_update_parts", "predict_update_s",
           "split_offloaded", "streamed_bytes"]
