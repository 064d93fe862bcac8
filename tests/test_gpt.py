"""The GPT-2 family: parameter counts, config lookup, the chunked cross-entropy, stages."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import chunkjax as cj
from models import gpt


@pytest.mark.parametrize("name", sorted(gpt.CONFIGS))
def test_n_params_is_the_probe_formula_and_the_real_count(name):
    cfg = gpt.get_config(name)
    h, L, V, S = cfg.d_model, cfg.n_layers, cfg.vocab_size, cfg.seq_len
    assert cfg.n_params == V * h + S * h + L * (12 * h * h + 2 * h) + h  # plain_jax_gpt.py
    counted = sum(math.prod(x.shape) for x in jax.tree.leaves(gpt.abstract_params(cfg)))
    assert counted == cfg.n_params
    assert cfg.flops_per_token() == 6 * cfg.n_params + 12 * L * S * h


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abstract_params_are_init_params_shapes(dtype):
    """``abstract_params`` (one block's init traced, its shapes given to every block) is
    ``jax.eval_shape`` of ``init_params``: the same tree, key order, shapes and dtypes, no node shared."""
    cfg = gpt.get_config("micro", n_layers=3)
    a = gpt.abstract_params(cfg, dtype)
    b = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0), dtype))
    assert jax.tree.structure(a) == jax.tree.structure(b) and list(a) == list(b)
    assert jax.tree.leaves(a) == jax.tree.leaves(b)
    assert a["h_0"] is not a["h_1"] and a["h_0"]["attn_c_attn"] is not a["h_1"]["attn_c_attn"]


def test_size_table_values():
    # PatrickStar's table (hidden, layers, heads)
    expect = {"GPT2_1B": (2048, 20, 16), "megatron_1.3B": (2048, 24, 32), "GPT2_2B": (2048, 40, 16),
              "megatron_3.9B": (2560, 48, 40), "GPT2_4B": (2304, 64, 16), "GPT3_6B": (3072, 53, 16),
              "GPT3_8B": (3072, 72, 16), "GPT3_10B": (4096, 50, 16), "GPT3_12B": (4096, 60, 16),
              "GPT3_15B": (4096, 78, 16), "GPT3_18B": (4096, 90, 16), "gpt2-small": (768, 12, 12)}
    for n, (h, L, H) in expect.items():
        c = gpt.get_config(n.lower())
        assert (c.d_model, c.n_layers, c.n_heads, c.seq_len) == (h, L, H, 1024)
    assert abs(gpt.get_config("gpt2-small").n_params / 1e6 - 124) < 2


def test_unknown_name_and_largest():
    with pytest.raises(ValueError, match="unknown model 'gpt9'.*GPT3_6B"):
        gpt.get_config("gpt9")
    # "largest" compares N, never names: megatron_3.9B (3.8e9) < GPT2_4B (4.1e9) < GPT3_6B
    assert gpt.largest(["megatron_3.9B", "GPT2_4B", "gpt2_2b"]) == "GPT2_4B"
    assert gpt.largest(["GPT3_18B", "GPT3_15B"]) == "GPT3_18B"


def test_chunked_cross_entropy_equals_full():
    cfg = gpt.get_config("micro")
    rng = np.random.default_rng(7)
    p = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))
    sub = {"ln_f": p["ln_f"], "wte": p["wte"]}
    x = jnp.asarray(rng.normal(size=(4, 64, cfg.d_model)), jnp.float32)
    t = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 64)), jnp.int32)
    full = lambda p, x: gpt.head_loss(p, x, t, piece_tokens=10**9)
    pieces = lambda p, x: gpt.head_loss(p, x, t, piece_tokens=32)
    (l1, g1), (l2, g2) = (jax.jit(jax.value_and_grad(f, (0, 1)))(sub, x) for f in (full, pieces))
    np.testing.assert_allclose(float(l2), float(l1), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)


def test_stages_compose_to_the_model_loss():
    cfg = gpt.get_config("micro")
    rng = np.random.default_rng(3)
    p = jax.jit(gpt.init_params, static_argnums=0)(cfg, jax.random.key(int(rng.integers(1 << 30))))
    b = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
    stages = gpt.gpt_stages(cfg)
    assert [s.name for s in stages] == ["embed", "h_0", "h_1", "h_2", "h_3", "head"]
    logits = jax.jit(lambda p, t: gpt.forward_logits(cfg, p, t))(p, b[:, :-1])
    ref = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b[:, 1:, None], -1))
    np.testing.assert_allclose(float(jax.jit(lambda p, b: cj.compose_loss(stages, p, b))(p, b)), float(ref), rtol=1e-5)
    np.testing.assert_allclose(float(jax.jit(lambda p, b: gpt.loss_fn(cfg, p, b))(p, b)), float(ref), rtol=1e-5)
