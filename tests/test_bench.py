"""The issue-4 benchmark harness on the CPU: baselines reproduce the plain optax reference, the
worker returns every key, an infeasible budget is refused before running, driver calls under one
run_id merge, crashed workers are recorded, and the profiler-trace parser reads every format
variant it claims to.

The worker subprocess runs last, at the batch shape of the in-process baseline tests: its
zero_offload_style programs are theirs, served by the persistent compilation cache; the plain optax
reference runs in this process (one Python + JAX start-up fewer).
"""
import dataclasses
import gzip
import json
import math
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import optax
import numpy as np
import pytest

from experiments import baselines as bl
from experiments import bench
from experiments import gpu_measure as gm
from experiments import measure
from models import gpt

CFG = gpt.get_config("micro")
CFG2 = gpt.get_config("micro", n_layers=2)  # the chunkjax system's tests: every chunk kind, fewer programs
BATCH, SEQ = 8, 128  # activations outweigh a block's params: the per-layer memory test below can tell
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- the worker subprocess, started by the last test -------------------------------------------

@pytest.fixture(scope="module")
def subprocesses(tmp_path_factory):
    """One worker (zero_offload_style on micro, the baseline tests' batch shape) in its own
    process, started when the last test asks for it (after the in-process zero_offload_style test
    compiled the same programs into the persistent cache)."""
    d = tmp_path_factory.mktemp("bench")
    worker_out = d / "worker.json"
    worker = subprocess.Popen([sys.executable, "-m", "experiments.bench", "--worker", "zero_offload_style", "--model",
                               "micro", "--batch", str(BATCH), "--seq", str(SEQ), "--steps", "2", "--budget-bytes",
                               str(2**30), "--out", str(worker_out)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs = {"worker": (worker, worker_out)}
    yield procs
    for p, _ in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


def _wait(procs, name):
    p, out = procs[name]
    _, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-3000:]
    return out


# ---- baselines vs the plain optax reference -------------------------------------------------

def _batches():
    return [jax.random.randint(jax.random.key(10 + i), (BATCH, SEQ + 1), 0, CFG.vocab_size, dtype=jnp.int32)
            for i in range(3)]


@pytest.mark.parametrize("name", bl.SYSTEMS)
def test_baseline_matches_plain_optax_reference(name):
    system = bl.build(name, CFG)
    state = system.init(jax.random.key(0))
    losses = []
    for b in _batches():
        state, loss = system.step(state, b)
        losses.append(float(loss))
    master = jax.device_get(state["master"])
    mem = system.compiled_memory(_batches()[0])
    assert mem["peak_bytes"] == mem["argument_bytes"] + mem["output_bytes"] + mem["temp_bytes"] - mem["alias_bytes"] > 0
    if name == "plain_jax":
        assert system.host_bytes(state) == 0
    else:  # fp32 master + Adam m and v = 12 B/param (+ int32 step counts)
        assert 12 * CFG.n_params <= system.host_bytes(state) <= 12 * CFG.n_params + 4 * 64
    if name == "zero_offload_style":
        assert system.last_update_s is not None and system.last_update_s > 0
        assert set(system.last_timings) == {"fwd_bwd_s", "d2h_s", "update_s", "h2d_s"}
        assert jax.tree.leaves(state["params"])[0].dtype == jnp.bfloat16
        assert state["params"]["blocks"]["mlp_c_fc"]["kernel"].shape == (CFG.n_layers, 64, 256)  # stacked

    ref_losses, ref_master = _reference()
    # same math, separately compiled programs: bf16 compute tolerance
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=2e-3)
    assert losses[-1] != losses[0]
    leaves = jax.tree.leaves(master)
    assert len(leaves) == len(ref_master)
    for a, r in zip(leaves, ref_master):
        np.testing.assert_allclose(np.asarray(a), r, rtol=0, atol=1e-5)


def test_baseline_memory_per_layer_is_one_saved_block_input():
    """A block more may cost its saved input and its params' bf16 copies, never its internals.

    Compiled temp bytes of the baselines' steps on micro with 2 and with 4 blocks (4: compiled
    by the test above). Per extra block a step holds the saved block input (B, T, h) bf16 and
    the block's bf16 gradient (and, for plain_jax and maxtext_style, its bf16 compute copy); on
    the CPU, XLA runs bf16 arithmetic in f32, so the backward loop carries the input stack and
    the gradient accumulators in f32 (measured: 2 inputs + 2 param sizes per block for
    zero_offload_style, 2 + 3 for plain_jax). Allowed: 3 inputs + 4 param sizes (787 KB). The
    unrolled ``gpt.loss_fn`` the baselines ran before grew by 12.7 MB per block here (the
    blocks' attention scores and activations kept alive; on the H200 the unrolled step compiled
    to 155 GB of temporaries for zero_offload_style and 126 GB for maxtext_style at GPT3_6B
    b32). maxtext_style's step is plain_jax's on the CPU (memory kinds compile to nothing):
    equal temps, one compile saved.
    """
    x_bytes = BATCH * SEQ * CFG.d_model * 2
    p_bytes = (12 * CFG.d_model ** 2 + 2 * CFG.d_model) * 2
    scores_f32 = BATCH * CFG.n_heads * SEQ * SEQ * 4

    def temp(name, n_layers):
        system = bl.build(name, gpt.get_config("micro", n_layers=n_layers))
        return system.compiled_memory(_batches()[0])["temp_bytes"]

    assert temp("maxtext_style", CFG.n_layers) == temp("plain_jax", CFG.n_layers)
    for name in ("plain_jax", "zero_offload_style"):
        t2, t4 = temp(name, 2), temp(name, CFG.n_layers)
        growth = (t4 - t2) / (CFG.n_layers - 2)
        assert growth <= 3 * x_bytes + 4 * p_bytes, (name, growth, t2, t4, x_bytes, p_bytes)
        assert growth < scores_f32  # not even one block's attention scores per block


