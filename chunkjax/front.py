"""The front door: an NNX model, its loss and an optimizer in, an offloaded train step out (issue 22, item 1).

::

    model = MyLlama(cfg, rngs=nnx.Rngs(0))
    step = chunkjax.offload(model, optax.adamw(1e-3), loss_fn, batch, device_budget="64MiB")
    for batch in batches:
        loss = step(batch)            # loss_fn(model, batch) -> scalar; step.metrics: loss, grad_norm
    step.sync(model)                  # the trained params and state written back into the model

The model's stages are found by :mod:`chunkjax.discover` (a block list or a scanned block, the parts
before and after as their own stages); the parameters, gradients and optimizer state are chunked
and placed by the tide plan through the one fit path (:func:`chunkjax.fit.prepare`, then
:func:`chunkjax.fit.fit_problem`; PatrickStar, arXiv 2108.05818, sections 4-5). Non-parameter
state (dropout RNG, counters, batch statistics) advances as in the plain NNX loop.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax.discover import Discovery, discover
from chunkjax.errors import PlanError
from chunkjax.fit import HEADROOM, auto_budget, batch_rows, describe, fit_problem, plan, prepare, resolve_budget


def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


class OffloadedStep:
    """A train step of an NNX model with chunked, placed parameters (built by :func:`offload`).

    ``step(batch) -> loss`` (() float32, the mean loss of the batch) runs one step: forward,
    backward and update of every chunk; ``step.metrics`` holds that step's ``loss`` and global
    ``grad_norm``. The model itself is not touched until :meth:`sync`.

    Attributes:
      discovery: the :class:`chunkjax.discover.Discovery` (stages, flat parameter keys).
      step: the :class:`chunkjax.ChunkedStep`; ``state``: its :class:`chunkjax.TrainState`.
      report: the :class:`chunkjax.fit.FitReport` (``schedule``, budgets, compiled check);
        ``problem``: the :class:`chunkjax.fit.FitProblem` (``layout``, traces).
      metrics: the last step's metrics (``loss``, ``grad_norm``), None before the first.
    """

    def __init__(self, discovery: Discovery, fitted, state, example):
        self.discovery = discovery
        self.step, self.report, self.problem = fitted
        self.state = state
        self.metrics = None
        self._example = example
        self._batch_sharding = self.step.topology.batch_sharding()
        side = tuple(discovery.side_values[j] for j in discovery.mutable)
        # on one device committed as the step's outputs are: later steps run the first one's programs
        self._side = side if self.step.mesh is not None else jax.device_put(side, self._batch_sharding)

    # ---- what was planned ------------------------------------------------------------------------
    @property
    def layout(self):
        """The :class:`chunkjax.ChunkLayout` (chunks of the flat parameter dict)."""
        return self.problem.layout

    @property
    def schedule(self):
        """The :class:`chunkjax.Schedule` the step runs (placement, fetches, update locations)."""
        return self.report.schedule

    @property
    def stages(self) -> tuple:
        return self.discovery.stages

    def summary(self) -> str:
        """One line: stages, chunks and the plan (:func:`chunkjax.fit.describe`)."""
        names = [s.name for s in self.stages]
        return (f"{len(names)} stages ({names[0]} .. {names[-1]}), {self.layout.n_chunks} chunks of "
                f"{self.layout.chunk_size} elements; " + describe(self.report, self.problem))

    # ---- running ---------------------------------------------------------------------------------
    def _check(self, batch) -> None:
        got = _abstract(batch)
        if jax.tree.structure(got) != jax.tree.structure(self._example) or any(
                a.shape != b.shape or a.dtype != b.dtype
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(self._example))):
            want = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(self._example)]
            have = [(tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(got)]
            raise ValueError(f"batch shapes {have} differ from the planned {want}: pass batches of the example's "
                             "shape (or build another step with chunkjax.offload for this shape)")

    def _step_batch(self, batch):
        """``(data, tiled side leaves)``; on one device placed (committed) where the compiled check
        placed it, so that the step runs the programs the check compiled (an uncommitted batch
        lowers without its sharding: every program compiled again at the first step)."""
        rows = int(jax.tree.leaves(batch)[0].shape[0])
        out = batch, tuple(jnp.broadcast_to(jnp.asarray(v)[None], (rows,) + tuple(np.shape(v))) for v in self._side)
        return out if self.step.mesh is not None else jax.device_put(out, self._batch_sharding)

    def __call__(self, batch):
        """One training step on ``batch`` (the planned shapes); returns its loss.

        Raises:
          ValueError: the batch's structure, shapes or dtypes differ from the example's.
        """
        self._check(batch)
        self.state, metrics = self.step(self.state, self._step_batch(batch))
        if self.discovery.mutable:
            self._side = tuple(metrics.pop("aux"))
        self.metrics = metrics
        return metrics["loss"]

    def evaluate(self, batch):
        """The loss of ``batch`` with the current parameters, the model in eval mode (``nnx``'s
        ``model.eval()``: dropout off, running statistics read), no update (() float32)."""
        self._check(batch)
        return self._eval_step.eval_loss(self.state, self._step_batch(batch))

    @functools.cached_property
    def _eval_step(self):
        """The step whose stages run the model in eval mode (same layout, schedule and state)."""
        from flax import nnx
        d = self.discovery
        model = nnx.merge(d.graphdef, jax.tree.unflatten(d.param_treedef, [d.param_avals[k] for k in d.param_keys]),
                          jax.tree.unflatten(d.side_treedef, list(d.side_values)))
        model.eval()
        de = dataclasses.replace(d, graphdef=nnx.graphdef(model))
        if tuple(s.param_keys for s in de.stages) != tuple(s.param_keys for s in d.stages):
            raise ValueError("in eval mode the model reads other parameters per stage: evaluate with the train step")
        return dataclasses.replace(self.step, stages=de.stages)

    def sync(self, model) -> None:
        """Write the trained parameters (the float32 masters, cast to each leaf's dtype) and the
        non-parameter state the loss changed back into ``model`` (``nnx.update``). Waits for the
        step's host updates.

        Raises:
          ValueError: ``model``'s parameters differ from the offloaded model's (a missing or extra
            leaf, another shape or dtype; one line naming the first), before anything is written.
        """
        from flax import nnx
        d = self.discovery
        d.check_model(model)
        flat = self.step.master_params(self.state)
        nnx.update(model, jax.tree.unflatten(d.param_treedef, d.stack(flat)))
        if d.mutable:
            side = list(d.side_values)
            for j, v in zip(d.mutable, self._side):
                side[j] = v
            nnx.update(model, jax.tree.unflatten(d.side_treedef, side))

    def wait(self) -> float | None:
        """Block until the last step's host updates are done; the seconds the host thread spent in
        its kernels (None: no host updates)."""
        return self.step.wait(self.state)


def _optimizer_kw(tx) -> dict:
    if isinstance(tx, optax.GradientTransformation):
        return {"tx": tx}
    if callable(getattr(tx, "optax", None)):
        return {"host_optimizer": tx}
    raise TypeError(f"tx={type(tx).__name__}: pass an optax transformation (e.g. optax.adamw(1e-3)) or a host "
                    "spec (chunkjax.host_update.AdamW(...)) for updates on the host")


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
    """What :func:`plan_offload` found and planned for a model (nothing allocated or compiled).

    Attributes:
      discovery: the :class:`chunkjax.discover.Discovery` (stages, flat parameter keys).
      problem: the :class:`chunkjax.fit.FitProblem` (layout, stage traces, FLOPs, rates).
      schedule: the :class:`chunkjax.Schedule` planned for ``budget_bytes`` (None: no budget given).
      budget_bytes: the per-rank device budget planned for (bytes; None without a budget).
    """

    discovery: Discovery
    problem: Any
    schedule: Any
    budget_bytes: int | None

    def summary(self) -> str:
        """One line: stages, chunks, the plan's counts, predicted peak and step."""
        names = [s.name for s in self.discovery.stages]
        lay = self.problem.layout
        head = (f"{len(names)} stages ({names[0]} .. {names[-1]}), {lay.n_chunks} chunks of {lay.chunk_size} "
                f"elements; {self.problem.flops_per_step / 1e12:.1f} TFLOP per step")
        if self.schedule is None:
            return head
        p = self.schedule.predicted
        return (f"{head}; plan {self.schedule.counts()}; accounted peak {p.peak_device_bytes / 2**20:.1f} MiB of "
                f"{self.budget_bytes / 2**20:.1f} MiB; predicted step {p.time.step_s * 1e3:.1f} ms")


def _discover(model, loss_fn, batch, *, wrt, blocks, compute_dtype, abstract_ok: bool):
    """Discovery of ``model`` (an abstract one's non-parameter state replaced by zeros of its
    shapes: planning reads shapes only) and its parameter leaves."""
    from flax import nnx
    wrt_ = nnx.Param if wrt is None else wrt
    graphdef, params, rest = nnx.split(model, wrt_, ...)
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)) and not abstract_ok:
        raise ValueError("offload needs a model with concrete parameters (this one is abstract, e.g. from "
                         "nnx.eval_shape): build it for real, or plan abstract shapes with chunkjax.plan_offload "
                         "or chunkjax.fit.prepare and chunkjax.fit.plan (docs/own_model.md)")
    if abstract_ok and any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(rest)):
        rest = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, rest)
        model = nnx.merge(graphdef, params, rest)
    batch_rows(_abstract(batch))  # a batch without a row axis: one line before tracing the loss
    d = discover(model, loss_fn, batch, wrt=wrt, blocks=blocks, compute_dtype=compute_dtype)
    return model, d, jax.tree.leaves(nnx.split(model, d.wrt, ...)[1])


