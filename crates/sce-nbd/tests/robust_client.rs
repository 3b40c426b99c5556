//! `NbdClient` against a source that goes away and comes back (issue #10, item 7): requests
//! fail with an error while the source is away, never hang; they succeed again once it is
//! back; dropping the client while the source is away completes.
//!
//! The source is a real `nbdkit` (Debian package `nbdkit`). Timeouts here are hang guards
//! only, never latency assertions.

use sce_io::BlockDevice;
use sce_nbd::{ClientOptions, NbdClient, NbdUri};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sce_testkit::within;

/// True if `nbdkit` is installed. Missing: a failure under `CI=true` naming the Debian
/// package, a skip (said on stderr) elsewhere.
fn have_nbdkit() -> bool {
    sce_testkit::require_known_tool("nbdkit")
}

/// An `nbdkit memory` source on a Unix socket, killed on drop.
struct Source(Child);

impl Source {
    fn start(sock: &Path) -> Source {
        // A killed nbdkit leaves its socket behind.
        let _ = std::fs::remove_file(sock);
        let child = Command::new("nbdkit")
            .args(["-f", "--exit-with-parent", "-U"])
            .arg(sock)
            .args(["memory", "64M"])
            .spawn()
            .expect("nbdkit starts");
        let end = Instant::now() + Duration::from_secs(60);
        while std::os::unix::net::UnixStream::connect(sock).is_err() {
            assert!(Instant::now() < end, "nbdkit never listened on {sock:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Source(child)
    }
    fn kill(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for Source {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn options() -> ClientOptions {
    ClientOptions {
        connect_timeout: Duration::from_secs(5),
        request_timeout: Duration::from_secs(10),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(500),
        ..ClientOptions::default()
    }
}

#[test]
fn a_source_restart_fails_requests_then_recovers() {
    if !have_nbdkit() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock: PathBuf = dir.path().join("src.sock");
    let src = Source::start(&sock);
    let uri = NbdUri::Unix {
        socket: sock.clone(),
        name: String::new(),
    };
    let c = Arc::new(NbdClient::connect_with(&uri, 4, options()).unwrap());
    c.write_at(0, &[0xab; 65536]).unwrap();
    let mut b = vec![0u8; 65536];
    c.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 0xab));

    src.kill();
    // Away: every request, from several threads at once, fails; none hangs.
    for round in 0..3 {
        let callers: Vec<_> = (0..6u64)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    let mut b = vec![0u8; 4096];
                    c.read_at(i * 4096, &mut b)
                })
            })
            .collect();
        let results = within("requests while the source is away", 60, move || {
            callers
                .into_iter()
                .map(|t| t.join().unwrap().is_err())
                .collect::<Vec<_>>()
        });
        assert!(results.iter().all(|&e| e), "round {round}: {results:?}");
        let c2 = c.clone();
        let w = within("a write while away", 60, move || {
            c2.write_at(0, &[1u8; 512])
        });
        assert!(w.is_err());
    }

    // Back: requests succeed again (after at most a backoff period of errors).
    let src = Source::start(&sock);
    let c2 = c.clone();
    within("recovery", 60, move || loop {
        let mut b = vec![0u8; 4096];
        if c2.read_at(0, &mut b).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    });
    c.write_at(4096, &[7u8; 4096]).unwrap();
    let mut b = vec![0u8; 4096];
    c.read_at(4096, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 7));
    // Once more away; dropping the client then completes.
    src.kill();
    let c2 = c.clone();
    let _ = within("a request after the second kill", 60, move || {
        c2.read_at(0, &mut [0u8; 512])
    });
    let c = Arc::try_unwrap(c).expect("no other holder");
    within(
        "dropping the client while the source is away",
        60,
        move || drop(c),
    );
}

#[test]
fn a_source_that_never_answers_times_out() {
    if !have_nbdkit() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock: PathBuf = dir.path().join("delay.sock");
    let _ = std::fs::remove_file(&sock);
    // Reads take an hour; writes and the handshake are immediate.
    let child = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "--filter=delay", "-U"])
        .arg(&sock)
        .args(["memory", "64M", "rdelay=3600"])
        .spawn()
        .expect("nbdkit starts");
    let src = Source(child);
    let end = Instant::now() + Duration::from_secs(60);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(Instant::now() < end, "nbdkit never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let uri = NbdUri::Unix {
        socket: sock.clone(),
        name: String::new(),
    };
    let opts = ClientOptions {
        request_timeout: Duration::from_secs(1),
        ..options()
    };
    let c = Arc::new(NbdClient::connect_with(&uri, 1, opts).unwrap());
    let c2 = c.clone();
    let r = within("a read the source never answers", 60, move || {
        c2.read_at(0, &mut [0u8; 512])
    });
    assert!(r.is_err());
    // The stuck connection was replaced: writes still work.
    let c2 = c.clone();
    within("a write after the timeout", 60, move || {
        c2.write_at(0, &[3u8; 512])
    })
    .unwrap();
    drop(src);
}
