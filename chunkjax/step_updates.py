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
import numpy as np

from chunkjax import optim, streamed
from chunkjax import updaters as upd
from chunkjax.host_memory import init_reserve_bytes
from chunkjax.memory import DEVICE, PINNED_HOST
from chunkjax.predict import chunk_bytes, streamed_pipeline_bytes
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

    def held_beside_programs(self, batch) -> list[int]:
        """Per program of the step, the device bytes (one rank's) the step holds when it launches
        beside the program's own arguments, outputs and temporaries and beside the device-updated
        chunks' master params and optimizer state (which ``fit.compiled_peak`` counts itself):

        * compute params of device-kind chunks the program does not take (model data between
          steps: every program holds all of them, but its arguments are only those it reads);
        * gradients of device-updated chunks completed by earlier programs of the pass, waiting
          on the device for the update after the last program (:meth:`run_programs` keeps them);
        * with early streamed updates (:attr:`stream_spec` ``early``), the streamed pipeline's
          buffers (:func:`chunkjax.predict.streamed_pipeline_bytes`) from the end of the first
          program completing a streamed chunk's gradient.

        The plan counts the same (:func:`chunkjax.predict.tide_moment_bytes`); the compiled check
        adds these to each program's compiled peak (measured with ``jax.live_arrays`` at every
        launch: tests/test_live_device_bytes.py, docs/device_live_bytes.md). PatrickStar (arXiv
        2108.05818) section 4: model data and non-model data on the device at each moment.

        Args:
          batch: the batch one pass of the programs runs on (global; arrays or ``ShapeDtypeStruct``).

        Returns:
          one int per program (bytes), in program order.
        """
        lay, kinds = self.layout, self.placement.param_kinds
        it = np.dtype(self.compute_dtype).itemsize
        whole = self.mesh is None or self.zero_stage != 3  # a device-kind chunk's params per rank
        params_of = {c: (lay.chunk_bytes(c) if c in self.frozen_chunks else lay.chunk_size * it)
                     // (1 if whole else self.n_ranks) for c in range(lay.n_chunks) if kinds[c] == DEVICE}
        grad = self.shard_size * it
        bounds = self.program_bounds()
        done_at = {s: t for t, (ph, s) in enumerate(self.moments) if ph != "forward"}

        def program_of(t):
            return next(k for k, (a, b) in enumerate(bounds) if a <= t < b)

        done = {c: program_of(done_at[s]) for c, s in self.first_reader.items() if c not in self.frozen_chunks}
        dev = [c for c in self.device_chunks if c in done]
        first_streamed = min((done[c] for c in self.streamed_chunks if c in done), default=len(bounds))
        pipe = 0
        if self.stream_spec.early:
            cb = chunk_bytes(lay, self.compute_dtype, optim.state_bytes_per_chunk(self.tx, lay.chunk_size))
            pipe = streamed_pipeline_bytes(lay.chunk_size, cb)
        out = []
        for k, (t0, t1) in enumerate(bounds):
            args = set(self._program_args(batch, t0, t1))
            out.append(sum(b for c, b in params_of.items() if c not in args)
                       + grad * sum(done[c] < k for c in dev) + (pipe if k > first_streamed else 0))
        return out

    def update_host_chunks(self, state, grads: dict, grad_scale) -> float:
        """Update host chunks in place (runs on the host-update thread): returns kernel seconds."""
        return self.updaters["host"].update(state, grads, grad_scale)

    def location(self, c: int) -> str:
        """Chunk ``c``'s update location (frozen: ``none``; the schedule's and the placement's
        agree with the layout on them)."""
        return (self.schedule or self.placement).update_locations[c]
