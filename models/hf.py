"""Hugging Face checkpoint folders of the Llama family in and out of :mod:`models.llama`.

A folder holds ``config.json``, the weights as ``model.safetensors`` or as shards
``model-0000k-of-0000n.safetensors`` named by ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes}, "weight_map": {tensor: file}}``), and usually ``tokenizer.json``. Read:
Llama 2 / 3 / 3.1 (GQA, untied head, ``rope_scaling`` of type ``llama3`` or ``linear``), Mistral
(``sliding_window``) and Qwen2 / 2.5 (biases on q/k/v; tied or untied head), in any of float32,
bfloat16 and float16. No torch: the safetensors files are parsed here (an 8-byte little-endian
header length, a JSON header of ``{name: {dtype, shape, data_offsets}}``, then the raw bytes) and
each tensor is read straight into its own numpy buffer (``readinto``; a large one in parts by
threads with ``os.preadv``), one at a time: loading holds the params being built plus one
tensor, never the checkpoint twice (no mmap that would keep the pages of a whole file
resident); kernels are transposed into our layout by threads (:func:`to_leaf`). Written: the
same layout, tensor by tensor, in the dtype each tensor had (so import -> export is
bit-identical), sharded above ``max_shard_bytes`` (shards by threads: ``workers``).

Name map (our params pytree of :mod:`models.llama` <-> transformers' state dict)::

    embed (V, d)                     model.embed_tokens.weight (V, d)
    layer_<i>/attn_norm/scale        model.layers.<i>.input_layernorm.weight
    layer_<i>/<p>/kernel (in, out)   model.layers.<i>.self_attn.<p>.weight (out, in)  p: q/k/v/o_proj
    layer_<i>/<p>/bias (out,)        model.layers.<i>.self_attn.<p>.bias
    layer_<i>/ffn_norm/scale         model.layers.<i>.post_attention_layernorm.weight
    layer_<i>/<p>/kernel             model.layers.<i>.mlp.<p>.weight   p: gate/up/down_proj
    final_norm/scale                 model.norm.weight
    lm_head/kernel (d, V)            lm_head.weight (V, d)   (untied only)

The head, as transformers 5 (``PreTrainedModel.tie_weights`` at ``from_pretrained``; checked
with transformers 5.24.0) reads it: ``tie_word_embeddings`` false (or absent) needs
``lm_head.weight`` (refused in one line without it; transformers would start a random head). Under
``tie_word_embeddings: true`` the head is the embedding, and a ``lm_head.weight`` the files also
hold is (a) bit-equal to the embedding: a copy, read tied and written back as a copy of the
trained embedding; (b) different: transformers warns and does *not* tie them, so neither do we:
the model is read untied (``LlamaConfig.tie_embeddings`` False, :attr:`HFCheckpoint.notes` says
so) and written back with both tensors and config.json unchanged; (c) the only one of the two:
transformers ties to the tensor that exists, so the embedding is read from ``lm_head.weight`` and
written back under that name. Import then export thus gives back the tensors the folder had.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import struct
import tempfile
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from models.llama import PROJECTIONS, LlamaConfig

#: ``model_type`` -> transformers architecture.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Shards are cut above this many bytes (transformers' ``save_pretrained`` default, "5GB").
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
#: Files copied from the source folder into an export (when present).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")
_ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(ml_dtypes.bfloat16),
              "F64": np.dtype(np.float64)}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_TORCH_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}

_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
          "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
          "down_proj": "mlp.down_proj"}


# ---- the name map ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One tensor: our leaf path, its Hugging Face name, whether the two are transposes (linear
    kernels), and our leaf's shape."""

    path: str
    name: str
    transpose: bool
    shape: tuple[int, ...]


def tensor_map(cfg: LlamaConfig) -> list[TensorMap]:
    """Every tensor of ``cfg``'s model in the order of transformers' state dict (module docstring)."""
    d = cfg.d_model
    shapes = cfg.proj_shapes()
    out = [TensorMap("embed", "model.embed_tokens.weight", False, (cfg.vocab_size, d))]
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        out.append(TensorMap(f"layer_{i}/attn_norm/scale", pre + "input_layernorm.weight", False, (d,)))
        for p in PROJECTIONS:
            out.append(TensorMap(f"layer_{i}/{p}/kernel", f"{pre}{_BLOCK[p]}.weight", True, shapes[p]))
            if p in cfg.bias_projs:
                out.append(TensorMap(f"layer_{i}/{p}/bias", f"{pre}{_BLOCK[p]}.bias", False, (shapes[p][1],)))
            if p == "o_proj":
                out.append(TensorMap(f"layer_{i}/ffn_norm/scale", pre + "post_attention_layernorm.weight", False, (d,)))
    out.append(TensorMap("final_norm/scale", "model.norm.weight", False, (d,)))
    if not cfg.tie_embeddings:
        out.append(TensorMap("lm_head/kernel", "lm_head.weight", True, (d, cfg.vocab_size)))
    return out


