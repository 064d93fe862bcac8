"""Issue 25 on the lent H200: a Llama-3-8B-shaped Hugging Face checkpoint (random bf16 weights,
sharded) fine-tuned through the main job in a 24 GiB device budget at batch 8 x 2048, LoRA and
full, each job's tokens/s, peak device bytes and peak host RSS recorded (``finetune_8b.sh`` runs it).

    python experiments/gpu_checks/finetune_8b.py prepare --shape 8b --dir CK_DIR
    python experiments/gpu_checks/finetune_8b.py jobs --shape 8b --dir CK_DIR --out OUT --jobs lora,full --until T

``prepare``: (1) the corpus: carry/data's GPT-2 token arrays decoded back to text (its
gpt2.tiktoken) and a byte-level BPE ``tokenizer.json`` trained on it; (2) the checkpoint written by
:func:`models.hf.export_hf_checkpoint` (bf16, 2 GB shards, 8 written at once by threads), every
tensor tiled from a pool of random values at its own offset when its shard writes it (so writing
runs at the disk's pace: 16 GB at 8B).

``jobs``: each job a child process ``python -m experiments.train --init-from CK_DIR/model --data
CK_DIR/corpus.txt ...`` (LoRA rank 16 on every projection, then full fine-tuning), stopped at
its share of the time left before ``--until`` (a Unix time; LoRA 60 %, the last job all of it)
and by a memory guard that kills it when ``MemAvailable`` falls below :data:`GUARD_BYTES`
(polled every 0.1 s, so the kernel's out-of-memory killer never picks a process: recorded as
such). Run folders go to ``CK_DIR/runs_<job>`` (their report, metrics, loss plot and adapter
config copied to ``OUT/runs_<job>``). Records per job in ``OUT/finetune_8b.json``: the command,
exit status, wall time, peak host RSS (``wait4``), the job's setup phases, tokens/s, peak device
bytes (the runtime's), the plan's host bytes (and per parameter), or the one line it was refused
with. Shapes: ``8b`` (Meta-Llama-3-8B's), ``narrow`` (the same structure at d 512: the 8B's leaf
count and vocabulary on a CPU) and ``tiny``.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from chunkjax.host_memory import host_memory_available_bytes  # noqa: E402  (imports no JAX)

#: The memory guard kills a job when MemAvailable falls below this (bytes; ``$FT8B_GUARD_GIB`` GiB, default 6).
GUARD_BYTES = int(float(os.environ.get("FT8B_GUARD_GIB", "6")) * 2**30)
#: Job settings per shape: (device budget, batch, seq, steps).
JOB_SHAPES = {"8b": ("24GiB", 8, 2048, 5), "narrow": ("auto", 2, 128, 3), "tiny": ("auto", 2, 64, 3)}
#: Corpus size (GPT-2 tokens decoded) and BPE vocabulary per shape.
CORPUS = {"8b": (1_000_000, 16384), "narrow": (400_000, 4096), "tiny": (400_000, 2048)}
#: Job name -> its flags beyond the common ones.
JOBS = {"lora": ["--lr", "1e-4", "--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,o,gate,up,down",
                 "--export", "adapters"],
        "full": ["--lr", "1e-5", "--export", "none"]}
#: Report keys copied into the record of a job.
REPORT_KEYS = ("n_params", "trainable_params", "lora", "tokens_per_s", "step_s_median", "tflops",
               "peak_device_bytes_measured", "peak_device_bytes_accounted", "device_budget_bytes", "host_bytes_accounted",
               "val_loss_first", "val_loss_last", "loss_first", "loss_last", "param_chunks_pinned_host", "n_chunks",
               "chunk_size", "chunk_waste_bytes", "placement_counts", "compute_dtype", "adapters_dir",
               "h2d_bytes_per_step_accounted", "d2h_bytes_per_step_accounted", "step_s_predicted", "setup_s",
               "host_bytes_per_param", "host_resident_bytes_per_param", "host_working_bytes_accounted",
               "master_fetch_chunks", "fit")


def shape_config(shape: str):
    """The :class:`models.llama.LlamaConfig` of ``shape`` (module docstring)."""
    from experiments.gpu_checks.ft8b_plan import llama_shape
    return llama_shape({"narrow": "8b-narrow"}.get(shape, shape))


# ---- prepare ---------------------------------------------------------------------------------

def prepare(shape: str, ck: str, data: str = "carry/data") -> dict:
    """Write ``ck/corpus.txt`` and the checkpoint folder ``ck/model``; returns the phase times (s)."""
    import ml_dtypes
    import numpy as np
    from tokenizers import ByteLevelBPETokenizer

    from experiments.data import gpt2_tokenizer
    from models import hf
    os.makedirs(ck, exist_ok=True)
    times = {}
    t = time.perf_counter()
    n_tokens, vocab = CORPUS[shape]
    ids = np.load(os.path.join(data, "gpt2_train.npy"))[:n_tokens]
    gpt2 = gpt2_tokenizer(os.path.join(data, "gpt2.tiktoken"))
    text = gpt2.decode([int(i) for i in ids]).replace("<|endoftext|>", "\n\n")
    with open(os.path.join(ck, "corpus.txt"), "w") as fh:
        fh.write(text)
    times["corpus_s"] = time.perf_counter() - t
    t = time.perf_counter()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text.split("\n\n"), vocab_size=vocab, min_frequency=2,
                            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False)
    tok = bpe._tokenizer
    times["tokenizer_s"] = time.perf_counter() - t
    print(f"corpus: {len(ids):,} GPT-2 tokens -> {len(text):,} characters ({times['corpus_s']:.1f} s); BPE tokenizer "
          f"{tok.get_vocab_size()} ids ({times['tokenizer_s']:.1f} s)", flush=True)

    cfg = shape_config(shape)
    pool = (0.02 * np.random.default_rng(0).standard_normal(1 << 22)).astype(ml_dtypes.bfloat16)

    class Lazy:
        """A random bf16 tensor made only when its shard writes it: the pool tiled from an offset
        of its own, made in the stored (transposed) order so that the export's transpose back is
        a view of it."""

        def __init__(self, shape, k, transpose):
            self.shape, self.k, self.transpose = tuple(shape), k, transpose

        def __array__(self, dtype=None, copy=None):
            if len(self.shape) == 1:
                return np.ones(self.shape, ml_dtypes.bfloat16)  # norm scales
            n = int(np.prod(self.shape))
            off = (self.k * 7919) % pool.size
            flat = np.tile(pool, -(-(n + off) // pool.size))[off:off + n]
            return flat.reshape(self.shape[::-1]).T if self.transpose else flat.reshape(self.shape)

    params: dict = {}
    for k, m in enumerate(hf.tensor_map(cfg)):
        hf._set_path(params, m.path, Lazy(m.shape, k, m.transpose))
    out = os.path.join(ck, "model")
    t = time.perf_counter()
    hf.export_hf_checkpoint(cfg, params, out, tokenizer=tok, dtype=ml_dtypes.bfloat16,
                            max_shard_bytes=2 * 10**9 if shape == "8b" else 50 * 10**6, bos_token_id=0,
                            eos_token_id=1, overwrite=True, workers=8)
    times["checkpoint_s"] = time.perf_counter() - t
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    size = sum(os.path.getsize(os.path.join(out, f)) for f in files)
    times["checkpoint_bytes"] = size
    print(f"checkpoint {out}: {cfg.n_params / 1e9:.3f}B parameters, {size / 1e9:.2f} GB in {len(files)} shards "
          f"({times['checkpoint_s']:.1f} s, {size / 1e9 / max(times['checkpoint_s'], 1e-9):.2f} GB/s)", flush=True)
    return times


# ---- the jobs --------------------------------------------------------------------------------

def job_command(shape: str, ck: str, out: str, name: str) -> list[str]:
    """The main job's command line for job ``name`` (lora | full)."""
    budget, batch, seq, steps = JOB_SHAPES[shape]
    common = ["--device-budget", budget, "--batch", str(batch), "--seq", str(seq), "--steps", str(steps),
              "--eval-every", str(steps), "--eval-batches", "1", "--sample-tokens", "0", "--checkpoint-every", "0",
              "--no-progress", "--warmup", "0"]
    return [sys.executable, "-m", "experiments.train", "--init-from", os.path.join(ck, "model"), "--data",
            os.path.join(ck, "corpus.txt"), *common, "--out-dir", os.path.join(ck, f"runs_{name}"), *JOBS[name],
            *shlex.split(os.environ.get(f"FT8B_{name.upper()}_ARGS", ""))]


