"""GPT-2 style decoder in Flax (linen), with the PatrickStar size table.

Architecture (identical to ``shared/probes/plain_jax_gpt.py``, so ``n_params`` and
``flops_per_token`` are exactly that formula): learned token and position embeddings,
pre-LayerNorm blocks (LayerNorm with scale only, no biases anywhere), causal multi-head
attention, GELU MLP of width 4h, final LayerNorm, LM head tied to the token embedding.

The model is also exposed as a sequence of :class:`chunkjax.Stage` s (``gpt_stages``): embedding,
one stage per block, head. chunkjax's runtime executes a step stage by stage, fetching each
stage's chunks just before it runs and recomputing a block's internals in the backward pass
(activation checkpointing per block). ``loss_fn`` composes the very same stage functions, so the
plain reference and the chunked step compute the same mathematics.

Params pytree (a dict)::

    wte (V, h)  wpe (S, h)
    h_<i>: {ln_1: {scale (h,)}, attn_c_attn: {kernel (h, 3h)}, attn_c_proj: {kernel (h, h)},
            ln_2: {scale (h,)}, mlp_c_fc: {kernel (h, 4h)}, mlp_c_proj: {kernel (4h, h)}}
    ln_f: {scale (h,)}

Compute runs in the dtype of the params handed in (bf16 compute copies under mixed precision);
LayerNorm statistics and the loss are computed in float32.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from chunkjax.stages import Stage

#: GPT-2 vocabulary padded to a multiple of 64 (as in the probes and Megatron).
GPT2_VOCAB = 50304
SEQ_LEN = 1024


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model hyper-parameters.

    Attributes:
      name: config name (case-insensitive lookup in :data:`CONFIGS`).
      d_model: hidden size h.
      n_layers: number of blocks L.
      n_heads: attention heads (``d_model % n_heads == 0``).
      vocab_size: V (token embedding rows).
      seq_len: S, maximum positions (rows of ``wpe``).
      remat: activation checkpointing per block in the plain reference (chunkjax's staged step
        always recomputes block internals in backward).
    """

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int = GPT2_VOCAB
    seq_len: int = SEQ_LEN
    remat: bool = True

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def n_params(self) -> int:
        """All parameters, tied embedding counted once, positions included."""
        return n_params(self.d_model, self.n_layers, self.vocab_size, self.seq_len)

    def flops_per_token(self, seq: int | None = None) -> int:
        """Training FLOPs per token, ``6N + 12 L S h`` (no recompute credit)."""
        s = self.seq_len if seq is None else seq
        return 6 * self.n_params + 12 * self.n_layers * s * self.d_model


def n_params(h: int, L: int, V: int = GPT2_VOCAB, S: int = SEQ_LEN) -> int:
    """Parameter count of this architecture (the formula of plain_jax_gpt.py)."""
    return V * h + S * h + L * (12 * h * h + 2 * h) + h


_TABLE = {  # name: (hidden, layers, heads) -- PatrickStar's table, seq 1024
    "gpt2-small": (768, 12, 12),
    "GPT2_1B": (2048, 20, 16),
    "megatron_1.3B": (2048, 24, 32),
    "GPT2_2B": (2048, 40, 16),
    "megatron_3.9B": (2560, 48, 40),
    "GPT2_4B": (2304, 64, 16),
    "GPT3_6B": (3072, 53, 16),
    "GPT3_8B": (3072, 72, 16),
    "GPT3_10B": (4096, 50, 16),
    "GPT3_12B": (4096, 60, 16),
    "GPT3_15B": (4096, 78, 16),
    "GPT3_18B": (4096, 90, 16),
    # Between 18B and 20B (issue 24, "aim beyond"): the 4096-wide family with more blocks (each
    # 201.3M params): 94 blocks, 19.14e9 params, the most that one H200 plans with its 64 GiB disk
    # at batch 8 x 1024 on the CPU's traces (96 with the GPU's; docs/storage.md, "Beyond GPT3_18B").
    "GPT3_19B": (4096, 94, 16),
    # Above 18B (issue 24): the shapes of ZeRO-Offload (Ren et al., USENIX ATC'21, the 20B and 40B
    # GPT-2-style models: hidden 8192, 25 / 50 layers), listed as GPT_DS_20B / GPT_DS_40B in
    # PatrickStar's examples/model_builder.py. 64 heads (head dim 128, cuDNN's fused attention)
    # where that file has 16: the head count changes neither the parameters nor 6N FLOPs/token.
    "GPT3_20B": (8192, 25, 64),
    "GPT3_40B": (8192, 50, 64),
}

