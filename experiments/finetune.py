"""Fine-tune a pre-trained model (SmolLM2-135M) on the Shakespeare training plays with its model
data in chunks, most of them updated on the host, and export the result as a Hugging Face
checkpoint.

    python -m experiments.finetune --model smollm2-135m                   # CPU defaults
    python -m experiments.finetune --model smollm2-135m --steps 200 --batch 8 --seq 256 --device-budget 400MiB

Data: the main job's document split (experiments/data.py: ``split_documents`` of all 104
documents, val_fraction 0.1, seed 0) restricted to Shakespeare, so the held-out plays are the
main job's held-out plays; tokenised with the SmolLM2 tokenizer, plays joined with
``<|endoftext|>`` (id 0). Validation perplexity is ``exp(mean next-token loss)`` over a fixed set
of held-out windows (:func:`experiments.data.eval_batches`), measured before and after.

The step comes from the one fit path (:func:`chunkjax.fit_step`, as in the main job and the
benchmark): first-use order, layout, stage traces, the tide plan with host updates under the
device budget, the host-memory check, and on a GPU the compiled check. A plan that keeps every
chunk on the device is refused: the budget must be smaller than the model data (``auto``: the
smallest budget with every chunk offloaded plus 20 % of the model's chunk bytes). On the CPU the memory kinds compile to the
same memory, but the schedule, host-updated chunks and host AdamW kernel are the real ones.

The run folder ``runs/<time>-smollm2-135m-ft/`` (written under ``.partial`` and renamed when
complete, as experiments/train.py does) holds ``report.json``, ``metrics.jsonl``, ``loss.png``,
``sample.txt`` and ``hf/`` (``model.safetensors`` + ``config.json`` + ``tokenizer.json``:
``transformers.LlamaForCausalLM.from_pretrained(<run>/hf)`` loads it). Bad input exits with
status 2 and one line saying what to do.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import time

from experiments.train import UsageError, config_field, last_validation, model_bytes_split, parse_budget, run_guarded

#: Models this script can load (name -> loader in models/llama.py).
MODELS = ("smollm2-135m",)


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
    """Every knob of the fine-tuning job; defaults run on a 2-core CPU."""

    model: str = config_field("smollm2-135m", "pre-trained model: smollm2-135m")
    steps: int = config_field(200, "optimizer steps")
    batch: int = config_field(8, "sequences per step")
    seq: int = config_field(256, "tokens per sequence")
    lr: float = config_field(2e-4, "peak AdamW learning rate")
    warmup: int = config_field(20, "linear warm-up steps, then cosine decay to lr/10")
    weight_decay: float = config_field(0.0, "AdamW weight decay (decoupled)")
    clip: float = config_field(1.0, "global-norm clipping (0 disables)")
    device_budget: str = config_field("auto", 'peak device bytes ("400MiB", "2GiB", ...); auto: the smallest budget with '
                                    "every chunk offloaded + 20% of the model's chunk bytes; must leave some chunks "
                                    "host-updated")
    chunk_size: int = config_field(0, "elements per chunk; 0 searches (floored at the largest leaf)")
    min_chunks: int = config_field(8, "the search prefers sizes giving at least this many chunks")
    prefetch: int = config_field(1, "fetch distance (moments)")
    compute_dtype: str = config_field("auto", "bfloat16 | float32; auto: bfloat16 on GPU, float32 on CPU")
    eval_windows: int = config_field(32, "held-out windows (of --seq tokens, fixed) for validation perplexity")
    eval_every: int = config_field(50, "steps between validation perplexities (also measured before and after)")
    sample_tokens: int = config_field(40, "greedy tokens generated after '**ROMEO**' at the end (0 disables)")
    out_dir: str = config_field("runs", "run folders go here")
    export: bool = config_field(True, "write the fine-tuned weights as a Hugging Face checkpoint into <run>/hf")
    seed: int = config_field(0, "data order")
    progress: bool = config_field(True, "progress bar")


def parse_args(argv=None) -> FinetuneConfig:
    """Command line -> :class:`FinetuneConfig` (argparse exits with status 2 on unknown flags)."""
    ap = argparse.ArgumentParser(prog="python -m experiments.finetune", description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(FinetuneConfig):
        name = "--" + f.name.replace("_", "-")
        help_ = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")
        if f.type in ("bool", bool):
            ap.add_argument(name, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            ap.add_argument(name, type=typ, default=f.default, help=help_)
    return FinetuneConfig(**vars(ap.parse_args(argv)))


def validate(cfg: FinetuneConfig) -> None:
    """Reject bad settings before anything is loaded. Raises :class:`UsageError` (one line)."""
    import os
    if cfg.model.lower() not in MODELS:
        raise UsageError(f"--model {cfg.model!r} is not known: use one of {', '.join(MODELS)}")
    for name in ("steps", "batch", "seq", "prefetch", "eval_windows", "eval_every", "min_chunks"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    for name in ("warmup", "sample_tokens", "chunk_size"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise UsageError(f"--lr must be a positive finite number, got {cfg.lr}")
    for name in ("weight_decay", "clip"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    if cfg.device_budget != "auto":
        parse_budget(cfg.device_budget)
    if cfg.compute_dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
        raise UsageError(f"--compute-dtype {cfg.compute_dtype!r}: use bfloat16, float32 or auto")
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {cfg.out_dir!r} cannot be created ({e.strerror}): pick a writable folder") from None
    if not os.access(cfg.out_dir, os.W_OK):
        raise UsageError(f"--out-dir {cfg.out_dir!r} is not writable: pick a writable folder")


# ---- data ------------------------------------------------------------------------------------

def shakespeare_tokens(tokenizer, val_fraction: float = 0.1, seed: int = 0):
    """Shakespeare train/held-out token arrays with a ``tokenizers.Tokenizer``.

    The split is experiments/data.py's :func:`~experiments.data.split_documents` over all
    documents (the main job's split), restricted to the plays. Plays are joined with id 0
    (SmolLM2's ``<|endoftext|>``) between them.

    Returns:
      ``(train, val, meta)``: 1-D int32 arrays of token ids, and a dict with the play names.
    Raises:
      UsageError: a data package is missing (the message says what to install).
    """
    import numpy as np

    from experiments import data as data_mod
    try:
        docs = data_mod.load_documents()
    except data_mod.MissingDataError as e:
        raise UsageError(str(e)) from None
    train_docs, val_docs = data_mod.split_documents(docs, val_fraction, seed)
    train_docs = [d for d in train_docs if d.source == "shakespeare"]
    val_docs = [d for d in val_docs if d.source == "shakespeare"]
    eot = 0

    def join(ds):
        ids: list[int] = []
        for i, e in enumerate(tokenizer.encode_batch([d.text for d in ds])):
            ids += ([eot] if i else []) + e.ids
        return np.asarray(ids, np.int32)

    return join(train_docs), join(val_docs), {"train_plays": [d.name for d in train_docs],
                                              "val_plays": [d.name for d in val_docs]}


# ---- the chunked step --------------------------------------------------------------------------

def host_adamw(lr: float, steps: int, warmup: int, weight_decay: float, clip: float):
    """The optimizer: :class:`chunkjax.host_update.AdamW` with a warm-up + cosine schedule
    (0 -> lr over ``warmup`` steps, then down to lr/10 at ``steps``), clipping to global L2 norm
    ``clip`` when clip > 0. ``spec.optax()`` is the same math for plain optax / device chunks.

    Raises:
      ValueError: weight_decay or clip out of range (from AdamW).
    """
    import optax

    from chunkjax.host_update import AdamW
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1), lr / 10)
    return AdamW(sched, weight_decay=weight_decay, max_grad_norm=clip if clip > 0 else None)


def build_chunked_step(mcfg, batch: int, seq: int, spec, compute_dtype, budget_bytes: int | None,
                       chunk_size: int = 0, min_chunks: int = 8, prefetch: int = 1,
                       resident=None, require_offload: bool = True):
    """Plan and build the chunked, offloaded step of a Llama model through the one fit path
    (:func:`chunkjax.fit_step`, as the main job and the benchmark).

    Args:
      mcfg: a :class:`models.llama.LlamaConfig`.
      batch, seq: batch shape; the step takes int32 (batch, seq + 1).
      spec: the host optimizer (:class:`chunkjax.host_update.AdamW`); device chunks use
        ``spec.optax()``, the same math.
      compute_dtype: dtype of compute params and gradients (jnp.float32 / jnp.bfloat16).
      budget_bytes: device budget in bytes; None: ``"auto"`` (:func:`chunkjax.fit.auto_budget`).
      chunk_size: elements per chunk (0: searched). min_chunks, prefetch: as chunkjax.
      resident: force these chunks resident (device-updated), skipping the search (tests).
      require_offload: refuse a plan with no host-updated chunk.
    Returns:
      ``(step, info)``: the :class:`chunkjax.ChunkedStep` and a dict (``layout``, ``schedule``,
      ``budget_bytes``, ``model_chunk_bytes``, ``cb``, ``traces``, ``fit``: the fit report).
    Raises:
      UsageError: no plan fits the budget or host memory, or the budget holds the whole model.
    """
    import jax
    import jax.numpy as jnp

    import chunkjax as cj
    from models import llama

    flops = (6 * mcfg.n_params + 12 * mcfg.n_layers * seq * mcfg.d_model) * batch * seq
    try:
        step, rep, problem = cj.fit_step(
            llama.llama_stages(mcfg), lambda: llama.init_params(mcfg, jax.random.key(0)),
            jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32), device_budget="auto" if budget_bytes is None else budget_bytes,
            resident=resident, host_optimizer=spec, compute_dtype=compute_dtype, chunk_size=chunk_size or None,
            min_chunks=min_chunks, prefetch=prefetch, flops_per_step=flops)
    except cj.PlanError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(f"--chunk-size: {e}" if chunk_size else str(e)) from None
    schedule, layout = rep.schedule, problem.layout
    if require_offload and "host" not in schedule.update_locations:
        raise UsageError(f"--device-budget {rep.budget_bytes} B holds all {layout.n_chunks} chunks "
                         f"({problem.model_chunk_bytes} B of model data) on the device: give a budget below the model "
                         f"data so that some chunks are offloaded (or use auto)")
    return step, {"layout": layout, "schedule": schedule, "budget_bytes": int(rep.budget_bytes),
                  "model_chunk_bytes": int(problem.model_chunk_bytes), "cb": problem.cb, "traces": problem.traces,
                  "fit": rep}


# ---- the job -----------------------------------------------------------------------------------

def run(cfg: FinetuneConfig) -> dict:
    """Fine-tune, evaluate before/after, export, and write the run folder. Returns the report.

    Raises:
      UsageError: bad settings, missing packages, a budget that fits no plan or the whole model,
        or a non-finite loss.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from experiments import data as data_mod
    from experiments.report import RunFolder, plot_losses
    from models import llama

    t_start = time.time()
    validate(cfg)
    budget = None if cfg.device_budget == "auto" else parse_budget(cfg.device_budget)
    platform = jax.devices()[0].platform
    cdt = {"auto": jnp.bfloat16 if platform == "gpu" else jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}[cfg.compute_dtype]

    try:
        mcfg, params, tok = llama.load_smollm2_135m()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if cfg.seq > mcfg.max_seq_len:
        raise UsageError(f"--seq {cfg.seq} exceeds the model's {mcfg.max_seq_len} positions")
    train_ids, val_ids, plays = shakespeare_tokens(tok)
    if train_ids.size < cfg.seq + 1:
        raise UsageError(f"--seq {cfg.seq} is longer than the training text ({train_ids.size} tokens)")
    n_val_windows = (val_ids.size - 1) // cfg.seq
    if n_val_windows < 1:
        raise UsageError(f"--seq {cfg.seq} is longer than the held-out text ({val_ids.size} tokens)")
    eval_windows = min(cfg.eval_windows, n_val_windows)
    # one window per eval batch of size gcd-friendly: batches of `batch` windows, the rest dropped
    eb = min(cfg.batch, eval_windows)
    val = data_mod.eval_batches(val_ids, eb, cfg.seq, max(1, eval_windows // eb))

    spec = host_adamw(cfg.lr, cfg.steps, cfg.warmup, cfg.weight_decay, cfg.clip)
    step, info = build_chunked_step(mcfg, cfg.batch, cfg.seq, spec, cdt, budget, cfg.chunk_size, cfg.min_chunks,
                                    cfg.prefetch)
    layout, schedule, budget = info["layout"], info["schedule"], info["budget_bytes"]
    pred = schedule.predicted
    resolved = dataclasses.asdict(cfg) | {"device_budget_bytes": budget, "platform": platform,
                                          "compute_dtype_resolved": jnp.dtype(cdt).name}
    print("config: " + " ".join(f"{k}={v}" for k, v in resolved.items()), flush=True)
    print(layout.summary().splitlines()[0], flush=True)
    print(f"schedule: {schedule.counts()}  update locations {dict(collections.Counter(schedule.update_locations))}; "
          f"accounted peak {pred.peak_device_bytes / 2**20:.1f} MiB of budget {budget / 2**20:.1f} MiB; model data "
          f"{info['model_chunk_bytes'] / 2**20:.1f} MiB; per step h2d {pred.h2d_bytes_per_step / 2**20:.1f} MiB, "
          f"d2h {pred.d2h_bytes_per_step / 2**20:.1f} MiB", flush=True)
    print(f"data: {train_ids.size:,} training tokens ({len(plays['train_plays'])} plays), {val_ids.size:,} held-out "
          f"tokens ({len(plays['val_plays'])} plays: {', '.join(plays['val_plays'])}); validation on "
          f"{len(val) * eb} fixed windows of {cfg.seq}", flush=True)

    state = step.init(params)
    del params
    dev = jax.devices()[0]
    val = [jax.device_put(b, dev) for b in val]

    def val_loss(state):
        return float(np.mean([float(step.eval_loss(state, b)) for b in val]))

    folder = RunFolder.create(cfg.out_dir, f"{mcfg.name}-ft")
    try:
        t0 = time.perf_counter()
        v0 = val_loss(state)
        eval_s = time.perf_counter() - t0
        print(f"before: held-out loss {v0:.4f} perplexity {math.exp(v0):.2f} ({eval_s:.1f} s)", flush=True)
        records, losses = [{"step": 0, "tokens": 0, "val_loss": v0, "val_ppl": math.exp(v0)}], []
        batches = data_mod.sample_batches(train_ids, cfg.batch, cfg.seq, cfg.seed)
        tokens_per_step = cfg.batch * cfg.seq
        train_time, timed = 0.0, 0
        bar = tqdm(range(1, cfg.steps + 1), disable=not cfg.progress, unit="step", dynamic_ncols=True,
                   file=sys.stdout)
        with open(folder.path / "metrics.jsonl", "w") as mf:
            mf.write(json.dumps(records[0]) + "\n")
            for i in bar:
                b = jax.device_put(next(batches), dev)
                t0 = time.perf_counter()
                state, m = step(state, b)
                loss = float(m["loss"])
                host_s = step.wait(state)
                dt = time.perf_counter() - t0
                if not math.isfinite(loss):
                    raise UsageError(f"loss became {loss} at step {i}: lower --lr (now {cfg.lr}) or keep --clip > 0")
                if i > 1:  # step 1 compiles
                    train_time += dt
                    timed += 1
                losses.append(loss)
                rec = {"step": i, "tokens": i * tokens_per_step, "loss": loss, "grad_norm": float(m["grad_norm"]),
                       "step_s": dt, "host_update_s": host_s}
                if i % cfg.eval_every == 0 or i == cfg.steps:
                    rec["val_loss"] = val_loss(state)
                    rec["val_ppl"] = math.exp(rec["val_loss"])
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                records.append(rec)
                tps = timed * tokens_per_step / train_time if train_time else float("nan")
                bar.set_postfix(loss=f"{loss:.3f}", val_ppl=f"{math.exp(last_validation(records)):.2f}",
                                tok_s=f"{tps:,.0f}" if math.isfinite(tps) else "-")
                if not cfg.progress and ("val_loss" in rec or i == 1):
                    print(f"step {i}/{cfg.steps} loss {loss:.3f} val ppl {math.exp(last_validation(records)):.2f} "
                          f"tokens/s {tps:,.0f} step {dt:.2f}s", flush=True)
        bar.close()
        v1 = records[-1]["val_loss"]
        ppl0, ppl1 = math.exp(v0), math.exp(v1)
        print(f"after {cfg.steps} steps: held-out loss {v1:.4f} perplexity {ppl1:.2f} "
              f"(before {ppl0:.2f}: {100 * (ppl1 / ppl0 - 1):+.1f} %)", flush=True)

        step.wait(state)
        tuned = jax.tree.map(np.asarray, step.master_params(state))
        sample = None
        if cfg.sample_tokens:
            prompt = "**ROMEO**\n"
            out = llama.greedy_generate(mcfg, jax.tree.map(jnp.asarray, tuned), tok.encode(prompt).ids,
                                        cfg.sample_tokens)
            sample = prompt + tok.decode(out)
            folder.write_text("sample.txt", sample + "\n")
            print("sample (greedy):\n" + sample, flush=True)
        export_dir = None
        if cfg.export:
            export_dir = folder.path / "hf"
            llama.export_hf_checkpoint(mcfg, tuned, export_dir, tokenizer=tok)
        tps = timed * tokens_per_step / train_time if train_time else None
        report = {
            "model": mcfg.name, "n_params": mcfg.n_params, "steps": cfg.steps, "batch": cfg.batch, "seq": cfg.seq,
            "tokens": cfg.steps * tokens_per_step, "tokens_per_s": tps,
            "step_s_median": float(np.median([r["step_s"] for r in records[2:]])) if len(records) > 2 else None,
            "loss_first": losses[0], "loss_last": losses[-1], "val_loss_first": v0, "val_loss_last": v1,
            "val_ppl_before": ppl0, "val_ppl_after": ppl1, "val_ppl_change": ppl1 / ppl0 - 1,
            "val_windows": len(val) * eb, "val_tokens_scored": len(val) * eb * cfg.seq,
            "device_budget_bytes": budget,
            "peak_device_bytes_accounted": pred.peak_device_bytes, "peak_device_bytes_measured": _peak_measured(),
            "model_bytes": 14 * mcfg.n_params, "chunk_bytes_accounted": info["model_chunk_bytes"],
            "h2d_bytes_per_step_accounted": pred.h2d_bytes_per_step,
            "d2h_bytes_per_step_accounted": pred.d2h_bytes_per_step,
            "chunk_size": layout.chunk_size, "n_chunks": layout.n_chunks, "chunk_waste_bytes": layout.waste_bytes,
            "schedule_counts": schedule.counts(), "update_locations": list(schedule.update_locations),
            "compute_dtype": jnp.dtype(cdt).name, "tokenizer": "smollm2", "vocab_size": mcfg.vocab_size,
            "train_tokens_available": int(train_ids.size), "val_tokens": int(val_ids.size), **plays,
            "platform": platform, "device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__,
            "sample": sample, "export_dir": None if export_dir is None else str(folder.final / "hf"),
        }
        report.update(model_bytes_split(layout, schedule.placement, info["cb"]))
        report["config"] = resolved
        report["wall_s"] = time.time() - t_start
        folder.write_json("report.json", report)
        plot_losses(folder.path / "loss.png", folder.path / "metrics.jsonl", title=f"{mcfg.name} fine-tune (chunkjax)")
        final = folder.commit()
    except BaseException:
        folder.discard()
        raise
    print(f"run folder: {final}", flush=True)
    return report


def _peak_measured():
    import jax
    d = jax.devices()[0]
    stats = d.memory_stats() if d.platform != "cpu" else None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def main(argv=None) -> int:
    """Entry point: 0 on success, 2 on bad input (one line on stderr), 130/143 when interrupted."""
    cfg = parse_args(argv)
    return run_guarded(lambda: run(cfg))


if __name__ == "__main__":
    sys.exit(main())
