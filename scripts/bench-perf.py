#!/usr/bin/env python3
"""The serving path, side by side in one run (issue 12). Prints three tables with ratios and
the goals met or missed, and writes them as Markdown (--out, default: stdout only).

1. OLTP over a slow source: fio's nbd engine, 8 KiB, 87% reads, Zipf 1.1 over 2 GiB, QD16,
   against `nbdkit --filter=delay memory 2G rdelay=2ms wdelay=2ms -t 64` (a fresh one per
   configuration). Configurations: the source alone; `sce serve` with its defaults; the
   flashcache-like configuration; nbdkit's cache filter; all-flash (`sce serve` of a fully
   written local file, no cache). IOPS per second are logged: the goal "never below the source
   alone from the first 10 s on" is checked on every 1 s interval from t = 10 s, "≥ 5x once
   warm" on the last 10 s.
2. Serving a fully written local file, no cache, 4 KiB random reads at QD1, QD32 and QD128
   with 1 and 4 connections (4 fio jobs, each at the queue depth): sce serve (O_DIRECT),
   nbdkit file cache=none, qemu-nbd --cache=none --aio=io_uring --persistent (threads if
   io_uring fails),
   and fio itself on the file (io_uring, O_DIRECT) as the physical limit. The servers serve
   the file read-only at the same time and the four runs of a cell follow each other, so
   drift of the machine hits them alike; --repeat N runs every cell N times (the order
   rotating) and reports the median.
3. A warm 100%-hit 4 KiB random-read load through the cache (QD32; the cache, 1200 MiB, holds
   the whole 1 GiB source) against the same server exporting a copy of its cache file
   plainly, alternated --hit-rounds times (8), medians.

Usage: scripts/bench-perf.py [--quick] [--sce BIN] [--parts oltp,local,hits] [--out FILE]
       [--repeat N] [--oltp-seconds S] [--local-seconds S]
The sce binary defaults to target/release/sce, built first (cargo build --release -p sce).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from benchkit import (Procs, fio, http_json, iops, log, p99_ms, read_pages, sce_serve, slow_source,
                      uri, wait_sock, warm_until_no_miss)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def fmt(x):
    return f"{x:,.0f}"


# ---------------------------------------------------------------------------------------------
# 1. OLTP over a 2 ms source


def oltp(a, procs, sce, d, flash):
    secs = a.oltp_seconds
    job = ["--name=oltp", "--ioengine=nbd", "--rw=randrw", "--rwmixread=87", "--bs=8k",
           "--random_distribution=zipf:1.1", "--size=2g", "--iodepth=16", "--time_based",
           f"--runtime={secs}", "--randseed=42", "--percentile_list=99"]
    cache_args = lambda name: ["--cache", os.path.join(d, f"{name}.cache"), "--cache-size", "1GiB",
                               "--state-dir", os.path.join(d, f"{name}.state")]
    configs = [
        ("source alone, no cache", "source", []),
        ("sce serve (defaults)", "sce", []),
        ("flashcache-like", "sce", ["--fragment-size", "4KiB", "--admission", "always",
                                    "--mode", "write-through", "--eviction", "lru"]),
        ("nbdkit cache filter", "kit", []),
        ("all-flash (sce serve of a local file)", "flash", []),
    ]
    def run_config(label, kind, extra):
        log(f"== OLTP: {label}, {secs} s")
        src, src_sock = slow_source(procs, d)
        server, target, addr = None, uri(src_sock), None
        name = label.split()[0].replace("(", "")
        if kind == "sce":
            server, sock, addr = sce_serve(procs, sce, d, name,
                                           ["--source", uri(src_sock)] + cache_args(name) + extra)
            target = uri(sock)
        elif kind == "kit":
            sock = os.path.join(d, "kit.sock")
            if os.path.exists(sock):
                os.unlink(sock)
            kd = os.path.join(d, "kit-tmp")
            os.makedirs(kd, exist_ok=True)
            server = procs.start(["nbdkit", "-f", "-U", sock, "--filter=cache", "nbd",
                                  f"socket={src_sock}", "cache=writethrough", "cache-on-read=true",
                                  "cache-max-size=1G"], env=dict(os.environ, TMPDIR=kd))
            wait_sock(sock, server, "nbdkit (cache filter)")
            target = uri(sock)
        elif kind == "flash":
            server, sock, addr = sce_serve(procs, sce, d, "flash", ["--source", flash])
            target = uri(sock)
        j, series = fio(job + [f"--uri={target}"], iops_log=os.path.join(d, "oltp"))
        hit = None
        if kind == "sce" and addr:
            e = http_json(addr)["exports"][""]
            h, m = e["read_pages_hit"], e["read_pages_missed"]
            hit = h / max(h + m, 1)
        row = dict(label=label, kind=kind, iops=iops(j), p99=p99_ms(j), series=series, hit=hit)
        if server:
            procs.stop(server)
        procs.stop(src)
        for f in os.listdir(d):
            if f.endswith(".cache"):
                os.unlink(os.path.join(d, f))
            elif f.endswith(".state"):
                shutil.rmtree(os.path.join(d, f), ignore_errors=True)
        return row

    # The machine's speed drifts by 2x within minutes: every configuration runs `rounds`
    # times, the configurations alternating, and each reports its median run by IOPS (of
    # two, the better).
    runs = {c[0]: [] for c in configs}
    for _ in range(a.oltp_rounds):
        for label, kind, extra in configs:
            runs[label].append(run_config(label, kind, extra))
    rows = []
    for label, _, _ in configs:
        rs = sorted(runs[label], key=lambda r: r["iops"])
        row = dict(rs[len(rs) // 2])
        row["runs"] = [r["iops"] for r in runs[label]]
        rows.append(row)
    src_iops = rows[0]["iops"]
    out = ["## 1. OLTP over a 2 ms NBD source", "",
           f"fio nbd, 8 KiB, 87% reads, Zipf 1.1 over 2 GiB, QD16, {secs} s per run, each "
           f"configuration {a.oltp_rounds} times in alternation from a fresh source and a cold "
           "cache, the median run shown (all runs' IOPS in the last column); cache 1 GiB; "
           "source `nbdkit --filter=delay memory 2G rdelay=2ms wdelay=2ms -t 64`.", "",
           "| configuration | IOPS | × source alone | read p99 (ms) | min 1 s IOPS from 10 s | "
           "last 10 s IOPS | read hit ratio | runs (IOPS) |",
           "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        s = r["series"] or [0]
        after10 = min(s[10:-1] or s)
        last10 = statistics.mean(s[-11:-1] or s)
        r["min_after10"], r["last10"] = after10, last10
        hit = f"{r['hit']:.3f}" if r["hit"] is not None else "—"
        out.append(f"| {r['label']} | {fmt(r['iops'])} | {r['iops'] / src_iops:.2f}x | "
                   f"{r['p99']:.1f} | {fmt(after10)} | {fmt(last10)} | {hit} | "
                   f"{', '.join(fmt(x) for x in r['runs'])} |")
    sce = rows[1]
    g1 = sce["min_after10"] >= src_iops
    g2 = sce["last10"] >= 5 * src_iops
    out += ["", f"- Goal: sce (defaults) never below the source alone from 10 s on: lowest 1 s "
            f"interval {fmt(sce['min_after10'])} IOPS against {fmt(src_iops)} "
            f"({sce['min_after10'] / src_iops:.2f}x): **{'met' if g1 else 'missed'}**.",
            f"- Goal: ≥ 5x the source alone once warm: last 10 s {fmt(sce['last10'])} IOPS, "
            f"{sce['last10'] / src_iops:.2f}x: **{'met' if g2 else 'missed'}**.",
            f"- sce / flashcache-like: {sce['iops'] / rows[2]['iops']:.2f}x; sce / nbdkit cache "
            f"filter: {sce['iops'] / rows[3]['iops']:.2f}x; sce / all-flash: "
            f"{sce['iops'] / rows[4]['iops']:.2f}x.",
            "", "IOPS per second, sce (defaults): " + " ".join(str(x) for x in sce["series"]), ""]
    return out


# ---------------------------------------------------------------------------------------------
# 2. Serving a local file


def local(a, procs, sce, d, flash):
    secs = a.local_seconds
    qemu_aio = "io_uring"
    cells = [(qd, n) for n in (1, 4) for qd in (1, 32, 128)]
    # sce-threads: the same server with its pool of blocking I/O threads instead of io_uring
    # (--io-backend threads), to show what the owned-buffer queue brings.
    servers = ["sce", "sce-threads", "nbdkit", "qemu-nbd", "fio-direct"]
    res = {c: {s: [] for s in servers} for c in cells}

    def start(s):
        nonlocal qemu_aio
        sock = os.path.join(d, f"{s}.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        # All three serve the file read-only at the same time (sce takes a shared lock, qemu
        # a shared one of its own), so that the runs of one cell follow each other closely.
        if s in ("sce", "sce-threads"):
            backend = "threads" if s == "sce-threads" else "auto"
            p, sock, _ = sce_serve(procs, sce, d, s, ["--source", flash, "--read-only",
                                                      "--io-backend", backend])
            return p, sock
        if s == "nbdkit":
            p = procs.start(["nbdkit", "-f", "-r", "-U", sock, "file", f"file={flash}",
                             "cache=none"])
        else:
            p = procs.start(["qemu-nbd", "-f", "raw", "--cache=none", f"--aio={qemu_aio}",
                             "--shared=8", "--persistent", "-r", "-k", sock, flash])
            time.sleep(0.5)
            if p.poll() is not None and qemu_aio == "io_uring":
                log("qemu-nbd refused --aio=io_uring; using --aio=threads")
                qemu_aio = "threads"
                return start(s)
        wait_sock(sock, p, s)
        return p, sock

    running = {s: start(s) for s in servers if s != "fio-direct"}
    # The machine's speed drifts by 2x within minutes: the four runs of a cell follow each
    # other, in an order that rotates from one repetition to the next.
    for rep in range(a.repeat):
        for qd, n in cells:
            k = rep % len(servers)
            order = servers[k:] + servers[:k]
            for s in order:
                log(f"== local file: {s}, QD{qd} x {n} connection(s), run {rep + 1}")
                base = ["--name=rr", "--rw=randread", "--bs=4k", f"--iodepth={qd}",
                        f"--numjobs={n}", "--size=2g", "--time_based", f"--runtime={secs}",
                        "--randseed=7"]
                if s == "fio-direct":
                    args = base + ["--ioengine=io_uring", "--direct=1", "--readonly",
                                   f"--filename={flash}"]
                else:
                    args = base + ["--ioengine=nbd", f"--uri={uri(running[s][1])}"]
                j, _ = fio(args)
                res[(qd, n)][s].append(iops(j))
    for p, _ in running.values():
        procs.stop(p)
    med = {c: {s: statistics.median(v) for s, v in res[c].items()} for c in cells}
    out = ["## 2. Serving a fully written local file, no cache", "",
           f"fio, 4 KiB random reads over 2 GiB, {secs} s per run, median of {a.repeat} run(s); "
           f"n connections = n fio jobs, each at the queue depth. The servers serve the "
           f"file read-only at once and the five runs of a cell follow each other (order "
           f"rotating per repetition). sce: io_uring (the default `--io-backend auto`); "
           f"sce threads: `--io-backend threads`. qemu-nbd --aio={qemu_aio}.", "",
           "| QD × connections | sce | sce threads | nbdkit | qemu-nbd | fio on the file | "
           "sce / faster of nbdkit, qemu-nbd | sce / fio | sce / sce threads |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    misses = []
    for c in cells:
        m = med[c]
        best = max(m["nbdkit"], m["qemu-nbd"])
        r1, r2 = m["sce"] / best, m["sce"] / m["fio-direct"]
        out.append(f"| QD{c[0]} × {c[1]} | {fmt(m['sce'])} | {fmt(m['sce-threads'])} | "
                   f"{fmt(m['nbdkit'])} | {fmt(m['qemu-nbd'])} | {fmt(m['fio-direct'])} | "
                   f"{r1:.2f}x | {r2:.2f}x | {m['sce'] / m['sce-threads']:.2f}x |")
        if r1 < 1.2:
            misses.append(f"QD{c[0]}×{c[1]}: {r1:.2f}x the faster server (goal 1.2x)")
        if c[0] >= 32 and r2 < 0.8:
            misses.append(f"QD{c[0]}×{c[1]}: {r2:.2f}x fio on the file (goal 0.8x)")
    out += ["", "- Goals (≥ 1.2x the faster of nbdkit and qemu-nbd everywhere; ≥ 0.8x fio at QD32 "
            "and QD128): " + ("**all met**." if not misses else "**missed**: " + "; ".join(misses)
                               + "."),
            "", "Every run (IOPS): " + "; ".join(
                f"QD{c[0]}×{c[1]} " + ", ".join(f"{s} {'/'.join(fmt(x) for x in res[c][s])}"
                                                 for s in servers) for c in cells), ""]
    return out


# ---------------------------------------------------------------------------------------------
# 3. Warm hits against the plain export of the cache file


def hits(a, procs, sce, d, flash):
    secs = a.local_seconds
    size = "1g"
    src = os.path.join(d, "hits-src")
    subprocess.run(["fio", "--name=fill", f"--filename={src}", f"--size={size}", "--rw=write",
                    "--bs=1M", "--direct=1", "--refill_buffers", "--output=/dev/null"], check=True)
    cache = os.path.join(d, "hits.cache")
    p, sock, addr = sce_serve(procs, sce, d, "hits",
                              # Larger than the source (its metadata takes room) and populating
                              # whatever the miss rate (Algorithm 1 stops at its target miss
                              # rate, 1% by default): every page must be cached for 100% hits.
                              ["--source", src, "--cache", cache, "--cache-size", "1200MiB",
                               "--target-missrate", "0",
                               "--state-dir", os.path.join(d, "hits.state")])
    rr = ["--name=rr", "--rw=randread", "--bs=4k", "--iodepth=32", f"--size={size}",
          "--time_based", "--randseed=9", "--ioengine=nbd"]
    warm_until_no_miss(addr, lambda: fio(rr + [f"--uri={uri(sock)}", "--runtime=3"]), 40)
    plain = os.path.join(d, "hits.plain")
    shutil.copyfile(cache, plain)
    q, psock, _ = sce_serve(procs, sce, d, "plain", ["--source", plain])
    runs = {"cached": [], "plain": []}
    h0, m0 = read_pages(addr)
    for _ in range(a.hit_rounds):
        for name, s in (("cached", sock), ("plain", psock)):
            j, _ = fio(rr + [f"--uri={uri(s)}", f"--runtime={secs}"])
            runs[name].append(iops(j))
    h1, m1 = read_pages(addr)
    h, m = h1 - h0, m1 - m0
    procs.stop(p)
    procs.stop(q)
    c, pl = statistics.median(runs["cached"]), statistics.median(runs["plain"])
    ok = c / pl >= 0.97
    return ["## 3. Warm 100% hits against the plain export of the cache file", "",
            f"fio nbd, 4 KiB random reads over 1 GiB, QD32, {secs} s per run, alternated "
            f"{a.hit_rounds} times, medians; "
            "the plain export serves a copy of the warm cache file with `sce serve --source`.", "",
            "| server | IOPS (runs) | median |", "|---|---|---:|",
            f"| sce serve, warm cache (read hit ratio {h / max(h + m, 1):.4f}) | "
            f"{', '.join(fmt(x) for x in runs['cached'])} | {fmt(c)} |",
            f"| sce serve of the cache file, no cache | {', '.join(fmt(x) for x in runs['plain'])} | "
            f"{fmt(pl)} |", "",
            f"- Goal ≥ 0.97x the plain export: {c / pl:.3f}x: **{'met' if ok else 'missed'}**.", ""]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short runs (OLTP 20 s, others 3 s)")
    ap.add_argument("--sce", help="a prebuilt sce binary (default: build target/release/sce)")
    ap.add_argument("--parts", default="oltp,local,hits")
    ap.add_argument("--out", help="also write the Markdown tables here")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--hit-rounds", type=int, default=8)
    ap.add_argument("--oltp-rounds", type=int, default=2)
    ap.add_argument("--oltp-seconds", type=int)
    ap.add_argument("--local-seconds", type=int)
    a = ap.parse_args()
    a.oltp_seconds = a.oltp_seconds or (20 if a.quick else 40)
    a.local_seconds = a.local_seconds or (3 if a.quick else 10)
    for tool in ("fio", "nbdkit", "qemu-nbd"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing (Debian packages: fio, nbdkit, qemu-utils)")
    sce = a.sce
    if not sce:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "sce"], cwd=ROOT, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        sce = os.path.join(target, "release", "sce")
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    procs = Procs()
    d = tempfile.mkdtemp(prefix="sce-perf.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    try:
        flash = os.path.join(d, "flash")
        log("writing the 2 GiB local file")
        subprocess.run(["fio", "--name=fill", f"--filename={flash}", "--size=2g", "--rw=write",
                        "--bs=1M", "--direct=1", "--refill_buffers", "--output=/dev/null"],
                       check=True)
        out = [f"# bench-perf: git {rev}, {time.strftime('%Y-%m-%d %H:%M')}, "
               f"{os.cpu_count()} CPUs", "",
               "`scripts/bench-perf.py " + " ".join(sys.argv[1:]) + "`", ""]
        parts = {"oltp": oltp, "local": local, "hits": hits}
        print("\n".join(out), flush=True)
        for part in a.parts.split(","):
            lines = parts[part](a, procs, sce, d, flash)
            print("\n".join(lines), flush=True)
            out += lines
        if a.out:
            with open(a.out, "w") as f:
                f.write("\n".join(out) + "\n")
    finally:
        procs.stop_all()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
