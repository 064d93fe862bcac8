"""Test-wide settings: 8 forced host devices for multi-device logic (set before jax is imported),
the CPU backend, XLA CPU flags that cut compile time (:data:`COMPILE_FLAGS`), jax's persistent
compilation cache in a fresh folder for this session only (many tests and their subprocesses
compile the same programs; removed when the session ends, also one ended by SIGTERM: :func:`_terminated`), and
a folder for set-ups built once per session and shared by the xdist workers
(``CHUNKJAX_TEST_SHARED_DIR``: tests/_shared_data.py's bpe512 cache; removed likewise).

Under ``pytest -n N --dist loadfile`` (``make test``) each test file is one
unit of work for an xdist worker, files that share a per-process set-up are one unit
(:data:`SHARED_SETUP`: a session fixture or a cached load is built once per worker), and the units
are handed out heaviest first (:data:`FILE_SECONDS`), so that the workers finish together. Which
tests run is never changed, only their order and worker."""
import os
import shutil
import signal
import tempfile

import pytest

# (as the Makefile's test target: XLA's Eigen ops on one thread each, since the xdist workers and the
# 8 forced devices already use every core; 8-16 % less CPU time on the 2-core machine)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_cpu_multi_thread_eigen=false")
#: XLA CPU flags that cut the suite's compile time, added to XLA_FLAGS where it does not name them (so
#: also under an explicit XLA_FLAGS, and inherited by subprocesses and notebook kernels): XLA's older
#: LLVM-IR fusion emitter instead of the MLIR one (which builds an MLIR context and pass pipeline per
#: fusion), and each program's LLVM module compiled whole instead of split for parallel codegen.
#: Session 23: the programs test_remat compiles, recompiled alone, 24-28 -> 6.6 CPU-s; the suite's
#: numbers are in the Makefile's note. Both programs of a comparison (library and optax reference)
#: are compiled with the same flags.
COMPILE_FLAGS = {"--xla_cpu_use_fusion_emitters": "false", "--xla_cpu_parallel_codegen_split_count": "1"}
_flags = os.environ["XLA_FLAGS"].split()
_named = {f.split("=", 1)[0] for f in _flags}
os.environ["XLA_FLAGS"] = " ".join(_flags + [f"{k}={v}" for k, v in COMPILE_FLAGS.items() if k not in _named])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="chunkjax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by subprocesses and notebook kernels
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program: a repeat of a small one is a disk read
else:
    _CACHE = None
if "CHUNKJAX_TEST_SHARED_DIR" not in os.environ:  # set-ups built once per session (tests/_shared_data.py)
    _SHARED = tempfile.mkdtemp(prefix="chunkjax_test_shared_")
    os.environ["CHUNKJAX_TEST_SHARED_DIR"] = _SHARED  # inherited by the xdist workers
else:
    _SHARED = None


