#!/usr/bin/env python3
"""The policy matrix of docs/SIM-REPORT.md: every trace at several cache sizes, every policy.

For each trace (the real ones in --traces, and generated ones) the script computes the 4 KiB
working set (distinct 4 KiB blocks, per volume, that reads or writes touch: from
`sce trace convert --out-format csv`), the fragment footprint (distinct 1 MiB fragments
touched) and how many requests are not 4 KiB-aligned (offset or length), then runs, for
each cache size (a percentage of the working set, or a multiple of the fragment footprint
such as "2x"; rounded up to a multiple of 1 MiB and at least 2 MiB), one

    sce sim --json --core-shards 1 --policy <POLICIES> --cache-size <SIZE> --interval <I>

with I = the trace's duration / 40 (rounded up to whole ms and one more; at least 1 s).
Per policy it reports:

  read hit      read pages hit / read pages (4 KiB pages of reads), from `read_hit_ratio`
  wr/req        cache bytes written per trace request (`cache_bytes_written_per_request`)
  warm-up       seconds until the first interval whose read hit ratio reaches 90% of
                flashcache-like's *final* interval read hit ratio (from `intervals`: the
                last interval with a read, but not a last interval shorter than half the
                others), counted from the start of the first interval
                with a read (so a trace that begins with writes only is not charged for
                them); "never" if no interval reaches it
  mean, p99     modelled read latency (`mean_read_latency_seconds`, `p99_read_latency_seconds`), in ms
  hits/MiB      read pages hit per MiB written to the cache: read hit pages
                (`read_hits`, or read_hit_ratio x the read pages counted from the trace)
                / (cache_bytes_written / 2^20)

A value `sce sim` does not report for a policy is printed as "–". A policy whose open
replay found the modelled source or cache device over 100% busy (`overloaded`) is marked
with a dagger, and a trace with more than half its requests misaligned is marked.

Goals (issue 47: never dominated by a 4 KiB cache), checked per cell (trace x size) for
`sce` against `flashcache-like`:
  (a) wr/req of sce <= 1.0 x flashcache-like's, and <= 0.5 x in a trace with spatial
      locality: one whose *page density*, its 4 KiB working set over the pages of the 1 MiB
      fragments it touches (blocks / (fragments x 256)), is at least LOCALITY (0.25: a
      touched MiB has a quarter of its pages used, on average);
  (b) read hit of sce >= the better of flashcache-like's and lru's - 0.01;
  (c) modelled mean read latency of sce <= 1.1 x flashcache-like's (what a slow warm-up
      costs; the warm-up column is shown, not checked).
A cell is not checked at all when both policies hit under 1% of reads (nothing to compare).

Output: Markdown on stdout (a table per trace, a goal line per cell, a summary), progress
on stderr, --json OUT for machine use, and --check to exit 1 if any goal is missed (exit
2 if a run fails, or if nothing could be checked).

Generated traces (`sce gen`, seed 1, 1000 requests/s; the volume and count are
--gen-size, 4 GiB, and --gen-requests, 300,000 by default, about 300 s of trace time):
  oltp     the SCE paper's TPC-E-like mix
  zipf     reads only, 4 KiB, Zipf 1.0
  phase    the oltp mix whose working set moves once, in the middle
  hotscan  the oltp mix with a 512 MiB sequential read scan every 60 s, each read in 15 s

Standard library only. Run from anywhere; see --help.
"""

import argparse
import concurrent.futures
import json
import shlex
import math
import os
import subprocess
import sys
import tempfile
import threading
import time

# The policies every cell runs. `sce` is the default admission, `sce-paper` the SCE paper's
# Algorithm 1, `flashcache-like` the baseline of the goals, `flashcache-4k` the same with
# misaligned requests widened to whole pages (a 4 KiB cache that caches misaligned I/O, the
# second baseline of misaligned traces), `larc`, `s3fifo` and `lru` reference policies.
# Override with --policies (e.g. while some do not exist yet).
POLICIES = "sce,sce-paper,flashcache-like,flashcache-4k,larc,s3fifo,lru"

# The policy the goals are about, and the one they compare it with.
SUBJECT = "sce"
BASELINE = "flashcache-like"
# The aligned-capable baseline, and the reference policies whose better hit ratio the
# subject should come within REF_MARGIN of.
BASELINE_4K = "flashcache-4k"
REFERENCES = ("lru", "s3fifo")
REF_MARGIN = 0.02
# Page density from which a trace has spatial locality (goal (a) then asks for half the
# baseline's writes).
LOCALITY = 0.25

