"""Issue 23 item 3: the Flax drop-in optimizer against ``nnx.Optimizer``, in one call.

The workload of ``shared/probes/nnx_dropin_probe.py``: a 1.28B-param NNX decoder (d 2048, 24
blocks, vocab 32768, 16 heads, remat per block), batch 8 x 1024, fp32 params, bf16 compute on the
GPU, AdamW(1e-4); the user's loop (jitted grads, ``opt.update`` outside, ``float(loss)`` every
step). Each system runs in its own process (a clean peak):

* ``nnx``: ``nnx.Optimizer`` inside ``nnx.jit``, everything on the device (and, first, the bf16
  matmul probe of this call: ``experiments.gpu_measure.matmul_tflops``);
* ``chunk_host``: ``chunkjax.NnxOptimizer(model, chunkjax.host_update.AdamW(1e-4), device_budget=B)``:
  offloaded chunks split between the streamed pipeline and the host kernel, run at once
  (``chunkjax.duplex``; the headline);
* ``front``: the loop that hands its loss over, ``chunkjax.offload(model, AdamW(1e-4), loss_fn,
  batch, device_budget=P)`` with P the ``chunk_host`` system's measured peak (the same device
  memory; ``--front-budget``): the offloaded updates overlap the backward (issue 23 item 3's
  "what the loop allows": ``docs/dropin.md``);
* ``chunk_optax``: the drop-in with ``optax.adamw(1e-4)`` (every offloaded chunk streamed).

``--sweep-host-chunks 8,31`` runs the ``chunk_host`` system again once per forced split (systems
``chunk_host_h8`` ..., ``host_chunks=N``, also nameable in ``--systems``; the JSON's
``sweep_host_chunks`` compares update seconds with their predictions and the host memory moved:
``docs/dropin.md``, "Host memory bandwidth"). ``--sweep-threads 16,12,8`` runs the ``chunk_host``
system once per numba thread count of its
host kernel (systems ``chunk_host_t16`` ..., ``NnxOptimizer(..., host_threads=N)``; the JSON's
``sweep_threads`` compares them); ``--rates recorded:<results json>`` splits by the rates a GPU run
measured under contention (``chunkjax.cost.Rates.from_record``). Each host-kernel system's
``own_rates_prediction`` is its update predicted with the rates it measured itself, against its
measured ``update_s`` (the cost model's check: ``docs/dropin.md``, "Rates under contention").

The drop-in systems also time the gradient step alone (``grad_step_s``: the floor of any
update placement in this loop) and record each update's breakdown
(``chunkjax.duplex.UpdateBreakdown``: predicted and measured update seconds, bytes and busy
seconds each way, both directions' overlap, kernel seconds), their medians over the steady
steps, and one steady update's event timeline; and each step's phases (the breakdown's caller
fields: outside ``update()`` (the loop's grad dispatch), setup, backward wait, update, finish,
model write; their sum is the step) as a table of milliseconds, with the loop's ``nnx.jit``
dispatch time in the loop and alone (``grad_dispatch_s``, ``grad_dispatch_alone_s``) and Python's
garbage-collector seconds per step (``gc_s``, ``gc_gen2_collections``). The ``front`` system
records its plan (``front_plan``: host chunks and the program first taking each, program bounds,
gradient window, predicted seconds, bytes each way per step, numba threads) and each step's phases
(``front_phases``, one row per step from ``experiments/gpu_checks/front_door_3b.py``'s
``PhaseClock``: the call, ``float(loss)`` after it, the waits for the previous step's host chunks
and work, the gradient window, the commit, programs' ends, host kernel seconds, compiles, kept
executables refused), printed one column per step (``docs/dropin.md``, "The front's steps 3+").

Writes ``dropin_<run>.json`` (keys ``nnx_optimizer_tokens_per_s``, ``chunkjax_tokens_per_s`` (the
``chunk_host`` system), ``chunkjax_optax_tokens_per_s``, ``ratio``, ``n_params``,
``device_budget_bytes``, per system ``tflops`` / ``mfu`` / ``mfu_datasheet`` (6N + 12LTd FLOPs per
token, as ``experiments/bench.py``) and the anchors' units (``model_tflops``,
``model_tflops_share_989``, ``model_mfu``, ``host_bytes_per_param``: ``experiments.report``), peak
device bytes, losses, the optimizer's summary and the update breakdowns) and prints a table last::

    python experiments/gpu_checks/dropin.py --run s10 --out experiments/results     # on the GPU (< 8 min)
    python experiments/gpu_checks/dropin.py --systems chunk_host --sweep-threads 16,12,8 --run s15t \\
        --out experiments/results                                                 # the kernel's threads
    python experiments/gpu_checks/dropin.py --systems nnx,chunk_host --total 230 --run s16p \
        --out experiments/results                                                 # the step's phases (< 4 min)
    python experiments/gpu_checks/dropin.py --systems front --front-budget 27900542976 --steps 8 --total 200 \
        --timeout 190 --run s21f --out experiments/results                        # the front's phases (< 3 min)
    timeout 230 python experiments/gpu_checks/dropin.py --systems nnx,chunk_host --steps 6 --total 225 \\
        --run s21d --out $OUT                                                     # lean + host memory split (< 4 min)
    timeout 230 python experiments/gpu_checks/dropin.py --systems chunk_host_h8,chunk_host_h31 --steps 6 \\
        --total 220 --run s21h --out $OUT                                         # the split's two sides (< 4 min)
    python experiments/gpu_checks/dropin.py --tiny --run cpu --out /tmp            # a CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# the repository root on the path: the script runs as a file (its children too, through this line)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

FULL = dict(D=2048, L=24, V=32768, H=16, B=8, T=1024, STEPS=6, BUDGET="2GiB")
TINY = dict(D=64, L=2, V=256, H=4, B=2, T=32, STEPS=3, BUDGET="1MiB")
SYSTEMS = ("nnx", "chunk_host", "front", "chunk_optax", "injit_tied", "injit_free", "injit_tied_nd")


#: Breakdown fields whose medians over the steady updates are recorded (chunkjax.duplex.UpdateBreakdown).
BREAKDOWN_KEYS = ("predicted_s", "predicted_h2d_s", "predicted_d2h_s", "predicted_kernel_s", "predicted_host_memory_s",
                  "backward_wait_s",
                  "update_s", "tail_s", "h2d_bytes", "d2h_bytes", "h2d_busy_s", "d2h_busy_s", "both_busy_s",
                  "h2d_gb_per_s", "d2h_gb_per_s", "kernel_s", "kernel_idle_s", "outside_s", "setup_s", "dispatch_s",
                  "finish_s", "model_update_s", "step_s", "grads_ready_s")
#: The step's phases (UpdateBreakdown's caller fields): their sum is the period between two
#: update() returns (``step_s``); printed as a table of milliseconds (``_phase_table``).
PHASES = (("outside_s", "outside update(): the loop's grad dispatch (nnx.jit), float(loss)"),
          ("setup_s", "update() setup: grads flatten + checks, join of the last write-backs"),
          ("backward_wait_s", "backward wait: the gradients not computed yet"),
          ("update_s", "update after the gradients existed (offloaded chunks)"),
          ("finish_s", "finish: new params pytree (host chunks' params, spanning leaves)"),
          ("model_update_s", "model write: the variables set at their paths (chunkjax.nnx_write)"))


def host_threads_of(kind: str) -> tuple[bool, int | None]:
    """``(host kernel spec?, numba threads or None)`` of a system name: ``chunk_host`` (the
    optimizer's default threads), ``chunk_host_t<N>`` (``host_threads=N``: ``--sweep-threads``),
    ``chunk_host_h<N>`` (the default threads, ``host_chunks=N``: ``--sweep-host-chunks``)."""
    if kind == "chunk_host" or host_chunks_of(kind) is not None:
        return True, None
    if kind.startswith("chunk_host_t") and kind[len("chunk_host_t"):].isdigit():
        return True, int(kind[len("chunk_host_t"):])
    return False, None


def host_chunks_of(kind: str) -> int | None:
    """``N`` of a ``chunk_host_h<N>`` system (``host_chunks=N``), else None."""
    tail = kind[len("chunk_host_h"):] if kind.startswith("chunk_host_h") else ""
    return int(tail) if tail.isdigit() else None


def own_rates_prediction(v: dict) -> dict | None:
    """A host-kernel system's update predicted with the rates it measured itself
    (``chunkjax.cost.Rates.from_record``: each direction while both ran, the kernel inside the
    update) against its measured ``update_s``: the cost model's check (None if it did not run)."""
    from chunkjax import dropin, recorded
    from chunkjax.cost import Rates
    try:
        ru = recorded.recorded_update(v)
        rates = Rates.from_record({"systems": {"s": v}}, "s")
    except (ValueError, KeyError):
        return None
    pred = dropin.predict_update_parts(ru.n_offloaded - ru.n_host, ru.n_host, ru.chunk_size, ru.state_bytes,
                                       ru.grad_bytes, ru.param_bytes, rates, ru.depth, ru.streamed_bytes)
    _, host = dropin.split_offloaded(range(ru.n_offloaded), ru.chunk_size, ru.state_bytes, ru.grad_bytes,
                                     ru.param_bytes, rates, None, ru.depth, ru.streamed_bytes)
    return {"predicted_s": pred.total_s, "h2d_s": pred.h2d_s, "d2h_s": pred.d2h_s, "kernel_s": pred.kernel_s,
            "host_memory_s": pred.host_memory_s, "host_memory_gb_per_s": rates.host_memory_bytes_per_s / 1e9,
            "measured_s": ru.measured_s, "h2d_gb_per_s": rates.h2d_bytes_per_s / 1e9,
            "d2h_gb_per_s": rates.d2h_bytes_per_s / 1e9, "kernel_ns_per_param": rates.host_update_s_per_param * 1e9,
            "split_host_chunks_at_these_rates": len(host)}


class _GcClock:
    """Seconds spent in Python's garbage collector (``gc.callbacks``) since ``reset()``, and the
    number of generation-2 collections: a pause of the user's loop that no phase names."""

    def __init__(self):
        import gc
        self._gc, self._t = gc, None
        self.reset()
        gc.callbacks.append(self._cb)

    def reset(self):
        self.seconds, self.gen2 = 0.0, 0

    def _cb(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        elif self._t is not None:
            self.seconds += time.perf_counter() - self._t
            self.gen2 += info.get("generation") == 2
            self._t = None

    def close(self):
        self._gc.callbacks.remove(self._cb)


#: Per-step fields of the front system's phases (``front_phases``; PhaseClock's row keys plus the
#: loop's): printed as a table of milliseconds, one column per step (``_front_table``).
FRONT_PHASES = (("step_s", "the loop's step: the call + float(loss)"),
                ("call_s", "in the step's call (opt(batch))"),
                ("loss_wait_s", "float(loss) after the call returned"),
                ("wait_host_chunks_s", "call: waits for the previous step's host chunks a program takes"),
                ("wait_host_s", "call: join of the previous step's host work (first backward program)"),
                ("wait_grad_window_s", "call: gradient window (host updates catching up)"),
                ("commit_s", "call: commit (device updates dispatched)"),
                ("python_s", "call: the rest (dispatch, bookkeeping)"),
                ("forward_s", "program 0 done (from the call's start; the loss is ready then)"),
                ("backward_done_s", "last program done (from the call's start)"),
                ("host_kernel_s", "host kernel seconds of this step's host work"),
                ("host_kernel_calls_s", "kernel calls inside this step's period (any step's work)"),
                ("host_grad_wait_s", "host thread waiting for gradients inside this period"),
                ("compile_s", "backend compiles inside this period"))


def front_plan(opt, batch) -> dict:
    """The front system's plan as the step runs it: chunk counts, the host chunks and the program
    each is first taken by (the next step waits for it there: ``chunkjax.cross_step.host_need``),
    the programs' moment bounds, the gradient window, the predicted seconds
    (``Schedule.predicted.time``) and bytes moved per step each way (the fetches of pinned chunks up,
    the offloaded chunks' gradients down: ``chunkjax.predict``), and numba's threads (the front's host kernel sets none: numba's default) and the host's cores."""
    import numba

    from chunkjax import cross_step
    st, pr = opt.step, opt.schedule.predicted
    need = cross_step.host_need(st, opt._step_batch(batch))
    return {"n_chunks": st.layout.n_chunks, "chunk_size": st.layout.chunk_size,
            "host_chunks": list(st.host_chunks), "host_first_program": {str(c): k for c, k in need.items()},
            "program_bounds": [list(b) for b in st.program_bounds()], "grad_window": int(st.grad_window),
            "cross_step": bool(st.cross_step), "numba_threads": numba.get_num_threads(), "cpu_count": os.cpu_count(),
            "predicted": pr.time.to_dict(), "h2d_bytes_per_step": int(pr.h2d_bytes_per_step),
            "d2h_bytes_per_step": int(pr.d2h_bytes_per_step), "n_fetches": int(pr.n_fetches)}


def front_phases(rows: list[dict], times: list[float], kernel_s: list) -> list[dict]:
    """PhaseClock's per-step rows (``experiments/gpu_checks/front_door_3b.py``) with the loop's
    step seconds (``step_s``: the call and ``float(loss)``), the loss's wait after the call
    (``loss_wait_s``), the last program's end from the call's start (``backward_done_s``) and the
    step's own host kernel seconds (``host_kernel_s``: its HostWork, joined by the next step)."""
    out = []
    for i, r in enumerate(rows):
        r = dict(r)
        done = [x for x in r.get("programs_done_s") or [] if x is not None]
        r["step_s"] = times[i] if i < len(times) else None
        r["loss_wait_s"] = None if r["step_s"] is None or r.get("call_s") is None else round(r["step_s"] - r["call_s"], 5)
        r["backward_done_s"] = max(done) if done else None
        r["host_kernel_s"] = None if i >= len(kernel_s) or kernel_s[i] is None else round(kernel_s[i], 5)
        out.append(r)
    return out


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def child(kind: str, cfg: dict) -> dict:
    """One system's run (in its own process): tokens/s from the median step after the first."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import chunkjax
    from chunkjax import dropin
    from chunkjax.host_update import AdamW

    D, L, V, H, B, T, STEPS = (cfg[k] for k in ("D", "L", "V", "H", "B", "T", "STEPS"))
    gpu = jax.default_backend() == "gpu"
    cdt = jnp.bfloat16 if gpu else jnp.float32
    out: dict = {"backend": jax.default_backend()}
    if kind == "nnx":  # the matmul probe of this call (before the model takes the memory)
        from experiments.gpu_measure import matmul_tflops
        out["matmul_tflops"] = matmul_tflops(8192 if gpu else 256, warmup=2 if gpu else 1, reps=10 if gpu else 2)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln1 = nnx.LayerNorm(D, rngs=rngs)
            self.ln2 = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, dtype=cdt, rngs=rngs)
            self.up = nnx.Linear(D, 4 * D, dtype=cdt, rngs=rngs)
            self.down = nnx.Linear(4 * D, D, dtype=cdt, rngs=rngs)

        def __call__(self, x, mask):
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V, D, dtype=cdt, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])
            self.lnf = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tok):
            x = self.emb(tok)
            mask = nnx.make_causal_mask(tok)
            for b in self.blocks:
                x = nnx.remat(lambda b, x: b(x, mask))(b, x)
            return self.emb.attend(self.lnf(x)).astype(jnp.float32)

    def loss_fn(model, tok):
        logits = model(tok[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tok[:, 1:]).mean()

    toks = jax.random.randint(jax.random.key(1), (STEPS + 1, B, T + 1), 0, V)
    model = LM(nnx.Rngs(0))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    update_call_s, breakdowns, grad_dispatch_s = [], [], []
    if kind == "nnx":
        opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, tok):
            loss, g = nnx.value_and_grad(loss_fn)(model, tok)
            opt.update(model, g)
            return loss
        run = lambda t: step(model, opt, t)  # noqa: E731
        out["host_bytes"] = 0  # everything on the device
    elif kind.startswith("injit_"):  # prototype: the update inside the user's one jitted step
        run = injit_run(model, loss_fn, kind)
        out["host_bytes"] = 8 * sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))  # mu, nu
    elif kind == "front":  # the loop handing over its loss: the update overlaps the backward
        from experiments.gpu_checks.front_door_3b import PhaseClock
        opt = chunkjax.offload(model, AdamW(1e-4), loss_fn, toks[0], device_budget=cfg["FRONT_BUDGET"])
        out["summary"] = str(opt.report.schedule.counts())
        out["front_budget_bytes"] = cfg["FRONT_BUDGET"]
        out["front_plan"] = front_plan(opt, toks[0])
        out["host_bytes"] = int(opt.schedule.predicted.host_bytes)  # the plan's host model data and working set
        clock, works = PhaseClock().__enter__(), []

        def run(t):  # the step's call under the phase clock; float(loss) after it is the loop's
            loss = clock.step(opt, t)
            works.append(opt.state.pending)  # its HostWork: kernel seconds once joined
            update_call_s.append(clock.steps[-1]["call_s"])
            return loss
    else:
        host, threads = host_threads_of(kind)
        tx = AdamW(1e-4) if host else optax.adamw(1e-4)  # the same math (weight decay 1e-4)
        kw = dict(cfg.get("KWARGS", {}))
        if threads is not None:
            kw["host_threads"] = threads
        if host_chunks_of(kind) is not None:
            kw["host_chunks"] = host_chunks_of(kind)
        if host:  # the kernel alone on this host (against its seconds inside the update), on 1 GiB
            from chunkjax.cost import Rates
            from chunkjax.host_update import measure_host_update_rate
            from experiments.gpu_measure import HOST_RATE_PARAMS
            out["host_rate_calibration"] = stats = {}
            out["host_update_s_per_param_alone"] = alone = measure_host_update_rate(
                HOST_RATE_PARAMS if gpu else 2**16, stats=stats)
            rates = cfg.get("RATES") or "default"
            if rates == "measured":
                kw["rates"] = Rates(host_update_s_per_param=alone)
            elif rates.startswith("recorded:"):  # the rates a GPU run measured under contention
                kw["rates"] = Rates.from_record(rates[len("recorded:"):])
        opt = chunkjax.NnxOptimizer(model, tx, device_budget=cfg["BUDGET"], **kw)
        c = opt.chunked
        out["summary"] = opt.summary()
        out["host_threads"] = c.host_threads
        out["split"] = {"device": c.placement.state_kinds.count("device"), "streamed": len(c.streamed_chunks),
                        "host": len(c.host_chunks), "depth": c.pipeline_depth, "chunk_size": c.layout.chunk_size,
                        "lean": len(c.lean_chunks)}
        cs = c.layout.chunk_size  # the host kernel's host memory bytes per chunk (AdamW, float32 grads and params)
        out["host_kernel_bytes_per_chunk"] = dropin.host_kernel_bytes(12 * cs, 4 * cs, 4 * cs, cs)
        out["host_bytes"] = int(c.host_state_bytes + len(c.host_chunks) * c.layout.chunk_size * 4)
        grad_fn = nnx.jit(nnx.value_and_grad(loss_fn))

        def run(t):
            t0 = time.perf_counter()
            loss, g = grad_fn(model, t)
            grad_dispatch_s.append(time.perf_counter() - t0)  # nnx.jit's Python until it returns
            t0 = time.perf_counter()
            opt.update(model, g)  # returns once dispatched (the host chunks' kernels done)
            update_call_s.append(time.perf_counter() - t0)
            if c.last_update is not None:  # the update before this one, joined by it
                breakdowns.append(c.last_update)
            return loss
    losses, times, gc_s, gc_gen2 = [], [], [], []
    gc_clock = _GcClock()
    for i in range(STEPS + 1):
        gc_clock.reset()
        t0 = time.perf_counter()
        loss = float(run(toks[i]))
        times.append(time.perf_counter() - t0)
        gc_s.append(gc_clock.seconds)
        gc_gen2.append(gc_clock.gen2)
        losses.append(loss)
    gc_clock.close()
    out["gc_s"], out["gc_gen2_collections"] = gc_s, gc_gen2  # Python's collector inside each step
    if kind == "front":
        clock.finish(opt.wait)
        clock.__exit__()
        out["front_phases"] = front_phases(clock.summary(), times, [w.seconds if w is not None else None
                                                                     for w in works])
        # two steady steps' raw events (PhaseClock: seconds from each call's start): the host thread's
        # gradient waits and kernel calls against the programs' dispatches and the main thread's waits
        out["front_events"] = [json.loads(json.dumps(clock.steps[i], default=str))
                               for i in (len(clock.steps) - 3, len(clock.steps) - 2) if i >= 1]
    if kind.startswith("chunk_"):
        opt.wait()
        breakdowns.append(opt.chunked.last_update)
        steady = [b for b in breakdowns if b is not None and b.step >= 1]
        out["breakdowns"] = [b.as_dict() for b in steady]
        out["breakdown_median"] = bd = {k: _median([getattr(b, k) for b in steady]) for k in BREAKDOWN_KEYS}
        if c.host_chunks and bd["kernel_s"]:  # the kernel's rate inside the update (beside the transfers)
            out["host_update_s_per_param_in_update"] = bd["kernel_s"] / (len(c.host_chunks) * c.layout.chunk_size)
        if bd.get("update_s"):  # host memory moved by the kernel and the DMA over the update (docs/dropin.md)
            moved = len(c.host_chunks) * out["host_kernel_bytes_per_chunk"] + bd["h2d_bytes"] + bd["d2h_bytes"]
            out["host_memory_gb_per_s_in_update"] = moved / bd["update_s"] / 1e9
        if steady:  # one steady update's timeline: (kind, chunk, bytes, start s, end s)
            out["timeline"] = steady[len(steady) // 2].as_dict(events=True)["events"]
        gt, gd = [], []
        for i in range(3):  # the gradient step alone: the floor of any update placement in this loop
            t0 = time.perf_counter()
            loss = grad_fn(model, toks[i])[0]
            gd.append(time.perf_counter() - t0)
            float(loss)
            gt.append(time.perf_counter() - t0)
        out["grad_step_s"] = _median(gt)
        # nnx.jit's dispatch (Python) in the loop, beside the optimizer's threads, and alone
        out["grad_dispatch_s"], out["grad_dispatch_alone_s"] = grad_dispatch_s, _median(gd)
    median = sorted(times[1:])[len(times[1:]) // 2]
    mem = jax.devices()[0].memory_stats() or {}
    out.update({"n_params": int(n), "losses": losses, "step_s": times, "step_s_median": median,
                "tokens_per_s": B * T / median, "first_step_s": times[0], "peak_device_bytes_measured": mem.get("peak_bytes_in_use"),
                "update_call_s": update_call_s})
    return out


def injit_run(model, loss_fn, kind: str):
    """Prototype (session 27, not the library): AdamW(1e-4) with its moments (mu, nu) in
    ``pinned_host``, updated inside the same ``jax.jit`` program as the gradients, as a
    ``nnx.Optimizer`` loop does inside ``nnx.jit``; per param leaf the moments move to the device,
    update there and move back, so XLA may overlap those transfers with the backward.

    kind: ``injit_free`` (the moves as XLA schedules them), ``injit_tied`` (each leaf's fetch tied
    to its gradient with ``optimization_barrier``: fetched when the backward has produced it),
    ``injit_tied_nd`` (tied, the moments not donated). Returns the loop's step ``run(tok) -> loss``.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from chunkjax.memory import DEVICE, PINNED_HOST, ordered_after, sharding

    hs, ds = sharding(PINNED_HOST), sharding(DEVICE)
    lr, b1, b2, eps, wd = 1e-4, 0.9, 0.999, 1e-8, 1e-4  # optax.adamw(1e-4)'s defaults
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.device_put(params, ds)
    zeros = [jnp.zeros(p.shape, jnp.float32) for p in jax.tree.leaves(params)]
    state = {"mu": [jax.device_put(z, hs) for z in zeros], "nu": [jax.device_put(z, hs) for z in zeros],
             "count": jax.device_put(jnp.zeros((), jnp.int32), ds)}
    del zeros
    tied = kind.startswith("injit_tied")

    def step(params, state, rest, tok):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tok))(params)
        gl, tree = jax.tree.flatten(g)
        c = state["count"] + 1
        bc1 = 1 - b1 ** c.astype(jnp.float32)
        bc2 = 1 - b2 ** c.astype(jnp.float32)
        new_p, new_mu, new_nu = [], [], []
        for gi, pi, mh, vh in zip(gl, jax.tree.leaves(params), state["mu"], state["nu"]):
            if tied:
                mh, vh = ordered_after(gi, (mh, vh))
            m = b1 * jax.device_put(mh, ds) + (1 - b1) * gi
            v = b2 * jax.device_put(vh, ds) + (1 - b2) * gi * gi
            u = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + wd * pi
            new_p.append(pi - lr * u)
            new_mu.append(jax.device_put(m, hs))
            new_nu.append(jax.device_put(v, hs))
        return loss, jax.tree.unflatten(tree, new_p), {"mu": new_mu, "nu": new_nu, "count": c}

    jstep = jax.jit(step, donate_argnums=(0,) if kind.endswith("_nd") else (0, 1))
    box = {"params": params, "state": state}

    def run(tok):
        loss, box["params"], box["state"] = jstep(box["params"], box["state"], rest, tok)
        return loss
    return run


