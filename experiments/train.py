"""The main job: train a GPT on real text (Shakespeare + King James Bible) with its model data in
chunks spread over device and pinned-host memory.

    python -m experiments.train                      # CPU default: tiny GPT, budget forcing >= half off-device
    python -m experiments.train --model GPT2_1B --device-budget 8GiB --batch 16 --seq 1024   # a GPU node
    python -m experiments.train --init-from smollm2-135m     # fine-tune a pre-trained model (docs/finetune.md)

``--init-from <name>`` starts from a pre-trained model (:mod:`experiments.job_model`; today
``smollm2-135m``) with its tokenizer and data and that preset's defaults (flags given win); the
run also reports the held-out perplexity before and after, samples before and after, and writes
the trained weights as a Hugging Face checkpoint into ``<run folder>/hf`` (``--export none``: not).
``--lora-rank R`` (``--lora-alpha``, ``--lora-targets``) trains LoRA adapters on the frozen base
(:func:`experiments.job_model.with_lora`); ``--export adapters`` writes them in PEFT's layout.

Every resolved setting is printed; the run folder ``runs/<time>-<model>/`` holds ``report.json``
(keys in shared/guides/definitions.md: ``_accounted`` figures are chunkjax's own bookkeeping,
``_measured`` ones come from the runtime and are null on the CPU), ``metrics.jsonl``,
``loss.png`` and ``sample.txt``. The folder is written under a ``.partial`` name and renamed when
the run completes, so a failed run leaves nothing behind (unless it has a checkpoint, below). Bad
input exits with status 2 and one line saying what to do.

Checkpoints and resuming (for runs of days: crashes, full disks, bad steps):

    python -m experiments.train --checkpoint-every 500 --keep-checkpoints 3 ...
    python -m experiments.train --resume runs/<time>-<model>.partial

``--checkpoint-every N`` saves a chunkjax checkpoint (:mod:`chunkjax.checkpoint`: atomic, chunk by
chunk) into ``<run folder>/checkpoints/`` every N steps and after the last step; the default (-1)
saves at each evaluation (``--eval-every``) and at the end, 0 saves none. Only the newest
``--keep-checkpoints`` (default 2) are kept. A checkpoint holds the whole training state plus the
data position, the RNG key, the settings and the report's running totals. Once a checkpoint
exists, a run that fails (crash, SIGKILL, SIGTERM, Ctrl-C, a non-finite loss) keeps its
``.partial`` folder (a run started as a background job of a script ignores Ctrl-C, as the shell
set: a ``note:`` line says so; SIGTERM stops it: :func:`run_guarded`), and ``--resume <that folder or its checkpoints folder>`` continues it in
place from the newest complete checkpoint: the data stream continues where it was and the losses
equal those of an uninterrupted run (bit for bit on the CPU; so after a non-finite loss, resume
with ``--nonfinite skip``). A run that diverges (:class:`DivergenceWatch`: a non-finite loss or
gradient norm, ``--skip-limit`` skipped steps in a row, a dead model, or a finite loss that
explodes: ``--explode-factor`` (4) x its running median, 3 steps in a row) stops with one line and
status 2; no checkpoint is saved while skipped, dead or exploding steps are running, the checkpoints of the
diverged state are deleted, and a kept folder's ``report.json`` says why (``stopped``).
A resume continues the run as it was configured: every option not given on its command line
takes the run's value (its checkpoint's settings; the ``config:`` line marks ``(run)`` those that
differ from the defaults),
options given win. Settings that change the training (model, init-from, batch, seq, lr, warmup, the schedule's
length ``--lr-decay-steps``, weight decay, clip, seed, tokenizer, eval batches, compute dtype), when
given, must equal the checkpoint's: a difference exits with status 2, one line, and nothing written.
``--steps`` may grow: ``--resume <a finished run folder> --steps M`` trains it on from its last
checkpoint to step M in place (the folder keeps its name), with the learning-rate schedule of the
run (``--lr-decay-steps`` defaults to the run's: a cosine that ended at its ``--steps`` stays at
lr/10); its steps equal those of an uninterrupted M-step run with the same ``--lr-decay-steps``.
``--device-budget``, ``--prefetch``, ``--cross-step``, ``--micro-batches`` (which changes only the float summation
order), ``--nonfinite``, ``--skip-limit``, ``--chunk-size`` / ``--min-chunks`` and the output settings may differ:
the checkpoint restores into any placement, and into another chunk layout by moving every leaf
to its new chunk (:func:`chunkjax.checkpoint.restore_checkpoint`). A checkpoint that cannot be written (full disk) stops the run
with status 1 and one line; the previous checkpoints stay intact and resumable. ``report.json``
says ``resumed_from_step``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from experiments.flags import with_flags

#: Environment variable marking a process already re-launched with the budget's memory settings.
_LAUNCHED = "CHUNKJAX_LAUNCHED"


def config_field(default, help_: str):
    """A dataclass field of a job configuration with its ``--help`` text (read by the CLI)."""
    return dataclasses.field(default=default, metadata={"help": help_})


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every knob of the main job, with defaults that run on a 2-core CPU in under 10 minutes."""

    model: str = config_field("tiny", 'name from models/gpt.py (case-insensitive); with --init-from: that model\'s name')
    init_from: str = config_field("", 'start from a pre-trained model with its preset (experiments/job_model.py PRESETS: smollm2-135m, fine-tuned on the Shakespeare training plays), or a Hugging Face folder of the Llama family (Llama 2/3, Mistral, Qwen2: config.json, *.safetensors, tokenizer.json); empty: a random init')
    data: str = config_field("", 'with --init-from: your own data, comma-separated text files, JSON-lines files ({"text": ...} or {"prompt": ..., "completion": ...}, loss on the completion) or folders of them, tokenized with the checkpoint\'s tokenizer, 10% of paragraphs/lines held out (experiments/user_data.py); empty: the Shakespeare plays')
    export: str = config_field("merged", 'with --init-from: merged: write the trained model as a Hugging Face checkpoint (the source folder\'s layout and dtypes; with LoRA the adapters merged in: W + alpha/R A@B) into <run folder>/hf; adapters: the LoRA adapters alone in PEFT\'s layout into <run folder>/adapters; both; none')
    lora_rank: int = config_field(0, 'with --init-from: LoRA adapters of this rank on --lora-targets (models/lora.py), the base frozen (no optimizer state); 0: full fine-tuning')
    lora_alpha: float = config_field(16.0, 'LoRA scale numerator: the adapters\' output is multiplied by alpha / rank')
    lora_targets: str = config_field("q,k,v,o", 'comma-separated projections given LoRA adapters: q, k, v, o, gate, up, down')
    steps: int = config_field(400, 'optimizer steps (400: the CPU demo ends at validation loss 4.98 nats; measured 0.43 s a step at the 10th percentile on a shared 2-core machine, under 10 minutes in all)')
    batch: int = config_field(8, 'sequences per step')
    seq: int = config_field(128, 'tokens per sequence')
    lr: float = config_field(3e-3, 'peak AdamW learning rate')
    warmup: int = config_field(-1, 'learning-rate warm-up: steps of a linear rise from 0 to --lr, then the cosine decay to lr/10; -1: min(30, a tenth of the cosine\'s horizon --lr-decay-steps or --steps; so 30 at --steps 400, none below 10 steps), on --resume the run\'s; 0: none (step 1 at --lr)')
    lr_decay_steps: int = config_field(0, 'the step at which the cosine reaches lr/10 (then held); 0: --steps, and on --resume the run\'s (so that a run extended with a larger --steps continues its schedule)')
    weight_decay: float = config_field(0.0, 'AdamW decoupled weight decay, on every parameter: biases, LayerNorm scales and embeddings too (GPT-2/nanoGPT decay only 2-D weights; chunkjax has no per-leaf decay mask yet)')
    clip: float = config_field(1.0, 'global-norm clipping (0 disables)')
    device_budget: str = config_field("auto", 'peak device bytes per device ("8GiB", "512MiB", ...); auto: the smallest budget with every chunk offloaded + 20% of the model\'s chunk bytes (chunkjax.fit), raised on a GPU to what the compiled step needs')
    host_budget: str = config_field("auto", 'host bytes for model data ("100GiB", ...); auto: what MemAvailable leaves after the process (chunkjax.fit)')
    storage: str = config_field("", 'storage directories, comma-separated, one per disk (the disk tier: chunks whose master params and optimizer state the host budget cannot hold keep them there, updated next to the disk by one worker process per directory; the directories are working memory, a previous run\'s chunk files there are replaced); empty: none')
    storage_keep_previous: bool = config_field(True, 'with --storage: keep the last committed step\'s chunk files until the next step commits (a failed step leaves the directories at the last step; twice the state on disk); --no-storage-keep-previous: the state once on disk (a failed step needs a checkpoint to resume)')
    chunk_size: int = config_field(0, 'elements per chunk; 0 searches (leaves larger than a chunk span chunks)')
    min_chunks: int = config_field(8, 'the search prefers sizes giving at least this many chunks')
    prefetch: int = config_field(1, 'fetch distance in stages')
    cross_step: bool = config_field(True, 'cross-step overlap (chunkjax.cross_step): the next step waits per program only for the host chunks it reads, not for all of this step\'s host updates (exact: the same losses); --no-cross-step: each step joins the previous one\'s host work')
    compute_dtype: str = config_field("auto", 'bfloat16 | float32; auto: bfloat16 on GPU, float32 on CPU')
    tokenizer: str = config_field("gpt2", 'gpt2 | bpe<N>')
    data_cache: str = config_field(".cache/data", 'token arrays cached here (copy this folder to a machine without the data packages)')
    eval_every: int = config_field(100, 'steps between validation losses')
    eval_batches: int = config_field(8, 'validation batches (of `batch` sequences)')
    sample_tokens: int = config_field(80, 'tokens generated at the end (0 disables)')
    out_dir: str = config_field("runs", 'run folders go here')
    seed: int = config_field(0, 'init and data order')
    progress: bool = config_field(True, 'progress bar')
    micro_batches: int = config_field(1, 'gradient accumulation: each step\'s --batch sequences run as this many equal micro-batches (activation memory of one micro-batch), one update')
    nonfinite: str = config_field("error", 'a NaN/inf loss or gradient: error (stop, say what to change) | skip (the step changes no state; counted in the report)')
    skip_limit: int = config_field(10, 'with --nonfinite skip: stop (exit 2) after this many skipped steps in a row (the model diverged, not one bad batch)')
    explode_factor: float = config_field(4.0, 'stop (exit 2) when a finite loss stays above this many times the median of the last 50 healthy steps\' losses (and 1 nat above it) for 3 steps in a row, after 10 steps (the loss exploded); 0: off')
    checkpoint_every: int = config_field(-1, 'steps between checkpoints in <run folder>/checkpoints, plus one after the last step; -1: at each evaluation (--eval-every); 0: none')
    keep_checkpoints: int = config_field(2, 'newest checkpoints kept (older ones are deleted)')
    zero_stage: int = config_field(0, 'ZeRO stage 1 | 2 | 3 over all devices (every chunk split over them; --batch a multiple of the device count), those of all processes when started as several (srun, or JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID: docs/multihost.md); 0: one device')
    resume: str = config_field("", 'continue a run from its newest complete checkpoint: its run folder (runs/<name>.partial) or checkpoints folder; every option not given takes the run\'s value, those given that change training must equal it')


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class JobFailed(Exception):
    """The run failed for a reason outside its input (a checkpoint that cannot be written):
    printed as one line, exit status 1."""


