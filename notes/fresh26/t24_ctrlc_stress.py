"""Ctrl-C (SIGINT) at random moments during 20 steps; after each KeyboardInterrupt the loop retries
the batch unless the exception's note says the step was applied. The final params must equal the
uninterrupted run's bit for bit."""
import sys, signal, threading, random, os, time
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

kind = sys.argv[1] if len(sys.argv) > 1 else "host"
mk = (lambda: AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)) if kind == "host" else \
     (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3)))
data = batches(20)
m0 = TiedMoE(rngs=nnx.Rngs(0))
s0 = chunkjax.offload(m0, mk(), loss_fn, data[0], device_budget="min")
want = [float(s0(b)) for b in data]
s0.sync(m0)

m = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(m, mk(), loss_fn, data[0], device_budget="min")
step(data[0]); step.sync(m); step.release(m)  # warm (compile) outside the storm... then redo from scratch
m = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(m, mk(), loss_fn, data[0], device_budget="min")
float(step(data[0]))
got = [float(step.metrics["loss"])]
stop = threading.Event()
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
def storm():
    while not stop.is_set():
        time.sleep(rng.uniform(0.001, 0.05))
        if not stop.is_set():
            os.kill(os.getpid(), signal.SIGINT)
th = threading.Thread(target=storm, daemon=True)
th.start()
i, interrupts, applied = 1, 0, 0
while i < len(data):
    before = step.metrics
    try:
        step(data[i])
    except KeyboardInterrupt as e:
        interrupts += 1
        noted = any("the step is applied" in n for n in getattr(e, "__notes__", []))
        applied += noted
        if noted and step.metrics is before:
            raise SystemExit("the note says applied but the metrics are the old step's")
    if step.metrics is not before:   # committed (the interrupt may have come after the return)
        got.append(step.metrics["loss"]); i += 1
stop.set()
while th.is_alive():
    try:
        th.join()
    except KeyboardInterrupt:
        pass
step.sync(m)
print("interrupts", interrupts, "applied-notes", applied)
got = [float(x) for x in got]
print("losses equal:", got == want)
la, lb = jax.tree.leaves(nnx.state(m0, nnx.Param)), jax.tree.leaves(nnx.state(m, nnx.Param))
print("params bit-equal:", all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(la, lb)))
