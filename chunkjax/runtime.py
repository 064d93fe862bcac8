"""The chunked training step: executes a :class:`~chunkjax.plan.Placement` with jitted programs.

One step is a short host-driven pipeline of jitted programs (definitions.md, "a step"):

1. ``fwd_bwd`` (one jit): runs the stages in order. Chunks whose params live in pinned host
   memory are fetched to the device ``prefetch`` stages ahead of the stage that reads them, each
   fetch tied by ``jax.lax.optimization_barrier`` to the activation of the stage it is issued at
   (without the tie XLA hoists every fetch to the program start: gpu_facts.md). Only stage inputs
   are saved; the backward pass re-fetches each stage's chunks tied to the incoming cotangent,
   recomputes the stage with ``jax.vjp`` (activation checkpointing per stage) and accumulates
   float32 gradient chunks. When a chunk's gradient is complete it leaves the program as a
   compute-dtype chunk: kept on the device if the chunk's update runs there, otherwise moved to
   pinned host memory at once (tied to the next cotangent so it cannot be postponed). The squared
   norm of every gradient chunk is returned for global-norm clipping.
2. ``update`` programs: one jit for all chunks whose state is on the device; one jit call per
   chunk whose state is in pinned host memory (*streamed*: grad, master and state go to the
   device, are updated there and go back). Both run the user's optax transformation unchanged
   (:mod:`chunkjax.optim`).

References: PatrickStar (arXiv 2108.05818) sections 4-5 (chunks, fetch before use, device-aware
update placement); gpu_probe6.py in shared/probes for the tied-fetch custom backward.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax import memory, optim
from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST, ordered_after, sharding
from chunkjax.plan import fetch_events
from chunkjax.schedule import Placement
from chunkjax.stages import first_readers, stage_reads


class TrainState(NamedTuple):
    """Model data of a chunked run: PatrickStar's chunk lists on one offset layout.

    Attributes:
      params: per chunk, (chunk_size,) compute-dtype params, in ``placement.param_kinds``.
      master: per chunk, (chunk_size,) float32 master params, in ``placement.state_kinds``.
      opt_state: per chunk, the chunk's optax state, in ``placement.state_kinds``.
    """

    params: tuple
    master: tuple
    opt_state: tuple




@dataclasses.dataclass(frozen=True)
class ChunkedStep:
    """A compiled chunked training step for one (model, layout, placement, optimizer).

    Build it with :func:`make_chunked_step`. Call ``step(state, batch) -> (state, metrics)``;
    ``metrics`` holds ``loss`` (float32 scalar, nats) and ``grad_norm`` (global, float32).

    Attributes:
      stages: the model's stages.
      layout: chunk layout of the params.
      placement: where every chunk lives between steps.
      tx: the optax transformation (elementwise).
      compute_dtype: dtype of compute params and gradients (bf16 for mixed precision).
      prefetch: fetch distance in stages (>= 1).
      micro_batches: gradient accumulation: each call splits the batch's leading axis into this
        many equal micro-batches, runs the forward/backward on each, and applies one update with
        the mean gradient (the same update as the whole batch at once, to the compute dtype's
        rounding; reported case 3). Host updates then wait for the last micro-batch.
      nonfinite: ``"ignore"`` (default: no check, as plain bf16 training), or ``"skip"``: a step
        whose gradients hold a NaN or inf (global norm not finite) changes no state (params,
        master params, optimizer state and its step count) and reports ``metrics["skipped"]``
        True. ``"skip"`` makes host updates wait for the global norm, as clipping does.
      loss_scaling: fp16 dynamic loss scaling: each call takes ``loss_scale`` (a float; keep it
        in a :class:`chunkjax.DynamicLossScale`), seeds the backward with it, unscales the
        gradients in the update and skips a step whose scaled gradients overflowed (as
        ``nonfinite="skip"``: no state changes; ``metrics["skipped"]``).
      donate: donate the programs' carries (saved activations, gradient accumulators) and, in
        ZeRO steps, the updates' inputs. None (default): on accelerators, not on the CPU; True on
        the CPU is for tests (reported case 19). An accumulator is never donated to a program that
        moves its gradient to another memory kind (jax would alias the two across memory kinds).
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

    def __post_init__(self):
        if not (isinstance(self.micro_batches, int) and self.micro_batches >= 1):
            raise ValueError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.nonfinite not in ("ignore", "skip"):
            raise ValueError(f"nonfinite={self.nonfinite!r}: use 'ignore' or 'skip'")
        if self.schedule is not None and self.schedule.placement != self.placement:
            raise ValueError("placement differs from schedule.placement: pass the schedule's")
        if self.host_chunks and self.host_optimizer is None:
            raise ValueError("the schedule updates chunks on the host: pass host_optimizer "
                             "(chunkjax.host_update.AdamW / Lion / SGDMomentum)")
        if self.placement.n_chunks != self.layout.n_chunks:
            raise ValueError(f"placement has {self.placement.n_chunks} chunks, layout {self.layout.n_chunks}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 stage, got {self.prefetch}")

    # ---- static structure ------------------------------------------------------------------
    @functools.cached_property
    def reads(self) -> tuple[tuple[int, ...], ...]:
        return stage_reads(self.stages, self.layout)

    @functools.cached_property
    def first_reader(self) -> dict[int, int]:
        return first_readers(self.reads)

    def traces(self, batch) -> tuple:
        """Per-stage chunk reads, forward and backward, for a batch shape (abstract tracing)."""
        ab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)  # any pytree batch
        key = (jax.tree.structure(ab), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(ab)))
        cache = self.__dict__.setdefault("_traces_cache", {})
        if key not in cache:
            from chunkjax.trace import StageTrace, backward_reads, stage_inputs
            ins = stage_inputs(self.stages, self.layout, ab, self.compute_dtype)
            cache[key] = tuple(StageTrace(st.name, r, 0, 0, backward_reads(st, self.layout, p, x, ab))
                               for st, r, (p, x) in zip(self.stages, self.reads, ins))
        return cache[key]

    def _fetch_plan(self, order: list[int], batch) -> list[list[int]]:
        """For each position in ``order``: chunk ids to fetch anew there (the rule of
        :func:`chunkjax.plan.fetch_events`)."""
        fwd, bwd = fetch_events(self.traces(batch), self.placement, self.prefetch)
        src = fwd if order[0] == 0 else bwd
        return [src[s] for s in order]

    # ---- programs ----------------------------------------------------------------------------
    def _run_pass(self, params_chunks, batch, order, body, anchor):
        """Walk ``order`` of stages, fetching host chunks ``prefetch`` positions ahead.

        ``body(pos, stage_idx, chunk_arrays, anchor) -> anchor`` runs one stage. In the backward
        order, chunks whose values the stage's gradient does not need are not fetched (their
        slot holds zeros, which the compiler removes).
        """
        if not order:  # one-stage model: the backward pass ran fused with the forward
            return anchor
        dev = sharding(DEVICE)
        new_fetch = self._fetch_plan(order, batch)
        backward = order[0] != 0
        traces = self.traces(batch)
        k = self.prefetch
        current: dict[int, jax.Array] = {}
        issued: dict[tuple[int, int], jax.Array] = {}

        def issue(upto: int, anchor):
            tie = batch if anchor is None else anchor  # the first fetches wait for the batch
            for p in range(upto, min(len(order), upto + k + 1)):
                for c in new_fetch[p]:
                    if (p, c) not in issued:
                        issued[(p, c)] = jax.device_put(ordered_after(tie, params_chunks[c]), dev)

        for pos, s in enumerate(order):
            issue(pos, anchor)
            needed = traces[s].backward_chunks if backward else self.reads[s]
            arrays = {}
            for c in self.reads[s]:
                if c not in needed:
                    arrays[c] = jnp.zeros((self.layout.chunk_size,), self.compute_dtype)
                    continue
                if self.placement.param_kinds[c] == DEVICE:
                    current[c] = params_chunks[c]
                elif (pos, c) in issued:
                    current[c] = issued.pop((pos, c))
                arrays[c] = current[c]
            anchor = body(pos, s, arrays, anchor)
        return anchor

    def _sub(self, arrays, s):
        return self.layout.unpack_subtree(arrays, self.stages[s].param_keys)

    def loss(self, params_chunks, batch):
        """Forward only: mean loss (float32) with the same fetch rule (for validation)."""
        n = len(self.stages)
        out = {}

        def body(pos, s, arrays, x):
            y = self.stages[s].apply(self._sub(arrays, s), x, batch)
            if s == n - 1:
                out["loss"] = y
            return y

        self._run_pass(params_chunks, batch, list(range(n)), body, None)
        return out["loss"]

    # ---- the moment walker (one step = moments in tide order, cut into programs) ----------------
    @functools.cached_property
    def moments(self) -> tuple[tuple[str, int], ...]:
        """``(phase, stage)`` per moment: forward 0..n-2, the fused head, backward n-2..0."""
        n = len(self.stages)
        return (tuple(("forward", s) for s in range(n - 1)) + (("forward+backward", n - 1),)
                + tuple(("backward", s) for s in range(n - 2, -1, -1)))

    def _fetch_lists(self, batch) -> tuple[tuple[int, ...], ...]:
        """Chunk ids fetched for each moment: the schedule's, or the fixed rule's for a placement."""
        if self.schedule is not None:
            return self.schedule.fetch
        fwd, bwd = fetch_events(self.traces(batch), self.placement, self.prefetch)
        return tuple(tuple(fwd[s] if ph != "backward" else bwd[s]) for ph, s in self.moments)

    def _reads_at(self, batch, t: int) -> tuple[int, ...]:
        ph, s = self.moments[t]
        return self.traces(batch)[s].backward_chunks if ph == "backward" else self.reads[s]

    def _program_bounds(self) -> list[tuple[int, int]]:
        segs = (self.schedule.segments if self.schedule is not None else (0,)) + (len(self.moments),)
        return [(a, b) for a, b in zip(segs[:-1], segs[1:])]

    def _plan_program(self, batch, t0: int, t1: int):
        """Static facts of the program running moments [t0, t1): the fetches it issues
        ((moment, chunk) pairs), the param chunks it reads as arguments, and the chunks it must
        release after each moment (next read is a fresh fetch, or none)."""
        fetch = self._fetch_lists(batch)
        T = len(self.moments)
        k = self.prefetch
        def issued_by(a, b):
            lo = 0 if a == 0 else a - 1 + k + 1
            return [(u, c) for u in range(lo, min(T, b - 1 + k + 1)) for c in fetch[u]]
        issues = issued_by(t0, t1)
        args = {c for _, c in issues}
        for t in range(t0, t1):
            args |= {c for c in self._reads_at(batch, t) if self.placement.param_kinds[c] == DEVICE}
        return issues, tuple(sorted(args))

    # hooks of the moment walker: one device here; chunkjax.zero_schedule shards them over a mesh
    def _to_device(self, x):
        """A fetch: host chunk (or this rank's shard of it) to device memory, inside a program."""
        return jax.device_put(x, sharding(DEVICE))

    def _to_host(self, g):
        """A gradient chunk (or shard) offloaded to pinned host memory, inside a program."""
        return jax.device_put(g, sharding(PINNED_HOST))

    def _gather(self, x):
        """The full chunk from what a fetch brought (identity on one device)."""
        return x

    def _resident(self, x, anchor):
        """The full chunk of a device-resident chunk at a moment that reads it (identity here)."""
        return x

    def _reduce_grad(self, g):
        """(gradient to keep (chunk or this rank's shard), () f32 squared norm of the chunk's
        whole reduced gradient)."""
        return g, jnp.sum(jnp.square(g.astype(jnp.float32)))

    def _loss_cotangent(self, loss):
        return jnp.ones_like(loss)

    def _zeros_grad(self, c):
        """The gradient of a chunk no stage reads (outside programs)."""
        return jax.device_put(jnp.zeros((self.layout.chunk_size,), self.compute_dtype),
                              sharding(self.placement.grad_kind(c)))

    def _zeros_sq(self):
        return jnp.zeros((), jnp.float32)

    def _run_moments(self, params: dict, batch, carry: dict, t0: int, t1: int):
        """Run moments [t0, t1). ``params``: chunk id -> compute params (only the chunks this
        program reads). ``carry`` holds what crosses program boundaries: ``x`` (activation or
        cotangent), ``saved`` stage inputs, ``acc`` float32 gradient accumulators, ``held``
        fetched chunks kept on the device, ``issued`` prefetched chunks keyed ``"t:c"``.

        Returns (carry, grads {chunk: grad in its grad kind}, sq {chunk: () f32}, loss or None).
        """
        lay = self.layout
        T = len(self.moments)
        fetch = self._fetch_lists(batch)
        k = self.prefetch
        x = carry.get("x")
        saved = dict(carry.get("saved", {}))
        acc = dict(carry.get("acc", {}))
        held = dict(carry.get("held", {}))
        issued = {tuple(int(v) for v in key.split(":")): a for key, a in carry.get("issued", {}).items()}
        loss_scale = carry.get("loss_scale")
        grads, sq, loss = {}, {}, None
        # next read of each chunk after moment t comes from a fetch (or never): release it then
        def released_after(t, c):
            for u in range(t + 1, T):
                if c in self._reads_at(batch, u):
                    return c in fetch[u]
            return True

        def issue(t, anchor):
            tie = batch if anchor is None else anchor  # the first fetches wait for the batch
            for u in range(t, min(T, t + k + 1)):
                for c in fetch[u]:
                    if (u, c) not in issued:
                        issued[(u, c)] = self._to_device(ordered_after(tie, params[c]))

        def add_grads(s, dp):
            for c in self.reads[s]:
                if c not in acc:
                    acc[c] = jnp.zeros((lay.chunk_size,), jnp.float32)
                acc[c] = lay.scatter_add(acc[c], c, dp)

        def emit(s, dx):
            for c in self.reads[s]:
                if self.first_reader[c] != s:
                    continue
                g, sq[c] = self._reduce_grad(acc.pop(c).astype(self.compute_dtype))
                if self.placement.grad_kind(c) == PINNED_HOST:
                    g = self._to_host(g)
                    if dx is not None:
                        dx, g = jax.lax.optimization_barrier((dx, g))
                grads[c] = g
            return dx

        for t in range(t0, t1):
            ph, s = self.moments[t]
            issue(t, x)
            reads = self._reads_at(batch, t)
            arrays = {}
            for c in self.reads[s]:
                if c not in reads:  # value not needed by this backward: zeros (compiled away)
                    arrays[c] = jnp.zeros((lay.chunk_size,), self.compute_dtype)
                elif self.placement.param_kinds[c] == DEVICE:
                    arrays[c] = self._resident(params[c], batch if x is None else x)
                else:
                    if (t, c) in issued:
                        held[c] = self._gather(issued.pop((t, c)))
                    arrays[c] = held[c]
            st = self.stages[s]
            if ph == "forward":
                saved[s] = x
                x = st.apply(self._sub(arrays, s), x, batch)
            elif ph == "forward+backward":
                loss, pull = jax.vjp(lambda p, xx: st.apply(p, xx, batch), self._sub(arrays, s), x)
                ct = self._loss_cotangent(loss)
                if loss_scale is not None:  # fp16 loss scaling: the backward carries scaled values
                    ct = ct * loss_scale.astype(ct.dtype)
                dp, dx = pull(ct)
                add_grads(s, dp)
                x = emit(s, dx)
            else:
                # tie the recompute's inputs to the cotangent: otherwise XLA merges the recompute
                # with the forward pass (common-subexpression elimination) and keeps every stage's
                # internals alive, undoing the activation checkpointing (jax.checkpoint's prevent_cse)
                x, x_in, arrays = jax.lax.optimization_barrier((x, saved.pop(s, None), arrays))
                p = self._sub(arrays, s)
                if s == 0:
                    _, pull = jax.vjp(lambda p: st.apply(p, None, batch), p)
                    (dp,), dx = pull(x), None
                else:
                    _, pull = jax.vjp(lambda p, xx: st.apply(p, xx, batch), p, x_in)
                    dp, dx = pull(x)
                add_grads(s, dp)
                x = emit(s, dx)
            for c in reads:  # eviction: the device copy dies after its last use
                if c in held and released_after(t, c):
                    del held[c]
        out = {"x": x, "saved": saved, "acc": acc, "held": held,
               "issued": {f"{u}:{c}": a for (u, c), a in issued.items()}}
        if loss_scale is not None:
            out["loss_scale"] = loss_scale
        if t1 == T:
            out = {}
        return out, grads, sq, loss

    def fwd_bwd(self, params_chunks, batch):
        """The whole step's forward/backward as one program (see module docstring).

        Returns:
          (loss () f32, grads: tuple of (chunk_size,) compute-dtype arrays in
          ``placement.grad_kind(c)``, grad_sq: (n_chunks,) f32).
        """
        params = dict(enumerate(params_chunks))
        _, grads, sq, loss = self._run_moments(params, batch, {}, 0, len(self.moments))
        return self._finish(loss, grads, sq)

    def _finish(self, loss, grads, sq):
        lay = self.layout
        for c in range(lay.n_chunks):  # chunks no stage reads: zero gradient
            if c not in grads:
                grads[c] = jnp.zeros((lay.chunk_size,), self.compute_dtype)
                sq[c] = jnp.zeros((), jnp.float32)
        return (loss, tuple(grads[c] for c in range(lay.n_chunks)),
                jnp.stack([sq[c] for c in range(lay.n_chunks)]))

    # ---- jitted entry points -----------------------------------------------------------------
    @functools.cached_property
    def _param_shardings(self):
        return tuple(sharding(k) for k in self.placement.param_kinds)

    @property
    def _batch_sharding(self):
        return sharding(DEVICE)

    @functools.cached_property
    def _grad_shardings(self):
        return tuple(sharding(self.placement.grad_kind(c)) for c in range(self.layout.n_chunks))

    @functools.cached_property
    def jit_fwd_bwd(self):
        dev = sharding(DEVICE)
        return jax.jit(self.fwd_bwd, in_shardings=(self._param_shardings, dev),
                       out_shardings=(dev, self._grad_shardings, dev))

    @functools.cached_property
    def jit_loss(self):
        dev = sharding(DEVICE)
        return jax.jit(self.loss, in_shardings=(self._param_shardings, dev), out_shardings=dev)

    @functools.cached_property
    def _device_chunks(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.layout.n_chunks) if self.placement.state_kinds[c] == DEVICE)


    @property
    def _skip_nonfinite(self) -> bool:
        return self.nonfinite == "skip" or self.loss_scaling

    @functools.cached_property
    def jit_update_device(self):
        """One device-state chunk per call (``c`` is traced, so one compiled program serves every
        chunk): master and state donated and updated in place, the new compute params reuse the
        old ones' buffer. One chunk at a time keeps the update's temporaries to one chunk (all
        chunks in one program let XLA schedule every chunk's float32 temporaries at once: out of
        memory for GPT3_12B on the whole card)."""
        dev = sharding(DEVICE)

        def make(param_kind):
            pk = sharding(param_kind)

            def upd(grad, master, state, grad_sq, c, old_params, inv_scale):
                del old_params  # donated
                o = optim.update_chunk(self.tx, grad, master, state, jnp.sum(grad_sq), grad_sq[c],
                                       self.compute_dtype, self._skip_nonfinite,
                                       inv_scale if self.loss_scaling else None)
                return jax.device_put(o.params, pk), o.master, o.opt_state

            # keep_unused: old_params is unused, and jit would prune it, dropping its donation
            # (every updated chunk would then hold two compute-param buffers until the step ends)
            return jax.jit(upd, in_shardings=(dev, dev, dev, dev, dev, pk, dev), out_shardings=(pk, dev, dev),
                           donate_argnums=(1, 2, 5), keep_unused=True)

        return {k: make(k) for k in set(self.placement.param_kinds)}

    @functools.cached_property
    def jit_update_streamed(self):
        """One host-state chunk: moved to the device, updated, moved back (``c`` is traced)."""
        dev, host = sharding(DEVICE), sharding(PINNED_HOST)

        def make(param_kind):
            def upd(grad, master, state, grad_sq, c, old_params, inv_scale):
                del old_params  # donated: the new compute params reuse its buffer
                grad, master, state = jax.device_put((grad, master, state), dev)
                o = optim.update_chunk(self.tx, grad, master, state, jnp.sum(grad_sq), grad_sq[c],
                                       self.compute_dtype, self._skip_nonfinite,
                                       inv_scale if self.loss_scaling else None)
                return (jax.device_put(o.params, sharding(param_kind)),
                        jax.device_put(o.master, host), jax.device_put(o.opt_state, host))

            return jax.jit(upd, in_shardings=(host, host, host, dev, dev, sharding(param_kind), dev),
                           out_shardings=(sharding(param_kind), host, host), donate_argnums=(1, 2, 5),
                           keep_unused=True)

        return {k: make(k) for k in set(self.placement.param_kinds)}

    def compiled_memory(self, batch) -> dict:
        """Compiler's memory analysis of the forward/backward program for a batch shape, in bytes:
        ``argument``, ``output``, ``temp``, ``alias`` (device memory) and ``host_*`` where the
        runtime reports them, plus ``peak_device_bytes`` = argument + output + temp - alias."""
        args = (tuple(jax.ShapeDtypeStruct((self.layout.chunk_size,), self.compute_dtype, sharding=s)
                      for s in self._param_shardings),
                jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding(DEVICE)), batch))
        ma = self.jit_fwd_bwd.lower(*args).compile().memory_analysis()
        out = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0)
               for k in ("argument", "output", "temp", "alias", "host_argument", "host_output", "host_temp")}
        out["peak_device_bytes"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
        return out

    # ---- the pipelined step -------------------------------------------------------------------
    @functools.cached_property
    def host_chunks(self) -> tuple[int, ...]:
        """Chunks updated in place on the host (update location ``host``)."""
        if self.schedule is None:
            return ()
        return tuple(c for c, u in enumerate(self.schedule.update_locations) if u == "host")

    @functools.cached_property
    def _streamed_chunks(self) -> tuple[int, ...]:
        host = set(self.host_chunks)
        return tuple(c for c in range(self.layout.n_chunks)
                     if self.placement.state_kinds[c] == PINNED_HOST and c not in host)

    def _program(self, batch, k: int):
        """(jitted program k, param chunk ids it takes) for a batch shape."""
        ab = jax.tree.map(lambda a: (a.shape, str(a.dtype)), batch)
        key = (str(ab), k)
        cache = self.__dict__.setdefault("_program_cache", {})
        if key not in cache:
            t0, t1 = self._program_bounds()[k]
            _, args = self._plan_program(batch, t0, t1)
            done = [c for t in range(t0, t1) if self.moments[t][0] != "forward"
                    for c in self.reads[self.moments[t][1]] if self.first_reader[c] == self.moments[t][1]]

            def prog(params, batch, carry, acc):
                out, grads, sq, loss = self._run_moments(params, batch, dict(carry, acc=acc), t0, t1)
                return {k: v for k, v in out.items() if k != "acc"}, out.get("acc", {}), grads, sq, loss

            # the XLA module is named after the program (profiles tell the programs apart)
            prog.__name__ = prog.__qualname__ = f"chunkjax_program_{k}"
            cache[key] = (self._jit_program(prog, done, t1 == len(self.moments)), args)
        return cache[key]

    def _jit_program(self, prog, done, last: bool):
        """jit one program ``prog(params, batch, carry, acc) -> (carry, acc, grads, sq, loss)``;
        ``done``: chunk ids whose gradients it emits; ``last``: it ends the step."""
        dev = sharding(DEVICE)
        gsh = {c: sharding(self.placement.grad_kind(c)) for c in done}
        # the carry (saved activations, held chunks, gradient accumulators) is donated so that
        # XLA frees each piece after its last use. The accumulators (argument 3) are not donated
        # to a program that emits a gradient to another memory kind: jax would alias the donated
        # device accumulator with that pinned_host output, and the executable then expects the
        # accumulator in host memory (GPU: "RuntimeProgramInputMismatch ... parameter in an
        # unexpected memory space 'device'"; CPU: "PjRtBuffer's memory kind does not match")
        moved = any(gsh[c].memory_kind != DEVICE for c in done)
        donate = ((2,) if moved else (2, 3)) if self._donates else ()
        return jax.jit(prog, out_shardings=(dev, dev, gsh, dev, dev), donate_argnums=donate)

    @property
    def _donates(self) -> bool:
        return jax.default_backend() != "cpu" if self.donate is None else bool(self.donate)

    def compiled_memory_programs(self, batch) -> list[dict]:
        """Memory analysis of every program of the pipelined step (bytes), in order; the carry
        of program k is program k-1's output."""
        out, carry = [], {}
        bsh = self._batch_sharding
        ab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=bsh), batch)
        for k in range(len(self._program_bounds())):
            fn, args = self._program(batch, k)
            params = {c: jax.ShapeDtypeStruct((self.layout.chunk_size,), self.compute_dtype,
                                              sharding=self._param_shardings[c]) for c in args}
            acc = carry.pop("acc", {}) if carry else {}
            compiled = fn.lower(params, ab, carry, acc).compile()
            ma = compiled.memory_analysis()
            d = {f: int(getattr(ma, f"{f}_size_in_bytes", 0) or 0)
                 for f in ("argument", "output", "temp", "alias", "host_argument", "host_output", "host_temp")}
            d["peak_device_bytes"] = d["argument"] + d["output"] + d["temp"] - d["alias"]
            out.append(d)
            res = jax.eval_shape(fn, params, ab, carry, acc)
            osh = compiled.output_shardings
            carry = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                                 dict(res[0], acc=res[1]), dict(osh[0], acc=osh[1]))
        return out

    def _executor(self):
        ex = self.__dict__.get("_host_executor")
        if ex is None:
            ex = self.__dict__["_host_executor"] = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="chunkjax-host-update")
        return ex

    def _host_update(self, state: TrainState, grads: dict, grad_scale):
        """Update host chunks in place (runs on the host-update thread): waits for each gradient
        chunk, then updates master, state and the pinned compute params of the chunk."""
        from chunkjax import host_update as hu
        if callable(grad_scale):
            grad_scale = grad_scale()
        if grad_scale is None:  # a skipped step (non-finite gradients): nothing changes
            return
        spent = self.__dict__.setdefault("_host_update_times", [])
        for c, g in grads.items():
            if isinstance(g, jax.Array):
                g.block_until_ready()
            t0 = time.perf_counter()
            g_np = np.asarray(g)
            p_arr = state.params[c]
            if self.compute_dtype == jnp.bfloat16:
                hu.host_update_(self.host_optimizer, state.opt_state[c], g_np.view(np.uint16), state.master[c],
                                 hu.writable_view(p_arr, np.uint16), grad_scale)
            else:
                hu.host_update_(self.host_optimizer, state.opt_state[c], g_np.astype(np.float32, copy=False),
                                 state.master[c], None, grad_scale)
                np.copyto(hu.writable_view(p_arr, np.dtype(self.compute_dtype)),
                          state.master[c].astype(self.compute_dtype))
            spent.append(time.perf_counter() - t0)

    def _warm_host_kernel(self) -> None:
        """Compile the host kernel for this step's dtypes on the calling thread: numba's LLVM
        must not compile while XLA compiles on another thread (the process aborts)."""
        from chunkjax import host_update as hu
        st = self.host_optimizer.host_state(1)
        master = np.zeros((1,), np.float32)
        if self.compute_dtype == jnp.bfloat16:
            hu.host_update_(self.host_optimizer, st, np.zeros((1,), np.uint16), master, np.zeros((1,), np.uint16), 1.0)
        else:
            hu.host_update_(self.host_optimizer, st, np.zeros((1,), np.float32), master, None, 1.0)

    def wait(self) -> None:
        """Block until the host updates of the last step are done (before reading the state).
        Afterwards ``last_host_update_s`` holds the seconds the host thread spent updating (the
        kernels, not the waits for gradients) in that step."""
        pending = self.__dict__.pop("_pending", ())
        for f in pending:
            f.result()
        if pending:
            times = self.__dict__.pop("_host_update_times", [])
            self.__dict__["last_host_update_s"] = float(sum(times))

    def __call__(self, state: TrainState, batch, loss_scale=None) -> tuple[TrainState, dict]:
        """One training step. batch: int (B, T+1) on the device. Returns (new state, metrics).

        The step runs the schedule's programs in order; the gradients of host-updated chunks are
        handed to a host thread as each program finishes, which updates those chunks in place
        while the device runs the rest of the backward. The next call (or :meth:`wait`) waits for
        that thread. ``state``'s device buffers are donated to the update: use the returned state.
        With ``micro_batches > 1`` the programs run once per micro-batch first (see the class).

        Args:
          loss_scale: with ``loss_scaling`` only: the loss scale of this step (a float, best a
            power of two; see :class:`chunkjax.DynamicLossScale`).

        Raises:
          ValueError: the batch does not split into ``micro_batches`` equal parts, or
            ``loss_scale`` given without ``loss_scaling`` (or missing with it).
        """
        if self.loss_scaling != (loss_scale is not None):
            raise ValueError("pass loss_scale exactly when the step was built with loss_scaling=True "
                             f"(loss_scaling={self.loss_scaling}, loss_scale={loss_scale!r})")
        self.wait()
        host = set(self.host_chunks)
        clip = self.host_optimizer is not None and getattr(self.host_optimizer, "max_grad_norm", None) is not None
        skip = self._skip_nonfinite
        scale = None if loss_scale is None else jnp.asarray(loss_scale, jnp.float32)
        inv = 1.0 if loss_scale is None else 1.0 / float(loss_scale)
        if self.micro_batches == 1:
            grads, sq, loss, pending = self._run_programs(state, batch, submit=not (clip or skip), scale=scale)
        else:
            grads, sq, loss = self._accumulate(state, batch, scale)
            pending = []
        grad_sq = jnp.stack([sq[c] for c in range(self.layout.n_chunks)])
        late = {c: grads[c] for c in host if clip or skip or not isinstance(grads[c], jax.Array)}
        if late:
            def host_scale():
                norm = float(jnp.sqrt(jnp.sum(grad_sq))) * inv
                if skip and not math.isfinite(norm):
                    return None
                return float(np.float32((self.host_optimizer.grad_scale(norm) if clip else 1.0) * inv))
            pending.append(self._executor().submit(self._host_update, state, late, host_scale))
        inv_arr = jnp.asarray(inv, jnp.float32)
        params, master, opt = list(state.params), list(state.master), list(state.opt_state)
        for c in self._device_chunks:
            fn = self.jit_update_device[self.placement.param_kinds[c]]
            params[c], master[c], opt[c] = fn(grads[c], master[c], opt[c], grad_sq,
                                              jnp.asarray(c, jnp.int32), params[c], inv_arr)
        for c in self._streamed_chunks:
            fn = self.jit_update_streamed[self.placement.param_kinds[c]]
            params[c], master[c], opt[c] = fn(grads[c], master[c], opt[c], grad_sq,
                                              jnp.asarray(c, jnp.int32), params[c], inv_arr)
        self.__dict__["_pending"] = tuple(pending)
        metrics = {"loss": loss, "grad_norm": jnp.sqrt(jnp.sum(grad_sq)) * inv_arr}
        if skip:
            metrics["skipped"] = ~jnp.isfinite(jnp.sum(grad_sq))
        return TrainState(tuple(params), tuple(master), tuple(opt)), metrics

    def _run_programs(self, state: TrainState, batch, submit: bool, scale=None):
        """Run every program of the step on ``batch``: returns ``(grads, sq, loss, pending)``,
        a gradient and squared norm for every chunk (zero for chunks no stage reads); with
        ``submit``, host chunks' updates are handed to the host thread as their gradients
        appear (``pending``: their futures)."""
        host = set(self.host_chunks)
        carry: dict = {} if scale is None else {"loss_scale": scale}  # carried to the loss's program
        acc: dict = {}
        grads, sq, loss, pending = {}, {}, None, []
        for k in range(len(self._program_bounds())):
            fn, args = self._program(batch, k)
            carry, acc, g, q, l = fn({c: state.params[c] for c in args}, batch, carry, acc)
            grads.update(g)
            sq.update(q)
            loss = l if l is not None else loss
            mine = {c: g[c] for c in g if c in host}
            if mine and submit:
                pending.append(self._executor().submit(self._host_update, state, mine, 1.0))
        lay = self.layout
        for c in range(lay.n_chunks):  # chunks no stage reads: zero gradient
            if c not in grads:
                grads[c] = np.zeros((lay.chunk_size,), self.compute_dtype) if c in host else self._zeros_grad(c)
                sq[c] = self._zeros_sq()
        return grads, sq, loss, pending

    @functools.cached_property
    def _jit_accumulate(self):
        """(first, add, finish) for device gradients: float32 sums, then the mean in the compute
        dtype and its squared norm (as the programs compute it)."""
        first = jax.jit(lambda g: g.astype(jnp.float32))
        add = jax.jit(lambda a, g: a + g.astype(jnp.float32), donate_argnums=(0,))

        def finish(a, inv):
            g = (a * inv).astype(self.compute_dtype)
            return g, jnp.sum(jnp.square(g.astype(jnp.float32)))

        return first, add, jax.jit(finish)

    def _accumulate(self, state: TrainState, batch, scale=None):
        """Gradient accumulation over ``micro_batches`` equal parts of ``batch``: returns the
        mean gradients, their squared norms and the mean loss. Device gradients are summed in
        float32 on the device; gradients in pinned host memory in float32 numpy."""
        n = self.micro_batches
        lead = {a.shape[0] for a in jax.tree.leaves(batch)}
        if len(lead) != 1 or next(iter(lead)) % n:
            raise ValueError(f"batch leading size {sorted(lead)} does not split into micro_batches={n} equal parts: "
                             f"use a batch size that is a multiple of {n}")
        size = next(iter(lead)) // n
        first, add, finish = self._jit_accumulate
        total, losses = {}, []
        for i in range(n):
            part = jax.tree.map(lambda a: a[i * size:(i + 1) * size], batch)
            grads, _, loss, _ = self._run_programs(state, part, submit=False, scale=scale)
            losses.append(loss)
            for c, g in grads.items():
                on_device = isinstance(g, jax.Array) and g.sharding.memory_kind in (None, DEVICE)
                if on_device:
                    total[c] = first(g) if c not in total else add(total[c], g)
                else:
                    g32 = np.asarray(g).astype(np.float32)
                    total[c] = g32 if c not in total else np.add(total[c], g32, out=total[c])
        host = set(self.host_chunks)
        cd = np.dtype(self.compute_dtype)
        grads, sq = {}, {}
        for c, a in total.items():
            if isinstance(a, np.ndarray):
                g = (a * np.float32(1.0 / n)).astype(cd)
                sq[c] = jnp.asarray(np.sum(np.square(g.astype(np.float32)), dtype=np.float32))
                grads[c] = g if c in host else jax.device_put(g, self._grad_put_sharding(c))
            else:
                grads[c], sq[c] = finish(a, jnp.float32(1.0 / n))
        return grads, sq, jnp.mean(jnp.stack([jnp.asarray(l, jnp.float32) for l in losses]))

    def _grad_put_sharding(self, c: int):
        """Where an accumulated gradient of chunk ``c`` goes back to (ZeRO: sharded over ranks)."""
        return sharding(self.placement.grad_kind(c))

    def with_optimizer(self, tx: optax.GradientTransformation) -> "ChunkedStep":
        """The same step with another optax transformation; the compiled forward/backward (which
        does not depend on the optimizer) is shared, only the update programs are rebuilt."""
        new = dataclasses.replace(self, tx=tx)
        for k in ("reads", "first_reader", "_traces_cache", "_param_shardings", "_grad_shardings",
                  "jit_fwd_bwd", "jit_loss"):
            if k in self.__dict__:
                new.__dict__[k] = self.__dict__[k]
        return new

    # ---- state ---------------------------------------------------------------------------------
    def init(self, params) -> TrainState:
        """Chunk the initial params into a :class:`TrainState`.

        Args:
          params: a params pytree (any float dtype; numpy or jax arrays), or a callable
            ``leaf_init(i) -> array`` giving leaf ``i`` of ``layout.slots`` (shape
            ``slots[i].shape``) so that a model larger than host memory twice over is never
            materialised whole: chunks are built one at a time.

        Raises:
          PlanError: on a GPU, the pinned host bytes (:meth:`pinned_host_bytes`) exceed the
            runtime's pinned-host cap (:func:`chunkjax.memory.check_pinned_host`); nothing has
            been allocated.

        Host-updated chunks keep float32 master params and optimizer state as numpy arrays in host
        memory and their compute params in pinned host memory; device and streamed chunks keep
        theirs in ``placement``'s memory kinds. The device never holds more than one chunk of
        initialisation data.
        """
        lay = self.layout
        # the GPU runtime's pinned-host pool is capped (64 GiB by default): say so before allocating
        memory.check_pinned_host(self.pinned_host_bytes(), jax.default_backend())
        leaf_at = params if callable(params) else (lambda i, _l=lay.treedef.flatten_up_to(params): _l[i])
        dev = sharding(DEVICE)
        init_state = jax.jit(lambda m: optim.init_chunk_state(self.tx, m), out_shardings=dev)
        host = set(self.host_chunks)

        def packed(c):
            buf = np.zeros((lay.chunk_size,), np.float32)
            for i, s in enumerate(lay.slots):
                if s.chunk == c:
                    buf[s.offset:s.offset + s.size] = np.asarray(leaf_at(i), np.float32).ravel()
            return buf

        # pass 1: master params and optimizer state (device temporaries freed chunk by chunk),
        # and host chunks' compute params; pass 2: compute params of the other chunks, allocated
        # after every temporary is gone so that resident chunks sit together and do not fragment
        # the device memory the step needs
        if host:
            self._warm_host_kernel()
        ms, os_, ps = [], [], [None] * lay.n_chunks
        for c in range(lay.n_chunks):
            m_np = packed(c)
            if c in host:
                ms.append(m_np)
                os_.append(self.host_optimizer.host_state(lay.chunk_size))
                ps[c] = jax.device_put(m_np.astype(self.compute_dtype), sharding(PINNED_HOST))
                continue
            sk = sharding(self.placement.state_kinds[c])
            m_dev = jax.device_put(m_np, dev)
            os_.append(jax.device_put(init_state(m_dev), sk))
            ms.append(jax.device_put(m_dev, sk))
            del m_dev
        for c in range(lay.n_chunks):
            if ps[c] is None:
                ps[c] = jax.device_put(packed(c).astype(self.compute_dtype),
                                       sharding(self.placement.param_kinds[c]))
        jax.block_until_ready((ps, [m for m in ms if isinstance(m, jax.Array)]))
        return TrainState(tuple(ps), tuple(ms), tuple(os_))

    def pinned_host_bytes(self) -> int:
        """Bytes this step's state and gradients keep in ``pinned_host`` memory: compute params
        and gradient chunks in that kind (host-updated chunks: both), master params and
        optimizer state kept there (streamed chunks). Host-updated chunks' master params and
        optimizer state are pageable numpy arrays and do not count."""
        cs, it = self.layout.chunk_size, np.dtype(self.compute_dtype).itemsize
        opt = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(jax.eval_shape(
            lambda m: optim.init_chunk_state(self.tx, m), jax.ShapeDtypeStruct((cs,), jnp.float32))))
        host, n = set(self.host_chunks), 0
        for c in range(self.layout.n_chunks):
            if c in host:
                n += 2 * cs * it
                continue
            n += cs * it * (self.placement.param_kinds[c] == PINNED_HOST)
            n += cs * it * (self.placement.grad_kind(c) == PINNED_HOST)
            n += (4 * cs + opt) * (self.placement.state_kinds[c] == PINNED_HOST)
        return int(n)

    def master_params(self, state: TrainState):
        """The float32 master params as a pytree (on the default device)."""
        self.wait()
        return self.layout.unpack([jax.device_put(m, sharding(DEVICE)) for m in state.master])

    def eval_loss(self, state: TrainState, batch) -> jax.Array:
        """Validation loss of ``batch`` (float32 scalar), params fetched by the same rule."""
        self.wait()
        return self.jit_loss(state.params, batch)


