"""Planner CLI: the schedule chunkjax would run for a model, batch and budget, next to the static
partitions users know, all planned by the same engine on abstract shapes (runs on a CPU).

    python -m experiments.plan --model GPT3_10B --device-budget 24GiB --host-budget 120GiB \\
        --batch 8 --seq 1024 [--json] [--tide-from RESULTS_JSON [--measured-rates]] \\
        [--ranks N [--zero-stage 3]] [--plots DIR] [--compute-dtype DTYPE] [--micro-batches N] [--storage DIRS]
    python -m experiments.plan --model mypkg.mymodel:make --device-budget 2GiB --plots plots/

``--model`` is a name of models/gpt.py's table or your own model as ``module:factory``: the
factory returns an NNX model, its loss and a batch (what :func:`chunkjax.offload` takes), or
``(stages, params, batch)``, on abstract shapes (:func:`call_factory` says how it is called). ``--plots DIR`` writes the plan's figures (:func:`chunkjax.plots.save_figures`: the memory
tide against the budget, device bytes per moment by kind, the schedule of fetches, evictions and
update locations, the placement in bytes per memory kind).

The plan is the one fit path's, on abstract shapes: :func:`chunkjax.fit.prepare` (first-use
order, layout, stage traces; no devices, no compile of the step, this machine's host memory not
checked) then :func:`chunkjax.fit.plan` (``chunkjax.plan_schedule``, policy ``"tide"``) with the
host AdamW kernel (offloaded chunks update in place on the host, overlapping the backward pass;
``--max-grad-norm`` makes it clip by global norm, and ``--clip-expect`` (default ``auto``: ``fires``
with clipping, else ``rare``, the rule of :func:`chunkjax.offload`) says what the step is timed for).
``--compute-dtype`` (default ``auto``: what the API does with the same model, an NNX model's params
dtype as :func:`chunkjax.offload`, else bfloat16 as :func:`chunkjax.fit.prepare`), ``--micro-batches``
and ``--storage`` (the disk tier's directories, with ``--host-budget``) are :func:`chunkjax.fit.prepare`'s,
so the plan is the one ``chunkjax.offload`` / ``chunkjax.fit_step`` makes for the same inputs.
Baselines are the same planner's static policies (``must_fit=False``), scheduled over the same tide with the same accounting and cost
model (:mod:`chunkjax.predict`):

``all_host``
    every chunk's model data in pinned host memory; each chunk is fetched at *every* moment that
    reads it and released after it (the fixed fetch rule: no chunk is held between uses);
    gradients go down as they complete and the host updates in place, overlapping the backward.
``zero_offload``
    compute params on the device for the whole step (all uploaded at its start), gradients
    offloaded as they complete, master params and optimizer state on the host, updated there
    after the backward with no overlap (ZeRO-Offload, arXiv 2101.06840; its upload of the new
    params here overlaps the next forward).

An infeasible budget exits 2 and names the smallest budget that works and whether activations
alone are the cause (:class:`chunkjax.PlanError`).

Non-model bytes come from compiling each distinct stage for the backend this runs on. On the CPU
that is an *estimate* of the GPU's, and a high one: XLA CPU's attention materialises the
(B, heads, T, T) scores (GPT3_6B at batch 32x1024: block temporaries ~19 GB on the CPU against
5.06 GB on the H200). ``--tide-from RESULTS_JSON`` takes the per-stage temporaries recorded by a
GPU run of experiments/bench.py (``stage_temp_bytes`` of the chunkjax system) when model, batch
and sequence match, and the cost-model rates that run calibrated; otherwise the plan is labelled
"estimated on cpu". ``--measured-rates`` takes the rates that run ran at instead (the host kernel's
inside its step: :meth:`chunkjax.cost.Rates.from_record`, ``docs/dropin.md`` "Rates under contention").

ZeRO over N GPUs of one node (``--ranks N``, N > 1; ``--zero-stage`` 1, 2 or 3, default 3): the
plan of every rank of :class:`chunkjax.ChunkedStep` over a data mesh, as
experiments/bench_chunkjax.py plans it on N real devices, here on abstract shapes (no mesh, no
devices: it runs on a one-device CPU). ``--batch`` is the *global* batch (rows per step, split
evenly: each rank traces ``batch / N`` rows), ``--device-budget`` is each GPU's (bytes), and
``--host-budget`` is the node's host memory for model data (bytes; each rank gets 1/N of it).
The layout is :func:`chunkjax.topology.build_zero_layout` (chunks split evenly over the ranks) and
the schedule ``chunkjax.plan_schedule(..., ranks=N, zero_stage=...)``: per-rank chunk bytes
(:meth:`chunkjax.ChunkBytes.per_rank`), one rank's FLOPs (1/N of the step's). The
report gives per rank the peak device bytes, the host bytes of model data, the H2D / D2H bytes
per step and the predicted step (seconds), the collective bytes one rank sends per step
(accounted, ring algorithms), and per node the host bytes (N x a rank's) and tokens/s (global
batch x seq / predicted step). The predicted step does *not* include collectives: the cost model
(:func:`chunkjax.cost.predict_pipelined_step`) times compute, PCIe transfers (each rank its own
link), host and device updates, and nothing of the all-gathers / reduce-scatters (see
:data:`ZERO_TIME_NOTE`). No baselines are planned for N > 1 (they are single-device schedules).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Sequence

from experiments.flags import with_flags

BASELINES = ("all_host", "zero_offload")
ZERO_STAGES = (1, 2, 3)
#: what the predicted step of a ZeRO plan counts and leaves out (printed and in the JSON)
ZERO_TIME_NOTE = (
    "predicted step = one rank's step by chunkjax.cost.predict_pipelined_step: compute (1/N of the step's FLOPs "
    "at rates.matmul_flops_per_s, with recompute), the rank's PCIe fetches/offloads (each rank its own link; "
    "host memory bandwidth shared by the N links is not modeled; a ZeRO-3 fetch is timed at the full chunk plus "
    "the rank's shard, ChunkBytes.per_rank's figure, though only the shard crosses PCIe), the host AdamW of every "
    "offloaded chunk's full chunk_size (one process's host thread updates the slices of all N ranks, at "
    "rates.host_update_s_per_param) and device updates (timed for full chunks; a rank updates its 1/N). "
    "NOT included: collective time (all-gather of params, "
    "reduce-scatter / all-reduce of gradients over NVLink), neither its duration nor its overlap with compute; "
    "their bytes are given (collective_bytes_per_step_per_rank, accounted, not timed)")
#: where the rates come from unless a recorded run gives them
RATES_DEFAULT = "chunkjax.cost.Rates() defaults (H200)"
#: recorded stage names whose temporaries stand for a group of identical stages
_BLOCK_PREFIX, _BLOCK_REF = "h_", "h_0"


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """Everything a plan needs for one (model, batch, seq), traced once.

    Attributes:
      cfg: the model config (models/gpt.py), None for a user model (``module:factory``).
      batch, seq: batch shape, rows x tokens (tokens per step = batch * seq); with ``n_ranks`` > 1
        the global batch (each rank runs ``batch / n_ranks`` rows).
      problem: the one fit path's problem (:func:`chunkjax.fit.prepare` on abstract shapes: the
        layout in first-use order, with ``n_ranks`` > 1 a ZeRO layout over an abstract mesh; the
        per-stage traces of one rank's rows; the chunk bytes; one rank's FLOPs; the rates).
      tide: the memory tide over the traces (one rank's non-model bytes).
      tide_source: where the non-model bytes come from ("estimated on cpu", "recorded on gpu ...").
      rates_source: where the rates come from.
      name: the model's name (the config's, or the ``module:factory`` spec).
      n_params: parameters of the model (elements of every leaf).
    """

    cfg: object
    batch: int
    seq: int
    problem: object
    tide: object
    tide_source: str
    rates_source: str
    name: str
    n_params: int

    @property
    def layout(self):
        """The chunk layout (ids in first-use order)."""
        return self.problem.layout

    @property
    def traces(self) -> tuple:
        """Per-stage traces of one rank's rows (temporaries from the backend or a recorded GPU run)."""
        return self.problem.traces

    @property
    def cb(self):
        """Bytes of one whole chunk per chunk list (AdamW state)."""
        return self.problem.cb

    @property
    def flops_per_step(self) -> float:
        """Training FLOPs of one step of one rank."""
        return self.problem.flops_per_step

    @property
    def rates(self):
        """The cost model's rates."""
        return self.problem.rates

    @property
    def n_ranks(self) -> int:
        """Data-parallel ranks (GPUs) the step is split over (1: one device, no ZeRO)."""
        return self.problem.n_ranks

    @property
    def rank_batch(self) -> int:
        """Rows one rank runs per step."""
        return self.batch // self.n_ranks