def run_job(cmd: list[str], log_path: str, limit_s: float, guard_bytes: int = GUARD_BYTES) -> dict:
    """Run ``cmd`` (cwd: the repository root) with its output in ``log_path``; kill it at
    ``limit_s`` seconds or when ``MemAvailable`` falls below ``guard_bytes``. Returns ``rc``,
    ``wall_s``, ``peak_host_rss_bytes`` (the child's ``ru_maxrss``), ``killed`` (None, ``"time"``
    or ``"memory"``) and ``min_mem_available_bytes``."""
    t = time.time()
    state = {"killed": None, "min_avail": None}
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        done = threading.Event()

        def guard():
            while not done.wait(0.1):
                avail = host_memory_available_bytes()
                if avail is not None:
                    state["min_avail"] = avail if state["min_avail"] is None else min(state["min_avail"], avail)
                why = ("time" if time.time() - t > limit_s else
                       "memory" if avail is not None and avail < guard_bytes else None)
                if why:
                    state["killed"] = why
                    p.kill()
                    return
        th = threading.Thread(target=guard, daemon=True)
        th.start()
        _, status, ru = os.wait4(p.pid, 0)
        done.set()
        th.join()
    return {"rc": os.waitstatus_to_exitcode(status), "wall_s": time.time() - t, "limit_s": limit_s,
            "peak_host_rss_bytes": ru.ru_maxrss * 1024, "killed": state["killed"],
            "min_mem_available_bytes": state["min_avail"]}


