#!/usr/bin/env bash
# qemu-img convert of a sparse image, one run, side by side: `qemu-img convert -O raw` of a
# 2 GiB file holding 320 MiB of scattered data (1 MiB and 4-64 KiB extents), read over NBD
# from (1) nbdkit's file plugin, (2) sce serve without a cache, (3) sce serve with a cache,
# first cold (every read a miss) and then warm, (4) the same in write-back, cold. Each convert runs with the page cache
# dropped first (root), so that every server reads the source from the disk, as a server of
# a SAN volume would. Three rounds, alternated; prints each time, the medians, and the
# speed ratios against nbdkit (time of nbdkit / time of sce: >= 1.0 is at least as fast).
# Part of the serving benchmark (scripts/bench-serve.sh); runs alone as well.
# Usage: scripts/bench-convert.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
cargo build --release -q -p sce
sce=$PWD/target/release/sce
dir=$(mktemp -d "${TMPDIR:-/tmp}/sce-convert.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
python3 - "$dir/src.img" <<'PY'
import os, random, sys
random.seed(1)
with open(sys.argv[1], "wb") as f:
    f.truncate(2 << 30)
    total = 0
    while total < 320 << 20:
        if random.random() < 0.5:
            at, n = random.randrange(0, 2047) << 20, 1 << 20
        else:
            at, n = random.randrange(0, (2 << 30) >> 12) << 12, 4096 * random.randint(1, 16)
            at = min(at, (2 << 30) - n)
        f.seek(at)
        f.write(os.urandom(n))
        total += n
PY
wait_sock() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1" >&2; exit 1; }
drop=yes
sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || drop="no (not root: the page cache stays warm)"
convert() {  # SOCKET -> seconds
  sync; [ "$drop" = yes ] && echo 3 >/proc/sys/vm/drop_caches
  local t0 t1; t0=$(date +%s.%N)
  qemu-img convert -O raw "nbd+unix:///?socket=$1" "$dir/out.raw"
  t1=$(date +%s.%N)
  cmp -s "$dir/out.raw" "$dir/src.img" || { echo "convert from $1 differs from the image" >&2; exit 1; }
  rm -f "$dir/out.raw"
  python3 -c "print(round($t1 - $t0, 3))"
}
# nbdkit on a copy: sce holds its source locked while it serves it.
cp --sparse=always "$dir/src.img" "$dir/kit.img"
nbdkit -f -U "$dir/kit.sock" file file="$dir/kit.img" 2>/dev/null &
pids+=($!)
"$sce" serve --source "$dir/src.img" --listen "unix:$dir/plain.sock" 2>/dev/null &
pids+=($!)
wait_sock "$dir/kit.sock"; wait_sock "$dir/plain.sock"
kit=(); plain=(); cold=(); warm=(); wb=()
for r in $(seq "$rounds"); do
  kit+=("$(convert "$dir/kit.sock")")
  plain+=("$(convert "$dir/plain.sock")")
done
kill "${pids[1]}"; wait "${pids[1]}" 2>/dev/null || true
for r in $(seq "$rounds"); do
  rm -f "$dir/cache"
  "$sce" serve --source "$dir/src.img" --cache "$dir/cache" --cache-size 1GiB \
      --listen "unix:$dir/cached.sock" 2>/dev/null &
  p=$!
  wait_sock "$dir/cached.sock"
  cold+=("$(convert "$dir/cached.sock")")
  warm+=("$(convert "$dir/cached.sock")")
  kill "$p"; wait "$p" 2>/dev/null || true
  # Write-back reports the source's holes less where it holds dirty data.
  rm -f "$dir/cache"
  "$sce" serve --source "$dir/src.img" --cache "$dir/cache" --cache-size 1GiB --mode writeback \
      --listen "unix:$dir/cached.sock" 2>/dev/null &
  p=$!
  wait_sock "$dir/cached.sock"
  wb+=("$(convert "$dir/cached.sock")")
  kill "$p"; wait "$p" 2>/dev/null || true
done
python3 - "$drop" "${kit[*]}" "${plain[*]}" "${cold[*]}" "${warm[*]}" "${wb[*]}" <<'PY'
import statistics as st, sys
drop, *runs = sys.argv[1:]
kit, plain, cold, warm, wb = ([float(x) for x in r.split()] for r in runs)
k = st.median(kit)
print("qemu-img convert -O raw, 2 GiB sparse image with 320 MiB of scattered data")
print(f"  page cache dropped before each convert: {drop}")
rows = [("nbdkit file plugin", kit), ("sce serve, no cache", plain),
        ("sce serve, cache cold (all misses)", cold), ("sce serve, cache warm", warm),
        ("sce serve, writeback, cache cold", wb)]
for name, r in rows:
    m = st.median(r)
    print(f"  {name:<36} median {m:6.3f} s  runs {' '.join(f'{x:.3f}' for x in r)}"
          f"  speed vs nbdkit {k / m:.2f}x")
PY