def test_scanned_loss_is_gpt_loss_fn():
    """The baselines' scanned formulation computes ``gpt.loss_fn`` (f32 params, 2 blocks: the
    stacking keeps the blocks' order); the gradients are autodiff of the same function."""
    cfg = gpt.get_config("micro", n_layers=2)
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: jnp.asarray(rng.normal(0.0, 0.1, a.shape), jnp.float32), gpt.abstract_params(cfg))
    batch = _batches()[0][:2, :17]
    both = jax.jit(lambda p, b: (gpt.loss_fn(cfg, p, b), bl.scanned_loss(cfg, bl.stack_blocks(p, 2), b)))
    both = both.lower(params, batch).compile({"xla_backend_optimization_level": 0})  # faster CPU compile
    ref, got = both(params, batch)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-6)
    swapped = dict(params, h_0=params["h_1"], h_1=params["h_0"])
    assert abs(float(both(swapped, batch)[1]) - float(ref)) > 1e-4  # the test can tell the order


def _dot_operand_dtypes(jaxpr) -> set:
    out = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out |= {str(v.aval.dtype) for v in eqn.invars}
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    out |= _dot_operand_dtypes(sub)
    return out


def test_baselines_compute_in_bf16():
    """Every matmul of the baselines' forward pass (attention included) takes bf16 operands: the
    compute copies are bf16 before the embedding, so no f32 activation reaches attention (XLA's
    attention would then materialise f32 scores, and cuDNN's flash attention needs bf16). The
    forward and backward run as a scan over the blocks."""
    L = CFG.n_layers
    master = gpt.abstract_params(CFG)
    batch = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    stacked = bl.build("zero_offload_style", CFG).abstract_params  # zero_offload_style's device params
    forwards = [
        jax.make_jaxpr(lambda m, b: bl.scanned_loss(CFG, bl.stack_blocks(bl.to_compute(m), L), b))(master, batch),
        jax.make_jaxpr(lambda p, b: bl.scanned_loss(CFG, p, b))(stacked, batch)]
    for j in forwards:
        assert _dot_operand_dtypes(j.jaxpr) == {"bfloat16"}
    steps = [
        jax.make_jaxpr(lambda m, b: bl._loss_and_grads_of_master(CFG, m, b))(master, batch),
        jax.make_jaxpr(lambda p, b: jax.value_and_grad(lambda q: bl.scanned_loss(CFG, q, b))(p))(stacked, batch)]
    for j in steps:
        assert sum(e.primitive.name == "scan" for e in j.jaxpr.eqns) == 2  # forward and backward loops


_REF_CACHE = {}


def _reference():
    """The plain optax reference (3 steps on micro, the batches of :func:`_batches`): its losses
    and master params (numpy), computed once for the module."""
    if "ref" not in _REF_CACHE:
        losses, master = bl.reference_losses(CFG, jax.random.key(0), _batches())
        _REF_CACHE["ref"] = (list(np.asarray(losses)), [np.asarray(a) for a in jax.tree.leaves(master)])
    return _REF_CACHE["ref"]


def test_zero_opt_state_equals_optax_init():
    tx = bl.make_optimizer()
    params = jax.tree.map(jnp.ones_like, gpt.abstract_params(CFG))
    built = bl.zeros_opt_state(tx, gpt.abstract_params(CFG), lambda s, d: jnp.zeros(s, d))
    ref = tx.init(params)
    assert jax.tree.structure(built) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype and a.shape == b.shape and not np.any(np.asarray(b))


# ---- worker: infeasible budget, chunkjax import ---------------------------------------------

def _worker_args(system, budget, **kw):
    a = dict(worker=system, model="micro", batch=BATCH, seq=SEQ, steps=1, seed=0, budget_bytes=budget,
             compile_only=False, zero_h2d_path=None, host_limit_gb=110, run_id="t")
    a.update(kw)
    return types.SimpleNamespace(**a)


def test_infeasible_budget_is_refused_before_running():
    system = bl.build("plain_jax", CFG)

    def boom(*a, **k):
        raise AssertionError("an infeasible system must not be initialised or stepped")

    system.init = system.step = boom
    rec = measure.measure_system(system, _worker_args("plain_jax", 2**20))
    assert rec["feasible"] is False
    assert "> budget 1048576" in rec["infeasible_reason"]
    assert rec["compiled_memory"]["peak_bytes"] > 2**20
    full = bench.run_worker(_worker_args("plain_jax", 2**20))
    assert set(bench.ALL_KEYS) <= set(full) and full["feasible"] is False and full["losses"] is None


