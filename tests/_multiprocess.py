"""Launching a localhost ``jax.distributed`` job for the multi-process tests (not a test itself)."""
import os
import re
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_env(devices: int) -> dict:
    """This process's environment for a CPU child with ``devices`` forced host devices: the other
    XLA flags kept (the suite's ``--xla_backend_optimization_level=0``: the children compile as
    fast as the tests, and the same programs as their single-process references)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", "")).split()
    return dict(os.environ, XLA_FLAGS=" ".join([f"--xla_force_host_platform_device_count={devices}", *flags]),
                JAX_PLATFORMS="cpu")


def run_processes(script: str, args_of, n: int = 2, devices_each: int = 4, timeout: float = 300) -> None:
    """Run ``tests/<script>`` as ``n`` processes on CPU (``devices_each`` forced devices each),
    process ``i`` with argv ``[i, n, port, *args_of(i)]`` (strings) and a free localhost port;
    waits for all, kills any still running on error, and asserts every exit status is 0 (the
    failure message holds the tail of each process's output)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = cpu_env(devices_each)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), str(n), str(port),
                               *map(str, args_of(i))], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(n)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
