"""The front door: an NNX model, its loss and an optimizer in, an offloaded train step out (issue 22, item 1).

::

    model = MyLlama(cfg, rngs=nnx.Rngs(0))
    step = chunkjax.offload(model, optax.adamw(1e-3), loss_fn, batch, device_budget="64MiB")
    for batch in batches:
        loss = step(batch)            # loss_fn(model, batch) -> scalar; step.metrics: loss, grad_norm
    step.sync(model)                  # the trained params and state written back into the model

Once the step holds the parameters in its chunks, the model's own parameter arrays are released
(:mod:`chunkjax.released`: the model keeps shapes and dtypes, not the data), so the model is not
held twice in memory and never read stale; ``step.sync(model)`` brings them back, and the model's
forward before it raises one line saying so (``keep_model=True`` keeps them).

The model's stages are found by :mod:`chunkjax.discover` (a block list or a scanned block, the parts
before and after as their own stages); the parameters, gradients and optimizer state are chunked
and placed by the tide plan through the one fit path (:func:`chunkjax.fit.prepare`, then
:func:`chunkjax.fit.fit_problem`; PatrickStar, arXiv 2108.05818, sections 4-5). Non-parameter
state (dropout RNG, counters, batch statistics) advances as in the plain NNX loop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from chunkjax.discover import Discovery, discover, path_key
from chunkjax.dtypes import compute_dtype_of
from chunkjax.errors import PlanError, complex_param_error
from chunkjax.fit import auto_budget, describe, fit_problem, min_budget, plan, prepare, resolve_budget
from chunkjax.fit_batch import batch_rows
from chunkjax.fit_report import stages_line
from chunkjax.front_checkpoint import OffloadedChunkIO
from chunkjax.nonfinite import raise_if_nonfinite
from chunkjax.offload_plan import OffloadPlan
from chunkjax.optim import wrapper_hint
from chunkjax.released import ReleasedParam, ReleasedParamsError, is_released, trim_host_heap
from chunkjax.step_commit import interrupts_deferred, recover


def _abstract(tree):
    """``tree``'s leaves as ``ShapeDtypeStruct`` s of their own dtypes (a python scalar: numpy's)."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype if hasattr(a, "dtype") else np.result_type(a)), tree)


def release_params(model, wrt) -> int:
    """Replace the value of every ``wrt`` Variable of ``model`` by a :class:`chunkjax.released.ReleasedParam`
    (its shape, dtype, path and sharding; ``nnx.update``), so that the arrays are freed once
    nothing else holds them, and the C heap's free pages go back to the OS
    (:func:`chunkjax.released.trim_host_heap`). Returns the bytes the model held (shape x itemsize, 0 for leaves already released)."""
    from flax import nnx
    flat, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model, wrt))
    held = sum(0 if is_released(a) else int(np.size(a)) * np.dtype(a.dtype).itemsize for _, a in flat)
    placeholders = [a if is_released(a) else
                    ReleasedParam(np.shape(a), a.dtype, path_key(p), a.sharding if isinstance(a, jax.Array) else None)
                    for p, a in flat]
    del flat  # the last references this function holds
    nnx.update(model, jax.tree.unflatten(treedef, placeholders))
    trim_host_heap()
    return held


