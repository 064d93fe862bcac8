"""Any elementwise optax transformation, applied one chunk at a time.

PatrickStar (section 5, "device-aware operator placement") updates each chunk where its
optimizer state lives. chunkjax does the same with an unchanged optax ``GradientTransformation``:
each chunk has its own optax state built by ``tx.init`` on that chunk, so the update of one chunk
needs only that chunk's gradient, master params and state, and can run wherever the chunk is.

Elementwise transformations (definitions.md: Adam, AdamW, Lion, SGD with momentum, and chains
of them) give the same result chunk by chunk as on the whole pytree, except for one global
quantity: the global gradient norm (``optax.clip_by_global_norm``). chunkjax computes the squared
norm of every gradient chunk as it leaves the backward pass and hands each chunk's update a
one-element *rest-of-model* leaf of magnitude ``sqrt(G^2 - |g_c|^2)``. The tree the optax chain
sees then has exactly the global norm ``G``, so clipping scales chunk ``c`` as it would scale the
whole model. The extra leaf's update is discarded.

.. warning:: a global norm taken of *transformed* updates later in a chain (e.g.
   ``chain(scale_by_adam(), clip_by_global_norm(1.0))``) is not reproduced: only norms of the
   incoming gradients are global. Transformations that read parameter structure (masks by
   leaf name, per-layer trust ratios) see chunks, not leaves, and are not supported.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

#: Master params and optimizer moments are kept in float32 (mixed precision rule).
MASTER_DTYPE = jnp.float32


class ChunkUpdate(NamedTuple):
    """Result of updating one chunk.

    Attributes:
      params: (chunk_size,) compute-dtype params after the step.
      master: (chunk_size,) float32 master params after the step.
      opt_state: the chunk's optax state after the step.
    """

    params: jax.Array
    master: jax.Array
    opt_state: Any


def init_chunk_state(tx: optax.GradientTransformation, master: jax.Array):
    """optax state of one chunk: ``tx.init([master, rest_leaf])``. master: (chunk_size,) f32."""
    return tx.init([master, jnp.zeros((), MASTER_DTYPE)])


def update_chunk(tx: optax.GradientTransformation, grad: jax.Array, master: jax.Array, opt_state,
                 grad_sq_total: jax.Array, grad_sq_chunk: jax.Array, compute_dtype,
                 skip_nonfinite: bool = False, inv_scale: jax.Array | None = None) -> ChunkUpdate:
    """One optimizer step for one chunk (pure; jit it where the chunk's update runs).

    Args:
      tx: any elementwise optax transformation.
      grad: (chunk_size,) gradient in the compute dtype (padding entries are zero).
      master: (chunk_size,) float32 master params.
      opt_state: the chunk's state from :func:`init_chunk_state`.
      grad_sq_total: () float32, squared global gradient norm over all chunks.
      grad_sq_chunk: () float32, squared norm of ``grad`` (as float32).
      compute_dtype: dtype of the returned compute params.
      skip_nonfinite: when ``grad_sq_total`` is not finite (a NaN or inf anywhere in the
        model's gradients), return ``master`` and ``opt_state`` unchanged (the step is skipped,
        as ``optax.apply_if_finite`` does; the optax step count does not advance either).
      inv_scale: () float32, 1 / loss scale: ``grad`` and both squared norms are of the scaled
        loss's gradient and are unscaled here (exact for power-of-two scales).

    Returns:
      :class:`ChunkUpdate`.
    """
    g = grad.astype(MASTER_DTYPE)
    if inv_scale is not None:
        inv = jnp.asarray(inv_scale, MASTER_DTYPE)
        g, grad_sq_total, grad_sq_chunk = g * inv, grad_sq_total * inv * inv, grad_sq_chunk * inv * inv
    rest = jnp.sqrt(jnp.maximum(grad_sq_total - grad_sq_chunk, 0.0)).astype(MASTER_DTYPE)
    updates, new_state = tx.update([g, rest], opt_state, [master, jnp.zeros((), MASTER_DTYPE)])
    new_master = (master + updates[0]).astype(MASTER_DTYPE)
    if skip_nonfinite:
        ok = jnp.isfinite(grad_sq_total)
        new_master = jnp.where(ok, new_master, master)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, opt_state)
    return ChunkUpdate(new_master.astype(compute_dtype), new_master, new_state)


def state_bytes_per_chunk(tx: optax.GradientTransformation, chunk_size: int) -> int:
    """Bytes of one chunk's optax state (abstract: nothing is allocated)."""
    st = jax.eval_shape(lambda: init_chunk_state(tx, jnp.zeros((chunk_size,), MASTER_DTYPE)))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st))


#: Probe tolerance (relative) when checking that ``tx`` is elementwise.
PROBE_RTOL = 1e-4
_MSG_NOT_ELEMENTWISE = (
    "the optax transformation gives different updates chunk by chunk than on the whole pytree ({why}): "
    "it is not elementwise. Per-leaf quantities are not supported (lamb / lars trust ratios, "
    "adaptive_grad_clip, masks by leaf name or ndim such as adamw(mask=...), a global norm of "
    "transformed updates such as chain(scale_by_adam(), clip_by_global_norm(...))); "
    "clip_by_global_norm of the incoming gradients is supported. pass check_tx=False to skip this check")

