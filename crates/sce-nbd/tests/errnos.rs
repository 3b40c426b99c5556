//! A client is told what went wrong in the protocol's words: a device that failed gives
//! EIO (not EINVAL: the request was valid), no room ENOSPC, shutting down ESHUTDOWN, and a
//! bad request EINVAL. Each `IoError` kind's errno is chosen once (`IoError::errno`).

mod common;

use common::{request, try_go};
use sce_io::{BlockDevice, IoError, MemDevice, Op};
use sce_nbd::proto::{self, errno};
use sce_nbd::{listen, Export, ListenAddr, Server, ServerConfig};
use std::io::{Read, Write};
use std::sync::Arc;

/// A device whose writes fail, each 4 KiB page with its own kind of error.
struct Failing(MemDevice);

/// The error a write at `offset` meets, and the errno the client must get.
fn failure(offset: u64) -> (IoError, u32) {
    match offset / 4096 {
        0 => (
            IoError::Failed("the write-back journal could not be written".into()),
            errno::EIO,
        ),
        1 => (
            IoError::NoRoom("the cache is full of dirty data".into()),
            errno::ENOSPC,
        ),
        2 => (
            IoError::ShuttingDown("the cache is shutting down".into()),
            errno::ESHUTDOWN,
        ),
        3 => (
            IoError::Io {
                op: Op::Write,
                offset,
                len: 4096,
                source: std::io::Error::other("the only copy was lost"),
            },
            errno::EIO,
        ),
        _ => (IoError::Invalid("a bad argument".into()), errno::EINVAL),
    }
}

impl BlockDevice for Failing {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.0.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, _buf: &[u8]) -> Result<(), IoError> {
        Err(failure(offset).0)
    }
    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.0.discard(offset, len)
    }
}

#[test]
fn each_kind_of_failure_reaches_the_client_as_its_errno() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let server = Server::with_config(
        vec![Export {
            name: "vol".into(),
            description: String::new(),
            device: Arc::new(Failing(MemDevice::new(1 << 20))),
            read_only: false,
            prefetch: None,
            io: None,
        }],
        ServerConfig::default(),
    );
    let _listener = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let mut s = try_go(&sock).expect("handshake");
    for page in 0..5u64 {
        let offset = page * 4096;
        request(&mut s, proto::CMD_WRITE, page, offset, 4096);
        s.write_all(&[7u8; 4096]).unwrap();
        let mut r = [0u8; 16];
        s.read_exact(&mut r).unwrap();
        assert_eq!(r[..4], proto::SIMPLE_REPLY_MAGIC.to_be_bytes());
        let got = u32::from_be_bytes(r[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(r[8..16].try_into().unwrap());
        assert_eq!(cookie, page);
        let (e, want) = failure(offset);
        assert_eq!(got, want, "{e}: errno {got}, want {want}");
    }
}
