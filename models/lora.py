"""LoRA adapters on the Llama model of :mod:`models.llama` (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", section 4.1), trained with the base frozen.

A targeted projection ``y = x @ W`` (W: (d_in, d_out), our kernel) becomes
``y = x @ W + (alpha / R) * (x @ A) @ B`` with A (d_in, R) and B (R, d_out). As in PEFT, A starts
kaiming-uniform (``a = sqrt(5)``: uniform in +-1/sqrt(d_in)) and B at zero, so the model at init
is the base model exactly. The adapters live inside the projection's params
(``layer_i/q_proj/{kernel, lora_a, lora_b}``); :class:`models.llama._Linear` adds them when present
with the config's ``lora_scale`` (alpha / R). Only the adapters are trainable
(:func:`trainable_mask`, passed to ``chunkjax.fit_step(trainable=...)``): the base leaves sit in
frozen chunks in their own dtype, with no master, optimizer state, gradient or update.

Export: :func:`merge` folds the adapters into the kernels (``W + alpha/R * A @ B`` computed in
float32, cast back to W's dtype) for a Hugging Face export of the whole model
(:func:`models.hf.export_hf_checkpoint`); :func:`export_adapters` writes the adapters alone in
PEFT's layout (``adapter_config.json`` + ``adapter_model.safetensors``, tensors
``base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight`` (R, d_in) and ``...lora_B.weight``
(d_out, R), torch's ``Linear.weight`` orientation), which PEFT's ``PeftModel.from_pretrained``
reads; :func:`read_adapters` reads it back.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
import zlib

import numpy as np

from models.llama import LlamaConfig

#: ``--lora-targets`` short name -> (Hugging Face module, projection name).
TARGETS = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"),
           "o": ("self_attn", "o_proj"), "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"),
           "down": ("mlp", "down_proj")}
ADAPTER_KEYS = ("lora_a", "lora_b")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """Which projections get adapters, their rank and alpha.

    Attributes:
      rank: R >= 1, inner width of each adapter.
      alpha: scale numerator: the adapter's output is multiplied by ``alpha / rank``.
      targets: projection names (``q_proj``, ``k_proj``, ... of :data:`TARGETS`), in block order.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank {self.rank!r} must be an int >= 1")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"LoRA alpha {self.alpha!r} must be a positive finite number")
        known = [p for _, p in TARGETS.values()]
        bad = [t for t in self.targets if t not in known]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"LoRA targets {list(self.targets)}: name each of {', '.join(TARGETS)} at most once "
                             "(e.g. q,k,v,o)")

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    @classmethod
    def parse(cls, rank: int, alpha: float, targets: str) -> "LoraSpec":
        """From the job's flags: ``targets`` comma-separated short names (``"q,k,v,o"``) or
        projection names (``"q_proj,v_proj"``).

        Raises:
          ValueError: a bad rank, alpha or target name (one line listing the names).
        """
        names = [t.strip().lower() for t in targets.split(",") if t.strip()]
        projs = [TARGETS[t][1] if t in TARGETS else t for t in names]
        order = [p for _, p in TARGETS.values()]
        if any(p not in order for p in projs):
            bad = [t for t, p in zip(names, projs) if p not in order]
            raise ValueError(f"LoRA targets {targets!r}: {', '.join(bad)} unknown: use some of {', '.join(TARGETS)}")
        return cls(int(rank), float(alpha), tuple(sorted(projs, key=order.index)))


def lora_config(cfg: LlamaConfig, spec: LoraSpec) -> LlamaConfig:
    """``cfg`` with ``lora_scale = spec.scale`` (the forward of a model with adapters)."""
    return dataclasses.replace(cfg, lora_scale=spec.scale)


def base_config(cfg: LlamaConfig) -> LlamaConfig:
    """``cfg`` without LoRA (``lora_scale = 0``): the config of the merged model."""
    return dataclasses.replace(cfg, lora_scale=0.0)


