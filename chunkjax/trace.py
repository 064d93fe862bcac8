"""Tracing pass: the non-model memory of each stage, from abstract shapes only.

For every stage the saved input activation (kept through the forward pass until the stage's
backward) comes from ``jax.eval_shape``; the transient bytes of the stage's recompute + vjp come
from the compiled program's ``memory_analysis()`` (temporaries plus the gradient outputs). No
model memory is allocated. Identical stages (same function code and shapes, e.g. transformer
blocks) are compiled once, and a stage program this process has compiled before (the same model
prepared again: every ``fit_step`` / ``offload`` traces its stages afresh) is not compiled again
(:func:`_temp_bytes`). With micro-batches looped inside each moment (in-program accumulation), each
distinct stage's loop over the whole batch is compiled and measured the same way
(:func:`in_program_traces`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from chunkjax.layout import ChunkLayout
from chunkjax.stages import differentiated, split_loss, stage_vjp
from chunkjax.tied_loop import tied_scan


@dataclasses.dataclass(frozen=True)
class StageTrace:
    """Non-model memory of one stage, from tracing it on abstract inputs.

    Attributes:
      name: the stage's name.
      chunks: chunk ids the stage reads.
      input_bytes: bytes of the activation saved at the stage's input (kept until its backward).
      temp_bytes: peak transient bytes of the stage's recompute + vjp (compiled memory analysis).
      bwd_chunks: chunk ids whose values the stage's backward needs (a subset of ``chunks``;
        an embedding lookup's gradient needs none). ``None`` means all of ``chunks``.
      output_bytes: bytes of the stage's output (the next stage's input; the head's loss), a
        part of ``temp_bytes`` (:func:`in_program_traces` scales it).
      offload_bytes: activations the stage moves to pinned host memory in its forward and back in
        its backward (remat ``"offload"``, :func:`chunkjax.remat.with_remat`; 0: none).
      saved_flops: matmul FLOPs its backward does not recompute (remat ``"save"``/``"offload"``).
      micro_loop: micro-batches the moment loops over inside its program (1: none;
        :func:`in_program_traces`).
      loop_unrolled: that loop is traced unrolled (straight-line code: the cost model takes the
        backward's fetches as overlapped with it; a while loop's are not:
        :func:`chunkjax.cost.predict_pipelined_step` ``looped_fetch``).
      loop_carry_bytes: bytes of the loop's float32 carry (the sums of the trainable chunks the
        stage reads, whole chunks; 0: no loop, or not known), a part of ``temp_bytes``.
    """

    name: str
    chunks: tuple[int, ...]
    input_bytes: int
    temp_bytes: int
    bwd_chunks: tuple[int, ...] | None = None
    output_bytes: int = 0
    offload_bytes: int = 0
    saved_flops: float = 0.0
    micro_loop: int = 1
    loop_unrolled: bool = False
    loop_carry_bytes: int = 0

    @property
    def backward_chunks(self) -> tuple[int, ...]:
        return self.chunks if self.bwd_chunks is None else self.bwd_chunks


def _nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def abstract_compute_params(layout: ChunkLayout, compute_dtype):
    """The params pytree as ``ShapeDtypeStruct`` s in the compute dtype (non-floating leaves,
    always frozen, keep their dtype)."""
    leaves = [jax.ShapeDtypeStruct(s.shape, compute_dtype if jnp.issubdtype(s.dtype, jnp.floating) else s.dtype)
              for s in layout.slots]
    return layout.treedef.unflatten(leaves)


def _live_inputs(closed, n_inputs: int) -> list[bool]:
    """Which of the first ``n_inputs`` inputs of a jaxpr the outputs depend on (a conservative
    dead-code pass over the top-level equations; sub-programs count as reading all inputs)."""
    jaxpr = closed.jaxpr
    used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
    return [v in used for v in jaxpr.invars[:n_inputs]]


def stage_signature(st, p_sub, x, mask=None):
    """Stages with equal signatures trace alike: identical blocks differ only in their top-level
    key (h_0, h_1, ...), so key on the function (or its ``trace_key``: :mod:`chunkjax.discover`),
    the values' structure and shapes and which leaves are trainable."""
    fn = getattr(st.apply, "trace_key", None) or getattr(st.apply, "__code__", st.apply)
    return (fn, jax.tree.structure(list(p_sub.values())),
            tuple((a.shape, a.dtype) for a in jax.tree.leaves(p_sub)),
            None if x is None else (jax.tree.structure(x), tuple((a.shape, a.dtype) for a in jax.tree.leaves(x))),
            None if mask is None else tuple(mask))


