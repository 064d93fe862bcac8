"""A weighted loss: a sum over scored tokens and their count, normalised by the global count.

A last stage that scores only some tokens (a prompt/completion example scores the completion;
padding scores nothing) returns :class:`WeightedLoss` ``(total,
weight)``: the sum of its per-token losses and the number of tokens it scored, instead of their
mean. The step then trains on the token mean of the *global* batch, whatever way the batch is cut
into micro-batches and ZeRO ranks: the gradient is ``d(sum of every part's total) / d(params)``
divided by the sum of every part's weight, and the reported loss that sum of totals over that sum
of weights. A mean per part would weight a token of a part with few scored tokens more than one of
a part with many (a mean of means), so the objective would change with ``micro_batches`` and the
number of ranks.

How (MaxText's habit: ``train.py`` sums ``total_loss`` and ``total_weights`` and divides by the
global ``total_weights``; its gradient accumulation adds each micro-batch's gradient times its
``total_weights`` and divides the sum by theirs):

* the head's backward is seeded with ``1 / W`` (:func:`seed`), ``W`` the part's weight summed over
  the ranks (one scalar ``psum`` on a mesh), so each micro-batch's reduced gradient is its token
  mean over every rank;
* with micro-batches, :mod:`chunkjax.accumulate` sums each part's gradient times its ``W`` and
  multiplies the sum by ``1 / sum(W)``;
* a part (a rank, a micro-batch) with weight 0 adds nothing (its seed is 0); a global batch with
  weight 0 is refused (:func:`require_weight`, one line) before any update starts.

A plain scalar loss runs exactly as before (seed 1, or ``1 / N`` over ``N`` ranks; the mean of the
micro-batches' gradients). The front door (:func:`chunkjax.offload`) takes a scalar loss only (a
``loss_fn`` returning a :class:`WeightedLoss` is refused in one line): use
:func:`chunkjax.fit_step` with stages, or there normalise by the whole batch's count passed in
the batch, times the number of parts (:func:`chunkjax.offload`'s ``loss_fn``). Supporting it in
the front door would carry the weight out of the discovered loss as a second output through the
stage cut (:mod:`chunkjax.discover`): not done yet.

References: MaxText ``train.py``: ``loss_fn`` returns ``total_loss`` and ``total_weights``;
``train_step``'s gradient accumulation adds ``grad * total_weights`` per micro-batch and divides
the sum by the summed ``total_weights``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightedLoss:
    """What a last stage returns for a loss normalised by the global count of scored tokens
    (MaxText's ``total_loss`` and ``total_weights``).

    Attributes:
      total: () float (float32 best): the sum of the per-token losses over the part's scored
        tokens (nats; a prompt token or padding adds 0).
      weight: () float or int: the number of scored tokens of the part (>= 0; any non-negative
        weights summed, e.g. per-token loss weights). It must not depend on the params: it gets
        no gradient.

    The last stage may return ``(WeightedLoss(total, weight), aux)`` as it may return ``(loss,
    aux)``. Example (a masked next-token loss; ``mask`` 1 where a target is scored)::

        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return chunkjax.WeightedLoss(jnp.sum(ce * mask), jnp.sum(mask))
    """

    total: jax.Array
    weight: jax.Array


def is_weighted(loss) -> bool:
    """``loss`` (a last stage's loss, after :func:`chunkjax.stages.split_loss`) is a :class:`WeightedLoss`."""
    return isinstance(loss, WeightedLoss)


def inverse_weight(w):
    """``1 / w`` (() float32), 0 where ``w`` is 0 (a part that scores nothing adds nothing)."""
    w = jnp.asarray(w, jnp.float32)
    return jnp.where(w > 0, 1.0 / jnp.where(w > 0, w, 1.0), 0.0)


def seed(loss: WeightedLoss, weight_sum=lambda w: w):
    """The head's cotangent of ``loss.total`` (() in its dtype): ``1 / W`` with ``W =
    weight_sum(weight)`` (float32; a mesh passes a ``psum`` over its ranks), 0 where ``W`` is 0."""
    return inverse_weight(weight_sum(jnp.asarray(loss.weight, jnp.float32))).astype(jnp.result_type(loss.total))


def as_float32(loss):
    """``loss`` with its values float32 (a scalar loss, or a :class:`WeightedLoss`'s two)."""
    if is_weighted(loss):
        return WeightedLoss(jnp.asarray(loss.total, jnp.float32), jnp.asarray(loss.weight, jnp.float32))
    return jnp.asarray(loss, jnp.float32)


def token_mean(loss):
    """The reported loss: a weighted loss's ``total / weight`` (() float32; 0 for weight 0, as
    MaxText's ``total_loss / (total_weights + EPS)``), a plain loss unchanged."""
    if not is_weighted(loss):
        return loss
    loss = as_float32(loss)
    return jnp.where(loss.weight > 0, loss.total / jnp.where(loss.weight > 0, loss.weight, 1.0), 0.0)


def combine(losses):
    """Micro-batches' weighted losses (each with its global weight) -> one :class:`WeightedLoss`
    (the sums of their totals and of their weights, float32)."""
    losses = [as_float32(l) for l in losses]
    return WeightedLoss(jnp.sum(jnp.stack([l.total for l in losses])), jnp.sum(jnp.stack([l.weight for l in losses])))


#: The refusal of a global batch that scores no token.
NO_SCORED_TOKENS = ("the batch scores no token (its loss weight, summed over every micro-batch and rank, is 0): "
                    "nothing to learn from, and no state was changed; leave such batches out (e.g. skip a batch "
                    "whose targets are all prompt or padding)")


def require_weight(loss, earlier: float = 0.0) -> None:
    """Refuse a batch whose weights (``loss``'s, after its ranks' ``psum``, plus ``earlier``: the
    batch's earlier micro-batches') sum to 0; a plain loss passes. Reads the weight (a device sync
    on the program that computed it; the step calls it before that program's gradients go to any
    update).

    Raises:
      ValueError: :data:`NO_SCORED_TOKENS`.
    """
    loss = loss[0] if isinstance(loss, tuple) else loss  # a last stage's (loss, aux)
    if is_weighted(loss) and not float(loss.weight) + earlier > 0:
        raise ValueError(NO_SCORED_TOKENS)


def check_scalar_loss(loss, who: str, shape_hint: str) -> None:
    """Refuse a loss that cannot be trained, in one line.

    Args:
      loss: the differentiated loss (an array or a ``jax.ShapeDtypeStruct``; a
        :class:`WeightedLoss`'s ``total``).
      who: what returned it, for the message (``"loss_fn"``, ``"the last stage ('head')"``).
      shape_hint: what to return instead of a non-scalar, for the message.

    Raises:
      ValueError: ``loss`` is not a scalar (``"{who} returns shape S: {shape_hint}"``).
      TypeError: ``loss`` is not floating point (an integer or bool loss has a zero gradient
        everywhere: ``jax.grad`` refuses it, training would silently not move).
    """
    if jnp.shape(loss) != ():
        raise ValueError(f"{who} returns shape {jnp.shape(loss)}: {shape_hint}")
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"{who} returns a loss of dtype {jnp.dtype(loss.dtype).name}: return a floating-point scalar (e.g. "
                        "loss.astype(jnp.float32) of a float computation); an integer loss has no gradient")
