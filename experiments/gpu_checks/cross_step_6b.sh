# Issue 23, cross-step overlap (chunkjax.cross_step) on the GPU in ONE call of < 9 min (one H200):
#   bash experiments/gpu_checks/cross_step_6b.sh <run-id>          # the runs below, then the table
#   bash experiments/gpu_checks/cross_step_6b.sh <run-id> table    # only the table of the runs under $OUT
#   bash experiments/gpu_checks/cross_step_6b.sh <run-id> 6b16_clip,6b16_mb4   # only these runs (a second call
#        for runs the first one skipped: their ratios need BASE_TPS=<6b16 chunkjax tokens/s> PLAIN_TPS=<plain>)
# GPT3_6B, batch 16 x 1024, AdamW, chunkjax at a 24 GiB device budget against plain JAX on the whole card:
#   6b16      plain JAX and chunkjax with cross-step overlap (the default: planned with forward cuts, the
#             next step waits per program for the host chunks it takes; the host thread takes the ready
#             chunks in the next step's read order);
#   6b16_off  chunkjax with --set cross_step=0 (each step joins the previous step's host work first; the
#             plan without forward cuts: the session-14 engine, 0.673x);
#   6b16_clip chunkjax, cross-step, clip_by_global_norm(1.0) (speculative host updates, validated as soon
#             as the norm is known);
#   6b16_mb4  chunkjax, cross-step, 4 micro-batches (the planner's accumulation);
#   6b16_clipr only when named: 6b16_clip planned as if clipping were rare (--set clip_expect=rare: the plan
#             before chunkjax.clip_plan, host updates timed overlapping the backward);
#   clip      the three runs of the clipped plan's check in one call of < 5 min (issue 23, chunkjax.clip_plan:
#             6b16_clip is now planned for clipping that fires, more chunks streamed):
#             LIMIT=290 bash experiments/gpu_checks/cross_step_6b.sh <run-id> clip   (= 6b16_one,6b16_clip,6b16_clipr;
#             6b16_clipr is skipped when the first two leave it under 60 s). CLIP_EXTRA adds bench arguments to
#             6b16_clip, e.g. CLIP_EXTRA="--host-budget 112e9" (the CPU plan: 8 streamed chunks, host need 106e9,
#             instead of 34 streamed and 128.7e9 at the auto budget of ~123e9; the s16x runs' RSS peaked 13-20 GB
#             above their plans' need: run the call under memwatch.sh)
#   6b16_mb4u only when named (not in "all"): 6b16_mb4 with the in-program micro-batch loops traced
#             unrolled (bench --set unroll_micro_batches=1: Schedule.unroll_micro_batches, planned so):
#             do the backward programs' fetches then overlap the loop?
#   6b16_one  only when named (not in "all"): chunkjax alone as in 6b16, unclipped, one micro-batch (no plain
#             JAX: the base of the clip and micro-batch comparisons in one call; its tokens/s is the ratios'
#             base when 6b16 did not run)
#   mb        = 6b16_one,6b16_mb4,6b16_mb4u (issue 23, micro-batches: one micro-batch, 4 looped, 4 unrolled,
#             each with its predicted step and programs; ~7 min): bash ... <run-id> mb
# Every run is experiments.bench (one subprocess per system, the matmul probe in each call, jax's persistent
# compilation cache shared by the runs); 3 timed steps after one warm-up. Each run gets the time left of the
# call's LIMIT (default 520 s); a run that would start with less than 60 s left is skipped and named in the
# table. JSON under $OUT: bench_<run>_<tag>.json per run and cross_step_6b_<run>.json (rows + targets); the
# table (tokens/s, ratio to plain JAX, predicted and measured step) is printed last.
# CPU smoke test (numbers meaningless): OUT=/tmp/o BIG=micro SEQ=16 BUDGET=12MiB WHOLE=1GiB LIMIT=900 bash ...
set -u
RUN=${1:-xs}
PART=${2:-all}
[[ $PART == mb ]] && PART=6b16_one,6b16_mb4,6b16_mb4u
export PYTHONUNBUFFERED=1
START=$SECONDS
LIMIT=${LIMIT:-520}
B="python -m experiments.bench --seq ${SEQ:-1024} --results-dir $OUT --steps ${STEPS:-3}"
SIX="--model ${BIG:-GPT3_6B} --device-budget ${BUDGET:-24GiB} --batch 16"
WHOLE=${WHOLE:-125GiB}
run() {  # run <tag> <bench args...>: within the call's time left, else skipped
  local tag=$1; shift
  local left=$((LIMIT - (SECONDS - START)))
  if (( left < 60 )); then echo "skip $tag (time)"; echo "$tag" >> $OUT/skipped.txt; return; fi
  local t0=$SECONDS
  timeout -k 10 $left $B --run-id ${RUN}_$tag --time-limit $((left - 5)) "$@" > $OUT/$tag.log 2>&1
  echo "$tag rc=$? $((SECONDS - t0)) s"
}
[[ $PART == clip ]] && PART=6b16_one,6b16_clip,6b16_clipr
want() { [[ $PART == all || ,$PART, == *,$1,* ]]; }
if [[ $PART != table ]]; then
  want 6b16 && run 6b16 $SIX --systems plain_jax,chunkjax --system-budget plain_jax=$WHOLE
  [[ ,$PART, == *,6b16_one,* ]] && run 6b16_one $SIX --systems chunkjax
  want 6b16_off && run 6b16_off $SIX --systems chunkjax --set cross_step=0
  want 6b16_clip && run 6b16_clip $SIX --systems chunkjax --set max_grad_norm=1.0 ${CLIP_EXTRA:-}
  [[ ,$PART, == *,6b16_clipr,* ]] && run 6b16_clipr $SIX --systems chunkjax --set max_grad_norm=1.0 --set clip_expect=rare
  want 6b16_mb4 && run 6b16_mb4 $SIX --systems chunkjax --set micro_batches=4
  [[ ,$PART, == *,6b16_mb4u,* ]] && run 6b16_mb4u $SIX --systems chunkjax --set micro_batches=4 --set unroll_micro_batches=1
