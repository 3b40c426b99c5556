//! How a reply reaches the client: a worker's one non-blocking send, and otherwise the
//! connection's writer thread, started on first need, with its blocking writes bounded by
//! `reply_timeout`.

use super::transmission::{ConnState, Deadlined, Out, Reply, Session, ToWriter};
use super::*;

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

/// A writer: writes the replies of one connection that workers could not send at once, until
/// every holder of its session is gone. A reply not written within `reply_timeout` (or the
/// shutdown grace) kills the connection; later replies are dropped.
fn write_replies(shared: &Shared, out: &Out, queue: &Receiver<ToWriter>, state: &ConnState) {
    loop {
        let next = if shared.shutting_down() {
            // Replies of requests still running (a slow device) may not come in time: shut
            // the socket down once the grace has run out, whatever is still to come.
            match queue.recv_timeout(SLICE) {
                Err(RecvTimeoutError::Timeout) => {
                    if !state.broken.load(Relaxed) && shared.past_grace() {
                        state.break_off(&*out.lock().sock);
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
        match next {
            None => break,
            Some(ToWriter::Reply(reply)) => write_blocking(shared, out, state, Some(reply)),
            Some(ToWriter::Tail) => write_blocking(shared, out, state, None),
        }
    }
    // After a DISC or EOF all outstanding requests are answered; now close.
    let mut o = out.lock();
    o.tail = None;
    o.sock.shut();
}

/// The bytes of a reply on the wire: its header, and its data if it succeeded.
fn wire(reply: &Reply) -> (&[u8], &[u8]) {
    match &reply.data {
        Some(d) if reply.error == 0 => (&reply.head, d),
        _ => (&reply.head, &[]),
    }
}

/// Counts a reply as served (as its sending begins, or dropped with a broken connection).
fn count(shared: &Shared, reply: &Reply) {
    shared.stats.requests.fetch_add(1, Relaxed);
    if reply.error != 0 {
        shared.stats.request_errors.fetch_add(1, Relaxed);
    }
}

/// A worker's attempt to send `reply` without waiting: one non-blocking `sendmsg` of header
/// and data under `try_lock`. Returns what the writer thread must do: the whole reply when
/// the lock was busy, a partly sent reply was pending or nothing could be sent; `Tail` when
/// only part went out (the rest is left in `OutState::tail`, which keeps the lock's next
/// holders from interleaving another reply into it).
pub(super) fn send_now(
    shared: &Shared,
    out: &Out,
    state: &ConnState,
    reply: Reply,
) -> Option<ToWriter> {
    if state.broken.load(Relaxed) {
        count(shared, &reply);
        return None;
    }
    let Some(mut o) = out.try_lock() else {
        return Some(ToWriter::Reply(reply));
    };
    if o.tail.is_some() {
        return Some(ToWriter::Reply(reply));
    }
    // Counted before its bytes go out: a client that has its reply finds it counted (a
    // metrics scrape right after the last reply saw one request short).
    count(shared, &reply);
    let (h, data) = wire(&reply);
    let total = h.len() + data.len();
    match send_nowait(o.sock.fd(), h, data) {
        Ok(n) if n == total => None,
        Ok(n) => {
            // The writer sends the rest (all of it if nothing went out).
            o.tail = Some((reply, n));
            Some(ToWriter::Tail)
        }
        Err(_) => {
            // The client is gone: stop the reader too, drop what is left.
            state.break_off(&*o.sock);
            None
        }
    }
}

/// One `sendmsg(MSG_DONTWAIT)` of `a` then `b`: the bytes sent, 0 if the socket buffer is
/// full (or a signal came first).
fn send_nowait(fd: RawFd, a: &[u8], b: &[u8]) -> io::Result<usize> {
    let mut iov = [
        libc::iovec {
            iov_base: a.as_ptr() as *mut libc::c_void,
            iov_len: a.len(),
        },
        libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        },
    ];
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = if b.is_empty() { 1 } else { 2 };
    // SAFETY: the iovecs point into `a` and `b`, which outlive the call and are only read;
    // `msg` points to them; `fd` is the connection's socket, open while `Out` holds it.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    if n >= 0 {
        return Ok(n as usize);
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(0),
        _ => Err(e),
    }
}

/// The writer's blocking write, under the lock: first the rest of a partly sent reply, then
/// `reply` if any. A reply that cannot be written within `reply_timeout` breaks the
/// connection: the client is gone or stuck, so the reader stops too and later replies are
/// dropped.
fn write_blocking(shared: &Shared, out: &Out, state: &ConnState, reply: Option<Reply>) {
    let mut o = out.lock();
    let o = &mut *o;
    // A tail was counted when its sending began (`send_now`); a new reply is counted here,
    // before its bytes go out.
    if let Some(r) = &reply {
        count(shared, r);
    }
    let tail = o.tail.take();
    for (r, done) in tail.into_iter().chain(reply.map(|r| (r, 0))) {
        if state.broken.load(Relaxed) {
            continue;
        }
        let (h, data) = wire(&r);
        let (h, data) = if done < h.len() {
            (&h[done..], data)
        } else {
            (&[][..], &data[done - h.len()..])
        };
        let mut timed = Deadlined {
            c: &mut o.sock,
            deadline: Instant::now() + shared.cfg.reply_timeout,
            shared: Some(shared),
        };
        if let Err(e) = write_two(&mut timed, h, data) {
            if e.kind() == io::ErrorKind::TimedOut && !shared.shutting_down() {
                shared.stats.reply_timeouts.fetch_add(1, Relaxed);
                tracing::warn!(
                    "NBD client did not read its replies for {:?}: disconnecting it",
                    shared.cfg.reply_timeout
                );
            }
            state.break_off(&*o.sock);
        }
    }
}

/// Writes `a` then `b` with as few system calls as the socket allows (one, usually).
fn write_two(w: &mut impl Write, a: &[u8], b: &[u8]) -> io::Result<()> {
    let (mut a, mut b) = (a, b);
    while !a.is_empty() {
        let n = w.write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    w.write_all(b)
}