def _trainable_mask(layout: ChunkLayout, keys) -> list[bool]:
    """Per leaf of the stage params ``{k: params[k] for k in keys}`` (flattening order): trainable."""
    tree = layout.treedef.unflatten([layout.chunk_trainable[s.chunks[0]] for s in layout.slots])
    return jax.tree.leaves({k: tree[k] for k in keys})


def _vjp_fn(stage, head: bool, mask=None):
    """``(p, x, ct, b) -> (dp, dx)``: the stage's recompute + vjp as the walker runs it
    (:func:`chunkjax.stages.stage_vjp`): over the trainable leaves of ``p`` and the floating leaves
    of ``x``, frozen leaves closed over as constants."""
    def vjp_fn(p, x, ct, b):
        leaves, td = jax.tree.flatten(p)
        m = [True] * len(leaves) if mask is None else mask

        def rebuild(tr):
            it = iter(tr)
            return td.unflatten([next(it) if k else a for a, k in zip(leaves, m)])

        tr = [a for a, k in zip(leaves, m) if k]
        return stage_vjp(lambda t, xx: stage.apply(rebuild(t), xx, b), tr, x, head=head)[1](ct)
    return vjp_fn


def _cotangent(stage, p_sub, x, batch, head: bool, out=None):
    """Abstract cotangent of the stage's output (``out``: its abstract output when known) as
    :func:`chunkjax.stages.stage_vjp` takes it."""
    out = jax.eval_shape(stage.apply, p_sub, x, batch) if out is None else out
    if head:
        loss = differentiated(split_loss(out)[0])
        return jax.ShapeDtypeStruct(jnp.shape(loss), loss.dtype)
    return [a for a in jax.tree.leaves(out) if jnp.issubdtype(a.dtype, jnp.floating)]


def _backward_live(stage, p_sub, x, batch, head: bool = False, mask=None) -> list[bool]:
    """Per leaf of ``p_sub`` (flattening order): does the stage's backward read its value."""
    ct = _cotangent(stage, p_sub, x, batch, head)
    closed = jax.make_jaxpr(_vjp_fn(stage, head, mask))(p_sub, x, ct, batch)
    return _live_inputs(closed, len(jax.tree.leaves(p_sub)))


def _chunks_of_live(layout: ChunkLayout, p_sub, live) -> tuple[int, ...]:
    flat, _ = jax.tree_util.tree_flatten_with_path(p_sub)
    paths = [jax.tree_util.keystr(k, simple=True, separator="/") for k, _ in flat]
    return layout.chunks_of([pth for pth, l in zip(paths, live) if l])


def backward_reads(stage, layout: ChunkLayout, p_sub, x, batch, head: bool = False) -> tuple[int, ...]:
    """Chunk ids whose *values* the stage's backward (recompute + vjp) needs.

    Some stages need no parameter values for their gradients (an embedding lookup's gradient is
    a scatter-add of the cotangent), so their chunks need not be fetched in the backward pass.
    """
    return _chunks_of_live(layout, p_sub, _backward_live(stage, p_sub, x, batch, head,
                                                         _trainable_mask(layout, stage.param_keys)))


def stage_inputs(stages, layout: ChunkLayout, batch, compute_dtype):
    """Abstract (params_sub, x) of every stage, in order (identical stages are shaped once)."""
    params = abstract_compute_params(layout, compute_dtype)
    out, x, shapes = [], None, {}
    for st in stages:
        p_sub = {k: params[k] for k in st.param_keys}
        out.append((p_sub, x))
        sig = stage_signature(st, p_sub, x)
        if sig not in shapes:
            shapes[sig] = jax.eval_shape(st.apply, p_sub, x, batch)
        x = shapes[sig]
    return out


def _stage_figures(st, p_sub, x, batch, head: bool, mask=None) -> tuple[int, int, list[bool]]:
    """``(transient bytes, output bytes, backward-live)`` of the stage's recompute + vjp: its
    compiled temporaries plus the gradient outputs and the stage's output, the output's bytes,
    and per leaf of ``p_sub`` whether the backward reads its value (:func:`_backward_live`).
    One trace of the vjp gives the jaxpr, the gradient shapes and the program compiled."""
    out = jax.eval_shape(st.apply, p_sub, x, batch)
    ct = _cotangent(st, p_sub, x, batch, head, out)
    traced = jax.jit(_vjp_fn(st, head, mask)).trace(p_sub, x, ct, batch)
    temp = _temp_bytes(traced.lower())
    live = _live_inputs(traced.jaxpr, len(jax.tree.leaves(p_sub)))
    grads = sum(math.prod(a.shape) * a.dtype.itemsize for a in traced.jaxpr.out_avals)
    return temp + grads + _nbytes(out), _nbytes(out), live


