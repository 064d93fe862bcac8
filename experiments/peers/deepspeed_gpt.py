"""One DeepSpeed peer measurement (issue 9): the GPT architecture of ``models/gpt.py`` as a
Hugging Face ``GPT2LMHeadModel``, trained under DeepSpeed ZeRO-Offload (stage 2, optimizer state
and its update on the CPU) or ZeRO-Infinity (stage 3, params and optimizer state offloaded to the
CPU, or to NVMe with ``--nvme-dir``), on one GPU with the device budget emulated by
``torch.cuda.set_per_process_memory_fraction(budget / card)``.

Run by :mod:`experiments.peers.run_peers` in its own process (a clean peak and start-up); needs
torch, transformers and deepspeed (carried as wheels: ``make peer-wheels``; README of this
folder). The settings match the benchmark (issue 4, item 2): AdamW lr 1e-4 (weight decay 1e-4),
no clipping or loss scaling, bf16 compute with fp32 master params (DeepSpeed ``bf16``), activation
checkpointing per block, random tokens (the same batch every step), the batch as one
micro-batch, no dropout, SDPA (flash) attention where transformers offers it.

Writes one JSON record (``--out``): ``tokens_per_s``, ``tflops`` (the FLOPs per token of
:meth:`models.gpt.GPTConfig.flops_per_token`, 6N + 12 L S h, N of our config), ``step_s_median``,
``step_s_all``, ``losses``, ``peak_device_bytes_measured`` (``torch.cuda.max_memory_allocated``),
``peak_device_reserved_bytes``, ``host_rss_peak_bytes_measured``, ``init_s`` (model build plus
``deepspeed.initialize``, the CPU Adam build included on a first run), ``torch_matmul_tflops`` (bf16
n x n matmuls in this process), ``n_params_hf`` (the HF model's own count: GPT-2 has biases, ours
not), ``feasible`` and ``error`` (an out-of-memory or any failure: the exception's last line).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback

os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29511")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from experiments.peers.common import ds_config, peer_record  # noqa: E402  (torch-free helpers)


def torch_matmul_tflops(n: int = 8192, reps: int = 10) -> float:
    """bf16 n x n x n matmul rate of this GPU under torch (TFLOP/s), after 3 warm-ups."""
    import torch
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12


def build_model(cfg, zero_init_config: dict | None):
    """The HF GPT-2 model of our config (no dropout, SDPA attention where available)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    hf = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
                    n_head=cfg.n_heads, use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                    tie_word_embeddings=True)
    kw = {}
    try:
        hf._attn_implementation = "sdpa"
    except Exception:
        kw = {}
    if zero_init_config is not None:
        import deepspeed
        with deepspeed.zero.Init(config_dict_or_path=zero_init_config):
            model = GPT2LMHeadModel(hf, **kw)
    else:  # built in bf16 on the device (fp32 would not fit a 24 GiB budget at GPT3_6B)
        dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = GPT2LMHeadModel(hf, **kw)
        finally:
            torch.set_default_dtype(dtype)
    model.gradient_checkpointing_enable()
    model.train()
    return model


def measure(args) -> dict:
    import torch
    rec: dict = {"system": args.system, "model": args.model, "batch": args.batch, "seq": args.seq,
                 "device_budget_bytes": args.budget_bytes, "feasible": False, "error": None}
    from models import gpt
    cfg = gpt.get_config(args.model)
    card = torch.cuda.get_device_properties(0).total_memory
    frac = min(1.0, args.budget_bytes / card)
    torch.cuda.set_per_process_memory_fraction(frac)
    rec.update(card_bytes=card, mem_fraction=frac, torch_version=torch.__version__,
               pytorch_cuda_alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    rec["torch_matmul_tflops"] = torch_matmul_tflops(args.matmul_n)
    import deepspeed
    import transformers
    rec.update(deepspeed_version=deepspeed.__version__, transformers_version=transformers.__version__)
    conf = ds_config(args.system, args.batch, nvme_dir=args.nvme_dir)
    rec["ds_config"] = conf
    t0 = time.perf_counter()
    model = build_model(cfg, conf if conf["zero_optimization"]["stage"] == 3 else None)
    rec["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    rec["n_params_hf"] = int(sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=conf)
    rec["init_s"] = time.perf_counter() - t0
    print(f"[peer] {args.system} {args.model} b{args.batch}: init {rec['init_s']:.1f} s", file=sys.stderr, flush=True)
    g = torch.Generator().manual_seed(args.seed)
    tok = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).cuda()
    losses, times = [], []
    for i in range(1 + args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = engine(input_ids=tok, labels=tok).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        losses.append(float(loss))
        if i:
            times.append(time.perf_counter() - t)
        print(json.dumps({"peer_progress": i, "loss": losses[-1], "s": time.perf_counter() - t}), file=sys.stderr,
              flush=True)
    rec.update(losses=losses, step_s_all=times, feasible=True,
               peak_device_bytes_measured=int(torch.cuda.max_memory_allocated()),
               peak_device_reserved_bytes=int(torch.cuda.max_memory_reserved()))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", required=True, choices=("ds_zero_offload", "ds_zero_infinity"))
    ap.add_argument("--model", default="GPT2_1B")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budget-bytes", type=int, required=True, help="device budget (bytes)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--nvme-dir", default=None, help="ZeRO-Infinity: offload to this NVMe folder, not the CPU")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    try:
        rec = measure(args)
    except BaseException as e:  # out of memory included: recorded, never raised
        tb = traceback.format_exc().strip().splitlines()
        rec = {"system": args.system, "model": args.model, "batch": args.batch, "seq": args.seq,
               "device_budget_bytes": args.budget_bytes, "feasible": False,
               "error": f"{type(e).__name__}: {e}"[:2000], "traceback_tail": tb[-12:]}
        try:
            import torch
            rec["peak_device_bytes_measured"] = int(torch.cuda.max_memory_allocated())
        except Exception:
            pass
    rec["host_rss_peak_bytes_measured"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rec["wall_s"] = time.time() - t0
    rec = peer_record(rec)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(rec, fh, indent=1, default=str)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
