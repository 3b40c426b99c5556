//! TLS for NBD over TCP, as qemu-nbd and nbdkit do it: the client asks with NBD_OPT_STARTTLS
//! during option haggling, the TLS handshake runs on the socket, and haggling goes on inside
//! TLS. X.509 server certificates, with optional client certificates (mutual TLS); or
//! pre-shared keys (`psk.rs`).
//!
//! After the handshake, one *pump* thread per TLS connection owns the TLS session and the
//! socket, and moves plaintext between them and one end of a Unix socket pair; the rest of
//! the server (option haggling, the reader, workers, non-blocking replies, timeouts) serves
//! the other end exactly as it serves a plain connection. It costs a copy and a thread per
//! TLS connection, and keeps one code path for everything else.

use super::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConnection;

/// Whether TLS is offered and whether it is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: NBD_OPT_STARTTLS is refused.
    Off,
    /// TLS is offered; clients may go without.
    On,
    /// Every option but STARTTLS and ABORT is refused until TLS is up.
    Require,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!(
                "unknown TLS mode {s:?} (expected off, on or require)"
            )),
        }
    }
}

impl std::fmt::Display for TlsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// The server's credentials: X.509 (rustls) or pre-shared keys (GnuTLS, `psk.rs`).
#[derive(Clone)]
enum Creds {
    X509(Arc<rustls::ServerConfig>),
    Psk(Arc<super::psk::PskKeys>),
}

/// A listener's TLS: its mode and the server's credentials.
#[derive(Clone)]
pub struct ServerTls {
    /// `On` or `Require` (`Off` is no `ServerTls` at all).
    pub mode: TlsMode,
    creds: Creds,
    /// Client certificates are required (mutual TLS).
    pub mutual: bool,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("mode", &self.mode)
            .field("mutual", &self.mutual)
            .finish()
    }
}

