//! TLS-PSK, as qemu-nbd and nbdkit do it: a psktool key file (`USERNAME:HEXKEY` lines), and
//! GnuTLS on the server side, which is what those servers and their clients (qemu, libnbd)
//! use. rustls has no external pre-shared keys (rustls/rustls#174), so this one mode runs
//! on the system's GnuTLS (`libgnutls.so.30`, in every Debian with qemu or libnbd), loaded
//! when a PSK listener starts: the build needs no C library, and a server without
//! `--tls-psk` never loads it.
//!
//! After the handshake, two pump threads move plaintext between the TLS session and one
//! end of a Unix socket pair (GnuTLS allows one thread receiving and one sending on a
//! session), and the server serves the other end as it serves any connection.

use super::*;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

type Session = *mut c_void;
type Creds = *mut c_void;

/// The GnuTLS functions used, from the system's library.
struct Gnutls {
    global_init: unsafe extern "C" fn() -> c_int,
    strerror: unsafe extern "C" fn(c_int) -> *const c_char,
    error_is_fatal: unsafe extern "C" fn(c_int) -> c_int,
    psk_allocate: unsafe extern "C" fn(*mut Creds) -> c_int,
    psk_set_file: unsafe extern "C" fn(Creds, *const c_char) -> c_int,
    init: unsafe extern "C" fn(*mut Session, c_uint) -> c_int,
    priority_set_direct: unsafe extern "C" fn(Session, *const c_char, *mut *const c_char) -> c_int,
    credentials_set: unsafe extern "C" fn(Session, c_int, *mut c_void) -> c_int,
    transport_set_int2: unsafe extern "C" fn(Session, c_int, c_int),
    handshake_set_timeout: unsafe extern "C" fn(Session, c_uint),
    handshake: unsafe extern "C" fn(Session) -> c_int,
    record_recv: unsafe extern "C" fn(Session, *mut c_void, usize) -> isize,
    record_send: unsafe extern "C" fn(Session, *const c_void, usize) -> isize,
    bye: unsafe extern "C" fn(Session, c_int) -> c_int,
    deinit: unsafe extern "C" fn(Session),
    psk_username: unsafe extern "C" fn(Session) -> *const c_char,
    psk_free: unsafe extern "C" fn(Creds),
}

const GNUTLS_SERVER: c_uint = 1;
const GNUTLS_CRD_PSK: c_int = 4;
const GNUTLS_SHUT_WR: c_int = 1;
const GNUTLS_E_AGAIN: isize = -28;
const GNUTLS_E_INTERRUPTED: isize = -52;
/// What qemu-nbd and nbdkit allow with PSK credentials.
const PRIORITY: &str = "NORMAL:+ECDHE-PSK:+DHE-PSK:+PSK";

/// Loads GnuTLS once; the error says what is missing.
fn gnutls() -> Result<&'static Gnutls, String> {
    static LIB: OnceLock<Result<Gnutls, String>> = OnceLock::new();
    LIB.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Gnutls, String> {
    let name = c"libgnutls.so.30";
    // SAFETY: dlopen with a valid C string; the handle is kept for the process's life.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        return Err(
            "TLS-PSK needs GnuTLS (libgnutls.so.30, Debian package libgnutls30), which could not be loaded"
                .into(),
        );
    }
    // SAFETY: each name is GnuTLS's function whose C prototype (gnutls/gnutls.h, 3.x) the
    // field's type follows, and the handle stays open for the process's life.
    unsafe {
        Ok(Gnutls {
            global_init: func(h, c"gnutls_global_init")?,
            strerror: func(h, c"gnutls_strerror")?,
            error_is_fatal: func(h, c"gnutls_error_is_fatal")?,
            psk_allocate: func(h, c"gnutls_psk_allocate_server_credentials")?,
            psk_set_file: func(h, c"gnutls_psk_set_server_credentials_file")?,
            init: func(h, c"gnutls_init")?,
            priority_set_direct: func(h, c"gnutls_priority_set_direct")?,
            credentials_set: func(h, c"gnutls_credentials_set")?,
            transport_set_int2: func(h, c"gnutls_transport_set_int2")?,
            handshake_set_timeout: func(h, c"gnutls_handshake_set_timeout")?,
            handshake: func(h, c"gnutls_handshake")?,
            record_recv: func(h, c"gnutls_record_recv")?,
            record_send: func(h, c"gnutls_record_send")?,
            bye: func(h, c"gnutls_bye")?,
            deinit: func(h, c"gnutls_deinit")?,
            psk_username: func(h, c"gnutls_psk_server_get_username")?,
            psk_free: func(h, c"gnutls_psk_free_server_credentials")?,
        })
    }
}