fi
for t in 6b16 6b16_one 6b16_off 6b16_clip 6b16_clipr 6b16_mb4 6b16_mb4u; do [ -f $OUT/$t.log ] && { echo "== $t"; tail -3 $OUT/$t.log; }; done
python - "$RUN" <<'P'
import json, os, sys
O, run = os.environ["OUT"], sys.argv[1]
TAGS = ("6b16", "6b16_one", "6b16_off", "6b16_clip", "6b16_clipr", "6b16_mb4", "6b16_mb4u")
def programs(e):  # the profiled step's programs (bench transfer_phases): seconds in all, backward ones' mean
    ph = [p for p in ((e.get("transfer_phases") or {}).get("phases") or []) if "chunkjax_program" in p["phase"]]
    bwd = [p for p in ph if p.get("d2h_bytes")]  # the programs sending gradients down
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"programs_s_measured": sum(p["duration_s"] for p in ph) if ph else None,
            "backward_program_ms_mean_measured": None if not bwd else 1e3 * mean([p["duration_s"] for p in bwd]),
            "backward_program_copy_only_ms_mean_measured": None if not bwd else 1e3 * mean([p["copy_only_s"] for p in bwd])}
def forward_programs(e):
    segs, n = e.get("segments") or [], len((e.get("schedule") or {}).get("moments") or [])
    return sum(1 for t in segs if t < (n + 1) // 2 - 1) if n else None
rows, out = [], {"run_id": run}
def load(tag):
    f = f"{O}/bench_{run}_{tag}.json"
    return json.load(open(f)) if os.path.exists(f) else None
for tag in TAGS:
    r = load(tag)
    for system, s in ((r or {}).get("systems") or {}).items():
        e = s.get("extra") or {}
        rows.append({"run": tag, "system": system, "cross_step": e.get("cross_step"), "feasible": s.get("feasible"),
                     "tokens_per_s": s.get("tokens_per_s"), "step_s": s.get("step_s_median"),
                     "step_s_predicted": e.get("step_s_predicted"), "predicted_time": e.get("predicted_time"),
                     "segments": e.get("segments"), "schedule_counts": e.get("schedule_counts"),
                     "update_s": s.get("update_s"), "model_tflops": s.get("model_tflops"),
                     "max_grad_norm": e.get("max_grad_norm"), "micro_batches": e.get("micro_batches"),
                     "unroll_micro_batches": e.get("unroll_micro_batches"), "accumulation": e.get("accumulation"),
                     "micro_group": e.get("micro_group"), "forward_programs": forward_programs(e), **programs(e),
                     "peak_device_bytes_measured": s.get("peak_device_bytes_measured"),
                     "speculation": e.get("speculation"), "clip_expect": e.get("clip_expect"),
                     "step_s_predicted_if": e.get("step_s_predicted_if"),
                     "error": (s.get("error") or s.get("infeasible_reason") or "")[:300]})
out["rows"] = rows
plain = next((x["tokens_per_s"] for x in rows if x["run"] == "6b16" and x["system"] == "plain_jax"),
             float(os.environ["PLAIN_TPS"]) if os.environ.get("PLAIN_TPS") else None)
tps = {x["run"]: x["tokens_per_s"] for x in rows if x["system"] == "chunkjax"}
if "6b16" not in tps and "6b16_one" in tps:  # the micro-batch comparison's own base (same call)
    tps["6b16"] = tps["6b16_one"]
if "6b16" not in tps and os.environ.get("BASE_TPS"):  # a second call: the first call's cross-step chunkjax
    tps["6b16"] = float(os.environ["BASE_TPS"])
ratio = lambda a, b: a / b if a and b else None  # noqa: E731
out["targets"] = {"6b16_cross_over_plain (>= 0.85)": ratio(tps.get("6b16"), plain),
                  "6b16_off_over_plain (0.673 in session 14)": ratio(tps.get("6b16_off"), plain),
                  "6b16_cross_over_off": ratio(tps.get("6b16"), tps.get("6b16_off")),
                  "6b16_clip_over_cross (>= 0.95)": ratio(tps.get("6b16_clip"), tps.get("6b16")),
                  "6b16_clipr_over_cross (0.577 in session 16)": ratio(tps.get("6b16_clipr"), tps.get("6b16")),
                  "6b16_clip_over_clipr": ratio(tps.get("6b16_clip"), tps.get("6b16_clipr")),
                  "6b16_mb4_over_cross (>= 0.95)": ratio(tps.get("6b16_mb4"), tps.get("6b16")),
                  "6b16_mb4u_over_cross (>= 0.95)": ratio(tps.get("6b16_mb4u"), tps.get("6b16")),
                  "6b16_mb4u_over_mb4": ratio(tps.get("6b16_mb4u"), tps.get("6b16_mb4"))}
skipped = f"{O}/skipped.txt"
out["skipped"] = open(skipped).read().split() if os.path.exists(skipped) else []
json.dump(out, open(f"{O}/cross_step_6b_{run}.json", "w"), indent=1)
f = lambda v, d=3: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
print("| run | system | cross-step | tokens/s | ratio to plain JAX | step s | predicted s | if fires / rare | "
      "host update s (pred) | streamed tail s pred | programs (forward) | accumulation | bwd program ms | split | "
      "speculated/redone | clip expected |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for x in rows:
    sp, both, pt = x["speculation"] or {}, x["step_s_predicted_if"] or {}, x["predicted_time"] or {}
    print(f"| {x['run']} | {x['system']} | {x['cross_step'] if x['system'] == 'chunkjax' else '-'} | "
          f"{f(x['tokens_per_s'], 0)} | {f(ratio(x['tokens_per_s'], plain))} | {f(x['step_s'])} | "
          f"{f(x['step_s_predicted'])} | {f(both.get('fires'))} / {f(both.get('rare'))} | "
          f"{f(x['update_s'])} ({f(pt.get('host_update_s'))}) | {f(pt.get('streamed_update_s'))} | "
          f"{len(x['segments'] or []) or '-'} ({x['forward_programs'] if x['forward_programs'] is not None else '-'}) | "
          f"{(x['accumulation'] or '-') + (' unrolled' if x['unroll_micro_batches'] else '')} | "
          f"{f(x['backward_program_ms_mean_measured'], 1)} | "
          f"{x['schedule_counts'] or '-'} | {sp.get('speculated_chunks', '-')}/{sp.get('redone_chunks', '-')} | "
          f"{x['clip_expect'] or '-'} | " + (x["error"].splitlines()[0] if x["error"] else ""))
print(json.dumps(out["targets"], indent=1), "skipped:", out["skipped"])
P