def _prepare(model, d: Discovery, leaves, tx, device_budget, host_budget, trainable, mesh, zero_stage, fit_kw):
    """The fit problem of a discovered model (:func:`chunkjax.fit.prepare`); ``fit_kw`` loses
    prepare's keywords. FLOPs: 3 x the forward's matrix products counted in the discovered loss
    (:attr:`Discovery.forward_flops`), unless ``flops_per_step`` is given."""
    if d.mutable and (mesh is not None or fit_kw.get("micro_batches", 1) != 1):
        raise ValueError("the loss changes non-parameter state (RNG streams, counters, batch statistics): run it on "
                         "one device with one micro-batch (mesh=None, micro_batches=1), or make those leaves constant")
    params = d.layout_params(leaves)
    if trainable is not None:
        fit_kw["trainable"] = _trainable_mask(model, d, trainable, params)
    fit_kw.setdefault("flops_per_step", 3.0 * d.forward_flops)
    rows = jax.tree.leaves(d.example)[0].shape[0]
    side = tuple(jax.ShapeDtypeStruct((rows,) + tuple(np.shape(d.side_values[j])), d.side_values[j].dtype)
                 for j in d.mutable)
    prep = {k: fit_kw.pop(k) for k in list(fit_kw) if k not in _FIT_ARGS}
    return params, prepare(d.stages, _abstract(params), (d.example, side), device_budget=device_budget,
                           host_budget=host_budget, compute_dtype=d.compute_dtype, mesh=mesh, zero_stage=zero_stage,
                           **_optimizer_kw(tx), **prep)