CONFIGS: dict[str, GPTConfig] = {n: GPTConfig(n, *v) for n, v in _TABLE.items()}
# CPU-sized configs. "tiny" is the demo model (GPT-2 BPE; its embedding spans several chunks);
# "micro" uses a small vocabulary (BPE trained on the training split).
CONFIGS["tiny"] = GPTConfig("tiny", d_model=128, n_layers=4, n_heads=4, seq_len=256)
CONFIGS["micro"] = GPTConfig("micro", d_model=64, n_layers=4, n_heads=4, vocab_size=512, seq_len=128)


def get_config(name: str, **overrides) -> GPTConfig:
    """Look up a config by name, case-insensitively.

    Raises:
      ValueError: unknown name (the message lists the known names).
    """
    for k, cfg in CONFIGS.items():
        if k.lower() == name.lower():
            return dataclasses.replace(cfg, **overrides) if overrides else cfg
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(CONFIGS)}")


def largest(names) -> str:
    """The name with the most parameters (compares N, never names)."""
    return max(names, key=lambda n: get_config(n).n_params)


# ---- modules -------------------------------------------------------------------------------

def attention_implementation(dtype, head_dim: int) -> str:
    """``"cudnn"`` (fused flash attention: no (B, heads, T, T) score tensors) on a GPU for bf16/fp16
    with head_dim a multiple of 8 up to cuDNN's limit (256 on Hopper and later, else 128), else
    ``"xla"``. Both compute the same function. (GPT3_6B has head_dim 192: with XLA's attention a
    block's backward at batch 32 x 1024 needs 8.3 GB of temporaries, with cuDNN's about 1.3 GB.)"""
    if jax.default_backend() != "gpu" or jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return "xla"
    cc = getattr(jax.devices()[0], "compute_capability", "0.0")
    h_max = 256 if float(cc) >= 9.0 else 128
    return "cudnn" if head_dim <= h_max and head_dim % 8 == 0 else "xla"


_init = nn.initializers.normal(0.02)
#: The block's activations named with ``checkpoint_name`` (identity functions: the numbers are the
#: same): ``attn_qkv`` the (B, T, 3h) output of ``attn_c_attn``, ``mlp_fc`` the (B, T, 4h) output of
#: ``mlp_c_fc`` before the GELU. :data:`REMAT_NAMES` are the ones chunkjax's remat options keep
#: (:mod:`chunkjax.remat`): saving ``mlp_fc`` removes the recompute of both MLP matmuls (16 h^2 FLOPs
#: per token, 2/3 of a block's) for 8 h bytes per token in bf16, the most FLOPs per byte kept.
ACTIVATION_NAMES = ("attn_qkv", "mlp_fc")
REMAT_NAMES = ("mlp_fc",)


class Block(nn.Module):
    """One pre-LN transformer block: x + attn(ln_1(x)); x + mlp(ln_2(x)). x: (B, T, h)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        B, T, h = x.shape
        proj_init = nn.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        y = nn.LayerNorm(use_bias=False, name="ln_1")(x)
        qkv = checkpoint_name(_Dense(3 * h, _init, name="attn_c_attn")(y), "attn_qkv")
        q, k, v = jnp.split(qkv.reshape(B, T, 3, cfg.n_heads, h // cfg.n_heads), 3, axis=2)
        q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]
        if x.dtype == jnp.float16 and jax.default_backend() == "cpu":
            # XLA:CPU has no float16 x float16 -> float32 dot (the attention's): widen there
            q, k, v = q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=attention_implementation(x.dtype, h // cfg.n_heads))
        a = a.astype(x.dtype)
        x = x + _Dense(h, proj_init, name="attn_c_proj")(a.reshape(B, T, h))
        y = nn.LayerNorm(use_bias=False, name="ln_2")(x)
        y = jax.nn.gelu(checkpoint_name(_Dense(4 * h, _init, name="mlp_c_fc")(y), "mlp_fc"))
        return x + _Dense(h, proj_init, name="mlp_c_proj")(y)


class _Dense(nn.Module):
    features: int
    kernel_init: object

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        return x @ kernel.astype(x.dtype) if kernel.dtype != x.dtype else x @ kernel


def _layernorm_apply(scale, x):
    return nn.LayerNorm(use_bias=False).apply({"params": {"scale": scale}}, x)


# ---- stages (pure functions over param sub-dicts) ------------------------------------------

def embed_apply(p, x, tokens):
    """Stage 0. p: {wte (V,h), wpe (S,h)}; tokens: (B, T) int -> x (B, T, h) in p's dtype."""
    del x
    T = tokens.shape[1]
    return p["wte"][tokens] + p["wpe"][:T]


