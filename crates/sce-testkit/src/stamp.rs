//! Self-describing test data: a block of `len` bytes whose every 16 bytes hold a 4-byte tag,
//! a version and the block's index, so that a read tells which version of which block it
//! got, a block of another place, or bytes nobody wrote (a tear). Version 0 is zeroes.

/// Version `version` of block `index`, `len` bytes (a multiple of 16), tagged `tag`.
pub fn stamped(len: usize, tag: &[u8; 4], index: u64, version: u32) -> Vec<u8> {
    let mut b = vec![0u8; len];
    if version == 0 {
        return b;
    }
    for c in b.chunks_mut(16) {
        c[..4].copy_from_slice(tag);
        c[4..8].copy_from_slice(&version.to_le_bytes());
        c[8..16].copy_from_slice(&index.to_le_bytes());
    }
    b
}

/// The version block `index`'s bytes `b` hold (0: zeroes), or None for bytes nobody wrote
/// there.
pub fn version_of(b: &[u8], tag: &[u8; 4], index: u64) -> Option<u32> {
    if b.iter().all(|&x| x == 0) {
        return Some(0);
    }
    let v = u32::from_le_bytes(b[4..8].try_into().ok()?);
    (v != 0 && b == stamped(b.len(), tag, index, v)).then_some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_reads_back_and_a_tear_or_another_block_does_not() {
        let b = stamped(512, b"TEST", 7, 3);
        assert_eq!(version_of(&b, b"TEST", 7), Some(3));
        assert_eq!(version_of(&b, b"TEST", 8), None);
        assert_eq!(version_of(&b, b"OTHR", 7), None);
        let mut torn = b.clone();
        torn[256..].copy_from_slice(&stamped(256, b"TEST", 7, 4));
        assert_eq!(version_of(&torn, b"TEST", 7), None);
        assert_eq!(version_of(&[0u8; 512], b"TEST", 7), Some(0));
    }
}