#: Stage programs whose temporaries :func:`_temp_bytes` keeps (the oldest dropped first).
MEASURED_PROGRAMS = 256
#: (backend, device kind, SHA-256 of the lowered program's text) -> its compiled temporaries
#: (bytes): a bounded memo of immutable ints. The text (shapes, dtypes, shardings, the whole
#: computation) and the backend decide what XLA compiles, with the process's XLA flags fixed.
_MEASURED: dict[tuple[str, str, str], int] = {}


def _temp_bytes(lowered) -> int:
    """Temporary bytes of a lowered stage program as XLA compiles it (``memory_analysis()``),
    compiling it only when this process has not compiled the same program before (the same
    text on the same backend: :data:`_MEASURED`)."""
    dev = jax.devices()[0]
    key = (dev.platform, dev.device_kind, hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest())
    temp = _MEASURED.get(key)
    if temp is None:
        temp = int(lowered.compile().memory_analysis().temp_size_in_bytes)
        while len(_MEASURED) >= MEASURED_PROGRAMS:
            _MEASURED.pop(next(iter(_MEASURED)))
        _MEASURED[key] = temp
    return temp


def trace_stages(stages, layout: ChunkLayout, batch: jax.ShapeDtypeStruct, compute_dtype) -> tuple[StageTrace, ...]:
    """Per-stage chunk reads and non-model bytes for one step.

    Args:
      stages: the model's :class:`~chunkjax.Stage` sequence.
      layout: chunk layout of the params.
      batch: abstract batch (e.g. ``ShapeDtypeStruct((B, T+1), int32)``).
      compute_dtype: dtype of the compute params (bf16 under mixed precision).

    Returns:
      one :class:`StageTrace` per stage.
    """
    out, cache = [], {}
    for i, (st, (p_sub, x)) in enumerate(zip(stages, stage_inputs(stages, layout, batch, compute_dtype))):
        mask = _trainable_mask(layout, st.param_keys)
        head = i == len(stages) - 1
        sig = stage_signature(st, p_sub, x, mask) + (head,)
        if sig not in cache:
            cache[sig] = _stage_figures(st, p_sub, x, batch, head, mask)
        temp, out_bytes, live = cache[sig]
        out.append(StageTrace(name=st.name, chunks=layout.chunks_of(st.param_keys),
                              input_bytes=0 if x is None else _nbytes(x), temp_bytes=temp,
                              bwd_chunks=_chunks_of_live(layout, p_sub, live), output_bytes=out_bytes))
    return tuple(out)


