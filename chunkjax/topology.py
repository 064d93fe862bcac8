"""Where a chunked step runs: one device, or a 1-D ``data`` mesh with ZeRO stage 1, 2 or 3.

The step (:mod:`chunkjax.step`) and the walker (:mod:`chunkjax.walker`) are written once; a
topology supplies what differs between one device and a mesh:

* the walker's hooks, called inside a program with per-rank values: ``to_device`` (a fetch),
  ``to_host`` (a gradient leaving for pinned host memory), ``gather`` (the full chunk from what
  a fetch brought), ``resident`` (the full chunk of a device-resident chunk at a moment that
  reads it), ``reduce_grad`` (the gradient to keep), ``loss_cotangent``;
* the shardings of params, gradients, master params, optimizer state and batches, and the
  wrapping of programs and update bodies (``jax.jit``, plus ``jax.shard_map`` over the mesh);
* the per-rank views of host-updated chunks (numpy slices of each rank's shard).

ZeRO over chunks (Rajbhandari et al., "ZeRO", SC 2020; PatrickStar, arXiv 2108.05818, section 6;
Colossal-AI's Gemini shards PatrickStar's chunks the same way): each chunk of ``chunk_size``
elements is split evenly over the ``N`` ranks; rank ``r`` owns elements
``[r * chunk_size / N, (r + 1) * chunk_size / N)`` of the float32 master params and of the
optimizer state (every optax leaf gets a leading rank axis: a leaf of per-shard shape ``s`` is a
global ``(N, *s)`` array ``P("data")``). ``zero_stage=3`` shards the compute params too (a fetch
brings the rank's shard, ``all_gather`` makes the full chunk); stages 1/2 keep them replicated.
Gradients are all-reduced (stage 1, each rank keeps its slice) or reduce-scattered (stages 2/3)
as the backward completes each chunk. The batch is split over the ranks; the loss is the mean
over ranks (a weighted loss: its sums over ranks, :mod:`chunkjax.loss_weight`). Collectives are
XLA's; the mesh may span processes (``jax.distributed``): every array is built from per-shard
callbacks and host updates touch ``addressable_shards`` only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkjax import loss_weight as lw
from chunkjax.layout import CHUNK_ALIGN_ELEMS, ChunkLayout, build_layout, search_chunk_size
from chunkjax.memory import DEVICE, ordered_after, sharding

#: Name of the data-parallel mesh axis.
AXIS = "data"


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: all of ``jax.devices()``, every
    process's under ``jax.distributed``)."""
    devs = np.asarray(jax.devices() if devices is None else devices)
    return Mesh(devs.reshape(-1), (AXIS,))


def build_zero_layout(params, n_ranks: int, chunk_size: int | None = None, order=None, *,
                      trainable=None) -> ChunkLayout:
    """:func:`chunkjax.build_layout` with ``chunk_size`` rounded up to a multiple of
    ``lcm(n_ranks, CHUNK_ALIGN_ELEMS)`` so every chunk splits evenly over the ranks.

    Args:
      params: params pytree (arrays or ``ShapeDtypeStruct``).
      n_ranks: data-parallel ranks N (>= 1).
      chunk_size: elements per chunk before rounding; ``None`` searches (``search_chunk_size``).
      order: leaf paths in first-use order.
      trainable: which leaves are trained (see :func:`chunkjax.build_layout`).

    Raises:
      ValueError: ``n_ranks < 1``, or the errors of :func:`chunkjax.build_layout`.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    m = math.lcm(n_ranks, CHUNK_ALIGN_ELEMS)
    if chunk_size is None:
        chunk_size = search_chunk_size(params, order, align=m, trainable=trainable)
    return build_layout(params, -(-int(chunk_size) // m) * m, order, trainable=trainable)


def _host_put(x: np.ndarray, sh) -> jax.Array:
    """``x`` (the whole global value, identical in every process) placed with ``sh``: each process
    builds only its addressable shards (no device_put of a whole array to a global sharding)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])


