//! The NBD wire protocol (fixed newstyle): constants, and pure parsers and encoders for
//! option haggling and transmission. No I/O here, so the parsers can be fuzzed directly.
//! Numbers are big-endian on the wire.

/// "NBDMAGIC".
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// "IHAVEOPT": starts the newstyle handshake and every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of option replies.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of requests.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of simple replies.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flag: fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: no zero padding after NBD_OPT_EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: no zeroes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option: export name (old style of choosing the export).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: abort the handshake.
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS on the connection.
pub const OPT_STARTTLS: u32 = 5;
/// Option: information about an export.
pub const OPT_INFO: u32 = 6;
/// Option: choose an export and start transmission.
pub const OPT_GO: u32 = 7;
/// Option: structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list the metadata contexts of an export.
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select the metadata contexts for NBD_CMD_BLOCK_STATUS.
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply: acknowledged.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of a list.
pub const REP_SERVER: u32 = 2;
/// Option reply: information item.
pub const REP_INFO: u32 = 3;
/// Option reply: one metadata context (its id and name).
pub const REP_META_CONTEXT: u32 = 4;
/// Option reply error flag.
pub const REP_FLAG_ERROR: u32 = 1 << 31;
/// Option reply: unsupported option.
pub const REP_ERR_UNSUP: u32 = REP_FLAG_ERROR | 1;
/// Option reply: malformed option.
pub const REP_ERR_INVALID: u32 = REP_FLAG_ERROR | 3;
/// Option reply: refused by the server's policy.
pub const REP_ERR_POLICY: u32 = REP_FLAG_ERROR | 2;
/// Option reply: TLS must be started first.
pub const REP_ERR_TLS_REQD: u32 = REP_FLAG_ERROR | 5;
/// Option reply: unknown export.
pub const REP_ERR_UNKNOWN: u32 = REP_FLAG_ERROR | 6;
/// Option reply: server shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_FLAG_ERROR | 7;

/// Info item: size and transmission flags.
pub const INFO_EXPORT: u16 = 0;
/// Info item: export name.
pub const INFO_NAME: u16 = 1;
/// Info item: description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Info item: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: flags are valid.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: read-only export.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: FLUSH supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: FUA supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: TRIM supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: WRITE_ZEROES supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: several connections see one consistent export.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: CACHE supported.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write.
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim.
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status of a range in the selected metadata contexts.
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: do not punch a hole for WRITE_ZEROES.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: BLOCK_STATUS answers with one extent, no longer than the request.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;

/// Magic of structured reply chunks.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Structured reply flag: the last chunk of its reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Chunk type: no payload (a successful reply without data).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: data at an offset (a read's reply).
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: block status descriptors of one metadata context.
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Chunk type: an error, with a message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
/// Size of a structured reply chunk's header.
pub const CHUNK_HEADER_LEN: usize = 20;

