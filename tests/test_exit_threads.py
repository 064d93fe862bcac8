"""No chunkjax thread outlives the final wait, and a process that exits with a step's host work
still running finishes it first (:func:`chunkjax.host_work.join_at_exit`).

On the GPU a daemon host thread still inside a kernel or a JAX call at interpreter finalization
aborted the bench worker ("FATAL: exception not rethrown", exit -6) after its steps had run:
the speculated path (clipping that never fires) with cross-step overlap, whose last step's host
work nothing joined. A CPU run of that path exits 0 even without the fix (the abort needs the
thread to be inside native code at the moment of finalization); these tests check its cause: the
threads alive after the final wait, and unjoined work finished at exit.
"""
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from chunkjax import host_work, speculate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chunkjax_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("chunkjax") and t.is_alive()]


def _backup_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("chunkjax-backup") and t.is_alive()}


def test_join_ends_the_host_thread():
    """After HostWork.join no host-update thread of it is alive (joined, not merely told to stop)."""
    before = set(host_work.live_threads())  # idle threads of steps other tests of this worker left unjoined
    work = host_work.HostWork(deadline_s=60)
    done = []
    work.submit(lambda: (time.sleep(0.05), done.append(1), 0.25)[-1])
    mine = set(host_work.live_threads()) - before
    assert len(mine) == 1 and all(t.name == "chunkjax-host-update" for t in mine)
    assert work.join() == 0.25 and done == [1]
    assert set(host_work.live_threads()) - before == set() and not any(t.is_alive() for t in mine)


def test_a_join_past_its_deadline_leaves_no_thread_behind():
    """HostWork.join past its deadline raises at once; the update not started yet never runs (it
    fails with the deadline's error), and the host thread ends once the stalled update returns
    (before: it then waited forever on a queue nobody closed)."""
    before = set(host_work.live_threads())
    work = host_work.HostWork(deadline_s=0.2)
    release, ran = threading.Event(), []
    work.submit(lambda: (release.wait(30), 0.0)[-1])  # stalls past the deadline
    later = work.submit(lambda: (ran.append(1), 1.0)[-1])
    mine = set(host_work.live_threads()) - before
    assert len(mine) == 1
    with pytest.raises(host_work.HostDeadlineError, match="within 0.2 s"):
        work.join()
    assert isinstance(later.exception(timeout=5), host_work.HostDeadlineError)
    release.set()
    for t in mine:
        t.join(10)
    assert not any(t.is_alive() for t in mine) and ran == []
    assert set(host_work.live_threads()) - before == set()


def test_backup_pool_close_ends_its_copy_threads():
    """BackupPool.copy's threads end at close(); a later copy starts them again, equal bits."""
    others = {t for t in threading.enumerate() if t.name.startswith("chunkjax-backup")}  # other tests' pools
    pool = speculate.BackupPool(1 << 30)
    rng = np.random.default_rng(0)
    src = rng.standard_normal((1 << 21) + 7).astype(np.float32)  # above the parallel copy's threshold
    dst = np.zeros_like(src)
    pool.copy(dst, src)
    np.testing.assert_array_equal(dst, src)
    if (os.cpu_count() or 1) > 1:  # one core: copied on the calling thread
        assert _backup_threads() - others
    pool.close()
    assert not (_backup_threads() - others)
    src2 = rng.standard_normal(src.size).astype(np.float32)
    pool.copy(dst, src2)
    np.testing.assert_array_equal(dst, src2)
    pool.close()


def test_unjoined_work_is_finished_at_exit(tmp_path):
    """A process that exits without joining a step's host work (no step.wait) exits 0 after the
    work ran to its end (the daemon thread is not cut off mid-update at finalization)."""
    marker = tmp_path / "done"
    code = textwrap.dedent(f"""
        import time
        from chunkjax import host_work
        w = host_work.HostWork(deadline_s=60)
        def slow():
            time.sleep(1.0)
            open({str(marker)!r}, "w").write("ok")
            return 0.0
        w.submit(slow)
        print("exiting", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert marker.read_text() == "ok"
    assert "still running at exit" not in p.stderr


def test_speculated_bench_worker_exits_cleanly(tmp_path):
    """The reported run, small: the bench worker with clipping that never fires (speculated host
    updates, cross-step overlap) exits 0; after it returns no chunkjax thread is alive, and the
    last step's speculation is counted (the final wait joined it)."""
    out = tmp_path / "w.json"
    steps = 2
    argv = ["--worker", "chunkjax", "--model", "micro", "--batch", "2", "--seq", "16", "--steps", str(steps),
            "--budget-bytes", "1300000", "--set", "max_grad_norm=1e4", "--set", "clip_expect=rare",
            "--out", str(out)]
    code = textwrap.dedent(f"""
        import sys, threading
        from experiments import bench
        rc = bench.main({argv!r})
        print("THREADS", [t.name for t in threading.enumerate() if t.name.startswith("chunkjax") and t.is_alive()])
        sys.exit(rc)
    """)
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "THREADS []" in p.stdout, p.stdout[-2000:]
    rec = json.loads(out.read_text())
    assert rec["feasible"] is True, rec.get("error")
    spec = rec["extra"]["speculation"]
    assert spec["speculated_chunks"] > 0 and spec["redone_chunks"] == 0
    assert spec["steps"] == steps + 1  # the warm-up and every timed step, the last one included
    assert "still running at exit" not in p.stderr