def block_apply(cfg: GPTConfig, p, x):
    """A block stage. p: {h_i: block params}; x: (B, T, h)."""
    (name, bp), = p.items()
    return Block(cfg).apply({"params": bp}, x)


#: Tokens per piece of the chunked cross-entropy: logits (piece, V) are materialised one piece at
#: a time (and recomputed in the backward pass), never for the whole batch.
LOSS_PIECE_TOKENS = 1024


def head_loss(p, x, targets, piece_tokens: int = LOSS_PIECE_TOKENS):
    """Last stage: mean next-token cross entropy in float32 nats (chunked over tokens).

    p: {ln_f: {scale}, wte (V, h)} (the tied LM head); x: (B, T, h); targets: (B, T) int.
    The B*T tokens are split into pieces of ``piece_tokens`` (when it divides B*T); forward and
    backward each loop over the pieces (:func:`fused_linear_cross_entropy`), so the head holds
    one piece's (piece_tokens, V) float32 logits at a time, never (B*T, V).
    """
    y = _layernorm_apply(p["ln_f"]["scale"], x)
    h = y.shape[-1]
    y, t = y.reshape(-1, h), targets.reshape(-1)
    n = y.shape[0]
    if n <= piece_tokens or n % piece_tokens:
        logits = (y @ p["wte"].T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).sum() / n
    return fused_linear_cross_entropy(y, p["wte"], t, piece_tokens) / n


