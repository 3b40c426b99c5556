//! The client pipelines (issue #12): one connection carries many requests at once, up to the
//! queue depth and never more, and replies that come back out of order reach the right
//! callers.
//!
//! The device behind the server holds every read until a given number of reads are inside it
//! at the same time (a barrier). A client with one request in flight per connection can never
//! fill it, so these tests would hang; `within` turns a hang into a failure. No timing is
//! asserted.

use sce_io::{BlockDevice, IoError, MemDevice};
use sce_nbd::{listen, ClientOptions, Export, ListenAddr, NbdClient, NbdUri, Server};
use sce_testkit::within;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Barrier};

/// A memory device whose reads wait at a barrier of `need`, counting how many are inside.
struct Gate {
    mem: MemDevice,
    barrier: Barrier,
    inside: AtomicUsize,
    most: AtomicUsize,
}

impl BlockDevice for Gate {
    fn size(&self) -> u64 {
        self.mem.size()
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let n = self.inside.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(n, SeqCst);
        self.barrier.wait();
        let r = self.mem.read_at(offset, buf);
        self.inside.fetch_sub(1, SeqCst);
        r
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.mem.write_at(offset, buf)
    }
    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.mem.discard(offset, len)
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    gate: Arc<Gate>,
    client: Arc<NbdClient>,
    _server: Arc<Server>,
    _listener: sce_nbd::Listener,
}

/// A server of a gated device (barrier `need`) and a client with one connection of depth
/// `depth`. Each 4 KiB block `i` of the device holds the byte `i`.
fn setup(need: usize, depth: usize) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gate.sock");
    let mem = MemDevice::new(1 << 20);
    for i in 0..256u64 {
        mem.write_at(i * 4096, &[i as u8; 4096]).unwrap();
    }
    let gate = Arc::new(Gate {
        mem,
        barrier: Barrier::new(need),
        inside: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let server = Server::new(vec![Export {
        name: String::new(),
        description: String::new(),
        device: gate.clone(),
        read_only: false,
        prefetch: None,
        io: None,
    }]);
    let listener = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let uri = NbdUri::Unix {
        socket: sock,
        name: String::new(),
    };
    let opts = ClientOptions {
        queue_depth: depth,
        ..ClientOptions::default()
    };
    let client = Arc::new(NbdClient::connect_with(&uri, 1, opts).unwrap());
    Setup {
        _dir: dir,
        gate,
        client,
        _server: server,
        _listener: listener,
    }
}

/// `threads` callers each read `rounds` blocks (the barrier must divide the reads that can
/// be outstanding at once: with one round each, or a barrier of `threads`) (block `t + threads * r`) and check them.
fn read_all(c: &Arc<NbdClient>, threads: usize, rounds: usize) {
    let callers: Vec<_> = (0..threads)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for r in 0..rounds {
                    let block = (t + threads * r) % 256;
                    let mut b = vec![0u8; 4096];
                    c.read_at(block as u64 * 4096, &mut b).unwrap();
                    assert!(b.iter().all(|&x| x == block as u8), "block {block}");
                }
            })
        })
        .collect();
    for t in callers {
        t.join().unwrap();
    }
}

#[test]
fn one_connection_carries_many_requests_at_once() {
    let s = setup(8, 32);
    assert_eq!(s.client.open_connections(), 1);
    let c = s.client.clone();
    within("8 reads that only complete together", 120, move || {
        read_all(&c, 8, 4)
    });
    assert_eq!(s.client.open_connections(), 1);
    assert!(s.gate.most.load(SeqCst) >= 8);
}

#[test]
fn the_queue_depth_bounds_requests_in_flight() {
    let s = setup(4, 4);
    let c = s.client.clone();
    // One read each: every barrier generation then finds 4 callers with a read to make.
    within("16 callers through a queue of 4", 120, move || {
        read_all(&c, 16, 1)
    });
    let most = s.gate.most.load(SeqCst);
    assert_eq!(most, 4, "at most 4 reads in flight, and 4 were");
}
