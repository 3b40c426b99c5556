//! Listeners: Unix sockets and TCP, the accept loops, and the rules for socket paths.

use super::*;

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
    /// TLS for TCP connections (NBD_OPT_STARTTLS); `None`: plain only. Ignored for Unix
    /// sockets, which the file permissions protect.
    pub tls: Option<ServerTls>,
}

impl Default for ListenOptions {
    fn default() -> Self {
        ListenOptions {
            socket_mode: 0o600,
            tls: None,
        }
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

pub(super) fn file_id(p: &Path) -> io::Result<(u64, u64)> {
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
pub(super) fn spawn_conn<C: Conn>(server: &Arc<Server>, conn: C, tls: Option<ServerTls>) {
    if let Err(why) = server.admit() {
        server.refused(&why);
        return;
    }
    let s = server.clone();
    tracing::debug!(
        open = server.shared.stats.open_connections.load(Relaxed),
        "NBD connection accepted"
    );
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || match s.serve_admitted(conn, tls) {
            Ok(()) => tracing::debug!("NBD connection closed"),
            Err(e) => tracing::info!("connection ended: {e}"),
        });
    if let Err(e) = spawned {
        // The closure, and the connection with it, is dropped: the socket closes.
        server.shared.stats.open_connections.fetch_sub(1, Relaxed);
        server.refused(&format!("cannot start a connection thread: {e}"));
    }
}

/// Accepts connections from a non-blocking listener until `stop`, serving each on its own
/// thread. `accept` returns a connection ready for blocking I/O.
pub(super) fn accept_loop<C: Conn>(
    server: &Arc<Server>,
    stop: &Arc<AtomicBool>,
    fd: RawFd,
    tls: Option<ServerTls>,
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
                    Ok(c) => spawn_conn(&s, c, tls.clone()),
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
pub(super) fn check_unix_path(path: &Path) -> io::Result<()> {
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

/// Binds a Unix socket at `path` with permission bits `mode` (and, with `group`, owned by
/// that group), atomically: the socket is bound under a temporary name next to `path`,
/// given its group and mode, then renamed over `path` (replacing a stale socket), so it is
/// never reachable with the umask's mode. A path a live server answers on, or that is not
/// a socket, is refused. Any Unix socket that must be private is placed this way (the NBD
/// listener's, the admin socket).
pub fn bind_unix(path: &Path, mode: u32, group: Option<u32>) -> io::Result<UnixListener> {
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
    let placed = std::os::unix::fs::chown(&tmp, None, group)
        .and_then(|()| {
            std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode & 0o777))
        })
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
            let l = bind_unix(path, opts.socket_mode, None)?;
            let id = file_id(path)?;
            l.set_nonblocking(true)?;
            let fd = l.as_raw_fd();
            let thread = accept_loop(server, &stop, fd, None, move || {
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
            let thread = accept_loop(server, &stop, fd, opts.tls.clone(), move || {
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