@dataclasses.dataclass(frozen=True)
class SingleDevice:
    """One device (``jax.devices()[0]``): the walker's hooks are plain moves, programs plain jits."""

    n_ranks = 1
    zero_stage = None
    mesh = None

    # ---- the walker's hooks (inside a program) --------------------------------------------------
    def to_device(self, x):
        return jax.device_put(x, sharding(DEVICE))

    def to_host(self, g):
        from chunkjax.memory import PINNED_HOST
        return jax.device_put(g, sharding(PINNED_HOST))

    def gather(self, x):
        return x

    def resident(self, x, anchor):
        del anchor
        return x

    def reduce_grad(self, g):
        """(gradient to keep, () f32 squared norm of the part kept)."""
        return g, jnp.sum(jnp.square(g.astype(jnp.float32)))

    def loss_cotangent(self, loss):
        """The head's backward seed: 1, or ``1 / weight`` of a weighted loss (:mod:`chunkjax.loss_weight`)."""
        return lw.seed(loss) if lw.is_weighted(loss) else jnp.ones_like(loss)

    def reduce_scalars(self, sq: dict, loss):
        """The squared norms of the whole reduced gradients and the loss (mean over ranks)."""
        return sq, loss

    # ---- shardings --------------------------------------------------------------------------------
    def param_sharding(self, kind: str):
        return sharding(kind)

    def grad_sharding(self, kind: str):
        return sharding(kind)

    def shard_sharding(self, kind: str = DEVICE):
        """Master params and optimizer state of a chunk (whole here)."""
        return sharding(kind)

    def scalar_sharding(self):
        return sharding(DEVICE)

    def batch_sharding(self):
        return sharding(DEVICE)

    def local_rows(self, rows: int) -> int:
        return rows

    def put(self, x, sh):
        return jax.device_put(x, sh)

    def put_batch(self, batch):
        """The batch as the programs take it (unchanged: jit places it)."""
        return batch

    def check_rows(self, rows: int, micro_batches: int) -> None:
        if rows % micro_batches:
            raise ValueError(f"batch leading size {rows} does not split into micro_batches={micro_batches} equal "
                             f"parts: use a batch size that is a multiple of {micro_batches}")

    # ---- programs -----------------------------------------------------------------------------------
    def jit_program(self, prog, *, carry_out: tuple, grad_kinds: dict, donate: tuple, name: str,
                    kept_kinds: dict | None = None):
        """jit ``prog(params, batch, carry, acc) -> (carry, acc, grads, sq, loss)``; ``kept_kinds``:
        the memory kind of each stage's kept activations in the carry (:func:`chunkjax.remat.kept_kinds`)."""
        dev = sharding(DEVICE)
        prog.__name__ = prog.__qualname__ = name  # the XLA module is named after the program
        gsh = {c: sharding(k) for c, k in grad_kinds.items()}
        carry = dev if not kept_kinds else dict({k: dev for k in carry_out}, **{
            part: {s: sharding(k) for s, k in kinds.items()} for part, kinds in kept_kinds.items()})
        return jax.jit(prog, out_shardings=(carry, dev, gsh, dev, dev), donate_argnums=donate)

    def jit_whole(self, fn, param_kinds, grad_kinds):
        """jit ``fn(params_tuple, batch) -> (loss, grads tuple, sq (n_chunks,))`` (one program)."""
        dev = sharding(DEVICE)
        return jax.jit(fn, in_shardings=(tuple(sharding(k) for k in param_kinds), dev),
                       out_shardings=(dev, tuple(sharding(k) for k in grad_kinds), dev))

    def jit_eval(self, fn, param_kinds):
        """jit ``fn(params_tuple, batch) -> loss`` (forward moments only)."""
        dev = sharding(DEVICE)
        return jax.jit(fn, in_shardings=(tuple(sharding(k) for k in param_kinds), dev), out_shardings=dev)

    # ---- update bodies ------------------------------------------------------------------------------
    def state_spec_of(self, template):
        return None

    def per_rank_update(self, body, state_template):
        """The update body as it runs: here unchanged (``body(grad, master, state, grad_sq, c,
        inv_scale, own_sq)``: whole chunk)."""
        del state_template

        def run(grad, master, state, grad_sq, c, inv_scale):
            return body(grad, master, state, jnp.sum(grad_sq), grad_sq[c], inv_scale)
        return run

    def per_rank_init(self, init, state_template):
        """``init(master) -> optax state`` as it runs (unchanged here)."""
        del state_template
        return init

    def state_shardings(self, template, kind: str):
        return jax.tree.map(lambda _: sharding(kind), template)

    # ---- host-updated chunks ----------------------------------------------------------------------
    def local_ranks(self) -> tuple[int, ...]:
        return (0,)

    def rank_slice(self, r: int, chunk_size: int) -> slice:
        return slice(0, chunk_size)

    def grad_shards(self, g) -> dict:
        """{rank: this rank's gradient of a host-updated chunk (numpy view or array)}."""
        return {0: g}

    def param_views(self, p_arr, r: int, dtype) -> list:
        """Writable numpy views of rank ``r``'s slice of the compute params (first one first)."""
        from chunkjax import host_update as hu
        return [hu.writable_view(p_arr, dtype)]

    def whole(self, a) -> np.ndarray:
        """A global array as numpy in this process."""
        return np.asarray(a)


