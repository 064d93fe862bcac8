# Issue 24 on the GPU: the largest models on one H200 (125.8 GiB host RAM, 64 GiB free disk), in parts of < 9 min.
#   bash experiments/gpu_checks/largest.sh <run-id> a      # GPT3_15B host-only, batch 8 x 1024, 5 steps
#   bash experiments/gpu_checks/largest.sh <run-id> b      # GPT3_18B with the disk tier, 5 steps (pool 56: see below)
#   bash experiments/gpu_checks/largest.sh <run-id> b19    # GPT3_19B with the disk tier, chunks of a quarter block (below)
#   bash experiments/gpu_checks/largest.sh <run-id> a2     # GPT3_15B, batch 64 = 8 micro-batches of 8 x 1024, disk tier
#   bash experiments/gpu_checks/largest.sh <run-id> b2     # GPT3_18B, batch 16 = 8 micro-batches of 2 x 1024, disk tier
#   bash experiments/gpu_checks/largest.sh <run-id> c      # GPT3_12B, 8 micro-batches: host only, then disk (host 110e9)
#   bash experiments/gpu_checks/largest.sh <run-id> table  # only the table of the runs under $OUT
# Each part is one experiments.bench --largest call per run (one subprocess per system, the matmul probe in each
# call), its pinned-pool settings in the environment of that call only; the bench's workers take
# XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB from the environment (before session 12's fix they got 110 GiB whatever was
# set). A run gets the time left of the part's $LIMIT s (a run that would start with less than its least s is
# skipped and named in the table). JSON under $OUT (bench_<run>_<tag>.json, largest_<run>.json); the table is printed
# last. --largest-steps N runs N + 2 steps (a warm-up, N timed, one profiled).
#
# Why these settings (CPU plans on CPU traces, the GPU's host measure: `python experiments/gpu_checks/largest_plan.py`):
# * The GPU host measure is XLA's pinned pool + pageable bytes. Unpreallocated, the pool grows to the power of two
#   above the pinned peak / 0.9 (the pool fragments: PINNED_POOL_FRAGMENTATION; s17r was OOM-killed with 95 % of
#   its 32 GiB pool pinned) (capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB): GPT3_15B's ~41 GB pinned (float32 masters
#   of its master-fetch host chunks + the host gradients of two programs) became a 64 GiB pool, or the 110 GiB cap
#   above 64 GiB, and 176 GB with the bench's 110 GiB preallocated. Preallocated at the pinned peak, the pool costs
#   what is pinned: a host-resident chunk is 12 B/param (float32 master pinned, Adam m + v pageable) plus the
#   working set, which the planner now cuts to 16-32 programs when even all master-fetch does not fit.
# * The fit plans first at 90 % of the device budget less a chunk, and the host need falls as the device holds
#   more: 138 GiB (fraction 0.98 of the card) is what lets GPT3_15B fit ~119 GB of host.
#   GPT3_15B b8x1024, 138 GiB, pool 38 GiB preallocated, host budget 119e9: 137 device / 179 host chunks (170
#   master-fetch), 32 programs; accounted device peak 132.98e9 (0.90 of 148.2e9: no margin for a compiled overshoot
#   of 10 %, which 12B never showed: compiled 123.3e9 vs 127.8e9 accounted); host measure 118.54e9 (pool 40.80e9 +
#   pageable 77.74e9), 12.27 B/param per host-resident chunk incl. 1.59e9 of gradients; predicted 3.45 s/step.
#   (Pool 37 GiB: pinned 38.13e9, measure 118.31e9, 166 master-fetch. A device margin needs the fit to plan below
#   the 90 % it checks at, a fit.py setting: with every host chunk master-fetch the host has ~2.1e9 to spare,
#   ~3 chunks off the device, ~2.5e9 = 1.9 % of the device.) At 126 GiB no pool setting fits 119e9.
# * GPT3_18B b8x1024 with one 64 GiB storage directory (disk budget 68.67e9, --no-storage-keep-previous), 138 GiB,
#   pool 50 GiB preallocated (48 refused: the pinned peak ~51.7e9 is over it), host 119e9: 128 device / 149 host
#   (all master-fetch) / 87 disk chunks, 32 programs; accounted device peak 133.15e9; host measure 118.71e9
#   (pool 53.69e9 + pageable 65.03e9); disk 110.6 GB/step; predicted 79.25 s/step (75.7 s of disk after the
#   backward): 5 steps (warm-up, 3 timed, 1 profiled) are ~400 s, so part b may only just fit its limit.
# * 8 micro-batches (session 13: the plan counts what accumulation allocates). Every chunk's gradient is summed in
#   float32 across the micro-batches: a device-updated chunk's sum is on the device (4 B/param there, which the
#   plan did not count: last session's 15B b64 plan, 137 device chunks, would have put 29e9 more on a full card),
#   a host, streamed or storage chunk's in host memory (4 B/param; the mean is written over the sum, was 6 B with
#   a second buffer, and storage chunks' sums were not counted). Device chunks then cost 20 B/param on the device,
#   master-fetch host chunks 16 B/param on the host, storage chunks 8 B/param on the host (compute params, the
#   micro-batch's gradient, the sum) beside 12 on disk; 64 GiB holds 108 chunk files. So:
#   GPT3_15B b64 does not fit: with 108 chunks on disk it needs 138.75e9 of host (pool 44 GiB; 48: 143.04e9,
#   52: 147.34e9), 103 device / 105 host / 108 disk: pool 47.24e9 (pinned 46.81e9: masters 22.2e9 + storage
#   chunks' params and gradients 22.9e9 + gradient window) + pageable 91.50e9 (Adam 44.5e9 + float32 sums of 213
#   chunks 45.1e9 + staging 1.9e9), predicted 121 s/step; at batch 32 (8 x 4 x 1024) 134.93e9. GPT3_18B b64
#   needs 196.24e9 (117 device / 139 host / 108 disk). Part r records the GPU's refusals (its traces are smaller
#   than the CPU's; a plan there runs --largest-steps 1).
#   GPT3_12B b64, 138 GiB, pool 30 GiB, host 119e9: 113 device / 131 host (118 master-fetch), "storage not
#   needed", 16 programs; accounted device peak 132.83e9 (23.9e9 of it float32 sums); host measure 118.21e9
#   (pool 32.21e9, pinned 28.49e9, + pageable 86.00e9); predicted 19.21 s/step (5 steps ~100 s).
#   GPT3_12B b64 with the disk at --host-budget 110e9 (pool 30 GiB): 113 device / 113 host (all master-fetch) / 18
#   disk, 32 programs; host measure 109.74e9 (32.21e9 + 77.52e9); disk 22.88 GB/step; predicted 33.72 s/step
#   (16.34 s of disk, 14.55 s of it after the 8 micro-batches; 5 steps ~170 s). At 100e9: 41 disk chunks,
#   52.1 GB/step, 54.60 s/step.
# * In-program accumulation (session 13, chunkjax.plan_micro): the micro-batches loop inside each moment, a chunk is
#   fetched once per step and its float32 sum stays on the device; no host sums.
# * Session 16 (micro-batch groups, chunkjax.plan_micro; docs/storage.md): the planner tries in-program over all 8
#   micro-batches, then over groups of 4 and 2 (4 B/param float32 sums across the passes), then per pass. CPU plans
#   (largest_plan.py, 138 GiB, host 119e9, one 64 GiB directory: --disk-gb 68.67, this code):
#   GPT3_15B b64 (8 x 8 x 1024), pool 44: in-program, 109 device / 109 host (copies) / 98 disk chunks, 8 programs;
#   accounted device peak 133.14e9; host measure 118.41e9 (pool 47.24e9 + pageable 71.17e9, pinned 39.50e9; need with
#   the process 124.7e9); disk 124.5 GB/step; predicted 101.5 s/step. At --host-budget 115e9: 109 / 103 / 104,
#   measure 114.60e9, need 120.93e9, disk 132.2 GB/step, 107.0 s/step (112e9 is refused: 112.06e9 needed).
#   GPT3_18B b64 does not fit with any group: in-program needs 161.2e9 of host (pool 56; whole-batch saved stage
#   inputs 48.9e9), groups of 4 207.3e9, groups of 2 and per pass 196.2e9 (pool 50): the passes' sums (73e9 for
#   18.3e9 params) cost more than the stage inputs they save (<= 42.8e9). b24: 124.3e9 (pool 58), b32: 131.1e9.
#   GPT3_18B b16 (8 x 2 x 1024), pool 56: in-program, 125 device / 134 host (all master-fetch) / 105 disk, 32
#   programs; device 133.15e9; host measure 118.80e9 (pool 60.13e9 + pageable 58.67e9, pinned 52.32e9; need 125.1e9);
#   disk 133.4 GB/step; predicted 97.4 s/step. Its least host: --host-budget 117.6e9: 125 / 131 / 108, measure
#   117.53e9, need 123.86e9, 137.3 GB/step, 100.0 s/step (115e9 is refused: 117.53e9 needed).
#   GPT3_18B b8 as 8 x 1 x 1024 (MB18_BATCH=8), --host-budget 115e9: 135 / 125 (all master-fetch) / 104, measure
#   114.99e9, need 121.32e9, 132.2 GB/step, 94.4 s/step (112e9 refused: 113.29e9): the same tokens as part b.
#   Part b (GPT3_18B b8, one micro-batch) under the 90 % rule: pool 50 is refused (pinned 51.47e9 > 0.9 x 53.69e9);
#   pool 56: 128 device / 134 host (all master-fetch) / 102 disk, 32 programs, host 118.80e9, disk 129.6 GB/step,
#   predicted 92.6 s/step (b2 at b16: twice the tokens for 5 % more time).
#   Host margin: s16b (part b, plan need 128.1e9) thrashed with the machine ~7e9 beyond the plan's need, s16a (15B
#   host-only, need 128.6e9) peaked 2.9e9 beyond it; a disk-tier part should plan a need <= ~124e9, hence
#   EXTRAMB="--host-budget 115e9" for a2 and 117.6e9 (b16's least) for b2. Time: s16a spent 296 s before its first
#   step, s16b ~385 s; with steps of 100-107 s, LIMIT=585 (as s16b) gives a warm-up and one timed step (the profiled
#   third of --largest-steps 1 is cut; the bench keeps the finished timed step); LIMIT 530-540 gives the warm-up only.
#   Re-planned on the CPU after setup18's accounting (storage workers, 3 % system share), same settings: a2 (GPT3_15B
#   b64, pool 44, host 115e9): 109 device / 103 host / 104 disk chunks, need 125.57e9 (system 3.66e9), 107.0 s/step. Re-plan b2 the same way before its call.
#   Session 16's calls (superseded by session 17's below):
#     PREALLOC=false POOL15MB=44 EXTRAMB="--host-budget 115e9" LIMIT=585 MEMLOG=$OUT/mem.log \
#       bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> a2
#     PREALLOC=false POOL18MB=56 EXTRAMB="--host-budget 117.6e9" LIMIT=585 MEMLOG=$OUT/mem.log \
#       bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b2
#   Session 17 (s17a2, s17a2b on the H200): both a2 calls were refused by the fit's compiled check before training:
#   compiled 142.60e9 vs 133.14e9 accounted (host 115e9), then after a re-plan 135.46e9 vs 123.69e9 (host 117.5e9),
#   the re-plans' host needs above the budget. In-program accumulation's accounting missed each stage's loop copies
#   (its float32 carry beside the accumulators, the loop's input copies) and accumulators held twice undonated; it now
#   measures each stage's compiled loop and the programs donate the accumulators (docs/storage.md, "In-program device
#   accounting"; experiments/gpu_checks/inprogram_gap.py prints the GPU's per-program compiled vs accounted peak, run it
#   first: < 5 min, compiles only). The device now holds fewer chunks, so the host needs more. CPU re-plans
#   (largest_plan.py, this code, 138GiB, one 64 GiB directory --disk-gb 68.67; the GPU plans on its own, smaller,
#   traces, so it holds more on the device and needs less host than these):
#   a2 GPT3_15B b64 (8 x 8 x 1024), pool 44: 115e9 and 115.5e9 refused (least 115.87e9 with 108 chunks on disk);
#     --host-budget 116e9: in-program, 103 device / 105 host (copies) / 108 disk chunks, 8 programs; device accounted
#     133.15e9; host measure 115.87e9, need 126.88e9 (pool 47.24e9 + pageable 68.63e9 + process 7.31e9 + system
#     3.70e9); disk 137.3 GB/step; predicted 110.8 s/step.
#   b2 GPT3_18B b16 (8 x 2 x 1024), pool 56: 117.6e9 refused (least 119.23e9); at 119.3e9: 121 / 135 (all
#     master-fetch) / 108, need 130.33e9, 137.3 GB/step, 100.1 s/step: above the ~126e9 the host allows. Run b2 at
#     batch 8 = 8 x 1 x 1024 (MB18_BATCH=8) instead: --host-budget 116e9: 132 / 127 (all master-fetch) / 105, 32
#     programs; device accounted 132.97e9; host measure 115.84e9, need 126.84e9 (pool 60.13e9 + pageable 55.71e9 +
#     process 7.31e9 + system 3.69e9); disk 133.4 GB/step; predicted 95.3 s/step.
#     At --host-budget 115e9 (the call below): 132 / 125 / 107, host measure 114.99e9, need 125.97e9 (pageable
#     54.86e9), disk 136.0 GB/step, predicted 97.1 s/step.
#   Then (s17g on the H200, experiments/results/inprogram_gap_s17g.json) the measured loops still compiled at 1.179x
#   their accounting, all of it in one backward program of 4 moments (+3.50e9): XLA sets up every loop's float32 sums
#   and stacked cotangent at the program's start (gapgpu: predict.loop_init_extra counts them; CPU 1.077x -> 0.886x).
#   The re-plans above predate that change: re-plan a2 and b2 on the CPU (largest_plan.py) before their calls.
#   Session 18: the loops are tied to their inputs (chunkjax.tied_loop) and loop_init_extra is deleted; the H200's gap
#   is 0.994x (inprogram_gap_s18x.json). CPU re-plans: a2 at --host-budget 116e9 needs 126.88e9 (8 programs, 108 disk
#   chunks, 111.0 s/step); b2 with MB18_BATCH=8 at 115e9 needs 125.97e9 (132 / 125 / 107, 98.0 s/step). Do not add
#   --set unroll_micro_batches=1 here: s18b2's 32 unrolled programs compiled for 402 s and the call ended in the init.
#   First (compiles only, JSON $OUT/inprogram_gap.json; ratio <= ~1.0 for both rows says the check will pass):
#   timeout 300 python experiments/gpu_checks/inprogram_gap.py
#   The loops are compiled once per plan on the GPU (3 stage programs per micro-batch group tried): budget a minute
#   more of setup (s16a 296 s, s16b ~385 s before the first step).
#   PREALLOC=false POOL15MB=44 EXTRAMB="--host-budget 116e9" LIMIT=585 MEMLOG=$OUT/mem.log \
#     bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> a2
#   PREALLOC=false POOL18MB=56 MB18_BATCH=8 EXTRAMB="--host-budget 115e9" LIMIT=585 MEMLOG=$OUT/mem.log \
#     bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b2
# * Session 13's part a (pool 38 preallocated) was killed by the kernel's OOM killer in its first step with shmem-rss
#   (pinned) 79.7 GB against the 40.8 GB pool (experiments/results/largest_s13_15b_memory.json): PREALLOC=false runs
#   a part with the pool growing up to its cap instead; run the part under memwatch.sh to log RssAnon/RssShmem.
# * Session 15 (largest_s15_15b_pinned.json): the pinned pool fragments: at 0.95-1.0 of its cap a 101 MiB
#   allocation failed with ~1.5 GB of the pool free, so a plan now uses at most 90 % of the cap
#   (chunkjax.host_memory.PINNED_POOL_FRAGMENTATION). CPU plan for the next call (largest_plan.py --pool 42
#   --host 122e9): 137 device / 179 host chunks (174 master-fetch), 32 programs, gradient working set 1.59e9,
#   host need 128.3e9 (pool 45.1e9), 4.35 s/step predicted:
#   PREALLOC=false POOL15=42 EXTRA15="--host-budget 122e9" LIMIT=480 MEMLOG=$OUT/mem.log \
#     bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> a
# * Session 16 (/work/notes/gpu_s16, docs/setup_time.md): GPT3_15B host-only trained (3.91 s/step, plan 3.55; peak RSS
#   129.7 GB, MemAvailable 3.6 GB left); GPT3_18B with the disk tier (pool 56, host 122e9, 95 storage chunks) ran out of
#   host memory in its first step (MemAvailable 0.1-0.3 GB for 200 s: the trainer matched its plan, the worker's ~2.3 GB
#   and the rest of the machine were not counted) after a ~375 s setup (plan + compile ~175 s, init ~200 s of which
#   ~51 s idle on the storage chunks' first writes). Now the plan counts each near-storage worker (128 MiB + staging +
#   4 message chunks) and 3 % of the need for the rest of the machine, and the init overlaps the storage writes with the
#   host fill and draws leaves once where it can. CPU plan (largest_plan.py --model GPT3_18B --budget 138GiB --pool 56
#   --host 117e9 --storage /tmp/d18 --disk-gb 68.67; 116e9 is refused, the floor is 116.26e9 with 108 chunks on disk):
#   128 device / 129 host (all master-fetch) / 107 storage chunks, 32 programs; host need 127.71e9 (pool 60.13e9 +
#   pageable 56.55e9 + process 7.31e9 incl. the worker + system 3.72e9): ~5.5 GB of MemAvailable left of the ~133.2e9
#   the H200 has after planning; disk 136.0 GB/step, predicted 97.1 s/step. Predicted setup ~290 s (probe ~14 s, plan +
#   compile ~175 s as in s16b, init ~100 s: device ~20, host fill and storage writes overlapped ~60, device params ~20),
#   then 3 steps ~291 s: ~580 s of the 585, at the limit (run experiments/gpu_checks/init_speed.py first, < 3 min, to
#   check the init's GB/s). The call:
#   PREALLOC=false POOL18=56 B_STEPS=1 EXTRA18="--host-budget 117e9" LIMIT=585 MEMLOG=$OUT/mem.log \
#     bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b
# * Session 18 (docs/storage.md, "Beyond GPT3_18B"): largest_plan.py --gpu-temps experiments/results/bench_s8_largest_12b.json
#   (GPT3_12B's GPU stage temporaries: same width and batch) reproduces s17b's GPU plan of GPT3_18B exactly (135 / 129 /
#   100, 127.09 GB/step, 91.7 s/step, need 127.71e9). The layout search's chunk size for the 4096-wide GPT3s,
#   52953088, pads 4.9 %; 50337792 pads 0.2 %. GPT3_19B (94 blocks, 19.14e9) at that size, pool 56, host 117e9, disk
#   68.67e9: 142 device / 136 host (all master-fetch) / 103 disk chunks, need 127.68e9 (s17b's), 124.44 GB/step,
#   predicted 89.9 s/step (CPU traces: 134 / 136 / 111, 96.9 s). 96 blocks plan with the GPU's temporaries only (disk
#   full), 97 are refused (docs/storage.md has the lines). The call (part b19):
#   PREALLOC=false POOL19=56 B_STEPS=1 LIMIT=585 MEMLOG=$OUT/mem.log \
#     bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b19
# * Session 19 (docs/benchmarks.md "Nineteenth session"): a2 and b19 trained to their memory plateau (python RSS
#   126-128 GB, 4.5-4.8 GB available) but recorded no step: the bench's worker was given the part's time *after* the
#   ~20 s matmul probe, so the outer `timeout` killed the driver first. The bench now takes --time-limit (each worker
#   gets what is left less 10 s; its finished steps, or its warm-up's seconds and loss, are kept) and echoes the
#   worker's progress and host-ledger lines into $OUT/<tag>.log as they come. Seen from memwatch: a2 plan + compile
#   ~200 s, init to ~340 s; b19 plan + compile ~210 s (s17b's GPT3_18B: 69 s), init to ~330 s. b2 (MB18_BATCH=8,
#   host 115e9) planned in 91 s, then compiled its 32 in-program programs for ~380 s (s17b's one-micro-batch 32:
#   34 s) and was refused: compiled 138.56e9 vs accounted 132.85e9 (1.043x); the re-plan at 127.54e9 of device needs
#   117.11e9 of host. With that compile b2 cannot reach a step in one 600 s call: first find where the compile time
#   goes (compiles only, ~5 min, JSON $OUT/inprogram_gap_<tag>.json with plan_s / compile_s per plan):
#     for f in "" "--xla_gpu_autotune_level=0" "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL"; do
#       XLA_FLAGS="$f" timeout 140 python experiments/gpu_checks/inprogram_gap.py --rows 1 --m 8 --layers 6 \
#         --in-program-only --tag "s20${f:+_$(echo $f | tr -c 'a-z0-9' _ | cut -c1-30)}"; done
#   then a2 and b19 as above (now with --time-limit: LIMIT=583 leaves the worker ~548 s after the probe; a2's warm-up
#   ends near 450 s, a timed step near 560 s).
# * Session 20 (docs/benchmarks.md "Twentieth session"): the probe above showed nothing (6 layers, 8 x 1 x 1024:
#   5 in-program programs compiled in 3.4 s under every flag, ratio 0.95; inprogram_gap_s20p*.json): b2's ~380 s is
#   not the loops' XLA passes at that size. a2 trained (warm-up 114.7 s, one timed step 106.6 s, loss 11.653 ->
#   11.546); b19 finished its warm-up (101.5 s, loss 11.630) at 491 s after plan 135 s + compile 135 s + init 120 s,
#   too late for a timed step. The part now keeps jax's compilation cache in the repository's ignored .cache/ (kept
#   on the device machine between calls while it is warm): run a part twice back to back (the second call within
#   the 30 s idle release) and the second skips most of plan + compile (b19: ~270 s), leaving time for 3 steps.
#   Next: b19 twice back to back (the second call: ~30 s of plan + compile from the cache, init ~120 s, then a warm-up
#   and 2-3 steps of ~100 s). b2 in one plan: `--set compiled_margin=5.8e9` makes the fit's first plan leave s19b2's
#   measured overshoot (138.56e9 compiled - 132.85e9 accounted) below the headroom, landing where its re-plan did
#   (127.54e9 of device, host need 117.11e9), so its 32 programs compile once, not twice. Twice back to back:
#   PREALLOC=false POOL18MB=56 MB18_BATCH=8 EXTRAMB="--host-budget 117.2e9 --set compiled_margin=5.8e9" LIMIT=583 \
#     MEMLOG=$OUT/mem.log bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b2
#   (host need ~128e9: b19 ran at 127.68e9 accounted with 2.5 GB available at its peak; watch MemAvailable).
# * Session 21 (docs/benchmarks.md "Twenty-first session"): s21b2 (the b2 command above) planned, compiled once (84 s,
#   compiled 132.20e9 vs 127.13e9 accounted) and initialised (110 s, MemAvailable 5.16 GiB after), then its first step
#   stopped with ENOSPC: 108 chunk files planned in exactly the directory's free bytes, and each worker writes up to
#   IO_THREADS new files beside their committed ones (now counted: plan_disk.disk_chunks_fit). s21b2b (same command,
#   106 disk chunks) planned in 118.9 s and its compile did not end before the worker's limit (552 s): the slow b2
#   compile of s19b2 again, cause not found. Next: run b2 twice back to back (the first call's compile fills the
#   cache), or find which of the 32 programs compiles slowly (inprogram_gap.py at 18B's 96 layers, compile only).
# * Session 22 (docs/benchmarks.md "Twenty-second session"): s22b2 (the command above) timed out again; s22b2d's whole
#   stderr (the bench now keeps it, with the worker's Python stack at its limit) shows no slow compile: the fit planned
#   each in-program micro-batch group in turn (8, then 4, then 2; ~80 s a plan on the H200's host), none fitting the
#   117.2e9 host budget once the disk-budget fix moved 2 chunks from disk to host. The planner is ~2x faster now
#   (predict's per-chunk lookups). Next: b2 at --host-budget 118.2e9, twice back to back:
#   PREALLOC=false POOL18MB=56 MB18_BATCH=8 EXTRAMB="--host-budget 118.2e9 --set compiled_margin=5.8e9" LIMIT=583 \
#     MEMLOG=$OUT/mem.log bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b2
# * Session 23 (docs/benchmarks.md "Twenty-third session"): the CPU plan (largest_plan.py, CPU traces) still refused
#   118.2e9 (least host need 124.0e9 with the CPU's larger activations); on the GPU, b2 at --host-budget 119e9 planned in
#   58.9 s, compiled once and trained in one call: 3 steps, losses 11.667 -> 11.077 -> 10.470, step 90.67 s against
#   96.56 s planned, disk 1.46 GB/s, peak RSS 127.06 GB (MemAvailable 2.18 GiB at its lowest):
#   PREALLOC=false POOL18MB=56 MB18_BATCH=8 EXTRAMB="--host-budget 119e9 --set compiled_margin=5.8e9" LIMIT=583 \
#     MEMLOG=$OUT/mem.log bash experiments/gpu_checks/memwatch.sh bash experiments/gpu_checks/largest.sh <run> b2
set -u
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax_gpu}
RUN=${1:-largest}
PART=${2:-a}
export PYTHONUNBUFFERED=1
START=$SECONDS
LIMIT=${LIMIT:-530}
OUT=${OUT:-/tmp/largest_out}
mkdir -p $OUT
DISK=${DISK:-$PWD/.scratch_disk}
BUDGET=${BUDGET:-138GiB}
# CPU smoke test: OUT=/tmp/o M15=micro M18=tiny M12=micro BUDGET=64MiB SEQ=16 bash ... a (numbers meaningless)
M15=${M15:-GPT3_15B}
M18=${M18:-GPT3_18B}
M12=${M12:-GPT3_12B}
B="python -m experiments.bench --largest --systems chunkjax --device-budget $BUDGET --largest-seq ${SEQ:-1024} --results-dir $OUT"
run() {  # run <tag> <pool GiB> <least s> <bench args...>: with at least <least s> of the part left, else skipped
  local tag=$1 pool=$2 least=$3; shift 3
  local left=$((LIMIT - (SECONDS - START)))
  if (( left < least )); then echo "skip $tag (time)"; echo "$tag" >> $OUT/skipped.txt; return; fi
  local t0=$SECONDS
  XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE=${PREALLOC:-true} XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=$pool \
    timeout -k 10 $left $B --run-id ${RUN}_$tag --time-limit $((left - 5)) "$@" > $OUT/$tag.log 2>&1
  echo "$tag rc=$? $((SECONDS - t0)) s"
}
disk() { rm -rf "$DISK"; mkdir -p "$DISK"; df -B1 --output=avail "$DISK" | tail -1 | sed 's/^/disk free bytes: /'; }
if [[ $PART == a ]]; then
  run 15b ${POOL15:-38} 120 --largest-models $M15 --largest-steps 5 ${EXTRA15:-}
