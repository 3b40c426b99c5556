#!/usr/bin/env python3
"""The papers' experiments with a real database on a real filesystem (issue 13). Builds the
stack a user would, once per configuration and each from the same starting state, runs a
read-mostly pgbench mix on PostgreSQL over it, prints the configurations side by side with
ratios and the issue's goals met or missed, and writes them as Markdown (--out).

The stack, bottom up:
- the "SAN": `nbdkit --filter=fua --filter=delay file <copy of the base image> rdelay=2ms
  wdelay=2ms fuamode=discard` on a Unix socket (or, with --source-uri, any NBD export, reset
  to the base image with nbdcopy before each configuration);
- the configuration under test on a Unix socket: nothing (no cache), `sce serve` caching the
  source on a cache file (write-through, write-back, flashcache-like, ...), nbdkit's cache
  filter, or `sce serve` of a local copy of the image (all-flash);
- `nbdfuse -C 16` turns the export into a file (16 connections: about 8 requests in flight
  where its default 4 allows 4; --fuse-connections), `losetup --direct-io=on` that file into a block
  device (no page cache below the filesystem), ext4 on it (made once, in the base image),
  mounted;
- PostgreSQL (Debian's package, /usr/lib/postgresql/N) run as the `postgres` user with its
  data directory on that filesystem, its own port and socket directory, its memory (shared
  buffers, backends and the page cache of its files) capped by a memory cgroup when one can
  be made, and the page cache dropped before every configuration;
- pgbench, initialised once into the base image, running the mix of MIX below: per
  transaction seven SELECTs of pgbench_accounts by aid, one UPDATE of it and the delta
  inserted in the history, so 7 of 8 accesses to the accounts table are reads (TPC-E: 87%
  reads); aids drawn from an
  exponential distribution (a hot region, like TPC-E's recent trades), --dist to change it.

Flushes (PostgreSQL's commits wait for them) are not equal work in every configuration:
FLUSHES below says what each does with one, and --help prints it. The source acknowledges a
flush at once, as a SAN does from its battery-backed cache (fuamode=discard: flushes do not
reach this machine's shared disk). All-flash and write-back make a flush durable on the local
disk (an fdatasync of the image or of the cache file); write-through passes it to the source
only, for every write it acknowledged is there already.

Figures per configuration: TPS over time (pgbench's per-transaction log, 1 s buckets; an SVG
plot, one line per configuration), steady-state TPS (the mean over the last third of the
run), time to 90% of it (the first second from which the trailing 5 s mean reaches 90% of the
steady TPS), read hit ratio over the last third (sce's /stats, sampled every second), mean and
p99 transaction latency over the last third, bytes written to the cache device per
transaction over the whole run, data (pages populated and pages written: sce's
cache_bytes_written; nbdkit's cache filter: the write_bytes of its process, /proc/PID/io) and
metadata (sce's persist_metadata_bytes_written + persist_journal_bytes) apart: the goals on
cache bytes are judged on data, which every cache writes, not on sce's records, which
flashcache in write-through does not keep. After each
configuration the database must pass its consistency check: pgbench's invariant (the sum of
the accounts' balances equals the sum of the history's deltas, tellers and branches sum to 0,
no account lost) and pg_amcheck (heap and B-tree indexes).

--kill-test: for each of --kill-configs (sce write-through and sce write-back by default),
from a cold cache under pgbench, SIGKILL of `sce serve` in the middle of the run, then what a
user must do: stop PostgreSQL (its device failed), unmount, detach the loop device and
nbdfuse, restart `sce serve` on the same cache file, rebuild the stack, replay the ext4
journal (e2fsck -p), start PostgreSQL (crash recovery from its WAL), run the consistency
check, check that no transaction pgbench saw committed before the kill is lost (its history
row is there: a commit returns after its WAL flush), and compare the hit ratio of the first
minute after the restart with the first minute of the cold start.

Usage: scripts/bench-db.py [--short | --full] [--sce BIN] [--out FILE] [--json FILE]
       [--plot FILE.svg] [--configs a,b,..] [--sizes large,small] [--seconds S] [--scale N]
       [--kill-test [--kill-configs sce,sce-wb]] [--keep-base DIR]
Needs root, /dev/fuse, loop devices and the Debian packages nbdkit, nbdfuse, libnbd-bin,
fuse3, mount, e2fsprogs and postgresql: installs those that are missing with apt-get (unless
--no-install), and refuses to start, saying why, without any of them.
"""

import argparse
import glob
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30

# The transaction: 7 reads and one update of pgbench_accounts, its delta recorded in the
# history as TPC-B does (pgbench's invariant: the balances sum to the deltas). Tellers and
# branches are not updated: with a few dozen branches rows, their row locks held across a
# commit serialise the clients and hide the storage (measured: 7 of 8 clients waiting).
# :scale is given with -D (for a custom script pgbench's own :scale is 1, not the database's).
MIX = """\\set nacc 100000 * :scale
{sets}
\\set aid {dist}
\\set bid random(1, :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
BEGIN;
{selects}
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP);
END;
"""
READS = 7

FLASHCACHE_LIKE = ["--fragment-size", "4KiB", "--admission", "always", "--mode",
                   "write-through", "--eviction", "lru"]
# name -> (label, kind, extra sce serve arguments); kinds: source (no cache), sce, kit, flash.
CONFIGS = {
    "nocache": ("no cache (the source alone)", "source", []),
    "sce": ("sce write-through (defaults)", "sce", []),
    "sce-wb": ("sce write-back (--mode writeback: through its write-back log, default size)",
               "sce", ["--mode", "writeback"]),
    # Write-back through a write-back log (issue 29) of a quarter of the cache.
    "sce-wblog": ("sce write-back through a write-back log (--writeback-log, 1/4 of the cache)",
                  "sce", ["--mode", "writeback", "--writeback-log", "{quarter}"]),
    # Write-back's room (issue 45): a log that lends no read slots, and background
    # cleaning from a tenth of the most the log may hold (the default: a quarter).
    "sce-wb-fixed": ("sce write-back, a log that lends no read slots (--writeback-grow 0)",
                     "sce", ["--mode", "writeback", "--writeback-grow", "0"]),
    "sce-wb-low10": ("sce write-back, cleaning from 10% (--writeback-low-watermark 10%)",
                     "sce", ["--mode", "writeback", "--writeback-low-watermark", "10%"]),
    "sce-paper": ("sce --admission sce-paper", "sce", ["--admission", "sce-paper"]),
    # flashcache in write-through keeps no metadata on the SSD and starts cold after a
    # restart: its like here runs without sce's persistent records and journal.
    "flashcache": ("flashcache-like (write-through, --no-persist)", "sce",
                   FLASHCACHE_LIKE + ["--no-persist"]),
    "kit": ("nbdkit cache filter", "kit", []),
    "flash": ("all-flash (sce serve of a local file)", "flash", []),
    # The ablations (not run by default): fragment sizes, and AWT against synchronous
    # write-through and against write-around (the paper's "AWT disabled").
    "sce-128k": ("sce, 128 KiB fragments", "sce", ["--fragment-size", "128KiB"]),
    "sce-4m": ("sce, 4 MiB fragments", "sce", ["--fragment-size", "4MiB"]),
    "sce-wt": ("sce, synchronous write-through", "sce", ["--mode", "write-through"]),
    "sce-wa": ("sce, write-around (no AWT)", "sce", ["--mode", "write-around"]),
    # Fills from every read miss's own data (issue 30; the default fills only while busy).
    "sce-mf": ("sce --miss-fills on", "sce", ["--miss-fills", "on"]),
    # The default before issue 30 made lines and miss fills while busy the default: whole
    # 1 MiB fragments, population alone.
    "sce-1m": ("sce, whole 1 MiB fragments, no miss fills (the default before issue 30)", "sce",
               ["--fragment-size", "1MiB", "--miss-fills", "off"]),
    # Lines inside 1 MiB fragments (issue 30), alone and with miss fills.
    "sce-l512": ("sce --line-size 512KiB", "sce", ["--line-size", "512KiB"]),
    "sce-l512-mf": ("sce --line-size 512KiB --miss-fills on", "sce",
                    ["--line-size", "512KiB", "--miss-fills", "on"]),
    "sce-l256-mf": ("sce --line-size 256KiB --miss-fills on", "sce",
                    ["--line-size", "256KiB", "--miss-fills", "on"]),
    # What persistence costs (Holland et al.): no crash journal, and no persistence at all.
    "sce-nojournal": ("sce, --crash-journal off", "sce", ["--crash-journal", "off"]),
    "sce-nopersist": ("sce, --no-persist", "sce", ["--no-persist"]),
    # The flashcache-like configuration as runs 1-7 of docs/REPRODUCTION.md ran it (named
    # `flashcache` there): with sce's persistent metadata and write journal.
    "fc-persist": ("flashcache-like with sce's persistence", "sce", FLASHCACHE_LIKE),
}
# Names used before, and what they are now.
ALIASES = {"fc-np": "flashcache"}
# What each configuration does with a client's FLUSH (PostgreSQL's commits wait for it).
FLUSHES = {
    "source": "acknowledged at once by the source (a SAN's battery-backed cache)",
    "flash": "fdatasync of the local image file (this machine's disk)",
    "sce": "passed to the source, acknowledged at once: every write acknowledged is there "
           "already (write-through)",
    "sce-wb": "one commit record and an fdatasync of the cache file (the only copy of dirty "
              "data), then passed to the source",
    "kit": "passed to the source (cache=writethrough)",
}
# What sce writes to the cache device: data (pages populated and pages written),
# metadata records, and the write journal's blocks (/stats counters).
WRITTEN = ("cache_bytes_written", "persist_metadata_bytes_written", "persist_journal_bytes")
# The default set; --short keeps the set the test suite asserts (tests/bench_db.rs).
MAIN = ["nocache", "sce", "sce-wb", "sce-paper", "flashcache", "kit", "flash"]
MAIN_SHORT = ["nocache", "sce", "sce-paper", "flashcache", "kit", "flash"]
KILL = ["sce", "sce-wb"]
CACHED = ("sce", "kit")


