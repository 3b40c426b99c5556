#!/usr/bin/env python3
"""Write-back over a slow, narrow source (issue 45): does the cleaner take the source from
the clients' reads? `sce sim`'s write-back rows for cloudPhysics (docs/SIM-REPORT.md) say it
can: over a 4-way 5 ms disk model the log fills, urgent cleaning (64 source writes at once)
holds the source, and reads queue behind it. This runs the server on such a source:
`nbdkit --filter=delay memory 2G rdelay=5ms wdelay=5ms -t 4` (4 requests at once: 800 per
second), `sce serve` with a fresh 1 GiB cache in write-through (AWT) and in write-back, and
fio's nbd engine, 4 KiB random reads and writes at QD16 over 2 GiB for --seconds, in two
mixes: 70% reads Zipf 1.1 (hot data that rewrites coalesce in the log), and 50% reads
uniform (every write a new page: the log fills and cleaning turns urgent). Prints one
Markdown table: IOPS, read mean and p99, write mean, read hit ratio, writes that waited
for room, bytes cleaned.

Usage: scripts/bench-narrow-source.py [--sce BIN] [--seconds S]"""

import argparse
import os
import subprocess
import tempfile

from benchkit import Procs, fio, http_json, sce_serve, uri, wait_sock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXES = [
    ("70% reads, Zipf 1.1", ["--rwmixread=70", "--random_distribution=zipf:1.1"]),
    ("50% reads, uniform", ["--rwmixread=50"]),
]


def run(sce, mode, mix, seconds):
    d = tempfile.mkdtemp(prefix="narrow.")
    procs = Procs()
    try:
        src_sock = os.path.join(d, "src.sock")
        src = procs.start(["nbdkit", "-f", "-U", src_sock, "--filter=delay", "memory", "2G",
                           "rdelay=5ms", "wdelay=5ms", "-t", "4"])
        wait_sock(src_sock, src, "nbdkit (source)")
        cache = os.path.join(d, "cache")
        subprocess.run(["dd", "if=/dev/zero", f"of={cache}", "bs=1M", "count=1024",
                        "status=none"], check=True)
        _, sock, addr = sce_serve(procs, sce, d, "sce", [
            "--source", uri(src_sock), "--cache", cache, "--cache-size", "1GiB", "--force",
            "--mode", mode])
        j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={uri(sock)}", "--rw=randrw",
                    "--bs=4k", "--iodepth=16", "--size=2G", "--time_based",
                    f"--runtime={seconds}"] + mix)
        st = http_json(addr)["exports"][""]
        return j, st
    finally:
        for p in list(procs.procs):
            procs.stop(p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sce", default=os.path.join(ROOT, "target/release/sce"))
    ap.add_argument("--seconds", type=int, default=60)
    a = ap.parse_args()
    print("| load | mode | read IOPS | write IOPS | read mean / p99 (ms) | write mean (ms) | "
          "read hit ratio | waits for room | cleaned |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, mix in MIXES:
        for mode in ("writethrough", "writeback"):
            j, st = run(a.sce, mode, mix, a.seconds)
            r, w = j["read"], j["write"]
            p99 = r["clat_ns"]["percentile"].get("99.000000", 0) / 1e6
            cleaned = st.get("writeback_cleaned_bytes")
            print(f"| {name} | {mode} | {r['iops']:,.0f} | {w['iops']:,.0f} | "
                  f"{r['lat_ns']['mean'] / 1e6:.2f} / {p99:.1f} | {w['lat_ns']['mean'] / 1e6:.2f} | "
                  f"{st.get('read_hit_ratio', 0):.3f} | {st.get('writeback_waits', '-')} | "
                  f"{'-' if cleaned is None else f'{cleaned / 2**20:,.0f} MiB'} |", flush=True)


if __name__ == "__main__":
    main()
