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
//! - Per admitted connection, a *reader* thread (handshake, then reading requests), and a
//!   *writer* thread only from the first reply that could not go out at once (a client
//!   that reads its replies promptly never gets one). Neither runs device I/O.
//! - One pool of [`ServerConfig::workers`] *worker* threads per server, shared by every
//!   connection, runs requests against the devices and sends each reply itself with one
//!   non-blocking `sendmsg` of header and data, when the socket takes it at once and no
//!   other reply is being written (the common case: one hand-off per request, reader to
//!   worker). A reply that would block, or only partly went out, is finished by the writer
//!   of its connection, so a client that does not read its replies never holds a worker.
//! - An export with an I/O queue ([`Export::io`]: io_uring on a local file or device) takes
//!   reads, writes and flushes straight from the reader: it submits them with their pooled
//!   buffer, and the queue's completion thread sends the reply the same way a worker does.
//!   No worker and no hand-off on the way in; the device sees as many requests in flight
//!   as the clients send; a cached volume ([`ExportIo::Reads`]) its hits. The rest goes to
//!   the workers; a request alone in flight runs on the reader (`inline_when_idle`): a
//!   read, write or flush of a local file, and a cached volume's write or flush that its
//!   cache device alone serves (write-back through the log).
//!
//! - A TCP connection that starts TLS (NBD_OPT_STARTTLS, see `tls.rs`) gets a *pump*
//!   thread that owns the TLS session and moves plaintext to and from one end of a Unix
//!   socket pair; everything above serves the other end as it serves any connection.
//!
//! So a server has at most `3 × max_connections + workers + listeners` threads, and in
//! practice one per connection plus the workers. A reader thread that cannot be spawned
//! refuses the connection; a writer that cannot be, leaves the blocking write to the worker;
//! neither panics the process.
//!
//! # Memory
//!
//! Every request holds a *ticket* from the reader until its reply is written (or dropped):
//! the bytes of its payload (writes) or reply (reads) counted against
//! [`ServerConfig::inflight_bytes`] for the server and
//! [`ServerConfig::connection_inflight_bytes`] per connection, and one of
//! [`ServerConfig::connection_queue_depth`] requests per connection. A reader waits for its
//! ticket before it reads on, so a client that stops reading its replies stops being read
//! and pins at most its connection's share, until the reply timeout closes it (plus a 64 KiB
//! receive buffer per connection).
//!
//! # Locks
//!
//! Each lock carries its level in its type (`sce_io::order`; a debug build panics on a lock
//! taken out of order): `unaligned::RMW` is `NbdRmw` (0), a connection's `Session::writer`
//! and `Session::out` are `NbdConn` (15), the others `Leaf` (17).
//!
//! Four server-wide locks, never nested, so there is no lock order to get wrong: `Server::conns` (the
//! closers of open connections), `Server::workers` (how many workers run),
//! `Server::shutdown_sender` (taken once, by `shutdown`) and `Shared::used` (the server's in-flight bytes; the per-connection counters change only
//! under it, and `Shared::freed` signals it). No lock is held across socket reads or writes
//! or device I/O; `shutdown` calls the non-blocking `shutdown(2)` of each connection under
//! `conns`, and `start_workers` spawns threads under `workers`.
//!
//! The write half of a connection sits behind its own mutex (`Session::out`), a leaf: a
//! worker only `try_lock`s it for one non-blocking send (and leaves a partly sent reply in
//! it for the writer), the writer locks it for its blocking writes, which `reply_timeout`
//! bounds. Under it only a written reply's ticket is released (`Shared::used`, a leaf);
//! under `Session::writer` only the writer thread's handle is stored. An I/O queue's own lock (its table of
//! operations in flight) is a device's (`Device`, 18), held to push a batch's entries (the kernel is
//! entered after it is released); its callbacks run with no lock held.
//!
//! One lock is held across device I/O: `unaligned::RMW`, by a worker serving an unaligned
//! write of a client that did not ask for block sizes (read-modify-write). It is taken
//! with no server lock held, and none is taken under it (the device takes its own).
//!
//! # Timeouts
//!
//! Sockets carry a short timeout (100 ms) while a deadline runs, and the I/O loops check
//! the deadline each time it fires: the handshake must finish within `handshake_timeout`, a
//! request that has started arriving must arrive whole within `request_timeout`, and each
//! reply must be written within `reply_timeout`. Between requests a connection may idle for
//! `idle_timeout` (none by default).

mod errors;
mod exec;
mod handshake;
mod jobs;
mod listen;
mod psk;
mod queued;
mod reader;
mod send;
mod serve;
mod tls;
mod transmission;
mod unaligned;
mod worker;

