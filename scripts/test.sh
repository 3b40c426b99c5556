#!/usr/bin/env bash
# Runs every check and test of sce. Installs what the tests need when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Real NBD clients and peers for the integration tests (Debian packages).
need=()
for pair in qemu-io:qemu-utils qemu-img:qemu-utils nbdkit:nbdkit nbdinfo:libnbd-bin nbdcopy:libnbd-bin \
            nbdfuse:nbdfuse fio:fio fusermount3:fuse3 losetup:mount mkfs.ext4:e2fsprogs; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The independent reference simulator for the sim cross-check (crates/sce/tests/sim.rs).
python3 -c 'import libcachesim' 2>/dev/null || python3 -m pip install -q libcachesim==0.3.5 \
  || echo "WARNING: pip could not install libcachesim==0.3.5; the cross-check will be skipped" >&2

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# --all-targets also runs the benchmarks once, briefly, as tests.
cargo test --workspace --all-targets
