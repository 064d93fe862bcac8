# Issue 23, session 25: the host kernel's guided division (chunkjax.kernel_threads) against numba's static one,
# in one call on one machine: the kernel walk beside loads (division_probe.py), then the GPT3_6B b16 pair at
# 24 GiB (plain JAX, chunkjax guided), then chunkjax with the static kernel (static_division/sitecustomize.py),
# then, while time is left, more chunkjax runs (EXTRA_RUNS: "NAME:FLAGS;NAME:FLAGS"). Usage:
# [PROBE=0] [PAIR=0] [STATIC=0] [EXTRA_RUNS=...] bash experiments/gpu_checks/division_ab.sh RUN_ID
set -u
export PYTHONPATH=$PWD
RUN=$1; T0=$(date +%s)
left() { echo $(( 560 - ($(date +%s) - T0) )); }
B="python -m experiments.bench --seq 1024 --results-dir $OUT --model GPT3_6B --device-budget 24GiB --batch 16 --steps 5"
[ "${PROBE:-1}" != 0 ] && python experiments/gpu_checks/division_probe.py $OUT/division_probe_$RUN.json > $OUT/division_probe_$RUN.log 2>&1
[ "${PAIR:-1}" != 0 ] && $B --run-id ${RUN}_pair --time-limit 220 --systems plain_jax,chunkjax --system-budget plain_jax=125GiB > $OUT/${RUN}_pair.log 2>&1
if [ "${STATIC:-1}" != 0 ] && [ $(left) -gt 100 ]; then
  PYTHONPATH=$PWD/experiments/gpu_checks/static_division:$PWD $B --run-id ${RUN}_static --time-limit $(( $(left) < 130 ? $(left) : 130 )) --systems chunkjax > $OUT/${RUN}_static.log 2>&1
fi
IFS=';' read -ra XS <<< "${EXTRA_RUNS:-}"
for x in "${XS[@]}"; do
  [ -z "$x" ] && continue
  [ $(left) -lt 100 ] && { echo "no time for ${x%%:*}"; continue; }
  $B --run-id ${RUN}_${x%%:*} --time-limit $(( $(left) < 150 ? $(left) : 150 )) --systems chunkjax ${x#*:} > $OUT/${RUN}_${x%%:*}.log 2>&1
done
rm -f $OUT/*.stderr.log
tail -n 4 $OUT/*.log | grep -v "^$" | cut -c1-300
python - "$RUN" <<'PY'
import glob, json, os, sys
out, run = os.environ["OUT"], sys.argv[1]
plain = None
for f in sorted(glob.glob(f"{out}/bench_{run}_*.json")):
    for name, c in json.load(open(f))["systems"].items():
        if name == "plain_jax":
            plain = c.get("tokens_per_s")
        ex = c.get("extra") or {}
        print(f"{os.path.basename(f)[6:-5]:>22} {name:>10} step {c.get('step_s_median') or 0:.3f} s  tok/s {c.get('tokens_per_s') or 0:8.0f}"
              f"  host {c.get('update_s') or 0:.3f} s  pred {ex.get('step_s_predicted') or 0:.3f}  err {str(c.get('error'))[:60]}"
              + (f"  x{c['tokens_per_s'] / plain:.3f}" if plain and c.get('tokens_per_s') and name != 'plain_jax' else ""))
PY
cat $OUT/division_probe_$RUN.log 2>/dev/null | tail -n 4
