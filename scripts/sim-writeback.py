#!/usr/bin/env python3
"""Write-back in the simulator on the shared traces (issue 45): `sce sim --policy sce` in
write-through (AWT, the default) and in write-back through the log (`--mode writeback`,
as `sce serve` runs it), with the log `auto` gives the cache and with a larger one, side by
side. Prints one markdown table per trace: read hit ratio, modelled write and read
latency (mean, p99), bytes written to the source and to the cache device, and for
write-back the most the log may hold and the chunks of read slots it lent (format 9: the
log grows into the read slots as dirty data outgrows it), the cleaner's bytes and source
writes, the writes that waited for room and the dirty bytes left at the end.

Rows: write-through; write-back as it ships (`--writeback-log auto`, `--writeback-grow
auto`); and each log of --logs that lends nothing (`--writeback-grow 0`: a fixed log).

Usage: scripts/sim-writeback.py [--sce BIN] [--oltp FILE] [--logs auto,50%]
The oltp trace is generated (`sce gen oltp --size 4GiB --requests 1000000 --seed 1`) if
--oltp names no file that exists."""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACES = os.path.join(ROOT, "..", "shared", "traces")
MIB = 1 << 20


def size(b):
    for unit, n in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if b >= n:
            return f"{b / n:.2f} {unit}"
    return f"{b} B"


def sim(sce, trace, fmt, cache, mode, log=None, grow=None):
    cmd = [sce, "sim", "--trace", trace, "--format", fmt, "--cache-size", cache,
           "--policy", "sce", "--mode", mode, "--interval", "60", "--json"]
    if log:
        cmd += ["--writeback-log", log]
    if grow:
        cmd += ["--writeback-grow", grow]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {out.stderr}")
    return json.loads(out.stdout)["policies"][0], " ".join(cmd[1:])


def parse_mib(s):
    n = float(s[:-3])
    return int(n * (1024 if s.endswith("GiB") else 1) * MIB)


def row(name, p):
    ms = lambda k: f"{p[k] * 1e3:.2f}" if p.get(k) is not None else "-"
    wb = p.get("bytes_written_back")
    cells = [
        name,
        f"{p['read_hit_ratio']:.4f}",
        f"{ms('mean_write_latency_seconds')} / {ms('p99_write_latency_seconds')}",
        f"{ms('mean_read_latency_seconds')} / {ms('p99_read_latency_seconds')}",
        size(p["source_bytes_written"]),
        size(p["cache_bytes_written"]),
        size(p["writeback_log_max_bytes"]) if wb is not None else "-",
        f"{p['writeback_log_lends']:,}" if wb is not None else "-",
        size(wb) if wb is not None else "-",
        f"{p['writeback_source_writes']:,}" if wb is not None else "-",
        f"{p['writeback_waits']:,}" if wb is not None else "-",
        size(p["dirty_bytes_at_end"]) if wb is not None else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sce", default=os.path.join(ROOT, "target", "release", "sce"))
    ap.add_argument("--oltp", default=os.path.join(tempfile.gettempdir(), "sce-oltp-1.sce"))
    ap.add_argument("--logs", default="auto,50%",
                    help="log sizes of the write-back runs: auto, SIZE, or N%% of the cache")
    a = ap.parse_args()
    if not os.path.exists(a.oltp):
        subprocess.run([a.sce, "gen", "oltp", "--size", "4GiB", "--requests", "1000000",
                        "--seed", "1", "--out", a.oltp], check=True, capture_output=True)
    runs = [
        ("cloudPhysicsIO.vscsi", os.path.join(TRACES, "cloudPhysicsIO.vscsi"), "vscsi",
         ["216MiB", "1GiB"]),
        ("oltp (sce gen oltp, seed 1)", a.oltp, "sce", ["280MiB", "1GiB"]),
        ("tpcc-small.trace", os.path.join(TRACES, "tpcc-small.trace"), "disksim", ["64MiB"]),
        ("wsrch-small.trace", os.path.join(TRACES, "wsrch-small.trace"), "disksim", ["64MiB"]),
    ]
    head = ("| configuration | read hit | write ms mean / p99 | read ms mean / p99 | "
            "source written | cache written | log holds at most | chunks lent | cleaned | "
            "cleaner's source writes | waits for room | dirty at the end |")
    for name, trace, fmt, caches in runs:
        for cache in caches:
            print(f"\n**{name}, cache {cache}** (`--replay` as the trace's timestamps allow)\n")
            print(head)
            print("|" + "---|" * 12)
            p, cmd = sim(a.sce, trace, fmt, cache, "writethrough")
            print(row("write-through (AWT)", p))
            p, cmd = sim(a.sce, trace, fmt, cache, "writeback")
            print(row(f"write-back as it ships (log auto, {size(p['writeback_log_bytes'])}, "
                      "growing)", p))
            cmds = [cmd]
            for log in a.logs.split(","):
                if log.endswith("%"):
                    log = f"{parse_mib(cache) * float(log[:-1]) / 100 // MIB:.0f}MiB"
                p, cmd = sim(a.sce, trace, fmt, cache, "writeback", log, "0")
                shown = "auto" if log == "auto" else log
                print(row(f"write-back, fixed log {shown} "
                          f"({size(p['writeback_log_bytes'])})", p))
                cmds.append(cmd)
            print("\n" + "; ".join(f"`{c}`" for c in cmds))


if __name__ == "__main__":
    main()
