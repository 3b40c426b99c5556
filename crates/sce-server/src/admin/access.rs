//! Who may use the admin socket: the socket is placed privately (bound under a temporary
//! name, given mode 0600, then renamed into place, so its final path is never reachable
//! with the umask's mode), and every accepted connection's peer is checked with
//! SO_PEERCRED: the server's own uid, root, or a member of the `--admin-group`.

use anyhow::{bail, Context, Result};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;

/// Places the admin socket at `path` with sce-nbd's [`sce_nbd::server::bind_unix`]: mode
/// 0600, or with `group` (the `--admin-group`) owned by that group and 0660, so that its
/// members can connect at all. A socket file left by a server that is gone is replaced;
/// one a live server answers on is refused, and so is a path that is not a socket.
pub(super) fn place(path: &Path, group: Option<u32>) -> Result<UnixListener> {
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    sce_nbd::server::bind_unix(path, mode, group)
        .with_context(|| format!("admin socket {}", path.display()))
}

/// The peers the admin socket serves.
#[derive(Debug, Clone)]
pub struct AdminAccess {
    /// The server's own uid (root is always allowed too).
    uid: u32,
    /// `--admin-group`: its name and gid; its members are allowed too.
    group: Option<(String, u32)>,
}

/// A connection's peer, as the kernel told it at connect().
#[derive(Debug, Clone, Copy)]
pub(super) struct Peer {
    pid: i32,
    uid: u32,
    gid: u32,
}

impl AdminAccess {
    /// The `--admin-group`'s gid, if one was given.
    pub(super) fn gid(&self) -> Option<u32> {
        self.group.as_ref().map(|g| g.1)
    }

    /// The server's uid and, if given, the group (a name or a number) whose members may
    /// use the socket too. An unknown group is an error.
    pub fn new(group: Option<&str>) -> Result<AdminAccess> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let group = group
            .map(|g| group_id(g).map(|id| (g.to_string(), id)))
            .transpose()?;
        Ok(AdminAccess { uid, group })
    }

    /// Ok if `conn`'s peer may use the socket, else why not (one line).
    pub(super) fn check(&self, conn: &UnixStream) -> std::result::Result<Peer, String> {
        let p = peer_cred(conn).map_err(|e| format!("cannot tell who is connecting: {e}"))?;
        if p.uid == 0 || p.uid == self.uid {
            return Ok(p);
        }
        if let Some((name, gid)) = &self.group {
            if p.gid == *gid || peer_groups(conn).is_ok_and(|g| g.contains(gid)) {
                return Ok(p);
            }
            return Err(format!(
                "permission denied: uid {} (pid {}) is neither the server's uid {}, root, nor in the admin group {name}",
                p.uid, p.pid, self.uid
            ));
        }
        Err(format!(
            "permission denied: uid {} (pid {}) is neither the server's uid {} nor root (see --admin-group)",
            p.uid, p.pid, self.uid
        ))
    }
}

/// The uid, gid and pid of `conn`'s peer (SO_PEERCRED).
fn peer_cred(conn: &UnixStream) -> std::io::Result<Peer> {
    let mut c = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: c and len are valid for writes of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut c as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(Peer {
        pid: c.pid,
        uid: c.uid,
        gid: c.gid,
    })
}

/// The supplementary groups of `conn`'s peer (SO_PEERGROUPS, Linux 4.13 and later).
fn peer_groups(conn: &UnixStream) -> std::io::Result<Vec<u32>> {
    let mut groups = vec![0 as libc::gid_t; 256];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: groups holds len bytes, len is valid for writes.
        let r = unsafe {
            libc::getsockopt(
                conn.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if r == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) || n <= groups.len() {
            return Err(e);
        }
        groups.resize(n, 0);
    }
}

/// The gid of group `g`, a name or a number.
fn group_id(g: &str) -> Result<u32> {
    if let Ok(n) = g.parse::<u32>() {
        return Ok(n);
    }
    let Ok(name) = std::ffi::CString::new(g) else {
        bail!("admin group {g:?}: not a group name");
    };
    let mut buf = vec![0 as libc::c_char; 16 << 10];
    loop {
        // SAFETY: all-zero is a valid `group` (null pointers, zero ids).
        let mut grp: libc::group = unsafe { std::mem::zeroed() };
        let mut out: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the sizes given; out is set to &grp or null.
        let r = unsafe {
            libc::getgrnam_r(
                name.as_ptr(),
                &mut grp,
                buf.as_mut_ptr(),
                buf.len(),
                &mut out,
            )
        };
        if r == libc::ERANGE && buf.len() < 16 << 20 {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if r != 0 {
            bail!("admin group {g}: {}", std::io::Error::from_raw_os_error(r));
        }
        if out.is_null() {
            bail!("admin group {g}: no such group (give a group name or number from /etc/group)");
        }
        return Ok(grp.gr_gid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_server_s_own_uid_is_let_in_and_an_unknown_group_refused() {
        let (a, _b) = UnixStream::pair().unwrap();
        let access = AdminAccess::new(None).unwrap();
        let p = access.check(&a).unwrap();
        assert_eq!(p.uid, access.uid);
        assert!(AdminAccess::new(Some("no-such-group-sce")).is_err());
        assert_eq!(AdminAccess::new(Some("0")).unwrap().group.unwrap().1, 0);
        assert_eq!(AdminAccess::new(Some("root")).unwrap().group.unwrap().1, 0);
    }
}
