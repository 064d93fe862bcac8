"""Bad inputs through chunkjax.offload: print what each gives."""
import sys, traceback
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax

data = batches(8)
def case(name, fn):
    print(f"--- {name}")
    try:
        r = fn()
        print("   no error:", repr(r)[:300])
    except BaseException as e:
        msg = str(e)
        print(f"   {type(e).__module__}.{type(e).__name__}: lines={msg.count(chr(10))+1} len={len(msg)}")
        print("   ", msg[:600])

mk = lambda **k: TiedMoE(rngs=nnx.Rngs(0), **k)
tx = optax.adam(1e-3)
cases = sys.argv[1:] or ["small", "zero", "neg", "float", "dtype_int", "dtype_typo", "dtype_f64", "noparam", "batchshape", "batchdtype", "nan", "tuple_loss", "kw"]
if "small" in cases: case("budget 1KiB", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget="1KiB"))
if "zero" in cases: case("budget 0", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget=0))
if "neg" in cases: case("budget -5", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget=-5))
if "float" in cases: case("budget 2.5 (non-whole float)", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget=2.5))
if "dtype_int" in cases: case("compute_dtype int32", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], compute_dtype=jnp.int32))
if "dtype_typo" in cases: case("compute_dtype 'bfloat'", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], compute_dtype="bfloat"))
if "dtype_f64" in cases: case("compute_dtype float64", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], compute_dtype=jnp.float64))

class NoParams(nnx.Module):
    def __init__(self):
        self.scale = 2.0
    def __call__(self, x):
        return x * self.scale
def lf0(m, b):
    return jnp.mean(m(b.astype(jnp.float32)))
if "noparam" in cases: case("model with no parameters", lambda: chunkjax.offload(NoParams(), tx, lf0, data[0]))

def shape_case():
    step = chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget="min")
    for i in range(4):
        step(data[i])
    return step(data[4][:, :-2])
if "batchshape" in cases: case("batch shape changes at step 5", shape_case)

def dtype_case():
    step = chunkjax.offload(mk(), tx, loss_fn, data[0], device_budget="min")
    return step(data[1].astype(jnp.float32))
if "batchdtype" in cases: case("float batch for int tokens", dtype_case)

def lf_nan(m, b):
    return loss_fn(m, b) * jnp.where(b[0, 0] >= 0, jnp.nan, 1.0)
def nan_case(policy):
    def f():
        m = mk()
        step = chunkjax.offload(m, tx, lf_nan, data[0], device_budget="min", nonfinite=policy)
        l = step(data[0])
        print("   loss", l, "metrics", step.metrics)
        step.sync(m)
        return np.isnan(np.asarray(m.embed.embedding[...])).any()
    return f
if "nan" in cases:
    for p in ["ignore", "skip", "error", "bogus"]:
        case(f"nan loss, nonfinite={p}", nan_case(p))

def tuple_loss(m, b):
    return loss_fn(m, b), {"acc": 0.0}
if "tuple_loss" in cases: case("loss returns (loss, aux)", lambda: chunkjax.offload(mk(), tx, tuple_loss, data[0]))
if "kw" in cases: case("misspelt keyword", lambda: chunkjax.offload(mk(), tx, loss_fn, data[0], device_budjet="1MiB"))
