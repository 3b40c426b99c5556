//! A server of `sce serve` assembled in process, as `server::run` assembles it, but without
//! the signal hook: the exports built by `group::build_all` over temp files, the NBD server
//! on a Unix socket, the rate sampler, the admin socket and (if asked) the metrics endpoint
//! on loopback. Every wait is a poll with a generous bound; nothing is timed.
#![allow(dead_code)]

use sce_nbd::{listen, ListenAddr, Listener, NbdClient, NbdUri, Server};
use sce_server::admin::{self, AdminAccess, Request};
use sce_server::attach::Volumes;
use sce_server::config::{ExportConfig, ServeConfig};
use sce_server::health::Sources;
use sce_server::rates::Rates;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub const MIB: u64 = 1 << 20;
/// Each test source's size.
pub const SOURCE: u64 = 16 * MIB;

/// The settings every test server starts from: buffered I/O (tmpfs refuses O_DIRECT),
/// threads for I/O, the state directory in `dir`.
pub fn base_config(dir: &Path) -> ServeConfig {
    ServeConfig {
        state_dir: dir.join("state"),
        direct: sce_io::DirectMode::Off,
        io_backend: sce_io::Backend::Threads,
        metadata_interval: Duration::from_millis(200),
        ..ServeConfig::default()
    }
}

/// A source file `NAME.src` of [`SOURCE`] bytes in `dir`, each 4 KiB block stamped with its
/// number (so that reads can be checked).
pub fn source_file(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(format!("{name}.src"));
    let mut data = vec![0u8; SOURCE as usize];
    for (i, b) in data.chunks_mut(4096).enumerate() {
        b[..8].copy_from_slice(&(i as u64).to_le_bytes());
        b[8..16].copy_from_slice(b"SCE-SRC!");
    }
    std::fs::write(&p, data).unwrap();
    p
}

/// What block `i` of a fresh source holds at its start.
pub fn stamp(i: u64) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..8].copy_from_slice(&i.to_le_bytes());
    s[8..].copy_from_slice(b"SCE-SRC!");
    s
}

/// An export `name` of a fresh source in `dir`, cached (on `NAME.cache`, created at 32 MiB)
/// or not.
pub fn export(dir: &Path, name: &str, cached: bool) -> ExportConfig {
    ExportConfig {
        name: name.into(),
        source: source_file(dir, name).display().to_string(),
        cache: cached.then(|| dir.join(format!("{name}.cache"))),
        cache_size: cached.then(|| "32MiB".into()),
        ..ExportConfig::default()
    }
}

/// A server assembled in process.
pub struct Rig {
    pub cfg: ServeConfig,
    pub server: Arc<Server>,
    pub volumes: Arc<Volumes>,
    pub sources: Arc<Sources>,
    pub rates: Arc<Rates>,
    pub admin: Option<admin::Admin>,
    /// The admin socket.
    pub ctl: PathBuf,
    /// The NBD socket.
    pub sock: PathBuf,
    pub listener: Option<Listener>,
    /// The metrics endpoint (HOST:PORT), if started.
    pub metrics: Option<String>,
}

impl Rig {
    /// Builds `cfg`'s exports and serves them (NBD, admin socket) from `dir`, and the
    /// metrics endpoint on a loopback port if `with_metrics`.
    pub fn start(dir: &Path, cfg: ServeConfig, with_metrics: bool) -> Rig {
        Self::try_start(dir, cfg, with_metrics).unwrap_or_else(|e| panic!("start: {e:#}"))
    }

    /// `start`, or why the exports could not be built.
    pub fn try_start(dir: &Path, cfg: ServeConfig, with_metrics: bool) -> anyhow::Result<Rig> {
        let built = sce_server::group::build_all(&cfg)?;
        let mut exports = Vec::new();
        let mut volumes = Vec::new();
        let mut sources = Vec::new();
        for (spec, b) in cfg.exports.iter().zip(built) {
            volumes.push((spec.name.clone(), b.volume));
            sources.push(b.source);
            exports.push(b.export);
        }
        let server = Server::new(exports);
        let volumes = Arc::new(volumes);
        let sources = Arc::new(sources);
        let rates = Rates::start(volumes.clone())?;
        let sock = dir.join("nbd.sock");
        let ctl = admin::default_path(&sock);
        let admin = admin::start(
            &ctl,
            AdminAccess::new(None)?,
            server.clone(),
            (volumes.clone(), sources.clone()),
            rates.clone(),
            (cfg.exports.clone(), cfg.config_file.clone()),
        )?;
        let metrics = with_metrics
            .then(|| {
                sce_server::metrics::metrics_server(
                    "127.0.0.1:0",
                    server.clone(),
                    volumes.clone(),
                    sources.clone(),
                    rates.clone(),
                )
            })
            .transpose()?;
        let listener = listen(&server, &ListenAddr::Unix(sock.clone()))?;
        Ok(Rig {
            cfg,
            server,
            volumes,
            sources,
            rates,
            admin: Some(admin),
            ctl,
            sock,
            listener: Some(listener),
            metrics,
        })
    }