def test_chunkjax_without_its_module_gives_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "experiments.bench_chunkjax", None)
    rec = bench.run_worker(_worker_args("chunkjax", 2**30))
    assert rec["feasible"] is False
    assert "experiments/bench_chunkjax.py" in rec["error"] and "run_chunkjax" in rec["error"]
    assert set(bench.ALL_KEYS) <= set(rec)


# ---- the driver: merging calls, crashed workers, docs ---------------------------------------

def _fake_record(system, tps):
    rec = bench.empty_record(system)
    rec.update(feasible=True, tokens_per_s=tps, losses=[6.2, 6.1], step_s_median=0.5, step_s_all=[0.5],
               host_bytes=123, compiled_memory={"peak_bytes": 1000}, update_s=None)
    return rec


def _fake_runner(rate, log):
    def runner(argv, env, timeout, log_path=None):
        log.append((argv, env))
        if "--probe" in argv:
            return {"rc": 0, "json": {"matmul_tflops": rate, "card_bytes": 100 * 2**30, "device_kind": "fake",
                                      "jax_version": jax.__version__, "platform": "gpu"}, "stderr_tail": []}
        system = argv[argv.index("--worker") + 1]
        if system == "maxtext_style":  # killed by the kernel: no record
            return {"rc": -9, "json": None, "stderr_tail": ["...", "RESOURCE_EXHAUSTED: out of memory"]}
        return {"rc": 0, "json": _fake_record(system, {"plain_jax": 1000.0, "chunkjax": 800.0,
                                                       "zero_offload_style": 200.0}[system]), "stderr_tail": []}
    return runner


