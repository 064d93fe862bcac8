"""A model as a sequence of stages: the unit at which chunkjax fetches chunks and recomputes.

PatrickStar hooks every submodule to learn which chunk is touched when (its *moments*). chunkjax
asks the model instead for an explicit, static sequence of stages: each stage names the
top-level parameter entries it reads and is a pure function ``apply(params_sub, x, batch) -> x``.
The first stage receives ``x=None``; the last returns the scalar loss, or ``(loss, aux)`` (aux: a pytree
that gets no gradient, e.g. a model's updated non-parameter state). Activations may be pytrees;
their integer leaves (masks, positions, RNG counters) carry no cotangent. The runtime fetches a
stage's chunks just before it runs, keeps only each stage's input activation through the forward
pass, and in the backward pass re-fetches the chunks and recomputes the stage with ``jax.vjp``
(activation checkpointing per stage).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from chunkjax.loss_weight import WeightedLoss


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a staged model.

    Attributes:
      name: label used in schedules and reports (e.g. ``"h_3"``).
      param_keys: top-level keys of the params dict this stage reads (a key may be read by
        several stages: a tied embedding is read by the first and the last).
      apply: ``apply(params_sub: dict, x, batch) -> x``; ``params_sub`` holds exactly
        ``param_keys``; the last stage returns a float32 scalar loss.
    """

    name: str
    param_keys: tuple[str, ...]
    apply: Callable

    def __post_init__(self):
        if not self.param_keys:
            raise ValueError(f"stage {self.name!r} reads no parameters: merge it into a neighbour")


def compose_loss(stages, params, batch):
    """Run the stages in order on a full params dict: the plain (un-chunked) loss (the last
    stage's output: the loss or ``(loss, aux)``, see :func:`split_loss`)."""
    x = None
    for st in stages:
        x = st.apply({k: params[k] for k in st.param_keys}, x, batch)
    return x


def split_loss(out):
    """The last stage's output -> ``(loss, aux)``; ``aux`` is None when it returns the loss alone."""
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


def differentiated(loss):
    """The scalar the head's backward differentiates: a :class:`~chunkjax.loss_weight.WeightedLoss`'s
    ``total``, else the loss itself."""
    return loss.total if isinstance(loss, WeightedLoss) else loss


def _floating(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.floating)


def differentiable(fn, x, *, head: bool = False):
    """``(f, xf)``: ``fn(p, x)`` as ``f(p, xf) -> (differentiated, out)`` in ``p`` and ``xf``, the
    floating leaves of ``x`` (the others stay fixed): ``differentiated`` is the floating leaves of
    ``out``, or with ``head`` the loss (:func:`differentiated` of :func:`split_loss`'s first);
    ``out`` is returned as ``jax.vjp``'s aux (:func:`stage_vjp`, :func:`chunkjax.remat.forward_saving`)."""
    xs, tdef = jax.tree.flatten(x)
    fi = [i for i, a in enumerate(xs) if _floating(a)]

    def f(p, xf):
        leaves = list(xs)
        for i, v in zip(fi, xf):
            leaves[i] = v
        out = fn(p, jax.tree.unflatten(tdef, leaves))
        if head:
            out = split_loss(out)
            return differentiated(out[0]), out
        return [a for a in jax.tree.leaves(out) if _floating(a)], out
    return f, [xs[i] for i in fi]


def stage_vjp(fn, p, x, *, head: bool = False):
    """``(out, pull)``: ``out = fn(p, x)`` (a stage's apply on its params ``p`` and activation
    ``x``) differentiated in ``p`` and the floating leaves of ``x`` (integer leaves and typed keys
    carry no cotangent).

    ``pull(ct) -> (dp, dx)``: ``ct`` is the cotangent of the floating leaves of ``out`` (a list, in
    ``jax.tree.leaves`` order) or, with ``head``, of the loss (a weighted loss's ``total``:
    :mod:`chunkjax.loss_weight`); ``dx`` is a list over the floating
    leaves of ``x`` (None when ``x`` is None). With ``head`` ``out`` is ``(loss, aux)``
    (:func:`split_loss`) and ``aux`` gets no gradient.
    """
    f, xf = differentiable(fn, x, head=head)
    _, pull_, out = jax.vjp(f, p, xf, has_aux=True)

    def pull(ct):
        dp, dx = pull_(ct)
        return dp, (None if x is None else dx)

    return out, pull


def stage_reads(stages, layout) -> tuple[tuple[int, ...], ...]:
    """Per stage, the chunk ids it reads (its ``param_keys``' chunks in ``layout``, a
    :class:`chunkjax.layout.ChunkLayout`).

    Raises:
      ValueError: a stage names a top-level key the params do not have (one line naming it).
    """
    check_param_keys(stages, [s.path for s in layout.slots])
    return tuple(layout.chunks_of(st.param_keys) for st in stages)


def check_param_keys(stages, leaf_paths) -> None:
    """Refuse a stage whose ``param_keys`` name no leaf (``leaf_paths``: every leaf's ``"a/b/c"``
    path, as :class:`chunkjax.layout.LeafSlot` writes them).

    Raises:
      ValueError: one line naming the stage, the missing key(s) and the top-level keys there are.
    """
    paths = list(leaf_paths)
    for st in stages:
        missing = [k for k in st.param_keys if not any(p == k or p.startswith(k + "/") for p in paths)]
        if missing:
            raise ValueError(f"stage {st.name!r} names param key(s) {missing} that the params do not have "
                             f"(top-level keys: {sorted({p.split('/')[0] for p in paths})})")


def first_readers(reads) -> dict[int, int]:
    """Chunk id -> the first stage that reads it: the backward completes a chunk's gradient
    there (the last backward moment to touch it)."""
    out: dict[int, int] = {}
    for s, cs in enumerate(reads):
        for c in cs:
            out.setdefault(c, s)
    return out
