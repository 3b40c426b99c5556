#!/usr/bin/env python3
"""Issue 44: every operator verb ends. Leaving write-back (`sce ctl set "" mode
writethrough`) and `sce ctl detach ""` under a writer that never stops (fio's nbd engine,
4 KiB random writes over 512 MiB, time-based), at QD1 and QD16, over a source whose writes
take 5 ms (`nbdkit --filter=delay memory 1G wdelay=5ms rdelay=5ms -t 64`), with a 1 GiB
cache served `--mode writeback` as it comes.

Per verb: the dirty bytes just before the command, the time it took (the reply's
`drain_seconds` and the command's wall time), and the bound of issue 44: the dirty bytes
over the source's own 4 KiB random-write rate at the cleaner's depth (16, measured first
with fio on the same source), plus 10 s.

Usage: scripts/bench-drain.py [--sce BIN] [--settle S] [--out FILE]
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

from benchkit import Procs, fio, log, report, sce_serve, slow_source, uri

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ctl(sce, sock, *args):
    t0 = time.time()
    out = subprocess.run([sce, "ctl", "-s", sock + ".ctl", "--json", *args], capture_output=True,
                         text=True, timeout=900)
    took = time.time() - t0
    if out.returncode != 0:
        raise SystemExit(f"sce ctl {args}: {out.stderr}")
    return json.loads(out.stdout), took


def dirty(sce, sock):
    v, _ = ctl(sce, sock, "status")
    return v["exports"][0]["writeback"]["dirty_bytes"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sce", default=os.path.join(ROOT, "target/release/sce"))
    ap.add_argument("--settle", type=float, default=20.0,
                    help="seconds of writing before each verb")
    ap.add_argument("--out")
    a = ap.parse_args()
    procs = Procs()
    rows = []
    try:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/var/tmp")) as d:
            _, ssock = slow_source(procs, d, "1G", delay="5ms")
            log("measuring the source's random-write rate at QD16")
            j, _ = fio(["--name=s", "--ioengine=nbd", f"--uri={uri(ssock)}", "--rw=randwrite",
                        "--bs=4k", "--iodepth=16", "--size=256M", "--runtime=10",
                        "--time_based"])
            rate = j["write"]["iops"] * 4096
            log(f"source: {rate / 2**20:.2f} MiB/s")
            for qd in (1, 16):
                p, sock, _ = sce_serve(procs, a.sce, d, f"wb{qd}", [
                    "--source", uri(ssock), "--cache", os.path.join(d, f"cache{qd}"),
                    "--cache-size", "1GiB", "--mode", "writeback",
                    "--state-dir", os.path.join(d, "st")])
                writer = procs.start(["fio", "--name=w", "--ioengine=nbd", f"--uri={uri(sock)}",
                                      "--rw=randwrite", "--bs=4k", f"--iodepth={qd}",
                                      "--size=512M", "--runtime=900", "--time_based"])
                for verb in ("set-writethrough", "detach"):
                    time.sleep(a.settle)
                    before = dirty(a.sce, sock)
                    if verb == "detach":
                        v, took = ctl(a.sce, sock, "detach", "")
                        inner = v.get("seconds", took)
                    else:
                        v, took = ctl(a.sce, sock, "set", "", "mode", "writethrough")
                        inner = v["drain_seconds"]
                    bound = before / rate + 10
                    rows.append((qd, verb, before, inner, took, bound))
                    log(f"QD{qd} {verb}: {before} dirty, {took:.1f} s (bound {bound:.1f} s)")
                    if verb == "set-writethrough":
                        ctl(a.sce, sock, "set", "", "mode", "writeback")
                assert writer.poll() is None, "the writer stopped"
                procs.stop(writer)
                procs.stop(p)
    finally:
        procs.stop_all()
    lines = [
        f"Source: 5 ms writes, its own 4 KiB random writes at QD16: {rate / 2**20:.2f} MiB/s.",
        "",
        "| writer | verb | dirty at the command | took (reply) | took (wall) | bound: dirty / rate + 10 s | within |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for qd, verb, before, inner, took, bound in rows:
        name = 'set "" mode writethrough' if verb == "set-writethrough" else 'detach ""'
        lines.append(f"| QD{qd} | `{name}` | {before / 2**20:.1f} MiB | {inner:.1f} s | "
                     f"{took:.1f} s | {bound:.1f} s | {'yes' if took <= bound else 'NO'} |")
    report("\n".join(lines), a.out)


if __name__ == "__main__":
    main()
