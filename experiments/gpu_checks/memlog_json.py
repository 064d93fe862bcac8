"""A memwatch.sh timeline (MEMLOG) as the JSON record kept under experiments/results/.

    python experiments/gpu_checks/memlog_json.py MEMLOG OUT.json --command "the call" [--note "..."]

Keys: ``command``, ``note``, ``peak_host_used_measured`` and ``peak_python_rss_measured`` (the
samples where each peaks) and ``every_2s`` (every sample). Bytes; ``t_s`` is seconds since the
call's start. Columns of MEMLOG: see memwatch.sh."""
import argparse
import json


def parse(path: str) -> list[dict]:
    rows = []
    for line in open(path):
        f = line.split()
        if len(f) < 4 or not f[0].isdigit():
            continue  # dmesg lines at the end
        py = next((x for x in f if x.startswith("py=")), None)
        n, rss, anon, shmem = (int(v) for v in py[3:].split(",")) if py else (0, 0, 0, 0)
        rows.append({"t_s": int(f[0]), "host_used_bytes_measured": int(f[1]), "mem_available_bytes_measured": int(f[2]),
                     "rss_anon_bytes_measured": anon * 1024, "rss_shmem_bytes_measured": shmem * 1024,
                     "python_processes": n, "python_rss_bytes_measured": rss * 1024})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("memlog")
    ap.add_argument("out")
    ap.add_argument("--command", required=True)
    ap.add_argument("--note", default="")
    a = ap.parse_args(argv)
    rows = parse(a.memlog)
    if not rows:
        raise SystemExit(f"error: {a.memlog} has no memwatch.sh samples")
    rec = {"command": a.command, "note": a.note,
           "peak_host_used_measured": max(rows, key=lambda r: r["host_used_bytes_measured"]),
           "peak_python_rss_measured": max(rows, key=lambda r: r["python_rss_bytes_measured"]),
           "every_2s": rows}
    with open(a.out, "w") as fh:
        json.dump(rec, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
