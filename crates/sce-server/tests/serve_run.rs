//! `server::run`, whole, in process: it reports its listeners, its metrics endpoint and
//! Ready, serves NBD, the admin socket and /metrics, and at SIGTERM shuts down in order
//! (admin socket gone, listeners gone, every write on its source, every cache left clean
//! so that the next start is warm). Refusals before anything serves (nothing to serve, a
//! network listener in the clear, a cache on a source, a later export that cannot be
//! built) return an error and leave no cache file the start created.
//!
//! The signal hook can be installed once per process: only one test here gets past the
//! assembly; the others are refused before it.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::{run, Event, ExportConfig, ServeConfig, Stopped};
use std::sync::mpsc;
use std::time::Duration;

/// Runs `cfg` on a thread: its events, and its end.
fn spawn(
    cfg: ServeConfig,
) -> (
    mpsc::Receiver<Event>,
    mpsc::Receiver<anyhow::Result<Stopped>>,
) {
    let (etx, erx) = mpsc::channel();
    let (dtx, drx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = run(cfg, &mut |e| {
            let _ = etx.send(e);
        });
        let _ = dtx.send(r);
    });
    (erx, drx)
}

/// The error of a start of `cfg` that is refused before it serves.
fn refused(cfg: ServeConfig) -> String {
    let (_, done) = spawn(cfg);
    match done
        .recv_timeout(Duration::from_secs(120))
        .expect("run returned")
    {
        Ok(s) => panic!("served: {s:?}"),
        Err(e) => text(&e),
    }
}

#[test]
fn a_server_serves_until_sigterm_then_shuts_down_in_order() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("nbd.sock");
    let cfg = ServeConfig {
        exports: vec![export(d.path(), "c", true), export(d.path(), "u", false)],
        listen: vec![format!("unix:{}", sock.display()).parse().unwrap()],
        metrics: Some("127.0.0.1:0".into()),
        ..base_config(d.path())
    };
    let (events, done) = spawn(cfg.clone());
    let mut seen = Vec::new();
    while seen.last() != Some(&Event::Ready) {
        let e = events
            .recv_timeout(Duration::from_secs(120))
            .expect("an event");
        seen.push(e);
    }
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert_eq!(
        seen[0],
        Event::Listening(format!("unix:{}", sock.display()))
    );
    let Event::Metrics(addr) = &seen[1] else {
        panic!("{seen:?}")
    };
    let ctl = sce_server::admin::default_path(&sock);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(&sock).unwrap().mode() & 0o777,
        0o600,
        "--socket-mode"
    );
    assert_eq!(std::fs::metadata(&ctl).unwrap().mode() & 0o777, 0o600);
    let st = sce_server::admin::call(&ctl, &req("status", None)).unwrap();
    assert_eq!(st["exports"].as_array().unwrap().len(), 2);
    let c = sce_nbd::NbdClient::connect(
        &sce_nbd::NbdUri::Unix {
            socket: sock.clone(),
            name: "c".into(),
        },
        1,
    )
    .unwrap();
    c.write_at(0, &[6u8; 4096]).unwrap();
    let pre = sce_server::admin::Request {
        offset: Some(MIB),
        len: Some(2 * MIB),
        ..req("prefetch", Some("c"))
    };
    sce_server::admin::call(&ctl, &pre).unwrap();
    assert_eq!(get(addr, "/metrics").0, 200);
    drop(c);
    // SAFETY: kill with this process's own id and a signal its handler (run's) catches.
    assert_eq!(unsafe { libc::kill(libc::getpid(), libc::SIGTERM) }, 0);
    let stopped = done
        .recv_timeout(Duration::from_secs(120))
        .expect("run returned");
    assert_eq!(stopped.unwrap(), Stopped::Clean);
    assert_eq!(events.try_recv().ok(), Some(Event::ShuttingDown));
    assert!(!ctl.exists(), "the admin socket is gone");
    assert!(!sock.exists(), "the listener is gone");
    let src = std::fs::read(d.path().join("c.src")).unwrap();
    assert!(
        src[..4096].iter().all(|&b| b == 6),
        "the write is on the source"
    );
    // The cache was left clean, with what it held, for the next start to be warm. (Read
    // without a lock: the metrics endpoint serves, holding the volumes, for as long as the
    // process runs, as its doc says, so no second start can take the devices here.)
    let opts = sce_io::FileOptions {
        direct: sce_io::DirectMode::Off,
        ..Default::default()
    };
    let dev = sce_io::FileDevice::open(&d.path().join("c.cache"), &opts).unwrap();
    let sb = sce_store::read_superblock(&dev).unwrap();
    assert_eq!(sb.state, sce_store::superblock::DeviceState::Clean);
    assert_eq!(sb.clean_shutdowns, 1);
    assert_eq!(sb.unclean_starts, 0);
}

