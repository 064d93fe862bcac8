# Issue 23 on the GPU in two calls of < 8 min each (one H200): offloaded training against in-memory training.
#   bash experiments/gpu_checks/overlap_6b.sh <run-id> a      # call 1: 6b16 plain JAX vs chunkjax, clip 1.0, finer programs
#   bash experiments/gpu_checks/overlap_6b.sh <run-id> b      # call 2: 4 micro-batches, batch 32, GPT2_1B overhead
#   bash experiments/gpu_checks/overlap_6b.sh <run-id> table  # only the table of the runs under $OUT
# a: GPT3_6B batch 16 x 1024, AdamW: plain JAX with everything on the device (125 GiB) against
#    chunkjax at a 24 GiB budget (tide plan, the update split, streamed updates overlapping the
#    backward), then chunkjax with clip_by_global_norm(1.0) (speculative host updates; streamed
#    updates after the norm), then chunkjax with the backward cut into programs of 2 moments
#    (6b16_fine: the host thread and the streamed pipeline start sooner, streamed chunks spread
#    over the backward and started early; on CPU traces the planner predicts 1.64 s against 1.98 s
#    for the default cut; skipped when the part's time runs out);
# b: the same with 4 micro-batches, GPT3_6B batch 32 x 1024 at 24 GiB (model TFLOP/s), GPT2_1B batch
#    16 on the whole card against plain JAX (overhead when the model fits).
# Every run is experiments.bench (one subprocess per system, the matmul probe in each bench call,
# jax's persistent compilation cache shared by the runs of a call); 3 timed steps after one warm-up.
# Each run gets the time left of the part's 470 s (a run that would start with less than 60 s left
# is skipped and named in the table), so a part ends inside 8 minutes. JSON under $OUT
# (bench_<run>_*.json and overlap_6b_<run>.json); the table is printed last.
set -u
RUN=${1:-ovl}
PART=${2:-a}
export PYTHONUNBUFFERED=1
START=$SECONDS
LIMIT=${LIMIT:-470}
# CPU smoke test: OUT=/tmp/o BIG=micro SMALL=micro SEQ=16 BUDGET=12MiB WHOLE=1GiB bash ... a (numbers meaningless)
B="python -m experiments.bench --seq ${SEQ:-1024} --results-dir $OUT --steps ${STEPS:-3}"
SIX="--model ${BIG:-GPT3_6B} --device-budget ${BUDGET:-24GiB}"
WHOLE=${WHOLE:-125GiB}
run() {  # run <tag> <bench args...>: within the part's time left, else skipped
  local tag=$1; shift
  local left=$((LIMIT - (SECONDS - START)))
  if (( left < 60 )); then echo "skip $tag (time)"; echo "$tag" >> $OUT/skipped.txt; return; fi
  local t0=$SECONDS
  timeout -k 10 $left $B --run-id ${RUN}_$tag --time-limit $((left - 5)) "$@" > $OUT/$tag.log 2>&1
  echo "$tag rc=$? $((SECONDS - t0)) s"
}
if [[ $PART == all || $PART == a ]]; then
  run 6b16 $SIX --batch 16 --systems plain_jax,chunkjax --system-budget plain_jax=$WHOLE
  run 6b16_clip $SIX --batch 16 --systems chunkjax --set max_grad_norm=1.0
  FINE=$(python -c "from models import gpt; n = len(gpt.gpt_stages(gpt.get_config('${BIG:-GPT3_6B}'))); print([0] + list(range(n, 2 * n - 1, 2)))" | tr -d ' ')
  run 6b16_fine $SIX --batch 16 --systems chunkjax --set segments=$FINE
fi
if [[ $PART == all || $PART == b ]]; then
  run 6b16_mb4 $SIX --batch 16 --systems chunkjax --set micro_batches=4
  run 6b32 $SIX --batch 32 --systems chunkjax
  run 1b16 --model ${SMALL:-GPT2_1B} --batch 16 --device-budget $WHOLE --systems plain_jax,chunkjax
