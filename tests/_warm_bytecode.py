"""Writes the bytecode (``__pycache__``) of the modules the tests and their subprocesses import, once,
when ``make env`` builds the environment (not a test itself; run with PYTHONDONTWRITEBYTECODE unset).

The Makefile installs with ``pip install --no-compile``: pip's byte-compiling of every file of every
installed package (~7,900 files, ~30 of the install's ~45 CPU seconds) is replaced by this script,
~2,500 files in ~10 CPU seconds: the imports of the library, its tests and their subprocesses,
then one tiny jitted program, optax update, numba kernel and orbax save, which import the modules
that jax, optax, numba and orbax load on first use. A module missed here is compiled where it is
first imported (and written there unless PYTHONDONTWRITEBYTECODE is set)."""
import importlib
import importlib.metadata
import tempfile

import chunkjax  # noqa: F401
import chunkjax.checkpoint  # noqa: F401
import chunkjax.storage.worker  # noqa: F401
import experiments.bench  # noqa: F401
import experiments.train  # noqa: F401
import flax.linen  # noqa: F401
import flax.nnx  # noqa: F401
import gguf  # noqa: F401
import ipykernel.kernelapp  # noqa: F401
import jax
import jax.ad_checkpoint  # noqa: F401
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import models  # noqa: E402,F401
import nbclient  # noqa: E402,F401
import nbformat  # noqa: E402,F401
import numba  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402,F401
import safetensors.numpy  # noqa: E402,F401
import tiktoken  # noqa: E402,F401
import tokenizers  # noqa: E402,F401
import xdist  # noqa: E402,F401
from _pytest.config import default_plugins  # noqa: E402

for name in default_plugins:  # pytest's own plugins and the installed ones (xdist, anyio), as pytest loads them
    importlib.import_module(f"_pytest.{name}")
for ep in importlib.metadata.entry_points(group="pytest11"):
    ep.load()

x = jnp.arange(4.0)
tx = optax.adamw(1e-3)
updates, _ = jax.jit(tx.update)(x, tx.init(x), x)
numba.njit(cache=False)(lambda a: a + 1)(np.zeros(2))
with tempfile.TemporaryDirectory() as d:
    fig = plt.figure()
    fig.savefig(f"{d}/warm.png")
    ocp.PyTreeCheckpointer().save(f"{d}/ckpt", {"x": np.asarray(updates)})