def test_driver_calls_merge_under_one_run_id(tmp_path, capsys):
    log = []
    common = ["--model", "micro", "--batch", "2", "--seq", "16", "--device-budget", "24GiB", "--run-id", "r1",
              "--results-dir", str(tmp_path)]
    assert bench.main(common + ["--systems", "plain_jax,maxtext_style", "--set", "segments=2"],
                      runner=_fake_runner(100.0, log)) == 0
    assert all("segments=2" in argv for argv, _ in log if "--worker" in argv)  # --set reaches the workers
    assert bench.main(common + ["--systems", "zero_offload_style,chunkjax", "--system-budget", "chunkjax=8GiB"],
                      runner=_fake_runner(50.0, log)) == 0
    cj_argv, cj_env = [(a, e) for a, e in log if "chunkjax" in a][-1]  # its own budget and memory fraction
    assert cj_argv[cj_argv.index("--budget-bytes") + 1] == str(8 * 2**30)
    assert cj_env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{8 / 100:.6f}"
    res = json.loads((tmp_path / "bench_r1.json").read_text())
    assert set(res["systems"]) == {"plain_jax", "maxtext_style", "zero_offload_style", "chunkjax"}
    assert [c["matmul_tflops"] for c in res["calls"]] == [100.0, 50.0] and res["matmul_tflops"] == 75.0
    assert len(res["commands"]) == 2 and all(c.startswith("python -m experiments.bench ") for c in res["commands"])
    for k in ("model", "n_params", "batch", "seq", "device_budget_bytes", "matmul_tflops", "run_id",
              "jax_version", "device_kind", "commands"):
        assert res[k] is not None, k
    fpt = CFG.flops_per_token(16)
    p, c = res["systems"]["plain_jax"], res["systems"]["chunkjax"]
    assert math.isclose(p["mfu"], fpt * 1000.0 / 100e12) and p["call"] == 0  # its own call's rate
    assert math.isclose(c["mfu"], fpt * 800.0 / 50e12) and c["call"] == 1
    assert math.isclose(c["mfu_datasheet"], fpt * 800.0 / 990e12)
    # the anchors' units (issue 23 item 4): 6N per token, 989 TFLOP/s, the call's own matmul rate
    n6 = 6 * CFG.n_params
    assert math.isclose(c["model_tflops"], n6 * 800.0 / 1e12)
    assert math.isclose(c["model_tflops_share_989"], n6 * 800.0 / 989e12)
    assert math.isclose(c["model_mfu"], n6 * 800.0 / 50e12) and math.isclose(p["model_mfu"], n6 * 1000.0 / 100e12)
    assert math.isclose(c["host_bytes_per_param"], 123 / CFG.n_params)
    crashed = res["systems"]["maxtext_style"]
    assert crashed["feasible"] is False and "RESOURCE_EXHAUSTED" in crashed["error"]
    for rec in res["systems"].values():
        assert set(bench.ALL_KEYS) <= set(rec)
    # every system subprocess got the budget as the memory fraction and the pinned cap lifted
    assert all(env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.75" for argv, env in log if "--probe" in argv)
    envs = [env for argv, env in log if "--worker" in argv]
    assert all(env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == f"{24 / 100:.6f}" for argv, env in log
               if "--worker" in argv and "chunkjax" not in argv)
    assert all(env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false" and env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] == "110"
               for env in envs)
    # a different setting under the same run_id is refused before any worker runs
    n = len(log)
    assert bench.main(["--model", "micro", "--batch", "4", "--seq", "16", "--device-budget", "24GiB", "--run-id", "r1",
                       "--results-dir", str(tmp_path), "--systems", "plain_jax"], runner=_fake_runner(1.0, log)) == 2
    assert "already holds batch=2" in capsys.readouterr().err
    assert bench.main(common + ["--systems", "plain_jax", "--system-budget", "cj=1GiB"], runner=_fake_runner(1.0, log)) == 2
    assert "--system-budget 'cj=1GiB'" in capsys.readouterr().err
    assert all("--worker" not in argv for argv, _ in log[n:])

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\nearlier text\n")
    section = bench.update_docs(str(tmp_path / "bench_r1.json"), str(docs))
    bench.update_docs(str(tmp_path / "bench_r1.json"), str(docs))  # replaces its own section
    text = docs.read_text()
    assert text.count("<!-- bench:r1:start -->") == 1 and "earlier text" in text
    assert "| chunkjax | yes | 800 |" in section and "0.80x" in section and "4.00x" in section  # vs plain, vs zero
    assert "model TFLOP/s (6N) | of 989T | model MFU |" in section and "host B/param" in section
    assert "python -m experiments.bench --model micro" in section
    assert (tmp_path / "bench_r1_tokens.png").stat().st_size > 1000


def test_anchor_units():
    """6N FLOPs per token (no recompute, no attention term), per device against 989 TFLOP/s and the
    matmul probe; host bytes per parameter; null where an input is missing."""
    from experiments.report import ANCHOR_KEYS, anchor_units
    u = anchor_units(10_000.0, 6_000_000_000, matmul_tflops=600.0, host_bytes=96_000_000_000, n_devices=2)
    assert set(u) == set(ANCHOR_KEYS) == set(bench.ANCHOR_KEYS)
    assert math.isclose(u["model_tflops"], 360.0)
    assert math.isclose(u["model_tflops_share_989"], 180.0 / 989.0) and math.isclose(u["model_mfu"], 0.3)
    assert u["host_bytes_per_param"] == 16.0
    assert anchor_units(None, 10) == dict.fromkeys(ANCHOR_KEYS)


def test_timed_out_worker_keeps_the_steps_it_finished(tmp_path):
    def line(**kw):
        return measure.PROGRESS_TAG + " " + json.dumps(kw)

    tails = {"zero_offload_style": [line(phase="compile", seconds=9.0), line(phase="init", seconds=30.0),
                                    line(phase="warmup", loss=7.0), line(phase="step", seconds=40.0, loss=6.9,
                                                                         update_s=31.0), "Killed"],
             "maxtext_style": [line(phase="compile", seconds=9.0), "still compiling"]}

    def runner(argv, env, timeout, log_path=None):
        if "--probe" in argv:
            return {"rc": 0, "json": {"matmul_tflops": 10.0}, "stderr_tail": []}
        system = argv[argv.index("--worker") + 1]
        return {"rc": 124, "json": None, "timed_out": True, "stderr_tail": tails[system]}

    assert bench.main(["--model", "micro", "--batch", "2", "--seq", "16", "--run-id", "T", "--results-dir",
                       str(tmp_path), "--systems", "zero_offload_style,maxtext_style", "--worker-timeout", "60"],
                      runner=runner) == 0
    res = json.loads((tmp_path / "bench_T.json").read_text())["systems"]
    zo, mx = res["zero_offload_style"], res["maxtext_style"]
    assert zo["feasible"] and zo["step_s_all"] == [40.0] and zo["tokens_per_s"] == 2 * 16 / 40.0
    assert zo["update_s"] == 31.0 and zo["error"] is None and any("timed out" in n for n in zo["notes"])
    assert not mx["feasible"] and mx["error"].startswith("worker timed out after 60") and mx["tokens_per_s"] is None


def test_largest_mode_records_the_largest_ok_config(tmp_path):
    ok = {"micro": True, "tiny": True, "gpt2-small": False}

    def runner(argv, env, timeout, log_path=None):
        if "--probe" in argv:
            return {"rc": 0, "json": {"matmul_tflops": 10.0}, "stderr_tail": []}
        m = argv[argv.index("--model") + 1]
        rec = _fake_record("chunkjax", 10.0)
        rec.update(losses=[6.0, 5.0] if ok[m] else [6.0, 7.0], losses_finite=True, loss_falling=ok[m],
                   model_bytes_per_param=16.0, host_bytes_accounted=5 * 2**30, host_resident_bytes_per_param=12.27)
        return {"rc": 0, "json": rec, "stderr_tail": []}

    argv = ["--largest", "--systems", "chunkjax", "--largest-models", "gpt2-small,micro,tiny", "--largest-seq", "16",
            "--run-id", "L", "--results-dir", str(tmp_path), "--largest-keep-going"]
    assert bench.main(argv, runner=runner) == 0
    res = json.loads((tmp_path / "bench_L.json").read_text())
    block = res["largest"]["chunkjax"]
    n = gpt.get_config("tiny").n_params
    assert block["largest"] == "tiny" and block["largest_n_params"] == n
    assert set(block["tried"]) == {"micro", "tiny", "gpt2-small"} and not block["tried"]["gpt2-small"]["ok"]
    # the plan's bytes per parameter, not a fixed 14 (issue 24 item 1: the plan reports its own)
    assert block["largest_model_bytes"] == int(16 * n) and block["largest_host_resident_bytes_per_param"] == 12.27
    md = bench.render_markdown(res, "bench_L.json", None)
    assert f"(N = {n:,}, model data {16 * n / 2**30:.1f} GiB at 16 B/param, host 5.0 GiB planned (12.27 B/param" in md


def test_bad_input_exits_2(tmp_path, capsys):
    for argv in (["--model", "nope"], ["--systems", "plain_jax,foo"], ["--device-budget", "lots"],
                 ["--model", "micro", "--seq", "4096"]):
        assert bench.main(argv + ["--results-dir", str(tmp_path)], runner=None) == 2
        assert capsys.readouterr().err.startswith("error: ")
    assert not list(tmp_path.iterdir())


# ---- measurements ---------------------------------------------------------------------------

def test_matmul_probe_and_peak_on_cpu():
    assert gm.matmul_tflops(n=64, warmup=1, reps=3) > 0
    assert gm.peak_device_bytes() is None


def test_profile_transfer_bytes_runs_on_cpu(tmp_path):
    f = jax.jit(lambda a: a * 2)
    keep = tmp_path / "kept" / "trace.json.gz"
    r = gm.profile_transfer_bytes(lambda: float(f(jnp.ones(8)).sum()), nvml=False, keep_trace_to=str(keep))
    assert r["result"] == 16.0 and r["profiler_error"] is None and r["calls"] == 1
    assert r["h2d_bytes"] == r["d2h_bytes"] == 0 and r["n_device_events"] == 0 and r["gpu_processes"] == []
    assert r["trace_file"] == str(keep) and gm.parse_trace_transfers(str(keep))["n_h2d"] == 0


class _FakeSystem:
    """The BaselineSystem interface without a model: a scalar state, a falling loss."""

    name = "fake"

    def __init__(self):
        self.cfg, self.dev_sh, self.notes = CFG, None, ["a note"]
        self.last_update_s, self.last_timings = None, {}

    def compiled_memory(self, batch):
        return {"peak_bytes": 10, "argument_bytes": 4, "output_bytes": 4, "temp_bytes": 2, "alias_bytes": 0}

    def init(self, key):
        return jnp.zeros(())

    def step(self, state, batch):
        self.last_update_s, self.last_timings = 0.001, {"update_s": 0.001}
        return state + 1, 6.0 - state

    def host_bytes(self, state):
        return 4


def test_measure_system_protocol_with_the_profiled_step(capsys):
    rec = measure.measure_system(_FakeSystem(), _worker_args("fake", 100, steps=3, profile_on_cpu=True))
    # the progress lines on stderr carry what a worker killed by --worker-timeout measured
    args = _worker_args("fake", 100, steps=3)
    part = measure.partial_from_progress(capsys.readouterr().err.splitlines(), args.batch, args.seq)
    assert part["step_s_all"] == rec["step_s_all"] and part["losses"] == rec["losses"][:4]
    assert part["tokens_per_s"] == rec["tokens_per_s"] and part["update_s"] == 0.001
    assert rec["feasible"] and rec["losses"] == [6.0, 5.0, 4.0, 3.0, 2.0]  # warm-up, 3 timed, profiled
    assert len(rec["step_s_all"]) == 3 and rec["tokens_per_s"] > 0 and rec["update_s"] == 0.001
    assert rec["loss_falling"] and rec["losses_finite"] and rec["host_bytes"] == 4 and rec["notes"] == ["a note"]
    assert rec.get("transfer_source") is None and rec.get("h2d_bytes_per_step_measured") is None  # no GPU/NVML
    assert rec["transfer_detail"]["n_device_events"] == 0


def _meta(pid, name):
    return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}


