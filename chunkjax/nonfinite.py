"""The non-finite policy of a step (``nonfinite=``): what a NaN or inf loss or gradient does.

* ``"ignore"`` (the step's default): no check; the update applies whatever the gradients hold.
* ``"skip"``: a step whose global gradient norm is not finite changes no state (parameters,
  master params, optimizer state and step count stay as they were) and reports
  ``metrics["skipped"]`` True; training goes on.
* ``"error"`` (the main job's default, ``--nonfinite error``): a step whose loss or global
  gradient norm is not finite changes no state, as under ``"skip"``, and the call raises
  :class:`NonFiniteError`: one line naming the step and which of the loss and the gradient norm
  was not finite; the exception's ``state`` is the unchanged state to continue (or checkpoint)
  from, since the call's input state may have been donated.

Under ``"error"`` a non-finite loss with finite gradients is not applied either: the loss's
finiteness is folded into the squared-norm vector every updater's skip reads (:func:`guard`),
so the device, streamed, host and storage updates all leave the step out. The check costs one
device-to-host copy of two scalars after the step's dispatch (the call waits for the backward).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

#: The policies a step takes; the main job's ``--nonfinite`` takes ``error`` and ``skip``.
POLICIES = ("ignore", "skip", "error")


class NonFiniteError(FloatingPointError):
    """A step under ``nonfinite="error"`` had a non-finite loss or gradient norm; nothing was
    updated.

    Attributes:
      step: the optimizer step that failed (1-based: the state's step count + 1), or None when the
        optimizer keeps no count.
      which: ``"loss"``, ``"gradient norm"`` or ``"loss and gradient norm"``.
      loss, grad_norm: the step's values (floats; the norm unscaled).
      state: the state after the call (its values are the input's): continue from it.
      metrics: the call's metrics (``skipped`` True).
    """

    def __init__(self, msg: str, *, step, which, loss, grad_norm, state=None, metrics=None):
        super().__init__(msg)
        self.step, self.which, self.loss, self.grad_norm = step, which, loss, grad_norm
        self.state, self.metrics = state, metrics


def check_policy(policy) -> None:
    """Raises ValueError (one line) for a ``nonfinite`` that is not one of :data:`POLICIES`."""
    if policy not in POLICIES:
        raise ValueError(f"nonfinite={policy!r}: use one of {', '.join(repr(p) for p in POLICIES)}")


def skips(policy: str) -> bool:
    """Whether a step under ``policy`` leaves its state unchanged on a non-finite gradient norm."""
    return policy in ("skip", "error")


def guard(policy: str, grad_sq: jax.Array, loss: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(grad_sq, norm, reported_norm)`` of a step: the (n_chunks,) float32 squared gradient norms
    every updater reads, their global norm, and the norm to report. Under ``"error"`` a
    non-finite ``loss`` (a () float32 token mean) makes ``grad_sq``'s total (and so ``norm``) NaN,
    so that the skip of every updater leaves the step out; ``reported_norm`` stays the gradient's."""
    norm = jnp.sqrt(jnp.sum(grad_sq))
    if policy != "error":
        return grad_sq, norm, norm
    poisoned = grad_sq.at[0].add(jnp.where(jnp.isfinite(loss), 0.0, jnp.nan).astype(grad_sq.dtype))
    return poisoned, jnp.sqrt(jnp.sum(poisoned)), norm


def steps_taken(state) -> int | None:
    """The optimizer step count of a :class:`chunkjax.TrainState` (the first trainable chunk's:
    a host state's ``count``, an optax state's ``count`` leaf, a storage chunk's committed step),
    or None when its optimizer keeps none (e.g. plain SGD)."""
    for master, opt in zip(state.master, state.opt_state):
        if opt is None:
            continue
        committed = getattr(master, "committed_step", None)
        if committed is not None:
            return int(committed)
        for st in (opt if isinstance(opt, tuple) and not hasattr(opt, "_fields") else (opt,)):
            if st is None:
                continue
            count = getattr(st, "count", None)  # a plain tuple's count is its method: not a step count
            if count is not None and not callable(count) and np.ndim(count) == 0 and not hasattr(st, "_fields"):
                return int(count)
            for path, leaf in jax.tree_util.tree_flatten_with_path(st)[0]:
                if any(getattr(k, "name", getattr(k, "key", None)) == "count" for k in path):
                    return int(np.asarray(leaf).ravel()[0])
        return None
    return None


def checked(step, state, metrics):
    """``(state, metrics)`` of a committed step, after :func:`raise_if_nonfinite`."""
    raise_if_nonfinite(step, state, metrics)
    return state, metrics


def raise_if_nonfinite(step, state, metrics) -> None:
    """Under ``step.nonfinite == "error"``: raise :class:`NonFiniteError` when ``metrics``' loss or
    gradient norm is not finite (the step changed no state: :func:`guard`). Waits for the two
    scalars."""
    if step.nonfinite != "error":
        return
    loss, norm = float(metrics["loss"]), float(metrics["grad_norm"])
    bad = [name for name, v in (("loss", loss), ("gradient norm", norm)) if not math.isfinite(v)]
    if not bad:
        return
    n = steps_taken(state)
    which = " and ".join(bad)
    where = f"step {n + 1}" if n is not None else "this step"
    raise NonFiniteError(
        f"{where}: the {which} {'are' if len(bad) > 1 else 'is'} not finite (loss {loss}, gradient norm {norm}), "
        "so nothing was updated (the exception's .state is the unchanged state); lower the learning rate, clip the "
        "gradients, check the batch, or pass nonfinite='skip' to skip such steps",
        step=None if n is None else n + 1, which=which, loss=loss, grad_norm=norm, state=state, metrics=metrics)
