//! sce's own compact binary trace format, which `sce trace convert` and `sce gen` write.
//!
//! Layout, all integers little-endian:
//! ```text
//! header, 32 bytes:
//!   0  magic    8 bytes  "SCETRACE"
//!   8  version  u16      1
//!  10  rec_size u16      32
//!  12  flags    u32      0 (reserved)
//!  16  records  u64      number of records, or u64::MAX if the writer could not say
//!  24  reserved 8 bytes  0
//! record, 32 bytes, `records` of them:
//!   0  time_ns  u64      nanoseconds since an arbitrary origin
//!   8  offset   u64      bytes
//!  16  len      u32      bytes
//!  20  volume   u32
//!  24  op       u8       0 = read, 1 = write
//!  25  reserved 7 bytes  0
//! ```
//! A reader rejects an unknown version or record size, a record whose reserved bytes are
//! not zero or whose op is unknown, a truncated record, and a file with fewer or more
//! records than the header says.

use crate::request::{IoKind, TraceRequest};

/// The magic bytes at the start of the file.
pub const MAGIC: &[u8; 8] = b"SCETRACE";
/// The format version this code reads and writes.
pub const VERSION: u16 = 1;
/// Size of the header in bytes.
pub const HEADER_SIZE: usize = 32;
/// Size of a record in bytes.
pub const RECORD_SIZE: usize = 32;
/// The record count of a header written by a writer that could not seek back.
pub const UNKNOWN_COUNT: u64 = u64::MAX;

/// Encodes the header.
pub fn encode_header(records: u64) -> [u8; HEADER_SIZE] {
    let mut h = [0u8; HEADER_SIZE];
    h[0..8].copy_from_slice(MAGIC);
    h[8..10].copy_from_slice(&VERSION.to_le_bytes());
    h[10..12].copy_from_slice(&(RECORD_SIZE as u16).to_le_bytes());
    h[16..24].copy_from_slice(&records.to_le_bytes());
    h
}

/// Decodes a header: the record count it announces (`UNKNOWN_COUNT` if none).
pub fn decode_header(h: &[u8; HEADER_SIZE]) -> Result<u64, String> {
    if &h[0..8] != MAGIC {
        return Err("not an sce trace (bad magic; is --format right?)".into());
    }
    let version = u16::from_le_bytes([h[8], h[9]]);
    if version != VERSION {
        return Err(format!(
            "sce trace version {version}, this build reads version {VERSION}"
        ));
    }
    let rs = u16::from_le_bytes([h[10], h[11]]);
    if rs as usize != RECORD_SIZE {
        return Err(format!(
            "record size {rs}, version {VERSION} has {RECORD_SIZE}"
        ));
    }
    Ok(u64::from_le_bytes(h[16..24].try_into().expect("8 bytes")))
}

/// Encodes a record. Errors if the length does not fit in 32 bits.
pub fn encode_record(r: &TraceRequest) -> Result<[u8; RECORD_SIZE], String> {
    let len = u32::try_from(r.len)
        .map_err(|_| format!("request length {} does not fit in 32 bits", r.len))?;
    let mut b = [0u8; RECORD_SIZE];
    b[0..8].copy_from_slice(&r.time_ns.to_le_bytes());
    b[8..16].copy_from_slice(&r.offset.to_le_bytes());
    b[16..20].copy_from_slice(&len.to_le_bytes());
    b[20..24].copy_from_slice(&r.volume.to_le_bytes());
    b[24] = match r.kind {
        IoKind::Read => 0,
        IoKind::Write => 1,
    };
    Ok(b)
}

/// Decodes a record.
pub fn decode_record(b: &[u8; RECORD_SIZE]) -> Result<TraceRequest, String> {
    let kind = match b[24] {
        0 => IoKind::Read,
        1 => IoKind::Write,
        x => return Err(format!("op {x} is neither 0 (read) nor 1 (write)")),
    };
    if b[25..].iter().any(|&x| x != 0) {
        return Err("reserved bytes are not zero".into());
    }
    Ok(TraceRequest {
        time_ns: u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
        offset: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        len: u32::from_le_bytes(b[16..20].try_into().expect("4 bytes")) as u64,
        volume: u32::from_le_bytes(b[20..24].try_into().expect("4 bytes")),
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_ones_are_rejected() {
        let r = TraceRequest {
            time_ns: 123_456_789_012,
            kind: IoKind::Write,
            volume: 7,
            offset: 1 << 40,
            len: 65536,
        };
        let mut b = encode_record(&r).unwrap();
        assert_eq!(decode_record(&b).unwrap(), r);
        b[24] = 2;
        assert!(decode_record(&b).unwrap_err().contains("op 2"));
        b[24] = 0;
        b[31] = 1;
        assert!(decode_record(&b).unwrap_err().contains("reserved"));
        assert!(encode_record(&TraceRequest { len: 1 << 32, ..r }).is_err());
        let mut h = encode_header(5);
        assert_eq!(decode_header(&h).unwrap(), 5);
        h[8] = 2;
        assert!(decode_header(&h).unwrap_err().contains("version 2"));
        h[0] = b'X';
        assert!(decode_header(&h).unwrap_err().contains("magic"));
    }
}
