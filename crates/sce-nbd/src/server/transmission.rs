//! A connection in transmission: its shared state, the in-flight tickets, and the reader
//! that turns the socket into jobs for the workers.

use super::*;

/// What a connection's reader, writer and tickets share.
#[derive(Default)]
pub(super) struct ConnState {
    /// The writer gave up (or the connection ended): stop reading, drop replies.
    pub(super) dead: AtomicBool,
    /// Writing a reply failed or the shutdown grace ran out: later replies are dropped.
    pub(super) broken: AtomicBool,
    pub(super) bytes: AtomicU64,
    pub(super) requests: AtomicUsize,
}

impl ConnState {
    /// Gives the connection up: later replies are dropped, the reader stops, and the socket
    /// (`sock`, the write half under its lock) is shut down.
    pub(super) fn break_off(&self, sock: &dyn WriteHalf) {
        self.broken.store(true, Relaxed);
        self.dead.store(true, Relaxed);
        sock.shut();
    }
}

/// A request's share of the in-flight budgets, from reading it to its reply being written.
pub(super) struct Ticket {
    pub(super) shared: Arc<Shared>,
    pub(super) conn: Arc<ConnState>,
    pub(super) bytes: u64,
}

impl Ticket {
    /// Waits until `bytes` fit the server's and the connection's budgets (and the connection
    /// has room for one more request). `None` if the connection died or the server is
    /// shutting down meanwhile.
    pub(super) fn take(shared: &Arc<Shared>, conn: &Arc<ConnState>, bytes: u64) -> Option<Ticket> {
        let mut used = shared.used.lock();
        loop {
            if conn.dead.load(Relaxed) || shared.shutting_down() {
                return None;
            }
            if let Some(t) = Self::fit(shared, conn, bytes, &mut used) {
                return Some(t);
            }
            // Timed, so that a connection dying or a shutdown is noticed without a signal.
            used.wait_for(&shared.freed, SLICE);
        }
    }

    /// A ticket if `bytes` fit the budgets now, without waiting.
    pub(super) fn try_take(
        shared: &Arc<Shared>,
        conn: &Arc<ConnState>,
        bytes: u64,
    ) -> Option<Ticket> {
        if conn.dead.load(Relaxed) || shared.shutting_down() {
            return None;
        }
        Self::fit(shared, conn, bytes, &mut shared.used.lock())
    }