def _set_path(tree: dict, path: str, value) -> None:
    *keys, last = path.split("/")
    for k in keys:
        tree = tree.setdefault(k, {})
    tree[last] = value


def _get_path(tree, path: str):
    node = tree
    for k in path.split("/"):
        if not isinstance(node, dict) or k not in node:
            raise ValueError(f"params lack {path}: expected the layout of models/llama.py")
        node = node[k]
    return node


# ---- config.json <-> LlamaConfig ------------------------------------------------------------

#: Keys every config.json must hold (no default makes sense for them).
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: RoPE type -> the ``rope_scaling`` keys transformers requires for it.
_ROPE_KEYS = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def config_from_hf(hc: dict, name: str = "hf-model", where: str = "config.json") -> LlamaConfig:
    """The :class:`models.llama.LlamaConfig` of a transformers ``config.json`` (a dict).

    Reads ``model_type`` (llama, mistral, qwen2), the sizes, ``rope_theta`` and ``rope_scaling``
    (or transformers 5's ``rope_parameters``), ``tie_word_embeddings`` (absent: untied, as the three
    families' defaults), biases (llama's ``attention_bias`` / ``mlp_bias``; qwen2: q, k, v always)
    and Mistral's ``sliding_window``. The model's name is ``chunkjax_name`` when present, else ``name``.

    Raises:
      ValueError: another model type, a missing size key (:data:`_REQUIRED_KEYS`), an activation
        other than silu, an unsupported, malformed or incomplete RoPE scaling (:data:`_ROPE_KEYS`),
        a non-numeric size or Qwen2's per-layer sliding window (one line naming the key and what
        is accepted).
    """
    if not isinstance(hc, dict):
        raise ValueError(f"{where}: a JSON object of settings is expected, got {type(hc).__name__}: re-download it")
    mt = hc.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(f"{where}: model_type {mt!r} is not of the Llama family: use one of {', '.join(FAMILIES)}")
    missing = [k for k in _REQUIRED_KEYS if hc.get(k) is None]
    if missing:
        raise ValueError(f"{where}: {', '.join(missing)} missing: a {mt} config.json needs {', '.join(_REQUIRED_KEYS)}")
    if hc.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hc.get('hidden_act')!r}: only silu (SwiGLU) is supported")
    for key in ("rope_parameters", "rope_scaling"):
        if hc.get(key) is not None and not isinstance(hc[key], dict):
            raise ValueError(f"{where}: {key} {hc[key]!r} must be an object such as {{\"rope_type\": \"llama3\", "
                             "\"factor\": 8.0, ...} or null")
    rp = hc.get("rope_parameters") or {}
    rs = hc.get("rope_scaling") or (rp if rp.get("rope_type", "default") != "default" else {})
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype not in _ROPE_KEYS:
        raise ValueError(f"{where}: rope_scaling type {rtype!r} is not supported: use default, linear or llama3")
    missing = [k for k in _ROPE_KEYS[rtype] if rs.get(k) is None]
    if missing:
        raise ValueError(f"{where}: rope_scaling of type {rtype} lacks {', '.join(missing)}: "
                         f"it needs {', '.join(_ROPE_KEYS[rtype])}")
    theta = hc.get("rope_theta", rp.get("rope_theta", 10000.0))
    if mt == "qwen2":
        bias = ("q_proj", "k_proj", "v_proj")
        if hc.get("use_sliding_window"):
            raise ValueError(f"{where}: use_sliding_window=true (Qwen2's per-layer window) is not supported")
        window = None
    else:
        bias = (("q_proj", "k_proj", "v_proj", "o_proj") if hc.get("attention_bias") else ()) + \
               (("gate_proj", "up_proj", "down_proj") if hc.get("mlp_bias") else ())
        window = hc.get("sliding_window") if mt == "mistral" else None
    try:
        n_heads = int(hc["num_attention_heads"])
        sizes = dict(
            vocab_size=int(hc["vocab_size"]), d_model=int(hc["hidden_size"]), n_layers=int(hc["num_hidden_layers"]),
            n_heads=n_heads, n_kv_heads=int(hc.get("num_key_value_heads") or n_heads),
            head_dim=int(hc.get("head_dim") or hc["hidden_size"] // n_heads), d_ff=int(hc["intermediate_size"]),
            rope_theta=float(theta), rms_eps=float(hc.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(hc.get("max_position_embeddings", 2048)),
            rope_factor=float(rs.get("factor", 1.0)), rope_low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
            rope_original_max_pos=int(rs.get("original_max_position_embeddings", 8192)),
            sliding_window=int(window) if window else None)
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise ValueError(f"{where}: a size or RoPE setting is not a number ({e}): fix config.json") from None
    try:
        return LlamaConfig(name=hc.get("chunkjax_name", name), family=mt, bias_projs=bias, rope_type=rtype,
                           tie_embeddings=bool(hc.get("tie_word_embeddings", False)), **sizes)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def hf_config_dict(cfg: LlamaConfig, bos_token_id: int | None = 1, eos_token_id: int | None = 2,
                   torch_dtype: str = "float32") -> dict:
    """A transformers ``config.json`` (dict) for ``cfg`` (architecture by ``cfg.family``);
    :func:`config_from_hf` of it gives ``cfg`` back (``remat`` aside).

    bos/eos default to SmolLM2's ids (``<|im_start|>`` = 1, ``<|im_end|>`` = 2).

    Raises:
      ValueError: biases the family's config cannot express (e.g. Qwen2 without q/k/v biases).
    """
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    mlp = ("gate_proj", "up_proj", "down_proj")
    bias = set(cfg.bias_projs)
    if cfg.family == "qwen2":
        ok = bias == {"q_proj", "k_proj", "v_proj"}
    else:
        ok = (bias & set(attn)) in (set(), set(attn)) and (bias & set(mlp)) in (set(), set(mlp)) and \
             (cfg.family == "llama" or not bias)
    if not ok or cfg.family not in FAMILIES:
        raise ValueError(f"config {cfg.name}: family {cfg.family!r} with biases on {sorted(bias)} has no "
                         "transformers config: use family llama (all or no attention biases) or qwen2 (q, k, v)")
    rope = None
    if cfg.rope_type == "linear":
        rope = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_type == "llama3":
        rope = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_pos}
    hc = {
        "architectures": [FAMILIES[cfg.family]], "model_type": cfg.family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": rope, "attention_dropout": 0.0, "tie_word_embeddings": cfg.tie_embeddings,
        "torch_dtype": torch_dtype, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "chunkjax_name": cfg.name,
    }
    if cfg.family == "llama":
        hc |= {"attention_bias": "q_proj" in bias, "mlp_bias": "gate_proj" in bias, "pretraining_tp": 1}
    elif cfg.family == "mistral":
        hc["sliding_window"] = cfg.sliding_window
    else:
        hc |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    return hc


def _same_model(a: LlamaConfig, b: LlamaConfig) -> bool:
    return dataclasses.replace(a, name="", remat=True) == dataclasses.replace(b, name="", remat=True)


# ---- safetensors, read and written tensor by tensor ----------------------------------------

def read_header(path) -> tuple[dict, int]:
    """``(header, data_start)`` of a safetensors file: the JSON header (tensor name -> ``{dtype,
    shape, data_offsets}``, plus ``__metadata__``) and the byte offset where tensor data begins.

    Raises:
      ValueError: not a safetensors file (one line naming it).
    """
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"{path}: header of {n} bytes: not a safetensors file")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: unreadable safetensors header") from None
    return header, 8 + n


