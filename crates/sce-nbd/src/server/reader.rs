//! A connection's reader: receives requests into a buffer (many at once when the client
//! pipelines), turns each into a job, and runs it inline, batches it for the export's I/O
//! queue, or hands it to the workers.

use super::queued::{self, Batch};
use super::transmission::{slice_timeout, timed_out, Deadlined, Job, Session, Ticket, ToWriter};
use super::transmission::{Reply, IDLE};
use super::*;

/// Bytes received and not parsed yet: up to this many are read with one `recv`.
const INBUF: usize = 64 << 10;

/// The receive buffer of a connection.
struct InBuf {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl InBuf {
    fn new() -> InBuf {
        InBuf {
            buf: vec![0u8; INBUF].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    fn len(&self) -> usize {
        self.end - self.start
    }

    /// Takes `n` buffered bytes (at most `len()`).
    fn take(&mut self, n: usize) -> &[u8] {
        let at = self.start;
        self.start += n;
        &self.buf[at..at + n]
    }

    /// One read from `rd` into the free space: the bytes read, 0 at end of file.
    fn recv(&mut self, rd: &mut impl Read) -> io::Result<usize> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let n = rd.read(&mut self.buf[self.end..])?;
        self.end += n;
        Ok(n)
    }
}

/// What the next request header brought.
enum Next {
    Header([u8; proto::REQUEST_LEN]),
    /// The client went away, or the connection is being closed.
    End,
}

/// The socket's read timeout: `idle` between requests, [`SLICE`] within one.
struct Timeouts {
    idle: Option<Duration>,
    idle_mode: bool,
}

impl Timeouts {
    fn set<C: Conn>(&mut self, rd: &C, idle_mode: bool) -> io::Result<()> {
        if self.idle_mode != idle_mode {
            rd.set_read_timeout_conn(if idle_mode { self.idle } else { Some(SLICE) })?;
            self.idle_mode = idle_mode;
        }
        Ok(())
    }
}

impl Server {
    /// Reads requests until the client disconnects, breaks the protocol or times out, or
    /// the server shuts down. Whatever is batched for the I/O queue is submitted before the
    /// reader can block (on the socket or for a ticket), so no request waits on the reader.
    pub(super) fn read_requests<C: Conn>(
        &self,
        rd: &mut C,
        session: &Arc<Session>,
    ) -> Result<(), ConnError> {
        let mut batch = Batch::default();
        let r = self.read_loop(rd, session, &mut batch);
        batch.submit(session);
        r
    }

