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

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax import optim
from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST, sharding
from chunkjax.plan import Placement, fetch_events


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


def _barrier(anchor, x):
    """Return ``x`` ordered after ``anchor`` is computed."""
    if anchor is None:
        return x
    _, x = jax.lax.optimization_barrier((anchor, x))
    return x


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
    """

    stages: tuple
    layout: ChunkLayout
    placement: Placement
    tx: optax.GradientTransformation
    compute_dtype: Any
    prefetch: int = 1

    def __post_init__(self):
        if self.placement.n_chunks != self.layout.n_chunks:
            raise ValueError(f"placement has {self.placement.n_chunks} chunks, layout {self.layout.n_chunks}")
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 stage, got {self.prefetch}")

    # ---- static structure ------------------------------------------------------------------
    @functools.cached_property
    def reads(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.layout.chunks_of(st.param_keys) for st in self.stages)

    @functools.cached_property
    def first_reader(self) -> dict[int, int]:
        out = {}
        for s, cs in enumerate(self.reads):
            for c in cs:
                out.setdefault(c, s)
        return out

    def traces(self, batch) -> tuple:
        """Per-stage chunk reads, forward and backward, for a batch shape (abstract tracing)."""
        ab = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)  # any pytree batch
        key = (jax.tree.structure(ab), tuple((a.shape, str(a.dtype)) for a in jax.tree.leaves(ab)))
        cache = self.__dict__.setdefault("_traces_cache", {})
        if key not in cache:
            from chunkjax.plan import StageTrace
            from chunkjax.trace import backward_reads, stage_inputs
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
                        issued[(p, c)] = jax.device_put(_barrier(tie, params_chunks[c]), dev)

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

    def fwd_bwd(self, params_chunks, batch):
        """Loss, gradient chunks and their squared norms (see module docstring).

        Returns:
          (loss () f32, grads: tuple of (chunk_size,) compute-dtype arrays in
          ``placement.grad_kind(c)``, grad_sq: (n_chunks,) f32).
        """
        n, lay = len(self.stages), self.layout
        host = sharding(PINNED_HOST)
        saved: dict[int, Any] = {}
        acc: dict[int, jax.Array] = {}
        grads: dict[int, jax.Array] = {}
        sq: dict[int, jax.Array] = {}
        out: dict[str, Any] = {}

        def add_grads(s, dp):
            for c in self.reads[s]:
                if c not in acc:
                    acc[c] = jnp.zeros((lay.chunk_size,), jnp.float32)
                acc[c] = lay.scatter_add(acc[c], c, dp)

        def emit(s, dx):
            for c in self.reads[s]:
                if self.first_reader[c] != s:
                    continue
                g = acc.pop(c).astype(self.compute_dtype)
                sq[c] = jnp.sum(jnp.square(g.astype(jnp.float32)))
                if self.placement.grad_kind(c) == PINNED_HOST:
                    g = jax.device_put(g, host)
                    if dx is not None:
                        dx, g = jax.lax.optimization_barrier((dx, g))
                grads[c] = g
            return dx

        def fwd_body(pos, s, arrays, x):
            st, p = self.stages[s], self._sub(arrays, s)
            if s < n - 1:
                saved[s] = x
                return st.apply(p, x, batch)
            # last stage: forward and backward fused
            loss, pull = jax.vjp(lambda p, x: st.apply(p, x, batch), p, x)
            dp, dx = pull(jnp.ones_like(loss))
            out["loss"] = loss
            add_grads(s, dp)
            return emit(s, dx)

        dx = self._run_pass(params_chunks, batch, list(range(n)), fwd_body, None)

        def bwd_body(pos, s, arrays, dx):
            st = self.stages[s]
            # tie the recompute's inputs to the cotangent: otherwise XLA merges the recompute
            # with the forward pass (common-subexpression elimination) and keeps every stage's
            # internals alive, undoing the activation checkpointing (jax.checkpoint's prevent_cse)
            dx, x_in, arrays = jax.lax.optimization_barrier((dx, saved.pop(s, None), arrays))
            p = self._sub(arrays, s)
            if s == 0:
                _, pull = jax.vjp(lambda p: st.apply(p, None, batch), p)
                (dp,), dx = pull(dx), None
            else:
                _, pull = jax.vjp(lambda p, x: st.apply(p, x, batch), p, x_in)
                dp, dx = pull(dx)
            add_grads(s, dp)
            return emit(s, dx)

        self._run_pass(params_chunks, batch, list(range(n - 2, -1, -1)), bwd_body, dx)
        for c in range(lay.n_chunks):  # chunks no stage reads: zero gradient
            if c not in grads:
                grads[c] = jnp.zeros((lay.chunk_size,), self.compute_dtype)
                sq[c] = jnp.zeros((), jnp.float32)
        return (out["loss"], tuple(grads[c] for c in range(lay.n_chunks)),
                jnp.stack([sq[c] for c in range(lay.n_chunks)]))

    # ---- jitted entry points -----------------------------------------------------------------
    @functools.cached_property
    def _param_shardings(self):
        return tuple(sharding(k) for k in self.placement.param_kinds)

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

    @functools.cached_property
    def _streamed_chunks(self) -> tuple[int, ...]:
        return tuple(c for c in range(self.layout.n_chunks) if self.placement.state_kinds[c] == PINNED_HOST)

    @functools.cached_property
    def jit_update_device(self):
        """All device-state chunks in one program (master and state donated)."""
        ids = self._device_chunks
        dev = sharding(DEVICE)
        pk = tuple(sharding(self.placement.param_kinds[c]) for c in ids)

        def upd(grads, masters, states, grad_sq, old_params):
            del old_params  # donated: the new compute params reuse their buffers (no fragmentation)
            total = jnp.sum(grad_sq)
            outs = [optim.update_chunk(self.tx, g, m, s, total, grad_sq[c], self.compute_dtype)
                    for c, g, m, s in zip(ids, grads, masters, states)]
            params = tuple(jax.device_put(o.params, k) for o, k in zip(outs, pk))
            return params, tuple(o.master for o in outs), tuple(o.opt_state for o in outs)

        return jax.jit(upd, in_shardings=(dev, dev, dev, dev, pk), out_shardings=(pk, dev, dev),
                       donate_argnums=(1, 2, 4))

    @functools.cached_property
    def jit_update_streamed(self):
        """One host-state chunk: moved to the device, updated, moved back (``c`` is traced)."""
        dev, host = sharding(DEVICE), sharding(PINNED_HOST)

        def make(param_kind):
            def upd(grad, master, state, grad_sq, c, old_params):
                del old_params  # donated: the new compute params reuse its buffer
                grad, master, state = jax.device_put((grad, master, state), dev)
                o = optim.update_chunk(self.tx, grad, master, state, jnp.sum(grad_sq), grad_sq[c],
                                       self.compute_dtype)
                return (jax.device_put(o.params, sharding(param_kind)),
                        jax.device_put(o.master, host), jax.device_put(o.opt_state, host))

            return jax.jit(upd, in_shardings=(host, host, host, dev, dev, sharding(param_kind)),
                           out_shardings=(sharding(param_kind), host, host), donate_argnums=(1, 2, 5))

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

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One training step. batch: int (B, T+1) on the device. Returns (new state, metrics).

        ``state``'s buffers are donated to the update (updated in place): do not use it after."""
        loss, grads, grad_sq = self.jit_fwd_bwd(state.params, batch)
        params, master, opt = list(state.params), list(state.master), list(state.opt_state)
        ids = self._device_chunks
        if ids:
            p, m, o = self.jit_update_device(tuple(grads[c] for c in ids), tuple(master[c] for c in ids),
                                             tuple(opt[c] for c in ids), grad_sq, tuple(params[c] for c in ids))
            for j, c in enumerate(ids):
                params[c], master[c], opt[c] = p[j], m[j], o[j]
        for c in self._streamed_chunks:
            fn = self.jit_update_streamed[self.placement.param_kinds[c]]
            params[c], master[c], opt[c] = fn(grads[c], master[c], opt[c], grad_sq,
                                              jnp.asarray(c, jnp.int32), params[c])
        return TrainState(tuple(params), tuple(master), tuple(opt)), {
            "loss": loss, "grad_norm": jnp.sqrt(jnp.sum(grad_sq))}

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
        """Chunk a params pytree (any float dtype; numpy or jax arrays) into a :class:`TrainState`.

        Chunks are packed one at a time in host memory and moved to their memory kinds, so the
        device never holds more than one chunk of initialisation data.
        """
        lay = self.layout
        leaves = lay.treedef.flatten_up_to(params)
        dev = sharding(DEVICE)
        init_state = jax.jit(lambda m: optim.init_chunk_state(self.tx, m), out_shardings=dev)
        def packed(c):
            buf = np.zeros((lay.chunk_size,), np.float32)
            for s, leaf in zip(lay.slots, leaves):
                if s.chunk == c:
                    buf[s.offset:s.offset + s.size] = np.asarray(leaf, np.float32).ravel()
            return buf

        # pass 1: master params and optimizer state (device temporaries freed chunk by chunk);
        # pass 2: compute params, allocated after every temporary is gone so that resident
        # chunks sit together and do not fragment the device memory the step needs
        ms, os_ = [], []
        for c in range(lay.n_chunks):
            sk = sharding(self.placement.state_kinds[c])
            m_dev = jax.device_put(packed(c), dev)
            os_.append(jax.device_put(init_state(m_dev), sk))
            ms.append(jax.device_put(m_dev, sk))
            del m_dev
        ps = [jax.device_put(packed(c).astype(self.compute_dtype), sharding(self.placement.param_kinds[c]))
              for c in range(lay.n_chunks)]
        jax.block_until_ready((ps, ms, os_))
        return TrainState(tuple(ps), tuple(ms), tuple(os_))

    def master_params(self, state: TrainState):
        """The float32 master params as a pytree (on the default device)."""
        return self.layout.unpack([jax.device_put(m, sharding(DEVICE)) for m in state.master])

    def eval_loss(self, state: TrainState, batch) -> jax.Array:
        """Validation loss of ``batch`` (float32 scalar), params fetched by the same rule."""
        return self.jit_loss(state.params, batch)


def make_chunked_step(stages, layout: ChunkLayout, placement: Placement, tx: optax.GradientTransformation,
                      compute_dtype=jnp.bfloat16, prefetch: int = 1) -> ChunkedStep:
    """Build the chunked step (see :class:`ChunkedStep`). Nothing is compiled until first use."""
    return ChunkedStep(tuple(stages), layout, placement, tx, jnp.dtype(compute_dtype), prefetch)
