"""The state of a chunked run: its chunk lists (:class:`TrainState`), what
:meth:`chunkjax.ChunkedStep.init` builds and every step returns."""
from __future__ import annotations

from typing import Any, NamedTuple


class TrainState(NamedTuple):
    """Model data of a chunked run: PatrickStar's chunk lists on one offset layout.

    Attributes:
      params: per chunk, (chunk_size,) compute-dtype params in the placement's param kind; on a
        mesh ``P("data")`` (stage 3) or replicated; frozen chunks: their leaves' dtype.
      master: per chunk (None: frozen), (chunk_size,) float32 master params in its state kind (on a
        mesh ``P("data")``); host-updated chunks: numpy (one device) or a tuple with one
        (chunk_size / N,) numpy slice per rank (None for ranks of other processes).
      opt_state: per chunk (None: frozen), the chunk's optax state (on a mesh every leaf with a leading rank
        axis, ``P("data")``); host-updated chunks: a ``Host*State`` (:mod:`chunkjax.host_update`)
        or one per rank.
      pending: the host thread's work of the step that returned this state
        (:class:`chunkjax.updaters.HostWork`), or None.
      speculation: a state restored from a checkpoint: the last step's outcome the speculation
        policy reads (:class:`chunkjax.speculate.Resumed`), until the next step; else None.
    """

    params: tuple
    master: tuple
    opt_state: tuple
    pending: Any = None
    speculation: Any = None