def writeback(name):
    return "writeback" in CONFIGS[name][2]


def sized(extra, cache_size):
    """A configuration's extra arguments for a cache of `cache_size` bytes."""
    return [x.replace("{quarter}", str(cache_size // 4)) for x in extra]


def flush_of(name):
    """What configuration `name` does with a client's FLUSH."""
    kind = CONFIGS[name][1]
    if name in FLUSHES:
        return FLUSHES[name]
    return FLUSHES["sce-wb" if kind == "sce" and writeback(name) else kind]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Failed(Exception):
    """A step of the benchmark failed; the message says which."""


def run(cmd, check=True, timeout=None, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise Failed(f"{' '.join(map(str, cmd))} exited with {r.returncode}: "
                     f"{(r.stderr or r.stdout).strip()[-2000:]}")
    return r


class Stack:
    """Cleanups in reverse order of the resources they release; each runs once, its failure
    logged, never raised, so that one stuck step does not leave the rest behind."""

    def __init__(self):
        self.items = []

    def push(self, what, fn):
        self.items.append((what, fn))
        return len(self.items) - 1

    def unwind(self):
        while self.items:
            what, fn = self.items.pop()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - cleanup must go on
                log(f"cleanup: {what}: {e}")


class Procs:
    """Processes started by the benchmark, each in its own session (a Ctrl-C on the terminal
    reaches only the script, which stops them in order)."""

    def __init__(self):
        self.procs = []

    def start(self, args, logf=None, env=None):
        err = open(logf, "a") if logf else subprocess.DEVNULL
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=err, stderr=err, env=env,
                             start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p, sig=signal.SIGTERM, timeout=30):
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in reversed(list(self.procs)):
            self.stop(p)


def wait_for(what, cond, proc=None, timeout=60, logf=None):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            said = f"; the end of its log:\n{tail(logf, 10)}" if logf else ""
            raise Failed(f"{what}: the process exited with {proc.returncode}{said}")
        time.sleep(0.05)
    raise Failed(f"{what}: not ready after {timeout} s")


def uri(sock):
    return f"nbd+unix:///?socket={sock}"


def http_json(addr, path="/stats"):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
        return json.loads(r.read())


def drop_caches():
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fmt_size(n):
    for unit, div in (("GiB", GiB), ("MiB", MiB)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------------------------------------
# The machine: requirements, memory cgroup, PostgreSQL


# The Debian packages the stack needs, by the command that tells whether each is there.
PACKAGES = {"nbdkit": "nbdkit", "nbdfuse": "libnbd-bin", "nbdcopy": "libnbd-bin",
            "fusermount3": "fuse3", "losetup": "mount", "mkfs.ext4": "e2fsprogs",
            "runuser": "util-linux", "pgbench": "postgresql"}


def install_missing(a):
    """Installs the Debian packages of the stack that are missing (as root, with apt-get),
    unless --no-install; says what it installs."""
    need = sorted({pkg for tool, pkg in PACKAGES.items() if not shutil.which(tool)}
                  | (set() if pg_bindir(a) else {"postgresql"}))
    if not need or a.no_install or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    log(f"== installing {' '.join(need)} (apt-get; --no-install to refuse)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    keep = ["-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold"]
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq"] + keep + need):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=env,
                               stdin=subprocess.DEVNULL, timeout=1200)
        except subprocess.TimeoutExpired:
            log(f"   {' '.join(cmd)} took over 20 minutes; stopped")
            return
        if r.returncode != 0:
            log(f"   {' '.join(cmd)} exited with {r.returncode}: {r.stderr.strip()[-500:]}")
            return


def preflight(a):
    """Installs what is missing (install_missing), then refuses to run, saying why, where the
    stack cannot be built (or cleaned up)."""
    install_missing(a)
    why = []
    if os.geteuid() != 0:
        why.append("must run as root (losetup, mount, FUSE, drop_caches, running PostgreSQL "
                   "as the postgres user)")
    if not os.path.exists("/dev/fuse"):
        why.append("/dev/fuse is missing (load the fuse module; in a container: --device "
                   "/dev/fuse)")
    if not os.path.exists("/dev/loop-control"):
        why.append("/dev/loop-control is missing: no loop devices (modprobe loop)")
    tools = {"nbdkit": "nbdkit", "nbdfuse": "nbdfuse (Debian 12: libnbd-bin)",
             "fusermount3": "fuse3", "losetup": "mount", "mount": "mount", "umount": "mount",
             "mkfs.ext4": "e2fsprogs", "e2fsck": "e2fsprogs", "runuser": "util-linux"}
    if a.source_uri:
        tools["nbdcopy"] = "libnbd-bin"
    for t, pkg in tools.items():
        if not shutil.which(t):
            why.append(f"{t} is missing (Debian package {pkg})")
    pg = pg_bindir(a)
    if not pg:
        why.append("PostgreSQL is missing: no /usr/lib/postgresql/*/bin/pg_ctl (Debian "
                   "package postgresql), or give --pg-bin")
    else:
        for t in ("initdb", "pg_ctl", "postgres", "psql", "pgbench", "pg_amcheck"):
            if not os.access(os.path.join(pg, t), os.X_OK):
                why.append(f"{pg}/{t} is missing (Debian package postgresql)")
    try:
        run(["id", "postgres"])
    except (Failed, OSError):
        why.append("there is no `postgres` user (Debian package postgresql creates it)")
    if why:
        sys.exit("bench-db: cannot run here:\n  - " + "\n  - ".join(why))
    return pg


def pg_bindir(a):
    if a.pg_bin:
        return a.pg_bin
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0)
    return os.path.dirname(found[-1]) if found else None


def make_cgroup(limit, stack):
    """A memory cgroup below ours with `limit` bytes (cgroup v2 or v1); None if none can be
    made here. PostgreSQL runs in it: its shared buffers, backends and the page cache of the
    files it reads are charged to it, so the page cache cannot hold the database."""
    name = f"sce-bench-db.{os.getpid()}"
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return None
    cands = []
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            cands.append((os.path.join("/sys/fs/cgroup/memory", path.lstrip("/"), name),
                          "memory.limit_in_bytes"))
        if hid == "0" and ctrls == "":
            cands.append((os.path.join("/sys/fs/cgroup", path.lstrip("/"), name), "memory.max"))
    for d, knob in cands:
        try:
            os.mkdir(d)
        except OSError:
            continue
        try:
            with open(os.path.join(d, knob), "w") as f:
                f.write(str(limit))
            # Processes can be placed in it (v2: the parent must not forbid it).
            run(["sh", "-c", f"echo $$ > {d}/cgroup.procs"])
        except (OSError, Failed):
            os.rmdir(d)
            continue
        stack.push("remove the memory cgroup", lambda d=d: os.rmdir(d))
        return d
    return None


class Postgres:
    """One PostgreSQL server on a data directory, run as the postgres user."""

    def __init__(self, ctx, data):
        self.ctx, self.data = ctx, data
        self.pid = None

    def cmd(self, tool, *args):
        return ["runuser", "-u", "postgres", "--", os.path.join(self.ctx.pg, tool)] + list(args)

    def start(self, stack, timeout=600):
        c = self.ctx
        args = self.cmd("pg_ctl", "-D", self.data, "-l", c.pg_log, "-w", "-t", str(timeout),
                        "-o", c.pg_options(), "start")
        if c.cgroup:
            args = ["sh", "-c", f'echo $$ > {c.cgroup}/cgroup.procs && exec "$@"', "sh"] + args
        r = run(args, check=False, timeout=timeout + 30)
        if r.returncode != 0:
            raise Failed(f"PostgreSQL did not start: {r.stdout.strip()} {r.stderr.strip()}\n"
                         + tail(c.pg_log))
        with open(os.path.join(self.data, "postmaster.pid")) as f:
            self.pid = int(f.readline())
        stack.push("stop PostgreSQL", self.stop)

    def stop(self, mode="fast"):
        if self.pid is None:
            return
        r = run(self.cmd("pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"),
                check=False, timeout=120)
        if r.returncode != 0 and mode != "immediate":
            run(self.cmd("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "-t", "30",
                         "stop"), check=False, timeout=60)
        if alive(self.pid):
            # Its data directory may be gone with the device: the postmaster by its pid.
            os.kill(self.pid, signal.SIGQUIT)
            for _ in range(100):
                if not alive(self.pid):
                    break
                time.sleep(0.1)
            else:
                os.kill(self.pid, signal.SIGKILL)
        self.pid = None

    def psql(self, sql, db="bench", timeout=3600):
        c = self.ctx
        r = run(self.cmd("psql", "-X", "-h", c.sockdir, "-p", str(c.port), "-d", db, "-Atq",
                         "-v", "ON_ERROR_STOP=1", "-c", sql), timeout=timeout)
        return r.stdout.strip()


def zombie(pid):
    """True if process `pid` has exited but is not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def tail(path, n=15):
    try:
        return "".join(open(path, errors="replace").readlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------
# The stack


class Ctx:
    """What every configuration shares: paths, the PostgreSQL server's address, the base
    image and its database."""

    def __init__(self, a, pg, d):
        self.a, self.pg, self.d = a, pg, d
        self.procs = Procs()
        self.pgdir = os.path.join(d, "pg")  # socket, logs, pgbench's logs: the postgres user's
        os.makedirs(self.pgdir)
        shutil.chown(self.pgdir, "postgres", "postgres")
        self.sockdir = self.pgdir
        self.pg_log = os.path.join(self.pgdir, "postgres.log")
        self.port = 54300 + os.getpid() % 600
        self.mnt = os.path.join(d, "mnt")
        os.makedirs(self.mnt)
        self.cgroup = None
        self.base = None
        self.source = None  # the latest nbdkit source process (none for --source-uri)
        self.meta = {}
        self.script = os.path.join(self.pgdir, "mix.sql")

    def pg_options(self):
        a = self.a
        return (f"-p {self.port} -k {self.sockdir} -c listen_addresses='' "
                f"-c shared_buffers={a.shared_buffers} -c max_connections=40 "
                f"-c max_wal_size={a.max_wal} -c checkpoint_timeout={a.checkpoint} "
                "-c autovacuum=off -c jit=off -c fsync=on -c synchronous_commit=on "
                "-c full_page_writes=on -c max_parallel_workers_per_gather=0")


def umount(path):
    for _ in range(20):
        if run(["umount", path], check=False).returncode == 0:
            return
        if run(["mountpoint", "-q", path], check=False).returncode != 0:
            return
        time.sleep(0.5)
    log(f"cleanup: {path} still busy, detaching it lazily (umount -l)")
    run(["umount", "-l", path])


def fuse_down(ctx, fuse, p):
    run(["fusermount3", "-u", fuse], check=False)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    ctx.procs.stop(p)
    run(["fusermount3", "-u", "-z", fuse], check=False)
    if os.path.exists(fuse) and not os.path.ismount(fuse):
        os.unlink(fuse)


def mount_stack(ctx, stack, target, cd, fsck=False):
    """nbdfuse, a direct-I/O loop device on its file, the filesystem mounted; returns what a
    report may want to know (the loop device, whether direct I/O is on, e2fsck's verdict)."""
    fuse = os.path.join(cd, "nbd")
    open(fuse, "w").close()
    p = ctx.procs.start(["nbdfuse", "-C", str(ctx.a.fuse_connections), fuse, target],
                        logf=os.path.join(cd, "nbdfuse.log"))
    stack.push("unmount nbdfuse", lambda: fuse_down(ctx, fuse, p))
    # At least the image's size: a --source-uri export may be larger (ext4 uses the image's).
    wait_for("nbdfuse", lambda: os.path.getsize(fuse) >= ctx.meta["image_size"], p)
    loop = run(["losetup", "--find", "--show", "--direct-io=on", fuse]).stdout.strip()
    stack.push(f"losetup -d {loop}", lambda: run(["losetup", "-d", loop]))
    try:
        dio = open(f"/sys/block/{os.path.basename(loop)}/loop/dio").read().strip() == "1"
    except OSError:
        dio = None
    info = {"loop": loop, "dio": dio, "nbdfuse": p}
    if fsck:
        r = run(["e2fsck", "-p", loop], check=False, timeout=600)
        said = "; ".join(x.strip() for x in (r.stdout + r.stderr).splitlines() if x.strip())
        info["fsck"] = f"e2fsck -p exit {r.returncode} ({said[-300:]})"
        if r.returncode > 1:
            raise Failed(f"the filesystem needs more than a journal replay: {info['fsck']}")
    run(["mount", "-o", "noatime", loop, ctx.mnt])
    stack.push("umount", lambda: umount(ctx.mnt))
    return info


class Server:
    def __init__(self, proc=None, target=None, addr=None, log=None):
        self.proc, self.target, self.addr, self.log = proc, target, addr, log


def start_source(ctx, stack, cd):
    """The slow source, in the base image's state; returns its NBD URI."""
    a = ctx.a
    if a.source_uri:
        run(["nbdcopy", "--flush", ctx.base, a.source_uri], timeout=3600)
        return a.source_uri
    run(["cp", "--sparse=always", ctx.base, os.path.join(cd, "source.img")])
    return launch_source(ctx, stack, cd)


def launch_source(ctx, stack, cd):
    """nbdkit over `cd`/source.img as it stands; its process is `ctx.source`."""
    a = ctx.a
    sock = os.path.join(cd, "source.sock")
    if os.path.exists(sock):
        os.unlink(sock)
    logf = os.path.join(cd, "source.log")
    p = ctx.procs.start(["nbdkit", "-f", "-U", sock, "-t", "64", "--filter=fua",
                         "--filter=delay", "file", os.path.join(cd, "source.img"),
                         f"rdelay={a.delay}", f"wdelay={a.delay}", "fuamode=discard"],
                        logf=logf)
    ctx.source = p
    stack.push("stop the source", lambda: ctx.procs.stop(p))
    wait_for("nbdkit (source)", lambda: os.path.exists(sock), p, logf=logf)
    return uri(sock)


def revive_source(ctx, stack, cd, step):
    """nbdkit 1.32 can abort when a client dies with replies in flight (an assertion in
    raw_send_socket). After the SIGKILL of sce serve that is the source dying too, as a SAN
    target might restart: say so, and start it again over the same file, which keeps every
    write it completed (the page cache outlives the process)."""
    p = ctx.source
    if p is None or p.poll() is None:
        return None
    lines = tail(os.path.join(cd, "source.log"), 20).splitlines()
    said = ([ln for ln in lines if "Assertion" in ln] or [ln for ln in lines if "error" in ln]
            or ["nothing in its log"])
    step(f"the source (nbdkit) died too, exit {p.returncode}: {said[-1].strip()[:200]}; "
         "started it again on the same image file")
    return launch_source(ctx, stack, cd)


def start_sce(ctx, stack, cd, name, args):
    sock = os.path.join(cd, f"{name}.sock")
    logf = os.path.join(cd, f"{name}.log")
    if os.path.exists(sock):
        os.unlink(sock)
    if os.path.exists(logf):
        raise Failed(f"{logf} exists: its metrics address would be the old server's")
    p = ctx.procs.start([ctx.a.sce, "serve", "--listen", f"unix:{sock}", "--metrics",
                         "127.0.0.1:0"] + args, logf=logf)
    stack.push(f"stop sce serve ({name})", lambda: ctx.procs.stop(p))
    wait_for(f"sce serve ({name})", lambda: os.path.exists(sock), p, logf=logf)
    addr = None

    def metrics():
        nonlocal addr
        for line in open(logf):
            if "metrics on http://" in line:
                addr = line.split("metrics on http://")[1].split()[0].split("/")[0]
        return addr is not None
    wait_for(f"sce serve ({name}) metrics", metrics, p, timeout=30, logf=logf)
    return Server(p, uri(sock), addr, logf)


def start_server(ctx, stack, cd, name, cache_size, src):
    """The configuration under test in front of the source `src` (an NBD URI)."""
    _, kind, extra = CONFIGS[name]
    if kind == "source":
        return Server(target=src)
    if kind == "sce":
        return start_sce(ctx, stack, cd, "sce",
                         ["--source", src, "--cache", os.path.join(cd, "cache"), "--cache-size",
                          str(cache_size), "--state-dir", os.path.join(cd, "state")]
                         + sized(extra, cache_size))
    if kind == "flash":
        img = os.path.join(cd, "flash.img")
        run(["cp", "--sparse=always", ctx.base, img])
        return start_sce(ctx, stack, cd, "flash", ["--source", img])
    sock = os.path.join(cd, "kit.sock")
    tmp = os.path.join(cd, "kit-tmp")
    os.makedirs(tmp)
    p = ctx.procs.start(["nbdkit", "-f", "-U", sock, "--filter=cache", "nbd",
                         f"uri={src}", "cache=writethrough", "cache-on-read=true",
                         f"cache-max-size={cache_size}"],
                        logf=os.path.join(cd, "kit.log"), env=dict(os.environ, TMPDIR=tmp))
    stack.push("stop nbdkit (cache filter)", lambda: ctx.procs.stop(p))
    wait_for("nbdkit (cache filter)", lambda: os.path.exists(sock), p)
    return Server(p, uri(sock))


def proc_write_bytes(pid):
    try:
        for line in open(f"/proc/{pid}/io"):
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


class Sampler(threading.Thread):
    """Reads a server's counters every second: (t, pages hit, pages missed, bytes written to
    the cache device) with t in seconds from `t0`."""

    def __init__(self, server, t0):
        super().__init__(daemon=True)
        self.server, self.t0 = server, t0
        self.samples = []
        self.first = self.last = None  # the first and last /stats of an sce server
        self.halt = threading.Event()

    def sample(self):
        s = self.server
        try:
            if s.addr:
                e = http_json(s.addr)["exports"][""]
                w = sum(e.get(k, 0) for k in WRITTEN)
                self.samples.append((time.time() - self.t0, e["read_pages_hit"],
                                     e["read_pages_missed"], w))
                if self.first is None:
                    self.first = e
                self.last = e
            elif s.proc:
                w = proc_write_bytes(s.proc.pid)
                if w is not None:
                    self.samples.append((time.time() - self.t0, None, None, w))
        except (OSError, ValueError, KeyError):
            pass

    def run(self):
        self.sample()
        while not self.halt.wait(1.0):
            self.sample()

    def stop(self):
        self.halt.set()
        self.join()
        self.sample()

    def hit_ratio(self, t_from, t_to):
        """Read hit ratio between the samples nearest after t_from and at or before t_to."""
        s = [x for x in self.samples if x[1] is not None]
        a = next((x for x in s if x[0] >= t_from), None)
        b = [x for x in s if x[0] <= t_to + 1.5]
        if a is None or not b or b[-1][0] <= a[0]:
            return None
        h, m = b[-1][1] - a[1], b[-1][2] - a[2]
        return h / (h + m) if h + m else None

    def written(self):
        if len(self.samples) < 2:
            return None
        return self.samples[-1][3] - self.samples[0][3]

    def breakdown(self):
        """What sce wrote to the cache device over the run, by cause (bytes), or None."""
        if self.first is None or self.last is None or len(self.samples) < 2:
            return None
        d = {k: self.last.get(k, 0) - self.first.get(k, 0) for k in WRITTEN}
        # A population is counted when it completes, its bytes as they are written: one
        # under way at the first sample may count more pages than bytes in the window.
        populated = min(d["cache_bytes_written"],
                        4096 * (self.last.get("pages_populated", 0)
                                - self.first.get("pages_populated", 0)))
        return {"populated": populated,
                "written pages": d["cache_bytes_written"] - populated,
                "journal": d["persist_journal_bytes"],
                "metadata": d["persist_metadata_bytes_written"]}


# ---------------------------------------------------------------------------------------------
# The database: the base image, pgbench, the consistency check


def build_base(ctx, img):
    """The base image: ext4 with a PostgreSQL cluster and pgbench's tables at --scale, shut
    down cleanly. Built on a plain loop device of the file (no delay: only once)."""
    a = ctx.a
    log(f"== base image: ext4 {fmt_size(a.image_size)}, pgbench scale {a.scale}")
    t0 = time.time()
    with open(img, "w") as f:
        f.truncate(a.image_size)
    run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=0,lazy_journal_init=0",
         "-L", "scedb", img])
    st = Stack()
    try:
        loop = run(["losetup", "--find", "--show", img]).stdout.strip()
        st.push(f"losetup -d {loop}", lambda: run(["losetup", "-d", loop]))
        run(["mount", "-o", "noatime", loop, ctx.mnt])
        st.push("umount", lambda: umount(ctx.mnt))
        data = os.path.join(ctx.mnt, "pgdata")
        os.makedirs(data)
        shutil.chown(data, "postgres", "postgres")
        os.chmod(data, 0o700)
        pgs = Postgres(ctx, data)
        run(pgs.cmd("initdb", "-D", data, "-U", "postgres", "--auth=peer", "-E", "UTF8",
                    "--locale=C"), timeout=600)
        cg, ctx.cgroup = ctx.cgroup, None  # initialised without the memory cap: faster
        try:
            pgs.start(st)
        finally:
            ctx.cgroup = cg
        pgs.psql("CREATE DATABASE bench", db="postgres")
        run(pgs.cmd("pgbench", "-h", ctx.sockdir, "-p", str(ctx.port), "-i", "-q", "-s",
                    str(a.scale), "bench"), timeout=3600)
        pgs.psql("CREATE EXTENSION amcheck")
        pgs.psql("CHECKPOINT")
        db = int(pgs.psql("SELECT pg_database_size('bench')"))
        pgs.stop()
        vfs = os.statvfs(ctx.mnt)
        used = (vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize
    finally:
        st.unwind()
    meta = {"scale": a.scale, "image_size": a.image_size, "db_bytes": db, "fs_used": used,
            "build_seconds": round(time.time() - t0)}
    with open(img + ".json", "w") as f:
        json.dump(meta, f)
    log(f"   database {fmt_size(db)}, filesystem {fmt_size(used)} used, "
        f"{meta['build_seconds']} s")
    return meta


def base_image(ctx):
    a = ctx.a
    if a.keep_base:
        os.makedirs(a.keep_base, exist_ok=True)
        img = os.path.join(a.keep_base, f"bench-db-base-s{a.scale}-{a.image_size}.img")
        if os.path.exists(img + ".json"):
            log(f"== base image: reusing {img}")
            return img, json.load(open(img + ".json"))
    else:
        img = os.path.join(ctx.d, "base.img")
    return img, build_base(ctx, img)


def write_script(ctx):
    a = ctx.a
    kind, _, p = a.dist.partition(":")
    if kind == "uniform":
        dist = "random(1, :nacc)"
    elif kind in ("exponential", "gaussian", "zipfian"):
        dist = f"random_{kind}(1, :nacc, {p or {'exponential': 5, 'gaussian': 5, 'zipfian': 1.1}[kind]})"
    else:
        sys.exit(f"--dist {a.dist}: uniform, exponential[:P], gaussian[:P] or zipfian[:S]")
    sets = "\n".join(f"\\set a{i} {dist}" for i in range(1, READS + 1))
    sel = "\n".join(f"SELECT abalance FROM pgbench_accounts WHERE aid = :a{i};"
                    for i in range(1, READS + 1))
    with open(ctx.script, "w") as f:
        f.write(MIX.format(sets=sets, dist=dist, selects=sel))
    os.chmod(ctx.script, 0o644)


def loop_stat(loop):
    """(read I/Os, read ms, write I/Os, write ms, flush I/Os, flush ms) of a block device so
    far (its sysfs stat; the flush fields are 0 on kernels before 5.5, which lack them), or
    None."""
    try:
        f = open(f"/sys/block/{os.path.basename(loop)}/stat").read().split()
        flush = (int(f[15]), int(f[16])) if len(f) >= 17 else (0, 0)
        return (int(f[0]), int(f[3]), int(f[4]), int(f[7])) + flush
    except (OSError, ValueError, IndexError):
        return None


def io_latency(before, after):
    """Mean read, write and flush latency (ms) at the block device between two
    loop_stat()s: what the filesystem under PostgreSQL waited for, per request, whatever
    serves it (a commit waits for a write of its WAL and a flush)."""
    if not before or not after:
        return {}
    d = [b - a for a, b in zip(before, after)]
    return {"dev_reads": d[0], "dev_read_ms": d[1] / d[0] if d[0] else None,
            "dev_writes": d[2], "dev_write_ms": d[3] / d[2] if d[2] else None,
            "dev_flushes": d[4], "dev_flush_ms": d[5] / d[4] if d[4] else None}


def start_pgbench(ctx, pgs, secs, cd, tag):
    logdir = os.path.join(ctx.pgdir, f"{os.path.basename(cd)}-{tag}")
    os.makedirs(logdir)
    shutil.chown(logdir, "postgres", "postgres")
    a = ctx.a
    cmd = pgs.cmd("pgbench", "-h", ctx.sockdir, "-p", str(ctx.port), "-n", "-c",
                  str(a.clients), "-j", str(min(a.clients, 2)), "-T", str(secs), "-P", "1",
                  "-D", f"scale={a.scale}",
                  "-l", "--log-prefix", os.path.join(logdir, "tx"), "-f", ctx.script, "bench")
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=logdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    return p, t0, logdir


def finish_pgbench(p, t0, logdir, secs, timeout=None):
    try:
        out, err = p.communicate(timeout=timeout or secs + 120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
    series = [0] * max(secs, 1)
    tx = []  # (end time from t0, latency in ms)
    failed = 0
    for f in glob.glob(os.path.join(logdir, "tx.*")):
        for line in open(f):
            x = line.split()
            if len(x) < 6:
                continue
            if not x[2].isdigit():
                failed += 1
                continue
            end = int(x[4]) + int(x[5]) / 1e6 - t0
            tx.append((end, int(x[2]) / 1000))
            series[min(max(int(end), 0), len(series) - 1)] += 1
    shutil.rmtree(logdir, ignore_errors=True)
    aborted = sum(1 for line in err.splitlines() if "aborted" in line)
    return {"rc": p.returncode, "series": series, "tx": tx, "failed": failed,
            "aborted_lines": aborted, "stdout": out, "stderr": err}


def figures(b, secs, sampler):
    """Steady TPS, time to 90%, latencies and hit ratio of one pgbench run."""
    s = b["series"]
    n = len(s)
    start = n - n // 3
    steady = statistics.mean(s[start:]) if n else 0
    t90 = None
    for i in range(n):
        w = s[max(0, i - 4):i + 1]
        if steady > 0 and statistics.mean(w) >= 0.9 * steady:
            t90 = i + 1
            break
    lat = sorted(ms for end, ms in b["tx"] if end >= start)
    total = len(b["tx"])
    f = {"series": s, "steady_tps": steady, "t90": t90, "transactions": total,
         "lat_mean_ms": statistics.mean(lat) if lat else None,
         "lat_p99_ms": lat[min(len(lat) - 1, int(math.ceil(0.99 * len(lat))) - 1)] if lat else None,
         "hit_last_third": None, "hit_run": None, "cache_bytes_per_tx": None, "failed_tx": b["failed"]}
    if sampler is not None:
        f["hit_last_third"] = sampler.hit_ratio(start, secs)
        f["hit_run"] = sampler.hit_ratio(0, secs)
        w = sampler.written()
        if w is not None and total:
            f["cache_bytes_per_tx"] = w / total
        parts = sampler.breakdown()
        if parts is not None and total:
            f["cache_bytes_per_tx_by_cause"] = {k: v / total for k, v in parts.items()}
        # Data (what any cache writes: pages populated and pages written) and sce's metadata
        # (records and journal) apart; nbdkit's cache filter writes data only.
        if parts is not None and total:
            f["cache_data_bytes_per_tx"] = (parts["populated"] + parts["written pages"]) / total
            f["cache_meta_bytes_per_tx"] = (parts["journal"] + parts["metadata"]) / total
        elif w is not None and total:
            f["cache_data_bytes_per_tx"] = w / total
    return f


def check_db(ctx, pgs):
    """pgbench's invariant and pg_amcheck; returns (ok, what was found)."""
    a = ctx.a
    row = pgs.psql(
        "SELECT (SELECT sum(abalance) FROM pgbench_accounts), (SELECT sum(tbalance) FROM "
        "pgbench_tellers), (SELECT sum(bbalance) FROM pgbench_branches), (SELECT "
        "coalesce(sum(delta), 0) FROM pgbench_history), (SELECT count(*) FROM pgbench_accounts),"
        " (SELECT count(*) FROM pgbench_branches), (SELECT count(*) FROM pgbench_history),"
        " (SELECT round(avg(aid) / (100000.0 * (SELECT count(*) FROM pgbench_branches)), 3)"
        " FROM pgbench_history)")
    acc, tel, br, hist, nacc, nbr, nhist, spread = row.split("|")
    sums_ok = (acc == hist and tel == br == "0" and int(nacc) == 100000 * a.scale
               and int(nbr) == a.scale)
    args = ["-h", ctx.sockdir, "-p", str(ctx.port), "-U", "postgres", "-d", "bench"]
    if a.heapallindexed:
        args.append("--heapallindexed")
    # light: every relation but the accounts heap, which the sums just read in full (reading
    # it again through a slow configuration takes minutes), then the accounts' index.
    runs = [[]] if a.amcheck == "full" else [["-R", "pgbench_accounts"],
                                             ["-i", "pgbench_accounts_pkey"]]
    rc, am = 0, ""
    for extra in runs:
        r = run(pgs.cmd("pg_amcheck", *args, *extra), check=False, timeout=3600)
        rc = rc or r.returncode
        am += (r.stdout + r.stderr).strip()
    ok = sums_ok and rc == 0
    what = (f"sums accounts {acc}, tellers {tel}, branches {br}, history {hist} "
            f"({'as they must be' if sums_ok else 'NOT as they must be'}); {nacc} accounts, "
            f"{nhist} history rows (mean aid at {spread or '-'} of the table); pg_amcheck "
            f"({a.amcheck}) exit {rc}" + (f": {am[-1500:]}" if am else ""))
    if not ok:
        log(f"!!! CONSISTENCY CHECK FAILED: {what}")
    return ok, what


# ---------------------------------------------------------------------------------------------
# One configuration


def run_config(ctx, name, size_name, cache_size):
    a = ctx.a
    label, kind, _ = CONFIGS[name]
    log(f"== {label}" + (f", cache {fmt_size(cache_size)} ({size_name})" if kind in CACHED
                          else "") + f", {a.seconds} s")
    cd = tempfile.mkdtemp(prefix=f"{name}-{size_name}.", dir=ctx.d)
    t_run = time.time()
    res = {"name": name, "label": label, "kind": kind, "size": size_name,
           "cache_size": cache_size if kind in CACHED else None, "started": False,
           "served": False, "check_ok": False, "check": None, "error": None}
    outer, upper = Stack(), Stack()
    try:
        src = start_source(ctx, outer, cd) if kind != "flash" else None
        srv = start_server(ctx, outer, cd, name, cache_size, src)
        res["started"] = True
        info = mount_stack(ctx, upper, srv.target, cd)
        res["loop_dio"] = info["dio"]
        res["dropped_caches"] = drop_caches()
        pgs = Postgres(ctx, os.path.join(ctx.mnt, "pgdata"))
        pgs.start(upper)
        pgs.psql("SELECT count(*) FROM pgbench_branches")
        res["served"] = True
        dev0 = loop_stat(info["loop"])
        p, t0, logdir = start_pgbench(ctx, pgs, a.seconds, cd, "run")
        sampler = Sampler(srv, t0) if kind in CACHED else None
        if sampler:
            sampler.start()
        b = finish_pgbench(p, t0, logdir, a.seconds)
        res.update(io_latency(dev0, loop_stat(info["loop"])))
        if sampler:
            sampler.stop()
        if b["rc"] != 0:
            raise Failed(f"pgbench exited with {b['rc']}: {b['stderr'].strip()[-1500:]}")
        res.update(figures(b, a.seconds, sampler))
        if sampler:
            res["hit_series"] = [round(sampler.hit_ratio(i, i + 1) or 0, 3)
                                 for i in range(0, a.seconds)]
        t_check = time.time()
        res["check_ok"], res["check"] = check_db(ctx, pgs)
        res["check_seconds"] = round(time.time() - t_check)
        log(f"   steady {res['steady_tps']:.0f} TPS, t90 {res['t90']} s, hit "
            f"{num(res['hit_last_third'], '.3f')}, {time.time() - t_run:.0f} s in all, "
            f"check ({res['check_seconds']} s) "
            f"{'passed' if res['check_ok'] else 'FAILED'}")
    except Failed as e:
        res["error"] = str(e)
        log(f"!!! {label}: {e}\n{tail(ctx.pg_log)}")
    finally:
        upper.unwind()
        outer.unwind()
        shutil.rmtree(cd, ignore_errors=True)
    return res


# ---------------------------------------------------------------------------------------------
# SIGKILL of sce serve under load


def kill_test(ctx, name, size_name, cache_size):
    a = ctx.a
    warm, after = a.kill_seconds, a.kill_after
    label, _, extra = CONFIGS[name]
    log(f"== kill test: {label}, cache {fmt_size(cache_size)}: {warm} s of pgbench "
        f"from a cold cache, SIGKILL, restart, {after} s of pgbench")
    cd = tempfile.mkdtemp(prefix=f"kill-{name}.", dir=ctx.d)
    res = {"name": name, "label": label, "cache_size": cache_size, "size": size_name,
           "steps": [], "check_ok": False, "error": None}
    step = lambda s: (res["steps"].append(s), log(f"   {s}"))  # noqa: E731
    outer, upper = Stack(), Stack()
    args = lambda: ["--source", src, "--cache", os.path.join(cd, "cache"), "--cache-size",  # noqa: E731
                    str(cache_size), "--state-dir", os.path.join(cd, "state")] + sized(extra, cache_size)
    try:
        src = start_source(ctx, outer, cd)
        srv = start_sce(ctx, outer, cd, "sce", args())
        info = mount_stack(ctx, upper, srv.target, cd)
        drop_caches()
        pgs = Postgres(ctx, os.path.join(ctx.mnt, "pgdata"))
        pgs.start(upper)
        p, t0, logdir = start_pgbench(ctx, pgs, warm + 600, cd, "cold")
        sampler = Sampler(srv, t0)
        sampler.start()
        time.sleep(warm)
        minute = min(60, warm, after)
        res["cold_hit"] = sampler.hit_ratio(0, minute)
        res["cold_window"] = minute
        sampler.stop()
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        step(f"t = {warm} s: SIGKILL of sce serve (pid {srv.proc.pid}) under pgbench "
             f"({a.clients} clients); read hit ratio of the first {minute} s of this cold "
             f"start: {num(res['cold_hit'], '.3f')}")
        b = finish_pgbench(p, t0, logdir, warm, timeout=60)
        errs = [ln for ln in b["stderr"].splitlines() if "progress:" not in ln]
        why = "its clients were aborted by errors" if b["rc"] else "no error"
        res["committed_before_kill"] = len(b["tx"])
        step(f"pgbench ended with exit {b['rc']} ({why}); {len(b['tx'])} transactions "
             f"committed before the kill (its log); its last error: "
             f"{(errs[-1] if errs else '-')[:300]}")
        time.sleep(2)
        old_pm = pgs.pid
        pm = alive(old_pm)
        panics = [ln for ln in tail(ctx.pg_log, 60).splitlines()
                  if "PANIC" in ln or "could not" in ln or "I/O error" in ln]
        step(f"PostgreSQL postmaster {'still running' if pm else 'exited by itself'}; its log: "
             + (" | ".join(x.strip()[:200] for x in panics[-3:]) or "no I/O error logged"))
        step("nbdfuse " + ("still running" if info["nbdfuse"].poll() is None else
                           f"exited ({info['nbdfuse'].returncode})"))
        upper.unwind()
        step("stopped PostgreSQL (pg_ctl stop, immediate if fast failed), unmounted the "
             "filesystem, detached the loop device and nbdfuse")
        src = revive_source(ctx, outer, cd, step) or src
        # A log (and metrics address) of its own: the first one names the dead server's port.
        srv = start_sce(ctx, outer, cd, "sce-restarted", args())
        restored = [ln.strip() for ln in open(srv.log) if "cache device loaded" in ln]
        step("restarted sce serve on the same cache file: " +
             (restored[-1].split("INFO")[-1].strip() if restored else "(no load line)"))
        info = mount_stack(ctx, upper, srv.target, cd, fsck=True)
        step(f"nbdfuse, loop device, {info['fsck']}; mounted")
        drop_caches()
        before = os.path.getsize(ctx.pg_log)
        # The postmaster could not remove its lock file (its device died under it). It is
        # gone now; should its pid have been reused meanwhile, PostgreSQL would take the
        # stale file for a live server and refuse to start, as an operator would not.
        # (A postmaster that exited but was not reaped yet, a zombie, still counts as alive
        # for PostgreSQL's check: it is waited for, for a bounded time, as gone.)
        stale = os.path.join(ctx.mnt, "pgdata", "postmaster.pid")
        deadline = time.time() + 10
        while alive(old_pm) and not zombie(old_pm) and time.time() < deadline:
            time.sleep(0.1)
        if os.path.exists(stale) and (not alive(old_pm) or zombie(old_pm)):
            os.remove(stale)
            step("removed the dead postmaster's lock file (postmaster.pid)")
        pgs = Postgres(ctx, os.path.join(ctx.mnt, "pgdata"))
        pgs.start(upper)
        with open(ctx.pg_log, errors="replace") as f:
            f.seek(before)
            rec = [ln.strip() for ln in f if any(k in ln for k in (
                "not properly shut down", "redo starts", "redo done", "interrupted",
                "ready to accept"))]
        step("PostgreSQL started and recovered: " + " | ".join(x[:160] for x in rec))
        res["check_ok"], res["check"] = check_db(ctx, pgs)
        step(f"consistency check after recovery: {'passed' if res['check_ok'] else 'FAILED'}: "
             f"{res['check'][:300]}")
        res["durable_ok"] = committed_kept(pgs, res, step)
        res["check_ok"] = res["check_ok"] and res["durable_ok"]
        p, t0, logdir = start_pgbench(ctx, pgs, after, cd, "warm")
        sampler = Sampler(srv, t0)
        sampler.start()
        b = finish_pgbench(p, t0, logdir, after)
        sampler.stop()
        minute = min(60, warm, after)
        res["warm_hit"] = sampler.hit_ratio(0, minute)
        res["warm_window"] = minute
        res["warm_tps"] = statistics.mean(b["series"]) if b["series"] else 0
        ok2, what2 = check_db(ctx, pgs)
        res["check_ok"] = res["check_ok"] and ok2 and b["rc"] == 0
        step(f"after the restart: pgbench exit {b['rc']}, {res['warm_tps']:.0f} TPS, read hit "
             f"ratio of the first {minute} s {num(res['warm_hit'], '.3f')} (the cold start's: "
             f"{num(res['cold_hit'], '.3f')}); "
             f"consistency check {'passed' if ok2 else 'FAILED'}")
    except Failed as e:
        res["error"] = str(e)
        log(f"!!! kill test: {e}\n{tail(ctx.pg_log)}")
    finally:
        upper.unwind()
        outer.unwind()
        shutil.rmtree(cd, ignore_errors=True)
    return res


def committed_kept(pgs, res, step):
    """True if every transaction pgbench saw committed before the kill survived it: each one
    inserted one history row (the table starts empty), and a commit returns only after its
    WAL is flushed, so after recovery there are at least as many rows (more if commits
    completed whose answers the kill cut off)."""
    rows = int(pgs.psql("SELECT count(*) FROM pgbench_history"))
    n = res["committed_before_kill"]
    res["history_after_recovery"] = rows
    ok = rows >= n
    step(f"committed transactions kept: {rows} history rows after recovery, {n} "
         f"transactions committed before the kill: "
         + ("none lost" if ok else f"**{n - rows} LOST**"))
    return ok


# ---------------------------------------------------------------------------------------------
# Report


COLORS = {"nocache": "#777777", "sce": "#d62728", "sce-paper": "#ff7f0e", "flashcache": "#1f77b4",
          "kit": "#9467bd", "flash": "#2ca02c", "sce-128k": "#8c564b", "sce-4m": "#e377c2",
          "sce-wt": "#17becf", "sce-wa": "#bcbd22", "sce-nojournal": "#aec7e8",
          "sce-nopersist": "#98df8a", "sce-wb": "#000000", "sce-wb-fixed": "#7f7f7f",
          "sce-wb-low10": "#bcbd22", "sce-wblog": "#8c564b", "fc-persist": "#9edae5"}


def svg_plot(panels, path):
    """One panel per cache size: TPS over time, one polyline per configuration."""
    w, h, ml, mr, mt, mb = 760, 300, 60, 200, 30, 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h * len(panels)}" '
           'font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h * len(panels)}" fill="white"/>']
    for k, (title, rows) in enumerate(panels):
        y0 = k * h
        series = [(r["name"], r["label"], r["series"]) for r in rows if r.get("series")]
        if not series:
            continue
        xmax = max(len(s) for _, _, s in series)
        ymax = max(max(s) for _, _, s in series) or 1
        step = 10 ** math.floor(math.log10(ymax)) if ymax >= 1 else 1
        ymax = math.ceil(ymax / step) * step
        pw, ph = w - ml - mr, h - mt - mb
        X = lambda t: ml + pw * t / max(xmax, 1)  # noqa: E731
        Y = lambda v: y0 + mt + ph * (1 - v / ymax)  # noqa: E731
        out.append(f'<text x="{ml}" y="{y0 + 18}" font-weight="bold">{title}</text>')
        out.append(f'<rect x="{ml}" y="{y0 + mt}" width="{pw}" height="{ph}" fill="none" '
                   'stroke="#999"/>')
        for i in range(6):
            v = ymax * i / 5
            out.append(f'<text x="{ml - 6}" y="{Y(v) + 4:.1f}" text-anchor="end">{v:,.0f}</text>')
            out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" '
                       'stroke="#eee"/>')
        for i in range(6):
            t = xmax * i / 5
            out.append(f'<text x="{X(t):.1f}" y="{y0 + h - mb + 16}" text-anchor="middle">'
                       f'{t:.0f}</text>')
        out.append(f'<text x="{ml + pw / 2}" y="{y0 + h - 6}" text-anchor="middle">seconds</text>')
        out.append(f'<text x="14" y="{y0 + mt + ph / 2}" transform="rotate(-90 14 '
                   f'{y0 + mt + ph / 2})" text-anchor="middle">transactions per second</text>')
        for j, (name, label, s) in enumerate(series):
            pts = " ".join(f"{X(t + 0.5):.1f},{Y(v):.1f}" for t, v in enumerate(s))
            c = COLORS.get(name, "#000")
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
            ly = y0 + mt + 14 + 16 * j
            out.append(f'<line x1="{ml + pw + 10}" x2="{ml + pw + 30}" y1="{ly - 4}" '
                       f'y2="{ly - 4}" stroke="{c}" stroke-width="2"/>')
            out.append(f'<text x="{ml + pw + 34}" y="{ly}">{label[:26]}</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


def num(x, spec=",.0f", none="—"):
    return none if x is None else format(x, spec)


def ratio(x, y):
    return f"{x / y:.2f}x" if x is not None and y else "—"


def t_level(series, level):
    """The first second from which the trailing 5 s mean of `series` reaches `level`, or None:
    a warm-up measure that compares configurations against one common level, where t90
    compares each with its own steady TPS (a cache that never warms reaches its own at once)."""
    for i in range(len(series)):
        w = series[max(0, i - 4):i + 1]
        if level > 0 and statistics.mean(w) >= level:
            return i + 1
    return None


def by_cause(r):
    parts = r.get("cache_bytes_per_tx_by_cause")
    if not parts:
        return None
    return f"{r['name']}: " + ", ".join(f"{k} {num(v)}" for k, v in parts.items())


def table_row(r, tl, level, against):
    """One configuration's row of a cache size's table; `against`: the rows its TPS is
    divided by (no cache, sce write-through, flashcache-like, all-flash), None where not run."""
    st = r.get("steady_tps")
    ok = ("passed" if r["check_ok"] else f"**FAILED**: {r['error'] or r['check']}"[:200])
    tl_s = "—" if not level else num(tl) if tl else f"never in {len(r.get('series', []))}"
    ratios = " | ".join(ratio(st, x and x.get("steady_tps")) for x in against)
    dev = " / ".join(num(r.get(k), ".2f") for k in ("dev_read_ms", "dev_write_ms",
                                                    "dev_flush_ms"))
    return (f"| {r['label']} | {num(st)} | {ratios} | {num(r.get('t90'))} | {tl_s} | "
            f"{num(r.get('hit_last_third'), '.3f')} | {num(r.get('lat_mean_ms'), '.1f')} | "
            f"{num(r.get('lat_p99_ms'), '.1f')} | {dev} | "
            f"{num(r.get('cache_data_bytes_per_tx'))} | {num(r.get('cache_meta_bytes_per_tx'))} "
            f"| {ok} |")


def report(ctx, rows, sizes, kills, argv):
    a, m = ctx.a, ctx.meta
    rev = run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=ROOT).stdout.strip()
    by = {(r["name"], r["size"]): r for r in rows}
    first = sizes[0][0]
    base_row = lambda name, size: by.get((name, size)) or by.get((name, first))  # noqa: E731
    mem = (f"PostgreSQL (postmaster, backends, shared_buffers={a.shared_buffers} and the page "
           f"cache of its files) in a memory cgroup capped at {fmt_size(a.pg_mem)}"
           if ctx.cgroup else "no memory cgroup could be made here: only shared_buffers="
           f"{a.shared_buffers} and dropping the page cache before each configuration bound "
           "what is cached in memory")
    out = [f"# bench-db: git {rev}, {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs",
           "", "`scripts/bench-db.py " + " ".join(argv) + "`", "",
           f"pgbench scale {a.scale}: database {fmt_size(m['db_bytes'])} in an ext4 image of "
           f"{fmt_size(m['image_size'])} ({fmt_size(m['fs_used'])} used); {mem}; page cache "
           f"dropped before each configuration. Source: "
           + (f"`{a.source_uri}`" if a.source_uri else
              f"`nbdkit --filter=fua --filter=delay file <copy of the base image> "
              f"rdelay={a.delay} wdelay={a.delay} fuamode=discard -t 64` (flushes "
              "acknowledged at once, as by a SAN's battery-backed cache)")
           + f". The export reaches the loop device through `nbdfuse -C {a.fuse_connections}`"
           + f". {a.clients} pgbench clients, {a.seconds} s per configuration, {READS} SELECTs "
           f"of pgbench_accounts, one UPDATE of it and one INSERT into the history per "
           f"transaction, aids `{a.dist}`. Loop devices with "
           f"direct I/O: {'yes' if all(r.get('loop_dio') for r in rows if r.get('started')) else 'NOT everywhere'}.",
           "", "What a client's FLUSH is (each commit waits for one): " + "; ".join(
               f"{CONFIGS[n][0]}: {flush_of(n)}" for n in a.configs) + ".",
           "", "Steady TPS: the mean over the last third of the run; t90: the first second "
           "from which the trailing 5 s mean reaches 90% of it; hit ratio and latencies over "
           "the last third; device read / write / flush: the mean latency of a read, a write and "
           "a flush at the loop device under ext4 over the run (its sysfs stat); t to sce's level: the first second from which the trailing 5 s "
           "mean reaches 90% of sce's steady TPS with the same cache (one level for every "
           "configuration, so that one that never warms up does not reach it at once); cache "
           "bytes written per transaction over the whole run, data (pages populated and "
           "pages written; nbdkit's cache filter: write_bytes of its process) and sce's "
           "metadata (records and write journal) apart: the goals are judged on data.", ""]
    goals = []
    for size, cache in sizes:
        fl, nc, fc = base_row("flash", size), base_row("nocache", size), by.get(("flashcache", size))
        out += [f"## Cache {fmt_size(cache)} ({size}: "
                f"{'holds the database' if size == 'large' else format(cache / m['db_bytes'], '.0%') + ' of the database'})",
                "", "| configuration | steady TPS | × no cache | × sce write-through | "
                "× flashcache-like | × all-flash | t90 (s) | t to sce's level (s) | read hit "
                "ratio | mean latency (ms) | p99 latency (ms) | device read / write / flush "
                "(ms) | cache data bytes / tx | cache metadata bytes / tx | consistency |",
                "|---|" + "---:|" * 13 + "---|"]
        panel = []
        sc = by.get(("sce", size))
        level = 0.9 * sc["steady_tps"] if sc and sc.get("steady_tps") else None
        for name in a.configs:
            r = by.get((name, size)) or (by.get((name, first)) if CONFIGS[name][1] not in CACHED
                                          else None)
            if r is None:
                continue
            panel.append(r)
            tl = t_level(r.get("series", []), level) if level else None
            r.setdefault("t_sce_level", {})[size] = tl
            out.append(table_row(r, tl, level, [nc, sc, fc, fl]))
        ctx.panels.append((f"TPS over time, cache {fmt_size(cache)} ({size})", panel))
        causes = [c for c in (by_cause(r) for r in panel) if c]
        if causes:
            out += ["", "Cache bytes written per transaction, by cause: " + "; ".join(causes) + "."]
        out += ["", "TPS per second: " + "; ".join(
            f"{r['name']}: " + " ".join(str(v) for v in r.get("series", [])) for r in panel), ""]
        goals += goal_lines(by, size, nc, fc, fl)
    out += ["## The issue's goals", ""] + (goals or ["- no goal could be evaluated with the "
                                                     "configurations run"]) + [""]
    for k in kills:
        out += [f"## SIGKILL of sce serve under pgbench: {k['label']}", "",
                f"`sce serve {' '.join(CONFIGS[k['name']][2]) or '(defaults)'}`, cache "
                f"{fmt_size(k['cache_size'])}, {a.clients} clients; a FLUSH: "
                f"{flush_of(k['name'])}. What happened, step by step:", ""]
        out += [f"{i + 1}. {s}" for i, s in enumerate(k["steps"])]
        kept = k.get("durable_ok")
        out += ["", f"- Consistency after recovery and after the run that followed, and no "
                f"committed transaction lost: **{'passed' if k['check_ok'] else 'FAILED'}**"
                + (f" ({k['error']})" if k["error"] else "") + ".",
                f"- Transactions committed before the kill: {num(k.get('committed_before_kill'))}"
                f"; history rows after recovery: {num(k.get('history_after_recovery'))}: "
                + ("none lost." if kept else "**some lost**." if kept is False else "not checked."),
                f"- Read hit ratio of the first {num(k.get('warm_window'))} s after the restart: "
                f"{num(k.get('warm_hit'), '.3f')}; of the first {num(k.get('cold_window'))} s "
                f"of the cold start: {num(k.get('cold_hit'), '.3f')}.", ""]
    return out


def met(ok):
    return "**met**" if ok else "**missed**"


def goal_lines(by, size, nc, fc, fl):
    """The goals of issue 13 (sce against the other caches) and of issue 29 (write-back),
    those the configurations run allow."""
    s = by.get(("sce", size))
    if not s or s.get("steady_tps") is None:
        return []
    return goals_sce(by, size, s, nc, fc, fl) + goals_writeback(size, s, by.get(("sce-wb", size)),
                                                                 fl)


def data_ratio(x, y):
    """x's cache data bytes per transaction over y's, or None."""
    bx, by_ = x.get("cache_data_bytes_per_tx"), y.get("cache_data_bytes_per_tx")
    return bx / by_ if bx is not None and by_ else None


def goals_sce(by, size, s, nc, fc, fl):
    g = []
    st = s["steady_tps"]
    if size == "large" and fl and fl.get("steady_tps"):
        r = st / fl["steady_tps"]
        g.append(f"- Cache that holds the database: sce steady TPS ≥ 0.9x all-flash: {r:.2f}x: "
                 f"{met(r >= 0.9)}.")
    if fc and fc.get("steady_tps"):
        r = st / fc["steady_tps"]
        if size == "small":
            rw = data_ratio(s, fc)
            meta = s.get("cache_meta_bytes_per_tx")
            g.append(f"- Small cache: sce ≥ 3x flashcache-like's steady TPS with ≤ 0.5x its "
                     f"cache data bytes per transaction (pages populated and written): "
                     f"{r:.2f}x TPS, {num(rw, '.2f')}x data bytes "
                     f"({num(s.get('cache_data_bytes_per_tx'))} against "
                     f"{num(fc.get('cache_data_bytes_per_tx'))}; sce's metadata apart: "
                     f"{num(meta)}): {met(r >= 3 and rw is not None and rw <= 0.5)}.")
        if s.get("t90") and fc.get("t90"):
            rt = s["t90"] / fc["t90"]
            ls, lf = s.get("t_sce_level", {}).get(size), fc.get("t_sce_level", {}).get(size)
            common = (f"; against one level (90% of sce's steady TPS): sce {num(ls)} s, "
                      f"flashcache-like {f'{lf} s' if lf else 'never in ' + str(len(fc['series'])) + ' s'}")
            g.append(f"- Cache {size}: time to 90% of steady TPS ≤ 0.25x flashcache-like's: "
                     f"{s['t90']} s against {fc['t90']} s, {rt:.2f}x: {met(rt <= 0.25)}{common}.")
    k = by.get(("kit", size))
    if k and k.get("steady_tps"):
        r = st / k["steady_tps"]
        bound = (f" (all-flash, the most any cache can reach in this stack, is "
                 f"{fl['steady_tps'] / k['steady_tps']:.2f}x it)" if fl and fl.get("steady_tps")
                 else "")
        g.append(f"- Cache {size}: sce ≥ 10x nbdkit's cache filter: {r:.2f}x{bound}: "
                 f"{met(r >= 10)}.")
    if nc and nc.get("steady_tps"):
        ser = s["series"]
        lows = [statistics.mean(ser[i - 5:i]) for i in range(10, len(ser) + 1)] or [st]
        r, rl = st / nc["steady_tps"], min(lows) / nc["steady_tps"]
        g.append(f"- Cache {size}: sce never below no cache: steady {r:.2f}x, lowest 5 s mean "
                 f"from 5 s on {rl:.2f}x no cache's steady TPS: {met(r >= 1 and rl >= 1)}.")
    return g


def goals_writeback(size, wt, wb, fl):
    """Issue 29's goals for write-back (`sce-wb`) against write-through (`sce`) and
    all-flash: the TPS, the loop device's write latency, and with the small cache the read
    hit ratio and the cache data bytes per transaction."""
    if not wb or not wb.get("steady_tps"):
        return []
    g = []
    st, sw = wb["steady_tps"], wt["steady_tps"]
    r = st / sw if sw else None
    if size == "large" and fl and fl.get("steady_tps"):
        rf = st / fl["steady_tps"]
        lw, lf = wb.get("dev_write_ms"), fl.get("dev_write_ms")
        rl = lw / lf if lw is not None and lf else None
        g.append(f"- Cache that holds the database: write-back ≥ 0.9x all-flash and ≥ 1.5x "
                 f"write-through: {rf:.2f}x and {num(r, '.2f')}x: "
                 f"{met(rf >= 0.9 and r is not None and r >= 1.5)}.")
        g.append(f"- Cache that holds the database: write-back's device write latency ≤ 1.2x "
                 f"all-flash's: {num(lw, '.2f')} against {num(lf, '.2f')} ms, "
                 f"{num(rl, '.2f')}x: {met(rl is not None and rl <= 1.2)}.")
    if size == "small":
        hb, ht = wb.get("hit_last_third"), wt.get("hit_last_third")
        rw = data_ratio(wb, wt)
        ok = (r is not None and r >= 1.5 and hb is not None and ht is not None
              and hb >= ht - 0.02 and rw is not None and rw <= 1.2)
        g.append(f"- Small cache: write-back ≥ 1.5x write-through's steady TPS, with a read "
                 f"hit ratio ≥ write-through's − 0.02 and ≤ 1.2x its cache data bytes per "
                 f"transaction: {num(r, '.2f')}x TPS, hit ratio {num(hb, '.3f')} against "
                 f"{num(ht, '.3f')}, {num(rw, '.2f')}x data bytes "
                 f"({num(wb.get('cache_data_bytes_per_tx'))} against "
                 f"{num(wt.get('cache_data_bytes_per_tx'))}; metadata apart: "
                 f"{num(wb.get('cache_meta_bytes_per_tx'))} against "
                 f"{num(wt.get('cache_meta_bytes_per_tx'))}): {met(ok)}.")
    return g


# ---------------------------------------------------------------------------------------------


MODES = {  # scale, image size, seconds, PostgreSQL memory cap, shared_buffers, clients, sizes
    "short": dict(scale=4, image_size=320 * MiB, seconds=8, pg_mem=64 * MiB,
                  shared_buffers="16MB", clients=4, sizes="small", max_wal="64MB",
                  checkpoint="30s", kill_seconds=8, kill_after=6, amcheck="light"),
    "default": dict(scale=40, image_size=1536 * MiB, seconds=60, pg_mem=192 * MiB,
                    shared_buffers="32MB", clients=8, sizes="large,small", max_wal="256MB",
                    checkpoint="60s", kill_seconds=90, kill_after=60, amcheck="light"),
    "full": dict(scale=100, image_size=3 * GiB, seconds=180, pg_mem=256 * MiB,
                 shared_buffers="32MB", clients=8, sizes="large,small", max_wal="512MB",
                 checkpoint="60s", kill_seconds=120, kill_after=60, amcheck="light"),
}


def parse_size(s):
    s = s.strip()
    for suf, mul in (("GiB", GiB), ("MiB", MiB), ("G", GiB), ("M", MiB)):
        if s.endswith(suf):
            return int(float(s[:-len(suf)]) * mul)
    return int(s)


def config_names(opt, text):
    """The configurations named in `text` (comma-separated), old names mapped to their new
    ones (said once); an unknown name ends the script, naming the known ones."""
    out = []
    for c in (x.strip() for x in text.split(",")):
        if not c:
            continue
        if c in ALIASES:
            log(f"{opt}: {c} is now called {ALIASES[c]}")
            c = ALIASES[c]
        if c not in CONFIGS:
            sys.exit(f"{opt}: unknown configuration {c} (of {', '.join(CONFIGS)})")
        if c not in out:
            out.append(c)
    return out


def epilog():
    """--help's list of configurations: what each runs and what it does with a FLUSH."""
    lines = ["configurations (--configs; * the default set):"]
    for name, (label, kind, extra) in CONFIGS.items():
        what = {"source": "nothing in front of the source", "kit": "nbdkit --filter=cache "
                "cache=writethrough", "flash": "sce serve --source <local copy of the image>"
                }.get(kind, "sce serve " + (" ".join(extra) or "(its defaults)"))
        lines.append(f"  {'*' if name in MAIN else ' '} {name:14} {label}: {what}")
    lines += ["", "what each does with a client's FLUSH (each commit of PostgreSQL waits for "
              "one):"]
    for name in ("nocache", "flash", "sce", "sce-wb", "kit"):
        lines.append(f"  {name:14} {flush_of(name)}")
    lines += ["", "flashcache runs as flashcache runs in write-through, without persistent "
              "metadata or journal\n(--no-persist); runs 1-7 of docs/REPRODUCTION.md ran it "
              "with them, now fc-persist."]
    return "\n".join(lines)


def args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=epilog(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="the test suite's run: about 2 min, "
                    "scale 4, the small cache only, 8 s per configuration")
    ap.add_argument("--full", action="store_true", help="the full run: scale 100, 180 s per "
                    "configuration, both cache sizes (about 50 min)")
    ap.add_argument("--sce", help="a prebuilt sce binary (default: build target/release/sce)")
    ap.add_argument("--configs", help="of " + ", ".join(CONFIGS) + " (below; default: "
                    + ", ".join(MAIN) + "; with --short: " + ", ".join(MAIN_SHORT) + ", the "
                    "test suite's set; the others are the ablations)")
    ap.add_argument("--sizes", help="cache sizes to run: large (holds the database), small "
                    "(--small-fraction of it)")
    ap.add_argument("--small-fraction", type=float, default=0.35)
    ap.add_argument("--seconds", type=int, help="pgbench run per configuration")
    ap.add_argument("--scale", type=int, help="pgbench scale (15 MiB each)")
    ap.add_argument("--image-size", type=parse_size)
    ap.add_argument("--pg-mem", type=parse_size, help="memory cgroup cap of PostgreSQL")
    ap.add_argument("--shared-buffers")
    ap.add_argument("--clients", type=int)
    ap.add_argument("--dist", default="exponential:5", help="aids: uniform, exponential[:P], "
                    "gaussian[:P], zipfian[:S] (pgbench's random_* functions)")
    ap.add_argument("--fuse-connections", type=int, default=16, help="nbdfuse's connections "
                    "to each export (its -C, default 4 there: 4 requests in flight, where a "
                    "kernel NBD client or iSCSI initiator keeps dozens; 16 gives about 8, the "
                    "most its 10 FUSE threads allow)")
    ap.add_argument("--delay", default="2ms", help="the source's delay per request")
    ap.add_argument("--source-uri", help="an NBD export to use as the source instead (its "
                    "contents are overwritten with the base image before each configuration)")
    ap.add_argument("--kill-test", action="store_true", help="also SIGKILL sce serve under "
                    "pgbench and check the recovery")
    ap.add_argument("--kill-configs", default=",".join(KILL), help="the sce configurations "
                    "the kill test runs, one after the other (default: " + ",".join(KILL)
                    + ": write-through and write-back)")
    ap.add_argument("--kill-seconds", type=int)
    ap.add_argument("--kill-after", type=int)
    ap.add_argument("--heapallindexed", action="store_true", help="pg_amcheck --heapallindexed")
    ap.add_argument("--amcheck", choices=("full", "light"), help="pg_amcheck every relation "
                    "(full), or all but the accounts heap, which the invariant's sums read in "
                    "full (light, the default: through the flashcache-like configuration a "
                    "second full read of it takes minutes)")
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install the "
                    "missing Debian packages (by default, as root, they are installed)")
    ap.add_argument("--keep-base", help="keep (and reuse) the base image in this directory")
    ap.add_argument("--pg-bin", help="PostgreSQL's bin directory (default: the newest "
                    "/usr/lib/postgresql/N/bin)")
    ap.add_argument("--out", help="also write the Markdown report here")
    ap.add_argument("--json", help="write every figure as JSON here")
    ap.add_argument("--plot", help="TPS over time as SVG (default: next to --out)")
    a = ap.parse_args()
    mode = MODES["short" if a.short else "full" if a.full else "default"]
    for k, v in mode.items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    if a.configs is None:
        a.configs = ",".join(MAIN_SHORT if a.short else MAIN)
    a.configs = config_names("--configs", a.configs)
    a.kill_configs = config_names("--kill-configs", a.kill_configs)
    for c in a.kill_configs:
        if CONFIGS[c][1] != "sce":
            sys.exit(f"--kill-configs: {c} is not an sce configuration (the test kills sce "
                     "serve)")
    a.sizes = [s.strip() for s in a.sizes.split(",")]
    if any(s not in ("large", "small") for s in a.sizes):
        sys.exit("--sizes: large and/or small")
    if a.plot is None and a.out:
        a.plot = os.path.splitext(a.out)[0] + "-tps.svg"
    return a


