"""The one forward/backward walker: a step is a sequence of *moments* in tide order.

Moments (definitions.md): forward of stages ``0..n-2``, the fused head (forward + backward of the
last stage), backward of stages ``n-2..0``. :meth:`Walk.run` executes a range of them inside one
program (the step cuts the moments into programs at the schedule's segments):

* chunks whose params live in pinned host memory are fetched ``prefetch`` moments ahead of the
  moment that reads them, each fetch tied by ``jax.lax.optimization_barrier`` to the activation
  (or cotangent) of the moment it is issued at (without the tie XLA hoists every fetch to the
  program start: gpu_facts.md); a fetched chunk is held until the moment after which its next
  read is a fresh fetch (eviction);
* only stage inputs are saved; the backward re-fetches each stage's chunks tied to the incoming
  cotangent, recomputes the stage with ``jax.vjp`` (activation checkpointing per stage) and
  accumulates float32 gradient chunks; a chunk whose gradient is complete leaves through the
  topology's ``reduce_grad`` (one device: as is; a mesh: all-reduce or reduce-scatter), moved to
  pinned host memory at once when its update does not run on the device (tied to the next
  cotangent so it cannot be postponed);
* a stage whose remat option (``remat``, :mod:`chunkjax.remat`) is ``"save"`` or ``"offload"``
  keeps its activations named ``remat_names`` from its forward (on the device, or moved to pinned
  host memory, each move tied to the next moment's activation) and its backward reads them instead
  of recomputing them (an offloaded stage's arrays fetched one backward moment ahead, tied to the
  cotangent, carried into the next program when it starts there); one micro-batch per pass only;
* in the backward, chunks whose values the stage's gradient does not need are not fetched
  (their slot holds zeros, which the compiler removes);
* a master-fetch chunk (:mod:`chunkjax.host_forms`: a host chunk without a compute-dtype copy)
  is fetched as its float32 master params and cast to the compute dtype on the device right
  after the fetch (round to nearest even, bit for bit the copy the host kernel would write);
* with ``micro_batches`` M > 1 (gradient accumulation inside the moments, ``accumulation=
  "in_program"``): the batch's rows are M equal micro-batches (rows ``[i*k, (i+1)*k)``); each
  moment fetches its chunks once and loops over the micro-batches inside the program
  (``jax.lax.map`` forward, ``jax.lax.scan`` in the head and the backward, the stage's fetched
  chunks constants of the loop): the saved stage inputs are the whole batch's, a stage's
  internals one micro-batch's; the head seeds each micro-batch's backward as with one and
  multiplies its gradient sum and each cotangent it sends back by the micro-batch's factor
  (``1/M``; a weighted loss ``W_i / sum(W)``, :mod:`chunkjax.loss_weight`), so the float32
  gradient chunks sum every micro-batch on the device to the mean and leave once, in the compute
  dtype, through the same ``reduce_grad`` and host hand-over (``1/M`` a power of two: the bits of
  :func:`chunkjax.accumulate.mean_gradients`' ``(sum * float32(1/M))``); the loss is the
  micro-batches' mean (a weighted loss: its sums); with ``unroll`` the loops are traced unrolled
  (``scan(..., unroll=True)``: the same operations in the same order, straight-line code, bit
  for bit the loop's results; the compiled program holds a copy of the stage per micro-batch), so
  that XLA may overlap a moment's fetches with the micro-batches' compute (a while loop's it did
  not overlap on the H200: docs/design.md, cross-step overlap);
* frozen chunks (``layout.chunk_trainable`` False) are fetched like the others but stored in their
  leaves' dtype (floating ones cast to the compute dtype when read, integer ones stay integers);
  a frozen chunk resident on the device is tied to the reading moment's input (activation or
  cotangent) like a fetch, so the slices and casts of its leaves are made at that moment (untied,
  XLA made them for every resident frozen chunk at the program start and held them until their
  forward use: a LoRA base's bytes once more, beyond the accounting);
  the backward's ``jax.vjp`` runs over the stage's trainable leaves only (frozen leaves are
  constants: a LoRA base costs no weight-gradient matmuls) and frozen chunks get no gradient.

:meth:`Walk.forward` runs the forward moments only, with the same fetches: evaluation.

References: PatrickStar (arXiv 2108.05818) sections 4-5 (chunks, fetch before use, moments);
gpu_probe6.py in shared/probes for the tied-fetch custom backward.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax.layout import ChunkLayout
from chunkjax.memory import DEVICE, PINNED_HOST, ordered_after
from chunkjax.loss_weight import WeightedLoss, as_float32, inverse_weight, is_weighted
from chunkjax.remat import FULL, OFFLOAD, backward_saved, check_remat, forward_saving, kept_kinds  # noqa: F401
from chunkjax.stages import split_loss, stage_vjp
from chunkjax.tied_loop import tied_scan


def rank_major(batch, micro_batches: int, n_ranks: int):
    """The global batch's rows reordered for in-program micro-batches on ``n_ranks`` N > 1: rank
    r's rows, cut into ``micro_batches`` M parts, are rank r's rows of each of the per-pass path's
    micro-batches (global micro-batch i: rows ``[i*B/M, (i+1)*B/M)``, rank r's the r-th
    ``B/(M*N)`` of those), so both paths average the same micro-batches. Leaves: numpy or jax
    arrays with B (a multiple of M*N) rows first; unchanged for M or N of 1."""
    if micro_batches == 1 or n_ranks == 1:
        return batch

    def reorder(a):
        k = a.shape[0] // (micro_batches * n_ranks)
        xp = np if isinstance(a, np.ndarray) else jnp
        return xp.swapaxes(a.reshape((micro_batches, n_ranks, k) + a.shape[1:]), 0, 1).reshape(a.shape)
    return jax.tree.map(reorder, batch)


def moments_of(n_stages: int) -> tuple[tuple[str, int], ...]:
    """``(phase, stage)`` per moment: forward 0..n-2, the fused head, backward n-2..0."""
    n = n_stages
    return (tuple(("forward", s) for s in range(n - 1)) + (("forward+backward", n - 1),)
            + tuple(("backward", s) for s in range(n - 2, -1, -1)))


@dataclasses.dataclass(frozen=True)
class Walk:
    """The static facts of one step's moments for one batch shape.

    Attributes:
      stages: the model's stages.
      layout: the chunk layout.
      topology: :class:`chunkjax.topology.SingleDevice` or :class:`~chunkjax.topology.DataMesh`
        (the hooks ``to_device``, ``to_host``, ``gather``, ``resident``, ``reduce_grad``,
        ``loss_cotangent``).
      compute_dtype: dtype of compute params and gradients.
      prefetch: fetch distance in moments (>= 1).
      param_kinds, grad_kinds: per chunk, the memory kind of its compute params between steps
        and the kind its gradient leaves the backward into.
      reads: per stage, the chunks it reads; bwd_reads: per stage, those whose values its
        backward needs.
      fetch: per moment, the chunk ids fetched for it.
      first_reader: chunk -> the first stage reading it (its gradient completes there).
      micro_batches: M, the micro-batches looped over inside each moment (1: none). The batch
        and every activation leaf carry the rows first; M divides them.
      unroll: trace those loops unrolled (:attr:`chunkjax.schedule.Schedule.unroll_micro_batches`).
      remat: per stage, its remat option (:data:`chunkjax.remat.REMAT_OPTIONS`; empty: all
        ``"full"``); remat_names: the ``checkpoint_name`` names a ``"save"``/``"offload"`` stage keeps.

    Raises:
      ValueError: a bad ``remat`` (:func:`chunkjax.remat.check_remat`), or ``"save"``/``"offload"``
        with ``micro_batches`` > 1.
    """

    stages: tuple
    layout: ChunkLayout
    topology: Any
    compute_dtype: Any
    prefetch: int
    param_kinds: tuple
    grad_kinds: tuple
    reads: tuple
    bwd_reads: tuple
    fetch: tuple
    first_reader: dict
    micro_batches: int = 1
    unroll: bool = False
    remat: tuple = ()
    remat_names: tuple = ()

    def __post_init__(self):
        remat = check_remat(self.remat, len(self.stages), self.remat_names)
        if any(r != FULL for r in remat) and self.micro_batches > 1:
            raise ValueError("remat 'save'/'offload' runs one micro-batch per pass: use accumulation="
                             "'per_micro_batch' or remat 'full' with in-program micro-batches")
        if any(r != FULL for r in remat) and getattr(self.topology, "n_ranks", 1) > 1:
            raise ValueError("remat 'save'/'offload' runs on one device: plan the mesh with remat 'full'")

    def _keeps(self, s: int) -> str:
        """Stage ``s``'s remat option."""
        return self.remat[s] if self.remat else FULL

    @property
    def moments(self):
        return moments_of(len(self.stages))

    def reads_at(self, t: int) -> tuple[int, ...]:
        ph, s = self.moments[t]
        return self.bwd_reads[s] if ph == "backward" else self.reads[s]

    def _sub(self, arrays, s):
        return self.layout.unpack_subtree(arrays, self.stages[s].param_keys)

    @functools.cached_property
    def _frozen(self) -> frozenset[int]:
        return frozenset(c for c, t in enumerate(self.layout.chunk_trainable) if not t)

    def _read_dtype(self, c):
        """The dtype stage code sees chunk ``c`` in: the compute dtype, or a frozen chunk's own
        dtype when it is not floating (integer leaves are never cast)."""
        dt = self.layout.chunk_dtypes[c]
        return dt if c in self._frozen and not jnp.issubdtype(dt, jnp.floating) else self.compute_dtype

    def _trainable_mask(self, s) -> list[bool]:
        """Per leaf of stage ``s``'s params (flattening order of :meth:`_sub`): trainable."""
        lay = self.layout
        tree = lay.treedef.unflatten([lay.chunk_trainable[sl.chunks[0]] for sl in lay.slots])
        return jax.tree.leaves({k: tree[k] for k in self.stages[s].param_keys})

    def _split(self, p, s):
        """``(trainable leaves, rebuild, grads_tree)`` of stage params ``p``: ``rebuild(leaves)``
        is ``p`` with the trainable leaves replaced, ``grads_tree(cotangents)`` the gradient
        subtree with None at frozen leaves (skipped by ``scatter_add``)."""
        mask = self._trainable_mask(s)
        leaves, td = jax.tree.flatten(p)

        def rebuild(tr):
            it = iter(tr)
            return td.unflatten([next(it) if m else x for x, m in zip(leaves, mask)])

        def grads_tree(dtr):
            it = iter(dtr)
            return td.unflatten([next(it) if m else None for m in mask])

        return [x for x, m in zip(leaves, mask) if m], rebuild, grads_tree

    def _arrays(self, t, x, batch, params, held, issued):
        """The chunk arrays moment ``t`` reads (fetched, resident or zeros)."""
        lay, topo = self.layout, self.topology
        s = self.moments[t][1]
        reads = self.reads_at(t)
        arrays = {}
        for c in self.reads[s]:
            if c not in reads:  # value not needed by this backward: zeros (compiled away)
                arrays[c] = jnp.zeros((lay.chunk_size,), self._read_dtype(c))
            elif self.param_kinds[c] == DEVICE:
                anchor = batch if x is None else x
                # a device-resident frozen chunk is tied to the moment's input like a fetch: untied,
                # XLA computes the slices/casts of its leaves at the program start and holds them
                # until their forward use (the resident base once more: tests/test_lora.py)
                p = ordered_after(anchor, params[c]) if c in self._frozen else params[c]
                arrays[c] = topo.resident(p, anchor)
            else:
                if (t, c) in issued:
                    held[c] = topo.gather(issued.pop((t, c)))
                arrays[c] = held[c]
            if c in self._frozen:  # stored in the leaves' dtype: floating ones read in the compute dtype
                arrays[c] = arrays[c].astype(self._read_dtype(c))
        return arrays

    def _parts(self, tree):
        """``[M*k, ...]`` leaves -> ``[M, k, ...]`` (micro-batch i: rows ``[i*k, (i+1)*k)``)."""
        m = self.micro_batches
        return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), tree)

    def _scan(self, body, init, xs):
        """A scan over the micro-batches (unrolled with :attr:`unroll`) whose buffers are filled
        only once its inputs exist (:func:`chunkjax.tied_loop.tied_scan`: untied, XLA fills every
        loop of a program at its start, issue 24); ``ShapeDtypeStruct`` carry leaves: zeros."""
        return tied_scan(body, init, xs, unroll=self.unroll)

    def _map(self, fn, xs):
        """``jax.lax.map`` over the micro-batches: :meth:`_scan` without carry."""
        return self._scan(lambda c, x: (c, fn(x)), None, xs)[1]

    @staticmethod
    def _whole(tree):
        """``[M, k, ...]`` leaves -> ``[M*k, ...]`` (the inverse of :meth:`_parts`)."""
        return jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), tree)

    def _add_grads(self, acc: dict, s: int, dp) -> dict:
        """``acc`` (chunk -> float32 (chunk_size,)) with stage ``s``'s gradient subtree ``dp`` added."""
        acc = dict(acc)
        for c in self.reads[s]:
            if c in self._frozen:
                continue
            if c not in acc:
                acc[c] = jnp.zeros((self.layout.chunk_size,), jnp.float32)
            acc[c] = self.layout.scatter_add(acc[c], c, dp)
        return acc

    def _acc_of(self, acc: dict, s: int, fresh: bool = False) -> dict:
        """Stage ``s``'s trainable chunks' float32 accumulators (zeros where none yet): a loop's carry;
        with ``fresh`` the zeros as ``ShapeDtypeStruct`` s (:meth:`_scan` makes them after its tie)."""
        z = jax.ShapeDtypeStruct if fresh else jnp.zeros
        return {c: acc[c] if c in acc else z((self.layout.chunk_size,), jnp.float32)
                for c in self.reads[s] if c not in self._frozen}

    def _head(self, st, s, arrays, x, batch, loss_scale, acc):
        """The fused head over the micro-batches: ``(acc, loss, aux, dx)``.

        Each micro-batch i is seeded as one alone (``loss_cotangent``: 1, 1/N, or a weighted
        loss's ``1 / W_i``, ``W_i`` its weight over the ranks) and gets the factor ``f_i``: ``1/M``
        (a plain loss: the mean), or ``W_i / sum(W)`` (a weighted loss: the global token mean,
        :mod:`chunkjax.loss_weight`). The head's own gradient sum ``sum(w_i * dp_i) * (f_i / w_i)``
        (``w_i``: ``W_i``, or 1) and the cotangent ``dx_i * f_i`` that leaves the head carry the
        factor, so the backward moments' float32 sums are the step's gradient as they stand.
        ``loss``: () f32, the micro-batches' mean, or a weighted loss of this rank's float32 sums;
        ``aux`` (if any) stacked ``[M, ...]``; ``dx`` the whole batch's rows."""
        tr, rebuild, grads_tree = self._split(self._sub(arrays, s), s)
        topo, m = self.topology, self.micro_batches

        def body(a, part):
            xi, bi = part
            (loss, aux), pull = stage_vjp(lambda p, xx: st.apply(rebuild(p), xx, bi), tr, xi, head=True)
            ct = topo.loss_cotangent(loss)
            if loss_scale is not None:
                ct = ct * loss_scale.astype(ct.dtype)
            dp, dx = pull(ct)
            w = jnp.ones((), jnp.float32)
            if is_weighted(loss):  # this part's weight over every rank
                w = jnp.asarray(topo.reduce_scalars({}, loss)[1].weight, jnp.float32)
                dp = jax.tree.map(lambda g: g.astype(jnp.float32) * w, dp)
                loss = as_float32(loss)
            return self._add_grads(a, s, grads_tree(dp)), (loss, aux, dx, w)

        zeros = {c: jax.ShapeDtypeStruct((self.layout.chunk_size,), jnp.float32) for c in self._acc_of(acc, s)}
        sums, (losses, aux, dx, w) = self._scan(body, zeros, self._parts((x, batch)))
        if is_weighted(losses):
            inv = inverse_weight(jnp.sum(w))
            loss = WeightedLoss(jnp.sum(losses.total), jnp.sum(losses.weight))
        else:
            inv = jnp.float32(1.0 / m)
            loss = jnp.mean(losses.astype(jnp.float32))
        f = w * inv  # (M,) f32
        if dx is not None:  # None: a one-stage model
            dx = [(d.astype(jnp.float32) * f.reshape((m,) + (1,) * (d.ndim - 1))).astype(d.dtype) for d in dx]
        prev = self._acc_of(acc, s)
        acc = {**acc, **{c: prev[c] + v * inv for c, v in sums.items()}}
        return acc, loss, aux, self._whole(dx)

    def _backward(self, st, s, tr, rebuild, grads_tree, ct, x_in, batch, acc):
        """A backward moment over the micro-batches: ``(acc, dx)`` (``dx`` the whole batch's rows)."""
        def body(a, part):
            ci, xi, bi = part
            _, pull = stage_vjp(lambda p, xx: st.apply(rebuild(p), xx, bi), tr, xi)
            dp, dx = pull(ci)
            return self._add_grads(a, s, grads_tree(dp)), dx

        a, dx = self._scan(body, self._acc_of(acc, s, fresh=True), self._parts((ct, x_in, batch)))
        return {**acc, **a}, self._whole(dx)

    def _issue(self, t, anchor, batch, params, issued, horizon):
        tie = batch if anchor is None else anchor  # the first fetches wait for the batch
        for u in range(t, min(horizon, t + self.prefetch + 1)):
            for c in self.fetch[u]:
                if (u, c) not in issued:
                    a = self.topology.to_device(ordered_after(tie, params[c]))
                    if c not in self._frozen and a.dtype != self.compute_dtype:  # a master-fetch chunk
                        a = a.astype(self.compute_dtype)  # round to nearest even: the host copy's bits
                    issued[(u, c)] = a

    def _release(self, t, held, horizon):
        """Eviction: a held chunk dies after the moment whose next read of it is a fresh fetch."""
        for c in self.reads_at(t):
            if c not in held:
                continue
            for u in range(t + 1, horizon):
                if c in self.reads_at(u):
                    if c in self.fetch[u]:
                        del held[c]
                    break
            else:
                del held[c]

    def _forward_keeping(self, st, s, arrays, x, batch, kept: dict):
        """A forward moment of a ``"save"``/``"offload"`` stage (one micro-batch): its output; its
        named activations go into ``kept[s]`` (moved to pinned host memory for ``"offload"``)."""
        sub = self._sub(arrays, s)
        tr, rebuild, _ = self._split(sub, s)
        out, keep = forward_saving(lambda p, xx: st.apply(rebuild(p), xx, batch), tr, x, self.remat_names, (batch, sub))
        # an entry even when empty (a stage naming none of the names): the carry's structure is the
        # schedule's (chunkjax.remat.kept_kinds: the programs' output shardings)
        kept[s] = [self.topology.to_host(a) for a in keep] if self._keeps(s) == OFFLOAD else keep
        return out

    def _kept_fetch(self, s, anchor, kept: dict, ahead: dict):
        """Stage ``s``'s kept activations on the device for its backward (None: it kept none): a
        copy fetched ahead, else fetched now, tied to ``anchor`` (an offloaded stage's), or as kept."""
        if s in ahead:
            return ahead.pop(s) or None
        vals = kept.pop(s, None)
        if not vals:  # kept nothing: recompute as "full"
            return None
        if self._keeps(s) == OFFLOAD:
            return [self.topology.to_device(ordered_after(anchor, a)) for a in vals]
        return vals

    def run(self, params: dict, batch, carry: dict, t0: int, t1: int):
        """Run moments [t0, t1) (inside a program; per-rank values on a mesh).

        Args:
          params: chunk id -> compute params (only the chunks this program reads).
          batch: the (rank's) batch.
          carry: what crosses program boundaries: ``x`` (activation or cotangent), ``saved``
            stage inputs, ``acc`` float32 gradient accumulators, ``held`` fetched chunks kept on
            the device, ``issued`` prefetched chunks keyed ``"t:c"``, ``loss_scale`` (fp16 loss
            scaling: the backward is seeded with it), ``kept`` the named activations of
            ``"save"``/``"offload"`` stages keyed by stage (lists; pinned host for ``"offload"``).

        Returns:
          ``(carry, grads {chunk: grad in its grad kind}, sq {chunk: () f32}, loss or None)``;
          the carry is empty after the last moment. A last stage returning ``(loss, aux)`` gives
          ``(loss, aux)`` in place of the loss (with ``micro_batches`` M > 1: the micro-batches'
          mean loss, () f32, and ``aux`` stacked ``[M, ...]``). Between stages the carry's ``x``
          is the activation (forward) or the list of cotangents of its floating leaves
          (backward), the whole batch's rows.
        """
        topo = self.topology
        T = len(self.moments)
        x = carry.get("x")
        saved = dict(carry.get("saved", {}))
        acc = dict(carry.get("acc", {}))
        held = dict(carry.get("held", {}))
        issued = {tuple(int(v) for v in key.split(":")): a for key, a in carry.get("issued", {}).items()}
        loss_scale = carry.get("loss_scale")
        kept = {int(k): list(v) for k, v in carry.get("kept", {}).items()}
        # kept activations fetched a moment ahead (also by the previous program); offloads issued last moment
        ahead, pending = {int(k): list(v) for k, v in carry.get("ahead", {}).items()}, []
        grads, sq, loss, aux = {}, {}, None, None
        m = self.micro_batches

        def add_grads(s, dp):
            acc.update(self._add_grads(acc, s, dp))

        def emit(s, dx):
            for c in self.reads[s]:
                if self.first_reader[c] != s or c in self._frozen:
                    continue
                g, sq[c] = topo.reduce_grad(acc.pop(c).astype(self.compute_dtype))
                if self.grad_kinds[c] == PINNED_HOST:
                    g = topo.to_host(g)
                    if dx is not None:
                        dx, g = jax.lax.optimization_barrier((dx, g))
                grads[c] = g
            return dx

        for t in range(t0, t1):
            ph, s = self.moments[t]
            self._issue(t, x, batch, params, issued, T)
            arrays = self._arrays(t, x, batch, params, held, issued)
            st = self.stages[s]
            if ph != "forward" and s > 0 and self._keeps(s - 1) == OFFLOAD and s - 1 in kept:
                # the next backward moment's offloaded activations, fetched while this one computes (in
                # the next program's carry when it starts there: chunkjax.remat.kept_kinds)
                ahead[s - 1] = [self.topology.to_device(ordered_after(x, a)) for a in kept.pop(s - 1)]
            if ph == "forward":
                saved[s] = x
                if m == 1 and self._keeps(s) != FULL:
                    x = self._forward_keeping(st, s, arrays, x, batch, kept)
                elif m == 1:
                    x = st.apply(self._sub(arrays, s), x, batch)
                else:  # the stage per micro-batch; the fetched chunks are the loop's constants
                    sub = self._sub(arrays, s)
                    x = self._whole(self._map(lambda part, sub=sub, st=st: st.apply(sub, *part),
                                              self._parts((x, batch))))
            elif ph == "forward+backward" and m > 1:
                acc, loss, aux, dx = self._head(st, s, arrays, x, batch, loss_scale, acc)
                x = emit(s, dx)
            elif ph == "forward+backward":
                tr, rebuild, grads_tree = self._split(self._sub(arrays, s), s)
                (loss, aux), pull = stage_vjp(lambda p, xx: st.apply(rebuild(p), xx, batch), tr, x, head=True)
                ct = topo.loss_cotangent(loss)
                if loss_scale is not None:  # fp16 loss scaling: the backward carries scaled values
                    ct = ct * loss_scale.astype(ct.dtype)
                dp, dx = pull(ct)
                add_grads(s, grads_tree(dp))
                x = emit(s, dx)
            else:
                # tie the recompute's inputs to the cotangent: otherwise XLA merges the recompute
                # with the forward pass (common-subexpression elimination) and keeps every stage's
                # internals alive, undoing the activation checkpointing (jax.checkpoint's prevent_cse)
                keep = self._kept_fetch(s, x, kept, ahead)
                x, x_in, arrays, keep = jax.lax.optimization_barrier((x, saved.pop(s, None), arrays, keep))
                sub = self._sub(arrays, s)
                tr, rebuild, grads_tree = self._split(sub, s)
                if s == 0 and not tr:  # a frozen first stage: nothing to differentiate
                    dp, dx = [], None
                elif keep is not None:  # named activations read, not recomputed (chunkjax.remat)
                    dp, dx = backward_saved(lambda p, xx: st.apply(rebuild(p), xx, batch), tr, x_in,
                                            self.remat_names, keep, (batch, sub))(x)
                elif m > 1:  # recompute + vjp per micro-batch, the float32 sums on the device
                    acc, dx = self._backward(st, s, tr, rebuild, grads_tree, x, x_in, batch, acc)
                    dp = None
                else:
                    _, pull = stage_vjp(lambda p, xx: st.apply(rebuild(p), xx, batch), tr, x_in)
                    dp, dx = pull(x)
                if dp is not None:
                    add_grads(s, grads_tree(dp))
                x = emit(s, dx)
            pending = [q for q in pending if q in kept]  # (one fetched ahead already waits for its offload)
            if pending and x is not None:  # last moment's offloads complete with this moment's output
                x, tied = jax.lax.optimization_barrier((x, [kept[q] for q in pending]))
                kept.update(zip(pending, tied))
            pending = [s] if ph == "forward" and self._keeps(s) == OFFLOAD and kept.get(s) else []
            self._release(t, held, T)
        if aux is not None:  # the last stage's (loss, aux): aux leaves with the loss
            loss = (loss, aux)
        if t1 == T:
            return {}, grads, sq, loss
        out = {"x": x, "saved": saved, "acc": acc, "held": held,
               "issued": {f"{u}:{c}": a for (u, c), a in issued.items()}}
        for key, d in (("kept", kept), ("ahead", ahead)):  # keys as chunkjax.remat.kept_kinds
            if d:
                out[key] = {str(q): v for q, v in d.items()}
        if loss_scale is not None:
            out["loss_scale"] = loss_scale
        return out, grads, sq, loss

    def forward(self, params: dict, batch):
        """The forward moments only (evaluation): the loss (() f32, this rank's mean; a
        :class:`~chunkjax.loss_weight.WeightedLoss` of float32 values, this rank's sums), params
        fetched by the same rule as the step's forward."""
        n = len(self.stages)
        x, held, issued = None, {}, {}
        for t in range(n):
            s = self.moments[t][1]
            self._issue(t, x, batch, params, issued, n)
            arrays = self._arrays(t, x, batch, params, held, issued)
            x = self.stages[s].apply(self._sub(arrays, s), x, batch)
            self._release(t, held, n)
        return as_float32(split_loss(x)[0])
