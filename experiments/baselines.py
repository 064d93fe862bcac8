"""The three baselines of the issue-4 benchmark: what JAX users run today, on chunkjax's model.

Every baseline trains the *same* model as chunkjax (``models/gpt.py``: ``gpt.loss_fn`` composes
the very stage functions chunkjax runs, with ``jax.checkpoint`` per block) with the same
settings: bf16 compute params derived from fp32 master params, gradients taken with respect to
the bf16 compute params (bf16 gradients), ``optax.adamw(1e-4)`` on the fp32 master params, no
clipping, no loss scaling. They differ only in where model data lives and where the update runs:

``plain_jax``
    Everything on the device; one ``jax.jit`` step (value_and_grad + optax update), state donated.
``maxtext_style``
    fp32 master params and optimizer state live in ``pinned_host`` shardings between steps. One
    jitted step moves them to the device with ``jax.device_put(x, device_sharding)``, runs the
    forward/backward and the update there, and moves the results back to ``pinned_host`` (how
    MaxText offloads parameters and optimizer state). Output shardings are ``pinned_host``.
``zero_offload_style``
    bf16 compute params live on the device; fp32 master params and optimizer state are arrays of
    the JAX CPU backend (``jax.devices("cpu")[0]``). A jitted forward/backward on the device emits
    the bf16 gradients (into ``pinned_host`` by default, so the device -> host copy happens inside
    the program); they are handed to the CPU backend, the AdamW update is jitted there (state
    donated) and returns the new bf16 params, which are copied back to the device (how
    ZeRO-Offload runs its CPU Adam).

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
    """``(loss float32 scalar, grads)`` of ``gpt.loss_fn`` with respect to the compute params
    (grads have the compute params' dtype and structure)."""
    return jax.value_and_grad(lambda p: gpt.loss_fn(cfg, p, batch))(compute_params)


def reference_losses(cfg: gpt.GPTConfig, key: jax.Array, batches) -> tuple[list[float], dict]:
    """The plain optax reference the baselines must reproduce: for each batch, the loss of the
    bf16 compute copies, then ``optax.adamw(1e-4)`` on the fp32 master params.

    Returns ``(losses, final fp32 master params)``. Runs on the default device; the initial
    params are ``jax.jit(gpt.init_params)``'s (which :func:`init_master_piecewise` reproduces).
    """
    tx = make_optimizer()
    master = jax.jit(gpt.init_params, static_argnums=0)(cfg, key)
    opt = tx.init(master)
    grad_fn = jax.jit(lambda p, b: loss_and_grads(cfg, p, b))

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


def _train_math(cfg, tx, master, opt, batch):
    compute = to_compute(master)
    loss, grads = loss_and_grads(cfg, compute, batch)
    updates, opt = tx.update(grads, opt, master)
    return optax.apply_updates(master, updates), opt, loss


class PlainJax(BaselineSystem):
    """Everything on the device, one jitted step with the state donated.

    State: ``{"master": fp32 params, "opt": adamw state}``, all in device memory (12 B/param
    plus the optimizer's count); the bf16 compute copies are made inside the step.
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
    them to the device (``jax.device_put(x, device_sharding)``), computes forward, backward and
    the update there, and moves the results back to ``pinned_host``.

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
            opt = to(state["opt"], dev_sh)
            master, opt, loss = _train_math(cfg, tx, master, opt, batch)
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

    A step: (1) jitted forward/backward on the device -> loss and bf16 gradients (written to
    ``pinned_host`` inside the program when ``grads_to_host`` and the device has pinned memory);
    the old compute params are deleted once the gradients exist; then for each parameter leaf in
    turn: (2) its gradient handed to the CPU backend (``jax.device_put(g, cpu)``; zero-copy from
    pinned_host per gpu_facts.md); (3) the AdamW update of that leaf jitted on the CPU backend
    (master and state donated), returning the new bf16 leaf; (4) the bf16 leaf copied to the
    device along ``h2d_path``:

    - ``"via_pinned"`` (default): CPU array -> numpy view -> pinned_host -> device;
    - ``"numpy"``: CPU array -> numpy view -> device (pageable, ~7 GB/s on the H200 machine);
    - ``"direct"``: ``jax.device_put(cpu_array, device)`` (~1 GB/s on the H200 machine).

    Leaf by leaf keeps the host's transient copies to one leaf (a whole-tree update would hold the
    bf16 copy and its staging copy of every parameter at once: 25 GB more for GPT3_6B). Each leaf
    has its own AdamW state (its own step count, all equal), which is the whole-tree update for an
    elementwise optimizer. The phases run one after another (no overlap); ``last_timings`` sums
    each phase over the leaves and ``last_update_s`` is the CPU update time.

    State: ``{"params": bf16 tree on the device, "master": fp32 tree on CPU, "opt": list of
    per-leaf AdamW states on CPU (leaf order of the params tree)}``. When the default backend is
    the CPU, "the CPU backend" is the default device itself.
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
        self._update = None

    def _options(self) -> tuple:
        return (("grads_to_host", self.grads_to_host),)

    def _compile(self, batch_abstract):
        cfg = self.cfg
        compute_abs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, COMPUTE_DTYPE), self.abstract_master)
        p_sh = jax.tree.map(lambda _: self.dev_sh, compute_abs)
        g_sh = jax.tree.map(lambda _: self.grad_sh, compute_abs)
        fn = jax.jit(lambda p, b: loss_and_grads(cfg, p, b), in_shardings=(p_sh, self.dev_sh),
                     out_shardings=(self.dev_sh, g_sh))
        return fn.lower(_abstract(compute_abs, p_sh), batch_abstract).compile()

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
        if self.h2d_path == "direct":
            return jax.device_put(a, self.dev_sh)
        if self.h2d_path == "numpy":
            return jax.device_put(np.asarray(a), self.dev_sh)
        return jax.device_put(jax.device_put(np.asarray(a), self.host_sh), self.dev_sh)

    def _to_cpu(self, tree):
        return jax.tree.map(lambda a: jax.device_put(a, self.cpu_sh), tree)

    def init(self, key):
        """Master params built piecewise on the device and moved to the CPU backend (through
        pinned_host where it exists); zero per-leaf AdamW state on the CPU backend; bf16 compute
        params derived on the CPU backend and copied to the device along ``h2d_path``."""
        if self.host_sh is not None and self.cpu != self.device:
            place = lambda t: self._to_cpu(jax.tree.map(lambda a: jax.device_put(a, self.host_sh), t))
        else:
            place = self._to_cpu
        master = init_master_piecewise(self.cfg, key, place, self.device)
        zeros = lambda s, d: jax.device_put(np.zeros(s, d), self.cpu_sh)
        opt = [zeros_opt_state(self.tx, leaf, zeros) for leaf in jax.tree.leaves(self.abstract_master)]
        cast = jax.jit(lambda a: a.astype(COMPUTE_DTYPE))
        params = []
        for m in jax.tree.leaves(master):
            params.append(self._leaf_to_device(cast(m)))
            jax.block_until_ready(params[-1])
        return {"params": jax.tree.unflatten(self._treedef, params), "master": master, "opt": opt}

    def step(self, state, batch):
        """One training step (host-driven: device fwd/bwd, then per leaf: gradient to the CPU,
        CPU update, bf16 leaf back). Returns ``(new state, loss)``; sets ``last_update_s`` (the
        CPU update, summed over leaves) and ``last_timings`` (fwd_bwd_s, d2h_s, update_s, h2d_s:
        wall seconds of each phase, waited on, summed over leaves)."""
        batch = self.put_batch(batch)
        t0 = time.perf_counter()
        loss, grads = self._executable(batch)(state["params"], batch)
        jax.block_until_ready(grads)
        t_fb = time.perf_counter() - t0
        for a in jax.tree.leaves(state["params"]):
            a.delete()
        update = self._update_fn()
        masters, params, opts = [], [], []
        t_d2h = t_upd = t_h2d = 0.0
        for m, o, g in zip(jax.tree.leaves(state["master"]), state["opt"], jax.tree.leaves(grads)):
            t0 = time.perf_counter()
            g_cpu = jax.device_put(g, self.cpu_sh)
            jax.block_until_ready(g_cpu)
            t1 = time.perf_counter()
            m, o, c = update(m, o, g_cpu)
            jax.block_until_ready(c)
            t2 = time.perf_counter()
            p = self._leaf_to_device(c)
            jax.block_until_ready(p)
            t3 = time.perf_counter()
            del g_cpu, c
            t_d2h, t_upd, t_h2d = t_d2h + t1 - t0, t_upd + t2 - t1, t_h2d + t3 - t2
            masters.append(m)
            opts.append(o)
            params.append(p)
        del grads
        self.last_update_s = t_upd
        self.last_timings = {"fwd_bwd_s": t_fb, "d2h_s": t_d2h, "update_s": t_upd, "h2d_s": t_h2d}
        return {"params": jax.tree.unflatten(self._treedef, params),
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
