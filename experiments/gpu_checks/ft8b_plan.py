"""The 8B fine-tuning plans of ``finetune_8b.sh`` on abstract shapes (nothing allocated, nothing
compiled for a device): the main job's LoRA and full fine-tuning problems for a Llama-3-8B-shaped
model at a device budget, each phase of the setup timed, the plan and its host bytes printed.

    python experiments/gpu_checks/ft8b_plan.py                       # 8B, 24 GiB, batch 8 x 2048
    python experiments/gpu_checks/ft8b_plan.py --shape 8b-narrow --json out.json
    python experiments/gpu_checks/ft8b_plan.py --jobs lora --host-gib 120

Shapes: ``8b`` (Meta-Llama-3-8B: vocab 128256, d 4096, 32 layers, 32 heads / 8 KV heads, d_ff
14336), ``8b-narrow`` (the same structure at d 512: what the import and setup cost per leaf, on a
CPU) and ``tiny``. The problems are the job's (``experiments.train.fit_model``'s arguments: its
AdamW host spec, the model's stages and FLOPs, ``trainable``) with this machine's host memory
unchecked and the platform taken as a GPU for the host bytes (on the CPU the device budget is
host memory too). On a CPU the activations are XLA CPU's (attention materialises its scores), an
over-estimate of the GPU's: the plan is a sanity check of the accounting, not the GPU's plan.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def llama_shape(name: str):
    """The :class:`models.llama.LlamaConfig` of a shape name (module docstring)."""
    from models import llama
    common = dict(rope_theta=500000.0, tie_embeddings=False, rope_type="llama3", rope_factor=8.0)
    if name == "8b":
        return llama.LlamaConfig(name="llama3-8b-random", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                                 n_kv_heads=8, head_dim=128, d_ff=14336, max_seq_len=8192,
                                 rope_original_max_pos=8192, **common)
    if name == "8b-narrow":
        return llama.LlamaConfig(name="llama3-8b-narrow", vocab_size=128256, d_model=512, n_layers=32, n_heads=8,
                                 n_kv_heads=2, head_dim=64, d_ff=1792, max_seq_len=8192, rope_original_max_pos=8192,
                                 **common)
    if name == "tiny":
        return llama.LlamaConfig(name="llama3-tiny", vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 head_dim=16, d_ff=160, max_seq_len=256, rope_original_max_pos=64, **common)
    raise ValueError(f"shape {name!r}: use 8b, 8b-narrow or tiny")


def job_models(cfg, lora: str, rank: int, alpha: float, base_dtype="bfloat16"):
    """``{"full": JobModel, "lora": JobModel}`` on abstract params as ``--init-from`` builds them
    from a ``base_dtype`` checkpoint: full fine-tuning reads float32 leaves, LoRA keeps the base
    in its stored dtype."""
    import jax
    import numpy as np

    from experiments import job_model
    from models import hf, lora as lora_mod
    f32 = {m.path: jax.ShapeDtypeStruct(m.shape, np.float32) for m in hf.tensor_map(cfg)}
    tree: dict = {}
    for path, a in f32.items():
        hf._set_path(tree, path, a)
    full = job_model.llama_model(cfg, tree)

    class _Source:  # the stored dtypes, as an HFCheckpoint reports them
        path = "abstract"

        @staticmethod
        def dtype(name):
            return np.dtype(base_dtype)

    spec = lora_mod.LoraSpec.parse(rank, alpha, lora)
    lo = job_model.with_lora(dataclasses.replace(full, source=_Source), spec)
    return {"full": full, "lora": lo}


def plan_job(model, budget: int, batch: int, seq: int, host_budget: int | None, lr: float = 1e-4,
             storage: str = "") -> dict:
    """Prepare and plan ``model`` (a JobModel) as the main job does, timing each phase; returns
    the plan's figures (bytes, seconds)."""
    import jax
    import jax.numpy as jnp

    from chunkjax import fit, fit_host
    from chunkjax.storage.updater import StorageOptions
    from experiments.train import TrainConfig, host_spec
    cfg = TrainConfig(lr=lr, warmup=0, steps=5, batch=batch, seq=seq)
    t = {}
    t0 = time.perf_counter()
    chunk_size = None
    if model.lora is not None:  # as experiments.train.fit_model
        from models.lora import adapter_chunk_size
        chunk_size = adapter_chunk_size(model.abstract_params, model.trainable, min_chunks=cfg.min_chunks)
    t["chunk_size_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    problem = fit.prepare(model.stages, model.abstract_params, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                          host_optimizer=host_spec(cfg), compute_dtype=jnp.bfloat16, chunk_size=chunk_size,
                          min_chunks=cfg.min_chunks,
                          flops_per_step=model.flops_per_token(seq) * batch * seq, trainable=model.trainable,
                          check_host=False, host_budget=host_budget,
                          storage=StorageOptions(tuple(storage.split(","))) if storage else None)
    t["prepare_s"] = time.perf_counter() - t0
    problem = dataclasses.replace(problem, platform="gpu")  # host bytes as on a GPU node
    t0 = time.perf_counter()
    sched = fit.plan(problem, budget)
    t["plan_s"] = time.perf_counter() - t0
    need = fit_host.host_need(problem, sched)
    lay, cb, p = problem.layout, problem.cb, sched.predicted
    n_params = model.n_params
    trainable_chunks = [c for c, tr in enumerate(lay.chunk_trainable) if tr]
    used = lay.chunk_used
    return {
        "n_params": n_params, "n_trainable": model.n_trainable, "chunk_size": lay.chunk_size, "n_chunks": lay.n_chunks,
        "trainable_chunks": len(trainable_chunks),
        "trainable_fill": sum(used[c] for c in trainable_chunks) / max(1, len(trainable_chunks) * lay.chunk_size),
        "waste_bytes": lay.waste_bytes, "model_chunk_bytes": problem.model_chunk_bytes,
        "counts": sched.counts(), "peak_device_bytes_accounted": int(p.peak_device_bytes),
        "device_model_bytes": int(p.device_model_bytes), "h2d_bytes_per_step": int(p.h2d_bytes_per_step),
        "d2h_bytes_per_step": int(p.d2h_bytes_per_step), "step_s_predicted": p.time.step_s,
        "host_need": need, "host_bytes_per_param": (need["pinned_host_bytes"] + need["pageable_bytes"]) / n_params,
        "host_budget_bytes": host_budget, "cb": {"params": cb.params, "grad": cb.grad, "master": cb.master, "opt": cb.opt},
        "times": t,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--budget", default="24GiB")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--jobs", default="lora,full")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32.0)
    ap.add_argument("--lora-targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--host-gib", type=float, default=None, help="host budget for model data (GiB); none: unbounded")
    ap.add_argument("--json", default=None)
    ap.add_argument("--storage", default="", help="storage directories (the disk tier), comma-separated")
    a = ap.parse_args(argv)
    import chunkjax as cj
    budget = cj.parse_bytes(a.budget)
    host = None if a.host_gib is None else int(a.host_gib * 2**30)
    cfg = llama_shape(a.shape)
    models = job_models(cfg, a.lora_targets, a.lora_rank, a.lora_alpha)
    out = {"shape": a.shape, "budget_bytes": budget, "batch": a.batch, "seq": a.seq}
    for name in a.jobs.split(","):
        r = plan_job(models[name], budget, a.batch, a.seq, host, storage=a.storage)
        out[name] = r
        gb = lambda b: b / 1e9  # noqa: E731
        h = r["host_need"]
        print(f"{name}: {r['n_params'] / 1e9:.3f}B params ({r['n_trainable'] / 1e6:.1f}M trained), "
              f"{r['n_chunks']} chunks x {r['chunk_size'] / 2**20:.1f}Mi elements ({r['trainable_chunks']} trainable, "
              f"{r['trainable_fill']:.0%} full), waste {gb(r['waste_bytes']):.2f} GB; plan {r['counts']}; accounted "
              f"peak {gb(r['peak_device_bytes_accounted']):.2f} GB of {gb(budget):.2f} GB, model data on device "
              f"{gb(r['device_model_bytes']):.2f} GB; host: pinned {gb(h['pinned_host_bytes']):.2f} GB + pageable "
              f"{gb(h['pageable_bytes']):.2f} GB + process {gb(h['process_bytes']):.2f} GB = {gb(h['need_bytes']):.2f} GB "
              f"({r['host_bytes_per_param']:.2f} B/param); h2d {gb(r['h2d_bytes_per_step']):.1f} GB/step, d2h "
              f"{gb(r['d2h_bytes_per_step']):.1f} GB/step; predicted step {r['step_s_predicted']:.2f} s; "
              f"prepare {r['times']['prepare_s']:.1f} s, plan {r['times']['plan_s']:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
