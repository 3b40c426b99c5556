#!/usr/bin/env bash
# Admission comparison over NBD, one run per configuration, side by side: fio's nbd engine
# drives an OLTP-like load (8 KiB random I/O, 87% reads, Zipf-skewed, iodepth 16, the same
# seed every time) against a cold cache in front of one slow source, and the script prints
# IOPS, latency, read hit ratio and cache bytes written, per configuration and per half of
# the run, then the ratios of sce to each other configuration and a Markdown table.
#
# The slow source: a sparse file served by nbdkit's file plugin behind its delay filter
# (rdelay = wdelay = DELAY) on a Unix socket, created afresh for every configuration, so
# every configuration starts from the same source contents. Every cache is an NBD client of
# that server:
#   sce              sce serve --admission sce (the default: flash-conscious)
#   sce-paper        sce serve --admission sce-paper (the paper's Algorithm 1, sce before)
#   flashcache-like  sce serve --fragment-size 4KiB --admission always --mode write-through --eviction lru
#   nbdkit-cache     nbdkit --filter=cache --filter=stats nbd socket=SOURCE cache=writethrough
#                    cache-on-read=true cache-max-size=CACHE (cache-min-block-size: default, 64K)
#   source           fio straight at the source server
# nbdkit's cache filter runs in its own process, in front of the source server through the
# nbd plugin (not stacked on the file plugin in one process): the cache then sits above the
# same delay as sce's, and every byte that process writes to disk is a cache write, which
# /proc/PID/io write_bytes counts (buffered writes, counted when a page turns dirty: a page
# rewritten before writeback counts once, so this is a lower bound). Its cache file is in the
# page cache, while sce's is opened with O_DIRECT. The stats filter under the cache counts
# the requests that reach the source (printed when nbdkit exits): every read or write that
# finds its 64K block uncached reads the block there, which gives a request hit ratio. Note
# that nbdkit 1.32's cache filter holds one lock over every block operation, source reads
# included: it has one request in flight to the source at a time.
# sce's NBD client sends one request per source connection at a time (--source-connections,
# default 4), fio pipelines 16 on its one connection: SCE_ARGS="--source-connections 16"
# gives sce the same depth toward the source.
# fio's zipf hashes each rank to an offset: hot 8 KiB blocks are scattered over the whole
# source, so a 1 MiB fragment holds few of them and 4 KiB fragments (flashcache-like) hold
# more hot data in the same cache (use ZIPF or CONFIGS to vary; fio has no locality knob).
#
# Usage: scripts/bench-admission.sh [SIZE] [CACHE] [SECONDS]
#   SIZE     source size (default 4GiB; env SIZE)
#   CACHE    cache size (default 1GiB; env CACHE)
#   SECONDS  length of each fio run (default 60; env RUN_SECONDS, or QUICK=1 for 10 s;
#            bash owns the variable SECONDS, so it cannot be the environment's name)
# Environment: DELAY (source latency, default 2ms), RATE (the source's bandwidth, in bits
# per second as nbdkit's rate filter takes it, e.g. 200M: a source whose link is the limit;
# default none), ZIPF (theta, default 0.99: fio refuses
# 1.0), SEED (fio --randseed, default 42), CONFIGS (a comma-separated subset of the names
# above, in the order to run), SCE_ARGS (more flags for every sce serve), SCE (a prebuilt
# sce binary: skips the build), STATS_OUT (a directory: each configuration's counters at
# the end of its run, as NAME.json), TMPDIR.
set -euo pipefail
cd "$(dirname "$0")/.."

quick_secs=60
case "${QUICK:-}" in 1|true|yes) quick_secs=10 ;; esac
size_arg=${1:-${SIZE:-4GiB}}
cache_arg=${2:-${CACHE:-1GiB}}
secs=${3:-${RUN_SECONDS:-$quick_secs}}
delay=${DELAY:-2ms}
zipf=${ZIPF:-0.99}
seed=${SEED:-42}
configs=${CONFIGS:-sce,sce-paper,flashcache-like,nbdkit-cache,source}
read -r -a sce_args <<<"${SCE_ARGS:-}"
half=$(( secs / 2 ))
[ "$half" -ge 1 ] || { echo "a run must last at least 2 s" >&2; exit 2; }

