"""The disk budget counts the chunk files a step writes beside the committed ones (session 21 on the
H200: GPT3_18B planned 108 chunk files of 0.636 GB in exactly its directory's 68.67 GB of free
space, with ``keep_previous=False``, and its first step stopped with ENOSPC while writing chunk 106)."""
import os
import threading

import numpy as np
import pytest

from chunkjax.plan_disk import DISK_VERSIONS, disk_chunks_fit
from chunkjax.storage import DiskTier, StorageError
from chunkjax.storage.files import _Shard
from chunkjax.storage.tier import IO_THREADS


def test_disk_chunks_fit_counts_the_files_in_flight():
    f = 636_000_000
    budget = 68_672_581_632  # s21b2's directory: 107.97 files
    assert disk_chunks_fit(budget, f, 1, 1) == 107 - IO_THREADS
    assert disk_chunks_fit(budget, f, 1, 2) == 107 - 2 * IO_THREADS
    assert disk_chunks_fit(budget, f, DISK_VERSIONS, 1) == 107 // 2 == 53  # every new file beside its old one
    assert disk_chunks_fit(f, f, 1, 1) == 0  # never negative


@pytest.mark.parametrize("keep_previous", [False, True])
def test_a_step_never_holds_more_chunk_files_than_the_plan_counts(tmp_path, monkeypatch, keep_previous):
    """A real tier over random chunks: the most chunk files on disk at any moment of a step (counted
    after every write) is what :func:`disk_chunks_fit` leaves room for: n + IO_THREADS files with
    ``keep_previous=False``, 2n with the two-phase commit; and the state after the steps is exact."""
    rng = np.random.default_rng()
    n, size = int(rng.integers(6, 11)), int(rng.integers(1000, 3000))
    d = tmp_path / "d"
    tier = DiskTier([d], [size] * n, n_buffers=IO_THREADS + 3, read_ahead=1, keep_previous=keep_previous,
                    fsync=False)
    x0 = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    tier.initialize(lambda c: x0[c])
    file_bytes = tier.shards[0].file_bytes(0)
    most, lock, write, unlink = [0], threading.Lock(), _Shard.write_from, _Shard._unlink

    def count():
        with lock:
            most[0] = max(most[0], sum(1 for e in os.scandir(d) if e.name.startswith("chunk")))

    def counted_write(self, c, step, buf):
        write(self, c, step, buf)
        count()

    def counted_unlink(self, name):
        count()  # the new file is written, the old one not yet gone
        unlink(self, name)

    monkeypatch.setattr(_Shard, "write_from", counted_write)
    monkeypatch.setattr(_Shard, "_unlink", counted_unlink)
    delta = rng.standard_normal(n).astype(np.float32)
    for _ in range(3):
        tier.update(lambda c, v: v[0].__iadd__(delta[c]))
    versions = DISK_VERSIONS if keep_previous else 1
    least = (n + IO_THREADS if versions == 1 else 2 * n) * file_bytes  # the least budget the plan puts n chunks in
    assert disk_chunks_fit(least, file_bytes, versions, 1) == n
    assert disk_chunks_fit(least - 1, file_bytes, versions, 1) == n - 1
    assert n < most[0] * file_bytes // file_bytes <= least // file_bytes, (most[0], n)
    for c in range(n):
        np.testing.assert_array_equal(tier.read_chunk(c)[0], x0[c] + delta[c] + delta[c] + delta[c])
    tier.close()
