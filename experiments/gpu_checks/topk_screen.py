"""Issue 6 screening: top-k selection rules at 1 %, in memory, every step one jitted program.

Not the benchmark (that is ``python -m experiments.bench_storage --mode train``, with worker
processes and the AdamW on storage): a fast screen of which selection rule to take there. The loop
is the bench's: the main job's tiny GPT, batch 8 x 128, AdamW (lr 3e-3, 30 warm-up steps, cosine
to lr/10, clip 1.0 on the *uncompressed* gradient's global norm, as the trainer computes it before
compression), forward on the bf16 rounding of the float32 master, the dense AdamW step on the
decompressed gradient (entries not sent step with a zero gradient). The selection rules:

* ``global``: the k = 1 % entries of largest |g| over the whole flattened gradient (the bench's
  ``topk_global``).
* ``perleaf``: 1 % of every parameter tensor (layer-wise top-k, as Deep Gradient Compression).
* ``leafnorm``: one global top-k of |g| / rms(g of its tensor): scale-free across tensors (AdamW
  moves every entry by about lr whatever its gradient's scale, so a raw-|g| ranking starves the
  tensors whose gradients are small).
* ``..._dense1d``: 1-D tensors (LayerNorm scales: 1,152 of 7.26M entries) sent whole; k stays 1 %
  of the other entries.
* ``..._ef<d>``: error feedback, residual decayed by d each step.
* ``..._hold<h>``: entries not sent keep their momentum decayed by h (instead of b1 = 0.9, which
  is what a zero gradient gives); ``..._r<ratio>``: another kept fraction.
* ``densewte`` / ``denserest`` (diagnostics, not compression): the token embedding dense and 1 %
  of the rest, or the reverse.

Usage on the GPU machine (``XLA_FLAGS=--xla_gpu_deterministic_ops=true`` for comparable rows):
  SEEDS="0 1 2" python3 experiments/gpu_checks/topk_screen.py <out.json> [variant ...]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

DEFAULT_VARIANTS = ("none", "global", "global_dense1d", "perleaf", "leafnorm", "leafnorm_dense1d",
                    "perleaf_dense1d", "global_ef0.9", "leafnorm_ef0.9", "leafnorm_dense1d_ef0.5")


def parse(variant: str) -> dict:
    out = {"rule": variant.split("_")[0], "dense1d": "_dense1d" in variant, "ef": None, "hold": None,
           "ratio": None}
    for part in variant.split("_")[1:]:
        for key in ("ef", "hold", "r"):
            if part.startswith(key) and part[len(key):][:1].isdigit():
                out["ratio" if key == "r" else key] = float(part[len(key):])
    return out


def leaf_budget(sizes, k: int, alpha: float) -> list[int]:
    """k entries split over tensors in proportion to size**alpha, no tensor given more than its size
    (the excess of a full tensor is split again over the others)."""
    sizes = np.asarray(sizes, np.float64)
    out = np.zeros(len(sizes))
    free = np.ones(len(sizes), bool)
    left = float(k)
    while left > 0.5 and free.any():
        w = np.where(free, sizes ** alpha, 0.0)
        share = left * w / w.sum()
        full = free & (out + share >= sizes)
        if not full.any():
            out += share
            break
        left -= float(np.sum(sizes[full] - out[full]))
        out[full] = sizes[full]
        free &= ~full
    return [int(min(n, max(1, round(x)))) for n, x in zip(sizes, out)]


def make_step(model, variant: str, ratio: float):
    from experiments.bench_storage import _schedule
    opt = parse(variant)
    ratio = opt["ratio"] or ratio
    cfg = model.cfg
    sched = _schedule(cfg)
    sizes = list(model.sizes)
    ndims = [len(s) for s in model.shapes]
    bounds = np.cumsum([0] + sizes)
    P = int(bounds[-1])
    leaf_id = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes), jnp.int32)
    is1d = np.repeat(np.array([d <= 1 for d in ndims]), sizes)
    n_comp = int(P - is1d.sum()) if opt["dense1d"] else P
    dense_mask = jnp.asarray(is1d) if opt["dense1d"] else None
    b1, b2, eps = 0.9, 0.999, 1e-8

    def select(g):  # (P,) -> (P,) bool mask of the entries sent
        a = jnp.abs(g)
        if opt["rule"] == "none":
            return jnp.ones_like(g, bool)
        if opt["rule"].startswith("alloc") or opt["rule"] == "perleaf":
            alpha = 1.0 if opt["rule"] == "perleaf" else float(opt["rule"][5:])
            ks = leaf_budget(sizes, int(np.ceil(ratio * P)), alpha)
            parts = []
            for i in range(len(sizes)):
                s = a[bounds[i]:bounds[i + 1]]
                k = max(1, int(np.ceil(ratio * sizes[i]))) if opt["rule"] == "perleaf" else ks[i]
                if opt["dense1d"] and ndims[i] <= 1 or k >= sizes[i]:
                    parts.append(jnp.ones_like(s, bool))
                else:
                    parts.append(s >= jnp.sort(s)[sizes[i] - k])
            return jnp.concatenate(parts)
        if opt["rule"].startswith("split"):  # a fraction f of the k entries to all but the embedding
            f = float(opt["rule"][5:])
            wte = jnp.asarray(np.repeat(np.array([s == model.shapes[-1] for s in model.shapes]), sizes))
            n_w = int(np.prod(model.shapes[-1]))
            k = int(np.ceil(ratio * P))
            kr, kw = int(round(f * k)), k - int(round(f * k))
            aw, ar = jnp.where(wte, a, -1.0), jnp.where(wte, -1.0, a)
            return (aw >= jnp.sort(aw)[P - kw]) | (ar >= jnp.sort(ar)[P - kr])
        if opt["rule"] in ("densewte", "denserest"):  # diagnostics: one part dense, top-k of the other
            wte = np.repeat(np.array([s == model.shapes[-1] for s in model.shapes]), sizes)
            dense = wte if opt["rule"] == "densewte" else ~wte
            n = int(np.sum(~dense))
            dense = jnp.asarray(dense)
            a = jnp.where(dense, -1.0, a)
            return (a >= jnp.sort(a)[P - int(np.ceil(ratio * n))]) | dense
        if opt["rule"] == "leafnorm":
            ms = jax.ops.segment_sum(a * a, leaf_id, len(sizes)) / jnp.asarray(sizes, jnp.float32)
            a = a / jnp.sqrt(ms + 1e-30)[leaf_id]
        elif opt["rule"] != "global":
            raise ValueError(variant)
        if dense_mask is not None:
            a = jnp.where(dense_mask, -1.0, a)
        k = int(np.ceil(ratio * n_comp))
        m = a >= jnp.sort(a)[P - k]
        return m if dense_mask is None else m | dense_mask

    @jax.jit
    def step(master, mu, nu, res, count, batch):
        p16 = master.astype(jnp.bfloat16).astype(jnp.float32)
        loss, g = model.loss_grad(p16, batch)
        norm = jnp.sqrt(jnp.sum(g * g))
        ge = g + res if opt["ef"] is not None else g
        mask = select(ge)
        sent = jnp.where(mask, ge, 0.0)
        res = (ge - sent) * opt["ef"] if opt["ef"] is not None else res
        gs = jnp.where(norm < cfg.clip, sent, sent / norm * cfg.clip)
        mu_new = b1 * mu + (1 - b1) * gs
        if opt["hold"] is not None:  # entries not sent: momentum decays by `hold` instead of b1
            mu_new = jnp.where(mask, mu_new, opt["hold"] * mu)
        mu = mu_new
        nu = b2 * nu + (1 - b2) * gs * gs
        t = (count + 1).astype(jnp.float32)
        u = (mu / (1 - b1 ** t)) / (jnp.sqrt(nu / (1 - b2 ** t)) + eps)
        master = master - sched(count) * u
        per_leaf = jax.ops.segment_sum(mask.astype(jnp.float32), leaf_id, len(sizes))
        return master, mu, nu, res, count + 1, loss, per_leaf

    return step


def run(model, variant: str, ratio: float) -> dict:
    step = make_step(model, variant, ratio)
    P = model.init_flat.size
    master = jnp.asarray(model.init_flat)
    mu = jnp.zeros(P, jnp.float32)
    nu = jnp.zeros(P, jnp.float32)
    res = jnp.zeros(P, jnp.float32)
    count = jnp.int32(0)
    batches = model.batches()
    vals, kept = {}, np.zeros(len(model.sizes))
    t0 = time.perf_counter()
    for i in range(1, model.cfg.steps + 1):
        master, mu, nu, res, count, loss, per_leaf = step(master, mu, nu, res, count, next(batches))
        kept += np.asarray(per_leaf)
        if i % 100 == 0 or i == model.cfg.steps:
            vals[i] = model.val_loss(master.astype(jnp.bfloat16).astype(jnp.float32))
    steps = model.cfg.steps
    return {"val": vals, "val_loss": vals[steps], "wall_s": time.perf_counter() - t0,
            "sent_fraction": float(kept.sum() / steps / P),
            "kept_per_leaf_mean": (kept / steps).tolist()}


def main():
    from experiments.bench_storage import _Model
    from experiments.train import TrainConfig
    out_path = sys.argv[1]
    variants = sys.argv[2:] or list(DEFAULT_VARIANTS)
    seeds = [int(s) for s in os.environ.get("SEEDS", "0 1 2").split()]
    ratio = float(os.environ.get("RATIO", "0.01"))
    steps = int(os.environ.get("STEPS", "300"))
    res = {"variants": variants, "seeds": seeds, "ratio": ratio, "steps": steps, "runs": {}}
    for seed in seeds:
        cfg = dataclasses.replace(TrainConfig(), seed=seed, steps=steps)
        model = _Model(cfg)
        res["leaves"] = [[str(s), int(n)] for s, n in zip(model.shapes, model.sizes)]
        for v in variants:
            r = run(model, v, ratio)
            res["runs"][f"{v}/s{seed}"] = r
            print(f"seed {seed} {v:24s} val {r['val_loss']:.4f} sent {r['sent_fraction']:.4%} "
                  f"({r['wall_s']:.0f}s)", flush=True)
            with open(out_path, "w") as f:
                json.dump(res, f, indent=1)
    print(f"\n{'variant':24s} " + " ".join(f"s{s:<7d}" for s in seeds) + " mean     vs none")
    base = {s: res["runs"][f"none/s{s}"]["val_loss"] for s in seeds if f"none/s{s}" in res["runs"]}
    for v in variants:
        vs = [res["runs"][f"{v}/s{s}"]["val_loss"] for s in seeds]
        rel = (np.mean(vs) - np.mean(list(base.values()))) / np.mean(list(base.values())) if base else float("nan")
        print(f"{v:24s} " + " ".join(f"{x:.4f} " for x in vs) + f" {np.mean(vs):.4f}  {rel:+.2%}")


if __name__ == "__main__":
    main()
