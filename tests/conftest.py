"""Test-wide settings: 8 forced host devices for multi-device logic (set before jax is imported),
the CPU backend, and jax's persistent compilation cache in a fresh folder for this session only
(many tests and their subprocesses compile the same programs; removed when the session ends)."""
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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