pub use listen::{bind_unix, listen, listen_with, unix_path, ListenAddr, ListenOptions, Listener};
pub use tls::{ServerTls, TlsMode};

use jobs::JobQueue;
use transmission::{Deadlined, Job, HANDSHAKE, IDLE};
use worker::work;

use crate::proto::{self, errno, ProtoError, Request};
use crossbeam_channel::{bounded, unbounded, Receiver, RecvTimeoutError, Sender};
use parking_lot::Condvar;
use sce_io::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use sce_io::{AlignedBuf, BlockDevice, BufPool, IoError, PooledBuf};
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
    /// How requests reach `device` without the workers (`None`: the workers run
    /// everything).
    pub io: Option<ExportIo>,
}

/// The ways an export's requests can skip the workers.
#[derive(Clone)]
pub enum ExportIo {
    /// An owned-buffer queue on the device itself (io_uring on a local file or block
    /// device): reads, writes and flushes are submitted to it by the connection's reader
    /// and answered from its completions.
    Queue(Arc<dyn sce_io::IoQueue>),
    /// A device that serves some reads from a queue (a cached volume's hits): those are
    /// started by the reader and answered from their completions; every other request goes
    /// to the workers.
    Reads(Arc<dyn sce_io::QueuedReads>),
}

impl ExportIo {
    /// The queue, for an export served through one.
    pub fn queue(&self) -> Option<&Arc<dyn sce_io::IoQueue>> {
        match self {
            ExportIo::Queue(q) => Some(q),
            ExportIo::Reads(_) => None,
        }
    }
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("read_only", &self.read_only)
            .field(
                "io",
                &self.io.as_ref().map(|io| match io {
                    ExportIo::Queue(q) => q.backend().name(),
                    ExportIo::Reads(_) => "queued reads",
                }),
            )
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
    /// The socket's descriptor (for non-blocking sends of replies).
    fn raw_fd(&self) -> RawFd;
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
            fn raw_fd(&self) -> RawFd {
                self.as_raw_fd()
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
    /// Requests submitted to an export's I/O queue (io_uring) by the reader, without a
    /// worker.
    pub queued_requests: AtomicU64,
    /// Requests the reader ran itself: alone in flight on their connection, on an export
    /// with an I/O queue, or a cached volume's write or flush that its cache device alone
    /// serves (see [`ServerConfig::inline_when_idle`]).
    pub inline_requests: AtomicU64,
    /// Connections ended because of a protocol violation.
    pub protocol_errors: AtomicU64,
    /// Connections refused: over `max_connections`, or no thread could be started for them.
    pub refused_connections: AtomicU64,
    /// Connections that started TLS.
    pub tls_connections: AtomicU64,
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
    /// On an export with an I/O queue (a local file or device), a read, write or flush that
    /// is alone in flight on its connection, with nothing more arriving, runs on the reader
    /// itself: a client at queue depth 1 then costs one thread wake-up per request instead
    /// of two. So does a cached volume's write or flush that its cache device alone serves
    /// ([`sce_io::QueuedReads::runs_locally`]: write-back through the log). Default on.
    pub inline_when_idle: bool,
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
            inline_when_idle: true,
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
    /// The TLS handshake failed (a bad or missing certificate, a protocol error), or the
    /// client skipped TLS where it is required.
    #[error("TLS: {0}")]
    Tls(String),
}

/// Largest write payload read and discarded before refusing it; beyond, disconnect.
const MAX_DISCARDED_PAYLOAD: u32 = 256 << 20;

/// Idle buffers the server keeps for reuse, at most.
const POOL_BYTES: u64 = 64 << 20;

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
    /// Buffers of read replies and write payloads, reused between requests (a leaf lock
    /// per size class, taken only to pop or push one buffer).
    pool: Arc<BufPool>,
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

/// The NBD server.
pub struct Server {
    exports: Vec<Export>,
    shared: Arc<Shared>,
    jobs: Arc<JobQueue>,
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

impl Drop for Server {
    /// The workers finish the jobs queued and leave (a reader holds the server, so none is
    /// left to queue more).
    fn drop(&mut self) {
        self.jobs.close();
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("exports", &self.exports)
            .field("config", &self.shared.cfg)
            .finish()
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
                pool: BufPool::new(POOL_BYTES),
            }),
            jobs: Arc::new(JobQueue::default()),
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
            let (queue, shared) = (self.jobs.clone(), self.shared.clone());
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
        self.serve_admitted(conn, None)
    }
}
