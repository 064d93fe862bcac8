"""Chunked, offloaded optimizer state for an ordinary Flax (NNX or linen) training loop.

The full chunked step (:func:`chunkjax.make_chunked_step`) needs the model cut into
:class:`~chunkjax.Stage` s. Most users have an ordinary loop instead: a jitted function computes
the loss and the gradients of the whole model, and an optax optimizer applies them. For that loop
this module offloads what dominates the memory of mixed-precision Adam training, the float32
master params and the optimizer state (12 of the 16 bytes per parameter of Adam with bf16
params; PatrickStar, arXiv 2108.05818, section 3), in the ZeRO-Offload manner:

* the params pytree is flattened into chunks (:func:`chunkjax.build_layout`); every chunk keeps
  its float32 master params and its own optax state (:func:`chunkjax.optim.init_chunk_state`);
* chunks are kept on the device in layout order while the predicted device bytes fit
  ``device_budget`` (:func:`chunkjax.plan_schedule`'s ``"optimizer_only"`` policy); the others
  keep theirs in ``pinned_host`` memory and are *streamed*: one chunk at a time goes to the
  device, is updated there and goes back
  (the step's streamed update, :func:`chunkjax.updaters.streamed_updater`);
* :meth:`ChunkedOptimizer.update` applies the user's optax transformation chunk by chunk
  (:func:`chunkjax.optim.update_chunk`, which reproduces ``clip_by_global_norm`` of the incoming
  gradients exactly by handing every chunk the global norm) and returns the new params pytree
  in the params' own dtypes.

What is *not* offloaded: the params and gradients pytrees that the training loop itself holds on
the device (the forward/backward is the user's, unchanged). For models whose params do not fit
on the device, use the staged step.

On the CPU backend ``pinned_host`` and ``device`` are the same memory; placement is only proven
on a GPU (:mod:`chunkjax.memory`). One device: everything is placed on ``jax.devices()[0]``
(for data-parallel training use :func:`chunkjax.make_chunked_step` with ``mesh=``).

Changed lines of an NNX loop::

    opt = chunkjax.NnxOptimizer(model, optax.adamw(1e-3), device_budget="2GiB")  # was nnx.Optimizer
    grads = grad_fn(model, batch)     # jitted: nnx.value_and_grad, without opt.update inside
    opt.update(model, grads)          # outside jit: chunk by chunk

and of a linen loop::

    opt = chunkjax.ChunkedOptimizer(params, optax.adamw(1e-3), device_budget="2GiB")
    grads = grad_fn(params, batch)    # jitted
    params = opt.update(grads)        # replaces tx.update + optax.apply_updates
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax import optim, portable
from chunkjax.layout import ChunkLayout, LeafSlot, Piece, build_layout
from chunkjax.memory import DEVICE, sharding
from chunkjax.plan import parse_bytes, plan_schedule
from chunkjax.predict import chunk_bytes

#: Default of ``min_chunks``: the chunk-size search prefers sizes giving at least this many chunks
#: (finer chunks let more of the state stay on the device under a budget).
DEFAULT_MIN_CHUNKS = 8

_MSG_NOT_FLOAT = ("leaf {path!r} has dtype {dtype}: ChunkedOptimizer trains floating-point leaves only; "
                  "pass only the trainable params (nnx.state(model, nnx.Param), or variables['params'] of linen)")
_MSG_STRUCTURE = "grads do not have the params' structure ({n} leaves expected): {err}"


def _budget_bytes(device_budget: int | str) -> int:
    if isinstance(device_budget, bool) or not isinstance(device_budget, (int, str)):
        raise TypeError(f"device_budget must be a byte count (int) or a string such as '2GiB', "
                        f"got {type(device_budget).__name__}")
    if isinstance(device_budget, int):
        if device_budget < 0:
            raise ValueError(f"device_budget must be >= 0 bytes, got {device_budget}")
        return device_budget
    return parse_bytes(device_budget)


def _sub_layout(layout: ChunkLayout, c: int) -> tuple[ChunkLayout, tuple[tuple[int, Piece], ...]]:
    """Chunk ``c`` as a one-chunk layout over the list of its leaf pieces (offset order), and the
    ``(slot index, piece)`` pairs (:meth:`ChunkLayout.chunk_pieces`). A piece holding a whole leaf
    keeps the leaf's shape; a piece of a leaf spanning chunks is a flat ``(size,)`` leaf. Paths are
    dropped so that chunks holding the same shapes at the same offsets (e.g. repeated blocks)
    compare equal and share compiled programs."""
    pieces = layout.chunk_pieces(c)
    slots = tuple(LeafSlot(path=str(k), pieces=(Piece(0, p.offset, 0, p.size),),
                           shape=layout.slots[i].shape if _whole(layout, i, p) else (p.size,),
                           dtype=layout.slots[i].dtype) for k, (i, p) in enumerate(pieces))
    sub = ChunkLayout(treedef=jax.tree.structure([0] * len(pieces)), slots=slots, chunk_size=layout.chunk_size,
                      chunk_dtypes=(layout.chunk_dtypes[c],), chunk_trainable=(layout.chunk_trainable[c],))
    return sub, pieces


def _whole(layout: ChunkLayout, i: int, p: Piece) -> bool:
    return p.size == layout.slots[i].size


def _piece_of(layout: ChunkLayout, leaves, i: int, p: Piece):
    """Leaf ``i`` of ``leaves`` as :func:`_sub_layout` takes it: whole, or its flat piece ``p``."""
    return leaves[i] if _whole(layout, i, p) else jax.lax.slice(jnp.ravel(leaves[i]), (p.leaf_offset,),
                                                                 (p.leaf_offset + p.size,))


@dataclasses.dataclass(frozen=True)
class _ChunkProgram:
    """The update of one chunk shape (one :func:`_sub_layout`) in one state memory kind."""

    sub: ChunkLayout
    state_kind: str
    tx: Any

    @property
    def jitted(self):
        dev = sharding(DEVICE)
        sk = sharding(self.state_kind)
        sub, tx = self.sub, self.tx
        dt = sub.chunk_dtypes[0]

        def upd(grad_leaves, master, state, grad_sq, c):
            g = sub.pack(list(grad_leaves), dtype=optim.MASTER_DTYPE)[0]
            master, state = jax.device_put((master, state), dev)  # a no-op for device chunks
            o = optim.update_chunk(tx, g, master, state, jnp.sum(grad_sq), grad_sq[c], dt)
            return tuple(sub.unpack([o.params])), jax.device_put(o.master, sk), jax.device_put(o.opt_state, sk)

        return jax.jit(upd, in_shardings=(dev, sk, sk, dev, dev), out_shardings=(dev, sk, sk), donate_argnums=(1, 2))


class ChunkedOptimizer:
    """Any (elementwise) optax transformation applied chunk by chunk, with float32 master params
    and optimizer state kept per chunk on the device or in pinned host memory.

    Args:
      params: the trainable params pytree (linen ``variables["params"]``, an ``nnx.State``, any
        pytree of floating-point arrays, any shapes; bf16 / f16 / f32 leaves). Its values
        initialise the float32 master params; the object keeps no reference to it.
      tx: an optax ``GradientTransformation``. Elementwise ones (adam, adamw without a mask, lion,
        sgd, chains of them, schedules, ``clip_by_global_norm`` of the incoming gradients) give
        the same result as on the whole pytree; see ``check_tx``.
      device_budget: device bytes the optimizer may use (int bytes, or ``"512MiB"``, ``"2GiB"``,
        ``"1e9"``: :func:`chunkjax.parse_bytes`). Counted: the master params (4 bytes/element) and
        optax state of device-resident chunks, plus the working set of one chunk's update (its
        float32 gradient, master and state, new params, two float32 temporaries). Not counted:
        the params and gradients pytrees of the training loop. Chunks stay on the device in
        layout order while the prediction fits; the rest go to pinned host memory.
      chunk_size: elements per chunk (a leaf larger than it spans chunks); ``None`` searches
        the size from ``min_chunks`` and a padding bound (:func:`chunkjax.search_chunk_size`).
      min_chunks: with ``chunk_size=None``, prefer sizes giving at least this many chunks.
      order: leaf paths in the order chunks should be filled (default: tree order), e.g. from
        :func:`chunkjax.first_use_order`; earlier chunks are kept on the device first.
      check_tx: run a 3-step probe on a tiny two-leaf tree comparing ``tx`` chunk by chunk with
        ``tx`` on the whole tree; it catches per-leaf transforms (lamb, lars, masks by leaf name
        or ndim, adaptive_grad_clip, clipping of transformed updates). A probe, not a proof.

    Attributes:
      layout: the :class:`chunkjax.ChunkLayout` of ``params``.
      placement: a :class:`chunkjax.Placement`; ``state_kinds[c]`` is where chunk ``c``'s master
        params and optax state live (``"device"`` or ``"pinned_host"``).
      device_state_bytes: predicted device bytes of resident master params + optax state.
      working_bytes: predicted device bytes of one chunk's update (transient).
      host_state_bytes: bytes of master params + optax state in pinned host memory.
      step: number of :meth:`update` calls done.

    Raises:
      TypeError: a non-floating leaf (the message names its path), ``device_budget`` of another type.
      ValueError: ``device_budget`` unparsable or negative; ``chunk_size`` below 1; ``tx`` fails
        the elementwise probe (the message lists what is not supported).
      chunkjax.PlanError: the budget is below one chunk's update working set (the message gives
        the smallest budget that works; ``.min_budget_bytes``).
      chunkjax.HostMemoryError: the offloaded optimizer state (plus, on the CPU, the device's
        share) does not fit the host's available memory; nothing has been allocated.
    """

    def __init__(self, params, tx: optax.GradientTransformation, *, device_budget: int | str,
                 chunk_size: int | None = None, min_chunks: int = DEFAULT_MIN_CHUNKS,
                 order: list[str] | None = None, check_tx: bool = True):
        budget = _budget_bytes(device_budget)
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"tx must be an optax.GradientTransformation, got {type(tx).__name__}")
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        for p, x in flat:
            dt = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
            if not jnp.issubdtype(dt, jnp.floating):
                raise TypeError(_MSG_NOT_FLOAT.format(path=jax.tree_util.keystr(p, simple=True, separator="/"),
                                                      dtype=dt))
        if check_tx:
            optim.check_elementwise(tx)
        self.tx = tx
        self.layout = build_layout(params, chunk_size, order, min_chunks=min_chunks)
        lay = self.layout
        # the drop-in optimizer's placement (plan_schedule's "optimizer_only" policy): the state of
        # the first chunks on the device while it fits next to one chunk's update, the rest streamed
        widest = max(lay.chunk_dtypes, key=lambda d: np.dtype(d).itemsize)
        cb = chunk_bytes(lay, widest, optim.state_bytes_per_chunk(tx, lay.chunk_size))
        plan = plan_schedule(lay, (), cb, budget, policy="optimizer_only")
        self._state_bytes = cb.state
        self.working_bytes = int(plan.predicted.peak_device_bytes - plan.predicted.device_model_bytes)
        self.placement = plan.placement
        kinds = self.placement.state_kinds
        self.device_state_bytes = int(plan.predicted.device_model_bytes)
        self.host_state_bytes = int(plan.predicted.host_model_bytes)
        # issue 21: refuse before allocating when host memory cannot hold the offloaded state (on
        # the CPU the device's share is host memory too)
        from chunkjax.host_memory import check_host_need, process_bytes
        on_cpu = jax.default_backend() == "cpu"
        need = {"pinned_host_bytes": self.host_state_bytes, "pageable_bytes": 0,
                "device_on_host_bytes": self.device_state_bytes if on_cpu else 0,
                "process_bytes": process_bytes(lay)}
        need["need_bytes"] = sum(need.values())
        check_host_need(need, "the optimizer state", jax.default_backend())
        self.step = 0
        subs = [_sub_layout(lay, c) for c in range(lay.n_chunks)]
        self._pieces = [pieces for _, pieces in subs]
        self._programs = {}
        for c, (sub, _) in enumerate(subs):
            key = (sub, kinds[c])
            if key not in self._programs:
                self._programs[key] = _ChunkProgram(sub, kinds[c], tx).jitted
        self._program_of = [self._programs[(sub, kinds[c])] for c, (sub, _) in enumerate(subs)]
        # master params and state, one chunk at a time (the device holds one chunk of temporaries)
        leaves = lay.treedef.flatten_up_to(params)
        init = jax.jit(lambda m: optim.init_chunk_state(tx, m))
        masters, states = [], []
        for c in range(lay.n_chunks):
            m = jax.device_put(lay.pack_chunk(c, leaves, dtype=optim.MASTER_DTYPE), sharding(DEVICE))
            sk = sharding(kinds[c])
            states.append(jax.device_put(init(m), sk))
            masters.append(jax.device_put(m, sk))
            del m
        self._master, self._opt_state = masters, states
        self._sq = jax.jit(self._grad_sq)

    # ---- the update ------------------------------------------------------------------------------
    def _grad_sq(self, grad_leaves):
        """(per chunk the () f32 squared norm of its gradient pieces, ``{(chunk, k): flat piece}``
        of the leaves spanning chunks)."""
        lay = self.layout
        split = {(c, k): _piece_of(lay, grad_leaves, i, p) for c, pieces in enumerate(self._pieces)
                 for k, (i, p) in enumerate(pieces) if not _whole(lay, i, p)}
        sq = [sum((jnp.sum(jnp.square(split.get((c, k), grad_leaves[i]).astype(jnp.float32)))
                   for k, (i, _) in enumerate(pieces)), jnp.zeros((), jnp.float32))
              for c, pieces in enumerate(self._pieces)]
        return jnp.stack(sq), split

    def update(self, grads):
        """One optimizer step. Call it outside ``jax.jit`` (it dispatches one jitted program per chunk).

        Args:
          grads: gradients with the params' pytree structure and leaf shapes (any float dtype;
            the update computes in float32), e.g. from ``jax.grad`` / ``nnx.grad`` of a loss.

        Returns:
          the new params pytree (the params' structure; each leaf in its original dtype, on the
          device), rounded from the float32 master params.

        Raises:
          ValueError: ``grads`` has another structure or leaf shapes (the message says which).
        """
        lay = self.layout
        try:
            leaves = lay.treedef.flatten_up_to(grads)
        except (ValueError, TypeError) as e:
            raise ValueError(_MSG_STRUCTURE.format(n=len(lay.slots), err=e)) from e
        for s, g in zip(lay.slots, leaves):
            if tuple(np.shape(g)) != s.shape:
                raise ValueError(f"gradient of {s.path!r} has shape {tuple(np.shape(g))}, the params' is {s.shape}")
        grad_sq, split = self._sq(leaves)
        out: list[Any] = [[] for _ in lay.slots]
        for c in range(lay.n_chunks):
            parts = tuple(split.get((c, k), leaves[i]) for k, (i, _) in enumerate(self._pieces[c]))
            new, self._master[c], self._opt_state[c] = self._program_of[c](
                parts, self._master[c], self._opt_state[c], grad_sq, jnp.asarray(c, jnp.int32))
            for (i, _), x in zip(self._pieces[c], new):
                out[i].append(x)
        self.step += 1  # a leaf spanning chunks: its pieces joined (they come in leaf order)
        return lay.treedef.unflatten([x[0] if len(x) == 1 else jnp.concatenate(x).reshape(s.shape)
                                      for x, s in zip(out, lay.slots)])

    # ---- state -----------------------------------------------------------------------------------
    def master_params(self):
        """The float32 master params as a pytree with the params' structure (on the device)."""
        dev = sharding(DEVICE)
        return self.layout.unpack([jax.device_put(m, dev) for m in self._master])

    @property
    def opt_state(self) -> tuple:
        """Per chunk, the chunk's optax state (``tx.init([master_chunk, rest_leaf])``), in its memory kind."""
        return tuple(self._opt_state)

    # ---- checkpoints: chunkjax.checkpoint.protocol.ChunkIO (the optimizer keeps its own state) ----
    @property
    def compute_dtype(self) -> np.dtype:
        """dtype of the params a checkpoint saves per chunk (the chunks' dtype; float32 if they differ)."""
        dts = {np.dtype(d) for d in self.layout.chunk_dtypes}
        return dts.pop() if len(dts) == 1 else np.dtype(np.float32)

    def wait(self, state=None) -> None:
        """Block until the dispatched updates are done (``state`` is ignored: None)."""
        del state
        jax.block_until_ready((self._master, self._opt_state))

    def checkpoint_info(self) -> dict:
        """The optax transformation, ``saved_from`` and the number of updates done (``optimizer_steps``)."""
        return {"optimizer": repr(self.tx), "saved_from": {"step": type(self).__name__, "n_ranks": 1},
                "multiprocess": False, "meta": {"optimizer_steps": self.step}}

    def checkpoint_arrays(self, c: int) -> dict:
        """``{name: ((chunk_size,), dtype)}``: params (compute dtype), float32 master and moments."""
        n, f32 = (self.layout.chunk_size,), np.dtype(np.float32)
        moments = portable.moment_names(self._opt_state[c])
        return {"params": (n, self.compute_dtype), "master": (n, f32), **{m: (n, f32) for m in moments}}

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        """Chunk ``c``'s portable arrays (params = the master cast to the compute dtype) and its
        meta.json entry. Raises CheckpointError for a transformation that is not elementwise."""
        del state
        count, moments, rest = portable.optax_to_portable(self._opt_state[c], self.layout.chunk_size)
        master = portable.host_value(self._master[c], np.float32)
        arrays = {"params": master.astype(self.compute_dtype), "master": master, **moments}
        if copy:  # np.asarray of a jax array may be a view of its buffer, which the next update donates
            arrays = {k: a if a.flags.owndata else np.array(a, copy=True) for k, a in arrays.items()}
        return arrays, {"count": count, "moments": sorted(moments), "rest": rest,
                        "saved_from": self.placement.state_kinds[c]}

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s (chunk_size,) float32 master params."""
        del state
        return np.asarray(self._master[c], np.float32)

    def checkpoint_restore(self, saved):
        """Replace the master params, optax state and step count with a checkpoint's (each chunk
        placed in its state memory kind) and return the new params pytree (params' structure and
        dtypes, on the device: what :meth:`update` returns). Raises CheckpointError for another
        optimizer (moments)."""
        lay = self.layout
        template = jax.eval_shape(lambda m: optim.init_chunk_state(self.tx, m),
                                  jax.ShapeDtypeStruct((lay.chunk_size,), jnp.float32))
        for c in range(lay.n_chunks):
            portable.check_optax_moments(template, saved.moments(c), c)
        masters, states, params, dev = [], [], [], sharding(DEVICE)
        for c in range(lay.n_chunks):
            arrs, cm = saved.chunk(c)
            master = arrs.pop("master")
            arrs.pop("params", None)
            opt = portable.portable_to_optax(template, cm["count"], arrs, cm["rest"], c)
            sk = sharding(self.placement.state_kinds[c])
            params.append(jax.device_put(master.astype(lay.chunk_dtypes[c]), dev))  # own buffer: master is donated
            masters.append(jax.device_put(master, sk))
            states.append(jax.device_put(opt, sk))
            count = cm["count"]
            del arrs, master, opt
        self._master, self._opt_state = masters, states
        self.step = int(saved.meta.get("optimizer_steps", count or 0))
        return lay.unpack(params)

    def summary(self) -> str:
        """One line: chunks, where their state lives, predicted bytes."""
        n_dev = self.placement.state_kinds.count(DEVICE)
        return (f"ChunkedOptimizer: {self.layout.n_chunks} chunks x {self.layout.chunk_size} elements; "
                f"state of {n_dev} on the device ({self.device_state_bytes / 2**20:.2f} MiB), "
                f"{self.layout.n_chunks - n_dev} in pinned host memory ({self.host_state_bytes / 2**20:.2f} MiB); "
                f"update working set {self.working_bytes / 2**20:.2f} MiB")


class NnxOptimizer:
    """Drop-in for ``nnx.Optimizer(model, tx, wrt=...)`` with the optimizer state chunked and
    offloaded (:class:`ChunkedOptimizer` over ``nnx.state(model, wrt)``).

    Unlike ``nnx.Optimizer``, :meth:`update` runs outside ``nnx.jit``: jit the function that
    returns the gradients (``nnx.value_and_grad``), then call ``opt.update(model, grads)``.

    Args:
      model: an ``nnx.Module``; its ``wrt`` state (float arrays) initialises the master params.
      tx: an optax transformation (see :class:`ChunkedOptimizer`).
      wrt: the nnx filter of trainable variables (default ``nnx.Param``); the grads passed to
        :meth:`update` must have the structure of ``nnx.state(model, wrt)`` (what ``nnx.grad``
        returns for ``wrt=nnx.Param``).
      **kwargs: ``device_budget`` (required), ``chunk_size``, ``min_chunks``, ``order``,
        ``check_tx``: as :class:`ChunkedOptimizer`.

    Attributes:
      chunked: the underlying :class:`ChunkedOptimizer`. step: updates done.

    Raises:
      as :class:`ChunkedOptimizer`.
    """

    def __init__(self, model, tx: optax.GradientTransformation, *, wrt: Any = None, **kwargs):
        from flax import nnx
        self.wrt = nnx.Param if wrt is None else wrt
        self.chunked = ChunkedOptimizer(nnx.state(model, self.wrt), tx, **kwargs)
        # commit the params to the device now: update() returns committed arrays, and a jitted
        # step that first saw uncommitted ones would compile a second time
        nnx.update(model, jax.device_put(nnx.state(model, self.wrt), sharding(DEVICE)))

    @property
    def step(self) -> int:
        return self.chunked.step

    def update(self, model, grads) -> None:
        """Apply one step to ``model`` in place (``nnx.update``). grads: ``nnx.State`` of the
        ``wrt`` variables (e.g. from ``nnx.grad(loss_fn)(model, ...)``)."""
        from flax import nnx
        nnx.update(model, self.chunked.update(grads))

    # ---- checkpoints: chunkjax.checkpoint.protocol.ChunkIO of the underlying ChunkedOptimizer ----
    @property
    def layout(self) -> ChunkLayout:
        return self.chunked.layout

    @property
    def compute_dtype(self) -> np.dtype:
        return self.chunked.compute_dtype

    def wait(self, state=None) -> None:
        self.chunked.wait(state)

    def checkpoint_info(self) -> dict:
        return self.chunked.checkpoint_info()

    def checkpoint_arrays(self, c: int) -> dict:
        return self.chunked.checkpoint_arrays(c)

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        return self.chunked.checkpoint_chunk(state, c, copy=copy)

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        return self.chunked.checkpoint_master(state, c)

    def checkpoint_restore(self, saved):
        """As :meth:`ChunkedOptimizer.checkpoint_restore`; returns the ``nnx.State`` of the ``wrt``
        variables for ``nnx.update(model, params)``."""
        return self.chunked.checkpoint_restore(saved)

    def summary(self) -> str:
        return self.chunked.summary()