def adapter_shapes(cfg: LlamaConfig, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Leaf path (``"layer_3/q_proj/lora_a"``) -> shape of every adapter, in layer order."""
    shapes = cfg.proj_shapes()
    out = {}
    for i in range(cfg.n_layers):
        for t in spec.targets:
            d_in, d_out = shapes[t]
            out[f"layer_{i}/{t}/lora_a"] = (d_in, spec.rank)
            out[f"layer_{i}/{t}/lora_b"] = (spec.rank, d_out)
    return out


def init_adapter(path: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """The initial value of adapter ``path``, float32: ``lora_a`` uniform in +-1/sqrt(d_in) (PEFT's
    ``kaiming_uniform_(a=sqrt(5))`` on its (R, d_in) weight), ``lora_b`` zeros. Drawn from a
    generator seeded by ``(seed, crc32(path))``: the same value whatever order leaves are made in."""
    if path.endswith("lora_b"):
        return np.zeros(shape, np.float32)
    bound = 1.0 / math.sqrt(shape[0])
    rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def leaf_paths(tree) -> list[tuple[str, object]]:
    """``(path, leaf)`` of every leaf of ``tree``, paths as chunk layouts write them
    (``"layer_3/q_proj/kernel"``)."""
    import jax
    return [(jax.tree_util.keystr(k, simple=True, separator="/"), v) for k, v in jax.tree_util.tree_leaves_with_path(tree)]


def add_adapters(params, cfg: LlamaConfig, spec: LoraSpec, seed: int = 0, abstract: bool = False) -> dict:
    """A copy of ``params`` (:mod:`models.llama`'s pytree) with the adapters of ``spec`` added:
    :func:`init_adapter` values (float32 numpy), or ``jax.ShapeDtypeStruct`` float32 when
    ``abstract``. The base leaves are shared, not copied.

    Raises:
      ValueError: ``params`` already hold adapters, or a target projection is missing.
    """
    import jax
    if any(p.rsplit("/", 1)[-1] in ADAPTER_KEYS for p, _ in leaf_paths(params)):
        raise ValueError("params already hold LoRA adapters: pass the base model's params")
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in params.items()}
    for path, shape in adapter_shapes(cfg, spec).items():
        layer, proj, key = path.split("/")
        if proj not in out.get(layer, {}):
            raise ValueError(f"params have no {layer}/{proj}: not a model of config {cfg.name}")
        out[layer][proj] = dict(out[layer][proj])
        out[layer][proj][key] = (jax.ShapeDtypeStruct(shape, np.float32) if abstract
                                 else init_adapter(path, shape, seed))
    return out


def is_adapter(path: str) -> bool:
    """True for an adapter leaf's path (``.../lora_a`` or ``.../lora_b``)."""
    return path.rsplit("/", 1)[-1] in ADAPTER_KEYS


def trainable_mask(params) -> dict:
    """``params``' structure with True at the adapters and False elsewhere (the frozen base):
    ``chunkjax.fit_step(trainable=...)``."""
    import jax
    return jax.tree_util.tree_map_with_path(
        lambda k, _: is_adapter(jax.tree_util.keystr(k, simple=True, separator="/")), params)


def adapter_chunk_size(params, trainable, *, min_chunks: int = 8, max_waste: float = 0.05) -> int:
    """A chunk size (elements) for a model with adapters: its trainable chunks nearly full.

    A layout has one chunk size for frozen and trainable chunks, and the default search
    (:func:`chunkjax.layout.search_chunk_size`) sizes chunks for the base: at 8B with rank 16 on
    every projection the adapters' 41.9M elements sat in one 55M-element trainable chunk (its
    float32 master, AdamW m and v and gradient 27 % padding). Here the size is the smallest that
    holds the adapters of ``A`` elements in ``k`` chunks, ``ceil(A / k)`` plus the largest adapter
    (a greedy chunk wastes less than one leaf) rounded up to ``CHUNK_ALIGN_ELEMS``, for the least
    ``k`` that gives a size no larger than the default search's and at least half of it, with
    at most ``max_waste`` padding bytes over all chunks (tree order; the job packs in first-use
    order, the same leaves): 8B, every projection: 197 chunks of 40.2Mi elements, the one
    trainable chunk 99 % full. Else the default search's size: adapters under half a default
    chunk (8B with q, k, v, o: 13.6M) keep one mostly padded trainable chunk (at most 16 bytes
    per element of one default chunk, 0.9 GB at 8B), because a size that fits them would
    multiply the chunk count and the planner's time grows faster than the count (measured on a
    CPU at 8B: 590 chunks planned in 186 s, 147 in 0.9 s).

    Args:
      params: the params pytree with adapters (arrays or ``jax.ShapeDtypeStruct``).
      trainable: its bool pytree (:func:`trainable_mask`).
      min_chunks: the default search's target count.
      max_waste: padding bound, a fraction of all chunk bytes.
    Returns:
      elements per chunk, a multiple of ``chunkjax.layout.CHUNK_ALIGN_ELEMS``.
    """
    import jax

    from chunkjax.layout import CHUNK_ALIGN_ELEMS, MAX_CHUNKS, build_layout, search_chunk_size
    leaves = jax.tree.leaves(params)
    flags = jax.tree.structure(params).flatten_up_to(trainable)
    sizes = [int(np.prod(a.shape)) for a, t in zip(leaves, flags) if t]
    default = search_chunk_size(params, min_chunks=min_chunks, trainable=trainable)
    if not sizes:
        return default
    total = sum(int(np.prod(a.shape)) for a in leaves)
    align = CHUNK_ALIGN_ELEMS
    least = max(-(-total // MAX_CHUNKS), default // 2)
    adapters, big = sum(sizes), max(sizes)
    for k in range(1, 1 + -(-adapters // max(1, least))):
        cs = -(-(-(-adapters // k) + big) // align) * align
        if cs > default:
            continue
        if cs < least:
            break
        lay = build_layout(params, cs, trainable=trainable)
        stored = sum(cs * np.dtype(d).itemsize for d in lay.chunk_dtypes)
        if lay.waste_bytes <= max_waste * stored:
            return cs
    return default


def merge(params, spec: LoraSpec) -> dict:
    """The base model's params with the adapters folded in: each targeted kernel becomes
    ``W + alpha/R * A @ B`` (float32 arithmetic, cast to W's dtype); adapters dropped. Numpy out;
    leaves without adapters are passed through unchanged (not copied)."""
    out = {}
    for k, v in params.items():
        if not isinstance(v, dict):
            out[k] = v
            continue
        layer = {}
        for name, p in v.items():
            if isinstance(p, dict) and "lora_a" in p:
                w = np.asarray(p["kernel"])
                delta = np.asarray(p["lora_a"], np.float32) @ np.asarray(p["lora_b"], np.float32)
                merged = {n: a for n, a in p.items() if n not in ADAPTER_KEYS}
                merged["kernel"] = (w.astype(np.float32) + np.float32(spec.scale) * delta).astype(w.dtype)
                layer[name] = merged
            else:
                layer[name] = p
        out[k] = layer
    return out


def peft_name(layer: int, proj: str, key: str) -> str:
    """PEFT's tensor name of adapter ``key`` (lora_a / lora_b) of ``proj`` in block ``layer``."""
    module = next(m for m, p in TARGETS.values() if p == proj)
    return f"base_model.model.model.layers.{layer}.{module}.{proj}.lora_{key[-1].upper()}.weight"


def adapter_config(spec: LoraSpec, base_model: str | None = None) -> dict:
    """PEFT's ``adapter_config.json`` for ``spec`` (task CAUSAL_LM, no dropout, no bias)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.targets), "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None}


def export_adapters(cfg: LlamaConfig, params, spec: LoraSpec, out_dir, *, base_model: str | None = None,
                    overwrite: bool = False) -> pathlib.Path:
    """Write the adapters of ``params`` alone in PEFT's layout, atomically (a temporary folder
    renamed at the end).

    Files: ``adapter_config.json`` (:func:`adapter_config`) and ``adapter_model.safetensors``
    (float32, metadata ``{"format": "pt"}``) with, per block N and target, ``peft_name(N, proj,
    "lora_a")`` of shape (R, d_in) (our A transposed) and ``...lora_B.weight`` (d_out, R).

    Args:
      cfg: the model config. params: the pytree with adapters (numpy or jax arrays).
      spec: the adapters' rank, alpha and targets. out_dir: folder to create.
      base_model: written as ``base_model_name_or_path``. overwrite: replace ``out_dir``.
    Returns:
      ``pathlib.Path`` of ``out_dir``.
    Raises:
      FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
      ValueError: an adapter of ``spec`` is missing or misshapen in ``params`` (nothing written).
    """
    from models.hf import write_safetensors
    out = pathlib.Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists: pass overwrite=True or pick another folder")
    items = []
    for path, shape in adapter_shapes(cfg, spec).items():
        layer, proj, key = path.split("/")
        a = params.get(layer, {}).get(proj, {}).get(key)
        if a is None or tuple(np.shape(a)) != shape:
            raise ValueError(f"params {path} is {None if a is None else np.shape(a)}, LoRA rank {spec.rank} on "
                             f"config {cfg.name} needs {shape}")
        items.append((peft_name(int(layer[6:]), proj, key), shape[::-1], np.dtype(np.float32),
                      lambda a=a: np.asarray(a, np.float32).T))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        write_safetensors(tmp / ADAPTER_FILE, items, {"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(spec, base_model), indent=2) + "\n")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_adapters(path) -> tuple[LoraSpec, dict[str, np.ndarray]]:
    """``(spec, adapters)`` of a PEFT adapter folder: ``adapters`` maps our leaf paths
    (``layer_3/q_proj/lora_a``, (d_in, R)) to float32 arrays.

    Raises:
      FileNotFoundError: the folder lacks ``adapter_config.json`` or ``adapter_model.safetensors``.
      ValueError: not a LoRA adapter, or a tensor name outside PEFT's Llama layout.
    """
    from safetensors.numpy import load_file
    p = pathlib.Path(path)
    for f in (ADAPTER_CONFIG, ADAPTER_FILE):
        if not (p / f).is_file():
            raise FileNotFoundError(f"{p / f} is missing: not a PEFT adapter folder")
    hc = json.loads((p / ADAPTER_CONFIG).read_text())
    if hc.get("peft_type") != "LORA":
        raise ValueError(f"{p / ADAPTER_CONFIG}: peft_type {hc.get('peft_type')!r}, expected LORA")
    spec = LoraSpec(int(hc["r"]), float(hc["lora_alpha"]), tuple(hc["target_modules"]))
    adapters = {}
    for name, a in load_file(str(p / ADAPTER_FILE)).items():
        parts = name.split(".")
        if len(parts) != 9 or parts[:4] != ["base_model", "model", "model", "layers"] or parts[-1] != "weight":
            raise ValueError(f"{p / ADAPTER_FILE}: tensor {name} is not in PEFT's Llama layout")
        key = {"lora_A": "lora_a", "lora_B": "lora_b"}[parts[7]]
        adapters[f"layer_{int(parts[4])}/{parts[6]}/{key}"] = np.ascontiguousarray(np.asarray(a, np.float32).T)
    return spec, adapters
