"""The :class:`chunkjax.ChunkedStep`'s side of the checkpoint protocol
(:class:`chunkjax.checkpoint.protocol.ChunkIO`): its chunks in the portable form and back.

A chunk of a step lives where the placement and topology put it: device or pinned-host jax
arrays with an optax state, numpy master and a ``Host*State`` for host-updated chunks, and on a
``data`` mesh ZeRO shards (every optax leaf with a leading rank axis) or one host slice and state
per rank, across processes under ``jax.distributed``. Saving gathers each chunk whole (a
collective on a mesh of several processes); restoring places each whole chunk through the
topology, every process building only its own shards. :class:`StepChunkIO` holds the protocol's
methods; :class:`chunkjax.ChunkedStep` inherits it and builds its ``TrainState`` from
:func:`restore_chunks`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import optim, portable
from chunkjax.checkpoint.protocol import CheckpointError
from chunkjax.speculate import policy_meta, resumed
from chunkjax.train_state import TrainState
from chunkjax.updaters import pinned_master, warm_host_kernel


class StepChunkIO:
    """The checkpoint protocol's methods of :class:`chunkjax.ChunkedStep` (a mixin: ``self`` is
    the step; ``state`` its :class:`chunkjax.TrainState`)."""

    def checkpoint_info(self) -> dict:
        """The optimizer, the step kind with its rank count and ZeRO stage, whether the mesh
        spans several processes (:meth:`chunkjax.checkpoint.protocol.ChunkIO.checkpoint_info`)."""
        mesh = self.mesh
        if mesh is not None:
            saved_from = {"step": "ChunkedStep", "n_ranks": self.n_ranks, "zero_stage": self.zero_stage}
        else:
            saved_from = {"step": "ChunkedStep", "n_ranks": 1}
        return {"optimizer": repr(getattr(self, "host_optimizer", None) or self.tx), "saved_from": saved_from,
                "needs_state": True,
                "multiprocess": mesh is not None and any(d.process_index != jax.process_index()
                                                         for d in mesh.devices.flat)}

    def checkpoint_state_meta(self, state) -> dict:
        """meta.json entries read from ``state`` after :meth:`wait` (the checkpoint's
        :class:`~chunkjax.checkpoint.job.SaveJob`): the speculation policy's input, the last step's
        outcome (:func:`chunkjax.speculate.policy_meta`), so that the step after a restore
        speculates as the uninterrupted run's did (:func:`resumed_state`)."""
        prev = state.speculation if state.pending is None else getattr(state.pending, "speculation", None)
        return policy_meta(prev)

    def checkpoint_arrays(self, c: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{name: ((chunk_size,), dtype)}`` of chunk ``c``'s portable arrays: compute-dtype
        params, float32 master and moments."""
        n = (self.layout.chunk_size,)
        if not self.layout.chunk_trainable[c]:  # a frozen chunk: its params in their own dtype
            return {"params": (n, np.dtype(self.layout.chunk_dtypes[c]))}
        if self.location(c) in ("host", "storage"):  # storage chunks: AdamW, the host tier's names
            names = [name for _, name in portable.host_moments()[type(self.host_optimizer.host_state(1))]]
        else:
            names = portable.moment_names(_optax_template(self))
        f32 = np.dtype(np.float32)
        return {"params": (n, np.dtype(self.compute_dtype)), "master": (n, f32), **{m: (n, f32) for m in names}}

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        """Chunk ``c`` of ``state`` whole, in the portable form, and its meta.json entry
        (:func:`chunk_portable`). With ``copy`` every array is host memory of its own: nothing
        aliases the state, which the next step may update in place or donate."""
        arrays, cm = chunk_portable(self, state, c)
        if copy:
            live = portable.numpy_leaves((state.master[c], state.opt_state[c]))
            for name, a in arrays.items():
                if not a.flags.owndata or any(np.may_share_memory(a, x) for x in live):
                    arrays[name] = np.array(a, copy=True)  # views of jax buffers, the host chunk's own arrays
                    del a
        return arrays, cm

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s (chunk_size,) float32 master params (rank slices concatenated; one process);
        a frozen chunk's params in their own dtype."""
        if not self.layout.chunk_trainable[c]:
            return _whole(state.params[c], f"chunk {c}'s params")
        m = state.master[c]
        if self.location(c) == "storage":  # read from its chunk file by its worker
            return m.read(c)[0]
        return np.concatenate(m) if isinstance(m, tuple) else np.asarray(m, np.float32)


def _optax_template(step_fn):
    """``jax.eval_shape`` of a chunk's optax state under ``step_fn.tx``."""
    return jax.eval_shape(lambda m: optim.init_chunk_state(step_fn.tx, m),
                          jax.ShapeDtypeStruct((step_fn.layout.chunk_size,), jnp.float32))


def resumed_state(step_fn, saved):
    """The :class:`chunkjax.TrainState` of ``step_fn`` restored from ``saved``
    (:func:`restore_chunks`), with the speculation policy's input the checkpoint carries
    (:func:`chunkjax.speculate.resumed`; None for a checkpoint without it)."""
    return TrainState(*restore_chunks(step_fn, saved), speculation=resumed(saved.meta))


def restore_chunks(step_fn, saved) -> tuple[tuple, tuple, tuple]:
    """``(params, master, opt_state)`` per chunk of ``step_fn``, built from ``saved`` (a
    :class:`chunkjax.checkpoint.protocol.SavedChunks` in ``step_fn.layout``) and placed where the
    step keeps them (:class:`_Placer`). Every chunk's moments are checked before any array is
    read; one chunk is read and placed at a time.

    Raises:
      CheckpointError: moments that do not fit a chunk's optimizer state (another optimizer).
    """
    place = check_moments(step_fn, saved)
    ps, ms, os_ = [], [], []
    for c in range(step_fn.layout.n_chunks):
        arrs, cm = saved.chunk(c)
        master, params = arrs.pop("master", None), arrs.pop("params")
        p, m, o = place(c, params, master, cm["count"], arrs, cm["rest"])
        ps.append(p), ms.append(m), os_.append(o)
        del arrs, master, params, p, m, o
    jax.block_until_ready([x for x in ps + ms if isinstance(x, jax.Array)])
    return tuple(ps), tuple(ms), tuple(os_)


def check_moments(step_fn, saved) -> "_Placer":
    """Check that every chunk of ``step_fn`` can take the optimizer moments ``saved`` (a
    :class:`chunkjax.checkpoint.protocol.SavedChunks`) holds for it, reading no array; returns the
    placer :func:`restore_chunks` uses.

    Raises:
      CheckpointError: one line naming the first chunk whose moments do not fit (another optimizer).
    """
    place = _Placer(step_fn)
    for c in range(step_fn.layout.n_chunks):
        place.check(c, saved.moments(c))
    return place


def chunk_portable(step_fn, state, c: int) -> tuple[dict, dict]:
    """Chunk ``c`` of a :class:`chunkjax.ChunkedStep`'s state in the portable (single-device)
    form: ``({"params", "master", moments...: (chunk_size,) numpy}, its meta.json entry)``. On a
    mesh, ZeRO shards are gathered (:func:`_zero_chunk_portable`) and host-updated chunks' per-rank
    slices concatenated in rank order.

    Raises:
      CheckpointError: step counts that differ over the ranks (of this process), or the errors of
        :func:`portable.optax_to_portable`.
    """
    if not step_fn.layout.chunk_trainable[c]:  # a frozen chunk: params only, in their own dtype
        return ({"params": _whole(state.params[c], f"chunk {c}'s params")},
                {"count": None, "moments": [], "rest": {}, "frozen": True, "saved_from": "none"})
    loc = step_fn.location(c)
    st = state.opt_state[c]
    if loc == "storage":  # master params and moments read from the chunk file by its worker
        master, m, v = state.master[c].read(c)
        return ({"params": portable.host_value(state.params[c]), "master": master, "mu": m, "nu": v},
                {"count": state.master[c].committed_step, "moments": ["mu", "nu"], "rest": {}, "saved_from": loc})
    if step_fn.mesh is not None:
        where = f"zero{step_fn.zero_stage}:{loc}"
        if loc != "host":
            arrays, cm = _zero_chunk_portable(step_fn, state, c)
            return arrays, dict(cm, saved_from=where)
        # this process's ranks (the others' slices are None under jax.distributed: gathered below)
        ports = [None if x is None else portable.host_to_portable(x) for x in st]
        counts = sorted({p[0] for p in ports if p is not None})
        if len(counts) > 1:
            raise CheckpointError(f"chunk {c}: the ranks' host optimizer step counts differ ({counts})")
        names = next(p[1] for p in ports if p is not None)
        gather = step_fn.topology.gather_slices  # a collective under jax.distributed
        moments = {n: gather(tuple(None if p is None else p[1][n] for p in ports)) for n in names}
        del ports
        arrays = {"params": _whole(state.params[c], f"chunk {c}'s params"),
                  "master": gather(state.master[c]).astype(np.float32, copy=False), **moments}
        return arrays, {"count": counts[0], "moments": sorted(moments), "rest": {}, "saved_from": where}
    if portable.is_host_state(st):
        count, moments = portable.host_to_portable(st)
        rest = {}
    else:
        count, moments, rest = portable.optax_to_portable(st, step_fn.layout.chunk_size)
    params = state.params[c]
    if c in step_fn.master_fetch_chunks:  # no compute copy: the portable params are the master's cast
        params = np.asarray(state.master[c]).astype(step_fn.compute_dtype)
    arrays = {"params": portable.host_value(params),
              "master": portable.host_value(state.master[c], np.float32), **moments}
    return arrays, {"count": count, "moments": sorted(set(portable.moment_names(st))), "rest": rest, "saved_from": loc}


def _whole(a, what: str) -> np.ndarray:
    """The whole global array ``a`` as numpy. Under ``jax.distributed`` (a mesh over several
    processes) the shards are all-gathered to every process (a collective: every process saves
    the same chunks in the same order)."""
    del what
    if not a.is_fully_addressable:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return portable.host_value(a)


def _zero_chunk_portable(step_fn, state, c: int) -> tuple[dict, dict]:
    """Chunk ``c`` (device- or stream-updated) of a ZeRO state in the single-device form: the
    sharded (chunk_size,) params and master gathered to whole numpy arrays, each rank's
    (chunk_size/N,) moment slice concatenated in rank order (rank r owns elements
    [r*chunk_size/N, (r+1)*...)).

    The per-rank step counts must agree; the per-rank moments of the rest-of-model leaf (which
    never reach a parameter update, :mod:`chunkjax.optim`) are taken from rank 0.

    Raises:
      CheckpointError: counts that differ over the ranks, a state leaf without the leading rank
        axis, or any error of :func:`portable.optax_to_portable`.
    """
    n, cs = step_fn.n_ranks, step_fn.layout.chunk_size
    st = _zero_optax_unshard(state.opt_state[c], n, c)
    count, moments, rest = portable.optax_to_portable(st, cs)
    del st
    arrays = {"params": _whole(state.params[c], f"chunk {c}'s params"),
              "master": _whole(state.master[c], f"chunk {c}'s master params").astype(np.float32, copy=False), **moments}
    return arrays, {"count": count, "moments": sorted(moments), "rest": rest}


def _zero_optax_unshard(opt_state, n_ranks: int, chunk: int):
    """A ZeRO chunk's optax state (every leaf with a leading rank axis) as the optax state of the
    whole chunk (numpy): (N,) counts -> (), (N, chunk_size/N) moments -> (chunk_size,), other
    (N,) per-rank scalars -> rank 0's."""
    def one(path, leaf):
        a = _whole(leaf, f"chunk {chunk}'s optimizer state")
        where = jax.tree_util.keystr(path)
        if a.ndim == 0 or a.shape[0] != n_ranks or a.ndim > 2:
            raise CheckpointError(f"chunk {chunk}: ZeRO optimizer state leaf {where} has shape {a.shape}, not "
                                  f"({n_ranks}, ...) with one row per rank")
        name, idx = portable.optax_leaf_role(path)
        if a.ndim == 2:
            return a.reshape(-1)
        if name == "count" and np.any(a != a[0]):
            raise CheckpointError(f"chunk {chunk}: the ranks' optimizer step counts differ ({sorted(set(a.tolist()))})")
        return a[0]
    return jax.tree_util.tree_map_with_path(one, opt_state)


class _Placer:
    """Places restored chunks (whole (chunk_size,) numpy arrays in the portable form) where a
    :class:`chunkjax.ChunkedStep` keeps them, through its topology: device / pinned host jax
    arrays (ZeRO shards on a mesh, each process building only its own shards), or numpy master
    and ``Host*State`` for host-updated chunks (on a mesh one slice and state per local rank)."""

    def __init__(self, step_fn):
        self.step = step_fn
        self.template = _optax_template(step_fn)
        self.host = set(step_fn.host_chunks)
        self.disk = {c for c in range(step_fn.layout.n_chunks) if step_fn.location(c) == "storage"}
        self.host_cls = type(step_fn.host_optimizer.host_state(1)) if self.host or self.disk else None
        if self.host:  # as init does: numba must not compile while XLA compiles
            warm_host_kernel(step_fn.host_optimizer, step_fn.compute_dtype)

    def check(self, c: int, moments) -> None:
        """Raise CheckpointError if chunk ``c`` cannot take these moment names."""
        if not self.step.layout.chunk_trainable[c]:
            if moments:
                raise CheckpointError(f"chunk {c} is frozen here but holds optimizer moments {sorted(moments)}")
        elif c in self.host or c in self.disk:
            portable.check_host_moments(self.host_cls, moments, c)
        else:
            portable.check_optax_moments(self.template, moments, c)

    def __call__(self, c, params, master, count, moments, rest):
        """(params, master, opt_state) of chunk ``c``, placed."""
        step, cdt = self.step, np.dtype(self.step.compute_dtype)
        topo, pl = step.topology, step.placement
        if not step.layout.chunk_trainable[c]:  # frozen: its params in their own dtype, nothing else
            cdt = np.dtype(step.layout.chunk_dtypes[c])
            p = topo.put(np.require(params, cdt, ["C", "W", "O"]), topo.param_sharding(pl.param_kinds[c]))
            return p, None, None
        p = topo.put(np.require(params, cdt, ["C", "W", "O"]), topo.param_sharding(pl.param_kinds[c]))
        if c in self.disk:  # streamed into the storage directories (chunks in id order), committed at ``count``
            m, o = step.updaters["storage"].init(master, c, moments=(moments["mu"], moments["nu"]), count=count or 0)
            return p, m, o
        if c in self.host:
            if step.mesh is None:
                if c in step.master_fetch_chunks:  # the master params are the pinned params
                    del p
                    p, master = pinned_master(topo, master)
                return p, master, portable.portable_to_host(self.host_cls, count, moments, c)
            local = set(topo.local_ranks())
            sl = [topo.rank_slice(r, step.layout.chunk_size) if r in local else None for r in range(step.n_ranks)]
            return (p, tuple(None if x is None else master[x].copy() for x in sl),
                    tuple(None if x is None else portable.portable_to_host(
                        self.host_cls, count, {k: v[x] for k, v in moments.items()}, c) for x in sl))
        sk = pl.state_kinds[c]
        opt = portable.portable_to_optax(self.template, count, moments, rest, c)
        if step.mesh is not None:  # every leaf with a leading rank axis (chunkjax.topology)
            n = step.n_ranks
            opt = jax.tree.map(lambda a: a.reshape(n, -1) if a.ndim == 1 else np.full((n,), a, a.dtype), opt)
        ssh = topo.state_shardings(opt, sk)
        return (p, topo.put(master, topo.shard_sharding(sk)),
                jax.tree.map(lambda a, sh: topo.put(np.asarray(a), sh), opt, ssh))
