"""One process of the lost-peer test (tests/test_checkpoint_integrity.py); not a test itself.

``python tests/checkpoint_lost_peer_worker.py PROCESS_ID N_PROCESSES PORT SEED CKPT_DIR OUT.npz HOW``
with ``XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu``: joins the
``jax.distributed`` job, builds the micro GPT's ZeRO-3 state over the 8-device mesh of both
processes (the model and step of tests/zero_multiprocess_worker.py; no training step runs), saves
checkpoint 1 (every process calls save_checkpoint), then starts checkpoint 2 (peer deadline
:data:`PEER_TIMEOUT_S`), during which the last process SIGKILLs (HOW=kill) or SIGSTOPs (HOW=stop) itself as it
reaches chunk 1's gather. Process 0 prints the one-line error of save_checkpoint after
``LOST:`` and writes the master params of checkpoint 1 to OUT.npz.
"""
import os
import signal
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
#: the peer deadline of checkpoint 2 (seconds): process 0 waits it out once (HOW=kill: the meeting after
#: Gloo's failure) or twice (HOW=stop: the gather, then that meeting); both processes reach each
#: meeting before chunk 1 within milliseconds of each other (they have just left a collective)
PEER_TIMEOUT_S = 3


def main(pid: int, n_proc: int, port: int, seed: int, ckpt: str, out: str, how: str) -> None:
    import importlib.util
    spec = importlib.util.spec_from_file_location("zmw", os.path.join(HERE, "zero_multiprocess_worker.py"))
    zmw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(zmw)
    _, params, _, _, step = zmw.joined(pid, n_proc, port, seed)
    import jax

    from chunkjax import checkpoint as ck
    state = step.init(params)
    ck.save_checkpoint(ckpt, 1, step, state, {"data_position": 1})
    master1 = step.master_params(state)  # collective
    if pid == 0:
        np.savez(out, **{f"p{i}": a for i, a in enumerate(jax.tree.leaves(master1))})
    if pid == n_proc - 1:
        real = ck.job.SaveJob.snapshot

        def snapshot(job, c, copy):
            if c == 1:
                print(f"{how.upper()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            return real(job, c, copy)
        ck.job.SaveJob.snapshot = snapshot
    try:
        ck.save_checkpoint(ckpt, 2, step, state, {"data_position": 2}, peer_timeout_s=PEER_TIMEOUT_S)
    except ck.CheckpointWriteError as e:
        print(f"LOST: {e}", flush=True)
        os._exit(0)  # the job has lost a process: no orderly jax.distributed shutdown
    print("SAVED", flush=True)
    os._exit(1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), int(a[3]), a[4], a[5], a[6])
