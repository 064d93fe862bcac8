"""The chunked training step: one class for one device and for a ZeRO data mesh.

One step is a short host-driven pipeline of jitted programs (definitions.md, "a step"):

1. the step's moments (:mod:`chunkjax.walker`: forward, the fused head, backward with per-stage
   recompute) cut into programs at the schedule's segments (one program for a plain
   :class:`~chunkjax.plan.Placement`); gradient chunks leave each program as they complete,
   reduced over the ranks on a mesh, with their squared norms for global-norm clipping;
2. updates (:mod:`chunkjax.updaters`): device chunks by one program each after the last program; streamed
   (:mod:`chunkjax.streamed`) and host chunks (a host thread) as each program's gradients complete, while the
   device runs the rest of the backward. The pending work is returned in the state (:attr:`TrainState.pending`);
   :meth:`ChunkedStep.wait` joins it, the next call per program for the chunks it takes (:mod:`chunkjax.cross_step`).

The topology (:mod:`chunkjax.topology`: one device, or a ``data`` mesh with ZeRO stage 1/2/3, in one process or
many through ``jax.distributed``) supplies the walker's hooks, the shardings and the ``shard_map`` wrapping.
Gradient accumulation over micro-batches, the non-finite policy and fp16 loss scaling work alike in every topology.

References: PatrickStar (arXiv 2108.05818) sections 4-6 (chunks, fetch before use,
device-aware update placement, data parallelism over chunks); ZeRO (Rajbhandari et al., SC 2020).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax import accumulate, cross_step, footprint, kept_programs, nonfinite, streamed
from chunkjax import updaters as upd
from chunkjax.layout import ChunkLayout
from chunkjax.loss_weight import require_weight, token_mean
from chunkjax.memory import DEVICE, sharding
from chunkjax.plan import Placement, fetch_events
from chunkjax.schedule import ACCUMULATIONS, PER_MICRO_BATCH, check_trainable, micro_group_size
from chunkjax.stages import first_readers, split_loss, stage_reads
from chunkjax.step_checkpoint import StepChunkIO, resumed_state
from chunkjax.step_commit import PendingStep, check_whole, hand_norm, in_place_updates, spoil
from chunkjax.step_init import init_state
from chunkjax.storage import updater as disk
from chunkjax.step_updates import StepUpdates
from chunkjax.topology import OnTopology, SingleDevice, make_topology
from chunkjax.train_state import TrainState
from chunkjax.speculate import check_options as check_speculation, for_step
from chunkjax.updaters import host_deadline_s
from chunkjax.walker import Walk, kept_kinds, moments_of, rank_major


@dataclasses.dataclass(frozen=True)
class ChunkedStep(StepChunkIO, StepUpdates, OnTopology):
    """A chunked training step for one (model, layout, placement or schedule, optimizer, topology).

    Build it with :func:`make_chunked_step`. ``step(state, batch) -> (state, metrics)``;
    ``metrics`` holds ``loss`` (float32 scalar, nats, mean over the whole batch, or over its scored
    tokens: :class:`~chunkjax.loss_weight.WeightedLoss`), ``grad_norm`` (global, float32) and ``aux``
    of a last stage returning ``(loss, aux)`` (one device, one micro-batch).
    Checkpointable: the protocol's methods (:class:`~chunkjax.step_checkpoint.StepChunkIO`).

    Attributes:
      stages, layout: the model's stages and chunk layout (on a mesh ``chunk_size`` is a multiple
        of the ranks: :func:`chunkjax.topology.build_zero_layout`).
      placement: where every chunk lives between steps.
      tx: the optax transformation (elementwise) of device and streamed chunks.
      compute_dtype: dtype of compute params and gradients (bf16 for mixed precision).
      prefetch: fetch distance in moments (>= 1).
      schedule: the :class:`~chunkjax.schedule.Schedule` run (fetches, programs, update locations),
        or None: a placement's fixed fetch rule (:func:`chunkjax.plan.fetch_events`), one program.
      host_optimizer: the host kernel spec of ``host`` chunks.
      micro_batches: gradient accumulation: each call splits the batch's leading axis into this
        many equal micro-batches and applies one update with the mean gradient (the same update
        as the whole batch at once, to the compute dtype's rounding; reported case 3).
      accumulation: ``"in_program"`` (looped inside each moment: :class:`chunkjax.walker.Walk`) or
        ``"per_micro_batch"`` (:func:`chunkjax.accumulate.mean_gradients`); :mod:`chunkjax.plan_micro`.
      micro_group: in-program over micro-batch groups: each pass of the programs loops over this
        many micro-batches inside its moments, ``micro_batches // micro_group`` passes a step
        summed by :func:`chunkjax.accumulate.mean_gradients` (one device); None: all in one pass
        (:func:`chunkjax.schedule.micro_group_size`).
      nonfinite: ``"ignore"`` (default: no check), ``"skip"`` (a step with NaN/inf gradients changes no
        state, ``metrics["skipped"]``) or ``"error"`` (also raises ``NonFiniteError``): :mod:`chunkjax.nonfinite`.
      loss_scaling: fp16 dynamic loss scaling: each call takes ``loss_scale``, seeds the backward
        with it, unscales the gradients in the update and skips an overflowed step.
      donate: donate the programs' carries (and, on a mesh, the updates' inputs). None: on
        accelerators, not on the CPU; True on the CPU is for tests (reported case 19).
      topology: :class:`~chunkjax.topology.SingleDevice` or :class:`~chunkjax.topology.DataMesh`.
      host_deadline: seconds a step's host updates may take before :meth:`wait` (or the next
        call) raises :class:`chunkjax.updaters.HostDeadlineError`; None: the larger of 300 s and
        50 predicted step times (:func:`chunkjax.updaters.host_deadline_s`).
      speculation_bytes, rollback, speculation_policy: speculative host updates
        (:mod:`chunkjax.speculate`): bytes of kept gradients (or backups) held at most, None: its
        ``auto_backup_bytes()``, 0: none; ``"invert"`` or ``"backup"``; ``"after_common"`` or ``"always"``.
      storage: the disk tier of ``storage`` chunks: :class:`chunkjax.storage.updater.StorageOptions`, or
        directories (:func:`~chunkjax.storage.updater.storage_options`).
      cross_step: the next call waits per program only for the host chunks it reads, not for all
        of this step's host work (:mod:`chunkjax.cross_step`; exact: no stale params). False:
        each call first joins the previous step's host work.

    Raises (at construction):
      ValueError: a bad ``micro_batches``, ``accumulation``, ``micro_group``, ``nonfinite`` or ``prefetch``, a
        ``micro_group`` of several passes on a mesh, a placement that differs from the schedule's or has another chunk count, host-updated chunks without
        ``host_optimizer``, or a ``chunk_size`` that does not split over the ranks.
    """

    stages: tuple
    layout: ChunkLayout
    placement: Placement
    tx: optax.GradientTransformation
    compute_dtype: Any
    prefetch: int = 1
    schedule: Any = None
    host_optimizer: Any = None
    micro_batches: int = 1
    nonfinite: str = "ignore"
    loss_scaling: bool = False
    donate: bool | None = None
    topology: Any = SingleDevice()
    host_deadline: float | None = None
    speculation_bytes: int | None = None
    storage: Any = None
    accumulation: str = PER_MICRO_BATCH
    rollback: str = "backup"
    speculation_policy: str = "after_common"
    cross_step: bool = True
    micro_group: int | None = None

    def __post_init__(self):
        check_speculation(self.rollback, self.speculation_policy)
        if not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.accumulation not in ACCUMULATIONS:
            raise ValueError(f"accumulation={self.accumulation!r}: use one of {ACCUMULATIONS}")
        group = micro_group_size(self.accumulation, self.micro_group, self.micro_batches)
        if 1 < group < self.micro_batches and self.n_ranks > 1:
            raise ValueError(f"micro_group={group} of micro_batches={self.micro_batches} runs on one device: on a mesh "
                             "use accumulation='in_program' without micro_group, or 'per_micro_batch'")
        nonfinite.check_policy(self.nonfinite)
        if self.schedule is not None and self.schedule.placement != self.placement:
            raise ValueError("placement differs from schedule.placement: pass the schedule's")
        if self.master_fetch_chunks and self.mesh is not None:
            raise ValueError("a schedule with master_fetch chunks runs on one device: plan the mesh without them")
        if self.host_chunks and self.host_optimizer is None:
            raise ValueError("the schedule updates chunks on the host: pass host_optimizer "
                             "(chunkjax.host_update.AdamW / Lion / SGDMomentum)")
        if self.placement.n_chunks != self.layout.n_chunks:
            raise ValueError(f"placement has {self.placement.n_chunks} chunks, layout {self.layout.n_chunks}")
        check_trainable(self.layout.chunk_trainable, self.placement, self.schedule)
        disk.check_step(self)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 stage, got {self.prefetch}")
        if self.layout.chunk_size % self.n_ranks:
            raise ValueError(f"chunk_size {self.layout.chunk_size} is not a multiple of the {self.n_ranks} ranks: "
                             "build the layout with chunkjax.topology.build_zero_layout")

    @property
    def passes(self) -> int:
        """Times the programs run per call: ``micro_batches`` per micro-batch, 1 in-program,
        ``micro_batches // micro_group`` in-program over groups."""
        return self.micro_batches // micro_group_size(self.accumulation, self.micro_group, self.micro_batches)

    @functools.cached_property
    def frozen_chunks(self) -> tuple[int, ...]:
        """Chunks without master params, optimizer state, gradient or update (``layout.chunk_trainable``)."""
        return tuple(c for c, t in enumerate(self.layout.chunk_trainable) if not t)

    @property
    def host_deadline_s(self) -> float:
        """The deadline of one step's host updates, seconds (see ``host_deadline``)."""
        predicted = self.schedule.predicted.time.step_s if self.schedule is not None else None
        return float(self.host_deadline) if self.host_deadline is not None else host_deadline_s(predicted)

    # ---- static structure ------------------------------------------------------------------------
    @functools.cached_property
    def reads(self) -> tuple[tuple[int, ...], ...]:
        return stage_reads(self.stages, self.layout)

    @functools.cached_property
    def first_reader(self) -> dict[int, int]:
        return first_readers(self.reads)

    @functools.cached_property
    def moments(self) -> tuple[tuple[str, int], ...]:
        """``(phase, stage)`` per moment (:func:`chunkjax.walker.moments_of`)."""
        return moments_of(len(self.stages))

    @functools.cached_property
    def _cache(self) -> dict:
        """Traces and compiled programs per batch shape (filled on first use)."""
        return {}

    def _traces_local(self, ab) -> tuple:
        key = ("traces", jax.tree.structure(ab), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(ab)))
        if key not in self._cache:
            from chunkjax.trace import StageTrace, backward_reads, stage_inputs
            ins = stage_inputs(self.stages, self.layout, ab, self.compute_dtype)
            last = len(self.stages) - 1
            self._cache[key] = tuple(StageTrace(st.name, r, 0, 0, backward_reads(st, self.layout, p, x, ab, i == last))
                                     for i, (st, r, (p, x)) in enumerate(zip(self.stages, self.reads, ins)))
        return self._cache[key]

    def local_batch(self, batch):
        """Abstract per-rank batch of a global batch."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((self.topology.local_rows(a.shape[0]),) + tuple(a.shape[1:]),
                                                           a.dtype), batch)

    def traces(self, batch) -> tuple:
        """Per-stage chunk reads, forward and backward, for a (global) batch shape: one rank's."""
        return self._traces_local(self.local_batch(batch))

    def _fetch_lists_local(self, ab) -> tuple[tuple[int, ...], ...]:
        """Chunk ids fetched for each moment: the schedule's, or the fixed rule's for a placement."""
        if self.schedule is not None:
            return self.schedule.fetch
        fwd, bwd = fetch_events(self._traces_local(ab), self.placement, self.prefetch)
        return tuple(tuple(fwd[s] if ph != "backward" else bwd[s]) for ph, s in self.moments)

    def _fetch_lists(self, batch):
        return self._fetch_lists_local(self.local_batch(batch))

    def walk(self, local_batch) -> Walk:
        """The walker for a per-rank batch (called inside programs, with the traced batch)."""
        ab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), local_batch)
        return Walk(self.stages, self.layout, self.topology, self.compute_dtype, self.prefetch,
                    self.placement.param_kinds, tuple(self.placement.grad_kind(c) for c in range(self.layout.n_chunks)),
                    self.reads, tuple(t.backward_chunks for t in self._traces_local(ab)),
                    self._fetch_lists_local(ab), self.first_reader, self.micro_batches // self.passes,
                    *((bool(s.unroll_micro_batches), s.remat, s.remat_names) if (s := self.schedule) is not None else ()))

    def program_bounds(self) -> list[tuple[int, int]]:
        """``[(first moment, end moment)]`` of each program (the schedule's segments)."""
        segs = (self.schedule.segments if self.schedule is not None else (0,)) + (len(self.moments),)
        return [(a, b) for a, b in zip(segs[:-1], segs[1:])]

    def _program_args(self, batch, t0: int, t1: int) -> tuple[int, ...]:
        """The param chunks program [t0, t1) takes: the ones it fetches (issued up to ``prefetch``
        moments ahead) and the device-resident ones it reads."""
        walk = self.walk(self.local_batch(batch))
        T, k = len(self.moments), self.prefetch
        lo = 0 if t0 == 0 else t0 - 1 + k + 1
        args = {c for u in range(lo, min(T, t1 - 1 + k + 1)) for c in walk.fetch[u]}
        for t in range(t0, t1):
            args |= {c for c in walk.reads_at(t) if self.placement.param_kinds[c] == DEVICE}
        return tuple(sorted(args))

    # ---- programs --------------------------------------------------------------------------------
    @property
    def _donates(self) -> bool:
        return jax.default_backend() != "cpu" if self.donate is None else bool(self.donate)

    @property
    def skips_nonfinite(self) -> bool:
        """A step whose gradients are not finite changes no state (``nonfinite`` skip/error, loss scaling)."""
        return nonfinite.skips(self.nonfinite) or self.loss_scaling

    def program(self, batch, k: int):
        """(jitted program k, param chunk ids it takes) for a (global) batch shape."""
        key = ("program", str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), batch)), k)
        if key not in self._cache:
            t0, t1 = self.program_bounds()[k]
            args = self._program_args(batch, t0, t1)
            done = [c for t in range(t0, t1) if self.moments[t][0] != "forward" for c in self.reads[self.moments[t][1]]
                    if self.first_reader[c] == self.moments[t][1] and c not in self.frozen_chunks]

            def prog(params, batch, carry, acc):
                out, grads, sq, loss = self.walk(batch).run(params, batch, dict(carry, acc=acc), t0, t1)
                return {k: v for k, v in out.items() if k != "acc"}, out.get("acc", {}), grads, sq, loss

            last = t1 == len(self.moments)
            carry_out = () if last else ("x", "saved", "held", "issued") + ("loss_scale",) * self.loss_scaling
            gk = {c: self.placement.grad_kind(c) for c in done}
            # the carry (saved activations, held chunks, gradient accumulators) is donated so that
            # XLA frees each piece after its last use. On one device the float32 accumulators
            # (argument 3) are not donated to a program emitting a float32 gradient to another memory
            # kind: jax would alias the donated accumulator with that pinned_host output (GPU:
            # "RuntimeProgramInputMismatch"; CPU: "PjRtBuffer's memory kind does not match").
            # Undonated, an accumulator passing through is held twice (issue 24)
            moved = (self.mesh is None and np.dtype(self.compute_dtype) == np.float32
                     and any(v != DEVICE for v in gk.values()))
            donate = ((2,) if moved else (2, 3)) if self._donates else ()
            kept = kept_kinds(getattr(self.schedule, "remat", ()), self.moments, t1)  # chunkjax.remat
            fn = self.topology.jit_program(prog, carry_out=carry_out, grad_kinds=gk, donate=donate, kept_kinds=kept,
                                           name=f"chunkjax_program_{k}")
            self._cache[key] = (fn, args)
        return self._cache[key]

    def runnable(self, batch, k: int, compiled=None):
        """(program k as it runs, its param chunk ids): :func:`chunkjax.kept_programs.runnable`."""
        fn, args = self.program(batch, k)
        return kept_programs.runnable(self._cache, fn, batch, k, compiled), args

    def fwd_bwd(self, params_chunks, batch):
        """The whole step's forward/backward as one program, per rank (see module docstring).

        Returns:
          (loss () f32, grads: per chunk the (rank's) gradient in ``placement.grad_kind(c)``,
          grad_sq: (n_chunks,) f32 squared norms of the whole reduced gradients)."""
        lay = self.layout
        _, grads, sq, loss = self.walk(batch).run(dict(enumerate(params_chunks)), batch, {}, 0, len(self.moments))
        for c in range(lay.n_chunks):  # chunks no stage reads: zero gradient
            if c not in grads:
                size = self.shard_size if self.mesh is not None else lay.chunk_size
                grads[c] = jnp.zeros((size,), self.compute_dtype)
                sq[c] = jnp.zeros((), jnp.float32)
        sq, loss = self.topology.reduce_scalars(sq, loss)
        return (loss, tuple(grads[c] for c in range(lay.n_chunks)), jnp.stack([sq[c] for c in range(lay.n_chunks)]))

    @functools.cached_property
    def jit_fwd_bwd(self):
        """jit of :meth:`fwd_bwd` (``shard_map`` over the mesh): ``(params tuple, batch) ->
        (loss, grads tuple, grad_sq)``."""
        return self.topology.jit_whole(self.fwd_bwd, self.placement.param_kinds,
                                       [self.placement.grad_kind(c) for c in range(self.layout.n_chunks)])

    @functools.cached_property
    def jit_loss(self):
        """jit of the forward moments (evaluation): ``(params tuple, batch) -> loss``."""
        return self.topology.jit_eval(lambda p, b: self.walk(b).forward(dict(enumerate(p)), b),
                                      self.placement.param_kinds)

    def compiled_memory(self, batch) -> dict:
        """:func:`chunkjax.footprint.compiled_memory` of this step (bytes)."""
        return footprint.compiled_memory(self, batch)

    def compiled_memory_programs(self, batch) -> list[dict]:
        """:func:`chunkjax.footprint.compiled_memory_programs` of this step (bytes)."""
        return footprint.compiled_memory_programs(self, batch)

    def pinned_host_bytes(self) -> int:
        """:func:`chunkjax.footprint.pinned_host_bytes` of this step (bytes)."""
        return footprint.pinned_host_bytes(self)

    def comm_bytes_per_step(self, batch) -> dict[str, int]:
        """:func:`chunkjax.footprint.comm_bytes_per_step` of this step (bytes per rank)."""
        return footprint.comm_bytes_per_step(self, batch)

    def device_bytes(self, state: TrainState) -> dict[str, dict[Any, int]]:
        """:func:`chunkjax.footprint.device_bytes` of ``state`` (bytes per local device)."""
        return footprint.device_bytes(self, state)

    # ---- the step ----------------------------------------------------------------------------------
    def wait(self, state: TrainState) -> float | None:
        """Block until the host updates of the step that returned ``state`` are done (before reading its
        host chunks). Returns the seconds the host thread spent in the kernels (not the waits for gradients),
        or None when it had nothing to do. Raises what the host thread raised; PartialStepError: a failed
        step left ``state`` half updated (:mod:`chunkjax.step_commit`)."""
        check_whole(self.host_chunks, state)
        out = state.pending.join() if state.pending is not None else None
        disk.wait_tail(self, state)  # the storage chunks' last writes and commit
        return out

    def __call__(self, state: TrainState, batch, loss_scale=None) -> tuple[TrainState, dict]:
        """One training step. batch: int (B, T+1), the global batch (every process passes the
        same one; on a mesh ``B`` a multiple of ``N * micro_batches``). Returns (new state,
        metrics). The programs run in order; as each finishes (with micro-batches: the last one)
        its host chunks' gradients go to a host thread, which updates them in place while the
        device runs the rest of the backward (speculatively when the factor depends on the norm:
        :mod:`chunkjax.speculate`), and its streamed ones to :mod:`chunkjax.streamed`; the returned
        state's ``pending`` holds that work. ``state``'s device buffers are donated: use the
        returned state. ``begin(state, batch).commit()``: an exception or Ctrl-C before the
        commit leaves ``state`` as it was (:mod:`chunkjax.step_commit`, with its exceptions).

        Args:
          loss_scale: with ``loss_scaling`` only: this step's loss scale (a float, best a power of
            two; see :class:`chunkjax.DynamicLossScale`).

        Raises:
          ValueError: the batch does not split over the ranks and micro-batches or (a weighted loss)
            scores no token, or ``loss_scale`` given without ``loss_scaling`` (or missing with it).
          HostDeadlineError, or what the previous step's host update raised (before this commit); PartialStepError:
            ``state`` was left half updated by a step that failed after its norm (:mod:`chunkjax.step_commit`).
          NonFiniteError: ``nonfinite="error"``, a non-finite loss or gradient norm (:mod:`chunkjax.nonfinite`).
        """
        return nonfinite.checked(self, *self.begin(state, batch, loss_scale).commit())

    def begin(self, state: TrainState, batch, loss_scale=None) -> PendingStep:
        """The step (:meth:`__call__`) up to its commit, nothing of ``state`` donated yet (host
        chunks: :mod:`chunkjax.step_commit`); the :class:`~chunkjax.step_commit.PendingStep`'s
        ``commit() -> (new state, metrics)`` dispatches the donating device updates (a caller that
        keeps its state across Ctrl-C commits and stores it inside ``interrupts_deferred()``).
        Raises what :meth:`__call__` raises."""
        if self.loss_scaling != (loss_scale is not None):
            raise ValueError("pass loss_scale exactly when the step was built with loss_scaling=True "
                             f"(loss_scaling={self.loss_scaling}, loss_scale={loss_scale!r})")
        lead = {a.shape[0] for a in jax.tree.leaves(batch)}
        if len(lead) != 1:
            raise ValueError(f"batch leaves have leading sizes {sorted(lead)}: give every leaf the batch axis")
        self.topology.check_rows(next(iter(lead)), self.micro_batches)
        check_whole(self.host_chunks, state)
        state, work, previous = cross_step.start(self, state, batch, self.cross_step and not disk.storage_chunks(self))
        try:
            return self._begin(state, batch, loss_scale, work, previous)
        except BaseException:
            cross_step.abandon(work)  # no thread of this step left writing host chunks
            raise

    def _begin(self, state, batch, loss_scale, work, previous) -> PendingStep:
        scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        inv = 1.0 if loss_scale is None else 1.0 / float(loss_scale)
        spec = work.speculation = for_step(self, work, inv, previous) if self.host_chunks else None
        stream = streamed.StepStream(self.stream_spec, state, inv_arr := jnp.asarray(inv, jnp.float32))
        on_disk = disk.StorageRun(self, state)  # storage chunks: the workers read their state from now on
        norm, (on_host, on_prog, hold) = None, in_place_updates(work, spec, state, on_disk)  # hold: Ctrl-C, see there
        try:
            grads, sq, loss = (self.run_programs(state, self.topology.put_batch(rank_major(
                batch, self.micro_batches, self.n_ranks)), scale, on_host, stream, on_prog, require_weight)
                if self.passes == 1 else accumulate.mean_gradients(self, state, batch, scale, on_host))
            (loss, aux), grad_sq = split_loss(loss), jnp.stack([sq[c] if c in sq else jnp.zeros((), jnp.float32)
                                                                for c in range(self.layout.n_chunks)])  # frozen: none
            grad_sq, norm, grad_norm = nonfinite.guard(self.nonfinite, grad_sq, token_mean(loss))
        finally:  # the host thread validates its speculation once the norm is known (None: abandoned)
            hold = hand_norm(spec, work, state, stream, on_disk, norm, grad_sq if norm is not None else None,
                             self.host_chunks, hold)  # fails after host chunks took the step in place: spoil
        params, master, opt = list(state.params), list(state.master), list(state.opt_state)
        try:  # all that can fail before the commit donates the input state (chunkjax.step_commit)
            on_disk.send(work, grads)  # storage chunks: beside the host thread and the device
            if stream.chunks:  # new buffers, the input's untouched; the host thread joins the last write-backs
                work.submit(stream.finish(grads, params, master, opt))
            metrics = {"loss": token_mean(loss), "grad_norm": grad_norm * inv_arr, **({} if aux is None else {"aux": aux})}
            if self.skips_nonfinite:
                metrics["skipped"] = ~jnp.isfinite(jnp.sum(grad_sq))
        except BaseException as e:
            stream.set_grad_sq(None)  # the pipeline stopped: no thread left waiting
            spoil(self.host_chunks, state, e)  # the host took the norm in place: the state refused
            hold.release()
            raise
        return PendingStep(self, state._replace(pending=work), grads, grad_sq, inv_arr, (params, master, opt), metrics,
                           hold=hold)

    def _zeros_grad(self, c: int):
        """The gradient of a chunk no stage reads (outside programs)."""
        if c in set(self.host_chunks):
            return np.zeros((self.layout.chunk_size,), self.compute_dtype)
        return self.topology.put(np.zeros((self.layout.chunk_size,), self.compute_dtype),
                                 self.topology.grad_sharding(self.placement.grad_kind(c)))

    def run_programs(self, state: TrainState, batch, scale, on_host=None, stream=None, on_disk=None, on_loss=None):
        """Run every program of the step on ``batch`` (placed): returns ``(grads, sq, loss)``, a
        gradient and squared norm for every chunk (zero for chunks no stage reads); ``on_loss(loss)``
        is called as the loss's program ends, before any gradient is handed on; with ``on_host``,
        host chunks' gradients go to ``on_host({c: gradient})`` as each program ends (unread ones at
        the end) and are not returned: the host thread drops each once consumed; the others to
        ``stream.on_program`` (:class:`chunkjax.streamed.StepStream`) and ``on_disk(g)``
        (:meth:`chunkjax.storage.updater.StorageRun.on_program`). ``state.pending``: the previous
        step's host work under cross-step overlap (:class:`chunkjax.cross_step.Previous`)."""
        host = set(self.host_chunks)
        prev = cross_step.Previous(state.pending, host)
        carry: dict = {} if scale is None else {"loss_scale": scale}  # carried to the loss's program
        acc, grads, sq, loss, late = {}, {}, {}, None, {}
        for k in range(len(self.program_bounds())):
            fn, args = self.runnable(batch, k)
            prev.before(args)
            carry, acc, g, q, l = fn({c: state.params[c] for c in args}, batch, carry, acc)
            if q:  # gradients leave: the previous step's host work is done first
                prev.join()
            if l is not None and on_loss is not None:
                on_loss(l)  # e.g. require_weight: a batch scoring no token refused before any update
            mine = {c: g.pop(c) for c in list(g) if c in host} if on_host is not None else {}
            grads.update(g)
            sq.update(q)
            loss = l if l is not None else loss
            if stream is not None:
                stream.on_program(g, q)
            if on_disk is not None:
                on_disk(g)
            g = None
            if mine:
                on_host(mine)
        prev.join()
        for c in range(self.layout.n_chunks):
            if c not in sq:  # chunks no stage reads: zero gradient; frozen chunks: none (their norm 0)
                if c not in self.frozen_chunks:
                    grads[c] = self._zeros_grad(c)
                    late[c] = grads[c]
                sq[c] = self.topology.put(np.zeros((), np.float32), self.topology.scalar_sharding())
        if on_host is not None and host.intersection(late):
            on_host({c: grads.pop(c) for c in late if c in host})
        return grads, sq, loss

    def with_optimizer(self, tx: optax.GradientTransformation) -> "ChunkedStep":
        """The same step with another optax transformation; the compiled forward/backward (which
        does not depend on the optimizer) is shared, only the update programs are rebuilt."""
        new = dataclasses.replace(self, tx=tx)
        for k in ("reads", "first_reader", "_cache", "jit_fwd_bwd", "jit_loss"):
            if k in self.__dict__:
                new.__dict__[k] = self.__dict__[k]
        return new

    # ---- state ---------------------------------------------------------------------------------
    def init(self, params) -> TrainState:
        """Chunk the initial params into a :class:`TrainState`, one chunk at a time.

        Args:
          params: a params pytree (any float dtype; numpy or jax arrays; on a mesh identical in
            every process), or a callable ``leaf_init(i) -> array`` giving leaf ``i`` of
            ``layout.slots`` (shape ``slots[i].shape``) so that a model larger than host memory
            twice over is never materialised whole; it may be called more than once for a leaf
            (a device chunk's compute params, a leaf spanning chunks placed apart) and must give
            the same values each time.

        Raises:
          PlanError: on a GPU, the pinned host bytes (:meth:`pinned_host_bytes`) exceed the
            runtime's pinned-host cap (:func:`chunkjax.host_memory.check_pinned_host`); nothing has
            been allocated.

        Each chunk's master params and optimizer state are placed by its update location's
        updater (:mod:`chunkjax.updaters`; on a mesh every array is built shard by shard from
        callbacks, so each process places only its own shards); compute params on the device are
        allocated after every temporary is gone, so that resident chunks sit together. The order,
        the threads and the overlap with the storage chunks' first writes:
        :mod:`chunkjax.step_init` (the state is the same bit for bit whatever the order).
        """
        return init_state(self, params)

    def checkpoint_restore(self, saved) -> TrainState:
        """A state from a checkpoint (:mod:`chunkjax.checkpoint`; :func:`chunkjax.step_checkpoint.resumed_state`)."""
        return resumed_state(self, saved)

    def master_params(self, state: TrainState):
        """The float32 master params as a pytree (frozen leaves: their params, in their dtype): on
        one device jax arrays on the default device; on a mesh numpy, gathered from every process
        under ``jax.distributed`` (a collective: every process calls it; host-updated chunks' rank
        slices too). Waits for the state's host updates."""
        self.wait(state)
        chunks = [p if m is None else m.read(c)[0] if isinstance(m, disk.DiskState) else m
                  for c, (p, m) in enumerate(zip(state.params, state.master))]
        if self.mesh is None:
            return self.layout.unpack([jax.device_put(m, sharding(DEVICE)) for m in chunks])
        topo = self.topology
        return self.layout.unpack([topo.gather_slices(m) if isinstance(m, tuple) else topo.whole(m)
                                   for m in chunks])

    def eval_loss(self, state: TrainState, batch) -> jax.Array:
        """Validation loss of ``batch`` (() float32, mean over the whole batch or its scored tokens,
        0 if a :class:`~chunkjax.loss_weight.WeightedLoss` scores none): the walker's
        forward moments with the step's fetches, on every topology (on a mesh ``B`` a multiple
        of the ranks). Waits for the state's host updates first.

        Raises:
          ValueError: the batch does not split over the ranks.
        """
        self.wait(state)
        self.topology.check_rows(jax.tree.leaves(batch)[0].shape[0], 1)
        return token_mean(self.jit_loss(state.params, self.topology.put_batch(batch)))