def _is_min(device_budget) -> bool:
    return isinstance(device_budget, str) and device_budget.strip().lower() == "min"


def plan_offload(model, tx, loss_fn, batch, *, device_budget: int | str | None = None, host_budget: Any = None,
                 wrt=None, trainable=None, blocks=None, compute_dtype=None, mesh=None, zero_stage: int = 0,
                 policy: str = "tide", **prepare_kw) -> OffloadPlan:
    """What :func:`offload` would plan for ``model``, without allocating or compiling the step:
    the discovered stages, the fit problem (layout, stage traces, FLOPs) and, given a budget, the
    schedule (:func:`chunkjax.fit.plan`; the compiled check and its re-plans are :func:`offload`'s).

    Args:
      model: an ``nnx.Module``, concrete or abstract (``nnx.eval_shape(lambda: MyModel(...))``:
        only shapes are read; abstract non-parameter state stands in as zeros).
      tx, loss_fn, batch, wrt, trainable, blocks, compute_dtype, mesh, zero_stage, policy: as
        :func:`offload` (``batch`` may be ``ShapeDtypeStruct`` s; ``mesh`` may be a
        ``jax.sharding.AbstractMesh`` with ``check_host=False``).
      device_budget: per-rank bytes, a size string, ``"auto"``, ``"min"``, or None (no schedule:
        the problem only).
      host_budget: bytes of host memory for model data, ``"auto"`` or None (default: no bound).
      **prepare_kw: the rest of :func:`chunkjax.fit.prepare` (chunk_size, min_chunks, prefetch,
        flops_per_step, rates, check_host, ...).

    Returns:
      an :class:`OffloadPlan`.

    Raises:
      TypeError, ValueError, chunkjax.PlanError: as :func:`offload` (a misspelt keyword: one
        line naming plan_offload).
    """
    _check_fit_kw(prepare_kw, "plan_offload", fit_args=False)
    model, d, leaves = _discover(model, loss_fn, batch, wrt=wrt, blocks=blocks, compute_dtype=compute_dtype,
                                 abstract_ok=True)
    smallest = _is_min(device_budget)
    _, problem = _prepare(model, d, leaves, tx, None if smallest else device_budget, host_budget, trainable, mesh,
                          zero_stage, dict(prepare_kw))
    if device_budget is None:
        return OffloadPlan(d, problem, None, None)
    budget = resolve_budget(device_budget) if not smallest else smallest_budget(problem, policy)
    budget = auto_budget(problem, policy=policy) if budget == "auto" else budget
    return OffloadPlan(d, problem, plan(problem, budget, policy=policy), int(budget))


