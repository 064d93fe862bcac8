# Issue 25 on the lent H200: a Llama-3-8B-shaped checkpoint (random bf16 weights, Hugging Face
# layout, 9 shards, 16 GB) fine-tuned through the main job in a 24 GiB device budget, batch 8 x 2048,
# LoRA (rank 16 on every projection) then full fine-tuning, 5 steps each, on the corpus in carry/data.
#   bash experiments/gpu_checks/finetune_8b.sh                   # the H200, both jobs in one call
#   JOBS=lora bash experiments/gpu_checks/finetune_8b.sh         # one job a call (each call writes
#   JOBS=full bash experiments/gpu_checks/finetune_8b.sh         #   the checkpoint again, ~20 s)
#   FT8B_FULL_ARGS="--host-budget 100GiB" ...                  # more flags for one job (FT8B_LORA_ARGS too)
#   SHAPE=tiny bash experiments/gpu_checks/finetune_8b.sh        # the same pieces on a CPU (or SHAPE=narrow:
#                                                                #   d 512, 32 layers, vocab 128256)
# Carry: carry/data (gpt2_train.npy, gpt2.tiktoken). Records go to $OUT/finetune_8b.json (commands,
# exit status, setup phases, tokens/s, peak device bytes, peak host RSS, the plan's host bytes per
# parameter, or the one line a job was refused with) and $OUT/{lora,full}.log.
# Every job ends by TOTAL_S (default 540 s) after the start: the scratch checkpoint (CK_DIR, on
# the disk, not /tmp) and the corpus are written first (experiments/gpu_checks/finetune_8b.py
# prepare), then each job gets its share of the time left and is killed at its limit, or by the
# memory guard when MemAvailable falls below 6 GiB (recorded: the kernel's OOM killer never runs).
# Full fine-tuning needs a float32 master and AdamW state per parameter in host memory: the job's
# host check refuses it in one line when its plan does not fit MemAvailable (recorded).
set -u
export PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-8b}
JOBS=${JOBS:-lora,full}
OUT=${OUT:-/tmp/ft8b_out}
CK_DIR=${CK_DIR:-$PWD/.scratch_ft8b}
TOTAL_S=${TOTAL_S:-540}
PY=${PYTHON:-python}
t0=$(date +%s)
rm -rf "$CK_DIR"  # a call cut short may have left a checkpoint and run folders behind
mkdir -p "$OUT" "$CK_DIR"
$PY experiments/gpu_checks/finetune_8b.py prepare --shape "$SHAPE" --dir "$CK_DIR" 2>&1 | tee "$OUT/prepare.log"
if [ ! -f "$CK_DIR/model/config.json" ]; then
  echo "the checkpoint was not written (above): stopping"; rm -rf "$CK_DIR"; exit 1
fi
echo "prepared in $(( $(date +%s) - t0 )) s"
$PY experiments/gpu_checks/finetune_8b.py jobs --shape "$SHAPE" --dir "$CK_DIR" --out "$OUT" --jobs "$JOBS" \
  --until $(( t0 + TOTAL_S - 10 ))
for j in ${JOBS//,/ }; do echo "== $j"; tail -n 6 "$OUT/$j.log"; done
rm -rf "$CK_DIR"
echo "total $(( $(date +%s) - t0 )) s"
