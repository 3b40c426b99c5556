#!/usr/bin/env bash
# Runs every check and test of sce. Installs what the tests need when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v losetup >/dev/null 2>&1 || need+=(mount)
if [ ${#need[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets -- -D warnings
# --all-targets also runs the benchmarks once, briefly, as tests.
cargo test --workspace --all-targets