def offload(model, tx, loss_fn, batch, *, device_budget: int | str = "auto", host_budget: Any = "auto",
            wrt=None, trainable=None, blocks=None, compute_dtype=None, mesh=None, zero_stage: int = 0,
            policy: str = "tide", **fit_kw) -> OffloadedStep:
    """A chunked, offloaded train step for an NNX model.

    Args:
      model: an ``nnx.Module``; its parameters initialise the step (the model is not changed
        until :meth:`OffloadedStep.sync`).
      tx: an elementwise optax transformation (offloaded chunks update streamed through the
        device), or a host spec (``chunkjax.host_update.AdamW / Lion / SGDMomentum``: offloaded
        chunks update on the host, its ``optax()`` twin updates the device chunks).
      loss_fn: ``loss_fn(model, batch) -> () float``: the loss (a scalar; nnx's usual signature).
        Blocks wrapped in ``nnx.remat`` (or calling ``jax.checkpoint`` inside) are found the same
        way; their rematerialisation coincides with the step's per-stage recompute.
      batch: an example batch, the planned shape: tokens (B, T+1) or any pytree of arrays with
        the batch axis first (e.g. ``{"images": (B, H, W, C), "labels": (B,)}``).
      device_budget: bytes per device for model data and activations: an int, ``"64MiB"``,
        ``"auto"`` (:func:`chunkjax.fit.auto_budget`) or ``"min"`` (:func:`smallest_budget`: the
        least the plan needs, every parameter chunk in pinned_host); ``host_budget``: bytes of
        host memory for model data, ``"auto"`` or None.
      wrt: nnx filter of the chunked leaves (default ``nnx.Param``); the rest of the model's
        state (RNG streams, counters, batch statistics) advances as in the plain loop.
      trainable: nnx filter of the trained leaves among ``wrt`` (default: all floating ones);
        the others are frozen: chunked and fetched, no optimizer state, never updated.
      blocks: attribute path of the block list or scanned block (``"decoder/layers"``) when the
        automatic choice is ambiguous (:func:`chunkjax.discover.discover`).
      compute_dtype: dtype of compute params and gradients (default: the params' dtype; e.g.
        ``jnp.bfloat16`` for mixed precision with float32 masters).
      mesh, zero_stage: a ``data`` mesh (:func:`chunkjax.data_mesh`) and ZeRO stage 1/2/3.
      policy: the planner's policy (default ``"tide"``).
      **fit_kw: the rest of :func:`chunkjax.fit_step` (chunk_size, min_chunks, prefetch,
        flops_per_step (default: 3 x the forward's matrix products counted in the traced loss),
        rates, check_compiled, strict, ...): this is the fit path's
        :func:`~chunkjax.fit.prepare` then :func:`~chunkjax.fit.fit_problem`.

    Returns:
      an initialised :class:`OffloadedStep`.

    Raises:
      TypeError: ``tx`` is neither an optax transformation nor a host spec; a keyword in
        ``fit_kw`` that the fit path does not take.
      ValueError: an abstract model (parameters ``ShapeDtypeStruct`` s, e.g. from ``nnx.eval_shape``:
        :func:`plan_offload` plans those).
      ValueError: see :func:`chunkjax.discover.discover` and :func:`chunkjax.fit.prepare` (a
        non-elementwise transformation, a batch without a row axis, ...); non-parameter state
        that the loss changes together with a mesh.
      chunkjax.PlanError, HostMemoryError: the budgets do not fit (one line: what to change).
    """
    _check_fit_kw(fit_kw, "offload")
    _optimizer_kw(tx)
    model, d, leaves = _discover(model, loss_fn, batch, wrt=wrt, blocks=blocks, compute_dtype=compute_dtype,
                                 abstract_ok=False)
    fit_args = {k: fit_kw.pop(k) for k in _FIT_ARGS if k in fit_kw}
    smallest = _is_min(device_budget)
    params, problem = _prepare(model, d, leaves, tx, None if smallest else device_budget, host_budget, trainable,
                               mesh, zero_stage, fit_kw)
    fitted = fit_problem(problem, smallest_budget(problem, policy) if smallest else device_budget, policy=policy,
                         **fit_args)
    state = fitted.step.init(params)
    return OffloadedStep(d, fitted, state, d.example)


