"""Host-memory bounds of checkpoints (issue 21, item 5), measured as peak RSS growth in a fresh
process (tests/checkpoint_memory_worker.py: a 0.875 GiB ChunkedStep state in 7 chunks of 128 MiB,
half device-, half host-updated; chunks above glibc's 32 MiB mmap threshold, as the 256 MiB chunks of
the 1.5 GiB state this file used before: the same growth in chunks, measured side by side) against the bounds documented in chunkjax/checkpoint (the package docstring):

* save_checkpoint: at most two chunks beyond the state (a device chunk's host copy and orbax's
  encoded copy of it while it writes);
* save_checkpoint_async with ``max_inflight_bytes`` of one chunk: at most
  ``max(max_inflight_bytes, 2 chunks)`` (the bound covers orbax's copy of the chunk being
  written; before the fix it counted only the snapshots and grew 3.1 chunks here);
* restore_checkpoint: the restored state plus at most two chunks (the chunk read and its placed
  copy).

Each bound is allowed half a chunk for what the C allocator keeps (measured growth above the
bounds' own buffers: under a quarter of a chunk) and the interpreter's own small allocations.
Measured with 128 MiB chunks: save 1.2 chunks, async 2.0, restore the state plus 1.0.
"""
import json
import os
import subprocess
import sys

import pytest

from _multiprocess import cpu_env

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    env = cpu_env(1)  # one CPU device (the state's device chunks are one buffer each), the suite's other XLA flags
    r = subprocess.run([sys.executable, os.path.join(HERE, "checkpoint_memory_worker.py"),
                        str(tmp_path_factory.mktemp("memory"))], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["state_bytes"] >= 0.85 * 2**30 and out["n_chunks"] >= 6, out
    return out


def _slack(m):
    return m["chunk_bytes"] // 2


def test_save_within_two_chunks(measured):
    m, chunk = measured, measured["chunk_bytes"]
    assert m["save"]["growth"] <= 2 * chunk + _slack(m), m


def test_async_save_within_its_bound(measured):
    m, chunk = measured, measured["chunk_bytes"]
    bound = max(chunk, 2 * chunk)  # max_inflight_bytes = one chunk
    assert m["async"]["growth"] <= bound + _slack(m), m


def test_restore_within_two_chunks_beyond_the_state(measured):
    m, chunk = measured, measured["chunk_bytes"]
    assert m["restore"]["after"] >= 0.9 * m["state_bytes"], m  # the restored state itself is held
    assert m["restore"]["growth"] <= m["state_bytes"] + 2 * chunk + _slack(m), m
