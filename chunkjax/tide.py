"""The memory tide: non-model bytes alive at every moment of a step, and the chunks each reads.

PatrickStar (arXiv 2108.05818, section 4.2) measures the GPU memory left for model data at each
*moment* (operator) of a warm-up iteration: activations rise through the forward pass and fall
through the backward pass, like a tide. chunkjax computes the same curve before the first step
from the traced stages (:mod:`chunkjax.trace`, abstract shapes only).

Moments, in program order (definitions.md: one chunk-access event each):

* ``forward`` of stages ``0 .. n-2`` (each reads its chunks; its input is saved);
* ``forward+backward`` of the last stage (the loss and its gradient run fused);
* ``backward`` of stages ``n-2 .. 0`` (recompute + vjp; reads only the chunks whose values the
  gradient needs).

Non-model bytes at a moment = saved stage inputs still alive + the stage's transient bytes
(recompute + vjp temporaries and gradient outputs) + float32 gradient accumulators of chunks
whose gradient is still being summed.
"""
from __future__ import annotations

import dataclasses

from chunkjax.trace import StageTrace

FORWARD, FUSED, BACKWARD = "forward", "forward+backward", "backward"


@dataclasses.dataclass(frozen=True)
class Moment:
    """One chunk-access event.

    Attributes:
      index: position in program order.
      phase: ``"forward"``, ``"forward+backward"`` or ``"backward"``.
      stage: the stage's index.
      name: the stage's name.
      chunks: chunk ids whose values this moment reads.
      non_model_bytes: activations, temporaries and gradient accumulators alive (bytes).
    """

    index: int
    phase: str
    stage: int
    name: str
    chunks: tuple[int, ...]
    non_model_bytes: int


@dataclasses.dataclass(frozen=True)
class Tide:
    """The memory tide of one step: :class:`Moment` s in program order."""

    moments: tuple[Moment, ...]

    @property
    def peak_non_model_bytes(self) -> int:
        return max(m.non_model_bytes for m in self.moments)

    @property
    def accesses(self) -> list[tuple[int, ...]]:
        """Chunk ids read at each moment (the access trace eviction works on)."""
        return [m.chunks for m in self.moments]

    def to_dict(self) -> dict:
        """Columns for plotting: index, phase, stage name, non-model bytes, chunks."""
        return {"index": [m.index for m in self.moments], "phase": [m.phase for m in self.moments],
                "name": [m.name for m in self.moments],
                "non_model_bytes": [m.non_model_bytes for m in self.moments],
                "chunks": [list(m.chunks) for m in self.moments]}


def memory_tide(traces: tuple[StageTrace, ...], chunk_size: int) -> Tide:
    """Build the tide from per-stage traces.

    Args:
      traces: one :class:`~chunkjax.trace.StageTrace` per stage, in stage order.
      chunk_size: elements per chunk (a gradient accumulator is ``4 * chunk_size`` bytes).

    Returns:
      the :class:`Tide` with ``2 * len(traces) - 1`` moments.
    """
    n = len(traces)
    readers: dict[int, list[int]] = {}
    for s, t in enumerate(traces):
        for c in t.chunks:
            readers.setdefault(c, []).append(s)
    first = {c: min(v) for c, v in readers.items()}
    last = {c: max(v) for c, v in readers.items()}
    acc_bytes = 4 * chunk_size
    moments: list[Moment] = []
    saved = 0
    for s in range(n - 1):
        saved += traces[s].input_bytes
        moments.append(Moment(len(moments), FORWARD, s, traces[s].name, traces[s].chunks,
                              saved + traces[s].temp_bytes))
    order = [n - 1] + list(range(n - 2, -1, -1))
    saved += traces[n - 1].input_bytes
    for s in order:
        # accumulators open from the last reader's backward to the first reader's backward
        accs = sum(acc_bytes for c in first if first[c] <= s <= last[c])
        phase = FUSED if s == n - 1 else BACKWARD
        chunks = traces[s].chunks if s == n - 1 else traces[s].backward_chunks
        moments.append(Moment(len(moments), phase, s, traces[s].name, chunks, saved + traces[s].temp_bytes + accs))
        saved -= traces[s].input_bytes
    return Tide(tuple(moments))
