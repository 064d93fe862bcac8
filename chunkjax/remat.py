"""Selective activation checkpointing per stage: save named activations instead of recomputing them.

By default the walker (:mod:`chunkjax.walker`) keeps only each stage's input through the forward
pass and recomputes the whole stage in its backward: the hardware runs the forward FLOPs twice
(8N per token for a transformer instead of 6N). A stage's *remat option* changes that:

* ``"full"``: recompute everything (the default, as before);
* ``"save"``: the forward keeps the stage's activations named ``names`` (``jax.ad_checkpoint.
  checkpoint_name`` in the model code) on the device until the stage's backward, which reads
  them instead of recomputing them (``jax.checkpoint_policies.save_only_these_names``);
* ``"offload"``: the same activations are moved to pinned host memory during the forward and
  fetched back for the backward (MaxText's host offload of activations; Korthikanti et al.,
  arXiv 2205.05198, section 5 for selective recomputation).

How: the forward moment differentiates the stage under ``jax.checkpoint(policy=
save_only_these_names(*names))``; the residuals of that ``jax.vjp`` are the stage's inputs, the
arrays it closes over and the saved named activations. The named ones (every residual that is not
one of the stage's inputs or closed-over arrays, nor a constant) leave the moment; the backward
moment takes the vjp of the same function again on its (re-fetched) inputs and swaps the saved
arrays in for its own residuals, so the forward work that produced them is dead and XLA removes
it. JAX's own ``save_and_offload_only_these_names`` policy moves residuals only inside one
differentiated function; the walker's forward and backward of a stage run at different moments,
often in different programs, so the walker moves the saved arrays itself, each move tied to a
moment's activation (``optimization_barrier``) like a chunk fetch (gpu_facts.md: untied, XLA hoists
every fetch to the program start).

:func:`remat_figures` measures, per stage, the saved bytes and the matmul FLOPs the saves remove
from the backward (from the traced programs, dead code removed); :func:`with_remat` writes an
option per stage into the stage traces (device bytes held, PCIe bytes, FLOPs saved) so that the
planner and the cost model (:mod:`chunkjax.predict`) account it with everything else.
"""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp

from chunkjax.flops import matmul_flops

FULL, SAVE, OFFLOAD = "full", "save", "offload"
#: a stage's remat option (module docstring)
REMAT_OPTIONS = (FULL, SAVE, OFFLOAD)


def check_remat(remat, n_stages: int, names) -> tuple[str, ...]:
    """``remat`` (one option per stage, or empty: all ``"full"``) as a tuple.

    Raises:
      ValueError: a wrong length, an unknown option, or ``"save"``/``"offload"`` without names.
    """
    remat = tuple(remat or ())
    if remat and len(remat) != n_stages:
        raise ValueError(f"remat has {len(remat)} entries for {n_stages} stages: give one option per stage")
    bad = [r for r in remat if r not in REMAT_OPTIONS]
    if bad:
        raise ValueError(f"remat option {bad[0]!r} is not one of {REMAT_OPTIONS}")
    if any(r != FULL for r in remat) and not names:
        raise ValueError("remat 'save'/'offload' needs remat_names: the checkpoint_name names of the "
                         "activations to keep (e.g. models.gpt.REMAT_NAMES)")
    return remat


def kept_kinds(remat, moments, t1: int) -> dict[str, dict[str, str]]:
    """The kept activations in the carry a program ending before moment ``t1`` hands on, as
    ``{"kept": {str(stage): kind}, "ahead": {str(stage): "device"}}`` (empty parts left out; the
    program's output shardings). ``kept``: every ``"save"``/``"offload"`` stage whose forward ran
    before ``t1`` and whose backward runs at or after it, in ``device`` or ``pinned_host``;
    ``ahead``: an ``"offload"`` stage whose backward is moment ``t1``, fetched to the device by the
    program's last moment. ``moments``: ``(phase, stage)`` per moment."""
    from chunkjax.memory import DEVICE, PINNED_HOST
    kept, ahead = {}, {}
    for t, (ph, s) in enumerate(moments):
        if ph == "forward" and t < t1 and remat and remat[s] != FULL:
            b = moments.index(("backward", s))
            if b == t1 and t1 > 0 and moments[t1 - 1][0] != "forward" and remat[s] == OFFLOAD:
                ahead[str(s)] = DEVICE
            elif b >= t1:
                kept[str(s)] = PINNED_HOST if remat[s] == OFFLOAD else DEVICE
    return {k: v for k, v in (("kept", kept), ("ahead", ahead)) if v}


