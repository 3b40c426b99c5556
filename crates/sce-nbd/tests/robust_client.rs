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

/// A client of one connection to the source on `sock` whose requests time out after 1 s.
fn impatient_client(sock: &Path) -> Arc<NbdClient> {
    let uri = NbdUri::Unix {
        socket: sock.to_path_buf(),
        name: String::new(),
    };
    let opts = ClientOptions {
        request_timeout: Duration::from_secs(1),
        ..options()
    };
    Arc::new(NbdClient::connect_with(&uri, 1, opts).unwrap())
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
    let c = impatient_client(&sock);
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

/// A fake source on `sock` that negotiates, then answers its connections' first read with
/// the reply header and half of the data, and stalls (the client reads replies straight
/// into the caller's buffer: a request that times out there must still return, with an
/// error, and leave the buffer to its caller). Later connections are answered in full
/// with bytes of `0x5a`.
fn half_answering_source(sock: &Path) -> std::thread::JoinHandle<()> {
    use sce_nbd::proto::*;
    use std::io::{Read, Write};
    let l = std::os::unix::net::UnixListener::bind(sock).unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for (n, s) in l.incoming().enumerate() {
            let Ok(mut s) = s else { return };
            let mut hello = NBDMAGIC.to_be_bytes().to_vec();
            hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
            hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
            if s.write_all(&hello).is_err() {
                continue;
            }
            let mut b = [0u8; 4];
            let _ = s.read_exact(&mut b);
            // The options: answer GO with the export's size, ignore the rest.
            loop {
                let mut h = [0u8; 16];
                if s.read_exact(&mut h).is_err() {
                    break;
                }
                let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
                let len = u32::from_be_bytes(h[12..16].try_into().unwrap()) as usize;
                let mut data = vec![0u8; len];
                let _ = s.read_exact(&mut data);
                let reply = |s: &mut std::os::unix::net::UnixStream, kind: u32, d: &[u8]| {
                    let mut r = OPT_REPLY_MAGIC.to_be_bytes().to_vec();
                    r.extend_from_slice(&opt.to_be_bytes());
                    r.extend_from_slice(&kind.to_be_bytes());
                    r.extend_from_slice(&(d.len() as u32).to_be_bytes());
                    r.extend_from_slice(d);
                    let _ = s.write_all(&r);
                };
                if opt == OPT_GO {
                    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                    info.extend_from_slice(&(64u64 << 20).to_be_bytes());
                    info.extend_from_slice(&1u16.to_be_bytes());
                    reply(&mut s, REP_INFO, &info);
                    reply(&mut s, REP_ACK, &[]);
                    break;
                }
                reply(&mut s, REP_FLAG_ERROR | 1, &[]);
            }
            let mut s2 = s.try_clone().unwrap();
            std::thread::spawn(move || loop {
                let mut r = [0u8; 28];
                if s2.read_exact(&mut r).is_err() {
                    return;
                }
                let cookie = &r[8..16];
                let len = u32::from_be_bytes(r[24..28].try_into().unwrap()) as usize;
                let mut out = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
                out.extend_from_slice(&0u32.to_be_bytes());
                out.extend_from_slice(cookie);
                if n == 0 {
                    out.extend(std::iter::repeat_n(0xa5u8, len / 2));
                    let _ = s2.write_all(&out);
                    std::thread::sleep(Duration::from_secs(3600));
                    return;
                }
                out.extend(std::iter::repeat_n(0x5au8, len));
                if s2.write_all(&out).is_err() {
                    return;
                }
            });
            held.push(s);
        }
    })
}

#[test]
fn a_reply_that_stops_halfway_through_its_data_times_out_and_the_next_read_is_whole() {
    let dir = tempfile::tempdir().unwrap();
    let sock: PathBuf = dir.path().join("half.sock");
    let _server = half_answering_source(&sock);
    let c = impatient_client(&sock);
    let c2 = c.clone();
    let (r, buf) = within("a read whose reply stops halfway", 60, move || {
        let mut buf = vec![0u8; 1 << 20];
        let r = c2.read_at(0, &mut buf);
        (r, buf)
    });
    assert!(r.is_err(), "a read answered halfway must fail");
    assert!(
        buf[..512 << 10].iter().all(|&b| b == 0xa5),
        "the half that came"
    );
    // The broken connection is replaced: a read is answered whole.
    let c2 = c.clone();
    let buf = within("a read on the new connection", 60, move || {
        let mut buf = vec![0u8; 1 << 20];
        c2.read_at(4096, &mut buf).map(|()| buf)
    })
    .unwrap();
    assert!(buf.iter().all(|&b| b == 0x5a));
}