#: Steps in a row with a gradient norm of exactly 0 at a positive loss before the job calls the
#: model dead (diverged: lr 1e4 without clipping makes every hidden state overflow, so RMSNorm's
#: mean square is inf, every normalised state 0, every prediction uniform: loss log V, gradient 0).
DEAD_STEPS = 3
#: The explosion check of :class:`DivergenceWatch` (``--explode-factor``, default 4): a finite loss
#: above ``factor`` x the median of the last :data:`EXPLODE_WINDOW` healthy steps' losses and at least
#: :data:`EXPLODE_MIN_EXCESS` nats above it is exploding; :data:`EXPLODE_STEPS` in a row stop, once
#: :data:`EXPLODE_WARMUP` healthy losses are known (one spike is not a divergence; a loss at
#: 0.02 nats that reaches 0.1 is noise, not an explosion).
EXPLODE_WINDOW, EXPLODE_WARMUP, EXPLODE_STEPS, EXPLODE_MIN_EXCESS = 50, 10, 3, 1.0


class Diverged(UsageError):
    """The training diverged (a non-finite loss or gradient norm, ``--skip-limit`` skipped steps
    in a row, or a dead model): one line, exit 2. ``record``: why, for the kept run folder's
    ``report.json`` (``stopped``)."""

    def __init__(self, msg: str, record: dict | None = None):
        super().__init__(msg)
        self.record = record or {}


@dataclasses.dataclass
class DivergenceWatch:
    """Decides, step by step, whether training diverged (:class:`Diverged`).

    Under ``--nonfinite error`` a non-finite loss or gradient norm stops at once (the step's
    update must not reach a checkpoint). Under ``skip`` a non-finite step is skipped by the step
    itself (no state changed); ``skip_limit`` of them in a row stop. Either way :data:`DEAD_STEPS`
    steps in a row with a gradient norm of exactly 0 at a positive loss stop (a loss of 0 means
    no target was scored). ``since``: the first step of the current run of suspect steps (skipped
    or dead; None when the last step was healthy): the state that produced it, the checkpoint of
    step ``since - 1`` and later, is the diverged one. A finite loss that explodes (above
    ``explode_factor`` x the running median of healthy losses: :data:`EXPLODE_WINDOW` and the
    rest) :data:`EXPLODE_STEPS` times in a row stops too (``explode_factor`` 0: never);
    :meth:`seed` gives a resumed run the losses before its checkpoint.
    """

    skip_limit: int
    lr: float
    since: int | None = None
    kind: str | None = None
    count: int = 0
    explode_factor: float = 4.0
    healthy: list = dataclasses.field(default_factory=list)

    def seed(self, losses) -> None:
        """The healthy losses (nats) of the steps before a resume, oldest first."""
        self.healthy = [float(x) for x in losses if x is not None and math.isfinite(x)][-EXPLODE_WINDOW:]

    def _median(self) -> float | None:
        """The running median the explosion check compares with (None: off, or too few losses yet)."""
        if not self.explode_factor or len(self.healthy) < EXPLODE_WARMUP:
            return None
        return float(statistics.median(self.healthy))

    @property
    def suspect(self) -> bool:
        """True while a run of skipped or dead steps is open (a checkpoint then waits)."""
        return self.kind is not None

    def observe(self, i: int, loss: float, grad_norm: float, skipped: bool) -> None:
        """Step ``i``'s loss (nats), global gradient norm and whether the step skipped it.

        Raises:
          Diverged: the training diverged at step ``i`` (the message says what to change).
        """
        fix = f"lower --lr (now {self.lr}) or keep --clip > 0"
        if not skipped and not math.isfinite(loss):
            self._stop(i, "nonfinite_loss", f"loss became {loss} at step {i}: {fix}", loss, grad_norm, i)
        if not skipped and not math.isfinite(grad_norm):
            self._stop(i, "nonfinite_grad", f"gradient norm became {grad_norm} at step {i} (loss {loss:.4f}): {fix}, "
                       "or --nonfinite skip to skip such steps", loss, grad_norm, i)
        med = self._median()
        exploding = not skipped and med is not None and loss > self.explode_factor * med and loss - med > EXPLODE_MIN_EXCESS
        kind = "skipped" if skipped else "dead" if grad_norm == 0.0 and loss > 0 else "exploding" if exploding else None
        if kind != self.kind:
            self.kind, self.since, self.count = kind, i if kind else None, 0
        self.count += kind is not None
        if kind is None:
            self.healthy = (self.healthy + [float(loss)])[-EXPLODE_WINDOW:]
        if kind == "exploding" and self.count >= EXPLODE_STEPS:
            self._stop(i, "exploded", f"the loss exploded: steps {self.since}-{i} had losses above {self.explode_factor:g} x "
                       f"the median {med:.4f} of the last healthy steps (now {loss:.4f}): {fix}, then resume from the "
                       "kept checkpoint (--explode-factor 0 turns this check off)", loss, grad_norm, self.since)
        if kind == "skipped" and self.count >= self.skip_limit:
            self._stop(i, "skip_limit", f"the model diverged: steps {self.since}-{i} all had non-finite gradients "
                       f"(--skip-limit {self.skip_limit} in a row skipped): {fix}", loss, grad_norm, self.since)
        if kind == "dead" and self.count >= DEAD_STEPS:
            self._stop(i, "dead", f"the model diverged: steps {self.since}-{i} had a gradient norm of 0 at loss "
                       f"{loss:.4f} (activations overflowed: every prediction alike, nothing left to train): {fix}",
                       loss, grad_norm, self.since)

    def _stop(self, i, why, msg, loss, grad_norm, since):
        raise Diverged(msg, {"step": i, "why": why, "message": msg, "loss": loss, "grad_norm": grad_norm,
                             "since_step": since})


#: Resolved settings that change the training: a checkpoint resumes only when they are equal.
#: (device_budget, prefetch, cross_step, micro_batches, chunk_size, min_chunks, eval_every, nonfinite, skip_limit,
#: checkpointing, sampling and output settings may differ: restore_checkpoint places the state
#: into any placement and moves the leaves into another chunk layout.)
RESUME_MUST_MATCH = ("model", "init_from", "data", "lr_decay_steps", "batch", "seq", "lr", "warmup", "weight_decay", "clip", "seed",
                     "tokenizer", "eval_batches", "compute_dtype_resolved", "lora_rank", "lora_alpha", "lora_targets")
CHECKPOINT_DIR = "checkpoints"


@dataclasses.dataclass
class ResumePoint:
    """Where ``--resume`` continues: the run folder, its checkpoint folder, the step and its meta."""

    run_dir: "os.PathLike"
    ckpt_dir: "os.PathLike"
    step: int
    meta: dict


def find_resume_point(path: str) -> ResumePoint:
    """The newest complete checkpoint of ``--resume path`` (a run folder or its checkpoints folder).

    Raises:
      UsageError: no such folder, no complete checkpoint, a finished run, an unreadable checkpoint.
    """
    import pathlib

    from chunkjax import checkpoint as ck
    from experiments.report import PARTIAL_SUFFIX

    p = pathlib.Path(path)
    if not p.exists() and pathlib.Path(str(p) + PARTIAL_SUFFIX).is_dir():
        p = pathlib.Path(str(p) + PARTIAL_SUFFIX)
    if (p / CHECKPOINT_DIR).is_dir():
        run_dir, ckpt_dir = p, p / CHECKPOINT_DIR
    elif p.is_dir() and (p.name == CHECKPOINT_DIR or ck.all_steps(p)):
        run_dir, ckpt_dir = p.parent, p
    else:
        raise UsageError(f"--resume {path}: not a run folder with a {CHECKPOINT_DIR}/ folder, nor a checkpoints folder")
    step = ck.latest_step(ckpt_dir)
    if step is None:
        raise UsageError(f"--resume {path}: no complete checkpoint in {ckpt_dir}")
    try:
        meta = ck.read_meta(ckpt_dir, step)
    except (ck.CheckpointError, OSError, ValueError) as e:
        raise UsageError(f"--resume {path}: checkpoint step {step} cannot be read: {e}") from None
    extra = meta.get("extra", {})
    if not isinstance(extra.get("config"), dict) or "data_position" not in extra:
        raise UsageError(f"--resume {path}: checkpoint step {step} was not written by experiments.train (its extra has "
                         "no config and data_position): --resume takes the run folder of an experiments.train run; a "
                         "chunkjax.save_checkpoint folder is loaded in Python with chunkjax.restore_checkpoint(folder, "
                         "step_or_optimizer) into the step or optimizer of the model that saved it (docs/own_model.md)")
    if not (run_dir / "metrics.jsonl").is_file():
        raise UsageError(f"--resume {path}: {run_dir} has no metrics.jsonl: pass the run folder the checkpoints belong to")
    if not os.access(run_dir, os.W_OK) or not os.access(ckpt_dir, os.W_OK):
        raise UsageError(f"--resume {path}: {run_dir} is not writable")
    return ResumePoint(run_dir, ckpt_dir, step, meta)


