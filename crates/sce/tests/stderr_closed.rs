//! `sce serve ... 2>&1 | head -1` (issue 27, item 10): the reader of the server's stdout and
//! stderr goes away after one line; the server must go on serving (its log lines are
//! dropped) and exit cleanly on SIGTERM. It used to panic (exit 101) at its next log line.

mod common;

use common::wait_for;
use sce_io::BlockDevice;
use sce_nbd::{NbdClient, NbdUri};
use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};

/// A pipe: (read end, write end).
fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2(2) fills two fds that nothing else owns; each is wrapped exactly once.
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: as above: fresh descriptors, owned from here on.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

#[test]
fn a_closed_stderr_does_not_stop_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let (src, sock) = (dir.path().join("src.img"), dir.path().join("s.sock"));
    let mut data = vec![0u8; 16 << 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i / 4096) as u8 ^ 0x5a;
    }
    std::fs::write(&src, &data).unwrap();
    let (rd, wr) = pipe();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("serve")
        .arg("--source")
        .arg(&src)
        .arg("--cache")
        .arg(dir.path().join("cache.img"))
        .args(["--cache-size", "16MiB", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        // Debug: a line per connection, so lines keep coming after the reader left.
        .env("SCE_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::from(wr.try_clone().unwrap()))
        .stderr(Stdio::from(wr))
        .spawn()
        .unwrap();
    // `head -1`: one line, then the reader is gone.
    let mut first = String::new();
    BufReader::new(std::fs::File::from(rd))
        .read_line(&mut first)
        .unwrap();
    assert!(!first.is_empty(), "no log line");
    let served = std::panic::catch_unwind(|| {
        wait_for(&sock);
        let uri = NbdUri::Unix {
            socket: sock.clone(),
            name: String::new(),
        };
        for round in 0..5u64 {
            let c = NbdClient::connect(&uri, 1).expect("connect");
            let at = round * (1 << 20);
            let mut b = vec![0u8; 4096];
            c.read_at(at, &mut b).expect("read");
            assert_eq!(b, data[at as usize..at as usize + 4096], "round {round}");
        }
    });
    // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    println!(
        "first line: {}; exit after SIGTERM: {status}",
        first.trim_end()
    );
    assert!(
        served.is_ok(),
        "the server stopped serving once stderr closed"
    );
    assert!(status.success(), "sce serve exited with {status}");
}