impl PartialEq for ServerTls {
    fn eq(&self, o: &Self) -> bool {
        let same = match (&self.creds, &o.creds) {
            (Creds::X509(a), Creds::X509(b)) => Arc::ptr_eq(a, b),
            (Creds::Psk(a), Creds::Psk(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        self.mode == o.mode && self.mutual == o.mutual && same
    }
}
impl Eq for ServerTls {}

impl ServerTls {
    /// Loads a PEM certificate chain and its private key, and a PEM bundle of CA
    /// certificates whose clients are accepted (then every client must present one).
    /// Errors name the file and what is wrong with it.
    pub fn from_files(
        mode: TlsMode,
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<ServerTls, String> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
            .and_then(|i| i.collect::<Result<_, _>>())
            .map_err(|e| format!("TLS certificate {}: {e}", cert.display()))?;
        if certs.is_empty() {
            return Err(format!(
                "TLS certificate {}: no certificate in it",
                cert.display()
            ));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| format!("TLS key {}: {e}", key.display()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = rustls::RootCertStore::empty();
                for c in CertificateDer::pem_file_iter(ca)
                    .map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?
                {
                    let c = c.map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?;
                    roots
                        .add(c)
                        .map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?;
                }
                let v = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                    .build()
                    .map_err(|e| format!("TLS client CA {}: {e}", ca.display()))?;
                builder.with_client_cert_verifier(v)
            }
        };
        let config = builder
            .with_single_cert(certs, key)
            .map_err(|e| format!("TLS certificate {} and its key: {e}", cert.display()))?;
        Ok(ServerTls {
            mode,
            creds: Creds::X509(Arc::new(config)),
            mutual: client_ca.is_some(),
        })
    }

    /// TLS-PSK with the keys of a psktool key file (`USERNAME:HEXKEY` lines): a client must
    /// know one of them. Errors name the file and what is wrong.
    pub fn from_psk_file(mode: TlsMode, keys: &Path) -> Result<ServerTls, String> {
        let k = super::psk::PskKeys::from_file(keys)?;
        tracing::info!(
            "TLS-PSK keys of {} user(s): {}",
            k.users.len(),
            k.users.join(", ")
        );
        Ok(ServerTls {
            mode,
            creds: Creds::Psk(Arc::new(k)),
            mutual: true,
        })
    }

    /// True for TLS-PSK.
    pub fn is_psk(&self) -> bool {
        matches!(self.creds, Creds::Psk(_))
    }
}

/// Runs the TLS handshake on `net` (within `deadline`), then hands the session to a pump
/// thread and returns the plaintext end of the connection.
pub(super) fn start<C: Conn>(
    mut net: C,
    tls: &ServerTls,
    deadline: Instant,
) -> Result<UnixStream, ConnError> {
    let config = match &tls.creds {
        Creds::X509(c) => c.clone(),
        Creds::Psk(k) => return super::psk::start(net, k, deadline, STALL),
    };
    let mut session = ServerConnection::new(config).map_err(|e| ConnError::Tls(e.to_string()))?;
    // The plaintext side is flow-controlled by the pump, not by rustls' buffer limit.
    session.set_buffer_limit(None);
    let mut timed = Deadlined {
        c: &mut net,
        deadline,
        shared: None,
    };
    while session.is_handshaking() {
        match session.complete_io(&mut timed) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                // A TLS alert or a bad certificate: tell the client, then close.
                let _ = session.write_tls(&mut timed);
                return Err(ConnError::Tls(e.to_string()));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let (plain, inner) = UnixStream::pair()?;
    std::thread::Builder::new()
        .name("nbd-tls".into())
        .spawn(move || {
            if let Err(e) = pump(net, session, inner) {
                tracing::debug!("NBD TLS connection ended: {e}");
            }
        })?;
    Ok(plain)
}

/// Bytes of decrypted data waiting for the server before the pump stops reading the network.
const PLAIN_BACKLOG: usize = 1 << 20;

/// A TLS connection whose client reads nothing of what is to be sent for this long is
/// ended (its pump threads would otherwise wait for ever); TLS-PSK's pumps get it from
/// [`start`].
const STALL: Duration = Duration::from_secs(60);

/// Moves bytes between the TLS session on `net` and the plaintext socket `plain` until both
/// directions have ended: the client's end of file (or close_notify) becomes the server's
/// end of file on `plain`, and the server closing `plain` sends close_notify.
fn pump<C: Conn>(net: C, mut tls: ServerConnection, plain: UnixStream) -> io::Result<()> {
    set_nonblocking(net.raw_fd())?;
    plain.set_nonblocking(true)?;
    let (mut net, mut plain) = (net, plain);
    let mut to_plain: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    // What arrived with the end of the handshake (the client's first option, often) is
    // decrypted already: deliver it before waiting for more.
    let mut net_eof = decrypted(&mut tls, &mut to_plain, &mut buf)?;
    let (mut plain_eof, mut plain_shut) = (false, false);
    // Since when the network has taken none of what is to be sent.
    let mut stalled: Option<Instant> = None;
    loop {
        while tls.wants_write() {
            match tls.write_tls(&mut net) {
                Ok(_) => stalled = None,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    stalled.get_or_insert_with(Instant::now);
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if stalled.is_some_and(|t| t.elapsed() > STALL) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client read nothing for a minute",
            ));
        }
        while !to_plain.is_empty() {
            match plain.write(&to_plain) {
                Ok(n) => drop(to_plain.drain(..n)),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            }
        }
        if plain_eof && !tls.wants_write() {
            return Ok(());
        }
        if net_eof && to_plain.is_empty() && !plain_shut {
            let _ = plain.shutdown(std::net::Shutdown::Write);
            plain_shut = true;
        }
        let read_net = !net_eof && to_plain.len() < PLAIN_BACKLOG;
        let read_plain = !plain_eof && !tls.wants_write();
        let mut fds = [
            pollfd(net.raw_fd(), read_net, tls.wants_write()),
            pollfd(plain.as_raw_fd(), read_plain, !to_plain.is_empty()),
        ];
        // SAFETY: two valid pollfds for the duration of the call, on descriptors this
        // thread owns.
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, 1000) } < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
            continue;
        }
        let ready = |p: &libc::pollfd| p.revents != 0;
        if read_net && ready(&fds[0]) {
            net_eof = from_net(&mut tls, &mut net, &mut to_plain, &mut buf)?;
        }
        if read_plain && ready(&fds[1]) {
            match plain.read(&mut buf) {
                Ok(0) => {
                    plain_eof = true;
                    tls.send_close_notify();
                }
                Ok(n) => tls.writer().write_all(&buf[..n])?,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Reads TLS records from the network and decrypts them into `to_plain`. True at the end of
/// the client's stream (end of file or close_notify).
fn from_net<C: Conn>(
    tls: &mut ServerConnection,
    net: &mut C,
    to_plain: &mut Vec<u8>,
    buf: &mut [u8],
) -> io::Result<bool> {
    match tls.read_tls(net) {
        Ok(0) => return Ok(true),
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
        Err(e) => return Err(e),
    }
    if let Err(e) = tls.process_new_packets() {
        // Send the alert before giving up.
        let _ = tls.write_tls(net);
        return Err(io::Error::new(io::ErrorKind::InvalidData, e));
    }
    decrypted(tls, to_plain, buf)
}

/// Moves the plaintext the session has decrypted into `to_plain`. True at the client's
/// close_notify.
fn decrypted(
    tls: &mut ServerConnection,
    to_plain: &mut Vec<u8>,
    buf: &mut [u8],
) -> io::Result<bool> {
    loop {
        match tls.reader().read(buf) {
            Ok(0) => return Ok(true),
            Ok(n) => to_plain.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        }
    }
}

/// A pollfd for `fd`, or one poll ignores (a negative descriptor) when neither direction is
/// wanted: a hung-up socket would otherwise wake the loop for nothing, again and again.
fn pollfd(fd: RawFd, read: bool, write: bool) -> libc::pollfd {
    let fd = if read || write { fd } else { -1 };
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    libc::pollfd {
        fd,
        events,
        revents: 0,
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor the caller owns, with integer arguments.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
