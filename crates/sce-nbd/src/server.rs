//! The NBD server: serves any `BlockDevice` (the cached volume is one) to a bounded number
//! of connections, over Unix sockets or TCP, with several named exports. A malformed header,
//! a broken socket or a timeout ends that connection only; every other connection keeps
//! being served. Every limit and timeout is a field of [`ServerConfig`].
//!
//! # Thread model
//!
//! - One *accept* thread per [`Listener`]. It admits a connection if fewer than
//!   [`ServerConfig::max_connections`] are open, and refuses it otherwise (a log line, the
//!   socket closed, `ServerStats::refused_connections`).
//! - Per admitted connection, a *reader* thread (handshake, then reading requests) and a
//!   *writer* thread (writing replies). Neither runs device I/O.
//! - One pool of [`ServerConfig::workers`] *worker* threads per server, shared by every
//!   connection, runs requests against the devices and hands each reply to the writer of its
//!   connection.
//!
//! So a server has at most `2 × max_connections + workers + listeners` threads. A thread
//! that cannot be spawned refuses the connection; it never panics the process.
//!
//! # Memory
//!
//! Every request holds a *ticket* from the reader until its reply is written (or dropped):
//! the bytes of its payload (writes) or reply (reads) counted against
//! [`ServerConfig::inflight_bytes`] for the server and
//! [`ServerConfig::connection_inflight_bytes`] per connection, and one of
//! [`ServerConfig::connection_queue_depth`] requests per connection. A reader waits for its
//! ticket before it reads on, so a client that stops reading its replies stops being read
//! and pins at most its connection's share, until the reply timeout closes it.
//!
//! # Locks
//!
//! Four locks, never nested, so there is no lock order to get wrong: `Server::conns` (the
//! closers of open connections), `Server::workers` (how many workers run),
//! `Server::shutdown_sender` (taken once, by `shutdown`) and `Shared::used` (the server's in-flight bytes; the per-connection counters change only
//! under it, and `Shared::freed` signals it). No lock is held across socket reads or writes
//! or device I/O; `shutdown` calls the non-blocking `shutdown(2)` of each connection under
//! `conns`, and `start_workers` spawns threads under `workers`. A writer owns the write half
//! of its socket outright (no lock); replies reach it through a channel.
//!
//! # Timeouts
//!
//! Sockets carry a short timeout (100 ms) while a deadline runs, and the I/O loops check
//! the deadline each time it fires: the handshake must finish within `handshake_timeout`, a
//! request that has started arriving must arrive whole within `request_timeout`, and each
//! reply must be written within `reply_timeout`. Between requests a connection may idle for
//! `idle_timeout` (none by default).

use crate::proto::{self, errno, ProtoError, Request};
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use parking_lot::{Condvar, Mutex};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

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
    /// Sets the socket's receive timeout (`None`: block).
    fn set_read_timeout_conn(&self, t: Option<Duration>) -> io::Result<()>;
    /// Sets the socket's send timeout (`None`: block).
    fn set_write_timeout_conn(&self, t: Option<Duration>) -> io::Result<()>;
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
            fn set_read_timeout_conn(&self, t: Option<Duration>) -> io::Result<()> {
                self.set_read_timeout(t)
            }
            fn set_write_timeout_conn(&self, t: Option<Duration>) -> io::Result<()> {
                self.set_write_timeout(t)
            }
        }
    )*};
}
socket_conn!(UnixStream, TcpStream);

/// Counters of the server.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections admitted.
    pub connections: AtomicU64,
    /// Connections currently open.
    pub open_connections: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Requests that got an error reply.
    pub request_errors: AtomicU64,
    /// Connections ended because of a protocol violation.
    pub protocol_errors: AtomicU64,
    /// Connections refused: over `max_connections`, or no thread could be started for them.
    pub refused_connections: AtomicU64,
    /// Connections closed because the handshake took longer than `handshake_timeout`.
    pub handshake_timeouts: AtomicU64,
    /// Connections closed because a request did not arrive whole within `request_timeout`.
    pub request_timeouts: AtomicU64,
    /// Connections closed after `idle_timeout` without a request.
    pub idle_timeouts: AtomicU64,
    /// Connections closed because a reply could not be written within `reply_timeout`.
    pub reply_timeouts: AtomicU64,
    /// Payload bytes held in flight now (requests read and not yet answered).
    pub inflight_bytes: AtomicU64,
    /// The most payload bytes ever held in flight at once.
    pub inflight_bytes_peak: AtomicU64,
}

