#!/usr/bin/env bash
# Runs every check and test of sce. Installs what the tests need when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# Under CI=true a missing requirement is an error here and in the tests (sce-testkit): a test
# that skips in CI never runs.
ci=false
case "${CI:-}" in true|TRUE|True|1) ci=true ;; esac
missing() {
  if [ "$ci" = true ]; then echo "ERROR: $*" >&2; exit 1; fi
  echo "WARNING: $*; the tests that need it will be skipped" >&2
}

# Real NBD clients and peers for the integration tests (Debian packages). The list matches
# sce_testkit::TOOLS (crates/sce-testkit/tests/require.rs checks it).
tools="qemu-io:qemu-utils qemu-img:qemu-utils nbdkit:nbdkit nbdinfo:libnbd-bin nbdcopy:libnbd-bin \
       nbdfuse:nbdfuse fio:fio fusermount3:fuse3 losetup:mount mkfs.ext4:e2fsprogs \
       pgbench:postgresql promtool:prometheus etcd:etcd-server python3:python3 setpriv:util-linux \
       systemd-analyze:systemd man:man-db"
need=()
for pair in $tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || need+=("${pair#*:}")
done
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing ${need[*]} (apt-get)" >&2
  apt_log=$(mktemp)
  # Quiet when it works; when it does not, say why (the tail of apt-get's own words).
  if ! { apt-get update -qq && apt-get install -y -qq "${need[@]}"; } >"$apt_log" 2>&1; then
    echo "WARNING: apt-get could not install ${need[*]}; it said:" >&2
    tail -n 20 "$apt_log" >&2
  fi
  rm -f "$apt_log"
fi
for pair in $tools; do
  command -v "${pair%%:*}" >/dev/null 2>&1 || missing "${pair%%:*} is not installed (Debian package ${pair#*:})"
done

# The independent reference simulator for the sim cross-check (crates/sce/tests/sim.rs).
lcs_ok() { python3 -c 'import libcachesim; assert libcachesim.__version__ == "0.3.5"' 2>/dev/null; }
lcs_ok || python3 -m pip install -q libcachesim==0.3.5 \
  || python3 -m pip install -q --break-system-packages libcachesim==0.3.5 || true
lcs_ok || missing "pip could not install libcachesim==0.3.5"

# The pinned toolchain (rust-toolchain.toml), installed or linked if it is missing.
source scripts/toolchain.sh
cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# --all-targets also runs the benchmarks once, briefly, as tests.
cargo test --workspace --all-targets