def _summarise(res: dict) -> None:
    """The headline keys of ``res`` from its systems (``chunkjax_tokens_per_s``: the host-kernel +
    streamed system), and per system its FLOP rates (``experiments.bench.finalize_record``'s keys)."""
    from experiments.gpu_measure import DATASHEET_BF16_FLOPS
    from experiments.report import anchor_units
    s, cfg = res["systems"], res["config"]
    tps = {k: v.get("tokens_per_s") for k, v in s.items()}
    res["n_params"] = next((v["n_params"] for v in s.values() if "n_params" in v), None)
    res["matmul_tflops"] = s.get("nnx", {}).get("matmul_tflops")
    flops_per_token = (6 * res["n_params"] + 12 * cfg["L"] * cfg["T"] * cfg["D"]) if res["n_params"] else None
    for k, v in s.items():
        if v.get("tokens_per_s") and flops_per_token:
            flops = flops_per_token * v["tokens_per_s"]
            v["tflops"] = flops / 1e12
            v["mfu"] = flops / (res["matmul_tflops"] * 1e12) if res["matmul_tflops"] else None
            v["mfu_datasheet"] = flops / DATASHEET_BF16_FLOPS
            v.update(anchor_units(v["tokens_per_s"], res["n_params"], matmul_tflops=res["matmul_tflops"],
                                  host_bytes=v.get("host_bytes")))  # null where a system did not record it
        if host_threads_of(k)[0] and "timeline" in v:
            v["own_rates_prediction"] = own_rates_prediction(v)
        bd, g = v.get("breakdown_median") or {}, v.get("grad_step_s")
        if g and bd.get("predicted_s") is not None and tps.get("nnx"):  # the cost model's tokens/s ratio
            v["predicted_ratio"] = cfg["B"] * cfg["T"] / (g + bd["predicted_s"]) / tps["nnx"]
    res["nnx_optimizer_tokens_per_s"] = tps.get("nnx")
    res["chunkjax_tokens_per_s"] = tps.get("chunk_host")
    sweep = {k: v for k, v in s.items() if k.startswith("chunk_host_t") and "error" not in v}
    if sweep:  # --sweep-threads: per numba thread count, the update and the kernel's rate inside it
        res["sweep_threads"] = {v.get("host_threads"): {
            "tokens_per_s": v.get("tokens_per_s"), "update_s": (v.get("breakdown_median") or {}).get("update_s"),
            "kernel_ns_per_param_in_update": _ns(v.get("host_update_s_per_param_in_update")),
            "h2d_gb_per_s": (v.get("breakdown_median") or {}).get("h2d_gb_per_s"),
            "d2h_gb_per_s": (v.get("breakdown_median") or {}).get("d2h_gb_per_s"),
            "split": v.get("split")} for v in sweep.values()}
    hsweep = {k: v for k, v in s.items() if host_chunks_of(k) is not None and "error" not in v}
    if hsweep:  # --sweep-host-chunks: per forced split, the update against its prediction
        res["sweep_host_chunks"] = {host_chunks_of(k): {
            "tokens_per_s": v.get("tokens_per_s"), "update_s": (v.get("breakdown_median") or {}).get("update_s"),
            "predicted_s": (v.get("breakdown_median") or {}).get("predicted_s"),
            "host_memory_gb_per_s_in_update": v.get("host_memory_gb_per_s_in_update"),
            "h2d_gb_per_s": (v.get("breakdown_median") or {}).get("h2d_gb_per_s"),
            "d2h_gb_per_s": (v.get("breakdown_median") or {}).get("d2h_gb_per_s"),
            "split": v.get("split")} for k, v in hsweep.items()}
    res["chunkjax_optax_tokens_per_s"] = tps.get("chunk_optax")
    res["ratio"] = (tps["chunk_host"] / tps["nnx"]) if tps.get("chunk_host") and tps.get("nnx") else None
    res["ratio_optax"] = (tps["chunk_optax"] / tps["nnx"]) if tps.get("chunk_optax") and tps.get("nnx") else None
    res["peak_device_bytes_measured"] = {k: v.get("peak_device_bytes_measured") for k, v in s.items()}
    if "losses" in s.get("nnx", {}):  # the drop-in must train the same numbers (bf16 compute: ~1e-3)
        ref = s["nnx"]["losses"]
        res["max_loss_rel_diff"] = {k: max(abs(x - y) / abs(y) for x, y in zip(v["losses"], ref))
                                    for k, v in s.items() if k != "nnx" and "losses" in v}


