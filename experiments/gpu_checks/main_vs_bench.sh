# Issue 20 on the GPU: the README's GPU command through the main job against the benchmark's
# chunkjax system, same model, batch, budget and optimizer (AdamW, host updates), in one call.
#   bash experiments/gpu_checks/main_vs_bench.sh <run-id> [extra main-job flags]   (token arrays in carry/data)
# The bench's chunkjax system runs AdamW lr 1e-4, weight decay 1e-4, no clipping; the main job is
# given --clip 0 --weight-decay 1e-4 to match (its lr schedule changes no speed), and is run a
# second time with its defaults (clipping at 1.0) to show what clipping costs today.
set -u
RUN=${1:-mvb}; shift || true
export PYTHONUNBUFFERED=1
M="--model GPT2_1B --device-budget 8GiB --batch 16 --seq 1024"
J="--steps 30 --data-cache carry/data --no-progress --sample-tokens 0 --checkpoint-every 0 --eval-batches 2"
python -m experiments.train $M $J --clip 0 --weight-decay 1e-4 --out-dir $OUT/runs_noclip "$@" > $OUT/main_noclip.log 2>&1; echo "main (no clip) rc=$?"
python -m experiments.bench $M --systems chunkjax --steps 10 --run-id $RUN --results-dir $OUT > $OUT/bench.log 2>&1; echo "bench rc=$?"
python -m experiments.train $M $J --out-dir $OUT/runs_clip "$@" > $OUT/main_clip.log 2>&1; echo "main (README defaults, clip 1.0) rc=$?"
python - "$RUN" <<'P'
import glob, json, os, sys
O, run = os.environ["OUT"], sys.argv[1]
def rep(d):
    f = glob.glob(f"{O}/{d}/*/report.json")
    return json.load(open(f[0])) if f else {}
a, c = rep("runs_noclip"), rep("runs_clip")
b = json.load(open(f"{O}/bench_{run}.json"))
sysrec = b["systems"]["chunkjax"] if "systems" in b else b
bt = sysrec.get("tokens_per_s")
out = {"model": "GPT2_1B", "batch": 16, "seq": 1024, "device_budget_bytes": 8 * 2**30,
       "main_job_tokens_per_s": a.get("tokens_per_s"), "bench_tokens_per_s": bt,
       "ratio": (a.get("tokens_per_s") or 0) / bt if bt else None,
       "main_job_clip1_tokens_per_s": c.get("tokens_per_s"),
       "optimizer": "AdamW, weight decay 1e-4, no clipping (main job also with its default clip 1.0: main_job_clip1_tokens_per_s)",
       "main_job_report_noclip": {k: a.get(k) for k in ("peak_device_bytes_measured", "param_chunks_pinned_host", "n_fetches_per_step_accounted", "step_s_predicted", "device_budget_bytes", "schedule_counts", "placement")},
       "bench_record": {k: sysrec.get(k) for k in ("step_s_median", "peak_bytes_in_use", "peak_device_bytes_measured", "schedule_counts", "mfu", "tflops", "feasible", "error")}}
json.dump(out, open(f"{O}/main_job_vs_bench_{run}.json", "w"), indent=1)
print(json.dumps({k: out[k] for k in ("main_job_tokens_per_s", "bench_tokens_per_s", "ratio", "main_job_clip1_tokens_per_s")}))
P
tail -4 $OUT/main_noclip.log $OUT/main_clip.log; tail -15 $OUT/bench.log
