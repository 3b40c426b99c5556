//! systemd's readiness protocol (`Type=notify`, sd_notify(3)): when `NOTIFY_SOCKET` names a
//! datagram socket (a path, or an abstract name starting with `@`), `sce serve` sends it
//! `READY=1` once every listener is up and every export serves, and `STOPPING=1` when a
//! signal starts the shutdown. Without the variable, nothing is sent.

use std::os::unix::net::UnixDatagram;

/// Sends `state` to the service manager, if there is one. A failure is logged, never
/// fatal: the server serves whether or not systemd heard it.
pub fn tell(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(target: "sce::serve", "NOTIFY_SOCKET {}: {e}", path.to_string_lossy());
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let s = UnixDatagram::unbound()?;
    let bytes = path.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        s.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        s.send_to(state.as_bytes(), path)?;
    }
    Ok(())
}
