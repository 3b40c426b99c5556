//! One connection to an NBD export: the handshake, and [`Conn`], which pipelines many
//! requests on it. Requests are written under a writer lock; one reader thread per
//! connection reads the replies and hands each to the request with its cookie, so a
//! connection carries up to the client's queue depth at once, as a client talking to the
//! source directly would.
//!
//! A connection that fails (a transport error, a reply that makes no sense, or a request
//! that outlived its deadline: the stream is then in an unknown state) is *broken*: its
//! socket is shut down and every request still waiting on it fails at once.

use crate::proto::{self, Request};
use crate::uri::NbdUri;
use parking_lot::Condvar;
use sce_io::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// `None`: reads block for ever.
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }
    fn set_write_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(Some(t)),
            Stream::Unix(s) => s.set_write_timeout(Some(t)),
        }
    }
    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    /// Reads exactly `buf`, however long it takes (the reader thread: a request's deadline
    /// is watched by the request, which breaks the connection when it passes).
    fn read_full(&mut self, buf: &mut [u8]) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.read_exact(buf),
            Stream::Unix(s) => s.read_exact(buf),
        }
    }

    pub(crate) fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// Reads exactly `buf`, giving up with `TimedOut` at `deadline`.
    pub(crate) fn read_by(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            self.set_read_timeout(Some(remaining(deadline)?))?;
            let r = match self {
                Stream::Tcp(s) => s.read(&mut buf[done..]),
                Stream::Unix(s) => s.read(&mut buf[done..]),
            };
            match r {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => done += n,
                Err(e) if retryable(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes all of `buf`, giving up with `TimedOut` at `deadline`.
    pub(crate) fn write_by(&mut self, buf: &[u8], deadline: Instant) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            self.set_write_timeout(remaining(deadline)?)?;
            let r = match self {
                Stream::Tcp(s) => s.write(&buf[done..]),
                Stream::Unix(s) => s.write(&buf[done..]),
            };
            match r {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => done += n,
                Err(e) if retryable(&e) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A socket timeout (the loop checks the deadline) or a signal: try again.
fn retryable(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

/// Time left before `deadline` (at least 1 ms: a zero socket timeout means none), or
/// `TimedOut` once it has passed.
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
    }
    Ok(left.max(Duration::from_millis(1)))
}

pub(crate) fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn open_stream(uri: &NbdUri, deadline: Instant) -> io::Result<(Stream, &str)> {
    match uri {
        NbdUri::Tcp { addr, name } => {
            use std::net::ToSocketAddrs;
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
            for a in addr.to_socket_addrs()? {
                match TcpStream::connect_timeout(&a, remaining(deadline)?) {
                    Ok(t) => {
                        t.set_nodelay(true)?;
                        return Ok((Stream::Tcp(t), name));
                    }
                    Err(e) => last = e,
                }
            }
            Err(last)
        }
        NbdUri::Unix { socket, name } => Ok((Stream::Unix(UnixStream::connect(socket)?), name)),
    }
}

/// Connects and negotiates with NBD_OPT_GO, all within `timeout`. Returns the stream, size
/// and flags.
pub(crate) fn connect(uri: &NbdUri, timeout: Duration) -> io::Result<(Stream, u64, u16)> {
    let deadline = Instant::now() + timeout;
    let (mut s, name) = greet(uri, deadline)?;
    let (size, flags) = go(&mut s, name, deadline)?;
    Ok((s, size, flags))
}

/// Opens the stream and does the greeting: the stream, and the export's name.
pub(crate) fn greet(uri: &NbdUri, deadline: Instant) -> io::Result<(Stream, &str)> {
    let (mut s, name) = open_stream(uri, deadline)?;
    let mut hello = [0u8; 18];
    s.read_by(&mut hello, deadline)?;
    if hello[..8] != proto::NBDMAGIC.to_be_bytes() || hello[8..16] != proto::IHAVEOPT.to_be_bytes()
    {
        return Err(bad("not an NBD newstyle server"));
    }
    let hflags = u16::from_be_bytes([hello[16], hello[17]]);
    if hflags & proto::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(bad("server does not speak fixed newstyle"));
    }
    let mut cflags = proto::FLAG_C_FIXED_NEWSTYLE;
    if hflags & proto::FLAG_NO_ZEROES != 0 {
        cflags |= proto::FLAG_C_NO_ZEROES;
    }
    s.write_by(&cflags.to_be_bytes(), deadline)?;
    Ok((s, name))
}

/// Sends option `opt` with `data`.
pub(crate) fn send_option(
    s: &mut Stream,
    opt: u32,
    data: &[u8],
    deadline: Instant,
) -> io::Result<()> {
    let mut o = proto::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&opt.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    s.write_by(&o, deadline)
}

/// Reads one option reply: its type and data.
pub(crate) fn option_reply(s: &mut Stream, deadline: Instant) -> io::Result<(u32, Vec<u8>)> {
    let mut h = [0u8; 20];
    s.read_by(&mut h, deadline)?;
    if h[..8] != proto::OPT_REPLY_MAGIC.to_be_bytes() {
        return Err(bad("bad option reply magic"));
    }
    let reply = u32::from_be_bytes([h[12], h[13], h[14], h[15]]);
    let len = u32::from_be_bytes([h[16], h[17], h[18], h[19]]);
    if len > proto::MAX_OPTION_LEN {
        return Err(bad("option reply too long"));
    }
    let mut d = vec![0u8; len as usize];
    s.read_by(&mut d, deadline)?;
    Ok((reply, d))
}

/// NBD_OPT_GO for export `name`: its size and transmission flags.
pub(crate) fn go(s: &mut Stream, name: &str, deadline: Instant) -> io::Result<(u64, u16)> {
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    send_option(s, proto::OPT_GO, &data, deadline)?;
    let (mut size, mut flags) = (None, 0u16);
    loop {
        let (reply, d) = option_reply(s, deadline)?;
        match reply {
            proto::REP_ACK => break,
            proto::REP_INFO
                if d.len() >= 12 && u16::from_be_bytes([d[0], d[1]]) == proto::INFO_EXPORT =>
            {
                let mut b = [0u8; 8];
                b.copy_from_slice(&d[2..10]);
                size = Some(u64::from_be_bytes(b));
                flags = u16::from_be_bytes([d[10], d[11]]);
            }
            proto::REP_INFO => {}
            r if r & proto::REP_FLAG_ERROR != 0 => {
                return Err(bad(format!(
                    "server refused export {name:?}: {}",
                    String::from_utf8_lossy(&d)
                )));
            }
            _ => return Err(bad("unexpected option reply")),
        }
    }
    let size = size.ok_or_else(|| bad("server sent no export size"))?;
    Ok((size, flags))
}

/// What a request gets back: the server's error (0 for success). A successful read's data
/// is in the caller's buffer.
pub(crate) type Reply = io::Result<u32>;

/// Where a read's data goes: the caller's buffer, which the reader thread fills in place (no
/// buffer of its own to allocate, zero and copy from: a 1 MiB read cost a memset and a
/// memcpy of 1 MiB each).
///
/// Sound because the caller of [`Conn::call`] holds the buffer's `&mut` borrow until the
/// request's slot is filled, and the reader thread writes through this pointer only between
/// taking the waiter out of `pending` and filling its slot: a request that times out breaks
/// the connection (the reader's read then fails at once) and still waits for its slot.
struct Dest {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is handed over to the reader thread for the time described above; no
// other thread touches it meanwhile.
unsafe impl Send for Dest {}

/// A request waiting for its reply.
struct Waiter {
    /// Where the data that follows a successful reply goes (a read's buffer, else none).
    dest: Option<Dest>,
    reply: Arc<ReplySlot>,
}

/// Where a request's reply is handed over: the request sleeps on it until the reader
/// thread (or a failure) fills it. Never spins: a request to a remote source waits for
/// milliseconds, and many requests spinning (yielding the processor in a loop, as a
/// channel's receive does first) take a small host's processors from everything else.
#[derive(Default)]
struct ReplySlot {
    reply: OrderedMutex<levels::DeviceLeaf, Option<Reply>>,
    filled: Condvar,
}

impl ReplySlot {
    fn send(&self, r: Reply) {
        *self.reply.lock() = Some(r);
        self.filled.notify_one();
    }

    /// The reply, or `None` at `deadline`.
    fn recv_deadline(&self, deadline: Instant) -> Option<Reply> {
        let mut r = self.reply.lock();
        while r.is_none() {
            if r.wait_until(&self.filled, deadline).timed_out() {
                break;
            }
        }
        r.take()
    }

    /// The reply, however long it takes (after the connection was broken: the reader or
    /// `Shared::fail` fills every slot promptly).
    fn recv(&self) -> Reply {
        let mut r = self.reply.lock();
        loop {
            if let Some(x) = r.take() {
                return x;
            }
            r.wait(&self.filled);
        }
    }
}

/// The part of a connection its reader thread shares with the requests.
struct Shared {
    /// Requests written (or being written) and not yet answered, by cookie.
    pending: Mutex<HashMap<u64, Waiter>>,
    /// Set once, when the connection breaks; no request is registered after that.
    broken: AtomicBool,
    /// Why it broke, for the requests that arrive afterwards.
    why: OrderedMutex<levels::DeviceLeaf, String>,
    /// A handle on the socket, to shut it down (which also stops the reader thread).
    shut: Stream,
}

impl Shared {
    /// Breaks the connection: shuts the socket down and fails every waiting request with
    /// `kind`. Idempotent.
    fn fail(&self, kind: io::ErrorKind, why: &str) {
        // Taking the pending lock first orders this against `Conn::call`'s registration:
        // a request either sees `broken` or is in the map drained here.
        let mut pending = self.pending.lock();
        if !self.broken.swap(true, Relaxed) {
            *self.why.lock() = why.to_string();
            self.shut.shutdown();
        }
        for (_, w) in pending.drain() {
            w.reply.send(Err(io::Error::new(kind, why.to_string())));
        }
    }
}

/// One connection to the source, carrying many requests at once.
pub(crate) struct Conn {
    shared: Arc<Shared>,
    writer: Mutex<Stream>,
    /// Requests taken on this connection and not yet finished (the pool's load measure).
    pub(crate) inflight: AtomicUsize,
    cookie: AtomicU64,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Conn {
    /// Wraps a negotiated stream and starts its reader thread.
    pub(crate) fn start(stream: Stream) -> io::Result<Conn> {
        let mut rd = stream.try_clone()?;
        let shared = Arc::new(Shared {
            pending: Mutex::new(HashMap::new()),
            broken: AtomicBool::new(false),
            why: OrderedMutex::new(String::new()),
            shut: stream.try_clone()?,
        });
        rd.set_read_timeout(None)?;
        let sh = shared.clone();
        let reader = std::thread::Builder::new()
            .name("sce-nbd-client".into())
            .spawn(move || read_replies(&mut rd, &sh))?;
        Ok(Conn {
            shared,
            writer: Mutex::new(stream),
            inflight: AtomicUsize::new(0),
            cookie: AtomicU64::new(1),
            reader: Mutex::new(Some(reader)),
        })
    }

    /// Whether the connection has failed (it takes no more requests).
    pub(crate) fn is_broken(&self) -> bool {
        self.shared.broken.load(Relaxed)
    }

    /// Sends one command and waits for its reply until `deadline`. `out` is a write's data;
    /// `into` a read's buffer (`len` bytes), which a successful reply fills. An `Err` means
    /// the connection is broken (by this request or another); `TimedOut` and `InvalidData`
    /// errors are the source's fault, the others the transport's.
    pub(crate) fn call(
        &self,
        command: u16,
        offset: u64,
        len: u32,
        out: Option<&[u8]>,
        into: Option<&mut [u8]>,
        deadline: Instant,
    ) -> Reply {
        let cookie = self.cookie.fetch_add(1, Relaxed);
        let slot = Arc::new(ReplySlot::default());
        debug_assert!(into.as_ref().is_none_or(|b| b.len() == len as usize));
        let dest = into.map(|b| Dest {
            ptr: b.as_mut_ptr(),
            len: b.len(),
        });
        {
            let mut pending = self.shared.pending.lock();
            if self.is_broken() {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    self.shared.why.lock().clone(),
                ));
            }
            pending.insert(
                cookie,
                Waiter {
                    dest,
                    reply: slot.clone(),
                },
            );
        }
        let h = proto::encode_request(&Request {
            flags: 0,
            command,
            cookie,
            offset,
            len,
        });
        let sent = {
            let mut w = self.writer.lock();
            w.write_by(&h, deadline)
                .and_then(|()| out.map_or(Ok(()), |d| w.write_by(d, deadline)))
        };
        if let Err(e) = sent {
            // A partly written request leaves the stream unusable.
            self.shared
                .fail(e.kind(), &format!("sending a request: {e}"));
        }
        match slot.recv_deadline(deadline) {
            Some(r) => r,
            None => {
                self.shared.fail(
                    io::ErrorKind::TimedOut,
                    "a request on this connection timed out",
                );
                // `fail` answered the request if it was still waiting; else the reader has
                // it (its read of the data fails now that the socket is shut down, or it
                // answered between the timeout and `fail`). Either way, wait for the answer:
                // the reader may be writing into `into` until then.
                match slot.recv() {
                    Err(e) if e.kind() != io::ErrorKind::TimedOut => {
                        Err(io::Error::new(io::ErrorKind::TimedOut, "request timed out"))
                    }
                    r => r,
                }
            }
        }
    }

    /// Sends NBD_CMD_DISC (best effort, waiting at most a second), closes the connection
    /// and waits for its reader thread.
    pub(crate) fn close(&self) {
        if !self.is_broken() {
            let disc = proto::encode_request(&Request {
                flags: 0,
                command: proto::CMD_DISC,
                cookie: 0,
                offset: 0,
                len: 0,
            });
            if let Some(mut w) = self.writer.try_lock_for(Duration::from_secs(1)) {
                let _ = w.write_by(&disc, Instant::now() + Duration::from_secs(1));
            }
        }
        self.shared.fail(
            io::ErrorKind::NotConnected,
            "the client closed the connection",
        );
        if let Some(t) = self.reader.lock().take() {
            let _ = t.join();
        }
    }
}

/// The reader thread: hands each reply to its request until the connection breaks.
fn read_replies(rd: &mut Stream, sh: &Shared) {
    let (kind, why) = loop {
        match read_reply(rd, sh) {
            Ok(()) => {}
            Err(e) if sh.broken.load(Relaxed) => break (e.kind(), e.to_string()),
            Err(e) => break (e.kind(), format!("reading replies: {e}")),
        }
    };
    sh.fail(kind, &why);
}

/// Reads one reply and its data and delivers it.
fn read_reply(rd: &mut Stream, sh: &Shared) -> io::Result<()> {
    let mut rh = [0u8; proto::REPLY_LEN];
    rd.read_full(&mut rh)?;
    let (error, cookie) = proto::parse_simple_reply(&rh)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let Some(w) = sh.pending.lock().remove(&cookie) else {
        return Err(bad(format!("a reply for unknown cookie {cookie}")));
    };
    if let (0, Some(d)) = (error, &w.dest) {
        // SAFETY: see `Dest`: the request waits, holding the buffer, until its slot is filled.
        let buf = unsafe { std::slice::from_raw_parts_mut(d.ptr, d.len) };
        if let Err(e) = rd.read_full(buf) {
            w.reply.send(Err(io::Error::new(e.kind(), e.to_string())));
            return Err(e);
        }
    }
    w.reply.send(Ok(error));
    Ok(())
}
