//! `NbdClient`: a remote NBD export as a `BlockDevice`, so a source can be a SAN-like export
//! (`nbd://host:port/name`, `nbd+unix:///name?socket=PATH`). Requests are pipelined: each
//! connection carries up to [`ClientOptions::queue_depth`] requests at once, answered by
//! cookie, and the client keeps several connections when the server allows it
//! (CAN_MULTI_CONN), one otherwise. Each request goes to the least loaded connection.
//!
//! The source may go away and come back (a restart, a network cut): no request waits for it.
//! Every request has a deadline ([`ClientOptions::request_timeout`]), broken connections are
//! closed and reopened on demand with an exponential backoff, and while the source is away
//! requests fail with [`IoError::Io`] (EIO at the NBD edge).

use crate::conn::{bad, connect, Conn};
use crate::proto::{self, errno};
use crate::uri::NbdUri;
use parking_lot::Condvar;
use sce_io::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use sce_io::{check_range, BlockDevice, IoError, Op};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How an [`NbdClient`] waits for its source and retries when the source goes away.
///
/// Whatever the source does, a request returns within about `request_timeout` (plus the
/// `connect_timeout` of one reconnection attempt it may make); while the source is away,
/// requests fail with [`IoError::Io`] (EIO at the NBD edge) instead of waiting for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Longest time to open a connection and negotiate the export (TCP connect, handshake,
    /// NBD_OPT_GO). Default 10 s. A Unix socket connect itself only blocks when the server's
    /// listen backlog is full, and name resolution of a TCP host is not bounded by it.
    pub connect_timeout: Duration,
    /// Longest time one request may take, from waiting for room on a connection to the
    /// last byte of its reply. Default 60 s. A connection on which a request timed out is
    /// closed (its stream is in an unknown state; the other requests on it fail too) and
    /// replaced later.
    pub request_timeout: Duration,
    /// Wait after a failed reconnection before the next attempt. Requests that need a new
    /// connection during that wait fail at once. Default 50 ms.
    pub backoff_initial: Duration,
    /// The wait doubles after each failed attempt up to this. Default 5 s. A successful
    /// connection resets it to `backoff_initial`.
    pub backoff_max: Duration,
    /// Requests in flight on one connection at most (pipelined, answered by cookie).
    /// Default 32. A request waits for room (within its `request_timeout`) when every
    /// connection carries this many.
    pub queue_depth: usize,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            queue_depth: 32,
        }
    }
}

/// The connections of a client and what it knows about reaching the source.
struct Pool {
    /// Open connections (a broken one is dropped from here when next seen).
    conns: Vec<Arc<Conn>>,
    /// Connections being opened.
    opening: usize,
    /// Wait after the next failed reconnection.
    backoff: Duration,
    /// No reconnection attempt before this (set by a failed one).
    retry_at: Option<Instant>,
    /// Why the last reconnection failed.
    last_error: String,
}

/// A remote export, as a `BlockDevice`.
///
/// Each request goes to the open connection with the fewest requests in flight, up to
/// [`ClientOptions::queue_depth`] per connection; several connections only when the server
/// sets CAN_MULTI_CONN. A connection that fails or times out is closed; connections are
/// reopened on demand, with an exponential backoff after failed attempts (see
/// [`ClientOptions`]). While the source is away requests fail with [`IoError::Io`]; none
/// waits for the source to come back. A request that failed on a connection it did not open
/// itself (the source may have restarted since) is retried once: every NBD command the
/// client sends is idempotent.
///
/// Dropping the client sends NBD_CMD_DISC on its connections and closes them; it never
/// waits for an absent source for longer than a second per connection.
pub struct NbdClient {
    uri: NbdUri,
    size: u64,
    flags: u16,
    capacity: usize,
    opts: ClientOptions,
    pool: Mutex<Pool>,
    room: Condvar,
    /// The block-status connection, opened on the first `extents` (a leaf lock, held
    /// across that connection's I/O: block status is asked one at a time).
    status: Mutex<StatusState>,
}

/// Whether the source can tell its holes, as far as we know.
enum StatusState {
    /// Not asked yet (or the last connection failed).
    Unknown,
    /// No structured replies or no `base:allocation`.
    Unsupported,
    Conn(crate::status::StatusConn),
}

impl std::fmt::Debug for NbdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdClient")
            .field("uri", &self.uri)
            .field("size", &self.size)
            .field("opts", &self.opts)
            .finish()
    }
}

fn open_err(uri: &NbdUri, e: io::Error) -> IoError {
    IoError::Open {
        path: PathBuf::from(uri.to_string()),
        source: e,
    }
}

/// A place taken on a connection for one request; gives it back on drop.
struct Slot<'a> {
    client: &'a NbdClient,
    conn: Arc<Conn>,
    /// The connection was opened for this request (a failure on it is no stale connection).
    fresh: bool,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let _p = self.client.pool.lock();
        self.conn.inflight.fetch_sub(1, Relaxed);
        self.client.room.notify_one();
    }
}

