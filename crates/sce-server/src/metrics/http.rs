//! The metrics endpoint's HTTP serving, bounded so that no client can make it grow or wait:
//! one poll thread reads every connection's request head (at most [`MAX_HEAD`] bytes, within
//! [`HEAD_TIMEOUT`] of the connect, at most [`MAX_PENDING`] connections at once, the oldest
//! dropped for a new one), and a fixed pool of [`WORKERS`] threads answers complete requests,
//! each write bounded by [`WRITE_TIMEOUT`]. An idle or slow client therefore holds neither a
//! thread nor a scrape.
//!
//! Hand-written rather than a crate's: tiny_http, the usual blocking server, starts a thread
//! for every connection waiting on a request (its pool grows without a bound), so a hundred
//! idle connections would be a hundred threads; this needs no runtime and no thread per
//! connection.

use sce_engine::order::{levels, OrderedMutex};
use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
/// The answering threads' shared queue (a leaf, `sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;
use std::time::{Duration, Instant};

/// The longest request head (request line and headers) taken; a longer one is answered
/// 431 and closed.
pub const MAX_HEAD: usize = 8 << 10;
/// A request head must be complete this long after the connect, or the connection closes.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections waiting for their request head at once; a new one drops the oldest.
pub const MAX_PENDING: usize = 256;
/// Threads that answer requests.
pub const WORKERS: usize = 2;
/// A reply that cannot be written within this long is dropped.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// A response: status line text, content type, body.
pub type Response = (&'static str, &'static str, String);

/// Answers a request path.
pub type Handler = dyn Fn(&str) -> Response + Send + Sync;

/// A connection whose request head is not complete yet.
struct Pending {
    conn: TcpStream,
    head: Vec<u8>,
    since: Instant,
}

/// Serves `l` from a poll thread and [`WORKERS`] answering threads, for as long as the
/// process runs.
pub fn serve(l: TcpListener, handler: Arc<Handler>) -> std::io::Result<()> {
    l.set_nonblocking(true)?;
    let (tx, rx) = sync_channel::<(TcpStream, String)>(MAX_PENDING);
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..WORKERS {
        let (rx, h) = (rx.clone(), handler.clone());
        std::thread::Builder::new()
            .name(format!("sce-metrics-{i}"))
            .spawn(move || answer_loop(&rx, &*h))?;
    }
    std::thread::Builder::new()
        .name("sce-metrics".into())
        .spawn(move || poll_loop(&l, &tx))?;
    Ok(())
}

/// Takes complete requests off the queue and answers them.
fn answer_loop(rx: &Mutex<Receiver<(TcpStream, String)>>, handler: &Handler) {
    loop {
        let next = rx.lock().recv();
        let Ok((conn, path)) = next else { return };
        let _ = conn.set_nonblocking(false);
        let _ = conn.set_write_timeout(Some(WRITE_TIMEOUT));
        reply(&conn, handler(&path));
    }
}

/// Writes `r` as an HTTP/1.0 response and closes.
fn reply(mut conn: &TcpStream, (status, ctype, body): Response) {
    let _ = write!(
        conn,
        "HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = conn.shutdown(std::net::Shutdown::Write);
}

/// Accepts connections and reads request heads until each is complete, too long, too late
/// or gone.
fn poll_loop(l: &TcpListener, tx: &SyncSender<(TcpStream, String)>) {
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        let mut fds = Vec::with_capacity(pending.len() + 1);
        fds.push(libc::pollfd {
            fd: l.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        fds.extend(pending.iter().map(|p| libc::pollfd {
            fd: p.conn.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }));
        let wait = pending
            .iter()
            .map(|p| HEAD_TIMEOUT.saturating_sub(p.since.elapsed()))
            .min()
            .unwrap_or(HEAD_TIMEOUT)
            .as_millis() as libc::c_int
            + 1;
        // SAFETY: fds is a valid array of fds.len() pollfd structs.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if n < 0 {
            std::thread::sleep(Duration::from_millis(10));
            continue;
        }
        // Connections first (their indexes are fds[1..]), then the listener, which may
        // add to the end or drop the oldest.
        let ready: Vec<bool> = fds[1..].iter().map(|f| f.revents != 0).collect();
        let mut keep = Vec::with_capacity(pending.len());
        for (p, ready) in pending.into_iter().zip(ready) {
            if let Some(p) = step(p, ready, tx) {
                keep.push(p);
            }
        }
        pending = keep;
        if fds[0].revents != 0 {
            accept_all(l, &mut pending);
        }
    }
}

/// Accepts every connection waiting, dropping the oldest pending ones beyond
/// [`MAX_PENDING`].
fn accept_all(l: &TcpListener, pending: &mut Vec<Pending>) {
    loop {
        match l.accept() {
            Ok((conn, _)) => {
                if conn.set_nonblocking(true).is_err() {
                    continue;
                }
                if pending.len() >= MAX_PENDING {
                    pending.remove(0);
                }
                pending.push(Pending {
                    conn,
                    head: Vec::new(),
                    since: Instant::now(),
                });
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => {
                // Out of descriptors or the like: let the poll's timeout pace the retries.
                std::thread::sleep(Duration::from_millis(10));
                return;
            }
        }
    }
}

/// Reads what `p` sent; the connection if it is still waiting for its head, else None
/// (queued for an answer, answered with an error, or closed).
fn step(mut p: Pending, ready: bool, tx: &SyncSender<(TcpStream, String)>) -> Option<Pending> {
    if ready {
        let mut buf = [0u8; 4096];
        let room = (MAX_HEAD + 1 - p.head.len()).min(buf.len());
        match p.conn.read(&mut buf[..room]) {
            Ok(0) => return None,
            Ok(k) => p.head.extend_from_slice(&buf[..k]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(_) => return None,
        }
    }
    if let Some(path) = request_path(&p.head) {
        return match tx.try_send((p.conn, path)) {
            Ok(()) => None,
            Err(TrySendError::Full((c, _)) | TrySendError::Disconnected((c, _))) => {
                reply(
                    &c,
                    ("503 Service Unavailable", "text/plain", "busy\n".into()),
                );
                None
            }
        };
    }
    if p.head.len() > MAX_HEAD {
        let body = format!("request head over {MAX_HEAD} bytes\n");
        reply(
            &p.conn,
            ("431 Request Header Fields Too Large", "text/plain", body),
        );
        return None;
    }
    if p.since.elapsed() >= HEAD_TIMEOUT {
        return None;
    }
    Some(p)
}

/// The path of a complete request head (one that ends with an empty line), without its
/// query; None while the head is incomplete.
fn request_path(head: &[u8]) -> Option<String> {
    let end = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .or_else(|| head.windows(2).position(|w| w == b"\n\n"))?;
    let text = String::from_utf8_lossy(&head[..end]);
    let target = text.split_whitespace().nth(1).unwrap_or("/");
    Some(target.split('?').next().unwrap_or("/").to_string())
}
