#!/usr/bin/env python3
"""Never slower than the source (issue 46), side by side in one run: writes over cached and
uncached data, and cold sequential reads, through `sce serve` against the source alone.

1. Writes: a fresh 2 ms source (`nbdkit --filter=delay memory 32G rdelay=2ms wdelay=2ms -t 64`)
   per mode; `sce serve` with a 1 GiB cache, `sce ctl prefetch 0 512MiB`; fio 4 KiB random
   writes (nbd engine) over the cached 512 MiB and over 512 MiB at 1 GiB that is not cached,
   at QD1 and QD16, each --seconds long; the source alone the same way. Mean and p99
   latency, and their ratios to the source alone's (goal: mean <= 1.05x, p99 <= 1.2x).
2. Cold sequential reads: fio 1 MiB reads in order at QD8 and QD1 over a 32 GiB volume
   (time-based, --seconds: the run never wraps), and `nbdcopy --no-extents` of a 4 GiB volume to `null:`
   (no full-cache row), a fresh source and a fresh 1 GiB cache per
   row, empty (the stream fills it) and, for write-through, full of other data (`sce ctl
   prefetch 16GiB 1GiB` first); behind the unlimited
   source and behind `nbdkit --filter=rate rate=4G` (about 500 MB/s). Throughput, its ratio
   to the source alone's (goals: >= 0.8x unlimited, >= 0.95x limited), and the CPU seconds
   of sce and of the source during the run (on 2 CPUs fio, the source and sce share them).

Usage: scripts/bench-source-pace.py [--sce BIN] [--parts writes,reads] [--seconds S]
       [--modes writethrough,writethrough-sync,writearound] [--out FILE]
The sce binary defaults to target/release/sce, built first (cargo build --release -p sce).
"""

import argparse
import os
import shutil
import subprocess
import tempfile
import time

from benchkit import Procs, cpu_s, fio, log, report, sce_serve, slow_source, uri

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source(procs, d, rate=None):
    """A fresh 2 ms memory source of 32 GiB (a sequential run never wraps onto what it
    cached), rate-limited if `rate` (bits/s)."""
    return slow_source(procs, d, "32G", rate=rate)


def lat(job, rw):
    c = job[rw]["clat_ns"]
    return c["mean"] / 1e3, c["percentile"]["99.000000"] / 1e3