impl NbdClient {
    /// Connects with up to `connections` connections (1 unless the server allows several),
    /// with the default [`ClientOptions`].
    pub fn connect(uri: &NbdUri, connections: usize) -> Result<NbdClient, IoError> {
        NbdClient::connect_with(uri, connections, ClientOptions::default())
    }

    /// Connects with up to `connections` connections (1 unless the server allows several).
    /// The first connection must succeed within `opts.connect_timeout`.
    pub fn connect_with(
        uri: &NbdUri,
        connections: usize,
        opts: ClientOptions,
    ) -> Result<NbdClient, IoError> {
        let (first, size, flags) =
            connect(uri, opts.connect_timeout).map_err(|e| open_err(uri, e))?;
        let capacity = if flags & proto::TFLAG_CAN_MULTI_CONN != 0 {
            connections.max(1)
        } else {
            1
        };
        let mut conns = vec![Arc::new(Conn::start(first).map_err(|e| open_err(uri, e))?)];
        for _ in 1..capacity {
            let (s, _, _) = connect(uri, opts.connect_timeout).map_err(|e| open_err(uri, e))?;
            conns.push(Arc::new(Conn::start(s).map_err(|e| open_err(uri, e))?));
        }
        Ok(NbdClient {
            uri: uri.clone(),
            size,
            flags,
            capacity,
            pool: Mutex::new(Pool {
                conns,
                opening: 0,
                backoff: opts.backoff_initial,
                retry_at: None,
                last_error: String::new(),
            }),
            opts: ClientOptions {
                queue_depth: opts.queue_depth.max(1),
                ..opts
            },
            room: Condvar::new(),
            status: Mutex::new(StatusState::Unknown),
        })
    }

    /// The transmission flags the server sent.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    /// The options in force.
    pub fn options(&self) -> &ClientOptions {
        &self.opts
    }

    /// Connections open now (they may carry several requests each).
    pub fn open_connections(&self) -> usize {
        self.pool.lock().conns.len()
    }

    /// Takes room on a connection: opens one if the pool has room for another and no
    /// backoff is running, else the least loaded open one with room, else waits for room
    /// until `deadline`.
    fn take(&self, deadline: Instant) -> io::Result<Slot<'_>> {
        let mut p = self.pool.lock();
        loop {
            p.conns.retain(|c| !c.is_broken());
            let now = Instant::now();
            if p.retry_at.is_some_and(|at| now >= at) {
                p.retry_at = None;
            }
            if p.conns.len() + p.opening < self.capacity && p.retry_at.is_none() {
                p.opening += 1;
                drop(p);
                return self.open(deadline);
            }
            let best = p
                .conns
                .iter()
                .min_by_key(|c| c.inflight.load(Relaxed))
                .filter(|c| c.inflight.load(Relaxed) < self.opts.queue_depth)
                .cloned();
            if let Some(conn) = best {
                conn.inflight.fetch_add(1, Relaxed);
                return Ok(Slot {
                    client: self,
                    conn,
                    fresh: false,
                });
            }
            if p.conns.is_empty() && p.opening == 0 {
                // Nothing open, and a backoff running (else the pool had room above).
                let at = p.retry_at.unwrap_or(now);
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    format!(
                        "NBD source {} is unreachable ({}); next attempt in {} ms",
                        self.uri,
                        p.last_error,
                        at.saturating_duration_since(now).as_millis()
                    ),
                ));
            }
            if p.wait_until(&self.room, deadline).timed_out() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "timed out waiting for room on a connection to the source",
                ));
            }
        }
    }

    /// Opens a connection for a request (`take` counted it in `opening`) and adds it to the
    /// pool.
    fn open(&self, deadline: Instant) -> io::Result<Slot<'_>> {
        let timeout = self
            .opts
            .connect_timeout
            .min(deadline.saturating_duration_since(Instant::now()))
            .max(Duration::from_millis(1));
        let r = connect(&self.uri, timeout).and_then(|(s, size, _)| {
            if size == self.size {
                Conn::start(s)
            } else {
                s.shutdown();
                Err(bad(format!(
                    "the export's size changed from {} to {size} bytes",
                    self.size
                )))
            }
        });
        let mut p = self.pool.lock();
        p.opening -= 1;
        match r {
            Ok(conn) => {
                p.backoff = self.opts.backoff_initial;
                p.retry_at = None;
                let conn = Arc::new(conn);
                conn.inflight.fetch_add(1, Relaxed);
                p.conns.push(conn.clone());
                self.room.notify_all();
                Ok(Slot {
                    client: self,
                    conn,
                    fresh: true,
                })
            }
            Err(e) => {
                p.retry_at = Some(Instant::now() + p.backoff);
                p.backoff = (p.backoff * 2).min(self.opts.backoff_max);
                p.last_error = e.to_string();
                self.room.notify_all();
                tracing::warn!("reconnecting to NBD source {}: {e}", self.uri);
                Err(e)
            }
        }
    }

    /// One command, retried once on a new connection if it failed on an older one for a
    /// transport reason. A read's data goes into `into` (which a failed read may leave
    /// partly written).
    fn request(
        &self,
        op: Op,
        command: u16,
        offset: u64,
        len: u32,
        out: Option<&[u8]>,
        mut into: Option<&mut [u8]>,
    ) -> Result<(), IoError> {
        let io_err = |e: io::Error| IoError::Io {
            op,
            offset,
            len: len as u64,
            source: e,
        };
        let deadline = Instant::now() + self.opts.request_timeout;
        let mut retried = false;
        let error = loop {
            let slot = self.take(deadline).map_err(io_err)?;
            let into = into.as_deref_mut();
            match slot.conn.call(command, offset, len, out, into, deadline) {
                Ok(r) => break r,
                Err(e) => {
                    let transport = !matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::InvalidData
                    );
                    if !slot.fresh && transport && !retried {
                        retried = true;
                        continue;
                    }
                    return Err(io_err(e));
                }
            }
        };
        match error {
            0 => Ok(()),
            errno::EINVAL => Err(IoError::Invalid(format!(
                "server refused {op} at {offset} (+{len}): EINVAL"
            ))),
            // The source is shutting down: for sce's own clients that is a failed source
            // (EIO), not sce shutting down (ESHUTDOWN, which sce says of itself).
            errno::ESHUTDOWN => Err(IoError::Failed(format!(
                "the NBD source {} is shutting down: {op} at {offset} (+{len}) failed",
                self.uri
            ))),
            e => Err(io_err(io::Error::from_raw_os_error(e as i32))),
        }
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        for c in std::mem::take(&mut self.pool.get_mut().conns) {
            c.close();
        }
    }
}

