#!/bin/bash
# Two sce builds, alternating, on one fio job through the write-back log: IOPS, write mean and
# sce's CPU per request, each run on a fresh 2 ms source and a fresh 1 GiB cache file.
#
#   scripts/bench-ab.sh OLD_SCE NEW_SCE [RUNS] [QD] [SECONDS]
#   JOB="--rw=randrw --rwmixread=87 --bs=8k --size=2g --random_distribution=zipf:1.1" \
#     scripts/bench-ab.sh OLD NEW 2 4 10
#
# Defaults: 3 runs of each, QD16, 12 s, JOB 4 KiB random writes over 256 MiB; sce serves
# --mode writeback with a 768 MiB log (SERVE_ARGS replaces that). Needs nbdkit and fio.
set -euo pipefail
OLD=$1; NEW=$2; RUNS=${3:-3}; QD=${4:-16}; SECS=${5:-12}
JOB=${JOB:---rw=randwrite --bs=4k --size=256m}
SERVE_ARGS=${SERVE_ARGS:---mode writeback --writeback-log 768MiB}
D=$(mktemp -d /var/tmp/sce-ab.XXXXXX)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$D"' EXIT
TICK=$(getconf CLK_TCK)

one() {
    local sce=$1 src srv
    rm -rf "$D/run"; mkdir -p "$D/run"
    nbdkit -f -U "$D/run/src.sock" --filter=delay memory 2G rdelay=2ms wdelay=2ms -t 64 \
        2>"$D/run/src.log" &
    src=$!
    dd if=/dev/zero of="$D/run/wb.cache" bs=1M count=1024 status=none
    for _ in $(seq 100); do [ -S "$D/run/src.sock" ] && break; sleep 0.05; done
    # shellcheck disable=SC2086
    "$sce" serve --listen "unix:$D/run/wb.sock" --source "nbd+unix:///?socket=$D/run/src.sock" \
        --cache "$D/run/wb.cache" --force --state-dir "$D/run/state" $SERVE_ARGS \
        2>"$D/run/serve.log" &
    srv=$!
    for _ in $(seq 100); do [ -S "$D/run/wb.sock" ] && break; sleep 0.05; done
    # shellcheck disable=SC2086
    fio --name=j --ioengine=nbd --uri="nbd+unix:///?socket=$D/run/wb.sock" $JOB \
        --iodepth="$QD" --time_based --runtime="$SECS" --randseed=7 --output-format=json \
        >"$D/run/fio.json"
    read -r -a st <"/proc/$srv/stat"
    kill "$srv" "$src"; wait "$srv" "$src" 2>/dev/null || true
    python3 - "$D/run/fio.json" "$(( st[13] + st[14] ))" "$TICK" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
j = json.loads(s[s.index("{"):])["jobs"][0]
ops = j["read"]["total_ios"] + j["write"]["total_ios"]
cpu = int(sys.argv[2]) / int(sys.argv[3])
iops = j["read"]["iops"] + j["write"]["iops"]
print(f"IOPS {iops:,.0f}  write mean {j['write']['clat_ns']['mean'] / 1e6:.3f} ms  "
      f"sce CPU {cpu * 1e6 / max(ops, 1):.0f} us/request")
PY
}

for r in $(seq "$RUNS"); do
    echo "run $r old: $(one "$OLD")"
    echo "run $r new: $(one "$NEW")"
done
