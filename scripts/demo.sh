#!/usr/bin/env bash
# The README's first command: builds sce with the pinned toolchain and runs `sce demo` (the
# cache against the source alone, side by side) with its defaults, or with ARGS.
# Usage: bash scripts/demo.sh [ARGS]   (e.g. --seconds 10 --json)
# SCE_BIN=PATH runs that sce binary instead of building one (the README's test does).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${SCE_BIN:-}" ]; then exec "$SCE_BIN" demo "$@"; fi
source scripts/toolchain.sh
exec cargo run --release -p sce -- demo "$@"