def make_chunked_step(stages, layout: ChunkLayout, placement, tx: optax.GradientTransformation | None = None,
                      compute_dtype=jnp.bfloat16, prefetch: int | None = None, host_optimizer=None,
                      micro_batches: int = 1, nonfinite: str = "ignore", loss_scaling: bool = False) -> ChunkedStep:
    """Build the chunked step (see :class:`ChunkedStep`). Nothing is compiled until first use.

    Args:
      stages: the model's stages.
      layout: the chunk layout.
      placement: a :class:`~chunkjax.plan.Placement` (fixed fetch rule, one program) or a
        :class:`~chunkjax.schedule.Schedule` (its fetches, evictions, programs and update
        locations).
      tx: the optax transformation; may be omitted when ``host_optimizer`` is given (its
        ``optax()`` is used for device and streamed chunks).
      compute_dtype: dtype of compute params and gradients.
      prefetch: fetch distance (moments); defaults to the schedule's, else 1.
      host_optimizer: the host kernel spec (:mod:`chunkjax.host_update`) for ``host`` chunks.
      micro_batches: gradient accumulation over this many equal parts of each batch.
      nonfinite: ``"ignore"`` or ``"skip"`` (a step with non-finite gradients changes no state).
      loss_scaling: fp16 dynamic loss scaling (each call takes ``loss_scale``).

    Raises:
      ValueError: a bad ``micro_batches`` or ``nonfinite``, a placement that differs from the
        schedule's, or host-updated chunks without ``host_optimizer``.
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
                       loss_scaling)
