//! Output to a closed pipe (`sce check CACHE | head -1`, where `head` has already exited):
//! every subcommand that prints ends quietly, as Unix tools do (killed by SIGPIPE, or a
//! clean exit), never with a panic ("failed printing to stdout") and exit code 101.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

/// The write end of a pipe whose read end is already closed: the first write to it fails
/// (EPIPE, and SIGPIPE unless ignored), whatever the timing.
fn broken_pipe() -> Stdio {
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) writes two descriptors into the array we pass, which holds two.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0, "pipe(2)");
    // SAFETY: both descriptors were just returned by pipe(2) and are owned by nobody else.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(r);
    Stdio::from(w)
}

fn sce_into_closed_pipe(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(args)
        .stdout(broken_pipe())
        .stderr(Stdio::piped())
        .output()
        .expect("run sce");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !err.contains("panicked") && !err.contains("Broken pipe"),
        "sce {args:?} into a closed pipe: {err}"
    );
    assert_ne!(out.status.code(), Some(101), "sce {args:?}: {err}");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "sce {args:?} into a closed pipe ended with {:?}: {err}",
        out.status
    );
}

#[test]
fn every_printing_subcommand_ends_quietly_on_a_closed_pipe() {
    let d = tempfile::tempdir().unwrap();
    let (src, cache) = (d.path().join("src"), d.path().join("cache"));
    std::fs::File::create(&src)
        .unwrap()
        .set_len(64 << 20)
        .unwrap();
    let (src, cache) = (src.to_str().unwrap(), cache.to_str().unwrap());
    let st = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["format", cache, "--source", src, "--cache-size", "16MiB"])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success(), "sce format: {st:?}");
    sce_into_closed_pipe(&["check", cache]);
    sce_into_closed_pipe(&["check", cache, "--json"]);
    for json in [false, true] {
        let mut a = vec![
            "footprint",
            "--cache-size",
            "64MiB",
            "--source-size",
            "1GiB",
        ];
        if json {
            a.push("--json");
        }
        sce_into_closed_pipe(&a);
    }
    sce_into_closed_pipe(&["--help"]);
}