def check_resume_steps(rp: ResumePoint, steps: int) -> None:
    """A finished run (its folder committed, no ``.partial``) resumes only to train on: ``--steps``
    above its last checkpoint's step; a stopped run (``.partial``) to at least that step (equal:
    it only finishes, evaluating and writing its report). Raises UsageError (one line) otherwise:
    a ``--steps`` below a stopped run's checkpoint used to finish it as a run of that many steps,
    its report's steps, tokens and last validation loss wrong."""
    import pathlib

    from experiments.report import PARTIAL_SUFFIX
    if not pathlib.Path(rp.run_dir).name.endswith(PARTIAL_SUFFIX):
        if rp.step >= steps:
            raise UsageError(f"--resume {rp.run_dir}: it is a finished run (checkpoint step {rp.step}, --steps {steps}): "
                             f"pass a larger --steps (e.g. --steps {2 * rp.step}) to train it on, or start a new run")
    elif rp.step > steps:
        raise UsageError(f"--resume {rp.run_dir}: its checkpoint step {rp.step} is past --steps {steps}: leave --steps "
                         f"out (the run's: {rp.meta['extra']['config'].get('steps')}) or pass --steps >= {rp.step}")


def decay_steps_for(cfg: "TrainConfig", rp: ResumePoint | None) -> int:
    """The resolved ``--lr-decay-steps``: the one given, else the resumed run's (its ``--steps``
    for checkpoints older than the setting), else ``--steps``."""
    if cfg.lr_decay_steps:
        return cfg.lr_decay_steps
    if rp is not None:
        saved = rp.meta["extra"]["config"]
        return int(saved.get("lr_decay_steps") or saved["steps"])
    return cfg.steps


def check_resume_config(rp: ResumePoint, resolved: dict) -> None:
    """Refuse (one line) when a setting in :data:`RESUME_MUST_MATCH` differs from the checkpoint's."""
    saved = dict(rp.meta["extra"]["config"])
    saved.setdefault("lr_decay_steps", saved.get("steps"))  # older checkpoints: the cosine ended at --steps
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}  # keys older checkpoints lack
    defaults["warmup"] = WARMUP_STEPS  # the default (30) before the automatic one
    diffs = [f"--{k.replace('_resolved', '').replace('_', '-')} {resolved[k]} (checkpoint: {saved.get(k)})"
             for k in RESUME_MUST_MATCH if saved.get(k, defaults.get(k)) != resolved[k]]
    if diffs:
        raise UsageError(f"--resume {rp.run_dir}: settings differ from checkpoint step {rp.step}: {', '.join(diffs)}; "
                         "resume with the run's settings")


def preset_config(init_from: str = "", **overrides) -> TrainConfig:
    """The job's settings for ``--init-from init_from`` (:data:`experiments.job_model.PRESETS`'
    defaults), with ``overrides`` on top; ``""``: :class:`TrainConfig`'s defaults.

    Raises:
      UsageError: an unknown ``init_from`` name.
    """
    from experiments.job_model import PRESETS
    preset = _preset(init_from, PRESETS)
    return TrainConfig(**(preset | {"init_from": init_from} | overrides))


def _preset(init_from: str, presets: dict) -> dict:
    if not init_from:
        return {}
    from experiments.job_model import preset_for
    preset = preset_for(init_from)
    if preset is None and os.path.isdir(init_from):
        raise UsageError(f"--init-from {init_from}: {os.path.join(init_from, 'config.json')} is missing: pass a Hugging "
                         "Face checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    if preset is None:
        raise UsageError(f"--init-from {init_from!r} is not known: use one of {', '.join(presets)} or a Hugging Face "
                         "folder (config.json, *.safetensors, tokenizer.json)")
    return preset


def given_options(argv=None) -> frozenset[str]:
    """The :class:`TrainConfig` fields given on the command line ``argv`` (``sys.argv[1:]`` when
    None), whatever their values (a flag given with its default value counts as given)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--init-from", default="")
    return frozenset(vars(arg_parser(pre.parse_known_args(argv)[0].init_from, defaults=False).parse_args(argv)))


def resumed_settings(cfg: TrainConfig, given) -> tuple[TrainConfig, tuple[str, ...]]:
    """``cfg`` with ``--resume``'s run settings: every field not in ``given`` (the options given on
    the command line, :func:`given_options`) takes the value the run's newest checkpoint saved
    (``extra["config"]``; a field an older checkpoint lacks keeps ``cfg``'s), so a resume continues
    the run as configured. Returns ``(cfg, the fields whose run value replaced another default)``
    (the others are the same either way); without ``--resume`` ``(cfg, ())``.

    Raises:
      UsageError: :func:`find_resume_point`'s (no such run folder, no complete checkpoint, ...).
    """
    if not cfg.resume:
        return cfg, ()
    saved = find_resume_point(cfg.resume).meta["extra"]["config"]
    taken = {f.name: saved[f.name] for f in dataclasses.fields(TrainConfig)
             if f.name != "resume" and f.name not in given and f.name in saved}
    return dataclasses.replace(cfg, **taken), tuple(k for k, v in taken.items() if v != getattr(cfg, k))


def parse_args(argv=None) -> TrainConfig:
    """Command line -> :class:`TrainConfig`; ``--init-from`` sets its preset's defaults first
    (flags given win), and ``--help`` shows the defaults that run (:func:`arg_parser`).

    Raises:
      UsageError: an unknown ``--init-from`` name (argparse itself exits 2 on unknown flags).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--init-from", default="")
    init_from = pre.parse_known_args(argv)[0].init_from
    return TrainConfig(**vars(arg_parser(init_from).parse_args(argv)))


def arg_parser(init_from: str = "", defaults: bool = True) -> argparse.ArgumentParser:
    """The job's argument parser with the defaults of ``--init-from init_from`` (empty: a random
    init). Each flag's help says its default and, where ``--init-from`` changes it, the other
    defaults: without ``--init-from``, the Hugging Face folder preset's and each named preset's
    (:data:`experiments.job_model.FOLDER_PRESET`, :data:`~experiments.job_model.PRESETS`); with it,
    that preset's value as the default and the random init's beside it. ``defaults=False``: no
    default set (a parse holds only the options given: :func:`given_options`).

    Raises:
      UsageError: an unknown ``init_from`` name.
    """
    from experiments.job_model import FOLDER_PRESET, PRESETS
    preset = _preset(init_from, PRESETS)
    shown = {"a Hugging Face folder": FOLDER_PRESET | {"model": "the folder's name", "seq": (
        f"{FOLDER_PRESET['seq']} or the model's max_position_embeddings if fewer")}} | PRESETS
    ap = argparse.ArgumentParser(
        prog="python -m experiments.train", description=__doc__.split("\n\n")[0],
        epilog="Defaults: a flag's 'with --init-from' values replace its random-init default when --init-from "
               "is given (flags given on the command line win); 'python -m experiments.train --init-from X "
               "--help' shows X's defaults.")
    for f in dataclasses.fields(TrainConfig):
        name = "--" + f.name.replace("_", "-")
        if f.name in preset and preset[f.name] != f.default:
            default = preset[f.name]
            note = f"default with --init-from {init_from}: {default}; random init: {f.default}"
        else:
            others = [f"{label}: {p[f.name]}" for label, p in shown.items() if f.name in p and p[f.name] != f.default]
            default = preset.get(f.name, f.default)
            note = f"default: {default}" + (f"; with --init-from {', '.join(others)}" if others and not preset else "")
        help_ = f"{f.metadata['help']} ({note})".replace("%", "%%")
        default = default if defaults else argparse.SUPPRESS
        if f.type in ("bool", bool):
            ap.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help_)
        else:
            typ = {"int": int, "float": float, "str": str}.get(str(f.type), str)
            ap.add_argument(name, type=typ, default=default, help=help_)
    return ap


# ---- the launcher: memory settings must be in the environment before JAX starts ------------

def _gpu_memory_bytes() -> int | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def relaunch_with_budget(cfg: TrainConfig, budget_bytes: int | None) -> None:
    """On a GPU, re-exec this process with ``XLA_PYTHON_CLIENT_MEM_FRACTION = budget / card`` and
    the pinned-host cap lifted to 90 % of host RAM (definitions.md, "Device budget")."""
    if os.environ.get(_LAUNCHED) or budget_bytes is None:
        return
    card = _gpu_memory_bytes()
    if card is None:
        return
    env = dict(os.environ, **{_LAUNCHED: "1"})
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{min(budget_bytes / card, 0.99):.4f}"
    env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(0.9 * _host_memory_bytes() / 2**30)))
    os.execve(sys.executable, [sys.executable, "-m", "experiments.train", *sys.argv[1:]], env)


# ---- the job ---------------------------------------------------------------------------------

