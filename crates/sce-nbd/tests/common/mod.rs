//! Helpers of the server tests: a fixture, a raw client, and what the process uses.
#![allow(dead_code, unused_imports)]

use sce_io::{open_queue, Backend, BlockDevice, DirectMode, FileDevice, FileOptions, MemDevice};
use sce_nbd::proto;
use sce_nbd::{
    listen, Export, ExportIo, ListenAddr, Listener, NbdClient, NbdUri, Server, ServerConfig,
};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sce_testkit::within;

pub use sce_testkit::wait_until;

pub struct Fixture {
    pub _dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub server: Arc<Server>,
    pub _listener: Listener,
}

pub fn fixture(cfg: ServerConfig) -> Fixture {
    fixture_on(cfg, None)
}

/// A fixture whose export is a 64 MiB memory device (`backend` None), or an O_DIRECT file
/// served through an I/O queue of that backend.
pub fn fixture_on(cfg: ServerConfig, backend: Option<Backend>) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let (dev, io): (Arc<dyn BlockDevice>, _) = match backend {
        None => (Arc::new(MemDevice::new(64 << 20)), None),
        Some(b) => {
            let opts = FileOptions {
                direct: DirectMode::Required,
                create_size: Some(64 << 20),
                ..Default::default()
            };
            let f = Arc::new(FileDevice::open(&dir.path().join("vol"), &opts).unwrap());
            let q = open_queue(f.clone(), b, 64).unwrap();
            assert_eq!(q.backend(), b);
            (f, Some(ExportIo::Queue(q)))
        }
    };
    let server = Server::with_config(
        vec![Export {
            name: "vol".into(),
            description: String::new(),
            device: dev,
            read_only: false,
            prefetch: None,
            io,
        }],
        cfg,
    );
    let listener = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    Fixture {
        _dir: dir,
        sock,
        server,
        _listener: listener,
    }
}

pub fn uri(sock: &Path) -> NbdUri {
    NbdUri::Unix {
        socket: sock.to_path_buf(),
        name: "vol".into(),
    }
}

/// A healthy client does a write and a read-back (inside a hang guard).
pub fn served(sock: &Path, at: u64) {
    let sock = sock.to_path_buf();
    within("a well-behaved client", 60, move || {
        let c = NbdClient::connect(&uri(&sock), 1).expect("the server still accepts");
        let pattern = [(at / 4096) as u8 ^ 0x5a; 4096];
        c.write_at(at, &pattern).unwrap();
        let mut b = [0u8; 4096];
        c.read_at(at, &mut b).unwrap();
        assert_eq!(b, pattern);
    });
}

pub fn threads() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Handshake of a raw client; `None` if the server closed the connection instead.
pub fn try_go(sock: &Path) -> Option<UnixStream> {
    let mut s = UnixStream::connect(sock).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut h = [0u8; 18];
    s.read_exact(&mut h).ok()?;
    s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes())
        .ok()?;
    let mut d = 3u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"vol");
    d.extend_from_slice(&0u16.to_be_bytes());
    let mut o = proto::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    o.extend_from_slice(&(d.len() as u32).to_be_bytes());
    o.extend_from_slice(&d);
    s.write_all(&o).ok()?;
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).ok()?;
        let reply = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        s.read_exact(&mut d).ok()?;
        match reply {
            proto::REP_ACK => return Some(s),
            proto::REP_INFO => {}
            _ => return None,
        }
    }
}

pub fn request(s: &mut UnixStream, command: u16, cookie: u64, offset: u64, len: u32) {
    let h = proto::encode_request(&proto::Request {
        flags: 0,
        command,
        cookie,
        offset,
        len,
    });
    s.write_all(&h).unwrap();
}

/// True once the server has closed `s` (what it had sent before is read away).
pub fn closed_by_server(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut b = vec![0u8; 1 << 20];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

pub fn raise_nofile(want: u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < want {
            r.rlim_cur = want.min(r.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// Resident memory of this process, in bytes.
pub fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf only reads a configuration value.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}
