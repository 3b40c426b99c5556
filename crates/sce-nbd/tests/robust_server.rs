//! The server against clients that misbehave on purpose (issue #10, items 8 and 14): floods
//! of connections, clients that never read their replies, slow and stalled clients, and
//! shutdown while such clients are connected; and the Unix socket rules (mode, live socket,
//! stale socket, regular file).
//!
//! Timeouts here are hang guards only, never latency assertions: a guard is generous, and a
//! test fails through it only if something never happens.

use sce_io::{BlockDevice, MemDevice};
use sce_nbd::proto;
use sce_nbd::{
    listen, listen_with, Export, ListenAddr, ListenOptions, NbdClient, Server, ServerConfig,
};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use sce_testkit::within;

mod common;
use common::*;

#[test]
fn a_flood_of_connections_is_refused_and_threads_stay_bounded() {
    raise_nofile(8192);
    // The shipped limits: 256 connections, 32 workers.
    let cfg = ServerConfig::default();
    let (limit, workers) = (cfg.max_connections, cfg.workers);
    let f = fixture(cfg);
    let keep = NbdClient::connect(&uri(&f.sock), 1).unwrap();
    let (threads0, rss0) = (threads(), rss());
    let mut held = Vec::new();
    let mut refused = 0;
    let mut peak_threads = 0;
    for i in 0..2000u64 {
        match try_go(&f.sock) {
            Some(s) => held.push(s),
            None => refused += 1,
        }
        if i % 100 == 0 {
            peak_threads = peak_threads.max(threads());
            let mut b = [0u8; 512];
            keep.read_at(i * 512, &mut b)
                .expect("the first client is served during the flood");
        }
    }
    peak_threads = peak_threads.max(threads());
    let rss1 = rss();
    eprintln!(
        "2000 idle connections opened: {} served, {refused} refused; threads {threads0} before, \
         {peak_threads} at the peak; RSS {} MiB before, {} MiB with them open",
        held.len(),
        rss0 >> 20,
        rss1 >> 20
    );
    assert!(held.len() < limit, "{} connections admitted", held.len());
    assert!(refused > 2000 - limit, "{refused} refused");
    assert!(f.server.stats().refused_connections.load(Relaxed) >= refused as u64);
    // One reader per admitted connection (idle clients never get a writer thread), the
    // workers, and what the test harness runs in parallel: far below one thread per
    // flooding connection.
    assert!(
        peak_threads < limit + workers + 100,
        "{peak_threads} threads for {limit} connections"
    );
    let mut b = [0u8; 512];
    keep.read_at(0, &mut b).unwrap();
    drop(held);
    wait_until("the flood's connections close", 60, || {
        f.server.stats().open_connections.load(Relaxed) <= 1
    });
    served(&f.sock, 8192);
}

