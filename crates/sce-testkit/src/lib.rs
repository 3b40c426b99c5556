//! `sce-testkit`: what an integration test needs from the machine it runs on (a program, a
//! Python module, a device node), and the one rule for when it is missing.
//!
//! # The rule
//! * Under `CI=true` (or `CI=1`), a missing requirement MUST fail the test, with a message
//!   that names what to install (the Debian package, or the pip requirement). A test that
//!   skips in CI is a test that never runs.
//! * Anywhere else the test skips: the helper says so on stderr (`SKIP: ...`, with the same
//!   install hint) and returns `false`, and the test returns early.
//!
//! ```no_run
//! if !sce_testkit::require_tool("qemu-io", "qemu-utils") {
//!     return;
//! }
//! ```
//!
//! `scripts/test.sh` installs every requirement the tests name here.

pub mod etcd;
pub mod stamp;

use std::path::Path;
use std::process::Command;

/// The environment variable CI systems set (GitHub Actions, GitLab, most others).
pub const CI_VAR: &str = "CI";

/// True if `value` (the value of `CI`, if set) says we run in CI: `true` or `1`, in any case.
pub fn is_ci(value: Option<&str>) -> bool {
    value.is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// What to do about a requirement: `Ok(true)` if it is present, `Ok(false)` (skip) if it is
/// missing outside CI, and `Err(message)` if it is missing in CI. `ci` is the value of the
/// `CI` variable; `what` names the requirement, `install` says how to get it.
///
/// This is the whole policy, as a pure function so that it can be tested for both values of
/// `CI` in one process.
pub fn decide(present: bool, ci: Option<&str>, what: &str, install: &str) -> Result<bool, String> {
    if present {
        Ok(true)
    } else if is_ci(ci) {
        Err(format!(
            "{what} is missing, and under CI=true a test may not skip: {install} \
             (scripts/test.sh installs it)"
        ))
    } else {
        Ok(false)
    }
}

/// Applies [`decide`] with this process's `CI` variable: returns whether the requirement is
/// present; prints `SKIP: ...` on stderr when it is not. Panics (fails the test) when it is
/// missing under CI.
pub fn require(present: bool, what: &str, install: &str) -> bool {
    let ci = std::env::var(CI_VAR).ok();
    match decide(present, ci.as_deref(), what, install) {
        Ok(true) => true,
        Ok(false) => {
            eprintln!("SKIP: {what} is missing: {install}; set CI=true to make this a failure");
            false
        }
        Err(msg) => panic!("{msg}"),
    }
}

/// True if `cmd` is a program on `PATH` (as the shell's `command -v` finds it).
pub fn on_path(cmd: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|path| {
        std::env::split_paths(&path).any(|dir| {
            let p = dir.join(cmd);
            p.is_file()
                && std::fs::metadata(&p).is_ok_and(|m| {
                    std::os::unix::fs::PermissionsExt::mode(&m.permissions()) & 0o111 != 0
                })
        })
    })
}

/// The programs sce's tests run, and the Debian package of each. `scripts/test.sh` installs
/// every one (a test checks that its list holds them all).
pub const TOOLS: &[(&str, &str)] = &[
    ("qemu-io", "qemu-utils"),
    ("qemu-img", "qemu-utils"),
    ("nbdkit", "nbdkit"),
    ("nbdinfo", "libnbd-bin"),
    ("nbdcopy", "libnbd-bin"),
    ("nbdfuse", "nbdfuse"),
    ("fio", "fio"),
    ("fusermount3", "fuse3"),
    ("losetup", "mount"),
    ("mkfs.ext4", "e2fsprogs"),
    // scripts/bench-db.py: PostgreSQL (server, pgbench, pg_amcheck) under /usr/lib/postgresql.
    ("pgbench", "postgresql"),
    // /metrics is checked by Prometheus' own linter.
    ("promtool", "prometheus"),
    // Several hosts over one volume coordinate through etcd (issue 16).
    ("etcd", "etcd-server"),
    // The admin socket's racer runs as another uid (issue 27).
    ("setpriv", "util-linux"),
    // scripts/install.sh's unit is checked as systemd checks it, its man pages as man reads them.
    ("systemd-analyze", "systemd"),
    ("man", "man-db"),
];

/// The Python modules sce's tests import: (module, version, pip requirement).
pub const PYTHON_MODULES: &[(&str, Option<&str>, &str)] =
    &[("libcachesim", Some("0.3.5"), "libcachesim==0.3.5")];

/// Requires the program `cmd`, which the Debian package `debian_package` provides.
pub fn require_tool(cmd: &str, debian_package: &str) -> bool {
    require(
        on_path(cmd),
        &format!("the program `{cmd}`"),
        &format!(
            "install the Debian package `{debian_package}` (apt-get install {debian_package})"
        ),
    )
}