/// The function `name` of the library `h`, as the function pointer type `F`.
///
/// # Safety
/// `F` must be a function pointer type matching the symbol's C prototype.
unsafe fn func<F: Copy>(h: *mut c_void, name: &CStr) -> Result<F, String> {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: dlsym on a live handle with a valid C string.
    let p = unsafe { libc::dlsym(h, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("GnuTLS lacks {}", name.to_string_lossy()));
    }
    // SAFETY: the caller names the symbol's type; a data pointer and a function pointer
    // have the same size here (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

impl Gnutls {
    fn error(&self, code: c_int) -> String {
        // SAFETY: gnutls_strerror returns a static string for any code.
        let s = unsafe { CStr::from_ptr((self.strerror)(code)) };
        s.to_string_lossy().into_owned()
    }
}

/// A psktool key file's server credentials.
pub struct PskKeys {
    lib: &'static Gnutls,
    creds: Creds,
    /// The usernames the file holds (for the log).
    pub users: Vec<String>,
}

// SAFETY: the credentials are read-only once set; GnuTLS allows sharing them between
// sessions on any thread.
unsafe impl Send for PskKeys {}
// SAFETY: as above.
unsafe impl Sync for PskKeys {}

impl PskKeys {
    /// Reads the key file (`USERNAME:HEXKEY` lines, as `psktool` writes them) and makes the
    /// server credentials. Errors name the file, the line and what is wrong.
    pub fn from_file(path: &Path) -> Result<PskKeys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("TLS-PSK key file {}: {e}", path.display()))?;
        let mut users = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let bad =
                |why: &str| format!("TLS-PSK key file {} line {}: {why}", path.display(), i + 1);
            let (user, key) = line
                .split_once(':')
                .ok_or_else(|| bad("expected USERNAME:HEXKEY (as psktool writes it)"))?;
            if user.is_empty() {
                return Err(bad("no username"));
            }
            if key.len() < 32 || key.len() % 2 != 0 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad("the key must be at least 16 bytes in hexadecimal"));
            }
            users.push(user.to_string());
        }
        if users.is_empty() {
            return Err(format!("TLS-PSK key file {}: no key in it", path.display()));
        }
        let lib = gnutls()?;
        let cpath = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| format!("TLS-PSK key file {}: bad path", path.display()))?;
        let mut creds: Creds = std::ptr::null_mut();
        // SAFETY: GnuTLS calls with valid out-pointers and C strings.
        unsafe {
            let r = (lib.global_init)();
            if r < 0 {
                return Err(format!("TLS-PSK: GnuTLS: {}", lib.error(r)));
            }
            let r = (lib.psk_allocate)(&mut creds);
            if r < 0 {
                return Err(format!("TLS-PSK: {}", lib.error(r)));
            }
        }
        // From here the credentials are freed on every path (`Drop`).
        let keys = PskKeys { lib, creds, users };
        // SAFETY: live credentials and a valid C string.
        let r = unsafe { (lib.psk_set_file)(keys.creds, cpath.as_ptr()) };
        if r < 0 {
            return Err(format!(
                "TLS-PSK key file {}: {}",
                path.display(),
                lib.error(r)
            ));
        }
        Ok(keys)
    }
}

impl Drop for PskKeys {
    fn drop(&mut self) {
        // SAFETY: credentials made by gnutls_psk_allocate_server_credentials; no session
        // uses them any more (each holds an `Arc` of these keys).
        unsafe { (self.lib.psk_free)(self.creds) }
    }
}

/// One TLS session and its socket, shared by the two pump threads.
struct Tls<C> {
    lib: &'static Gnutls,
    s: Session,
    net: C,
    /// The credentials the session uses: kept alive as long as it.
    _keys: Arc<PskKeys>,
}

// SAFETY: GnuTLS allows one thread in record_recv and another in record_send on a session;
// the pumps keep to that, and deinit runs once both are done (on the last drop).
unsafe impl<C: Send> Send for Tls<C> {}
// SAFETY: as above.
unsafe impl<C: Send> Sync for Tls<C> {}

impl<C> Drop for Tls<C> {
    fn drop(&mut self) {
        // SAFETY: the session was made by gnutls_init and is no longer in use.
        unsafe { (self.lib.deinit)(self.s) }
    }
}