@dataclasses.dataclass(frozen=True)
class DataMesh:
    """A 1-D ``data`` mesh of ``N`` ranks with ZeRO ``zero_stage`` (1, 2 or 3), in one process or
    across processes (``jax.distributed``; build the mesh with :func:`data_mesh` after
    ``jax.distributed.initialize``).

    Raises (at construction):
      ValueError: a mesh that is not 1-D ``"data"``, or a stage other than 1/2/3.
    """

    mesh: Mesh
    zero_stage: int = 3

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh) or tuple(self.mesh.axis_names) != (AXIS,):
            raise ValueError(f"mesh must be a 1-D Mesh with axis {AXIS!r} (chunkjax.topology.data_mesh())")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")

    @property
    def n_ranks(self) -> int:
        return int(self.mesh.devices.size)

    def _ns(self, spec, kind: str = DEVICE) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    @property
    def pspec(self):
        """PartitionSpec of compute params: sharded (stage 3) or replicated."""
        return P(AXIS) if self.zero_stage == 3 else P()

    # ---- the walker's hooks (inside shard_map: per-rank values) -----------------------------------
    def to_device(self, x):
        return jax.device_put(x, jax.memory.Space.Device)

    def to_host(self, g):
        return jax.device_put(g, jax.memory.Space.Host)

    def gather(self, x):
        return jax.lax.all_gather(x, AXIS, axis=0, tiled=True) if self.zero_stage == 3 else x

    def resident(self, x, anchor):
        if self.zero_stage != 3:
            return x
        # tied to the moment's input: no hoisting to the program start, no CSE between the
        # forward and the backward gathers (which would keep every full chunk alive)
        return jax.lax.all_gather(ordered_after(anchor, x), AXIS, axis=0, tiled=True)

    def reduce_grad(self, g):
        """(this rank's slice of the reduced gradient, () f32 its squared norm: summed over the
        ranks by :meth:`reduce_scalars`)."""
        if self.zero_stage == 1:  # all-reduce, keep the own slice
            n = g.shape[0] // self.n_ranks
            g = jax.lax.psum(g, AXIS)
            g = jax.lax.dynamic_slice(g, (jax.lax.axis_index(AXIS) * n,), (n,))
        else:  # reduce-scatter: each rank receives the sum of its slice
            g = jax.lax.psum_scatter(g, AXIS, scatter_dimension=0, tiled=True)
        return g, jnp.sum(jnp.square(g.astype(jnp.float32)))

    def loss_cotangent(self, loss):
        """The head's backward seed: ``1 / N`` (d(mean over ranks)), or ``1 / W`` of a weighted
        loss, ``W`` its weight summed over the ranks (:mod:`chunkjax.loss_weight`)."""
        if lw.is_weighted(loss):
            return lw.seed(loss, lambda w: jax.lax.psum(w, AXIS))
        return jnp.full_like(loss, 1.0 / self.n_ranks)

    def reduce_scalars(self, sq: dict, loss):
        """One ``psum`` per program: every chunk's squared shard norm summed over the ranks, with
        the loss's mean over ranks (a weighted loss: its total and weight summed over ranks)."""
        keys = sorted(sq)
        vals = [sq[c] for c in keys]
        if lw.is_weighted(loss):
            vals += [jnp.asarray(loss.total, jnp.float32), jnp.asarray(loss.weight, jnp.float32)]
        elif loss is not None:
            vals.append(loss.astype(jnp.float32) / self.n_ranks)
        if not vals:
            return sq, loss
        tot = jax.lax.psum(jnp.stack(vals), AXIS)
        out = {c: tot[i] for i, c in enumerate(keys)}
        if lw.is_weighted(loss):
            return out, lw.WeightedLoss(tot[-2], tot[-1])
        return out, (tot[-1] if loss is not None else None)

    # ---- shardings --------------------------------------------------------------------------------
    def param_sharding(self, kind: str):
        return self._ns(self.pspec, kind)

    def grad_sharding(self, kind: str):
        return self._ns(P(AXIS), kind)

    def shard_sharding(self, kind: str = DEVICE):
        return self._ns(P(AXIS), kind)

    def scalar_sharding(self):
        return self._ns(P())

    def batch_sharding(self):
        return self._ns(P(AXIS))

    def local_rows(self, rows: int) -> int:
        return rows // self.n_ranks

    def put(self, x, sh):
        """``x`` placed with ``sh``: ``device_put`` in one process; across processes each process
        builds its own shards from ``x`` (the whole value, the same in every process)."""
        if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sh)
        return _host_put(np.asarray(x), sh)

    def put_batch(self, batch):
        """The global batch (every process passes the same one) placed ``P("data")``: each process
        builds its ranks' rows."""
        sh = self.batch_sharding()
        return jax.tree.map(lambda a: a if isinstance(a, jax.Array) and a.sharding == sh else self.put(a, sh), batch)

    def check_rows(self, rows: int, micro_batches: int) -> None:
        if rows % (self.n_ranks * micro_batches):
            raise ValueError(f"batch of {rows} rows does not split over {self.n_ranks} ranks x {micro_batches} "
                             f"micro-batches: use a multiple of {self.n_ranks * micro_batches}")

    # ---- programs -----------------------------------------------------------------------------------
    def _carry_spec(self, keys):
        spec = {"x": P(AXIS), "saved": P(AXIS), "held": P(),
                "issued": P(AXIS) if self.zero_stage == 3 else P(), "loss_scale": P()}
        return {k: spec[k] for k in keys}

    def jit_program(self, prog, *, carry_out: tuple, grad_kinds: dict, donate: tuple, name: str,
                    kept_kinds: dict | None = None):
        """jit(shard_map) of ``prog(params, batch, carry, acc) -> (carry, acc, grads, sq, loss)``:
        params in their ZeRO spec, batch and accumulators ``P("data")``, gradients leave as each
        rank's shard, squared norms and loss reduced once (:meth:`reduce_scalars`).
        ``kept_kinds`` must be empty (remat ``"save"``/``"offload"`` runs on one device)."""
        if kept_kinds:
            raise ValueError("remat 'save'/'offload' runs on one device: plan the mesh with remat 'full'")

        def program(params, batch, carry, acc):
            def local(params, batch, carry, acc):
                c2, a2, g, q, loss = prog(params, batch, carry, acc)
                q, loss = self.reduce_scalars(q, loss)
                return c2, a2, g, q, loss

            fn = jax.shard_map(local, mesh=self.mesh,
                               in_specs=({c: self.pspec for c in params}, P(AXIS), self._carry_spec(carry), P(AXIS)),
                               out_specs=(self._carry_spec(carry_out), P(AXIS), P(AXIS), P(), P()),
                               check_vma=False)
            return fn(params, batch, carry, acc)

        program.__name__ = program.__qualname__ = name
        carry_sh = {k: self._ns(s) for k, s in self._carry_spec(carry_out).items()}
        gsh = {c: self._ns(P(AXIS), k) for c, k in grad_kinds.items()}
        return jax.jit(program, out_shardings=(carry_sh, self._ns(P(AXIS)), gsh, self._ns(P()), self._ns(P())),
                       donate_argnums=donate)

    def jit_whole(self, fn, param_kinds, grad_kinds):
        """jit(shard_map) of ``fn(params_tuple, batch) -> (loss, grads tuple, sq (n_chunks,))``,
        the per-rank body of the whole step in one program."""
        nc = len(param_kinds)
        body = jax.shard_map(fn, mesh=self.mesh, in_specs=((self.pspec,) * nc, P(AXIS)),
                             out_specs=(P(), (P(AXIS),) * nc, P()), check_vma=False)
        return jax.jit(body, in_shardings=(tuple(self.param_sharding(k) for k in param_kinds), self._ns(P(AXIS))),
                       out_shardings=(self._ns(P()), tuple(self.grad_sharding(k) for k in grad_kinds),
                                      self._ns(P())))

    def jit_eval(self, fn, param_kinds):
        nc = len(param_kinds)
        body = jax.shard_map(lambda p, b: self.reduce_scalars({}, fn(p, b))[1], mesh=self.mesh,
                             in_specs=((self.pspec,) * nc, P(AXIS)), out_specs=P(), check_vma=False)
        return jax.jit(body, in_shardings=(tuple(self.param_sharding(k) for k in param_kinds), self._ns(P(AXIS))),
                       out_shardings=self._ns(P()))

    # ---- update bodies ------------------------------------------------------------------------------
    def state_spec_of(self, template):
        return jax.tree.map(lambda _: P(AXIS), template)

    def per_rank_update(self, body, state_template):
        """shard_map of the update body over the ranks: each rank updates its slice (the squared
        norm of its own gradient shard feeds the rest-of-model leaf, :mod:`chunkjax.optim`);
        stages 1/2 all-gather the new compute params."""
        sspec = self.state_spec_of(state_template)

        def local(grad, master, state, grad_sq, c, inv_scale):
            del c
            own = jnp.sum(jnp.square(grad.astype(jnp.float32)))
            state = jax.tree.map(lambda a: a[0], state)
            p, m, st = body(grad, master, state, jnp.sum(grad_sq), own, inv_scale)
            if self.zero_stage != 3:
                p = jax.lax.all_gather(p, AXIS, axis=0, tiled=True)
            return p, m, jax.tree.map(lambda a: a[None], st)

        return jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS), P(AXIS), sspec, P(), P(), P()),
                             out_specs=(self.pspec, P(AXIS), sspec), check_vma=False)

    def per_rank_init(self, init, state_template):
        """shard_map of ``init``: each rank's state of its master shard, leaves given the leading
        rank axis."""
        return jax.shard_map(lambda m: jax.tree.map(lambda a: a[None], init(m)), mesh=self.mesh, in_specs=P(AXIS),
                             out_specs=self.state_spec_of(state_template), check_vma=False)

    def state_shardings(self, template, kind: str):
        return jax.tree.map(lambda _: self._ns(P(AXIS), kind), template)

    # ---- host-updated chunks ----------------------------------------------------------------------
    def rank_of(self, index, chunk_size: int) -> int:
        return (index[0].start or 0) // (chunk_size // self.n_ranks)

    def local_ranks(self) -> tuple[int, ...]:
        """Ranks whose device belongs to this process, in rank order."""
        me = jax.process_index()
        return tuple(r for r, d in enumerate(self.mesh.devices.flat) if d.process_index == me)

    def rank_slice(self, r: int, chunk_size: int) -> slice:
        n = chunk_size // self.n_ranks
        return slice(r * n, (r + 1) * n)

    def grad_shards(self, g) -> dict:
        if isinstance(g, jax.Array):
            n = g.shape[0]
            return {self.rank_of(sh.index, n): sh.data for sh in g.addressable_shards}
        return {r: g[self.rank_slice(r, g.shape[0])] for r in self.local_ranks()}

    def param_views(self, p_arr, r: int, dtype) -> list:
        """Stage 3: the rank's shard; stages 1/2: that slice of every local replica."""
        from chunkjax import host_update as hu
        n = p_arr.shape[0]
        if self.zero_stage == 3:
            return [hu.writable_view(sh.data, dtype) for sh in p_arr.addressable_shards
                    if self.rank_of(sh.index, n) == r]
        return [hu.writable_view(sh.data, dtype)[self.rank_slice(r, n)] for sh in p_arr.addressable_shards]

    def gather_slices(self, slices: tuple) -> np.ndarray:
        """A host-updated chunk's per-rank numpy slices (None for other processes' ranks) as the
        whole chunk, in rank order: under ``jax.distributed`` each process's contiguous ranks are
        all-gathered (a collective: every process calls it).

        Raises:
          ValueError: a process whose ranks are not contiguous in the mesh.
        """
        mine = [r for r, x in enumerate(slices) if x is not None]
        if mine != list(range(mine[0], mine[-1] + 1)):
            raise ValueError(f"this process holds ranks {mine}, not a contiguous run: build the mesh with data_mesh()")
        local = np.concatenate([slices[r] for r in mine])
        if len(mine) == len(slices):
            return local
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(local, tiled=True))

    def whole(self, a) -> np.ndarray:
        """A global array as numpy, gathered from every process under ``jax.distributed`` (a
        collective then: every process calls it)."""
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            from jax.experimental import multihost_utils
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)


Topology = SingleDevice | DataMesh


def make_topology(mesh: Mesh | None = None, zero_stage: int | None = None) -> Any:
    """:class:`SingleDevice` without a mesh, else :class:`DataMesh` (``zero_stage`` default 3).

    Raises:
      ValueError: ``zero_stage`` given without a mesh, or the errors of :class:`DataMesh`.
    """
    if mesh is None:
        if zero_stage is not None:
            raise ValueError(f"zero_stage={zero_stage} needs a mesh: pass mesh=chunkjax.topology.data_mesh()")
        return SingleDevice()
    return DataMesh(mesh, 3 if zero_stage is None else int(zero_stage))


class OnTopology:
    """The topology's facts as attributes of a step holding ``topology`` and ``layout``
    (:class:`chunkjax.ChunkedStep`): ranks, mesh, ZeRO stage and one rank's share of a chunk."""

    @property
    def n_ranks(self) -> int:
        return self.topology.n_ranks

    @property
    def mesh(self):
        return self.topology.mesh

    @property
    def zero_stage(self) -> int | None:
        return self.topology.zero_stage

    @property
    def shard_size(self) -> int:
        """Elements of one chunk held by one rank (chunk_size / N)."""
        return self.layout.chunk_size // self.n_ranks