/// Requires the program `cmd` of [`TOOLS`], naming its package. A program that is not in
/// the table is a bug of the test that asks for it (add it there, and to `scripts/test.sh`).
pub fn require_known_tool(cmd: &str) -> bool {
    let Some(&(_, package)) = TOOLS.iter().find(|(c, _)| *c == cmd) else {
        panic!("`{cmd}` is not in sce_testkit::TOOLS: add it with its Debian package");
    };
    require_tool(cmd, package)
}

/// True if `python3` imports `module`, and, when `version` is given, its `__version__` is
/// exactly that.
pub fn python_has(module: &str, version: Option<&str>) -> bool {
    let check = match version {
        Some(v) => format!("import {module}; assert {module}.__version__ == {v:?}"),
        None => format!("import {module}"),
    };
    Command::new("python3")
        .args(["-c", &check])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Requires the Python module `module` (at `version`, if given), which
/// `pip install <pip_requirement>` provides.
pub fn require_python_module(module: &str, version: Option<&str>, pip_requirement: &str) -> bool {
    let what = match version {
        Some(v) => format!("the Python module `{module}` {v}"),
        None => format!("the Python module `{module}`"),
    };
    require(
        python_has(module, version),
        &what,
        &format!("install it with `python3 -m pip install {pip_requirement}`"),
    )
}

/// Requires the device node `path` (such as `/dev/fuse`); `install` says where it comes from.
pub fn require_device(path: &str, install: &str) -> bool {
    require(
        Path::new(path).exists(),
        &format!("the device `{path}`"),
        install,
    )
}

/// Polls `cond` every 20 ms until it holds; fails, naming `what`, after `secs` seconds: a
/// hang guard for tests, never a claim on how soon.
pub fn wait_until(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    poll(what, secs, || cond().then_some(()).ok_or_else(String::new));
}

/// Polls `probe` every 20 ms until it gives `Ok`, and returns that; fails after `secs`
/// seconds, naming `what` and what the last `Err` said (the state the probe saw): a hang
/// guard for tests, never a claim on how soon.
pub fn poll<T>(what: &str, secs: u64, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        match probe() {
            Ok(v) => return v,
            Err(saw) => assert!(
                std::time::Instant::now() < end,
                "{what}: not after {secs} s{}{saw}",
                if saw.is_empty() { "" } else { ": " }
            ),
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Runs `f` on a thread and waits for it at most `secs` seconds: a hang guard for tests,
/// never a latency assertion. Panics, naming `what`, if `f` is still running then or
/// panicked.
pub fn within<T: Send + 'static>(
    what: &str,
    secs: u64,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what}: still running after {secs} s (hung)")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ci_values() {
        assert!(is_ci(Some("true")));
        assert!(is_ci(Some("TRUE")));
        assert!(is_ci(Some("1")));
        assert!(!is_ci(None));
        assert!(!is_ci(Some("")));
        assert!(!is_ci(Some("false")));
        assert!(!is_ci(Some("0")));
    }

    #[test]
    fn missing_fails_in_ci_and_names_the_package() {
        let e = decide(false, Some("true"), "the program `x`", "install `pkg-x`").unwrap_err();
        assert!(e.contains("the program `x`") && e.contains("pkg-x"), "{e}");
    }

    #[test]
    fn missing_skips_elsewhere() {
        assert_eq!(decide(false, None, "x", "y"), Ok(false));
        assert_eq!(decide(false, Some("false"), "x", "y"), Ok(false));
    }

    #[test]
    fn present_runs_everywhere() {
        assert_eq!(decide(true, Some("true"), "x", "y"), Ok(true));
        assert_eq!(decide(true, None, "x", "y"), Ok(true));
    }

    #[test]
    fn finds_programs_on_path() {
        assert!(on_path("sh"));
        assert!(!on_path("sce-testkit-no-such-program"));
    }

    #[test]
    fn poll_returns_what_the_probe_found() {
        let mut n = 0;
        let got = poll("n reaching 3", 60, || {
            n += 1;
            if n == 3 {
                Ok(n * 10)
            } else {
                Err(format!("n {n}"))
            }
        });
        assert_eq!(got, 30);
    }

    #[test]
    #[should_panic(expected = "never: not after 0 s: saw 7")]
    fn poll_fails_with_what_the_probe_saw_last() {
        poll::<()>("never", 0, || Err("saw 7".into()));
    }

    #[test]
    #[should_panic(expected = "never true: not after 0 s")]
    fn wait_until_fails_naming_what() {
        wait_until("never true", 0, || false);
    }
}