/// Limits and timeouts of a [`Server`]. `ServerConfig::default()` is what [`Server::new`]
/// uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Connections served at once; more are refused (closed after a log line). Default 256.
    /// Each costs two threads (reader and writer) and two file descriptors.
    pub max_connections: usize,
    /// Worker threads running requests against the devices, shared by every connection.
    /// Default 32.
    pub workers: usize,
    /// Longest time from accepting a connection to the end of option haggling. Default 10 s.
    pub handshake_timeout: Duration,
    /// Longest time a request may take to arrive once its first byte has (header and write
    /// payload, up to 32 MiB): ends slow and stalled clients. Default 60 s.
    pub request_timeout: Duration,
    /// Longest time a connection may wait between requests; `None` (the default) waits for
    /// ever: NBD clients such as qemu keep an idle connection open for hours, and an idle
    /// connection costs only its two threads, which `max_connections` bounds.
    pub idle_timeout: Option<Duration>,
    /// Longest time writing one reply may take; a client that does not read its replies is
    /// disconnected after it. Default 60 s.
    pub reply_timeout: Duration,
    /// Payload bytes the server holds in flight over all connections (write payloads read,
    /// read replies not yet written). Readers wait while it is used up. Default 256 MiB. One
    /// request larger than the budget is still admitted when nothing else is in flight.
    pub inflight_bytes: u64,
    /// The same, per connection. Default 64 MiB.
    pub connection_inflight_bytes: u64,
    /// Requests one connection may have in flight. Default 128.
    pub connection_queue_depth: usize,
    /// After [`Server::shutdown`], how long replies may still take to be written before the
    /// sockets are shut down regardless. Default 5 s.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            max_connections: 256,
            workers: 32,
            handshake_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            idle_timeout: None,
            reply_timeout: Duration::from_secs(60),
            inflight_bytes: 256 << 20,
            connection_inflight_bytes: 64 << 20,
            connection_queue_depth: 128,
            shutdown_grace: Duration::from_secs(5),
        }
    }
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
    /// The client was too slow: in the handshake, sending a request, or idle.
    #[error("timed out {0}")]
    Timeout(&'static str),
    /// The server could not take the connection (limit reached, no thread).
    #[error("connection refused: {0}")]
    Refused(String),
}

/// Largest write payload read and discarded before refusing it; beyond, disconnect.
const MAX_DISCARDED_PAYLOAD: u32 = 256 << 20;

/// The socket timeout while a deadline runs: how often I/O loops look at their deadline.
const SLICE: Duration = Duration::from_millis(100);

/// Closes the read half of one open connection.
type Closer = Box<dyn Fn() + Send>;

/// What the workers share with the server and the connections.
struct Shared {
    cfg: ServerConfig,
    stats: ServerStats,
    shutting_down: AtomicBool,
    shutdown_at: OnceLock<Instant>,
    /// Never sent on: its sender is dropped at shutdown, which wakes every writer waiting
    /// for a reply (they then watch the grace).
    shutdown_signal: Receiver<()>,
    /// Payload bytes in flight over the server; `freed` is signalled when tickets drop.
    used: Mutex<u64>,
    freed: Condvar,
}

impl Shared {
    fn shutting_down(&self) -> bool {
        self.shutting_down.load(Relaxed)
    }

    /// True once the shutdown grace has run out.
    fn past_grace(&self) -> bool {
        self.shutdown_at
            .get()
            .is_some_and(|t| t.elapsed() >= self.cfg.shutdown_grace)
    }
}

/// What a connection's reader, writer and tickets share.
#[derive(Default)]
struct ConnState {
    /// The writer gave up (or the connection ended): stop reading, drop replies.
    dead: AtomicBool,
    bytes: AtomicU64,
    requests: AtomicUsize,
}

/// A request's share of the in-flight budgets, from reading it to its reply being written.
struct Ticket {
    shared: Arc<Shared>,
    conn: Arc<ConnState>,
    bytes: u64,
}

