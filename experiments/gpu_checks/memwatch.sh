# Run a command with a memory timeline: every 2 s, seconds since start, host used and MemAvailable (bytes),
# the largest process's RssAnon and RssShmem (KiB; pinned host memory shows as shmem), then "py=" the number of
# python processes and the sum of their RSS, RssAnon and RssShmem (KiB: the trainer, the bench driver and the
# near-storage workers together), then the largest process's RSS (KiB) and command, to $MEMLOG (default
# $OUT/mem.log); then dmesg's last OOM lines. Columns: t_s used_bytes available_bytes anon_KiB shmem_KiB
# py=N,rss_KiB,anon_KiB,shmem_KiB rss_KiB command.
#   MEMLOG=$OUT/mem.log bash experiments/gpu_checks/memwatch.sh <command...>
MEMLOG=${MEMLOG:-${OUT:-/tmp}/mem.log}
t0=$(date +%s)
( while true; do
    top=$(ps -eo pid,rss,args --sort=-rss | sed -n 2p)
    pid=$(echo $top | cut -d' ' -f1)
    kinds=$(awk '/^RssAnon|^RssShmem/{printf "%s ", $2}' /proc/$pid/status 2>/dev/null)
    py=$(for p in $(pgrep python); do awk '/^VmRSS|^RssAnon|^RssShmem/{printf "%s ", $2}' /proc/$p/status 2>/dev/null; echo; done |
         awk 'NF==3{n++; r+=$1; a+=$2; s+=$3} END{printf "py=%d,%d,%d,%d ", n, r, a, s}')
    echo "$(( $(date +%s) - t0 )) $(free -b | awk '/Mem:/{print $3, $7}') $kinds$py$(echo $top | cut -d' ' -f2- | cut -c1-80)"
    sleep 2
  done ) > "$MEMLOG" 2>&1 &
W=$!
"$@"
rc=$?
kill $W 2>/dev/null
(dmesg 2>/dev/null || true) | grep -i -E "oom|killed process" | tail -5 >> "$MEMLOG"
exit $rc
