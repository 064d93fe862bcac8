"""The front door (issue 22, item 1): an NNX model trained through ``chunkjax.offload`` equals the
standard ``nnx.Optimizer`` loop (fp32, 20 steps, 1e-5 relative) with its parameter chunks in
pinned_host (``device_budget="min"``: the least the plan needs), for (a) a Llama-style decoder with GQA and rotary, (b) a small ViT on a dict batch,
(c) a model with scanned layers, (d) a model with dropout and a LoRA-frozen base.

The two loops stand side by side (:func:`nnx_loop`, :func:`chunkjax_loop`); a test counts the
lines that differ (at most 6).
"""
from __future__ import annotations

import difflib
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import chunkjax
from chunkjax.memory import PINNED_HOST

from _compiles import assert_compiles_only_first, per_step

STEPS = 20
RTOL = 1e-5


# ---- the two loops -------------------------------------------------------------------------------

def nnx_loop(make, tx, loss_fn, batches, wrt=nnx.Param):
    model = make()
    optimizer = nnx.Optimizer(model, tx, wrt=wrt)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt))(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(train_step(model, optimizer, batch)) for batch in batches]
    return losses, model


def chunkjax_loop(make, tx, loss_fn, batches, wrt=nnx.Param):
    model = make()
    step = chunkjax.offload(model, tx, loss_fn, batches[0], trainable=wrt, device_budget="min")

    losses = [float(step(batch)) for batch in batches]
    step.sync(model)
    return losses, model, step