impl Ticket {
    /// Waits until `bytes` fit the server's and the connection's budgets (and the connection
    /// has room for one more request). `None` if the connection died or the server is
    /// shutting down meanwhile.
    fn take(shared: &Arc<Shared>, conn: &Arc<ConnState>, bytes: u64) -> Option<Ticket> {
        let cfg = &shared.cfg;
        let mut used = shared.used.lock();
        loop {
            if conn.dead.load(Relaxed) || shared.shutting_down() {
                return None;
            }
            let mine = conn.bytes.load(Relaxed);
            let fits = (*used == 0 || *used + bytes <= cfg.inflight_bytes)
                && (mine == 0 || mine + bytes <= cfg.connection_inflight_bytes)
                && conn.requests.load(Relaxed) < cfg.connection_queue_depth.max(1);
            if fits {
                *used += bytes;
                conn.bytes.fetch_add(bytes, Relaxed);
                conn.requests.fetch_add(1, Relaxed);
                shared.stats.inflight_bytes.store(*used, Relaxed);
                shared.stats.inflight_bytes_peak.fetch_max(*used, Relaxed);
                return Some(Ticket {
                    shared: shared.clone(),
                    conn: conn.clone(),
                    bytes,
                });
            }
            // Timed, so that a connection dying or a shutdown is noticed without a signal.
            shared.freed.wait_for(&mut used, SLICE);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut used = self.shared.used.lock();
        *used -= self.bytes;
        self.conn.bytes.fetch_sub(self.bytes, Relaxed);
        self.conn.requests.fetch_sub(1, Relaxed);
        self.shared.stats.inflight_bytes.store(*used, Relaxed);
        drop(used);
        self.shared.freed.notify_all();
    }
}

/// A request on its way to a worker.
struct Job {
    conn: Arc<Session>,
    req: Request,
    payload: Option<AlignedBuf>,
    ticket: Ticket,
}

/// A reply on its way to the writer.
struct Reply {
    error: u32,
    cookie: u64,
    data: Option<AlignedBuf>,
    _ticket: Ticket,
}

/// One connection in transmission, as workers see it. The writer ends once every holder
/// (the reader and the jobs in flight) has dropped it.
struct Session {
    export: Export,
    replies: Sender<Reply>,
    state: Arc<ConnState>,
}

/// A socket with a deadline: reads and writes fail with `TimedOut` once it has passed (or,
/// with `shared`, once the shutdown grace has run out). The socket's timeouts must be set
/// to [`SLICE`] so the loops get to look at the clock.
struct Deadlined<'a, C> {
    c: &'a mut C,
    deadline: Instant,
    shared: Option<&'a Shared>,
}

impl<C> Deadlined<'_, C> {
    fn expired(&self) -> Option<io::Error> {
        if Instant::now() >= self.deadline {
            return Some(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        if self.shared.is_some_and(|s| s.past_grace()) {
            return Some(io::Error::new(
                io::ErrorKind::TimedOut,
                "shutdown grace passed",
            ));
        }
        None
    }
}

fn slice_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl<C: Read> Read for Deadlined<'_, C> {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.c.read(b) {
                Err(e) if slice_timeout(&e) => {
                    if let Some(e) = self.expired() {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }
}

impl<C: Write> Write for Deadlined<'_, C> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        loop {
            match self.c.write(b) {
                Err(e) if slice_timeout(&e) => {
                    if let Some(e) = self.expired() {
                        return Err(e);
                    }
                }
                r => return r,
            }
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        self.c.flush()
    }
}

/// The NBD server.
pub struct Server {
    exports: Vec<Export>,
    shared: Arc<Shared>,
    jobs: Sender<Job>,
    job_queue: Receiver<Job>,
    /// Worker threads started.
    workers: Mutex<usize>,
    conns: Mutex<Vec<(u64, Closer)>>,
    next_conn: AtomicU64,
    /// Second (since the server started) of the last refusal logged.
    last_refusal_log: AtomicU64,
    started: Instant,
    /// Dropped by `shutdown` (see `Shared::shutdown_signal`).
    shutdown_sender: Mutex<Option<Sender<()>>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("exports", &self.exports)
            .field("config", &self.shared.cfg)
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

impl Server {
    /// A server of `exports` with the default [`ServerConfig`]. The first export is also the
    /// default one (name "").
    pub fn new(exports: Vec<Export>) -> Arc<Server> {
        Server::with_config(exports, ServerConfig::default())
    }

