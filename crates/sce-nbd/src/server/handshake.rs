//! Option haggling: from the greeting to the export the client chose.

use super::*;

/// What the client negotiated besides its export.
#[derive(Debug, Default, Clone)]
pub(super) struct Negotiated {
    /// Structured replies (NBD_OPT_STRUCTURED_REPLY).
    pub(super) structured: bool,
    /// The export whose `base:allocation` context the last NBD_OPT_SET_META_CONTEXT
    /// selected, if it selected it.
    allocation_of: Option<String>,
    /// NBD_CMD_BLOCK_STATUS may be used: `base:allocation` was selected for the export
    /// that transmission started with.
    pub(super) block_status: bool,
    /// The client asked for block sizes (NBD_INFO_BLOCK_SIZE in its NBD_OPT_GO) and so
    /// keeps to the minimum sent; otherwise the protocol's default minimum of 1 byte holds
    /// and its requests are served byte-granular (`unaligned.rs`).
    pub(super) block_sizes: bool,
}

/// Where TLS stands on a connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct TlsPolicy {
    /// STARTTLS is accepted (a TLS listener).
    pub(super) offered: bool,
    /// Nothing but STARTTLS and ABORT is accepted before TLS.
    pub(super) required: bool,
    /// In TLS already, with the client's no-zeroes flag from before STARTTLS: haggling
    /// goes on, without a greeting.
    pub(super) active: Option<bool>,
}

/// How option haggling ended.
pub(super) enum Outcome {
    /// Transmission starts with this export.
    Go(Export, Negotiated),
    /// The client aborted.
    Abort,
    /// STARTTLS was acknowledged: the TLS handshake comes next. The client's no-zeroes
    /// flag, for after it.
    StartTls(bool),
}

/// What one option asks of the haggling loop.
enum Next {
    /// Read the next option.
    More,
    /// Transmission starts with this export.
    Go(Export),
    /// The client aborted.
    Abort,
}

impl Server {
    /// Option haggling: the greeting (unless TLS is `active`: haggling goes on after
    /// STARTTLS), then options until the client chooses an export, aborts or starts TLS.
    pub(super) fn handshake<S: Read + Write>(
        &self,
        c: &mut S,
        tls: TlsPolicy,
    ) -> Result<Outcome, ConnError> {
        let no_zeroes = match tls.active {
            Some(flag) => flag,
            None => greet(c)?,
        };
        let mut neg = Negotiated::default();
        loop {
            let mut h = [0u8; 16];
            c.read_exact(&mut h)?;
            let oh = proto::parse_option_header(&h)?;
            let mut data = vec![0u8; oh.len as usize];
            c.read_exact(&mut data)?;
            let opt = oh.option;
            if self.is_shutting_down() && opt != proto::OPT_ABORT {
                refuse(c, opt, proto::REP_ERR_SHUTDOWN, b"server is shutting down")?;
                continue;
            }
            if opt == proto::OPT_STARTTLS {
                if starttls(c, &data, tls)? {
                    return Ok(Outcome::StartTls(no_zeroes));
                }
                continue;
            }
            if tls.required && tls.active.is_none() && opt != proto::OPT_ABORT {
                if opt == proto::OPT_EXPORT_NAME {
                    // No error reply exists for it: close.
                    return Err(ConnError::Tls(
                        "the client skipped TLS, which is required".into(),
                    ));
                }
                refuse(
                    c,
                    opt,
                    proto::REP_ERR_TLS_REQD,
                    b"TLS is required: send STARTTLS",
                )?;
                continue;
            }
            let next = match opt {
                proto::OPT_EXPORT_NAME => self.export_name(c, &data, no_zeroes)?,
                proto::OPT_ABORT => {
                    let _ = c.write_all(&proto::option_reply(opt, proto::REP_ACK, &[]));
                    Next::Abort
                }
                proto::OPT_LIST => self.list(c, &data)?,
                proto::OPT_INFO | proto::OPT_GO => self.info(c, opt, &data, &mut neg)?,
                proto::OPT_STRUCTURED_REPLY => structured(c, &data, &mut neg)?,
                proto::OPT_LIST_META_CONTEXT | proto::OPT_SET_META_CONTEXT => {
                    self.meta_context(c, opt, &data, &mut neg)?
                }
                _ => {
                    refuse(c, opt, proto::REP_ERR_UNSUP, b"option not supported")?;
                    Next::More
                }
            };
            match next {
                Next::More => {}
                Next::Go(e) => {
                    neg.block_status =
                        neg.structured && neg.allocation_of.as_deref() == Some(e.name.as_str());
                    return Ok(Outcome::Go(e, neg));
                }
                Next::Abort => return Ok(Outcome::Abort),
            }
        }
    }