def test_the_loops_differ_in_at_most_6_lines():
    a = inspect.getsource(nnx_loop).splitlines()[1:]
    b = inspect.getsource(chunkjax_loop).splitlines()[1:]
    changed = [ln for ln in difflib.unified_diff(a, b, lineterm="", n=0)
               if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert len([ln for ln in changed if ln.startswith("+")]) <= 6, changed


# ---- (a) Llama-style decoder: RMSNorm, GQA attention with rotary, SwiGLU ----------------------------

class RMSNorm(nnx.Module):
    def __init__(self, d):
        self.scale = nnx.Param(jnp.ones((d,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class Attention(nnx.Module):
    def __init__(self, d, heads, kv_heads, rngs):
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        self.wq = nnx.Linear(d, heads * self.hd, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(d, kv_heads * self.hd, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(d, kv_heads * self.hd, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(heads * self.hd, d, use_bias=False, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        B, T, _ = x.shape
        q = self.wq(x).reshape(B, T, self.h, self.hd)
        k = self.wk(x).reshape(B, T, self.kv, self.hd)
        v = self.wv(x).reshape(B, T, self.kv, self.hd)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        k, v = jnp.repeat(k, self.h // self.kv, axis=2), jnp.repeat(v, self.h // self.kv, axis=2)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(self.hd)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        return self.wo(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(B, T, -1))


def rotary(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


class LlamaBlock(nnx.Module):
    def __init__(self, d, heads, kv_heads, ffn, rngs):
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads, rngs)
        self.w1 = nnx.Linear(d, ffn, use_bias=False, rngs=rngs)
        self.w3 = nnx.Linear(d, ffn, use_bias=False, rngs=rngs)
        self.w2 = nnx.Linear(ffn, d, use_bias=False, rngs=rngs)

    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.n1(x), cos, sin, mask)
        h = self.n2(x)
        return x + self.w2(jax.nn.silu(self.w1(h)) * self.w3(h))


class Llama(nnx.Module):
    def __init__(self, vocab=64, d=32, heads=4, kv_heads=2, layers=2, ffn=64, seq=16, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([LlamaBlock(d, heads, kv_heads, ffn, rngs) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)
        self.positions = nnx.Variable(jnp.arange(seq, dtype=jnp.int32))  # an integer leaf (constant)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))              # an integer counter
        self.hd = d // heads

    def __call__(self, tokens):
        self.calls[...] += 1
        T = tokens.shape[1]
        pos = self.positions[...][:T].astype(jnp.float32)
        freqs = pos[:, None] / 10000.0 ** (jnp.arange(self.hd // 2) / (self.hd // 2))
        cos, sin = jnp.cos(freqs)[None, :, None, :], jnp.sin(freqs)[None, :, None, :]
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def token_batches(vocab=64, rows=4, seq=16, n=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.integers(0, vocab, (rows, seq + 1)), jnp.int32) for _ in range(n)]


# ---- (b) a small ViT on images (dict batch: images + labels) ------------------------------------------

class ViTBlock(nnx.Module):
    def __init__(self, d, heads, rngs):
        self.n1, self.n2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        # no biases: a key bias has an exactly-zero gradient, Adam on its rounding noise tells nothing
        self.attn = nnx.MultiHeadAttention(heads, d, use_bias=False, decode=False, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.n2(x))))


class ViT(nnx.Module):
    def __init__(self, image=8, patch=4, d=32, heads=2, layers=2, classes=10, *, rngs):
        self.patch, n = patch, (image // patch) ** 2
        self.proj = nnx.Linear(patch * patch * 3, d, rngs=rngs)
        self.cls = nnx.Param(jax.random.normal(rngs.params(), (1, 1, d)) * 0.02)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, n + 1, d)) * 0.02)
        self.blocks = nnx.List([ViTBlock(d, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, images):
        B, H, W, C = images.shape
        p = self.patch
        x = images.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, -1, p * p * C)
        x = jnp.concatenate([jnp.broadcast_to(self.cls[...], (B, 1, self.cls.shape[-1])), self.proj(x)], 1)
        x = x + self.pos[...]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x[:, 0]))


def vit_loss(model, batch):
    logits = model(batch["images"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()


def image_batches(rows=4, n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [{"images": jnp.asarray(rng.normal(size=(rows, 8, 8, 3)), jnp.float32),
             "labels": jnp.asarray(rng.integers(0, 10, (rows,)), jnp.int32)} for _ in range(n)]


# ---- (c) scanned layers (nnx.vmap-made blocks, nnx.scan over them) ------------------------------------

class MLPBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.fc2(jax.nn.gelu(self.fc1(self.norm(x))))


class ScannedLM(nnx.Module):
    def __init__(self, vocab=64, d=32, layers=3, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return MLPBlock(d, rngs)

        self.layers = make(rngs)
        self.out = nnx.Linear(d, vocab, rngs=rngs)
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))

    def __call__(self, tokens):
        self.steps[...] += 1

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.out(body(self.embed(tokens), self.layers))


# ---- (d) dropout and a LoRA-frozen base --------------------------------------------------------------

class LoRABlock(nnx.Module):
    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.fc = nnx.LoRALinear(d, d, lora_rank=4, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.gelu(self.fc(self.norm(x))))


class LoRALM(nnx.Module):
    def __init__(self, vocab=64, d=32, layers=3, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([LoRABlock(d, rngs) for _ in range(layers)])
        self.out = nnx.LoRALinear(d, vocab, lora_rank=4, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.out(x)


# ---- the runs ----------------------------------------------------------------------------------------

CASES = {
    "llama": (lambda: Llama(rngs=nnx.Rngs(0)), lm_loss, token_batches, nnx.Param),
    "vit": (lambda: ViT(rngs=nnx.Rngs(0)), vit_loss, image_batches, nnx.Param),
    "scanned": (lambda: ScannedLM(rngs=nnx.Rngs(0)), lm_loss, token_batches, nnx.Param),
    "lora": (lambda: LoRALM(rngs=nnx.Rngs(0, dropout=1)), lm_loss, token_batches, nnx.LoRAParam),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def run(request):
    make, loss_fn, batches_of, wrt = CASES[request.param]
    batches = batches_of()
    ref_losses, ref_model = nnx_loop(make, optax.adamw(1e-3), loss_fn, batches, wrt)
    losses, model, step = chunkjax_loop(make, optax.adamw(1e-3), loss_fn, batches, wrt)
    return request.param, make, (ref_losses, ref_model), (losses, model, step)


def test_losses_equal_the_nnx_loop(run):
    name, _, (ref, _), (got, _, _) = run
    np.testing.assert_allclose(got, ref, rtol=RTOL, err_msg=name)


def test_parameter_chunks_are_in_pinned_host(run):
    _, _, _, (_, _, step) = run
    kinds = step.schedule.param_kinds
    assert sum(k == PINNED_HOST for k in kinds) >= max(1, len(kinds) // 2), kinds


def test_synced_model_equals_the_nnx_loop(run):
    name, _, (_, ref_model), (_, model, _) = run
    ref, got = nnx.state(ref_model), nnx.state(model)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(ref), jax.tree_util.tree_leaves_with_path(got)):
        assert a.dtype == b.dtype, (name, path)
        if jnp.issubdtype(a.dtype, jnp.floating):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=f"{name} {path}")
        elif not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(b, a, err_msg=f"{name} {path}")


def test_integer_leaves_keep_dtype_and_value(run):
    name, make, _, (_, model, _) = run
    fresh = make()
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx.state(fresh)),
                                 jax.tree_util.tree_leaves_with_path(nnx.state(model))):
        if jnp.issubdtype(a.dtype, jnp.integer) and "count" not in jax.tree_util.keystr(path) \
                and "calls" not in jax.tree_util.keystr(path) and "steps" not in jax.tree_util.keystr(path):
            assert b.dtype == a.dtype and np.array_equal(a, b), (name, path)
    if name in ("llama", "scanned"):  # counters advance once per step, as in the nnx loop
        counter = model.calls if name == "llama" else model.steps
        assert counter[...].dtype == jnp.int32 and int(counter[...]) == STEPS


def test_frozen_leaves_are_bit_identical(run):
    name, make, _, (_, model, _) = run
    if name != "lora":
        return
    fresh = make()
    base = nnx.state(fresh, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    after = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(after)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    adapters = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(nnx.state(fresh, nnx.LoRAParam)), adapters))


# ---- blocks with rematerialisation (nnx.remat on the method, around the call, jax.checkpoint inside) ----

class RematBlock(LlamaBlock):
    """A Llama block whose call is ``nnx.remat``-ed and checkpoints its MLP inside."""

    @nnx.remat
    def __call__(self, x, cos, sin, mask):
        x = x + self.attn(self.n1(x), cos, sin, mask)
        return x + jax.checkpoint(lambda h: self.w2(jax.nn.silu(self.w1(h)) * self.w3(h)))(self.n2(x))


class RematLlama(Llama):
    """Llama with :class:`RematBlock` s; every other block's call is also wrapped in ``nnx.remat``
    by the loop (a remat equation around the block call)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        for blk in self.blocks:
            blk.__class__ = RematBlock

    def __call__(self, tokens):
        self.calls[...] += 1
        T = tokens.shape[1]
        freqs = self.positions[...][:T].astype(jnp.float32)[:, None] / 10000.0 ** (jnp.arange(self.hd // 2) / (self.hd // 2))
        cos, sin = jnp.cos(freqs)[None, :, None, :], jnp.sin(freqs)[None, :, None, :]
        mask = jnp.tril(jnp.ones((T, T), bool))[None, None]
        x = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            x = nnx.remat(lambda b, y: b(y, cos, sin, mask))(blk, x) if i % 2 else blk(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


class ScannedRematLM(ScannedLM):
    """ScannedLM whose scanned body is ``nnx.remat``-ed."""

    def __call__(self, tokens):
        self.steps[...] += 1

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def body(x, block):
            return block(x)

        return self.out(body(self.embed(tokens), self.layers))


#: steps of the remat comparison (each step's loss compared; the compiles, not the steps, are most of its time)
REMAT_STEPS = 6


@pytest.mark.parametrize("make", [lambda: RematLlama(rngs=nnx.Rngs(0)), lambda: ScannedRematLM(rngs=nnx.Rngs(0))],
                         ids=["list", "scanned"])
def test_remat_blocks_equal_the_nnx_loop(make):
    """Blocks under nnx.remat / jax.checkpoint: found as blocks, the losses equal the nnx loop's
    (which rematerialises the same way), and the FLOPs count each block's forward once."""
    batches = token_batches(n=REMAT_STEPS)
    ref, _ = nnx_loop(make, optax.adamw(1e-3), lm_loss, batches)
    got, _, step = chunkjax_loop(make, optax.adamw(1e-3), lm_loss, batches)
    np.testing.assert_allclose(got, ref, rtol=RTOL)
    listed = isinstance(make(), RematLlama)
    n_blocks = 2 if listed else 3
    assert [s.name for s in step.stages][1:-1] == [f"block_{i}" for i in range(n_blocks)]
    plain = chunkjax.discover.discover(Llama(rngs=nnx.Rngs(0)) if listed else ScannedLM(rngs=nnx.Rngs(0)),
                                       lm_loss, batches[0])
    assert step.discovery.forward_flops == plain.forward_flops > 0
    assert step.problem.flops_per_step == 3 * plain.forward_flops


# ---- FLOPs: counted from the traced program, on every backend --------------------------------------------

def test_matmul_flops_counts_dots_convs_and_scans():
    from chunkjax.cost import matmul_flops
    a, b = jnp.zeros((4, 8, 16)), jnp.zeros((4, 16, 32))
    assert matmul_flops(jax.make_jaxpr(lambda a, b: jnp.einsum("bik,bkj->bij", a, b))(a, b)) == 2 * 4 * 8 * 16 * 32
    x, k = jnp.zeros((2, 8, 8, 3)), jnp.zeros((3, 3, 3, 5))
    conv = jax.make_jaxpr(lambda x, k: jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(x, k)
    assert matmul_flops(conv) == 2 * (2 * 8 * 8 * 5) * (3 * 3 * 3)
    w, h = jnp.zeros((6, 16, 16)), jnp.zeros((2, 16))
    scan = jax.make_jaxpr(lambda w, h: jax.lax.scan(lambda c, wi: (jax.checkpoint(jnp.dot)(c, wi), None), h, w)[0])
    assert matmul_flops(scan(w, h)) == 6 * 2 * 2 * 16 * 16


def test_front_door_flops_are_three_forwards_of_the_matmuls():
    """The plan's FLOPs are 3 x the forward's matrix products (not XLA's cost analysis of a
    lowered program, which the GPU plugin does not give: the plan then had no compute)."""
    model, batch = Llama(rngs=nnx.Rngs(0)), token_batches(n=1)[0]
    p = chunkjax.plan_offload(model, optax.adam(1e-3), lm_loss, batch)
    n = sum(int(np.size(a)) for a in jax.tree.leaves(nnx.state(model, nnx.Param)) if a.ndim == 2)
    rows, tokens = batch.shape[0], batch.shape[1] - 1
    lm = 2 * (n - 64 * 32) * rows * tokens  # every 2-D weight but the embedding table is a matmul
    attn = len(model.blocks) * 2 * 2 * rows * tokens * tokens * 32  # q.k and p.v per block
    assert p.problem.flops_per_step == 3 * (lm + attn)


# ---- stage discovery and bad input -----------------------------------------------------------------------

def test_stages_found():
    d = chunkjax.discover.discover(Llama(rngs=nnx.Rngs(0)), lm_loss, token_batches(n=1)[0])
    assert d.mode == "list" and d.blocks == ("blocks",)
    assert [s.name for s in d.stages] == ["pre", "block_0", "block_1", "post"]
    assert d.stages[0].param_keys == ("embed/embedding",)
    s = chunkjax.discover.discover(ScannedLM(rngs=nnx.Rngs(0)), lm_loss, token_batches(n=1)[0])
    assert s.mode == "scan" and s.blocks == ("layers",) and len(s.stages) == 5
    assert "layers/2/fc1/kernel" in s.stages[3].param_keys


def test_bad_batches_are_one_line():
    model = Llama(rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pass tokens as"):
        chunkjax.offload(model, optax.adamw(1e-3), lm_loss, jnp.zeros((17,), jnp.int32))
    with pytest.raises(ValueError, match="blocks="):
        chunkjax.offload(model, optax.adamw(1e-3), lm_loss, token_batches(n=1)[0], blocks="nope")
    with pytest.raises(TypeError, match="optax transformation"):
        chunkjax.offload(model, "adam", lm_loss, token_batches(n=1)[0])


def test_evaluate_runs_the_model_in_eval_mode(run):
    name, _, _, (_, model, step) = run
    if name != "lora":  # dropout: eval mode matters
        return
    batch = token_batches(n=1, seed=7)[0]
    model.eval()
    np.testing.assert_allclose(float(step.evaluate(batch)), float(lm_loss(model, batch)), rtol=RTOL)


def test_another_batch_shape_is_one_line(run):
    name, _, _, (_, _, step) = run
    if name != "llama":
        return
    with pytest.raises(ValueError, match="differ from the planned"):
        step(token_batches(rows=2, n=1)[0])


def test_zero_3_over_8_devices_equals_the_nnx_loop():
    assert len(jax.devices()) >= 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    batches = image_batches(rows=8, n=3)  # one block: the 8 ranks' slices of every chunk, as with more
    ref, ref_model = nnx_loop(lambda: ViT(layers=1, rngs=nnx.Rngs(0)), optax.adamw(1e-3), vit_loss, batches)
    model = ViT(layers=1, rngs=nnx.Rngs(0))
    step = chunkjax.offload(model, optax.adamw(1e-3), vit_loss, batches[0], device_budget="min",
                            mesh=chunkjax.data_mesh(), zero_stage=3)
    np.testing.assert_allclose([float(step(b)) for b in batches], ref, rtol=RTOL)
    step.sync(model)  # chunk by chunk from the ranks' slices into the released model
    for a, b in zip(jax.tree.leaves(nnx.state(ref_model, nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


# ---- a new user's mistakes: one line each (abstract model, misspelt keyword, sync mismatch, no block list)

class DictLM(LoRALM):
    """LoRALM's blocks held in an nnx.Dict: discovery finds no block list."""

    def __init__(self, *, rngs, layers=3):
        super().__init__(layers=layers, rngs=rngs)
        self.blocks = nnx.Dict({f"b{i}": blk for i, blk in enumerate(self.blocks)})

    def __call__(self, tokens):
        x = self.embed(tokens)
        for i in range(len(self.blocks)):
            x = self.blocks[f"b{i}"](x)
        return self.out(x)


@pytest.fixture(scope="module")
def small_step():
    return chunkjax.offload(LoRALM(rngs=nnx.Rngs(0, dropout=1)), optax.adam(1e-3), lm_loss, token_batches(n=1)[0])


def test_abstract_model_is_refused_in_one_line():
    model = nnx.eval_shape(lambda: LoRALM(rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="concrete parameters.*chunkjax.fit.prepare") as e:
        chunkjax.offload(model, optax.adam(1e-3), lm_loss, token_batches(n=1)[0])
    assert "\n" not in str(e.value)


def test_misspelt_keyword_names_offload():
    with pytest.raises(TypeError, match=r"^offload\(\) got an unexpected keyword argument 'device_budgt'$"):
        chunkjax.offload(LoRALM(rngs=nnx.Rngs(0)), optax.adam(1e-3), lm_loss, token_batches(n=1)[0],
                         device_budgt="64MiB")


def test_sync_into_another_model_is_one_line_and_writes_nothing(small_step):
    for other, words in [(LoRALM(d=48, rngs=nnx.Rngs(1)), "'blocks/0/fc/bias' is (48,) float32, the step's is (32,)"),
                         (LoRALM(layers=2, rngs=nnx.Rngs(1)), "lacks parameter 'blocks/2/"),
                         (LoRALM(layers=4, rngs=nnx.Rngs(1)), "has parameter 'blocks/3/")]:
        before = jax.tree.map(np.array, nnx.state(other, nnx.Param))
        with pytest.raises(ValueError, match=re.escape(words)) as e:
            small_step.sync(other)
        assert "\n" not in str(e.value)
        after = nnx.state(other, nnx.Param)
        assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, np.array(b)), before, after))


def test_no_block_list_warns_and_blocks_error_names_nnx_list():
    model, batch = DictLM(rngs=nnx.Rngs(0, dropout=1)), token_batches(n=1)[0]
    with pytest.warns(UserWarning, match="found no block list: the model is one stage.*nnx.List \\(or a list\\), or scan over one stacked block"):
        d = chunkjax.discover.discover(model, lm_loss, batch)
    assert len(d.stages) == 1
    with pytest.raises(ValueError, match="nnx.List"):
        chunkjax.discover.discover(model, lm_loss, batch, blocks="blocks")


def test_later_steps_trace_and_compile_nothing(small_step):
    """Steps 2 and 3 of the front door run the first step's programs: nothing traced or lowered,
    the model's side state (dropout key) included (a count, not a time)."""
    step, batches = small_step, token_batches(n=3, seed=5)
    assert step.discovery.mutable  # side state that each step returns
    assert_compiles_only_first(per_step(lambda i: float(step(batches[i])), 3), "OffloadedStep")


def test_plan_offload_plans_an_abstract_model_as_offload_does(small_step):
    """The plan-only entry: an abstract model (its dropout key abstract too), nothing allocated,
    the layout, FLOPs and schedule offload planned for the same budget."""
    abstract = nnx.eval_shape(lambda: LoRALM(rngs=nnx.Rngs(0, dropout=1)))
    p = chunkjax.plan_offload(abstract, optax.adam(1e-3), lm_loss, token_batches(n=1)[0],
                              device_budget=small_step.report.budget_bytes)
    assert p.problem.layout.n_chunks == small_step.layout.n_chunks
    assert p.problem.flops_per_step == small_step.problem.flops_per_step > 0
    # the figures take the plan as they take the step: the same tide bars and residency image
    from chunkjax import plots
    tide = [b.get_height() for b in plots.plot_tide(p).axes[0].patches]
    assert tide == [b.get_height() for b in plots.plot_tide(p.problem, schedule=p.schedule).axes[0].patches]
    a = plots.plot_schedule(p).axes[0].images[0].get_array()
    assert (a == plots.plot_schedule(p.problem, schedule=p.schedule).axes[0].images[0].get_array()).all()
    assert p.schedule.counts() == small_step.schedule.counts()
    assert p.schedule.predicted.peak_device_bytes == small_step.schedule.predicted.peak_device_bytes
    assert "stages" in p.summary() and "predicted step" in p.summary()
    assert chunkjax.plan_offload(abstract, optax.adam(1e-3), lm_loss, token_batches(n=1)[0]).schedule is None
    with pytest.raises(TypeError, match=r"^plan_offload\(\) got an unexpected keyword argument 'strict'$"):
        chunkjax.plan_offload(abstract, optax.adam(1e-3), lm_loss, token_batches(n=1)[0], strict=True)


# ---- the model's parameters released once the step holds them (the model not held twice) -------------

def _param_bytes(model) -> int:
    """Bytes of the arrays (jax or numpy) the model's parameters hold."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(nnx.state(model, nnx.Param))
               if isinstance(a, (jax.Array, np.ndarray)))


@pytest.fixture(scope="module")
def released():
    """A scanned model of a few MB, built on another device than the step's (as a model built in
    host memory for a GPU step), offloaded with every chunk in pinned_host: the live arrays before
    and after, weak references to its parameter arrays, a copy of its initial params."""
    import gc
    import weakref
    with jax.default_device(jax.devices()[-1]):
        model = ScannedLM(vocab=256, d=256, layers=4, rngs=nnx.Rngs(0))
    batch = token_batches(n=1)[0]
    initial = jax.tree.map(np.array, nnx.state(model, nnx.Param))
    arrays = jax.tree.leaves(nnx.state(model, nnx.Param))
    refs, model_bytes = [weakref.ref(a) for a in arrays], sum(a.nbytes for a in arrays)
    del arrays
    gc.collect()
    before = {id(x) for x in jax.live_arrays()}
    step = chunkjax.offload(model, optax.adamw(1e-3), lm_loss, batch, device_budget="min")
    gc.collect()
    new = [x for x in jax.live_arrays() if id(x) not in before]
    state_ids = {id(x) for x in jax.tree.leaves(step.state) if isinstance(x, jax.Array)}
    outside = sum(x.nbytes for x in new if id(x) not in state_ids)
    del new
    return model, batch, step, initial, refs, model_bytes, outside


def test_offload_frees_the_model_parameter_arrays(released):
    model, _, step, _, refs, model_bytes, outside = released
    assert model_bytes > 4 * 2**20 and step.released_bytes == model_bytes
    assert all(r() is None for r in refs)          # every parameter array of the model freed
    assert _param_bytes(model) == 0                # the model references no parameter data
    assert all(chunkjax.released.is_released(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # new live arrays besides the step's chunks: the batch, the side leaves; not the model again
    assert outside < 0.05 * model_bytes, (outside, model_bytes)
    # the model keeps its structure: shapes and sizes as before
    n = sum(np.size(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n * 4 == model_bytes


def test_released_model_forward_is_one_line(released):
    model, batch, step, *_ = released
    for run_forward in (lambda: lm_loss(model, batch), lambda: nnx.jit(lm_loss)(model, batch),
                        lambda: nnx.value_and_grad(lm_loss)(model, batch),
                        lambda: jax.tree.map(np.asarray, nnx.state(model))):
        with pytest.raises(chunkjax.released.ReleasedParamsError, match=r"call step\.sync\(model\) first") as e:
            run_forward()
        assert "\n" not in str(e.value) and "released by chunkjax.offload" in str(e.value)
    with pytest.raises(chunkjax.released.ReleasedParamsError, match=r"sync\(model\) first") as e:
        chunkjax.offload(model, optax.adamw(1e-3), lm_loss, batch)
    assert "\n" not in str(e.value)
    assert chunkjax.plan_offload(model, optax.adamw(1e-3), lm_loss, batch).problem.layout == step.layout


def test_sync_brings_back_bit_identical_params_and_release_again(released):
    model, batch, step, initial, _, model_bytes, _ = released
    step.sync(model)                               # no step taken yet: the initial parameters
    got = nnx.state(model, nnx.Param)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(initial),
                                 jax.tree_util.tree_leaves_with_path(got)):
        assert b.dtype == a.dtype and np.array_equal(np.asarray(b), a), path
        assert b.devices() == {jax.devices()[-1]}, path  # back where the model was built
    assert np.isfinite(float(lm_loss(model, batch)))  # the model's own forward runs again
    assert step.release(model) == model_bytes and _param_bytes(model) == 0
    with pytest.raises(chunkjax.released.ReleasedParamsError):
        lm_loss(model, batch)


def test_keep_model_keeps_the_arrays_and_the_default_releases_even_when_nothing_is_offloaded():
    """keep_model=True keeps the model's arrays (its forward runs on the initial parameters); the
    default releases them whatever the plan offloads: with a budget that keeps every chunk on the
    device, a loop that forgot sync gets ReleasedParamsError, not the initial parameters
    (before: kept, read stale without a word), and sync gives the trained ones."""
    model, batch = LoRALM(rngs=nnx.Rngs(0, dropout=1)), token_batches(n=1)[0]
    held = _param_bytes(model)
    step = chunkjax.offload(model, optax.adam(1e-3), lm_loss, batch, device_budget="min", keep_model=True)
    assert step.released_bytes == 0 and _param_bytes(model) == held
    float(lm_loss(model, batch))                   # the model's own forward still runs
    roomy = LoRALM(rngs=nnx.Rngs(0, dropout=1))
    params = lambda: [np.asarray(a) for a in jax.tree.leaves(nnx.state(roomy, nnx.Param))]  # noqa: E731
    initial = params()
    step = chunkjax.offload(roomy, optax.adam(1e-3), lm_loss, batch, device_budget="1GiB")
    assert set(step.schedule.param_kinds) == {"device"} and step.released_bytes == held
    step(batch)
    with pytest.raises(chunkjax.released.ReleasedParamsError, match="sync"):
        lm_loss(roomy, batch)
    step.sync(roomy)
    trained = params()  # the trained parameters, not the initial ones
    assert len(trained) == len(initial) and any(not np.array_equal(a, b) for a, b in zip(trained, initial))


def test_the_loop_released_the_model_until_sync(run):
    name, _, _, (_, model, step) = run
    assert step.released_bytes == _param_bytes(model) > 0, name


def _main_thread_syncs(run) -> int:
    """Calls of ``run()`` that wait for device values on the main thread (``block_until_ready``,
    ``float``, ``np.asarray`` of a jax array)."""
    import threading

    from jax._src.array import ArrayImpl
    n = [0]

    def counting(orig):
        def wrapper(*a, **k):
            if threading.current_thread() is threading.main_thread():
                n[0] += 1
            return orig(*a, **k)
        return wrapper

    patched = [(ArrayImpl, name) for name in ("block_until_ready", "__array__", "__float__", "item")] + [
        (jax, "block_until_ready")]
    saved = [getattr(o, k) for o, k in patched]
    for o, k in patched:
        setattr(o, k, counting(getattr(o, k)))
    try:
        run()
    finally:
        for (o, k), v in zip(patched, saved):
            setattr(o, k, v)
    return n[0]


def test_the_front_door_adds_no_wait_to_the_engines_step(small_step):
    """Speed (docs/own_model.md, "Speed: what the front door adds per step"): a front-door step
    waits for the device on its main thread exactly as often as the engine's own step on the same
    placed batch (the batch check, its placement and the commit under held signals read no device
    value), and traces nothing."""
    batch = token_batches(n=1)[0]
    small_step(batch)
    small_step.wait()
    front = _main_thread_syncs(lambda: small_step(batch))
    small_step.wait()

    def engine():
        small_step.state, _ = small_step.step(small_step.state, small_step._step_batch(batch))
    assert _main_thread_syncs(engine) == front
    small_step.wait()


def test_sync_into_a_model_with_other_state_is_one_line_and_writes_nothing(small_step):
    """A target built without the dropout stream the step's model had: refused before any write."""
    other = LoRALM(rngs=nnx.Rngs(1))
    for blk in other.blocks:
        blk.drop = nnx.Dropout(0.2)  # no RNG stream held: its rngs node is None
    as_np = lambda a: np.array(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key) else a)
    before = jax.tree.map(as_np, nnx.state(other))
    with pytest.raises(ValueError, match="the model lacks state '.*rngs.*' .*sync into a model built like") as e:
        small_step.sync(other)
    assert "\n" not in str(e.value)
    after = jax.tree.map(as_np, nnx.state(other))
    assert jax.tree.structure(before) == jax.tree.structure(after)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_batch_of_another_structure_or_x64_dtype(small_step):
    """A tuple where an array was planned names the structures; numpy int64 tokens (x64 off) are
    cast to the planned int32 as ``jnp.asarray`` would: the same loss."""
    batch = token_batches(n=1, seed=3)[0]
    with pytest.raises(ValueError, match=re.escape("pytree structure PyTreeDef((*,)) differs from the planned "
                                                   "PyTreeDef(*)")) as e:
        small_step.evaluate((batch,))
    assert "\n" not in str(e.value)
    assert float(small_step.evaluate(np.asarray(batch, np.int64))) == float(small_step.evaluate(batch))
    with pytest.raises(ValueError, match=re.escape("batch dtypes differ from the planned: the batch float32 (planned "
                                                   "int32): pass batches of the example's dtype")) as e:
        small_step.evaluate(np.asarray(batch, np.float32))
    assert "\n" not in str(e.value)


class NestedLM(LoRALM):
    """LoRALM's blocks in a list of two lists (groups of blocks)."""

    def __init__(self, *, rngs):
        super().__init__(layers=4, rngs=rngs)
        self.blocks = nnx.List([nnx.List(list(self.blocks)[:2]), nnx.List(list(self.blocks)[2:])])

    def __call__(self, tokens):
        x = self.embed(tokens)
        for group in self.blocks:
            for blk in group:
                x = blk(x)
        return self.out(x)


def test_nested_block_lists_are_refused_in_one_line():
    model, batch = NestedLM(rngs=nnx.Rngs(0, dropout=1)), token_batches(n=1)[0]
    for blocks in (None, "blocks", "blocks/0"):
        with pytest.raises(ValueError, match="holds lists or is held in one .*one flat nnx.List") as e:
            chunkjax.discover.discover(model, lm_loss, batch, blocks=blocks)
        assert "\n" not in str(e.value)


def test_trainable_matching_nothing_is_refused_in_one_line():
    with pytest.raises(ValueError, match="trainable=.* matches no floating parameter") as e:
        chunkjax.offload(Llama(rngs=nnx.Rngs(0)), optax.adam(1e-3), lm_loss, token_batches(n=1)[0],
                         trainable=nnx.LoRAParam)
    assert "\n" not in str(e.value)


def test_integer_or_bool_loss_is_refused_in_one_line():
    """A loss of integer dtype (here the number of correct next-token guesses, which depends on
    the params) has a zero gradient: plain jax.grad refuses it, so does the front door."""
    def correct(model, tokens):
        return jnp.sum(jnp.argmax(model(tokens[:, :-1]), -1) == tokens[:, 1:])

    for loss_fn in (correct, lambda m, t: correct(m, t) > 3):
        with pytest.raises(TypeError, match=r"loss_fn returns a loss of dtype (int32|bool): return a floating-point") as e:
            chunkjax.offload(Llama(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, token_batches(n=1)[0])
        assert "\n" not in str(e.value)


def test_front_door_checkpoint_into_a_drop_in_optimizer_is_one_line(tmp_path):
    """An offload checkpoint restored into NnxOptimizer / ChunkedOptimizer of the same model:
    one line saying it came from chunkjax.offload and how to restore it, not a leaf-path diff."""
    step = chunkjax.offload(Llama(rngs=nnx.Rngs(0)), optax.adam(1e-3), lm_loss, token_batches(n=1)[0])
    chunkjax.save_checkpoint(tmp_path, 0, step)
    model = Llama(rngs=nnx.Rngs(0))
    for opt in (chunkjax.NnxOptimizer(model, optax.adam(1e-3), device_budget="1GiB"),
                chunkjax.ChunkedOptimizer(nnx.state(model, nnx.Param), optax.adam(1e-3), device_budget="1GiB")):
        with pytest.raises(chunkjax.CheckpointError, match=r"saved by chunkjax.offload .*not by a "
                           rf"{type(opt).__name__}: .*chunkjax.restore_checkpoint\(dir, step\)") as e:
            chunkjax.restore_checkpoint(tmp_path, opt)
        assert "\n" not in str(e.value)


def test_bad_budget_names_every_spelling_the_front_door_takes():
    """chunkjax.budget.parse_budget: the front door's message lists 'auto' and 'min' (fit_step's
    parser, reached later, takes only 'auto')."""
    for bad, err in ((None, TypeError), (1.5, TypeError), ([1], TypeError)):
        with pytest.raises(err, match=r"'auto' or 'min'") as e:
            chunkjax.offload(Llama(rngs=nnx.Rngs(0)), optax.adam(1e-3), lm_loss, token_batches(n=1)[0],
                             device_budget=bad)
        assert "\n" not in str(e.value)


def test_nonfinite_error_through_offload():
    """Session 19: ``chunkjax.offload(..., nonfinite="error")`` (was refused: only "ignore"/"skip"):
    a step whose loss is infinite raises one line naming step 2 and leaves every parameter as the
    first step left it; the next finite step trains on."""
    def loss(model, batch):
        return lm_loss(model, batch["tokens"]) * jnp.mean(batch["scale"])  # a (B,) column

    toks = token_batches(n=3)
    model = LoRALM(rngs=nnx.Rngs(0, dropout=1))
    step = chunkjax.offload(model, optax.adam(1e-3), loss, {"tokens": toks[0], "scale": jnp.ones((4,), jnp.float32)},
                            nonfinite="error")
    assert np.isfinite(float(step({"tokens": toks[0], "scale": jnp.ones((4,), jnp.float32)})))
    step.sync(model)
    before = [np.array(x, copy=True) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    with pytest.raises(chunkjax.NonFiniteError, match=r"^step 2: the loss and gradient norm are not finite") as e:
        step({"tokens": toks[1], "scale": jnp.full((4,), np.inf, jnp.float32)})
    assert "\n" not in str(e.value) and "nothing was updated" in str(e.value)
    step.sync(model)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), before):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert np.isfinite(float(step({"tokens": toks[2], "scale": jnp.ones((4,), jnp.float32)})))


def test_fresh25_bad_inputs_are_one_line_errors_naming_what_to_pass():
    """Session 25's fresh user: a None model, a trainable filter matching nothing, clip_expect='fires'
    for a host spec that never clips, a float64 compute dtype without x64, a NaN learning rate, and
    budgets in PiB (named by the too-large message, so parsed too)."""
    from chunkjax.budget import MAX_BYTES, parse_bytes
    from chunkjax.dtypes import compute_dtype_of
    from chunkjax.host_update import AdamW
    batch = token_batches(n=1)[0]
    cases = [
        (lambda: chunkjax.offload(None, optax.adam(1e-3), lm_loss, batch), TypeError, r"pass the flax nnx.Module"),
        (lambda: chunkjax.offload(Llama(rngs=nnx.Rngs(0)), optax.adam(1e-3), lm_loss, batch, trainable=nnx.LoRAParam),
         ValueError, r"matches no floating parameter.*a Variable type it has"),
        (lambda: chunkjax.offload(Llama(rngs=nnx.Rngs(0)), AdamW(1e-3), lm_loss, batch, clip_expect="fires"),
         ValueError, r"clip_expect='fires' with a host optimizer that does not clip .*set its max_grad_norm"),
        (lambda: compute_dtype_of(jnp.float64), ValueError, r"float64 needs jax.config.update\('jax_enable_x64'"),
        (lambda: AdamW(float("nan")), ValueError, r"learning_rate = nan: must be a finite float"),
        (lambda: AdamW(float("inf")), ValueError, r"must be a finite float"),
        (lambda: parse_bytes("1.5PiB"), ValueError, r"more than the 1 PiB"),
    ]
    for call, err, match in cases:
        with pytest.raises(err, match=match) as e:
            call()
        assert "\n" not in str(e.value)
    assert parse_bytes("1PiB") == MAX_BYTES and parse_bytes("0.5 pib") == 2**49 and parse_bytes("1PB") == 10**15
    assert compute_dtype_of(jnp.float32) == jnp.float32 and compute_dtype_of("bf16") == jnp.bfloat16
    # a model without a block list is one stage, and the summary says so (it read "1 stages (pre .. pre)")
    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))[:, 0]

    line = chunkjax.offload(Mlp(nnx.Rngs(0)), optax.adam(1e-3), lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                            {"x": jnp.ones((4, 8)), "y": jnp.zeros((4,))}).summary()
    assert line.startswith("1 stage (pre: no block list found; blocks= names one"), line
    # a clipping host spec may expect 'fires'; a non-clipping one plans 'rare' under 'auto'
    from chunkjax import clip_plan
    assert clip_plan.resolve("fires", AdamW(1e-3, max_grad_norm=1.0)) == "fires"
    assert clip_plan.resolve("auto", AdamW(1e-3)) == "rare" and clip_plan.resolve("fires", None) == "fires"
