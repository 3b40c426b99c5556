#!/usr/bin/env python3
"""Write-back's write latency, side by side in one run (issue 15). Prints two tables with
ratios and the goal met or missed, and writes them as Markdown (--out).

1. fio's nbd engine, 4 KiB random writes over 256 MiB, at QD1 and QD16, against:
   the source alone (`nbdkit --filter=delay memory 2G rdelay=2ms wdelay=2ms -t 64`, a fresh
   one per run); `sce serve` over it in synchronous writethrough (`--awt off`), in AWT
   writethrough (the default) and in writeback; and the cache device alone: `sce serve` of
   a fully written local file on the cache's filesystem with no cache, the same NBD path
   and O_DIRECT. Mean and p99 completion latency of the writes; the goal is write-back
   within 1.2x of the device alone. Every configuration runs --rounds times in alternation,
   the median run (by mean latency) shown.
2. The load of `sce demo` (OLTP-like: 87% reads of 8 KiB, Zipf 1.0, 16 in flight, a 2 ms
   source, in-process): `sce demo --json --mode M` for writeback, writethrough and
   writethrough --awt off; the write latency of the cache run, and of the run without a
   cache (the source alone).

Usage: scripts/bench-writeback.py [--sce BIN] [--seconds S] [--demo-seconds S] [--rounds N]
       [--out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from benchkit import Procs, fio, log, mean_ms, p99_ms, sce_serve, report, slow_source, uri

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def part_fio(a, procs, sce, d, flash):
    configs = [
        ("source alone (2 ms)", "source", []),
        ("sce writethrough, synchronous", "sce", ["--mode", "writethrough", "--awt", "off"]),
        ("sce writethrough (AWT)", "sce", ["--mode", "writethrough"]),
        ("sce writeback", "sce", ["--mode", "writeback"]),
        ("cache device alone", "flash", []),
    ]

    def run(label, kind, extra, qd):
        src, src_sock = slow_source(procs, d)
        server, target = None, uri(src_sock)
        if kind == "sce":
            server, sock, _ = sce_serve(procs, sce, d, "wb", [
                "--source", uri(src_sock), "--cache", os.path.join(d, "wb.cache"),
                "--cache-size", "1GiB", "--state-dir", os.path.join(d, "wb.state")] + extra)
            target = uri(sock)
        elif kind == "flash":
            server, sock, _ = sce_serve(procs, sce, d, "flash", ["--source", flash])
            target = uri(sock)
        job = ["--name=w", "--ioengine=nbd", "--rw=randwrite", "--bs=4k", "--size=256m",
               f"--iodepth={qd}", "--time_based", f"--runtime={a.seconds}", "--randseed=7",
               "--percentile_list=99", f"--uri={target}"]
        j, _ = fio(job)
        mean, p99 = mean_ms(j, "write"), p99_ms(j, "write")
        for p in (server, src):
            if p:
                procs.stop(p)
        for f in ("wb.cache",):
            if os.path.exists(os.path.join(d, f)):
                os.unlink(os.path.join(d, f))
        subprocess.run(["rm", "-rf", os.path.join(d, "wb.state")])
        return dict(mean=mean, p99=p99, iops=j["write"]["iops"])

    out = []
    for qd in (1, 16):
        runs = {c[0]: [] for c in configs}
        for r in range(a.rounds):
            for label, kind, extra in configs:
                log(f"== writes QD{qd}: {label}, round {r + 1}")
                runs[label].append(run(label, kind, extra, qd))
        rows = {}
        for label, _, _ in configs:
            rs = sorted(runs[label], key=lambda x: x["mean"])
            rows[label] = rs[len(rs) // 2]
        dev = rows["cache device alone"]
        awt = rows["sce writethrough (AWT)"]
        out += [f"### 4 KiB random writes, QD{qd}", "",
                "| configuration | write mean (ms) | write p99 (ms) | IOPS | mean × device alone | "
                "mean × AWT writethrough |", "|---|---|---|---|---|---|"]
        for label, _, _ in configs:
            x = rows[label]
            out.append(f"| {label} | {x['mean']:.3f} | {x['p99']:.3f} | {x['iops']:,.0f} | "
                       f"{x['mean'] / dev['mean']:.2f}x | {x['mean'] / awt['mean']:.2f}x |")
        wb = rows["sce writeback"]
        ratio = wb["mean"] / dev["mean"]
        out += ["", f"Goal: write-back within 1.2x of the cache device alone: "
                f"{ratio:.2f}x, {'met' if ratio <= 1.2 else 'missed'}.", ""]
    return out


def part_demo(a, sce):
    modes = [("writeback", ["--mode", "writeback"]),
             ("writethrough (AWT)", ["--mode", "writethrough"]),
             ("writethrough, synchronous", ["--mode", "writethrough", "--awt", "off"])]
    out = ["### The load of `sce demo`", "",
           f"`sce demo --json --seconds {a.demo_seconds}` (OLTP-like: 87% reads of 8 KiB, "
           "Zipf 1.0, 16 in flight, 2 ms source, in-process; each mode once).", "",
           "| mode | write mean (ms) | write p99 (ms) | all requests mean (ms) | IOPS | "
           "write mean × source alone |", "|---|---|---|---|---|---|"]
    src = None
    for label, extra in modes:
        log(f"== sce demo: {label}")
        r = subprocess.run([sce, "demo", "--json", "--seconds", str(a.demo_seconds)] + extra,
                           check=True, capture_output=True, text=True).stdout
        doc = json.loads(r[r.index("{"):])
        c, n = doc["cache"], doc["no_cache"]
        src = src or n
        out.append(f"| {label} | {c['write_mean_ms']:.3f} | {c['write_p99_ms']:.3f} | "
                   f"{c['mean_ms']:.3f} | {c['iops']:,.0f} | "
                   f"{c['write_mean_ms'] / max(n['write_mean_ms'], 1e-9):.2f}x |")
    out.append(f"| source alone (the first run's no-cache half) | {src['write_mean_ms']:.3f} | "
               f"{src['write_p99_ms']:.3f} | {src['mean_ms']:.3f} | {src['iops']:,.0f} | 1.00x |")
    return out + [""]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sce", default=os.path.join(ROOT, "target/release/sce"))
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--demo-seconds", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.sce == os.path.join(ROOT, "target/release/sce"):
        subprocess.run(["cargo", "build", "--release", "-p", "sce"], cwd=ROOT, check=True)
    procs = Procs()
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as d:
            flash = os.path.join(d, "flash.img")
            subprocess.run(["dd", "if=/dev/urandom", f"of={flash}", "bs=1M", "count=512",
                            "status=none"], check=True)
            out = ["## Write latency: write-back against write-through and the device alone",
                   "", "`scripts/bench-writeback.py " + " ".join(sys.argv[1:]) + "`", ""]
            out += part_fio(a, procs, a.sce, d, flash)
            out += part_demo(a, a.sce)
    finally:
        procs.stop_all()
    report("\n".join(out), a.out)


if __name__ == "__main__":
    main()
