"""A save of a state spread over several processes (``jax.distributed``): every process takes
part in each chunk's all-gather, process 0 writes, and every wait on another process has a
deadline (:class:`Peers`), so a process killed or stuck is named in one line by the others while
process 0 removes its temporary directory."""
from __future__ import annotations

import os
import shutil
import threading

import jax
import numpy as np

import chunkjax.checkpoint.files as files
from chunkjax.checkpoint.job import SaveJob, chunk_nbytes
from chunkjax.checkpoint.protocol import CheckpointError, CheckpointWriteError


#: Default deadline (seconds) of one wait on the other processes in a multi-process save.
DEFAULT_PEER_TIMEOUT_S = 300.0


class Peers:
    """The other processes of a multi-process save, met with a deadline through the
    ``jax.distributed`` coordination service's key-value store: before each collective every
    process posts ``<save>/<meeting>/<process>`` and waits for the others' posts, so a process
    that is gone or stuck is named instead of hanging in (or failing inside) the collective."""

    def __init__(self, step_fn, step_number: int, timeout_s: float):
        from jax._src import distributed  # the coordination client: no public API has a deadline
        self.client = distributed.global_state.client
        self.me, self.n = jax.process_index(), jax.process_count()
        count = vars(step_fn).setdefault("_checkpoint_multiprocess_saves", [0])  # same sequence on every process
        count[0] += 1
        self.prefix = f"chunkjax_checkpoint/{step_number}/{count[0]}"
        self.timeout_s = float(timeout_s)

    def meet(self, meeting: str, doing: str, timeout_s: float | None = None) -> None:
        """Wait up to the deadline for every other process to reach ``meeting``.

        Raises:
          _PeerLost: naming the processes that did not arrive (or the coordinator, unreachable).
        """
        import time
        t_end = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        key = f"{self.prefix}/{meeting}"
        try:
            self.client.key_value_set(f"{key}/{self.me}", "1")
        except Exception as e:  # noqa: BLE001 - the coordination service (process 0) is gone
            raise _PeerLost([0], doing, files.one_line(e)) from None
        missing = []
        for p in range(self.n):
            if p == self.me:
                continue
            left_ms = max(1, int(1000 * (t_end - time.monotonic())))
            try:
                self.client.blocking_key_value_get(f"{key}/{p}", left_ms if not missing else 1)
            except Exception:  # noqa: BLE001 - deadline passed, or the service is gone
                missing.append(p)
        if missing:
            raise _PeerLost(missing, doing, f"not there after {self.timeout_s if timeout_s is None else timeout_s:g} s")

    def collective(self, fn, doing: str):
        """``fn()`` (a collective over every process) with the deadline: run in a helper thread
        (a collective blocked on a stopped peer cannot be interrupted; the thread is left behind,
        a daemon, and the job has to end). CheckpointError/TypeError of ``fn`` pass through; any
        other failure or the deadline raises :class:`_PeerLost`."""
        box: list = []

        def run():
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
        t = threading.Thread(target=run, name="chunkjax-checkpoint-collective", daemon=True)
        t.start()
        t.join(self.timeout_s)
        if not box:
            raise self.lost(TimeoutError(f"not done after {self.timeout_s:g} s"), doing)
        ok, value = box[0]
        if ok:
            return value
        if isinstance(value, (CheckpointError, TypeError)) or not isinstance(value, Exception):
            raise value
        raise self.lost(value, doing) from value

    def lost(self, e: BaseException, doing: str) -> "_PeerLost":
        """After a collective failed (a peer dropped out of it): the processes that do not also
        report the failure within a short deadline are the lost ones."""
        try:
            self.meet(f"failed/{doing}", doing, timeout_s=min(self.timeout_s, 10.0))
        except _PeerLost as p:
            return _PeerLost(p.processes, doing, files.one_line(e))
        return _PeerLost([], doing, files.one_line(e))

    def forget(self) -> None:
        """Delete this save's keys (process 0, once everyone has passed the last meeting)."""
        if self.me == 0:
            try:
                self.client.key_value_delete(self.prefix)
            except Exception:  # noqa: BLE001 - bookkeeping only
                pass


