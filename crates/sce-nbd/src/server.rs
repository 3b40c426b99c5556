//! The NBD server: serves any `BlockDevice` (the cached volume is one) to any number of
//! connections, over Unix sockets or TCP, with several named exports.
//!
//! Per connection, one thread reads requests and hands them to a small pool of workers that
//! run them against the device in parallel; replies go out as each finishes (out of order,
//! matched by cookie) under a lock on the socket's write half. A malformed header or a broken
//! socket ends that connection only; every other connection keeps being served.

use crate::proto::{self, errno, ProtoError, Request};
use crossbeam_channel::{bounded, Receiver};
use parking_lot::Mutex;
use sce_io::{AlignedBuf, BlockDevice, IoError};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// Prefetches a range into a cache (NBD_CMD_CACHE).
pub type PrefetchFn = Arc<dyn Fn(u64, u64) -> Result<(), IoError> + Send + Sync>;

/// One export.
#[derive(Clone)]
pub struct Export {
    /// Name clients ask for.
    pub name: String,
    /// Free text shown by `nbdinfo`.
    pub description: String,
    /// What is served.
    pub device: Arc<dyn BlockDevice>,
    /// Refuse writes, trims and write-zeroes with EPERM.
    pub read_only: bool,
    /// What NBD_CMD_CACHE does; `None` acknowledges it without doing anything.
    pub prefetch: Option<PrefetchFn>,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("read_only", &self.read_only)
            .finish()
    }
}

impl Export {
    fn transmission_flags(&self) -> u16 {
        let mut f = proto::TFLAG_HAS_FLAGS
            | proto::TFLAG_SEND_FLUSH
            | proto::TFLAG_SEND_FUA
            | proto::TFLAG_SEND_TRIM
            | proto::TFLAG_SEND_WRITE_ZEROES
            | proto::TFLAG_SEND_CACHE
            | proto::TFLAG_CAN_MULTI_CONN;
        if self.read_only {
            f |= proto::TFLAG_READ_ONLY;
        }
        f
    }
}

/// A socket the server can serve.
pub trait Conn: Read + Write + Send + Sized + 'static {
    /// A second handle on the same socket (for the write half).
    fn try_clone_conn(&self) -> io::Result<Self>;
    /// Shuts both directions down.
    fn shutdown_conn(&self);
    /// Shuts the read direction down: the reader sees end of file, replies still go out.
    fn shutdown_read(&self);
}

macro_rules! socket_conn {
    ($($t:ty),*) => {$(
        impl Conn for $t {
            fn try_clone_conn(&self) -> io::Result<Self> {
                self.try_clone()
            }
            fn shutdown_conn(&self) {
                let _ = self.shutdown(std::net::Shutdown::Both);
            }
            fn shutdown_read(&self) {
                let _ = self.shutdown(std::net::Shutdown::Read);
            }
        }
    )*};
}
socket_conn!(UnixStream, TcpStream);

/// Counters of the server.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections currently open.
    pub open_connections: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Requests that got an error reply.
    pub request_errors: AtomicU64,
    /// Connections ended because of a protocol violation.
    pub protocol_errors: AtomicU64,
}

/// Why a connection ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket failed or closed.
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    /// The client broke the protocol.
    #[error("protocol violation: {0}")]
    Protocol(#[from] ProtoError),
    /// The client asked for an export that does not exist (NBD_OPT_EXPORT_NAME).
    #[error("unknown export {0:?}")]
    UnknownExport(String),
}

/// How many requests of one connection run at once.
const WORKERS_PER_CONNECTION: usize = 32;
/// Requests read ahead of the workers.
const QUEUE_DEPTH: usize = 64;
/// Largest write payload read and discarded before refusing it; beyond, disconnect.
const MAX_DISCARDED_PAYLOAD: u32 = 256 << 20;

/// Closes the read half of one open connection.
type Closer = Box<dyn Fn() + Send>;

/// The NBD server.
pub struct Server {
    exports: Vec<Export>,
    shutting_down: AtomicBool,
    stats: ServerStats,
    conns: Mutex<Vec<(u64, Closer)>>,
    next_conn: AtomicU64,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("exports", &self.exports)
            .finish()
    }
}