def _x(pid, name, args=None, tid=1):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": 1.0, "dur": 2.0, "name": name, "args": args or {}}


def test_parser_xla_cupti_format(tmp_path):
    """openxla/xla cupti_collector.cc: MemcpyH2D/D2H activity events on /device:GPU:0 with a
    memcpy_details stat; host-side events (python tracer, API callbacks) are not counted."""
    trace = {"displayTimeUnit": "ns", "traceEvents": [
        _meta(1, "/host:CPU"), _meta(1001, "/device:GPU:0"),
        _x(1, "$bench.py:10 memcpy_helper"),  # python tracer: host process, never counted
        _x(1001, "MemcpyH2D", {"memcpy_details": "kind_src:pinned kind_dst:device size:1048576 dest:0 async:1",
                               "correlation_id": "7"}),
        _x(1001, "MemcpyH2D", {"memcpy_details": "kind_src:pinned kind_dst:device size:1024 dest:0 async:1"}),
        _x(1001, "MemcpyD2H", {"memcpy_details": "kind_src:device kind_dst:pinned size:4096 dest:0 async:1"}),
        _x(1001, "MemcpyD2D", {"memcpy_details": "kind_src:device kind_dst:device size:999 dest:0 async:1"}),
        _x(1001, "cuMemcpyHtoDAsync_v2", {"memcpy_details": "kind_src:pinned kind_dst:device size:1048576"}),
        _x(1001, "fusion_3", {"kernel_details": "regs:32"}),
        _x(1001, "copy_fusion.2"),
    ]}
    path = tmp_path / "plugins" / "profile" / "run1" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as fh:
        json.dump(trace, fh)
    assert gm.find_trace_file(str(tmp_path)) == str(path)
    r = gm.parse_trace_transfers(str(path))
    assert (r["h2d_bytes"], r["n_h2d"], r["d2h_bytes"], r["n_d2h"]) == (1048576 + 1024, 2, 4096, 1)
    assert (r["other_bytes"], r["n_other"], r["n_api_skipped"], r["n_unrecognized"]) == (999, 1, 1, 0)
    assert r["n_device_events"] == 7 and r["gpu_processes"] == ["/device:GPU:0"]
    assert [e["name"] for e in r["copy_kernel_samples"]] == ["copy_fusion.2"]
    assert len(r["events"]) == 3


