//! `NbdClient`: a remote NBD export as a `BlockDevice`, so a source can be a SAN-like export
//! (`nbd://host:port/name`, `nbd+unix:///name?socket=PATH`). It keeps a small pool of
//! connections when the server allows several (CAN_MULTI_CONN), one otherwise; each request
//! takes a free connection, so concurrent callers run in parallel.
//!
//! The source may go away and come back (a restart, a network cut): no request waits for it.
//! Every request has a deadline ([`ClientOptions::request_timeout`]), broken connections are
//! closed and reopened on demand with an exponential backoff, and while the source is away
//! requests fail with [`IoError::Io`] (EIO at the NBD edge).

use crate::proto::{self, errno, ProtoError, Request};
use parking_lot::{Condvar, Mutex};
use sce_io::{check_range, BlockDevice, IoError, Op};
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// Where an export is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://host[:port]/name`.
    Tcp {
        /// `host:port`.
        addr: String,
        /// Export name.
        name: String,
    },
    /// `nbd+unix:///name?socket=PATH`.
    Unix {
        /// Socket path.
        socket: PathBuf,
        /// Export name.
        name: String,
    },
}

impl std::str::FromStr for NbdUri {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest
                .split_once('?')
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            let name = path.strip_prefix('/').unwrap_or(path).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .filter(|p| !p.is_empty())
                .ok_or_else(|| format!("{s}: nbd+unix URIs need ?socket=PATH"))?;
            Ok(NbdUri::Unix {
                socket: PathBuf::from(socket),
                name,
            })
        } else if let Some(rest) = s.strip_prefix("nbd://") {
            let (hostport, name) = rest.split_once('/').unwrap_or((rest, ""));
            if hostport.is_empty() {
                return Err(format!("{s}: nbd URIs need a host"));
            }
            let addr = if hostport.contains(':') {
                hostport.to_string()
            } else {
                format!("{hostport}:10809")
            };
            Ok(NbdUri::Tcp {
                addr,
                name: name.to_string(),
            })
        } else {
            Err(format!(
                "{s:?} is not an NBD URI (nbd://host:port/name or nbd+unix:///name?socket=PATH)"
            ))
        }
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NbdUri::Tcp { addr, name } => write!(f, "nbd://{addr}/{name}"),
            NbdUri::Unix { socket, name } => {
                write!(f, "nbd+unix:///{name}?socket={}", socket.display())
            }
        }
    }
}

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
    /// Longest time one request may take, from waiting for a free connection to the last
    /// byte of its reply. Default 60 s. A connection on which a request timed out is closed
    /// (its stream is in an unknown state) and replaced later.
    pub request_timeout: Duration,
    /// Wait after a failed reconnection before the next attempt. Requests that need a new
    /// connection during that wait fail at once. Default 50 ms.
    pub backoff_initial: Duration,
    /// The wait doubles after each failed attempt up to this. Default 5 s. A successful
    /// connection resets it to `backoff_initial`.
    pub backoff_max: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(60),
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
        }
    }
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_read_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(Some(t)),
            Stream::Unix(s) => s.set_read_timeout(Some(t)),
        }
    }
    fn set_write_timeout(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(Some(t)),
            Stream::Unix(s) => s.set_write_timeout(Some(t)),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }

    /// Reads exactly `buf`, giving up with `TimedOut` at `deadline`.
    fn read_by(&mut self, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
        let mut done = 0;
        while done < buf.len() {
            self.set_read_timeout(remaining(deadline)?)?;
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
    fn write_by(&mut self, buf: &[u8], deadline: Instant) -> io::Result<()> {
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

fn bad(msg: impl Into<String>) -> io::Error {
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
fn connect(uri: &NbdUri, timeout: Duration) -> io::Result<(Stream, u64, u16)> {
    let deadline = Instant::now() + timeout;
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
    let mut data = (name.len() as u32).to_be_bytes().to_vec();
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    let mut opt = proto::IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
    opt.extend_from_slice(&data);
    s.write_by(&opt, deadline)?;
    let (mut size, mut flags) = (None, 0u16);
    loop {
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
    Ok((s, size, flags))
}

/// The connections of a client and what it knows about reaching the source.
struct Pool {
    /// Connections ready for a request.
    idle: Vec<Stream>,
    /// Connections idle or carrying a request, plus reconnections under way: at most
    /// `NbdClient::capacity`.
    live: usize,
    /// Wait after the next failed reconnection.
    backoff: Duration,
    /// No reconnection attempt before this (set by a failed one).
    retry_at: Option<Instant>,
    /// Why the last reconnection failed.
    last_error: String,
}

/// A remote export, as a `BlockDevice`.
///
/// Each request takes a connection of a small pool (one request per connection at a time;
/// several connections only when the server sets CAN_MULTI_CONN). A connection that fails
/// or times out is closed; connections are reopened on demand, with an exponential backoff
/// after failed attempts (see [`ClientOptions`]). While the source is away requests fail
/// with [`IoError::Io`]; none waits for the source to come back. A request that failed on
/// a pooled connection (the source restarted since it was opened) is retried once on a new
/// connection: every NBD command the client sends is idempotent.
///
/// Dropping the client sends NBD_CMD_DISC on its idle connections and closes them; it never
/// waits for an absent source for longer than a second per connection.
pub struct NbdClient {
    uri: NbdUri,
    size: u64,
    flags: u16,
    capacity: usize,
    opts: ClientOptions,
    pool: Mutex<Pool>,
    free: Condvar,
    cookie: AtomicU64,
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

/// A connection taken for one request, and whether it came from the pool (it may be stale).
struct Taken {
    stream: Stream,
    pooled: bool,
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
        let mut idle = vec![first];
        for _ in 1..capacity {
            idle.push(
                connect(uri, opts.connect_timeout)
                    .map_err(|e| open_err(uri, e))?
                    .0,
            );
        }
        Ok(NbdClient {
            uri: uri.clone(),
            size,
            flags,
            capacity,
            pool: Mutex::new(Pool {
                live: idle.len(),
                idle,
                backoff: opts.backoff_initial,
                retry_at: None,
                last_error: String::new(),
            }),
            opts,
            free: Condvar::new(),
            cookie: AtomicU64::new(1),
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

    /// Takes an idle connection, or opens one if the pool has room and no backoff is
    /// running, or waits for one until `deadline`.
    fn take(&self, deadline: Instant) -> io::Result<Taken> {
        let mut p = self.pool.lock();
        loop {
            if let Some(stream) = p.idle.pop() {
                return Ok(Taken {
                    stream,
                    pooled: true,
                });
            }
            if p.live < self.capacity {
                if let Some(at) = p.retry_at {
                    let now = Instant::now();
                    if now < at {
                        return Err(io::Error::new(
                            io::ErrorKind::NotConnected,
                            format!(
                                "NBD source {} is unreachable ({}); next attempt in {} ms",
                                self.uri,
                                p.last_error,
                                (at - now).as_millis()
                            ),
                        ));
                    }
                }
                p.live += 1;
                drop(p);
                let timeout = self
                    .opts
                    .connect_timeout
                    .min(deadline.saturating_duration_since(Instant::now()))
                    .max(Duration::from_millis(1));
                let r = connect(&self.uri, timeout).and_then(|(s, size, _)| {
                    if size == self.size {
                        Ok(s)
                    } else {
                        s.shutdown();
                        Err(bad(format!(
                            "the export's size changed from {} to {size} bytes",
                            self.size
                        )))
                    }
                });
                let mut p = self.pool.lock();
                return match r {
                    Ok(stream) => {
                        p.backoff = self.opts.backoff_initial;
                        p.retry_at = None;
                        Ok(Taken {
                            stream,
                            pooled: false,
                        })
                    }
                    Err(e) => {
                        p.live -= 1;
                        p.retry_at = Some(Instant::now() + p.backoff);
                        p.backoff = (p.backoff * 2).min(self.opts.backoff_max);
                        p.last_error = e.to_string();
                        self.free.notify_one();
                        tracing::warn!("reconnecting to NBD source {}: {e}", self.uri);
                        Err(e)
                    }
                };
            }
            if self.free.wait_until(&mut p, deadline).timed_out() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "timed out waiting for a free connection",
                ));
            }
        }
    }

    /// Returns a healthy connection to the pool.
    fn give_back(&self, s: Stream) {
        self.pool.lock().idle.push(s);
        self.free.notify_one();
    }

    /// Forgets a broken connection; with `stale_too`, the idle ones as well (after a
    /// transport failure they most likely lead to the same dead source).
    fn discard(&self, s: Stream, stale_too: bool) {
        s.shutdown();
        let mut p = self.pool.lock();
        p.live -= 1;
        if stale_too {
            let stale = std::mem::take(&mut p.idle);
            // `live` counts idle connections too.
            p.live -= stale.len();
            for s in stale {
                s.shutdown();
            }
        }
        drop(p);
        self.free.notify_all();
    }

    #[allow(clippy::too_many_arguments)]
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
            let Taken { mut stream, pooled } = self.take(deadline).map_err(io_err)?;
            let cookie = self.cookie.fetch_add(1, Relaxed);
            match self.exchange(
                &mut stream,
                command,
                cookie,
                offset,
                len,
                out,
                into.as_deref_mut(),
                deadline,
            ) {
                Ok(error) => {
                    self.give_back(stream);
                    break error;
                }
                Err(e) => {
                    let transport = !matches!(
                        e.kind(),
                        io::ErrorKind::TimedOut | io::ErrorKind::InvalidData
                    );
                    self.discard(stream, transport);
                    if pooled && transport && !retried {
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
            e => Err(io_err(io::Error::from_raw_os_error(e as i32))),
        }
    }

    /// One request and its reply on `s`. Returns the error the server replied with; an
    /// `Err` means the stream is in an unknown state.
    #[allow(clippy::too_many_arguments)]
    fn exchange(
        &self,
        s: &mut Stream,
        command: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        out: Option<&[u8]>,
        into: Option<&mut [u8]>,
        deadline: Instant,
    ) -> io::Result<u32> {
        let h = proto::encode_request(&Request {
            flags: 0,
            command,
            cookie,
            offset,
            len,
        });
        s.write_by(&h, deadline)?;
        if let Some(d) = out {
            s.write_by(d, deadline)?;
        }
        let mut rh = [0u8; proto::REPLY_LEN];
        s.read_by(&mut rh, deadline)?;
        let (error, c) = proto::parse_simple_reply(&rh)
            .map_err(|e: ProtoError| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if c != cookie {
            return Err(bad("reply cookie does not match"));
        }
        if error == 0 {
            if let Some(b) = into {
                s.read_by(b, deadline)?;
            }
        }
        Ok(error)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        let idle = std::mem::take(&mut self.pool.get_mut().idle);
        let disc = proto::encode_request(&Request {
            flags: 0,
            command: proto::CMD_DISC,
            cookie: 0,
            offset: 0,
            len: 0,
        });
        for mut s in idle {
            let _ = s.write_by(&disc, Instant::now() + Duration::from_secs(1));
            s.shutdown();
        }
    }
}

impl BlockDevice for NbdClient {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            "nbd://127.0.0.1:10810/lun0".parse(),
            Ok(NbdUri::Tcp {
                addr: "127.0.0.1:10810".into(),
                name: "lun0".into()
            })
        );
        assert_eq!(
            "nbd://filer".parse(),
            Ok(NbdUri::Tcp {
                addr: "filer:10809".into(),
                name: String::new()
            })
        );
        assert_eq!(
            "nbd+unix:///vol?socket=/run/x.sock".parse(),
            Ok(NbdUri::Unix {
                socket: "/run/x.sock".into(),
                name: "vol".into()
            })
        );
        assert!("nbd+unix:///vol".parse::<NbdUri>().is_err());
        assert!("http://x".parse::<NbdUri>().is_err());
        assert!("nbd:///x".parse::<NbdUri>().is_err());
    }
}