impl NbdClient {
    /// The source's allocation from its `base:allocation` context; all data when it has
    /// none or the query fails (always true). A range longer than 4 GiB is answered for a
    /// prefix. `one`: the first extent only (REQ_ONE), which the server finds in one look.
    fn source_extents(&self, offset: u64, len: u64, one: bool) -> Vec<sce_io::Extent> {
        let all_data = vec![sce_io::Extent::data(len)];
        let ask = len.min(u32::MAX as u64 & !511) as u32;
        let mut st = self.status.lock();
        if matches!(*st, StatusState::Unknown) {
            *st = match crate::status::connect(&self.uri, self.opts.connect_timeout) {
                Ok(Some(c)) => StatusState::Conn(c),
                Ok(None) => StatusState::Unsupported,
                Err(e) => {
                    tracing::debug!("block status of {}: {e}", self.uri);
                    return all_data;
                }
            };
        }
        let StatusState::Conn(c) = &mut *st else {
            return all_data;
        };
        match c.extents(offset, ask, one, Instant::now() + self.opts.request_timeout) {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!("block status of {}: {e}", self.uri);
                *st = StatusState::Unknown;
                all_data
            }
        }
    }
}

impl BlockDevice for NbdClient {
    fn extents(&self, offset: u64, len: u64, max: usize) -> Result<Vec<sce_io::Extent>, IoError> {
        check_range(Op::Read, offset, len, self.size, 512)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        // Block status goes over a connection of its own: only a server that allows
        // several connections (CAN_MULTI_CONN) promises that one sees what another wrote
        // and flushed. Without it, a hole it reports may be one a write just filled: all
        // data then, which is always true.
        if self.flags & proto::TFLAG_CAN_MULTI_CONN == 0 {
            return Ok(vec![sce_io::Extent::data(len)]);
        }
        let mut out = self.source_extents(offset, len, max == 1);
        out.truncate(max.max(1));
        Ok(out)
    }
    /// The export's URI and size. An NBD export's content can change on its server without
    /// either changing: a persistent cache adds the operator's `--source-generation`.
    fn identity(&self) -> Option<String> {
        Some(format!("nbd:{}:size={}", self.uri, self.size))
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, 512)?;
        for (i, chunk) in buf.chunks_mut(proto::MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i as u64) * proto::MAX_PAYLOAD as u64;
            let n = chunk.len() as u32;
            if n > 0 {
                self.request(Op::Read, proto::CMD_READ, at, n, None, Some(chunk))?;
            }
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(Op::Write, offset, buf.len() as u64, self.size, 512)?;
        for (i, chunk) in buf.chunks(proto::MAX_PAYLOAD as usize).enumerate() {
            let at = offset + (i as u64) * proto::MAX_PAYLOAD as u64;
            self.request(
                Op::Write,
                proto::CMD_WRITE,
                at,
                chunk.len() as u32,
                Some(chunk),
                None,
            )?;
        }
        Ok(())
    }
    fn flush(&self) -> Result<(), IoError> {
        if self.flags & proto::TFLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.request(Op::Flush, proto::CMD_FLUSH, 0, 0, None, None)
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, 512)?;
        // WRITE_ZEROES keeps the BlockDevice contract (reads back as zeroes); TRIM would not.
        if self.flags & proto::TFLAG_SEND_WRITE_ZEROES == 0 {
            return Err(IoError::Unsupported { op: Op::Discard });
        }
        let step = proto::MAX_PAYLOAD as u64;
        let mut at = offset;
        while at < offset + len {
            let n = step.min(offset + len - at);
            self.request(
                Op::Discard,
                proto::CMD_WRITE_ZEROES,
                at,
                n as u32,
                None,
                None,
            )?;
            at += n;
        }
        Ok(())
    }
}
