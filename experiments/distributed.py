"""The main job as several processes (``jax.distributed``): joining the job and the run folder.

``experiments/train.py`` calls :func:`start` before any other JAX call. The job joins a
``jax.distributed`` job when its launcher started it as several processes, read from the
environment the way the field's launchers set it (docs/multihost.md, "The main job on several
nodes"):

* under SLURM, ``srun`` with more than one task (``SLURM_STEP_NUM_TASKS > 1``):
  ``jax.distributed.initialize()`` with no arguments reads the coordinator, the process count
  and this process's id from SLURM's variables;
* anywhere else, ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0, the variable
  ``jax.distributed.initialize`` itself reads) with ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``
  (the same naming; JAX reads only the first, this module the other two).

With neither, the job is one process, as before. Every process then builds the ``data`` mesh over
every process's devices (``chunkjax.data_mesh()``), draws the same global batches (the data
order comes from ``--seed``) and calls the collectives (steps, evaluations, ``master_params``,
checkpoint saves) in the same order. Only process 0 writes the run folder; the others write
their copies of the metrics and report into a scratch folder (:func:`scratch_folder`) that is
removed when they finish. A checkpoint is saved by every process
(:func:`chunkjax.save_checkpoint`: process 0 writes the files into its run folder), and restored
by every process from the run folder passed to ``--resume`` (a filesystem every node sees).
"""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

ADDRESS_VAR, COUNT_VAR, ID_VAR = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


def launched_processes(environ=None) -> int:
    """The number of processes the launcher started (1: not a multi-process launch).

    Raises:
      ValueError: ``JAX_COORDINATOR_ADDRESS`` is set without valid ``JAX_NUM_PROCESSES`` /
        ``JAX_PROCESS_ID`` (one line that says what to set).
    """
    env = os.environ if environ is None else environ
    if env.get(ADDRESS_VAR):
        try:
            n, me = int(env[COUNT_VAR]), int(env[ID_VAR])
        except (KeyError, ValueError):
            raise ValueError(f"{ADDRESS_VAR}={env[ADDRESS_VAR]} needs {COUNT_VAR} (the number of processes) and "
                             f"{ID_VAR} (0 .. {COUNT_VAR}-1, this process) as integers") from None
        if n < 1 or not 0 <= me < n:
            raise ValueError(f"{ID_VAR}={me} with {COUNT_VAR}={n}: the id must be in 0 .. {n - 1}")
        return n
    try:
        return max(int(env.get("SLURM_STEP_NUM_TASKS", "1")), 1)
    except ValueError:
        return 1


def start(zero_stage: int, environ=None) -> int:
    """Join the ``jax.distributed`` job when the launcher started several processes (before any
    other JAX call: it must run first in the process); returns the process count (1: nothing
    done). On the CPU the cross-process collectives go through gloo.

    Args:
      zero_stage: the job's ``--zero-stage`` (0: one device, which cannot span processes).

    Raises:
      ValueError: several processes without a ZeRO stage, bad ``JAX_*`` variables, or the
        coordinator could not be joined (one line each).
    """
    env = os.environ if environ is None else environ
    n = launched_processes(env)
    if n == 1:
        return 1
    if not zero_stage:
        raise ValueError(f"the job was started as {n} processes but --zero-stage is 0: add --zero-stage 1, 2 or 3 "
                         "(one device cannot span processes), or start one process")
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices only; GPUs use NCCL
    try:
        if env.get(ADDRESS_VAR):
            jax.distributed.initialize(env[ADDRESS_VAR], num_processes=n, process_id=int(env[ID_VAR]))
        else:  # SLURM: jax reads the coordinator (first node of the step), SLURM_NTASKS and SLURM_PROCID
            jax.distributed.initialize()
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"could not join the jax.distributed job of {n} processes: "
                         f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None
    return jax.process_count()


def barrier(name: str, timeout_s: float = 900.0) -> None:
    """Wait until every process of the ``jax.distributed`` job has reached ``name`` (a name used
    once), through the coordination service, which waits up to ``timeout_s`` seconds. The job
    calls it before each step: on the CPU, gloo's reduce-scatter fails when the processes reach it
    more than 30 s apart (one compiling the evaluation while the other waits), whatever XLA's
    collective timeout says (jax-ml/jax#40831). Nothing with one process.

    Raises:
      jax.errors.JaxRuntimeError: a process did not arrive within ``timeout_s``."""
    import jax
    if jax.process_count() == 1:
        return
    from jax._src import distributed as _distributed  # the coordination service's client
    _distributed.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))


def is_writer() -> bool:
    """True in the process that writes the run folder (process 0, or the only process)."""
    import jax
    return jax.process_index() == 0


def scratch_folder(resume=None, checkpoint_dir: str = "checkpoints"):
    """A stand-in run folder for a process other than 0, else None.

    It is a :class:`experiments.report.RunFolder` in a temporary directory (removed at exit and by
    ``commit``/``discard``), so the job's writes (metrics, report, picture, sample) land there
    and not in process 0's folder. When resuming (``resume``: the job's ``ResumePoint``), its
    ``checkpoint_dir`` holds a link to the checkpoint being resumed and its ``metrics.jsonl`` a copy
    of that run's, so this process restores the same state and data position; nothing of the
    resumed run folder is written or pruned by this process.
    """
    if is_writer():
        return None
    import jax

    from chunkjax.checkpoint.files import step_dir
    from experiments.report import RunFolder

    class _Scratch(RunFolder):
        def commit(self):
            self.discard()
            return "(written by process 0)"

    path = pathlib.Path(tempfile.mkdtemp(prefix=f"chunkjax-process{jax.process_index()}-"))
    atexit.register(shutil.rmtree, path, True)
    if resume is not None:
        (path / checkpoint_dir).mkdir()
        src = pathlib.Path(step_dir(resume.ckpt_dir, resume.step)).resolve()
        (path / checkpoint_dir / src.name).symlink_to(src, target_is_directory=True)
        if (pathlib.Path(resume.run_dir) / "metrics.jsonl").is_file():
            shutil.copyfile(pathlib.Path(resume.run_dir) / "metrics.jsonl", path / "metrics.jsonl")
    return _Scratch(path, path)