fn errno_of(e: &IoError, write: bool) -> u32 {
    match e {
        IoError::OutOfRange { .. } if write => errno::ENOSPC,
        IoError::OutOfRange { .. } | IoError::Unaligned { .. } | IoError::Invalid(_) => {
            errno::EINVAL
        }
        IoError::Unsupported { .. } | IoError::DirectIoUnsupported { .. } => errno::EINVAL,
        IoError::Io { source, .. } => match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => errno::ENOSPC,
            Some(libc::ENOMEM) => errno::ENOMEM,
            _ => errno::EIO,
        },
        _ => errno::EIO,
    }
}

struct Job {
    req: Request,
    payload: Option<AlignedBuf>,
}

impl Server {
    /// A server of `exports`. The first export is also the default one (name "").
    pub fn new(exports: Vec<Export>) -> Arc<Server> {
        Arc::new(Server {
            exports,
            shutting_down: AtomicBool::new(false),
            stats: ServerStats::default(),
            conns: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
        })
    }

    /// The exports.
    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// The counters.
    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }

    /// True once `shutdown` was called.
    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Relaxed)
    }

    /// Stops the server: new options get ERR_SHUTDOWN, new requests ESHUTDOWN, requests in
    /// flight finish, then every connection is closed and every export flushed.
    pub fn shutdown(&self) {
        self.shutting_down.store(true, Relaxed);
        for (_, close) in self.conns.lock().iter() {
            close();
        }
    }

    /// Flushes every export (after shutdown).
    pub fn flush_all(&self) -> Result<(), IoError> {
        for e in &self.exports {
            e.device.flush()?;
        }
        Ok(())
    }

    fn find(&self, name: &str) -> Option<&Export> {
        if name.is_empty() {
            return self.exports.first();
        }
        self.exports.iter().find(|e| e.name == name)
    }

    /// Serves one connection to its end. Errors end only this connection.
    pub fn serve<C: Conn>(self: &Arc<Self>, conn: C) -> Result<(), ConnError> {
        self.stats.connections.fetch_add(1, Relaxed);
        self.stats.open_connections.fetch_add(1, Relaxed);
        let id = self.next_conn.fetch_add(1, Relaxed);
        let closer = conn.try_clone_conn()?;
        // Closing the read half ends the reader; requests in flight still get their replies.
        self.conns
            .lock()
            .push((id, Box::new(move || closer.shutdown_read())));
        let r = self.serve_inner(conn);
        self.conns.lock().retain(|(i, _)| *i != id);
        self.stats.open_connections.fetch_sub(1, Relaxed);
        if matches!(
            r,
            Err(ConnError::Protocol(_)) | Err(ConnError::UnknownExport(_))
        ) {
            self.stats.protocol_errors.fetch_add(1, Relaxed);
        }
        r
    }

    fn serve_inner<C: Conn>(self: &Arc<Self>, mut conn: C) -> Result<(), ConnError> {
        let Some(export) = self.handshake(&mut conn)? else {
            return Ok(());
        };
        self.transmission(conn, export)
    }

    /// Option haggling. Returns the export chosen, or None if the client aborted.
    fn handshake<C: Conn>(&self, c: &mut C) -> Result<Option<Export>, ConnError> {
        let mut hello = Vec::with_capacity(18);
        hello.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
        hello.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        hello
            .extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
        c.write_all(&hello)?;
        let mut cf = [0u8; 4];
        c.read_exact(&mut cf)?;
        let client_flags = u32::from_be_bytes(cf);
        if client_flags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
            return Err(ProtoError::BadMagic(client_flags as u64).into());
        }
        let no_zeroes = client_flags & proto::FLAG_C_NO_ZEROES != 0;
        loop {
            let mut h = [0u8; 16];
            c.read_exact(&mut h)?;
            let oh = proto::parse_option_header(&h)?;
            let mut data = vec![0u8; oh.len as usize];
            c.read_exact(&mut data)?;
            let opt = oh.option;
            if self.is_shutting_down() && opt != proto::OPT_ABORT {
                c.write_all(&proto::option_reply(
                    opt,
                    proto::REP_ERR_SHUTDOWN,
                    b"server is shutting down",
                ))?;
                continue;
            }
            match opt {
                proto::OPT_EXPORT_NAME => {
                    let name = proto::parse_export_name(&data)?;
                    let Some(e) = self.find(&name) else {
                        // The protocol has no error reply here: the server closes.
                        return Err(ConnError::UnknownExport(name));
                    };
                    let mut v = e.device.size().to_be_bytes().to_vec();
                    v.extend_from_slice(&e.transmission_flags().to_be_bytes());
                    if !no_zeroes {
                        v.extend_from_slice(&[0u8; 124]);
                    }
                    c.write_all(&v)?;
                    return Ok(Some(e.clone()));
                }
                proto::OPT_ABORT => {
                    let _ = c.write_all(&proto::option_reply(opt, proto::REP_ACK, &[]));
                    return Ok(None);
                }
                proto::OPT_LIST => {
                    if !data.is_empty() {
                        c.write_all(&proto::option_reply(
                            opt,
                            proto::REP_ERR_INVALID,
                            b"LIST takes no data",
                        ))?;
                        continue;
                    }
                    let mut out = Vec::new();
                    for e in &self.exports {
                        out.extend(proto::option_reply(
                            opt,
                            proto::REP_SERVER,
                            &proto::rep_server(&e.name),
                        ));
                    }
                    out.extend(proto::option_reply(opt, proto::REP_ACK, &[]));
                    c.write_all(&out)?;
                }
                proto::OPT_INFO | proto::OPT_GO => {
                    let req = match proto::parse_info_request(&data) {
                        Ok(r) => r,
                        Err(e) => {
                            c.write_all(&proto::option_reply(
                                opt,
                                proto::REP_ERR_INVALID,
                                e.to_string().as_bytes(),
                            ))?;
                            continue;
                        }
                    };
                    let Some(e) = self.find(&req.name) else {
                        let msg = format!("no export named {:?}", req.name);
                        c.write_all(&proto::option_reply(
                            opt,
                            proto::REP_ERR_UNKNOWN,
                            msg.as_bytes(),
                        ))?;
                        continue;
                    };
                    let mut out = proto::option_reply(
                        opt,
                        proto::REP_INFO,
                        &proto::info_export(e.device.size(), e.transmission_flags()),
                    );
                    let min = e.device.logical_block_size().max(proto::MIN_BLOCK);
                    out.extend(proto::option_reply(
                        opt,
                        proto::REP_INFO,
                        &proto::info_block_size(
                            min,
                            proto::PREFERRED_BLOCK.max(min),
                            proto::MAX_PAYLOAD,
                        ),
                    ));
                    if req.items.contains(&proto::INFO_NAME) {
                        out.extend(proto::option_reply(
                            opt,
                            proto::REP_INFO,
                            &proto::info_string(proto::INFO_NAME, &e.name),
                        ));
                    }
                    if req.items.contains(&proto::INFO_DESCRIPTION) && !e.description.is_empty() {
                        out.extend(proto::option_reply(
                            opt,
                            proto::REP_INFO,
                            &proto::info_string(proto::INFO_DESCRIPTION, &e.description),
                        ));
                    }
                    out.extend(proto::option_reply(opt, proto::REP_ACK, &[]));
                    c.write_all(&out)?;
                    if opt == proto::OPT_GO {
                        return Ok(Some(e.clone()));
                    }
                }
                _ => {
                    c.write_all(&proto::option_reply(
                        opt,
                        proto::REP_ERR_UNSUP,
                        b"option not supported",
                    ))?;
                }
            }
        }
    }

    fn transmission<C: Conn>(self: &Arc<Self>, mut rd: C, export: Export) -> Result<(), ConnError> {
        let wr = Arc::new(Mutex::new(rd.try_clone_conn()?));
        let (tx, rx) = bounded::<Job>(QUEUE_DEPTH);
        let export = Arc::new(export);
        let workers: Vec<JoinHandle<()>> = (0..WORKERS_PER_CONNECTION)
            .map(|_| {
                let (rx, wr, export, me) = (rx.clone(), wr.clone(), export.clone(), self.clone());
                std::thread::spawn(move || me.worker(&rx, &wr, &export))
            })
            .collect();
        drop(rx);
        let result = (|| -> Result<(), ConnError> {
            loop {
                let mut h = [0u8; proto::REQUEST_LEN];
                match rd.read_exact(&mut h) {
                    Ok(()) => {}
                    // The client went away (or we shut the socket down): not an error.
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) if self.is_shutting_down() => {
                        let _ = e;
                        return Ok(());
                    }
                    Err(e) => return Err(e.into()),
                }
                let req = proto::parse_request(&h)?;
                if req.command == proto::CMD_DISC {
                    return Ok(());
                }
                let payload = if req.command == proto::CMD_WRITE {
                    if req.len > proto::MAX_PAYLOAD {
                        if req.len > MAX_DISCARDED_PAYLOAD {
                            return Err(ProtoError::TooLong {
                                what: "write payload",
                                len: req.len as u64,
                                max: MAX_DISCARDED_PAYLOAD as u64,
                            }
                            .into());
                        }
                        // Too big to accept, small enough to skip: read it away, refuse it.
                        io::copy(&mut (&mut rd).take(req.len as u64), &mut io::sink())?;
                        self.reply(&wr, errno::EINVAL, req.cookie, None);
                        continue;
                    }
                    let mut b = AlignedBuf::new(req.len as usize);
                    rd.read_exact(&mut b)?;
                    Some(b)
                } else {
                    None
                };
                if tx.send(Job { req, payload }).is_err() {
                    return Ok(());
                }
            }
        })();
        drop(tx);
        for w in workers {
            let _ = w.join();
        }
        // After a DISC or EOF all outstanding requests are answered; now close.
        wr.lock().shutdown_conn();
        result
    }

    fn reply<C: Conn>(&self, wr: &Mutex<C>, error: u32, cookie: u64, data: Option<&[u8]>) {
        self.stats.requests.fetch_add(1, Relaxed);
        if error != 0 {
            self.stats.request_errors.fetch_add(1, Relaxed);
        }
        let h = proto::simple_reply(error, cookie);
        let mut w = wr.lock();
        let r = w.write_all(&h).and_then(|()| match data {
            Some(d) if error == 0 => w.write_all(d),
            _ => Ok(()),
        });
        if r.is_err() {
            // The client is gone: make sure the reader stops too.
            w.shutdown_conn();
        }
    }

    fn worker<C: Conn>(&self, rx: &Receiver<Job>, wr: &Mutex<C>, e: &Export) {
        for job in rx.iter() {
            let req = job.req;
            if self.is_shutting_down() {
                self.reply(wr, errno::ESHUTDOWN, req.cookie, None);
                continue;
            }
            match self.execute(e, &req, job.payload) {
                Ok(Some(data)) => self.reply(wr, 0, req.cookie, Some(&data)),
                Ok(None) => self.reply(wr, 0, req.cookie, None),
                Err(code) => self.reply(wr, code, req.cookie, None),
            }
        }
    }

    /// Runs one request: Ok(data for reads), or the errno to reply with.
    fn execute(
        &self,
        e: &Export,
        req: &Request,
        payload: Option<AlignedBuf>,
    ) -> Result<Option<AlignedBuf>, u32> {
        let dev = &e.device;
        let size = dev.size();
        let (off, len) = (req.offset, req.len as u64);
        let in_range = off.checked_add(len).is_some_and(|end| end <= size);
        let allowed_flags = match req.command {
            proto::CMD_WRITE => proto::CMD_FLAG_FUA,
            proto::CMD_WRITE_ZEROES => proto::CMD_FLAG_FUA | proto::CMD_FLAG_NO_HOLE,
            proto::CMD_TRIM => proto::CMD_FLAG_FUA,
            proto::CMD_READ | proto::CMD_FLUSH | proto::CMD_CACHE => 0,
            _ => return Err(errno::EINVAL),
        };
        if req.flags & !allowed_flags != 0 {
            return Err(errno::EINVAL);
        }
        let writes = matches!(
            req.command,
            proto::CMD_WRITE | proto::CMD_WRITE_ZEROES | proto::CMD_TRIM
        );
        if writes && e.read_only {
            return Err(errno::EPERM);
        }
        if req.command != proto::CMD_FLUSH && !in_range {
            return Err(if writes { errno::ENOSPC } else { errno::EINVAL });
        }
        let fua = |r: Result<(), IoError>| -> Result<Option<AlignedBuf>, u32> {
            r.map_err(|x| errno_of(&x, true))?;
            if req.flags & proto::CMD_FLAG_FUA != 0 {
                dev.flush().map_err(|x| errno_of(&x, true))?;
            }
            Ok(None)
        };
        match req.command {
            proto::CMD_READ => {
                if req.len > proto::MAX_PAYLOAD {
                    return Err(errno::EINVAL);
                }
                let mut b = AlignedBuf::new(req.len as usize);
                dev.read_at(off, &mut b).map_err(|x| errno_of(&x, false))?;
                Ok(Some(b))
            }
            proto::CMD_WRITE => {
                let b = payload.ok_or(errno::EINVAL)?;
                fua(dev.write_at(off, &b))
            }
            proto::CMD_FLUSH => dev.flush().map(|()| None).map_err(|x| errno_of(&x, true)),
            proto::CMD_TRIM => fua(dev.discard(off, len)),
            proto::CMD_WRITE_ZEROES => {
                if req.flags & proto::CMD_FLAG_NO_HOLE == 0 {
                    // Discard reads back as zeroes by the BlockDevice contract.
                    return fua(dev.discard(off, len));
                }
                let chunk = AlignedBuf::new((1usize << 20).min(len as usize));
                let mut at = off;
                while at < off + len {
                    let n = (chunk.len() as u64).min(off + len - at) as usize;
                    dev.write_at(at, &chunk[..n])
                        .map_err(|x| errno_of(&x, true))?;
                    at += n as u64;
                }
                fua(Ok(()))
            }
            proto::CMD_CACHE => match &e.prefetch {
                Some(p) => p(off, len).map(|()| None).map_err(|x| errno_of(&x, false)),
                None => Ok(None),
            },
            _ => Err(errno::EINVAL),
        }
    }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A Unix socket path.
    Unix(PathBuf),
    /// A TCP address, `host:port`.
    Tcp(String),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(p) = s.strip_prefix("unix:") {
            if p.is_empty() {
                return Err("unix: needs a socket path, like unix:/run/sce/vol.sock".into());
            }
            Ok(ListenAddr::Unix(PathBuf::from(p)))
        } else if let Some(a) = s.strip_prefix("tcp:") {
            if !a.contains(':') {
                return Err(format!("tcp:{a} needs HOST:PORT, like tcp:127.0.0.1:10809"));
            }
            Ok(ListenAddr::Tcp(a.to_string()))
        } else {
            Err(format!(
                "invalid listen address {s:?}: expected unix:PATH or tcp:HOST:PORT"
            ))
        }
    }
}

