//! Block status of an NBD source: a connection of its own, opened on first need, that
//! negotiates structured replies and the `base:allocation` context and asks one
//! NBD_CMD_BLOCK_STATUS at a time. The data connections stay as they are (simple replies,
//! pipelined); block status is asked seldom (`qemu-img map`, `nbdinfo --map` through sce).

use crate::conn::{bad, go, greet, option_reply, send_option, Stream};
use crate::proto::{self, Request};
use crate::uri::NbdUri;
use sce_io::Extent;
use std::io;
use std::time::{Duration, Instant};

/// A connection that can ask block status.
pub(crate) struct StatusConn {
    s: Stream,
    context: u32,
    cookie: u64,
}

/// Opens a block-status connection to `uri`. `Ok(None)`: the server has no structured
/// replies or no `base:allocation` (it cannot tell holes from data).
pub(crate) fn connect(uri: &NbdUri, timeout: Duration) -> io::Result<Option<StatusConn>> {
    let deadline = Instant::now() + timeout;
    let (mut s, name) = greet(uri, deadline)?;
    send_option(&mut s, proto::OPT_STRUCTURED_REPLY, &[], deadline)?;
    if option_reply(&mut s, deadline)?.0 != proto::REP_ACK {
        return Ok(None);
    }
    let counted = |x: &str| {
        let mut v = (x.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(x.as_bytes());
        v
    };
    let mut d = counted(name);
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend(counted(proto::BASE_ALLOCATION));
    send_option(&mut s, proto::OPT_SET_META_CONTEXT, &d, deadline)?;
    let mut context = None;
    loop {
        let (reply, d) = option_reply(&mut s, deadline)?;
        match reply {
            proto::REP_META_CONTEXT if d.len() >= 4 => {
                if &d[4..] == proto::BASE_ALLOCATION.as_bytes() {
                    context = Some(u32::from_be_bytes([d[0], d[1], d[2], d[3]]));
                }
            }
            proto::REP_ACK => break,
            r if r & proto::REP_FLAG_ERROR != 0 => return Ok(None),
            _ => return Err(bad("unexpected reply to SET_META_CONTEXT")),
        }
    }
    let Some(context) = context else {
        return Ok(None);
    };
    go(&mut s, name, deadline)?;
    Ok(Some(StatusConn {
        s,
        context,
        cookie: 1,
    }))
}

impl StatusConn {
    /// The allocation of `[offset, offset + len)` (`len` at most `u32::MAX`): a nonempty
    /// prefix of it, cut at its end. A hole here is what reads as zeroes (HOLE and ZERO);
    /// anything else is data.
    pub(crate) fn extents(
        &mut self,
        offset: u64,
        len: u32,
        one: bool,
        deadline: Instant,
    ) -> io::Result<Vec<Extent>> {
        let cookie = self.cookie;
        self.cookie += 1;
        let req = proto::encode_request(&Request {
            flags: if one { proto::CMD_FLAG_REQ_ONE } else { 0 },
            command: proto::CMD_BLOCK_STATUS,
            cookie,
            offset,
            len,
        });
        self.s.write_by(&req, deadline)?;
        let mut out: Vec<Extent> = Vec::new();
        loop {
            let mut magic = [0u8; 4];
            self.s.read_by(&mut magic, deadline)?;
            if u32::from_be_bytes(magic) == proto::SIMPLE_REPLY_MAGIC {
                // Allowed for errors: the error and the cookie follow.
                let mut rest = [0u8; 12];
                self.s.read_by(&mut rest, deadline)?;
                let error = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
                return Err(bad(format!("block status refused (error {error})")));
            }
            if u32::from_be_bytes(magic) != proto::STRUCTURED_REPLY_MAGIC {
                return Err(bad("bad reply magic"));
            }
            let mut h = [0u8; proto::CHUNK_HEADER_LEN - 4];
            self.s.read_by(&mut h, deadline)?;
            let flags = u16::from_be_bytes([h[0], h[1]]);
            let kind = u16::from_be_bytes([h[2], h[3]]);
            let got = u64::from_be_bytes(h[4..12].try_into().expect("8 bytes"));
            let n = u32::from_be_bytes(h[12..16].try_into().expect("4 bytes"));
            if got != cookie || n > proto::MAX_PAYLOAD + 16 {
                return Err(bad("block status reply out of place"));
            }
            let mut d = vec![0u8; n as usize];
            self.s.read_by(&mut d, deadline)?;
            match kind {
                proto::REPLY_TYPE_BLOCK_STATUS => self.descriptors(&d, len as u64, &mut out)?,
                k if k & (1 << 15) != 0 => {
                    let e = d
                        .get(..4)
                        .map_or(0, |b| u32::from_be_bytes(b.try_into().unwrap()));
                    return Err(bad(format!("block status failed (error {e})")));
                }
                _ => {}
            }
            if flags & proto::REPLY_FLAG_DONE != 0 {
                break;
            }
        }
        if out.is_empty() {
            return Err(bad("block status reply without an extent"));
        }
        Ok(out)
    }

    /// Adds the descriptors of a block status chunk of our context, cut at `len`.
    fn descriptors(&self, d: &[u8], len: u64, out: &mut Vec<Extent>) -> io::Result<()> {
        if d.len() < 12 || !(d.len() - 4).is_multiple_of(8) {
            return Err(bad("malformed block status chunk"));
        }
        if u32::from_be_bytes(d[..4].try_into().expect("4 bytes")) != self.context {
            return Ok(());
        }
        let mut at: u64 = 0;
        for c in d[4..].chunks(8) {
            let l = u32::from_be_bytes(c[..4].try_into().expect("4 bytes")) as u64;
            let state = u32::from_be_bytes(c[4..].try_into().expect("4 bytes"));
            let l = l.min(len - at);
            if l == 0 {
                break;
            }
            let hole = state & proto::STATE_HOLE != 0 && state & proto::STATE_ZERO != 0;
            match out.last_mut() {
                Some(e) if e.hole == hole => e.len += l,
                _ => out.push(Extent { len: l, hole }),
            }
            at += l;
        }
        Ok(())
    }
}
