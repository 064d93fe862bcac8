# Issue 25 on the lent H200: a Llama-3-8B-shaped checkpoint (random weights, Hugging Face layout,
# bf16, sharded) fine-tuned through the main job in a 24 GiB device budget, batch 8 x 2048: full
# fine-tuning and LoRA, a few steps each, in ONE call (~9 min; JOBS_S=450 s for the two jobs, LoRA
# first; a job still running at its limit is killed and recorded so), on the corpus in carry/data.
#   bash experiments/gpu_checks/finetune_8b.sh                 # the H200 (writes JSON under $OUT)
#   SHAPE=tiny bash experiments/gpu_checks/finetune_8b.sh      # the same pieces on a CPU, tiny shape
# Steps: (1) the corpus: carry/data's GPT-2 token arrays decoded back to text (its gpt2.tiktoken),
# a byte-level BPE tokenizer.json trained on it; (2) the checkpoint written by models/hf.py's export
# tensor by tensor (random values tiled from a pool, so writing is disk-bound, 16 GB at 8B) into
# a scratch folder on the disk (CK_DIR, default ./.scratch_ft8b, not /tmp, which may be RAM; 64 GiB
# free on the H200); (3) LoRA rank 16 on every projection, then (4) the full fine-tune: at ~16 host bytes per parameter an 8B model needs ~128 GB of host RAM,
# above what a 125 GiB host leaves, so the job is expected to refuse it in one line: the script
# records that line. LoRA: the bf16 base frozen (no master, no optimizer state, fetched like any
# chunk), the adapters exported in PEFT's layout.
# Each job's tokens/s, peak device bytes (the runtime's) and peak host RSS (wait4 of the job) go
# to $OUT/finetune_8b.json with the commands. The scratch checkpoint is deleted at the end.
set -u
export PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-8b}
OUT=${OUT:-/tmp/ft8b_out}
CK_DIR=${CK_DIR:-$PWD/.scratch_ft8b}
mkdir -p "$OUT" "$CK_DIR"
if [ "$SHAPE" = tiny ]; then
  J="--device-budget auto --batch 2 --seq 64 --steps 3 --eval-every 3"
else
  J="--device-budget 24GiB --batch 8 --seq 2048 --steps 5 --eval-every 5"
fi
J="$J --eval-batches 1 --sample-tokens 0 --checkpoint-every 0 --no-progress --warmup 0"
t0=$(date +%s)
python - "$SHAPE" "$CK_DIR" <<'P'
# (1) corpus + tokenizer, (2) the random checkpoint
import json, os, sys, time
import numpy as np, ml_dtypes
from experiments.data import gpt2_tokenizer
from models import hf, llama
shape, ck = sys.argv[1], sys.argv[2]
t = time.time()
ids = np.load("carry/data/gpt2_train.npy")[: 400_000 if shape == "tiny" else 2_000_000]
gpt2 = gpt2_tokenizer("carry/data/gpt2.tiktoken")
text = gpt2.decode([int(i) for i in ids]).replace("<|endoftext|>", "\n\n")
with open(os.path.join(ck, "corpus.txt"), "w") as fh:
    fh.write(text)