def _ns(x):
    return x * 1e9 if isinstance(x, (int, float)) else None


def _table(res: dict, budget: int, path: str) -> None:
    """The short table printed last: one row per system, then each drop-in's update breakdown."""
    s = res["systems"]
    nnx_tps = s.get("nnx", {}).get("tokens_per_s")
    def f(x, spec):  # a number in its format, else a dash of its width
        width = spec.split(".")[0]
        return format(x, spec) if isinstance(x, (int, float)) else "-".rjust(int(width) if width.isdigit() else 1)
    print(f"{'system':<12} {'tokens/s':>9} {'x nnx':>6} {'step s':>7} {'grad s':>7} {'peak GiB':>8} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'6N TF/s':>8} {'pred x':>6}")
    for k, v in s.items():
        if "error" in v:
            print(f"{k:<12} failed {v['error']}: {v.get('stderr', '')[-300:]}")
            continue
        peak = v.get("peak_device_bytes_measured")
        print(f"{k:<12} {f(v['tokens_per_s'], '9.0f')} {f(v['tokens_per_s'] / nnx_tps if nnx_tps else None, '6.3f')} "
              f"{f(v['step_s_median'], '7.3f')} {f(v.get('grad_step_s'), '7.3f')} "
              f"{f(peak / 2**30 if peak else None, '8.2f')} {f(v.get('tflops'), '8.1f')} {f(v.get('mfu'), '6.3f')} "
              f"{f(v.get('model_tflops'), '8.1f')} {f(v.get('predicted_ratio'), '6.3f')}")
    for k, v in s.items():
        bd = v.get("breakdown_median")
        if not bd:
            continue
        gb = lambda x: x / 1e9 if isinstance(x, (int, float)) else None  # noqa: E731
        print(f"  {k}: {v.get('split')}; update s measured {f(bd['update_s'], '.3f')} (backward wait "
              f"{f(bd['backward_wait_s'], '.3f')}, tail {f(bd['tail_s'], '.3f')}) predicted {f(bd['predicted_s'], '.3f')} "
              f"(h2d {f(bd['predicted_h2d_s'], '.3f')}, d2h {f(bd['predicted_d2h_s'], '.3f')}, kernel "
              f"{f(bd['predicted_kernel_s'], '.3f')}, host memory {f(bd.get('predicted_host_memory_s'), '.3f')}); host "
              f"memory moved at {f(v.get('host_memory_gb_per_s_in_update'), '.1f')} GB/s in the update")
        print(f"    h2d {f(gb(bd['h2d_bytes']), '.2f')} GB in {f(bd['h2d_busy_s'], '.3f')} s ({f(bd['h2d_gb_per_s'], '.1f')} GB/s), "
              f"d2h {f(gb(bd['d2h_bytes']), '.2f')} GB in {f(bd['d2h_busy_s'], '.3f')} s ({f(bd['d2h_gb_per_s'], '.1f')} GB/s), "
              f"both busy {f(bd['both_busy_s'], '.3f')} s; kernel {f(bd['kernel_s'], '.3f')} s (idle "
              f"{f(bd['kernel_idle_s'], '.3f')}); kernel ns/param alone {f(_ns(v.get('host_update_s_per_param_alone')), '.3f')}, "
              f"in the update {f(_ns(v.get('host_update_s_per_param_in_update')), '.3f')}; numba threads "
              f"{v.get('host_threads')}")
        _phase_table(v, bd)
    for k, v in s.items():
        if v.get("front_phases"):
            _front_table(k, v)
        own = v.get("own_rates_prediction")
        if own:
            print(f"    with its own rates (h2d {own['h2d_gb_per_s']:.1f}, d2h {own['d2h_gb_per_s']:.1f} GB/s, kernel "
                  f"{own['kernel_ns_per_param']:.3f} ns/param): predicted {own['predicted_s']:.3f} s against "
                  f"{own['measured_s']:.3f} measured; their split: {own['split_host_chunks_at_these_rates']} host chunks")
    print(f"n_params {res['n_params']}, device_budget {budget} bytes, matmul {f(res.get('matmul_tflops'), '.0f')} "
          f"TFLOP/s, ratio {f(res.get('ratio'), '.3f')} -> {path}")


