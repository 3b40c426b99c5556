#!/usr/bin/env python3
"""Shared mode's cost and warm migration, side by side in one run (issues 16 and 31).
Prints three tables with ratios and writes them as Markdown (--out).

0. The protocol's own latency: 4 KiB random writes at QD1 and at QD16 through one host,
   for one host without shared mode, one, two and three hosts in shared mode (the others
   idle but registered: the writing host owns its region, issue 31), three hosts with
   ownership off (`--region-size 0`: every write waits for the others' acknowledgements),
   and the source alone.
1. The cost of coherence. A 2 ms source (`nbdkit --filter=delay memory 4G rdelay=2ms
   wdelay=2ms -t 64`), a 3-member etcd cluster on loopback, and on each host `sce serve`
   over the source with its own 64 MiB cache. On every host at once, fio's nbd engine runs
   the same load (4 KiB, 80% reads, Zipf 1.1 over 256 MiB, 4 in flight, the same seed): a
   warm-up of --warm seconds, then --seconds measured. Configurations: one host without
   shared mode; one, two and three hosts in shared mode on the same blocks (two and three
   contend: they write one region at once); three hosts on the same blocks with ownership
   off; three hosts each on a volume of its own (1 GiB apart: a region each, as VMs on a
   shared LUN); and the source alone under one client's load. Shown: mean and p99 write
   latency, mean read latency, the read hit ratio of the measured part (from /stats), the
   etcd operations per write (publications, acquisitions, releases and acknowledgements of
   every host, over every host's writes), and ratios against one host alone.
2. Warm migration of a cache of more than 200,000 fragments (4 KiB fragments over a 1 GiB
   volume, 2 GiB caches). Host A reads the whole volume into its cache (parallel `ctl
   prefetch`), then runs a read-only Zipf 1.1 load for --warm seconds (its heat) and
   --seconds more (its steady hit ratio). `sce ctl handoff --to B` then hands A's list,
   hottest first, in chunks, to host B, which starts the same load at once while it
   prefetches; a cold host C runs it with nothing. Each is sampled every half second.
   Shown: the time until a half second's hit ratio first reaches 90% of A's steady ratio.

Usage: scripts/bench-shared.py [--sce BIN] [--seconds S] [--warm S] [--out FILE]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from benchkit import (Procs, fio, http_json, log, mean_ms, p99_ms, report, sce_serve,
                      slow_source, uri)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_ports(n):
    """`n` distinct free ports (every socket stays bound until all are chosen)."""
    import socket
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def etcd_cluster(procs, d):
    """Three etcd members on loopback; their client endpoints."""
    p = free_ports(6)
    ports = [(p[2 * i], p[2 * i + 1]) for i in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{p[1]}" for i, p in enumerate(ports))
    for i, (c, p) in enumerate(ports):
        procs.start(["etcd", "--name", f"m{i}", "--data-dir", os.path.join(d, f"etcd{i}"),
                     "--listen-client-urls", f"http://127.0.0.1:{c}",
                     "--advertise-client-urls", f"http://127.0.0.1:{c}",
                     "--listen-peer-urls", f"http://127.0.0.1:{p}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{p}",
                     "--initial-cluster", initial, "--initial-cluster-state", "new"])
    eps = [f"127.0.0.1:{c}" for c, _ in ports]
    import urllib.request

    def healthy(ep):
        try:
            with urllib.request.urlopen(f"http://{ep}/health", timeout=2) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError):
            return False
    for _ in range(300):
        if all(healthy(ep) for ep in eps):
            return eps
        time.sleep(0.2)
    sys.exit("etcd never became healthy")


def host(procs, sce, d, name, src_sock, shared, cache="64MiB", more=()):
    args = ["--source", uri(src_sock), "--cache", os.path.join(d, f"{name}.cache"),
            "--cache-size", cache, "--state-dir", os.path.join(d, f"{name}.state")] + list(more)
    if shared:
        args += ["--shared", shared, "--host-name", name]
    return sce_serve(procs, sce, d, name, args)


def ratio(stats):
    e = stats["exports"][""]
    return e["read_pages_hit"], e["read_pages_hit"] + e["read_pages_missed"]


def job(sock, secs, rw="randrw", size="256m", offset=0):
    return ["--name=load", "--ioengine=nbd", f"--uri={uri(sock)}", f"--rw={rw}",
            "--rwmixread=80", "--bs=4k", f"--size={size}", f"--offset={offset}",
            "--random_distribution=zipf:1.1",
            "--iodepth=4", "--time_based", f"--runtime={secs}", "--randseed=7"]


def on_all(socks, secs, rw="randrw", disjoint=False):
    """fio on every host at once (each on its own volume, 1 GiB apart, if `disjoint`); the
    job results."""
    out = [None] * len(socks)

    def one(i):
        out[i], _ = fio(job(socks[i], secs, rw, offset=(i << 30) if disjoint else 0))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(len(socks))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def etcd_ops(st):
    """etcd operations per write over the hosts' shared-mode stats."""
    ops = sum(x["publications"] + x["region_acquisitions"] + x["region_acquisitions_refused"]
              + x["region_releases"] + x["acknowledgements"] for x in st)
    writes = sum(x["writes_published"] + x["owned_writes"] for x in st)
    return ops / max(1, writes)