/// The one metadata context served: which ranges are holes.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Its id in NBD_REP_META_CONTEXT and block status chunks.
pub const BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` flag: a hole (not allocated).
pub const STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: reads as zeroes.
pub const STATE_ZERO: u32 = 1 << 1;

/// Errno values allowed on the wire.
pub mod errno {
    /// Operation not permitted.
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument.
    pub const EINVAL: u32 = 22;
    /// No space (write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported.
    pub const ENOTSUP: u32 = 95;
    /// Server shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Smallest block size advertised.
pub const MIN_BLOCK: u32 = 512;
/// Preferred block size advertised.
pub const PREFERRED_BLOCK: u32 = 4096;
/// Largest request payload accepted: 32 MiB.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest option payload accepted.
pub const MAX_OPTION_LEN: u32 = 64 << 10;

/// A malformed message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The magic number is wrong.
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// The message is shorter than its own header says.
    #[error("truncated message: {0}")]
    Truncated(&'static str),
    /// A length field is out of bounds.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// What was too long.
        what: &'static str,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A string is not UTF-8 or contains NUL.
    #[error("invalid string in {0}")]
    BadString(&'static str),
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}
fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// The 16-byte header of a client option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// The option code.
    pub option: u32,
    /// Length of the data that follows.
    pub len: u32,
}

/// Parses an option header. Its length is checked against `MAX_OPTION_LEN`.
pub fn parse_option_header(b: &[u8; 16]) -> Result<OptionHeader, ProtoError> {
    let magic = be64(b);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic(magic));
    }
    let h = OptionHeader {
        option: be32(&b[8..]),
        len: be32(&b[12..]),
    };
    if h.len > MAX_OPTION_LEN {
        return Err(ProtoError::TooLong {
            what: "option data",
            len: h.len as u64,
            max: MAX_OPTION_LEN as u64,
        });
    }
    Ok(h)
}

/// The data of NBD_OPT_INFO and NBD_OPT_GO: an export name and the info items requested.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name ("" is the default export).
    pub name: String,
    /// Info items the client asks for.
    pub items: Vec<u16>,
}

fn parse_string(b: &[u8], what: &'static str) -> Result<String, ProtoError> {
    if b.len() > 4096 {
        return Err(ProtoError::TooLong {
            what,
            len: b.len() as u64,
            max: 4096,
        });
    }
    let s = std::str::from_utf8(b).map_err(|_| ProtoError::BadString(what))?;
    if s.contains('\0') {
        return Err(ProtoError::BadString(what));
    }
    Ok(s.to_string())
}

/// Parses the data of NBD_OPT_INFO / NBD_OPT_GO.
pub fn parse_info_request(d: &[u8]) -> Result<InfoRequest, ProtoError> {
    if d.len() < 4 {
        return Err(ProtoError::Truncated("info request name length"));
    }
    let n = be32(d) as usize;
    let rest = &d[4..];
    if rest.len() < n.saturating_add(2) {
        return Err(ProtoError::Truncated("info request name"));
    }
    let name = parse_string(&rest[..n], "export name")?;
    let count = be16(&rest[n..]) as usize;
    let items = &rest[n + 2..];
    if items.len() != count * 2 {
        return Err(ProtoError::Truncated("info request items"));
    }
    Ok(InfoRequest {
        name,
        items: items.chunks(2).map(be16).collect(),
    })
}

/// The data of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    /// Export name.
    pub name: String,
    /// The queries (`namespace:leaf`).
    pub queries: Vec<String>,
}

/// Parses the data of NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT.
pub fn parse_meta_context_request(d: &[u8]) -> Result<MetaContextRequest, ProtoError> {
    let (name, mut rest) = counted_string(d, "meta context export name")?;
    if rest.len() < 4 {
        return Err(ProtoError::Truncated("meta context query count"));
    }
    let count = be32(rest) as usize;
    rest = &rest[4..];
    // Each query takes at least its 4-byte length: a count beyond that is a lie.
    if count > rest.len() / 4 {
        return Err(ProtoError::Truncated("meta context queries"));
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let (q, r) = counted_string(rest, "meta context query")?;
        queries.push(q);
        rest = r;
    }
    if !rest.is_empty() {
        return Err(ProtoError::Truncated(
            "meta context request has trailing bytes",
        ));
    }
    Ok(MetaContextRequest { name, queries })
}

/// A string after its 32-bit length, and what follows it.
fn counted_string<'a>(d: &'a [u8], what: &'static str) -> Result<(String, &'a [u8]), ProtoError> {
    if d.len() < 4 {
        return Err(ProtoError::Truncated(what));
    }
    let n = be32(d) as usize;
    let rest = &d[4..];
    if rest.len() < n {
        return Err(ProtoError::Truncated(what));
    }
    Ok((parse_string(&rest[..n], what)?, &rest[n..]))
}

/// Data of an NBD_REP_META_CONTEXT reply.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut v = id.to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// Encodes a structured reply chunk's header.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; CHUNK_HEADER_LEN] {
    let mut b = [0u8; CHUNK_HEADER_LEN];
    b[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..].copy_from_slice(&len.to_be_bytes());
    b
}

/// Parses the data of NBD_OPT_EXPORT_NAME.
pub fn parse_export_name(d: &[u8]) -> Result<String, ProtoError> {
    parse_string(d, "export name")
}

/// Encodes an option reply.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(20 + data.len());
    v.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&reply.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// Data of an NBD_INFO_EXPORT reply.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = INFO_EXPORT.to_be_bytes().to_vec();
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

/// Data of an NBD_INFO_BLOCK_SIZE reply.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut v = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for x in [min, preferred, max] {
        v.extend_from_slice(&x.to_be_bytes());
    }
    v
}

/// Data of an NBD_INFO_NAME or NBD_INFO_DESCRIPTION reply.
pub fn info_string(item: u16, s: &str) -> Vec<u8> {
    let mut v = item.to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// Data of an NBD_REP_SERVER reply (one listed export).
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// A transmission request header (28 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub command: u16,
    /// Cookie (handle) echoed in the reply.
    pub cookie: u64,
    /// Offset.
    pub offset: u64,
    /// Length.
    pub len: u32,
}

/// Size of a request header.
pub const REQUEST_LEN: usize = 28;

/// Parses a request header. Semantic checks (range, flags, command) are the server's.
pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Result<Request, ProtoError> {
    let magic = be32(b);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic(magic as u64));
    }
    Ok(Request {
        flags: be16(&b[4..]),
        command: be16(&b[6..]),
        cookie: be64(&b[8..]),
        offset: be64(&b[16..]),
        len: be32(&b[24..]),
    })
}

/// Encodes a request header.
pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.command.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.len.to_be_bytes());
    b
}

/// Size of a simple reply header.
pub const REPLY_LEN: usize = 16;

/// Encodes a simple reply header.
pub fn simple_reply(error: u32, cookie: u64) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// Parses a simple reply header: (error, cookie).
pub fn parse_simple_reply(b: &[u8; REPLY_LEN]) -> Result<(u32, u64), ProtoError> {
    let magic = be32(b);
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(ProtoError::BadMagic(magic as u64));
    }
    Ok((be32(&b[4..]), be64(&b[8..])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip_and_bad_magic() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            command: CMD_WRITE,
            cookie: 0xdead_beef_0123,
            offset: 1 << 40,
            len: 4096,
        };
        assert_eq!(parse_request(&encode_request(&r)), Ok(r));
        let mut b = encode_request(&r);
        b[0] ^= 1;
        assert!(matches!(parse_request(&b), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn info_request_parsing() {
        let mut d = 3u32.to_be_bytes().to_vec();
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(
            parse_info_request(&d),
            Ok(InfoRequest {
                name: "abc".into(),
                items: vec![3, 1]
            })
        );
        assert!(parse_info_request(&d[..d.len() - 1]).is_err());
        assert!(parse_info_request(&[0, 0, 0, 200, 1]).is_err());
        assert!(parse_info_request(&[0xff, 0xff, 0xff, 0xff]).is_err());
        let mut nul = 1u32.to_be_bytes().to_vec();
        nul.extend_from_slice(&[0, 0, 0]);
        assert_eq!(
            parse_info_request(&nul),
            Err(ProtoError::BadString("export name"))
        );
    }

    fn counted(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    #[test]
    fn meta_context_request_parsing() {
        let mut d = counted("disk");
        d.extend_from_slice(&2u32.to_be_bytes());
        d.extend(counted(BASE_ALLOCATION));
        d.extend(counted("qemu:dirty-bitmap:x"));
        assert_eq!(
            parse_meta_context_request(&d),
            Ok(MetaContextRequest {
                name: "disk".into(),
                queries: vec![BASE_ALLOCATION.into(), "qemu:dirty-bitmap:x".into()]
            })
        );
        for cut in 0..d.len() {
            assert!(
                parse_meta_context_request(&d[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut extra = d.clone();
        extra.push(0);
        assert!(parse_meta_context_request(&extra).is_err());
        // A count of 4 billion queries in a few bytes is refused before any allocation.
        let mut huge = counted("");
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta_context_request(&huge).is_err());
    }

    #[test]
    fn chunk_header_layout() {
        let h = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 0x0102, 4104);
        assert_eq!(&h[..4], &STRUCTURED_REPLY_MAGIC.to_be_bytes());
        assert_eq!(&h[4..8], &[0, 1, 0, 1]);
        assert_eq!(&h[8..16], &0x0102u64.to_be_bytes());
        assert_eq!(&h[16..], &4104u32.to_be_bytes());
    }

    #[test]
    fn option_header_limits() {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        h[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        h[12..].copy_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
        assert!(matches!(
            parse_option_header(&h),
            Err(ProtoError::TooLong { .. })
        ));
        h[12..].copy_from_slice(&10u32.to_be_bytes());
        assert_eq!(
            parse_option_header(&h),
            Ok(OptionHeader {
                option: OPT_GO,
                len: 10
            })
        );
    }
}
