"""The figures and the machine-readable report of my model."""
import sys, json, os
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax import plots
from chunkjax.host_update import AdamW

data = batches(3)
out = sys.argv[1]
step = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0)), AdamW(1e-3, max_grad_norm=1.0), loss_fn, data[0], device_budget="min")
step(data[1])
r = step.report.to_dict()
s = json.dumps(r)
print("report keys", sorted(r)[:40], len(s))
print(json.dumps({k: r[k] for k in r if not isinstance(r[k], (dict, list))}, indent=0)[:1500])
paths = plots.save_figures(step, out)
print("figures", paths)
print(os.listdir(out))
