#!/usr/bin/env python3
"""The hit-path bench (`cargo bench -p sce-engine --bench hit_path`) of the working tree
against a base commit, alternated: builds the base's bench in a git worktree (its own target
directory), then runs the two binaries in turn, N times each (which goes first alternates),
and prints per case the median operations per second of each, their ratio and the spread
(min-max). With --cpu, both run pinned to that CPU (taskset): on a 2-CPU machine the
unpinned runs swing by +-30% with the scheduler, pinned by a few percent.

With --instructions N, it counts instead of timing: each build's bench warms one case and
makes exactly N, then 2N reads on one thread (`HIT_PATH_READS`, `HIT_PATH_CASE`) under
valgrind's cachegrind (instructions executed; this machine's VM has no hardware counters
for `perf stat`); the difference over N is the instructions per hit, which the machine's
load does not move. The base is built with the working tree's bench file (the
counting mode is newer than some bases; the file uses only `CacheVolume`'s public API).

Usage: scripts/bench-hit-path-ab.py BASE [--runs N] [--cpu K] [--workdir DIR] [--long]
                                         [--instructions READS]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_binary(tree, target):
    """Builds the hit_path bench of `tree` into `target`; returns the executable's path."""
    env = dict(os.environ, CARGO_TARGET_DIR=target)
    out = subprocess.run(
        ["cargo", "bench", "-p", "sce-engine", "--bench", "hit_path", "--no-run"],
        cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"building the bench in {tree} failed:\n{out.stderr[-3000:]}")
    m = re.search(r"Executable benches/hit_path.rs \((.*)\)", out.stderr)
    if not m:
        sys.exit(f"no bench executable in cargo's output:\n{out.stderr[-2000:]}")
    path = m.group(1)
    return path if os.path.isabs(path) else os.path.join(tree, path)


def parse(out):
    """{(case, '1 thread' | '2 threads'): ops/s} from the bench's output."""
    d, case = {}, None
    for line in out.splitlines():
        m = re.search(r"all hits \(\d+ reads\), (.*), median", line)
        if line.startswith("hit path") and m:
            case = m.group(1)
        m = re.match(r"\s+(1 thread|2 threads)\s*:\s+(\d+) ops/s", line)
        if m and case:
            d[(case, m.group(1))] = int(m.group(2))
    return d


CASES = ["checksums in memory", "persistent, default units", "persistent, 1 unit",
         "checksums off"]


def instructions(exe, case, reads, pin):
    """Instructions executed by one counting run of `exe` (cachegrind's I refs)."""
    env = dict(os.environ, HIT_PATH_READS=str(reads), HIT_PATH_CASE=str(case))
    out = subprocess.run(pin + ["valgrind", "--tool=cachegrind", "--cache-sim=no",
                                "--cachegrind-out-file=/dev/null", exe],
                         env=env, capture_output=True, text=True, check=True)
    m = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    if not m:
        sys.exit(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(m.group(1).replace(",", ""))


def count_ab(builds, runs, reads, pin):
    """Per case, the instructions per hit of each build, alternated: the median count at N
    reads and at 2N, differenced (a run's warm-up varies now and then with the scheduling of
    the volume's threads under valgrind; the medians take the usual value of each)."""
    print(f"hit path, instructions per 4 KiB hit (1 thread), {runs} runs each, "
          f"alternated: (median count at {2 * reads} reads - median at {reads}) / {reads}")
    print(f"{'case':<28} {'base':>9} {'head':>9} {'head/base':>9}  per-run spread base | head")
    for case, name in enumerate(CASES):
        one = {"base": [], "head": []}
        two = {"base": [], "head": []}
        for i in range(runs):
            order = list(builds.items())
            for who, exe in order if i % 2 == 0 else order[::-1]:
                one[who].append(instructions(exe, case, reads, pin))
                two[who].append(instructions(exe, case, 2 * reads, pin))
        per = {w: (statistics.median(two[w]) - statistics.median(one[w])) / reads for w in one}
        runs_of = {w: [(b - a) / reads for a, b in zip(one[w], two[w])] for w in one}
        b, h = per["base"], per["head"]
        print(f"{name:<28} {b:>9.0f} {h:>9.0f} {h / b:>9.4f}  "
              f"{min(runs_of['base']):.0f}-{max(runs_of['base']):.0f} | "
              f"{min(runs_of['head']):.0f}-{max(runs_of['head']):.0f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the commit to compare with")
    ap.add_argument("--runs", type=int, default=7, help="runs of each [7]")
    ap.add_argument("--cpu", type=int, help="pin both to this CPU (taskset)")
    ap.add_argument("--long", action="store_true",
                    help="each run as `cargo bench` runs it: 5 rounds of 1 s per case, the "
                         "median kept (the default: one round of 200 ms)")
    ap.add_argument("--instructions", type=int, metavar="READS",
                    help="count instructions per hit over READS reads instead of timing")
    ap.add_argument("--workdir", default="/tmp/sce-hit-path-ab",
                    help="where the base's worktree and target go [/tmp/sce-hit-path-ab]")
    a = ap.parse_args()
    tree, target = os.path.join(a.workdir, "tree"), os.path.join(a.workdir, "target")
    if not os.path.isdir(tree):
        os.makedirs(a.workdir, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", tree, a.base],
                       cwd=REPO, check=True, capture_output=True)
    else:
        subprocess.run(["git", "checkout", "-q", "--detach", a.base], cwd=tree, check=True)
    if a.instructions:
        bench = os.path.join("crates", "sce-engine", "benches", "hit_path.rs")
        with open(os.path.join(REPO, bench)) as src, open(os.path.join(tree, bench), "w") as dst:
            dst.write(src.read())
    base = bench_binary(tree, target)
    head = bench_binary(REPO, os.environ.get("CARGO_TARGET_DIR", os.path.join(REPO, "target")))
    pin = ["taskset", "-c", str(a.cpu)] if a.cpu is not None else []
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                         capture_output=True, text=True).stdout.strip()
    if a.instructions:
        print(f"base {a.base}, head {rev} (working tree)")
        count_ab({"base": base, "head": head}, a.runs, a.instructions, pin)
        subprocess.run(["git", "checkout", "-q", "--", "."], cwd=tree)
        return
    res = {"base": {}, "head": {}}
    for i in range(a.runs):
        order = [("base", base), ("head", head)]
        for name, exe in order if i % 2 == 0 else order[::-1]:
            args = [exe] + (["--bench"] if a.long else [])
            out = subprocess.run(pin + args, capture_output=True, text=True, check=True).stdout
            for key, v in parse(out).items():
                res[name].setdefault(key, []).append(v)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                         capture_output=True, text=True).stdout.strip()
    print(f"hit path, {a.runs} runs each, alternated; base {a.base}, head {rev} (working tree)"
          f"{'; pinned to CPU ' + str(a.cpu) if pin else ''}")
    print(f"{'case':<72} {'base':>9} {'head':>9} {'head/base':>9}  spread base | head")
    for key, b in res["base"].items():
        h = res["head"].get(key, [])
        if not h:
            continue
        mb, mh = statistics.median(b), statistics.median(h)
        print(f"{key[0][:60] + ' / ' + key[1]:<72} {mb:>9.0f} {mh:>9.0f} {mh / mb:>9.3f}"
              f"  {min(b)}-{max(b)} | {min(h)}-{max(h)}")


if __name__ == "__main__":
    main()