from tokenizers import ByteLevelBPETokenizer
bpe = ByteLevelBPETokenizer()
bpe.train_from_iterator(text.split("\n\n"), vocab_size=2048 if shape == "tiny" else 16384, min_frequency=2,
                        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"], show_progress=False)
tok = bpe._tokenizer
print(f"corpus: {len(ids):,} GPT-2 tokens -> {len(text):,} characters; tokenizer {tok.get_vocab_size()} ids "
      f"({time.time() - t:.0f} s)", flush=True)
if shape == "tiny":
    cfg = llama.LlamaConfig(name="llama3-tiny", vocab_size=4096, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            head_dim=16, d_ff=160, rope_theta=500000.0, max_seq_len=256, tie_embeddings=False,
                            rope_type="llama3", rope_factor=8.0, rope_original_max_pos=64)
    shard = 200_000
else:  # Meta-Llama-3-8B's shape
    cfg = llama.LlamaConfig(name="llama3-8b-random", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32,
                            n_kv_heads=8, head_dim=128, d_ff=14336, rope_theta=500000.0, max_seq_len=8192,
                            tie_embeddings=False, rope_type="llama3", rope_factor=8.0, rope_original_max_pos=8192)
    shard = 5 * 10**9
pool = (0.02 * np.random.default_rng(0).standard_normal(1 << 22)).astype(ml_dtypes.bfloat16)


class Lazy:
    """A random bf16 tensor made only when the export writes it (tiled from the pool at a
    random offset; made in the transposed order so that the export's transpose is contiguous)."""

    def __init__(self, shape, k):
        self.shape, self.k = tuple(shape), k

    def __array__(self, dtype=None, copy=None):
        if len(self.shape) == 1:
            return np.ones(self.shape, ml_dtypes.bfloat16)  # norm scales
        off = (self.k * 7919) % pool.size
        return np.resize(np.roll(pool, off), self.shape[::-1]).T


params = {}
for k, m in enumerate(hf.tensor_map(cfg)):
    node = params
    *head, last = m.path.split("/")
    for p in head:
        node = node.setdefault(p, {})
    node[last] = Lazy(m.shape, k)
out = os.path.join(ck, "model")
t = time.time()
hf.export_hf_checkpoint(cfg, params, out, tokenizer=tok, dtype=ml_dtypes.bfloat16, max_shard_bytes=shard,
                        bos_token_id=0, eos_token_id=1, overwrite=True)
size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
print(f"checkpoint {out}: {cfg.n_params / 1e9:.2f}B parameters, {size / 1e9:.1f} GB, "
      f"{len([f for f in os.listdir(out) if f.endswith('.safetensors')])} shards ({time.time() - t:.0f} s)", flush=True)
P
[ -f "$CK_DIR/model/config.json" ] || { echo "the checkpoint was not written (above): stopping"; exit 1; }
echo "prepared in $(( $(date +%s) - t0 )) s"
python - "$SHAPE" "$CK_DIR" "$OUT" "$J" <<'P'
# (3) LoRA, (4) full: each job a child process; its peak RSS from wait4
import json, os, shlex, subprocess, sys, threading, time
shape, ck, out, common = sys.argv[1:5]
host_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
base = ["python", "-m", "experiments.train", "--init-from", f"{ck}/model", "--data", f"{ck}/corpus.txt", *shlex.split(common)]
# LoRA first (what fits), then the full fine-tune with the time left; each killed at its limit
jobs = {"lora": ["--lr", "1e-4", "--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,o,gate,up,down",
                 "--export", "adapters"],
        "full": ["--lr", "1e-5", "--export", "none"]}
deadline = time.time() + float(os.environ.get("JOBS_S", "450"))
res = {"shape": shape, "host_ram_bytes": host_total, "note": (
    "full fine-tuning keeps a float32 master, Adam m and v (12 B/param) plus bf16 params and gradients in host "
    "memory: ~16 B/param, ~128 GB for 8.03B parameters, more than a 125 GiB host leaves; the job refuses it in "
    "one line (recorded below) and the LoRA run is what fits")}
for name, extra in jobs.items():
    cmd = base + ["--out-dir", f"{out}/runs_{name}", *extra]
    t = time.time()
    limit = max(30.0, deadline - t - (150 if name == "lora" else 0))
    with open(f"{out}/{name}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        timer = threading.Timer(limit, p.kill)
        timer.start()
        _, status, ru = os.wait4(p.pid, 0)
        timer.cancel()
    rc = os.waitstatus_to_exitcode(status)
    rec = {"command": " ".join(cmd), "rc": rc, "wall_s": time.time() - t, "limit_s": limit, "killed_at_limit": rc == -9,
           "peak_host_rss_bytes": ru.ru_maxrss * 1024}
    reps = [os.path.join(r, d, "report.json") for r, ds, _ in os.walk(f"{out}/runs_{name}") for d in ds]
    reps = [r for r in reps if os.path.isfile(r)]
    if reps:
        rep = json.load(open(reps[0]))
        rec |= {k: rep.get(k) for k in ("n_params", "trainable_params", "lora", "tokens_per_s", "step_s_median", "tflops",
                                        "peak_device_bytes_measured", "peak_device_bytes_accounted", "device_budget_bytes",
                                        "host_bytes_accounted", "val_loss_first", "val_loss_last", "loss_first",
                                        "loss_last", "param_chunks_pinned_host", "n_chunks", "compute_dtype",
                                        "adapters_dir", "h2d_bytes_per_step_accounted")}
    else:
        with open(f"{out}/{name}.log") as fh:
            lines = [l.strip() for l in fh if l.strip()]
        rec["error"] = next((l for l in reversed(lines) if l.startswith("error:")), lines[-1] if lines else None)
    res[name] = rec
    print(name, json.dumps({k: rec.get(k) for k in ("rc", "tokens_per_s", "peak_device_bytes_measured",
                                                     "peak_host_rss_bytes", "val_loss_first", "val_loss_last",
                                                     "error", "wall_s")}), flush=True)
json.dump(res, open(f"{out}/finetune_8b.json", "w"), indent=1)
print(f"wrote {out}/finetune_8b.json", flush=True)
P
tail -n 5 "$OUT/full.log" "$OUT/lora.log"
rm -rf "$CK_DIR/model"
echo "total $(( $(date +%s) - t0 )) s"
