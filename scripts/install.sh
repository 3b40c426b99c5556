#!/usr/bin/env bash
# Installs sce where a distribution would put it:
#   $PREFIX/bin/sce                                   the binary
#   $PREFIX/share/man/man1/sce*.1                     man pages (sce man --out)
#   $PREFIX/share/bash-completion/completions/sce     completions (sce completions SHELL)
#   $PREFIX/share/zsh/vendor-completions/_sce
#   $PREFIX/share/fish/vendor_completions.d/sce.fish
#   $UNITDIR/sce@.service                             the systemd unit, its ExecStart on $PREFIX/bin/sce
#   $PREFIX/share/doc/sce/examples/sce.toml           the example configuration
#   /etc/sce/                                         created empty (configs are yours: none is written)
# everything under $DESTDIR when it is set (a package's staging root).
#
# Usage: scripts/install.sh [--prefix DIR] [--destdir DIR] [--bin FILE] [--uninstall]
#   --prefix   default /usr/local (PREFIX in the environment works too)
#   --destdir  default none (DESTDIR)
#   --bin      an sce binary already built (SCE_BIN); default: build target/release/sce first
#   UNITDIR    default /etc/systemd/system under /usr/local, else $PREFIX/lib/systemd/system
# Example:
#   sudo scripts/install.sh                      # /usr/local, then: systemctl daemon-reload
#   scripts/install.sh --prefix /usr --destdir /tmp/stage   # stage a package
set -euo pipefail
cd "$(dirname "$0")/.."

prefix="${PREFIX:-/usr/local}"
destdir="${DESTDIR:-}"
bin="${SCE_BIN:-}"
uninstall=false
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --destdir) destdir="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --uninstall) uninstall=true; shift ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$prefix" in /*) ;; *) echo "install.sh: --prefix must be absolute, not '$prefix'" >&2; exit 2 ;; esac
if [ -z "${UNITDIR:-}" ]; then
  if [ "$prefix" = /usr/local ]; then UNITDIR=/etc/systemd/system; else UNITDIR="$prefix/lib/systemd/system"; fi
fi

root="$destdir"
bindir="$root$prefix/bin"
mandir="$root$prefix/share/man/man1"
bashdir="$root$prefix/share/bash-completion/completions"
zshdir="$root$prefix/share/zsh/vendor-completions"
fishdir="$root$prefix/share/fish/vendor_completions.d"
docdir="$root$prefix/share/doc/sce/examples"
unitdir="$root$UNITDIR"

if [ "$uninstall" = true ]; then
  rm -fv "$bindir/sce" "$mandir"/sce.1 "$mandir"/sce-*.1 "$bashdir/sce" "$zshdir/_sce" \
    "$fishdir/sce.fish" "$unitdir/sce@.service" "$docdir/sce.toml"
  exit 0
fi

if [ -z "$bin" ]; then
  source scripts/toolchain.sh
  cargo build --release -p sce
  bin=target/release/sce
fi
[ -x "$bin" ] || { echo "install.sh: $bin is not an executable" >&2; exit 1; }

install -d "$bindir" "$mandir" "$bashdir" "$zshdir" "$fishdir" "$docdir" "$unitdir" "$root/etc/sce"
install -m 0755 "$bin" "$bindir/sce"
pages=$(mktemp -d)
trap 'rm -rf "$pages"' EXIT
"$bin" man --out "$pages" >/dev/null
install -m 0644 "$pages"/*.1 "$mandir/"
"$bin" completions bash >"$bashdir/sce"
"$bin" completions zsh >"$zshdir/_sce"
"$bin" completions fish >"$fishdir/sce.fish"
chmod 0644 "$bashdir/sce" "$zshdir/_sce" "$fishdir/sce.fish"
install -m 0644 contrib/sce.toml "$docdir/sce.toml"
# The unit runs the binary where it was installed (without DESTDIR: that is where it runs).
sed "s|/usr/bin/sce |$prefix/bin/sce |" contrib/sce@.service >"$unitdir/sce@.service"
chmod 0644 "$unitdir/sce@.service"
echo "installed sce $("$bindir/sce" --version | awk '{print $2}') under ${destdir:-/}: $prefix/bin/sce, $(ls "$pages" | wc -l) man pages, completions, $UNITDIR/sce@.service, $prefix/share/doc/sce/examples/sce.toml"