#: Tensors of at least this many bytes are read by threads, in parts.
_THREADED_READ_BYTES = 64 * 2**20


def _read_into(fh, data_start: int, info: dict, where: str) -> np.ndarray:
    dt = _ST_DTYPES.get(info["dtype"])
    if dt is None:
        raise ValueError(f"{where}: dtype {info['dtype']} is not a float type this loader reads (F32, BF16, F16, F64)")
    begin, end = info["data_offsets"]
    out = np.empty(tuple(info["shape"]), dt)
    if out.nbytes != end - begin:
        raise ValueError(f"{where}: {end - begin} bytes for shape {info['shape']} {info['dtype']}")
    buf = memoryview(out.reshape(-1).view(np.uint8))
    parts = min(16, os.cpu_count() or 1) if out.nbytes >= _THREADED_READ_BYTES else 1
    if parts == 1:
        fh.seek(data_start + begin)
        got = fh.readinto(buf)
    else:  # a large tensor: read in parts by threads (os.preadv releases the GIL)
        from concurrent.futures import ThreadPoolExecutor
        cuts = [out.nbytes * k // parts for k in range(parts + 1)]
        fd = fh.fileno()

        def read(k):
            lo, hi, n = cuts[k], cuts[k + 1], 0
            while lo + n < hi:
                r = os.preadv(fd, [buf[lo + n:hi]], data_start + begin + lo + n)
                if r == 0:
                    break
                n += r
            return n
        with ThreadPoolExecutor(parts) as ex:
            got = sum(ex.map(read, range(parts)))
    if got != out.nbytes:
        raise ValueError(f"{where}: file ends inside the tensor (truncated download?)")
    return out


def write_safetensors(path, tensors: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
                      metadata: dict | None = None) -> int:
    """Write a safetensors file tensor by tensor: ``tensors`` lists ``(name, shape, dtype,
    produce)``; ``produce()`` returns that tensor (any layout, cast here) only when it is written,
    so the file is never held in memory. Tensors are laid out in the given order; the header is
    padded with spaces to a multiple of 8 bytes (as the ``safetensors`` library writes it).
    Returns the file's size in bytes.

    Raises:
      ValueError: a produced array's shape differs from the one announced.
    """
    header, off = {}, 0
    if metadata:
        header["__metadata__"] = metadata
    for name, shape, dtype, _ in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _ST_NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name, shape, dtype, produce in tensors:
            a = np.ascontiguousarray(produce(), dtype=dtype)
            if a.shape != tuple(shape):
                raise ValueError(f"tensor {name} has shape {a.shape}, expected {tuple(shape)}")
            fh.write(memoryview(a.reshape(-1).view(np.uint8)))
    return 8 + len(blob) + off


# ---- import ------------------------------------------------------------------------------------

#: Rows of a stored tensor copied per band by :func:`to_leaf` (a band of 8 rows transposes with
#: short strided writes: 2.8x numpy's plain ``.T`` copy of a 14336 x 4096 bf16 kernel, measured).
_BAND_ROWS = 8
#: Elements below which :func:`to_leaf` uses one thread.
_THREADED_ELEMS = 1 << 20
_BF16 = np.dtype(ml_dtypes.bfloat16)


def _bands(n: int, work, threads: int) -> None:
    """``work(lo, hi)`` over ``range(n)`` cut into ``threads`` contiguous parts, run by threads
    (numpy's copies release the GIL)."""
    if threads <= 1:
        work(0, n)
        return
    from concurrent.futures import ThreadPoolExecutor
    cuts = [n * k // threads for k in range(threads + 1)]
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda k: work(cuts[k], cuts[k + 1]), range(threads)))