class _PeerLost(Exception):
    """Processes that failed to meet the others in a multi-process save."""

    def __init__(self, processes, doing: str, why: str):
        self.processes, self.doing, self.why = list(processes), doing, why
        who = (f"process {', '.join(map(str, processes))} of {jax.process_count()}" if processes
               else "a peer process")
        super().__init__(f"{who} lost while {doing} ({why})")


def peer_deadline(step_fn, timeout_s: float | None) -> float:
    if timeout_s is not None:
        if not timeout_s > 0:
            raise ValueError(f"peer_timeout_s must be > 0, got {timeout_s}")
        return float(timeout_s)
    chunk_bytes = chunk_nbytes(step_fn, 0)  # params, master and moments of one chunk
    return max(DEFAULT_PEER_TIMEOUT_S, 60.0 + chunk_bytes / (100 << 20))


def save_multiprocess(directory, step_number: int, step_fn, state, extra, peer_timeout_s=None) -> str:
    """:func:`save_checkpoint` of a state sharded over several processes (``jax.distributed``;
    ``directory`` on a filesystem every process sees). Every process takes part in each chunk's
    all-gather, in chunk order; process 0 alone writes the files and renames the checkpoint into
    place. A write failure on process 0 does not stop the gathers (no process hangs); afterwards
    process 0's outcome is broadcast and every process raises if it failed. Before each gather
    and the broadcast the processes meet with a deadline (:class:`Peers`): a process killed or
    stuck is named in one line by every survivor, and process 0 removes its temporary
    directory (the previous checkpoints stay intact)."""
    from jax.experimental import multihost_utils
    timeout_s = peer_deadline(step_fn, peer_timeout_s)
    writer = jax.process_index() == 0
    job = SaveJob(directory, step_number, step_fn, state, extra, writer=writer)
    peers = Peers(step_fn, step_number, timeout_s)
    failure, stage = None, "creating the temporary directory"
    try:
        if writer:
            try:
                job.open()
            except Exception as e:  # noqa: BLE001 - reported after the collectives
                failure = (e, stage)
        for c in range(job.n_chunks):
            stage = f"gathering chunk {c} of {job.n_chunks}"
            peers.meet(f"chunk{c}", stage)
            arrays = peers.collective(lambda: job.snapshot(c, copy=False), stage)  # noqa: B023 - called at once
            if writer and failure is None:
                stage = f"writing chunk {c} of {job.n_chunks}"
                try:
                    job.write(c, arrays)
                except Exception as e:  # noqa: BLE001
                    failure = (e, stage)
            del arrays
        if writer and failure is None:
            try:
                job.finalize()
            except Exception as e:  # noqa: BLE001
                failure = (e, job.stage or "finalizing")
        stage = "sharing process 0's outcome"
        peers.meet("outcome", stage)
        ok = int(peers.collective(lambda: multihost_utils.broadcast_one_to_all(np.int32(failure is None)), stage))
    except _PeerLost as lost:
        shutil.rmtree(job.tmp, ignore_errors=True)  # the writer's temporary (others have none)
        prev = files.latest_step(directory, verify=False)
        raise CheckpointWriteError(
            f"saving checkpoint step {step_number} to {os.fspath(directory)} failed: {lost}; "
            + (f"the checkpoint itself was complete at {job.final}" if writer and os.path.isdir(job.final)
               else "the partial write was removed and the existing checkpoints are intact"
               + (f" (latest: step {prev})" if prev is not None else "") if writer
               else "process 0 writes the files: its next save removes its partial write")) from None
    finally:
        job.close()
    peers.forget()
    if failure is not None:
        err = job.failed(*failure)
        raise err from failure[0]
    if not ok:
        raise CheckpointWriteError(f"saving checkpoint step {step_number} to {os.fspath(directory)} failed on process "
                                   "0 (its error says why); the partial write was removed and the existing "
                                   "checkpoints are intact")
    return job.final