def run(cfg: TrainConfig, from_run=()) -> dict:
    """Train and write the run folder. Returns the report dict. ``from_run``: the settings
    ``--resume`` took from the run (:func:`resumed_settings`), marked on the ``config:`` line.

    Raises:
      UsageError: bad model name, budget, data, or a non-finite loss.
    """
    import jax
    import jax.numpy as jnp

    import chunkjax as cj
    from chunkjax.errors import format_bytes as fb
    from chunkjax.fit import describe as describe_fit
    from experiments import data as data_mod
    from experiments import distributed
    from experiments import job_model
    from experiments.report import RunFolder, plot_losses

    t_start = time.time()
    _validate(cfg)
    if cfg.device_budget != "auto":
        parse_budget(cfg.device_budget)  # refused before anything is loaded
    try:
        if cfg.init_from:
            model, tokenizer = job_model.load_pretrained(cfg.init_from)
        else:
            model, tokenizer = job_model.gpt_model(cfg.model), None
        if cfg.lora_rank:  # the base frozen, the adapters trained (models/lora.py)
            from models.lora import LoraSpec
            model = job_model.with_lora(model, LoraSpec.parse(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets), cfg.seed)
    except job_model.ModelError as e:
        raise UsageError(str(e)) from None
    for note in getattr(model.source, "notes", ()):  # how a Hugging Face folder was read where transformers warns
        print(f"note: {note}", flush=True)
    setup = {"load": time.time() - t_start}  # seconds per setup phase (report "setup_s")
    if cfg.seq > model.max_seq:
        raise UsageError(f"--seq {cfg.seq} exceeds the model's {model.max_seq} positions: use --seq <= {model.max_seq}")
    platform = jax.devices()[0].platform
    n_dev = jax.device_count() if cfg.zero_stage else 1  # every process's devices under jax.distributed
    if cfg.zero_stage and n_dev < 2:
        raise UsageError(f"--zero-stage {cfg.zero_stage} needs more than one device (this machine has one: nothing "
                         "to shard): drop --zero-stage, or run on several GPUs (or, on a CPU, set XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8 to test)")
    if cfg.batch % (n_dev * cfg.micro_batches):
        raise UsageError(f"--batch {cfg.batch} does not split over {n_dev} devices x {cfg.micro_batches} micro-batches: "
                         f"use a multiple of {n_dev * cfg.micro_batches}")
    cdt = {"auto": jnp.bfloat16 if platform == "gpu" else jnp.float32, "bfloat16": jnp.bfloat16,
           "bf16": jnp.bfloat16, "float32": jnp.float32, "fp32": jnp.float32}.get(cfg.compute_dtype)
    if cdt is None:
        raise UsageError(f"--compute-dtype {cfg.compute_dtype!r}: use bfloat16, float32 or auto")
    resume = None
    if cfg.resume:  # refuse a mismatch before anything is loaded or written
        resume = find_resume_point(cfg.resume)
    cfg = dataclasses.replace(cfg, lr_decay_steps=decay_steps_for(cfg, resume))
    warmup_given = cfg.warmup >= 0
    cfg = dataclasses.replace(cfg, warmup=warmup_for(cfg, resume))
    if resume is not None:
        check_resume_config(resume, dataclasses.asdict(cfg) | {"compute_dtype_resolved": jnp.dtype(cdt).name})
        check_resume_steps(resume, cfg.steps)

    try:
        if cfg.data:  # your own data, with the checkpoint's tokenizer
            from experiments.user_data import load_user_data
            td = load_user_data(cfg.data, tokenizer, seed=cfg.seed, min_val_tokens=cfg.batch * cfg.seq + 1,
                                min_train_tokens=cfg.seq + 1)
        else:
            td = (job_model.shakespeare_tokens(tokenizer) if tokenizer is not None
                  else data_mod.load_token_data(cfg.tokenizer, cfg.data_cache))
    except data_mod.MissingDataError as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        now = f" (now --batch {cfg.batch} --seq {cfg.seq})" if cfg.data and " split has " in str(e) else ""
        raise UsageError(str(e) + now) from None
    except OSError as e:
        raise UsageError(f"--data-cache {cfg.data_cache!r}: {e.strerror}: pick a writable folder") from None
    setup["data"] = time.time() - t_start - sum(setup.values())
    if td.meta.get("masked_train_tokens"):  # the loss on completions only: the mean over the whole batch's scored
        # tokens however --zero-stage and --micro-batches split it (chunkjax.loss_weight)
        from models import llama  # data with prompts come with a --init-from checkpoint: a Llama-family model
        model = dataclasses.replace(model, stages=llama.llama_stages(model.config, weighted=True))
    if td.vocab_size > model.vocab_size and cfg.init_from:
        raise UsageError(f"--init-from {cfg.init_from}: its tokenizer has {td.vocab_size} tokens but its model only "
                         f"{model.vocab_size} embedding rows: the folder's tokenizer.json does not belong to its "
                         "weights (use the tokenizer the checkpoint was trained with)")
    if td.vocab_size > model.vocab_size:
        raise UsageError(f"tokenizer {td.tokenizer.name} has {td.vocab_size} tokens but model {model.name} only "
                         f"{model.vocab_size} rows: pick a tokenizer that fits it (--tokenizer bpe{model.vocab_size} trains a BPE of "
                         f"that size on the corpus; --tokenizer gpt2 needs a model with >= 50257 rows)")

    rates = None
    if platform == "gpu":  # the cost model calibrated on this machine, as the benchmark plans
        from experiments.gpu_measure import calibrated_rates
        rates, _ = calibrated_rates()
    fitted = fit_model(cfg, model, compute_dtype=cdt, rates=rates)
    step, fit_report, problem = fitted
    setup["fit"] = time.time() - t_start - sum(setup.values())
    layout, schedule = step.layout, fit_report.schedule
    if resume is not None and resume.meta["layout_fingerprint"] != cj.checkpoint.layout_fingerprint(layout):
        saved = resume.meta["layout"]
        print(f"note: chunk layout {layout.chunk_size} x {layout.n_chunks} chunks differs from checkpoint step "
              f"{resume.step}'s ({saved['chunk_size']} x {saved['n_chunks']}): its leaves are moved to the new "
              "chunks (losses equal up to float summation order)", flush=True)
    budget = fit_report.budget_bytes

    resolved = dataclasses.asdict(cfg) | {"device_budget_bytes": budget, "platform": platform,
                                          "n_devices": problem.n_ranks, "compute_dtype_resolved": jnp.dtype(cdt).name}
    print(config_line(resolved, warmup_given, from_run), flush=True)
    if (note := schedule_note(cfg)):
        print(note, flush=True)
    if (note := interrupt_note()):
        print(note, flush=True)
    print(layout.summary().splitlines()[0], flush=True)
    for k, h in enumerate(fit_report.plans):
        print(f"compiled check {k}: plan for {fb(h['effective_budget_bytes'])} {h['counts']}: compiled peak "
              f"{fb(h['compiled_peak_bytes'])}, accounted {fb(h['predicted_peak_bytes'])} "
              f"(headroom {fit_report.headroom:.0%} of {fb(budget)})", flush=True)
    for note in fit_report.notes:
        print(f"note: {note}", flush=True)
    print(describe_fit(fit_report, problem), flush=True)
    h = fit_report.host
    pool = h.get("pinned_pool_bytes", h["pinned_host_bytes"])
    print(f"host: the plan needs {fb(h['need_bytes'])} ({fb(h['pinned_host_bytes'])} pinned"
          + (f" in a {fb(pool)} pinned pool" if pool > h["pinned_host_bytes"] else "") + " + "
          f"{fb(h['pageable_bytes'])} pageable + {fb(h['process_bytes'])} for the process"
          + (f" + {fb(h['device_on_host_bytes'])} of device memory" if h.get("device_on_host_bytes") else "")
          + (f"; with clipping, speculative host updates may back up to {fb(h['speculation_bytes'])} "
             "of state beside it" if h.get("speculation_bytes") and "host" in fit_report.schedule.update_locations
             else "")
          + f"; the plan's {schedule.predicted.host_bytes_per_param:.2f} B/param of the model, "
          + (f"{schedule.predicted.host_resident_bytes_per_param:.2f} B/param of its host-resident chunks"
             if schedule.predicted.host_resident_bytes_per_param else "no host-resident chunks") + ") of "
          + (f"{fb(h['available_bytes'])} available" if h.get("available_bytes") else "unknown available"),
          flush=True)

    if "train_plays" in td.meta:
        print(f"data: {td.train.size:,} training tokens ({len(td.meta['train_plays'])} plays), {td.val.size:,} "
              f"held-out tokens ({len(td.meta['val_plays'])} plays: {', '.join(td.meta['val_plays'])})", flush=True)
    elif "data_files" in td.meta:
        print(f"data: {td.train.size:,} training tokens ({td.meta['train_examples']} paragraphs/lines, "
              f"{td.meta['masked_train_tokens']:,} of them prompt tokens the loss skips), {td.val.size:,} held-out tokens "
              f"({td.meta['val_examples']}) from {', '.join(td.meta['data_files'])}", flush=True)

    folder = distributed.scratch_folder(resume, CHECKPOINT_DIR) or (  # process 0 alone writes the run folder
        _resumed_folder(resume.run_dir) if resume is not None else RunFolder.create(cfg.out_dir, model.run_name))
    from chunkjax.updaters import HostDeadlineError
    try:
        try:
            report = _train(cfg, model, fitted, td, folder, t_start, resolved, resume, setup)
        except HostDeadlineError as e:  # a stalled host-update thread: one line, exit 1
            raise JobFailed(str(e)) from None
        report.update(model_bytes_split(layout, schedule.placement, problem.cb))
        report["config"] = resolved
        folder.write_json("report.json", report)
        title = f"{model.name} {'fine-tune ' if model.pretrained else ''}(chunkjax)"
        plot_losses(folder.path / "loss.png", folder.path / "metrics.jsonl", title=title)
        final = folder.commit()
    except BaseException as e:
        if isinstance(e, Diverged):
            drop_diverged_checkpoints(folder.path / CHECKPOINT_DIR, e)
        kept = cj.checkpoint.latest_step(folder.path / CHECKPOINT_DIR)
        if kept is None and resume is None:
            folder.discard()
            raise
        how = f"continue with --resume {folder.path}"
        if isinstance(e, Diverged):  # why it stopped, beside the checkpoint kept
            folder.write_json("report.json", {"stopped": e.record, "config": resolved})
            how = (f"{how} --nonfinite skip" if e.record["why"].startswith("nonfinite") else
                   "its report.json says why the run stopped")
        _note_kept(e, f"{folder.path} keeps checkpoint step {kept}: {how}")
    finally:  # the disk tier's workers end with the run, on every path (else only a later garbage collection)
        from chunkjax.storage.updater import close_storage
        close_storage(fitted.step)
    print(f"run folder: {final}", flush=True)
    return report


def drop_diverged_checkpoints(ckpt_dir, e: Diverged) -> list[int]:
    """After :class:`Diverged`: delete the checkpoints of the diverged state (a run of skipped or
    dead steps from step ``since``: the checkpoints of step ``since - 1`` on hold the state that
    produced them; :func:`chunkjax.checkpoint.delete_checkpoint`), keep the older ones as they
    are, complete ``e.record`` with both lists (``checkpoints_dropped``, ``checkpoints_kept``)
    and its message with the deletion. Returns the deleted steps."""
    from chunkjax import checkpoint as ck
    since = e.record["since_step"]
    dropped = [s for s in ck.all_steps(ckpt_dir) if e.record["why"] in ("skip_limit", "dead", "exploded")
               and s >= since - 1]
    for s in dropped:
        ck.delete_checkpoint(ckpt_dir, s)
    e.record.update(checkpoints_dropped=dropped, checkpoints_kept=ck.all_steps(ckpt_dir))
    if dropped:
        e.args = (f"{e}; checkpoint step{'s' if len(dropped) > 1 else ''} {', '.join(map(str, dropped))} of the "
                  "diverged model deleted",)
    return dropped