def to_leaf(a: np.ndarray, transpose: bool, dtype=np.float32, threads: int | None = None) -> np.ndarray:
    """A stored tensor as our leaf: ``a.T`` (a 2-D linear weight, when ``transpose``) or ``a``, as
    a new C-contiguous ``dtype`` array, bit-exact with ``np.ascontiguousarray(a.T, dtype)``.

    At 8B scale numpy's plain paths are the import's bottleneck (measured on a 14336 x 4096 bf16
    kernel: ``.T`` copy 0.54 s, bf16 -> float32 cast 0.79 s, ~100M elements/s), so the transpose
    runs in bands of :data:`_BAND_ROWS` rows on ``threads`` threads (default: the cores, at most
    16) and bfloat16 -> float32 is the exact 16-bit left shift of the bits (0.10 s).

    Args:
      a: the tensor as stored (any float dtype); ``transpose`` needs it 2-D.
      transpose: return ``a.T``.
      dtype: the leaf's dtype.
      threads: copy threads (None: ``min(16, os.cpu_count())``).
    """
    dtype = np.dtype(dtype)
    threads = min(16, os.cpu_count() or 1) if threads is None else max(1, int(threads))
    if a.size < _THREADED_ELEMS:
        threads = 1
    widen = a.dtype == _BF16 and dtype == np.float32
    if not transpose:
        if not widen:
            return np.ascontiguousarray(a, dtype=dtype)
        out = np.empty(a.shape, np.float32)
        src, dst = a.reshape(-1).view(np.uint16), out.reshape(-1).view(np.uint32)
        _bands(src.size, lambda lo, hi: np.left_shift(src[lo:hi], 16, out=dst[lo:hi], dtype=np.uint32), threads)
        return out
    if a.ndim != 2:
        raise ValueError(f"to_leaf: a transposed tensor must be 2-D, got shape {a.shape}")
    rows, cols = a.shape
    bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    src = a.view(bits)
    t = np.empty((cols, rows), bits)

    def band(lo, hi):  # rows lo..hi of a -> columns lo..hi of a.T
        for r in range(lo, hi, _BAND_ROWS):
            t[:, r:min(hi, r + _BAND_ROWS)] = src[r:min(hi, r + _BAND_ROWS)].T
    _bands(rows, band, threads)
    t = t.view(a.dtype)
    if widen:
        out = np.empty(t.shape, np.float32)
        src2, dst = t.view(np.uint16), out.view(np.uint32)
        _bands(cols, lambda lo, hi: np.left_shift(src2[lo:hi], 16, out=dst[lo:hi], dtype=np.uint32), threads)
        return out
    return t if t.dtype == dtype else t.astype(dtype)