def _terminated(signum, frame):
    """SIGTERM (``kill``, ``timeout``, a CI runner's stop) ends the session as Ctrl-C does: pytest
    unwinds the running test (its finalizers) and runs :func:`pytest_sessionfinish`, which removes
    the two folders above (by default SIGTERM killed the process and left them in the temp
    folder). A second SIGTERM kills at once (the default is back)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"terminated by {signal.Signals(signum).name}")


if (_CACHE or _SHARED) and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # not where a launcher chose otherwise
    signal.signal(signal.SIGTERM, _terminated)


#: test files that share an expensive per-process set-up -> the one xdist unit they run in
SHARED_SETUP = {
    "test_train_job": "zero3_job", "test_train_multiprocess": "zero3_job",  # zero3_job_single_process
    "test_checkpoint_multiprocess": "zero3_two_processes", "test_zero_multiprocess": "zero3_two_processes",
    "test_lora": "smollm2", "test_finetune": "smollm2", "test_pretrained": "smollm2",  # _shared_data.smollm2_135m
}
#: seconds per test file in a 2-worker run of the suite (a hint for the order only: a file not
#: listed counts as DEFAULT_FILE_SECONDS; refresh from ``--junitxml`` when the suite changes much).
#: Session 17: one ``make test``-like run (2 workers, cold numba and XLA caches as in CI) on a shared
#: 2-core box (~3.5x slower than CI), its junit seconds / 2; a file's first test carries its module
#: fixtures and the first use of each numba kernel (compiled once per clone: most of test_rollback's);
#: overlap, micro_groups, host_bytes and inprogram_micro scaled by their after/before ratio of the
#: shared optax reference (tests/_optax_reference.py), measured back to back
FILE_SECONDS = {
    "micro_groups": 63, "host_bytes": 72, "overlap": 54, "storage": 84, "zero_schedule": 37, "front_door": 49,
    "checkpoint_memory": 24, "plan_cli": 54, "cases": 47, "cross_step": 43, "flax_api": 35, "schedule": 28,
    "rollback": 80, "bench": 66, "checkpoint_flax": 62, "hf": 34, "bench_storage": 61, "checkpoint_multiprocess": 64,
    "zero": 59, "user_reports": 75, "checkpoint": 63, "storage_host_memory": 51, "notebooks": 28, "layout": 53,
    "disk_tier": 56, "train_job": 61, "inprogram_micro": 59, "checkpoint_integrity": 42, "host_update": 50,
    "masked_loss": 47, "gpt": 18, "lora": 40, "plots": 39, "frozen": 34, "checkpoint_storage": 36,
    "zero_mixed_precision": 32, "train_equivalence": 35, "checkpoint_zero": 32, "checkpoint_async": 31,
    "compiled_check": 27, "finetune": 29, "host_ledger": 25, "fit_checks": 24, "placement_export": 22,
    "rates_record": 22, "host_deadline": 17, "train_multiprocess": 20, "live_device_bytes": 17, "sweep": 15,
    "dropin_duplex": 22, "train_job_errors": 8, "init_state": 6, "peers": 6, "host_pool": 6, "zero_multiprocess": 4,
    "data": 4, "accumulate_memory": 4, "pretrained": 3, "tide_eviction": 1, "plan_memo": 1, "overlap_window": 1,
    # added after that run, measured alone on the shared box: clip_plan, speculation_resume, remat, micro_cuts,
    # host_contention (session 18: 5.8 s with its imports, 3 s of it tests);
    # inprogram_micro now compiles each stage's micro-batch loop (mb8gap)
    "clip_plan": 45, "speculation_resume": 45, "remat": 52, "micro_cuts": 41, "host_contention": 3, "tied_loop": 5,
    # session 18 (suite18): clip_plan, remat scaled by their after/before CPU seconds measured back to back
    # alone (frozen, speculation_resume: no change measurable, kept)
    # session 19 (ux19): train_job +7 (extending a finished run: two short job runs, 13 s on the shared box),
    # checkpoint +3 (the orbax-noise worker subprocess, 7 s), front_door +5 (nonfinite="error" through offload)
    # session 19 (suite19b): cases, flax_api, schedule, bench scaled by their after/before CPU seconds measured
    # side by side alone (fresh compile caches); checkpoint_memory (I/O-bound: its junit seconds are wall) by
    # its wall seconds, 58 -> 15 (CPU 31 -> 16)
    # session 19 (suite19a): micro_groups, host_bytes, overlap, storage, zero_schedule, inprogram_micro, remat,
    # micro_cuts scaled likewise (each file alone, a fresh compilation cache, base and branch back to back)
    # session 19 (fresh19): nonfinite_count, eager optax on a 4-element chunk, 4 s with its imports
    # session 20 (suite20a): host_bytes, cross_step, schedule, zero_mixed_precision, compiled_check,
    # inprogram_micro scaled by their after/before CPU seconds (main's file and the branch's alone, back to back
    # in one worktree, fresh XLA caches); micro_cuts by its planner test's saving only (-3.5 of 47 s: the file's
    # own ratio, 0.79, was measured under a changing load); accumulate_memory within the noise: kept
    "nonfinite_count": 2,  # train_job_errors +1 (schedule_note: no jit)
    # session 20 (ux20): readme, the README's own-model block and its nnx.Optimizer twin, 14.6 s alone
    "readme": 15,
    # session 20 (suite20b): front_door (107.9 -> 97.0), checkpoint_flax (41.1 -> 37.1), storage_host_memory
    # (34.6 -> 31.3) scaled by their after/before CPU seconds (each file alone, a fresh compilation cache, base and
    # branch back to back on the shared box); train_job by its one changed test's 2.1 s (the file's 99.6 -> 92.1
    # is mostly the box's noise)
    # session 20 (fresh20): front_numpy_batch, numpy int64/float64 batches through offload, 9 s alone
    "front_numpy_batch": 9,
    # session 21 (drop21): dropin_duplex +8 (test_lean_streamed_chunks_move_their_state_only: 7.7 s alone)
    # session 21 (ux21): user_reports +18 (a step failing after the norm, 14 s alone; offload's micro-batch
    # recipe against optax, two offload builds, 21-27 s alone), train_job +4 (a bare --resume, 7.6 s alone)
    # session 21 (suite21a): notebooks (CPU 62.0 -> 49.4 s), host_deadline (17.8 -> 14.8), host_ledger (its bench
    # worker test, junit 9.5 -> 8.0) scaled by their after/before seconds (each file alone, a fresh compilation
    # cache, base and branch back to back); checkpoint_integrity by the 6 s of peer deadlines no longer waited
    # session 21 (suite21b): gpt (20.6 -> 9.0: abstract_params traces one block), frozen (37.3 -> 32.6: a jitted
    # init_params) scaled by their after/before CPU seconds (each file alone, a fresh compilation cache, main and
    # the branch back to back); train_equivalence, disk_tier, compiled_check, plan_cli, bench, layout: no change
    # measurable on the shared box, kept
    # session 21 (lead): disk_budget, a real tier's files counted after every write, 4 s alone
    "disk_budget": 4,
    # session 21 (lead): checkpoint +3 (save_checkpoint keep=: three saves and a restore, 3 s alone)
    # session 22 (ux22): launch_signals, scenarios started as background jobs of sh (small subprocesses, one a
    # pytest session) and a terminal Ctrl-C to a near-storage trainer and its workers, 8.8 s CPU / 12 s wall alone
    "launch_signals": 12,
    # session 23 (suite23): XLA's LLVM-IR fusion emitter and whole-module codegen (COMPILE_FLAGS): remat, front_door,
    # storage, micro_cuts, cases, cross_step, plan_cli, flax_api, hf, schedule, zero_schedule, notebooks, bench_storage
    # scaled by their after/before CPU seconds (each file alone, main and the branch back to back, fresh caches);
    # rollback (numba compiles, 47 -> 50) kept; the files not measured save likewise where they compile
    # session 25 (leak25): storage +3 (an optimizer dropped without close: two workers, ~5 CPU-s alone), disk_tier +2
    # (a failed init's workers: one more storage init, ~8 CPU-s alone with its plan)
    # session 26 (leak26): disk_tier +3 (DiskState.close past its deadline: one worker, ~4 CPU-s alone; the whole
    # file, main and the branch back to back, 81 -> 71 CPU-s: the shared box's noise)
}
DEFAULT_FILE_SECONDS = 30


def _cost(unit: str) -> float:
    files = [f for f, u in SHARED_SETUP.items() if u == unit] or [unit.rsplit("/", 1)[-1].removesuffix(".py")]
    return sum(FILE_SECONDS.get(f.removeprefix("test_"), DEFAULT_FILE_SECONDS) for f in files)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist, never called
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the units described in this module's docstring (xdist's own
    ``loadgroup`` cannot merge files under pytest 9: it renames node ids through an attribute
    pytest no longer reads)."""
    if config.getoption("dist", "no") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return SHARED_SETUP.get(path.rsplit("/", 1)[-1].removesuffix(".py"), path)

        def _assign_work_unit(self, node) -> None:
            if not self.ordered:  # the first call: every unit is queued; heaviest first (a stable sort)
                self.workqueue = OrderedDict(sorted(self.workqueue.items(), key=lambda kv: -_cost(kv[0])))
                self.ordered = True
            super()._assign_work_unit(node)

    return SharedSetupScheduling(config, log)