fi
if [[ $PART == b ]]; then
  disk
  run 18b_disk ${POOL18:-56} 120 --largest-models $M18 --largest-steps ${B_STEPS:-3} --storage "$DISK" --no-storage-keep-previous \
    ${EXTRA18:-}
  rm -rf "$DISK"
fi
if [[ $PART == b19 ]]; then  # past 18B: chunks of a quarter block and a LayerNorm scale (0.2 % padding; the search's 52953088 pads 4.9 %)
  disk
  run 19b_disk ${POOL19:-56} 120 --largest-models ${M19:-GPT3_19B} --largest-steps ${B_STEPS:-1} --storage "$DISK" \
    --no-storage-keep-previous --set chunk_size=${CHUNK19:-50337792} ${EXTRA19:---host-budget 117e9}
  rm -rf "$DISK"
fi
if [[ $PART == a2 || $PART == b2 ]]; then  # in-program accumulation where it fits (the plan line says which)
  if [[ $PART == a2 ]]; then tag=15b_disk_mb8; model=$M15; pool=${POOL15MB:-44}; batch=${MB15_BATCH:-64}
  else tag=18b_disk_mb8; model=$M18; pool=${POOL18MB:-56}; batch=${MB18_BATCH:-16}; fi
  disk
  run $tag $pool ${MB_LEAST:-480} --largest-models $model --largest-steps ${MB_STEPS:-1} --largest-batch $batch \
    --set micro_batches=8 --storage "$DISK" --no-storage-keep-previous ${EXTRAMB:-}
  rm -rf "$DISK"
