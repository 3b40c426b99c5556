# Sourced by scripts/test.sh and scripts/demo.sh (the README's two commands) before any
# cargo: makes sure the pinned toolchain of rust-toolchain.toml is there, with rustfmt and
# clippy. rustup (1.28 and later) no longer installs a pinned toolchain by itself, so:
#   1. already installed: nothing to do;
#   2. else rustup installs it (minimal profile plus the two components), where it can
#      download;
#   3. else, if the machine's installed stable is that very version, it is linked under the
#      pinned name (what an install would give: no download, same compiler);
#   4. else this run uses the installed stable, with a warning that says the pin is not met.
# Without rustup (a distribution's cargo), the pin does not apply and cargo is used as is.
sce_toolchain() {
  command -v rustup >/dev/null 2>&1 || return 0
  local pin stable triple home
  pin=$(sed -n 's/^channel = "\(.*\)"/\1/p' rust-toolchain.toml)
  [ -n "$pin" ] || return 0
  if rustup run "$pin" rustc --version >/dev/null 2>&1; then
    # Installed, perhaps with a minimal profile: the components the checks need.
    rustup run "$pin" cargo fmt --version >/dev/null 2>&1 && rustup run "$pin" cargo clippy --version >/dev/null 2>&1 \
      || rustup component add --toolchain "$pin" rustfmt clippy >&2 \
      || echo "WARNING: toolchain $pin lacks rustfmt or clippy and they cannot be added here" >&2
    return 0
  fi
  echo "toolchain $pin (rust-toolchain.toml) is not installed: installing it" >&2
  if rustup toolchain install "$pin" --profile minimal -c rustfmt -c clippy >&2; then
    return 0
  fi
  stable=$(rustup run stable rustc --version 2>/dev/null | awk '{print $2}')
  triple=$(rustup run stable rustc -vV 2>/dev/null | sed -n 's/^host: //p')
  home="${RUSTUP_HOME:-$HOME/.rustup}"
  if [ "$stable" = "$pin" ] && [ -n "$triple" ] && [ -d "$home/toolchains/stable-$triple" ]; then
    ln -sfn "$home/toolchains/stable-$triple" "$home/toolchains/$pin-$triple"
    echo "toolchain $pin: no download here, but the installed stable is $pin: linked under the pinned name" >&2
  else
    echo "WARNING: toolchain $pin (rust-toolchain.toml) cannot be installed here; using the installed stable ${stable:-?} instead" >&2
    export RUSTUP_TOOLCHAIN=stable
  fi
}
sce_toolchain