def test_parser_older_and_nsight_variants():
    trace = {"traceEvents": [
        _meta(7, "/device:GPU:0 (Stream #14)"),
        _x(7, "MemcpyH2D bytes:2048"),                       # TF timeline label
        _x(7, "MemcpyD2H", {"bytes": "512"}),                # bytes arg
        _x(7, "[CUDA memcpy HtoD]", {"size": 100}),          # nvprof name
        _x(7, "Memcpy DtoH (Device -> Pinned)", {"Bytes": "1,000"}),  # Nsight name
        _x(7, "MemcpyH2D", {"memcpy_details": "kind_src:unknown kind_dst:unknown size:8 dest:0 async:0"}),
    ]}
    r = gm.parse_trace_transfers(trace)
    assert (r["h2d_bytes"], r["n_h2d"]) == (2048 + 100 + 8, 3)
    assert (r["d2h_bytes"], r["n_d2h"]) == (512 + 1000, 2)
    # no GPU process at all (e.g. an Nsight export): every process counts
    flat = gm.parse_trace_transfers([_x(3, "Memcpy HtoD", {"bytes": 5}), _x(4, "Memcpy DtoH", {"bytes": 6})])
    assert (flat["h2d_bytes"], flat["d2h_bytes"]) == (5, 6)


def test_parser_keeps_unrecognized_samples():
    trace = {"traceEvents": [_meta(2, "/device:GPU:0")] + [
        _x(2, "MemcpyOther", {"memcpy_details": "kind_src:array kind_dst:array dest:0"}) for _ in range(8)]
        + [_x(2, "Memcpy", {"note": "no size"})]}
    r = gm.parse_trace_transfers(trace, max_samples=3)
    assert r["h2d_bytes"] == r["d2h_bytes"] == 0
    assert r["n_unrecognized"] == 9 and len(r["unrecognized"]) == 3
    assert r["unrecognized"][0]["name"] == "MemcpyOther"


def test_nvml_sampler_field_counters(monkeypatch):
    class Val:
        def __init__(self, v):
            self.nvmlReturn, self.valueType = 0, 1
            self.value = types.SimpleNamespace(uiVal=v % 2**32, ullVal=v)

    counters = {"tx": 2**32 - 100, "rx": 5}

    def get_fields(handle, ids):
        counters["tx"] += 1000  # wraps the 32-bit counter on the first poll
        counters["rx"] += 3000
        return [Val(counters["tx"]), Val(counters["rx"])]

    fake = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: "h", nvmlDeviceGetFieldValues=get_fields)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    s = gm.NvmlPcieSampler(interval_s=0.001).start()
    r = s.stop()
    assert r["available"] and r["estimate"] and r["method"] == "field_counters"
    n = r["samples"]
    assert n >= 1 and r["d2h_bytes_estimate"] == 1000 * n and r["h2d_bytes_estimate"] == 3000 * n


def test_nvml_absent_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    r = gm.NvmlPcieSampler().start().stop()
    assert r["available"] is False and "pynvml" in r["error"]


# ---- last: the worker subprocess ------------------------------------------------------------------

def test_worker_subprocess_returns_every_key(subprocesses):
    rec = json.loads(_wait(subprocesses, "worker").read_text())
    assert set(bench.ALL_KEYS) <= set(rec)
    assert rec["feasible"] is True and rec["error"] is None
    for k in ("peak_device_bytes_measured", "h2d_bytes_per_step_measured", "d2h_bytes_per_step_measured"):
        assert rec[k] is None, k  # the CPU cannot measure them
    assert len(rec["losses"]) == 3 and rec["losses_finite"] and len(rec["step_s_all"]) == 2
    assert rec["tokens_per_s"] > 0 and rec["tflops"] > 0 and rec["update_s"] > 0
    assert rec["host_bytes"] >= 12 * CFG.n_params