#: Files of a run folder copied into ``OUT/runs_<job>`` (the rest, e.g. the adapters' 168 MB at
#: 8B, stays in the scratch folder, deleted at the end).
KEPT_FILES = ("report.json", "metrics.jsonl", "loss.png", "adapters/adapter_config.json")


def job_record(name: str, cmd: list[str], res: dict, ck: str, out: str) -> dict:
    """The record of a finished job: ``res`` plus the report's keys, or the line it stopped with;
    the run folder's small files copied from ``ck`` to ``out``."""
    import shutil
    rec = {"command": shlex.join(cmd), **res}
    runs = os.path.join(ck, f"runs_{name}")
    reps = [os.path.join(r, "report.json") for r, _, fs in os.walk(runs) if "report.json" in fs]
    for rep in reps[:1]:
        run = os.path.dirname(rep)
        for f in KEPT_FILES:
            if os.path.isfile(os.path.join(run, f)):
                dst = os.path.join(out, f"runs_{name}", os.path.basename(run), f)
                os.makedirs(os.path.dirname(dst), exist_ok=True)
                shutil.copyfile(os.path.join(run, f), dst)
    with open(os.path.join(out, f"{name}.log")) as fh:
        lines = [ln.rstrip() for ln in fh if ln.strip()]
    if reps:
        with open(reps[0]) as fh:
            rep = json.load(fh)
        rec |= {k: rep.get(k) for k in REPORT_KEYS}
        host = rep.get("host_bytes_accounted") or {}
        n = rep.get("n_params") or 0
        if host and n:
            rec["host_bytes_per_param_accounted"] = (host.get("pinned_host_bytes", 0) + host.get("pageable_bytes", 0)) / n
            rec["peak_host_rss_bytes_per_param"] = res["peak_host_rss_bytes"] / n
    else:
        rec["error"] = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else None)
    rec["setup_lines"] = [ln for ln in lines if ln.startswith(("setup:", "plan:", "host:", "note:", "compiled check",
                                                               "ChunkLayout"))][:16]
    if res["killed"] == "memory":
        rec["error"] = (f"killed by the script's memory guard: MemAvailable fell below {GUARD_BYTES / 2**30:.0f} GiB "
                        f"at peak RSS {res['peak_host_rss_bytes'] / 2**30:.1f} GiB (the job's host check had passed)")
    elif res["killed"] == "time":
        rec["error"] = f"stopped at its time limit ({res['limit_s']:.0f} s); last line: {lines[-1] if lines else None}"
    return rec


def run_jobs(shape: str, ck: str, out: str, names: list[str], until: float) -> dict:
    """Run the jobs ``names`` in order, each given the time left before ``until`` (the last one all
    of it, the others their share less 30 s for the rest); returns the records."""
    os.makedirs(out, exist_ok=True)
    res = {"shape": shape, "host_ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
           "mem_available_bytes_before": host_memory_available_bytes()}
    share = {"lora": 0.6, "full": 1.0}
    for k, name in enumerate(names):
        left = until - time.time()
        limit = left if k == len(names) - 1 else max(60.0, share.get(name, 0.5) * left)
        cmd = job_command(shape, ck, out, name)
        print(f"{name}: {shlex.join(cmd)} (limit {limit:.0f} s)", flush=True)
        rec = job_record(name, cmd, run_job(cmd, os.path.join(out, f"{name}.log"), limit), ck, out)
        res[name] = rec
        print(name, json.dumps({k: rec.get(k) for k in ("rc", "wall_s", "tokens_per_s", "peak_device_bytes_measured",
                                                       "peak_host_rss_bytes", "host_bytes_per_param_accounted",
                                                       "val_loss_first", "val_loss_last", "setup_s", "error")}),
              flush=True)
        with open(os.path.join(out, "finetune_8b.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("prepare", "jobs"))
    ap.add_argument("--shape", default="8b", choices=tuple(JOB_SHAPES))
    ap.add_argument("--dir", required=True, help="scratch folder: corpus.txt and the checkpoint model/")
    ap.add_argument("--out", default=None, help="jobs: records, logs and run folders go here")
    ap.add_argument("--jobs", default="lora,full")
    ap.add_argument("--until", type=float, default=None, help="jobs: Unix time by which every job has ended")
    ap.add_argument("--data", default=os.path.join(ROOT, "carry", "data"))
    a = ap.parse_args(argv)
    if a.what == "prepare":
        times = prepare(a.shape, a.dir, a.data)
        with open(os.path.join(a.dir, "prepare.json"), "w") as fh:
            json.dump(times, fh)
        return 0
    names = [n for n in a.jobs.split(",") if n]
    bad = [n for n in names if n not in JOBS]
    if bad or not a.out:
        ap.error(f"--jobs takes {', '.join(JOBS)} (got {a.jobs}) and jobs needs --out")
    res = run_jobs(a.shape, a.dir, a.out, names, a.until or time.time() + 480)
    try:
        with open(os.path.join(a.dir, "prepare.json")) as fh:
            res["prepare"] = json.load(fh)
    except OSError:
        pass
    with open(os.path.join(a.out, "finetune_8b.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"wrote {os.path.join(a.out, 'finetune_8b.json')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