def fit_model(cfg: TrainConfig, model, *, compute_dtype, rates=None, resident=None):
    """The job's step for ``model`` (:class:`experiments.job_model.JobModel`) through the one fit
    path (:func:`chunkjax.fit_step`): layout -> host-memory bound -> trace -> the tide plan with
    host updates (:func:`host_spec`) under ``cfg.device_budget`` -> host check -> step -> compiled
    check. ``--zero-stage`` splits every chunk over the local devices.

    Args:
      cfg: the job's settings (batch, seq, budget, chunking, micro-batches, ZeRO stage, optimizer).
      model: what is trained (only its stages and abstract params are read).
      compute_dtype: compute params / gradients dtype.
      rates: the cost model's rates (None: the defaults).
      resident: force exactly these chunks resident (device-updated) instead of searching (tests).
    Returns:
      :class:`chunkjax.fit.Fitted` ``(step, report, problem)``; the step is not initialised.
    Raises:
      UsageError: no plan fits the device budget or host memory, or a bad chunk size (one line).
    """
    import jax
    import jax.numpy as jnp

    import chunkjax as cj
    budget = "auto" if cfg.device_budget == "auto" else parse_budget(cfg.device_budget)
    mesh = cj.data_mesh() if cfg.zero_stage else None
    chunk_size = cfg.chunk_size or None
    if chunk_size is None and model.lora is not None:  # trainable chunks sized to the adapters
        from models.lora import adapter_chunk_size
        chunk_size = adapter_chunk_size(model.abstract_params, model.trainable, min_chunks=cfg.min_chunks)
    try:
        return cj.fit_step(model.stages, model.abstract_params, jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32),
                           device_budget=budget, resident=resident, host_optimizer=host_spec(cfg),
                           compute_dtype=compute_dtype, chunk_size=chunk_size, min_chunks=cfg.min_chunks,
                           prefetch=cfg.prefetch, cross_step=cfg.cross_step, micro_batches=cfg.micro_batches,
                           nonfinite="skip" if cfg.nonfinite == "skip" else "ignore", mesh=mesh,
                           zero_stage=cfg.zero_stage, flops_per_step=model.flops_per_token(cfg.seq) * cfg.batch * cfg.seq,
                           rates=rates, trainable=model.trainable,
                           host_budget="auto" if cfg.host_budget == "auto" else parse_budget(cfg.host_budget, "--host-budget"),
                           storage=storage_options(cfg))
    except cj.PlanError as e:
        raise UsageError(with_flags(str(e))) from None
    except ValueError as e:
        raise UsageError(f"--chunk-size: {e}" if cfg.chunk_size else str(e)) from None


def storage_options(cfg: TrainConfig):
    """``--storage`` and ``--storage-keep-previous`` as :class:`chunkjax.StorageOptions` (None without storage)."""
    if not cfg.storage:
        return None
    from chunkjax.storage.updater import StorageOptions
    return StorageOptions(tuple(d for d in cfg.storage.split(",") if d), keep_previous=cfg.storage_keep_previous)


def _resumed_folder(run_dir):
    """The RunFolder of a ``.partial`` run folder being resumed (committed to its final name), or of
    a finished one being trained on (written in place: its name stays)."""
    import pathlib

    from experiments.report import PARTIAL_SUFFIX, RunFolder
    path = pathlib.Path(run_dir)
    if not path.name.endswith(PARTIAL_SUFFIX):
        return RunFolder(path, path)
    base = path.with_name(path.name[:-len(PARTIAL_SUFFIX)])
    final, k = base, 1
    while final.exists():
        final, k = base.with_name(f"{base.name}-{k}"), k + 1
    return RunFolder(path, final)


def _note_kept(e: BaseException, note: str):
    """Re-raise ``e`` saying that the run folder was kept with a checkpoint to resume from (one
    line for UsageError / JobFailed; run_guarded prints ``kept_note`` for signals)."""
    if isinstance(e, (UsageError, JobFailed)):
        again = type(e)(f"{e}; {note}")
        again.__dict__.update(e.__dict__)  # Diverged's record
        raise again from None
    if isinstance(e, (KeyboardInterrupt, _Terminated)):
        e.kept_note = note
    else:
        print(f"the run failed: {note}", file=sys.stderr, flush=True)
    raise e


