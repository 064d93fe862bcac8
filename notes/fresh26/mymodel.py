"""A fresh user's model (not from models/): tied embedding used twice (input and output head),
a list of MoE-ish blocks with a soft router over stacked experts, a learnable scalar temperature,
an int32 Param buffer (frozen by chunkjax's default), and a counter Variable the loss advances."""
import jax, jax.numpy as jnp, optax
from flax import nnx


class Counter(nnx.Variable):
    pass


class MoEBlock(nnx.Module):
    def __init__(self, d, h, n_experts, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.router = nnx.Linear(d, n_experts, rngs=rngs)
        k1, k2 = jax.random.split(rngs.params())
        self.w_in = nnx.Param((jax.random.normal(k1, (n_experts, d, h)) / jnp.sqrt(d)).astype(jnp.float32))
        self.w_out = nnx.Param((jax.random.normal(k2, (n_experts, h, d)) / jnp.sqrt(h)).astype(jnp.float32))

    def __call__(self, x):
        y = self.norm(x)
        gate = jax.nn.softmax(self.router(y), axis=-1)            # (B, T, E)
        hid = jax.nn.gelu(jnp.einsum("btd,edh->bteh", y, self.w_in))
        out = jnp.einsum("bteh,ehd->bted", hid, self.w_out)
        return x + jnp.einsum("bte,bted->btd", gate, out)


class TiedMoE(nnx.Module):
    def __init__(self, vocab=64, d=32, h=48, n_experts=4, n_blocks=3, *, rngs, count=True):
        self.count = count
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jnp.arange(16, dtype=jnp.int32))   # an int "param" buffer
        self.pos_embed = nnx.Param((jax.random.normal(rngs.params(), (16, d)) * 0.02).astype(jnp.float32))
        self.blocks = nnx.List([MoEBlock(d, h, n_experts, rngs) for _ in range(n_blocks)])
        self.final_norm = nnx.RMSNorm(d, rngs=rngs)
        self.temp = nnx.Param(jnp.asarray(1.0, jnp.float32))    # a scalar leaf
        self.calls = Counter(jnp.zeros((), jnp.int32))

    def __call__(self, tokens):
        T = tokens.shape[1]
        x = self.embed(tokens) + self.pos_embed[self.pos[:T]]
        for b in self.blocks:
            x = b(x)
        if self.count:
            self.calls[...] = self.calls[...] + 1
        return self.embed.attend(self.final_norm(x)) / self.temp   # tied head


def loss_fn(model, batch):
    logits = model(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def batches(n, B=8, T=12, vocab=64, seed=1):
    key = jax.random.key(seed)
    return [jax.random.randint(k, (B, T + 1), 0, vocab) for k in jax.random.split(key, n)]


def make(batch, seq):
    """planner CLI factory"""
    model = nnx.eval_shape(lambda: TiedMoE(rngs=nnx.Rngs(0)))
    return model, loss_fn, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
