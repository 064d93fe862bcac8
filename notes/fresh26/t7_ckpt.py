"""Checkpoint save at step 10, new process restores and continues to 20: equal to uninterrupted.
usage: t7_ckpt.py full|first|resume DIR [kill_during_save]"""
import sys, os, json, signal, threading
sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import *
import chunkjax
from chunkjax.host_update import AdamW

mode, d = sys.argv[1], sys.argv[2]
data = batches(20)
spec = AdamW(3e-3, weight_decay=0.1, max_grad_norm=0.5)
model = TiedMoE(rngs=nnx.Rngs(0))
step = chunkjax.offload(model, spec, loss_fn, data[0], device_budget="min")
start = 0
if mode == "resume":
    state, extra = chunkjax.restore_checkpoint(d, step)
    start = extra["pos"]
    print("restored at", start, extra)
losses = []
for i in range(start, 20):
    losses.append(float(step(data[i])))
    if mode == "first" and i + 1 == 10:
        if len(sys.argv) > 3:   # kill ourselves in the middle of the save (a second save)
            chunkjax.save_checkpoint(d, 10, step, extra={"pos": 10})
            losses.append(float(step(data[10])))  # step 11 (index 10) for a second save
            threading.Timer(float(sys.argv[3]), lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            chunkjax.save_checkpoint(d, 11, step, extra={"pos": 11})
            print("save finished before the kill"); sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)
        chunkjax.save_checkpoint(d, 10, step, extra={"pos": 10}, keep=2)
        break
step.sync(model)
print(json.dumps({"start": start, "losses": losses, "calls": int(model.calls[...]),
                  "emb": float(np.asarray(model.embed.embedding[...]).sum())}))
