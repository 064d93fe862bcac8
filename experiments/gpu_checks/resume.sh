# Issue 8 on the GPU: main job SIGKILL + --resume (other device budget), and the checkpoint tests on the cuda backend
D=$OUT/runs; mkdir -p $D
A="--steps 400 --eval-every 100 --checkpoint-every 100 --sample-tokens 0 --no-progress"
python -m experiments.train $A --out-dir $D/ref > $OUT/ref.log 2>&1; echo ref rc=$?
python -m experiments.train $A --out-dir $D/killed > $OUT/killed.log 2>&1 &
pid=$!
for i in $(seq 1 6000); do if ls -d $D/killed/*/checkpoints/step_00000200 >/dev/null 2>&1; then kill -9 $pid; echo "killed after step_200 appeared (poll $i)"; break; fi; sleep 0.02; done
wait $pid; echo killed rc=$?
ls $D/killed/*/checkpoints/; tail -c 600 $D/killed/*/metrics.jsonl | tail -2
run=$(ls -d $D/killed/*); python -m experiments.train $A --resume $run --device-budget 2GiB --out-dir $D/killed > $OUT/resume.log 2>&1; echo resume rc=$?
tail -3 $OUT/resume.log
python - <<'P'
import json, glob, os
O = os.environ["OUT"]
def losses(pat):
    f = glob.glob(pat)[0]
    return {r["step"]: r for r in map(json.loads, open(f))}
ref = losses(f"{O}/runs/ref/*/metrics.jsonl"); res = losses(f"{O}/runs/killed/*/metrics.jsonl")
keys = [k for k in ref if "loss" in ref[k]]
d = {k: abs(ref[k]["loss"] - res[k]["loss"]) for k in keys if k in res}
eq = sum(v == 0 for v in d.values())
out = {"steps_compared": len(d), "equal_bitwise": eq, "max_abs_diff": max(d.values()), "first_diff_step": min([k for k, v in d.items() if v], default=None),
       "val": {k: (ref[k].get("val_loss"), res[k].get("val_loss")) for k in ref if ref[k].get("val_loss") is not None}}
rep = json.load(open(glob.glob(f"{O}/runs/killed/*/report.json")[0]))
out["resumed_from_step"] = rep.get("resumed_from_step"); out["report_keys"] = {k: rep.get(k) for k in ("device_budget", "placement", "checkpoints_saved", "checkpoint_save_s", "tokens_per_s")}
print("CKPT", json.dumps(out)); json.dump(out, open(f"{O}/gpu_resume.json", "w"), indent=1)
P
JAX_PLATFORMS=cuda timeout 200 python -m pytest -q -x -p no:cacheprovider -W ignore tests/test_checkpoint.py -k "other_schedule" 2>&1 | grep -E "^E |Error" | head -30
