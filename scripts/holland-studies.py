#!/usr/bin/env python3
"""Holland et al.'s studies (../shared/papers/holland-flash-caching-on-the-storage-client.txt)
run with `sce sim`, as markdown for docs/SIM-REPORT.md:

1. the working-set sweep (their Figure 2): mean read latency against the volume a workload
   addresses, without flash and with three flash sizes, under a RAM cache;
2. the write-policy matrix: the RAM cache's write policy (sync, async, periodic, none)
   against the flash cache's mode (writethrough-sync, writethrough, writearound, writeback);
3. RAM shrunk towards zero (their Figures 5 and 6), with and without flash, for a workload
   larger than RAM and one that fits in it;
4. persistence (their Figure 3): the second half of each trace on a warm cache (warmed by the
   first half), a cold one (a restart without persistence) and no flash, and when the cold
   cache catches up.

Workloads are Holland's: `sce gen oltp --read-fraction 0.7` (30% writes), 8 KiB requests at
1,000 a second, each trace pushing twice the addressed volume through (their rule), sizes
scaled down from their 8 GB RAM and 64 GB flash to fit this machine (RAM 32 MiB, flash
256 MiB to 4 GiB). Every figure is modelled (virtual time), from `sce sim --json`; the
engine policy is `sce`'s default. Usage: scripts/holland-studies.py [--sce BIN] [--quick].
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

MIB = 1 << 20
KIB = 1 << 10
RAM = "32MiB"
# The issue-30 options that keep population off a busy source (not yet the default).
FED = ["--miss-fills", "on", "--line-size", "256KiB"]
FED_NAME = "miss fills, 256 KiB lines"


def sh(args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


class Studies:
    def __init__(self, sce, work, quick):
        self.sce, self.work, self.quick = sce, work, quick
        self.traces = {}

    def trace(self, size_mib, seed=1):
        """The workload addressing `size_mib` MiB: twice that volume in 8 KiB requests."""
        key = (size_mib, seed)
        if key not in self.traces:
            requests = 2 * size_mib * MIB // (8 * KIB)
            if self.quick:
                requests = min(requests, 100_000)
            out = os.path.join(self.work, f"oltp-{size_mib}-{seed}.sce")
            sh([self.sce, "gen", "oltp", "--read-fraction", "0.7", "--size",
                f"{size_mib}MiB", "--requests", str(requests), "--seed", str(seed),
                "--out", out])
            self.traces[key] = (out, requests)
        return self.traces[key]

    def sim(self, trace, cache, *more, policy="sce"):
        out = sh([self.sce, "sim", "--trace", trace, "--cache-size", cache, "--policy",
                  policy, "--json", *more])
        return json.loads(out)["policies"][0]

    def no_flash(self, trace, *more):
        # The engine in passthrough: the flash layer caches nothing, the RAM cache above works.
        return self.sim(trace, "16MiB", "--mode", "passthrough", *more)


def ms(x):
    return "-" if x is None else f"{x * 1e3:.2f}"


def lat(p, kind):
    """The mean `kind` (read or write) latency the application sees, in ms text: the RAM
    cache's view when there is one (a RAM hit costs nothing), else the flash layer's."""
    app = p.get(f"app_mean_{kind}_latency_seconds")
    return ms(app if app is not None else p[f"mean_{kind}_latency_seconds"])


def study_sweep(st, w):
    sizes = [128, 512, 2048, 8192]
    flashes = ["256MiB", "1GiB", "4GiB"]
    w("### 1. The working-set sweep (Figure 2)")
    w("")
    w(f"Mean read latency (ms), RAM {RAM} (async), by the volume the workload addresses; "
      "read hit ratio (RAM and flash together) in brackets.")
    w("")
    w("| volume | requests | no flash | " + " | ".join(f"flash {f}" for f in flashes)
      + f" | flash {flashes[-1]}, {FED_NAME} |")
    w("|---|---:|---:|" + "---:|" * (len(flashes) + 1))
    for s in sizes:
        t, n = st.trace(s)
        row = [st.no_flash(t, "--ram-size", RAM)]
        row += [st.sim(t, f, "--ram-size", RAM) for f in flashes]
        row.append(st.sim(t, flashes[-1], "--ram-size", RAM, *FED))
        cells = [f"{lat(p, 'read')} ({p['read_hit_ratio']:.2f})" for p in row]
        w(f"| {s} MiB | {n:,} | " + " | ".join(cells) + " |")
    w("")


def study_policies(st, w):
    t, _ = st.trace(1024)
    ram_policies = ["sync", "async", "periodic:5", "periodic:60", "none"]
    modes = ["writethrough-sync", "writethrough", "writearound", "writeback"]
    w("### 2. The write-policy matrix")
    w("")
    w(f"1 GiB volume, RAM {RAM}, flash 2 GiB (the volume fits). Mean read / write latency "
      "(ms) by the RAM cache's write policy (rows) and the flash cache's mode (columns).")
    w("")
    w("| RAM policy | " + " | ".join(modes) + " |")
    w("|---|" + "---|" * len(modes))
    for rp in ram_policies:
        cells = []
        for m in modes:
            p = st.sim(t, "2GiB", "--ram-size", RAM, "--ram-policy", rp, "--mode", m)
            cells.append(f"{lat(p, 'read')} / {lat(p, 'write')}")
        w(f"| {rp} | " + " | ".join(cells) + " |")
    w("")


def study_ram(st, w):
    rams = ["256MiB", "64MiB", "16MiB", "1MiB", "256KiB", None]
    w("### 3. RAM shrunk towards zero (Figures 5 and 6)")
    w("")
    w("Flash 2 GiB, RAM cache async. Mean read / write latency (ms) for a volume larger "
      "than every RAM size (4 GiB) and one that fits in the largest (128 MiB); without flash "
      "for comparison.")
    w("")
    w(f"| RAM | 4 GiB: flash | 4 GiB: flash, {FED_NAME} | 4 GiB: no flash | 128 MiB: flash "
      f"| 128 MiB: flash, {FED_NAME} | 128 MiB: no flash |")
    w("|---|---:|---:|---:|---:|---:|---:|")
    traces = [st.trace(4096)[0], st.trace(128)[0]]
    for r in rams:
        more = ["--ram-size", r] if r else []
        cells = []
        for t in traces:
            for p in (st.sim(t, "2GiB", *more), st.sim(t, "2GiB", *more, *FED),
                      st.no_flash(t, *more)):
                cells.append(f"{lat(p, 'read')} / {lat(p, 'write')}")
        w(f"| {r or 'none'} | " + " | ".join(cells) + " |")
    w("")


def second_half(st, trace, requests):
    """A trace of the second half of `trace`'s requests (a restart half-way through)."""
    csv = trace + ".csv"
    sh([st.sce, "trace", "convert", "--in", trace, "--out", csv, "--out-format", "csv"])
    half = trace + ".half.csv"
    with open(csv) as f, open(half, "w") as g:
        rows = [line for line in f if line[:1].isdigit()]
        g.writelines(rows[len(rows) // 2:])
    return half


def study_persistence(st, w):
    w("### 4. Persistence: warm, cold and no flash (Figure 3)")
    w("")
    w(f"Flash 1 GiB, RAM {RAM}. The second half of each trace: on a cache the first half "
      "warmed (a persistent cache after a restart), on a cold one (a restart without "
      "persistence), and without flash. Read hit ratio of the second half (warm: the mean "
      "of its intervals in the full run), the cold cache's mean read latency against no "
      "flash's, and when the cold cache's interval hit ratio first comes within 0.05 of the "
      "warm one's (trace seconds after the restart); the same for a cold flashcache-like "
      "(populate on every miss), against the warm sce.")
    w("")
    w("| volume | half (s) | warm hit | cold hit | no-flash hit | cold ms | no-flash ms | "
      "cold within 0.05 of warm after | flashcache-like cold: hit, ms, within 0.05 after |")
    w("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for s in [128, 512, 2048]:
        t, n = st.trace(s)
        half = second_half(st, t, n)
        span = n / 1000.0 / 2
        iv = ["--interval", f"{max(span / 20, 1):.3f}"]
        full = st.sim(t, "1GiB", "--ram-size", RAM, "--interval", f"{max(span / 20, 1):.3f}")
        cold = st.sim(half, "1GiB", "--ram-size", RAM, "--format", "csv", *iv)
        cold_fc = st.sim(half, "1GiB", "--ram-size", RAM, "--format", "csv", *iv,
                         policy="flashcache-like")
        none = st.no_flash(half, "--ram-size", RAM, "--format", "csv", *iv)
        # The full run's intervals after the restart point, and the cold run's, side by side
        # (both runs' intervals have the same length; the restart falls on a boundary, near
        # enough: the trace's halves are equal in requests, not exactly in time).
        warm_iv = [h for e, h in full["intervals"] if e > span + 1e-9]
        seen = [h for h in warm_iv if h is not None]
        warm = sum(seen) / len(seen) if seen else float("nan")

        def catch(run):
            for (e, h), wh in zip(run["intervals"], warm_iv):
                if h is not None and wh is not None and h >= wh - 0.05:
                    return f"{e:.0f} s"
            return "never"
        w(f"| {s} MiB | {span:,.0f} | {warm:.3f} | {cold['read_hit_ratio']:.3f} | "
          f"{none['read_hit_ratio']:.3f} | {lat(cold, 'read')} | {lat(none, 'read')} | "
          f"{catch(cold)} | {cold_fc['read_hit_ratio']:.3f}, {lat(cold_fc, 'read')}, "
          f"{catch(cold_fc)} |")
    w("")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    ap.add_argument("--sce", default=os.path.join(target, "release", "sce"))
    ap.add_argument("--quick", action="store_true", help="at most 100,000 requests a trace")
    a = ap.parse_args()
    out = []
    with tempfile.TemporaryDirectory() as work:
        st = Studies(a.sce, work, a.quick)
        for study in (study_sweep, study_policies, study_ram, study_persistence):
            study(st, out.append)
            print(f"{study.__name__} done", file=sys.stderr)
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