def part_cost(a, procs, sce, d, url):
    rows = []
    for label, n, shared, disjoint, more in [
            ("1 host, no shared mode", 1, False, False, []),
            ("1 host, shared mode", 1, True, False, []),
            ("2 hosts, shared mode, same blocks", 2, True, False, []),
            ("3 hosts, shared mode, same blocks", 3, True, False, []),
            ("3 hosts, shared mode, same blocks, ownership off", 3, True, False,
             ["--region-size", "0"]),
            ("3 hosts, shared mode, each on a volume of its own", 3, True, True, []),
            ("the source alone (no sce), one client", 0, False, False, [])]:
        src, src_sock = slow_source(procs, d, "4G")
        prefix = f"{url}cost{len(rows)}"
        hs = [host(procs, sce, d, f"c{len(rows)}h{i}", src_sock, prefix if shared else None,
                   more=more) for i in range(n)]
        socks = [h[1] for h in hs] or [src_sock]
        log(f"{label}: warm-up {a.warm} s")
        on_all(socks, a.warm, disjoint=disjoint)
        before = [ratio(http_json(h[2])) for h in hs]
        sh = lambda: [http_json(h[2])["exports"][""]["shared"] for h in hs]
        st0 = sh() if shared else None
        log(f"{label}: measured {a.seconds} s")
        jobs = on_all(socks, a.seconds, disjoint=disjoint)
        after = [ratio(http_json(h[2])) for h in hs]
        hit = sum(x[0] - y[0] for x, y in zip(after, before))
        tot = sum(x[1] - y[1] for x, y in zip(after, before))
        w = sum(mean_ms(j, "write") for j in jobs) / len(jobs)
        wp = max(p99_ms(j, "write") for j in jobs)
        r = sum(mean_ms(j) for j in jobs) / len(jobs)
        ops = None
        if shared:
            delta = [{k: x[k] - y[k] for k in x if isinstance(x[k], int) and not isinstance(x[k], bool)}
                     for x, y in zip(sh(), st0)]
            ops = etcd_ops(delta)
        rows.append((label, w, wp, r, hit / max(1, tot) if hs else None, ops))
        for h in hs:
            procs.stop(h[0])
        procs.stop(src)
    base, alone = rows[0], rows[-1]
    out = ["| configuration | write mean (ms) | write p99 (ms) | read mean (ms) | read hit ratio "
           "| write × 1 host | write × source alone | read × source alone | hit ratio × 1 host "
           "| etcd ops per write |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for label, w, wp, r, h, ops in rows:
        hit = "-" if h is None else f"{h:.3f}"
        hit_x = "-" if h is None else f"{h / max(base[4], 1e-9):.2f}x"
        out.append(f"| {label} | {w:.3f} | {wp:.3f} | {r:.3f} | {hit} | {w / base[1]:.2f}x | "
                   f"{w / alone[1]:.2f}x | {r / alone[3]:.2f}x | {hit_x} | "
                   f"{'' if ops is None else f'{ops:.3f}'} |")
    return out


def part_qd(a, procs, sce, d, url, qd):
    """The protocol's own latency: 4 KiB random writes at depth `qd` on one host, the
    others idle."""
    rows = []
    for label, n, shared, more in [
            ("1 host, no shared mode", 1, False, []),
            ("1 host, shared mode (owner)", 1, True, []),
            ("2 hosts, shared mode (owner)", 2, True, []),
            ("3 hosts, shared mode (owner)", 3, True, []),
            ("3 hosts, shared mode, ownership off", 3, True, ["--region-size", "0"]),
            ("the source alone (no sce)", 0, False, [])]:
        src, src_sock = slow_source(procs, d)
        prefix = f"{url}qd{qd}-{len(rows)}"
        hs = [host(procs, sce, d, f"q{qd}-{len(rows)}h{i}", src_sock,
                   prefix if shared else None, more=more) for i in range(n)]
        target = hs[0][1] if hs else src_sock
        log(f"QD{qd} writes, {label}: {a.seconds} s")
        j, _ = fio(["--name=w", "--ioengine=nbd", f"--uri={uri(target)}", "--rw=randwrite",
                    "--bs=4k", "--size=256m", f"--iodepth={qd}", "--time_based",
                    f"--runtime={a.seconds}"])
        rows.append((label, mean_ms(j, "write"), p99_ms(j, "write")))
        for h in hs:
            procs.stop(h[0])
        procs.stop(src)
    alone, base = rows[-1], rows[0]
    out = ["| configuration | write mean (ms) | write p99 (ms) | mean × no shared mode "
           "| p99 × no shared mode | mean × source alone |", "|---|---|---|---|---|---|"]
    for label, m, p99 in rows:
        out.append(f"| {label} | {m:.3f} | {p99:.3f} | {m / base[1]:.2f}x | "
                   f"{p99 / base[2]:.2f}x | {m / alone[1]:.2f}x |")
    return out


def warm_up_time(addr, target, secs, sock):
    """Runs the read load on one host while sampling its /stats: seconds until an interval
    reaches `target`, and the series."""
    series = []
    t = threading.Thread(target=lambda: fio(job(sock, secs, "randread", MIG_SIZE)))
    prev = ratio(http_json(addr))
    t0 = time.time()
    t.start()
    reached = None
    while t.is_alive():
        time.sleep(0.5)
        cur = ratio(http_json(addr))
        dh, dt = cur[0] - prev[0], cur[1] - prev[1]
        prev = cur
        if dt > 0:
            series.append((time.time() - t0, dh / dt))
            if reached is None and dh / dt >= target:
                reached = time.time() - t0
    t.join()
    return reached, series


MIG_SIZE, MIG_CACHE, MIG_FRAG = "1g", "2GiB", "4KiB"


def fill(sce, sock, size, parts=8):
    """Reads [0, size) into the cache of the host on `sock` with `parts` parallel `ctl
    prefetch` (each runs on the server's thread for its request; the admin socket takes a
    few clients at once)."""
    step = size // parts
    errors = []

    def one(i):
        r = subprocess.run([sce, "ctl", "-s", sock, "prefetch", str(i * step), str(step)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            errors.append(r.stderr)
    ts = [threading.Thread(target=one, args=(i,)) for i in range(parts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        sys.exit(f"prefetch failed: {errors[0]}")


def part_migration(a, procs, sce, d, url):
    src, src_sock = slow_source(procs, d)
    prefix = f"{url}migrate"
    frag = ["--fragment-size", MIG_FRAG]
    A = host(procs, sce, d, "mA", src_sock, prefix, MIG_CACHE, frag)
    t0 = time.time()
    fill(sce, A[1], 1 << 30)
    log(f"migration: host A read the volume into its cache in {time.time() - t0:.0f} s")
    log(f"migration: host A's heat, {a.warm} s")
    fio(job(A[1], a.warm, "randread", MIG_SIZE))
    b0 = ratio(http_json(A[2]))
    fio(job(A[1], a.seconds, "randread", MIG_SIZE))
    b1 = ratio(http_json(A[2]))
    steady = (b1[0] - b0[0]) / max(1, b1[1] - b0[1])
    target = 0.9 * steady
    # Host B gets the hand-off as the VM moves (Mercury) and runs the load at once, while
    # it prefetches the list, hottest first.
    B = host(procs, sce, d, "mB", src_sock, prefix, MIG_CACHE, frag)
    t0 = time.time()
    r = subprocess.run([sce, "ctl", "--json", "-s", A[1], "handoff", "", "--to", "mB"],
                       capture_output=True, text=True, check=True)
    listed = json.loads(r.stdout)
    log(f"handoff: {listed} in {time.time() - t0:.1f} s")
    with_h, s_with = warm_up_time(B[2], target, a.seconds * 2, B[1])
    C = host(procs, sce, d, "mC", src_sock, prefix, MIG_CACHE, frag)
    without, s_without = warm_up_time(C[2], target, a.seconds * 2, C[1])
    shared_b = http_json(B[2])["exports"][""]["shared"]

    def fmt(x):
        return f"{x:.1f}" if x is not None else f"not within {a.seconds * 2} s"
    first = lambda s: f"{s[0][1]:.3f}" if s else "-"
    out = [f"Read-only Zipf 1.1 load over 1 GiB, {MIG_FRAG} fragments, {MIG_CACHE} caches. "
           f"Host A's hand-off listed "
           f"{listed['fragments']} fragments ({listed['bytes'] / 2**20:.0f} MiB). Host A's "
           f"steady read hit ratio: {steady:.3f}; the target (90%): {target:.3f}. Host B "
           f"prefetched {shared_b['handoff_prefetched_bytes'] / 2**20:.0f} MiB of it while "
           "its load ran.", "",
           "| receiving host | seconds to 90% of A's steady hit ratio | hit ratio of the first half second | final hit ratio |",
           "|---|---|---|---|",
           f"| with `sce ctl handoff` | {fmt(with_h)} | {first(s_with)} | {s_with[-1][1]:.3f} |",
           f"| cold, no handoff | {fmt(without)} | {first(s_without)} | {s_without[-1][1]:.3f} |"]
    if with_h is not None and without is not None:
        out.append("")
        out.append(f"Warm-up with handoff: {with_h / max(without, 1e-9):.2f}x the cold start's time.")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sce", default=os.path.join(ROOT, "target", "release", "sce"))
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--out")
    ap.add_argument("--parts", default="qd,cost,migration",
                    help="which tables: qd, cost, migration (comma-separated)")
    a = ap.parse_args()
    procs = Procs()
    d = tempfile.mkdtemp(prefix="sce-bench-shared-", dir=os.environ.get("BENCH_DIR"))
    try:
        eps = etcd_cluster(procs, d)
        url = f"etcd://{','.join(eps)}/"
        parts = a.parts.split(",")
        qd1 = part_qd(a, procs, sce=a.sce, d=d, url=url, qd=1) if "qd" in parts else []
        qd16 = part_qd(a, procs, sce=a.sce, d=d, url=url, qd=16) if "qd" in parts else []
        cost = part_cost(a, procs, sce=a.sce, d=d, url=url) if "cost" in parts else []
        mig = part_migration(a, procs, sce=a.sce, d=d, url=url) if "migration" in parts else []
    finally:
        procs.stop_all()
    text = "\n".join(["## The protocol's latency: QD1 writes on one host, the others idle", ""]
                     + qd1 + ["", "## The same at QD16", ""] + qd16
                     + ["", "## The cost of coherence under load on every host", ""] + cost
                     + ["", "## Warm migration", ""] + mig)
    report(text, a.out)


if __name__ == "__main__":
    main()
