#!/usr/bin/env bash
# Serving benchmark, one run, side by side: fio's nbd engine, 4 KiB random reads at iodepth 32,
# against (1) sce serve with a fully warm cache as large as the data, (2) "all-flash": the
# same server exporting a file on the fast device directly, (3) nbdkit's file plugin on that
# file (through the page cache: this nbdkit has no O_DIRECT), (4) sce serve --buffered on that
# file, which compares the two servers on equal terms. Prints IOPS and the ratios. Then runs
# scripts/bench-convert.sh (qemu-img convert of a sparse image, against nbdkit).
# Usage: scripts/bench-serve.sh [DATA_SIZE] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-512M}
secs=${2:-15}
cargo build --release -q -p sce
sce=$PWD/target/release/sce
dir=$(mktemp -d "${TMPDIR:-/tmp}/sce-bench.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

# The source: a file with data, behind nothing (the cache's value here is its speed, the
# comparison is about serving overhead). The flash file is a copy on the same device.
fio --name=fill --filename="$dir/source" --size="$size" --rw=write --bs=1M --direct=1 \
    --refill_buffers --output=/dev/null
cp "$dir/source" "$dir/flash"

wait_sock() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1" >&2; exit 1; }
randread() {  # URI -> IOPS
  fio --name=rr --ioengine=nbd --uri="$1" --rw=randread --bs=4k --iodepth=32 --size="$size" \
      --time_based --runtime="$2" --output-format=json | python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))'
}

"$sce" serve --source "$dir/source" --cache "$dir/cache" --cache-size "$size" --fragment-size 1MiB --target-missrate 0 \
    --listen "unix:$dir/sce.sock" --metrics 127.0.0.1:0 2>"$dir/sce.log" &
pids+=($!)
wait_sock "$dir/sce.sock"
metrics=$(grep -o '127.0.0.1:[0-9]*' "$dir/sce.log" | head -1)
# Warm until every read hits: random reads drive population of the whole data set.
for i in $(seq 30); do
  randread "nbd+unix:///?socket=$dir/sce.sock" 3 >/dev/null
  hit=$("$sce" stats --metrics "$metrics" --json | python3 -c 'import json,sys; e=json.load(sys.stdin)["exports"][""]; print(e["read_hit_ratio"], e["free_slots"])')
  echo "warm-up pass $i: cumulative read hit ratio and free slots: $hit"
  [ "${hit#* }" = 0 ] && break
done
"$sce" serve --source "$dir/flash" --listen "unix:$dir/flash.sock" 2>/dev/null &
pids+=($!)
wait_sock "$dir/flash.sock"
randread "nbd+unix:///?socket=$dir/sce.sock" 3 >/dev/null
# Alternate the two runs twice and average, so that drift of the device hits both alike.
before=$("$sce" stats --metrics "$metrics" --json)
c1=$(randread "nbd+unix:///?socket=$dir/sce.sock" "$secs")
f1=$(randread "nbd+unix:///?socket=$dir/flash.sock" "$secs")
c2=$(randread "nbd+unix:///?socket=$dir/sce.sock" "$secs")
f2=$(randread "nbd+unix:///?socket=$dir/flash.sock" "$secs")
after=$("$sce" stats --metrics "$metrics" --json)
cached=$(( (c1 + c2) / 2 )); flash=$(( (f1 + f2) / 2 ))
echo "runs: cached $c1 $c2, all-flash $f1 $f2"
measured_hit=$(python3 -c 'import json,sys; a=json.loads(sys.argv[1])["exports"][""]; b=json.loads(sys.argv[2])["exports"][""]; h=b["read_pages_hit"]-a["read_pages_hit"]; m=b["read_pages_missed"]-a["read_pages_missed"]; print(round(h/max(h+m,1),4))' "$before" "$after")

nbdkit -f -U "$dir/kit.sock" file file="$dir/flash" cache=none 2>/dev/null &
pids+=($!)
wait_sock "$dir/kit.sock"
kit=$(randread "nbd+unix:///?socket=$dir/kit.sock" "$secs")
"$sce" serve --source "$dir/flash" --buffered --listen "unix:$dir/flashb.sock" 2>/dev/null &
pids+=($!)
wait_sock "$dir/flashb.sock"
kitd=$(randread "nbd+unix:///?socket=$dir/flashb.sock" "$secs")

python3 - "$cached" "$flash" "$kit" "$measured_hit" "$kitd" <<'PY'
import sys
c, f, k, h, kd = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
print(f"fio nbd, 4 KiB randread, iodepth 32:")
print(f"  sce serve, warm cache (read hit ratio {h}): {c:>10.0f} IOPS")
print(f"  all-flash (sce serve, no cache):            {f:>10.0f} IOPS")
print(f"  nbdkit file plugin (page cache):            {k:>10.0f} IOPS")
print(f"  sce serve --buffered on the same file:      {kd:>10.0f} IOPS")
print(f"  ratio cached / all-flash: {c/f:.3f}")
print(f"  ratio cached / nbdkit:    {c/k:.3f}   (sce reads with O_DIRECT, nbdkit from the page cache)")
print(f"  ratio sce --buffered / nbdkit (both page cache, server overhead only): {kd/k:.3f}")
PY

# Second part: qemu-img convert of a sparse image against nbdkit (scripts/bench-convert.sh).
cleanup
trap - EXIT
exec bash scripts/bench-convert.sh
