"""ZeRO data parallelism inside the static schedule (issue 5): every chunk sharded over the ranks.

:class:`ZeroScheduledStep` is the pipelined step of :mod:`chunkjax.runtime` (moments in tide
order, fetches and evictions of a :class:`chunkjax.schedule.Schedule`, programs cut at backward
moments, host updates on a thread while the backward runs) run by every rank of a 1-D ``data``
mesh, Gemini style (Colossal-AI's sharding of PatrickStar's chunks; ZeRO, Rajbhandari et al.,
SC 2020):

* each chunk of ``chunk_size`` elements is split evenly over the ``N`` ranks; rank ``r`` owns
  elements ``[r * chunk_size / N, (r + 1) * chunk_size / N)``: its slice of the float32 master
  params and of the optimizer state, on the device or in host memory as the schedule places the
  chunk (host-updated chunks: numpy per rank, updated in place by the numba kernel);
* ``zero_stage=3``: compute params sharded too; a fetch brings the rank's shard to the device
  and ``all_gather`` makes the full chunk, held until the schedule evicts it; a device-resident
  chunk is all-gathered at every moment that reads it (tied to that moment's activation);
  ``zero_stage=2``: compute params replicated (every rank fetches the whole chunk), gradients
  reduce-scattered; ``zero_stage=1``: gradients all-reduced, each rank keeps its slice;
* gradients are reduced as the backward completes each chunk (``psum_scatter``), and a
  host-updated chunk's shard leaves for pinned host memory at once;
* the batch is split over the ranks (``B % N == 0``); the loss is the mean over ranks.

Each program is ``jax.jit(jax.shard_map(...))`` over the mesh: the moment walker of
:class:`~chunkjax.runtime.ChunkedStep` with its hooks (``_to_device``, ``_gather``,
``_resident``, ``_reduce_grad``...) bound to collectives. Collectives are XLA's; no home-made
transport.

One process drives all its local devices. Host updates read each rank's gradient shard from
``addressable_shards`` and write the rank's slice of the compute params in place (stage 3: the
rank's shard; stages 1/2: that slice of every replica). Multi-process runs of this step are
not supported yet (:class:`chunkjax.zero.ZeroStep` is the multi-host path).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from chunkjax import optim
from chunkjax.memory import DEVICE, PINNED_HOST, ordered_after
from chunkjax.runtime import ChunkedStep, TrainState
from chunkjax.schedule import Schedule
from chunkjax.zero import AXIS


@dataclasses.dataclass(frozen=True)
class ZeroScheduledStep(ChunkedStep):
    """A :class:`~chunkjax.runtime.ChunkedStep` sharded over ``mesh`` (ZeRO ``zero_stage``).

    Build it with :func:`make_zero_scheduled_step`. ``step(state, batch)`` takes the global batch
    (B, T+1) int32 with ``B`` a multiple of the number of ranks.

    State (:class:`~chunkjax.runtime.TrainState`), per chunk ``c``:
      params: (chunk_size,) compute dtype, ``P("data")`` (stage 3) or replicated, in the
        schedule's param kind.
      master: device-updated chunks: (chunk_size,) float32 ``P("data")`` on the device;
        streamed chunks: the same in pinned host memory (each rank's shard moved to its device,
        updated there and moved back, inside one jitted program);
        host-updated chunks: a tuple of N numpy (chunk_size / N,) float32 slices, one per rank.
      opt_state: device-updated: the optax state of each rank's shard with a leading rank axis
        (a leaf of per-shard shape ``s`` is a global (N, *s) array ``P("data")``, as
        :class:`chunkjax.zero.ZeroState`); host-updated: a tuple of N host states
        (:mod:`chunkjax.host_update`), one per rank.

    Raises (at construction):
      ValueError: no schedule, a mesh that is not 1-D ``"data"``, a stage other than 1/2/3,
        or ``chunk_size`` not a multiple of the ranks (use :func:`chunkjax.zero.build_zero_layout`).
    """

    mesh: Any = None
    zero_stage: int = 3

    def __post_init__(self):
        super().__post_init__()
        if self.schedule is None:
            raise ValueError("ZeroScheduledStep runs a chunkjax.schedule.Schedule: pass one")
        if not isinstance(self.mesh, Mesh) or tuple(self.mesh.axis_names) != (AXIS,):
            raise ValueError(f"mesh must be a 1-D Mesh with axis {AXIS!r} (chunkjax.zero.data_mesh())")
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage}")
        if self.layout.chunk_size % self.n_ranks:
            raise ValueError(f"chunk_size {self.layout.chunk_size} does not split over {self.n_ranks} ranks: "
                             "build the layout with chunkjax.zero.build_zero_layout")

    # ---- shapes and shardings ------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        return int(self.mesh.devices.size)

    @property
    def shard_size(self) -> int:
        return self.layout.chunk_size // self.n_ranks

    def _ns(self, spec, kind: str = DEVICE) -> NamedSharding:
        return NamedSharding(self.mesh, spec, memory_kind=kind)

    @property
    def _pspec(self):
        return P(AXIS) if self.zero_stage == 3 else P()

    @functools.cached_property
    def _param_shardings(self):
        return tuple(self._ns(self._pspec, k) for k in self.placement.param_kinds)

    @property
    def _batch_sharding(self):
        return self._ns(P(AXIS))

    def _rank_slice(self, r: int) -> slice:
        return slice(r * self.shard_size, (r + 1) * self.shard_size)

    # ---- the walker's hooks (inside shard_map: per-rank values) ---------------------------------
    def _to_device(self, x):
        return jax.device_put(x, jax.memory.Space.Device)

    def _to_host(self, g):
        return jax.device_put(g, jax.memory.Space.Host)

    def _gather(self, x):
        return jax.lax.all_gather(x, AXIS, axis=0, tiled=True) if self.zero_stage == 3 else x

    def _resident(self, x, anchor):
        if self.zero_stage != 3:
            return x
        # tied to the moment's input: no hoisting to the program start, no CSE between the
        # forward and the backward gathers (which would keep every full chunk alive)
        return jax.lax.all_gather(ordered_after(anchor, x), AXIS, axis=0, tiled=True)

    def _reduce_grad(self, g):
        if self.zero_stage == 1:  # all-reduce, keep the own slice
            g = jax.lax.psum(g, AXIS)
            g = jax.lax.dynamic_slice(g, (jax.lax.axis_index(AXIS) * self.shard_size,), (self.shard_size,))
        else:  # reduce-scatter: each rank receives the sum of its slice
            g = jax.lax.psum_scatter(g, AXIS, scatter_dimension=0, tiled=True)
        return g, jax.lax.psum(jnp.sum(jnp.square(g.astype(jnp.float32))), AXIS)

    def _loss_cotangent(self, loss):
        return jnp.full_like(loss, 1.0 / self.n_ranks)  # d(mean over ranks)

    def _zeros_grad(self, c):
        return jax.device_put(jnp.zeros((self.layout.chunk_size,), self.compute_dtype),
                              self._ns(P(AXIS), self.placement.grad_kind(c)))

    def _zeros_sq(self):
        return jax.device_put(jnp.zeros((), jnp.float32), self._ns(P()))

    # ---- programs --------------------------------------------------------------------------------
    def _carry_spec(self, keys):
        spec = {"x": P(AXIS), "saved": P(AXIS), "held": P(),
                "issued": P(AXIS) if self.zero_stage == 3 else P(), "loss_scale": P()}
        return {k: spec[k] for k in keys}

    def _jit_program(self, prog, done, last: bool):
        carry_keys = () if last else ("x", "saved", "held", "issued") + (("loss_scale",) if self.loss_scaling else ())

        def program(params, batch, carry, acc):
            def local(params, batch, carry, acc):
                c2, a2, g, q, loss = prog(params, batch, carry, acc)
                if loss is not None:
                    loss = jax.lax.pmean(loss.astype(jnp.float32), AXIS)
                return c2, a2, g, q, loss

            fn = jax.shard_map(local, mesh=self.mesh,
                               in_specs=({c: self._pspec for c in params}, P(AXIS), self._carry_spec(carry), P(AXIS)),
                               out_specs=(self._carry_spec(carry_keys), P(AXIS), P(AXIS), P(), P()),
                               check_vma=False)
            return fn(params, batch, carry, acc)

        program.__name__ = program.__qualname__ = getattr(prog, "__name__", "chunkjax_program")
        carry_sh = {k: self._ns(s) for k, s in self._carry_spec(carry_keys).items()}
        gsh = {c: self._ns(P(AXIS), self.placement.grad_kind(c)) for c in done}
        donate = (2, 3) if self._donates else ()
        return jax.jit(program, out_shardings=(carry_sh, self._ns(P(AXIS)), gsh, self._ns(P()), self._ns(P())),
                       donate_argnums=donate)

    # ---- updates -------------------------------------------------------------------------------
    @functools.cached_property
    def _state_specs(self):
        st = jax.eval_shape(lambda: optim.init_chunk_state(self.tx, jnp.zeros((self.shard_size,), jnp.float32)))
        return jax.tree.map(lambda _: P(AXIS), st)

    @functools.cached_property
    def _update_body(self):
        """The per-rank update of one chunk's shards (shard_map over ``data``): each rank updates
        its slice; stages 1/2 all-gather the new compute params."""
        sspec = self._state_specs

        def local(grad, master, state, grad_sq, c, old_params, inv_scale):
            del old_params
            own = jnp.sum(jnp.square(grad.astype(jnp.float32)))
            state = jax.tree.map(lambda a: a[0], state)
            o = optim.update_chunk(self.tx, grad, master, state, jnp.sum(grad_sq), own, self.compute_dtype,
                                   self._skip_nonfinite, inv_scale if self.loss_scaling else None)
            p = o.params if self.zero_stage == 3 else jax.lax.all_gather(o.params, AXIS, axis=0, tiled=True)
            return p, o.master, jax.tree.map(lambda a: a[None], o.opt_state)

        return jax.shard_map(local, mesh=self.mesh,
                             in_specs=(P(AXIS), P(AXIS), sspec, P(), P(), self._pspec, P()),
                             out_specs=(self._pspec, P(AXIS), sspec), check_vma=False)

    def _jit_updates(self, state_kind: str) -> dict:
        """``{param_kind: jitted update}`` of one chunk whose gradient, master and state shards
        live in ``state_kind`` (``P("data")``): moved to their ranks' devices (a no-op for
        ``device``), updated by :attr:`_update_body`, master and state moved back, in one program
        (``c`` traced: one compilation per param kind). Master, state and old params donated off
        the CPU."""
        sspec, body = self._state_specs, self._update_body
        d, k = self._ns(P(AXIS)), self._ns(P(AXIS), state_kind)
        ssh_d = jax.tree.map(lambda sp: self._ns(sp), sspec)
        ssh_k = jax.tree.map(lambda sp: self._ns(sp, state_kind), sspec)
        donate = (1, 2, 5) if self._donates else ()
        moved = state_kind != DEVICE

        def make(pk):
            psh = self._ns(self._pspec, pk)

            def upd(grad, master, state, grad_sq, c, old_params, inv_scale):
                if moved:
                    grad, master = jax.device_put(grad, d), jax.device_put(master, d)
                    state = jax.device_put(state, ssh_d)
                if pk != DEVICE:
                    old_params = jax.device_put(old_params, self._ns(self._pspec))
                p, m, st = body(grad, master, state, grad_sq, c, old_params, inv_scale)
                if moved:
                    m, st = jax.device_put(m, k), jax.device_put(st, ssh_k)
                return (jax.device_put(p, psh) if pk != DEVICE else p), m, st

            return jax.jit(upd, in_shardings=(k, k, ssh_k, self._ns(P()), self._ns(P()), psh, self._ns(P())),
                           out_shardings=(psh, k, ssh_k), donate_argnums=donate, keep_unused=True)

        return {pk: make(pk) for pk in set(self.placement.param_kinds)}

    @functools.cached_property
    def jit_update_device(self):
        """``{param_kind: jitted update}`` of one device-state chunk's shards (:meth:`_jit_updates`)."""
        return self._jit_updates(DEVICE)

    @functools.cached_property
    def jit_update_streamed(self):
        """``{param_kind: jitted update}`` of one streamed chunk: shards kept in pinned host
        memory, updated on their ranks' devices (PatrickStar's device-side update of a host
        chunk, per rank; :meth:`_jit_updates`)."""
        return self._jit_updates(PINNED_HOST)

    def _host_update(self, state: TrainState, grads: dict, grad_scale):
        """Per rank and chunk: the numba kernel on the rank's gradient shard, master slice and
        state, writing the new compute params of that slice in place (host-update thread)."""
        import time

        from chunkjax import host_update as hu
        if callable(grad_scale):
            grad_scale = grad_scale()
        if grad_scale is None:  # a skipped step (non-finite gradients): nothing changes
            return
        spent = self.__dict__.setdefault("_host_update_times", [])
        bf16 = self.compute_dtype == jnp.bfloat16
        for c, g in grads.items():
            if isinstance(g, jax.Array):
                g.block_until_ready()
                shards = {self._rank_of(sh.index): sh.data for sh in g.addressable_shards}
            else:  # a chunk no stage reads: zeros
                shards = {r: g[self._rank_slice(r)] for r in range(self.n_ranks)}
            t0 = time.perf_counter()
            p_arr = state.params[c]
            for r, g_r in shards.items():
                g_np = np.asarray(g_r)
                outs = self._param_views(p_arr, r)
                master, st = state.master[c][r], state.opt_state[c][r]
                if bf16:
                    hu.host_update_(self.host_optimizer, st, g_np.view(np.uint16), master, outs[0], grad_scale)
                else:
                    hu.host_update_(self.host_optimizer, st, g_np.astype(np.float32, copy=False), master, None,
                                    grad_scale)
                    np.copyto(outs[0], master.astype(self.compute_dtype).view(outs[0].dtype))
                for o in outs[1:]:  # stages 1/2: the other replicas get the same slice
                    np.copyto(o, outs[0])
            spent.append(time.perf_counter() - t0)

    def _rank_of(self, index) -> int:
        start = index[0].start or 0
        return start // self.shard_size

    def _param_views(self, p_arr, r: int) -> list:
        """Writable views of rank ``r``'s slice of the compute params: stage 3, the rank's shard;
        stages 1/2, that slice of every local replica (first one first)."""
        from chunkjax import host_update as hu
        dt = np.uint16 if self.compute_dtype == jnp.bfloat16 else np.dtype(self.compute_dtype)
        if self.zero_stage == 3:
            return [hu.writable_view(sh.data, dt) for sh in p_arr.addressable_shards if self._rank_of(sh.index) == r]
        return [hu.writable_view(sh.data, dt)[self._rank_slice(r)] for sh in p_arr.addressable_shards]

    # ---- state ---------------------------------------------------------------------------------
    def __call__(self, state: TrainState, batch, loss_scale=None) -> tuple[TrainState, dict]:
        """One training step. batch: int (B, T+1), ``B`` a multiple of ``N * micro_batches``;
        see :meth:`chunkjax.runtime.ChunkedStep.__call__` (micro-batches, ``nonfinite="skip"``
        and fp16 loss scaling work as there: the skip decision and the clipping use the global
        norm over every rank's shard).

        Raises:
          ValueError: the batch (or each micro-batch) does not split over the ranks.
        """
        rows = jax.tree.leaves(batch)[0].shape[0]
        if rows % (self.n_ranks * self.micro_batches):
            raise ValueError(f"batch of {rows} rows does not split over {self.n_ranks} ranks x {self.micro_batches} "
                             f"micro-batches: use a multiple of {self.n_ranks * self.micro_batches}")
        return super().__call__(state, jax.device_put(batch, self._batch_sharding), loss_scale)

    def _grad_put_sharding(self, c: int):
        return self._ns(P(AXIS), self.placement.grad_kind(c))

    def init(self, params) -> TrainState:
        """Chunk the initial params (pytree, or ``leaf_init(i)`` callable as
        :meth:`chunkjax.runtime.ChunkedStep.init`) into a sharded :class:`TrainState`."""
        lay = self.layout
        leaf_at = params if callable(params) else (lambda i, _l=lay.treedef.flatten_up_to(params): _l[i])
        sspec = self._state_specs
        init_state = jax.jit(jax.shard_map(
            lambda m: jax.tree.map(lambda a: a[None], optim.init_chunk_state(self.tx, m)),
            mesh=self.mesh, in_specs=P(AXIS), out_specs=sspec, check_vma=False),
            out_shardings=jax.tree.map(lambda sp: self._ns(sp), sspec))
        host = set(self.host_chunks)
        if host:
            self._warm_host_kernel()
        ps, ms, os_ = [], [], []
        for c in range(lay.n_chunks):
            buf = np.zeros((lay.chunk_size,), np.float32)
            for i, s in enumerate(lay.slots):
                if s.chunk == c:
                    buf[s.offset:s.offset + s.size] = np.asarray(leaf_at(i), np.float32).ravel()
            if c in host:
                ms.append(tuple(buf[self._rank_slice(r)].copy() for r in range(self.n_ranks)))
                os_.append(tuple(self.host_optimizer.host_state(self.shard_size) for _ in range(self.n_ranks)))
            else:
                m_dev = jax.device_put(buf, self._ns(P(AXIS)))
                st = init_state(m_dev)
                if self.schedule.update_locations[c] == "streamed":  # kept in pinned host memory
                    m_dev = jax.device_put(m_dev, self._ns(P(AXIS), PINNED_HOST))
                    st = jax.tree.map(lambda a: jax.device_put(a, self._ns(a.sharding.spec, PINNED_HOST)), st)
                os_.append(st)
                ms.append(m_dev)
            ps.append(jax.device_put(buf.astype(self.compute_dtype), self._param_shardings[c]))
        jax.block_until_ready((ps, [m for m in ms if isinstance(m, jax.Array)]))
        return TrainState(tuple(ps), tuple(ms), tuple(os_))

    def master_params(self, state: TrainState):
        """The float32 master params as a pytree of numpy arrays."""
        self.wait()
        whole = [np.concatenate(m) if isinstance(m, tuple) else np.asarray(m) for m in state.master]
        return self.layout.unpack(whole)

    def eval_loss(self, state, batch):
        raise NotImplementedError("eval_loss under ZeRO is not written yet: evaluate with "
                                  "chunkjax.zero.ZeroStep or on one device from master_params()")

    def comm_bytes_per_step(self, batch) -> dict[str, int]:
        """Bytes one rank sends per step by collective, for ring algorithms (NCCL's for large
        messages): an all-gather or reduce-scatter of a C-byte chunk moves ``(N-1)/N * C`` per
        rank, an all-reduce ``2 (N-1)/N * C``; scalar reductions are left out.

        Stage 3 gathers a fetched chunk once per fetch and a device-resident chunk at every
        moment that reads it; stages 1/2 gather each device- or streamed-updated chunk's new params once
        (host-updated slices are written into every local replica on the host). Returns
        ``{"all_gather", "reduce_scatter", "all_reduce", "total"}`` in bytes.
        """
        n, lay = self.n_ranks, self.layout
        cbytes = lay.chunk_size * np.dtype(self.compute_dtype).itemsize
        part = lambda k: (k * (n - 1) * cbytes) // n  # noqa: E731
        if self.zero_stage == 3:
            gathers = 0
            for t in range(len(self.moments)):
                reads = self._reads_at(batch, t)
                gathers += sum(1 for c in reads if self.placement.param_kinds[c] == DEVICE)
                gathers += len(self.schedule.fetch[t])
        else:
            gathers = len(self._device_chunks) + len(self._streamed_chunks)
        graded = len(self.first_reader)
        out = {"all_gather": part(gathers), "reduce_scatter": part(graded) if self.zero_stage != 1 else 0,
               "all_reduce": 2 * part(graded) if self.zero_stage == 1 else 0}
        out["total"] = sum(out.values())
        return out

    def device_bytes(self, state: TrainState) -> dict[str, dict[Any, int]]:
        """Bytes each device holds of the sharded arrays, from ``addressable_shards``:
        ``{"params"|"master"|"opt_state": {device: bytes}}`` (host-updated numpy slices are not
        device memory and are not counted)."""
        out = {}
        for name, tree in (("params", state.params), ("master", state.master), ("opt_state", state.opt_state)):
            per = {d: 0 for d in self.mesh.devices.flat}
            for a in jax.tree.leaves(tree):
                if isinstance(a, jax.Array):
                    for sh in a.addressable_shards:
                        per[sh.device] += sh.data.size * sh.data.dtype.itemsize
            out[name] = per
        return out