def _front_table(k: str, v: dict) -> None:
    """The front system's steps phase by phase (ms, one column per step) and its plan's line."""
    rows, plan = v["front_phases"], v.get("front_plan") or {}
    ms = lambda x: f"{x * 1e3:8.1f}" if isinstance(x, (int, float)) else "       -"  # noqa: E731
    pred = plan.get("predicted") or {}
    print(f"  {k}: host chunks {plan.get('host_chunks')} first taken by programs {plan.get('host_first_program')} of "
          f"{len(plan.get('program_bounds') or [])}; grad window {plan.get('grad_window')}; predicted step "
          f"{ms(pred.get('step_s')).strip()} ms (host update {ms(pred.get('host_update_s')).strip()}, exposed "
          f"{ms(pred.get('host_update_exposed_s')).strip()}); h2d {plan.get('h2d_bytes_per_step', 0) / 1e9:.2f} GB, "
          f"d2h {plan.get('d2h_bytes_per_step', 0) / 1e9:.2f} GB per step")
    print("    front step phases, ms (one column per step):")
    for key, label in FRONT_PHASES:
        print("      " + "".join(ms(r.get(key)) for r in rows) + f"  {label}")
    print("      " + "".join(f"{r.get('compiles', 0):8d}" for r in rows) + "  compiles; kept executables refused: "
          + str([r.get("kept_refused") for r in rows]))


