"""The plan's figures from plan_offload (abstract model) and from a schedule saved as JSON."""
import sys, json, tempfile, os
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax import plots
from chunkjax.schedule import Schedule
from chunkjax.host_update import AdamW
ab = nnx.eval_shape(lambda: TiedMoE(rngs=nnx.Rngs(0)))
p = chunkjax.plan_offload(ab, AdamW(1e-3), loss_fn, jax.ShapeDtypeStruct((8, 13), jnp.int32), device_budget="min")
d = tempfile.mkdtemp()
print(plots.save_figures(p, d))
s = json.loads(json.dumps(p.schedule.to_dict()))
s2 = Schedule.from_dict(s)
for f in (plots.plot_device_bytes, plots.plot_schedule, plots.plot_step_time, plots.plot_tide, plots.plot_placement):
    try:
        f(s2, path=os.path.join(d, f.__name__ + ".png")); print(f.__name__, "ok")
    except Exception as e:
        print(f.__name__, type(e).__name__, str(e)[:250])
try:
    print(plots.save_figures(s2, d))
except Exception as e:
    print("save_figures(schedule)", type(e).__name__, str(e)[:250])
try:
    plots.plot_budget_sweep({1 << 20: s2, 2 << 20: chunkjax.fit.plan(p.problem, 2 << 20)}, path=os.path.join(d, "sweep.png")); print("sweep ok")
except Exception as e:
    print("sweep", type(e).__name__, str(e)[:250])
print(os.listdir(d))
