"""``chunkjax.tied_loop.tied_scan`` (issue 24): the loop of ``jax.lax.scan`` with its buffers made
after its inputs, bit for bit the scan's results (reference: ``jax.lax.scan`` on the same body and
fresh random inputs), looped and unrolled; fresh-zero carry leaves, ``None`` outputs, bf16 and
integer leaves. The memory effect is tests/test_inprogram_micro.py's
``test_program_of_several_looped_backward_moments_compiles_within_its_accounting``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from chunkjax.tied_loop import tied_scan


@pytest.mark.parametrize("unroll", [False, True])
def test_tied_scan_equals_scan(unroll):
    rng = np.random.default_rng()
    xs = (jnp.asarray(rng.normal(size=(5, 3, 4)), jnp.bfloat16), jnp.asarray(rng.normal(size=(5, 4)), jnp.float32),
          jnp.asarray(rng.integers(0, 9, (5, 2)), jnp.int32))
    w = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)
    acc0 = jnp.asarray(rng.normal(size=(4,)), jnp.float32)

    def body(c, x):
        a, b, i = x
        s = c["s"] + (a.astype(jnp.float32) @ w).sum(0)
        return {"s": s, "t": c["t"] * 0.5 + b, "n": c["n"] + i.sum()}, ((a * 2).astype(jnp.bfloat16), None, b @ w, i)

    ref = jax.jit(lambda xs: jax.lax.scan(body, {"s": jnp.zeros(4), "t": acc0, "n": jnp.int32(0)}, xs))(xs)
    init = {"s": jax.ShapeDtypeStruct((4,), jnp.float32), "t": acc0, "n": jnp.int32(0)}
    got = jax.jit(lambda xs: tied_scan(body, init, xs, unroll=unroll))(xs)
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tied_scan_without_scanned_arrays_is_refused():
    with pytest.raises(ValueError, match="at least one scanned array"):
        tied_scan(lambda c, x: (c, x), jnp.zeros(2), None)