def _ce_piece(y, w, t, i, piece):
    yi = jax.lax.dynamic_slice_in_dim(y, i * piece, piece)
    ti = jax.lax.dynamic_slice_in_dim(t, i * piece, piece)
    return yi, ti, (yi @ w.T).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fused_linear_cross_entropy(y, w, t, piece: int):
    """Sum over tokens of ``softmax_cross_entropy(y @ w.T, t)`` (float32), piece by piece.

    y: (n, h) compute dtype; w: (V, h); t: (n,) int; ``piece`` divides n. The backward pass loops
    over the pieces too, recomputing each piece's logits and accumulating dW in float32, so
    memory is one piece of logits plus dW, whatever n (as Liger's fused linear cross-entropy;
    a ``jax.checkpoint``-ed scan let XLA materialise every piece's logits at once on the GPU:
    8.3 GB of temporaries for GPT3_6B at batch 32 x 1024).
    """
    def body(i, acc):
        _, ti, logits = _ce_piece(y, w, t, i, piece)
        return acc + optax.softmax_cross_entropy_with_integer_labels(logits, ti).sum()

    return jax.lax.fori_loop(0, y.shape[0] // piece, body, jnp.zeros((), jnp.float32))


def _dot_f32(a, b):
    """``a @ b`` accumulated in float32. XLA's CPU backend has no float16 x float16 -> float32
    dot: there float16 operands are widened first (same values, exact)."""
    if a.dtype == jnp.float16 and jax.default_backend() == "cpu":
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _flce_fwd(y, w, t, piece):
    return fused_linear_cross_entropy(y, w, t, piece), (y, w, t)


def _flce_bwd(piece, res, g):
    y, w, t = res

    def body(i, carry):
        dy, dw = carry
        yi, ti, logits = _ce_piece(y, w, t, i, piece)
        prob = jax.nn.softmax(logits, axis=-1)
        dl = (prob - jax.nn.one_hot(ti, logits.shape[-1], dtype=prob.dtype)) * g
        dl = dl.astype(y.dtype)
        dy = jax.lax.dynamic_update_slice_in_dim(dy, (dl @ w).astype(y.dtype), i * piece, 0)
        dw = dw + _dot_f32(dl.T, yi)
        return dy, dw

    dy, dw = jax.lax.fori_loop(0, y.shape[0] // piece, body,
                               (jnp.zeros_like(y), jnp.zeros(w.shape, jnp.float32)))
    return dy, dw.astype(w.dtype), None


fused_linear_cross_entropy.defvjp(_flce_fwd, _flce_bwd)


def head_logits(p, x):
    y = _layernorm_apply(p["ln_f"]["scale"], x)
    return (y @ p["wte"].T).astype(jnp.float32)


def gpt_stages(cfg: GPTConfig) -> tuple[Stage, ...]:
    """The model as chunkjax stages: embed, h_0 .. h_{L-1}, head.

    Batch convention: ``batch`` is an int array (B, T+1); inputs are ``batch[:, :-1]`` and targets
    ``batch[:, 1:]``.
    """
    stages = [Stage("embed", ("wte", "wpe"), lambda p, x, b: embed_apply(p, x, b[:, :-1]))]
    for i in range(cfg.n_layers):
        stages.append(Stage(f"h_{i}", (f"h_{i}",), lambda p, x, b, _c=cfg: block_apply(_c, p, x)))
    stages.append(Stage("head", ("ln_f", "wte"), lambda p, x, b: head_loss(p, x, b[:, 1:])))
    return tuple(stages)


def _sub(params, keys):
    return {k: params[k] for k in keys}


def loss_fn(cfg: GPTConfig, params, batch, compute_dtype=None):
    """Plain (un-chunked) loss: the stages composed, remat per block when ``cfg.remat``.

    Args:
      params: the full params dict (float32 master params).
      batch: int (B, T+1).
      compute_dtype: cast params to this dtype first (bf16 mixed precision); None keeps them.
    """
    if compute_dtype is not None:
        params = jax.tree.map(lambda a: a.astype(compute_dtype), params)
    x = None
    for st in gpt_stages(cfg):
        fn = st.apply
        if cfg.remat and st.name.startswith("h_"):
            fn = jax.checkpoint(fn)
        x = fn(_sub(params, st.param_keys), x, batch)
    return x


def forward_logits(cfg: GPTConfig, params, tokens):
    """Logits (B, T, V) float32 for int tokens (B, T)."""
    x = embed_apply(_sub(params, ("wte", "wpe")), None, tokens)
    for i in range(cfg.n_layers):
        x = block_apply(cfg, {f"h_{i}": params[f"h_{i}"]}, x)
    return head_logits(_sub(params, ("ln_f", "wte")), x)


def init_params(cfg: GPTConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params (normal 0.02; residual projections scaled by 1/sqrt(2L); LN scales 1)."""
    k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + cfg.n_layers)
    x = jnp.zeros((1, 8, cfg.d_model), dtype)
    params = {"wte": _init(k_wte, (cfg.vocab_size, cfg.d_model), dtype),
              "wpe": _init(k_wpe, (cfg.seq_len, cfg.d_model), dtype)}
    for i, k in enumerate(k_blocks):
        bp = Block(cfg).init(k, x)["params"]
        params[f"h_{i}"] = bp
    params["ln_f"] = {"scale": jnp.ones((cfg.d_model,), dtype)}
    return jax.tree.map(lambda a: a.astype(dtype), params)


def abstract_params(cfg: GPTConfig, dtype=jnp.float32) -> dict:
    """``jax.ShapeDtypeStruct`` params (nothing allocated), those of :func:`init_params`: one block's
    init traced and its shapes given to every block (the blocks are alike; tracing all L inits took
    seconds for a GPT3 config)."""
    one = jax.eval_shape(lambda: init_params(dataclasses.replace(cfg, n_layers=1), jax.random.key(0), dtype))
    blocks = {f"h_{i}": one["h_0"] for i in range(cfg.n_layers)}
    # a copy of every node, in the order jax.eval_shape gives (dict keys sorted)
    return jax.tree.map(lambda x: x, {"wte": one["wte"], "wpe": one["wpe"], **blocks, "ln_f": one["ln_f"]})



def leaf_initializer(cfg: GPTConfig, key: jax.Array, layout):
    """Initialise leaf ``i`` of ``layout.slots`` on its own, with the rule of :func:`init_params`
    (normal 0.02; ``attn_c_proj``/``mlp_c_proj`` kernels normal 0.02/sqrt(2L); LayerNorm scales 1).

    For models whose params do not fit host memory twice over: chunkjax builds chunks one at a
    time from it (``ChunkedStep.init(leaf_fn)``). Each leaf draws from ``fold_in(key, i)``, so the
    values differ from :func:`init_params`' (same distribution). Returns ``fn(i) -> f32 array``
    on the default device; one compiled program per distinct (shape, rule).
    """
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layers)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def draw(k, shape, std):
        return jax.random.normal(k, shape, jnp.float32) * std

    def fn(i: int):
        s = layout.slots[i]
        if s.path.endswith("scale"):
            return jnp.ones(s.shape, jnp.float32)
        std = proj_std if ("c_proj" in s.path) else 0.02
        return draw(jax.random.fold_in(key, i), tuple(s.shape), std)

    return fn
