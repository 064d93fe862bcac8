"""Disk tier on my model, then close_storage(step) and call the step again."""
import sys, tempfile
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW
from chunkjax.storage.updater import close_storage

if __name__ == "__main__":
    data = batches(6)
    d = tempfile.mkdtemp()
    spec = AdamW(3e-3, weight_decay=0.1)
    ref, ref_losses = reference(spec.optax(), data, TiedMoE(rngs=nnx.Rngs(0), count=False))
    m = TiedMoE(rngs=nnx.Rngs(0), count=False)
    step = chunkjax.offload(m, spec, loss_fn, data[0], device_budget="min", storage=[d], host_budget="402KiB")
    print(step.schedule.counts())
    cj = [float(step(b)) for b in data[:5]]
    print("losses", cj, "ref", ref_losses[:5])
    np.testing.assert_allclose(cj, ref_losses[:5], rtol=2e-5)
    close_storage(step.step if "inner" in sys.argv else step)
    for what, fn in [("step", lambda: step(data[5])), ("sync", lambda: step.sync(m)),
                     ("save", lambda: chunkjax.save_checkpoint(tempfile.mkdtemp(), 5, step)),
                     ("close again", lambda: close_storage(step))]:
        try:
            r = fn()
            print(what, "-> no error", r)
        except Exception as e:
            print(what, "->", type(e).__name__, str(e)[:400])