bytes() {  # 4GiB, 4G, 512MiB, 4096 -> bytes (K, M, G, T are binary, as in sce and nbdkit)
  python3 - "$1" <<'PY'
import re, sys
m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", sys.argv[1], re.I)
if not m:
    sys.exit(f"not a size: {sys.argv[1]}")
print(int(m[1]) << (10 * " KMGT".index((m[2] or " ").upper())))
PY
}
size=$(bytes "$size_arg")
cache_size=$(bytes "$cache_arg")

for tool in fio nbdkit python3; do
  command -v "$tool" >/dev/null || { echo "$tool is missing (Debian: fio, nbdkit)" >&2; exit 1; }
done
# What runs: the tree at HEAD, and whether the crates differed from it, or a given binary.
rev="git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
git diff --quiet HEAD -- crates Cargo.toml Cargo.lock 2>/dev/null || rev="$rev + uncommitted changes in crates/"
[ -z "${SCE:-}" ] || rev="sce binary $SCE"
if [ -n "${SCE:-}" ]; then
  sce=$SCE
else
  cargo build --release -q -p sce
  sce=${CARGO_TARGET_DIR:-$PWD/target}/release/sce
fi

dir=$(mktemp -d "${TMPDIR:-/tmp}/sce-admission.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
# Servers never outlive the script by more than this, even if it is killed with SIGKILL
# (nbdkit also gets --exit-with-parent).
limit=$(( 4 * secs + 300 ))
extra=()
if [ "$(stat -f -c %T "$dir")" = tmpfs ]; then
  echo "WARNING: $dir is on tmpfs, which refuses O_DIRECT: sce falls back to buffered I/O" >&2
  extra=(--allow-buffered)
fi

wait_sock() { for _ in $(seq 400); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1" >&2; exit 1; }
stop() {  # PID: SIGTERM (sce flushes and exits), then wait
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
}

src_uri="nbd+unix:///?socket=$dir/src.sock"
rate_args=() rate_param=()  # nbdkit takes filters before the plugin, parameters after it
[ -z "${RATE:-}" ] || { rate_args=(--filter=rate); rate_param=(rate="$RATE"); }
start_source() {
  rm -f "$dir/source" "$dir/src.sock"
  truncate -s "$size" "$dir/source"
  nbdkit -f --exit-with-parent -U "$dir/src.sock" "${rate_args[@]}" --filter=delay \
      file file="$dir/source" rdelay="$delay" wdelay="$delay" "${rate_param[@]}" 2>>"$dir/source.log" &
  src_pid=$!
  pids+=("$src_pid")
  wait_sock "$dir/src.sock"
}

fio_cmd=(fio --name=oltp --ioengine=nbd --rw=randrw --rwmixread=87 --bs=8k
         --random_distribution="zipf:$zipf" --iodepth=16 --size="$size" --time_based
         --runtime="$secs" --randseed="$seed" --lat_percentiles=1 --output-format=json
         --status-interval="$half")

# probe KIND TARGET: the counters of a cache, as one line of JSON.
probe() {
  case "$1" in
    sce) "$sce" stats --metrics "$2" --json | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["exports"][""]))' ;;
    kit) python3 -c 'import json,sys; print(json.dumps(dict(l.strip().split(": ") for l in open(sys.argv[1]))))' "/proc/$2/io" ;;
    none) echo '{}' ;;
  esac
}

# CPU seconds (user + system) a process has used so far; 0 if there is none.
cpu() {
  [ -n "$1" ] && [ -r "/proc/$1/stat" ] || { echo 0; return; }
  python3 -c 'import os,sys; f=open(sys.argv[1]).read().rsplit(")",1)[1].split(); print((int(f[11])+int(f[12]))/os.sysconf("SC_CLK_TCK"))' "/proc/$1/stat"
}