def test_chunkjax_refuses_a_plan_over_its_headroom(monkeypatch):
    """When the compiled peak stays above the headroom and re-planning fails, chunkjax reports
    infeasible before initialising (it once ran the over-headroom plan: GPT3_12B at 100 GiB ran
    out of memory in the step). The check is the fit path's (chunkjax.fit), shared with the main job."""
    import chunkjax as cj
    from chunkjax import fit
    from chunkjax.fit import HEADROOM
    from chunkjax.step import ChunkedStep
    from experiments.bench_chunkjax import ChunkjaxSystem
    # the micro GPT with 2 blocks at 2 x 32 tokens (test_chunkjax_init_params_...'s model and batch): the
    # check reads the compiled programs' peaks, whatever the model's size
    system = ChunkjaxSystem(CFG2, 2**30, 2, 32)
    real = ChunkedStep.compiled_memory_programs
    # every program compiles to 2x the budget, and no smaller plan exists
    monkeypatch.setattr(ChunkedStep, "compiled_memory_programs",
                        lambda self, b: [dict(p, peak_device_bytes=2**31) for p in real(self, b)])
    real_plan, calls = fit.plan, []

    def plan_once(problem, b, **kw):  # the first plan, then none
        calls.append(b)
        if len(calls) > 1:
            raise cj.PlanError("no smaller plan", b, False)
        return real_plan(problem, b, **kw)

    monkeypatch.setattr(fit, "plan", plan_once)
    system.init = system.step = None  # must not be reached
    rec = measure.measure_system(system, _worker_args("chunkjax", 2**30, batch=2, seq=32))
    assert rec["feasible"] is False
    assert f"exceeds {HEADROOM:.0%} of the budget" in rec["infeasible_reason"]
    assert "no smaller plan" in rec["infeasible_reason"]


def test_chunkjax_out_of_memory_records_what_held_the_memory(monkeypatch):
    """A run-time out-of-memory keeps the plan and adds the live arrays grouped by shape, dtype
    and memory kind (the GPT3_12B failures left nothing to diagnose them with)."""
    from experiments import bench_chunkjax

    def oom(system, args):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 515.81MiB")

    monkeypatch.setattr(measure, "measure_system", oom)
    keep = jnp.ones((123, 457), jnp.float32)  # a live array the summary must list
    rec = bench_chunkjax.run_chunkjax(_worker_args("chunkjax", 2**30))
    assert rec["feasible"] is False and "RESOURCE_EXHAUSTED" in rec["error"]
    live = rec["live_arrays_at_failure"]
    assert any(g["shape"] == "(123, 457)" and g["bytes"] >= keep.nbytes for g in live["largest_groups"])
    assert rec["schedule_counts"] and rec["n_chunks"] > 0


def test_transfer_phases_per_program():
    """Per program (XLA module) of a profiled step: bytes and GB/s each way, and which programs
    are transfer-bound (a direction busy >= 90 % of the program): a synthetic trace with one
    compute-bound forward, one PCIe-bound update and a copy outside any program."""
    def ev(ts, dur, name, tid, args=None):
        return {"ph": "X", "pid": 1001, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args or {}}

    def thread(tid, name):
        return {"ph": "M", "pid": 1001, "tid": tid, "name": "thread_name", "args": {"name": name}}

    h2d = {"memcpy_details": "kind_src:pinned kind_dst:device size:54000000"}  # 54 MB
    d2h = {"memcpy_details": "kind_src:device kind_dst:pinned size:27000000"}
    trace = {"traceEvents": [
        _meta(1001, "/device:GPU:0"), thread(1, "XLA Modules"), thread(2, "Stream #1(MemcpyH2D)"),
        thread(3, "Stream #2(MemcpyD2H)"), thread(4, "XLA Ops"),
        ev(0, 10_000, "jit_prog(1)", 1), ev(100, 9_000, "fusion", 4),
        ev(1_000, 1_000, "MemcpyH2D", 2, h2d),                       # 1 ms of a 10 ms program
        ev(20_000, 2_000, "jit_upd(2)", 1),
        ev(20_000, 1_000, "MemcpyH2D", 2, h2d), ev(21_000, 950, "MemcpyH2D", 2, h2d),  # busy 97.5 %
        ev(20_500, 500, "MemcpyD2H", 3, d2h),
        ev(30_000, 1_000, "MemcpyD2H", 3, d2h),                      # outside any program
    ]}
    r = gm.transfer_phases(trace)
    by = {p["phase"]: p for p in r["phases"]}
    assert set(by) == {"jit_prog(1)", "jit_upd(2)", "outside programs"}
    fwd, upd = by["jit_prog(1)"], by["jit_upd(2)"]
    assert fwd["h2d_bytes"] == 54_000_000 and fwd["transfer_bound"] == []
    assert fwd["h2d_gb_s"] == pytest.approx(5.4) and fwd["h2d_gb_s_while_busy"] == pytest.approx(54.0)
    assert upd["h2d_bytes"] == 108_000_000 and upd["d2h_bytes"] == 27_000_000
    assert upd["transfer_bound"] == ["h2d"] and upd["h2d_busy_s"] == pytest.approx(1.95e-3)
    assert by["outside programs"]["d2h_bytes"] == 27_000_000
    assert r["step"]["h2d_bytes"] == 162_000_000 and r["step"]["duration_s"] == pytest.approx(0.031)


