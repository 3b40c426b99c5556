#!/usr/bin/env bash
# Two builds of sce side by side, in one run (issue 28: a restructuring must cost nothing):
# fio's nbd engine, 4 KiB random reads at iodepth 32, against `sce serve` of each build
# (1) with a warm cache as large as the data and (2) exporting the local file without a
# cache; the runs alternate OLD, NEW, OLD, NEW so that drift hits both alike. Prints IOPS
# and NEW / OLD. Usage: scripts/bench-builds.sh OLD_SCE NEW_SCE [DATA_SIZE] [SECONDS]
set -euo pipefail
old=$1 new=$2 size=${3:-256M} secs=${4:-8}
dir=$(mktemp -d "${TMPDIR:-/tmp}/sce-builds.XXXXXX")
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT

fio --name=fill --filename="$dir/source" --size="$size" --rw=write --bs=1M --direct=1 \
    --refill_buffers --output=/dev/null
# Each server locks what it serves: every one gets its own copy of the data.
for f in source-old source-new file-old file-new; do cp "$dir/source" "$dir/$f"; done
wait_sock() { for _ in $(seq 200); do [ -S "$1" ] && return 0; sleep 0.05; done; echo "no socket $1" >&2; exit 1; }
randread() {  # SOCKET SECONDS -> IOPS
  fio --name=rr --ioengine=nbd --uri="nbd+unix:///?socket=$1" --rw=randread --bs=4k \
      --iodepth=32 --size="$size" --time_based --runtime="$2" --output-format=json |
    python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["read"]["iops"]))'
}

# Each build serves the source with its own warm cache, and the file without one.
for b in old new; do
  sce=${!b}
  "$sce" serve --source "$dir/source-$b" --cache "$dir/cache-$b" --cache-size "$size" \
      --fragment-size 1MiB --target-missrate 0 --listen "unix:$dir/$b.sock" \
      --metrics 127.0.0.1:0 2>"$dir/$b.log" &
  pids+=($!)
  "$sce" serve --source "$dir/file-$b" --listen "unix:$dir/$b-file.sock" 2>/dev/null &
  pids+=($!)
  wait_sock "$dir/$b.sock"
  wait_sock "$dir/$b-file.sock"
  metrics=$(grep -o '127.0.0.1:[0-9]*' "$dir/$b.log" | head -1)
  for i in $(seq 30); do
    randread "$dir/$b.sock" 3 >/dev/null
    free=$("$sce" stats --metrics "$metrics" --json |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["exports"][""]["free_slots"])')
    [ "$free" = 0 ] && break
  done
  echo "$b: warm after $i passes" >&2
done

declare -A r
for round in 1 2; do
  for b in old new; do
    r[$b-cache-$round]=$(randread "$dir/$b.sock" "$secs")
    r[$b-file-$round]=$(randread "$dir/$b-file.sock" "$secs")
  done
done
python3 - "${r[old-cache-1]}" "${r[old-cache-2]}" "${r[new-cache-1]}" "${r[new-cache-2]}" \
  "${r[old-file-1]}" "${r[old-file-2]}" "${r[new-file-1]}" "${r[new-file-2]}" <<'PY'
import sys
v = [float(x) for x in sys.argv[1:]]
oc, nc, of, nf = (v[0]+v[1])/2, (v[2]+v[3])/2, (v[4]+v[5])/2, (v[6]+v[7])/2
print("fio nbd, 4 KiB randread, iodepth 32 (runs alternate old, new, old, new):")
print(f"  warm cache  old {oc:>9.0f} IOPS ({v[0]:.0f}, {v[1]:.0f})  new {nc:>9.0f} IOPS ({v[2]:.0f}, {v[3]:.0f})  new/old {nc/oc:.3f}")
print(f"  local file  old {of:>9.0f} IOPS ({v[4]:.0f}, {v[5]:.0f})  new {nf:>9.0f} IOPS ({v[6]:.0f}, {v[7]:.0f})  new/old {nf/of:.3f}")
PY
