//! A connection's life: admission, option haggling (and TLS), transmission, and the
//! counters of why it ended.

use super::handshake::{Outcome, TlsPolicy};
use super::tls::{self, ServerTls, TlsMode};
use super::*;

impl Server {
    /// Serves a connection that holds a slot (see `admit`), and gives the slot back.
    pub(super) fn serve_admitted<C: Conn>(
        self: &Arc<Self>,
        conn: C,
        tls: Option<ServerTls>,
    ) -> Result<(), ConnError> {
        let stats = &self.shared.stats;
        stats.connections.fetch_add(1, Relaxed);
        let id = self.next_conn.fetch_add(1, Relaxed);
        let r = match conn.try_clone_conn() {
            Ok(closer) => {
                // Closing the read half ends the reader; requests in flight still get their
                // replies.
                self.conns
                    .lock()
                    .push((id, Box::new(move || closer.shutdown_read())));
                let r = self.serve_inner(conn, tls.as_ref());
                self.conns.lock().retain(|(i, _)| *i != id);
                r
            }
            Err(e) => Err(e.into()),
        };
        stats.open_connections.fetch_sub(1, Relaxed);
        r
    }

    /// Counts why a connection ends, before its socket is closed (so that a client seeing
    /// the close sees the counter too).
    pub(super) fn note(&self, r: Result<(), ConnError>) -> Result<(), ConnError> {
        let stats = &self.shared.stats;
        match &r {
            Err(ConnError::Protocol(_))
            | Err(ConnError::UnknownExport(_))
            | Err(ConnError::Tls(_)) => {
                stats.protocol_errors.fetch_add(1, Relaxed);
            }
            Err(ConnError::Timeout(what)) => {
                let counter = match *what {
                    HANDSHAKE => &stats.handshake_timeouts,
                    IDLE => &stats.idle_timeouts,
                    _ => &stats.request_timeouts,
                };
                counter.fetch_add(1, Relaxed);
            }
            _ => {}
        }
        r
    }

    /// Option haggling (inside TLS once the client starts it), then transmission.
    fn serve_inner<C: Conn>(
        self: &Arc<Self>,
        mut conn: C,
        tls: Option<&ServerTls>,
    ) -> Result<(), ConnError> {
        conn.set_read_timeout_conn(Some(SLICE))?;
        conn.set_write_timeout_conn(Some(SLICE))?;
        let deadline = Instant::now() + self.shared.cfg.handshake_timeout;
        let policy = TlsPolicy {
            offered: tls.is_some(),
            required: tls.is_some_and(|t| t.mode == TlsMode::Require),
            active: None,
        };
        let mut timed = Deadlined {
            c: &mut conn,
            deadline,
            shared: None,
        };
        let outcome = self.handshake(&mut timed, policy);
        match self.note_handshake(outcome)? {
            Outcome::Go(e, n) => self.transmission(conn, e, n),
            Outcome::Abort => Ok(()),
            Outcome::StartTls(no_zeroes) => {
                // Acknowledged only when offered, so `tls` is there.
                let Some(tls) = tls else {
                    return Ok(());
                };
                let mut plain = match tls::start(conn, tls, deadline) {
                    Ok(p) => p,
                    Err(e) => return self.note(Err(in_handshake(e))),
                };
                self.shared.stats.tls_connections.fetch_add(1, Relaxed);
                plain.set_read_timeout_conn(Some(SLICE))?;
                plain.set_write_timeout_conn(Some(SLICE))?;
                let mut timed = Deadlined {
                    c: &mut plain,
                    deadline,
                    shared: None,
                };
                let policy = TlsPolicy {
                    active: Some(no_zeroes),
                    ..policy
                };
                let outcome = self.handshake(&mut timed, policy);
                match self.note_handshake(outcome)? {
                    Outcome::Go(e, n) => self.transmission(plain, e, n),
                    _ => Ok(()),
                }
            }
        }
    }

    /// Counts a failed handshake (a timeout as one).
    fn note_handshake(&self, r: Result<Outcome, ConnError>) -> Result<Outcome, ConnError> {
        r.or_else(|e| self.note(Err(in_handshake(e))).map(|()| Outcome::Abort))
    }
}

/// An I/O timeout during the handshake is the handshake's timeout.
fn in_handshake(e: ConnError) -> ConnError {
    match e {
        ConnError::Io(e) if e.kind() == io::ErrorKind::TimedOut => ConnError::Timeout(HANDSHAKE),
        e => e,
    }
}
