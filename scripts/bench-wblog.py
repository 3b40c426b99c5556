#!/usr/bin/env python3
"""Issue 29: write-back at the speed of the cache device, side by side in one run. Prints
three tables with ratios and each goal met or missed, and writes them as Markdown (--out).

Every sce runs over a fresh slow source (`nbdkit --filter=delay memory 2G rdelay=2ms
wdelay=2ms -t 64`) with a 1 GiB cache file on this filesystem (written through with zeroes
first, as the device direct's file is), served over a Unix socket;
"device direct" is fio writing a fully written file on the same filesystem itself, O_DIRECT
(psync at QD1, libaio at QD16), the same job: the cache device alone, with no NBD path.
The NBD floor, what serving the device over NBD costs before any cache: `sce serve` of the
same file with no cache (io_uring, O_DIRECT), and nbdkit's file plugin (`nbdkit -U SOCK file
FILE`, its default threads), which writes through the page cache (nbdkit 1.32 has no
O_DIRECT), so its row is set beside "device buffered": fio writing the file without O_DIRECT
(fdatasync is still a device flush).

1. 4 KiB random writes over 256 MiB at QD1 and QD16: mean and p99 write latency of sce
   write-back through the log (`--writeback-log 768MiB`), `--mode writeback` as it comes (a
   64 MiB log), write-back in the slots (`--writeback-log 0`: a device
   without a log), AWT write-through, the source alone, and device direct. Goal: write-back
   through the log within 1.2x of device direct, mean and p99.
2. A 4 KiB write followed by a FLUSH, QD1 (fio --fsync=1, an NBD FLUSH after every write;
   device direct: --fdatasync=1). Goal: within 1.3x of device direct.
3. OLTP (8 KiB, 87% reads, zipf 1.1 over 2 GiB, QD16): write-back as it comes (`--mode
   writeback`) against AWT write-through and device direct (and a 768 MiB log). Goals: IOPS
   at least 1.5x write-through's; read hit ratio at least write-through's - 0.02; write
   mean within 1.2x of device direct's.
4. Write-back as a new user reaches it (issue 45): a 128 MiB burst of 4 KiB random writes
   over 2 GiB at QD16 on a 1 GiB cache served with the defaults and switched live (`sce
   ctl set "" mode writeback`), on one made by `sce format` with its defaults and served
   in `--mode writeback`, and on `--mode writeback` as it comes, against the source alone.
   Goal: at least 2x the source alone's IOPS.
5. Sustained (issue 45): `--sustain` seconds (120) of 4 KiB random writes at QD16 over
   512 MiB and over 2 GiB through `serve --mode writeback` on a new 1 GiB cache, IOPS per
   10 s window, against the source alone at QD16; and the cleaner's source writes per
   second while it cleans, at each depth it runs at (16 in the background, 64 while
   urgent: its own time-in-batch counters), against the source alone at that depth (QD16
   over the same region, QD64). Goals: no window below the source alone's rate; the
   cleaner at least 0.8x the source at its depth.
6. A burst of half the cache (issue 45, format 9): 512 MiB of 4 KiB random writes over
   2 GiB at QD16 through `serve --mode writeback` on a new 1 GiB cache (its log lends read
   slots as the burst grows), against `sce serve` of a 2 GiB file on the same disk with no
   cache (the serving floor) and fio on that file (device direct). Goals: mean latency
   within 1.25x of the floor's, p99 within 2x.

Usage: scripts/bench-wblog.py [--sce BIN] [--seconds S] [--parts 1,2,3,4,5,6] [--quick]
                              [--compare OTHER_BIN]... [--out FILE]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import urllib.request

from benchkit import (Procs, fio, http_json, log, mean_ms, p99_ms, report, sce_serve,
                      slow_source, uri, wait_sock)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOG = ["--mode", "writeback", "--writeback-log", "768MiB"]
# `--mode writeback` as it comes: a new 1 GiB cache gets a log of a sixteenth (64 MiB).
DEFAULT = ["--mode", "writeback"]
# Write-back in the slots: a device formatted without a log.
SLOTS = ["--mode", "writeback", "--writeback-log", "0"]


def run(a, procs, d, kind, extra, job, direct_file):
    """One fio `job` against configuration `kind` ("sce", "source" or "direct")."""
    src = server = None
    if kind in ("direct", "buffered"):
        engine = ["--ioengine=libaio"] if "--iodepth=16" in job else ["--ioengine=psync"]
        if kind == "buffered":
            # libaio is synchronous on buffered files: several jobs give QD16 instead.
            qd16 = "--iodepth=16" in job
            engine = ["--ioengine=psync", "--direct=0"] + (["--numjobs=16"] if qd16 else [])
            job = [x for x in job if not x.startswith("--iodepth")]
        else:
            engine.append("--direct=1")
        j, _ = fio(["--name=j", f"--filename={direct_file}"] + engine + job)
        return j
    if kind == "nbdkit":
        # nbdkit's file plugin serving the same file (its default threads).
        sock = os.path.join(d, "nbdkit.sock")
        if os.path.exists(sock):
            os.unlink(sock)
        server = procs.start(["nbdkit", "-f", "-U", sock, "file", direct_file])
        wait_sock(sock, server, "nbdkit (file)")
        try:
            j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={uri(sock)}"] + job)
        finally:
            procs.stop(server)
        return j
    if kind == "nbd":
        # The device through sce's NBD server alone: `sce serve` of the same file, no cache.
        server, sock, _ = sce_serve(procs, a.sce, d, "plain", ["--source", direct_file])
        try:
            j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={uri(sock)}"] + job)
        finally:
            procs.stop(server)
        return j
    src, src_sock = slow_source(procs, d)
    target = uri(src_sock)
    sce = a.sce
    if kind.startswith("sce@"):
        kind, sce = "sce", kind[4:]
    if kind == "sce":
        # A cache file written through first, like the device direct's file (and an SSD): a
        # sparse file would make every first write allocate blocks in the filesystem.
        cache = os.path.join(d, "wb.cache")
        subprocess.run(["dd", "if=/dev/zero", f"of={cache}", "bs=1M", "count=1024",
                        "status=none"], check=True)
        server, sock, addr = sce_serve(procs, sce, d, "wb", [
            "--source", target, "--cache", cache, "--force", "--state-dir",
            os.path.join(d, "wb.state")] + extra)
        target = uri(sock)
    try:
        j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={target}"] + job)
        if server and addr:
            # The read hit ratio over the whole run (the cache starts cold), in pages: the
            # write-back log's count as hits (since issue 45; before, /stats saw only the
            # reads that reached the read slots).
            e = http_json(addr)["exports"][""]
            h, m = e["read_pages_hit"], e["read_pages_missed"]
            j["sce_hit_ratio"] = h / (h + m) if h + m else None
    finally:
        for p in (server, src):
            if p:
                procs.stop(p)
        for f in ("wb.cache",):
            if os.path.exists(os.path.join(d, f)):
                os.unlink(os.path.join(d, f))
        subprocess.run(["rm", "-rf", os.path.join(d, "wb.state")])
    return j


def verdict(x, goal):
    return f"{x:.2f}x ({'met' if x <= goal else 'missed'}, goal ≤ {goal}x)"


def compared(a, label, extra, tail):
    """The rows of `--compare` binaries: `label` served by each (kind "sce@BIN")."""
    return [(f"{label} ({os.path.basename(b)})", f"sce@{b}", extra, *tail) for b in a.compare]


def part_writes(a, procs, d, direct):
    configs = [
        ("device direct (fio, O_DIRECT file)", "direct", []),
        ("the device through sce's NBD server (no cache)", "nbd", []),
        ("sce write-back through the log", "sce", LOG),
        ("device buffered (fio, page cache)", "buffered", []),
        ("the device through nbdkit's file plugin (page cache)", "nbdkit", []),
        ("sce --mode writeback as it comes (a 64 MiB log)", "sce", DEFAULT),
        ("sce write-back in the slots", "sce", SLOTS),
        ("sce write-through (AWT)", "sce", ["--mode", "writethrough"]),
        ("source alone (2 ms)", "source", []),
    ]
    if a.quick:
        configs = configs[:5]
    configs += compared(a, "sce write-back through the log", LOG, [])
    out = []
    for qd in (1, 16):
        job = ["--rw=randwrite", "--bs=4k", "--size=256m", f"--iodepth={qd}", "--time_based",
               f"--runtime={a.seconds}", "--randseed=7", "--percentile_list=99"]
        rows = {}
        for label, kind, extra in configs:
            log(f"== writes QD{qd}: {label}")
            j = run(a, procs, d, kind, extra, job, direct)
            rows[label] = (mean_ms(j, "write"), p99_ms(j, "write"), j["write"]["iops"])
        dev = rows[configs[0][0]]
        out += [f"### 4 KiB random writes, QD{qd}", "",
                "| configuration | write mean (ms) | write p99 (ms) | IOPS | mean × device | "
                "p99 × device | mean × NBD floor | p99 × NBD floor |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        floor = rows[configs[1][0]]
        for label, _, _ in configs:
            m, p, i = rows[label]
            out.append(f"| {label} | {m:.3f} | {p:.3f} | {i:,.0f} | {m / dev[0]:.2f}x | "
                       f"{p / dev[1]:.2f}x | {m / floor[0]:.2f}x | {p / floor[1]:.2f}x |")
        m, p, _ = rows[configs[2][0]]
        nm, np_, _ = rows[configs[1][0]]
        out += ["", f"Write-back through the log against the device: mean "
                f"{verdict(m / dev[0], 1.2)}, p99 {verdict(p / dev[1], 1.2)}; against the "
                f"device through the same NBD server: mean {m / nm:.2f}x, p99 {p / np_:.2f}x.",
                ""]
    return out


def part_flush(a, procs, d, direct):
    base = ["--rw=randwrite", "--bs=4k", "--size=256m", "--iodepth=1", "--time_based",
            f"--runtime={a.seconds}", "--randseed=9", "--percentile_list=99"]
    rows = []
    compare = compared(a, "sce write-back through the log, write + FLUSH", LOG, ["--fsync=1"])
    for label, kind, extra, sync in [
            ("device direct, write + fdatasync", "direct", [], "--fdatasync=1"),
            ("the device through sce's NBD server, write + FLUSH", "nbd", [], "--fsync=1"),
            ("sce write-back through the log, write + FLUSH", "sce", LOG, "--fsync=1"),
            ("device buffered, write + fdatasync", "buffered", [], "--fdatasync=1"),
            ("the device through nbdkit's file plugin, write + FLUSH", "nbdkit", [],
             "--fsync=1"),
            ("sce write-back in the slots, write + FLUSH", "sce", SLOTS, "--fsync=1")] + compare:
        log(f"== write + flush: {label}")
        j = run(a, procs, d, kind, extra, base + [sync], direct)
        # fio counts a write and its sync as one operation; the mean of the pair is the
        # write's completion latency plus the sync's.
        sync_mean = j["sync"]["lat_ns"]["mean"] / 1e6 if "sync" in j else 0.0
        rows.append((label, mean_ms(j, "write"), sync_mean, j["write"]["iops"]))
    dev = rows[0][1] + rows[0][2]
    floor = rows[1][1] + rows[1][2]
    out = ["### A 4 KiB write followed by a FLUSH, QD1", "",
           "| configuration | write mean (ms) | flush mean (ms) | write + flush (ms) | "
           "writes/s | × device | × NBD floor |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, w, s, i in rows:
        out.append(f"| {label} | {w:.3f} | {s:.3f} | {w + s:.3f} | {i:,.0f} | "
                   f"{(w + s) / dev:.2f}x | {(w + s) / floor:.2f}x |")
    x = (rows[2][1] + rows[2][2]) / dev
    nbd = (rows[2][1] + rows[2][2]) / (rows[1][1] + rows[1][2])
    return out + ["", f"Write-back through the log, write + FLUSH against the device's "
                  f"write + fdatasync: {verdict(x, 1.3)}; against the device through the same "
                  f"NBD server: {nbd:.2f}x.", ""]


def part_oltp(a, procs, d, big):
    job = ["--rw=randrw", "--rwmixread=87", "--bs=8k", "--size=2g", "--iodepth=16",
           "--random_distribution=zipf:1.1", "--time_based", f"--runtime={a.seconds}",
           "--randseed=11", "--percentile_list=99"]
    rows = {}
    # Write-back as it comes (its log lends read slots as dirty data grows: format 9); the
    # goals are its. The 768 MiB log of part 1 for reference (the read slots lose it whole).
    configs = [("device direct (fio, O_DIRECT file)", "direct", []),
               ("sce write-back (`--mode writeback`)", "sce", DEFAULT),
               ("sce write-through (AWT)", "sce", ["--mode", "writethrough"]),
               ("source alone (2 ms)", "source", []),
               ("sce write-back, a 768 MiB log", "sce", LOG)]
    for label, kind, extra in configs:
        log(f"== oltp: {label}")
        j = run(a, procs, d, kind, extra, job, big)
        rows[label] = (j["read"]["iops"] + j["write"]["iops"], mean_ms(j, "write"),
                       mean_ms(j, "read"), j.get("sce_hit_ratio"))
    dev, wb, wt = (rows[c[0]] for c in configs[:3])
    out = ["### OLTP: 8 KiB, 87% reads, zipf 1.1 over 2 GiB, QD16", "",
           "| configuration | IOPS | write mean (ms) | read mean (ms) | read hit ratio | "
           "IOPS × write-through |",
           "|---|---:|---:|---:|---:|---:|"]
    for label, _, _ in configs:
        i, w, r, h = rows[label]
        hit = "" if h is None else f"{h:.3f}"
        out.append(f"| {label} | {i:,.0f} | {w:.3f} | {r:.3f} | {hit} | {i / wt[0]:.2f}x |")
    ratio = wb[0] / wt[0]
    hit_gap = (wb[3] or 0) - (wt[3] or 0)
    return out + ["", f"Write-back as it comes: IOPS {ratio:.2f}x write-through's "
                  f"({'met' if ratio >= 1.5 else 'missed'}, goal ≥ 1.5x); read hit ratio "
                  f"{hit_gap:+.3f} against write-through's ({'met' if hit_gap >= -0.02 else 'missed'}, "
                  f"goal ≥ -0.02); write mean {verdict(wb[1] / dev[1], 1.2)} of the device's.", ""]


def burst(a, procs, d, how, sce):
    """A 128 MiB burst at QD16 (fio's IOPS) through a 1 GiB cache made and served `how`:
    "live" (served with the defaults, then `sce ctl set "" mode writeback`), "format" (`sce
    format` with its defaults, then `serve --mode writeback`), "serve" (`serve --mode
    writeback` on a new cache), or "source" (the source alone)."""
    job = ["--rw=randwrite", "--bs=4k", "--size=2g", "--io_size=128m", "--iodepth=16",
           "--randseed=13", "--percentile_list=99"]
    src, src_sock = slow_source(procs, d)
    server = None
    target = uri(src_sock)
    cache = os.path.join(d, "burst.cache")
    state = os.path.join(d, "burst.state")
    try:
        if how != "source":
            subprocess.run(["dd", "if=/dev/zero", f"of={cache}", "bs=1M", "count=1024",
                            "status=none"], check=True)
            args = ["--source", target, "--cache", cache, "--state-dir", state]
            if how == "format":
                subprocess.run([sce, "format", cache, "--source", target, "--force"],
                               check=True, stdout=subprocess.DEVNULL)
            else:
                args.append("--force")
            if how in ("format", "serve"):
                args += ["--mode", "writeback"]
            server, sock, _ = sce_serve(procs, sce, d, "burst", args)
            if how == "live":
                r = subprocess.run([sce, "ctl", "-s", sock, "set", "", "mode", "writeback"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    log(f"   refused: {r.stderr.strip()[:200]}")
                    return None
            target = uri(sock)
        j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={target}"] + job)
    finally:
        for p in (server, src):
            if p:
                procs.stop(p)
        subprocess.run(["rm", "-rf", cache, state])
    return j


def part_default(a, procs, d):
    configs = [("source alone (2 ms)", "source"),
               ("served with the defaults, then `ctl set \"\" mode writeback`", "live"),
               ("`sce format` with its defaults, then `serve --mode writeback`", "format"),
               ("`serve --mode writeback` on a new cache", "serve")]
    rows = {}
    for label, how in configs:
        for b in [a.sce] + a.compare:
            name = label if b == a.sce else f"{label} ({os.path.basename(b)})"
            if how == "source" and b != a.sce:
                continue
            log(f"== burst: {name}")
            j = burst(a, procs, d, how, b)
            rows[name] = (j["write"]["iops"], mean_ms(j, "write"), p99_ms(j, "write")) \
                if j else None
    src = rows[configs[0][0]][0]
    out = ["### A 128 MiB burst of 4 KiB random writes at QD16, write-back as users reach it",
           "", "| configuration | IOPS | write mean (ms) | write p99 (ms) | IOPS × source |",
           "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if r is None:
            out.append(f"| {name} | refused (no write-back log) | | | |")
            continue
        i, m, p = r
        out.append(f"| {name} | {i:,.0f} | {m:.3f} | {p:.3f} | {i / src:.2f}x |")
    worst = min((rows[c[0]] or (0,))[0] for c in configs[1:]) / src
    return out + ["", f"The slowest way in: {worst:.2f}x the source alone "
                  f"({'met' if worst >= 2 else 'missed'}, goal ≥ 2x).", ""]


def windows(series, width=10):
    """Per-second IOPS summed into `width`-second windows (the last partial one dropped)."""
    return [sum(series[k:k + width]) / width for k in range(0, len(series) - width + 1, width)]


def sustained(a, procs, d, size, sce):
    """`--sustain` s of 4 KiB random writes at QD16 over `size`: through `serve --mode
    writeback` on a new cache (`sce`), or the source alone (`sce` None). Returns the job, its
    per-10 s IOPS, and the cleaner's source writes per second (sce only)."""
    job = ["--rw=randwrite", "--bs=4k", f"--size={size}", "--iodepth=16", "--time_based",
           f"--runtime={a.sustain}", "--randseed=17"]
    src, src_sock = slow_source(procs, d)
    server, target = None, uri(src_sock)
    cache, state = os.path.join(d, "sus.cache"), os.path.join(d, "sus.state")
    try:
        if sce:
            subprocess.run(["dd", "if=/dev/zero", f"of={cache}", "bs=1M", "count=1024",
                            "status=none"], check=True)
            server, sock, addr = sce_serve(procs, sce, d, "sus", [
                "--source", target, "--cache", cache, "--force", "--state-dir", state,
                "--mode", "writeback"])
            target = uri(sock)
        j, series = fio(["--name=j", "--ioengine=nbd", f"--uri={target}"] + job,
                        iops_log=os.path.join(d, "sus"))
        cleaner = None
        if sce:
            m = urllib.request.urlopen(f"http://{addr}/metrics").read().decode()

            def metric(name):
                return sum(float(x.split()[-1]) for x in m.splitlines()
                           if x.startswith(name + " ") or x.startswith(name + "{"))
            pre = "sce_writeback_clean_"
            cleaner = {
                "run": metric("sce_writeback_log_source_writes_total") / a.sustain,
                "background": (metric(pre + "background_source_writes_total"),
                               metric(pre + "background_seconds_total")),
                "urgent": (metric(pre + "urgent_source_writes_total"),
                           metric(pre + "urgent_seconds_total")),
            }
    finally:
        for p in (server, src):
            if p:
                procs.stop(p)
        subprocess.run(["rm", "-rf", cache, state])
    return j, windows(series), cleaner


def part_sustained(a, procs, d):
    out = [f"### Sustained 4 KiB random writes at QD16, {a.sustain} s, IOPS per 10 s window",
           "", "| configuration | IOPS | windows (IOPS) | lowest window × source |",
           "|---|---:|---|---:|"]
    verdicts = []
    for size in ("512m", "2g"):
        log(f"== sustained over {size}: source alone")
        sj, sw, _ = sustained(a, procs, d, size, None)
        base = sj["write"]["iops"]
        out.append(f"| source alone, over {size} | {base:,.0f} | "
                   f"{', '.join(f'{x:,.0f}' for x in sw)} | |")
        for b in [a.sce] + a.compare:
            log(f"== sustained over {size}: {os.path.basename(b)}")
            j, w, cleaner = sustained(a, procs, d, size, b)
            low = min(w) / base if w else 0.0
            out.append(f"| write-back ({os.path.basename(b)}), over {size} | "
                       f"{j['write']['iops']:,.0f} | {', '.join(f'{x:,.0f}' for x in w)} | "
                       f"{low:.2f}x |")
            if b == a.sce:
                verdicts.append((size, low, cleaner, base))
    log("== the source alone at QD64 (the cleaner's urgent depth)")
    src, src_sock = slow_source(procs, d)
    try:
        j, _ = fio(["--name=j", "--ioengine=nbd", f"--uri={uri(src_sock)}", "--rw=randwrite",
                    "--bs=4k", "--size=2g", "--iodepth=64", "--time_based", "--runtime=10",
                    "--randseed=19"])
    finally:
        procs.stop(src)
    qd64 = j["write"]["iops"]
    out += ["", f"The source alone at QD64: {qd64:,.0f} writes/s.", ""]
    for size, low, cleaner, qd16 in verdicts:
        out.append(f"Over {size}: lowest window {low:.2f}x the source alone "
                   f"({'met' if low >= 1 else 'missed'}, goal ≥ 1x); the cleaner made "
                   f"{cleaner['run']:,.0f} source writes/s over the whole run "
                   f"({cleaner['run'] / qd64:.2f}x the source at QD64).")
        out += cleaner_rows(cleaner, {"background": (16, qd16), "urgent": (64, qd64)})
    return out + [""]


def cleaner_rows(cleaner, sources):
    """The cleaner's source writes per second while it cleaned, at each of its depths,
    against the source alone at that depth (goal ≥ 0.8x); a depth it spent under a second
    at is printed without a verdict."""
    out = []
    for kind, (depth, src) in sources.items():
        n, secs = cleaner[kind]
        if secs <= 0:
            out.append(f"- {kind} (QD{depth}): never ran.")
            continue
        r = n / secs
        verdict = ("under a second: no verdict" if secs < 1 else
                   f"{'met' if r / src >= 0.8 else 'missed'}, goal ≥ 0.8x")
        out.append(f"- {kind} (QD{depth}): {n:,.0f} source writes in {secs:.1f} s = "
                   f"{r:,.0f}/s, {r / src:.2f}x the source alone at QD{depth} "
                   f"({src:,.0f}/s; {verdict}).")
    return out


def part_half(a, procs, d, big):
    job = ["--rw=randwrite", "--bs=4k", "--size=2g", "--io_size=512m", "--iodepth=16",
           "--randseed=23"]
    rows = {}
    for label, kind, extra in [("device direct (fio on the file)", "direct", []),
                               ("serving floor (`sce serve` of the file, no cache)", "nbd", []),
                               ("write-back, `serve --mode writeback` on a new cache", "sce",
                                ["--mode", "writeback"])] + \
            compared(a, "write-back", ["--mode", "writeback"], ()):
        log(f"== half-cache burst: {label}")
        j = run(a, procs, d, kind, extra, job, big)
        rows[label] = (j["write"]["iops"], mean_ms(j, "write"), p99_ms(j, "write"))
    floor = rows["serving floor (`sce serve` of the file, no cache)"]
    direct = rows["device direct (fio on the file)"]
    out = ["### A burst of half the cache: 512 MiB of 4 KiB random writes over 2 GiB at QD16",
           "", "| configuration | IOPS | write mean (ms) | write p99 (ms) | mean × floor | "
           "p99 × floor | mean × device |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, (i, m, p) in rows.items():
        out.append(f"| {name} | {i:,.0f} | {m:.3f} | {p:.3f} | {m / floor[1]:.2f}x | "
                   f"{p / floor[2]:.2f}x | {m / direct[1]:.2f}x |")
    i, m, p = rows["write-back, `serve --mode writeback` on a new cache"]
    mr, pr = m / floor[1], p / floor[2]
    out += ["", f"Write-back: mean {mr:.2f}x the floor ({'met' if mr <= 1.25 else 'missed'}, "
            f"goal ≤ 1.25x), p99 {pr:.2f}x ({'met' if pr <= 2 else 'missed'}, goal ≤ 2x); "
            f"mean {m / direct[1]:.2f}x fio on the device.", ""]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sce", default=os.path.join(ROOT, "target/release/sce"))
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--parts", default="1,2,3,4,5,6", help="which tables to run (1: writes, "
                    "2: write + flush, 3: OLTP, 4: write-back as users reach it, 5: sustained, "
                    "6: a burst of half the cache), comma-separated")
    ap.add_argument("--sustain", type=int, default=120, help="seconds of each sustained run "
                    "(part 5)")
    ap.add_argument("--quick", action="store_true", help="part 1 without the slot, "
                    "write-through and source rows (while iterating)")
    ap.add_argument("--compare", action="append", default=[], metavar="BIN",
                    help="also run write-back through the log served by BIN (another sce "
                    "build), in parts 1, 2, 4 and 5")
    ap.add_argument("--out")
    a = ap.parse_args()
    parts = {int(x) for x in a.parts.split(",")}
    if a.sce == os.path.join(ROOT, "target/release/sce"):
        subprocess.run(["cargo", "build", "--release", "-p", "sce"], cwd=ROOT, check=True)
    procs = Procs()
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "/var/tmp")) as d:
            direct = os.path.join(d, "direct.img")
            big = os.path.join(d, "big.img")
            for path, mib in ((direct, 256), (big, 2048 if parts & {3, 6} else 0)):
                if not mib:
                    continue
                subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=1M",
                                f"count={mib}", "status=none"], check=True)
            out = ["## Issue 29: write-back at the speed of the cache device", "",
                   "`scripts/bench-wblog.py " + " ".join(sys.argv[1:]) + "`", ""]
            if 1 in parts:
                out += part_writes(a, procs, d, direct)
            if 2 in parts:
                out += part_flush(a, procs, d, direct)
            if 3 in parts:
                out += part_oltp(a, procs, d, big)
            if 4 in parts:
                out += part_default(a, procs, d)
            if 5 in parts:
                out += part_sustained(a, procs, d)
            if 6 in parts:
                out += part_half(a, procs, d, big)
    finally:
        procs.stop_all()
    report("\n".join(out), a.out)


if __name__ == "__main__":
    main()