def _recorded(path: str | pathlib.Path) -> tuple[dict, dict]:
    """(top-level record, chunkjax system record) of a results JSON."""
    rec = json.loads(pathlib.Path(path).read_text())
    systems = rec.get("systems") or {}
    sys_rec = systems.get("chunkjax") or next(
        (s for s in systems.values() if (s.get("extra") or {}).get("stage_temp_bytes")), {})
    return rec, sys_rec


def recorded_stage_temps(path, model: str, batch: int, seq: int, stage_names: Sequence[str]
                         ) -> tuple[dict[str, int] | None, str]:
    """Per-stage temporaries recorded by a GPU run, when its model, batch and seq match.

    Block stages (``h_<i>``) take the recorded ``h_0`` figure (identical blocks compile to one
    program). ``batch`` is rows per device; a recorded ZeRO run (``extra.zero_stage`` over
    ``extra.n_devices``) traced ``batch / n_devices`` rows per device, which is what it is compared
    with. Returns (``{stage name: bytes}`` or None, a one-line reason when None).
    """
    from models import gpt

    rec, s = _recorded(path)
    temps = (s.get("extra") or {}).get("stage_temp_bytes")
    if not temps:
        return None, f"{path} records no stage_temp_bytes (a chunkjax run of experiments/bench.py does)"
    r_model = s.get("model", rec.get("model"))
    r_batch, r_seq = s.get("batch", rec.get("batch")), s.get("seq", rec.get("seq"))
    extra = s.get("extra") or {}
    r_dev = int(extra.get("n_devices") or 1) if extra.get("zero_stage") else 1
    if r_dev > 1 and isinstance(r_batch, int):
        r_batch //= r_dev  # a ZeRO run traced each device's rows
    try:
        same_model = gpt.get_config(str(r_model)).name == gpt.get_config(model).name
    except ValueError:
        same_model = False
    if not (same_model and r_batch == batch and r_seq == seq):
        return None, (f"{path} was recorded for {r_model} at batch {r_batch}x{r_seq}, "
                      f"not {model} at {batch}x{seq}")
    out = {}
    for n in stage_names:
        key = _BLOCK_REF if n.startswith(_BLOCK_PREFIX) and n not in temps else n
        if key not in temps:
            return None, f"{path} records no temporaries for stage {n!r}"
        out[n] = int(temps[key])
    return out, ""


def recorded_rates(path, measured: bool = False):
    """The cost-model rates a recorded GPU run calibrated (None if it has none); with ``measured``
    the rates it ran at (:meth:`chunkjax.cost.Rates.from_record`: the host kernel's rate inside its
    step, its host thread's update seconds per host-updated param, in place of the calibration)."""
    from chunkjax.cost import Rates

    _, s = _recorded(path)
    r = (s.get("extra") or {}).get("rates")
    if not r:
        return None
    if measured:
        return Rates.from_record({"systems": {"chunkjax": s}}, "chunkjax")
    fields = {f.name for f in dataclasses.fields(Rates)}
    return Rates(**{k: float(v) for k, v in r.items() if k in fields})