@dataclasses.dataclass
class HFCheckpoint:
    """A Hugging Face folder opened for reading: nothing but the headers is read until asked.

    Attributes:
      path: the folder.
      hf_config: ``config.json`` as a dict (written back unchanged by :func:`export_hf_checkpoint`).
      config: its :class:`models.llama.LlamaConfig`.
      entries: tensor name -> ``(file path, data_start, header entry)``.
      nbytes: bytes of tensor data in all the weight files.
      aliases: a :func:`tensor_map` name -> the file's tensor that holds it (a tied folder whose
        embedding is stored only as ``lm_head.weight``: module docstring, case (c)).
      copies: a file tensor -> our leaf it copies (``{"lm_head.weight": "embed"}``: a tied
        folder that also stores the head, case (a)); export writes the leaf under that name too.
      notes: lines on how the folder was read where transformers would warn (case (b)).
    """

    path: pathlib.Path
    hf_config: dict
    config: LlamaConfig
    entries: dict
    nbytes: int
    aliases: dict = dataclasses.field(default_factory=dict)
    copies: dict = dataclasses.field(default_factory=dict)
    notes: tuple = ()

    def dtype(self, name: str) -> np.dtype:
        """The stored dtype of tensor ``name`` (a :func:`tensor_map` name or a file tensor)."""
        return _ST_DTYPES[self.entries[self.aliases.get(name, name)][2]["dtype"]]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` as stored (transformers' layout and dtype), read from its file alone."""
        file, start, info = self.entries[self.aliases.get(name, name)]
        with open(file, "rb") as fh:
            return _read_into(fh, start, info, f"{file} {name}")

    def leaf(self, path: str, dtype=np.float32) -> np.ndarray:
        """Our leaf ``path`` (``"layer_3/q_proj/kernel"``) as a C-contiguous ``dtype`` array
        (:func:`to_leaf`: kernels transposed by threads, bf16 widened by a bit shift)."""
        m = self._by_path[path]
        return to_leaf(self.tensor(m.name), m.transpose, dtype)

    def leaf_fn(self, layout) -> Callable[[int], np.ndarray]:
        """``fn(i)``: leaf ``i`` of a chunk layout (``layout.slots[i].path``) read from the files
        as float32, for ``ChunkedStep.init`` (chunks built one at a time; no params pytree)."""
        return lambda i: self.leaf(layout.slots[i].path)

    def params(self, dtype=np.float32) -> dict:
        """The whole params pytree (numpy ``dtype``), read tensor by tensor in file order."""
        params: dict = {}
        def where(m):
            file, _, info = self.entries[self.aliases.get(m.name, m.name)]
            return file, info["data_offsets"][0]

        for m in sorted(self._by_path.values(), key=where):
            _set_path(params, m.path, self.leaf(m.path, dtype))
        return params

    def abstract_params(self):
        """The params pytree as ``jax.ShapeDtypeStruct`` float32 (nothing read)."""
        import jax
        tree: dict = {}
        for m in self._by_path.values():
            _set_path(tree, m.path, jax.ShapeDtypeStruct(m.shape, np.float32))
        return tree

    def tokenizer(self):
        """``tokenizers.Tokenizer`` of the folder's ``tokenizer.json``.

        Raises:
          FileNotFoundError: the folder has no tokenizer.json (one line).
          ValueError: tokenizer.json cannot be parsed (one line naming it).
        """
        from tokenizers import Tokenizer
        f = self.path / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: the checkpoint needs its tokenizer.json (a fast tokenizer)")
        try:
            return Tokenizer.from_file(str(f))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{f}: not a valid tokenizer.json ({' '.join(str(e).split())}): fix or re-download "
                             "it (a fast tokenizer, as transformers saves it)") from None

    def token_id(self, key: str) -> int | None:
        """``bos_token_id`` / ``eos_token_id`` of config.json (the first of a list), or None."""
        v = self.hf_config.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        return None if v is None else int(v)

    @functools.cached_property
    def _by_path(self) -> dict[str, TensorMap]:
        return {m.path: m for m in tensor_map(self.config)}


def _read_json(f: pathlib.Path):
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({' '.join(str(e).split())}): fix or re-download it") from None


def open_hf_checkpoint(path) -> HFCheckpoint:
    """Open a Hugging Face folder of the Llama family (module docstring): reads config.json and
    the safetensors headers, checks every tensor's name, shape and dtype, and resolves the head as
    transformers does (module docstring); reads no weights but a tied folder's two head tensors
    when it stores both (compared piece by piece).

    Raises:
      FileNotFoundError: no config.json, or neither model.safetensors nor its index (one line).
      ValueError: config.json or the index not valid JSON, an unsupported config
        (:func:`config_from_hf`), a missing, mis-shaped or non-float tensor, a tensor past the end
        of its file (truncated download: from the header's ``data_offsets`` and the file size,
        nothing read), a shard the index names but the folder lacks, or an untied config
        (``tie_word_embeddings`` false or absent) whose weights lack ``lm_head.weight`` (one line
        naming config.json's key and the weights file).
    """
    p = pathlib.Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p / 'config.json'} is missing: not a Hugging Face checkpoint folder")
    hc = _read_json(p / "config.json")
    cfg = config_from_hf(hc, p.name, str(p / "config.json"))
    if (p / INDEX_FILE).is_file():
        index = _read_json(p / INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{p / INDEX_FILE}: no weight_map of tensor -> file: re-download it")
        files = sorted(set(weight_map.values()))
    elif (p / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{p} has neither {SINGLE_FILE} nor {INDEX_FILE}: export safetensors weights "
                                "(transformers: save_pretrained(..., safe_serialization=True))")
    entries, nbytes = {}, 0
    for f in files:
        if not (p / f).is_file():
            raise ValueError(f"{p / INDEX_FILE} names {f}, which the folder lacks (incomplete download?)")
        header, start = read_header(p / f)
        size = os.path.getsize(p / f)
        for name, info in header.items():
            if name != "__metadata__":
                try:
                    begin, end = (int(x) for x in info["data_offsets"])
                except (TypeError, KeyError, ValueError):
                    raise ValueError(f"{p / f} {name}: header entry without data_offsets: re-download it") from None
                if start + end > size:
                    raise ValueError(f"{p / f} {name}: file ends inside the tensor (truncated download?): "
                                     "re-download it")
                entries[name] = (p / f, start, info)
                nbytes += end - begin
    weights = p / INDEX_FILE if (p / INDEX_FILE).is_file() else p / SINGLE_FILE
    cfg, aliases, copies, notes = _resolve_head(cfg, hc, entries, p / "config.json", weights)
    for m in tensor_map(cfg) + [TensorMap(path, name, False, (cfg.vocab_size, cfg.d_model))
                                for name, path in copies.items()]:
        name = aliases.get(m.name, m.name)
        if name not in entries:
            raise ValueError(f"{p}: tensor {m.name} is missing (config {cfg.family}, {cfg.n_layers} layers)")
        info = entries[name][2]
        want = m.shape[::-1] if m.transpose else m.shape
        if tuple(info["shape"]) != want:
            raise ValueError(f"{p}: {name} has shape {tuple(info['shape'])}, config.json needs {want}")
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{p}: {name} is {info['dtype']}: quantized checkpoints are not supported "
                             "(use the float16/bfloat16/float32 release)")
    return HFCheckpoint(p, hc, cfg, entries, nbytes, aliases, copies, notes)


_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _resolve_head(cfg: LlamaConfig, hc: dict, entries: dict, config_file: pathlib.Path, weights: pathlib.Path):
    """``(cfg, aliases, copies, notes)``: how the head of a folder is read, as transformers reads
    it (module docstring, cases (a)-(c)). Reads the two head tensors only when a tied folder holds
    both (compared in pieces of 64 MiB; a difference usually shows in the first).

    Raises:
      ValueError: an untied config without ``lm_head.weight`` (one line naming config.json's key
        and the weights file).
    """
    if not cfg.tie_embeddings:
        if _HEAD not in entries and _EMBED in entries:
            said = "false" if "tie_word_embeddings" in hc else "absent (false)"
            raise ValueError(f"{config_file}: tie_word_embeddings is {said} but {weights} has no {_HEAD}: set "
                             f'"tie_word_embeddings": true if the head is the embedding, or add {_HEAD}')
        return cfg, {}, {}, ()
    if _HEAD not in entries:
        return cfg, {}, {}, ()
    if _EMBED not in entries:  # (c) transformers ties to the tensor that exists
        return cfg, {_EMBED: _HEAD}, {}, ()
    if _same_tensor(entries[_EMBED], entries[_HEAD]):  # (a) a copy of the embedding
        return cfg, {}, {_HEAD: "embed"}, ()
    note = (f"{config_file} sets tie_word_embeddings but {weights.parent} holds a {_HEAD} that differs from "
            f"{_EMBED}: read untied, the head from {_HEAD} (as transformers does; export writes both)")
    return dataclasses.replace(cfg, tie_embeddings=False), {}, {}, (note,)


def _same_tensor(a, b, piece_bytes: int = 64 * 2**20) -> bool:
    """Whether two safetensors entries ``(file, data_start, header entry)`` hold the same values:
    same shape, and the same bytes (same dtype, read in pieces) or equal float32 values."""
    (fa, sa, ia), (fb, sb, ib) = a, b
    if list(ia["shape"]) != list(ib["shape"]) or ia["dtype"] not in _ST_DTYPES or ib["dtype"] not in _ST_DTYPES:
        return False
    if ia["dtype"] != ib["dtype"]:
        with open(fa, "rb") as ha, open(fb, "rb") as hb:
            return bool(np.array_equal(_read_into(ha, sa, ia, str(fa)).astype(np.float32),
                                       _read_into(hb, sb, ib, str(fb)).astype(np.float32)))
    (a0, a1), (b0, _) = (int(x) for x in ia["data_offsets"]), (int(x) for x in ib["data_offsets"])
    with open(fa, "rb") as ha, open(fb, "rb") as hb:
        for off in range(0, a1 - a0, piece_bytes):
            n = min(piece_bytes, a1 - a0 - off)
            if os.pread(ha.fileno(), n, sa + a0 + off) != os.pread(hb.fileno(), n, sb + b0 + off):
                return False
    return True


def load_hf_checkpoint(path, dtype=np.float32):
    """``(cfg, params)`` of a Hugging Face folder (:func:`open_hf_checkpoint`), the params pytree
    of numpy ``dtype`` arrays read tensor by tensor (peak host memory: the params plus one tensor).

    Raises: as :func:`open_hf_checkpoint`.
    """
    ck = open_hf_checkpoint(path)
    return ck.config, ck.params(dtype)


# ---- export ------------------------------------------------------------------------------------

def _shards(items: list, max_shard_bytes: int) -> list[list]:
    shards, cur, size = [], [], 0
    for it in items:
        nbytes = int(np.prod(it[1], dtype=np.int64)) * np.dtype(it[2]).itemsize
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(it)
        size += nbytes
    return shards + [cur] if cur else shards


def export_hf_checkpoint(cfg: LlamaConfig, params, out_dir, tokenizer=None, overwrite: bool = False, *,
                         source: HFCheckpoint | None = None, dtype=None, max_shard_bytes: int | None = None,
                         bos_token_id: int | None = 1, eos_token_id: int | None = 2, workers: int = 1) -> pathlib.Path:
    """Write ``params`` as a Hugging Face folder, atomically, tensor by tensor.

    Files: ``model.safetensors`` (metadata ``{"format": "pt"}``), or above ``max_shard_bytes``
    shards ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``;
    ``config.json``; the tokenizer. With ``source`` (the :class:`HFCheckpoint` the params came
    from): its config.json unchanged (``torch_dtype`` aside when ``dtype`` overrides), its
    tokenizer and generation files copied, each tensor in its stored dtype, file and order (the
    source's shards and index, unless ``max_shard_bytes`` is given), so an unchanged import
    exports the same files with bit-identical tensors. Without: :func:`hf_config_dict`, float32 (or
    ``dtype``), and ``tokenizer`` (a ``tokenizers.Tokenizer``) saved with a
    ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast``. Everything goes into a temporary
    folder beside ``out_dir`` renamed at the end: a failure leaves nothing half-written.

    Args:
      cfg: the model config. params: our pytree (numpy or jax arrays, any float dtype).
      out_dir: folder to create (parents are created). tokenizer: see above.
      overwrite: replace an existing ``out_dir`` (removed only once the new one is in place).
      source: see above. dtype: numpy dtype of every tensor (None: the source's, else float32).
      max_shard_bytes: largest shard in bytes (a single larger tensor gets a shard of its own);
        None: the source's files, else :data:`DEFAULT_MAX_SHARD_BYTES`.
      bos_token_id, eos_token_id: written into a generated config.json (SmolLM2's by default).
      workers: shards written at once, one thread each (the same files; host memory: one tensor
        per thread).
    Returns:
      ``pathlib.Path`` of ``out_dir``.
    Raises:
      FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
      ValueError: params do not match ``cfg``, or ``cfg`` is not ``source``'s model (one line).
      OSError: the folder cannot be written (nothing is left behind).
    """
    out = pathlib.Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass overwrite=True or pick another folder")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be >= 1")
    maps = tensor_map(cfg)
    for m in maps:  # refuse before anything is written
        shape = tuple(np.shape(_get_path(params, m.path)))
        if shape != m.shape:
            raise ValueError(f"params {m.path} has shape {shape}, config {cfg.name} needs {m.shape}")
    if source is not None and not _same_model(source.config, cfg):
        raise ValueError(f"export source {source.path} holds another model than config {cfg.name}")
    if source is not None:  # the source's tensor names, and its copy of a tied embedding (module docstring)
        maps = [dataclasses.replace(m, name=source.aliases.get(m.name, m.name)) for m in maps]
        maps += [TensorMap(path, name, False, (cfg.vocab_size, cfg.d_model)) for name, path in source.copies.items()]
        order = {n: (str(e[0]), e[2]["data_offsets"][0]) for n, e in source.entries.items()}
        maps = sorted(maps, key=lambda m: order.get(m.name, ("~", 0)))

    def tensor_dtype(m):
        if dtype is not None:
            return np.dtype(dtype)
        return source.dtype(m.name) if source is not None else np.dtype(np.float32)

    def produce(m):
        def get():
            a = np.asarray(_get_path(params, m.path))
            return a.T if m.transpose else a
        return get

    items = [(m.name, m.shape[::-1] if m.transpose else m.shape, tensor_dtype(m), produce(m)) for m in maps]
    if max_shard_bytes is None and source is not None:  # the source's files, in its order
        files = sorted({source.entries[m.name][0].name for m in maps})
        names = files if files != [SINGLE_FILE] else [None]
        shards = [[it for it, m in zip(items, maps) if source.entries[m.name][0].name == f] for f in files]
    else:
        shards = _shards(items, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        names = [None] if len(shards) == 1 else \
            [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if source is not None:
        hc = dict(source.hf_config)
        if dtype is not None:  # transformers 5 writes "dtype", earlier versions "torch_dtype"
            hc["dtype" if "dtype" in hc and "torch_dtype" not in hc else "torch_dtype"] = np.dtype(dtype).name
    else:
        hc = hf_config_dict(cfg, bos_token_id, eos_token_id, np.dtype(dtype or np.float32).name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        if names == [None]:
            write_safetensors(tmp / SINGLE_FILE, shards[0], {"format": "pt"})
        else:
            weight_map, total = {}, 0
            jobs = list(zip(names, shards))
            if workers > 1 and len(jobs) > 1:
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(min(workers, len(jobs))) as ex:
                    for f in [ex.submit(write_safetensors, tmp / fname, shard, {"format": "pt"}) for fname, shard in jobs]:
                        f.result()
            else:
                for fname, shard in jobs:
                    write_safetensors(tmp / fname, shard, {"format": "pt"})
            for fname, shard in jobs:
                for name, shape, dt, _ in shard:
                    weight_map[name] = fname
                    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hc, indent=2) + "\n")
        if source is not None:
            for f in TOKENIZER_FILES:
                if (source.path / f).is_file():
                    shutil.copyfile(source.path / f, tmp / f)
        elif tokenizer is not None:
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


def iter_tensors(path) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, tensor)`` of every tensor of a Hugging Face folder's weight files, as stored, one
    at a time in file order (for comparing two folders without holding either)."""
    p = pathlib.Path(path)
    files = (sorted(set(json.loads((p / INDEX_FILE).read_text())["weight_map"].values()))
             if (p / INDEX_FILE).is_file() else [SINGLE_FILE])
    for f in files:
        header, start = read_header(p / f)
        with open(p / f, "rb") as fh:
            for name, info in sorted(((n, i) for n, i in header.items() if n != "__metadata__"),
                                     key=lambda t: t[1]["data_offsets"][0]):
                yield name, _read_into(fh, start, info, f"{p / f} {name}")
