//! Block sizes as the NBD spec has them (issue 27, item 10): NBD_INFO_BLOCK_SIZE goes only
//! to a client that asked for it; a client that did not keeps to the protocol's default
//! minimum of 1 byte, and its 1-byte reads and writes are served (not EINVAL); a client
//! that asked keeps to the minimum it was sent.

mod common;

use common::fixture_on;
use sce_io::Backend;
use sce_nbd::proto::{self, errno};
use sce_nbd::ServerConfig;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// A raw session after NBD_OPT_GO, asking for block sizes or not; with the info types and
/// the minimum block size the server sent.
fn go(sock: &Path, ask_block_sizes: bool) -> (UnixStream, Vec<u16>, Option<u32>) {
    let mut s = UnixStream::connect(sock).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut h = [0u8; 18];
    s.read_exact(&mut h).unwrap();
    s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    let mut d = 3u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"vol");
    if ask_block_sizes {
        d.extend_from_slice(&1u16.to_be_bytes());
        d.extend_from_slice(&proto::INFO_BLOCK_SIZE.to_be_bytes());
    } else {
        d.extend_from_slice(&0u16.to_be_bytes());
    }
    let mut o = proto::IHAVEOPT.to_be_bytes().to_vec();
    o.extend_from_slice(&proto::OPT_GO.to_be_bytes());
    o.extend_from_slice(&(d.len() as u32).to_be_bytes());
    o.extend_from_slice(&d);
    s.write_all(&o).unwrap();
    let (mut infos, mut min) = (Vec::new(), None);
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let reply = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let mut d = vec![0u8; u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize];
        s.read_exact(&mut d).unwrap();
        match reply {
            proto::REP_ACK => return (s, infos, min),
            proto::REP_INFO => {
                let t = u16::from_be_bytes([d[0], d[1]]);
                if t == proto::INFO_BLOCK_SIZE {
                    min = Some(u32::from_be_bytes(d[2..6].try_into().unwrap()));
                }
                infos.push(t);
            }
            r => panic!("GO refused: {r:#x}"),
        }
    }
}

/// Sends a request (with `data` for a write) and returns its reply's errno, reading `len`
/// bytes of data after a successful read.
fn ask(
    s: &mut UnixStream,
    cmd: u16,
    flags: u16,
    off: u64,
    len: u32,
    data: &[u8],
) -> (u32, Vec<u8>) {
    let h = proto::encode_request(&proto::Request {
        flags,
        command: cmd,
        cookie: off,
        offset: off,
        len,
    });
    s.write_all(&h).unwrap();
    s.write_all(data).unwrap();
    let mut r = [0u8; proto::REPLY_LEN];
    s.read_exact(&mut r).unwrap();
    let (e, cookie) = proto::parse_simple_reply(&r).unwrap();
    assert_eq!(cookie, off);
    let mut b = vec![
        0u8;
        if cmd == proto::CMD_READ && e == 0 {
            len as usize
        } else {
            0
        }
    ];
    s.read_exact(&mut b).unwrap();
    (e, b)
}

fn byte_granular(backend: Option<Backend>) {
    let f = fixture_on(ServerConfig::default(), backend);
    let (mut s, infos, min) = go(&f.sock, false);
    assert!(
        !infos.contains(&proto::INFO_BLOCK_SIZE),
        "block sizes sent to a client that did not ask: {infos:?}"
    );
    assert_eq!(min, None);
    let w = proto::CMD_WRITE;
    // Single bytes side by side in one block, a write across a block boundary, with FUA.
    assert_eq!(ask(&mut s, w, 0, 1, 1, &[0xa1]).0, 0);
    assert_eq!(ask(&mut s, w, 0, 2, 1, &[0xa2]).0, 0);
    assert_eq!(
        ask(&mut s, w, proto::CMD_FLAG_FUA, 510, 4, &[1, 2, 3, 4]).0,
        0
    );
    assert_eq!(ask(&mut s, proto::CMD_READ, 0, 1, 1, &[]), (0, vec![0xa1]));
    assert_eq!(
        ask(&mut s, proto::CMD_READ, 0, 0, 4, &[]),
        (0, vec![0, 0xa1, 0xa2, 0])
    );
    assert_eq!(
        ask(&mut s, proto::CMD_READ, 0, 509, 6, &[]),
        (0, vec![0, 1, 2, 3, 4, 0])
    );
    // Write-zeroes over part of it, a trim of less than a block: both succeed.
    let z = proto::CMD_WRITE_ZEROES;
    assert_eq!(ask(&mut s, z, proto::CMD_FLAG_NO_HOLE, 2, 509, &[]).0, 0);
    assert_eq!(
        ask(&mut s, proto::CMD_READ, 0, 0, 4, &[]),
        (0, vec![0, 0xa1, 0, 0])
    );
    assert_eq!(
        ask(&mut s, proto::CMD_READ, 0, 510, 3, &[]),
        (0, vec![0, 2, 3])
    );
    assert_eq!(ask(&mut s, proto::CMD_TRIM, 0, 4000, 10, &[]).0, 0);
    // What the byte-granular session wrote is what an aligned reader sees.
    let (mut sized, infos, min) = go(&f.sock, true);
    assert!(infos.contains(&proto::INFO_BLOCK_SIZE), "{infos:?}");
    let min = min.expect("a minimum block size") as u64;
    assert!(min >= 512, "{min}");
    let (e, b) = ask(&mut sized, proto::CMD_READ, 0, 0, 1024, &[]);
    assert_eq!(
        (e, &b[..4], &b[509..514]),
        (0, &[0, 0xa1, 0, 0][..], &[0, 0, 2, 3, 4][..])
    );
    // A client that was sent a minimum and breaks it gets EINVAL.
    assert_eq!(
        ask(&mut sized, proto::CMD_READ, 0, 1, 1, &[]).0,
        errno::EINVAL
    );
    assert_eq!(ask(&mut sized, w, 0, 1, 1, &[9]).0, errno::EINVAL);
    assert_eq!(ask(&mut s, proto::CMD_READ, 0, 1, 1, &[]), (0, vec![0xa1]));
}

#[test]
fn a_client_that_did_not_ask_for_block_sizes_reads_and_writes_single_bytes() {
    byte_granular(None);
}

#[test]
fn single_bytes_through_an_io_uring_export() {
    byte_granular(Some(Backend::IoUring));
}