def in_program_traces(traces: tuple[StageTrace, ...], micro_batches: int, stages=None, layout: ChunkLayout | None = None,
                      batch=None, compute_dtype=None, unrolled: bool = False) -> tuple[StageTrace, ...]:
    """The traces of one micro-batch (:func:`trace_stages` on its rows) -> those of a step that
    loops over ``micro_batches`` M of them inside each moment (:class:`chunkjax.walker.Walk`
    ``micro_batches``): the saved stage inputs are the whole batch's (``M * input_bytes``), the
    stage's output too (``M * output_bytes``); chunk reads are unchanged (each moment fetches its
    chunks once).

    A stage's transient bytes: with ``stages``, ``layout``, ``batch`` (one micro-batch's rows,
    as :func:`trace_stages` got) and ``compute_dtype``, measured as for one micro-batch, from the
    compiled loop the walker runs (:func:`_loop_figures`: a ``jax.lax.scan`` of the stage's
    recompute + vjp over the M parts of the whole batch, float32 gradient sums carried): what
    the compiler keeps for the loop beyond one micro-batch's internals (the stacked cotangents,
    its copies of the loop's inputs) is in it, plus the loop's float32 carry (4 bytes per element
    of each trainable chunk the stage reads, ``loop_carry_bytes``; the step's program holds it beside
    the accumulators it takes and gives, which the tide counts). Without them, the estimate ``temp_bytes
    + (M - 1) * (input_bytes + output_bytes)`` (the forward's stacked output; the backward's
    incoming cotangent and outgoing input cotangent), which misses those copies (issue 24: 7-10 %
    of GPT3_15B's device peak at 8 micro-batches). The traces record the loop (``micro_loop`` M,
    ``loop_unrolled``: the walker's ``unroll``, ``unrolled``) for the cost model."""
    m = int(micro_batches)
    if m < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    loop = dict(micro_loop=m, loop_unrolled=bool(unrolled))
    if m == 1:
        return tuple(dataclasses.replace(t, **loop) for t in traces)
    if stages is None:
        return tuple(dataclasses.replace(t, input_bytes=m * t.input_bytes,
                                         temp_bytes=t.temp_bytes + (m - 1) * (t.input_bytes + t.output_bytes),
                                         output_bytes=m * t.output_bytes, **loop) for t in traces)
    whole = jax.tree.map(lambda a: jax.ShapeDtypeStruct((m * a.shape[0],) + tuple(a.shape[1:]), a.dtype), batch)
    out, cache = [], {}
    for i, (st, t, (p_sub, x)) in enumerate(zip(stages, traces, stage_inputs(stages, layout, whole, compute_dtype))):
        mask = _trainable_mask(layout, st.param_keys)
        head = i == len(stages) - 1
        sig = stage_signature(st, p_sub, x, mask) + (head, m)
        if sig not in cache:
            cache[sig] = _loop_figures(st, p_sub, x, whole, head, mask, m)
        # the loop's float32 carry: the stage's trainable chunks whole (the walker sums into chunk buffers)
        carry = 4 * layout.chunk_size * sum(bool(layout.chunk_trainable[c]) for c in t.chunks)
        out.append(dataclasses.replace(t, input_bytes=m * t.input_bytes, temp_bytes=cache[sig] + carry,
                                       output_bytes=m * t.output_bytes, loop_carry_bytes=carry, **loop))
    return tuple(out)


def _loop_fn(stage, head: bool, mask, m: int):
    """``(p, x, ct, b) -> (sums, dx)``: the walker's in-program backward moment of ``stage`` over
    ``m`` micro-batches (:meth:`chunkjax.walker.Walk._backward` / ``_head``): a ``jax.lax.scan``
    over the parts of the whole batch (rows ``[i*k, (i+1)*k)``; :func:`chunkjax.tied_loop.tied_scan`
    as the walker's), each part's recompute + vjp,
    its gradient added to float32 sums (the loop's carry), the input cotangents stacked; the
    head's cotangent (the loss's) is the loop's constant and its ``dx`` is scaled by ``1/m`` in
    float32, as the walker does."""
    vjp = _vjp_fn(stage, head, mask)
    f32 = jnp.float32

    def parts(tree):
        return jax.tree.map(lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:]), tree)

    def loop(p, x, ct, b):
        leaves = jax.tree.leaves(p)
        keep = [True] * len(leaves) if mask is None else mask
        zeros = [jax.ShapeDtypeStruct(a.shape, f32) for a, k in zip(leaves, keep) if k]

        def body(acc, part):
            xi, ci, bi = part
            dp, dx = vjp(p, xi, ct if head else ci, bi)
            return [s + g.astype(f32) for s, g in zip(acc, jax.tree.leaves(dp))], dx

        sums, dx = tied_scan(body, zeros, parts((x, None if head else ct, b)))
        if dx is not None:
            if head:
                dx = [(d.astype(f32) * f32(1.0 / m)).astype(d.dtype) for d in dx]
            dx = jax.tree.map(lambda a: a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]), dx)
        return sums, dx
    return loop


def _loop_figures(st, p_sub, x, whole, head: bool, mask, m: int) -> int:
    """Transient bytes of ``stage``'s in-program backward moment over ``m`` micro-batches of the
    ``whole`` batch (:func:`_loop_fn`), its float32 carry left out: the compiled loop's temporaries
    plus its stacked input cotangent and the whole batch's output (the incoming cotangent's size),
    as :func:`_stage_figures` counts one micro-batch's. The carry (float32 sums) is the caller's to
    add: the walker's are whole chunks (:func:`in_program_traces`), kept in the step's program
    beside the accumulators it takes and gives (the tide's)."""
    out = jax.eval_shape(st.apply, p_sub, x, whole)
    ct = _cotangent(st, p_sub, x, whole, head, out)
    fn = _loop_fn(st, head, mask, m)
    lowered = jax.jit(fn).trace(p_sub, x, ct, whole).lower()
    return _temp_bytes(lowered) + _nbytes(jax.eval_shape(fn, p_sub, x, ct, whole)[1]) + _nbytes(out)
