"""Chunked, offloaded optimizer state for an ordinary Flax (NNX or linen) training loop
(:class:`ChunkedOptimizer`; its NNX drop-in :class:`chunkjax.NnxOptimizer` is
:mod:`chunkjax.nnx_optimizer`).

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
  keep theirs in host memory and are updated either *streamed* (moved to the device, updated,
  moved back: a pipeline of a few chunks with both PCIe directions in flight) or, when ``tx`` is
  a host kernel spec (``chunkjax.host_update.AdamW(...)``), by the in-place *host kernel* in
  parallel with the streamed ones (:mod:`chunkjax.dropin`: the split by rate; :mod:`chunkjax.duplex`:
  both at once, one thread per PCIe direction);
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

import collections
import functools
import time
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import dropin, duplex, nnx_write, optim, portable, step_commit
from chunkjax.cost import Rates
from chunkjax.layout import ChunkLayout, build_layout
from chunkjax.memory import DEVICE, PINNED_HOST, sharding
from chunkjax.predict import chunk_bytes

#: Default of ``min_chunks``: the chunk-size search prefers sizes giving at least this many chunks
#: (finer chunks let more of the state stay on the device under a budget).
DEFAULT_MIN_CHUNKS = 8

_MSG_NOT_FLOAT = ("leaf {path!r} has dtype {dtype}: ChunkedOptimizer trains floating-point leaves only; "
                  "pass only the trainable params (variables['params'] of linen; for NnxOptimizer a wrt= filter "
                  "without it, e.g. nnx.All(nnx.Param, lambda path, x: jnp.issubdtype(x.dtype, jnp.floating)))")
_MSG_STRUCTURE = "grads do not have the params' structure: {what}"
_MSG_HOST_NEEDS_SPEC = ("host_chunks={n} needs tx given as a host kernel spec (chunkjax.host_update.AdamW / Lion / "
                        "SGDMomentum): an optax transformation runs on the device only")
_MSG_DEPTH = "pipeline_depth must be an int >= 1, got {v!r}"
_NOTE_APPLIED = ("chunkjax: Ctrl-C came during this update and was held until it ended: the optimizer took the "
                 "update, but the new params were not returned: take them from master_params() (float32) and do not "
                 "repeat the batch")
_MSG_DELETED = ("the params this optimizer returned for leaf {path!r} were deleted (donated to a jitted step?): "
                "float32 streamed chunks keep them as their master; keep them alive, or construct the optimizer "
                "with lean_streamed=False")
_MSG_TRACED = ("the optimizer's update got traced gradients: call opt.update(...) outside jax.jit / nnx.jit (it "
               "moves chunks between host and device memory and runs host threads, which a traced program cannot); "
               "jit only the function returning the gradients")


class ChunkedOptimizer:
    """Any (elementwise) optax transformation applied chunk by chunk, with float32 master params
    and optimizer state kept per chunk on the device or in pinned host memory (updated there by
    streaming through the device, or by the host kernel: :mod:`chunkjax.dropin`).

    Args:
      params: the trainable params pytree (linen ``variables["params"]``, an ``nnx.State``, any
        pytree of floating-point arrays, any shapes; bf16 / f16 / f32 leaves). Its values
        initialise the float32 master params; the object keeps a reference only to the float32
        leaves of lean streamed chunks (``lean_streamed``), as the device arrays they are.
      tx: an optax ``GradientTransformation``, or a host kernel spec
        (``chunkjax.host_update.AdamW / Lion / SGDMomentum``: its ``.optax()`` runs on the device,
        and part of the offloaded chunks is updated in place by the host kernel in parallel with
        the streamed ones). Elementwise optax transformations (adam, adamw without a mask, lion,
        sgd, chains of them, schedules, ``clip_by_global_norm`` of the incoming gradients) give
        the same result as on the whole pytree; see ``check_tx``.
      device_budget: device bytes the optimizer may use (int bytes, a whole float such as
        ``3.5e6``, ``"512MiB"``, ``"2GiB"``, ``"1e9"``, or ``"min"``: the least a plan of the chunks
        needs, with the chunks ``min_chunks`` gives; :func:`chunkjax.budget.parse_budget`, the one
        parser; ``"auto"`` is refused: the optimizer does not see the loop's device memory). Counted:
        the master params (4 bytes/element) and optax state of device-resident chunks, the
        working set of one chunk's update (its float32 gradient, master and state, new params, two
        float32 temporaries), and the master + state of ``pipeline_depth - 1`` more streamed
        chunks in flight. Not counted: the params and gradients pytrees of the training loop.
        Chunks stay on the device in layout order while the prediction fits; the rest go to
        pinned host memory.
      chunk_size: elements per chunk (a leaf larger than it spans chunks); ``None`` searches
        the size from ``min_chunks`` and a padding bound (:func:`chunkjax.search_chunk_size`).
      min_chunks: with ``chunk_size=None``, prefer sizes giving at least this many chunks (raised
        so that one chunk's update needs at most a sixth of the budget:
        :func:`chunkjax.dropin.min_chunks_for_budget`).
      order: leaf paths in the order chunks should be filled (default: tree order), e.g. from
        :func:`chunkjax.first_use_order`; earlier chunks are kept on the device first.
      check_tx: run a 3-step probe on a tiny tree comparing ``tx`` chunk by chunk with ``tx`` on
        the whole tree (:func:`chunkjax.optim.check_elementwise`); it catches per-leaf transforms
        (lamb, lars, masks by leaf name or ndim, adaptive_grad_clip, clipping of transformed
        updates). A probe, not a proof. Host kernel specs need no probe.
      host_chunks: with a host kernel spec, how many offloaded chunks the host kernel updates
        (None: split by rate, :func:`chunkjax.dropin.split_offloaded`; 0: all streamed).
      pipeline_depth: streamed chunks whose state may be on the device at once (>= 1; 3 keeps
        both PCIe directions busy). A smaller depth is used when the budget has no room for it.
      rates: :class:`chunkjax.cost.Rates` for the host/streamed split (default:
        :data:`chunkjax.dropin.DEFAULT_RATES`, the H200's with the kernel beside the transfers;
        :meth:`chunkjax.cost.Rates.from_record` reads the rates a GPU run measured).
      host_threads: numba threads of the host kernel (None: the cores less the transfer threads:
        :func:`chunkjax.dropin.host_threads_for`; ignored without a host kernel spec).
      lean_streamed: float32 streamed chunks keep no master of their own (default True): their
        master is the params this optimizer returned last (on the device; for float32 params the
        master bit for bit), so they move their optimizer state only (8 of AdamW's 12 bytes per
        param each way: :func:`chunkjax.dropin.lean_chunks`). The optimizer then keeps a
        reference to the params it returned; a step that donates them (``donate_argnums``) gets a
        one-line error at the next update: pass False for such a loop.

    Attributes:
      layout: the :class:`chunkjax.ChunkLayout` of ``params``.
      placement: a :class:`chunkjax.Placement`; ``state_kinds[c]`` is where chunk ``c``'s master
        params and optax state live (``"device"`` or ``"pinned_host"``).
      streamed_chunks, host_chunks: the offloaded chunk ids updated through the device and by the
        host kernel.
      pipeline_depth: the depth used.
      predicted_update_s: predicted seconds of the offloaded chunks' update (H200 rates by
        default; :func:`chunkjax.dropin.predict_update_s`); ``predicted_update``: the same with its
        parts (:class:`chunkjax.dropin.UpdateTime`).
      last_update: the last joined update's :class:`chunkjax.duplex.UpdateBreakdown` (predicted
        and measured seconds, bytes each way, the caller's phases of the step; None before the
        first update is joined).
      host_optimizer: the host kernel spec, or None; host_threads: its kernel's threads (or None).
      device_state_bytes: predicted device bytes of resident master params + optax state.
      working_bytes: predicted device bytes of the update's transient state (one chunk's working
        set plus the pipeline's other chunks).
      host_state_bytes: bytes of master params + optimizer state in host memory.
      step: number of :meth:`update` calls done.

    Raises:
      TypeError: a non-floating leaf (the message names its path), ``device_budget`` or ``tx`` of
        another type.
      ValueError: ``device_budget`` unparsable or not positive; ``chunk_size`` below 1; ``tx`` fails the elementwise probe (the message lists what is not
        supported); ``host_chunks`` without a host spec or out of range; ``pipeline_depth`` < 1;
        ``host_threads`` outside ``[1, NUMBA_NUM_THREADS]``.
      chunkjax.PlanError: the budget is below one chunk's update working set (the message gives
        the smallest budget that works; ``.min_budget_bytes``).
      chunkjax.HostMemoryError: the offloaded optimizer state (plus, on the CPU, the device's
        share) does not fit the host's available memory; nothing has been allocated.
    """

    def __init__(self, params, tx, *, device_budget: int | str, chunk_size: int | None = None,
                 min_chunks: int = DEFAULT_MIN_CHUNKS, order: list[str] | None = None, check_tx: bool = True,
                 host_chunks: int | None = None, pipeline_depth: int = duplex.DEFAULT_PIPELINE_DEPTH,
                 rates: Rates | None = None, host_threads: int | None = None, lean_streamed: bool = True):
        budget = dropin.budget_bytes(device_budget)
        spec = dropin.host_spec(tx)
        if spec is None and host_chunks:
            raise ValueError(_MSG_HOST_NEEDS_SPEC.format(n=host_chunks))
        if isinstance(pipeline_depth, bool) or not isinstance(pipeline_depth, int) or pipeline_depth < 1:
            raise ValueError(_MSG_DEPTH.format(v=pipeline_depth))
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        for p, x in flat:
            dt = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
            if not jnp.issubdtype(dt, jnp.floating):
                raise TypeError(_MSG_NOT_FLOAT.format(path=jax.tree_util.keystr(p, simple=True, separator="/"),
                                                      dtype=dt))
        if order is not None:
            have = {jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat}
            unknown = [k for k in order if k not in have]
            if unknown:
                raise ValueError(f"order names leaf {unknown[0]!r} that the params do not have: use leaf paths such "
                                 f"as {sorted(have)[0]!r} ({len(unknown)} unknown)")
        if spec is None:  # a mask is refused even unchecked: it would silently pick the wrong elements
            optim.refuse_masks(tx)
            if check_tx:
                optim.check_elementwise(tx)
        self.host_optimizer = spec
        self.host_threads = dropin.host_threads_for(host_threads) if spec is not None else None
        self.tx = tx = spec.optax() if spec is not None else tx
        if chunk_size is None and budget != "min":  # chunks small enough that a pipeline of a few fits a fraction of the budget
            min_chunks = max(min_chunks, dropin.min_chunks_for_budget(
                sum(int(np.prod(np.shape(x))) for _, x in flat), optim.state_bytes_per_chunk(tx, 2**10) / 2**10,
                budget))
        self.layout = build_layout(params, chunk_size, order, min_chunks=min_chunks)
        lay = self.layout
        widest = max(lay.chunk_dtypes, key=lambda d: np.dtype(d).itemsize)
        cb = chunk_bytes(lay, widest, optim.state_bytes_per_chunk(tx, lay.chunk_size))

        # host chunks' gradients travel to the host two at a time (the next one's transfer under this
        # one's kernel), or one at a time where the budget has no room for two (chunkjax.dropin.choose)
        if budget == "min":  # the least budget a plan of these chunks needs
            budget = dropin.smallest_budget(lay, cb, pipeline_depth, spec is not None, host_chunks, rates,
                                            bool(lean_streamed))
        self.device_budget = budget  # bytes (the least a plan needs for "min")
        dp = dropin.choose(lay, cb, budget, pipeline_depth, spec is not None, host_chunks, rates, bool(lean_streamed))
        self.pipeline_depth, self.streamed_chunks, self.host_chunks = dp.depth, dp.streamed, dp.host
        self._host_in_flight, self.placement = dp.in_flight, dp.placement
        self._state_bytes = cb.state
        self.working_bytes, self.device_state_bytes, self.host_state_bytes = (
            dp.working_bytes, dp.device_state_bytes, dp.host_state_bytes)
        self.predicted_update_s = dp.predicted_s
        self.lean_chunks = dropin.lean_chunks(lay, dp.streamed) if lean_streamed else frozenset()
        self.predicted_update = dropin.predict_update_parts(
            len(dp.streamed), len(dp.host), lay.chunk_size, cb.state, cb.grad, cb.params, rates or dropin.DEFAULT_RATES,
            dp.depth, dropin.streamed_bytes(lay, cb, bool(lean_streamed)))
        kinds = self.placement.state_kinds
        # issue 21: refuse before allocating when host memory cannot hold the offloaded state (on
        # the CPU the device's share is host memory too); host chunks add a pinned params buffer
        from chunkjax.host_memory import check_host_need, host_need, process_bytes
        platform = jax.default_backend()
        need = host_need(self.host_state_bytes + len(self.host_chunks) * cb.params, 0,
                         self.device_state_bytes if platform == "cpu" else 0, process_bytes(lay, platform), platform)
        check_host_need(need, "the optimizer state", platform)
        self.step = 0
        subs = [dropin.sub_layout(lay, c) for c in range(lay.n_chunks)]
        self._pieces = [pieces for _, pieces in subs]
        programs: dict = {}  # one set of compiled programs per chunk shape (repeated blocks share them)
        self._update_of, self._unpack_of = {}, {}
        for c, (sub, _) in enumerate(subs):
            key = dropin.program_key(lay, c)  # leaf offsets are arguments: chunks inside one leaf share programs
            progs = programs.setdefault(key, dropin.ChunkPrograms(sub, tx, key[1]))
            if c in self.host_chunks:
                self._unpack_of[c] = programs.setdefault(("unpack", sub), progs.unpack)
            elif c in self.lean_chunks:
                self._update_of[c] = programs.setdefault(("lean", progs), progs.update_lean)
            else:
                self._update_of[c] = programs.setdefault(("update", progs), progs.update)
        self._sends = dropin.host_sends(lay, self.host_chunks)
        self._chunk_id = [jax.device_put(dropin.chunk_ids(lay, c), sharding(DEVICE)) for c in range(lay.n_chunks)]
        # the leaves spanning chunks, joined from their pieces in one program
        spanning = [i for i, sl in enumerate(lay.slots) if len(sl.pieces) > 1]
        self._join_spanning = jax.jit(lambda pieces: [jnp.concatenate(x).reshape(lay.slots[i].shape)
                                                      for i, x in zip(spanning, pieces)])
        if self.host_chunks:  # numba must not compile while XLA compiles on another thread
            dropin.warm_host_kernels(spec, [lay.chunk_dtypes[c] for c in self.host_chunks])
        # master params and state, one chunk at a time (the device holds one chunk of temporaries)
        leaves = lay.treedef.flatten_up_to(params)
        init = jax.jit(lambda m: optim.init_chunk_state(tx, m))
        masters, states, self._host_params = [], [], {}
        for c in range(lay.n_chunks):
            m = jax.device_put(lay.pack_chunk(c, leaves, dtype=optim.MASTER_DTYPE), sharding(DEVICE))
            if c in self.host_chunks:
                master, self._host_params[c] = dropin.host_buffers(np.asarray(jax.device_put(m, sharding(PINNED_HOST))),
                                                             lay.chunk_dtypes[c])
                masters.append(master)
                states.append(spec.host_state(lay.chunk_size))
            else:
                sk = sharding(kinds[c])
                states.append(jax.device_put(init(m), sk))
                masters.append(None if c in self.lean_chunks else jax.device_put(m, sk))
            del m
        self._master, self._opt_state = masters, states
        # the lean chunks' master: the params returned last (first: the given ones, on the device)
        lean_slots = {i for c in self.lean_chunks for i, _ in self._pieces[c]}
        self._params_now = [jax.device_put(x, sharding(DEVICE)) if i in lean_slots else None
                            for i, x in enumerate(leaves)]
        self._host_tokens: dict = {}  # per host chunk, the last update's unpack token (ChunkPrograms.unpack)
        self._pending: duplex.DuplexUpdate | None = None
        self._spoiled: str | None = None  # an update failed midway (step_commit.spoiled_by): refused
        self._pending_phases: duplex.StepPhases | None = None
        self._returned_at: float | None = None  # perf_counter() of the last update's return (StepPhases)
        self.last_update: duplex.UpdateBreakdown | None = None
        self._prepare = jax.jit(functools.partial(dropin.prepare_grads, lay, self._sends))

    # ---- the update ------------------------------------------------------------------------------
    def _host_scale(self, grad_sq):
        """The host kernels' gradient factor (the clipping pair of :func:`chunkjax.kernels.clip_scale`)."""
        max_norm = self.host_optimizer.max_grad_norm
        if max_norm is None:
            return 1.0
        from chunkjax.kernels import clip_scale
        return clip_scale(max_norm, np.sqrt(np.sum(np.asarray(grad_sq, np.float32), dtype=np.float32)))

    def update(self, grads):
        """One optimizer step. Call it outside ``jax.jit``: it dispatches the device-resident
        chunks' update programs, and runs the offloaded chunks on :class:`chunkjax.duplex.DuplexUpdate`'s
        threads: the streamed chunks through the device and the host chunks on the host kernel at
        the same time, both PCIe directions in flight together. It may be called right after
        dispatching the jitted gradient step (the streamed chunks' first fetches then run during
        its backward).

        Returns after every update program is dispatched and the host chunks' new params are on
        their way to the device (the caller's next program waits for them there); the write-backs
        of the last streamed chunks may still be in flight behind the caller's next program
        (:meth:`wait` joins them; the next :meth:`update` does too). :attr:`last_update` then holds the previous update's :class:`chunkjax.duplex.UpdateBreakdown`
        (predicted and measured seconds, bytes each way).

        Args:
          grads: gradients with the params' pytree structure and leaf shapes (any float dtype;
            the update computes in float32), e.g. from ``jax.grad`` / ``nnx.grad`` of a loss.

        Returns:
          the new params pytree (the params' structure; each leaf in its original dtype, on the
          device), rounded from the float32 master params.

        Raises:
          TypeError: called inside ``jax.jit`` (traced gradients; one line).
          ValueError: ``grads`` has another structure or leaf shapes (one line naming the leaf).
        """
        hold = step_commit.SignalHold()
        with step_commit.applied_on_interrupt(hold, _NOTE_APPLIED):
            new_params = self.layout.treedef.unflatten(self._update_leaves(grads, hold))
            self._returned_at = self._pending_phases.mark("finish")
        return new_params

    def _update_leaves(self, grads, hold) -> list:
        """:meth:`update`'s new params as the layout's list of leaves (``layout.treedef`` order).
        ``hold`` (a :class:`chunkjax.step_commit.SignalHold`, released by the caller once it has
        stored them) starts as the first chunk is updated: a Ctrl-C then waits for the whole update,
        and any other exception from then on makes every later use raise PartialStepError."""
        phases = duplex.StepPhases(time.perf_counter(), self._returned_at)
        lay = self.layout
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(grads)):
            raise TypeError(_MSG_TRACED)
        try:
            leaves = lay.treedef.flatten_up_to(grads)
        except (ValueError, TypeError):
            raise ValueError(_MSG_STRUCTURE.format(what=dropin.structure_error(lay, grads))) from None
        for s, g in zip(lay.slots, leaves):
            if tuple(np.shape(g)) != s.shape:
                raise ValueError(f"gradient of {s.path!r} has shape {tuple(np.shape(g))}, the params' is {s.shape}")
        for i, x in enumerate(self._params_now):
            if x is not None and x.is_deleted():
                raise ValueError(_MSG_DELETED.format(path=lay.slots[i].path))
        self._join()
        t0 = phases.mark("setup")
        grad_sq, cut, cast = self._prepare(leaves)
        out: list[Any] = [[] for _ in lay.slots]
        of = lambda c: tuple(leaves[i] for i, _ in self._pieces[c])  # noqa: E731  (whole leaves: cut in the program)

        def update(c, *fetched):
            if c in self.lean_chunks:  # (state,): the master packed from the params returned last
                new, state = self._update_of[c](of(c), self._lean_params(c), *fetched, grad_sq, self._chunk_id[c])
                self._put(out, c, new)
                return (state,)
            new, master, state = self._update_of[c](of(c), *fetched, grad_sq, self._chunk_id[c])
            self._put(out, c, new)
            return master, state

        landed: dict = {}  # ("leaf", slot) / ("piece", (chunk, k)) -> its pinned host copy (this update)

        def send_grads(c):
            keys = [("leaf", i) for i in self._sends.whole[c]] + [("piece", (c, k)) for k in range(len(self._pieces[c]))
                                                                   if (c, k) in self._sends.cut]
            srcs = [cast.get(key[1], leaves[key[1]]) if key[0] == "leaf" else cut[key[1]] for key in keys]
            landed.update(zip(keys, jax.block_until_ready(jax.device_put(srcs, sharding(PINNED_HOST), may_alias=False))))
            sent, keep, views = [landed[k] for k in keys], [], []
            for k, (i, p) in enumerate(self._pieces[c]):
                key = ("piece", (c, k)) if (c, k) in self._sends.cut else ("leaf", i)
                keep.append(landed[key] if self._sends.last[key] != c else landed.pop(key))
                flat = np.asarray(keep[-1]).reshape(-1)
                views.append(flat if key[0] == "piece" else flat[p.leaf_offset:p.leaf_offset + p.size])
            # (the arrays moved count as its bytes; the views, kept with their buffers, are no pytree)
            return sent, types.SimpleNamespace(keep=keep, views=views)

        scale: list = []

        def kernel(c, landed_grads):
            token = self._host_tokens.pop(c, None)
            if token is not None:  # the last update's transfer out of this params buffer is done
                token.block_until_ready()
            if not scale:
                scale.append(self._host_scale(grad_sq))
            dropin.host_chunk_step(self.host_optimizer, self._opt_state[c], self._master[c], self._host_params[c],
                                   self._pieces[c], landed_grads[1].views, scale[0], self.host_threads)

        host_out, outstanding = {}, collections.deque()

        def send_params(c):
            p = jax.device_put(self._host_params[c], sharding(DEVICE), may_alias=False)
            host_out[c], self._host_tokens[c] = self._unpack_of[c](p)
            outstanding.append(self._host_tokens[c])
            while len(outstanding) >= self._host_in_flight:  # at most that many params chunks on their way
                outstanding.popleft().block_until_ready()
            return p

        run = duplex.DuplexUpdate(self.streamed_chunks, self.host_chunks, self.pipeline_depth, fetch=self._fetch,
                                  update=update, store=self._store, send_grads=send_grads, kernel=kernel,
                                  send_params=send_params, ready=grad_sq.block_until_ready)
        run.t0 = t0
        # chunks are updated in place from here (no copy kept): all of them, or the state refused. The
        # hold starts before the threads do: the kernel thread updates host chunks as soon as their
        # gradients land, and a Ctrl-C between its start and the hold left threads running (exit hung)
        hold.start()
        try:
            try:
                run.start()  # fetches first: they need no gradient
                for c, k in enumerate(self.placement.state_kinds):
                    if k == DEVICE:
                        new, self._master[c], self._opt_state[c] = self._update_of[c](
                            of(c), self._master[c], self._opt_state[c], grad_sq, self._chunk_id[c])
                        self._put(out, c, new)
            except BaseException:
                run.abort()
                raise
            phases.mark("dispatch")
            self._pending, self._pending_phases = run.run(), phases
            phases.mark("offloaded")
            for c in self.host_chunks:
                self._put(out, c, host_out.pop(c))
            self.step += 1
            # a leaf spanning chunks: its pieces joined in leaf order (the chunks update in another order)
            joined = iter(self._join_spanning([[y for _, y in sorted(x, key=lambda e: e[0])] for x in out if len(x) > 1]))
            new_leaves = [x[0][1] if len(x) == 1 else next(joined) for x in out]
            self._params_now = [None if x is None else y for x, y in zip(self._params_now, new_leaves)]
        except BaseException as e:
            self._spoiled = step_commit.spoiled_by(e)
            raise
        return new_leaves

    def _lean_params(self, c: int) -> tuple:
        """A lean chunk's master as the whole param leaves of its pieces (cut in its program)."""
        return tuple(self._params_now[i] for i, _ in self._pieces[c])

    def _master_of(self, c: int):
        """Chunk ``c``'s (chunk_size,) float32 master: its own, or a lean chunk's packed from the
        params returned last (on the device)."""
        if c not in self.lean_chunks:
            return self._master[c]
        return self.layout.pack_chunk(c, self._params_now, dtype=optim.MASTER_DTYPE)

    def _put(self, out: list, c: int, new) -> None:
        for (i, p), x in zip(self._pieces[c], new):
            out[i].append((p.leaf_offset, x))

    def _fetch(self, c: int):
        moved = (self._opt_state[c],) if c in self.lean_chunks else (self._master[c], self._opt_state[c])
        return jax.block_until_ready(jax.device_put(moved, sharding(DEVICE), may_alias=False))

    def _store(self, c: int, *updated) -> None:
        back = jax.block_until_ready(jax.device_put(updated, sharding(PINNED_HOST), may_alias=False))
        if c in self.lean_chunks:
            self._opt_state[c] = back[0]
        else:
            self._master[c], self._opt_state[c] = back

    # ---- state -----------------------------------------------------------------------------------
    def master_params(self):
        """The float32 master params as a pytree with the params' structure (on the device)."""
        self._join()
        dev = sharding(DEVICE)
        return self.layout.unpack([jax.device_put(self._master_of(c), dev) for c in range(self.layout.n_chunks)])

    @property
    def opt_state(self) -> tuple:
        """Per chunk, the chunk's optax state (``tx.init([master_chunk, rest_leaf])``) in its memory
        kind, or for a host chunk its ``Host*State`` (numpy moments)."""
        self._join()
        return tuple(self._opt_state)

    # ---- checkpoints: chunkjax.checkpoint.protocol.ChunkIO (the optimizer keeps its own state) ----
    @property
    def compute_dtype(self) -> np.dtype:
        """dtype of the params a checkpoint saves per chunk (the chunks' dtype; float32 if they differ)."""
        dts = {np.dtype(d) for d in self.layout.chunk_dtypes}
        return dts.pop() if len(dts) == 1 else np.dtype(np.float32)

    def _join(self) -> None:
        """Join the last update's streamed write-backs (the rest is joined by update()) and keep
        its :class:`chunkjax.duplex.UpdateBreakdown` in :attr:`last_update`."""
        step_commit.refuse_partial(self._spoiled, "an update failed midway")
        run, self._pending = self._pending, None
        if run is None:
            return
        try:
            run.join()
        except BaseException as e:  # write-backs lost: some streamed chunks kept the step before
            self._spoiled = step_commit.spoiled_by(e)
            raise
        self.last_update = duplex.breakdown(run, step=self.step - 1, n_device=self.placement.state_kinds.count(DEVICE),
                                            predicted=self.predicted_update, phases=self._pending_phases)

    def wait(self, state=None) -> None:
        """Block until the dispatched updates are done: the streamed write-backs joined and every
        chunk's state ready (``state`` is ignored: None)."""
        del state
        self._join()
        jax.block_until_ready([x for x in jax.tree.leaves((self._master, self._opt_state, self._host_tokens))
                               if isinstance(x, jax.Array)])

    def checkpoint_info(self) -> dict:
        """The optax transformation, ``saved_from`` and the number of updates done (``optimizer_steps``)."""
        return {"optimizer": repr(self.host_optimizer or self.tx), "saved_from": {"step": type(self).__name__, "n_ranks": 1},
                "multiprocess": False, "meta": {"optimizer_steps": self.step}}

    def checkpoint_arrays(self, c: int) -> dict:
        """``{name: ((chunk_size,), dtype)}``: params (compute dtype), float32 master and moments."""
        self._join()
        n, f32 = (self.layout.chunk_size,), np.dtype(np.float32)
        moments = portable.moment_names(self._opt_state[c])
        return {"params": (n, self.compute_dtype), "master": (n, f32), **{m: (n, f32) for m in moments}}

    def checkpoint_chunk(self, state, c: int, *, copy: bool) -> tuple[dict, dict]:
        """Chunk ``c``'s portable arrays (params = the master cast to the compute dtype) and its
        meta.json entry. Raises CheckpointError for a transformation that is not elementwise."""
        del state
        self._join()
        st = self._opt_state[c]
        if portable.is_host_state(st):  # a host chunk: its own numpy moments (copied below if asked)
            count, moments = portable.host_to_portable(st)
            rest = {}
            master = self._master[c]
        else:
            count, moments, rest = portable.optax_to_portable(st, self.layout.chunk_size)
            master = portable.host_value(self._master_of(c), np.float32)
        arrays = {"params": master.astype(self.compute_dtype), "master": master, **moments}
        if copy:  # np.asarray of a jax array may be a view of its buffer, which the next update donates;
            # a host chunk's master and moments are updated in place by the next update
            live = portable.numpy_leaves((self._master[c], st))
            arrays = {k: a if a.flags.owndata and not any(np.may_share_memory(a, x) for x in live)
                      else np.array(a, copy=True) for k, a in arrays.items()}
        return arrays, {"count": count, "moments": sorted(moments), "rest": rest,
                        "saved_from": "host" if c in self.host_chunks else self.placement.state_kinds[c]}

    def checkpoint_master(self, state, c: int) -> np.ndarray:
        """Chunk ``c``'s (chunk_size,) float32 master params."""
        del state
        self._join()
        return np.asarray(self._master_of(c), np.float32)

    def checkpoint_restore(self, saved):
        """Replace the master params, optax state and step count with a checkpoint's (each chunk
        placed in its state memory kind) and return the new params pytree (params' structure and
        dtypes, on the device: what :meth:`update` returns). Raises CheckpointError for another
        optimizer (moments)."""
        spoiled, self._spoiled = self._spoiled, None  # a restore is how a half-updated state is left
        try:
            self.wait()
        finally:
            self._spoiled = spoiled
        lay = self.layout
        template = jax.eval_shape(lambda m: optim.init_chunk_state(self.tx, m),
                                  jax.ShapeDtypeStruct((lay.chunk_size,), jnp.float32))
        host = set(self.host_chunks)
        host_cls = type(self.host_optimizer.host_state(1)) if host else None
        for c in range(lay.n_chunks):
            if c in host:
                portable.check_host_moments(host_cls, saved.moments(c), c)
            else:
                portable.check_optax_moments(template, saved.moments(c), c)
        masters, states, params, dev = [], [], [], sharding(DEVICE)
        host_params = {}
        for c in range(lay.n_chunks):
            arrs, cm = saved.chunk(c)
            master = arrs.pop("master")
            arrs.pop("params", None)
            dt = lay.chunk_dtypes[c]
            params.append(jax.device_put(master.astype(dt), dev))  # own buffer: master is donated
            if c in host:
                m_host, host_params[c] = dropin.host_buffers(master, dt)
                masters.append(m_host)
                states.append(portable.portable_to_host(host_cls, cm["count"], arrs, c))
            else:
                opt = portable.portable_to_optax(template, cm["count"], arrs, cm["rest"], c)
                sk = sharding(self.placement.state_kinds[c])
                masters.append(None if c in self.lean_chunks else jax.device_put(master, sk))
                states.append(jax.device_put(opt, sk))
                del opt
            count = cm["count"]
            del arrs, master
        self._master, self._opt_state, self._host_params = masters, states, host_params
        self._host_tokens = {}
        self.step = int(saved.meta.get("optimizer_steps", count or 0))
        restored, self._spoiled = lay.unpack(params), None
        self._params_now = [None if x is None else y for x, y in zip(self._params_now, lay.treedef.flatten_up_to(restored))]
        return restored

    def summary(self) -> str:
        """One line: chunks, where their state lives, predicted bytes."""
        n_dev = self.placement.state_kinds.count(DEVICE)
        return (f"ChunkedOptimizer: {self.layout.n_chunks} chunks x {self.layout.chunk_size} elements; "
                f"state of {n_dev} on the device ({self.device_state_bytes / 2**20:.2f} MiB), "
                f"{len(self.streamed_chunks)} in pinned host memory streamed through the device (pipeline depth "
                f"{self.pipeline_depth}; {len(self.lean_chunks)} of them moving their optimizer state only), "
                f"{len(self.host_chunks)} updated by the host kernel"
                f"{f' (numba threads: {self.host_threads})' if self.host_threads else ''} "
                f"({self.host_state_bytes / 2**20:.2f} MiB off the device); "
                f"update working set {self.working_bytes / 2**20:.2f} MiB")
