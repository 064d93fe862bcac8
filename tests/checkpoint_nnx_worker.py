"""Worker of tests/test_checkpoint_flax.py: trains the small NNX transformer of
tests/test_flax_api.py with chunkjax.NnxOptimizer (AdamW, fp32, CPU) for ``steps`` steps.

Usage: python checkpoint_nnx_worker.py CKPT_DIR OUT.npz STEPS SAVE_AT RESUME

* SAVE_AT > 0: after step SAVE_AT the state is saved (``save_checkpoint(dir, SAVE_AT, opt, extra=...)``,
  the losses so far in ``extra``), ``SAVED`` is printed and the worker trains on without end,
  until the test SIGKILLs it.
* RESUME = 1: the optimizer and the model's params come from the latest checkpoint of CKPT_DIR
  (``restore_checkpoint`` + ``nnx.update``), training continues at its step.
* Otherwise the losses of every step and the final params go to OUT.npz.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import chunkjax as cj  # noqa: E402
from chunkjax import checkpoint as ck  # noqa: E402
from test_flax_api import TinyTransformer, batches, nnx_loss  # noqa: E402

CHUNK = 1024  # elements: the model's ~3.5k params in several chunks
BUDGET = 70_000  # bytes: the first chunk's state on the device, the others streamed from pinned host (pipeline of 3)


def main(ckpt: str, out: str, steps: int, save_at: int, resume: bool) -> None:
    model = TinyTransformer(rngs=nnx.Rngs(0))
    opt = cj.NnxOptimizer(model, optax.adamw(3e-3, weight_decay=0.1), device_budget=BUDGET, chunk_size=CHUNK)
    grad_fn = nnx.jit(nnx.value_and_grad(nnx_loss))
    data = batches(1, steps)
    losses, start = [], 0
    if resume:
        params, extra = ck.restore_checkpoint(ckpt, opt)
        nnx.update(model, params)
        start, losses = int(extra["step"]), [np.float32(x) for x in extra["losses"]]
        assert opt.step == start, (opt.step, start)
    for i in range(start, 10**9 if save_at > 0 else steps):
        loss, grads = grad_fn(model, data[i % steps])
        opt.update(model, grads)
        losses.append(np.float32(loss))
        if i + 1 == save_at:
            ck.save_checkpoint(ckpt, save_at, opt, extra={"step": save_at, "losses": np.asarray(losses)})
            print("SAVED", opt.summary(), flush=True)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    np.savez(out, losses=np.asarray(losses), **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1")
