"""ZeRO data parallelism over chunks (Gemini style), with XLA collectives.

Every chunk of ``chunk_size`` elements is split evenly over the ``N`` ranks of a 1-D ``data``
mesh axis: rank ``r`` owns elements ``[r * chunk_size/N, (r+1) * chunk_size/N)`` of every chunk,
and keeps and updates only that slice of the float32 master params and of the chunk's optax
state. The batch is split over the same axis (each rank its ``B/N`` rows) and the loss is the
mean over ranks (equal token counts per rank, so it equals the full-batch mean).

Stages (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020; PatrickStar, Fang et al., arXiv 2108.05818, section 6; Colossal-AI's Gemini,
which shards PatrickStar's chunks the same way):

* ``stage=1``: compute params replicated; gradients all-reduced (``psum``) chunk by chunk, each
  rank updates its slice of master/state; the new compute params are all-gathered.
* ``stage=2``: as 1, but gradients are reduce-scattered (``psum_scatter``): each rank receives
  only the summed gradient of its own slice.
* ``stage=3``: compute params sharded too. Before a stage runs, the chunks it reads are
  all-gathered (``all_gather``), tied to the stage's input activation so that XLA cannot hoist
  the gather to the program start; the full chunk dies after its last use. The backward pass
  gathers again the chunks whose values the stage's gradient needs (:meth:`ZeroStep.backward_reads`),
  tied to the incoming cotangent, so XLA cannot merge it with the forward gather and keep every
  full chunk alive. Gradients are reduce-scattered chunk by chunk as the backward completes each
  chunk (tied to the next cotangent).

Collectives are XLA's (``jax.shard_map`` with ``all_gather`` / ``psum_scatter`` / ``psum``);
there is no home-made transport. The global gradient norm is ``psum`` of per-shard squared
norms, handed to each shard's update through :mod:`chunkjax.optim`'s rest-of-model leaf, so
``clip_by_global_norm`` sees the true global norm.

A step is two kinds of jitted program: ``fwd_bwd`` (one shard_map program: gathers, forward,
backward with per-stage recompute, reduce of gradients) and ``update`` (one shard_map program per
chunk, one compilation per (param kind, state kind) serving all chunks, as
:class:`chunkjax.runtime.ChunkedStep`'s device update).

Memory kinds follow a :class:`chunkjax.Placement` (per chunk): the sharded master params and
optimizer state of a ``pinned_host`` chunk stay in pinned host memory and its update is
*streamed* (that chunk's shard moved to the device, updated, moved back, one chunk per call);
``pinned_host`` compute params (each rank's shard in stage 3, the replicated chunk in stages 1/2)
are fetched inside the program with ``device_put(optimization_barrier((anchor, shard))[1],
Space.Device)`` (the runtime's rule 1), then all-gathered. Gradient shards leave ``fwd_bwd`` on
the device (1/N of a chunk each) and go to the update from there.

Multi-host: the mesh may span processes (``jax.distributed.initialize`` before building it;
``data_mesh()`` takes every process's devices). Every process passes the same global batch and
params (each device takes its rows / slices); :meth:`ZeroStep.master_params` gathers across
processes. ``tests/zero_multiprocess_worker.py`` is the launch recipe (2 processes on localhost,
CPU collectives through gloo); on a cluster, set the coordinator address, process count and id
per node, or call ``jax.distributed.initialize()`` without arguments under SLURM.

Known limits: on the CPU, XLA turns optimization barriers into control dependencies early and
then merges the forward and backward gathers of a chunk (same values; CPU memory is not the
point), so the tie is only checked in the CUDA lowering (tests) until a GPU run; stage 1 holds
every full gradient chunk on each rank until its slice is taken (by definition of ZeRO-1);
gradient shards all wait on the device until the update programs run.

Not yet here (issue 5): the schedule's per-moment fetch/eviction (fetch distance, Belady) and
host (numba) updates, per-rank plan accounting, a GPU run.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkjax import optim
from chunkjax.layout import CHUNK_ALIGN_ELEMS, ChunkLayout, build_layout, search_chunk_size
from chunkjax.memory import DEVICE, PINNED_HOST, ordered_after
from chunkjax.schedule import Placement
from chunkjax.stages import first_readers, stage_reads

#: Name of the data-parallel mesh axis.
AXIS = "data"


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: all of ``jax.devices()``)."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), (AXIS,))


def build_zero_layout(params, n_ranks: int, chunk_size: int | None = None, order=None) -> ChunkLayout:
    """:func:`chunkjax.build_layout` with ``chunk_size`` rounded up to a multiple of
    ``lcm(n_ranks, CHUNK_ALIGN_ELEMS)`` so every chunk splits evenly over the ranks.

    Args:
      params: params pytree (arrays or ``ShapeDtypeStruct``).
      n_ranks: data-parallel ranks N (>= 1).
      chunk_size: elements per chunk before rounding; ``None`` searches (``search_chunk_size``).
      order: leaf paths in first-use order.

    Raises:
      ValueError: ``n_ranks < 1``, or the errors of :func:`chunkjax.build_layout`.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if chunk_size is None:
        chunk_size = search_chunk_size(params, order)
    m = math.lcm(n_ranks, CHUNK_ALIGN_ELEMS)
    return build_layout(params, -(-int(chunk_size) // m) * m, order)


class ZeroState(NamedTuple):
    """Model data of a ZeRO run (global ``jax.Array`` s over the mesh).

    Attributes:
      params: per chunk, compute-dtype params: stage 3: (chunk_size,) sharded ``P("data")`` (each
        rank chunk_size/N elements); stages 1/2: (chunk_size,) replicated ``P()``; in
        ``placement.param_kinds[c]`` memory.
      master: per chunk, (chunk_size,) float32 sharded ``P("data")``, in ``placement.state_kinds[c]``.
      opt_state: per chunk, the optax state of each rank's shard, every leaf given a leading rank
        axis: a leaf of per-shard shape ``s`` is a global (N, *s) array sharded ``P("data")``
        (per-rank scalars such as the step count become (N,); the rest-of-model leaf's moments
        differ per rank, which is why the axis is kept), in ``placement.state_kinds[c]``.
    """

    params: tuple
    master: tuple
    opt_state: tuple




@dataclasses.dataclass(frozen=True)
class ZeroStep:
    """A ZeRO-sharded chunked training step. Build with :func:`make_zero_step`.

    ``step(state, batch) -> (state, metrics)``: ``batch`` int (B, T+1) with ``B % N == 0``
    (placed ``P("data")`` by the call); ``metrics``: ``loss`` (() float32 nats, mean over the
    whole batch) and ``grad_norm`` (() float32, global).

    Attributes:
      stages: the model's stages (:class:`chunkjax.Stage`).
      layout: chunk layout with ``chunk_size % N == 0`` (see :func:`build_zero_layout`).
      mesh: a 1-D mesh with axis ``"data"`` (:func:`data_mesh`).
      tx: an elementwise optax transformation (as :mod:`chunkjax.optim`).
      stage: ZeRO stage, 1, 2 or 3.
      compute_dtype: dtype of compute params and of the gradients communicated.
      placement: per chunk, memory kind of compute params and of master + optimizer state.
    """

    stages: tuple
    layout: ChunkLayout
    mesh: Mesh
    tx: optax.GradientTransformation
    stage: int = 3
    compute_dtype: Any = jnp.float32
    placement: Placement | None = None

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {self.stage!r}")
        if tuple(self.mesh.axis_names) != (AXIS,):
            raise ValueError(f"mesh must be 1-D with axis {AXIS!r}, got axes {self.mesh.axis_names}")
        if self.layout.chunk_size % self.n_ranks:
            raise ValueError(f"chunk_size={self.layout.chunk_size} is not a multiple of the {self.n_ranks} "
                             f"ranks: build the layout with chunkjax.zero.build_zero_layout")
        if self.placement is None:
            object.__setattr__(self, "placement", Placement.uniform(self.layout.n_chunks, DEVICE, DEVICE))
        if self.placement.n_chunks != self.layout.n_chunks:
            raise ValueError(f"placement has {self.placement.n_chunks} chunks, layout {self.layout.n_chunks}")

    # ---- static structure ------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def shard_size(self) -> int:
        """Elements of one chunk held by one rank (chunk_size / N)."""
        return self.layout.chunk_size // self.n_ranks

    @functools.cached_property
    def reads(self) -> tuple[tuple[int, ...], ...]:
        return stage_reads(self.stages, self.layout)

    @functools.cached_property
    def first_reader(self) -> dict[int, int]:
        return first_readers(self.reads)

    def backward_reads(self, batch) -> tuple[tuple[int, ...], ...]:
        """Per stage, the chunks whose *values* its backward needs (``chunkjax.trace.backward_reads``
        on one rank's batch slice): only these are gathered again (an embedding lookup's gradient
        needs no parameter values). ``batch``: the global (B, T+1) array or its shape/dtype."""
        loc = jax.ShapeDtypeStruct((batch.shape[0] // self.n_ranks,) + tuple(batch.shape[1:]), batch.dtype)
        key = (loc.shape, str(loc.dtype))
        cache = self.__dict__.setdefault("_bwd_reads", {})
        if key not in cache:
            from chunkjax.trace import backward_reads, stage_inputs
            ins = stage_inputs(self.stages, self.layout, loc, self.compute_dtype)
            cache[key] = tuple(backward_reads(st, self.layout, p, x, loc) for st, (p, x) in zip(self.stages, ins))
        return cache[key]

    def _ns(self, spec, kind=DEVICE) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    @property
    def _param_spec(self):
        return P(AXIS) if self.stage == 3 else P()

    # ---- the forward/backward program --------------------------------------------------------
    def _local_fwd_bwd(self, params, batch):
        """Per-rank body (inside shard_map). params: per chunk, the rank's shard (stage 3) or the
        full chunk; batch: the rank's (B/N, T+1) rows.

        Returns (loss () f32 mean over ranks, grads: per chunk the rank's reduced gradient shard
        (shard_size,) compute dtype, sq: (1, n_chunks) f32 squared norms of those shards)."""
        lay, n = self.layout, len(self.stages)
        cdt = self.compute_dtype

        def gather(c, anchor):
            p = params[c]
            host = self.placement.param_kinds[c] == PINNED_HOST
            if self.stage != 3 and not host:
                return p
            # tie to the activation/cotangent: no hoisting to the program start, no CSE between the
            # forward and the backward gather
            p = ordered_after(anchor, p)
            if host:  # fetch this rank's shard (stage 3) or the chunk (stages 1/2)
                p = jax.device_put(p, jax.memory.Space.Device)
            if self.stage != 3:
                return p
            return jax.lax.all_gather(p, AXIS, axis=0, tiled=True)

        def sub(s, arrays):
            return lay.unpack_subtree(arrays, self.stages[s].param_keys)

        acc, grads, sq = {}, {}, {}
        rank = jax.lax.axis_index(AXIS)

        def add_grads(s, dp):
            for c in self.reads[s]:
                if c not in acc:
                    acc[c] = jnp.zeros((lay.chunk_size,), jnp.float32)
                acc[c] = lay.scatter_add(acc[c], c, dp)

        def emit(s, dx):
            for c in self.reads[s]:
                if self.first_reader[c] != s:
                    continue
                g = acc.pop(c).astype(cdt)
                if self.stage == 1:  # all-reduce, then keep the own slice for the sharded update
                    g = jax.lax.psum(g, AXIS)
                    g = jax.lax.dynamic_slice(g, (rank * self.shard_size,), (self.shard_size,))
                else:  # reduce-scatter: each rank receives the sum of its slice only
                    g = jax.lax.psum_scatter(g, AXIS, scatter_dimension=0, tiled=True)
                sq[c] = jnp.sum(jnp.square(g.astype(jnp.float32)))
                if dx is not None:  # the reduction happens as the chunk completes, not at the end
                    dx, g = jax.lax.optimization_barrier((dx, g))
                grads[c] = g
            return dx

        # forward: save stage inputs only
        x, saved, loss = None, {}, None
        scale = 1.0 / self.n_ranks  # d(mean over ranks of the local mean loss)
        for s in range(n):
            st = self.stages[s]
            arrays = {c: gather(c, batch if x is None else x) for c in self.reads[s]}
            if s < n - 1:
                saved[s] = x
                x = st.apply(sub(s, arrays), x, batch)
            else:
                loss, pull = jax.vjp(lambda p, xx: st.apply(p, xx, batch), sub(s, arrays), x)
                dp, dx = pull(jnp.full_like(loss, scale))
                add_grads(s, dp)
                x = emit(s, dx)
        # backward: re-gather (only chunks whose values the gradient needs), recompute, vjp
        bwd_reads = self.backward_reads(batch)
        for s in range(n - 2, -1, -1):
            st = self.stages[s]
            x, x_in = jax.lax.optimization_barrier((x, saved.pop(s)))
            arrays = {c: gather(c, x) if c in bwd_reads[s] else jnp.zeros((lay.chunk_size,), cdt)
                      for c in self.reads[s]}
            if s == 0:
                _, pull = jax.vjp(lambda p: st.apply(p, None, batch), sub(s, arrays))
                (dp,), dx = pull(x), None
            else:
                _, pull = jax.vjp(lambda p, xx: st.apply(p, xx, batch), sub(s, arrays), x_in)
                dp, dx = pull(x)
            add_grads(s, dp)
            x = emit(s, dx)
        for c in range(lay.n_chunks):  # chunks no stage reads
            if c not in grads:
                grads[c] = jnp.zeros((self.shard_size,), cdt)
                sq[c] = jnp.zeros((), jnp.float32)
        loss = jax.lax.pmean(loss.astype(jnp.float32), AXIS)
        return (loss, tuple(grads[c] for c in range(lay.n_chunks)),
                jnp.stack([sq[c] for c in range(lay.n_chunks)])[None])

    @functools.cached_property
    def jit_fwd_bwd(self):
        """jit(shard_map(fwd_bwd)): (params, batch) -> (loss, grad shards (chunk_size,) P("data")
        each, sq (N, n_chunks) f32 per-rank per-chunk squared norms)."""
        nc = self.layout.n_chunks
        pspec = (self._param_spec,) * nc
        fn = jax.shard_map(self._local_fwd_bwd, mesh=self.mesh, in_specs=(pspec, P(AXIS)),
                           out_specs=(P(), (P(AXIS),) * nc, P(AXIS)), check_vma=False)
        return jax.jit(fn, in_shardings=(self._param_shardings, self._ns(P(AXIS))),
                       out_shardings=(self._ns(P()), (self._ns(P(AXIS)),) * nc, self._ns(P(AXIS))))

    @functools.cached_property
    def _param_shardings(self):
        return tuple(self._ns(self._param_spec, k) for k in self.placement.param_kinds)

    # ---- the per-chunk update program --------------------------------------------------------
    def _local_update(self, grad, master, state, sq, c, old_params):
        """Per-rank update of one chunk's shard. grad, master: (shard_size,); state leaves (1, ...);
        sq: (1, n_chunks) this rank's squared shard norms; c: () int32 chunk id."""
        del old_params
        g_sq_total = jax.lax.psum(jnp.sum(sq), AXIS)
        state = jax.tree.map(lambda a: a[0], state)
        o = optim.update_chunk(self.tx, grad, master, state, g_sq_total, sq[0, c], self.compute_dtype)
        p = o.params
        if self.stage != 3:  # replicated compute params: all-gather the updated slices
            p = jax.lax.all_gather(p, AXIS, axis=0, tiled=True)
        return p, o.master, jax.tree.map(lambda a: a[None], o.opt_state)

    @functools.cached_property
    def _state_specs(self):
        st = jax.eval_shape(lambda: optim.init_chunk_state(self.tx, jnp.zeros((self.shard_size,), jnp.float32)))
        return jax.tree.map(lambda _: P(AXIS), st)

    @functools.cached_property
    def jit_update(self) -> dict:
        """``{(param_kind, state_kind): jitted update}``: one chunk per call (``c`` traced: one
        compilation serves all chunks of a kind pair). Master and state in ``pinned_host`` are
        moved to the device, updated and moved back (streamed); the new compute params go to
        ``param_kind``; master, state and the old compute params are donated off the CPU."""
        return {(pk, sk): self._make_update(pk, sk)
                for pk, sk in set(zip(self.placement.param_kinds, self.placement.state_kinds))}

    def _make_update(self, param_kind, state_kind):
        dspec = P(AXIS)
        sspec = self._state_specs
        body = jax.shard_map(self._local_update, mesh=self.mesh,
                             in_specs=(dspec, dspec, sspec, dspec, P(), self._param_spec),
                             out_specs=(self._param_spec, dspec, sspec), check_vma=False)
        dev_d, k_d = self._ns(dspec), self._ns(dspec, state_kind)
        dev_s = jax.tree.map(lambda sp: self._ns(sp), sspec)
        k_s = jax.tree.map(lambda sp: self._ns(sp, state_kind), sspec)
        dev_p, k_p = self._ns(self._param_spec), self._ns(self._param_spec, param_kind)

        def upd(grad, master, state, sq, c, old_params):
            if state_kind != DEVICE:
                master, state = jax.device_put(master, dev_d), jax.device_put(state, dev_s)
            if param_kind != DEVICE:
                old_params = jax.device_put(old_params, dev_p)
            p, m, s = body(grad, master, state, sq, c, old_params)
            if state_kind != DEVICE:
                m, s = jax.device_put(m, k_d), jax.device_put(s, k_s)
            if param_kind != DEVICE:
                p = jax.device_put(p, k_p)
            return p, m, s

        donate = (1, 2, 5) if jax.default_backend() != "cpu" else ()
        return jax.jit(upd, in_shardings=(dev_d, k_d, k_s, dev_d, self._ns(P()), k_p),
                       out_shardings=(k_p, k_d, k_s), donate_argnums=donate)

    # ---- communication ------------------------------------------------------------------------
    def comm_bytes_per_step(self, batch) -> dict[str, int]:
        """Bytes one rank sends per step, by collective, for ring algorithms (what NCCL uses for
        large messages): an all-gather or a reduce-scatter of a C-byte chunk moves ``(N-1)/N * C``
        per rank, an all-reduce ``2 (N-1)/N * C``. Gradients travel in the compute dtype; the
        scalar reductions (loss, squared norms) are left out.

        Returns ``{"all_gather": bytes, "reduce_scatter": bytes, "all_reduce": bytes, "total": bytes}``.
        Stage 3 gathers each stage's chunks in the forward and, in the backward recompute, those
        of :meth:`backward_reads` (``batch``: the global batch or its shape; the head's backward is
        fused with its forward); stages 1/2 gather every chunk once after the update.
        """
        n, lay = self.n_ranks, self.layout
        cb = lay.chunk_size * np.dtype(self.compute_dtype).itemsize
        part = lambda k: (k * (n - 1) * cb) // n  # noqa: E731
        read = len({c for r in self.reads for c in r})
        if self.stage == 3:
            gathers = sum(len(r) for r in self.reads) + sum(len(r) for r in self.backward_reads(batch)[:-1])
        else:
            gathers = lay.n_chunks
        out = {"all_gather": part(gathers),
               "reduce_scatter": part(read) if self.stage != 1 else 0,
               "all_reduce": 2 * part(read) if self.stage == 1 else 0}
        out["total"] = sum(out.values())
        return out

    # ---- state and the step -------------------------------------------------------------------
    def init(self, params) -> ZeroState:
        """Chunk a params pytree (float32 or any float dtype) into a sharded :class:`ZeroState`.

        Chunks are packed on the host one at a time and placed with ``NamedSharding`` s; each
        rank's optimizer state is built by ``tx.init`` on its own shard (inside shard_map)."""
        lay = self.layout
        leaves = lay.treedef.flatten_up_to(params)
        sspec = self._state_specs
        init_state = jax.jit(jax.shard_map(
            lambda m: jax.tree.map(lambda a: a[None], optim.init_chunk_state(self.tx, m)),
            mesh=self.mesh, in_specs=P(AXIS), out_specs=sspec, check_vma=False),
            out_shardings=jax.tree.map(lambda sp: self._ns(sp), sspec))
        ps, ms, os_ = [], [], []
        for c in range(lay.n_chunks):
            buf = np.zeros((lay.chunk_size,), np.float32)
            for s, leaf in zip(lay.slots, leaves):
                if s.chunk == c:
                    buf[s.offset:s.offset + s.size] = np.asarray(leaf, np.float32).ravel()
            sk = self.placement.state_kinds[c]
            m_dev = jax.device_put(buf, self._ns(P(AXIS)))
            os_.append(jax.device_put(init_state(m_dev), jax.tree.map(lambda sp: self._ns(sp, sk), sspec)))
            ms.append(jax.device_put(m_dev, self._ns(P(AXIS), sk)))
            del m_dev
            ps.append(jax.device_put(buf.astype(self.compute_dtype), self._param_shardings[c]))
        jax.block_until_ready((ps, ms, os_))
        return ZeroState(tuple(ps), tuple(ms), tuple(os_))

    def __call__(self, state: ZeroState, batch) -> tuple[ZeroState, dict]:
        """One training step. batch: int (B, T+1), ``B % N == 0``.

        Raises:
          ValueError: the batch does not split evenly over the ranks.
        """
        if batch.shape[0] % self.n_ranks:
            raise ValueError(f"batch of {batch.shape[0]} rows does not split over {self.n_ranks} ranks: "
                             f"use a multiple of {self.n_ranks}")
        batch = jax.device_put(batch, self._ns(P(AXIS)))
        loss, grads, sq = self.jit_fwd_bwd(state.params, batch)
        params, master, opt = list(state.params), list(state.master), list(state.opt_state)
        pl = self.placement
        for c in range(self.layout.n_chunks):
            fn = self.jit_update[(pl.param_kinds[c], pl.state_kinds[c])]
            params[c], master[c], opt[c] = fn(grads[c], master[c], opt[c], sq, jnp.asarray(c, jnp.int32), params[c])
        return ZeroState(tuple(params), tuple(master), tuple(opt)), {
            "loss": loss, "grad_norm": jnp.sqrt(jnp.sum(sq))}

    def master_params(self, state: ZeroState):
        """The float32 master params as a pytree of numpy arrays, gathered to this host (from every
        process under ``jax.distributed``; every process must call it then)."""
        from jax.experimental import multihost_utils

        def whole(m):
            if m.is_fully_addressable:
                return np.asarray(m)
            return np.asarray(multihost_utils.process_allgather(m, tiled=True))

        return self.layout.unpack([whole(m) for m in state.master])

    def device_bytes(self, state: ZeroState) -> dict[str, dict[Any, int]]:
        """Bytes each device holds, from ``addressable_shards``: ``{"params": {device: bytes},
        "master": ..., "opt_state": ...}`` (every memory kind counted)."""
        out = {}
        for name, tree in (("params", state.params), ("master", state.master), ("opt_state", state.opt_state)):
            per = {d: 0 for d in self.mesh.devices.flat}
            for a in jax.tree.leaves(tree):
                for sh in a.addressable_shards:
                    per[sh.device] += sh.data.size * sh.data.dtype.itemsize
            out[name] = per
        return out


def make_zero_step(stages, layout: ChunkLayout, mesh: Mesh, tx: optax.GradientTransformation, *,
                   stage: int = 3, compute_dtype=jnp.float32, placement: Placement | None = None,
                   param_kind: str = DEVICE, state_kind: str = DEVICE) -> ZeroStep:
    """Build a :class:`ZeroStep` (nothing is compiled until first use).

    Args:
      stages: the model's stages.
      layout: a layout whose ``chunk_size`` is a multiple of the mesh size
        (:func:`build_zero_layout`).
      mesh: 1-D ``"data"`` mesh (:func:`data_mesh`).
      tx: elementwise optax transformation.
      stage: ZeRO stage 1, 2 or 3.
      compute_dtype: compute params / gradient dtype (float32 or bfloat16).
      placement: per-chunk memory kinds (a :class:`chunkjax.Placement`); when omitted, every chunk
        gets ``param_kind`` for its compute params and ``state_kind`` for master + state.
      param_kind, state_kind: "device" or "pinned_host" (used only without ``placement``).

    Raises:
      ValueError: bad stage, mesh, chunk size, placement or memory kind (see :class:`ZeroStep`).
    """
    if placement is None:
        placement = Placement.uniform(layout.n_chunks, param_kind, state_kind)
    return ZeroStep(tuple(stages), layout, mesh, tx, int(stage), jnp.dtype(compute_dtype), placement)