fi
for t in 6b16 6b16_clip 6b16_fine 6b16_mb4 6b32 1b16; do [ -f $OUT/$t.log ] && { echo "== $t"; tail -4 $OUT/$t.log; }; done
python - "$RUN" <<'P'
import glob, json, os, sys
O, run = os.environ["OUT"], sys.argv[1]
rows = []
out = {"run_id": run, "rows": rows}
def load(tag):
    f = f"{O}/bench_{run}_{tag}.json"
    return json.load(open(f)) if os.path.exists(f) else None
def tps(tag, system="chunkjax"):
    r = load(tag)
    s = (r or {}).get("systems", {}).get(system) or {}
    return s.get("tokens_per_s") if s.get("feasible") else None
for tag in ("6b16", "6b16_clip", "6b16_fine", "6b16_mb4", "6b32", "1b16"):
    r = load(tag)
    if r is None:
        continue
    for system, s in r["systems"].items():
        e = s.get("extra") or {}
        rows.append({"run": tag, "system": system, "model": r["model"], "batch": r["batch"],
                     "device_budget_bytes": (e.get("effective_budget_bytes") or r["device_budget_bytes"]),
                     "feasible": s.get("feasible"), "tokens_per_s": s.get("tokens_per_s"),
                     "step_s": s.get("step_s_median"), "step_s_predicted": e.get("step_s_predicted"),
                     "model_tflops": s.get("model_tflops"), "of_989": s.get("model_tflops_share_989"),
                     "model_mfu": s.get("model_mfu"), "matmul_tflops": s.get("matmul_tflops"),
                     "host_bytes_per_param": s.get("host_bytes_per_param"), "update_s": s.get("update_s"),
                     "schedule_counts": e.get("schedule_counts"), "predicted_time": e.get("predicted_time"),
                     "max_grad_norm": e.get("max_grad_norm"), "micro_batches": e.get("micro_batches"),
                     "speculation": e.get("speculation"), "error": (s.get("error") or s.get("infeasible_reason") or "")[:300]})
def ratio(a, b):
    return a / b if a and b else None
base = tps("6b16") or (float(os.environ["BASE_TPS"]) if os.environ.get("BASE_TPS") else None)  # part b: call 1's chunkjax
out["targets"] = {
    "6b16_chunkjax_over_plain (>= 0.85)": ratio(base, tps("6b16", "plain_jax")),
    "6b16_clip_over_unclipped (>= 0.95)": ratio(tps("6b16_clip"), base),
    "6b16_mb4_over_unclipped (>= 0.95)": ratio(tps("6b16_mb4"), base),
    "6b16_fine_over_plain (programs of 2 moments)": ratio(tps("6b16_fine"), tps("6b16", "plain_jax")),
    "6b32_model_tflops (>= 500)": next((x["model_tflops"] for x in rows if x["run"] == "6b32" and x["system"] == "chunkjax"), None),
    "1b16_chunkjax_over_plain (>= 1.0)": ratio(tps("1b16"), tps("1b16", "plain_jax")),
}
skipped = f"{O}/skipped.txt"
out["skipped"] = open(skipped).read().split() if os.path.exists(skipped) else []
json.dump(out, open(f"{O}/overlap_6b_{run}.json", "w"), indent=1)
f = lambda v, d=2: "-" if v is None else f"{v:,.{d}f}"
print("| run | system | tokens/s | step s | predicted s | model TFLOP/s | of 989T | MFU (probe) | host B/param | update split | speculated/redone |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for x in rows:
    sp = x["speculation"] or {}
    print(f"| {x['run']} | {x['system']} | {f(x['tokens_per_s'], 0)} | {f(x['step_s'], 3)} | {f(x['step_s_predicted'], 3)} | "
          f"{f(x['model_tflops'], 1)} | {f(x['of_989'], 3)} | {f(x['model_mfu'], 3)} | {f(x['host_bytes_per_param'], 1)} | "
          f"{x['schedule_counts'] or '-'} | {sp.get('speculated_chunks', '-')}/{sp.get('redone_chunks', '-')} | "
          + (x["error"].splitlines()[0] if x["error"] else ""))
print(json.dumps(out["targets"], indent=1), "skipped:", out["skipped"])
P