class OffloadedStep(OffloadedChunkIO):
    """A train step of an NNX model with chunked, placed parameters (built by :func:`offload`).

    ``step(batch) -> loss`` (() float32, the mean loss of the batch) runs one step: forward,
    backward and update of every chunk; ``step.metrics`` holds that step's ``loss`` and global
    ``grad_norm``. The model's parameters are not written until :meth:`sync`; unless
    :func:`offload` kept them (``keep_model``), its parameter arrays were released
    (``released_bytes``) and :meth:`sync` brings them back. A step is all or nothing under
    exceptions and Ctrl-C (:meth:`__call__`). Checkpointable with the step alone, its
    non-parameter state included (:mod:`chunkjax.front_checkpoint`:
    ``chunkjax.save_checkpoint(dir, n, step)``, ``chunkjax.restore_checkpoint(dir, step)``).

    Attributes:
      discovery: the :class:`chunkjax.discover.Discovery` (stages, flat parameter keys).
      step: the :class:`chunkjax.ChunkedStep`; ``state``: its :class:`chunkjax.TrainState`.
      report: the :class:`chunkjax.fit.FitReport` (``schedule``, budgets, compiled check);
        ``problem``: the :class:`chunkjax.fit.FitProblem` (``layout``, traces).
      metrics: the last step's metrics (``loss``, ``grad_norm``), None before the first.
      released_bytes: bytes of parameter arrays :func:`offload` released from the model (0: kept).
    """

    def __init__(self, discovery: Discovery, fitted, state, example):
        self.discovery = discovery
        self.step, self.report, self.problem = fitted
        self.state = state
        self.metrics = None
        self.released_bytes = 0
        self._example = example
        self._batch_sharding = self.step.topology.batch_sharding()
        self._no_state = None  # why ``state`` is None (a failed restore: chunkjax.front_checkpoint)
        self._side = self._place_side(tuple(discovery.side_values[j] for j in discovery.mutable))

    def _place_side(self, side: tuple) -> tuple:
        """The non-parameter state the loss changes, on one device committed as the step's outputs
        are (later steps run the first one's programs)."""
        return side if self.step.mesh is not None else jax.device_put(side, self._batch_sharding)

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
        return (f"{stages_line(names)}, {self.layout.n_chunks} chunks of "
                f"{self.layout.chunk_size} elements; " + describe(self.report, self.problem))

    # ---- running ---------------------------------------------------------------------------------
    def _check(self, batch):
        """``batch`` as planned: ValueError (one line) unless its pytree structure, shapes and
        dtypes are the example's; a leaf whose dtype JAX canonicalises to the planned one (int64
        -> int32, float64 -> float32 with x64 off: what ``jnp.asarray`` does) is cast to it."""
        got, ex = _abstract(batch), self._example
        if jax.tree.structure(got) != jax.tree.structure(ex):
            raise ValueError(f"the batch's pytree structure {jax.tree.structure(got)} differs from the planned "
                             f"{jax.tree.structure(ex)}: pass batches structured as the example")
        pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(ex)))
        if any(a.shape != b.shape or jax.dtypes.canonicalize_dtype(a.dtype) != b.dtype for a, b in pairs):
            names = [jax.tree_util.keystr(k) or "the batch" for k, _ in jax.tree_util.tree_flatten_with_path(ex)[0]]
            bad = [(n, a, b) for n, (a, b) in zip(names, pairs)
                   if a.shape != b.shape or jax.dtypes.canonicalize_dtype(a.dtype) != b.dtype]
            if all(a.shape == b.shape for _, a, b in bad):  # only dtypes differ
                raise ValueError("batch dtypes differ from the planned: " + ", ".join(
                    f"{n} {a.dtype} (planned {b.dtype})" for n, a, b in bad) + ": pass batches of the example's dtype, "
                    "e.g. x.astype(...) (shapes match)")
            raise ValueError("batch shapes differ from the planned: " + ", ".join(
                f"{n} {tuple(a.shape)} {a.dtype} (planned {tuple(b.shape)} {b.dtype})" for n, a, b in bad) +
                ": pass batches of the example's shape (or build another step with chunkjax.offload for this shape)")
        if all(a.dtype == b.dtype for a, b in pairs):
            return batch
        return jax.tree.map(lambda a, b: a if a.dtype == b.dtype else jnp.asarray(a, b.dtype), batch, ex)

    def _step_batch(self, batch):
        """``(data, tiled side leaves)``; on one device placed (committed) where the compiled check
        placed it, so that the step runs the programs the check compiled (an uncommitted batch
        lowers without its sharding: every program compiled again at the first step)."""
        rows = int(jax.tree.leaves(batch)[0].shape[0])
        out = batch, tuple(jnp.broadcast_to(jnp.asarray(v)[None], (rows,) + tuple(np.shape(v))) for v in self._side)
        return out if self.step.mesh is not None else jax.device_put(out, self._batch_sharding)

    def __call__(self, batch, loss_scale=None):
        """One training step on ``batch`` (the planned shapes); returns its loss. ``loss_scale``:
        exactly when offloaded with ``loss_scaling=True`` (float16 compute), the scale of a
        :class:`chunkjax.DynamicLossScale` (``s = s.adjust(not step.metrics["skipped"])``).

        All or nothing: an exception or Ctrl-C inside leaves ``state``, the non-parameter state
        and ``metrics`` as they were before the call (:mod:`chunkjax.step_commit`: the device
        chunks' donating updates are dispatched last, with signals held; compute params an
        early-streamed chunk donated are rebuilt from its master params, the same bits). Host and
        storage chunks updated in place (from the backward on without clipping, else once the
        global norm is known) hold Ctrl-C until the commit (the step then completes); an exception
        after they started cannot undo them: every later use of the state then raises
        :class:`chunkjax.PartialStepError` (restore the last checkpoint). Costs no device or host bytes.

        ``batch``'s leaves of a dtype JAX canonicalises to the planned one (int64 or float64 with
        x64 off) are cast to it, as ``jnp.asarray`` would.

        Raises:
          ValueError: the batch's pytree structure, shapes or dtypes differ from the example's.
          chunkjax.front_checkpoint.NoStateError: a restore failed after releasing the state.
          chunkjax.PartialStepError: a step failed after chunks took it in place, leaving the state half updated.
        """
        batch = self._check(batch)
        state = self._held()
        try:
            pending = self.step.begin(state, self._step_batch(batch), loss_scale)
        except BaseException:
            with contextlib.suppress(Exception):  # the step's own error is the one to raise
                self.state = recover(self.step, state)  # early-streamed params it donated, rebuilt
            raise
        try:
            with interrupts_deferred():  # a signal now is delivered once the new state is stored
                self.state, metrics = pending.commit()
                self._side = tuple(metrics.pop("aux")) if self.discovery.mutable else self._side
                self.metrics = metrics
        except KeyboardInterrupt as e:  # held until the step was stored: say so, its batch is done
            e.add_note("chunkjax: Ctrl-C came as this step committed: the step is applied (step.metrics are its), "
                       "do not repeat its batch")
            raise
        raise_if_nonfinite(self.step, self.state, metrics)  # nonfinite="error": nothing updated
        return metrics["loss"]

    def evaluate(self, batch):
        """The loss of ``batch`` with the current parameters, the model in eval mode (``nnx``'s
        ``model.eval()``: dropout off, running statistics read), no update (() float32)."""
        batch = self._check(batch)
        return self._eval_step.eval_loss(self._held(), self._step_batch(batch))

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
        step's host updates. A model whose parameters :func:`offload` (or :meth:`release`)
        released gets arrays again: its forward, export or ``nnx.state`` work as before (the model
        then holds a second copy of the parameters beside the step's chunks until
        :meth:`release`). Before any step, the synced parameters are the model's initial ones,
        bit for bit.

        Raises:
          ValueError: ``model``'s parameters, or the non-parameter state the sync writes, differ
            from the offloaded model's (a missing or extra parameter, a missing state leaf or
            node, e.g. no dropout RNG; another shape or dtype; one line naming the first), before
            anything is written.
        """
        from flax import nnx
        d = self.discovery
        d.check_model(model)
        if d.mutable:
            _check_side(d, model)
        if jax.process_count() == 1:
            leaves = self._synced_leaves(jax.tree.leaves(nnx.state(model, d.wrt)))
        else:  # the masters gathered from every process (a collective)
            leaves = d.stack(self.step.master_params(self._held()))
        nnx.update(model, jax.tree.unflatten(d.param_treedef, leaves))
        if d.mutable:
            side = list(d.side_values)
            for j, v in zip(d.mutable, self._side):
                side[j] = v
            nnx.update(model, jax.tree.unflatten(d.side_treedef, side))

    def _synced_leaves(self, now: list) -> list:
        """The ``wrt`` leaves (leaf order, their own dtypes) built on the host from the step's
        float32 masters one chunk at a time (:meth:`chunkjax.ChunkedStep.checkpoint_master`; a
        scanned block's layers into their stacked leaf), each put where the model's leaf ``now``
        lives (its sharding, or a released one's; else the default device) once complete: the
        device never holds every master at once, the host one chunk beside the leaves."""
        d, step, lay = self.discovery, self.step, self.step.layout
        step.wait(self._held())
        pos = {k: j for j, k in enumerate(d.param_keys)}
        layer_of = {kk: (k, i) for k, kks in d.per_layer.items() for i, kk in enumerate(kks)}
        avals = [d.param_avals[k] for k in d.param_keys]
        target = []  # slot -> (leaf, element offset of the slot in the leaf)
        for key in _slot_keys(lay):
            stacked, layer = layer_of.get(key, (key, 0))
            target.append((pos[stacked], layer * math.prod(avals[pos[stacked]].shape[1:])))
        left = [math.prod(a.shape) for a in avals]
        out, bufs = [None] * len(avals), {}

        def place(j, a):
            where = getattr(now[j], "sharding", None) if isinstance(now[j], jax.Array) or is_released(now[j]) else None
            out[j] = jnp.asarray(a) if where is None else jax.device_put(a, where)

        for c in range(lay.n_chunks):
            master = step.checkpoint_master(self.state, c)
            for i, p in lay.chunk_pieces(c):
                j, off = target[i]
                if j not in bufs:
                    bufs[j] = np.empty(math.prod(avals[j].shape), avals[j].dtype)
                bufs[j][off + p.leaf_offset:off + p.leaf_offset + p.size] = master[p.offset:p.offset + p.size]
                left[j] -= p.size
                if left[j] == 0:
                    place(j, bufs.pop(j).reshape(avals[j].shape))
            del master
        for j, a in enumerate(avals):  # leaves without elements
            if out[j] is None:
                place(j, np.zeros(a.shape, a.dtype))
        return out

    def release(self, model) -> int:
        """Release ``model``'s parameter arrays (the step holds the parameters in its chunks):
        each ``wrt`` Variable keeps its shape and dtype, not its data
        (:class:`chunkjax.released.ReleasedParam`); reading one, e.g. the model's forward, raises
        :class:`chunkjax.released.ReleasedParamsError` in one line until :meth:`sync`. What
        :func:`offload` does unless ``keep_model``; use it again after a :meth:`sync` (e.g. an
        evaluation with the model's own forward). Returns the bytes released (shape x itemsize;
        freed when nothing else holds the arrays).

        Raises:
          ValueError: ``model``'s parameters differ from the offloaded model's (as :meth:`sync`).
        """
        self.discovery.check_model(model)
        return release_params(model, self.discovery.wrt)


def _check_side(d: Discovery, model) -> None:
    """ValueError (one line, the first differing path) unless ``model`` has every non-parameter
    leaf the sync writes (``d.side_keys``) with its shape and dtype."""
    from flax import nnx
    have = {path_key(p): a for p, a in jax.tree_util.tree_flatten_with_path(nnx.split(model, d.wrt, ...)[2])[0]}
    for k, want in zip(d.side_keys, d.side_values):
        a = have.get(k)
        if a is None:
            raise ValueError(f"the model lacks state {k!r} ({tuple(np.shape(want))} {want.dtype}) that the step "
                             "writes (e.g. built without dropout RNGs): sync into a model built like the offloaded one")
        if tuple(np.shape(a)) != tuple(np.shape(want)) or a.dtype != want.dtype:
            raise ValueError(f"the model's state {k!r} is {tuple(np.shape(a))} {a.dtype}, the step's is "
                             f"{tuple(np.shape(want))} {want.dtype}: sync into a model built like the offloaded one")


def _optimizer_kw(tx) -> dict:
    if isinstance(tx, optax.GradientTransformation):
        return {"tx": tx}
    if callable(getattr(tx, "optax", None)):
        return {"host_optimizer": tx}
    raise TypeError(f"tx={type(tx).__name__}: pass an optax transformation (e.g. optax.adamw(1e-3)) or a host "
                    f"spec (chunkjax.host_update.AdamW(...)) for updates on the host{wrapper_hint(tx)}")


def _discover(model, loss_fn, batch, *, wrt, blocks, compute_dtype, abstract_ok: bool):
    """Discovery of ``model`` (an abstract one's non-parameter state replaced by zeros of its
    shapes: planning reads shapes only) and its parameter leaves."""
    from flax import nnx
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model={type(model).__name__}: pass the flax nnx.Module to train (e.g. MyModel(rngs=nnx.Rngs(0))); "
                        "for a params pytree and stage functions use chunkjax.fit_step (docs/own_model.md)")
    wrt_ = nnx.Param if wrt is None else wrt
    graphdef, params, rest = nnx.split(model, wrt_, ...)
    released = [a for a in jax.tree.leaves(params) if is_released(a)]
    if released and not abstract_ok:
        raise ReleasedParamsError(f"the model's parameters were released by an earlier chunkjax.offload (e.g. "
                                  f"{released[0].path!r}): call that step's sync(model) first, or plan it with "
                                  "chunkjax.plan_offload")
    if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(params)) and not abstract_ok:
        raise ValueError("offload needs a model with concrete parameters (this one is abstract, e.g. from "
                         "nnx.eval_shape): build it for real, or plan abstract shapes with chunkjax.plan_offload "
                         "or chunkjax.fit.prepare and chunkjax.fit.plan (docs/own_model.md)")
    if abstract_ok and any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(rest)):
        rest = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a, rest)
        model = nnx.merge(graphdef, params, rest)
    batch_rows(_abstract(batch))  # a batch without a row axis: one line before tracing the loss
    d = discover(model, loss_fn, batch, wrt=wrt, blocks=blocks,
                 compute_dtype=compute_dtype_of(compute_dtype))  # "bf16" as the planner CLI; one line on a bad one
    return model, d, jax.tree.leaves(nnx.split(model, d.wrt, ...)[1])


def _prepare(model, d: Discovery, leaves, tx, device_budget, host_budget, trainable, mesh, zero_stage, fit_kw):
    """The fit problem of a discovered model (:func:`chunkjax.fit.prepare`, on the abstract params
    dict: no array is copied); ``fit_kw`` loses prepare's keywords. FLOPs: 3 x the forward's matrix products counted in the discovered loss
    (:attr:`Discovery.forward_flops`), unless ``flops_per_step`` is given."""
    if d.mutable and (mesh is not None or fit_kw.get("micro_batches", 1) != 1):
        raise ValueError("the loss changes non-parameter state (RNG streams, counters, batch statistics): run it on "
                         "one device with one micro-batch (mesh=None, micro_batches=1), or make those leaves constant")
    params = d.layout_params(leaves)
    if trainable is not None:
        fit_kw["trainable"] = _trainable_mask(model, d, trainable, params)
        if not any(fit_kw["trainable"].values()):
            raise ValueError(f"trainable={trainable!r} matches no floating parameter of wrt={d.wrt!r}: nothing would "
                             "train; pass a filter that matches some of this model's parameters (a Variable type it "
                             "has, or a path filter) or leave trainable=None")
    fit_kw.setdefault("flops_per_step", 3.0 * d.forward_flops)
    rows = jax.tree.leaves(d.example)[0].shape[0]
    side = tuple(jax.ShapeDtypeStruct((rows,) + tuple(np.shape(d.side_values[j])), d.side_values[j].dtype)
                 for j in d.mutable)
    prep = {k: fit_kw.pop(k) for k in list(fit_kw) if k not in _FIT_ARGS}
    return prepare(d.stages, params, (d.example, side), device_budget=device_budget, host_budget=host_budget,
                   compute_dtype=d.compute_dtype, mesh=mesh, zero_stage=zero_stage, **_optimizer_kw(tx), **prep)


def _is_min(device_budget, none_ok: bool = True) -> bool:
    """Whether the budget is ``"min"``; any other spelling is checked by the one parser
    (:func:`chunkjax.budget.parse_budget`: a bad one is one line naming all the front door takes)."""
    from chunkjax.budget import parse_budget
    if device_budget is None and none_ok:
        return False
    return parse_budget(device_budget, api="the front door") == "min"


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
        flops_per_step, rates, check_host, cross_step, ...).

    Returns:
      an :class:`chunkjax.offload_plan.OffloadPlan` (``budget_bytes`` the budget resolved,
      ``requested`` as given; ``summary()`` in the terms of the built step's).

    Raises:
      TypeError, ValueError, chunkjax.PlanError: as :func:`offload` (a misspelt keyword: one
        line naming plan_offload).
    """
    _check_fit_kw(prepare_kw, "plan_offload", fit_args=False)
    model, d, leaves = _discover(model, loss_fn, batch, wrt=wrt, blocks=blocks, compute_dtype=compute_dtype,
                                 abstract_ok=True)
    smallest = _is_min(device_budget)
    problem = _prepare(model, d, leaves, tx, None if smallest else device_budget, host_budget, trainable, mesh,
                       zero_stage, dict(prepare_kw))
    if device_budget is None:
        return OffloadPlan(d, problem, None, None)
    budget = resolve_budget(device_budget) if not smallest else min_budget(problem, policy=policy)
    requested = "min" if smallest else budget  # as given: a keyword, else the bytes
    budget = auto_budget(problem, policy=policy) if budget == "auto" else budget
    return OffloadPlan(d, problem, plan(problem, budget, policy=policy), int(budget), requested)


def offload(model, tx, loss_fn, batch, *, device_budget: int | str = "auto", host_budget: Any = "auto",
            wrt=None, trainable=None, blocks=None, compute_dtype=None, mesh=None, zero_stage: int = 0,
            policy: str = "tide", keep_model: bool = False, **fit_kw) -> OffloadedStep:
    """A chunked, offloaded train step for an NNX model.

    Args:
      model: an ``nnx.Module``; its parameters initialise the step, chunk by chunk (a scanned
        block's stacked leaves are sliced one layer at a time: host memory holds the model and
        the chunks, never a third copy). Then, unless ``keep_model``, its ``wrt`` arrays are
        released (:meth:`OffloadedStep.release`): the model keeps shapes and dtypes, its forward
        raises :class:`chunkjax.released.ReleasedParamsError` (one line) until
        :meth:`OffloadedStep.sync` writes the step's parameters back. Its other state is not
        changed until :meth:`OffloadedStep.sync`.
      tx: an elementwise optax transformation (offloaded chunks update streamed through the
        device), or a host spec (``chunkjax.host_update.AdamW / Lion / SGDMomentum``: offloaded
        chunks update on the host, its ``optax()`` twin updates the device chunks).
      loss_fn: ``loss_fn(model, batch) -> () float``: the loss (a scalar; nnx's usual signature),
        nothing else: no ``(loss, aux)`` pair (:meth:`OffloadedStep.evaluate` gives the loss
        without an update; other outputs come from the model's forward after a sync), no
        :class:`chunkjax.WeightedLoss` (ValueError; :func:`chunkjax.fit_step` takes one). With
        ``micro_batches=M`` the objective is the mean of the P = M (x ranks on a mesh) parts'
        losses: a masked mean becomes a mean of means; the whole batch's token mean is
        ``sum(loss * mask) / batch["n_scored"][0] * P``, ``n_scored`` a batch leaf holding the
        whole batch's count in every row.
        Blocks wrapped in ``nnx.remat`` (or calling ``jax.checkpoint`` inside) are found the same
        way; their rematerialisation coincides with the step's per-stage recompute.
      batch: an example batch, the planned shape: tokens (B, T+1) or any pytree of arrays with
        the batch axis first (e.g. ``{"images": (B, H, W, C), "labels": (B,)}``).
      device_budget: bytes per device for model data and activations: an int, ``"64MiB"``,
        ``"auto"`` (:func:`chunkjax.fit.auto_budget`) or ``"min"`` (:func:`chunkjax.fit.min_budget`: the
        least the plan needs, every parameter chunk in pinned_host); ``host_budget``: bytes of
        host memory for model data, ``"auto"`` or None.
      wrt: nnx filter of the chunked leaves (default ``nnx.Param``); the rest of the model's
        state (RNG streams, counters, batch statistics) advances as in the plain loop.
      trainable: nnx filter of the trained leaves among ``wrt`` (default: all floating ones);
        the others are frozen: chunked and fetched, no optimizer state, never updated. A filter
        matching no floating parameter is refused (ValueError).
      blocks: attribute path of the block list or scanned block (``"decoder/layers"``) when the
        automatic choice is ambiguous (:func:`chunkjax.discover.discover`).
      compute_dtype: dtype of compute params and gradients (default: the params' dtype; e.g.
        ``jnp.bfloat16`` for mixed precision with float32 masters).
      mesh, zero_stage: a ``data`` mesh (:func:`chunkjax.data_mesh`) and ZeRO stage 1/2/3.
      policy: the planner's policy (default ``"tide"``).
      keep_model: keep the model's parameter arrays (a second copy of the parameters beside the
        step's chunks, in the memory they were built in, holding the initial parameters until
        :meth:`OffloadedStep.sync`: a loop that reads the model without a sync gets them, not
        the trained ones). False (default): release them, whatever the plan offloads (before
        session 26 they were kept when it offloaded nothing, and a forgotten sync read the
        initial parameters without a word); one offloads because memory is short, and the
        model held twice is what fills it (a 3B float32 model: 11.2 GiB of host memory).
      **fit_kw: the rest of :func:`chunkjax.fit_step` (chunk_size, min_chunks, prefetch,
        flops_per_step (default: 3 x the forward's matrix products counted in the traced loss),
        rates, check_compiled, strict, ...): ``nonfinite`` defaults to ``"ignore"`` (no check: a
        step with NaN/inf gradients is applied as it is); ``nonfinite="skip"`` leaves parameters and optimizer
        state of a step with non-finite gradients unchanged (``"error"``: also raises
        :class:`chunkjax.NonFiniteError` naming the step, the non-finite loss or norm), while the non-parameter state the
        loss changes (counters, RNG counts) advances; ``check_tx=False`` skips the probe that
        refuses a non-elementwise ``tx`` (only for one known elementwise); ``cross_step=False``
        makes each step join all of the previous step's host work (default: cross-step overlap,
        :mod:`chunkjax.cross_step`). This is the fit path's
        :func:`~chunkjax.fit.prepare` then :func:`~chunkjax.fit.fit_problem`.

    Returns:
      an initialised :class:`OffloadedStep` (``released_bytes``: the parameter bytes released).

    Raises:
      TypeError: ``tx`` is neither an optax transformation nor a host spec; a keyword in
        ``fit_kw`` that the fit path does not take.
      ValueError: an abstract model (parameters ``ShapeDtypeStruct`` s, e.g. from ``nnx.eval_shape``:
        :func:`plan_offload` plans those).
      chunkjax.released.ReleasedParamsError: the model's parameters were released by an earlier
        ``offload`` (sync it from that step first).
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
    smallest = _is_min(device_budget, none_ok=False)
    problem = _prepare(model, d, leaves, tx, None if smallest else device_budget, host_budget, trainable, mesh,
                       zero_stage, fit_kw)
    fitted = fit_problem(problem, min_budget(problem, policy=policy) if smallest else device_budget, policy=policy,
                         **fit_args)
    if smallest:  # the report's request is what was asked; its budget_bytes the bytes "min" resolved to
        fitted = fitted._replace(report=dataclasses.replace(fitted.report, requested="min"))
    state = fitted.step.init(_leaf_source(d, leaves, fitted.step.layout))
    del leaves
    out = OffloadedStep(d, fitted, state, d.example)
    if not keep_model:
        out.released_bytes = release_params(model, d.wrt)
    return out


def _slot_keys(layout) -> list:
    """The step's params keys in ``layout.slots`` order."""
    index = layout.treedef.unflatten(list(range(len(layout.slots))))  # params key -> slot index
    return [k for k, _ in sorted(index.items(), key=lambda kv: kv[1])]


def _leaf_source(d: Discovery, leaves, layout):
    """``leaf_at(i)`` for :meth:`chunkjax.ChunkedStep.init`: slot ``i``'s array from the model's
    ``wrt`` leaves; a scanned block's per-layer leaf is sliced from its stacked leaf when drawn (a
    layer at a time, not a copy of every stacked leaf at once)."""
    by_key = dict(zip(d.param_keys, leaves))
    layer_of = {kk: (k, i) for k, kks in d.per_layer.items() for i, kk in enumerate(kks)}
    keys = _slot_keys(layout)

    def leaf_at(i: int):
        k = keys[i]
        if k in layer_of:
            stacked, layer = layer_of[k]
            return by_key[stacked][layer]
        return by_key[k]
    return leaf_at


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


def _trainable_mask(model, d: Discovery, trainable, params: dict) -> dict:
    """Flat parameter key -> bool: the floating leaves of ``wrt`` that match ``trainable``."""
    from flax import nnx
    keys = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.All(d.wrt, trainable)))}
    for leaf in (kk for k in d.param_keys if k in keys for kk in d.per_layer.get(k, (k,))):
        if jnp.issubdtype(params[leaf].dtype, jnp.complexfloating):  # the filter trains it: refused, not frozen
            raise complex_param_error(leaf, np.dtype(params[leaf].dtype).name)
    return {kk: k in keys and jnp.issubdtype(params[kk].dtype, jnp.floating)
            for k in d.param_keys for kk in d.per_layer.get(k, (k,))}
