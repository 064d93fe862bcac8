# Issue 23, session 24: the turn cut against the cut before it (chunkjax.program_cut.turn_cut), interleaved in one
# call on one machine (the host kernel's in-step rate varies between processes), with the huge-page probe first and
# the machine's AnonHugePages logged every 5 s. Usage: [PROBE=0] [EXTRA="--set rates_from=RESULTS_JSON"]
# bash experiments/gpu_checks/turn_ab.sh RUN_ID [ROUNDS] (PROBE=0: no huge-page probe; EXTRA: more bench flags for both)
set -u
export PYTHONPATH=$PWD
RUN=$1; ROUNDS=${2:-2}
if [ "${PROBE:-1}" != 0 ]; then
  python experiments/gpu_checks/hugepage_probe.py 32 > $OUT/hugepage_probe_$RUN.json 2> $OUT/hugepage_probe_$RUN.log
fi
(while sleep 5; do echo "$(date +%s) $(grep AnonHugePages /proc/meminfo)"; done) > $OUT/thp_$RUN.log &
B="python -m experiments.bench --seq 1024 --results-dir $OUT --steps 8 --model GPT3_6B --device-budget 24GiB --batch 16 --time-limit 140 --systems chunkjax ${EXTRA:-}"
for i in $(seq 1 $ROUNDS); do
  $B --run-id ${RUN}_noturn$i --set turn_cut=0 > /dev/null 2>&1
  $B --run-id ${RUN}_turn$i > /dev/null 2>&1
done
kill %1
python - "$RUN" <<'PY'
import glob, json, os, re, sys
out, run = os.environ["OUT"], sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{out}/bench_{run}_*.json")):
    c = json.load(open(f))["systems"]["chunkjax"]
    log = f"{out}/{os.path.basename(f)[6:-5]}_chunkjax_GPT3_6B.stderr.log"
    steps = [json.loads(m) for m in re.findall(r"\[bench-progress\] (\{.*\"phase\": \"step\".*\})", open(log).read())] if os.path.exists(log) else []
    rows.append({"run": os.path.basename(f), "median": c.get("step_s_median"), "update_s": c.get("update_s"),
                 "steps": [round(s["seconds"], 3) for s in steps], "host": [round(s.get("update_s", 0), 3) for s in steps],
                 "pred": (c.get("extra") or {}).get("step_s_predicted"), "segments": len((c.get("extra") or {}).get("segments") or [])})
    print(rows[-1])
json.dump(rows, open(f"{out}/turn_ab_{run}.json", "w"), indent=1)
PY
rm -f $OUT/*.stderr.log
cat $OUT/hugepage_probe_$RUN.log 2>/dev/null
