//! A connection in transmission: its shared state, the in-flight tickets, and the reader
//! that turns the socket into jobs for the workers.

use super::worker::{write_blocking, write_replies};
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
pub(super) struct Job {
    pub(super) conn: Arc<Session>,
    pub(super) req: Request,
    pub(super) payload: Option<PooledBuf>,
    pub(super) ticket: Ticket,
}

/// A reply on its way to the writer.
pub(super) struct Reply {
    pub(super) error: u32,
    pub(super) cookie: u64,
    pub(super) data: Option<PooledBuf>,
    pub(super) _ticket: Ticket,
}

/// One connection in transmission, as workers see it. The writer ends once every holder
/// (the reader and the jobs in flight) has dropped it.
pub(super) struct Session {
    pub(super) export: Export,
    /// The writer thread's queue, once a reply could not go out at once (the thread starts
    /// then: most connections never need one). A leaf lock.
    pub(super) writer: Mutex<Option<Sender<ToWriter>>>,
    /// The writer thread, for the reader to join at the end.
    pub(super) writer_thread: Arc<Mutex<Option<JoinHandle<()>>>>,
    pub(super) shared: Arc<Shared>,
    /// The write half of the socket.
    pub(super) out: Arc<Out>,
    pub(super) state: Arc<ConnState>,
}

impl Session {
    /// Hands work to the connection's writer thread, starting it on first need. If no thread
    /// can be started, the caller writes (blocking, bounded by `reply_timeout`) itself.
    pub(super) fn to_writer(&self, todo: ToWriter) {
        let mut w = self.writer.lock();
        if w.is_none() {
            let (tx, queue) = unbounded::<ToWriter>();
            let (shared, state, out) = (self.shared.clone(), self.state.clone(), self.out.clone());
            match std::thread::Builder::new()
                .name("nbd-writer".into())
                .spawn(move || write_replies(&shared, &out, &queue, &state))
            {
                Ok(t) => {
                    *self.writer_thread.lock() = Some(t);
                    *w = Some(tx);
                }
                Err(e) => {
                    drop(w);
                    tracing::warn!("cannot start an NBD writer thread ({e}): writing in place");
                    let reply = match todo {
                        ToWriter::Reply(r) => Some(r),
                        ToWriter::Tail => None,
                    };
                    write_blocking(&self.shared, &self.out, &self.state, reply);
                    return;
                }
            }
        }
        if let Some(tx) = w.as_ref() {
            // Fails only if the writer has gone; the ticket is released either way.
            let _ = tx.send(todo);
        }
    }
}

/// The write half of a connection, and the rest of a reply that went out only in part. Its
/// lock is taken by a worker only with `try_lock` and only for a non-blocking send; the
/// writer thread takes it for blocking writes (bounded by `reply_timeout`).
pub(super) type Out = Mutex<OutState>;

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
    ) -> Result<(), ConnError> {
        let wr = rd.try_clone_conn()?;
        wr.set_write_timeout_conn(Some(SLICE))?;
        let out: Arc<Out> = Arc::new(Mutex::new(OutState {
            sock: Box::new(wr),
            tail: None,
        }));
        let state = Arc::new(ConnState::default());
        let writer_thread = Arc::new(Mutex::new(None));
        let session = Arc::new(Session {
            export,
            writer: Mutex::new(None),
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
            self.shared.freed.wait_for(&mut used, SLICE);
        }
        true
    }

    pub(super) fn read_requests<C: Conn>(
        &self,
        rd: &mut C,
        session: &Arc<Session>,
    ) -> Result<(), ConnError> {
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
            if got < h.len() {
                rd.set_read_timeout_conn(Some(SLICE))?;
                idle_mode = false;
                Deadlined {
                    c: &mut *rd,
                    deadline: Instant::now() + cfg.request_timeout,
                    shared: None,
                }
                .read_exact(&mut h[got..])
                .map_err(timed_out)?;
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
            let mut payload = None;
            if req.command == proto::CMD_WRITE {
                if idle_mode {
                    rd.set_read_timeout_conn(Some(SLICE))?;
                    idle_mode = false;
                }
                payload = self.read_payload(rd, &req)?;
                if payload.is_none() {
                    session.to_writer(ToWriter::Reply(Reply {
                        error: errno::EINVAL,
                        cookie: req.cookie,
                        data: None,
                        _ticket: ticket,
                    }));
                    continue;
                }
            }
            let job = Job {
                conn: session.clone(),
                req,
                payload,
                ticket,
            };
            // Alone in flight, with nothing more from the client yet: run it here, and
            // save the hand-off to a worker (or to a queue's completion thread).
            if cfg.inline_when_idle && inline_ok(&job, rd.raw_fd()) {
                super::worker::run_inline(&self.shared, job);
                continue;
            }
            // An export with an I/O queue takes reads, writes and flushes from this thread.
            let Err(job) = super::queued::submit(&self.shared, job) else {
                continue;
            };
            if self.jobs.send(job).is_err() {
                return Ok(());
            }
        }
    }

    /// Reads a write's payload, with its own deadline (waiting for the budget is the
    /// server's doing, not the client's). `None`: too big to accept but small enough to
    /// skip, so it was read away and the write is to be refused.
    fn read_payload<C: Conn>(
        &self,
        rd: &mut C,
        req: &Request,
    ) -> Result<Option<PooledBuf>, ConnError> {
        let mut timed = Deadlined {
            c: &mut *rd,
            deadline: Instant::now() + self.shared.cfg.request_timeout,
            shared: None,
        };
        if req.len > proto::MAX_PAYLOAD {
            if req.len > MAX_DISCARDED_PAYLOAD {
                return Err(ProtoError::TooLong {
                    what: "write payload",
                    len: req.len as u64,
                    max: MAX_DISCARDED_PAYLOAD as u64,
                }
                .into());
            }
            io::copy(&mut (&mut timed).take(req.len as u64), &mut io::sink()).map_err(timed_out)?;
            return Ok(None);
        }
        let mut b = self.shared.pool.take(req.len as usize);
        timed.read_exact(&mut b).map_err(timed_out)?;
        Ok(Some(b))
    }
}

/// What timed out, for [`ConnError::Timeout`] and the counters.
/// A request that did not arrive whole in time is the client's timeout.
fn timed_out(e: io::Error) -> ConnError {
    match e.kind() {
        io::ErrorKind::TimedOut => ConnError::Timeout(REQUEST),
        _ => e.into(),
    }
}

pub(super) const HANDSHAKE: &str = "in the handshake";
pub(super) const REQUEST: &str = "receiving a request";
pub(super) const IDLE: &str = "waiting for a request (idle)";

/// Whether the reader runs a request itself: a read or write of a local export (one with
/// an I/O queue, whose I/O takes microseconds, not a remote source's milliseconds), the only
/// request of its connection in flight, with no further request already arriving. That is a
/// client at queue depth 1, waiting for this reply before it sends anything: running the
/// request here saves a wake-up of another thread, and delays nobody.
fn inline_ok(job: &Job, fd: RawFd) -> bool {
    job.conn.export.io.is_some()
        && matches!(job.req.command, proto::CMD_READ | proto::CMD_WRITE)
        && job.conn.state.requests.load(Relaxed) == 1
        && !readable(fd)
}

/// True if the socket has bytes to read now.
fn readable(fd: RawFd) -> bool {
    let mut b = 0u8;
    // SAFETY: a one-byte peek into a valid local buffer on the connection's socket.
    let n = unsafe {
        libc::recv(
            fd,
            &mut b as *mut u8 as *mut libc::c_void,
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n != -1 || io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock
}