def _vjp(fn, p, x, names, head: bool):
    """``(out, pull)`` of ``fn(p, x)`` under ``jax.checkpoint`` with the names saved: as
    :func:`chunkjax.stages.stage_vjp` (differentiated in ``p`` and the floating leaves of ``x``);
    ``pull`` is ``jax.vjp``'s function, a pytree whose leaves are its residuals."""
    from chunkjax.stages import differentiable
    f, xf = differentiable(fn, x, head=head)
    policy = jax.checkpoint_policies.save_only_these_names(*names)
    _, pull, out = jax.vjp(jax.checkpoint(f, policy=policy), p, xf, has_aux=True)
    return out, pull


def _saved_positions(pull, p, x, outer) -> list[int]:
    """Positions among ``pull``'s leaves of the saved activations: residuals that are neither an
    input, an array the function closes over (``outer``), nor a constant."""
    known = {id(a) for a in jax.tree.leaves((p, x, outer))}
    tracer = getattr(jax.core, "Tracer", object)  # constants are concrete (kept as saved where jax.core lacks it)
    return [i for i, a in enumerate(jax.tree.leaves(pull)) if isinstance(a, tracer) and id(a) not in known]


def forward_saving(fn, p, x, names, outer=()):
    """A stage's forward that keeps its named activations.

    Args:
      fn: ``fn(p, x) -> out`` (a stage's apply with its batch bound).
      p, x: its params (the leaves differentiated) and input activation.
      names: ``checkpoint_name`` names to keep.
      outer: every array ``fn`` closes over (the batch, frozen leaves): they are not saved.

    Returns:
      ``(out, saved)``: the stage's output and the list of saved arrays (the backward's
      :func:`backward_saved` takes them back; ``[]`` when the stage names none of ``names``).
    """
    out, pull = _vjp(fn, p, x, names, head=False)
    leaves = jax.tree.leaves(pull)
    return out, [leaves[i] for i in _saved_positions(pull, p, x, outer)]


def backward_saved(fn, p, x, names, saved, outer=()):
    """``pull(ct) -> (dp, dx)`` of a stage whose named activations ``saved`` (from
    :func:`forward_saving` on the same function, params and input) are read, not recomputed; as
    :func:`chunkjax.stages.stage_vjp`'s ``pull``.

    Raises:
      ValueError: ``saved`` does not match the residuals of this trace (number, shapes, dtypes).
    """
    _, pull = _vjp(fn, p, x, names, head=False)
    leaves, td = jax.tree.flatten(pull)
    pos = _saved_positions(pull, p, x, outer)
    if len(pos) != len(saved) or any((leaves[i].shape, leaves[i].dtype) != (s.shape, s.dtype)
                                     for i, s in zip(pos, saved)):
        raise ValueError(f"the stage's saved activations ({len(saved)} arrays) do not match its residuals "
                         f"({len(pos)}): the forward and the backward traced different functions")
    for i, s in zip(pos, saved):
        leaves[i] = s
    pull = jax.tree.unflatten(td, leaves)

    def pull_(ct):
        dp, dx = pull(ct)
        return dp, (None if x is None else dx)
    return pull_