def trace_inputs(model: str, batch: int, seq: int, *, chunk_size: int | None = None,
                 min_chunks: int = 8, n_ranks: int = 1, host_budget: int | None = None, **step_kw) -> PlanInputs:
    """Trace a model's stages for a batch shape on this backend (abstract shapes only) and build
    its tide, with the default rates.

    Args:
      model: a name of models/gpt.py's table (case-insensitive).
      batch, seq: batch shape (rows, tokens per row); with ``n_ranks`` > 1 the global batch.
      chunk_size: elements per chunk (None: chunkjax's search, as experiments/bench.py uses).
      min_chunks: passed to the chunk-size search.
      n_ranks: ZeRO ranks (> 1: the layout of :func:`chunkjax.topology.build_zero_layout`, each rank's
        ``batch / n_ranks`` rows traced and 1/n_ranks of the FLOPs, as
        experiments/bench_chunkjax.py plans a ZeRO run; no devices are needed).
      **step_kw: ``compute_dtype`` (None: :func:`chunkjax.fit.prepare`'s bfloat16), ``micro_batches``
        and ``storage`` (storage directories), as :func:`chunkjax.fit.prepare` takes them (:func:`step_options`).
      host_budget: bytes, given to :func:`chunkjax.fit.prepare` (the disk tier needs one; the plan's
        own comes with each plan, :func:`plan_problem`).

    Raises:
      ValueError: unknown model, ``seq`` beyond the model's positions, ``n_ranks < 1`` or a batch
        that does not split over the ranks.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from chunkjax.fit import prepare as fit_prepare
    from chunkjax.host_update import AdamW
    from chunkjax.tide import memory_tide
    from chunkjax.topology import AXIS
    from models import gpt

    cfg = gpt.get_config(model)
    if seq > cfg.seq_len:
        raise ValueError(f"--seq {seq} exceeds the model's {cfg.seq_len} positions")
    check_shape(batch, seq)
    check_ranks(batch, n_ranks)
    # the one fit path on abstract shapes: ranks without devices, the target machine's host memory
    # is not this one's (the host budget is given per plan)
    zero = dict(mesh=AbstractMesh((n_ranks,), (AXIS,)), zero_stage=3) if n_ranks > 1 else {}
    problem = fit_prepare(gpt.gpt_stages(cfg), gpt.abstract_params(cfg), jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32),
                          host_optimizer=AdamW(1e-4, weight_decay=1e-4),  # what experiments/bench.py's chunkjax system runs
                          chunk_size=chunk_size, min_chunks=min_chunks, **step_options(**step_kw),
                          flops_per_step=float(cfg.flops_per_token(seq) * batch * seq), host_budget=host_budget,
                          check_host=False, **zero)
    return PlanInputs(cfg, batch, seq, problem, memory_tide(problem.traces, problem.layout.chunk_size),
                      _traced_on(), RATES_DEFAULT, cfg.name, cfg.n_params)


def _traced_on() -> str:
    import jax
    backend = jax.default_backend()
    return f"estimated on {backend}" if backend != "gpu" else "traced on gpu"


def is_factory_spec(model: str) -> bool:
    """``model`` names a user model (``module:factory``) rather than a models/gpt.py config."""
    return ":" in model


def load_factory(spec: str):
    """The callable named by ``spec`` = ``"package.module:factory"`` (the module imported from
    ``sys.path``, which includes the current directory when run as ``python -m``).

    Raises:
      ValueError: ``spec`` is not ``module:name``, the module cannot be imported, it has no
        such callable, or the callable is a class (one line each).
    """
    import importlib

    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"--model {spec!r}: give a user model as module:factory, e.g. mymodels.llama:make")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"--model {spec!r}: cannot import {mod_name!r} ({e}); run from the folder that holds it "
                         "or add it to PYTHONPATH") from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {mod_name} has no callable {attr!r}")
    if isinstance(fn, type):  # the model's class: called with batch=, it died in its own __init__
        raise ValueError(f"--model {spec!r}: {attr} is a class; give a function that builds the model and returns "
                         "(model, loss_fn, batch), e.g. def make(batch, seq) (docs/own_model.md)")
    return fn


def call_factory(spec: str, batch: int, seq: int) -> dict:
    """Call the factory of ``spec`` and return its model as a dict.

    The factory takes ``batch`` (rows) and ``seq`` (tokens per row) as keyword arguments when its
    signature names them (or takes ``**kwargs``), and returns one of

    * ``(model, loss_fn, batch)``: an ``nnx.Module`` (concrete, or abstract from
      ``nnx.eval_shape``), its ``loss_fn(model, batch) -> () float`` and an example batch (arrays
      or ``ShapeDtypeStruct`` s, any pytree with the rows first): what :func:`chunkjax.offload`
      takes; the stages are found as it finds them (:func:`chunkjax.plan_offload`);
    * ``(stages, params, batch)``: the model's :class:`chunkjax.Stage` sequence, its params
      pytree (arrays, ``jax.ShapeDtypeStruct`` s, or a callable returning them, evaluated with
      ``jax.eval_shape``) and the step's batch (an int32 (rows, tokens + 1) array or
      ``ShapeDtypeStruct``);
    * a dict with the keys of either, and optionally ``flops_per_step`` (one step's training
      FLOPs; default 6 x params x tokens), ``name`` and, with a model, ``blocks`` (the block
      list's attribute path, :func:`chunkjax.discover.discover`).

    Raises:
      ValueError: the factory cannot be called with ``batch`` / ``seq`` (other parameters without
        defaults), or returns something else (one line saying what it must return).
    """
    import inspect

    fn = load_factory(spec)
    sig = inspect.signature(fn).parameters
    takes_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.values())
    kw = {k: v for k, v in (("batch", batch), ("seq", seq)) if takes_kw or k in sig}
    try:
        inspect.signature(fn).bind(**kw)
    except TypeError as e:
        raise ValueError(f"--model {spec!r}: the factory cannot be called with {kw or 'no arguments'} ({e}): "
                         "give it the parameters batch and seq (or defaults for the others)") from None
    out = fn(**kw)
    if isinstance(out, (tuple, list)) and len(out) == 3:
        out = dict(zip(("model", "loss_fn", "batch") if _is_nnx(out[0]) else ("stages", "params", "batch"), out))
    if not isinstance(out, dict) or not ({"stages", "params", "batch"} <= set(out)
                                         or {"model", "loss_fn", "batch"} <= set(out)):
        raise ValueError(f"--model {spec!r}: the factory must return (stages, params, batch), (nnx model, loss_fn, "
                         f"batch) or a dict with those keys, got {type(out).__name__}")
    return out


def _is_nnx(x) -> bool:
    try:
        from flax import nnx
    except ImportError:
        return False
    return isinstance(x, nnx.Module)


def trace_user_model(spec: str, batch: int, seq: int, *, chunk_size: int | None = None, min_chunks: int = 8,
                     n_ranks: int = 1, host_budget: int | None = None, **step_kw) -> PlanInputs:
    """:func:`trace_inputs` for a user model given as ``module:factory`` (:func:`call_factory`):
    the one fit path on abstract shapes with the host AdamW kernel. The batch shape is the one
    the factory returns (``batch`` and ``seq`` are what it was asked for). ``step_kw``: as
    :func:`trace_inputs`; compute_dtype None is what the API called with the same model does: an
    NNX model's params dtype (:func:`chunkjax.offload`), stages' bfloat16 (:func:`chunkjax.fit.prepare`).

    Raises:
      ValueError: as :func:`call_factory`, :func:`check_ranks` and :func:`chunkjax.fit.prepare`.
    """
    import math

    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh

    from chunkjax.fit import prepare as fit_prepare
    from chunkjax.front import plan_offload
    from chunkjax.host_update import AdamW
    from chunkjax.tide import memory_tide
    from chunkjax.topology import AXIS

    check_shape(batch, seq)
    m = call_factory(spec, batch, seq)
    opts = step_options(**step_kw)
    spec_kw = dict(host_optimizer=AdamW(1e-4, weight_decay=1e-4))
    zero = dict(mesh=AbstractMesh((n_ranks,), (AXIS,)), zero_stage=3) if n_ranks > 1 else {}
    common = dict(chunk_size=chunk_size, min_chunks=min_chunks, host_budget=host_budget, check_host=False, **zero,
                  **{k: v for k, v in opts.items() if k != "compute_dtype"})
    if m.get("flops_per_step") is not None:
        common["flops_per_step"] = m["flops_per_step"]
    if "model" in m:  # the front door's discovery and fit problem (chunkjax.plan_offload)
        rows = int(jax.tree.leaves(m["batch"])[0].shape[0])
        check_ranks(rows, n_ranks)
        planned = plan_offload(m["model"], spec_kw["host_optimizer"], m["loss_fn"], m["batch"], blocks=m.get("blocks"),
                               compute_dtype=opts.get("compute_dtype"), **common)
        problem, b = planned.problem, planned.discovery.example
        n_params = sum(math.prod(x.shape) for x in planned.discovery.param_avals.values())
    else:
        abstract = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)  # noqa: E731
        b = abstract(m["batch"])
        rows = int(jax.tree.leaves(b)[0].shape[0])
        check_ranks(rows, n_ranks)
        params = jax.eval_shape(m["params"]) if callable(m["params"]) else m["params"]
        problem = fit_prepare(tuple(m["stages"]), abstract(params), b, **spec_kw, **common,
                              **({"compute_dtype": opts["compute_dtype"]} if "compute_dtype" in opts else {}))
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    first = jax.tree.leaves(b)[0]
    tokens = int(first.shape[1]) - 1 if first.ndim == 2 else seq  # a (rows, tokens + 1) batch, else as asked
    return PlanInputs(None, rows, tokens, problem, memory_tide(problem.traces, problem.layout.chunk_size),
                      _traced_on(), RATES_DEFAULT, str(m.get("name", spec)), int(n_params))


def model_bytes_per_param(inp) -> int:
    """Model data bytes per parameter of the planned step (AdamW, the planner's optimizer): the
    compute params in the compute dtype (2 B for bf16, 4 B for float32), float32 master weights
    (4 B) and the two float32 moments (8 B): 14 B with bf16 compute, 16 B with float32."""
    import jax.numpy as jnp
    return jnp.dtype(inp.problem.compute_dtype).itemsize + 12


def with_clipping(inp: PlanInputs, clip_expect: str = "auto", max_grad_norm: float | None = None) -> PlanInputs:
    """``inp`` planned for the run's clipping: its host AdamW (and the device chunks' optax twin)
    clipping by global norm at ``max_grad_norm`` (None: not clipping), and the clipping the plan
    expects resolved by the fit path's rule (:func:`chunkjax.clip_plan.resolve`: ``"auto"`` is
    ``"fires"`` with clipping, else ``"rare"``, as :func:`chunkjax.offload` resolves it for a host spec).

    Raises:
      ValueError: ``max_grad_norm`` not positive, an unknown ``clip_expect`` (one line).
    """
    from chunkjax.clip_plan import resolve
    spec = inp.problem.host_optimizer
    if max_grad_norm is not None:
        if not max_grad_norm > 0:
            raise ValueError(f"--max-grad-norm {max_grad_norm}: give a global norm > 0, or leave it out for no clipping")
        spec = dataclasses.replace(spec, max_grad_norm=float(max_grad_norm))
    elif clip_expect == "fires" and getattr(spec, "max_grad_norm", None) is None:
        raise ValueError("--clip-expect fires needs clipping: add --max-grad-norm NORM (the clipping threshold), "
                         "or use --clip-expect auto")
    return dataclasses.replace(inp, problem=dataclasses.replace(inp.problem, host_optimizer=spec, tx=spec.optax(),
                                                                clip_expect=resolve(clip_expect, spec)))


def plots_dir(path: str) -> None:
    """Create ``--plots``' directory ``path`` (and its parents) before planning.

    Raises:
      ValueError: ``path`` is a file or cannot be created (one line saying what to do).
    """
    p = pathlib.Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"--plots {path} is a file, not a directory: give a directory this process can write")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--plots {path}: the directory cannot be created ({e.strerror or type(e).__name__}): "
                         "give a directory this process can write") from None


def step_options(compute_dtype=None, micro_batches: int = 1, storage=None) -> dict:
    """The :func:`chunkjax.fit.prepare` keywords of the step's options, only those given:
    ``compute_dtype`` (a dtype or a spelling of :data:`chunkjax.dtypes.SPELLINGS`, as the API
    takes; None / ``"auto"``: not passed, what the API does with the same model),
    ``micro_batches`` (gradient accumulation, >= 1) and ``storage`` (storage directories: a list
    or a comma-separated string; the disk tier, planned with a host budget).

    Raises:
      ValueError: an unknown dtype spelling or ``micro_batches < 1`` (one line).
    """
    from chunkjax.dtypes import SPELLINGS, compute_dtype_of  # the API's parser: the same spellings
    out = {}
    if isinstance(compute_dtype, str) and compute_dtype.lower() == "auto":
        compute_dtype = None
    if compute_dtype is not None:
        try:
            out["compute_dtype"] = compute_dtype_of(compute_dtype)
        except ValueError as e:
            raise ValueError(f"--compute-dtype {compute_dtype!r}: use one of auto, {', '.join(SPELLINGS)}") from e
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"--micro-batches must be >= 1, got {micro_batches}: use 1 for no gradient accumulation")
    if micro_batches != 1:
        out["micro_batches"] = micro_batches
    if storage:
        out["storage"] = [d for d in storage.split(",") if d] if isinstance(storage, str) else list(storage)
    return out


def check_shape(batch: int, seq: int) -> None:
    """Raise ValueError (one line) unless ``batch`` (rows) and ``seq`` (tokens per row) are >= 1:
    checked for every model kind (named or ``module:factory``) before anything is built."""
    if batch < 1 or seq < 1:
        raise ValueError(f"--batch and --seq must be >= 1, got --batch {batch} --seq {seq}: give positive "
                         "rows per step and tokens per row, e.g. --batch 8 --seq 1024")


def check_ranks(batch: int, n_ranks: int, zero_stage: int = 3) -> None:
    """Raise ValueError (one line naming what to use) unless ``n_ranks >= 1``, ``zero_stage`` is
    1, 2 or 3 and the global ``batch`` (rows) splits evenly over the ranks."""
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ValueError(f"--ranks must be >= 1 (GPUs the step is split over), got {n_ranks}: "
                         "use --ranks 1 for one GPU")
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"--zero-stage must be 1, 2 or 3, got {zero_stage}: use 3 (params, gradients and "
                         "optimizer state sharded), 2 or 1")
    if batch % n_ranks:
        up = -(-batch // n_ranks) * n_ranks
        raise ValueError(f"--batch {batch} (the global batch) does not split over {n_ranks} ranks: use a "
                         f"multiple of {n_ranks}, e.g. --batch {up}")


def with_recorded(inp: PlanInputs, path, warn=None, measured_rates: bool = False) -> PlanInputs:
    """``inp`` with the stage temporaries a GPU run recorded in the results JSON ``path`` (when its
    model, batch and seq match; otherwise ``warn`` is called with the reason and the traced tide
    stays) and the rates that run calibrated (when recorded: they describe the machine; with
    ``measured_rates`` the rates it ran at: :func:`recorded_rates`)."""
    from chunkjax.tide import memory_tide

    if inp.cfg is None:
        raise ValueError(f"--tide-from takes a recorded run of a models/gpt.py config; {inp.name} is a user model")
    temps, why = recorded_stage_temps(path, inp.cfg.name, inp.rank_batch, inp.seq, [t.name for t in inp.traces])
    if temps is None:
        if warn:
            warn(f"--tide-from: {why}; the tide is {inp.tide_source}")
    else:
        traces = tuple(dataclasses.replace(t, temp_bytes=temps[t.name]) for t in inp.traces)
        inp = dataclasses.replace(inp, problem=dataclasses.replace(inp.problem, traces=traces),
                                  tide=memory_tide(traces, inp.layout.chunk_size),
                                  tide_source=f"recorded on gpu ({path}: stage temporaries)")
    rates = recorded_rates(path, measured_rates)
    if rates is not None:
        inp = dataclasses.replace(inp, problem=dataclasses.replace(inp.problem, rates=rates),
                                  rates_source=f"{'measured' if measured_rates else 'recorded'} in {path} (host "
                                               f"kernel {rates.host_update_s_per_param * 1e9:.3f} ns/param)")
    return inp


def prepare(model: str, batch: int, seq: int, *, chunk_size: int | None = None, min_chunks: int = 8,
            tide_from: str | None = None, warn=None, n_ranks: int = 1,
            measured_rates: bool = False, **step_kw) -> PlanInputs:
    """:func:`trace_inputs`, then :func:`with_recorded` when ``tide_from`` (a results JSON of a GPU
    run of experiments/bench.py) is given (``measured_rates``: see there). ``step_kw``:
    ``compute_dtype``, ``micro_batches``, ``storage`` (:func:`step_options`) and ``host_budget``."""
    kw = ({"n_ranks": n_ranks} if n_ranks != 1 else {}) | {k: v for k, v in step_kw.items() if v is not None}
    trace = trace_user_model if is_factory_spec(model) else trace_inputs
    inp = trace(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks, **kw)
    return with_recorded(inp, tide_from, warn, measured_rates) if tide_from else inp


# ---- the schedules -----------------------------------------------------------------------------

def plan_problem(inp: PlanInputs, host_budget: int | None = None, prefetch: int = 1, zero_stage: int = 3):
    """The fit problem the chunkjax schedule is planned from: ``inp.problem`` with the fetch
    distance, the host budget (bytes, the node's) and, with ``inp.n_ranks`` > 1, the ZeRO stage
    and one rank's chunk bytes (what :mod:`chunkjax.plots` draws a plan with)."""
    stage = zero_stage if inp.n_ranks > 1 else 0
    return dataclasses.replace(inp.problem, prefetch=prefetch, host_budget_bytes=host_budget, zero_stage=stage,
                               cb_rank=inp.cb.per_rank(inp.n_ranks, stage) if stage else inp.cb)


def plan_schedules(inp: PlanInputs, device_budget: int, host_budget: int | None = None, prefetch: int = 1,
                   zero_stage: int = 3, split: bool = True):
    """(chunkjax schedule, {baseline name: schedule}) for one budget (bytes), all from
    :func:`chunkjax.plan_schedule`: the tide plan (host AdamW kernel) and the static baselines
    (``must_fit=False``: they are reported even when they do not fit).

    With ``inp.n_ranks`` > 1 the schedule is every rank's ZeRO ``zero_stage`` plan (``device_budget``
    per GPU, ``host_budget`` the node's) and there are no baselines (``{}``).

    Raises:
      chunkjax.PlanError: no chunkjax schedule fits the budgets.
    """
    from chunkjax.fit import plan

    problem = plan_problem(inp, host_budget, prefetch, zero_stage)
    sched = plan(problem, device_budget, split=split)  # the tide plan, host AdamW kernel (split: the update split)
    if inp.n_ranks > 1:
        return sched, {}
    base = dataclasses.replace(problem, host_budget_bytes=None, storage=None, storage_devices=0,
                               disk_budget_bytes=None)  # reported against the host budget, not planned in it
    return sched, {k: plan(base, device_budget, policy=k, must_fit=False) for k in BASELINES}


def figures(s, device_budget: int, host_budget: int | None, chunk_size: int) -> dict:
    """The report figures of one schedule (bytes, seconds)."""
    p = s.predicted
    t = p.time.to_dict()
    return {"feasible": p.peak_device_bytes <= device_budget
            and (host_budget is None or p.host_bytes <= host_budget),
            "predicted_peak_device_bytes": p.peak_device_bytes, "device_budget_bytes": device_budget,
            "device_model_bytes": p.device_model_bytes, "host_bytes": p.host_bytes,
            "host_model_bytes": p.host_model_bytes, "host_bytes_per_param": p.host_bytes_per_param, "host_resident_bytes_per_param": p.host_resident_bytes_per_param,
            "host_working_bytes": p.host_working_bytes, "master_fetch_chunks": len(s.master_fetch),
            "h2d_bytes_per_step": p.h2d_bytes_per_step, "d2h_bytes_per_step": p.d2h_bytes_per_step,
            "n_fetches": p.n_fetches, "predicted_step_s": p.time.step_s, "time": t,
            "n_chunks": s.n_chunks, "chunk_size": chunk_size, "placement_counts": s.counts(),
            "segments": list(s.segments)}


def if_clipped(problem, sched) -> dict | None:
    """The report's ``if_clipped``: the step of a ``"rare"`` plan (``problem.clip_expect``, one device)
    if its host kernel clipped by global norm. The planner CLI plans with an AdamW unclipped unless
    ``--max-grad-norm``, timed with every host chunk updating as its gradient completes (the
    table's step); a clipped step speculates
    (:mod:`chunkjax.speculate`) only within its bound: here the step's default backup pool,
    :data:`chunkjax.speculate.DEFAULT_BACKUP_BYTES` (no step is built: the run's machine is not this
    one; a run gets at most that, less on a host with under twice it available or where the fit
    path's host check leaves less), in whole chunks by the rollback's rule
    (:func:`chunkjax.clip_plan.params_within`), and the plan retimed with it
    (:func:`chunkjax.clip_plan.predicted_time`, as the fit path's report and the bench). Keys:
    ``predicted_step_s`` (seconds), ``retimed`` (False with micro-batches or storage chunks: the
    planner's figure, as if every host chunk speculates for free), ``host_chunks`` and
    ``speculation_bound`` (:func:`chunkjax.clip_plan.bound_record`). None: a ``"fires"`` plan (it
    waits for the norm), ZeRO, or no host kernel."""
    from chunkjax.clip_plan import bound_record, norm_wait, params_within, predicted_time, retime_keywords
    from chunkjax.speculate import DEFAULT_BACKUP_BYTES
    if norm_wait(problem.clip_expect) or problem.n_ranks > 1 or problem.host_optimizer is None:
        return None
    cs = problem.layout.chunk_size
    n, bpp = params_within(DEFAULT_BACKUP_BYTES, problem.host_optimizer, problem.rollback, problem.cb_rank, cs)
    bound = {"speculation_params": n, "backup_bytes_per_param": bpp}
    return {"predicted_step_s": predicted_time(problem, sched, bound).step_s,
            "retimed": retime_keywords(problem, sched) is not None,
            "host_chunks": sum(u == "host" for u in sched.update_locations),
            "speculation_bound": bound_record(bound, cs, DEFAULT_BACKUP_BYTES, problem.rollback)}


def plan_report(model: str, device_budget: int, host_budget: int | None, batch: int, seq: int,
                prefetch: int = 1, chunk_size: int | None = None, min_chunks: int = 8,
                tide_from: str | None = None, inputs: PlanInputs | None = None, warn=None,
                n_ranks: int = 1, zero_stage: int = 3, split: bool = True, **step_kw) -> dict:
    """Plan a step and its baselines; returns the JSON report (bytes, seconds). ``step_kw``:
    ``compute_dtype``, ``micro_batches``, ``storage`` (:func:`step_options`; with ``inputs``, theirs).

    ``inputs`` (from :func:`prepare`) skips the tracing (budget sweeps).

    With ``n_ranks`` > 1 (ZeRO ``zero_stage`` over that many GPUs of one node): ``batch`` is the
    global batch (rows), ``device_budget`` each GPU's and ``host_budget`` the node's (bytes). The
    top-level figures are then one rank's (as in ``per_rank``), ``baselines`` is empty, and the
    report adds ``n_ranks``, ``zero_stage``, ``batch_per_rank``, ``per_rank`` (bytes, bytes per
    step, seconds), ``node`` (bytes, bytes per step, tokens/s), ``collective_bytes_per_step_per_rank``
    (bytes, accounted, not timed) and ``predicted_time_note`` (:data:`ZERO_TIME_NOTE`). With
    ``n_ranks`` == 1 the report is the single-device one (no ZeRO keys).

    Raises:
      ValueError: unknown model, bad ranks / stage / batch split; chunkjax.PlanError: the budget
        cannot hold the step.
    """
    import jax.numpy as jnp

    from chunkjax.plan_disk import storage_line
    check_ranks(batch, n_ranks, zero_stage)
    inp = inputs or prepare(model, batch, seq, chunk_size=chunk_size, min_chunks=min_chunks,
                            tide_from=tide_from, warn=warn, n_ranks=n_ranks, **step_kw)
    if inp.n_ranks != n_ranks:
        raise ValueError(f"inputs were traced for {inp.n_ranks} ranks, not {n_ranks}")
    sched, base = plan_schedules(inp, device_budget, host_budget, prefetch, zero_stage, split)
    cs = inp.layout.chunk_size
    # with ZeRO the figures are one rank's: its share of the node's host budget
    out = figures(sched, device_budget, host_budget if n_ranks == 1 or host_budget is None else host_budget // n_ranks,
                  cs)
    out["baselines"] = {k: figures(b, device_budget, host_budget, cs)
                        for k, b in base.items()}
    out.update({"model": inp.name, "n_params": inp.n_params, "batch": inp.batch, "seq": inp.seq,
                "host_budget_bytes": host_budget, "model_bytes": model_bytes_per_param(inp) * inp.n_params,
                "model_bytes_per_param": model_bytes_per_param(inp),
                "model_chunk_bytes": inp.problem.model_chunk_bytes,  # model_bytes with the chunks' padding
                "peak_non_model_bytes": inp.tide.peak_non_model_bytes, "n_moments": len(inp.tide.moments),
                "first_backward_moment": len(inp.traces), "tide_source": inp.tide_source,
                "rates_source": inp.rates_source, "rates": dataclasses.asdict(inp.rates),
                "stage_temp_bytes": {t.name: t.temp_bytes for t in inp.traces
                                     if inp.cfg is None or t.name in ("embed", _BLOCK_REF, "head")},
                "compute_dtype": jnp.dtype(inp.problem.compute_dtype).name,
                "micro_batches": inp.problem.micro_batches, "storage_dirs": inp.problem.storage_dirs,
                "storage": storage_line(sched, inp.problem.storage_dirs, host_budget),
                "schedule": sched.to_dict(),
                "if_clipped": if_clipped(plan_problem(inp, host_budget, prefetch, zero_stage), sched)})
    if n_ranks > 1:
        out.update(zero_figures(out, inp, sched, zero_stage))
    return out


def zero_figures(r: dict, inp: PlanInputs, sched, zero_stage: int) -> dict:
    """The ZeRO keys of a :func:`plan_report` ``r`` (whose figures are one rank's).

    Returns ``n_ranks``, ``zero_stage``, ``batch_per_rank`` (rows), ``per_rank`` (``peak_device_bytes``,
    ``device_model_bytes``, ``host_bytes`` (model data in host memory), ``h2d_bytes_per_step``,
    ``d2h_bytes_per_step``, ``n_fetches``, ``predicted_step_s`` (seconds, collectives excluded),
    ``tokens_per_s`` (the rank's rows x seq / step)), ``node`` (``n_ranks`` x the per-rank bytes:
    ``host_bytes``, ``h2d_bytes_per_step``, ``d2h_bytes_per_step``, ``device_budget_bytes``; and
    ``tokens_per_s`` = global batch x seq / predicted step), ``collective_bytes_per_step_per_rank``
    (:func:`chunkjax.predict_zero.collective_bytes`, bf16 chunks) and ``predicted_time_note``.
    """
    from chunkjax.predict_zero import collective_bytes

    n, step = inp.n_ranks, r["predicted_step_s"]
    per = {"peak_device_bytes": r["predicted_peak_device_bytes"], "device_budget_bytes": r["device_budget_bytes"],
           "device_model_bytes": r["device_model_bytes"], "host_bytes": r["host_bytes"],
           "host_budget_bytes": None if r["host_budget_bytes"] is None else r["host_budget_bytes"] // n,
           "h2d_bytes_per_step": r["h2d_bytes_per_step"], "d2h_bytes_per_step": r["d2h_bytes_per_step"],
           "n_fetches": r["n_fetches"], "predicted_step_s": step,
           "tokens_per_s": inp.rank_batch * inp.seq / step if step else None}
    node = {"n_ranks": n, "host_bytes": n * r["host_bytes"], "host_budget_bytes": r["host_budget_bytes"],
            "h2d_bytes_per_step": n * r["h2d_bytes_per_step"], "d2h_bytes_per_step": n * r["d2h_bytes_per_step"],
            "device_budget_bytes": n * r["device_budget_bytes"],
            "tokens_per_step": inp.batch * inp.seq,
            "tokens_per_s": inp.batch * inp.seq / step if step else None}
    return {"n_ranks": n, "zero_stage": zero_stage, "batch_per_rank": inp.rank_batch, "per_rank": per, "node": node,
            "collective_bytes_per_step_per_rank": collective_bytes(sched, inp.traces, inp.tide, inp.layout.chunk_size,
                                                                   n, zero_stage),
            "predicted_time_note": ZERO_TIME_NOTE}


def _time_unit(step_s: float) -> tuple[str, float]:
    return ("s", 1.0) if step_s >= 0.1 else ("ms", 1e3) if step_s >= 1e-4 else ("us", 1e6)


def _where(t: dict, k: float) -> str:
    other = ("streamed update", t["streamed_update_s"])
    return (f"forward {t['forward_s'] * k:.3f} + backward {t['backward_s'] * k:.3f} + exposed host update "
            f"{t['host_update_exposed_s'] * k:.3f} (of {t['host_update_s'] * k:.3f}) + device update "
            f"{t['device_update_s'] * k:.3f}" + (f" + {other[0]} {other[1] * k:.3f}" if other[1] else ""))


def _model_data(r: dict, B: float, bu: str) -> str:
    """The header's model data: the parameters' own (``model_bytes``) and, labelled, the chunks'
    with their padding (``model_chunk_bytes``, the figure chunkjax.offload's summary gives)."""
    return (f"model data {r['model_bytes'] / B:.2f} {bu} ({r['model_bytes_per_param']} B/param; "
            f"{r['model_chunk_bytes'] / B:.2f} {bu} in chunks, with padding)")


def _resolved(r: dict) -> str:
    """The keyword the report's device budget was resolved from (``device_budget_requested``), if any."""
    asked = r.get("device_budget_requested")
    return f" (resolved from {asked!r})" if isinstance(asked, str) else ""


def _summary_zero(r: dict) -> str:
    """The readable form of a ZeRO :func:`plan_report` (``n_ranks`` > 1)."""
    big = r["device_budget_bytes"] >= 2**30
    bu, B, du, D = ("GiB", 2**30, "GB", 1e9) if big else ("MiB", 2**20, "MB", 1e6)
    tu, k = _time_unit(r["predicted_step_s"])
    n, pr, nd, cm = r["n_ranks"], r["per_rank"], r["node"], r["collective_bytes_per_step_per_rank"]
    hb = ("unbounded" if r["host_budget_bytes"] is None else
          f"{r['host_budget_bytes'] / B:.2f} {bu} per node ({pr['host_budget_bytes'] / B:.2f} {bu} per rank)")
    counts = "; ".join(f"{v} with params on {c.split('/')[0][len('params_'):]}, update on "
                       f"{c.split('/')[1][len('update_'):]}" for c, v in r["placement_counts"].items())
    fb = r["first_backward_moment"]
    return "\n".join([
        f"{r['model']}: N={param_count(r['n_params'])}, {_model_data(r, B, bu)}, "
        f"{r['n_chunks']} chunks x {r['chunk_size']} elements, each split over {n} ranks",
        f"ZeRO-{r['zero_stage']} over {n} ranks (planned on abstract shapes, no devices used); global batch "
        f"{r['batch']}x{r['seq']} = {r['batch_per_rank']}x{r['seq']} per rank",
        f"device budget {r['device_budget_bytes'] / B:.2f} {bu} per GPU{_resolved(r)}, host budget {hb}",
        f"tide (per rank): peak non-model {r['peak_non_model_bytes'] / B:.2f} {bu} over {r['n_moments']} moments, "
        f"{r['tide_source']}; rates {r['rates_source']}",
        "",
        f"per rank: feasible {r['feasible']}, peak device {pr['peak_device_bytes'] / B:.2f} {bu}, device model "
        f"{pr['device_model_bytes'] / B:.2f} {bu}, host {pr['host_bytes'] / B:.2f} {bu}, h2d "
        f"{pr['h2d_bytes_per_step'] / D:.2f} {du}, d2h {pr['d2h_bytes_per_step'] / D:.2f} {du} per step, "
        f"{pr['n_fetches']} fetches, predicted step {pr['predicted_step_s'] * k:.3f} {tu} (no collectives)",
        f"node ({n} ranks): host {nd['host_bytes'] / B:.2f} {bu}, h2d {nd['h2d_bytes_per_step'] / D:.2f} {du}, "
        f"d2h {nd['d2h_bytes_per_step'] / D:.2f} {du} per step, {nd['tokens_per_s']:,.0f} tokens/s predicted "
        f"(global batch x seq / step; no collectives)",
        f"collectives per rank per step (accounted, NOT timed): all-gather {cm['all_gather'] / D:.2f} {du}, "
        f"reduce-scatter {cm['reduce_scatter'] / D:.2f} {du}, all-reduce {cm['all_reduce'] / D:.2f} {du}",
        "",
        f"where the time goes, one rank ({tu}): {_where(r['time'], k)}",
        f"note: {r['predicted_time_note']}",
        "",
        f"chunks (each rank): {counts}",
        f"programs: {len(r['segments'])}, starting at moments {r['segments']} "
        f"(fused head at moment {fb - 1}, backward from {fb}); no baselines for --ranks > 1"])


def summary(r: dict) -> str:
    """The readable form of a :func:`plan_report`."""
    if r.get("n_ranks", 1) > 1:
        return _summary_zero(r)
    big = r["device_budget_bytes"] >= 2**30
    bu, B, du, D = ("GiB", 2**30, "GB", 1e9) if big else ("MiB", 2**20, "MB", 1e6)
    tu, k = _time_unit(r["predicted_step_s"])
    hb = "unbounded" if r["host_budget_bytes"] is None else f"{r['host_budget_bytes'] / B:.2f} {bu}"
    lines = [f"{r['model']}: N={param_count(r['n_params'])}, {_model_data(r, B, bu)}, {r['n_chunks']} chunks x "
             f"{r['chunk_size']} elements; batch {r['batch']}x{r['seq']}",
             f"device budget {r['device_budget_bytes'] / B:.2f} {bu}{_resolved(r)}, host budget {hb}",
             f"tide: peak non-model {r['peak_non_model_bytes'] / B:.2f} {bu} over {r['n_moments']} moments, "
             f"{r['tide_source']}; rates {r['rates_source']}",
             "",
             f"{'plan':13s} {'feasible':>8s} {'peak ' + bu:>9s} {'dev model ' + bu:>13s} {'host ' + bu:>9s} "
             f"{'h2d ' + du:>8s} {'d2h ' + du:>8s} {'fetches':>7s} {'step ' + tu:>8s}"]
    rows = [("chunkjax", r)] + list(r["baselines"].items())
    for name, x in rows:
        lines.append(f"{name:13s} {str(x['feasible']):>8s} {x['predicted_peak_device_bytes'] / B:9.2f} "
                     f"{x['device_model_bytes'] / B:13.2f} {x['host_bytes'] / B:9.2f} "
                     f"{x['h2d_bytes_per_step'] / D:8.2f} {x['d2h_bytes_per_step'] / D:8.2f} "
                     f"{x['n_fetches']:7d} {x['predicted_step_s'] * k:8.3f}")
    lines += ["", f"where the time goes ({tu})" + (", clipping expected to fire (host updates from the "
                                                  "backward's end; baselines as if rare)" if r.get("clip_expect") ==
                                                  "fires" else "") + ":"]
    lines += [f"  {name:13s} {_where(x['time'], k)}" for name, x in rows]
    lines += _clipped_line(r.get("if_clipped"), tu, k, r.get("max_grad_norm") is not None)
    counts = "; ".join(f"{v} with params on {c.split('/')[0][len('params_'):]}, update on "
                       f"{c.split('/')[1][len('update_'):]}" for c, v in r["placement_counts"].items())
    fb = r["first_backward_moment"]
    lines += [f"chunkjax {r['storage']}"] if r.get("storage") else []
    lines += ["", f"chunkjax chunks: {counts}",
              f"chunkjax programs: {len(r['segments'])}, starting at moments {r['segments']} "
              f"(fused head at moment {fb - 1}, backward from {fb})"]
    return "\n".join(lines)


def _clipped_line(c: dict | None, tu: str, k: float, clips: bool = False) -> list[str]:
    """The summary's line on a ``"rare"`` plan's step with clipping (:func:`if_clipped`): ``clips``
    (``--max-grad-norm`` given) says "with clipping", else the line is labelled as the step if
    clipping were configured (the planned optimizer does not clip: fresh25)."""
    if not c or not c["host_chunks"]:  # nothing speculates: the same step with clipping
        return []
    head = "with clipping (rare)" if clips else "if clipping were configured (--max-grad-norm, rare)"
    if not c["retimed"]:
        return [f"{head}: the step above, if every host chunk speculates (not retimed with the "
                f"speculation bound with micro-batches or storage chunks)"]
    b = c["speculation_bound"]
    return [f"{head}: speculation within the default backup pool ({b['bytes'] / 2**30:.2f} GiB: "
            f"{min(b['chunks'], c['host_chunks'])} of {c['host_chunks']} host chunks), predicted step "
            f"{c['predicted_step_s'] * k:.3f} {tu}; the table's step is the planner's, every host chunk speculating "
            "(as without clipping)"]


def param_count(n: int) -> str:
    """A parameter count as the field writes it: ``'921.2K'``, ``'6.16B'``, ``'1.3M'``."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(int(n))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help="a name of models/gpt.py's table (case-insensitive), or your model as module:factory "
                         "(factory(batch=, seq=) -> (nnx model, loss_fn, batch) or (stages, params, batch); see call_factory)")
    ap.add_argument("--device-budget", required=True,
                    help="peak device bytes (per GPU with --ranks), e.g. 24GiB, 3.5e9, or min (the least budget a run can "
                         "be given, chunkjax.offload's 'min': the least the plan needs over the fit path's "
                         "compiled-step headroom, chunkjax.fit.min_budget)")
    ap.add_argument("--host-budget", default=None,
                    help="host memory for model data, bytes (the node's with --ranks; default: unbounded)")
    ap.add_argument("--batch", type=int, default=8, help="rows per step (the global batch with --ranks)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--prefetch", type=int, default=1, help="moments between a fetch and its use")
    ap.add_argument("--compute-dtype", default="auto", metavar="DTYPE",
                    help="compute params and gradients: bfloat16, float32 or float16; auto (default): what the API "
                         "does with the same model (an NNX model's params dtype, as chunkjax.offload; else bfloat16, "
                         "as chunkjax.fit.prepare)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation: each step's --batch rows as this many micro-batches (default 1)")
    ap.add_argument("--storage", default=None, metavar="DIRS",
                    help="storage directories of the disk tier, comma-separated (needs --host-budget): chunks the "
                         "host cannot hold keep their master params and optimizer state there")
    ap.add_argument("--tide-from", default=None, metavar="RESULTS_JSON",
                    help="stage temporaries (and calibrated rates) recorded by a GPU run of experiments/bench.py")
    ap.add_argument("--measured-rates", action="store_true", help="with --tide-from: the rates that run ran at "
                    "(the host kernel's inside its step: chunkjax.cost.Rates.from_record), not its start-up "
                    "calibration, so the plan's step time can be checked against its measured one")
    ap.add_argument("--max-grad-norm", type=float, default=None, metavar="NORM",
                    help="the planned host AdamW clips gradients to this global L2 norm, as a host spec's "
                         "max_grad_norm (chunkjax.host_update.AdamW; default: no clipping, as experiments/bench.py)")
    ap.add_argument("--clip-expect", choices=("auto", "fires", "rare"), default="auto",
                    help="time the step for global-norm clipping that fires on most steps (fires: host updates "
                         "start when the norm is known; more chunks stream through the device) or rarely (rare: "
                         "host updates overlap the backward, as without clipping); default auto: fires with "
                         "--max-grad-norm, else rare, the rule chunkjax.offload and chunkjax.fit_step apply to a "
                         "host spec (chunkjax.clip_plan.resolve)")
    ap.add_argument("--ranks", type=int, default=1,
                    help="GPUs of one node the step is split over with ZeRO (default 1: one device, no ZeRO)")
    ap.add_argument("--zero-stage", type=int, default=None, help="ZeRO stage 1, 2 or 3 with --ranks > 1 (default 3)")
    ap.add_argument("--plots", default=None, metavar="DIR",
                    help="also write the plan's figures there (tide.png, device_bytes.png, schedule.png, "
                         "placement.png; chunkjax.plots)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.zero_stage is not None and a.ranks == 1:
            raise ValueError(f"--zero-stage {a.zero_stage} needs --ranks N > 1 (one GPU has nothing to shard): "
                             "add --ranks or drop --zero-stage")
        a.zero_stage = 3 if a.zero_stage is None else a.zero_stage
        check_shape(a.batch, a.seq)  # every model kind, before a factory is called or a model traced
        check_ranks(a.batch, a.ranks, a.zero_stage)
        if a.plots:
            plots_dir(a.plots)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import chunkjax as cj
    try:
        from chunkjax.budget import parse_budget
        budget = parse_budget(a.device_budget, takes=("min",), who="--device-budget", api="the planner CLI")
        host = parse_budget(a.host_budget, takes=(), who="--host-budget", api="the planner CLI") if a.host_budget else None
        t0 = time.time()
        if a.measured_rates and not a.tide_from:
            raise ValueError("--measured-rates reads the rates of a recorded run: add --tide-from RESULTS_JSON")
        inp = prepare(a.model, a.batch, a.seq, tide_from=a.tide_from,
                      warn=lambda m: print(f"note: {m}", file=sys.stderr), n_ranks=a.ranks,
                      measured_rates=a.measured_rates, **step_options(a.compute_dtype, a.micro_batches, a.storage),
                      **({"host_budget": host} if a.storage else {}))  # the disk tier plans with a host budget
        inp = with_clipping(inp, a.clip_expect, a.max_grad_norm)
        asked = budget  # as given: "min" or bytes (the report's device_budget_requested)
        if budget == "min":  # the least device budget a run can be given: chunkjax.offload's "min"
            from chunkjax.fit import min_budget
            budget = min_budget(plan_problem(inp, host, a.prefetch, a.zero_stage))
        r = plan_report(a.model, budget, host, inp.batch, inp.seq, a.prefetch, inputs=inp, n_ranks=a.ranks,
                        zero_stage=a.zero_stage)
        r["plan_s"], r["clip_expect"], r["max_grad_norm"] = time.time() - t0, inp.problem.clip_expect, a.max_grad_norm
        r["device_budget_requested"] = asked
        if a.plots:
            from chunkjax import plots
            r["plots"] = {k: str(v) for k, v in plots.save_figures(
                plan_problem(inp, host, a.prefetch, a.zero_stage), a.plots,
                schedule=cj.Schedule.from_dict(r["schedule"])).items()}
    except (cj.PlanError, ValueError, OSError) as e:
        print(f"error: {with_flags(str(e))}", file=sys.stderr)
        if a.json and isinstance(e, cj.PlanError):
            print(json.dumps({"feasible": False, "error": with_flags(str(e)), "min_device_budget_bytes": e.min_budget_bytes,
                              "activations_alone": e.activations_alone}))
        return 2
    if a.json:
        print(json.dumps(r, indent=1))
    else:
        print(summary(r))
        if a.plots:
            print(f"figures: {', '.join(r['plots'].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
