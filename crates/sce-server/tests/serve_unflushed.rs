//! `server::run` stopping over a source that cannot be flushed: it says why
//! (`Stopped::Unflushed`) and leaves the cache as after a crash, never marked clean, so that
//! the next start recovers it rather than trusting records the source may not match. (A
//! process of its own: the signal hook is installed once per process.)

mod common;
use common::*;
use sce_io::{BlockDevice, FaultDevice, MemDevice, Op};
use sce_server::{run, Event, ExportConfig, ServeConfig, Stopped};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Runs `cfg` on a thread: the events up to Ready, and where its end will come.
fn run_until_ready(cfg: ServeConfig) -> (Vec<Event>, mpsc::Receiver<anyhow::Result<Stopped>>) {
    let (etx, events) = mpsc::channel();
    let (dtx, done) = mpsc::channel();
    std::thread::spawn(move || {
        let r = run(cfg, &mut |e| {
            let _ = etx.send(e);
        });
        let _ = dtx.send(r);
    });
    let mut seen = Vec::new();
    while seen.last() != Some(&Event::Ready) {
        seen.push(
            events
                .recv_timeout(Duration::from_secs(120))
                .expect("an event"),
        );
    }
    (seen, done)
}

#[test]
fn a_source_that_cannot_be_flushed_leaves_the_cache_as_after_a_crash() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("nbd.sock");
    let tcp_listen = "tcp:127.0.0.1:0";
    let cfg = ServeConfig {
        exports: vec![ExportConfig {
            name: "c".into(),
            source: "mem:src".into(),
            cache: Some("mem:cache".into()),
            ..ExportConfig::default()
        }],
        listen: vec![
            format!("unix:{}", sock.display()).parse().unwrap(),
            tcp_listen.parse().unwrap(),
        ],
        admin: Some(d.path().join("ctl").join("admin.sock")),
        socket_mode: 0o660,
        ..base_config(d.path())
    };
    std::fs::create_dir(d.path().join("ctl")).unwrap();
    let source = FaultDevice::new(MemDevice::new(SOURCE));
    let faults = source.control();
    cfg.devices.put("mem:src", Arc::new(source));
    let cache = Arc::new(MemDevice::new(32 * MIB));
    cfg.devices.put("mem:cache", cache.clone());
    let (seen, done) = run_until_ready(cfg);
    // Both listeners, in order; the TCP one on the port it was given.
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(
        seen[0],
        Event::Listening(format!("unix:{}", sock.display()))
    );
    let Event::Listening(tcp) = &seen[1] else {
        panic!("{seen:?}")
    };
    let hp = tcp.strip_prefix("tcp:127.0.0.1:").expect("tcp:HOST:PORT");
    assert_ne!(hp, "0", "{tcp}: the port bound");
    // The admin socket where --admin put it, none beside the data socket; the data socket
    // with --socket-mode.
    let admin = d.path().join("ctl").join("admin.sock");
    let st = sce_server::admin::call(&admin, &req("status", Some("c"))).unwrap();
    assert_eq!(st["exports"][0]["name"], "c");
    assert!(!sce_server::admin::default_path(&sock).exists());
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(&sock).unwrap().mode() & 0o777, 0o660);
    let uri: sce_nbd::NbdUri = format!("nbd://127.0.0.1:{hp}/c").parse().unwrap();
    let client = sce_nbd::NbdClient::connect(&uri, 1).unwrap();
    client.write_at(0, &[3u8; 4096]).unwrap();
    let mut b = vec![0u8; 4096];
    client.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 3));
    drop(client);
    faults.fail_from(&[Op::Flush], 0);
    // SAFETY: kill with this process's own id and a signal its handler (run's) catches.
    assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGTERM) }, 0);
    let stopped = done
        .recv_timeout(Duration::from_secs(120))
        .expect("run returned");
    match stopped.unwrap() {
        Stopped::Unflushed(why) => assert!(why.contains("flush"), "{why}"),
        s => panic!("{s:?}"),
    }
    let sb = sce_store::read_superblock(&*cache).unwrap();
    assert_eq!(
        sb.state,
        sce_store::DeviceState::Open,
        "not marked clean: the next start recovers it"
    );
    assert_eq!(sb.clean_shutdowns, 0);
    assert!(!admin.exists(), "the admin socket went first");
}