# run NAME KIND TARGET URI SERVER-COMMAND [SERVER-PID]: one fio run, counters before, at
# half time, after; CPU time of the cache server and of the source server during the run.
run() {
  local name=$1 kind=$2 target=$3 uri=$4 server=$5 server_pid=${6:-}
  echo "== $name: $secs s" >&2
  local c0 s0
  c0=$(cpu "$server_pid"); s0=$(cpu "$src_pid")
  probe "$kind" "$target" >"$dir/$name.p0"
  "${fio_cmd[@]}" --uri="$uri" --output="$dir/$name.fio" &
  local fio_pid=$!
  pids+=("$fio_pid")
  sleep "$half" &  # in the background: a signal to the script is handled at once
  pids+=($!)
  wait $!
  probe "$kind" "$target" >"$dir/$name.p1"
  wait "$fio_pid"
  probe "$kind" "$target" >"$dir/$name.p2"
  [ -z "${STATS_OUT:-}" ] || { mkdir -p "$STATS_OUT" && cp "$dir/$name.p2" "$STATS_OUT/$name.json"; }
  local c1 s1
  c1=$(cpu "$server_pid"); s1=$(cpu "$src_pid")
  python3 -c 'import json,sys; a=sys.argv[1:]; print(json.dumps(dict(name=a[0], kind=a[1], uri=a[2], server=a[3], cpu_cache=float(a[5])-float(a[4]), cpu_source=float(a[7])-float(a[6]))))' \
      "$name" "$kind" "$uri" "$server" "$c0" "$c1" "$s0" "$s1" >>"$dir/manifest"
}

sce_config() {  # NAME ARGS...: sce serve with these admission flags
  local name=$1; shift
  local args=(--source "$src_uri" --cache "$dir/cache" --cache-size "$cache_size"
              --listen "unix:$dir/cache.sock" --metrics 127.0.0.1:0 --state-dir "$dir/state"
              "${extra[@]}" "${sce_args[@]}" "$@")
  rm -f "$dir/cache" "$dir/cache.sock"
  timeout "$limit" "$sce" serve "${args[@]}" 2>"$dir/$name.log" &
  local pid=$!
  pids+=("$pid")
  wait_sock "$dir/cache.sock"
  local metrics=""
  for _ in $(seq 100); do
    metrics=$(grep -o 'metrics on http://[0-9.]*:[0-9]*' "$dir/$name.log" | grep -o '[0-9.]*:[0-9]*$' || true)
    [ -n "$metrics" ] && break
    sleep 0.05
  done
  [ -n "$metrics" ] || { echo "sce serve printed no metrics address" >&2; cat "$dir/$name.log" >&2; exit 1; }
  # timeout's child is sce serve
  run "$name" sce "$metrics" "nbd+unix:///?socket=$dir/cache.sock" "sce serve ${args[*]}" \
      "$(cat "/proc/$pid/task/$pid/children" 2>/dev/null | awk '{print $1}')"
  stop "$pid"
}

kit_config() {
  local args=(-f --exit-with-parent -U "$dir/cache.sock" --filter=cache --filter=stats
              nbd socket="$dir/src.sock" cache=writethrough cache-on-read=true
              cache-max-size="$cache_size" statsfile="$dir/nbdkit-cache.stats")
  rm -f "$dir/cache.sock"
  mkdir -p "$dir/kit-tmp"
  TMPDIR="$dir/kit-tmp" nbdkit "${args[@]}" 2>"$dir/nbdkit-cache.log" &
  local pid=$!
  pids+=("$pid")
  wait_sock "$dir/cache.sock"
  run nbdkit-cache kit "$pid" "nbd+unix:///?socket=$dir/cache.sock" "TMPDIR=$dir/kit-tmp nbdkit ${args[*]}" "$pid"
  stop "$pid"
}

for c in ${configs//,/ }; do
  start_source
  case "$c" in
    sce) sce_config sce --admission sce ;;
    sce-paper) sce_config sce-paper --admission sce-paper ;;
    flashcache-like) sce_config flashcache-like --fragment-size 4KiB --admission always --mode write-through --eviction lru ;;
    nbdkit-cache) kit_config ;;
    source) run source none "" "$src_uri" "" ;;
    *) echo "unknown configuration $c" >&2; exit 2 ;;
  esac
  stop "$src_pid"
done

source_cmd="nbdkit -f -U $dir/src.sock ${rate_args[*]} --filter=delay file file=$dir/source rdelay=$delay wdelay=$delay ${rate_param[*]}  (a fresh sparse $size_arg file per configuration)"
python3 - "$dir" "$secs" "$source_cmd" "${fio_cmd[*]}" "scripts/bench-admission.sh $size_arg $cache_arg $secs" \
    "DELAY=$delay RATE=${RATE:-none} ZIPF=$zipf SEED=$seed CONFIGS=$configs SCE_ARGS='${SCE_ARGS:-}'" "$rev" <<'PY'
