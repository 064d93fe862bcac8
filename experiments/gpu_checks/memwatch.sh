# Run a command with a memory timeline: every 2 s, seconds since start, host used and MemAvailable (bytes),
# the largest process's RSS, RssAnon and RssShmem (KiB; pinned host memory shows as shmem) and its command, to $MEMLOG (default $OUT/mem.log); then dmesg's last OOM lines.
#   MEMLOG=$OUT/mem.log bash experiments/gpu_checks/memwatch.sh <command...>
MEMLOG=${MEMLOG:-${OUT:-/tmp}/mem.log}
t0=$(date +%s)
( while true; do
    top=$(ps -eo pid,rss,args --sort=-rss | sed -n 2p)
    pid=$(echo $top | cut -d' ' -f1)
    kinds=$(awk '/^RssAnon|^RssShmem/{printf "%s ", $2}' /proc/$pid/status 2>/dev/null)
    echo "$(( $(date +%s) - t0 )) $(free -b | awk '/Mem:/{print $3, $7}') $kinds$(echo $top | cut -d' ' -f2- | cut -c1-80)"
    sleep 2
  done ) > "$MEMLOG" 2>&1 &
W=$!
"$@"
rc=$?
kill $W 2>/dev/null
(dmesg 2>/dev/null || true) | grep -i -E "oom|killed process" | tail -5 >> "$MEMLOG"
exit $rc
