"""Issue 23 item 3: the Flax drop-in optimizer against ``nnx.Optimizer``, in one call.

The workload of ``shared/probes/nnx_dropin_probe.py``: a 1.28B-param NNX decoder (d 2048, 24
blocks, vocab 32768, 16 heads, remat per block), batch 8 x 1024, fp32 params, bf16 compute on the
GPU, AdamW(1e-4); the user's loop (jitted grads, ``opt.update`` outside, ``float(loss)`` every
step). Each system runs in its own process (a clean peak):

* ``nnx``: ``nnx.Optimizer`` inside ``nnx.jit``, everything on the device;
* ``chunk_host``: ``chunkjax.NnxOptimizer(model, chunkjax.host_update.AdamW(1e-4), device_budget=B)``:
  offloaded chunks split between the streamed pipeline and the host kernel (the headline);
* ``chunk_optax``: the same with ``optax.adamw(1e-4)`` (every offloaded chunk streamed).

Writes ``dropin_<run>.json`` (keys ``nnx_optimizer_tokens_per_s``, ``chunkjax_tokens_per_s`` (the
``chunk_host`` system), ``chunkjax_optax_tokens_per_s``, ``ratio``, ``n_params``,
``device_budget_bytes``, peak device bytes per system, losses, the optimizer's summary) and prints
a table::

    python experiments/gpu_checks/dropin.py --run s9 --out experiments/results      # on the GPU
    python experiments/gpu_checks/dropin.py --tiny --run cpu --out /tmp             # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# the repository root on the path: the script runs as a file (its children too, through this line)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FULL = dict(D=2048, L=24, V=32768, H=16, B=8, T=1024, STEPS=6, BUDGET="2GiB")
TINY = dict(D=64, L=2, V=256, H=4, B=2, T=32, STEPS=3, BUDGET="1MiB")
SYSTEMS = ("nnx", "chunk_host", "chunk_optax")


def child(kind: str, cfg: dict) -> dict:
    """One system's run (in its own process): tokens/s from the median step after the first."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import chunkjax
    from chunkjax.host_update import AdamW

    D, L, V, H, B, T, STEPS = (cfg[k] for k in ("D", "L", "V", "H", "B", "T", "STEPS"))
    cdt = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(D, rngs=rngs)
            self.ln2 = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, dtype=cdt, rngs=rngs)
            self.up = nnx.Linear(D, 4 * D, dtype=cdt, rngs=rngs)
            self.down = nnx.Linear(4 * D, D, dtype=cdt, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V, D, dtype=cdt, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])
            self.lnf = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tok):
            x = self.emb(tok)
            mask = nnx.make_causal_mask(tok)
            for b in self.blocks:
                x = nnx.remat(lambda b, x: b(x, mask))(b, x)
            return self.emb.attend(self.lnf(x)).astype(jnp.float32)

    def loss_fn(model, tok):
        logits = model(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    toks = jax.random.randint(jax.random.key(1), (STEPS + 1, B, T + 1), 0, V)
    model = LM(nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    summary, update_call_s = None, []
    if kind == "nnx":
        opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, tok):
            loss, g = nnx.value_and_grad(loss_fn)(model, tok)
            opt.update(model, g)
            return loss
        run = lambda t: step(model, opt, t)  # noqa: E731
    else:
        tx = AdamW(1e-4) if kind == "chunk_host" else optax.adamw(1e-4)  # the same math (weight decay 1e-4)
        opt = chunkjax.NnxOptimizer(model, tx, device_budget=cfg["BUDGET"])
        summary = opt.summary()
        grad_fn = nnx.jit(nnx.value_and_grad(loss_fn))

        def run(t):
            loss, g = grad_fn(model, t)
            t0 = time.perf_counter()
            opt.update(model, g)  # returns once dispatched (the host chunks' kernels done)
            update_call_s.append(time.perf_counter() - t0)
            return loss
    losses, times = [], []
    for i in range(STEPS + 1):
        t0 = time.perf_counter()
        loss = float(run(toks[i]))
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    if kind != "nnx":
        opt.wait()
    steady = sorted(times[1:])[len(times[1:]) // 2]
    mem = jax.devices()[0].memory_stats() or {}
    return {"n_params": int(n), "losses": losses, "step_s": times, "step_s_median": steady,
            "tokens_per_s": B * T / steady, "first_step_s": times[0], "peak_device_bytes": mem.get("peak_bytes_in_use"),
            "summary": summary, "update_call_s": update_call_s, "backend": jax.default_backend()}


def _summarise(res: dict) -> None:
    """The headline keys of ``res`` from its systems (``chunkjax_tokens_per_s``: the host-kernel +
    streamed system)."""
    s = res["systems"]
    tps = {k: v.get("tokens_per_s") for k, v in s.items()}
    res["n_params"] = next((v["n_params"] for v in s.values() if "n_params" in v), None)
    res["nnx_optimizer_tokens_per_s"] = tps.get("nnx")
    res["chunkjax_tokens_per_s"] = tps.get("chunk_host")
    res["chunkjax_optax_tokens_per_s"] = tps.get("chunk_optax")
    res["ratio"] = (tps["chunk_host"] / tps["nnx"]) if tps.get("chunk_host") and tps.get("nnx") else None
    res["ratio_optax"] = (tps["chunk_optax"] / tps["nnx"]) if tps.get("chunk_optax") and tps.get("nnx") else None
    res["peak_device_bytes"] = {k: v.get("peak_device_bytes") for k, v in s.items()}
    if "losses" in s.get("nnx", {}):  # the drop-in must train the same numbers (bf16 compute: ~1e-3)
        ref = s["nnx"]["losses"]
        res["max_loss_rel_diff"] = {k: max(abs(x - y) / abs(y) for x, y in zip(v["losses"], ref))
                                    for k, v in s.items() if k != "nnx" and "losses" in v}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a folder (gets dropin_<run>.json) or a .json path")
    ap.add_argument("--run", default="local", help="run id in the file name")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    ap.add_argument("--budget", default=None, help="the drop-in's device budget (default 2GiB; tiny: 1MiB)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ",".join(SYSTEMS))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system (its own process)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print("JSON" + json.dumps(child(a.child, json.loads(a.cfg))), flush=True)
        return 0
    cfg = dict(TINY if a.tiny else FULL)
    if a.budget:
        cfg["BUDGET"] = a.budget
    if a.steps:
        cfg["STEPS"] = a.steps
    from chunkjax.fit import resolve_budget
    budget = resolve_budget(cfg["BUDGET"])
    res = {"config": cfg, "device_budget_bytes": budget, "systems": {}}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    path = a.out if a.out.endswith(".json") else os.path.join(a.out, f"dropin_{a.run}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    s = res["systems"]
    for kind in a.systems.split(","):
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--child", kind,
                                "--cfg", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=a.timeout)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JSON")), None)
            s[kind] = json.loads(line[4:]) if line else {"error": f"rc={p.returncode}", "stderr": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            s[kind] = {"error": f"timed out after {a.timeout} s", "stderr": str(e.stderr or "")[-3000:]}
        s[kind]["wall_s"] = round(time.time() - t0, 1)
        _summarise(res)
        with open(path, "w") as f:  # after each system: a call cut short keeps what it measured
            json.dump(res, f, indent=1)
    tps = {k: v.get("tokens_per_s") for k, v in s.items()}
    print(f"{'system':<12} {'tokens/s':>10} {'x nnx':>7} {'step s':>8} {'peak GiB':>9}")
    for k, v in s.items():
        if "error" in v:
            print(f"{k:<12} failed {v['error']}: {v['stderr'][-300:]}")
            continue
        peak = v.get("peak_device_bytes")
        ratio = v["tokens_per_s"] / tps["nnx"] if tps.get("nnx") else float("nan")
        print(f"{k:<12} {v['tokens_per_s']:>10.0f} {ratio:>7.3f} {v['step_s_median']:>8.3f} "
              f"{(peak / 2**30 if peak else float('nan')):>9.2f}")
        if v.get("summary"):
            print("   ", v["summary"])
    print(f"n_params {res['n_params']}, device_budget {budget} bytes -> {path}")
    return 0 if all("error" not in v for v in s.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
