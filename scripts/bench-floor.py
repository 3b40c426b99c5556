#!/usr/bin/env python3
"""The serving floor (issue 46), side by side in one run: a local file served with no cache
by `sce serve --source FILE`, against fio on the file itself (io_uring, O_DIRECT) and the
same file served by nbdkit and qemu-nbd.

A 1 GiB file, every block written; `sce serve --source F --read-only`, `nbdkit file
cache=none` (not O_DIRECT: nbdkit's file plugin drops pages after use, so a region that fits
in RAM may stay in the page cache) and `qemu-nbd --cache=none --aio=io_uring` at once. fio
4 KiB random reads over the file at total depths 1, 32 and 128, over one connection (one
job at that depth) and over four (four jobs, each a quarter of the depth, at least 1: each
fio job of the nbd engine opens its own connection); fio on the file gets the same jobs and
depths. --seconds per run; the runs of a cell follow each other in an order that rotates per
round, --rounds rounds, medians. CPU per request: each server's user + system time over the
run divided by fio's requests. Goals: sce >= 0.8x fio on the file, and >= 1.2x the faster
of nbdkit and qemu-nbd at depths 32 and 128.

Usage: scripts/bench-floor.py [--sce BIN] [--seconds S] [--rounds N] [--qds 1,32,128]
       [--conns 1,4] [--out FILE]
The sce binary defaults to target/release/sce, built first (cargo build --release -p sce).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile

from benchkit import Procs, cpu_s, fio, iops, log, report, sce_serve, uri, wait_sock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = ["fio on the file", "sce", "nbdkit", "qemu-nbd"]


def job_args(qd, conns, secs):
    per = max(1, qd // conns)
    return ["--name=rr", "--rw=randread", "--bs=4k", f"--iodepth={per}", f"--numjobs={conns}",
            "--size=1g", "--time_based", f"--runtime={secs}", "--randseed=9"]


def servers(procs, sce, d, f):
    out = {}
    p, sock, _ = sce_serve(procs, sce, d, "sce", ["--source", f, "--read-only"])
    out["sce"] = (p, sock)
    sock = os.path.join(d, "nbdkit.sock")
    p = procs.start(["nbdkit", "-f", "-r", "-U", sock, "file", f"file={f}", "cache=none"])
    wait_sock(sock, p, "nbdkit")
    out["nbdkit"] = (p, sock)
    sock = os.path.join(d, "qemu.sock")
    p = procs.start(["qemu-nbd", "-f", "raw", "--cache=none", "--aio=io_uring", "--shared=8",
                     "--persistent", "-r", "-k", sock, f])
    wait_sock(sock, p, "qemu-nbd")
    out["qemu-nbd"] = (p, sock)
    return out


def run(s, srv, f, qd, conns, secs):
    """IOPS and the server's CPU microseconds per request of one run."""
    base = job_args(qd, conns, secs)
    if s == "fio on the file":
        job, _ = fio(base + ["--ioengine=io_uring", "--direct=1", f"--filename={f}"])
        return iops(job), 0.0
    proc, sock = srv[s]
    c0 = cpu_s(proc)
    job, _ = fio(base + ["--ioengine=nbd", f"--uri={uri(sock)}"])
    n = job["read"]["total_ios"]
    return iops(job), (cpu_s(proc) - c0) * 1e6 / max(n, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sce", help="a prebuilt sce binary (default: build target/release/sce)")
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--qds", default="1,32,128")
    ap.add_argument("--conns", default="1,4")
    ap.add_argument("--out", help="also write the Markdown table here")
    a = ap.parse_args()
    sce = a.sce
    if not sce:
        subprocess.run(["cargo", "build", "--release", "-p", "sce"], cwd=ROOT, check=True)
        sce = os.path.join(ROOT, "target/release/sce")
    qds = [int(q) for q in a.qds.split(",")]
    conns = [int(c) for c in a.conns.split(",")]
    cells = [(q, c) for c in conns for q in qds]
    procs = Procs()
    d = tempfile.mkdtemp(prefix="sce-floor-", dir=os.environ.get("BENCH_DIR", "/var/tmp"))
    res = {(q, c, s): [] for (q, c) in cells for s in SERVERS}
    cpu = {(q, c, s): [] for (q, c) in cells for s in SERVERS}
    try:
        f = os.path.join(d, "file")
        subprocess.run(["fio", "--name=fill", f"--filename={f}", "--size=1g", "--rw=write",
                        "--bs=1M", "--direct=1", "--refill_buffers", "--output=/dev/null"],
                       check=True)
        srv = servers(procs, sce, d, f)
        for rnd in range(a.rounds):
            for (qd, c) in cells:
                k = rnd % len(SERVERS)
                for s in SERVERS[k:] + SERVERS[:k]:
                    n, us = run(s, srv, f, qd, c, a.seconds)
                    res[(qd, c, s)].append(n)
                    cpu[(qd, c, s)].append(us)
                    log(f"round {rnd + 1} QD{qd} x{c} {s}: {n:,.0f} IOPS, {us:.1f} us CPU/req")
    finally:
        procs.stop_all()
        shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in res.items()}
    mcpu = {k: statistics.median(v) for k, v in cpu.items()}
    out = ["| depth | connections | fio on the file | sce | nbdkit | qemu-nbd | sce / fio | "
           "sce / faster of nbdkit, qemu-nbd | CPU us/request: sce, nbdkit, qemu-nbd | goal |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for (qd, c) in cells:
        m = lambda s: med[(qd, c, s)]  # noqa: E731
        vs_fio = m("sce") / m("fio on the file")
        vs_other = m("sce") / max(m("nbdkit"), m("qemu-nbd"))
        ok = vs_fio >= 0.8 and (qd < 32 or vs_other >= 1.2)
        out.append(f"| {qd} | {c} | " + " | ".join(f"{m(s):,.0f}" for s in SERVERS)
                   + f" | {vs_fio:.2f}x | {vs_other:.2f}x | "
                   + ", ".join(f"{mcpu[(qd, c, s)]:.1f}" for s in SERVERS[1:])
                   + f" | {'met' if ok else 'missed'} |")
    every = "; ".join(f"QD{q} x{c} {s} " + "/".join(f"{v:,.0f}" for v in res[(q, c, s)])
                      for (q, c) in cells for s in SERVERS)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    text = (f"`scripts/bench-floor.py --seconds {a.seconds} --rounds {a.rounds}` (git {rev}, "
            f"{os.cpu_count()} CPUs)\n\n" + "\n".join(out)
            + f"\n\nMedians of {a.rounds} rounds. Every run (IOPS): {every}\n")
    report(text, a.out)


if __name__ == "__main__":
    main()