    /// A server of `exports` with the limits and timeouts of `cfg`. Worker threads start
    /// with the first connection.
    pub fn with_config(exports: Vec<Export>, cfg: ServerConfig) -> Arc<Server> {
        let (jobs, job_queue) = unbounded();
        let (shutdown_sender, shutdown_signal) = bounded(0);
        Arc::new(Server {
            exports,
            shared: Arc::new(Shared {
                cfg,
                stats: ServerStats::default(),
                shutting_down: AtomicBool::new(false),
                shutdown_at: OnceLock::new(),
                shutdown_signal,
                used: Mutex::new(0),
                freed: Condvar::new(),
            }),
            jobs,
            job_queue,
            workers: Mutex::new(0),
            conns: Mutex::new(Vec::new()),
            next_conn: AtomicU64::new(0),
            last_refusal_log: AtomicU64::new(u64::MAX),
            started: Instant::now(),
            shutdown_sender: Mutex::new(Some(shutdown_sender)),
        })
    }

    /// The exports.
    pub fn exports(&self) -> &[Export] {
        &self.exports
    }

    /// The limits and timeouts in force.
    pub fn config(&self) -> &ServerConfig {
        &self.shared.cfg
    }

    /// The counters.
    pub fn stats(&self) -> &ServerStats {
        &self.shared.stats
    }

    /// True once `shutdown` was called.
    pub fn is_shutting_down(&self) -> bool {
        self.shared.shutting_down()
    }

