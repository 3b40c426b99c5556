//! An NBD client is told EIO, not EINVAL, when the cache device under a write-back volume
//! fails: its request was valid, the device was not (issue 28). A cached volume over a
//! cache device that fails every write after the first, served by the NBD server, read by
//! the NBD client.

use sce_core::{CoreConfig, WriteMode};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::{BlockDevice, FaultDevice, IoError, MemDevice, Op};
use sce_nbd::{listen, Export, ListenAddr, NbdClient, NbdUri, Server, ServerConfig};
use std::sync::Arc;

#[test]
fn a_failed_cache_device_in_write_back_is_eio_at_the_client() {
    let source: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(16 << 20));
    let cache = Arc::new(FaultDevice::new(MemDevice::new(32 << 20)));
    let faults = cache.control();
    let mut p = PersistConfig::new("errno");
    p.flush_interval = std::time::Duration::from_secs(3600);
    let cfg = EngineConfig {
        core: CoreConfig {
            fragment_size: 64 * 1024,
            write_mode: WriteMode::WriteBack,
            ..CoreConfig::default()
        },
        persist: Some(p),
        ..EngineConfig::default()
    };
    let vol = Arc::new(CacheVolume::open(source, cache, cfg).expect("open"));
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let server = Server::with_config(
        vec![Export {
            name: "vol".into(),
            description: String::new(),
            device: vol.clone(),
            read_only: false,
            prefetch: None,
            io: None,
        }],
        ServerConfig::default(),
    );
    let _listener = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let uri = NbdUri::Unix {
        socket: sock,
        name: "vol".into(),
    };
    let client = NbdClient::connect(&uri, 1).expect("connect");
    client
        .write_at(0, &[1u8; 4096])
        .expect("a write while the device works");
    // From now on every write to the cache device fails: the journal entries of the next
    // write cannot be made durable.
    faults.fail_from(&[Op::Write], 0);
    let e = client
        .write_at(65536, &[2u8; 4096])
        .expect_err("a write whose journal cannot be written fails");
    assert!(
        !matches!(e, IoError::Invalid(_)),
        "the client was told its valid request was invalid: {e}"
    );
    assert_eq!(e.errno(), libc::EIO, "{e}");
    // The engine said why, in its own kind: a device failure, not a bad request.
    faults.fail_from(&[Op::Write], 0);
    let direct = vol.write_at(131072, &[3u8; 4096]).expect_err("fails");
    assert!(
        matches!(direct, IoError::Failed(_) | IoError::Io { .. }),
        "{direct:?}"
    );
    assert_eq!(direct.errno(), libc::EIO);
    faults.clear();
}