def pytest_sessionfinish(session, exitstatus):
    for d in (_CACHE, _SHARED):  # made by this process (the xdist controller, or a run without xdist)
        if d:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def zero3_two_process_run(tmp_path_factory):
    """tests/checkpoint_multiprocess_worker.py run once as a 2-process ``jax.distributed`` job (4
    forced CPU devices each; ZeRO-3 on the micro GPT of tests/zero_multiprocess_worker.py, a
    checkpoint after step 2, resumed): ``(seed, out.npz, checkpoint folder)``, read only. Shared by
    tests/test_checkpoint_multiprocess.py and tests/test_zero_multiprocess.py."""
    import numpy as np
    from _multiprocess import run_processes
    seed = int(np.random.default_rng().integers(1 << 30))
    d = tmp_path_factory.mktemp("zero3_two_processes")
    out, ckpt = d / "out.npz", d / "ckpt"
    run_processes("checkpoint_multiprocess_worker.py", lambda i: (seed, ckpt, out))
    return seed, out, ckpt


@pytest.fixture(scope="session")
def zero3_job_single_process(tmp_path_factory):
    """The main job's ``--zero-stage 3`` run over this process's 8 forced CPU devices with
    tests/test_train_multiprocess.py's settings (micro GPT with 2 blocks, float32, 3 steps of 8 rows, evaluation
    and checkpoints at steps 2 and 3, a 4-token sample): its run folder, read only. The
    single-process reference of tests/test_train_multiprocess.py and the ZeRO-3 run of
    tests/test_train_job.py (compared there with the same settings at ``--zero-stage 0``), trained once."""
    from _shared_data import bpe512_cache, two_block_micro
    from test_train_multiprocess import _args

    from experiments import train
    out = tmp_path_factory.mktemp("zero3_job_one_process")
    with two_block_micro():  # the micro GPT of those tests' runs
        assert train.main(_args(bpe512_cache(), out)) == 0
    (run,) = out.iterdir()
    return run