    fn read_loop<C: Conn>(
        &self,
        rd: &mut C,
        session: &Arc<Session>,
        batch: &mut Batch,
    ) -> Result<(), ConnError> {
        let cfg = &self.shared.cfg;
        let mut timeouts = Timeouts {
            idle: cfg.idle_timeout.filter(|t| !t.is_zero()),
            idle_mode: false,
        };
        rd.set_read_timeout_conn(timeouts.idle)?;
        timeouts.idle_mode = true;
        let mut inb = InBuf::new();
        loop {
            if inb.len() < proto::REQUEST_LEN {
                batch.submit(session);
            }
            let h = match self.next_header(rd, session, &mut inb, &mut timeouts)? {
                Next::Header(h) => h,
                Next::End => return Ok(()),
            };
            let req = proto::parse_request(&h)?;
            if req.command == proto::CMD_DISC {
                return Ok(());
            }
            let too_long = req.len > proto::MAX_PAYLOAD;
            let bytes = match req.command {
                proto::CMD_READ | proto::CMD_WRITE if !too_long => req.len as u64,
                _ => 0,
            };
            let Some(ticket) = self.ticket(session, bytes, batch) else {
                return Ok(());
            };
            let mut payload = None;
            if req.command == proto::CMD_WRITE {
                if inb.len() < req.len as usize {
                    batch.submit(session);
                    timeouts.set(rd, false)?;
                }
                payload = self.read_payload(rd, &mut inb, &req)?;
                if payload.is_none() {
                    let reply = Reply::new(session, &req, Err(errno::EINVAL), ticket);
                    session.to_writer(ToWriter::Reply(reply));
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
            let alone = cfg.inline_when_idle && inb.len() == 0 && alone(&job, rd.raw_fd());
            if alone && runs_here(&job) {
                super::worker::run_inline(&self.shared, job);
                continue;
            }
            // Queued exports: batched here (a cached volume: its hits), or run if alone.
            let Err(job) = queued::prepare(&self.shared, job, batch, alone) else {
                continue;
            };
            if self.jobs.push(job).is_err() {
                return Ok(());
            }
        }
    }

    /// A request's ticket: at once if the budgets allow, else after submitting the batch
    /// (its requests hold tickets too) and waiting; the client is not read meanwhile.
    /// `None` if the connection died or the server shuts down.
    fn ticket(&self, session: &Arc<Session>, bytes: u64, batch: &mut Batch) -> Option<Ticket> {
        Ticket::try_take(&self.shared, &session.state, bytes).or_else(|| {
            batch.submit(session);
            Ticket::take(&self.shared, &session.state, bytes)
        })
    }

    /// The next request header: from the buffer, or read from the socket (waiting up to the
    /// idle timeout for its first byte, then up to `request_timeout` for the rest).
    fn next_header<C: Conn>(
        &self,
        rd: &mut C,
        session: &Session,
        inb: &mut InBuf,
        timeouts: &mut Timeouts,
    ) -> Result<Next, ConnError> {
        while inb.len() == 0 {
            timeouts.set(rd, true)?;
            match inb.recv(rd) {
                // The client went away (or we shut the socket down): not an error.
                Ok(0) => return Ok(Next::End),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) if self.is_shutting_down() || session.state.dead.load(Relaxed) => {
                    return Ok(Next::End)
                }
                Err(e) if slice_timeout(&e) => return Err(ConnError::Timeout(IDLE)),
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return Ok(Next::End),
                Err(e) => return Err(e.into()),
            }
        }
        if inb.len() < proto::REQUEST_LEN {
            timeouts.set(rd, false)?;
            let mut timed = Deadlined {
                c: &mut *rd,
                deadline: Instant::now() + self.shared.cfg.request_timeout,
                shared: None,
            };
            while inb.len() < proto::REQUEST_LEN {
                if inb.recv(&mut timed).map_err(timed_out)? == 0 {
                    return Err(ConnError::Io(io::ErrorKind::UnexpectedEof.into()));
                }
            }
        }
        let mut h = [0u8; proto::REQUEST_LEN];
        h.copy_from_slice(inb.take(proto::REQUEST_LEN));
        Ok(Next::Header(h))
    }

    /// Reads a write's payload (what is buffered, then the rest from the socket), with its
    /// own deadline (waiting for the budget is the server's doing, not the client's).
    /// `None`: too big to accept but small enough to skip, so it was read away and the
    /// write is to be refused.
    fn read_payload<C: Conn>(
        &self,
        rd: &mut C,
        inb: &mut InBuf,
        req: &Request,
    ) -> Result<Option<PooledBuf>, ConnError> {
        let mut timed = Deadlined {
            c: &mut *rd,
            deadline: Instant::now() + self.shared.cfg.request_timeout,
            shared: None,
        };
        let len = req.len as usize;
        let have = inb.len().min(len);
        if req.len > proto::MAX_PAYLOAD {
            if req.len > MAX_DISCARDED_PAYLOAD {
                return Err(ProtoError::TooLong {
                    what: "write payload",
                    len: req.len as u64,
                    max: MAX_DISCARDED_PAYLOAD as u64,
                }
                .into());
            }
            inb.take(have);
            io::copy(&mut (&mut timed).take((len - have) as u64), &mut io::sink())
                .map_err(timed_out)?;
            return Ok(None);
        }
        let mut b = self.shared.pool.take(len);
        b[..have].copy_from_slice(inb.take(have));
        timed.read_exact(&mut b[have..]).map_err(timed_out)?;
        Ok(Some(b))
    }
}

/// Whether a request may run on the reader itself: a read, write, flush or block status of
/// an export served through a queue (a local device, whose I/O takes microseconds; or a cached
/// volume's hit, or its write or flush that the cache device alone serves), the only
/// request of its connection in flight, with no further request already arriving. That is
/// a client at queue depth 1, waiting for this reply before it sends anything: running the
/// request here saves a wake-up of another thread, and delays nobody.
fn alone(job: &Job, fd: RawFd) -> bool {
    job.conn.export.io.is_some()
        && matches!(
            job.req.command,
            proto::CMD_READ | proto::CMD_WRITE | proto::CMD_FLUSH | proto::CMD_BLOCK_STATUS
        )
        && job.conn.state.requests.load(Relaxed) == 1
        && !readable(fd)
}

/// Whether a request alone in flight runs whole on the reader (by a blocking call): block
/// status answered on this host (qemu-img asks it before every read, one extent at a
/// time); any on an export with a queue on the local device; on a cached volume, a write or flush
/// the cache device alone serves ([`sce_io::QueuedReads::runs_locally`]). A cached
/// volume's read hit is started by `queued::prepare` instead (and misses go to the
/// workers).
fn runs_here(job: &Job) -> bool {
    let req = &job.req;
    if req.command == proto::CMD_BLOCK_STATUS {
        return job.conn.export.device.extents_are_local();
    }
    match &job.conn.export.io {
        Some(ExportIo::Queue(_)) => true,
        Some(ExportIo::Reads(r)) => match req.command {
            proto::CMD_WRITE => r.runs_locally(sce_io::Op::Write, req.offset, req.len as u64),
            proto::CMD_FLUSH => r.runs_locally(sce_io::Op::Flush, 0, 0),
            _ => false,
        },
        None => false,
    }
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
