"""The three baselines of the issue-4 benchmark: what JAX users run today, on chunkjax's model.

Every baseline trains the *same* model as chunkjax (``models/gpt.py``'s stage functions: embed,
one block per layer, head) with the same settings: bf16 compute params derived from fp32 master
params, gradients taken with respect to the bf16 compute params (bf16 gradients),
``optax.adamw(1e-4)`` on the fp32 master params, no clipping, no loss scaling. They differ only in
where model data lives and where the update runs.

The layers run as ``jax.lax.scan`` over the blocks' params stacked along a leading layer axis,
with ``jax.checkpoint`` on the scanned block (:func:`scanned_loss`): how large JAX models are
trained (MaxText's default ``scan_layers=True``, Levanter, ``carry/plain_jax_gpt.py``). The
backward pass is then a loop whose every iteration recomputes one block and takes its gradients,
so the compiled program saves one block input per layer plus one block's temporaries, whatever
XLA's scheduler does. The unrolled form (``gpt.loss_fn``: a Python loop over blocks, each under
``jax.checkpoint``) leaves the order to the scheduler. The GPU's latency-hiding scheduler is
known to defer the weight-gradient matmuls of an unrolled backward pass towards the end of the
program when asynchronous work depends on them (here: the gradients' device -> pinned_host copies
of zero_offload_style, the state copies of maxtext_style), which keeps every block's recomputed
activations and incoming gradients alive (openxla/xla#45753 and #45929: 290 GB unrolled vs 62 GB
scanned for MaxText Llama3-8B; jax-ml/jax#20763). With the unrolled form GPT3_6B at batch
32 x 1024 compiled to 155 GB of temporaries for zero_offload_style and 126 GB for maxtext_style
on the H200 (``experiments/results/bench_s3c_gpt3_6b_24g_static.json``; plain_jax, with no
asynchronous copies, compiled as expected on GPT2_1B). On the CPU backend the unrolled form's
recompute is scheduled into the forward pass (XLA:CPU removes the optimization barriers before
scheduling), so the temporaries grow by whole blocks' internals per layer there too:
tests/test_bench.py checks every baseline's growth of compiled temporaries per layer on the CPU.
The unrolled form stays available as :func:`loss_and_grads` (the same mathematics: tested).

``plain_jax``
    Everything on the device; one ``jax.jit`` step (value_and_grad + optax update), state donated.
``maxtext_style``
    fp32 master params and optimizer state live in ``pinned_host`` shardings between steps. One
    jitted step moves them to the device with ``jax.device_put(x, device_sharding)`` (the master
    params first, for the bf16 compute copies; the optimizer state after the backward pass, as
    MaxText's train step does), runs the forward/backward and the update there, and moves the
    results back to ``pinned_host`` (how MaxText offloads parameters and optimizer state). Output
    shardings are ``pinned_host``. The whole fp32 master and Adam state (12 B/param) are on the
    device during the update, as in MaxText.
``zero_offload_style``
    bf16 compute params live on the device (the blocks' leaves stacked along the layer axis, as
    the scanned program takes them); fp32 master params and optimizer state are arrays of the JAX
    CPU backend (``jax.devices("cpu")[0]``), one per parameter leaf of ``gpt.init_params``'s tree.
    A jitted forward/backward on the device emits the bf16 gradients (into ``pinned_host`` by
    default, so the device -> host copy happens inside the program); they are handed to the CPU
    backend, the AdamW update is jitted there (state donated) and returns the new bf16 params,
    which are copied back to the device (how ZeRO-Offload runs its CPU Adam).

On the CPU backend, memory kinds exist but moves between them compile to nothing, and the "CPU
backend" is the default device itself: everything still runs (numerics are testable), nothing
about placement or speed is.

Every builder returns a :class:`BaselineSystem` with ``init(key)``, ``step(state, batch) ->
(state, loss)``, ``compiled_memory(batch)`` and ``host_bytes(state)``. ``batch`` is int32
``(B, T+1)`` (inputs ``batch[:, :-1]``, targets ``batch[:, 1:]``), ``T <= cfg.seq_len``.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import SingleDeviceSharding

from models import gpt

#: The benchmark's settings (issue 4, item 2), identical for every system.
COMPUTE_DTYPE = jnp.bfloat16
LEARNING_RATE = 1e-4

SYSTEMS = ("plain_jax", "maxtext_style", "zero_offload_style")


def make_optimizer() -> optax.GradientTransformation:
    """AdamW, lr 1e-4, optax defaults otherwise (b1 0.9, b2 0.999, eps 1e-8, weight decay 1e-4);
    no clipping, no loss scaling."""
    return optax.adamw(LEARNING_RATE)


def to_compute(master):
    """bf16 compute copies of a float32 params pytree (same structure)."""
    return jax.tree.map(lambda a: a.astype(COMPUTE_DTYPE), master)


def loss_and_grads(cfg: gpt.GPTConfig, compute_params, batch):
    """``(loss float32 scalar, grads)`` of the unrolled ``gpt.loss_fn`` (a Python loop over the
    blocks, each under ``jax.checkpoint``) with respect to the compute params (grads have the
    compute params' dtype and structure). The same mathematics as
    :func:`scanned_loss_and_grads`, which the baselines run (see the module docstring for why)."""
    return jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, batch))(compute_params)


def _is_block_key(k: str) -> bool:
    return k.startswith("h_") and k[2:].isdigit()


def stack_blocks(params: dict, n_layers: int) -> dict:
    """``gpt.init_params``' tree with the blocks' leaves stacked: ``{"wte", "wpe", "ln_f",
    "blocks": <one block's tree, each leaf (L, ...)>}`` (block ``i`` at index ``i``). Works on
    arrays (traced or not) and on ``jax.ShapeDtypeStruct`` trees."""
    out = {k: v for k, v in params.items() if not _is_block_key(k)}
    blocks = [params[f"h_{i}"] for i in range(n_layers)]
    if all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(blocks)):
        out["blocks"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct((n_layers, *a.shape), a.dtype), blocks[0])
    else:
        out["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    return out


def scanned_loss(cfg: gpt.GPTConfig, params: dict, batch) -> jax.Array:
    """The loss of ``gpt.loss_fn`` (same stage functions: ``gpt.gpt_stages``), with the blocks run
    by ``jax.lax.scan`` over ``params["blocks"]`` (:func:`stack_blocks` layout) and each scanned
    block under ``jax.checkpoint`` when ``cfg.remat`` (``prevent_cse=False``: the loop already
    keeps the recompute apart from the forward pass, as MaxText sets it with ``scan_layers``).

    Saved for the backward pass: the (L, B, T, h) stack of block inputs; the backward loop
    recomputes one block and takes its gradients per iteration.
    """
    stages = gpt.gpt_stages(cfg)
    embed, block, head = stages[0], stages[1], stages[-1]
    x = embed.apply({k: params[k] for k in embed.param_keys}, None, batch)

    def body(x, block_params):
        return block.apply({block.param_keys[0]: block_params}, x, batch), None

    if cfg.remat:
        body = jax.checkpoint(body, prevent_cse=False)
    x, _ = jax.lax.scan(body, x, params["blocks"])
    return head.apply({k: params[k] for k in head.param_keys}, x, batch)


def scanned_loss_and_grads(cfg: gpt.GPTConfig, compute_params: dict, batch):
    """``(loss, grads)`` of :func:`scanned_loss` with respect to compute params in
    ``gpt.init_params``' tree (per-block leaves; stacked inside, so the gradients come back in the
    same per-block tree). For params already stacked use ``jax.value_and_grad(scanned_loss)``."""
    L = cfg.n_layers
    return jax.value_and_grad(lambda p: scanned_loss(cfg, stack_blocks(p, L), batch))(compute_params)


def reference_losses(cfg: gpt.GPTConfig, key: jax.Array, batches) -> tuple[list[float], dict]:
    """The plain optax reference the baselines must reproduce: for each batch, the loss of the
    bf16 compute copies (:func:`scanned_loss_and_grads`, the baselines' formulation; that it
    equals the unrolled ``gpt.loss_fn`` is tested separately), then ``optax.adamw(1e-4)`` on the
    fp32 master params.

    Returns ``(losses, final fp32 master params)``. Runs on the default device; the initial
    params are ``jax.jit(gpt.init_params)``'s (which :func:`init_master_piecewise` reproduces).
    """
    tx = make_optimizer()
    master = jax.jit(gpt.init_params, static_argnums=0)(cfg, key)
    opt = tx.init(master)
    grad_fn = jax.jit(lambda p, b: scanned_loss_and_grads(cfg, p, b))

    @jax.jit
    def update(grads, opt, master):
        updates, opt = tx.update(grads, opt, master)
        return optax.apply_updates(master, updates), opt

    losses = []
    for b in batches:
        loss, grads = grad_fn(to_compute(master), b)
        master, opt = update(grads, opt, master)
        losses.append(float(loss))
    return losses, master


# ---- shardings -----------------------------------------------------------------------------

def _kinds(device) -> set[str]:
    try:
        return {m.kind for m in device.addressable_memories()}
    except Exception:  # a backend without memory kinds
        return set()


def device_sharding(device) -> SingleDeviceSharding:
    """``device`` memory of ``device`` (the default kind where kinds are not exposed)."""
    if "device" in _kinds(device):
        return SingleDeviceSharding(device, memory_kind="device")
    return SingleDeviceSharding(device)


def host_sharding(device) -> SingleDeviceSharding:
    """``pinned_host`` memory of ``device``.

    Raises:
      ValueError: the device has no pinned_host memory.
    """
    kinds = _kinds(device)
    if "pinned_host" not in kinds:
        raise ValueError(f"device {device} has no pinned_host memory (it has {sorted(kinds)})")
    return SingleDeviceSharding(device, memory_kind="pinned_host")


def cpu_device():
    """The JAX CPU backend's first device (the default device itself on the CPU backend)."""
    return jax.devices("cpu")[0]


def _abstract(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def _tree_bytes(tree) -> int:
    return int(sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def memory_stats_dict(compiled) -> dict:
    """``compiled.memory_analysis()`` as a dict of ints (bytes).

    Keys: argument_bytes, output_bytes, temp_bytes, alias_bytes, generated_code_bytes,
    peak_bytes (= argument + output + temp - alias: the device bytes the program needs at once,
    the figure compared with the budget), xla_peak_bytes (XLA's own ``peak_memory_in_bytes`` where
    reported, else None) and the host_* counterparts (pinned-host bytes of the program).
    """
    ma = compiled.memory_analysis()

    def g(name):
        v = getattr(ma, name, None)
        return None if v is None else int(v)

    out = {"argument_bytes": g("argument_size_in_bytes"), "output_bytes": g("output_size_in_bytes"),
           "temp_bytes": g("temp_size_in_bytes"), "alias_bytes": g("alias_size_in_bytes"),
           "generated_code_bytes": g("generated_code_size_in_bytes"),
           "host_argument_bytes": g("host_argument_size_in_bytes"),
           "host_output_bytes": g("host_output_size_in_bytes"),
           "host_temp_bytes": g("host_temp_size_in_bytes"), "host_alias_bytes": g("host_alias_size_in_bytes")}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"] - out["alias_bytes"])
    xp = g("peak_memory_in_bytes")
    out["xla_peak_bytes"] = xp if xp else None
    return out


# ---- initialisation ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _init_fns(cfg: gpt.GPTConfig, device):
    """Jitted piece initialisers for ``cfg`` on ``device`` (cached: compiled once per process)."""
    dev_sh = device_sharding(device)
    h = cfg.d_model
    normal = jax.nn.initializers.normal(0.02)

    def embeddings(k_wte, k_wpe):
        return {"wte": normal(k_wte, (cfg.vocab_size, h), jnp.float32),
                "wpe": normal(k_wpe, (cfg.seq_len, h), jnp.float32)}

    def block(k):
        x = jnp.zeros((1, 8, h), jnp.float32)
        return jax.tree.map(lambda a: a.astype(jnp.float32), gpt.Block(cfg).init(k, x)["params"])

    return jax.jit(embeddings, out_shardings=dev_sh), jax.jit(block, out_shardings=dev_sh)


def init_master_piecewise(cfg: gpt.GPTConfig, key: jax.Array, place: Callable, device=None) -> dict:
    """fp32 master params with ``gpt.init_params(cfg, key)``'s values, built one piece at a time.

    Each piece (the embeddings, one block's params, ln_f) is computed on ``device`` (default: the
    default device), handed to ``place(piece_tree) -> placed_tree``, waited for and dropped, so the
    device holds one piece at a time: a model larger than the device budget can be initialised
    straight into pinned_host or the CPU backend. Same key splits and initialisers as
    ``gpt.init_params``; the pieces are jitted, so values equal ``jax.jit(gpt.init_params)``'s
    (bit-exact for micro when written) and the eager ``gpt.init_params``'s to within one float32
    ulp (XLA fuses the normal sampler differently eagerly). tests/test_bench.py compares
    baselines initialised this way with a reference initialised by ``jax.jit(gpt.init_params)``.
    """
    device = device or jax.devices()[0]
    dev_sh = device_sharding(device)
    emb_init, block_init = _init_fns(cfg, device)
    k_wte, k_wpe, *k_blocks = jax.random.split(key, 2 + cfg.n_layers)

    def put(piece):
        placed = place(piece)
        jax.block_until_ready(placed)
        return placed

    params = dict(put(emb_init(jax.device_put(k_wte, dev_sh), jax.device_put(k_wpe, dev_sh))))
    for i, k in enumerate(k_blocks):
        params[f"h_{i}"] = put(block_init(jax.device_put(k, dev_sh)))
    params["ln_f"] = put({"scale": jax.device_put(jnp.ones((cfg.d_model,), jnp.float32), dev_sh)})
    return params


def zeros_opt_state(tx, abstract_master, make_zeros: Callable):
    """The optimizer state of ``tx`` for ``abstract_master``, every leaf ``make_zeros(shape,
    dtype)``. Equals ``tx.init(master)`` for optimizers whose initial state is all zeros (adam,
    adamw: count 0, mu 0, nu 0; checked in tests); it never materialises the whole state on one
    device."""
    shapes = jax.eval_shape(tx.init, abstract_master)
    return jax.tree.map(lambda s: make_zeros(s.shape, s.dtype), shapes)


# ---- the systems ---------------------------------------------------------------------------

#: Compiled programs shared by systems built with the default optimizer in one process, keyed by
#: (system, config, batch shape, device, build options).
_EXE_CACHE: dict = {}

class BaselineSystem:
    """Common interface of the benchmark systems.

    Attributes:
      name: system name (a key of :data:`BUILDERS`).
      cfg: the model config.
      device: the compute device (``jax.devices()[0]`` by default).
      last_update_s: seconds of the last step's separately timed optimizer update (None where the
        update is inside the one device program).
      last_timings: per-phase seconds of the last step (system-specific keys; may be empty).
      notes: free-text facts about how the system ran (e.g. donation fallback).
    """

    name = "base"

    def __init__(self, cfg: gpt.GPTConfig, device=None, tx=None):
        self.cfg = cfg
        self.device = device or jax.devices()[0]
        self._default_tx = tx is None
        self.tx = tx or make_optimizer()
        self.dev_sh = device_sharding(self.device)
        self.abstract_master = gpt.abstract_params(cfg)
        self.last_update_s: float | None = None
        self.last_timings: dict = {}
        self.notes: list[str] = []
        self._exe: dict = {}

    # -- helpers
    def _batch_abstract(self, batch):
        return jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=self.dev_sh)

    def put_batch(self, batch):
        """The batch committed to the compute device (a no-op when it already is)."""
        return jax.device_put(batch, self.dev_sh)

    def compiled_memory(self, batch) -> dict:
        """Memory analysis of the compiled *device* program for a batch (array or
        ShapeDtypeStruct of shape (B, T+1) int32). Compiles (and caches) the program; allocates
        nothing. See :func:`memory_stats_dict` for the keys."""
        return memory_stats_dict(self._executable(batch))

    def _options(self) -> tuple:
        """Build options that change the compiled program (part of the cache key)."""
        return ()

    def _executable(self, batch):
        key = (tuple(batch.shape), jnp.dtype(batch.dtype).name)
        if key not in self._exe:
            gkey = None
            if self._default_tx:  # a process-wide cache: the same program is compiled once
                gkey = (type(self).__name__, self.cfg, key, self.device.platform, self.device.id, self._options())
            if gkey is not None and gkey in _EXE_CACHE:
                self._exe[key], notes = _EXE_CACHE[gkey]
                self.notes.extend(n for n in notes if n not in self.notes)
            else:
                n0 = len(self.notes)
                self._exe[key] = self._compile(self._batch_abstract(batch))
                if gkey is not None:
                    _EXE_CACHE[gkey] = (self._exe[key], list(self.notes[n0:]))
        return self._exe[key]

    def _compile(self, batch_abstract):  # pragma: no cover - abstract
        raise NotImplementedError

    def host_bytes(self, state) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def device_state_bytes(self, state) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


def _loss_and_grads_of_master(cfg, master, batch):
    """bf16 compute copies of the fp32 master params (per leaf, then stacked inside
    :func:`scanned_loss`: XLA fuses the cast into the stacking), loss and bf16 gradients."""
    return scanned_loss_and_grads(cfg, to_compute(master), batch)


def _apply_update(tx, grads, opt, master):
    updates, opt = tx.update(grads, opt, master)
    return optax.apply_updates(master, updates), opt


def _train_math(cfg, tx, master, opt, batch):
    loss, grads = _loss_and_grads_of_master(cfg, master, batch)
    master, opt = _apply_update(tx, grads, opt, master)
    return master, opt, loss


class PlainJax(BaselineSystem):
    """Everything on the device, one jitted step with the state donated.

    State: ``{"master": fp32 params, "opt": adamw state}``, all in device memory (12 B/param
    plus the optimizer's count); the bf16 compute copies are made inside the step and the blocks
    run as a scan (:func:`scanned_loss`).
    """

    name = "plain_jax"

    def _state_shardings(self):
        abstract = {"master": self.abstract_master, "opt": jax.eval_shape(self.tx.init, self.abstract_master)}
        return abstract, jax.tree.map(lambda _: self.dev_sh, abstract)

    def _compile(self, batch_abstract):
        abstract, shardings = self._state_shardings()
        cfg, tx = self.cfg, self.tx

        def step(state, batch):
            master, opt, loss = _train_math(cfg, tx, state["master"], state["opt"], batch)
            return {"master": master, "opt": opt}, loss

        fn = jax.jit(step, in_shardings=(shardings, self.dev_sh), out_shardings=(shardings, self.dev_sh),
                     donate_argnums=(0,))
        return fn.lower(_abstract(abstract, shardings), batch_abstract).compile()

    def init(self, key):
        """fp32 master params (``gpt.init_params`` values) and zero AdamW state, on the device."""
        master = init_master_piecewise(self.cfg, key, lambda t: t, self.device)
        opt = zeros_opt_state(self.tx, self.abstract_master, lambda s, d: jnp.zeros(s, d, device=self.dev_sh))
        return {"master": master, "opt": opt}

    def step(self, state, batch):
        """One training step. Returns ``(new state, loss)``; the old state is donated (deleted)."""
        batch = self.put_batch(batch)
        return self._executable(batch)(state, batch)

    def host_bytes(self, state) -> int:
        return 0

    def device_state_bytes(self, state) -> int:
        return _tree_bytes(state)


class MaxTextStyle(BaselineSystem):
    """Master params and optimizer state in ``pinned_host`` between steps; one jitted step moves
    them to the device (``jax.device_put(x, device_sharding)``: the master params at the start,
    the optimizer state after the backward pass), computes forward (scanned blocks, see
    :func:`scanned_loss`), backward and the update there, and moves the results back to
    ``pinned_host``.

    State: ``{"master", "opt"}`` all in pinned_host. The step donates its state (input and output
    are both pinned_host, so the buffers can alias); if the compiler refuses the donation the step
    is rebuilt without it and ``notes`` says so (then the host holds two copies during a step).
    """

    name = "maxtext_style"

    def __init__(self, cfg, device=None, tx=None, donate: bool = True):
        super().__init__(cfg, device, tx)
        self.host_sh = host_sharding(self.device)
        self.donate = donate

    def _state_shardings(self):
        abstract = {"master": self.abstract_master, "opt": jax.eval_shape(self.tx.init, self.abstract_master)}
        return abstract, jax.tree.map(lambda _: self.host_sh, abstract)

    def _options(self) -> tuple:
        return (("donate", self.donate),)

    def _compile(self, batch_abstract):
        abstract, shardings = self._state_shardings()
        cfg, tx, dev_sh, host_sh = self.cfg, self.tx, self.dev_sh, self.host_sh

        def to(tree, sh):
            return jax.tree.map(lambda a: jax.device_put(a, sh), tree)

        def step(state, batch):
            master = to(state["master"], dev_sh)
            loss, grads = _loss_and_grads_of_master(cfg, master, batch)
            opt = to(state["opt"], dev_sh)  # after the backward pass, as MaxText's train step
            master, opt = _apply_update(tx, grads, opt, master)
            return {"master": to(master, host_sh), "opt": to(opt, host_sh)}, loss

        args = (_abstract(abstract, shardings), batch_abstract)
        kw = dict(in_shardings=(shardings, dev_sh), out_shardings=(shardings, dev_sh))
        if self.donate:
            try:
                return jax.jit(step, donate_argnums=(0,), **kw).lower(*args).compile()
            except Exception as e:  # donation across/within memory kinds not supported here
                self.donate = False
                self.notes.append(f"donation refused by the compiler ({type(e).__name__}: {str(e)[:200]}); "
                                  "compiled without donation")
        return jax.jit(step, **kw).lower(*args).compile()

    def init(self, key):
        """Master params built piecewise on the device and moved to pinned_host one piece at a
        time; zero AdamW state written straight into pinned_host."""
        to_host = lambda t: jax.tree.map(lambda a: jax.device_put(a, self.host_sh), t)
        master = init_master_piecewise(self.cfg, key, to_host, self.device)
        opt = zeros_opt_state(self.tx, self.abstract_master,
                              lambda s, d: jax.device_put(np.zeros(s, d), self.host_sh))
        return {"master": master, "opt": opt}

    def step(self, state, batch):
        """One training step. Returns ``(new state in pinned_host, loss on the device)``."""
        batch = self.put_batch(batch)
        return self._executable(batch)(state, batch)

    def host_bytes(self, state) -> int:
        return _tree_bytes(state)

    def device_state_bytes(self, state) -> int:
        return 0


class ZeroOffloadStyle(BaselineSystem):
    """bf16 compute params on the device; fp32 master params and AdamW state on the JAX CPU
    backend, updated there after the backward pass, leaf by leaf.

    A step: (1) jitted forward/backward on the device (scanned blocks, :func:`scanned_loss`) ->
    loss and bf16 gradients in the stacked layout of the device params (written to
    ``pinned_host`` inside the program when ``grads_to_host`` and the device has pinned memory);
    the old compute params are deleted once the gradients exist; then for each device leaf in turn
    (``wte``, ``wpe``, ``ln_f`` and each stacked block leaf): (2) its gradient handed to the CPU
    backend (``jax.device_put(g, cpu)``; zero-copy from pinned_host per gpu_facts.md); (3) for each
    parameter leaf of ``gpt.init_params``' tree in it (one per layer for a stacked leaf), the AdamW
    update of that leaf jitted on the CPU backend (master and state donated), returning the new
    bf16 leaf; (4) the new bf16 device leaf (a stacked leaf: the layers' new leaves stacked on the
    host) copied to the device along ``h2d_path``:

    - ``"via_pinned"`` (default): CPU array -> numpy view -> pinned_host -> device;
    - ``"numpy"``: CPU array -> numpy view -> device (pageable, ~7 GB/s on the H200 machine);
    - ``"direct"``: ``jax.device_put(cpu_array, device)`` (~1 GB/s on the H200 machine).

    Leaf by leaf keeps the host's transient copies to one device leaf (at most one stacked block
    leaf: its gradient, its new bf16 values and their staging copy, 4.0 GB each for GPT3_6B's
    ``mlp_c_fc``; a whole-tree update would hold the bf16 copy and its staging copy of every
    parameter at once: 25 GB more for GPT3_6B). Each master leaf has its own AdamW state (its own step count, all equal), which is
    the whole-tree update for an elementwise optimizer. The phases run one after another (no
    overlap); ``last_timings`` sums each phase over the leaves and ``last_update_s`` is the CPU
    update time.

    State: ``{"params": bf16 tree on the device in the :func:`stack_blocks` layout, "master": fp32
    tree on CPU (``gpt.init_params``' per-block tree), "opt": list of per-leaf AdamW states on CPU
    (leaf order of the master tree)}``. When the default backend is the CPU, "the CPU backend" is
    the default device itself.
    """

    name = "zero_offload_style"

    H2D_PATHS = ("via_pinned", "numpy", "direct")

    def __init__(self, cfg, device=None, tx=None, grads_to_host: bool = True, h2d_path: str = "via_pinned"):
        super().__init__(cfg, device, tx)
        if h2d_path not in self.H2D_PATHS:
            raise ValueError(f"h2d_path {h2d_path!r} is not one of {self.H2D_PATHS}")
        self.cpu = cpu_device()
        self.cpu_sh = SingleDeviceSharding(self.cpu)
        try:
            self.host_sh = host_sharding(self.device)
        except ValueError:
            self.host_sh = None
        self.grads_to_host = grads_to_host and self.host_sh is not None
        self.grad_sh = self.host_sh if self.grads_to_host else self.dev_sh
        self.h2d_path = h2d_path if (h2d_path != "via_pinned" or self.host_sh is not None) else "numpy"
        self._treedef = jax.tree.structure(self.abstract_master)
        self.abstract_params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, COMPUTE_DTYPE),
                                            stack_blocks(self.abstract_master, cfg.n_layers))
        self._params_treedef = jax.tree.structure(self.abstract_params)
        self._param_leaves = jax.tree.leaves(self.abstract_params)
        self._groups = self._leaf_groups()
        self._update = None

    def _leaf_groups(self) -> list[list[tuple[int, int | None]]]:
        """For each leaf of the device params (leaf order of ``abstract_params``), the master
        leaves it holds: ``[(master leaf index, layer or None), ...]`` (a stacked block leaf: one
        per layer, in layer order)."""
        index = {}
        for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(self.abstract_master)[0]):
            keys = tuple(k.key for k in path)
            if _is_block_key(keys[0]):
                index[("blocks",) + keys[1:], int(keys[0][2:])] = i
            else:
                index[keys, None] = i
        groups = []
        for path, _ in jax.tree_util.tree_flatten_with_path(self.abstract_params)[0]:
            keys = tuple(k.key for k in path)
            layers = range(self.cfg.n_layers) if keys[0] == "blocks" else [None]
            groups.append([(index[keys, layer], layer) for layer in layers])
        return groups

    def _options(self) -> tuple:
        return (("grads_to_host", self.grads_to_host),)

    def _compile(self, batch_abstract):
        cfg = self.cfg
        p_sh = jax.tree.map(lambda _: self.dev_sh, self.abstract_params)
        g_sh = jax.tree.map(lambda _: self.grad_sh, self.abstract_params)
        fn = jax.jit(lambda p, b: jax.value_and_grad(lambda q: scanned_loss(cfg, q, b))(p),
                     in_shardings=(p_sh, self.dev_sh), out_shardings=(self.dev_sh, g_sh))
        return fn.lower(_abstract(self.abstract_params, p_sh), batch_abstract).compile()

    def _update_fn(self):
        """The per-leaf CPU update, jitted (one compile per leaf shape), master and state donated."""
        if self._update is None:
            gkey = "zero_offload_update" if self._default_tx else None
            if gkey in _EXE_CACHE:
                self._update = _EXE_CACHE[gkey]
            else:
                tx = self.tx

                def update(master, opt, grad):
                    updates, opt = tx.update(grad, opt, master)
                    master = optax.apply_updates(master, updates)
                    return master, opt, master.astype(COMPUTE_DTYPE)

                self._update = jax.jit(update, donate_argnums=(0, 1))
                if gkey is not None:
                    _EXE_CACHE[gkey] = self._update
        return self._update

    def _leaf_to_device(self, a):
        """A bf16 leaf (CPU-backend array, or numpy for a stacked leaf) to the device."""
        if self.h2d_path == "direct":
            return jax.device_put(a, self.dev_sh)
        if self.h2d_path == "numpy":
            return jax.device_put(np.asarray(a), self.dev_sh)
        return jax.device_put(jax.device_put(np.asarray(a), self.host_sh), self.dev_sh)

    def _host_leaf(self, k: int, leaf_fn: Callable):
        """The host value of device leaf ``k``: ``leaf_fn(master index, layer)`` (a bf16 CPU-backend
        array) for a plain leaf; for a stacked block leaf, each layer's ``leaf_fn`` result written
        into one numpy buffer (L, ...), one layer at a time."""
        group = self._groups[k]
        if group[0][1] is None:
            return leaf_fn(*group[0])
        out = np.empty(self._param_leaves[k].shape, np.dtype(COMPUTE_DTYPE))
        for i, layer in group:
            out[layer] = np.asarray(leaf_fn(i, layer))
        return out

    def _to_cpu(self, tree):
        return jax.tree.map(lambda a: jax.device_put(a, self.cpu_sh), tree)

    def init(self, key):
        """Master params built piecewise on the device and moved to the CPU backend (through
        pinned_host where it exists); zero per-leaf AdamW state on the CPU backend; bf16 compute
        params derived on the CPU backend, stacked per block leaf on the host and copied to the
        device along ``h2d_path``."""
        if self.host_sh is not None and self.cpu != self.device:
            place = lambda t: self._to_cpu(jax.tree.map(lambda a: jax.device_put(a, self.host_sh), t))
        else:
            place = self._to_cpu
        master = init_master_piecewise(self.cfg, key, place, self.device)
        zeros = lambda s, d: jax.device_put(np.zeros(s, d), self.cpu_sh)
        opt = [zeros_opt_state(self.tx, leaf, zeros) for leaf in jax.tree.leaves(self.abstract_master)]
        cast = jax.jit(lambda a: a.astype(COMPUTE_DTYPE))
        masters = jax.tree.leaves(master)
        params = []
        for k in range(len(self._groups)):
            params.append(self._leaf_to_device(self._host_leaf(k, lambda i, _: cast(masters[i]))))
            jax.block_until_ready(params[-1])
        return {"params": jax.tree.unflatten(self._params_treedef, params), "master": master, "opt": opt}

    def step(self, state, batch):
        """One training step (host-driven: device fwd/bwd, then per device leaf: gradient to the
        CPU, CPU update of each master leaf in it, new bf16 leaf back). Returns ``(new state,
        loss)``; sets ``last_update_s`` (the CPU update, summed over leaves) and ``last_timings``
        (fwd_bwd_s, d2h_s, update_s, h2d_s: wall seconds of each phase, waited on, summed over
        leaves)."""
        batch = self.put_batch(batch)
        t0 = time.perf_counter()
        loss, grads = self._executable(batch)(state["params"], batch)
        jax.block_until_ready(grads)
        t_fb = time.perf_counter() - t0
        for a in jax.tree.leaves(state["params"]):
            a.delete()
        update = self._update_fn()
        masters, opts = list(jax.tree.leaves(state["master"])), list(state["opt"])
        params = []
        t_d2h = t_upd = t_h2d = 0.0
        for k, g in enumerate(jax.tree.leaves(grads)):
            t0 = time.perf_counter()
            g_cpu = jax.device_put(g, self.cpu_sh)
            jax.block_until_ready(g_cpu)
            t1 = time.perf_counter()

            def leaf_update(i, layer):
                masters[i], opts[i], c = update(masters[i], opts[i], g_cpu if layer is None else g_cpu[layer])
                return jax.block_until_ready(c)

            host = self._host_leaf(k, leaf_update)
            t2 = time.perf_counter()
            p = self._leaf_to_device(host)
            jax.block_until_ready(p)
            t3 = time.perf_counter()
            del g_cpu, host
            t_d2h, t_upd, t_h2d = t_d2h + t1 - t0, t_upd + t2 - t1, t_h2d + t3 - t2
            params.append(p)
        del grads
        self.last_update_s = t_upd
        self.last_timings = {"fwd_bwd_s": t_fb, "d2h_s": t_d2h, "update_s": t_upd, "h2d_s": t_h2d}
        return {"params": jax.tree.unflatten(self._params_treedef, params),
                "master": jax.tree.unflatten(self._treedef, masters), "opt": opts}, loss

    def host_bytes(self, state) -> int:
        return _tree_bytes(state["master"]) + _tree_bytes(state["opt"])

    def device_state_bytes(self, state) -> int:
        return _tree_bytes(state["params"])


BUILDERS: dict[str, type[BaselineSystem]] = {
    "plain_jax": PlainJax, "maxtext_style": MaxTextStyle, "zero_offload_style": ZeroOffloadStyle}


def build(name: str, cfg: gpt.GPTConfig, **kw) -> BaselineSystem:
    """The baseline system called ``name`` for ``cfg``.

    Raises:
      ValueError: unknown name.
    """
    if name not in BUILDERS:
        raise ValueError(f"unknown baseline {name!r}: choose one of {', '.join(BUILDERS)}")
    return BUILDERS[name](cfg, **kw)


def plain_jax(cfg, **kw) -> PlainJax:
    """See :class:`PlainJax`."""
    return PlainJax(cfg, **kw)


def maxtext_style(cfg, **kw) -> MaxTextStyle:
    """See :class:`MaxTextStyle`."""
    return MaxTextStyle(cfg, **kw)


def zero_offload_style(cfg, **kw) -> ZeroOffloadStyle:
    """See :class:`ZeroOffloadStyle`."""
    return ZeroOffloadStyle(cfg, **kw)
