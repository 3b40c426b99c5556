//! The control plane of a running server: an admin Unix socket (mode 0600) that answers
//! `sce ctl`. One JSON request per line, one JSON reply per line:
//!
//! ```text
//! -> {"verb":"set","export":"lun0","key":"mode","value":"passthrough"}
//! <- {"ok":true,"result":{...}}          or {"ok":false,"error":"why"}
//! ```
//!
//! Verbs: `status`, `stats`, `flush`, `exists`, `evict`, `prefetch`, `forget`, `set`, `detach`, `attach` (see
//! [`Request`]). Requests naming an export that has no cache get an error saying so, but
//! for `status`, `stats` and `flush`. A connection is served on a thread of its own, at most
//! [`MAX_CLIENTS`] at once (more are told to wait and closed), and may send several
//! requests; a client that sends nothing for [`IDLE`] is closed. The socket is never
//! reachable with the umask's mode, and a connection from a uid other than the server's,
//! root's or a member's of `--admin-group` is refused (see [`AdminAccess`]).

mod access;
mod request;
mod save;
mod settings;

use crate::attach::{Attachable, Volumes, Watch};
use crate::health::Sources;
use crate::metrics::stats_json;
use crate::rates::Rates;
use crate::LOG_TARGET;
pub use access::AdminAccess;
use anyhow::{anyhow, bail, Context, Result};
pub use request::Request;
use sce_core::WriteMode;
use sce_engine::CacheVolume;
use sce_nbd::Server;
use serde_json::{json, Value};
pub use settings::retune;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Admin connections served at once.
pub const MAX_CLIENTS: usize = 16;
/// An admin connection that sends nothing for this long is closed.
pub const IDLE: Duration = Duration::from_secs(300);
/// The longest request line taken.
const MAX_LINE: u64 = 64 << 10;

/// What the admin thread needs of the server.
struct Ctx {
    server: Arc<Server>,
    volumes: Arc<Volumes>,
    sources: Arc<Sources>,
    started: Instant,
    rates: Arc<Rates>,
    /// Every export as declared (for the ownership checks of `attach`), and the TOML file
    /// they came from, if any (`set --save`).
    exports: Vec<crate::config::ExportConfig>,
    config_file: Option<PathBuf>,
    /// Who may connect.
    access: AdminAccess,
}

/// The admin socket of a running server; dropping it stops serving and removes the file.
pub struct Admin {
    path: PathBuf,
    stop: Arc<AtomicBool>,
}

