#!/usr/bin/env bash
# Two sce binaries side by side on warm hits: 4 KiB random reads of a prefetched 256 MiB
# region through `sce serve` (1 GiB random source, 1 GiB cache, the defaults otherwise), fio's
# nbd engine at QD32 and QD1, 5 s each after a 2 s warm-up, ROUNDS rounds whose order
# alternates. Prints per binary and depth the median IOPS and the server's CPU per request
# (user + system time over fio's requests), and B's ratio to A. Made for the counting
# allocator (docs/MEMORY.md): A built without `#[global_allocator]`, B as it is.
# Usage: scripts/bench-alloc-ab.sh BIN_A BIN_B [ROUNDS]
set -euo pipefail
a="$(realpath "$1")"; b="$(realpath "$2")"; rounds="${3:-6}"
dir="$(mktemp -d)"; trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$dir"' EXIT
cd "$dir"
head -c 1GiB /dev/urandom > src.img
for round in $(seq "$rounds"); do
  if [ $((round % 2)) = 1 ]; then order="A B"; else order="B A"; fi
  for which in $order; do
    bin="$a"; [ "$which" = B ] && bin="$b"
    rm -f cache.img s.sock s.sock.ctl
    "$bin" serve --source src.img --cache cache.img --cache-size 1GiB --listen unix:s.sock \
      --state-dir "$dir" 2>serve.log &
    pid=$!
    for _ in $(seq 100); do [ -S s.sock ] && break; sleep 0.1; done
    "$bin" ctl -s s.sock prefetch 0 256MiB > /dev/null
    for qd in 32 1; do
      run() { fio --name=h --ioengine=nbd --uri="nbd+unix:///?socket=$dir/s.sock" --rw=randread \
                --bs=4k --iodepth="$qd" --size=256M --time_based --runtime="$1" \
                --output-format=json 2>/dev/null | sed -n '/^{/,$p'; }
      run 2 > /dev/null
      t0=$(awk '{print $14+$15}' "/proc/$pid/stat")
      r=$(run 5 | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print(j["iops"], j["total_ios"])')
      t1=$(awk '{print $14+$15}' "/proc/$pid/stat")
      echo "$which $qd $r $((t1 - t0))" >> results.txt
    done
    kill "$pid"; wait "$pid" || true
  done
done
python3 - "$(getconf CLK_TCK)" <<'PY'
import statistics as st, sys
tck = int(sys.argv[1]); d = {}
for l in open("results.txt"):
    w, qd, iops, ios, ticks = l.split()
    d.setdefault((w, qd), []).append((float(iops), int(ticks) / tck * 1e6 / int(ios)))
print("| depth | A IOPS | B IOPS | B/A | A CPU us/req | B CPU us/req | B/A |")
print("|---|---|---|---|---|---|---|")
for qd in ("32", "1"):
    ai, bi = (st.median(x[0] for x in d[(w, qd)]) for w in "AB")
    ac, bc = (st.median(x[1] for x in d[(w, qd)]) for w in "AB")
    print(f"| QD{qd} | {ai:,.0f} | {bi:,.0f} | {bi/ai:.3f} | {ac:.2f} | {bc:.2f} | {bc/ac:.3f} |")
PY