def make_zero_scheduled_step(stages, layout, schedule, mesh: Mesh, *, zero_stage: int = 3, host_optimizer=None,
                             tx=None, compute_dtype=jnp.bfloat16, micro_batches: int = 1, nonfinite: str = "ignore",
                             loss_scaling: bool = False) -> ZeroScheduledStep:
    """Build a :class:`ZeroScheduledStep` (nothing is compiled until first use).

    Args:
      stages: the model's stages.
      layout: a layout whose ``chunk_size`` is a multiple of the mesh size
        (:func:`chunkjax.zero.build_zero_layout`).
      schedule: a :class:`chunkjax.schedule.Schedule` (device and host update locations).
      mesh: 1-D ``"data"`` mesh (:func:`chunkjax.zero.data_mesh`).
      zero_stage: 1, 2 or 3.
      host_optimizer: the host kernel spec for host-updated chunks (its ``optax()`` serves the
        device chunks when ``tx`` is omitted).
      tx: optax transformation for device-updated chunks.
      compute_dtype: compute params / gradient dtype.
      micro_batches, nonfinite, loss_scaling: gradient accumulation, the non-finite-step policy
        and fp16 dynamic loss scaling, as :func:`chunkjax.runtime.make_chunked_step`.

    Raises:
      ValueError: see :class:`ZeroScheduledStep`.
    """
    if tx is None:
        if host_optimizer is None:
            raise ValueError("pass tx (an optax transformation) or host_optimizer")
        tx = host_optimizer.optax()
    return ZeroScheduledStep(tuple(stages), layout, schedule.placement, tx, jnp.dtype(compute_dtype),
                             schedule.prefetch, schedule, host_optimizer, micro_batches=micro_batches,
                             nonfinite=nonfinite, loss_scaling=loss_scaling, mesh=mesh, zero_stage=int(zero_stage))
