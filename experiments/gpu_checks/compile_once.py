"""GPU check of the compiled check compiling each program once (footprint.compiled_programs, kept by
ChunkedStep.runnable): the fit path (check_compiled on, as on every accelerator) then two steps, the
programs lowered and compiled counted by name, with the seconds of each phase. Results JSON to $OUT.

    python experiments/gpu_checks/compile_once.py     # on the GPU machine, repo root (< 2 min)

Expect every ``chunkjax_program_<k>`` lowered once during the fit and none in either step (before
the change: each program taking a pinned_host chunk was lowered and compiled again at step 1).

Then the set-up's compile phase of a large plan (``COMPILE_MODEL``, default GPT3_6B, batch 16 x 1024,
24 GiB: its programs, nothing initialised): ``footprint.compiled_programs`` with its default threads,
one thread, the default again (XLA's autotuning results are cached in the process, so the third
shows the parallel compile without autotuning and the second has the cache's help).
"""
import json
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from chunkjax import fit
from chunkjax.host_update import AdamW
from models import gpt

LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"
events: list = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: events.append((e, str(kw.get("fun_name")), d)) if e in (LOWER, COMPILE) else None)


def programs(since: int, event: str) -> list[int]:
    return sorted(int(m.group(1)) for e, n, _ in events[since:] if e == event
                  and (m := re.search(r"chunkjax_program_(\d+)", n)))


def seconds(since: int, event: str) -> float:
    return round(sum(d for e, _, d in events[since:] if e == event), 2)


cfg = gpt.get_config("gpt2-small")  # 124M; the auto budget offloads most chunks (params in pinned_host)
batch = jax.ShapeDtypeStruct((8, 1025), jnp.int32)
problem = fit.prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), batch, host_optimizer=AdamW(3e-4),
                      compute_dtype=jnp.bfloat16)
out = {"jax": jax.__version__, "device": str(jax.devices()[0])}
n0, t = len(events), time.time()
step, rep, _ = fit.fit_problem(problem, "auto")
out["fit"] = {"s": round(time.time() - t, 1), "lowered": programs(n0, LOWER), "compiled": programs(n0, COMPILE),
              "compile_s": seconds(n0, COMPILE), "n_programs": len(step.program_bounds()),
              "counts": rep.schedule.counts(), "budget_bytes": rep.budget_bytes, "compiled_check": rep.compiled is not None}
state = step.init(gpt.leaf_initializer(cfg, jax.random.key(0), step.layout))
rng = np.random.default_rng(0)
for i in range(2):
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, batch.shape), jnp.int32)
    n0, t = len(events), time.time()
    state, m = step(state, tokens)
    step.wait(state)
    out[f"step{i + 1}"] = {"s": round(time.time() - t, 1), "lowered": programs(n0, LOWER),
                           "compiled": programs(n0, COMPILE), "compile_s": seconds(n0, COMPILE),
                           "loss": float(m["loss"])}
out["ok"] = (out["fit"]["lowered"] == list(range(out["fit"]["n_programs"]))
             and not out["step1"]["lowered"] and not out["step2"]["lowered"])
print(f"{'phase':8} {'s':>6} {'compile_s':>9}  programs lowered")
for k in ("fit", "step1", "step2"):
    print(f"{k:8} {out[k]['s']:6.1f} {out[k]['compile_s']:9.2f}  {out[k]['lowered']}")
print("each program compiled once:", out["ok"])

from chunkjax import footprint  # noqa: E402

big = gpt.get_config(os.environ.get("COMPILE_MODEL", "GPT3_6B"))
bb = jax.ShapeDtypeStruct((16, 1025), jnp.int32)
t = time.time()
bstep, brep, _ = fit.fit_problem(fit.prepare(gpt.gpt_stages(big), gpt.abstract_params(big), bb, host_optimizer=AdamW(1e-4),
                                             compute_dtype=jnp.bfloat16), "24GiB", check_compiled=False)
out["parallel_compile"] = {"model": os.environ.get("COMPILE_MODEL", "GPT3_6B"), "plan_s": round(time.time() - t, 1),
                           "n_programs": len(bstep.program_bounds()), "cpu_count": os.cpu_count(), "runs": []}
for w in (None, 1, None):
    for key in [k for k in bstep._cache if k[0] in ("program", "compiled")]:
        del bstep._cache[key]
    t = time.time()
    footprint.compiled_programs(bstep, bb, workers=w)
    out["parallel_compile"]["runs"].append({"workers": w or "default", "s": round(time.time() - t, 1)})
print("compile phase of", out["parallel_compile"]["model"], out["parallel_compile"]["n_programs"], "programs:",
      out["parallel_compile"]["runs"])
with open(os.path.join(os.environ.get("OUT", "/tmp"), "compile_once.json"), "w") as f:
    json.dump(out, f, indent=1)