    fn fit(
        shared: &Arc<Shared>,
        conn: &Arc<ConnState>,
        bytes: u64,
        used: &mut u64,
    ) -> Option<Ticket> {
        let cfg = &shared.cfg;
        let mine = conn.bytes.load(Relaxed);
        let fits = (*used == 0 || *used + bytes <= cfg.inflight_bytes)
            && (mine == 0 || mine + bytes <= cfg.connection_inflight_bytes)
            && conn.requests.load(Relaxed) < cfg.connection_queue_depth.max(1);
        if !fits {
            return None;
        }
        *used += bytes;
        conn.bytes.fetch_add(bytes, Relaxed);
        conn.requests.fetch_add(1, Relaxed);
        shared.stats.inflight_bytes.store(*used, Relaxed);
        shared.stats.inflight_bytes_peak.fetch_max(*used, Relaxed);
        Some(Ticket {
            shared: shared.clone(),
            conn: conn.clone(),
            bytes,
        })
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
pub(super) struct Job {
    pub(super) conn: Arc<Session>,
    pub(super) req: Request,
    pub(super) payload: Option<PooledBuf>,
    pub(super) ticket: Ticket,
}

/// A reply on its way to the writer.
pub(super) struct Reply {
    pub(super) error: u32,
    /// Its header on the wire: a simple reply's, or a structured chunk's with the fixed
    /// part of its payload.
    pub(super) head: Head,
    /// A successful read's data or a block status chunk's descriptors.
    pub(super) data: Option<PooledBuf>,
    pub(super) _ticket: Ticket,
}

impl Reply {
    /// The reply to `req` on `conn`: simple, or one structured chunk (flagged done) when
    /// the client negotiated structured replies. An error reply carries no data.
    pub(super) fn new(
        conn: &Session,
        req: &Request,
        result: Result<Option<PooledBuf>, u32>,
        ticket: Ticket,
    ) -> Reply {
        let (error, data) = match result {
            Ok(data) => (0, data),
            Err(code) => (code, None),
        };
        let len = data.as_ref().map_or(0, |d| d.len());
        Reply {
            error,
            head: Head::of(conn.structured, req, error, len),
            data,
            _ticket: ticket,
        }
    }
}

/// A reply's header: at most a chunk header and 8 bytes of fixed payload.
pub(super) struct Head {
    b: [u8; proto::CHUNK_HEADER_LEN + 8],
    n: usize,
}

impl Head {
    fn of(structured: bool, req: &Request, error: u32, len: usize) -> Head {
        let mut h = Head {
            b: [0; proto::CHUNK_HEADER_LEN + 8],
            n: 0,
        };
        let cookie = req.cookie;
        if !structured {
            h.push(&proto::simple_reply(error, cookie));
            return h;
        }
        let done = proto::REPLY_FLAG_DONE;
        if error != 0 {
            // An error chunk: the errno, and an empty message.
            h.push(&proto::chunk_header(
                done,
                proto::REPLY_TYPE_ERROR,
                cookie,
                6,
            ));
            h.push(&error.to_be_bytes());
            h.push(&0u16.to_be_bytes());
            return h;
        }
        match req.command {
            proto::CMD_READ if len > 0 => {
                let n = (8 + len) as u32;
                h.push(&proto::chunk_header(
                    done,
                    proto::REPLY_TYPE_OFFSET_DATA,
                    cookie,
                    n,
                ));
                h.push(&req.offset.to_be_bytes());
            }
            proto::CMD_BLOCK_STATUS => {
                let kind = proto::REPLY_TYPE_BLOCK_STATUS;
                h.push(&proto::chunk_header(done, kind, cookie, len as u32));
            }
            _ => h.push(&proto::chunk_header(
                done,
                proto::REPLY_TYPE_NONE,
                cookie,
                0,
            )),
        }
        h
    }

    fn push(&mut self, b: &[u8]) {
        self.b[self.n..self.n + b.len()].copy_from_slice(b);
        self.n += b.len();
    }
}

impl std::ops::Deref for Head {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.b[..self.n]
    }
}

/// One connection in transmission, as workers see it. The writer ends once every holder
/// (the reader and the jobs in flight) has dropped it.
pub(super) struct Session {
    pub(super) export: Export,
    /// Replies are structured chunks (negotiated in the handshake).
    pub(super) structured: bool,
    /// NBD_CMD_BLOCK_STATUS may be used (`base:allocation` was selected for this export).
    pub(super) block_status: bool,
    /// Requests need not be aligned to the device's block size: the client did not ask for
    /// block sizes, so NBD's default minimum of 1 byte holds (see `unaligned.rs`).
    pub(super) byte_granular: bool,
    /// The writer thread's queue, once a reply could not go out at once (the thread starts
    /// then: most connections never need one; see `send.rs`). A leaf lock.
    pub(super) writer: OrderedMutex<levels::NbdConn, Option<Sender<ToWriter>>>,
    /// The writer thread, for the reader to join at the end.
    pub(super) writer_thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    pub(super) shared: Arc<Shared>,
    /// The write half of the socket.
    pub(super) out: Arc<Out>,
    pub(super) state: Arc<ConnState>,
}

/// The write half of a connection, and the rest of a reply that went out only in part. Its
/// lock is taken by a worker only with `try_lock` and only for a non-blocking send; the
/// writer thread takes it for blocking writes (bounded by `reply_timeout`).
pub(super) type Out = OrderedMutex<levels::NbdConn, OutState>;

pub(super) struct OutState {
    pub(super) sock: Box<dyn WriteHalf>,
    /// A reply partly sent: the bytes still to write come before any other reply.
    pub(super) tail: Option<(Reply, usize)>,
}

/// Work for a connection's writer thread.
pub(super) enum ToWriter {
    /// A reply a worker could not send without waiting.
    Reply(Reply),
    /// A worker left a partly sent reply in `OutState::tail`.
    Tail,
}

/// A socket's write half, as the replies need it.
pub(super) trait WriteHalf: Write + Send {
    fn fd(&self) -> RawFd;
    fn shut(&self);
}

impl<C: Conn> WriteHalf for C {
    fn fd(&self) -> RawFd {
        self.raw_fd()
    }
    fn shut(&self) {
        self.shutdown_conn()
    }
}

/// A socket with a deadline: reads and writes fail with `TimedOut` once it has passed (or,
/// with `shared`, once the shutdown grace has run out). The socket's timeouts must be set
/// to [`SLICE`] so the loops get to look at the clock.
pub(super) struct Deadlined<'a, C> {
    pub(super) c: &'a mut C,
    pub(super) deadline: Instant,
    pub(super) shared: Option<&'a Shared>,
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

pub(super) fn slice_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

impl<C> Deadlined<'_, C> {
    /// Runs `op` on the socket again each time its slice timeout fires, until it completes
    /// or the deadline (or the shutdown grace) has passed.
    fn retry<T>(&mut self, mut op: impl FnMut(&mut C) -> io::Result<T>) -> io::Result<T> {
        loop {
            match op(self.c) {
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

impl<C: Read> Read for Deadlined<'_, C> {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        self.retry(|c| c.read(b))
    }
}

impl<C: Write> Write for Deadlined<'_, C> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.retry(|c| c.write(b))
    }
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.retry(|c| c.write_vectored(bufs))
    }
    fn flush(&mut self) -> io::Result<()> {
        self.c.flush()
    }
}

