"""The drop-in for ``nnx.Optimizer``: :class:`NnxOptimizer`, a :class:`chunkjax.ChunkedOptimizer`
over an NNX model's trainable variables, written back into the model in place
(:mod:`chunkjax.nnx_write`), whose checkpoints also hold the model's non-parameter state
(:mod:`chunkjax.nnx_side`)."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from chunkjax import nnx_side, nnx_write
from chunkjax.flax_api import ChunkedOptimizer
from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, sharding
from chunkjax.step_commit import SignalHold, applied_on_interrupt


_MSG_IN_JIT = ("chunkjax.NnxOptimizer.update cannot run inside nnx.jit / jax.jit (it got traced gradients): return the "
               "grads from the jitted function and call optimizer.update(model, grads) outside jax.jit / nnx.jit (it moves "
               "chunks between host and device memory), or use chunkjax.offload(model, tx, loss_fn, batch, "
               "device_budget=...) for one step")


def _check_kwargs(kwargs: dict) -> None:
    """TypeError (one line, naming NnxOptimizer) for a keyword :class:`ChunkedOptimizer` does not
    take, or no ``device_budget``: before the model is touched."""
    import inspect
    known = set(inspect.signature(ChunkedOptimizer.__init__).parameters) - {"self", "params", "tx"}
    for k in kwargs:
        if k not in known:
            raise TypeError(f"NnxOptimizer() got an unexpected keyword argument {k!r}")
    if "device_budget" not in kwargs:
        raise TypeError("NnxOptimizer() missing required keyword argument 'device_budget': the device bytes of the "
                        "optimizer's chunks, e.g. device_budget='2GiB' (bytes, a size string or 'min')")


class NnxOptimizer:
    """Drop-in for ``nnx.Optimizer(model, tx, wrt=...)`` with the optimizer state chunked and
    offloaded (:class:`ChunkedOptimizer` over ``nnx.state(model, wrt)``).

    Unlike ``nnx.Optimizer``, :meth:`update` runs outside ``nnx.jit``: jit the function that
    returns the gradients (``nnx.value_and_grad``), then call ``opt.update(model, grads)``.

    Args:
      model: an ``nnx.Module``; its ``wrt`` state (float arrays) initialises the master params.
      tx: an optax transformation, or a host kernel spec such as
        ``chunkjax.host_update.AdamW(1e-4)`` (part of the offloaded chunks then update on the
        host kernel in parallel with the streamed ones; see :class:`ChunkedOptimizer`).
      wrt: the nnx filter of trainable variables (default ``nnx.Param``); the grads passed to
        :meth:`update` must have the structure of ``nnx.state(model, wrt)`` (what ``nnx.grad``
        returns for ``wrt=nnx.Param``).
      **kwargs: ``device_budget`` (required), ``chunk_size``, ``min_chunks``, ``order``,
        ``check_tx``, ``host_chunks``, ``pipeline_depth``, ``rates``, ``host_threads``, ``lean_streamed``: as
        :class:`ChunkedOptimizer`.

    Checkpoints (``chunkjax.save_checkpoint(dir, n, opt)`` / ``chunkjax.restore_checkpoint(dir,
    opt)``) hold the optimizer's chunks and the model's non-parameter state (every variable
    outside ``wrt``: dropout RNG keys and counts, BatchNorm statistics, user counters;
    :mod:`chunkjax.nnx_side`), so that save -> restore -> continue equals uninterrupted training
    bit for bit. The optimizer keeps a reference to its model (the one given to the constructor,
    then the last one given to :meth:`update`): a save reads that model's state, a restore writes
    the non-parameter state back into it (the params come back as the return value, for
    ``nnx.update(model, params)``).

    Attributes:
      chunked: the underlying :class:`ChunkedOptimizer`. step: updates done. model: the model
        whose non-parameter state checkpoints save and restore.

    Raises:
      as :class:`ChunkedOptimizer`.
    """

    def __init__(self, model, tx, *, wrt: Any = None, **kwargs):
        from flax import nnx
        _check_kwargs(kwargs)
        self.wrt = nnx.Param if wrt is None else wrt
        self.model = model
        # commit the params to the device now: update() returns committed arrays, and a jitted
        # step that first saw uncommitted ones would compile a second time; the model's other
        # uncommitted arrays too (counters, constants: nnx.jit's outputs are committed). First, so
        # that the optimizer's lean chunks take the model's own arrays as their master (no copy)
        nnx.update(model, jax.device_put(nnx.state(model, self.wrt), sharding(DEVICE)))
        nnx.update(model, jax.tree.map(lambda x: jax.device_put(x, sharding(DEVICE))
                                       if isinstance(x, jax.Array) and not x.committed else x, nnx.state(model)))
        state = nnx.state(model, self.wrt)
        self.chunked = ChunkedOptimizer(state, tx, **kwargs)
        self._paths = nnx_write.variable_paths(state)  # per leaf, its Variable's path in the model

    @property
    def step(self) -> int:
        return self.chunked.step

    def update(self, model, grads) -> None:
        """Apply one step to ``model`` in place (``nnx.update``). grads: ``nnx.State`` of the
        ``wrt`` variables (e.g. from ``nnx.grad(loss_fn)(model, ...)``). Returns once every update
        is dispatched (:meth:`ChunkedOptimizer.update`); the next jitted step waits on the device
        for the new params; :meth:`wait` joins what is still in flight.

        Raises:
          TypeError: called inside ``jax.jit`` / ``nnx.jit`` (traced gradients; one line).
          ValueError: ``grads`` has another structure or leaf shapes (one line naming the leaf).
        """
        from flax import nnx
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(grads)):
            raise TypeError(_MSG_IN_JIT)
        c = self.chunked
        self.model = model
        hold = SignalHold()  # a Ctrl-C from the first chunk's update on waits for the model's update
        with applied_on_interrupt(hold, "chunkjax: Ctrl-C came during this update and was held until it ended: the "
                                        "model and the optimizer took it, do not repeat its batch"):
            leaves = c._update_leaves(grads, hold)
            c._pending_phases.mark("finish")  # the caller's clock (UpdateBreakdown)
            if not nnx_write.write(model, self._paths, leaves):  # the variables at their paths, else nnx.update
                nnx.update(model, c.layout.treedef.unflatten(leaves))
            c._returned_at = c._pending_phases.mark("model_update")

    # ---- checkpoints: chunkjax.checkpoint.protocol.ChunkIO of the underlying ChunkedOptimizer ----
    @property
    def layout(self) -> ChunkLayout:
        return self.chunked.layout

    @property
    def compute_dtype(self) -> np.dtype:
        return self.chunked.compute_dtype

    def wait(self, state=None) -> None:
        self.chunked.wait(state)

    def checkpoint_info(self) -> dict:
        """The :class:`ChunkedOptimizer`'s, with the model's non-parameter state in ``meta``
        (:func:`chunkjax.nnx_side.side_entry`)."""
        info = self.chunked.checkpoint_info()
        return dict(info, meta={**info["meta"], **nnx_side.side_entry(self.model, self.wrt)})

    def checkpoint_arrays(self, c: int) -> dict:
        return self.chunked.checkpoint_arrays(c)

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        return self.chunked.checkpoint_chunk(state, c, copy=copy)

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        return self.chunked.checkpoint_master(state, c)

    def checkpoint_restore(self, saved):
        """As :meth:`ChunkedOptimizer.checkpoint_restore`, and the model's non-parameter state
        written back into :attr:`model` (checked before anything changes: a one-line
        CheckpointError naming the first key, shape or dtype that differs); returns the
        ``nnx.State`` of the ``wrt`` variables for ``nnx.update(model, params)``."""
        side = nnx_side.saved_side(self.model, self.wrt, saved)
        params = self.chunked.checkpoint_restore(saved)
        if side is not None:
            nnx_side.write_side(self.model, self.wrt, side)
        return params

    def summary(self) -> str:
        return self.chunked.summary()


# a pytree with no leaves, itself as its static part: passed to nnx.jit / jax.jit (the nnx.Optimizer habit) the
# same object reaches the traced function, whose update() then refuses the traced gradients in one line (not
# JAX's many-line 'not a valid JAX type'); as a static argument it stays usable, as before
jax.tree_util.register_pytree_node(NnxOptimizer, lambda opt: ((), opt), lambda opt, _: opt)
