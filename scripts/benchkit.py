"""What the benchmark scripts share: their processes, fio and its figures, `sce serve` and
the 2 ms source. Each script imports it from its own directory (`from benchkit import ...`)."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class Procs:
    """Servers started by the benchmark; all killed at exit."""

    def __init__(self):
        self.procs = []

    def start(self, args, stderr=None, env=None):
        p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr or subprocess.DEVNULL,
                             env=env, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self, p):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        if p in self.procs:
            self.procs.remove(p)

    def stop_all(self):
        for p in list(self.procs):
            self.stop(p)


def cpu_s(p):
    """CPU seconds (user + system) of process `p` (a Popen) so far."""
    with open(f"/proc/{p.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def report(text, path=None):
    """Prints a benchmark's Markdown `text` and, with `path` (--out), writes it there."""
    print(text, flush=True)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")


def wait_sock(path, proc, what):
    end = time.time() + 60
    while time.time() < end:
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode} before listening")
        time.sleep(0.05)
    sys.exit(f"{what} never listened on {path}")


def uri(sock):
    return f"nbd+unix:///?socket={sock}"


def fio(args, iops_log=None):
    """Runs fio with `args` (JSON output); returns the parsed job list and, with `iops_log`
    (a path prefix), the per-second IOPS."""
    cmd = ["fio", "--output-format=json", "--group_reporting"] + args
    if iops_log:
        cmd += [f"--write_iops_log={iops_log}", "--log_avg_msec=1000"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    doc = json.loads(out[out.index("{"):])
    series = None
    if iops_log:
        buckets = {}
        d = os.path.dirname(iops_log) or "."
        for f in os.listdir(d):
            if f.startswith(os.path.basename(iops_log) + "_iops"):
                for line in open(os.path.join(d, f)):
                    t, v = line.split(",")[:2]
                    s = round(int(t) / 1000)
                    buckets[s] = buckets.get(s, 0) + int(v)
                os.unlink(os.path.join(d, f))
        series = [buckets[k] for k in sorted(buckets)]
    return doc["jobs"][0], series


def iops(job):
    return job["read"]["iops"] + job["write"]["iops"]


def mean_ms(job, rw="read"):
    return job[rw]["clat_ns"]["mean"] / 1e6


def p99_ms(job, rw="read"):
    pct = job[rw]["clat_ns"].get("percentile", {})
    return pct.get("99.000000", 0) / 1e6


def http_json(addr, path="/stats"):
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=30) as r:
        return json.loads(r.read())


def read_pages(addr):
    """(pages hit, pages missed) so far by the default export of the `sce serve` whose
    metrics are at `addr`."""
    e = http_json(addr)["exports"][""]
    return e["read_pages_hit"], e["read_pages_missed"]


def warm_until_no_miss(addr, run, passes):
    """Calls `run()` (a pass of reads) until a pass misses nothing, at most `passes` times,
    logging each pass's read hit ratio; returns the last pass's."""
    ratio = 0.0
    for i in range(passes):
        h0, m0 = read_pages(addr)
        run()
        h1, m1 = read_pages(addr)
        h, m = h1 - h0, m1 - m0
        ratio = h / max(h + m, 1)
        log(f"warm-up pass {i + 1}: read hit ratio of the pass {ratio:.4f}")
        if m == 0:
            break
    return ratio


def sce_serve(procs, sce, d, name, args):
    """Starts `sce serve ARGS --listen unix:D/NAME.sock --metrics 127.0.0.1:0`; returns the
    process, the socket and the metrics address."""
    sock = os.path.join(d, f"{name}.sock")
    logf = os.path.join(d, f"{name}.log")
    if os.path.exists(sock):
        os.unlink(sock)
    p = procs.start([sce, "serve", "--listen", f"unix:{sock}", "--metrics", "127.0.0.1:0"] + args,
                    stderr=open(logf, "w"))
    wait_sock(sock, p, f"sce serve ({name})")
    addr = None
    for _ in range(200):
        for line in open(logf):
            if "metrics on http://" in line:
                addr = line.split("metrics on http://")[1].split()[0].split("/")[0]
        if addr:
            break
        time.sleep(0.05)
    return p, sock, addr


def slow_source(procs, d, size="2G", delay="2ms", rate=None):
    """A fresh slow source: `nbdkit --filter=delay memory SIZE rdelay=DELAY wdelay=DELAY -t
    64` on D/src.sock (DELAY 2 ms unless given), behind `--filter=rate rate=RATE` (bits per
    second) if RATE is given. Returns the process and the socket."""
    src_sock = os.path.join(d, "src.sock")
    if os.path.exists(src_sock):
        os.unlink(src_sock)
    limit = (["--filter=rate"], [f"rate={rate}"]) if rate else ([], [])
    src = procs.start(["nbdkit", "-f", "-U", src_sock] + limit[0] + ["--filter=delay", "memory",
                       size, f"rdelay={delay}", f"wdelay={delay}", "-t", "64"] + limit[1])
    wait_sock(src_sock, src, "nbdkit (source)")
    return src, src_sock