import json, re, sys

dir, secs, source_cmd, fio_cmd, cmd, env, rev = sys.argv[1:]
secs = int(secs)
MiB = 1 << 20

def fio_docs(path):
    text, dec, i, docs = open(path).read(), json.JSONDecoder(), 0, []
    while (j := text.find("{", i)) >= 0:
        doc, i = dec.raw_decode(text, j)
        docs.append(doc["jobs"][0])
    return docs

def ios(job):
    return job["read"]["total_ios"] + job["write"]["total_ios"]

def lat(job, rw):
    l = job[rw]["lat_ns"]
    return l["mean"] / 1e6, l.get("percentile", {}).get("99.000000", 0) / 1e6

rows = []
for line in open(f"{dir}/manifest"):
    m = json.loads(line)
    name = m["name"]
    docs = fio_docs(f"{dir}/{name}.fio")
    final = docs[-1]
    mid = min(docs[:-1] or docs, key=lambda d: abs(d["job_runtime"] - secs * 500))
    rt, rt1 = final["job_runtime"] / 1e3, mid["job_runtime"] / 1e3
    r = {"name": name, "kind": m["kind"], "server": m["server"], "uri": m["uri"],
         "iops": ios(final) / rt, "iops1": ios(mid) / rt1,
         "iops2": (ios(final) - ios(mid)) / max(rt - rt1, 1e-9),
         "read": lat(final, "read"), "write": lat(final, "write"),
         "cpu_cache": m["cpu_cache"], "cpu_source": m["cpu_source"], "n_ios": ios(final)}
    p = [json.load(open(f"{dir}/{name}.p{k}")) for k in range(3)]
    if m["kind"] == "sce":
        def d(key, a, b):
            return p[b][key] - p[a][key]
        def hit(a, b):
            h, miss = d("read_pages_hit", a, b), d("read_pages_missed", a, b)
            return h / max(h + miss, 1)
        r.update(hit=hit(0, 2), hit1=hit(0, 1), hit2=hit(1, 2),
                 cw=d("cache_bytes_written", 0, 2), cw1=d("cache_bytes_written", 0, 1),
                 cw2=d("cache_bytes_written", 1, 2), src_read=d("source_bytes_read", 0, 2),
                 populated=d("fragments_populated", 0, 2), evicted=d("fragments_evicted", 0, 2),
                 free=f'{p[2]["free_slots"]}/{p[2]["total_slots"]}')
    elif m["kind"] == "kit":
        def d(a, b):
            return int(p[b]["write_bytes"]) - int(p[a]["write_bytes"])
        r.update(cw=d(0, 2), cw1=d(0, 1), cw2=d(1, 2))
        try:  # "read: N ops, ..." of the stats filter under the cache: requests to the source
            stats = open(f"{dir}/{name}.stats").read()
            src_reads = int(re.search(r"^read: (\d+) ops", stats, re.M)[1])
            src_read_mib = re.search(r"^read: \d+ ops, [^,]*, ([^,]*),", stats, re.M)[1]
            r.update(req_hit=1 - src_reads / max(ios(final), 1), src_reads=src_reads,
                     src_read_mib=src_read_mib)
        except (OSError, TypeError):
            pass
    rows.append(r)
by = {r["name"]: r for r in rows}

def mib(x):
    return f"{x / MiB:,.0f}"

print()
print(f"# admission over NBD: {cmd}  ({env}; {rev})")
print(f"slow source: {source_cmd}")
print(f"load:        {fio_cmd} --uri=<configuration>")
for r in rows:
    if r["server"]:
        print(f"{r['name']:>16}: {r['server']}")