    /// Stops the server and returns at once: new options get ERR_SHUTDOWN, requests not yet
    /// started get ESHUTDOWN, requests running finish and are answered, then every
    /// connection is closed. Replies still unwritten after
    /// [`ServerConfig::shutdown_grace`] (a client that does not read them) are dropped with
    /// their connection. Wait for `stats().open_connections` to reach 0, then call
    /// [`Server::flush_all`].
    pub fn shutdown(&self) {
        let _ = self.shared.shutdown_at.set(Instant::now());
        self.shared.shutting_down.store(true, Relaxed);
        drop(self.shutdown_sender.lock().take());
        for (_, close) in self.conns.lock().iter() {
            close();
        }
        self.shared.freed.notify_all();
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

    /// Takes a connection slot if fewer than `max_connections` are open and workers run.
    fn admit(&self) -> Result<(), String> {
        let max = self.shared.cfg.max_connections as u64;
        let open = &self.shared.stats.open_connections;
        if open
            .fetch_update(Relaxed, Relaxed, |n| (n < max).then_some(n + 1))
            .is_err()
        {
            return Err(format!(
                "{max} connections are open already (max_connections)"
            ));
        }
        if let Err(e) = self.start_workers() {
            open.fetch_sub(1, Relaxed);
            return Err(e);
        }
        Ok(())
    }

    /// Counts and logs a refused connection (at most one log line a second).
    fn refused(&self, why: &str) {
        let n = self.shared.stats.refused_connections.fetch_add(1, Relaxed) + 1;
        let now = self.started.elapsed().as_secs();
        if self.last_refusal_log.swap(now, Relaxed) != now {
            tracing::warn!("refusing an NBD connection: {why} ({n} refused so far)");
        }
    }

    /// Starts the worker pool up to `workers` threads. Fails only if not one runs.
    fn start_workers(&self) -> Result<(), String> {
        let mut n = self.workers.lock();
        while *n < self.shared.cfg.workers.max(1) {
            let (queue, shared) = (self.job_queue.clone(), self.shared.clone());
            match std::thread::Builder::new()
                .name("nbd-worker".into())
                .spawn(move || work(&shared, &queue))
            {
                Ok(_) => *n += 1,
                Err(e) => {
                    if *n == 0 {
                        return Err(format!("cannot start a worker thread: {e}"));
                    }
                    tracing::warn!("cannot start more NBD worker threads ({} run): {e}", *n);
                    break;
                }
            }
        }
        Ok(())
    }

    /// Serves one connection to its end. Errors end only this connection. Over
    /// `max_connections` the connection is refused ([`ConnError::Refused`]).
    pub fn serve<C: Conn>(self: &Arc<Self>, conn: C) -> Result<(), ConnError> {
        if let Err(why) = self.admit() {
            self.refused(&why);
            return Err(ConnError::Refused(why));
        }
        self.serve_admitted(conn)
    }

    /// Serves a connection that holds a slot (see `admit`), and gives the slot back.
    fn serve_admitted<C: Conn>(self: &Arc<Self>, conn: C) -> Result<(), ConnError> {
        let stats = &self.shared.stats;
        stats.connections.fetch_add(1, Relaxed);
        let id = self.next_conn.fetch_add(1, Relaxed);
        let r = match conn.try_clone_conn() {
            Ok(closer) => {
                // Closing the read half ends the reader; requests in flight still get their
                // replies.
                self.conns
                    .lock()
                    .push((id, Box::new(move || closer.shutdown_read())));
                let r = self.serve_inner(conn);
                self.conns.lock().retain(|(i, _)| *i != id);
                r
            }
            Err(e) => Err(e.into()),
        };
        stats.open_connections.fetch_sub(1, Relaxed);
        r
    }

    /// Counts why a connection ends, before its socket is closed (so that a client seeing
    /// the close sees the counter too).
    fn note(&self, r: Result<(), ConnError>) -> Result<(), ConnError> {
        let stats = &self.shared.stats;
        match &r {
            Err(ConnError::Protocol(_)) | Err(ConnError::UnknownExport(_)) => {
                stats.protocol_errors.fetch_add(1, Relaxed);
            }
            Err(ConnError::Timeout(what)) => {
                let counter = match *what {
                    HANDSHAKE => &stats.handshake_timeouts,
                    IDLE => &stats.idle_timeouts,
                    _ => &stats.request_timeouts,
                };
                counter.fetch_add(1, Relaxed);
            }
            _ => {}
        }
        r
    }

    fn serve_inner<C: Conn>(self: &Arc<Self>, mut conn: C) -> Result<(), ConnError> {
        conn.set_read_timeout_conn(Some(SLICE))?;
        conn.set_write_timeout_conn(Some(SLICE))?;
        let mut timed = Deadlined {
            c: &mut conn,
            deadline: Instant::now() + self.shared.cfg.handshake_timeout,
            shared: None,
        };
        let export = match self.handshake(&mut timed) {
            Ok(Some(e)) => e,
            Ok(None) => return Ok(()),
            Err(ConnError::Io(e)) if e.kind() == io::ErrorKind::TimedOut => {
                return self.note(Err(ConnError::Timeout(HANDSHAKE)));
            }
            Err(e) => return self.note(Err(e)),
        };
        self.transmission(conn, export)
    }

    /// Option haggling. Returns the export chosen, or None if the client aborted.
    fn handshake<S: Read + Write>(&self, c: &mut S) -> Result<Option<Export>, ConnError> {
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

    /// Reads requests and queues them for the workers until the client disconnects, breaks
    /// the protocol or times out, or the server shuts down; then waits for the writer to
    /// answer what was queued.
    fn transmission<C: Conn>(self: &Arc<Self>, mut rd: C, export: Export) -> Result<(), ConnError> {
        let wr = rd.try_clone_conn()?;
        let state = Arc::new(ConnState::default());
        let (replies, queue) = unbounded::<Reply>();
        let writer = {
            let (shared, state) = (self.shared.clone(), state.clone());
            std::thread::Builder::new()
                .name("nbd-writer".into())
                .spawn(move || write_replies(&shared, wr, &queue, &state))
                .map_err(|e| {
                    let why = format!("cannot start a writer thread: {e}");
                    self.refused(&why);
                    ConnError::Refused(why)
                })?
        };
        let session = Arc::new(Session {
            export,
            replies,
            state: state.clone(),
        });
        let result = self.note(self.read_requests(&mut rd, &session));
        // The writer ends once the jobs in flight have dropped their sessions too.
        drop(session);
        if result.is_err() {
            state.dead.store(true, Relaxed);
        }
        let _ = writer.join();
        state.dead.store(true, Relaxed);
        rd.shutdown_conn();
        result
    }

    fn read_requests<C: Conn>(&self, rd: &mut C, session: &Arc<Session>) -> Result<(), ConnError> {
        let cfg = &self.shared.cfg;
        let idle = cfg.idle_timeout.filter(|t| !t.is_zero());
        // Whether the socket's read timeout is `idle` (between requests) or SLICE.
        let mut idle_mode = false;
        loop {
            let mut h = [0u8; proto::REQUEST_LEN];
            if !idle_mode {
                rd.set_read_timeout_conn(idle)?;
                idle_mode = true;
            }
            let got = match rd.read(&mut h) {
                // The client went away (or we shut the socket down): not an error.
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) if self.is_shutting_down() || session.state.dead.load(Relaxed) => {
                    return Ok(())
                }
                Err(e) if slice_timeout(&e) => return Err(ConnError::Timeout(IDLE)),
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(()),
                Err(e) => return Err(e.into()),
            };
            let deadline = Instant::now() + cfg.request_timeout;
            let timeout = |e: io::Error| -> ConnError {
                match e.kind() {
                    io::ErrorKind::TimedOut => ConnError::Timeout(REQUEST),
                    _ => e.into(),
                }
            };
            if got < h.len() {
                rd.set_read_timeout_conn(Some(SLICE))?;
                idle_mode = false;
                Deadlined {
                    c: &mut *rd,
                    deadline,
                    shared: None,
                }
                .read_exact(&mut h[got..])
                .map_err(timeout)?;
            }
            let req = proto::parse_request(&h)?;
            if req.command == proto::CMD_DISC {
                return Ok(());
            }
            let too_long = req.len > proto::MAX_PAYLOAD;
            let bytes = match req.command {
                proto::CMD_READ | proto::CMD_WRITE if !too_long => req.len as u64,
                _ => 0,
            };
            // Waits while the budgets are used up: the client is not read meanwhile.
            let Some(ticket) = Ticket::take(&self.shared, &session.state, bytes) else {
                return Ok(());
            };
            let payload = if req.command == proto::CMD_WRITE {
                // The payload gets its own deadline: waiting for the budget is the server's
                // doing, not the client's.
                let deadline = Instant::now() + cfg.request_timeout;
                if idle_mode {
                    rd.set_read_timeout_conn(Some(SLICE))?;
                    idle_mode = false;
                }
                let mut timed = Deadlined {
                    c: &mut *rd,
                    deadline,
                    shared: None,
                };
                if too_long {
                    if req.len > MAX_DISCARDED_PAYLOAD {
                        return Err(ProtoError::TooLong {
                            what: "write payload",
                            len: req.len as u64,
                            max: MAX_DISCARDED_PAYLOAD as u64,
                        }
                        .into());
                    }
                    // Too big to accept, small enough to skip: read it away, refuse it.
                    io::copy(&mut (&mut timed).take(req.len as u64), &mut io::sink())
                        .map_err(timeout)?;
                    let _ = session.replies.send(Reply {
                        error: errno::EINVAL,
                        cookie: req.cookie,
                        data: None,
                        _ticket: ticket,
                    });
                    continue;
                }
                let mut b = AlignedBuf::new(req.len as usize);
                timed.read_exact(&mut b).map_err(timeout)?;
                Some(b)
            } else {
                None
            };
            let job = Job {
                conn: session.clone(),
                req,
                payload,
                ticket,
            };
            if self.jobs.send(job).is_err() {
                return Ok(());
            }
        }
    }
}

/// What timed out, for [`ConnError::Timeout`] and the counters.
const HANDSHAKE: &str = "in the handshake";
const REQUEST: &str = "receiving a request";
const IDLE: &str = "waiting for a request (idle)";

/// A worker: runs jobs of any connection until the server is dropped.
fn work(shared: &Shared, queue: &Receiver<Job>) {
    for job in queue.iter() {
        let Job {
            conn,
            req,
            payload,
            ticket,
        } = job;
        let r = if shared.shutting_down() {
            Err(errno::ESHUTDOWN)
        } else if conn.state.dead.load(Relaxed) {
            // Nobody will read the reply.
            Err(errno::EIO)
        } else {
            execute(&conn.export, &req, payload)
        };
        let (error, data) = match r {
            Ok(data) => (0, data),
            Err(code) => (code, None),
        };
        // Fails only if the writer has gone; the ticket is released either way.
        let _ = conn.replies.send(Reply {
            error,
            cookie: req.cookie,
            data,
            _ticket: ticket,
        });
    }
}

/// A writer: writes the replies of one connection until every holder of its session is
/// gone. A reply not written within `reply_timeout` (or the shutdown grace) kills the
/// connection; later replies are dropped.
fn write_replies<C: Conn>(shared: &Shared, mut wr: C, queue: &Receiver<Reply>, state: &ConnState) {
    let stats = &shared.stats;
    let mut broken = wr.set_write_timeout_conn(Some(SLICE)).is_err();
    loop {
        let next = if shared.shutting_down() {
            // Replies of requests still running (a slow device) may not come in time: shut
            // the socket down once the grace has run out, whatever is still to come.
            match queue.recv_timeout(SLICE) {
                Err(RecvTimeoutError::Timeout) => {
                    if !broken && shared.past_grace() {
                        broken = true;
                        state.dead.store(true, Relaxed);
                        wr.shutdown_conn();
                    }
                    continue;
                }
                r => r.ok(),
            }
        } else {
            crossbeam_channel::select! {
                recv(queue) -> r => r.ok(),
                recv(shared.shutdown_signal) -> _ => continue,
            }
        };
        let Some(reply) = next else { break };
        stats.requests.fetch_add(1, Relaxed);
        if reply.error != 0 {
            stats.request_errors.fetch_add(1, Relaxed);
        }
        if broken {
            continue;
        }
        let mut timed = Deadlined {
            c: &mut wr,
            deadline: Instant::now() + shared.cfg.reply_timeout,
            shared: Some(shared),
        };
        let h = proto::simple_reply(reply.error, reply.cookie);
        let r = timed.write_all(&h).and_then(|()| match &reply.data {
            Some(d) if reply.error == 0 => timed.write_all(d),
            _ => Ok(()),
        });
        if let Err(e) = r {
            if e.kind() == io::ErrorKind::TimedOut && !shared.shutting_down() {
                stats.reply_timeouts.fetch_add(1, Relaxed);
                tracing::warn!(
                    "NBD client did not read its replies for {:?}: disconnecting it",
                    shared.cfg.reply_timeout
                );
            }
            // The client is gone or stuck: stop the reader too, drop what is left.
            broken = true;
            state.dead.store(true, Relaxed);
            wr.shutdown_conn();
        }
    }
    // After a DISC or EOF all outstanding requests are answered; now close.
    wr.shutdown_conn();
}

/// Runs one request: Ok(data for reads), or the errno to reply with.
fn execute(
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

/// How to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenOptions {
    /// Permission bits of a Unix socket, whatever the umask. Default `0o600`: only the
    /// owner may connect. Ignored for TCP.
    pub socket_mode: u32,
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions { socket_mode: 0o600 }
    }
}

/// A running listener: accepts connections until stopped.
pub struct Listener {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    /// The socket file and its (device, inode), to remove it only if it is still ours.
    unix_path: Option<(PathBuf, (u64, u64))>,
    /// The address actually bound (for `tcp:127.0.0.1:0`).
    pub local: String,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("local", &self.local)
            .finish()
    }
}

