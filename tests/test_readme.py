"""The README's "Your own model" block runs as printed, and its losses are those of the same loop
with ``nnx.Optimizer`` (plain optax on the device, float32: 1e-5 relative)."""
import contextlib
import io
import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _own_model_block() -> str:
    text = README.read_text()
    section = text[text.index("\n## Your own model\n"):]
    section = section[:section.index("\n## ", 1)]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return block


def test_readme_own_model_block_runs_and_matches_nnx_optimizer():
    import optax
    from flax import nnx

    ns: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_own_model_block(), str(README), "exec"), ns)  # noqa: S102 - the README's own code
    lines = out.getvalue().splitlines()
    counts = eval(lines[0])  # noqa: S307 - the printed dict of chunk counts
    assert sum(counts.values()) == ns["step"].layout.n_chunks and any("pinned_host" in k for k in counts), counts
    losses = [float(x) for x in lines[1:]]
    assert len(losses) == 3 and losses[2] < losses[0]

    model = ns["TinyLM"](rngs=nnx.Rngs(0))  # the reference: the same model, loss and batch, nnx.Optimizer
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, opt, batch):
        loss, grads = nnx.value_and_grad(ns["loss_fn"])(model, batch)
        opt.update(model, grads)
        return loss

    ref = [float(train_step(model, opt, ns["batch"])) for _ in range(3)]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(ns["model"], nnx.Param)), jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)  # sync: the trained params