#[test]
fn nothing_to_serve_or_nowhere_safe_to_listen_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let e = refused(ServeConfig {
        listen: vec!["unix:/nonexistent/x.sock".parse().unwrap()],
        ..base_config(d.path())
    });
    assert!(e.starts_with("nothing to serve"), "{e}");
    let e = refused(ServeConfig {
        exports: vec![export(d.path(), "a", true)],
        listen: vec!["tcp:0.0.0.0:10809".parse().unwrap()],
        ..base_config(d.path())
    });
    assert!(
        e.starts_with("refusing to listen on tcp:0.0.0.0:10809"),
        "{e}"
    );
    assert!(
        !d.path().join("a.cache").exists(),
        "refused before anything was created"
    );
}

#[test]
fn a_cache_on_a_source_is_refused_before_anything_is_written() {
    let d = tempfile::tempdir().unwrap();
    let a = export(d.path(), "a", false);
    let mut b = export(d.path(), "b", true);
    b.cache = Some(a.source.clone().into());
    let before = std::fs::read(&a.source).unwrap();
    let e = refused(ServeConfig {
        exports: vec![a.clone(), b],
        listen: vec![format!("unix:{}", d.path().join("s.sock").display())
            .parse()
            .unwrap()],
        ..base_config(d.path())
    });
    assert!(e.contains("same storage"), "{e}");
    assert_eq!(std::fs::read(&a.source).unwrap(), before);
}

#[test]
fn a_refused_start_removes_only_the_cache_files_it_created() {
    let d = tempfile::tempdir().unwrap();
    let a = export(d.path(), "a", true);
    let b = export(d.path(), "b", true);
    let mut foreign = vec![0u8; 32 * MIB as usize];
    foreign[..8].copy_from_slice(b"NOT-OURS");
    std::fs::write(b.cache.as_ref().unwrap(), &foreign).unwrap();
    let e = refused(ServeConfig {
        exports: vec![a.clone(), b.clone()],
        listen: vec![format!("unix:{}", d.path().join("s.sock").display())
            .parse()
            .unwrap()],
        ..base_config(d.path())
    });
    assert!(
        e.contains("export \"b\"") && e.contains("not an sce cache"),
        "{e}"
    );
    assert!(
        !a.cache.as_ref().unwrap().exists(),
        "a's new cache file is removed"
    );
    assert_eq!(
        std::fs::read(b.cache.as_ref().unwrap()).unwrap(),
        foreign,
        "b's is kept"
    );
    assert!(!d.path().join("s.sock").exists());
}

#[test]
fn exports_sharing_a_device_must_agree_on_its_settings() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("shared.cache");
    let member = |n: &str, extra: &str| {
        let mut e: ExportConfig = toml::from_str(&format!("source = \"/x\"\n{extra}")).unwrap();
        let base = export(d.path(), n, true);
        (e.name, e.source, e.cache) = (base.name, base.source, Some(cache.clone()));
        e.cache_size = e.cache_size.or(Some("32MiB".into()));
        e
    };
    for (extra, says) in [
        ("mode = \"writearound\"", "cache settings (mode, admission"),
        ("persist = false", "persistence settings"),
        ("crash_journal = false", "persistence settings"),
        ("cache_size = \"64MiB\"", "sizes (cache_size)"),
    ] {
        let e = refused(ServeConfig {
            exports: vec![member("a", ""), member("b", extra)],
            listen: vec![format!("unix:{}", d.path().join("s.sock").display())
                .parse()
                .unwrap()],
            ..base_config(d.path())
        });
        assert!(
            e.starts_with("exports \"a\" and \"b\" share the cache device"),
            "{extra}: {e}"
        );
        assert!(e.contains(says), "{extra}: {e}");
        assert!(!cache.exists(), "{extra}: nothing created");
    }
    // Shares that add up: each export gets its part.
    let mut a = member("a", "cache_share = \"30%\"");
    a.cache_share = Some("30%".into());
    let cfg = ServeConfig {
        exports: vec![a, member("b", "cache_share = \"70%\"")],
        ..base_config(d.path())
    };
    let built = sce_server::group::build_all(&cfg).unwrap();
    let part = built[1].volume.as_ref().unwrap().part().unwrap().clone();
    assert_eq!(
        (part.index, part.siblings.clone()),
        (1, vec!["a".to_string()])
    );
    assert!(part.base >= SOURCE, "b's bytes come after a's: {part:?}");
    assert!(built[0].export.description.contains("(shared with b)"));
}