    /// NBD_OPT_EXPORT_NAME: the old way into transmission, with no error reply.
    fn export_name<S: Write>(
        &self,
        c: &mut S,
        data: &[u8],
        no_zeroes: bool,
    ) -> Result<Next, ConnError> {
        let name = proto::parse_export_name(data)?;
        let Some(e) = self.find(&name) else {
            // The protocol has no error reply here: the server closes.
            return Err(ConnError::UnknownExport(name));
        };
        let mut v = e.device.size().to_be_bytes().to_vec();
        v.extend_from_slice(&e.transmission_flags().to_be_bytes());
        if !no_zeroes {
            v.extend_from_slice(&[0u8; 124]);
        }
        c.write_all(&v)?;
        Ok(Next::Go(e.clone()))
    }

    /// NBD_OPT_LIST: every export's name.
    fn list<S: Write>(&self, c: &mut S, data: &[u8]) -> Result<Next, ConnError> {
        let opt = proto::OPT_LIST;
        if !data.is_empty() {
            refuse(c, opt, proto::REP_ERR_INVALID, b"LIST takes no data")?;
            return Ok(Next::More);
        }
        let mut out = Vec::new();
        for e in &self.exports {
            out.extend(proto::option_reply(
                opt,
                proto::REP_SERVER,
                &proto::rep_server(&e.name),
            ));
        }
        out.extend(proto::option_reply(opt, proto::REP_ACK, &[]));
        c.write_all(&out)?;
        Ok(Next::More)
    }

    /// NBD_OPT_INFO and NBD_OPT_GO: the export's size, flags, block sizes, and its name and
    /// description if asked; GO then starts transmission.
    ///
    /// NBD_INFO_BLOCK_SIZE goes only to a client that asked for it: one that did not keeps to
    /// the protocol's defaults (a minimum of 1 byte), which the server then serves.
    fn info<S: Write>(
        &self,
        c: &mut S,
        opt: u32,
        data: &[u8],
        neg: &mut Negotiated,
    ) -> Result<Next, ConnError> {
        let parsed = proto::parse_info_request(data);
        let Some((req, e)) = self.requested_export(c, opt, parsed, |r| &r.name)? else {
            return Ok(Next::More);
        };
        let info = |data: &[u8]| proto::option_reply(opt, proto::REP_INFO, data);
        let mut out = info(&proto::info_export(e.device.size(), e.transmission_flags()));
        let block_sizes = req.items.contains(&proto::INFO_BLOCK_SIZE);
        if block_sizes {
            let min = e.device.logical_block_size().max(proto::MIN_BLOCK);
            out.extend(info(&proto::info_block_size(
                min,
                proto::PREFERRED_BLOCK.max(min),
                proto::MAX_PAYLOAD,
            )));
        }
        if req.items.contains(&proto::INFO_NAME) {
            out.extend(info(&proto::info_string(proto::INFO_NAME, &e.name)));
        }
        if req.items.contains(&proto::INFO_DESCRIPTION) && !e.description.is_empty() {
            out.extend(info(&proto::info_string(
                proto::INFO_DESCRIPTION,
                &e.description,
            )));
        }
        out.extend(proto::option_reply(opt, proto::REP_ACK, &[]));
        c.write_all(&out)?;
        Ok(if opt == proto::OPT_GO {
            neg.block_sizes = block_sizes;
            Next::Go(e.clone())
        } else {
            Next::More
        })
    }
}

/// NBD_OPT_STARTTLS: true when acknowledged (the TLS handshake comes next); refused
/// without TLS credentials, once in TLS, or with data.
fn starttls<S: Write>(c: &mut S, data: &[u8], tls: TlsPolicy) -> Result<bool, ConnError> {
    let opt = proto::OPT_STARTTLS;
    let (code, msg): (u32, &[u8]) = if !tls.offered {
        (
            proto::REP_ERR_POLICY,
            b"TLS is not configured on this listener",
        )
    } else if tls.active.is_some() {
        (proto::REP_ERR_INVALID, b"TLS is already started")
    } else if !data.is_empty() {
        (proto::REP_ERR_INVALID, b"STARTTLS takes no data")
    } else {
        c.write_all(&proto::option_reply(opt, proto::REP_ACK, &[]))?;
        c.flush()?;
        return Ok(true);
    };
    refuse(c, opt, code, msg)?;
    Ok(false)
}