/// Runs the TLS-PSK handshake on `net` (within `deadline`), then hands the session to the
/// pump threads and returns the plaintext end of the connection. A send that makes no
/// progress for `stall` ends the connection.
pub(super) fn start<C: Conn>(
    net: C,
    keys: &Arc<PskKeys>,
    deadline: Instant,
    stall: Duration,
) -> Result<UnixStream, ConnError> {
    let lib = keys.lib;
    let err = |r: c_int| ConnError::Tls(lib.error(r));
    let mut s: Session = std::ptr::null_mut();
    // SAFETY: gnutls_init with a valid out-pointer.
    let r = unsafe { (lib.init)(&mut s, GNUTLS_SERVER) };
    if r < 0 {
        return Err(err(r));
    }
    let fd = net.raw_fd();
    let tls = Arc::new(Tls {
        lib,
        s,
        net,
        _keys: keys.clone(),
    });
    let prio = CString::new(PRIORITY).expect("no NUL");
    let left = deadline.saturating_duration_since(Instant::now());
    // SAFETY: calls on a live session with valid arguments; the credentials outlive it
    // (`Tls` holds them).
    unsafe {
        let r = (lib.priority_set_direct)(s, prio.as_ptr(), std::ptr::null_mut());
        if r < 0 {
            return Err(err(r));
        }
        let r = (lib.credentials_set)(s, GNUTLS_CRD_PSK, keys.creds);
        if r < 0 {
            return Err(err(r));
        }
        (lib.transport_set_int2)(s, fd, fd);
        (lib.handshake_set_timeout)(s, left.as_millis().clamp(1, u32::MAX as u128) as c_uint);
        loop {
            let r = (lib.handshake)(s);
            if r >= 0 {
                break;
            }
            if (lib.error_is_fatal)(r) != 0 || Instant::now() >= deadline {
                return Err(err(r));
            }
        }
        let u = (lib.psk_username)(s);
        if !u.is_null() {
            tracing::debug!(
                "TLS-PSK connection of {}",
                CStr::from_ptr(u).to_string_lossy()
            );
        }
    }
    // The pumps' receives block until data or end of file (the server's idle timeout ends
    // a quiet connection through the plaintext side); a send that makes no progress for
    // `stall` ends the connection (a client that stopped reading).
    tls.net.set_read_timeout_conn(None)?;
    tls.net.set_write_timeout_conn(Some(stall))?;
    let (plain, inner) = UnixStream::pair()?;
    let (t2, inner2) = (tls.clone(), inner.try_clone()?);
    std::thread::Builder::new()
        .name("nbd-psk-in".into())
        .spawn(move || from_net(&tls, inner))?;
    std::thread::Builder::new()
        .name("nbd-psk-out".into())
        .spawn(move || to_net(&t2, inner2))?;
    Ok(plain)
}

/// Client to server: decrypted records into the plaintext socket; the client's end (or an
/// error) becomes the server's end of file.
fn from_net<C: Conn>(t: &Tls<C>, mut plain: UnixStream) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        // SAFETY: a live session, a buffer of that length.
        let n = unsafe { (t.lib.record_recv)(t.s, buf.as_mut_ptr().cast(), buf.len()) };
        if n == GNUTLS_E_AGAIN || n == GNUTLS_E_INTERRUPTED {
            continue;
        }
        if n <= 0 || plain.write_all(&buf[..n as usize]).is_err() {
            if n < 0 {
                tracing::debug!("NBD TLS-PSK connection ended: {}", t.lib.error(n as c_int));
            }
            let _ = plain.shutdown(std::net::Shutdown::Write);
            return;
        }
    }
}

/// Server to client: plaintext into records; the server's end sends close_notify and
/// closes the connection.
fn to_net<C: Conn>(t: &Tls<C>, mut plain: UnixStream) {
    let mut buf = vec![0u8; 64 << 10];
    'outer: loop {
        let n = match plain.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let mut at = 0;
        while at < n {
            // SAFETY: a live session, `n - at` bytes of the buffer.
            let w = unsafe { (t.lib.record_send)(t.s, buf[at..n].as_ptr().cast(), n - at) };
            if w == GNUTLS_E_INTERRUPTED {
                continue;
            }
            if w < 0 {
                // GNUTLS_E_AGAIN here is the send timeout: the client stopped reading.
                tracing::debug!("NBD TLS-PSK connection ended: {}", t.lib.error(w as c_int));
                break 'outer;
            }
            at += w as usize;
        }
    }
    // SAFETY: a live session; only this thread sends.
    unsafe { (t.lib.bye)(t.s, GNUTLS_SHUT_WR) };
    t.net.shutdown_conn();
    let _ = plain.shutdown(std::net::Shutdown::Both);
}
