"""Worker of tests/test_checkpoint.py::test_failed_save_prints_only_our_line: checkpoints a
ChunkedOptimizer through orbax three times in one process and prints one line per failure, as
the main job does; the test reads its stderr.

1. ``save_checkpoint(dir, 1, ...)``: succeeds.
2. step 2 with a full disk: a file-size limit (RLIMIT_FSIZE, as tests/test_disk_tier.py's worker
   fault) set just before a chunk write, so tensorstore's own writes inside orbax's threads fail
   (EFBIG: the write path of ENOSPC); prints ``error: <the CheckpointWriteError>``.
3. step 3 interrupted: orbax's background writes held 1 s (tensorstore's ``open`` delayed) and
   SIGINT delivered 0.3 s into the save, while the main thread waits on them; prints
   ``interrupted``.

Then it checks that step 1 is the latest checkpoint, restores it and prints ``OK <latest step>``.
Its SIGINT is Python's KeyboardInterrupt whatever it inherited (a suite started as a background
job of a script starts it with SIGINT ignored: tests/test_launch_signals.py); its first line says
what it inherited (``inherited SIGINT: ignored`` or ``handled``).
Usage: python checkpoint_noise_worker.py CKPT_DIR
"""
import asyncio
import os
import resource
import signal
import sys
import threading

import numpy as np
import optax

import chunkjax as cj
from chunkjax import checkpoint as ck


def main(ckpt: str) -> None:
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # step 3's SIGINT: a KeyboardInterrupt
    print(f"inherited SIGINT: {'ignored' if inherited is signal.SIG_IGN else 'handled'}", flush=True)
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((64, 256)).astype(np.float32), "b": np.zeros(256, np.float32)}
    opt = cj.ChunkedOptimizer(params, optax.adamw(1e-3), device_budget="1MiB", chunk_size=4096)
    ck.save_checkpoint(ckpt, 1, opt)
    real = ck.files.write_chunk

    def full_disk(ckptr, path, arrays):  # every chunk file of this save grows past 4 KiB: EFBIG
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            return real(ckptr, path, arrays)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    ck.files.write_chunk = full_disk
    try:
        ck.save_checkpoint(ckpt, 2, opt)
    except ck.CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
    ck.files.write_chunk = real

    from orbax.checkpoint._src.serialization import type_handlers
    ts = type_handlers.ts
    real_open = ts.open

    async def slow_open(*a, **k):
        await asyncio.sleep(1.0)
        return await real_open(*a, **k)

    ts.open = slow_open
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        ck.save_checkpoint(ckpt, 3, opt)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
    finally:
        ts.open = real_open
    latest = ck.latest_step(ckpt)
    ck.restore_checkpoint(ckpt, opt)
    print(f"OK {latest} {sorted(os.listdir(ckpt))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