/// NBD_OPT_STRUCTURED_REPLY: takes no data; acknowledged (again, if asked again).
fn structured<S: Write>(c: &mut S, data: &[u8], neg: &mut Negotiated) -> Result<Next, ConnError> {
    let opt = proto::OPT_STRUCTURED_REPLY;
    if !data.is_empty() {
        refuse(
            c,
            opt,
            proto::REP_ERR_INVALID,
            b"STRUCTURED_REPLY takes no data",
        )?;
    } else {
        neg.structured = true;
        c.write_all(&proto::option_reply(opt, proto::REP_ACK, &[]))?;
    }
    Ok(Next::More)
}

impl Server {
    /// The export that a parsed NBD_OPT_INFO, GO or META_CONTEXT request names, with the
    /// request; None, after refusing the option, when the request did not parse or names no
    /// export.
    fn requested_export<'s, S: Write, R>(
        &'s self,
        c: &mut S,
        opt: u32,
        parsed: Result<R, ProtoError>,
        name: fn(&R) -> &str,
    ) -> Result<Option<(R, &'s Export)>, ConnError> {
        let req = match parsed {
            Ok(r) => r,
            Err(e) => {
                refuse(c, opt, proto::REP_ERR_INVALID, e.to_string().as_bytes())?;
                return Ok(None);
            }
        };
        let Some(e) = self.find(name(&req)) else {
            let msg = format!("no export named {:?}", name(&req));
            refuse(c, opt, proto::REP_ERR_UNKNOWN, msg.as_bytes())?;
            return Ok(None);
        };
        Ok(Some((req, e)))
    }

    /// NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT. The one context is
    /// `base:allocation`; `base:` lists it; queries of other namespaces are ignored. SET
    /// needs structured replies first and replaces the selection even when it fails.
    fn meta_context<S: Write>(
        &self,
        c: &mut S,
        opt: u32,
        data: &[u8],
        neg: &mut Negotiated,
    ) -> Result<Next, ConnError> {
        let set = opt == proto::OPT_SET_META_CONTEXT;
        if set {
            neg.allocation_of = None;
            if !neg.structured {
                let msg = b"SET_META_CONTEXT needs structured replies first";
                refuse(c, opt, proto::REP_ERR_INVALID, msg)?;
                return Ok(Next::More);
            }
        }
        let parsed = proto::parse_meta_context_request(data);
        let Some((req, e)) = self.requested_export(c, opt, parsed, |r| &r.name)? else {
            return Ok(Next::More);
        };
        let wanted = |q: &str| q == proto::BASE_ALLOCATION || (!set && q == "base:");
        let allocation = if set {
            req.queries.iter().any(|q| wanted(q))
        } else {
            req.queries.is_empty() || req.queries.iter().any(|q| wanted(q))
        };
        let mut out = Vec::new();
        if allocation {
            // Listed contexts carry id 0 (the protocol reserves it there).
            let id = if set { proto::BASE_ALLOCATION_ID } else { 0 };
            let name = proto::rep_meta_context(id, proto::BASE_ALLOCATION);
            out.extend(proto::option_reply(opt, proto::REP_META_CONTEXT, &name));
            if set {
                neg.allocation_of = Some(e.name.clone());
            }
        }
        out.extend(proto::option_reply(opt, proto::REP_ACK, &[]));
        c.write_all(&out)?;
        Ok(Next::More)
    }
}

/// Sends the greeting and reads the client's flags; returns whether the client asked for
/// no zeroes after NBD_OPT_EXPORT_NAME.
fn greet<S: Read + Write>(c: &mut S) -> Result<bool, ConnError> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&proto::NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(proto::FLAG_FIXED_NEWSTYLE | proto::FLAG_NO_ZEROES).to_be_bytes());
    c.write_all(&hello)?;
    let mut cf = [0u8; 4];
    c.read_exact(&mut cf)?;
    let client_flags = u32::from_be_bytes(cf);
    if client_flags & !(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES) != 0 {
        return Err(ProtoError::BadMagic(client_flags as u64).into());
    }
    Ok(client_flags & proto::FLAG_C_NO_ZEROES != 0)
}

/// An error reply to option `opt`.
fn refuse<S: Write>(c: &mut S, opt: u32, code: u32, msg: &[u8]) -> Result<(), ConnError> {
    c.write_all(&proto::option_reply(opt, code, msg))?;
    Ok(())
}