_MSG_MASKED = (
    "the optax transformation masks leaves (optax.masked, adamw(mask=...), multi_transform), so it is not "
    "elementwise: chunkjax updates flat chunks of many leaves, which have no leaf names or shapes, so the mask would be applied "
    "to the wrong elements (e.g. no weight decay at all); per-leaf weight-decay masks are not supported yet: "
    "drop mask= (weight decay on every parameter, biases and norm scales too) or pass weight_decay=0")


def wrapper_hint(tx, micro_batches: bool = True) -> str:
    """What to pass instead of an optax wrapper that is no ``GradientTransformation`` (``optax.MultiSteps``:
    its ``.gradient_transformation()``), as a suffix for a refusal of ``tx``; ``""`` for anything else.
    ``micro_batches``: the refusing API takes ``micro_batches=`` (the drop-in optimizers do not)."""
    if not callable(getattr(tx, "gradient_transformation", None)):
        return ""
    return (f"; {type(tx).__name__} is a wrapper, not a GradientTransformation: pass tx.gradient_transformation()"
            + (" (or, for several micro-batches in one update, micro_batches=)" if micro_batches else ""))


def refuse_masks(tx: optax.GradientTransformation) -> None:
    """Refuse a masked optax transformation (``optax.masked``, ``adamw(mask=...)``,
    ``multi_transform``/``partition``), even with ``check_tx=False``: a mask picks leaves by name or
    shape, and a chunk (a flat array of many leaves) never gets what the user's tree would, so the
    updates would be silently wrong. Found by the state's structure (:class:`optax.MaskedState`)
    on a three-leaf probe tree, whatever the mask selects. Raises ValueError (one line, what to do)."""
    params = {"a": jnp.zeros((2, 3), jnp.float32), "b": jnp.zeros((5,), jnp.float32), "c": jnp.zeros((4,), jnp.float32)}
    try:
        masked = any(isinstance(x, optax.MaskedState) for x in jax.tree_util.tree_leaves(
            jax.eval_shape(tx.init, params), is_leaf=lambda x: isinstance(x, optax.MaskedState)))
    except Exception:  # noqa: BLE001 - check_elementwise's probe reports a tx that fails on a foreign tree
        masked = False
    if masked:
        raise ValueError(_MSG_MASKED)


def check_elementwise(tx: optax.GradientTransformation) -> None:
    """Refuse an optax transformation that is not elementwise (definitions.md): every path that
    runs ``tx`` chunk by chunk calls this (the staged step through :func:`chunkjax.fit.prepare`,
    the drop-in optimizers). Raises ValueError (one line naming what is not supported) if ``tx``
    does not give the same updates chunk by chunk as on a whole pytree: a three-leaf tree (2x3, 5 and 4 elements, params ~ N(0, 100^2) so that weight decay
    shows) in two chunks ([a, b] and [c]), 3 steps with gradients of norm ~ 40 (above usual
    clipping thresholds). Each chunk's update is called as :func:`optim.update_chunk` calls it
    (the chunk plus a rest-of-model leaf carrying the global norm); the updates are compared
    before they are added to the params (adding them to params ~ 100 would round them)."""
    rng = np.random.default_rng(0)
    shapes = {"a": (2, 3), "b": (5,), "c": (4,)}
    groups = (("a", "b"), ("c",))
    params = {k: jnp.asarray(100 * rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    zero = jnp.zeros((), MASTER_DTYPE)

    def cat(tree, ks):
        return jnp.concatenate([jnp.ravel(tree[k]) for k in ks])

    grads = [{k: jnp.asarray(10 * rng.normal(size=s), jnp.float32) for k, s in shapes.items()} for _ in range(3)]

    @jax.jit  # one compilation instead of one per eager op
    def run(params, grads):
        state = tx.init(params)
        chunks = [cat(params, ks) for ks in groups]
        cstate = [init_chunk_state(tx, m) for m in chunks]
        whole, chunked = [], []
        for g_tree in grads:
            upd, state = tx.update(g_tree, state, params)
            params = optax.apply_updates(params, upd)
            total = sum(jnp.sum(jnp.square(g)) for g in g_tree.values())
            whole.append([cat(upd, ks) for ks in groups])
            row = []
            for j, ks in enumerate(groups):
                g = cat(g_tree, ks)
                rest = jnp.sqrt(jnp.maximum(total - jnp.sum(jnp.square(g)), 0.0))
                u, cstate[j] = tx.update([g, rest], cstate[j], [chunks[j], zero])
                chunks[j] = chunks[j] + u[0]
                row.append(u[0])
            chunked.append(row)
        return whole, chunked

    refuse_masks(tx)
    try:
        whole, chunked = jax.device_get(run(params, grads))
    except Exception as e:  # noqa: BLE001 - any failure on a foreign tree means tx reads structure
        raise ValueError(_MSG_NOT_ELEMENTWISE.format(why=f"it fails on a probe tree: {type(e).__name__}: {e}")) from e
    for step, (w_row, c_row) in enumerate(zip(whole, chunked)):
        for j, (want, got) in enumerate(zip(w_row, c_row)):
            scale = float(np.max(np.abs(want))) + 1e-30
            if not np.allclose(got, want, rtol=PROBE_RTOL, atol=PROBE_RTOL * scale):
                raise ValueError(_MSG_NOT_ELEMENTWISE.format(
                    why=f"probe chunk {j} update differs by {float(np.max(np.abs(got - want))):.3g} "
                        f"(updates up to {scale:.3g}) at step {step + 1}"))
