"""Issue 8 GPU checks of reported cases 10 and 17 (and 18 via pytest); results JSON to $OUT.

    python experiments/gpu_checks/cases.py      # on the GPU machine, repo root, OUT set (gpu_cases_s8.json)
"""
import json, os, subprocess, sys, time
OUT = os.environ.get("OUT", "/tmp")
res = {}

def sub(code, env_extra, timeout=240):
    env = dict(os.environ); env.pop("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", None); env.update(env_extra)
    t = time.time()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    return {"rc": p.returncode, "s": round(time.time() - t, 1), "stdout": p.stdout[-1500:], "stderr": p.stderr[-1500:]}

# case 17: raw JAX indexing of a pinned_host array, then chunkjax's master_params path
c17 = r'''
import jax, numpy as np, json, optax, jax.numpy as jnp
from chunkjax.memory import sharding, PINNED_HOST, DEVICE
out = {"jax": jax.__version__, "backend": jax.default_backend()}
a = jax.device_put(np.arange(12, dtype=np.float32).reshape(3, 4), sharding(PINNED_HOST))
out["placed_kind"] = a.sharding.memory_kind
for name, f in [("a[0]", lambda: a[0]), ("a[1:3, ::2]", lambda: a[1:3, ::2]), ("jit a[0]", lambda: jax.jit(lambda x: x[0])(a))]:
    try:
        v = f(); out[name] = {"ok": True, "value": np.asarray(v).tolist(), "kind": v.sharding.memory_kind}
    except Exception as e:
        out[name] = {"ok": False, "error": (type(e).__name__ + ": " + str(e))[:400]}
from chunkjax import build_layout, make_chunked_step, Placement
params = {"w0": jnp.asarray(np.random.default_rng(0).normal(size=(7, 5)), jnp.float32),
          "shared": jnp.asarray(np.random.default_rng(1).normal(size=(5, 6)), jnp.float32)}
lay = build_layout(params, 64)
from chunkjax import Stage
st = (Stage("only", ("w0", "shared"), lambda p, x, b: jnp.mean((b @ p["w0"] @ p["shared"]) ** 2)),)
step = make_chunked_step(st, lay, Placement.uniform(lay.n_chunks, PINNED_HOST, PINNED_HOST), optax.adam(1e-3), jnp.float32)
state = step.init(params)
out["master_kinds"] = sorted({m.sharding.memory_kind for m in state.master})
m = step.master_params(state)
out["chunkjax_master_kinds"] = sorted({l.sharding.memory_kind for l in jax.tree.leaves(m)})
out["chunkjax_index_equal"] = bool(np.array_equal(np.asarray(m["w0"][0]), np.asarray(params["w0"][0])) and
    np.array_equal(np.asarray(m["shared"][1:3, ::2]), np.asarray(params["shared"][1:3, ::2])))
print("JSON" + json.dumps(out))
'''
res["case17"] = sub(c17, {})

# case 10 raw: a 66 GiB pinned_host allocation with the default cap, then with the cap lifted
c10raw = r'''
import jax, jax.numpy as jnp, time
from chunkjax.memory import sharding, PINNED_HOST
n = 66 * 2**30 // 2
t = time.time()
try:
    a = jax.jit(lambda: jnp.ones((n,), jnp.bfloat16), out_shardings=sharding(PINNED_HOST))()
    a.block_until_ready(); print("ALLOCATED", a.sharding.memory_kind, round(time.time()-t,1))
except Exception as e:
    print("ERROR", (type(e).__name__ + ": " + str(e))[:600])
'''
res["case10_raw_default_cap"] = sub(c10raw, {})
res["case10_raw_cap_100"] = sub(c10raw, {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "100"})

# case 10 chunkjax: GPT3_6B all on host (> 64 GiB pinned) refused before allocating
c10cj = r'''
import jax, jax.numpy as jnp, optax
from models.gpt import abstract_params, get_config, gpt_stages
from chunkjax import build_layout, make_chunked_step, Placement, PlanError, PINNED_HOST
cfg = get_config("GPT3_6B"); params = abstract_params(cfg)
lay = build_layout(params, cfg.vocab_size * cfg.d_model)
step = make_chunked_step(gpt_stages(cfg), lay, Placement.uniform(lay.n_chunks, PINNED_HOST, PINNED_HOST), optax.adamw(1e-4), jnp.bfloat16)
print("PINNED_BYTES", step.pinned_host_bytes())
before = (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", -1)
try:
    step.init(params); print("NOT REFUSED")
except PlanError as e:
    print("REFUSED", str(e)); print("DEVICE_BYTES_IN_USE", before, (jax.devices()[0].memory_stats() or {}).get("bytes_in_use", -1))
'''
res["case10_chunkjax_default_cap"] = sub(c10cj, {})

# case 17/18/10 tests on the GPU backend
p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cases.py", "-k",
                    "case17 or case18 or case10"], capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cuda"), timeout=300)
res["pytest_gpu"] = {"rc": p.returncode, "tail": p.stdout[-2500:] + p.stderr[-1000:]}
json.dump(res, open(os.path.join(OUT, "gpu_cases.json"), "w"), indent=1)
for k, v in res.items():
    print("==", k, v.get("rc"), (v.get("stdout") or v.get("tail") or "")[-700:].replace("\n", " | "))