# Cache sizes: percentages of the 4 KiB working set, and ("2x", "4x") multiples of the
# fragment footprint (distinct 1 MiB fragments the trace touches, x 1 MiB): the cache that
# holds what 1 MiB fragments need, the SCE paper's "cache holds the data" case.
SIZES = ["10", "25", "50", "100", "150", "2x", "4x"]


def parse_size(tok):
    """A --sizes entry: "50" (percent of the working set) or "2x" (of the fragment
    footprint); returns ("pct", 50) or ("fp", 2.0), or None if it is neither."""
    tok = tok.strip()
    try:
        if tok.endswith("x"):
            v = float(tok[:-1])
            return ("fp", v) if v > 0 else None
        v = int(tok)
        return ("pct", v) if v > 0 else None
    except ValueError:
        return None


def spec_label(spec):
    kind, v = spec
    return f"{v}%" if kind == "pct" else f"{v:g}x footprint"

MIB = 1 << 20
PAGE = 4096

# Real traces: (name, file in --traces, format).
REAL = [
    ("cloudPhysicsIO.vscsi", "cloudPhysicsIO.vscsi", "vscsi"),
    ("msr-cambridge1-sample.csv", "msr-cambridge1-sample.csv", "msr"),
    ("systor17-traces-sample.csv.gz", "systor17-traces-sample.csv.gz", "systor"),
    ("tpcc-small.trace", "tpcc-small.trace", "disksim"),
    ("wsrch-small.trace", "wsrch-small.trace", "disksim"),
]

# Generated traces: name -> `sce gen` arguments (the volume size, count and seed are added).
GENERATED = {
    "oltp": ["oltp"],
    "zipf": ["zipf"],
    "phase": ["phase"],
    "hotscan": [
        "hotscan",
        "--scan-every",
        "60",
        "--scan-duration",
        "15",
        "--scan-size",
        "512MiB",
    ],
}

DASH = "\u2013"

_print_lock = threading.Lock()


def log(msg):
    with _print_lock:
        print(msg, file=sys.stderr, flush=True)


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_sce():
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(repo_root(), "target")
    return os.path.join(target, "release", "sce")


def run(cmd, what):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr.strip()}")
    return p.stdout