fi
if [[ $PART == c ]]; then
  run 12b_mb8 ${POOL12MB:-30} ${MB_LEAST12:-200} --largest-models $M12 --largest-steps ${MB_STEPS:-3} --largest-batch 64 \
    --set micro_batches=8
  disk
  run 12b_disk_mb8 ${POOL12MB:-30} ${MB_LEAST12:-200} --largest-models $M12 --largest-steps ${MB_STEPS:-3} --largest-batch 64 \
    --set micro_batches=8 --host-budget ${HOST12:-110e9} --storage "$DISK" --no-storage-keep-previous
  rm -rf "$DISK"
fi
TAGS="15b 18b_disk 19b_disk 12b_mb8 12b_disk_mb8 15b_disk_mb8 18b_disk_mb8"
for t in $TAGS; do [ -f $OUT/$t.log ] && { echo "== $t"; tail -3 $OUT/$t.log; }; done
python - "$RUN" $TAGS <<'P'
import json, os, sys
O, run = os.environ.get("OUT", "/tmp/largest_out"), sys.argv[1]
rows = []
for tag in sys.argv[2:]:
    f = f"{O}/bench_{run}_{tag}.json"
    if not os.path.exists(f):
        continue
    blk = json.load(open(f)).get("largest", {}).get("chunkjax", {})
    for model, t in blk.get("tried", {}).items():
        st = t.get("storage") or {}
        gbs = st.get("disk_gb_per_s_measured") or []
        losses = t.get("losses") or []
        rows.append({"run": tag, "model": model, "batch": blk.get("batch"), "micro_batches": t.get("micro_batches"),
                     "ok": t.get("ok"), "step_s": t.get("step_s_median"), "step_s_predicted": t.get("step_s_predicted"),
                     "tokens_per_s": t.get("tokens_per_s"), "loss_first_last": [losses[0], losses[-1]] if losses else None,
                     "host_rss_peak": t.get("host_rss_peak_bytes_measured"), "host_accounted": t.get("host_bytes_accounted"),
                     "host_budget": t.get("host_budget_bytes"), "device_peak": t.get("peak_device_bytes_measured"),
                     "device_accounted": t.get("peak_device_bytes_accounted"), "compiled_peak": t.get("compiled_peak_bytes"),
                     "storage_chunks": st.get("storage_chunks"), "disk_gb_step": (st.get("disk_bytes_per_step_accounted") or 0) / 1e9,
                     "disk_gb_s": gbs[-1] if gbs else None, "counts": t.get("schedule_counts"),
                     "error": (t.get("error") or t.get("infeasible_reason") or "")[:300]})