impl Server {
    /// Reads requests and queues them for the workers until the client disconnects, breaks
    /// the protocol or times out, or the server shuts down; then waits for the writer to
    /// answer what was queued.
    pub(super) fn transmission<C: Conn>(
        self: &Arc<Self>,
        mut rd: C,
        export: Export,
        negotiated: super::handshake::Negotiated,
    ) -> Result<(), ConnError> {
        let wr = rd.try_clone_conn()?;
        wr.set_write_timeout_conn(Some(SLICE))?;
        let out: Arc<Out> = Arc::new(OrderedMutex::new(OutState {
            sock: Box::new(wr),
            tail: None,
        }));
        let state = Arc::new(ConnState::default());
        let writer_thread = Arc::new(Mutex::new(None));
        let session = Arc::new(Session {
            export,
            structured: negotiated.structured,
            block_status: negotiated.block_status,
            byte_granular: !negotiated.block_sizes,
            writer: OrderedMutex::new(None),
            writer_thread: writer_thread.clone(),
            shared: self.shared.clone(),
            out: out.clone(),
            state: state.clone(),
        });
        let result = self.note(self.read_requests(&mut rd, &session));
        if result.is_err() {
            state.dead.store(true, Relaxed);
        }
        // A writer thread ends once the jobs in flight have dropped their sessions too.
        drop(session);
        if self.wait_answered(&state, &out) {
            if let Some(t) = writer_thread.lock().take() {
                let _ = t.join();
            }
        }
        state.dead.store(true, Relaxed);
        out.lock().sock.shut();
        rd.shutdown_conn();
        result
    }

    /// After the last request was read: waits until every request in flight has been
    /// answered (its ticket released). During a shutdown it waits at most until the grace
    /// runs out, then shuts the socket down (a stuck device must not hold the connection
    /// open) and returns false.
    fn wait_answered(&self, state: &ConnState, out: &Out) -> bool {
        let mut used = self.shared.used.lock();
        while state.requests.load(Relaxed) > 0 {
            if self.shared.shutting_down() && self.shared.past_grace() {
                drop(used);
                state.break_off(&*out.lock().sock);
                return false;
            }
            used.wait_for(&self.shared.freed, SLICE);
        }
        true
    }
}

/// What timed out, for [`ConnError::Timeout`] and the counters.
/// A request that did not arrive whole in time is the client's timeout.
pub(super) fn timed_out(e: io::Error) -> ConnError {
    match e.kind() {
        io::ErrorKind::TimedOut => ConnError::Timeout(REQUEST),
        _ => e.into(),
    }
}

pub(super) const HANDSHAKE: &str = "in the handshake";
pub(super) const REQUEST: &str = "receiving a request";
pub(super) const IDLE: &str = "waiting for a request (idle)";