fn file_id(p: &Path) -> io::Result<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(p)?;
    Ok((m.dev(), m.ino()))
}

impl Listener {
    /// Stops accepting (connections already open are not touched) and removes the socket
    /// file of a Unix listener, if it is still the one this listener created.
    pub fn stop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        if let Some((p, id)) = self.unix_path.take() {
            if file_id(&p).is_ok_and(|now| now == id) {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Admits `conn` and serves it on a thread of its own, or refuses it (closing it).
fn spawn_conn<C: Conn>(server: &Arc<Server>, conn: C) {
    if let Err(why) = server.admit() {
        server.refused(&why);
        return;
    }
    let s = server.clone();
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            if let Err(e) = s.serve_admitted(conn) {
                tracing::info!("connection ended: {e}");
            }
        });
    if let Err(e) = spawned {
        // The closure, and the connection with it, is dropped: the socket closes.
        server.shared.stats.open_connections.fetch_sub(1, Relaxed);
        server.refused(&format!("cannot start a connection thread: {e}"));
    }
}

/// Accepts connections from a non-blocking listener until `stop`, serving each on its own
/// thread. `accept` returns a connection ready for blocking I/O.
fn accept_loop<C: Conn>(
    server: &Arc<Server>,
    stop: &Arc<AtomicBool>,
    fd: RawFd,
    mut accept: impl FnMut() -> io::Result<C> + Send + 'static,
) -> io::Result<JoinHandle<()>> {
    let (s, st) = (server.clone(), stop.clone());
    let poll = Duration::from_millis(50);
    // Waits until a connection arrives, or `poll` passes (to look at `stop`).
    let wait = move || {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `p` is one valid pollfd for the duration of the call; `fd` is owned by
        // the listener that `accept` holds, which lives as long as this thread.
        if unsafe { libc::poll(&mut p, 1, poll.as_millis() as libc::c_int) } < 0 {
            std::thread::sleep(poll);
        }
    };
    std::thread::Builder::new()
        .name("nbd-accept".into())
        .spawn(move || {
            while !st.load(Relaxed) {
                match accept() {
                    Ok(c) => spawn_conn(&s, c),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait(),
                    Err(e) => {
                        tracing::warn!("accept: {e}");
                        std::thread::sleep(poll);
                    }
                }
            }
        })
}

/// Refuses a Unix socket path that is not ours to take: a live socket (a server answers
/// there), or anything that is not a socket. `Ok` when the path is free or holds a stale
/// socket (nothing answers), which binding replaces.
fn check_unix_path(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        ));
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            format!(
                "{}: a server is listening on this socket already",
                path.display()
            ),
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!(
                "{}: cannot tell whether a server uses it: {e}",
                path.display()
            ),
        )),
    }
}

