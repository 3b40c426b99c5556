#!/usr/bin/env bash
# Serving benchmark, one run, side by side: fio's nbd engine, 4 KiB random reads at iodepth 32,
# against (1) sce serve with a fully warm cache at least as large as the data, (2) "all-flash":
# the same server exporting a file on the fast device directly, (3) nbdkit's file plugin on
# that same file. Prints IOPS and the ratios. Usage: scripts/bench-serve.sh [DATA_SIZE] [SECONDS]
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
      --time_based --runtime="$2" --output-format=json | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["read"]["iops"]))'
}

"$sce" serve --source "$dir/source" --cache "$dir/cache" --cache-size "$size" --fragment-size 1MiB \
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
randread "nbd+unix:///?socket=$dir/sce.sock" 3 >/dev/null
before=$("$sce" stats --metrics "$metrics" --json)
cached=$(randread "nbd+unix:///?socket=$dir/sce.sock" "$secs")
after=$("$sce" stats --metrics "$metrics" --json)
measured_hit=$(python3 -c 'import json,sys; a=json.loads(sys.argv[1])["exports"][""]; b=json.loads(sys.argv[2])["exports"][""]; h=b["read_pages_hit"]-a["read_pages_hit"]; m=b["read_pages_missed"]-a["read_pages_missed"]; print(round(h/max(h+m,1),4))' "$before" "$after")

"$sce" serve --source "$dir/flash" --listen "unix:$dir/flash.sock" 2>/dev/null &
pids+=($!)
wait_sock "$dir/flash.sock"
flash=$(randread "nbd+unix:///?socket=$dir/flash.sock" "$secs")

nbdkit -f -U "$dir/kit.sock" file file="$dir/flash" cache=none 2>/dev/null &
pids+=($!)
wait_sock "$dir/kit.sock"
kit=$(randread "nbd+unix:///?socket=$dir/kit.sock" "$secs")

python3 - "$cached" "$flash" "$kit" "$measured_hit" <<'PY'
import sys
c, f, k, h = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
print(f"fio nbd, 4 KiB randread, iodepth 32:")
print(f"  sce serve, warm cache (read hit ratio {h}): {c:>10.0f} IOPS")
print(f"  all-flash (sce serve, no cache):            {f:>10.0f} IOPS")
print(f"  nbdkit file plugin:                         {k:>10.0f} IOPS")
print(f"  ratio cached / all-flash: {c/f:.3f}")
print(f"  ratio cached / nbdkit:    {c/k:.3f}")
PY
