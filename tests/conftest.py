"""Test-wide settings: 8 forced host devices for multi-device logic (set before jax is imported),
the CPU backend, and jax's persistent compilation cache in a fresh folder for this session only
(many tests and their subprocesses compile the same programs; removed when the session ends)."""
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="chunkjax_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE  # inherited by subprocesses and notebook kernels
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
else:
    _CACHE = None


def pytest_sessionfinish(session, exitstatus):
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


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
    tests/test_train_multiprocess.py's settings (micro GPT, float32, 3 steps of 8 rows, evaluation
    and checkpoints at steps 2 and 3, a 4-token sample): its run folder, read only. The
    single-process reference of tests/test_train_multiprocess.py and the ZeRO-3 run of
    tests/test_train_job.py (compared there with the same settings at ``--zero-stage 0``), trained once."""
    from _shared_data import bpe512_cache
    from test_train_multiprocess import _args

    from experiments import train
    out = tmp_path_factory.mktemp("zero3_job_one_process")
    assert train.main(_args(bpe512_cache(), out)) == 0
    (run,) = out.iterdir()
    return run