class Trace:
    """One trace of the matrix and what the script learns about it from its CSV form."""

    def __init__(self, name, path, fmt):
        self.name, self.path, self.fmt = name, path, fmt
        self.requests = 0
        self.blocks = 0
        self.fragments = 0
        self.misaligned = 0
        self.read_pages = 0
        self.duration = 0.0

    @property
    def density(self):
        """The 4 KiB working set over the pages of the 1 MiB fragments it touches."""
        return self.blocks / max(1, self.fragments * 256)

    @property
    def locality(self):
        return self.density >= LOCALITY

    @property
    def interval(self):
        # A little over a 40th, in whole ms: the 40th interval then ends after the last
        # request, instead of leaving it alone in a 41st interval of its own.
        return max(1.0, math.ceil(self.duration * 1000 / 40 + 1) / 1000)

    def survey(self, sce, workdir):
        csv = os.path.join(workdir, self.name + ".csv")
        run(
            [sce, "trace", "convert", "--in", self.path, "--format", self.fmt, "--out", csv,
             "--out-format", "csv"],
            f"converting {self.name}",
        )
        blocks = set()
        frags = set()
        t0 = t1 = None
        with open(csv) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                t, op, vol, off, ln = line.rstrip("\n").split(",")
                t, off, ln = int(t), int(off), int(ln)
                t0 = t if t0 is None else min(t0, t)
                t1 = t if t1 is None else max(t1, t)
                self.requests += 1
                if ln <= 0:
                    continue
                first, last = off // PAGE, (off + ln - 1) // PAGE
                vol = int(vol)
                blocks.update((vol, b) for b in range(first, last + 1))
                frags.update((vol, f) for f in range(off // MIB, (off + ln - 1) // MIB + 1))
                if off % PAGE or ln % PAGE:
                    self.misaligned += 1
                if op == "R":
                    self.read_pages += last - first + 1
        os.unlink(csv)
        self.blocks = len(blocks)
        self.fragments = len(frags)
        self.duration = (t1 - t0) / 1e9 if t0 is not None else 0.0

    def cache_size(self, spec):
        """The cache of size spec ("pct", P) or ("fp", X), in bytes (whole MiB, >= 2)."""
        kind, v = spec if isinstance(spec, tuple) else ("pct", spec)
        want = self.blocks * PAGE * v / 100.0 if kind == "pct" else self.fragments * MIB * v
        return max(2, math.ceil(want / MIB)) * MIB

    @property
    def misaligned_share(self):
        return self.misaligned / self.requests if self.requests else 0.0


def generate(sce, name, args, workdir):
    out = os.path.join(workdir, f"gen-{name}.sce")
    run(
        [sce, "gen", *GENERATED[name], "--size", args.gen_size, "--requests",
         str(args.gen_requests), "--seed", "1", "--out", out],
        f"sce gen {name}",
    )
    return out


def warmup(intervals, target, interval):
    """Seconds from the start of the first interval with a read to the end of the first
    interval whose read hit ratio reaches `target`; None if none does."""
    start = None
    for t, h in intervals:
        if h is None:
            continue
        if start is None:
            start = max(0.0, t - interval)
        if h >= target - 1e-12:
            return t - start
    return None


def final_ratio(intervals, interval):
    """The read hit ratio of the last interval with a read, passing over a last interval
    shorter than half the others (the end of the trace, a few requests)."""
    seen = [(t, h) for t, h in intervals if h is not None]
    if len(seen) >= 2 and intervals and seen[-1][0] == intervals[-1][0]:
        prev = intervals[-2][0] if len(intervals) >= 2 else 0.0
        if seen[-1][0] - prev < interval / 2:
            seen.pop()
    return seen[-1][1] if seen else None


def metrics(p, trace, target, interval):
    hit = p.get("read_hit_ratio")
    written = p.get("cache_bytes_written")
    if p.get("read_hits") is not None:
        hits = p["read_hits"]
    else:
        hits = round(hit * trace.read_pages) if hit is not None else None
    return {
        "read_hit_ratio": hit,
        "cache_bytes_written": written,
        "cache_bytes_written_per_request": p.get("cache_bytes_written_per_request"),
        "warmup_seconds": warmup(p.get("intervals", []), target, interval)
        if target is not None
        else None,
        "mean_read_latency": p.get("mean_read_latency_seconds"),
        "p99_read_latency": p.get("p99_read_latency_seconds"),
        "read_hits": hits,
        "overloaded": bool(p.get("overloaded")),
        "read_hits_per_mib_written": hits / (written / MIB)
        if hits is not None and written
        else None,
    }


def reference_check(cell):
    """Whether the subject's read hit ratio is within REF_MARGIN of the better of the
    reference policies in `cell`: None if the cell lacks them, else (ok, text)."""
    s = cell.get(SUBJECT)
    refs = [(n, cell[n]["read_hit_ratio"]) for n in REFERENCES if n in cell]
    if s is None or not refs:
        return None
    name, best = max(refs, key=lambda x: x[1])
    ok = s["read_hit_ratio"] >= best - REF_MARGIN - 1e-12
    rel = ">=" if ok else "<"
    return ok, f"read hit {s['read_hit_ratio']:.4f} {rel} {name} {best:.4f} - {REF_MARGIN}"


def goals(cell, interval, read_intervals=2, baseline=BASELINE, locality=False):
    """The goals of `cell` (a dict of policy -> metrics) against `baseline` (issue 47): a
    dict with `checked`, `missed` (a list of "(x) why") and `notes`. `locality`: the trace
    has spatial locality (LOCALITY), and writes must be half the baseline's. The warm-up
    column is shown, not checked: the modelled latency (c) is what a slow warm-up costs.
    `interval` and `read_intervals` are kept for the callers."""
    del interval, read_intervals
    s, b = cell.get(SUBJECT), cell.get(baseline)
    if s is None or b is None:
        return {"checked": False, "missed": [], "why": f"needs {SUBJECT} and {baseline}"}
    if b["read_hit_ratio"] < 0.01 and s["read_hit_ratio"] < 0.01:
        # Neither caches anything worth reading (tpcc-small): meeting a goal means nothing.
        return {"checked": False, "missed": [],
                "why": f"{baseline} and {SUBJECT} both hit under 1% of reads"}
    missed = []
    share = 0.5 if locality else 1.0
    sw, bw = s["cache_bytes_written_per_request"], b["cache_bytes_written_per_request"]
    if sw is None or bw is None:
        missed.append("(a) wr/req not reported")
    elif sw > share * bw:
        missed.append(f"(a) wr/req {sw / 1024:.1f} KiB > {share} x {bw / 1024:.1f} KiB")
    sh = s["read_hit_ratio"]
    name, bh = max(((n, cell[n]["read_hit_ratio"]) for n in (baseline, "lru") if n in cell),
                   key=lambda x: x[1])
    if sh < bh - 0.01:
        missed.append(f"(b) read hit {sh:.4f} < {name} {bh:.4f} - 0.01")
    sl, bl = s.get("mean_read_latency"), b.get("mean_read_latency")
    if sl is not None and bl is not None and sl > 1.1 * bl:
        missed.append(f"(c) mean read latency {sl * 1e3:.3f} ms > 1.1 x {bl * 1e3:.3f} ms")
    return {"checked": True, "missed": missed, "notes": []}


def secs(x):
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def fmt(x, spec, scale=1.0):
    return DASH if x is None else format(x * scale, spec)


def fmt_warm(m, has_target):
    if not has_target:
        return DASH
    w = m["warmup_seconds"]
    return "never" if w is None else secs(w)


def size_label(b):
    return f"{b / MIB:.0f} MiB" if b < 1 << 30 else f"{b / (1 << 30):.2f} GiB"


def goal_text(g):
    if not g["checked"]:
        return f"not checked ({g['why']})"
    text = "met" if not g["missed"] else "MISSED (" + "; ".join(g["missed"]) + ")"
    return text + "".join(f"; {n}" for n in g.get("notes", []))


def markdown(traces, cells, policies, args):
    out = []
    w = out.append
    w("# Policy matrix")
    w("")
    sizes = ", ".join(spec_label(x) for x in args.sizes)
    w(f"`sce sim --json --core-shards 1 --policy {','.join(policies)}`, cache sizes {sizes} "
      "(percentages of each trace's 4 KiB working set; \"footprint\": its distinct 1 MiB "
      "fragments x 1 MiB, what 1 MiB fragments need to hold it all; rounded up to whole MiB, "
      "at least 2 MiB); interval "
      "a little over duration / 40 (at least 1 s). Generated: `sce gen NAME --size "
      f"{args.gen_size} --requests {args.gen_requests} --seed 1` (hotscan: "
      f"`{' '.join(GENERATED['hotscan'][1:])}`). One core shard: the matrix compares "
      "policies, not the server's split budgets (`sce sim`'s default runs the server's "
      "automatic shard count). The reference policies (`larc`, `s3fifo`, `lru`) are charged "
      "4 KiB of cache writes per block inserted and per block a write hit rewrote.")
    w("")
    w("Columns: read hit ratio; cache bytes written per request (KiB); warm-up (s, to 90% of "
      f"{BASELINE}'s final interval read hit ratio, from the first interval with a read); "
      "modelled mean and p99 read latency (ms); read pages hit per MiB written to the cache. "
      f"Goals for {SUBJECT} against {BASELINE} (issue 47): (a) wr/req <= 1.0x, 0.5x in a "
      f"trace with spatial locality (page density, its 4 KiB working set over the pages of "
      f"the 1 MiB fragments it touches, >= {LOCALITY}), (b) read hit >= the better of its "
      "and lru's - 0.01, (c) modelled mean read latency <= 1.1x its. A policy marked "
      "\u2020 was replayed open into a modelled source or cache device more than 100% busy: "
      "its latencies, and the hits of a policy that fills by re-reading the source, measure "
      f"overload, not policy; such a cell is run again closed ({CLOSED} requests in flight) "
      "and shown both ways. A trace marked **misaligned** has most requests not on 4 KiB "
      "boundaries: flashcache-like caches only whole aligned pages there, so its hits are "
      "not a 4 KiB cache's: `flashcache-4k` (flashcache-like with requests widened to whole "
      "pages), `lru` and `s3fifo` cover every page a request touches, and the goals are "
      "checked against `flashcache-4k` too.")
    for t in traces:
        w("")
        w(f"## {t.name}")
        w("")
        mis = t.misaligned_share
        w(f"{t.requests:,} requests, {t.duration:,.0f} s, working set {t.blocks:,} blocks "
          f"({size_label(t.blocks * PAGE)}), fragment footprint {t.fragments:,} fragments "
          f"({size_label(t.fragments * MIB)}), {t.read_pages:,} read pages, interval "
          f"{t.interval:g} s; {t.misaligned:,} requests ({mis:.0%}) not 4 KiB-aligned"
          + (" (**misaligned**)" if mis > 0.5 else "")
          + f"; page density {t.density:.3f}"
          + (" (spatial locality)." if t.locality else "."))
        w("")
        w("| cache | policy | read hit | wr/req KiB | warm-up s | mean ms | p99 ms | hits/MiB |")
        w("|---|---|---|---|---|---|---|---|")
        lines = []
        for c in cells:
            if c["trace"] != t.name:
                continue
            label = f"{c['size']} {size_label(c['cache_size'])}"
            if c.get("error"):
                w(f"| {label} | (failed) | | | | | | |")
                lines.append(f"- {label}: FAILED ({c['error'].splitlines()[0]})")
                continue
            has_target = c["target"] is not None
            first = True
            for p in policies:
                m = c["policies"].get(p)
                if m is None:
                    continue
                mark = " \u2020" if m.get("overloaded") else ""
                w(f"| {label if first else ''} | {p}{mark} | {fmt(m['read_hit_ratio'], '.4f')} | "
                  f"{fmt(m['cache_bytes_written_per_request'], '.1f', 1 / 1024)} | "
                  f"{fmt_warm(m, has_target)} | {fmt(m['mean_read_latency'], '.3f', 1e3)} | "
                  f"{fmt(m['p99_read_latency'], '.3f', 1e3)} | "
                  f"{fmt(m['read_hits_per_mib_written'], '.1f')} |")
                first = False
            lines.append(f"- {label}: goals {goal_text(c['goals'])}")
            if t.misaligned_share > 0.5 and c.get("goals_4k", {}).get("checked") is not None:
                lines.append(f"  - against {BASELINE_4K}: {goal_text(c['goals_4k'])}")
            if c.get("reference"):
                ok, text = c["reference"]
                lines.append(f"  - against the better of {' and '.join(REFERENCES)}: "
                             + ("met" if ok else "MISSED") + f" ({text})")
            closed = c.get("closed_policies")
            if closed:
                for p in policies:
                    m = closed.get(p)
                    if m is None:
                        continue
                    w(f"| closed:{CLOSED} | {p} | {fmt(m['read_hit_ratio'], '.4f')} | "
                      f"{fmt(m['cache_bytes_written_per_request'], '.1f', 1 / 1024)} | "
                      f"{DASH} | {fmt(m['mean_read_latency'], '.3f', 1e3)} | "
                      f"{fmt(m['p99_read_latency'], '.3f', 1e3)} | "
                      f"{fmt(m['read_hits_per_mib_written'], '.1f')} |")
                hits = ", ".join(f"{p} {fmt(m['read_hit_ratio'], '.4f')}"
                                 for p, m in closed.items())
                lines.append(f"- {label}: overloaded open; closed ({CLOSED} in flight): {hits}")
        w("")
        out.extend(lines)
    ok = [c for c in cells if c.get("goals", {}).get("checked")]
    met = [c for c in ok if not c["goals"]["missed"]]
    w("")
    w("## Summary")
    w("")
    w(f"Goals met in {len(met)} of {len(ok)} checked cells.")
    for g in "abc":
        n = sum(1 for c in ok if any(m.startswith(f"({g})") for m in c["goals"]["missed"]))
        w(f"- ({g}) missed in {n} cell(s)")
    refs = [c["reference"] for c in ok if c.get("reference")]
    if refs:
        w(f"- read hit within {REF_MARGIN} of the better of {' and '.join(REFERENCES)}: "
          f"{sum(1 for r in refs if r[0])} of {len(refs)} checked cells")
    mis = [c for c in cells if c.get("misaligned") and c.get("goals_4k", {}).get("checked")]
    if mis:
        met4 = sum(1 for c in mis if not c["goals_4k"]["missed"])
        w(f"- misaligned traces against {BASELINE_4K}: goals met in {met4} of {len(mis)} "
          "checked cells")
    failed = [c for c in cells if c.get("error")]
    if failed:
        w(f"- {len(failed)} cell(s) failed to run")
    return "\n".join(out) + "\n"


# Requests in flight of the closed replay of an overloaded cell.
CLOSED = 32

# Extra options of every `sce sim` (--sim-args), e.g. "--partial-fill".
SIM_ARGS = []


def run_cell(sce, trace, spec, size, policies, done, total):
    t0 = time.monotonic()
    # One core shard: the matrix compares policies, not the server's split budgets (a
    # sharded flashcache-like with 4 KiB fragments starves on its per-shard AWT budget;
    # docs/ARCHITECTURE.md, "Core shards").
    cmd = [sce, "sim", "--json", "--core-shards", "1", "--trace", trace.path, "--format", trace.fmt, "--cache-size",
           str(size), "--policy", ",".join(policies), "--interval", f"{trace.interval:.3f}"]
    cmd += SIM_ARGS
    try:
        out = json.loads(run(cmd, f"sce sim on {trace.name} at {size_label(size)}"))
        err = None
        # An open replay that overloads the modelled devices measures overload: the cell is
        # run again closed, CLOSED requests in flight, and shows both.
        if any(p.get("overloaded") for p in out["policies"]):
            closed = cmd + ["--replay", f"closed:{CLOSED}"]
            out["closed"] = json.loads(run(closed, f"sce sim closed on {trace.name}"))
    except (RuntimeError, ValueError) as e:
        out, err = None, str(e)
    with _print_lock:
        done[0] += 1
        print(f"[{done[0]}/{total}] {trace.name} {size_label(size)} ({spec_label(spec)}): "
              f"{'FAILED' if err else 'done'} in {time.monotonic() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return out, err


def self_test():
    """Checks the arithmetic of the goals on made-up results (no sce needed). Not `assert`,
    which `python3 -O` drops."""

    def check(ok):
        if not ok:
            raise SystemExit(f"self-test failed at line {sys._getframe(1).f_lineno}")

    t = Trace("t", "-", "sce")
    t.blocks, t.read_pages, t.duration = 1000, 5000, 400.0
    check(t.interval == 10.001)
    check([t.cache_size(p) for p in (10, 50, 150)] == [2 * MIB, 2 * MIB, 6 * MIB])
    t.fragments = 3
    check([t.cache_size(parse_size(x)) for x in ("150", "2x", "4x")] == [6 * MIB, 6 * MIB,
                                                                         12 * MIB])
    check(parse_size("0") is None and parse_size("2.5x") == ("fp", 2.5) and
          parse_size("x") is None and parse_size("fifty") is None)
    check(spec_label(("fp", 2.0)) == "2x footprint" and spec_label(("pct", 50)) == "50%")
    t.blocks = 100_000
    check(t.cache_size(10) == 40 * MIB)  # 39.06 MiB, rounded up
    t.duration = 10.0
    check(t.interval == 1.0)
    # Intervals of 10 s; reads start in the third. A last interval of 1 s is passed over.
    iv = [(10, None), (20, None), (30, 0.1), (40, 0.5), (50, 0.9), (60, 1.0), (61, 0.0)]
    check(final_ratio(iv, 10) == 1.0)
    check(final_ratio(iv[:-1], 10) == 1.0)
    check(final_ratio([(10, None), (15, 0.3)], 10) == 0.3)
    check(final_ratio([(10, None)], 10) is None)
    check(warmup(iv, 0.9, 10) == 30)  # from 20, the start of the first interval with a read
    check(warmup(iv, 0.1, 10) == 10)
    check(warmup(iv, 1.1, 10) is None)

    def m(hit, wpr, warm, lat=0.001):
        return {"read_hit_ratio": hit, "cache_bytes_written_per_request": wpr,
                "warmup_seconds": warm, "mean_read_latency": lat}

    def missed(s, b, lru=None, locality=False):
        cell = {SUBJECT: s, BASELINE: b}
        if lru is not None:
            cell["lru"] = lru
        g = goals(cell, 10, locality=locality)
        check(g["checked"])
        return "".join(x[1] for x in g["missed"])

    check(missed(m(0.5, 100, 10), m(0.5, 200, 40)) == "")
    check(missed(m(0.491, 200, 20, 0.0011), m(0.5, 200, 40)) == "")  # just within each bound
    check(missed(m(0.489, 201, 21, 0.00111), m(0.5, 200, 40)) == "abc")  # just beyond each
    check(missed(m(0.5, 101, 10), m(0.5, 200, 40), locality=True) == "a")  # locality: half
    check(missed(m(0.5, 100, 10), m(0.5, 200, 40), locality=True) == "")
    check(missed(m(0.5, 0, 10), m(0.4, 0, 10), lru=m(0.52, 0, 10)) == "b")  # lru is better
    check(missed(m(0.5, 0, 10), m(0.4, 0, 10), lru=m(0.51, 0, 10)) == "")
    check(missed(m(0.5, 0, None), m(0.5, 0, 40)) == "")  # warm-up is not a goal
    check(missed(m(0.5, None, 10), m(0.5, 1, 10)) == "a")  # not reported: missed
    check(not goals({SUBJECT: m(1, 0, 1)}, 10)["checked"])
    check(goals({SUBJECT: m(0.5, 0, 10), BASELINE_4K: m(0.6, 0, 10)}, 10,
                baseline=BASELINE_4K)["missed"][0].startswith("(b)"))
    check(reference_check({SUBJECT: m(0.48, 0, 1), "lru": m(0.5, 0, 1),
                           "s3fifo": m(0.4, 0, 1)})[0])
    check(not reference_check({SUBJECT: m(0.47, 0, 1), "lru": m(0.4, 0, 1),
                               "s3fifo": m(0.5, 0, 1)})[0])
    check(reference_check({SUBJECT: m(0.5, 0, 1)}) is None)
    t.fragments, t.blocks = 4, 256
    check(t.density == 0.25 and t.locality)
    t.blocks = 255
    check(not t.locality)
    print("self-test passed", file=sys.stderr)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description="Run the policy matrix of docs/SIM-REPORT.md (see the module docstring).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("--traces", default=os.path.join(repo_root(), "..", "shared", "traces"),
                    help="directory of the real traces [<repo>/../shared/traces]")
    ap.add_argument("--traces-subset", default=None,
                    help="comma-separated trace names to run (real file names and "
                         f"{', '.join(GENERATED)}) [all]")
    ap.add_argument("--sizes", default=",".join(SIZES),
                    help="cache sizes: percentages of the 4 KiB working set, and multiples "
                    "of the 1 MiB fragment footprint ending in x [%(default)s]")
    ap.add_argument("--policies", default=POLICIES, help="policies to run [%(default)s]")
    ap.add_argument("--sce", default=None,
                    help="the sce binary [$CARGO_TARGET_DIR or <repo>/target, release/sce]")
    ap.add_argument("--sim-args", default="",
                    help="extra options for every sce sim, e.g. '--partial-fill' [none]")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cells run at once (each sce sim uses several threads) [1]")
    ap.add_argument("--gen-size", default="4GiB", help="volume of generated traces [4GiB]")
    ap.add_argument("--gen-requests", type=int, default=300_000,
                    help="requests of generated traces [300000]")
    ap.add_argument("--workdir", default=None,
                    help="where generated traces go [a temporary directory, removed]")
    ap.add_argument("--json", metavar="OUT", default=None, help="also write the results as JSON")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if a goal is missed in any cell (listing them)")
    ap.add_argument("--self-test", action="store_true",
                    help="check the goal arithmetic on made-up results, run nothing")
    args = ap.parse_args(argv)
    SIM_ARGS[:] = shlex.split(args.sim_args)
    if args.self_test:
        self_test()
        return 0

    sce = args.sce or default_sce()
    if not os.access(sce, os.X_OK):
        ap.error(f"no sce binary at {sce} (build it: cargo build --release -p sce, or --sce PATH)")
    specs = [parse_size(x) for x in args.sizes.split(",") if x.strip()]
    if not specs or None in specs:
        ap.error(f"--sizes {args.sizes!r}: expected percentages of the working set and "
                 "multiples of the fragment footprint, each > 0, such as 10,50,150,2x")
    args.sizes = specs
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        ap.error("--policies: at least one")
    names = [n for n, _, _ in REAL] + list(GENERATED)
    subset = names
    if args.traces_subset:
        subset = [n.strip() for n in args.traces_subset.split(",") if n.strip()]
        unknown = [n for n in subset if n not in names]
        if unknown:
            ap.error(f"unknown trace(s) {', '.join(unknown)}; known: {', '.join(names)}")
    if args.jobs < 1:
        ap.error("--jobs must be >= 1")

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sim-matrix-")
        workdir = tmp.name
    os.makedirs(workdir, exist_ok=True)
    t_start = time.monotonic()
    try:
        traces = []
        for name in subset:
            real = [r for r in REAL if r[0] == name]
            if real:
                path = os.path.join(args.traces, real[0][1])
                if not os.path.exists(path):
                    ap.error(f"trace {path} not found (--traces DIR)")
                t = Trace(name, path, real[0][2])
            else:
                log(f"generating {name} ...")
                t = Trace(name, generate(sce, name, args, workdir), "sce")
            log(f"surveying {name} ...")
            t.survey(sce, workdir)
            log(f"  {t.requests} requests, {t.duration:.0f} s, working set {t.blocks} blocks, "
                f"interval {t.interval:g} s")
            traces.append(t)

        # One run per distinct (trace, cache size): small traces round several sizes to 2 MiB.
        jobs = {}
        for t in traces:
            for spec in args.sizes:
                jobs.setdefault((t.name, t.cache_size(spec)), (t, spec))
        done = [0]
        results = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as ex:
            futs = {
                ex.submit(run_cell, sce, t, spec, key[1], policies, done, len(jobs)): key
                for key, (t, spec) in jobs.items()
            }
            for f in concurrent.futures.as_completed(futs):
                results[futs[f]] = f.result()

        cells = []
        for t in traces:
            for spec in args.sizes:
                size = t.cache_size(spec)
                out, err = results[(t.name, size)]
                cell = {"trace": t.name, "size": spec_label(spec),
                        "pct": spec[1] if spec[0] == "pct" else None,
                        "footprint_x": spec[1] if spec[0] == "fp" else None,
                        "cache_size": size,
                        "interval": t.interval}
                if err:
                    cell.update(error=err, target=None, policies={},
                                goals={"checked": False, "missed": [], "why": "run failed"})
                    cells.append(cell)
                    continue
                by_name = {p["policy"]: p for p in out["policies"]}
                base = by_name.get(BASELINE)
                final = final_ratio(base["intervals"], t.interval) if base else None
                target = 0.9 * final if final is not None else None
                cell["target"] = target
                cell["baseline_final_interval_hit_ratio"] = final
                cell["policies"] = {
                    n: metrics(p, t, target, t.interval) for n, p in by_name.items()
                }
                reads = sum(1 for _, h in base["intervals"] if h is not None) if base else 0
                cell["goals"] = goals(cell["policies"], t.interval, reads,
                                      locality=t.locality)
                cell["misaligned"] = t.misaligned_share > 0.5
                if BASELINE_4K in cell["policies"]:
                    b4 = by_name[BASELINE_4K]
                    final4 = final_ratio(b4["intervals"], t.interval)
                    target4 = 0.9 * final4 if final4 is not None else None
                    # Warm-up against the 4 KiB baseline's own final ratio.
                    p4 = {n: metrics(p, t, target4, t.interval) for n, p in by_name.items()}
                    reads4 = sum(1 for _, h in b4["intervals"] if h is not None)
                    cell["goals_4k"] = goals(p4, t.interval, reads4, BASELINE_4K,
                                             locality=t.locality)
                ref = reference_check(cell["policies"])
                if ref is not None and cell["goals"]["checked"]:
                    cell["reference"] = ref
                if out.get("closed"):
                    cell["closed_policies"] = {
                        p["policy"]: metrics(p, t, None, t.interval)
                        for p in out["closed"]["policies"]
                    }
                cells.append(cell)
    finally:
        if tmp is not None:
            tmp.cleanup()

    sys.stdout.write(markdown(traces, cells, policies, args))
    elapsed = time.monotonic() - t_start
    log(f"matrix: {len(cells)} cells ({len(jobs)} runs) in {elapsed:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "sce": sce, "policies": policies,
                "sizes": [spec_label(x) for x in args.sizes],
                "subject": SUBJECT, "baseline": BASELINE,
                "generated": {"size": args.gen_size, "requests": args.gen_requests,
                              "args": GENERATED},
                "traces": [{"name": t.name, "path": t.path, "format": t.fmt,
                            "requests": t.requests, "duration": t.duration,
                            "working_set_blocks": t.blocks, "read_pages": t.read_pages,
                            "fragment_footprint": t.fragments,
                            "misaligned_requests": t.misaligned,
                            "interval": t.interval} for t in traces],
                "cells": cells,
                "seconds": elapsed,
            }, f, indent=1)

    failed = [c for c in cells if c.get("error")]
    if failed:
        for c in failed:
            log(f"FAILED: {c['trace']} {c['size']}: {c['error']}")
        return 2
    if args.check:
        checked = [c for c in cells if c["goals"]["checked"]]
        if not checked:
            log(f"--check: no cell could be checked (the goals need {SUBJECT} and {BASELINE})")
            return 2
        missed = [c for c in checked if c["goals"]["missed"]]
        if missed:
            log(f"--check: goals missed in {len(missed)} of {len(checked)} cells:")
            for c in missed:
                log(f"  {c['trace']} {c['size']} ({size_label(c['cache_size'])}): "
                    + "; ".join(c["goals"]["missed"]))
            return 1
        log(f"--check: goals met in all {len(checked)} cells")
    return 0


if __name__ == "__main__":
    sys.exit(main())
