"""Where a :class:`chunkjax.ChunkedStep`'s chunks update: its update locations and their updaters.

A mixin of the step (as :class:`chunkjax.step_checkpoint.StepChunkIO`): ``self`` is the step. The
update locations come from the schedule (definitions.md, "update location"); each has one
:class:`~chunkjax.updaters.Updater` (:mod:`chunkjax.updaters`). Host chunks come in two forms
(:mod:`chunkjax.host_forms`): with a compute-dtype copy in pinned host memory, or
*master-fetch* (:attr:`StepUpdates.master_fetch_chunks`).
"""
from __future__ import annotations

import functools

import jax

from chunkjax import streamed
from chunkjax import updaters as upd
from chunkjax.host_memory import init_reserve_bytes
from chunkjax.memory import PINNED_HOST
from chunkjax.storage import updater as disk


class StepUpdates:
    """The update locations of a :class:`chunkjax.ChunkedStep` (a mixin: ``self`` is the step)."""

    @functools.cached_property
    def host_chunks(self) -> tuple[int, ...]:
        """Chunks updated in place on the host (update location ``host``)."""
        if self.schedule is None:
            return ()
        return tuple(c for c, u in enumerate(self.schedule.update_locations) if u == "host")

    @property
    def grad_window(self) -> int:
        """Programs whose host-chunk gradients may exist at once (the schedule's
        ``grad_window``: :meth:`chunkjax.updaters.HostWork.hand_over`)."""
        return int(getattr(self.schedule, "grad_window", upd.GRAD_WINDOW_PROGRAMS))

    @functools.cached_property
    def master_fetch_chunks(self) -> tuple[int, ...]:
        """Host chunks without a compute copy: ``params[c]`` is the float32 master params in pinned
        host memory, fetched and cast on the device; ``master[c]`` a numpy view of it."""
        return () if self.schedule is None else tuple(self.schedule.master_fetch)

    @functools.cached_property
    def device_chunks(self) -> tuple[int, ...]:
        """Chunks whose state lives and updates on the device (update location ``device``)."""
        return tuple(c for c in range(self.layout.n_chunks) if self.location(c) == "device")

    @functools.cached_property
    def streamed_chunks(self) -> tuple[int, ...]:
        """Chunks whose state lives in pinned host memory and updates on the device (``streamed``)."""
        return tuple(c for c in range(self.layout.n_chunks) if self.location(c) == "streamed")

    @functools.cached_property
    def stream_spec(self) -> streamed.StreamSpec:
        """What the step's streamed updates (:class:`chunkjax.streamed.StepStream`) need, decided
        once: the chunks, their param kinds, the streamed updater's programs and whether the
        updates start early (the schedule's ``streamed_early`` where
        :func:`chunkjax.streamed.starts_early` allows it for this ``tx`` and step settings)."""
        chunks = self.streamed_chunks
        early = bool(chunks) and bool(getattr(self.schedule, "streamed_early", False)) and streamed.starts_early(
            self.tx, skip=self.skips_nonfinite, loss_scaling=self.loss_scaling, micro_batches=self.passes,
            n_ranks=self.n_ranks)
        return streamed.StreamSpec(chunks, self.placement.param_kinds, self.updaters["streamed"].update,
                                   self.topology, upd.state_template(self.tx, self.layout.chunk_size) if chunks else None,
                                   early)

    @functools.cached_property
    def storage_early(self) -> bool:
        """Whether the storage chunks update as their gradients complete, before the global norm is
        known (decided once; :func:`chunkjax.storage.updater.updates_early`): the update provably
        does not read the norm (:func:`chunkjax.streamed.starts_early` for this ``tx`` and step
        settings), the host spec does not clip, and ``StorageOptions.early_updates`` without top-k
        (which selects over all gradients at once)."""
        return bool(self.storage is not None and self.storage.early_updates and self.storage.compression is None
                    and self.host_optimizer is not None and self.host_optimizer.max_grad_norm is None
                    and streamed.starts_early(self.tx, skip=self.skips_nonfinite, loss_scaling=self.loss_scaling,
                                              micro_batches=self.passes, n_ranks=self.n_ranks))

    @functools.cached_property
    def updaters(self) -> dict[str, upd.Updater]:
        """``{"device", "streamed", "host"[, "storage"]}`` -> the location's :class:`~chunkjax.updaters.Updater`."""
        kw = dict(skip=self.skips_nonfinite, loss_scaling=self.loss_scaling,
                  donate=self.mesh is None or self._donates)
        args = (self.topology, self.tx, self.layout.chunk_size, self.compute_dtype, set(self.placement.param_kinds))
        out = {"device": upd.device_updater(*args, **kw),
               "streamed": upd.device_updater(*args, state_kind=PINNED_HOST, **kw)}
        if self.host_optimizer is not None:
            out["host"] = upd.host_updater(self.topology, self.host_optimizer, self.layout.chunk_size,
                                           self.compute_dtype, self.master_fetch_chunks,
                                           init_reserve_bytes(self.schedule, jax.default_backend()))
        return out | disk.updaters_of(self)  # "storage": chunkjax.storage.updater

    def update_host_chunks(self, state, grads: dict, grad_scale) -> float:
        """Update host chunks in place (runs on the host-update thread): returns kernel seconds."""
        return self.updaters["host"].update(state, grads, grad_scale)

    def location(self, c: int) -> str:
        """Chunk ``c``'s update location (frozen: ``none``; the schedule's and the placement's
        agree with the layout on them)."""
        return (self.schedule or self.placement).update_locations[c]