def _phase_table(v: dict, bd: dict) -> None:
    """Where every millisecond of a steady step went (medians over the steady updates; the
    phases' medians need not add up to the median step exactly)."""
    if bd.get("step_s") is None:
        return
    ms = lambda x: f"{x * 1e3:8.1f}" if isinstance(x, (int, float)) else "       -"  # noqa: E731
    print("    step phases, ms (median of the steady steps; their sum is the period between two update() returns):")
    for key, label in PHASES:
        print(f"      {ms(bd.get(key))}  {label}")
    parts = sum(bd.get(k) or 0.0 for k, _ in PHASES)
    gc_steady = v.get("gc_s", [])[1:]
    print(f"      {ms(parts)}  = sum of the medians; median step_s of the phases {ms(bd['step_s']).strip()}, of the loop "
          f"{ms(v.get('step_s_median')).strip()}; grads ready {ms(bd.get('grads_ready_s')).strip()} after the last "
          f"return (grad step alone {ms(v.get('grad_step_s')).strip()}); caller's dispatch inside "
          f"{ms(bd.get('dispatch_s')).strip()}; gc {ms(_median(gc_steady)).strip()} median, "
          f"{ms(max(gc_steady) if gc_steady else None).strip()} max per step "
          f"({sum(v.get('gc_gen2_collections', [])[1:])} gen-2 collections)")
    print(f"      (outside: the loop's grad dispatch (nnx.jit returning) {ms(_median(v.get('grad_dispatch_s', [])[1:])).strip()} "
          f"median in the loop, {ms(v.get('grad_dispatch_alone_s')).strip()} alone)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a folder (gets dropin_<run>.json) or a .json path")
    ap.add_argument("--run", default="local", help="run id in the file name")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke run)")
    ap.add_argument("--budget", default=None, help="the drop-in's device budget (default 2GiB; tiny: 1MiB)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of " + ",".join(SYSTEMS))
    ap.add_argument("--timeout", type=int, default=300, help="seconds per system (its own process)")
    ap.add_argument("--total", type=int, default=450, help="seconds for every system together (a system gets "
                    "what is left, at most --timeout)")
    ap.add_argument("--kwargs", default="{}", help="JSON of extra NnxOptimizer arguments, e.g. "
                    "'{\"host_chunks\": 40, \"pipeline_depth\": 2}'")
    ap.add_argument("--front-budget", default=None, help="the front system's device budget (default: the "
                    "chunk_host system's measured peak bytes, else 'auto')")
    ap.add_argument("--rates", default="default", help="the drop-in's split by 'default' (chunkjax.cost.Rates()), "
                    "'measured' (this host's kernel rate alone) or 'recorded:<results json>' (the rates that run "
                    "measured under contention: chunkjax.cost.Rates.from_record)")
    ap.add_argument("--sweep-threads", default=None, metavar="N,N,...", help="run the chunk_host system once per "
                    "numba thread count of its host kernel (systems chunk_host_t<N>, in place of chunk_host), "
                    "e.g. 16,12,8")
    ap.add_argument("--sweep-host-chunks", default=None, metavar="N,N,...", help="after the chunk_host system, run "
                    "it once per forced split (systems chunk_host_h<N>, host_chunks=N), e.g. 12,30")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if not (a.rates in ("default", "measured") or (
            a.rates.startswith("recorded:") and os.path.isfile(a.rates[len("recorded:"):]))):
        ap.error(f"--rates {a.rates}: use default, measured or recorded:<an existing results json>")
    systems = a.systems.split(",")
    if a.sweep_threads:
        try:
            counts = [int(x) for x in a.sweep_threads.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            ap.error(f"--sweep-threads {a.sweep_threads}: use thread counts >= 1, e.g. 16,12,8")
        at = systems.index("chunk_host") if "chunk_host" in systems else len(systems)
        systems = [k for k in systems[:at]] + [f"chunk_host_t{n}" for n in counts] + [
            k for k in systems[at + 1:]]
    if a.sweep_host_chunks:
        try:
            splits = [int(x) for x in a.sweep_host_chunks.split(",")]
        except ValueError:
            splits = []
        if not splits or min(splits) < 0:
            ap.error(f"--sweep-host-chunks {a.sweep_host_chunks}: use host chunk counts >= 0, e.g. 12,30")
        at = systems.index("chunk_host") + 1 if "chunk_host" in systems else len(systems)
        systems = systems[:at] + [f"chunk_host_h{n}" for n in splits] + systems[at:]
    unknown = [k for k in systems if k not in SYSTEMS and not host_threads_of(k)[1] and host_chunks_of(k) is None]
    if unknown:
        ap.error(f"--systems {unknown[0]}: use names of {','.join(SYSTEMS)}")
    if a.child:
        print("JSON" + json.dumps(child(a.child, json.loads(a.cfg))), flush=True)
        return 0
    cfg = dict(TINY if a.tiny else FULL)
    if a.budget:
        cfg["BUDGET"] = a.budget
    if a.steps:
        cfg["STEPS"] = a.steps
    cfg["KWARGS"] = json.loads(a.kwargs)
    cfg["FRONT_BUDGET"] = a.front_budget
    cfg["RATES"] = ("recorded:" + os.path.abspath(a.rates[len("recorded:"):])) if a.rates.startswith("recorded:") \
        else a.rates
    from chunkjax.fit import resolve_budget
    budget = resolve_budget(cfg["BUDGET"])
    res = {"config": cfg, "device_budget_bytes": budget, "systems": {}}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    path = a.out if a.out.endswith(".json") else os.path.join(a.out, f"dropin_{a.run}.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    s = res["systems"]
    end = time.time() + a.total
    for kind in systems:
        t0 = time.time()
        left = int(min(a.timeout, end - t0))
        if left < 30:
            s[kind] = {"error": f"skipped: {left} s left of --total {a.total}"}
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
            continue
        if kind == "front" and cfg["FRONT_BUDGET"] is None:
            cfg["FRONT_BUDGET"] = next((v["peak_device_bytes_measured"] for k, v in s.items() if host_threads_of(k)[0]
                                        and v.get("peak_device_bytes_measured")), "auto")
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--out", a.out, "--child", kind,
                                "--cfg", json.dumps(cfg)], capture_output=True, text=True, env=env, timeout=left)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("JSON")), None)
            s[kind] = json.loads(line[4:]) if line else {"error": f"rc={p.returncode}", "stderr": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as e:
            s[kind] = {"error": f"timed out after {left} s", "stderr": str(e.stderr or "")[-3000:]}
        s[kind]["wall_s"] = round(time.time() - t0, 1)
        _summarise(res)
        with open(path, "w") as f:  # after each system: a call cut short keeps what it measured
            json.dump(res, f, indent=1)
    _table(res, budget, path)
    return 0 if all("error" not in v for v in s.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
