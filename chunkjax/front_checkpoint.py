"""The :class:`chunkjax.OffloadedStep`'s side of the checkpoint protocol
(:class:`chunkjax.checkpoint.protocol.ChunkIO`): the step keeps its own state, so it is saved and
restored like a drop-in optimizer::

    chunkjax.save_checkpoint(ckpt_dir, n, step, extra={"data_position": n})
    ...
    step = chunkjax.offload(MyModel(...), tx, loss_fn, batch, device_budget=...)   # a new process
    state, extra = chunkjax.restore_checkpoint(ckpt_dir, step)                     # the step holds it

The chunks (params, float32 master params, optimizer moments) are the
:class:`chunkjax.ChunkedStep`'s (:mod:`chunkjax.step_checkpoint`: any placement, device count or
chunk size on restore); the non-parameter state the loss changes (dropout RNG counts, counters,
batch statistics: :attr:`chunkjax.discover.Discovery.mutable`) goes into ``meta.json`` as
``side_state`` (``{"keys": [leaf path, ...], "values": [array, ...]}``, arrays as
:mod:`chunkjax.checkpoint.codec` writes them), so a resumed run draws the same dropout masks as
the uninterrupted one: bit-exact.

Restoring checks everything before it lets go of the step's state: the parameter tree (the
checkpoint package), the non-parameter state (keys, shapes, dtypes), every chunk's optimizer
moments and every chunk file's crc32 (one extra read of the checkpoint). A mismatch is one
:class:`~chunkjax.checkpoint.protocol.CheckpointError` line naming what differs, the step
unchanged. Only then is the old state released (so the device and host hold the state once, not
twice, as the plan counts) and the new one built; should that fail (an I/O error, out of memory)
the step has no state and says so in one line until a restore succeeds.
"""
from __future__ import annotations

import contextlib

import numpy as np

from chunkjax.checkpoint.codec import encode
from chunkjax.checkpoint.protocol import CheckpointError
from chunkjax.nnx_side import side_by_key
from chunkjax.step_checkpoint import check_moments
from chunkjax.step_commit import PartialStepError, interrupts_deferred

#: The meta.json entry of the non-parameter state.
SIDE_STATE = "side_state"


class NoStateError(RuntimeError):
    """The step has no state: a restore failed after the old state was released."""


class OffloadedChunkIO:
    """The checkpoint protocol's methods of :class:`chunkjax.OffloadedStep` (a mixin: ``self``
    is the front door's step; ``state`` arguments are ignored, it keeps its own)."""

    @property
    def compute_dtype(self):
        """dtype of the params a checkpoint saves per chunk (the step's compute dtype)."""
        return self.step.compute_dtype

    def _held(self):
        """The step's :class:`chunkjax.TrainState`; raises :class:`NoStateError` (one line) after a failed restore."""
        if self.state is None:
            raise NoStateError(f"the step has no state: {self._no_state}; restore a checkpoint "
                               "(chunkjax.restore_checkpoint) or build the step again")
        return self.state

    def _side_keys(self) -> list[str]:
        d = self.discovery
        return [str(d.side_keys[j]) for j in d.mutable]

    def wait(self, state=None):
        """Block until the last step's host updates are done (``state`` ignored); the seconds the
        host thread spent in its kernels (None: no host updates)."""
        del state
        return self.step.wait(self._held())

    def checkpoint_info(self) -> dict:
        """The step's (:meth:`chunkjax.ChunkedStep.checkpoint_info`) as ``saved_from`` OffloadedStep,
        with the non-parameter state in ``meta`` (:data:`SIDE_STATE`)."""
        info = self.step.checkpoint_info()
        side = {"keys": self._side_keys(), "values": encode(list(self._side), SIDE_STATE)}
        return dict(info, saved_from=dict(info["saved_from"], step=type(self).__name__), needs_state=False,
                    meta={SIDE_STATE: side})

    def checkpoint_state_meta(self, state=None) -> dict:
        """The step's :meth:`chunkjax.ChunkedStep.checkpoint_state_meta` of the state it holds."""
        del state
        return self.step.checkpoint_state_meta(self._held())

    def checkpoint_arrays(self, c: int) -> dict:
        """``{name: ((chunk_size,), dtype)}`` of chunk ``c`` (the step's)."""
        return self.step.checkpoint_arrays(c)

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        """Chunk ``c`` of the step's state in the portable form (the step's)."""
        del state
        return self.step.checkpoint_chunk(self._held(), c, copy=copy)

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s (chunk_size,) float32 master params (the step's)."""
        del state
        return self.step.checkpoint_master(self._held(), c)

    def _saved_side(self, saved) -> tuple:
        """The checkpoint's non-parameter state as this step's ``_side`` (numpy), checked against
        it; one-line CheckpointError naming the first key, shape or dtype that differs."""
        entry = saved.meta.get(SIDE_STATE)
        keys = self._side_keys()
        if entry is None:
            if keys:
                raise CheckpointError(f"{saved.where} holds no non-parameter state (saved from a "
                                      f"{saved.meta.get('saved_from', {}).get('step', '?')}), but this model's loss "
                                      f"changes {keys[0]!r}: restore a checkpoint of an OffloadedStep of this model")
            return ()
        by_key = side_by_key(saved, entry, keys, "which this model's loss does not change")
        out = []
        for k, j in zip(keys, self.discovery.mutable):
            v, now = by_key[k], self.discovery.side_values[j]  # numpy, or a typed PRNG key array
            if tuple(np.shape(v)) != tuple(np.shape(now)) or v.dtype != now.dtype:
                raise CheckpointError(f"non-parameter state {k!r} is {tuple(np.shape(v))} {v.dtype} in {saved.where} "
                                      f"but {tuple(np.shape(now))} {now.dtype} in this model: restore a checkpoint of "
                                      "this model")
            out.append(v)
        return tuple(out)

    def checkpoint_restore(self, saved):
        """Replace the step's state and non-parameter state with the checkpoint's; returns the new
        :class:`chunkjax.TrainState` (the step holds it as ``state``). Everything is checked first
        (module docstring); the old state is released before the new one is built.

        Raises:
          CheckpointError: another non-parameter state, another optimizer's moments, or a corrupt
            chunk file (one line; the step unchanged). Errors while building the new state leave
            the step without a state (:class:`NoStateError` on use) and are raised as they are.
        """
        side = self._saved_side(saved)
        check_moments(self.step, saved)
        saved.verify()
        if self.state is not None:
            with contextlib.suppress(PartialStepError):  # a state a failed step left half updated: replaced
                self.step.wait(self.state)
        try:
            with interrupts_deferred():
                self.state, self._no_state = None, f"restoring {saved.where} did not finish"
            state = self.step.checkpoint_restore(saved)
            side = self._place_side(side)
        except BaseException as e:
            self._no_state = f"restoring {saved.where} failed ({type(e).__name__})"
            raise
        with interrupts_deferred():
            self.state, self._side, self._no_state = state, side, None
        return state