def make_chunked_step(stages, layout: ChunkLayout, placement, tx: optax.GradientTransformation | None = None,
                      compute_dtype=jnp.bfloat16, prefetch: int | None = None, host_optimizer=None,
                      micro_batches: int = 1, nonfinite: str = "ignore", loss_scaling: bool = False, *,
                      mesh=None, zero_stage: int | None = None, donate: bool | None = None,
                      host_deadline: float | None = None, speculation_bytes: int | None = None,
                      storage=None, accumulation: str | None = None, rollback: str = "backup",
                      speculation_policy: str = "after_common", cross_step: bool = True,
                      micro_group: int | None = None) -> ChunkedStep:
    """Build the chunked step (see :class:`ChunkedStep`). Nothing is compiled until first use.

    Args:
      stages: the model's stages.
      layout: the chunk layout (with a mesh: :func:`chunkjax.topology.build_zero_layout`).
      placement: a :class:`~chunkjax.plan.Placement` (fixed fetch rule, one program) or a
        :class:`~chunkjax.schedule.Schedule` (its fetches, evictions, programs and update
        locations; with a mesh, one rank's plan).
      tx: the optax transformation; may be omitted when ``host_optimizer`` is given (its
        ``optax()`` is used for device and streamed chunks).
      compute_dtype: dtype of compute params and gradients.
      prefetch: fetch distance (moments); defaults to the schedule's, else 1.
      host_optimizer: the host kernel spec (:mod:`chunkjax.host_update`) for ``host`` chunks.
      micro_batches: gradient accumulation over this many equal parts of each batch.
      nonfinite: ``"ignore"``, ``"skip"`` or ``"error"`` (:mod:`chunkjax.nonfinite`).
      loss_scaling: fp16 dynamic loss scaling (each call takes ``loss_scale``).
      mesh: a 1-D ``"data"`` mesh (:func:`chunkjax.topology.data_mesh`) for ZeRO data
        parallelism, in one process or across processes (``jax.distributed``); None: one device.
      zero_stage: 1, 2 or 3 with a mesh (default 3).
      donate, host_deadline, speculation_bytes, storage, accumulation, rollback, speculation_policy,
        cross_step, micro_group: see :class:`ChunkedStep` (``accumulation`` None: the schedule's, else
        ``"per_micro_batch"``; ``micro_group`` None: the schedule's when the accumulation is the schedule's,
        else None).

    Raises:
      ValueError: a bad ``micro_batches``, ``accumulation``, ``nonfinite`` or ``zero_stage``, a mesh that is not 1-D
        ``"data"``, a placement that differs from the schedule's, host-updated chunks without
        ``host_optimizer``, ``zero_stage`` without a mesh, or neither ``tx`` nor
        ``host_optimizer``.
    """
    from chunkjax.schedule import Schedule
    schedule = placement if isinstance(placement, Schedule) else None
    if schedule is not None:
        placement = schedule.placement
        prefetch = schedule.prefetch if prefetch is None else prefetch
    if tx is None:
        if host_optimizer is None:
            raise ValueError("pass tx (an optax transformation) or host_optimizer")
        tx = host_optimizer.optax()
    return ChunkedStep(tuple(stages), layout, placement, tx, jnp.dtype(compute_dtype),
                       1 if prefetch is None else prefetch, schedule, host_optimizer, micro_batches, nonfinite,
                       loss_scaling, donate, make_topology(mesh, zero_stage), host_deadline, speculation_bytes, storage,
                       accumulation or (schedule.accumulation if schedule is not None else PER_MICRO_BATCH),
                       rollback, speculation_policy, bool(cross_step),
                       micro_group if micro_group is not None or schedule is None
                       or (accumulation or schedule.accumulation) != schedule.accumulation else schedule.micro_group)
