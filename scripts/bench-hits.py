#!/usr/bin/env python3
"""The hit path against the device's pace (issue 46), side by side in one run: warm 4 KiB
random reads of a wholly cached region through `sce serve`, against the same cache file
exported plainly (no cache) by `sce serve`, nbdkit and qemu-nbd, with each server's CPU per
request.

A 1 GiB local source file; `sce serve --source FILE --cache C --cache-size 1GiB` (the
defaults otherwise: write-through, admission sce); `sce ctl prefetch 0 REGION`, then fio
passes over the region until a pass misses nothing. The cache file is copied, every block
written (holes too: a hole reads without the device), and the copy served read-only by `sce serve --source COPY`, `nbdkit file cache=none` and `qemu-nbd
--cache=none --aio=io_uring`, all at once. fio (nbd engine) 4 KiB random reads over the
region at QD1, QD32 and QD128, --seconds per run; the servers' runs of a cell follow each
other in an order that rotates per round, --rounds rounds, medians. CPU per request: the
server process's user + system time over the run divided by fio's requests. Goal: the
cached export >= 0.95x the plain `sce serve` at every depth.

Usage: scripts/bench-hits.py [--sce BIN] [--seconds S] [--rounds N] [--region 200MiB]
       [--qds 1,32,128] [--out FILE]
The sce binary defaults to target/release/sce, built first (cargo build --release -p sce).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile

from benchkit import (Procs, cpu_s, fio, iops, log, read_pages, report, sce_serve, uri,
                      wait_sock, warm_until_no_miss)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = ["sce cached", "sce plain", "nbdkit", "qemu-nbd"]


def rr(region, qd, secs):
    return ["--name=rr", "--rw=randread", "--bs=4k", f"--iodepth={qd}", f"--size={region}",
            "--time_based", f"--runtime={secs}", "--randseed=9", "--ioengine=nbd"]


def warm(sce, sock, addr, region):
    """Prefetches the region, then reads it until a pass misses nothing; returns the hit
    ratio of the last pass."""
    subprocess.run([sce, "ctl", "-s", sock, "prefetch", "0", region], check=True,
                   capture_output=True)
    return warm_until_no_miss(addr, lambda: fio(rr(region, 32, 2) + [f"--uri={uri(sock)}"]), 20)


def dense_copy(src, dst):
    """Copies `src` to `dst` writing every block, holes too, then drops it from the page
    cache. The cache file is sparse where no slot was written: a plain export reading a hole
    gets zeroes from the file system without a device read (the first 200 MiB of a 1 GiB
    cache holding 200 MiB were three quarters holes), and would not be the device's pace."""
    with open(src, "rb") as r, open(dst, "wb") as w:
        while True:
            b = r.read(1 << 20)
            if not b:
                break
            w.write(b)
        w.flush()
        os.fsync(w.fileno())
        os.posix_fadvise(w.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def plain_servers(procs, sce, d, plain):
    """The copy of the cache file served read-only by sce, nbdkit and qemu-nbd at once."""
    out = {}
    p, sock, _ = sce_serve(procs, sce, d, "plain", ["--source", plain, "--read-only"])
    out["sce plain"] = (p, sock)
    sock = os.path.join(d, "nbdkit.sock")
    p = procs.start(["nbdkit", "-f", "-r", "-U", sock, "file", f"file={plain}", "cache=none"])
    wait_sock(sock, p, "nbdkit")
    out["nbdkit"] = (p, sock)
    sock = os.path.join(d, "qemu.sock")
    p = procs.start(["qemu-nbd", "-f", "raw", "--cache=none", "--aio=io_uring", "--shared=8",
                     "--persistent", "-r", "-k", sock, plain])
    wait_sock(sock, p, "qemu-nbd")
    out["qemu-nbd"] = (p, sock)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sce", help="a prebuilt sce binary (default: build target/release/sce)")
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--region", default="200MiB")
    ap.add_argument("--qds", default="1,32,128")
    ap.add_argument("--out", help="also write the Markdown table here")
    a = ap.parse_args()
    sce = a.sce
    if not sce:
        subprocess.run(["cargo", "build", "--release", "-p", "sce"], cwd=ROOT, check=True)
        sce = os.path.join(ROOT, "target/release/sce")
    qds = [int(q) for q in a.qds.split(",")]
    procs = Procs()
    d = tempfile.mkdtemp(prefix="sce-hits-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    try:
        src = os.path.join(d, "src")
        subprocess.run(["fio", "--name=fill", f"--filename={src}", "--size=1g", "--rw=write",
                        "--bs=1M", "--direct=1", "--refill_buffers", "--output=/dev/null"],
                       check=True)
        cache = os.path.join(d, "cache")
        p, sock, addr = sce_serve(procs, sce, d, "cached",
                                  ["--source", src, "--cache", cache, "--cache-size", "1GiB",
                                   "--state-dir", os.path.join(d, "state")])
        ratio = warm(sce, sock, addr, a.region)
        plain = os.path.join(d, "plain")
        dense_copy(cache, plain)
        servers = {"sce cached": (p, sock)} | plain_servers(procs, sce, d, plain)
        res = {(q, s): [] for q in qds for s in SERVERS}
        cpu = {(q, s): [] for q in qds for s in SERVERS}
        h0, m0 = read_pages(addr)
        for rnd in range(a.rounds):
            for qd in qds:
                k = rnd % len(SERVERS)
                for s in SERVERS[k:] + SERVERS[:k]:
                    proc, ssock = servers[s]
                    c0 = cpu_s(proc)
                    job, _ = fio(rr(a.region, qd, a.seconds) + [f"--uri={uri(ssock)}"])
                    n = job["read"]["total_ios"]
                    res[(qd, s)].append(iops(job))
                    cpu[(qd, s)].append((cpu_s(proc) - c0) * 1e6 / max(n, 1))
                    log(f"round {rnd + 1} QD{qd} {s}: {iops(job):,.0f} IOPS, "
                        f"{cpu[(qd, s)][-1]:.1f} us CPU/request")
        h1, m1 = read_pages(addr)
        h, m = h1 - h0, m1 - m0
    finally:
        procs.stop_all()
        shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = ["| QD | sce cached | sce plain | nbdkit | qemu-nbd | cached / sce plain | "
           "CPU µs/request: cached, sce plain, nbdkit, qemu-nbd | goal ≥ 0.95x |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for qd in qds:
        r = med[(qd, "sce cached")] / med[(qd, "sce plain")]
        out.append(f"| {qd} | " + " | ".join(f"{med[(qd, s)]:,.0f}" for s in SERVERS)
                   + f" | {r:.2f}x | " + ", ".join(f"{mcpu[(qd, s)]:.1f}" for s in SERVERS)
                   + f" | {'met' if r >= 0.95 else 'missed'} |")
    out += ["", f"Warm-up's last pass hit ratio {ratio:.4f}; over the measured runs "
            f"{h:,} pages hit, {m:,} missed. Region {a.region}, {a.seconds} s per run, "
            f"{a.rounds} rounds, medians. Every run (IOPS): " + "; ".join(
                f"QD{qd} {s} " + "/".join(f"{x:,.0f}" for x in res[(qd, s)])
                for qd in qds for s in SERVERS)]
    report("\n".join(out), a.out)


if __name__ == "__main__":
    main()