def test_transfer_phases_from_hlo_module_tags():
    """GPU traces without an "XLA Modules" thread: programs are the runs of kernels tagged with
    one ``hlo_module``; a program whose copies run while no kernel computes is transfer-bound."""
    def ev(ts, dur, name, tid, args):
        return {"ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}

    h2d = {"memcpy_details": "kind_src:pinned kind_dst:device size:10000000", "hlo_module": "jit_upd"}
    trace = {"traceEvents": [
        _meta(7, "/device:GPU:0"),
        ev(0, 5_000, "fusion.1", 1, {"hlo_module": "jit_fwd"}),
        ev(5_000, 5_000, "fusion.2", 1, {"hlo_module": "jit_fwd"}),
        ev(12_000, 100, "fusion.3", 1, {"hlo_module": "jit_upd"}),
        ev(12_100, 600, "MemcpyH2D", 2, h2d),    # no kernel runs meanwhile: exposed
        ev(12_700, 300, "fusion.4", 1, {"hlo_module": "jit_upd"}),
    ]}
    r = gm.transfer_phases(trace)
    by = {p["phase"]: p for p in r["phases"]}
    assert list(by) == ["jit_fwd", "jit_upd"]
    assert by["jit_fwd"]["duration_s"] == pytest.approx(0.010) and by["jit_fwd"]["transfer_bound"] == []
    upd = by["jit_upd"]
    assert upd["duration_s"] == pytest.approx(0.001) and upd["h2d_bytes"] == 10_000_000
    assert upd["copy_only_s"] == pytest.approx(0.0006) and upd["transfer_bound"] == ["h2d"]


def test_chunkjax_init_params_losses_match_plain_jax_step_by_step():
    """``--set init=init_params``: chunkjax starts from the baselines' params, so its losses equal
    plain_jax's step by step (the GPU check of a big model's arithmetic, bench
    ``losses_vs_plain_jax``); a budget that forces host chunks keeps the host update in the path
    (the micro GPT with 2 blocks: device, streamed and host chunks at 2.5 MB)."""
    from experiments.bench_chunkjax import ChunkjaxSystem
    batch, seq = 2, 32

    norms = {"plain_jax": [], "chunkjax": []}

    def losses(system, name):
        b = measure.make_batch(CFG2, batch, seq, 0, getattr(system, "dev_sh", None))
        state, out = system.init(jax.random.key(0)), []
        for _ in range(3):
            if name == "plain_jax":  # the reference norm: plain JAX's gradients at its params before its step
                g = bl.loss_and_grads(CFG2, bl.to_compute(state["master"]), b)[1]
                norms[name].append(float(optax.tree.norm(jax.tree.map(lambda a: a.astype(jnp.float32), g))))
            state, loss = system.step(state, b)
            out.append(float(loss))
            if name == "chunkjax":
                norms[name].append(float(system.last_grad_norm))  # what the bench records as grad_norms
        return out

    plain = {"losses": losses(bl.build("plain_jax", CFG2), "plain_jax")}
    system = ChunkjaxSystem(CFG2, 2_500_000, batch, seq, init="init_params")
    assert {"host", "device"} <= set(system.schedule.update_locations)
    rec = {"losses": losses(system, "chunkjax"), "init": system.init_rule}
    # bf16 gradients summed in float32: the global norm to bf16's rounding (8 mantissa bits)
    np.testing.assert_allclose(norms["chunkjax"], norms["plain_jax"], rtol=1e-2)
    assert min(norms["plain_jax"]) > 0
    cmp = bench.compare_losses({"plain_jax": plain, "chunkjax": rec})
    assert cmp["chunkjax"]["steps"] == 3 and plain["losses"][-1] < plain["losses"][0] - 0.05
    # bf16 compute: ~2e-5 relative; one skipped or doubled update moves the loss by ~1e-2
    assert cmp["chunkjax"]["max_rel_diff"] < 5e-4, (plain["losses"], rec["losses"])
    assert bench.compare_losses({"plain_jax": plain, "chunkjax": dict(rec, init="leafwise")}) == {}
    with pytest.raises(ValueError, match="init="):
        ChunkjaxSystem(CFG2, 2_500_000, batch, seq, init="zeros")



def test_largest_plan_takes_a_gpu_runs_stage_temporaries(tmp_path):
    """experiments/gpu_checks/largest_plan.py --gpu-temps: each stage's temporaries are those a GPU run
    of a model of the same width, heads and vocabulary recorded at the same batch (blocks take its
    h_0); a record of another width or batch is refused."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "experiments" / "gpu_checks" / "largest_plan.py"
    spec = importlib.util.spec_from_file_location("largest_plan", path)
    lp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lp)
    p, cfg = lp.prepare("micro", 2, 16)
    temps = {"embed": 1111, "h_0": 2222, "head": 3333}
    rec = tmp_path / "bench_x.json"
    rec.write_text(json.dumps({"model": "micro", "batch": 2, "seq": 16,
                               "systems": {"chunkjax": {"extra": {"stage_temp_bytes": temps}}}}))
    q = lp.with_gpu_temps(p, cfg, str(rec), 2, 16)
    names = [t.name for t in p.traces]
    assert names[0] == "embed" and names[-1] == "head" and len(names) == cfg.n_layers + 2
    assert [t.temp_bytes for t in q.traces] == [1111] + [2222] * cfg.n_layers + [3333]
    assert [dataclasses.replace(t, temp_bytes=0) for t in q.traces] == [dataclasses.replace(t, temp_bytes=0)
                                                                        for t in p.traces]
    with pytest.raises(ValueError, match="not micro's width"):
        lp.with_gpu_temps(p, cfg, str(rec), 4, 16)