#[test]
fn stalled_and_slow_clients_are_dropped_by_the_timeouts() {
    let f = fixture(ServerConfig {
        handshake_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    });
    let stats = f.server.stats();
    // Stuck in the handshake: reads the greeting, never answers.
    let mut s = UnixStream::connect(&f.sock).unwrap();
    let mut h = [0u8; 18];
    s.read_exact(&mut h).unwrap();
    assert!(within("handshake stall", 60, move || closed_by_server(
        &mut s
    )));
    assert!(stats.handshake_timeouts.load(Relaxed) >= 1);
    // Dribbles the handshake one byte at a time: each byte in time, the whole too slow.
    let mut s = UnixStream::connect(&f.sock).unwrap();
    s.read_exact(&mut h).unwrap();
    let dribble = |mut s: UnixStream, bytes: Vec<u8>| {
        within("slow client", 60, move || {
            for b in bytes {
                if s.write_all(&[b]).is_err() {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
            closed_by_server(&mut s)
        })
    };
    let mut opt = 3u32.to_be_bytes().to_vec();
    opt.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    opt.extend_from_slice(&[0u8; 200]);
    assert!(dribble(s, opt), "a slow handshake is dropped");
    assert!(stats.handshake_timeouts.load(Relaxed) >= 2);
    // Stalls in the middle of a request header.
    let mut s = try_go(&f.sock).unwrap();
    s.write_all(&proto::REQUEST_MAGIC.to_be_bytes()).unwrap();
    assert!(within("request stall", 60, move || closed_by_server(
        &mut s
    )));
    assert!(stats.request_timeouts.load(Relaxed) >= 1);
    // Sends a 64 KiB write one byte every 300 ms.
    let s = try_go(&f.sock).unwrap();
    let mut w = proto::encode_request(&proto::Request {
        flags: 0,
        command: proto::CMD_WRITE,
        cookie: 1,
        offset: 0,
        len: 65536,
    })
    .to_vec();
    w.extend_from_slice(&[1u8; 65536]);
    assert!(dribble(s, w), "a slow request is dropped");
    assert!(stats.request_timeouts.load(Relaxed) >= 2);
    served(&f.sock, 0);
}

#[test]
fn idle_connections_are_closed_only_when_configured() {
    let f = fixture(ServerConfig {
        idle_timeout: Some(Duration::from_secs(1)),
        ..ServerConfig::default()
    });
    let mut s = try_go(&f.sock).unwrap();
    request(&mut s, proto::CMD_FLUSH, 1, 0, 0);
    assert!(within("idle", 60, move || closed_by_server(&mut s)));
    assert!(f.server.stats().idle_timeouts.load(Relaxed) >= 1);
    assert_eq!(ServerConfig::default().idle_timeout, None);
}

#[test]
fn shutdown_with_a_client_that_never_reads_completes() {
    let f = fixture(ServerConfig {
        // Far longer than the hang guard: shutdown must not wait for it.
        reply_timeout: Duration::from_secs(3600),
        shutdown_grace: Duration::from_secs(1),
        ..ServerConfig::default()
    });
    let mut bad = try_go(&f.sock).unwrap();
    for cookie in 0..100 {
        request(&mut bad, proto::CMD_READ, cookie, 0, 4 << 20);
    }
    // Let the server take the requests in (not a timing assumption: shutdown must complete
    // whatever it has taken in by then).
    std::thread::sleep(Duration::from_millis(500));
    let server = f.server.clone();
    within("shutdown", 60, move || {
        server.shutdown();
        while server.stats().open_connections.load(Relaxed) > 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    assert!(within("closed", 60, move || closed_by_server(&mut bad)));
}

#[test]
fn shutdown_closes_connections_whose_device_is_stuck() {
    use sce_io::{LatencyConfig, LatencyDevice};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("stuck.sock");
    // Every I/O takes an hour.
    let stuck: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(
        MemDevice::new(1 << 20),
        LatencyConfig::disk(Duration::from_secs(3600), 4),
    ));
    let server = Server::with_config(
        vec![Export {
            name: "vol".into(),
            description: String::new(),
            device: stuck,
            read_only: false,
            prefetch: None,
            io: None,
        }],
        ServerConfig {
            shutdown_grace: Duration::from_secs(1),
            ..ServerConfig::default()
        },
    );
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let mut s = try_go(&sock).unwrap();
    request(&mut s, proto::CMD_READ, 1, 0, 4096);
    // Let the read reach the device (if it has not, it gets ESHUTDOWN: fine too).
    std::thread::sleep(Duration::from_millis(300));
    server.shutdown();
    assert!(within("closed", 60, move || closed_by_server(&mut s)));
}

fn mode(p: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[test]
fn unix_sockets_are_0600_whatever_the_umask() {
    // SAFETY: umask only sets the process's file creation mask.
    let old = unsafe { libc::umask(0) };
    let f = fixture(ServerConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let group = dir.path().join("group.sock");
    let l = listen_with(
        &f.server,
        &ListenAddr::Unix(group.clone()),
        &ListenOptions {
            socket_mode: 0o660,
            ..Default::default()
        },
    )
    .unwrap();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    assert_eq!(mode(&f.sock), 0o600);
    assert_eq!(mode(&group), 0o660);
    served(&group, 0);
    drop(l);
}

#[test]
fn a_live_socket_is_never_taken_over() {
    let f = fixture(ServerConfig::default());
    let other = Server::new(vec![]);
    let Err(e) = listen(&other, &ListenAddr::Unix(f.sock.clone())) else {
        panic!("a second server took over a live socket");
    };
    assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse, "{e}");
    assert!(e.to_string().contains(&f.sock.display().to_string()), "{e}");
    served(&f.sock, 0);
}

#[test]
fn a_stale_socket_is_replaced_and_a_regular_file_refused() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let f = fixture(ServerConfig::default());
    let l = listen(&f.server, &ListenAddr::Unix(stale.clone())).expect("stale socket replaced");
    served(&stale, 0);
    drop(l);
    let file = dir.path().join("file");
    std::fs::write(&file, b"keep me").unwrap();
    let Err(e) = listen(&f.server, &ListenAddr::Unix(file.clone())) else {
        panic!("listen replaced a regular file");
    };
    assert!(e.to_string().contains(&file.display().to_string()), "{e}");
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
}
