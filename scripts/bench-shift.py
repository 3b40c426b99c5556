#!/usr/bin/env python3
"""A shift of the working set on the real server, side by side: sce (the default) and
flashcache-like (4 KiB lines, admission always, LRU, write-through), each in front of the
same kind of source, afresh.

Phase 1 fills the cache with one working set: 4 KiB random reads over the first PHASE1
bytes of the source for --fill seconds (QD32). Phase 2 shifts: 4 KiB random reads over a
new region of --region bytes after it, at QD32, in --windows windows of --window seconds
each (one fio run per window, a different seed each); the read hit ratio of each window
comes from the server's counters (pages hit and missed), the IOPS from fio. With --scan, a
sequential 1 MiB reader sweeps 4x the cache over a third region during phase 2 (fio job in
the same run): its pages, read once and so all misses, are taken out of the window's
hit ratio, which is then the shifted reads' alone.

Sources: `nbd` (nbdkit's file plugin behind its delay filter, --delay each way, on a Unix
socket: a busy 2 ms source) or `file` (the local file itself, no delay).

Usage: scripts/bench-shift.py --sce target/release/sce [--source nbd|file] [--cache 256MiB]
           [--phase1 1GiB] [--region 200MiB] [--fill 20] [--window 10] [--windows 3]
           [--scan] [--configs sce,flashcache-like]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "sce": [],
    "flashcache-like": ["--fragment-size", "4KiB", "--admission", "always",
                        "--mode", "write-through", "--eviction", "lru"],
}


def size(s):
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", s, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s}")
    return int(m[1]) << (10 * " KMGT".index((m[2] or " ").upper()))


def wait_for(pred, what, timeout=30):
    t = time.time() + timeout
    while time.time() < t:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    sys.exit(f"timed out waiting for {what}")


def stats(sce, metrics):
    out = subprocess.run([sce, "stats", "--metrics", metrics, "--json"], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)["exports"][""]


def fio(uri, jobs, seconds):
    """Runs fio's nbd engine with `jobs` (lists of options) for `seconds`; returns the read
    IOPS of the first job and the bytes the others read."""
    cmd = ["fio", "--ioengine=nbd", f"--uri={uri}", "--output-format=json", "--time_based",
           f"--runtime={seconds}", "--group_reporting=0"]
    for j in jobs:
        cmd += j
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"fio failed: {out.stderr[-2000:]}{out.stdout[:2000]}")
    d = json.loads(out.stdout[out.stdout.index("{"):])
    return d["jobs"][0]["read"]["iops"], sum(j["read"]["io_bytes"] for j in d["jobs"][1:])


def run_config(a, name, work):
    d = tempfile.mkdtemp(dir=work, prefix=name + ".")
    src_file = os.path.join(d, "source")
    with open(src_file, "wb") as f:
        f.truncate(a.phase1 + a.region + 4 * a.cache + (64 << 20))
    procs = []
    try:
        if a.source == "nbd":
            sock = os.path.join(d, "src.sock")
            procs.append(subprocess.Popen(
                ["nbdkit", "-f", "-U", sock, "--filter=delay", "file", f"file={src_file}",
                 f"rdelay={a.delay}", f"wdelay={a.delay}"], stderr=subprocess.DEVNULL))
            wait_for(lambda: os.path.exists(sock), "the source's socket")
            source = f"nbd+unix:///?socket={sock}"
        else:
            source = src_file
        log = open(os.path.join(d, "sce.log"), "w")
        csock = os.path.join(d, "cache.sock")
        procs.append(subprocess.Popen(
            [a.sce, "serve", "--source", source, "--cache", os.path.join(d, "cache"),
             "--cache-size", str(a.cache), "--listen", f"unix:{csock}",
             "--metrics", "127.0.0.1:0", "--state-dir", os.path.join(d, "state")]
            + CONFIGS[name], stdout=log, stderr=subprocess.STDOUT))

        def metrics_addr():
            m = re.search(r"metrics on http://([0-9.]+:[0-9]+)",
                          open(os.path.join(d, "sce.log")).read())
            return m and m.group(1)
        metrics = wait_for(metrics_addr, "sce's metrics address")
        wait_for(lambda: os.path.exists(csock), "sce's socket")
        uri = f"nbd+unix:///?socket={csock}"
        rand = ["--rw=randread", "--bs=4k", "--iodepth=32"]
        fio(uri, [["--name=fill"] + rand + ["--offset=0", f"--size={a.phase1}",
                                            "--randseed=1"]], a.fill)
        rows = []
        for i in range(a.windows):
            s0 = stats(a.sce, metrics)
            jobs = [["--name=shift"] + rand + [f"--offset={a.phase1}", f"--size={a.region}",
                                               f"--randseed={10 + i}"]]
            if a.scan:
                # Each window sweeps its share of 4x the cache, in whole MiB.
                part = (4 * a.cache // a.windows) >> 20 << 20
                jobs.append(["--name=scan", "--rw=read", "--bs=1m", "--iodepth=1",
                             f"--offset={a.phase1 + a.region + i * part}", f"--size={part}"])
            iops, scanned = fio(uri, jobs, a.window)
            s1 = stats(a.sce, metrics)
            hit = s1["read_pages_hit"] - s0["read_pages_hit"]
            # The scan's pages are read once, never before: all misses, not the shift's.
            miss = s1["read_pages_missed"] - s0["read_pages_missed"] - scanned // 4096
            rows.append((iops, hit / max(hit + miss, 1)))
        return rows
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sce", required=True, help="the sce binary")
    ap.add_argument("--source", choices=["nbd", "file"], default="nbd")
    ap.add_argument("--delay", default="2ms", help="nbd source delay each way [2ms]")
    ap.add_argument("--cache", type=size, default=size("256MiB"))
    ap.add_argument("--phase1", type=size, default=size("1GiB"))
    ap.add_argument("--region", type=size, default=size("200MiB"))
    ap.add_argument("--fill", type=int, default=20, help="seconds of phase 1 [20]")
    ap.add_argument("--window", type=int, default=10, help="seconds per window [10]")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--scan", action="store_true", help="a scan of 4x the cache in phase 2")
    ap.add_argument("--configs", default="sce,flashcache-like")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    for tool in ("fio", "nbdkit"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing (Debian: fio, nbdkit)")
    work = a.workdir or tempfile.mkdtemp(prefix="sce-shift.")
    names = a.configs.split(",")
    res = {n: run_config(a, n, work) for n in names}
    print(f"shift: {a.source} source{' (' + a.delay + ' each way)' if a.source == 'nbd' else ''},"
          f" cache {a.cache >> 20} MiB, phase 1 {a.phase1 >> 20} MiB for {a.fill} s, then 4 KiB"
          f" random reads over {a.region >> 20} MiB at QD32{', with a scan of 4x the cache' if a.scan else ''}")
    print("| window | " + " | ".join(f"{n} IOPS | {n} read hit" for n in names)
          + (" | IOPS sce / flashcache-like | hit sce - flashcache-like |"
             if len(names) == 2 else " |"))
    print("|---" * (1 + 2 * len(names) + (2 if len(names) == 2 else 0)) + "|")
    for i in range(a.windows):
        cells = [f"{res[n][i][0]:.0f} | {res[n][i][1]:.3f}" for n in names]
        extra = ""
        if len(names) == 2:
            (i0, h0), (i1, h1) = res[names[0]][i], res[names[1]][i]
            extra = f" | {i0 / max(i1, 1):.2f}x | {h0 - h1:+.3f}"
        print(f"| {i + 1} ({i * a.window}-{(i + 1) * a.window} s) | " + " | ".join(cells)
              + extra + " |")


if __name__ == "__main__":
    main()