@pytest.fixture
def default_sigint():
    """SIGINT as a Python process started from a terminal has it (``KeyboardInterrupt``) for a test
    that raises it in this process, restored after. A suite started as a background job of a
    non-interactive shell (``make test &`` in a script, some CI runners) runs with SIGINT ignored
    (POSIX: SIG_IGN, inherited across exec by pytest, its xdist workers and their subprocesses),
    and Python then installs no handler: session 20's three failures (docs/benchmarks.md). A
    subprocess that needs SIGINT sets its own handler (tests/checkpoint_noise_worker.py);
    tests/test_launch_signals.py launches both kinds so and checks that every test naming SIGINT
    asks for this fixture."""
    import signal
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.fixture(autouse=True)
def _no_signal_hold_left_open():
    """Every test ends with the process's signal hold closed (chunkjax.step_commit.open_holds): a
    hold left open by a pending step never committed would keep SIGINT/SIGTERM from every later
    test of the worker (session 22: a drop-in update's hold opened after its threads, a 12-minute
    hang). Imported lazily so that tests which never import chunkjax pay nothing."""
    yield
    import sys
    sc = sys.modules.get("chunkjax.step_commit")
    if sc is not None and sc.open_holds():
        n = sc.release_holds()  # the next tests run with signals delivered
        pytest.fail(f"{n} signal hold(s) of chunkjax.step_commit left open by this test: commit or close every "
                    "pending step (PendingStep) it began")


@pytest.fixture(autouse=True)
def _no_storage_worker_left_alive():
    """Every test ends with no near-storage worker process (:mod:`chunkjax.storage.worker`) alive
    that it started: whoever owns the workers (``NearStorageOptimizer.close``, ``DiskState.close``,
    ``chunkjax.storage.updater.close_storage``) stops them on every path, success or failure (a clean
    clone's ``make test``: a job's worker, freed only by a later garbage collection, was still alive
    in a later test of the same xdist worker). Workers alive before the test (a module fixture's)
    are not counted. Costs nothing where the storage pool was never imported."""
    import multiprocessing
    import sys

    def workers():  # none without the pool (chunkjax.storage.pool starts them)
        if "chunkjax.storage.pool" not in sys.modules:
            return {}
        return {p.pid: p for p in multiprocessing.active_children() if p.name.startswith("near_storage_")}

    before = set(workers())
    yield
    left = [p for pid, p in workers().items() if pid not in before]
    if left:
        pytest.fail(f"{len(left)} near-storage worker process(es) left alive by this test (pids "
                    f"{[p.pid for p in left]}): close the NearStorageOptimizer / DiskState (or the step's storage: "
                    "chunkjax.storage.updater.close_storage) on every path")