/// A running listener: accepts connections until stopped.
pub struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    unix_path: Option<PathBuf>,
    /// The address actually bound (for `tcp:127.0.0.1:0`).
    pub local: String,
}

impl Listener {
    /// Stops accepting (connections already open are not touched).
    pub fn stop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = self.unix_path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

fn spawn_conn<C: Conn>(server: &Arc<Server>, conn: C) {
    let s = server.clone();
    std::thread::spawn(move || {
        if let Err(e) = s.serve(conn) {
            tracing::info!("connection ended: {e}");
        }
    });
}

/// Accepts connections from a non-blocking listener until `stop`, serving each on its own
/// thread. `accept` returns a connection ready for blocking I/O.
fn accept_loop<C: Conn>(
    server: &Arc<Server>,
    stop: &Arc<AtomicBool>,
    mut accept: impl FnMut() -> io::Result<C> + Send + 'static,
) -> JoinHandle<()> {
    let (s, st) = (server.clone(), stop.clone());
    let poll = Duration::from_millis(50);
    std::thread::spawn(move || {
        while !st.load(Relaxed) {
            match accept() {
                Ok(c) => spawn_conn(&s, c),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(poll),
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(poll);
                }
            }
        }
    })
}

/// Starts accepting connections on `addr` in a background thread.
pub fn listen(server: &Arc<Server>, addr: &ListenAddr) -> io::Result<Listener> {
    let stop = Arc::new(AtomicBool::new(false));
    match addr {
        ListenAddr::Unix(path) => {
            if path.exists() {
                // A stale socket from an earlier run; refuse anything else.
                let meta = std::fs::symlink_metadata(path)?;
                use std::os::unix::fs::FileTypeExt;
                if !meta.file_type().is_socket() {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} exists and is not a socket", path.display()),
                    ));
                }
                std::fs::remove_file(path)?;
            }
            let l = UnixListener::bind(path)?;
            l.set_nonblocking(true)?;
            let thread = accept_loop(server, &stop, move || {
                let (c, _) = l.accept()?;
                c.set_nonblocking(false)?;
                Ok(c)
            });
            let local = format!("unix:{}", path.display());
            Ok(Listener {
                stop,
                thread: Some(thread),
                unix_path: Some(path.clone()),
                local,
            })
        }
        ListenAddr::Tcp(a) => {
            let l = TcpListener::bind(a)?;
            let local = format!("tcp:{}", l.local_addr()?);
            l.set_nonblocking(true)?;
            let thread = accept_loop(server, &stop, move || {
                let (c, _) = l.accept()?;
                c.set_nonblocking(false)?;
                c.set_nodelay(true)?;
                Ok(c)
            });
            Ok(Listener {
                stop,
                thread: Some(thread),
                unix_path: None,
                local,
            })
        }
    }
}

/// Convenience for tests: the path of a Unix listener.
pub fn unix_path(l: &Listener) -> Option<&Path> {
    l.unix_path.as_deref()
}