def _validate(cfg: TrainConfig) -> None:
    """Reject bad numbers before anything is allocated (one line each)."""
    if cfg.init_from:
        from experiments.job_model import PRESETS
        preset = _preset(cfg.init_from, PRESETS)
        for name in ("model", "tokenizer"):
            if getattr(cfg, name).lower() != preset[name]:
                raise UsageError(f"--{name} {getattr(cfg, name)!r} with --init-from {cfg.init_from}: the pre-trained "
                                 f"model brings its own ({preset[name]}); leave --{name} out")
    elif cfg.data:
        raise UsageError("--data needs --init-from (the checkpoint's tokenizer reads it): add --init-from <folder>")
    elif cfg.lora_rank:
        raise UsageError("--lora-rank needs --init-from (LoRA adapts a pre-trained model): add --init-from <folder>")
    if cfg.lora_rank < 0:
        raise UsageError(f"--lora-rank must be >= 0 (0: full fine-tuning), got {cfg.lora_rank}")
    if cfg.lora_rank:
        from models.lora import LoraSpec
        try:
            LoraSpec.parse(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
        except ValueError as e:
            raise UsageError(f"--lora-rank/--lora-alpha/--lora-targets: {e}") from None
    if cfg.host_budget != "auto":
        parse_budget(cfg.host_budget, "--host-budget")
    if cfg.storage:
        from chunkjax.storage.updater import storage_options
        try:
            storage_options(cfg.storage)
        except ValueError as e:
            raise UsageError(f"--storage: {e}") from None
        if cfg.zero_stage:
            raise UsageError("--storage runs on one device: leave out --zero-stage")
        for line in check_storage_dirs(storage_options(cfg.storage).dirs):
            print(line, flush=True)
    if cfg.export not in ("merged", "adapters", "both", "none"):
        raise UsageError(f"--export {cfg.export!r}: use merged, adapters, both or none")
    if cfg.export in ("adapters", "both") and not cfg.lora_rank:
        raise UsageError(f"--export {cfg.export} writes LoRA adapters: add --lora-rank R, or use --export merged")
    for name in ("steps", "batch", "seq", "prefetch", "eval_every", "eval_batches", "min_chunks"):
        if getattr(cfg, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.micro_batches < 1 or cfg.batch % cfg.micro_batches:
        raise UsageError(f"--micro-batches {cfg.micro_batches} must be >= 1 and divide --batch {cfg.batch}")
    if cfg.zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"--zero-stage {cfg.zero_stage}: use 1, 2 or 3 (ZeRO over the devices) or 0 (one device)")
    if cfg.nonfinite not in ("error", "skip"):
        raise UsageError(f"--nonfinite {cfg.nonfinite!r}: use error or skip")
    if cfg.skip_limit < 1:
        raise UsageError(f"--skip-limit must be >= 1, got {cfg.skip_limit}")
    if not (cfg.explode_factor == 0 or cfg.explode_factor > 1):
        raise UsageError(f"--explode-factor must be > 1 (times the running median loss) or 0 (off), got {cfg.explode_factor}")
    if cfg.warmup < -1:
        raise UsageError(f"--warmup must be >= 0 (steps; -1: the automatic default), got {cfg.warmup}")
    for name in ("lr_decay_steps", "sample_tokens", "chunk_size"):
        if getattr(cfg, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise UsageError(f"--lr must be a positive finite number, got {cfg.lr}")
    for name in ("weight_decay", "clip"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a finite number >= 0, got {v}")
    if cfg.checkpoint_every < -1:
        raise UsageError(f"--checkpoint-every must be >= -1 (-1: at each evaluation, 0: none), got {cfg.checkpoint_every}")
    if cfg.keep_checkpoints < 1:
        raise UsageError(f"--keep-checkpoints must be >= 1, got {cfg.keep_checkpoints}")
    if cfg.resume:
        return  # the run folder being resumed is written, not --out-dir
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out-dir {cfg.out_dir!r} cannot be created ({e.strerror}): pick a writable folder") from None
    try:  # a folder made and removed: os.access says yes to root where the filesystem says no
        os.rmdir(tempfile.mkdtemp(prefix=".writable_", dir=cfg.out_dir))
    except OSError as e:
        raise UsageError(f"--out-dir {cfg.out_dir!r} is not writable ({e.strerror}): pick a writable folder") from None


def check_storage_dirs(dirs) -> list[str]:
    """Check every ``--storage`` directory by writing, before any work and whether or not the plan
    will put chunks there: an existing directory gets a probe folder made and removed in it; a
    missing one is created (with its missing parents) and removed again. ``os.access`` is not
    enough (it says yes to root where the filesystem says no, e.g. under ``/sys`` or on a
    read-only mount). Nothing is left behind.

    Args:
      dirs: the directories (strings, as :class:`chunkjax.storage.updater.StorageOptions`' ``dirs``).
    Returns:
      one line per directory for the log: ``"storage: DIR (exists|created when used), FREE free"``
      (free bytes of its filesystem, :func:`chunkjax.errors.format_bytes`).
    Raises:
      UsageError: a directory that cannot be created or written (one line naming it and why).
    """
    from chunkjax.errors import format_bytes
    lines = []
    for d in dirs:
        existed = os.path.isdir(d)
        made = []  # the folders this check creates, deepest last
        try:
            if not existed:
                probe = os.path.abspath(d)
                while not os.path.exists(probe):
                    made.append(probe)
                    probe = os.path.dirname(probe)
                made.reverse()
                for m in made:
                    os.mkdir(m)
            os.rmdir(tempfile.mkdtemp(prefix=".writable_", dir=d))
            st = os.statvfs(d)
        except OSError as e:
            raise UsageError(f"--storage {d!r}: {'not writable' if existed else 'cannot be created'} "
                             f"({e.strerror}): give a writable directory (or leave out --storage)") from None
        finally:
            for m in reversed(made):
                try:
                    os.rmdir(m)
                except OSError:
                    pass
        lines.append(f"storage: {d} ({'exists' if existed else 'created when used'}), "
                     f"{format_bytes(st.f_bavail * st.f_frsize)} free")
    return lines


def parse_budget(text: str, flag: str = "--device-budget") -> int:
    """A byte count from ``"8GiB"`` / ``"500MB"`` / ``"1e9"`` (:func:`chunkjax.parse_bytes`) given to ``flag``.

    Raises:
      UsageError: the text is not a byte count (one line that says the accepted forms).
    """
    import chunkjax as cj
    try:
        return cj.parse_bytes(text)
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None


def decay_horizon(cfg: TrainConfig) -> int:
    """The step at which the cosine reaches lr/10: ``--lr-decay-steps``, or ``--steps`` when 0."""
    return cfg.lr_decay_steps or cfg.steps


#: The most warm-up steps of the automatic ``--warmup`` (-1), and the value for checkpoints that lack the key.
WARMUP_STEPS = 30


def warmup_for(cfg: TrainConfig, rp: ResumePoint | None = None) -> int:
    """The resolved ``--warmup`` (steps): the one given (>= 0); for -1 (the default), on
    ``--resume`` the run's (so that its schedule continues), else ``min(30, horizon // 10)`` with
    the cosine's horizon :func:`decay_horizon`: 30 for the 400-step demo, 2 at ``--steps 20``,
    none below 10 steps (a 30-step warm-up left short runs at a fraction of ``--lr`` throughout)."""
    if cfg.warmup >= 0:
        return cfg.warmup
    if rp is not None:
        return int(rp.meta["extra"]["config"].get("warmup", WARMUP_STEPS))
    return min(WARMUP_STEPS, decay_horizon(cfg) // 10)


def config_line(resolved: dict, warmup_given: bool = True, from_run=()) -> str:
    """The ``config:`` line of every resolved setting (``key=value``, one space between), with
    the sentinel values spelled out: ``checkpoint_every=each_eval(N)`` for -1 (a checkpoint at
    each evaluation, every ``eval_every`` = N steps, and after the last step), ``=off`` for 0,
    ``warmup=N(auto)`` when ``--warmup`` was left to :func:`warmup_for`, and on ``--resume``
    ``resume=<folder>(options-not-given:the-run's)`` with ``key=value(run)`` for the settings
    ``from_run`` whose run value replaced another default (:func:`resumed_settings`)."""
    shown = dict(resolved)
    every = shown.get("checkpoint_every")
    if every is not None and every < 0:
        shown["checkpoint_every"] = f"each_eval({shown['eval_every']})"
    elif every == 0:
        shown["checkpoint_every"] = "off"
    if not warmup_given:
        shown["warmup"] = f"{shown['warmup']}(auto)"
    for k in from_run:
        if k in shown:
            shown[k] = f"{shown[k]}(run)"
    if shown.get("resume"):
        shown["resume"] = f"{shown['resume']}(options-not-given:the-run's)"
    return "config: " + " ".join(f"{k}={v}" for k, v in shown.items())


def schedule_note(cfg: TrainConfig) -> str:
    """A one-line note when the warm-up does not end before the cosine's horizon (``--lr-decay-steps``
    or ``--steps``): :func:`host_spec` then stretches the cosine to ``warmup + 1`` steps, so the
    learning rate rises for the whole run and never decays (e.g. ``--steps 20`` with ``--warmup 30``,
    the default before it became :func:`warmup_for`'s); "" otherwise."""
    horizon = decay_horizon(cfg)
    cfg = dataclasses.replace(cfg, warmup=warmup_for(cfg))
    if not cfg.warmup or cfg.warmup < horizon:
        return ""
    return (f"note: --warmup {cfg.warmup} >= {'--lr-decay-steps' if cfg.lr_decay_steps else '--steps'} {horizon}: "
            f"the warm-up outlasts the cosine, so the learning rate still rises at step {horizon} "
            f"({(horizon - 1) / cfg.warmup:.2g} x --lr) and decays only after step {cfg.warmup}; pass a smaller "
            "--warmup to warm up and decay")


def host_spec(cfg: TrainConfig):
    """The job's optimizer as a host kernel spec (:class:`chunkjax.host_update.AdamW`): the
    warm-up + cosine schedule (0 -> lr over ``warmup`` steps, then down to lr/10 at ``steps``),
    ``weight_decay``, and global-norm clipping to ``clip`` (none when 0). Host-updated chunks run
    its numba kernel, device chunks its ``optax()`` twin (the same math)."""
    import optax

    from chunkjax.host_update import AdamW
    horizon = decay_horizon(cfg)
    cfg = dataclasses.replace(cfg, warmup=warmup_for(cfg))
    if cfg.warmup:
        sched = optax.warmup_cosine_decay_schedule(0.0, cfg.lr, cfg.warmup, max(horizon, cfg.warmup + 1), cfg.lr / 10)
    else:  # no warm-up: the first step at lr (a one-step ramp would give it lr 0; and --steps 1 no decay steps)
        sched = optax.cosine_decay_schedule(cfg.lr, horizon, alpha=0.1)
    return AdamW(sched, weight_decay=cfg.weight_decay, max_grad_norm=cfg.clip if cfg.clip > 0 else None)


def _optimizer(cfg: TrainConfig):
    """The job's optimizer as optax (``clip_by_global_norm`` then ``adamw``): :func:`host_spec`'s twin."""
    return host_spec(cfg).optax()


def _train(cfg, model, fitted, td, folder, t_start, resolved, resume=None, setup=None):
    """Initialise (or restore) the state of ``fitted.step``, train, evaluate, checkpoint, sample
    and (a pre-trained model) export; returns the report (the run folder's ``report.json``
    without the layout figures). ``setup``: seconds per setup phase so far (load, data, fit),
    completed here with ``init``, ``first_eval`` and ``first_step`` (report ``setup_s``)."""
    import zlib

    from experiments import distributed

    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from chunkjax import checkpoint as ck
    from chunkjax.host_ledger import HostLedger, plan_parts, release_free_heap
    from experiments import data as data_mod

    step, fit_report, problem = fitted
    layout, schedule = step.layout, fit_report.schedule
    pred = schedule.predicted
    ckpt_dir = folder.path / CHECKPOINT_DIR
    every = cfg.eval_every if cfg.checkpoint_every < 0 else cfg.checkpoint_every
    batches = data_mod.sample_batches(td.train, cfg.batch, cfg.seq, cfg.seed)
    metrics_path = folder.path / "metrics.jsonl"
    sample_before = None
    setup = dict(setup or {})
    # the process's RSS by kind beside the plan's host parts (issue 24), the parts printed before the init
    ledger = HostLedger(echo=lambda line: print(line, flush=True))
    ledger.mark("fit")
    ledger.account(plan_parts(problem, schedule, fit_report.host), held_at="fit")
    t_init = time.time()
    if resume is None:  # a random init goes leaf by leaf into chunks: no whole params pytree in host memory
        state = step.init(model.init(layout, cfg.seed))
        start, saved = 0, {"train_time": 0.0, "timed_steps": 0, "resumed_from": [], "wall_s_total": 0.0}
        if model.pretrained and cfg.sample_tokens:
            sample_before = _sample(step, state, model, td, cfg)
            if sample_before is not None:
                folder.write_text("sample_before.txt", sample_before + "\n")
                print("sample before training:\n" + sample_before, flush=True)
    else:
        if (folder.path / "sample_before.txt").exists():  # written by the run resumed
            sample_before = (folder.path / "sample_before.txt").read_text().rstrip("\n")
        # nothing is written until the state, the data position and the metrics are known good
        try:
            state, saved = ck.restore_checkpoint(ckpt_dir, step, resume.step)
        except (ck.CheckpointError, OSError, ValueError) as e:
            raise UsageError(f"--resume {resume.run_dir}: checkpoint step {resume.step} cannot be restored: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        start = int(saved["step"])
        nb = None
        for _ in range(int(saved["data_position"])):  # the data stream continues where it stopped
            nb = next(batches)
        if nb is not None and zlib.crc32(nb.tobytes()) != saved["data_check"]:
            raise UsageError(f"--resume {resume.run_dir}: the training data differ from the run's (batch "
                             f"{saved['data_position']} does not match): "
                             + ("give the run's --data files unchanged" if cfg.data else
                                "use the run's --data-cache and --tokenizer"))
        kept = _metrics_upto(metrics_path, start)
        if [r["step"] for r in kept] != list(range(start + 1)):
            print(f"warning: {metrics_path} lacks records of some steps <= {start}; the loss curve has gaps", flush=True)
        saved["resumed_from"] = list(saved["resumed_from"]) + [start]
        print(f"resumed from checkpoint step {start} of {cfg.steps} in {ckpt_dir}", flush=True)

    setup["init"] = time.time() - t_init
    release_free_heap()  # what the init's temporaries left in the C heap (0.2 GB of a 355M model on the CPU)
    ledger.mark("init")
    dev = problem.batch_sharding  # the first device, or split over the ZeRO ranks
    val_np = data_mod.eval_batches(td.val, cfg.batch, cfg.seq, cfg.eval_batches)
    # each batch's loss is the mean over its scored targets (ids >= 0: prompts are not scored); the
    # held-out loss is the mean over all of them, whatever --batch and --eval-batches cut them into
    val_scored = [int((np.asarray(b)[:, 1:] >= 0).sum()) for b in val_np]
    val = [jax.device_put(b, dev) for b in val_np]

    def val_loss(state):
        losses = [float(step.eval_loss(state, b)) for b in val]
        return float(np.dot(losses, val_scored) / max(1, sum(val_scored)))

    tokens_per_step = cfg.batch * cfg.seq
    train_time, timed_steps = float(saved["train_time"]), int(saved["timed_steps"])
    ckpt_s, ckpt_saved = 0.0, 0
    t_process = time.time()

    def save_checkpoint(i, state, last_batch):
        nonlocal ckpt_s, ckpt_saved
        t0 = time.perf_counter()
        extra = {"rng": jax.random.key(cfg.seed), "data_position": i, "data_check": zlib.crc32(last_batch.tobytes()),
                 "config": resolved, "step": i, "train_time": train_time, "timed_steps": timed_steps,
                 "resumed_from": saved["resumed_from"],
                 "wall_s_total": float(saved["wall_s_total"]) + time.time() - t_process}
        try:
            ck.save_checkpoint(ckpt_dir, i, step, state, extra)
        except ck.CheckpointWriteError as e:
            if isinstance(e.__cause__, (KeyboardInterrupt, _Terminated)):
                raise e.__cause__ from None
            raise JobFailed(f"checkpoint of step {i} not written: {e}") from None
        ck.prune_checkpoints(ckpt_dir, cfg.keep_checkpoints)
        ckpt_s += time.perf_counter() - t0
        ckpt_saved += 1

    if resume is None:
        t0 = time.time()
        records = [{"step": 0, "tokens": 0, "val_loss": val_loss(state)}]
        setup["first_eval"] = time.time() - t0
        if model.pretrained and not math.isfinite(records[0]["val_loss"]):
            raise UsageError(f"the held-out loss before training is {records[0]['val_loss']}: {_nonfinite_leaf(step, state)}")
        mf = open(metrics_path, "w")
        mf.write(json.dumps(records[0]) + "\n")
    else:
        records = kept
        _rewrite_metrics(metrics_path, records)  # drop the records of steps after the checkpoint
        ck.remove_stale_temporaries(ckpt_dir)  # a save cut short by the crash
        drop_skipped_checkpoints(ckpt_dir, start)
        mf = open(metrics_path, "a")
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    skipped = [r["step"] for r in records if r.get("skipped")]
    bar = tqdm(range(start + 1, cfg.steps + 1), initial=start, total=cfg.steps, disable=not cfg.progress,
               unit="step", dynamic_ncols=True, file=sys.stdout)
    watch, save_due = DivergenceWatch(cfg.skip_limit, cfg.lr, explode_factor=cfg.explode_factor), False
    watch.seed(losses)  # a resumed run: the running median of the losses before its checkpoint
    with mf:
        for i in bar:
            nb = next(batches)
            distributed.barrier(f"chunkjax-step-{i}")  # several processes reach the step together
            b = jax.device_put(nb, dev)
            t0 = time.perf_counter()
            unscored = bool(td.meta.get("masked_train_tokens")) and not (nb[:, 1:] >= 0).any()  # all prompt
            state, m = (state, {"loss": jnp.nan, "grad_norm": jnp.nan, "skipped": True}) if unscored else step(state, b)
            # the loss is ready at the head of the step; the global gradient norm only when the
            # whole backward is done: wait for both, so that dt is the step's (the host updates
            # still running are joined at the start of the next step, inside its dt)
            loss, grad_norm = float(m["loss"]), float(m["grad_norm"])
            dt = time.perf_counter() - t0
            skip = (cfg.nonfinite == "skip" or unscored) and bool(m["skipped"])
            if skip:
                skipped.append(i)
                print(f"step {i}: " + ("the batch scores no token (prompts only)" if unscored else
                                       f"non-finite gradients (loss {loss})") + ": skipped, no state changed", flush=True)
            if not unscored:  # a batch of prompts only says nothing about divergence
                watch.observe(i, loss, grad_norm, skip)
            if i > start + 1:  # the first step of a process compiles
                train_time += dt
                timed_steps += 1
            else:
                setup["first_step"] = dt
                print("setup: " + ", ".join(f"{k} {v:.1f} s" for k, v in setup.items()), flush=True)
                ledger.mark("first step")
            if not skip:
                losses.append(loss)
            rec = {"step": i, "tokens": i * tokens_per_step, "loss": loss if not skip else None,
                   "grad_norm": grad_norm if not skip else None, "step_s": dt, "skipped": skip}
            if i % cfg.eval_every == 0 or i == cfg.steps:
                rec["val_loss"] = val_loss(state)
                if not math.isfinite(rec["val_loss"]):
                    msg = f"validation loss became {rec['val_loss']} at step {i}: lower --lr (now {cfg.lr}) or keep --clip > 0"
                    raise Diverged(msg, {"step": i, "why": "nonfinite_val_loss", "message": msg, "loss": loss,
                                         "grad_norm": grad_norm, "since_step": i})
            mf.write(json.dumps(rec) + "\n")
            mf.flush()
            records.append(rec)
            save_due = save_due or bool(every and (i % every == 0 or i == cfg.steps))
            if save_due and (not watch.suspect or i == cfg.steps):  # no checkpoint of a state suspected dead
                os.fsync(mf.fileno())  # the metrics up to a checkpoint outlive a crash
                save_checkpoint(i, state, nb)
                save_due = False
            tps = timed_steps * tokens_per_step / train_time if train_time else float("nan")
            bar.set_postfix(loss=f"{loss:.3f}", val=f"{last_validation(records):.3f}",
                            tok_s=f"{tps:,.0f}" if math.isfinite(tps) else "-")
            if not cfg.progress and "val_loss" in rec:
                print(f"step {i}/{cfg.steps} loss {loss:.3f} val {rec['val_loss']:.3f} tokens/s {tps:,.0f} "
                      f"step {dt:.3f}s", flush=True)
    bar.close()
    step.wait(state)  # the last step's host updates

    peak_measured = None
    stats = jax.local_devices()[0].memory_stats() if jax.devices()[0].platform != "cpu" else None
    if stats and "peak_bytes_in_use" in stats:
        peak_measured = int(stats["peak_bytes_in_use"])
    sample = _sample(step, state, model, td, cfg) if cfg.sample_tokens else None
    if sample is not None:
        folder.write_text("sample.txt", sample + "\n")
        print("sample:\n" + sample, flush=True)
    export_dir = adapters_dir = None
    if cfg.export != "none" and model.export is not None:
        # adapters alone: only the trainable chunks leave the device (not the frozen base, 16 GB at 8B)
        tuned = trainable_params(step, state) if cfg.export == "adapters" else master_params(step, state)
        if cfg.export in ("merged", "both"):
            model.export(tuned, folder.path / "hf")
            export_dir = str(folder.final / "hf")
            print(f"Hugging Face checkpoint{' (LoRA merged)' if model.lora else ''}: {export_dir}", flush=True)
        if cfg.export in ("adapters", "both") and model.export_adapters is not None:
            model.export_adapters(tuned, folder.path / "adapters")
            adapters_dir = str(folder.final / "adapters")
            print(f"LoRA adapters (PEFT layout): {adapters_dir}", flush=True)
        del tuned
    disk = disk_bytes(schedule, state)
    if disk["storage_chunks"]:
        from chunkjax.errors import format_moved_bytes as moved
        measured = disk["disk_bytes_per_step_measured"]
        print(f"disk: {disk['storage_chunks']} storage chunks, per step "
              + ("no committed step measured" if measured is None else
                 f"{moved(disk['disk_read_bytes_per_step_measured'])} read + "
                 f"{moved(disk['disk_written_bytes_per_step_measured'])} written")
              + f" (plan: {moved(disk['disk_bytes_per_step_accounted'])} read + written)", flush=True)
    tps = timed_steps * tokens_per_step / train_time if train_time else None
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    ppl0, ppl1 = math.exp(vals[0]), math.exp(vals[-1])
    print(f"held-out loss {vals[0]:.4f} -> {vals[-1]:.4f} nats, perplexity {ppl0:.2f} -> {ppl1:.2f} "
          f"({100 * (ppl1 / ppl0 - 1):+.1f} %)", flush=True)
    step_s = [r["step_s"] for r in records if r["step"] >= 2 and "step_s" in r]
    return {
        "model": model.name, "init_from": cfg.init_from or None, "n_params": model.n_params, "steps": cfg.steps,
        "batch": cfg.batch, "seq": cfg.seq, "tokens": cfg.steps * tokens_per_step, "tokens_per_s": tps,
        "step_s_median": float(np.median(step_s)) if step_s else None,
        "tflops": tps * model.flops_per_token(cfg.seq) / 1e12 if tps else None,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None, "val_loss_first": vals[0], "val_loss_last": vals[-1],
        "val_ppl_before": ppl0, "val_ppl_after": ppl1, "val_ppl_change": ppl1 / ppl0 - 1,
        "val_tokens_scored": sum(val_scored),
        "unigram_val_loss": data_mod.unigram_cross_entropy(td.train, td.val, td.vocab_size),
        "device_budget_bytes": fit_report.budget_bytes,
        "peak_device_bytes_accounted": pred.peak_device_bytes, "peak_device_bytes_measured": peak_measured,
        "compiled_memory": fit_report.compiled,
        # model data as the plan counts it: compute params + master + optimizer state per parameter
        "model_bytes": int(model.n_params * (problem.cb.params + problem.cb.state) / layout.chunk_size),
        "device_chunk_bytes_accounted": pred.device_model_bytes,
        "chunk_bytes_accounted": problem.model_chunk_bytes,
        "h2d_bytes_per_step_accounted": pred.h2d_bytes_per_step,
        "d2h_bytes_per_step_accounted": pred.d2h_bytes_per_step,
        **disk,  # the disk tier's bytes per step (disk_bytes)
        "n_fetches_per_step_accounted": pred.n_fetches,
        "host_bytes_accounted": fit_report.host, "host_ledger": ledger.to_dict(),
        "host_bytes_per_param": pred.host_bytes_per_param,
        "host_resident_bytes_per_param": pred.host_resident_bytes_per_param,
        "host_working_bytes_accounted": pred.host_working_bytes, "master_fetch_chunks": len(schedule.master_fetch),
        # with a speculating step's bound (chunkjax.clip_plan.predicted_time); the planner's own figure beside it
        "step_s_predicted": fit_report.predicted_time.step_s, "step_s_planned": pred.time.step_s,
        "chunk_size": layout.chunk_size, "n_chunks": layout.n_chunks, "chunk_waste_bytes": layout.waste_bytes,
        "placement_counts": schedule.counts(), "update_locations": list(schedule.update_locations),
        "param_kinds": list(schedule.param_kinds),
        "param_chunks_pinned_host": sum(k != "device" for k in schedule.param_kinds),
        "zero_stage": cfg.zero_stage, "n_devices": problem.n_ranks, "fit": fit_report.to_dict(),
        "compute_dtype": jnp.dtype(problem.compute_dtype).name, "tokenizer": td.tokenizer.name, "vocab_size": td.vocab_size,
        "train_tokens_available": int(td.train.size), "val_tokens": int(td.val.size),
        "platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
        "jax_version": jax.__version__, "wall_s": time.time() - t_start,
        "wall_s_total": float(saved["wall_s_total"]) + time.time() - t_start, "sample": sample,
        "sample_before": sample_before, "export_dir": export_dir, "adapters_dir": adapters_dir,
        "trainable_params": model.n_trainable,
        "lora": dataclasses.asdict(model.lora) if model.lora is not None else None,
        **{k: td.meta[k] for k in ("train_plays", "val_plays", "data_files", "train_examples", "val_examples",
                                   "masked_train_tokens") if k in td.meta},
        "micro_batches": cfg.micro_batches, "nonfinite": cfg.nonfinite, "skipped_steps": skipped,
        "stopped": None,  # a run that diverged keeps this report only as {"stopped": why, "config": ...}
        "resumed_from_step": saved["resumed_from"][-1] if saved["resumed_from"] else None,
        "resumed_from_steps": list(saved["resumed_from"]),
        "checkpoint_every": every, "checkpoints_kept": ck.all_steps(ckpt_dir),
        "checkpoints_saved": ckpt_saved, "checkpoint_save_s": ckpt_s, "setup_s": setup,
    }


def disk_bytes(schedule, state) -> dict:
    """The disk tier's bytes per step for ``report.json`` (bytes; 0 / None without storage chunks):
    ``disk_bytes_per_step_accounted``, the plan's (every storage chunk's file read once and written
    once: :attr:`chunkjax.schedule.Prediction.disk_bytes_per_step`); ``disk_read_bytes_per_step_measured``,
    ``disk_written_bytes_per_step_measured`` and their sum ``disk_bytes_per_step_measured``, what the
    near-storage workers' reads and writes of the chunk files completed in the last committed step
    (:class:`chunkjax.storage.trainer.StepResult`; the benchmark's key; None when no step committed);
    ``storage_chunks``. Waits for the last step's disk work."""
    p = schedule.predicted
    out = {"storage_chunks": p.storage_chunks, "disk_bytes_per_step_accounted": p.disk_bytes_per_step,
           "disk_bytes_per_step_measured": None, "disk_read_bytes_per_step_measured": None,
           "disk_written_bytes_per_step_measured": None}
    if "storage" not in schedule.update_locations:
        return out
    tier = state.master[schedule.update_locations.index("storage")]  # a chunkjax.storage.updater.DiskState
    tier.wait()
    done = [r for r in tier.history if r is not None and not r.skipped and r.storage_read_bytes]
    if done:
        rd, wr = sum(done[-1].storage_read_bytes.values()), sum(done[-1].storage_written_bytes.values())
        out.update(disk_bytes_per_step_measured=rd + wr, disk_read_bytes_per_step_measured=rd,
                   disk_written_bytes_per_step_measured=wr)
    return out


def drop_skipped_checkpoints(ckpt_dir, start: int) -> list[int]:
    """Delete the checkpoints newer than ``start``, the step a resume restored: ``latest_step``
    skipped them (corrupt), and the resumed run saves those steps again (a save refuses an existing
    step). Returns the deleted steps."""
    from chunkjax import checkpoint as ck
    gone = [s for s in ck.all_steps(ckpt_dir) if s > start]
    for s in gone:
        ck.delete_checkpoint(ckpt_dir, s)
        print(f"note: checkpoint step {s} was skipped (corrupt): deleted, this run saves step {s} again", flush=True)
    return gone


def _metrics_upto(path, step: int) -> list[dict]:
    """The records of ``metrics.jsonl`` up to ``step`` (a line cut short by a crash ends the file)."""
    out = []
    with open(path) as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                break
            if r.get("step", -1) > step:
                break
            out.append(r)
    return out


def _rewrite_metrics(path, records) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def model_bytes_split(layout, placement, cb) -> dict:
    """Model data (real elements, padding excluded) stored in total and placed on the device
    between steps, in the dtypes actually kept (compute params, float32 master, optimizer state)."""
    import chunkjax as cj
    used = layout.chunk_used
    per_elem_params = cb.params / layout.chunk_size
    per_elem_state = cb.state / layout.chunk_size
    total = sum(u * (per_elem_params + per_elem_state) for u in used)
    dev = sum(u * ((per_elem_params if placement.param_kinds[c] == cj.DEVICE else 0)
                   + (per_elem_state if placement.state_kinds[c] == cj.DEVICE else 0)) for c, u in enumerate(used))
    return {"model_bytes_stored_accounted": int(total), "device_model_bytes_accounted": int(dev),
            "device_model_fraction_accounted": dev / total}


def last_validation(records) -> float:
    """The newest ``val_loss`` (nats per token) among the metric records (dicts), NaN if none."""
    for r in reversed(records):
        if "val_loss" in r:
            return r["val_loss"]
    return float("nan")


#: Largest model sampled from at the end (generation runs un-chunked on the host CPU).
_SAMPLE_MAX_PARAMS = 200_000_000


def _nonfinite_leaf(step, state) -> str:
    """Which pre-trained weight holds a NaN or inf (read chunk by chunk), as advice for the job's
    refusal; or what else to check when every weight is finite."""
    import numpy as np
    lay = step.layout
    chunks = (step.checkpoint_master(state, c) for c in range(lay.n_chunks))
    bad = {c: a for c, a in enumerate(chunks) if not np.isfinite(a).all()}
    for s in lay.slots:
        if any(p.chunk in bad and not np.isfinite(bad[p.chunk][p.offset:p.offset + p.size]).all() for p in s.pieces):
            return f"the checkpoint's {s.path} holds NaN or inf values: re-download or repair the checkpoint"
    return "every weight is finite: check the data (token ids within the model's vocabulary) and --compute-dtype"


def master_params(step, state) -> dict:
    """The float32 master params of ``state`` as a pytree of numpy arrays (host memory), after the
    pending host updates: what the export writes and the sampler reads. Under ZeRO a collective
    (every process calls it: the shards of every process gathered)."""
    import jax
    import numpy as np

    step.wait(state)
    if step.mesh is not None:  # gathered from every process's shards and slices (a collective)
        return jax.tree.map(np.asarray, step.master_params(state))
    masters = [step.checkpoint_master(state, c) for c in range(step.layout.n_chunks)]
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return jax.tree.map(np.asarray, step.layout.unpack(masters))


def trainable_params(step, state) -> dict:
    """The float32 master params of the trainable leaves of ``state`` only (numpy, nested dicts
    by leaf path, e.g. ``{"layer_0": {"q_proj": {"lora_a": ...}}}``), read from the trainable
    chunks alone after the pending host updates: what an adapters-only export writes, without
    the frozen chunks ever leaving the device. Under ZeRO: :func:`master_params` (a collective)."""
    import numpy as np

    if step.mesh is not None:
        return master_params(step, state)
    step.wait(state)
    lay = step.layout
    chunks = {c: step.checkpoint_master(state, c) for c in range(lay.n_chunks) if lay.chunk_trainable[c]}
    out: dict = {}
    for s in lay.slots:
        if not all(lay.chunk_trainable[p.chunk] for p in s.pieces):
            continue
        leaf = np.concatenate([chunks[p.chunk][p.offset:p.offset + p.size] for p in s.pieces]).reshape(s.shape)
        *keys, last = s.path.split("/")
        node = out
        for k in keys:
            node = node.setdefault(k, {})
        node[last] = leaf
    return out


def _sample(step, state, model, td, cfg) -> str | None:
    """A short continuation of a prompt, generated on the host CPU from the master params."""
    import jax
    import jax.numpy as jnp

    if model.n_params > _SAMPLE_MAX_PARAMS:
        return None
    cpu = jax.local_devices(backend="cpu")[0]
    params_np = master_params(step, state)
    with jax.default_device(cpu):
        params = jax.tree.map(jnp.asarray, params_np)
        prompt = td.meta.get("sample_prompt", "**ROMEO**\n")  # --data's, or the plays' speaker format
        ids = td.tokenizer.encode(prompt)
        ctx = min(cfg.seq, model.max_seq)
        # fixed-length window (right-padded; attention is causal) so the forward compiles once
        logits_fn = jax.jit(lambda p, t, pos: model.forward_logits(model.config, p, t)[0, pos])
        key = jax.random.key(cfg.seed + 1)
        for _ in range(cfg.sample_tokens):
            window = ids[-ctx:]
            padded = jnp.asarray(window + [0] * (ctx - len(window)), jnp.int32)[None]
            lg = logits_fn(params, padded, len(window) - 1)[: td.vocab_size] / 0.8
            key, sub = jax.random.split(key)
            ids.append(int(jax.random.categorical(sub, lg)))
    return td.tokenizer.decode(ids)


class _Terminated(Exception):
    """SIGTERM / SIGHUP arrived: unwind so the partial run folder is removed."""


def _on_signal(signum, frame):
    raise _Terminated(signal.Signals(signum).name)


def interrupt_note() -> str | None:
    """One line when this process ignores SIGINT (Ctrl-C, ``kill -INT``), else None. A
    non-interactive shell starts a background job (``python -m experiments.train ... &`` in a
    script, and what such a job starts) with SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: the run is left so (the launcher's choice, as every Python program
    leaves it), and this says how to stop it cleanly instead (SIGTERM, handled by
    :func:`run_guarded` however the job was started)."""
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        return None
    return (f"note: SIGINT (Ctrl-C, kill -INT) is ignored by this process (pid {os.getpid()}): the shell or launcher "
            f"that started it set that (a background job of a script does); stop the run cleanly with SIGTERM: "
            f"kill {os.getpid()}")


def run_guarded(job) -> int:
    """Run ``job()`` (a whole run that writes its folder under ``.partial`` and renames it at the
    end) with SIGTERM/SIGHUP turned into an unwind; returns the exit status: 0 done, 2 bad input
    (one line on stderr), 1 failed (:class:`JobFailed`, one line), 130 interrupted, 143 terminated
    (the partial folder removed by ``job``'s own cleanup, or kept when it holds a checkpoint).
    SIGTERM (``kill``, a scheduler's stop) is always handled; SIGHUP only when this process was
    not started ignoring it (``nohup``: the run goes on when its terminal closes); SIGINT is
    Python's (KeyboardInterrupt, or ignored as inherited: :func:`interrupt_note`)."""
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # nohup's (or the launcher's) choice: hanging up does not stop the run
            handlers[sig] = signal.signal(sig, _on_signal)
    try:
        job()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except JobFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt as e:
        print(f"interrupted: {getattr(e, 'kept_note', 'the partial run folder was removed')}", file=sys.stderr, flush=True)
        return 130
    except _Terminated as e:
        print(f"terminated by {e}: {getattr(e, 'kept_note', 'the partial run folder was removed')}", file=sys.stderr,
              flush=True)
        return 143
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)
    return 0


def main(argv=None) -> int:
    def job():
        cfg, from_run = resumed_settings(parse_args(argv), given_options(argv))  # --resume: the run's settings
        budget = None if cfg.device_budget == "auto" else parse_budget(cfg.device_budget)
        relaunch_with_budget(cfg, budget)
        from experiments import distributed
        try:  # several processes (srun, or JAX_COORDINATOR_ADDRESS ...): join them before any other JAX call
            distributed.start(cfg.zero_stage)
        except ValueError as e:
            raise UsageError(str(e)) from None
        run(cfg, from_run)

    return run_guarded(job)


if __name__ == "__main__":
    sys.exit(main())