_FIT_ARGS = ("resident", "check_compiled", "strict")  # fit_problem's; the rest of **fit_kw goes to prepare
_OFFLOAD_SETS = ("stages", "params", "batch", "tx", "host_optimizer", "compute_dtype", "mesh", "zero_stage",
                 "device_budget", "host_budget", "trainable")  # prepare's arguments offload fills itself


def _check_fit_kw(fit_kw: dict, name: str, fit_args: bool = True) -> None:
    """TypeError naming the first keyword of ``fit_kw`` that neither prepare nor (``fit_args``)
    fit_problem takes."""
    import inspect
    known = (set(inspect.signature(prepare).parameters) - set(_OFFLOAD_SETS)) | (set(_FIT_ARGS) if fit_args else set())
    for k in fit_kw:
        if k not in known:
            raise TypeError(f"{name}() got an unexpected keyword argument {k!r}")


def smallest_budget(problem, policy: str = "tide") -> int:
    """The smallest per-rank device budget ``problem`` plans for (every parameter chunk offloaded:
    the planner's ``PlanError.min_budget_bytes``), over :data:`chunkjax.fit.HEADROOM`, in bytes."""
    try:
        plan(problem, 1, policy=policy)
        return 1
    except PlanError as e:
        return int(math.ceil(e.min_budget_bytes / HEADROOM))


def _trainable_mask(model, d: Discovery, trainable, params: dict) -> dict:
    """Flat parameter key -> bool: the floating leaves of ``wrt`` that match ``trainable``."""
    from flax import nnx
    keys = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.All(d.wrt, trainable)))}
    return {kk: k in keys and jnp.issubdtype(params[kk].dtype, jnp.floating)
            for k in d.param_keys for kk in d.per_layer.get(k, (k,))}