    /// An NBD client of export `name`.
    pub fn client(&self, name: &str) -> NbdClient {
        let uri = NbdUri::Unix {
            socket: self.sock.clone(),
            name: name.into(),
        };
        NbdClient::connect(&uri, 1).unwrap_or_else(|e| panic!("connect to {name:?}: {e}"))
    }

    /// The export `name`'s cache, as the admin socket sees it.
    pub fn attachable(&self, name: &str) -> Arc<sce_server::attach::Attachable> {
        let v = self.volumes.iter().find(|(n, _)| n == name).unwrap();
        v.1.clone().expect("a cached export")
    }

    /// Sends `req` through `admin::call`, as `sce ctl` does.
    pub fn call(&self, req: &Request) -> anyhow::Result<Value> {
        admin::call(&self.ctl, req)
    }

    /// A request of `verb` on `export`.
    pub fn verb(&self, verb: &str, export: Option<&str>) -> anyhow::Result<Value> {
        self.call(&req(verb, export))
    }

    /// Sends raw `lines` on one admin connection and returns a reply per line.
    pub fn raw(&self, lines: &[&str]) -> Vec<Value> {
        raw(&self.ctl, lines)
    }

    /// Stops serving and shuts the caches down as the server's shutdown does: admin socket
    /// first, listener, flush, then every live volume.
    pub fn shut_down(mut self) -> Vec<bool> {
        drop(self.admin.take());
        self.rates.stop();
        if let Some(mut l) = self.listener.take() {
            l.stop();
        }
        self.server.shutdown();
        self.server.flush_all().unwrap();
        // Exports that share a cache device share its volume: it is shut down once.
        let mut done: Vec<Arc<sce_engine::CacheVolume>> = Vec::new();
        let mut clean = Vec::new();
        for (_, v) in self.volumes.iter() {
            if let Some(v) = v.as_ref().and_then(|a| a.live_volume()) {
                if !done.iter().any(|d| Arc::ptr_eq(d, &v)) {
                    clean.push(v.shutdown());
                    done.push(v);
                }
            }
        }
        clean
    }
}

/// A request of `verb` on `export`.
pub fn req(verb: &str, export: Option<&str>) -> Request {
    Request {
        verb: verb.into(),
        export: export.map(str::to_string),
        ..Request::default()
    }
}

/// Sends raw `lines` on one connection to the admin socket `ctl`; one reply per line.
pub fn raw(ctl: &Path, lines: &[&str]) -> Vec<Value> {
    let c = UnixStream::connect(ctl).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut r = BufReader::new(&c);
    let mut out = Vec::new();
    for l in lines {
        writeln!(&c, "{l}").unwrap();
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        out.push(serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}")));
    }
    out
}

/// An HTTP request `head` sent to `addr` as is; the status code, the headers and the body.
pub fn http(addr: &str, head: &str) -> (u16, String, String) {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(head.as_bytes()).unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    let (headers, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let code = headers
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, headers.to_string(), body.to_string())
}

/// GET `path` from the metrics endpoint `addr`.
pub fn get(addr: &str, path: &str) -> (u16, String, String) {
    http(addr, &format!("GET {path} HTTP/1.0\r\n\r\n"))
}

/// Polls `cond` every 20 ms until it holds, for at most `secs` seconds (a generous bound,
/// never a timing claim).
pub fn wait_until(what: &str, secs: u64, cond: impl FnMut() -> bool) {
    sce_testkit::wait_until(what, secs, cond)
}

/// `e`'s text as `sce` prints it.
pub fn text(e: &anyhow::Error) -> String {
    sce_server::error_text(e)
}