print()
for r in rows:
    print(f"{r['name']:>16}: {r['iops']:8.0f} IOPS (1st half {r['iops1']:.0f}, 2nd half {r['iops2']:.0f}); "
          f"read lat mean {r['read'][0]:.2f} ms p99 {r['read'][1]:.2f} ms; "
          f"write lat mean {r['write'][0]:.2f} ms p99 {r['write'][1]:.2f} ms")
    cpu = f"CPU: source server {r['cpu_source']:.1f} s ({1e6 * r['cpu_source'] / max(r['n_ios'], 1):.0f} µs per request)"
    if r["kind"] != "none":
        cpu = (f"CPU: cache server {r['cpu_cache']:.1f} s ({1e6 * r['cpu_cache'] / max(r['n_ios'], 1):.0f} µs "
               f"per request), " + cpu[5:])
    print(f"{'':>18}{cpu}")
    if r["kind"] == "sce":
        print(f"{'':>18}read hit ratio {r['hit']:.3f} (1st half {r['hit1']:.3f}, 2nd half {r['hit2']:.3f}); "
              f"cache bytes written {mib(r['cw'])} MiB (1st {mib(r['cw1'])}, 2nd {mib(r['cw2'])}); "
              f"source read {mib(r['src_read'])} MiB; fragments populated {r['populated']}, evicted {r['evicted']}; "
              f"free slots at end {r['free']}")
    elif r["kind"] == "kit":
        print(f"{'':>18}cache bytes written {mib(r['cw'])} MiB (1st {mib(r['cw1'])}, 2nd {mib(r['cw2'])}) "
              f"(/proc/PID/io write_bytes of the nbdkit cache process: pages dirtied, a lower bound)")
        if "req_hit" in r:
            print(f"{'':>18}source read {r['src_read_mib']} in {r['src_reads']} requests (stats filter); request "
                  f"hit ratio, reads and writes (a write reads its block first) {r['req_hit']:.3f}")

sce = by.get("sce")
if sce:
    print()
    print("ratios, sce / other:")
    for o in ("sce-paper", "flashcache-like", "nbdkit-cache", "source"):
        if o in by:
            x = by[o]
            print(f"  IOPS vs {o:<16} {sce['iops'] / x['iops']:6.2f}x   "
                  f"(1st half {sce['iops1'] / x['iops1']:.2f}x, 2nd half {sce['iops2'] / x['iops2']:.2f}x)")
    for o in ("sce-paper", "flashcache-like", "nbdkit-cache"):
        if o in by and "cw" in by[o]:
            x = by[o]
            ratio = lambda a, b: f"{a / b:.3f}" if b else "n/a"
            note = "  (nbdkit: pages dirtied, a lower bound)" if o == "nbdkit-cache" else ""
            print(f"  cache bytes written vs {o:<16} {ratio(sce['cw'], x['cw']):>6}   "
                  f"(1st half {ratio(sce['cw1'], x['cw1'])}, 2nd half {ratio(sce['cw2'], x['cw2'])}){note}")
    for o in ("sce-paper", "flashcache-like"):
        if o in by:
            x = by[o]
            print(f"  read hit ratio, sce minus {o:<16} {100 * (sce['hit'] - x['hit']):+6.1f} pp   "
                  f"(1st half {100 * (sce['hit1'] - x['hit1']):+.1f}, 2nd half {100 * (sce['hit2'] - x['hit2']):+.1f})")

print()
print(f"| configuration | IOPS | IOPS 1st / 2nd half | read lat mean / p99 (ms) | write lat mean / p99 (ms) "
      f"| read hit ratio (1st / 2nd half) | cache MiB written (1st / 2nd half) | IOPS: sce / this |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    hit = f"{r['hit']:.3f} ({r['hit1']:.3f} / {r['hit2']:.3f})" if "hit" in r else "—"
    if "req_hit" in r:
        hit = f"{r['req_hit']:.3f} ²"
    cw = f"{mib(r['cw'])} ({mib(r['cw1'])} / {mib(r['cw2'])})" if "cw" in r else "—"
    if r["kind"] == "kit":
        cw += " ¹"
    vs = f"{sce['iops'] / r['iops']:.2f}x" if sce else "—"
    print(f"| {r['name']} | {r['iops']:.0f} | {r['iops1']:.0f} / {r['iops2']:.0f} "
          f"| {r['read'][0]:.2f} / {r['read'][1]:.2f} | {r['write'][0]:.2f} / {r['write'][1]:.2f} "
          f"| {hit} | {cw} | {vs} |")
if "nbdkit-cache" in by:
    print()
    print("¹ /proc/PID/io write_bytes of the nbdkit cache process (its cache file is buffered: pages "
          "dirtied, a page rewritten before writeback counts once).")
    print("² nbdkit: requests, reads and writes, whose 64 KiB block was cached (from the requests that "
          "reached the source, counted by nbdkit's stats filter); sce: 4 KiB pages read.")
PY