/// Binds a Unix socket at `path` with permission bits `mode`, atomically: the socket is
/// bound under a temporary name next to `path`, given its mode, then renamed over `path`
/// (replacing a stale socket), so it is never reachable with the umask's mode.
fn bind_unix(path: &Path, mode: u32) -> io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    check_unix_path(path)?;
    let name = path
        .file_name()
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} is not a file path", path.display()),
            )
        })?
        .to_string_lossy();
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let tmp = path.with_file_name(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Relaxed)
    ));
    let l = UnixListener::bind(&tmp)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode & 0o777))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&tmp);
        return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display())));
    }
    Ok(l)
}

/// Starts accepting connections on `addr` in a background thread, with the default
/// [`ListenOptions`].
pub fn listen(server: &Arc<Server>, addr: &ListenAddr) -> io::Result<Listener> {
    listen_with(server, addr, &ListenOptions::default())
}

/// Starts accepting connections on `addr` in a background thread.
///
/// A Unix socket is created with mode `opts.socket_mode`. If `addr`'s path exists, it must
/// be a stale socket (no server answers on it), which is replaced; a live socket is refused
/// with `AddrInUse`, anything else with `AlreadyExists`, both naming the path.
pub fn listen_with(
    server: &Arc<Server>,
    addr: &ListenAddr,
    opts: &ListenOptions,
) -> io::Result<Listener> {
    let stop = Arc::new(AtomicBool::new(false));
    match addr {
        ListenAddr::Unix(path) => {
            let l = bind_unix(path, opts.socket_mode)?;
            let id = file_id(path)?;
            l.set_nonblocking(true)?;
            let fd = l.as_raw_fd();
            let thread = accept_loop(server, &stop, fd, move || {
                let (c, _) = l.accept()?;
                c.set_nonblocking(false)?;
                Ok(c)
            });
            let thread = match thread {
                Ok(t) => t,
                Err(e) => {
                    let _ = std::fs::remove_file(path);
                    return Err(e);
                }
            };
            Ok(Listener {
                stop,
                thread: Some(thread),
                unix_path: Some((path.clone(), id)),
                local: format!("unix:{}", path.display()),
            })
        }
        ListenAddr::Tcp(a) => {
            let l = TcpListener::bind(a)?;
            let local = format!("tcp:{}", l.local_addr()?);
            l.set_nonblocking(true)?;
            let fd = l.as_raw_fd();
            let thread = accept_loop(server, &stop, fd, move || {
                let (c, _) = l.accept()?;
                c.set_nonblocking(false)?;
                c.set_nodelay(true)?;
                Ok(c)
            })?;
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
    l.unix_path.as_ref().map(|(p, _)| p.as_path())
}