def main():
    a = args()
    pg = preflight(a)
    if not a.sce:
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "sce"], cwd=ROOT, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
        a.sce = os.path.join(target, "release", "sce")
    a.sce = os.path.abspath(a.sce)
    d = tempfile.mkdtemp(prefix="sce-db.", dir=os.environ.get("TMPDIR", "/var/tmp"))
    os.chmod(d, 0o755)  # the postgres user reaches its socket and log directory below it
    stack = Stack()
    stack.push(f"remove {d}", lambda: shutil.rmtree(d, ignore_errors=True))
    ctx = Ctx(a, pg, d)
    ctx.panels = []
    stack.push("stop every process started", ctx.procs.stop_all)

    interrupted = []

    def on_signal(sig, _frame):
        # Only the first: a second Ctrl-C must not interrupt the cleanup the first started.
        if not interrupted:
            interrupted.append(sig)
            raise KeyboardInterrupt(f"signal {sig}")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    rows, kills, t_start = [], [], time.time()
    try:
        write_script(ctx)
        ctx.cgroup = make_cgroup(a.pg_mem, stack)
        log("== PostgreSQL's memory: " + (f"cgroup {ctx.cgroup}, {fmt_size(a.pg_mem)}"
                                          if ctx.cgroup else "no cgroup could be made"))
        ctx.base, ctx.meta = base_image(ctx)
        db = ctx.meta["db_bytes"]
        large = ((ctx.meta["image_size"] + 64 * MiB + MiB - 1) // MiB) * MiB
        small = max(16 * MiB, int(db * a.small_fraction) // MiB * MiB)
        sizes = [(s, large if s == "large" else small) for s in a.sizes]
        done_uncached = False
        for size, cache in sizes:
            for name in a.configs:
                if CONFIGS[name][1] not in CACHED:
                    if done_uncached:
                        continue
                rows.append(run_config(ctx, name, size, cache))
            done_uncached = True
        if a.kill_test:
            size, cache = sizes[-1]
            for name in a.kill_configs:
                kills.append(kill_test(ctx, name, size, cache))
    except KeyboardInterrupt as e:
        log(f"bench-db: interrupted ({e}); cleaning up")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.unwind()
        sys.exit(130)
    except Failed as e:
        log(f"bench-db: {e}")
        stack.unwind()
        sys.exit(1)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.unwind()
    out = report(ctx, rows, sizes, kills, sys.argv[1:])
    out[3:3] = [f"Run time {(time.time() - t_start) / 60:.1f} min.", ""]
    text = "\n".join(out) + "\n"
    print(text, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.plot:
        svg_plot(ctx.panels, a.plot)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": ctx.meta, "memory_cgroup": bool(ctx.cgroup),
                       "configs": [{k: v for k, v in r.items() if k != "tx"} for r in rows],
                       # kill_test: the first kill test (write-through by default), as
                       # before; kill_tests: every one.
                       "kill_test": kills[0] if kills else None, "kill_tests": kills},
                      f, indent=1)
    bad = ([r for r in rows if not r["check_ok"]]
           + [dict(k, label=f"kill test, {k['label']}") for k in kills if not k["check_ok"]])
    if bad:
        log("bench-db: FAILED: " + "; ".join(r["label"] + ": " +
                                              str(r.get("error") or r.get("check")) for r in bad))
        sys.exit(1)


if __name__ == "__main__":
    main()