impl Drop for Admin {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The admin socket next to a data socket: `PATH.ctl`.
pub fn default_path(data_socket: &Path) -> PathBuf {
    let mut s = data_socket.as_os_str().to_owned();
    s.push(".ctl");
    PathBuf::from(s)
}

/// Starts the admin socket at `path` (mode 0600), serving the peers `access` allows. A
/// socket file left by a server that is gone is replaced; one a live server answers on is
/// refused.
pub fn start(
    path: &Path,
    access: AdminAccess,
    server: Arc<Server>,
    (volumes, sources): (Arc<Volumes>, Arc<Sources>),
    rates: Arc<Rates>,
    (exports, config_file): (Vec<crate::config::ExportConfig>, Option<PathBuf>),
) -> Result<Admin> {
    let l = access::place(path, access.gid())?;
    l.set_nonblocking(true)?;
    let ctx = Arc::new(Ctx {
        server,
        volumes,
        sources,
        started: Instant::now(),
        rates,
        exports,
        config_file,
        access,
    });
    let stop = Arc::new(AtomicBool::new(false));
    let clients = Arc::new(AtomicUsize::new(0));
    let st = stop.clone();
    std::thread::Builder::new()
        .name("sce-admin".into())
        .spawn(move || accept_loop(&l, &ctx, &st, &clients))?;
    tracing::info!(target: LOG_TARGET, "admin socket at {}", path.display());
    Ok(Admin {
        path: path.to_path_buf(),
        stop,
    })
}

fn accept_loop(l: &UnixListener, ctx: &Arc<Ctx>, stop: &AtomicBool, clients: &Arc<AtomicUsize>) {
    while !stop.load(Relaxed) {
        let conn = match l.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!(target: LOG_TARGET, "admin socket: accept: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let _ = conn.set_nonblocking(false);
        if let Err(why) = ctx.access.check(&conn) {
            tracing::warn!(target: LOG_TARGET, "admin socket: refused a connection: {why}");
            let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = writeln!(&conn, "{}", json!({"ok": false, "error": why}));
            continue;
        }
        if clients.fetch_add(1, Relaxed) >= MAX_CLIENTS {
            clients.fetch_sub(1, Relaxed);
            let mut c = conn;
            let _ = writeln!(
                c,
                "{}",
                json!({"ok": false, "error": format!("too many admin connections ({MAX_CLIENTS}); try again")})
            );
            continue;
        }
        let (ctx, clients) = (ctx.clone(), clients.clone());
        let spawned = std::thread::Builder::new()
            .name("sce-admin-conn".into())
            .spawn(move || {
                ctx.serve_conn(conn);
                clients.fetch_sub(1, Relaxed);
            });
        if spawned.is_err() {
            // The closure was dropped with the connection; give the place back.
            tracing::warn!(target: LOG_TARGET, "admin socket: cannot start a thread");
        }
    }
}

impl Ctx {
    fn serve_conn(&self, conn: UnixStream) {
        let _ = conn.set_read_timeout(Some(IDLE));
        let _ = conn.set_write_timeout(Some(Duration::from_secs(30)));
        let mut r = BufReader::new(&conn);
        loop {
            let mut line = String::new();
            match std::io::Read::take(&mut r, MAX_LINE).read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if !line.ends_with('\n') && line.len() as u64 >= MAX_LINE {
                let _ = writeln!(
                    &conn,
                    "{}",
                    json!({"ok": false, "error": "request too long"})
                );
                return;
            }
            let gone = || client_gone(&conn);
            let reply = match serde_json::from_str::<Request>(line.trim()) {
                Ok(req) => match self.handle(&req, Watch::new(&gone)) {
                    Ok(v) => json!({"ok": true, "result": v}),
                    Err(e) => json!({"ok": false, "error": crate::error_text(&e)}),
                },
                Err(e) => json!({"ok": false, "error": format!("bad request: {e}")}),
            };
            if writeln!(&conn, "{reply}").is_err() {
                return;
            }
        }
    }

    /// The export a request names, by index (None for "every export" where allowed).
    fn export_index(&self, name: Option<&str>) -> Result<usize> {
        match name {
            Some(n) => self
                .volumes
                .iter()
                .position(|(e, _)| e == n)
                .ok_or_else(|| anyhow!("no export {n:?} (exports: {})", self.names())),
            None if self.volumes.len() == 1 => Ok(0),
            None => {
                // The default export, "" if there is one.
                self.volumes
                    .iter()
                    .position(|(e, _)| e.is_empty())
                    .ok_or_else(|| anyhow!("name the export: {}", self.names()))
            }
        }
    }

    /// The exports a status or flush names: all of them, or the one named (an error if
    /// there is none by that name).
    fn selected(&self, name: Option<&str>) -> Result<Vec<(usize, &sce_nbd::Export)>> {
        let only = name.map(|n| self.export_index(Some(n))).transpose()?;
        let all = self.server.exports().iter().enumerate();
        Ok(all.filter(|(i, _)| only.is_none_or(|o| o == *i)).collect())
    }

    fn names(&self) -> String {
        self.volumes
            .iter()
            .map(|(n, _)| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The cached volume a request names, while its cache is attached.
    fn volume(&self, name: Option<&str>) -> Result<(&str, Arc<CacheVolume>)> {
        let (n, a) = self.attachable(name)?;
        match a.volume() {
            Some(v) => Ok((n, v)),
            None => bail!("export {n:?} has its cache detached (sce ctl attach)"),
        }
    }

    /// The export a request names, if it is a cached one.
    fn attachable(&self, name: Option<&str>) -> Result<(&str, &Arc<Attachable>)> {
        let i = self.export_index(name)?;
        let (n, v) = &self.volumes[i];
        match v {
            Some(a) => Ok((n, a)),
            None => bail!("export {n:?} has no cache"),
        }
    }

    /// The range a request names, checked against the export's size.
    fn range(req: &Request, v: &Attachable) -> Result<(u64, u64)> {
        let (Some(o), Some(l)) = (req.offset, req.len) else {
            bail!("{} needs an offset and a length", req.verb);
        };
        let size = sce_io::BlockDevice::size(v);
        if o.checked_add(l).is_none_or(|e| e > size) {
            bail!(
                "{}: the range {o}+{l} is out of range: the export has {size} bytes",
                req.verb
            );
        }
        Ok((o, l))
    }

    fn handle(&self, req: &Request, watch: Watch<'_>) -> Result<Value> {
        let name = req.export.as_deref();
        match req.verb.as_str() {
            "status" => self.status(name),
            "stats" => self.stats(name),
            "flush" if req.to_source => self.flush_to_source(name, watch),
            "flush" => self.flush(name),
            "exists" | "evict" | "prefetch" | "clean" => self.range_verb(req),
            "forget" => {
                let (n, a) = self.attachable(name)?;
                let (frags, errors) = a.forget().map_err(|e| anyhow!("export {n:?}: {e}"))?;
                // Write-back's dirty (and lost) pages are the only copy: forget keeps them.
                let k = a.part().map_or(0, |p| p.index);
                let (dirty, lost) = a.volume().map_or((0, 0), |v| v.dirty_pages_of_volume(k));
                tracing::warn!(target: LOG_TARGET, export = n, fragments = frags, dirty_pages_kept = dirty, lost_pages_kept = lost, "ctl forget: everything clean that was cached was dropped; {dirty} dirty pages (write-back data newer than the source) and {lost} lost pages are kept");
                if errors > 0 {
                    bail!("forgot {frags} fragments, but {errors} metadata writes failed: a crash now may bring old records back; check the cache device");
                }
                Ok(json!({"export": n, "fragments_dropped": frags, "dirty_pages_kept": dirty, "lost_pages_kept": lost}))
            }
            "set" => self.set(req, watch),
            "detach" => {
                let (n, a) = self.attachable(name)?;
                crate::coherent::refuse_in_shared_mode(n, a, "detach")?;
                let t0 = Instant::now();
                let (path, clean) = a.detach(watch)?;
                let seconds = t0.elapsed().as_secs_f64();
                Ok(json!({"export": n, "cache": path.display().to_string(), "left_clean": clean, "seconds": seconds}))
            }
            "attach" => self.attach(req),
            "handoff" => {
                let (n, a) = self.attachable(name)?;
                crate::coherent::handoff_verb(n, a, req.value.as_deref())
            }
            v => bail!(
                "unknown verb {v:?} (status, stats, flush, exists, evict, prefetch, clean, forget, set, detach, attach, handoff)"
            ),
        }
    }

    fn stats(&self, name: Option<&str>) -> Result<Value> {
        let mut v = stats_json(&self.server, &self.volumes, &self.sources);
        if let Some(n) = name {
            self.export_index(Some(n))?;
            if let Some(ex) = v["exports"].as_object_mut() {
                ex.retain(|k, _| k == n);
            }
        }
        Ok(v)
    }

    fn flush(&self, name: Option<&str>) -> Result<Value> {
        let mut flushed = Vec::new();
        for (_, e) in self.selected(name)? {
            e.device
                .flush()
                .with_context(|| format!("flushing export {:?}", e.name))?;
            flushed.push(e.name.clone());
        }
        Ok(json!({ "flushed": flushed }))
    }

    /// `flush --to-source`: every write-back byte of the export(s) to the source, which is
    /// then flushed; writes to them go through to the source meanwhile, so it ends. Waits as
    /// long as cleaning makes progress (fails after a minute without) and the client stays.
    fn flush_to_source(&self, name: Option<&str>, watch: Watch<'_>) -> Result<Value> {
        let mut done = Vec::new();
        for (i, e) in self.selected(name)? {
            let d = match self.volumes.get(i).and_then(|(_, v)| v.as_ref()) {
                Some(a) => a
                    .flush_to_source(watch)
                    .with_context(|| format!("export {:?}", e.name))?,
                None => {
                    e.device.flush()?;
                    Default::default()
                }
            };
            let (bytes, seconds) = (d.cleaned_bytes, d.elapsed.as_secs_f64());
            tracing::info!(target: LOG_TARGET, export = &e.name, bytes, seconds, "ctl flush --to-source");
            done.push(json!({"export": e.name, "bytes_written_back": bytes, "seconds": seconds}));
        }
        Ok(
            json!({ "flushed": done.iter().map(|d| d["export"].clone()).collect::<Vec<_>>(), "to_source": done }),
        )
    }

    /// exists, evict, prefetch and clean: a range of a cached export.
    fn range_verb(&self, req: &Request) -> Result<Value> {
        let (n, vol) = self.volume(req.export.as_deref())?;
        let (_, v) = self.attachable(req.export.as_deref())?;
        let (o, l) = Self::range(req, v)?;
        let cached = |v: &Attachable| -> Result<u64> {
            Ok(v.exists(o, l)?.iter().map(|f| f.1).sum::<u64>().min(l))
        };
        match req.verb.as_str() {
            "exists" => {
                let frags = v.exists(o, l)?;
                Ok(json!({
                    "export": n, "offset": o, "len": l,
                    "cached_bytes": cached(v)?,
                    "fragments": frags.iter().map(|&(off, b)| json!({"offset": off, "cached_bytes": b})).collect::<Vec<_>>(),
                }))
            }
            "clean" => {
                let bytes = v.clean(o, l, std::time::Duration::from_secs(60))?;
                tracing::info!(target: LOG_TARGET, export = n, offset = o, len = l, bytes, "ctl clean");
                Ok(json!({"export": n, "offset": o, "len": l, "bytes_written_back": bytes}))
            }
            "evict" => {
                let bytes = v.evict(o, l)?;
                tracing::info!(target: LOG_TARGET, export = n, offset = o, len = l, bytes, "ctl evict");
                Ok(json!({"export": n, "offset": o, "len": l, "evicted_bytes": bytes}))
            }
            _ => {
                let before = (cached(v)?, vol.stats().endurance_refusals);
                v.prefetch(o, l)?;
                let after = cached(v)?;
                let refused = vol.stats().endurance_refusals - before.1;
                Ok(json!({
                    "export": n, "offset": o, "len": l,
                    "cached_bytes": after,
                    "fetched_bytes": after.saturating_sub(before.0),
                    "short_because": (after < l).then(|| short_because(&vol, l, refused)),
                }))
            }
        }
    }

    fn status(&self, name: Option<&str>) -> Result<Value> {
        let mut exports = Vec::new();
        for (i, e) in self.selected(name)? {
            let size = e.device.size();
            let mut m = json!({
                "name": e.name,
                "size_bytes": size,
                "read_only": e.read_only,
            });
            let att = self.volumes.get(i).and_then(|(_, v)| v.as_ref());
            match (att, att.and_then(|a| a.volume())) {
                (None, _) => {
                    m["cached"] = json!(false);
                    m["state"] = json!("uncached");
                }
                (Some(a), None) => {
                    m["cached"] = json!(false);
                    m["state"] = json!("detached");
                    m["cache"] = json!(a.cache_path().map(|p| p.display().to_string()));
                    m["writes_while_detached"] = json!(a.writes_while_detached());
                }
                (Some(a), Some(v)) => {
                    m["cache"] = json!(a.cache_path().map(|p| p.display().to_string()));
                    let s = a.stats().unwrap_or_else(|| v.stats());
                    let cfg = v.config();
                    let slot_bytes = cfg.fragment_size;
                    let used = s.total_slots.saturating_sub(s.free_slots);
                    m["cached"] = json!(true);
                    m["state"] = json!(if v.is_passthrough() {
                        "failed-passthrough"
                    } else if cfg.write_mode == WriteMode::Passthrough {
                        "passthrough"
                    } else {
                        "active"
                    });
                    m["mode"] = json!(cfg.write_mode.to_string());
                    m["admission"] = json!(cfg.admission.to_string());
                    m["line_size_bytes"] = json!(slot_bytes);
                    m["fragment_size_bytes"] = json!(cfg.heat_bytes());
                    m["heat_size_bytes"] = json!(cfg.heat_bytes());
                    m["cache_bytes"] = json!(s.total_slots * slot_bytes);
                    m["occupancy_bytes"] = json!(used * slot_bytes);
                    m["occupancy_ratio"] = json!(used as f64 / s.total_slots.max(1) as f64);
                    m["read_hit_ratio"] = json!(s.read_hit_ratio());
                    m["read_pages"] = json!(s.read_pages_hit + s.read_pages_missed);
                    m["population_rate_limit_bytes_per_second"] = json!(s.population_rate);
                    let recent = self.rates.recent(i);
                    rates_and_errors(&mut m, recent.as_ref(), &s);
                    m["persistent"] = json!(v.persist_stats().is_some());
                    crate::metrics::writeback_status(&mut m, &v, recent);
                    export_figures(&mut m, a);
                    if let Some(c) = crate::coherent::of(a) {
                        if !c.serving() {
                            m["state"] = json!("shared-passthrough");
                        }
                        m["shared"] = c.status();
                    }
                }
            }
            (self.sources.get(i)).inspect(|s| crate::health::status(&mut m, &s.health(), att));
            exports.push(m);
        }
        let st = self.server.stats();
        Ok(json!({
            "version": env!("CARGO_PKG_VERSION"),
            "uptime_seconds": self.started.elapsed().as_secs_f64(),
            "open_connections": st.open_connections.load(Relaxed),
            "exports": exports,
        }))
    }
}

/// An export's rates over the sampled window (none before two samples), and its cache
/// device's errors, in its status.
fn rates_and_errors(
    m: &mut Value,
    recent: Option<&crate::rates::Recent>,
    s: &sce_engine::VolumeStats,
) {
    if let Some(r) = recent {
        m["populations_per_second"] = json!(r.populations_per_second);
        m["population_bytes_per_second"] = json!(r.population_bytes_per_second);
        m["evictions_per_second"] = json!(r.evictions_per_second);
        m["recent_read_hit_ratio"] = json!((r.read_pages > 0.0).then_some(r.read_hit_ratio));
        m["rates_window_seconds"] = json!(r.window_seconds);
    }
    m["errors"] = json!({
        "cache_read": s.cache_read_errors,
        "cache_write": s.cache_write_errors,
        "cache_checksum": s.cache_checksum_errors,
    });
}

/// Why a prefetch left part of its range uncached.
fn short_because(v: &CacheVolume, len: u64, endurance_refusals: u64) -> String {
    let cfg = v.config();
    let s = v.stats();
    let capacity = s.total_slots * cfg.fragment_size;
    if !cfg.write_mode.caches_reads() {
        format!("the cache is in {}: nothing is populated", cfg.write_mode)
    } else if v.is_passthrough() {
        "the cache device failed: it passes everything through".into()
    } else if endurance_refusals > 0 {
        format!("the endurance budget (max_cache_writes) refused {endurance_refusals} fragment(s)")
    } else if len > capacity {
        format!(
            "the range is larger than the cache ({} bytes): its first fragments were evicted \
             for the last",
            capacity
        )
    } else {
        "no slot could be had for the rest: every slot was held (by reads, populations or \
         dirty data) or its fragment is being written"
            .into()
    }
}

/// The export's own figures, apart from its cache device's (which exports that share the
/// device have in common): its reads, their hit ratio, and the bytes the cache holds of it.
fn export_figures(m: &mut Value, a: &Attachable) {
    let c = &a.counters;
    let (reads, hits) = (c.read_requests.load(Relaxed), c.read_hits.load(Relaxed));
    m["export_read_requests"] = json!(reads);
    m["export_read_hit_ratio"] = json!(hits as f64 / reads.max(1) as f64);
    m["export_cached_bytes"] = json!(a.cached_bytes());
    if let Some(d) = a.dirty_bytes() {
        m["export_dirty_bytes"] = json!(d);
    }
    if let Some(d) = a.dirty_share_bytes() {
        m["export_dirty_share_bytes"] = json!(d);
    }
    if let Some(p) = a.part() {
        m["shared_with"] = json!(p.siblings);
    }
}

/// Sends one request to the admin socket at `path` and returns its result, or the server's
/// error.
pub fn call(path: &Path, req: &Request) -> Result<Value> {
    let c = UnixStream::connect(path).with_context(|| {
        format!(
            "connecting to the admin socket {} (is sce serve running? its log names the socket)",
            path.display()
        )
    })?;
    writeln!(&c, "{}", serde_json::to_string(req)?)?;
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line)?;
    let v: Value = serde_json::from_str(&line).context("bad reply from the admin socket")?;
    if v["ok"] == json!(true) {
        Ok(v["result"].clone())
    } else {
        bail!(
            "{}",
            v["error"]
                .as_str()
                .unwrap_or("the server refused the request")
        )
    }
}

/// True if the client of `conn` went away (closed its end, or the connection broke): a
/// long verb it asked for may stop. A client that sent more (a pipelined request) stays.
fn client_gone(conn: &UnixStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: conn.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: `pfd` is one valid pollfd for the duration of the call; a timeout of 0 never
    // blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    if n <= 0 {
        return false;
    }
    if pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
        return true;
    }
    let mut b = [0u8; 1];
    // SAFETY: `b` is a writable buffer of 1 byte that outlives the call; MSG_PEEK leaves
    // the data for the reader and MSG_DONTWAIT never blocks.
    let r = unsafe {
        libc::recv(
            conn.as_raw_fd(),
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    r == 0
}
