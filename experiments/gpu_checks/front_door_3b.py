"""Issue 22 GPU check: a ~3B Llama-style NNX model through the front door against nnx.Optimizer.

One process, the same model (d 3072, 28 blocks, 24 heads / 8 KV heads, SwiGLU 8192, vocab 32768,
float32 params, bf16 compute), the same AdamW and the same batches:

1. ``chunkjax.offload(model, chunkjax.host_update.AdamW(...), loss_fn, batch,
   device_budget=model data / 3, compute_dtype=bfloat16)``: the tide plan, host AdamW for
   offloaded chunks (the model is built in host memory, so the device holds what the plan puts
   there); run first, so the device's peak-bytes counter is its own;
2. ``nnx.Optimizer(model, optax.adamw(...))`` with everything on the device, one ``nnx.jit`` step.

Model data = 16 bytes per parameter (bf16 params and gradients, float32 master, Adam m and v).
Prints a table and writes JSON (tokens/s of both, ratio, model TFLOP/s at 6N per token, peak device
bytes, budget, n_params)::

    python experiments/gpu_checks/front_door_3b.py $OUT/front_door_3b.json          # the H200
    python experiments/gpu_checks/front_door_3b.py /tmp/fd.json --tiny              # a CPU smoke run

Options: --batch 16 --seq 1024 --steps 8 --warmup 2 --budget-fraction 0.3333. At 16 x 1024 the
nnx.Optimizer run needs about 110 GiB (no rematerialisation); chunkjax recomputes each block in
the backward (8N FLOPs per token against 6N), so 0.75x is its compute-bound ceiling against it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import chunkjax  # noqa: E402
from chunkjax.host_update import AdamW  # noqa: E402

CONFIGS = {
    "3b": dict(vocab=32768, d=3072, heads=24, kv_heads=8, layers=28, ffn=8192),
    "tiny": dict(vocab=256, d=64, heads=4, kv_heads=2, layers=2, ffn=128),
}
LR, WD = 3e-4, 0.1
BYTES_PER_PARAM = 16


class RMSNorm(nnx.Module):
    def __init__(self, d):
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
        return (y * self.scale[...]).astype(x.dtype)


def rotary(x, cos, sin):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Block(nnx.Module):
    def __init__(self, d, heads, kv_heads, ffn, rngs):
        self.h, self.kv, self.hd = heads, kv_heads, d // heads
        lin = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
        self.wq = nnx.Linear(d, heads * self.hd, **lin)
        self.wk = nnx.Linear(d, kv_heads * self.hd, **lin)
        self.wv = nnx.Linear(d, kv_heads * self.hd, **lin)
        self.wo = nnx.Linear(heads * self.hd, d, **lin)
        self.w1, self.w3 = nnx.Linear(d, ffn, **lin), nnx.Linear(d, ffn, **lin)
        self.w2 = nnx.Linear(ffn, d, **lin)

    def __call__(self, x, cos, sin):
        B, T, _ = x.shape
        h = self.n1(x)
        q = rotary(self.wq(h).reshape(B, T, self.h, self.hd), cos, sin)
        k = rotary(self.wk(h).reshape(B, T, self.kv, self.hd), cos, sin)
        v = self.wv(h).reshape(B, T, self.kv, self.hd)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # GQA: 8 KV heads for 24 query heads
        x = x + self.wo(a.reshape(B, T, -1))
        h = self.n2(x)
        return x + self.w2(jax.nn.silu(self.w1(h)) * self.w3(h))


class Llama(nnx.Module):
    def __init__(self, vocab, d, heads, kv_heads, layers, ffn, *, rngs):
        self.embed = nnx.Embed(vocab, d, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, kv_heads, ffn, rngs) for _ in range(layers)])
        self.norm = RMSNorm(d)
        self.lm_head = nnx.Linear(d, vocab, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.hd = d // heads

    def __call__(self, tokens):
        T = tokens.shape[1]
        freqs = jnp.arange(T, dtype=jnp.float32)[:, None] / 10000.0 ** (jnp.arange(self.hd // 2) / (self.hd // 2))
        cos, sin = jnp.cos(freqs)[None, :, None, :], jnp.sin(freqs)[None, :, None, :]
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.lm_head(self.norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def batches(cfg, rows, seq, n):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.integers(0, cfg["vocab"], (rows, seq + 1)), jnp.int32) for _ in range(n)]


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def timed(run_step, data, warmup, sync):
    losses = [float(run_step(b)) for b in data[:warmup]]
    sync()
    t = time.perf_counter()
    out = [run_step(b) for b in data[warmup:]]
    sync()
    jax.block_until_ready(out)
    dt = time.perf_counter() - t
    return losses + [float(x) for x in out], dt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="path of the JSON written")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, runnable on the CPU")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-fraction", type=float, default=1 / 3, help="device budget / model data")
    a = ap.parse_args(argv)
    cfg = CONFIGS["tiny" if a.tiny else "3b"]
    rows, seq = a.batch or (2 if a.tiny else 16), a.seq or (32 if a.tiny else 1024)
    data = batches(cfg, rows, seq, a.warmup + a.steps)
    tokens = rows * seq * a.steps
    res = {"config": cfg, "batch": rows, "seq": seq, "steps": a.steps, "warmup": a.warmup,
           "backend": jax.default_backend(), "device": str(jax.devices()[0]), "lr": LR, "weight_decay": WD}

    # 1. the front door (model built in host memory; run first: the peak counter is its own)
    with jax.default_device(jax.devices("cpu")[0]):
        model = Llama(**cfg, rngs=nnx.Rngs(0))
    n_params = sum(int(np.size(x)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    model_bytes = BYTES_PER_PARAM * n_params
    budget = int(model_bytes * a.budget_fraction)
    res.update(n_params=n_params, model_data_bytes=model_bytes)
    spec = AdamW(LR, weight_decay=WD)
    t0 = time.perf_counter()
    try:
        step = chunkjax.offload(model, spec, loss_fn, data[0], device_budget=budget, compute_dtype=jnp.bfloat16)
    except chunkjax.PlanError as e:
        if not a.tiny:
            res["error"] = str(e)
            write(a.out, res)
            raise
        budget = int(e.min_budget_bytes * 1.05)  # a tiny model's activations outweigh its model data
        res["note"] = f"--tiny: budget raised to the plan's smallest ({e.min_budget_bytes} B)"
        step = chunkjax.offload(model, spec, loss_fn, data[0], device_budget=budget, compute_dtype=jnp.bfloat16)
    res["chunkjax_setup_s"] = round(time.perf_counter() - t0, 1)
    res.update(device_budget_bytes=budget, budget_fraction_of_model_data=budget / model_bytes, plan=step.summary(),
               fit=step.report.to_dict())
    losses, dt = timed(step, data, a.warmup, step.wait)
    res.update(chunkjax_tokens_per_s=tokens / dt, chunkjax_step_s=dt / a.steps, chunkjax_losses=losses,
               chunkjax_peak_device_bytes=peak_bytes(), chunkjax_model_tflops=6 * n_params * tokens / dt / 1e12)
    write(a.out, res)  # kept if the baseline below fails
    del step, model
    gc.collect()
    jax.clear_caches()

    # 2. nnx.Optimizer, everything on the device
    model = Llama(**cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(LR, weight_decay=WD), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    try:
        losses, dt = timed(lambda b: train_step(model, opt, b), data, a.warmup, lambda: None)
    except Exception as e:  # e.g. out of device memory: the chunkjax row stands alone
        res["nnx_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        write(a.out, res)
        raise
    res.update(nnx_tokens_per_s=tokens / dt, nnx_step_s=dt / a.steps, nnx_losses=losses,
               nnx_peak_device_bytes=peak_bytes(), nnx_model_tflops=6 * n_params * tokens / dt / 1e12)
    res["ratio"] = res["chunkjax_tokens_per_s"] / res["nnx_tokens_per_s"]

    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print(f"model: {n_params / 1e9:.3f}B params, model data {gib(model_bytes)} GiB; batch {rows} x {seq}; "
          f"{jax.devices()[0].device_kind}")
    print(f"{'system':<28}{'tokens/s':>12}{'step s':>9}{'peak GiB':>10}{'budget GiB':>12}{'loss[0]':>9}{'loss[-1]':>9}")
    for name, k, bud in (("chunkjax.offload (tide)", "chunkjax", gib(budget)), ("nnx.Optimizer (device)", "nnx", "-")):
        print(f"{name:<28}{res[k + '_tokens_per_s']:>12,.0f}{res[k + '_step_s']:>9.3f}"
              f"{gib(res[k + '_peak_device_bytes']):>10}{bud:>12}"
              f"{res[k + '_losses'][0]:>9.4f}{res[k + '_losses'][-1]:>9.4f}")
    print(f"ratio chunkjax / nnx: {res['ratio']:.3f}")
    print(res["plan"])
    write(a.out, res)


def write(path, res):
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