skipped = f"{O}/skipped.txt"
out = {"run_id": run, "rows": rows, "skipped": open(skipped).read().split() if os.path.exists(skipped) else []}
json.dump(out, open(f"{O}/largest_{run}.json", "w"), indent=1)
g = lambda v, d=2, s=1e9: "-" if v is None else f"{v / s:,.{d}f}"
print("| run | model | batch (micro) | ok | step s | predicted s | tokens/s | loss first -> last | host RSS GB | host plan GB "
      "| device GB (compiled / plan) | disk chunks | disk GB/step | disk GB/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for x in rows:
    l = x["loss_first_last"]
    print(f"| {x['run']} | {x['model']} | {x['batch']} ({x['micro_batches'] or 1}) | {x['ok']} | {g(x['step_s'], 2, 1)} | "
          f"{g(x['step_s_predicted'], 2, 1)} | {g(x['tokens_per_s'], 0, 1)} | "
          f"{'-' if not l else f'{l[0]:.3f} -> {l[1]:.3f}'} | {g(x['host_rss_peak'])} | {g(x['host_accounted'])} | "
          f"{g(x['device_peak'])} ({g(x['compiled_peak'])} / {g(x['device_accounted'])}) | {x['storage_chunks'] or 0} | "
          f"{x['disk_gb_step']:.1f} | {g(x['disk_gb_s'], 2, 1)} | " + (x["error"].splitlines()[0] if x["error"] else ""))
print("skipped:", out["skipped"])
P
