"""What a new user found trying chunkjax with their own small NNX model (helper ``newuser``).

Each test asserts the right value or behaviour against a reference (plain optax, float32 on the
CPU) where it is numeric. A test of a failure not fixed here is ``xfail(strict=True)`` with the
exact reason, so the lead can assign it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import chunkjax as cj


def _lnf_mask(tree):
    """A mask by leaf name, as a user writes it: weight decay on the final layer norm only."""
    return jax.tree_util.tree_map_with_path(lambda path, x: "lnf" in jax.tree_util.keystr(path), tree)


def _masked_by_name():
    return optax.chain(optax.masked(optax.add_decayed_weights(0.5), _lnf_mask), optax.sgd(1e-2))


def test_mask_by_a_leaf_name_outside_the_probe_tree_is_refused():
    """A mask by a name the elementwise probe's tree does not have ('lnf') passed the probe, and
    the chunks (flat arrays with no names) then never got the masked transformation: the run
    silently trained without the decay (my decoder: loss 1.5e-3 relative off nnx.Optimizer after 4
    steps, the final layer norm's scale 3.5e-2 off). The README promises such masks are refused."""
    params = {"w": jnp.ones((4, 3)), "lnf": jnp.ones((3,))}
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x), params)
    ref_upd, _ = _masked_by_name().update(grads, _masked_by_name().init(params), params)
    np.testing.assert_allclose(ref_upd["lnf"], -1e-2 * (0.1 + 0.5), rtol=1e-6)  # decayed on the whole tree
    np.testing.assert_allclose(ref_upd["w"], -1e-2 * 0.1, rtol=1e-6)
    with pytest.raises(ValueError, match="not elementwise") as e:
        cj.ChunkedOptimizer(params, _masked_by_name(), device_budget="1GiB")
    assert "\n" not in str(e.value)
    for tx in (optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: True, p)),
               optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(1e-2)},
                                     lambda p: jax.tree_util.tree_map_with_path(
                                         lambda k, x: "b" if "lnf" in jax.tree_util.keystr(k) else "a", p))):
        with pytest.raises(ValueError, match="not elementwise"):
            cj.ChunkedOptimizer(params, tx, device_budget="1GiB")