def live_matmul_flops(closed) -> float:
    """Matmul FLOPs (:func:`chunkjax.flops.matmul_flops`) of the top-level equations of a jaxpr
    that its outputs depend on (dead equations, e.g. a forward whose residuals were swapped for
    saved ones, are what XLA removes)."""
    jaxpr = closed.jaxpr
    used = {v for v in jaxpr.outvars if not isinstance(v, jex_core.Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in used for v in eqn.outvars):
            used.update(v for v in eqn.invars if not isinstance(v, jex_core.Literal))
            live.append(eqn)
    return matmul_flops(types.SimpleNamespace(eqns=live[::-1]))


@dataclasses.dataclass(frozen=True)
class RematFigures:
    """What keeping a stage's named activations changes (one stage; one pass of its rows).

    Attributes:
      saved_bytes: bytes of the saved activations (0: the stage names none of the names).
      recompute_flops: matmul FLOPs of the stage's backward with full recompute.
      saved_flops: matmul FLOPs the saves remove from it (recompute no longer run).
    """

    saved_bytes: int
    recompute_flops: float
    saved_flops: float


def _stage_figures(st, p, x, batch, names) -> RematFigures:
    from chunkjax.stages import stage_vjp

    def fwd(q, xx, b):
        return forward_saving(lambda q2, x2: st.apply(q2, x2, b), q, xx, names, b)

    out, saved = jax.eval_shape(fwd, p, x, batch)
    cts = [a for a in jax.tree.leaves(out) if jnp.issubdtype(a.dtype, jnp.floating)]

    def full(q, xx, ct, b):
        return stage_vjp(lambda q2, x2: st.apply(q2, x2, b), q, xx)[1](ct)

    def kept(q, xx, ct, b, sv):
        return backward_saved(lambda q2, x2: st.apply(q2, x2, b), q, xx, names, sv, b)(ct)

    f_full = live_matmul_flops(jax.make_jaxpr(full)(p, x, cts, batch))
    f_kept = live_matmul_flops(jax.make_jaxpr(kept)(p, x, cts, batch, saved)) if saved else f_full
    nbytes = sum(int(a.size) * a.dtype.itemsize for a in saved)
    return RematFigures(nbytes, f_full, max(0.0, f_full - f_kept))


def remat_figures(stages, layout, batch, compute_dtype, names) -> tuple[RematFigures, ...]:
    """Per stage (the last, fused one never saves: zeros), :class:`RematFigures` of keeping the
    activations named ``names``, from abstract shapes (identical stages traced once).

    Args:
      stages, layout: the model's stages and chunk layout.
      batch: the abstract batch of one pass (``ShapeDtypeStruct`` leaves).
      compute_dtype: dtype of the compute params.
      names: ``checkpoint_name`` names.
    """
    from chunkjax.trace import stage_signature, stage_inputs
    out, cache = [], {}
    ins = stage_inputs(stages, layout, batch, compute_dtype)
    for i, (st, (p, x)) in enumerate(zip(stages, ins)):
        if i == len(stages) - 1 or not names:
            out.append(RematFigures(0, 0.0, 0.0))
            continue
        sig = stage_signature(st, p, x)
        if sig not in cache:
            cache[sig] = _stage_figures(st, p, x, batch, tuple(names))
        out.append(cache[sig])
    return tuple(out)


def with_remat(traces, figures, remat) -> tuple:
    """The stage traces of a step run with remat options ``remat`` (one per stage): a ``"save"``
    stage holds its saved activations on the device from its forward to its backward (added to
    its saved input bytes: the memory tide carries them); an ``"offload"`` stage holds two
    stages' worth at its moments (its own being moved, the neighbour's in flight: added to its
    transient bytes) and moves them down in the forward and up in the backward
    (``offload_bytes``); both remove ``saved_flops`` of recompute (``StageTrace.saved_flops``)."""
    out = []
    for t, f, r in zip(traces, figures, remat):
        if r == FULL or not f.saved_bytes:
            out.append(t)
        elif r == SAVE:
            out.append(dataclasses.replace(t, input_bytes=t.input_bytes + f.saved_bytes, saved_flops=f.saved_flops))
        else:
            out.append(dataclasses.replace(t, temp_bytes=t.temp_bytes + 2 * f.saved_bytes,
                                           offload_bytes=f.saved_bytes, saved_flops=f.saved_flops))
    return tuple(out)