def writes(a, procs, sce, d):
    rows = []
    base = {}
    src, sock = source(procs, d)
    for qd in (1, 16):
        for region, off in (("cached", "0"), ("uncached", "1G")):
            job, _ = fio(["--name=w", "--ioengine=nbd", f"--uri={uri(sock)}", "--rw=randwrite",
                          "--bs=4k", f"--iodepth={qd}", f"--offset={off}", "--size=512M",
                          "--time_based", f"--runtime={a.seconds}"])
            base[(qd, region)] = lat(job, "write")
    procs.stop(src)
    for mode in a.modes.split(","):
        src, sock = source(procs, d)
        cache = os.path.join(d, "cache.img")
        if os.path.exists(cache):
            os.unlink(cache)
        p, ssock, _ = sce_serve(procs, sce, d, "sce", ["--source", uri(sock), "--cache", cache,
                                                       "--cache-size", "1GiB", "--mode", mode])
        subprocess.run([sce, "ctl", "-s", ssock, "prefetch", "0", "512MiB"], check=True,
                       capture_output=True)
        time.sleep(1)
        for qd in (1, 16):
            for region, off in (("cached", "0"), ("uncached", "1G")):
                job, _ = fio(["--name=w", "--ioengine=nbd", f"--uri={uri(ssock)}",
                              "--rw=randwrite", "--bs=4k", f"--iodepth={qd}", f"--offset={off}",
                              "--size=512M", "--time_based", f"--runtime={a.seconds}"])
                m, p99 = lat(job, "write")
                bm, bp = base[(qd, region)]
                rows.append((mode, qd, region, m, p99, bm, bp))
                log(f"writes {mode} QD{qd} {region}: {m:.0f} us (source {bm:.0f})")
        procs.stop(p)
        procs.stop(src)
    out = ["### Writes, 4 KiB random, 2 ms source, 512 MiB of the volume cached", "",
           "| mode | QD | data | mean us | source us | mean ratio | p99 us | source p99 | "
           "p99 ratio | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, qd, region, m, p99, bm, bp in rows:
        ok = m / bm <= 1.05 and p99 / bp <= 1.2
        out.append(f"| {mode} | {qd} | {region} | {m:.0f} | {bm:.0f} | {m / bm:.2f}x | "
                   f"{p99:.0f} | {bp:.0f} | {p99 / bp:.2f}x | {'met' if ok else 'missed'} |")
    return "\n".join(out)


COPY_SIZE = "4G"


def read_once(a, target, qd):
    """MB/s of one cold sequential read through `target`: fio 1 MiB at depth `qd` for
    --seconds, or (`qd` "copy") `nbdcopy --no-extents TARGET null:` of the whole COPY_SIZE volume."""
    if qd == "copy":
        t0 = time.monotonic()
        # --no-extents: read every byte (a fresh source is all zeroes, which nbdcopy skips).
        subprocess.run(["nbdcopy", "--no-extents", target, "null:"], check=True)
        return int(COPY_SIZE[:-1]) * 2**30 / (time.monotonic() - t0) / 1e6
    job, _ = fio(["--name=r", "--ioengine=nbd", f"--uri={target}", "--rw=read", "--bs=1M",
                  f"--iodepth={qd}", "--size=32G", "--time_based", f"--runtime={a.seconds}"])
    return job["read"]["bw_bytes"] / 1e6


def reads(a, procs, sce, d):
    rows = []
    for rate in (None, "4G"):
        for qd in (8, 1, "copy"):
            configs = [("source alone", None, False)]
            configs += [(m, m, False) for m in a.read_modes.split(",")]
            if qd != "copy":
                configs += [("writethrough, cache full of other data", "writethrough", True)]
            base = None
            for label, mode, full in configs:
                src, sock = (slow_source(procs, d, COPY_SIZE, rate=rate) if qd == "copy"
                             else source(procs, d, rate))
                srv = None
                target = uri(sock)
                if mode:
                    cache = os.path.join(d, "cache.img")
                    if os.path.exists(cache):
                        os.unlink(cache)
                    srv, ssock, _ = sce_serve(procs, sce, d, "sce", [
                        "--source", target, "--cache", cache, "--cache-size", "1GiB",
                        "--mode", mode])
                    target = uri(ssock)
                    if full:
                        subprocess.run([sce, "ctl", "-s", ssock, "prefetch", "16GiB", "1GiB"],
                                       check=True, capture_output=True)
                c0 = (cpu_s(srv) if srv else 0.0, cpu_s(src))
                mbs = read_once(a, target, qd)
                cpu = ((cpu_s(srv) - c0[0]) if srv else 0.0, cpu_s(src) - c0[1])
                base = base or mbs
                rows.append((rate, qd, label, mbs, mbs / base, cpu))
                log(f"reads {rate or 'unlimited'} QD{qd} {label}: {mbs:.0f} MB/s")
                if srv:
                    procs.stop(srv)
                procs.stop(src)
    out = ["### Cold sequential reads, fio 1 MiB in order over 32 GiB (QD 8, 1), `nbdcopy` of a "
           f"{COPY_SIZE}iB volume to null: (QD copy), 2 ms source", "",
           "| source | QD | configuration | MB/s | ratio | sce CPU s | source CPU s | goal |",
           "|---|---|---|---|---|---|---|---|"]
    for rate, qd, label, mbs, r, (c_sce, c_src) in rows:
        goal = 0.95 if rate else 0.8
        verdict = "" if label == "source alone" else ("met" if r >= goal else "missed")
        out.append(f"| {'rate=4G (~500 MB/s)' if rate else 'unlimited'} | {qd} | {label} | "
                   f"{mbs:.0f} | {r:.2f}x | {c_sce:.2f} | {c_src:.2f} | {verdict} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sce", help="a prebuilt sce binary (default: build target/release/sce)")
    ap.add_argument("--parts", default="writes,reads")
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--modes", default="writethrough,writethrough-sync,writearound")
    ap.add_argument("--read-modes", default="writethrough,writearound,writeback")
    ap.add_argument("--out", help="also write the Markdown tables here")
    a = ap.parse_args()
    for tool in ("fio", "nbdkit"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is needed")
    sce = a.sce
    if not sce:
        subprocess.run(["cargo", "build", "--release", "-p", "sce"], cwd=ROOT, check=True)
        sce = os.path.join(ROOT, "target/release/sce")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    procs = Procs()
    parts = []
    with tempfile.TemporaryDirectory(prefix="bench-pace-") as d:
        try:
            if "writes" in a.parts:
                parts.append(writes(a, procs, sce, d))
            if "reads" in a.parts:
                parts.append(reads(a, procs, sce, d))
        finally:
            procs.stop_all()
    head = (f"`scripts/bench-source-pace.py --seconds {a.seconds}` (sce {os.path.basename(sce)}, "
            f"git {rev}, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs)\n")
    report(head + "\n" + "\n\n".join(parts) + "\n", a.out)


if __name__ == "__main__":
    main()
