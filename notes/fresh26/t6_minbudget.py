"""Does the budget the refusal names work? and 1 byte below it?"""
import sys
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
data = batches(3)
for b in sys.argv[1:]:
    try:
        step = chunkjax.offload(TiedMoE(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, data[0], device_budget=int(b) if b.isdigit() else b)
        print(b, "->", step.summary()[:400])
        print("loss", float(step(data[1])))
    except Exception as e:
        print(b, "->", type(e).__name__, str(e)[:400])
