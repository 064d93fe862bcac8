"""Test-wide settings: 8 forced host devices for multi-device logic (set before jax is imported),
the CPU backend, and jax's persistent compilation cache in a fresh folder for this session only
(many tests and their subprocesses compile the same programs; removed when the session ends), and
a folder for set-ups built once per session and shared by the xdist workers
(``CHUNKJAX_TEST_SHARED_DIR``: tests/_shared_data.py's bpe512 cache; removed likewise).

Under ``pytest -n N --dist loadfile`` (``make test``) each test file is one
unit of work for an xdist worker, files that share a per-process set-up are one unit
(:data:`SHARED_SETUP`: a session fixture or a cached load is built once per worker), and the units
are handed out heaviest first (:data:`FILE_SECONDS`), so that the workers finish together. Which
tests run is never changed, only their order and worker."""
import os
import shutil
import tempfile

import pytest

# (as the Makefile's test target: XLA's Eigen ops on one thread each, since the xdist workers and the
# 8 forced devices already use every core; 8-16 % less CPU time on the 2-core machine)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_cpu_multi_thread_eigen=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="chunkjax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by subprocesses and notebook kernels
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
else:
    _CACHE = None
if "CHUNKJAX_TEST_SHARED_DIR" not in os.environ:  # set-ups built once per session (tests/_shared_data.py)
    _SHARED = tempfile.mkdtemp(prefix="chunkjax_test_shared_")
    os.environ["CHUNKJAX_TEST_SHARED_DIR"] = _SHARED  # inherited by the xdist workers
else:
    _SHARED = None


#: test files that share an expensive per-process set-up -> the one xdist unit they run in
SHARED_SETUP = {
    "test_train_job": "zero3_job", "test_train_multiprocess": "zero3_job",  # zero3_job_single_process
    "test_checkpoint_multiprocess": "zero3_two_processes", "test_zero_multiprocess": "zero3_two_processes",
    "test_lora": "smollm2", "test_finetune": "smollm2", "test_pretrained": "smollm2",  # _shared_data.smollm2_135m
}
#: seconds per test file in a 2-worker run of the suite (a hint for the order only: a file not
#: listed counts as DEFAULT_FILE_SECONDS; refresh from ``--junitxml`` when the suite changes much)
FILE_SECONDS = {
    "train_job": 162, "lora": 162, "train_equivalence": 122, "schedule": 99, "front_door": 116,
    "finetune": 88, "disk_tier": 120, "host_bytes": 93, "flax_api": 87, "bench": 85, "notebooks": 86,
    "zero_schedule": 85, "overlap": 90, "cross_step": 90, "clip_plan": 50, "checkpoint_memory": 64, "checkpoint_integrity": 64,
    "train_multiprocess": 61, "bench_storage": 58, "storage": 56, "checkpoint_multiprocess": 52,
    "plan_cli": 50, "checkpoint": 47, "speculation_resume": 45, "checkpoint_flax": 45, "checkpoint_async": 38, "hf": 43,
    "checkpoint_storage": 40, "layout": 38, "frozen": 38, "zero": 37, "host_update": 36, "cases": 33,
    "user_reports": 33, "sweep": 21, "zero_mixed_precision": 31, "checkpoint_zero": 27, "placement_export": 26,
    "host_deadline": 21, "gpt": 20, "plots": 13, "pretrained": 10, "fit_checks": 7, "peers": 3, "host_pool": 3,
    "data": 2, "tide_eviction": 2, "zero_multiprocess": 1,
    # session 14, measured alone (CPU seconds x 1.6, the ratio of train_job's and front_door's listed
    # seconds to their CPU time); unlisted they counted 30 each
    "inprogram_micro": 80, "masked_loss": 37, "accumulate_memory": 25, "train_job_errors": 18, "overlap_window": 1,
    "host_ledger": 30, "live_device_bytes": 12, "dropin_duplex": 12, "rates_record": 10,
    "rollback": 20,  # session 15, measured alone: 13 s
    "storage_host_memory": 50, "init_state": 15,  # session 16, measured alone: 48 s, 12 s
    # session 15, from a 2-worker run of the whole suite (its seconds / 1.3, that run's ratio to the listed ones)
    "compiled_check": 30, "plan_memo": 1,
    "micro_groups": 60,  # session 16, measured alone: 31-85 s (a shared box)
    "remat": 110,  # measured alone on a shared 2-core box: 86 s + the CUDA export test + the tight host budget (~10 s)
    "micro_cuts": 105,  # session 17, measured alone: 105 s
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
