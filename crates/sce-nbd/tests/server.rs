//! The NBD server and client against each other, against hostile input, and against real
//! clients (qemu-io, qemu-img, nbdinfo) when they are installed.

use sce_io::{
    conformance, open_queue, Backend, BlockDevice, DirectMode, FileDevice, FileOptions, MemDevice,
};
use sce_nbd::proto::{self, errno};
use sce_nbd::{listen, Export, ExportIo, ListenAddr, Listener, NbdClient, NbdUri, Server};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

struct Fixture {
    _dir: tempfile::TempDir,
    sock: PathBuf,
    server: Arc<Server>,
    _listener: Listener,
}

/// What the exports of a fixture are: memory devices run by the workers, or O_DIRECT
/// files with an I/O queue (reads, writes and flushes answered from the queue).
#[derive(Clone, Copy, Debug)]
enum Backing {
    Mem,
    File(Backend),
}

fn fixture(size: u64) -> Fixture {
    fixture_on(size, Backing::Mem)
}

fn device(dir: &Path, name: &str, size: u64, backing: Backing) -> Export {
    let (device, io): (Arc<dyn BlockDevice>, _) = match backing {
        Backing::Mem => (Arc::new(MemDevice::new(size)), None),
        Backing::File(backend) => {
            let opts = FileOptions {
                direct: DirectMode::Required,
                create_size: Some(size),
                ..Default::default()
            };
            let f = Arc::new(FileDevice::open(&dir.join(name), &opts).unwrap());
            let q = open_queue(f.clone(), backend, 64).unwrap();
            assert_eq!(q.backend(), backend, "this machine has io_uring");
            (f, Some(ExportIo::Queue(q)))
        }
    };
    Export {
        name: name.into(),
        description: String::new(),
        device,
        read_only: false,
        prefetch: None,
        io,
    }
}

fn fixture_on(size: u64, backing: Backing) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let mut vol = device(dir.path(), "vol", size, backing);
    vol.description = "test volume".into();
    let mut ro = device(dir.path(), "ro", 1 << 20, backing);
    ro.read_only = true;
    let server = Server::new(vec![vol, ro]);
    let listener = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    Fixture {
        _dir: dir,
        sock,
        server,
        _listener: listener,
    }
}

/// Requests answered through an I/O queue so far.
fn queued(f: &Fixture) -> u64 {
    f.server
        .stats()
        .queued_requests
        .load(std::sync::atomic::Ordering::Relaxed)
}

fn uri(f: &Fixture, name: &str) -> NbdUri {
    NbdUri::Unix {
        socket: f.sock.clone(),
        name: name.into(),
    }
}

#[test]
fn client_passes_the_conformance_suite_through_the_server() {
    conformance_through(Backing::Mem);
}

#[test]
fn io_uring_and_thread_queues_pass_the_conformance_suite_through_the_server() {
    for backend in [Backend::IoUring, Backend::Threads] {
        let f = conformance_through(Backing::File(backend));
        // One request at a time runs on the reader; requests in flight together go to
        // the queue.
        let inline = || f.server.stats().inline_requests.load(Relaxed);
        assert!(inline() > 100, "{backend}: {} ran inline", inline());
        let before = queued(&f);
        let c = Arc::new(NbdClient::connect(&uri(&f, "vol"), 1).unwrap());
        let readers: Vec<_> = (0..8u64)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    let mut b = vec![0u8; 4096];
                    for i in 0..200u64 {
                        c.read_at(((t * 200 + i) % 4096) * 4096, &mut b).unwrap();
                    }
                })
            })
            .collect();
        for r in readers {
            r.join().unwrap();
        }
        assert!(
            queued(&f) > before,
            "{backend}: pipelined reads went through the queue ({} then {})",
            before,
            queued(&f)
        );
    }
    let f = conformance_through(Backing::Mem);
    assert_eq!(queued(&f), 0);
    assert_eq!(f.server.stats().inline_requests.load(Relaxed), 0);
}

fn conformance_through(backing: Backing) -> Fixture {
    let f = fixture_on(16 << 20, backing);
    let c = NbdClient::connect(&uri(&f, "vol"), 4).unwrap();
    assert_eq!(c.size(), 16 << 20);
    assert!(c.flags() & proto::TFLAG_CAN_MULTI_CONN != 0);
    conformance::run_all(&c);
    assert!(
        f.server
            .stats()
            .requests
            .load(std::sync::atomic::Ordering::Relaxed)
            > 100
    );
    f
}

#[test]
fn cached_volume_served_over_nbd_passes_the_suite() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("c.sock");
    let src: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(32 << 20));
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 << 20));
    let vol = Arc::new(
        sce_engine::CacheVolume::open(src, cache, sce_engine::EngineConfig::default()).unwrap(),
    );
    let v2 = vol.clone();
    let server = Server::new(vec![Export {
        name: String::new(),
        description: "cached".into(),
        device: vol,
        read_only: false,
        prefetch: Some(Arc::new(move |o, l| v2.prefetch(o, l))),
        io: None,
    }]);
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let c = NbdClient::connect(
        &NbdUri::Unix {
            socket: sock,
            name: String::new(),
        },
        4,
    )
    .unwrap();
    conformance::run_all(&c);
}

/// A raw client for hostile tests.
struct Raw(UnixStream);

impl Raw {
    fn hello(sock: &PathBuf) -> Raw {
        let mut s = UnixStream::connect(sock).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut h = [0u8; 18];
        s.read_exact(&mut h).unwrap();
        assert_eq!(&h[..8], b"NBDMAGIC");
        assert_eq!(&h[8..16], b"IHAVEOPT");
        s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        Raw(s)
    }
    fn option(&mut self, opt: u32, data: &[u8]) {
        let mut v = proto::IHAVEOPT.to_be_bytes().to_vec();
        v.extend_from_slice(&opt.to_be_bytes());
        v.extend_from_slice(&(data.len() as u32).to_be_bytes());
        v.extend_from_slice(data);
        self.0.write_all(&v).unwrap();
    }
    fn option_reply(&mut self) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(h[..8], proto::OPT_REPLY_MAGIC.to_be_bytes());
        let reply = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        (reply, d)
    }
    fn go(sock: &PathBuf, name: &str) -> Raw {
        let mut r = Raw::hello(sock);
        r.go_on(name);
        r
    }
    /// NBD_OPT_GO after whatever options were sent.
    fn go_on(&mut self, name: &str) {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&0u16.to_be_bytes());
        self.option(proto::OPT_GO, &d);
        loop {
            let (rep, _) = self.option_reply();
            if rep == proto::REP_ACK {
                return;
            }
            assert_eq!(rep, proto::REP_INFO);
        }
    }
    /// Sends a LIST or SET_META_CONTEXT for `name`: the replies up to the final one.
    fn meta(&mut self, opt: u32, name: &str, queries: &[&str]) -> Vec<(u32, Vec<u8>)> {
        let counted = |s: &str| {
            let mut v = (s.len() as u32).to_be_bytes().to_vec();
            v.extend_from_slice(s.as_bytes());
            v
        };
        let mut d = counted(name);
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend(counted(q));
        }
        self.option(opt, &d);
        let mut out = Vec::new();
        loop {
            let (rep, d) = self.option_reply();
            let last = rep != proto::REP_META_CONTEXT;
            out.push((rep, d));
            if last {
                return out;
            }
        }
    }
    /// One structured reply chunk: (flags, type, cookie, payload).
    fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let mut h = [0u8; proto::CHUNK_HEADER_LEN];
        self.0.read_exact(&mut h).unwrap();
        assert_eq!(h[..4], proto::STRUCTURED_REPLY_MAGIC.to_be_bytes(), "{h:?}");
        let be16 = |b: &[u8]| u16::from_be_bytes([b[0], b[1]]);
        let len = u32::from_be_bytes(h[16..].try_into().unwrap());
        let mut d = vec![0u8; len as usize];
        self.0.read_exact(&mut d).unwrap();
        let cookie = u64::from_be_bytes(h[8..16].try_into().unwrap());
        (be16(&h[4..]), be16(&h[6..]), cookie, d)
    }
    fn request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        let h = proto::encode_request(&proto::Request {
            flags,
            command,
            cookie,
            offset,
            len,
        });
        self.0.write_all(&h).unwrap();
        self.0.write_all(data).unwrap();
    }
    fn reply(&mut self) -> (u32, u64) {
        let mut h = [0u8; proto::REPLY_LEN];
        self.0.read_exact(&mut h).unwrap();
        proto::parse_simple_reply(&h).unwrap()
    }
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

/// A healthy second connection must be served whatever happened on the others.
fn still_serving(f: &Fixture) {
    let c = NbdClient::connect(&uri(f, "vol"), 1).expect("server still accepts");
    c.write_at(4096, &[7u8; 4096]).unwrap();
    let mut b = [0u8; 4096];
    c.read_at(4096, &mut b).unwrap();
    assert_eq!(b, [7u8; 4096]);
}

#[test]
fn hostile_handshakes_end_only_their_connection() {
    let f = fixture(8 << 20);
    let keep = NbdClient::connect(&uri(&f, "vol"), 1).unwrap();
    // Wrong client flags.
    let mut s = UnixStream::connect(&f.sock).unwrap();
    let mut h = [0u8; 18];
    s.read_exact(&mut h).unwrap();
    s.write_all(&[0xff, 0xff, 0xff, 0xff]).unwrap();
    assert!(Raw(s).closed());
    still_serving(&f);
    // Wrong option magic.
    let mut r = Raw::hello(&f.sock);
    r.0.write_all(&[0u8; 16]).unwrap();
    assert!(r.closed());
    // Truncated handshake: the client goes away mid-option.
    let mut r = Raw::hello(&f.sock);
    r.0.write_all(&proto::IHAVEOPT.to_be_bytes()[..5]).unwrap();
    drop(r);
    still_serving(&f);
    // Unknown option: ERR_UNSUP and the haggling goes on; unknown export: ERR_UNKNOWN.
    let mut r = Raw::hello(&f.sock);
    r.option(0xdead, b"junk");
    assert_eq!(r.option_reply().0, proto::REP_ERR_UNSUP);
    r.option(proto::OPT_STRUCTURED_REPLY, b"junk");
    assert_eq!(r.option_reply().0, proto::REP_ERR_INVALID);
    let mut d = 4u32.to_be_bytes().to_vec();
    d.extend_from_slice(b"nope");
    d.extend_from_slice(&0u16.to_be_bytes());
    r.option(proto::OPT_INFO, &d);
    assert_eq!(r.option_reply().0, proto::REP_ERR_UNKNOWN);
    r.option(proto::OPT_INFO, &[0, 0, 0]);
    assert_eq!(r.option_reply().0, proto::REP_ERR_INVALID);
    // LIST shows both exports.
    r.option(proto::OPT_LIST, &[]);
    let mut names = Vec::new();
    loop {
        let (rep, d) = r.option_reply();
        if rep == proto::REP_ACK {
            break;
        }
        assert_eq!(rep, proto::REP_SERVER);
        names.push(String::from_utf8(d[4..].to_vec()).unwrap());
    }
    assert_eq!(names, ["vol", "ro"]);
    r.option(proto::OPT_ABORT, &[]);
    assert_eq!(r.option_reply().0, proto::REP_ACK);
    still_serving(&f);
    let mut b = [0u8; 512];
    keep.read_at(0, &mut b)
        .expect("the first connection was never disturbed");
}

#[test]
fn hostile_requests_get_the_specified_errors() {
    hostile_requests(Backing::Mem);
}

#[test]
fn hostile_requests_get_the_specified_errors_from_io_uring() {
    let f = hostile_requests(Backing::File(Backend::IoUring));
    // The pipelined write and flush at least went through the queue.
    assert!(queued(&f) >= 1, "{}", queued(&f));
}

fn hostile_requests(backing: Backing) -> Fixture {
    let f = fixture_on(8 << 20, backing);
    let size = 8u64 << 20;
    let mut r = Raw::go(&f.sock, "vol");
    // Past the end: EINVAL for reads, ENOSPC for writes.
    r.request(proto::CMD_READ, 0, 1, size - 512, 1024, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 1));
    r.request(proto::CMD_WRITE, 0, 2, size, 512, &[0u8; 512]);
    assert_eq!(r.reply(), (errno::ENOSPC, 2));
    r.request(proto::CMD_READ, 0, 3, u64::MAX - 100, 512, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 3));
    // 33 MiB: refused, and the connection goes on.
    r.request(proto::CMD_READ, 0, 4, 0, 33 << 20, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 4));
    r.request(proto::CMD_WRITE, 0, 5, 0, 33 << 20, &vec![1u8; 33 << 20]);
    assert_eq!(r.reply(), (errno::EINVAL, 5));
    // Unknown command and unknown flag.
    r.request(42, 0, 6, 0, 512, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 6));
    r.request(proto::CMD_READ, 0x80, 7, 0, 512, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 7));
    // Unaligned, from a client that did not ask for block sizes: served (byte_granular.rs).
    r.request(proto::CMD_READ, 0, 8, 100, 512, &[]);
    assert_eq!(r.reply(), (0, 8));
    r.0.read_exact(&mut [0u8; 512]).unwrap();
    // Still a working connection: pipelined requests (one send, as a pipelining client's:
    // the write has the flush behind it, so neither runs alone on the reader), replies
    // matched by cookie.
    let mut both = Vec::new();
    for (command, flags, cookie, len) in [
        (proto::CMD_WRITE, proto::CMD_FLAG_FUA, 9u64, 4096u32),
        (proto::CMD_FLUSH, 0, 10, 0),
    ] {
        both.extend_from_slice(&proto::encode_request(&proto::Request {
            flags,
            command,
            cookie,
            offset: 0,
            len,
        }));
        both.extend(std::iter::repeat_n(9u8, len as usize));
    }
    r.0.write_all(&both).unwrap();
    let mut got = vec![r.reply(), r.reply()];
    got.sort();
    assert_eq!(got, vec![(0, 9), (0, 10)]);
    r.request(
        proto::CMD_WRITE_ZEROES,
        proto::CMD_FLAG_NO_HOLE,
        11,
        0,
        1024,
        &[],
    );
    assert_eq!(r.reply(), (0, 11));
    r.request(proto::CMD_TRIM, 0, 12, 4096, 4096, &[]);
    assert_eq!(r.reply(), (0, 12));
    r.request(proto::CMD_CACHE, 0, 13, 0, 65536, &[]);
    assert_eq!(r.reply(), (0, 13));
    r.request(proto::CMD_READ, 0, 14, 0, 2048, &[]);
    assert_eq!(r.reply(), (0, 14));
    let mut b = vec![0u8; 2048];
    r.0.read_exact(&mut b).unwrap();
    assert!(b[..1024].iter().all(|&x| x == 0) && b[1024..].iter().all(|&x| x == 9));
    // Read-only export: EPERM for writes, trims and write-zeroes.
    let mut ro = Raw::go(&f.sock, "ro");
    ro.request(proto::CMD_WRITE, 0, 1, 0, 512, &[0u8; 512]);
    assert_eq!(ro.reply(), (errno::EPERM, 1));
    ro.request(proto::CMD_TRIM, 0, 2, 0, 512, &[]);
    assert_eq!(ro.reply(), (errno::EPERM, 2));
    ro.request(proto::CMD_WRITE_ZEROES, 0, 3, 0, 512, &[]);
    assert_eq!(ro.reply(), (errno::EPERM, 3));
    // A bad request magic ends that connection.
    r.0.write_all(&[0u8; proto::REQUEST_LEN]).unwrap();
    assert!(r.closed());
    // A connection dropped in the middle of a write payload.
    let mut d = Raw::go(&f.sock, "vol");
    d.request(proto::CMD_WRITE, 0, 1, 0, 65536, &[1u8; 1000]);
    drop(d);
    // DISC: outstanding requests answered, then the server closes.
    let mut g = Raw::go(&f.sock, "vol");
    g.request(proto::CMD_READ, 0, 1, 0, 512, &[]);
    g.request(proto::CMD_DISC, 0, 2, 0, 0, &[]);
    assert_eq!(g.reply(), (0, 1));
    let mut b = [0u8; 512];
    g.0.read_exact(&mut b).unwrap();
    assert!(g.closed());
    still_serving(&f);
    f
}

#[test]
fn shutdown_answers_then_refuses() {
    let f = fixture(8 << 20);
    let mut r = Raw::go(&f.sock, "vol");
    r.request(proto::CMD_READ, 0, 1, 0, 512, &[]);
    assert_eq!(r.reply(), (0, 1));
    let mut b = [0u8; 512];
    r.0.read_exact(&mut b).unwrap();
    f.server.shutdown();
    assert!(r.closed(), "connections are closed on shutdown");
    let mut h = Raw::hello(&f.sock);
    h.option(proto::OPT_LIST, &[]);
    assert_eq!(h.option_reply().0, proto::REP_ERR_SHUTDOWN);
    f.server.flush_all().unwrap();
}

/// True if the client `name` is installed. Missing: the test skips, saying so, or fails
/// under `CI=true` naming the Debian package (see `sce_testkit`).
fn tool(name: &str) -> bool {
    sce_testkit::require_known_tool(name)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let s =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{s}");
    s
}

#[test]
fn qemu_io_writes_and_reads_patterns() {
    qemu_io_patterns(Backing::Mem);
}

#[test]
fn qemu_io_writes_and_reads_patterns_through_io_uring() {
    qemu_io_patterns(Backing::File(Backend::IoUring));
}

fn qemu_io_patterns(backing: Backing) {
    if !tool("qemu-io") {
        return;
    }
    let f = fixture_on(64 << 20, backing);
    let u = format!("nbd+unix:///vol?socket={}", f.sock.display());
    let out = run(Command::new("qemu-io").args(["-f", "raw", &u]).args([
        "-c",
        "write -P 0xab 0 1M",
        "-c",
        "write -P 0xcd 3M 64k",
        "-c",
        "write -z 1M 64k",
        "-c",
        "discard 2M 64k",
        "-c",
        "flush",
        "-c",
        "read -P 0xab 0 1M",
        "-c",
        "read -P 0xcd 3M 64k",
        "-c",
        "read -P 0 1M 64k",
    ]));
    assert!(!out.contains("Pattern verification failed"), "{out}");
    // A failed pattern must be noticed by this test: check one that is wrong.
    let bad = Command::new("qemu-io")
        .args(["-f", "raw", &u, "-c", "read -P 0x11 0 4k"])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&bad.stdout).to_string() + &String::from_utf8_lossy(&bad.stderr);
    assert!(text.contains("Pattern verification failed"), "{text}");
}

#[test]
fn qemu_img_and_nbdinfo_see_the_exports() {
    if !tool("qemu-img") {
        return;
    }
    let f = fixture(64 << 20);
    let u = format!("nbd+unix:///vol?socket={}", f.sock.display());
    let info = run(Command::new("qemu-img").args(["info", "-f", "raw", &u]));
    assert!(
        info.contains("64 MiB") || info.contains("67108864"),
        "{info}"
    );
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("in.raw");
    let data: Vec<u8> = (0..(64u32 << 20)).map(|i| (i / 4096) as u8).collect();
    std::fs::write(&img, &data).unwrap();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&img)
        .arg(&u));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&img)
        .arg(&u));
    let back = dir.path().join("out.raw");
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &u])
        .arg(&back));
    assert!(std::fs::read(&back).unwrap() == data);
    if tool("nbdinfo") {
        let list = run(Command::new("nbdinfo")
            .arg("--list")
            .arg(format!("nbd+unix://?socket={}", f.sock.display())));
        assert!(list.contains("vol") && list.contains("ro"), "{list}");
        let one = run(Command::new("nbdinfo").arg(&u));
        for want in [
            "67108864",
            "block_size_minimum: 512",
            "block_size_preferred: 4096",
            "block_size_maximum: 33554432",
            "can_multi_conn: true",
            "can_cache: true",
        ] {
            assert!(one.contains(want), "nbdinfo lacks {want}:\n{one}");
        }
        let ro =
            run(Command::new("nbdinfo").arg(format!("nbd+unix:///ro?socket={}", f.sock.display())));
        assert!(ro.contains("is_read_only: true"), "{ro}");
    }
}

#[test]
fn tcp_listener_and_nbd_uri() {
    let dev: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 << 20));
    let server = Server::new(vec![Export {
        name: "t".into(),
        description: String::new(),
        device: dev,
        read_only: false,
        prefetch: None,
        io: None,
    }]);
    let l = listen(&server, &ListenAddr::Tcp("127.0.0.1:0".into())).unwrap();
    let addr = l.local.strip_prefix("tcp:").unwrap().to_string();
    let u: NbdUri = format!("nbd://{addr}/t").parse().unwrap();
    let c = NbdClient::connect(&u, 2).unwrap();
    conformance::run_all(&c);
}

/// Requests still queued when shutdown starts get ESHUTDOWN; none is left unanswered.
#[test]
fn queued_requests_get_eshutdown() {
    use sce_io::{LatencyConfig, LatencyDevice};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("slow.sock");
    let slow: Arc<dyn BlockDevice> = Arc::new(LatencyDevice::new(
        MemDevice::new(8 << 20),
        LatencyConfig::disk(std::time::Duration::from_millis(20), 1),
    ));
    let server = Server::new(vec![Export {
        name: String::new(),
        description: String::new(),
        device: slow,
        read_only: false,
        prefetch: None,
        io: None,
    }]);
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let mut r = Raw::go(&sock, "");
    // More reads than the connection has workers, on a device that serves one at a time,
    // 20 ms each: when shutdown starts, most are still queued.
    const N: u64 = 80;
    for cookie in 0..N {
        r.request(proto::CMD_READ, 0, cookie, 0, 512, &[]);
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    server.shutdown();
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..N {
        let (err, cookie) = r.reply();
        if err == 0 {
            let mut b = [0u8; 512];
            r.0.read_exact(&mut b).unwrap();
        }
        seen.insert(cookie, err);
    }
    assert_eq!(seen.len(), N as usize, "every request answered once");
    assert!(seen.values().any(|&e| e == 0), "the ones running finished");
    assert!(
        seen.values().any(|&e| e == errno::ESHUTDOWN),
        "the queued ones got ESHUTDOWN: {seen:?}"
    );
    assert!(seen.values().all(|&e| e == 0 || e == errno::ESHUTDOWN));
    assert!(r.closed());
}

/// Requests that arrive together (one send, as a pipelining client's do) are parsed from
/// one receive buffer and submitted to the I/O queue together; a write payload larger than
/// that buffer, and a header cut across two sends, arrive whole.
#[test]
fn pipelined_requests_sent_at_once_are_all_answered_through_io_uring() {
    let f = fixture_on(8 << 20, Backing::File(Backend::IoUring));
    let mut r = Raw::go(&f.sock, "vol");
    let enc = |command, cookie, offset, len| {
        proto::encode_request(&proto::Request {
            flags: 0,
            command,
            cookie,
            offset,
            len,
        })
    };
    // One send: a 200 KiB write, then 64 reads elsewhere.
    let payload: Vec<u8> = (0..200 << 10).map(|i| (i % 251) as u8).collect();
    let mut wire = enc(proto::CMD_WRITE, 1000, 1 << 20, payload.len() as u32).to_vec();
    wire.extend_from_slice(&payload);
    for i in 0..64u64 {
        wire.extend_from_slice(&enc(proto::CMD_READ, i, (4 << 20) + i * 4096, 4096));
    }
    r.0.write_all(&wire).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..65 {
        let (err, cookie) = r.reply();
        assert_eq!(err, 0, "cookie {cookie}");
        if cookie != 1000 {
            let mut b = vec![0u8; 4096];
            r.0.read_exact(&mut b).unwrap();
            assert!(b.iter().all(|&x| x == 0));
        }
        assert!(seen.insert(cookie), "cookie {cookie} answered twice");
    }
    assert_eq!(seen.len(), 65);
    // The write is acknowledged: 50 reads of it in one send, the last header split in two.
    let mut wire = Vec::new();
    for i in 0..50u64 {
        wire.extend_from_slice(&enc(proto::CMD_READ, 2000 + i, (1 << 20) + i * 4096, 4096));
    }
    let cut = wire.len() - 10;
    r.0.write_all(&wire[..cut]).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    r.0.write_all(&wire[cut..]).unwrap();
    for _ in 0..50 {
        let (err, cookie) = r.reply();
        assert_eq!(err, 0);
        let i = (cookie - 2000) as usize;
        let mut b = vec![0u8; 4096];
        r.0.read_exact(&mut b).unwrap();
        assert!(b == payload[i * 4096..(i + 1) * 4096], "read {i} differs");
    }
    assert!(queued(&f) >= 100, "{}", queued(&f));
    still_serving(&f);
}

/// A device that serves the reads of its first half from a queue, as a cached volume
/// serves its hits: those are started by the reader and answered from the completion;
/// the rest, and every write, go to the workers.
struct HalfQueued {
    size: u64,
    queue: Arc<dyn sce_io::IoQueue>,
}

impl sce_io::QueuedReads for HalfQueued {
    fn start_read(&self, offset: u64, len: u64) -> Option<sce_io::StartedRead> {
        if offset + len > self.size / 2 {
            return None;
        }
        Some(Box::new(move |buf, done| {
            (sce_io::IoOp::Read { offset, buf }, done)
        }))
    }
    fn queue(&self) -> Option<Arc<dyn sce_io::IoQueue>> {
        Some(self.queue.clone())
    }
}

#[test]
fn reads_a_device_can_start_are_answered_from_its_queue_and_the_rest_by_workers() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let size = 8u64 << 20;
    let dev = Arc::new(MemDevice::new(size));
    let queue: Arc<dyn sce_io::IoQueue> = Arc::new(sce_io::ThreadQueue::new(dev.clone(), 4));
    let server = Server::new(vec![Export {
        name: "vol".into(),
        description: String::new(),
        device: dev.clone(),
        read_only: false,
        prefetch: None,
        io: Some(ExportIo::Reads(Arc::new(HalfQueued { size, queue }))),
    }]);
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let c = NbdClient::connect(
        &NbdUri::Unix {
            socket: sock,
            name: "vol".into(),
        },
        2,
    )
    .unwrap();
    // Writes (workers) over both halves, then reads of every block: the first half's from
    // the queue, the second half's from the workers.
    let blocks = size / 65536;
    for b in 0..blocks {
        c.write_at(b * 65536, &[b as u8; 65536]).unwrap();
    }
    // Started reads: submitted to the queue, or run on the reader when alone in flight.
    let n = || {
        let st = server.stats();
        st.queued_requests.load(Relaxed) + st.inline_requests.load(Relaxed)
    };
    assert_eq!(n(), 0, "writes never go to the reads' queue");
    let mut buf = vec![0u8; 65536];
    for b in 0..blocks {
        c.read_at(b * 65536, &mut buf).unwrap();
        assert!(buf.iter().all(|&x| x == b as u8), "block {b}");
    }
    assert_eq!(n(), blocks / 2, "the first half's reads, and only they");
    // Out of range is refused before the device is asked.
    let mut r = Raw::go(&dir.path().join("nbd.sock"), "vol");
    r.request(proto::CMD_READ, 0, 1, size - 512, 1024, &[]);
    assert_eq!(r.reply(), (errno::EINVAL, 1));
    assert_eq!(n(), blocks / 2);
    conformance::run_all(&c);
}

/// A device whose writes and flushes the local device alone serves, or not (`local`), as
/// a cached volume's in write-back through the log.
struct LocalWrites {
    local: bool,
}

impl sce_io::QueuedReads for LocalWrites {
    fn start_read(&self, _offset: u64, _len: u64) -> Option<sce_io::StartedRead> {
        None
    }
    fn queue(&self) -> Option<Arc<dyn sce_io::IoQueue>> {
        None
    }
    fn runs_locally(&self, op: sce_io::Op, _offset: u64, _len: u64) -> bool {
        self.local && matches!(op, sce_io::Op::Write | sce_io::Op::Flush)
    }
}

/// Writes and flushes alone in flight run on the reader when the device serves them
/// locally, and go to the workers when it does not, or when requests are pipelined.
#[test]
fn writes_and_flushes_a_device_serves_locally_run_on_the_reader_when_alone() {
    for local in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let dev = Arc::new(MemDevice::new(8 << 20));
        let server = Server::new(vec![Export {
            name: "vol".into(),
            description: String::new(),
            device: dev.clone(),
            read_only: false,
            prefetch: None,
            io: Some(ExportIo::Reads(Arc::new(LocalWrites { local }))),
        }]);
        let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
        let inline = || server.stats().inline_requests.load(Relaxed);
        let mut r = Raw::go(&sock, "vol");
        r.request(proto::CMD_WRITE, 0, 1, 4096, 4096, &[5u8; 4096]);
        assert_eq!(r.reply(), (0, 1));
        r.request(proto::CMD_FLUSH, 0, 2, 0, 0, &[]);
        assert_eq!(r.reply(), (0, 2));
        // A read the device cannot start goes to the workers either way.
        r.request(proto::CMD_READ, 0, 3, 4096, 4096, &[]);
        assert_eq!(r.reply(), (0, 3));
        let mut data = vec![0u8; 4096];
        r.0.read_exact(&mut data).unwrap();
        assert!(data.iter().all(|&b| b == 5));
        let want = if local { 2 } else { 0 };
        assert_eq!(
            inline(),
            want,
            "local {local}: a write and a flush alone in flight"
        );
        // Two writes sent at once: the first has the second behind it, so a worker runs it.
        let mut two = Vec::new();
        for (cookie, at) in [(4u64, 8192u64), (5, 12288)] {
            two.extend_from_slice(&proto::encode_request(&proto::Request {
                flags: 0,
                command: proto::CMD_WRITE,
                cookie,
                offset: at,
                len: 4096,
            }));
            two.extend_from_slice(&[cookie as u8; 4096]);
        }
        r.0.write_all(&two).unwrap();
        let mut cookies = [r.reply(), r.reply()].map(|(e, c)| {
            assert_eq!(e, 0);
            c
        });
        cookies.sort_unstable();
        assert_eq!(cookies, [4, 5]);
        assert!(
            inline() <= want + 1,
            "local {local}: {} ran inline",
            inline()
        );
        let mut b = vec![0u8; 4096];
        dev.read_at(8192, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 4));
        dev.read_at(12288, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 5));
    }
}

/// A device that starts its writes without blocking, through a queue on itself, unless
/// they touch its last MiB, which the workers write (as a cached volume's log writes that
/// must wait).
struct StartsWrites {
    queue: Arc<dyn sce_io::IoQueue>,
    started: std::sync::atomic::AtomicU64,
}

impl sce_io::QueuedReads for StartsWrites {
    fn start_read(&self, _offset: u64, _len: u64) -> Option<sce_io::StartedRead> {
        None
    }
    fn queue(&self) -> Option<Arc<dyn sce_io::IoQueue>> {
        None
    }
    fn start_write(
        &self,
        offset: u64,
        len: u64,
    ) -> Option<(sce_io::StartedWrite, Arc<dyn sce_io::IoQueue>)> {
        if offset + len > 7 << 20 {
            return None;
        }
        self.started.fetch_add(1, Relaxed);
        let start: sce_io::StartedWrite =
            Box::new(move |buf, done| (sce_io::IoOp::Write { offset, buf }, done));
        Some((start, self.queue.clone()))
    }
}

/// Writes a device can start go to the queue it names and are answered from their
/// completion; FUA writes, and those it does not start, go to the workers.
#[test]
fn writes_a_device_starts_are_answered_from_its_queue_and_fua_by_workers() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let dev = Arc::new(MemDevice::new(8 << 20));
    let queue: Arc<dyn sce_io::IoQueue> = Arc::new(sce_io::ThreadQueue::new(dev.clone(), 2));
    let starts = Arc::new(StartsWrites {
        queue,
        started: Default::default(),
    });
    let export = Export {
        name: "vol".into(),
        description: String::new(),
        device: dev.clone(),
        read_only: false,
        prefetch: None,
        io: Some(ExportIo::Reads(starts.clone())),
    };
    // Nothing runs on the reader: every write is started or handed over.
    let cfg = sce_nbd::ServerConfig {
        inline_when_idle: false,
        ..Default::default()
    };
    let server = Server::with_config(vec![export], cfg);
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let queued = || server.stats().queued_requests.load(Relaxed);
    let mut r = Raw::go(&sock, "vol");
    let mut all = Vec::new();
    for (cookie, at, flags) in [
        (1u64, 0u64, 0u16),
        (2, 4096, 0),
        (3, 8192, proto::CMD_FLAG_FUA),
        (4, 7 << 20, 0),
    ] {
        all.extend_from_slice(&proto::encode_request(&proto::Request {
            flags,
            command: proto::CMD_WRITE,
            cookie,
            offset: at,
            len: 4096,
        }));
        all.extend_from_slice(&[cookie as u8; 4096]);
    }
    r.0.write_all(&all).unwrap();
    let mut cookies: Vec<u64> = (0..4)
        .map(|_| {
            let (e, c) = r.reply();
            assert_eq!(e, 0, "cookie {c}");
            c
        })
        .collect();
    cookies.sort_unstable();
    assert_eq!(cookies, [1, 2, 3, 4]);
    assert_eq!(queued(), 2, "the two plain writes it starts");
    assert_eq!(
        starts.started.load(Relaxed),
        2,
        "never asked for the FUA write"
    );
    let mut b = vec![0u8; 4096];
    for (cookie, at) in [(1u8, 0u64), (2, 4096), (3, 8192), (4, 7 << 20)] {
        dev.read_at(at, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == cookie), "write {cookie}");
    }
}

/// A memory device that records the writes and flushes it receives, in order.
struct Recorder {
    dev: MemDevice,
    log: std::sync::Mutex<Vec<&'static str>>,
}

impl BlockDevice for Recorder {
    fn size(&self) -> u64 {
        self.dev.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.dev.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), sce_io::IoError> {
        self.dev.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), sce_io::IoError> {
        self.log.lock().unwrap().push("write");
        self.dev.write_at(offset, buf)
    }
    fn flush(&self) -> Result<(), sce_io::IoError> {
        self.log.lock().unwrap().push("flush");
        self.dev.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), sce_io::IoError> {
        self.dev.discard(offset, len)
    }
}

/// A FUA write is acknowledged only after a flush that follows its write, on the reader
/// (alone in flight) and through the queue (pipelined); a plain write is not flushed.
#[test]
fn fua_writes_are_flushed_before_their_reply_on_every_path() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let rec = Arc::new(Recorder {
        dev: MemDevice::new(8 << 20),
        log: std::sync::Mutex::new(Vec::new()),
    });
    let queue: Arc<dyn sce_io::IoQueue> = Arc::new(sce_io::ThreadQueue::new(rec.clone(), 4));
    let server = Server::new(vec![Export {
        name: "vol".into(),
        description: String::new(),
        device: rec.clone(),
        read_only: false,
        prefetch: None,
        io: Some(ExportIo::Queue(queue)),
    }]);
    let _l = listen(&server, &ListenAddr::Unix(sock.clone())).unwrap();
    let mut r = Raw::go(&sock, "vol");
    let log = || rec.log.lock().unwrap().clone();
    r.request(proto::CMD_WRITE, 0, 1, 0, 4096, &[1u8; 4096]);
    assert_eq!(r.reply(), (0, 1));
    assert_eq!(log(), ["write"], "a plain write is not flushed");
    r.request(
        proto::CMD_WRITE,
        proto::CMD_FLAG_FUA,
        2,
        4096,
        4096,
        &[2u8; 4096],
    );
    assert_eq!(r.reply(), (0, 2));
    assert_eq!(
        log(),
        ["write", "write", "flush"],
        "alone in flight, on the reader"
    );
    // Pipelined: a FUA write and 8 reads in one send, through the queue.
    let enc = |command, flags, cookie, offset, len| {
        proto::encode_request(&proto::Request {
            flags,
            command,
            cookie,
            offset,
            len,
        })
    };
    let mut wire = enc(proto::CMD_WRITE, proto::CMD_FLAG_FUA, 3, 8192, 4096).to_vec();
    wire.extend_from_slice(&[3u8; 4096]);
    for c in 10..18u64 {
        wire.extend_from_slice(&enc(proto::CMD_READ, 0, c, 0, 4096));
    }
    let queued_before = server.stats().queued_requests.load(Relaxed);
    r.0.write_all(&wire).unwrap();
    for _ in 0..9 {
        let (err, cookie) = r.reply();
        assert_eq!(err, 0);
        if cookie == 3 {
            let l = log();
            assert_eq!(
                &l[3..],
                ["write", "flush"],
                "flushed after its write: {l:?}"
            );
        } else {
            let mut b = vec![0u8; 4096];
            r.0.read_exact(&mut b).unwrap();
        }
    }
    assert!(server.stats().queued_requests.load(Relaxed) > queued_before);
}

/// Descriptors of a `base:allocation` block status chunk: (length, flags).
fn descriptors(d: &[u8]) -> Vec<(u32, u32)> {
    assert_eq!(d[..4], proto::BASE_ALLOCATION_ID.to_be_bytes());
    assert_eq!((d.len() - 4) % 8, 0);
    d[4..]
        .chunks(8)
        .map(|c| {
            let w = |i: usize| u32::from_be_bytes(c[i..i + 4].try_into().unwrap());
            (w(0), w(4))
        })
        .collect()
}

#[test]
fn structured_replies_and_block_status_follow_the_protocol() {
    for backing in [Backing::Mem, Backing::File(Backend::IoUring)] {
        structured_session(backing);
    }
}

fn structured_session(backing: Backing) {
    let f = fixture_on(16 << 20, backing);
    let mut r = Raw::hello(&f.sock);
    // SET_META_CONTEXT before structured replies is refused; LIST is answered.
    let set = proto::OPT_SET_META_CONTEXT;
    let rep = r.meta(set, "vol", &[proto::BASE_ALLOCATION]);
    assert_eq!(rep.last().unwrap().0, proto::REP_ERR_INVALID);
    r.option(proto::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(r.option_reply().0, proto::REP_ACK);
    for queries in [
        &[][..],
        &["base:"][..],
        &[proto::BASE_ALLOCATION, "qemu:x"][..],
    ] {
        let rep = r.meta(proto::OPT_LIST_META_CONTEXT, "vol", queries);
        assert_eq!(rep.len(), 2, "{queries:?}");
        assert_eq!(rep[0].0, proto::REP_META_CONTEXT);
        assert_eq!(rep[0].1, proto::rep_meta_context(0, proto::BASE_ALLOCATION));
    }
    let rep = r.meta(
        proto::OPT_LIST_META_CONTEXT,
        "vol",
        &["qemu:dirty-bitmap:a"],
    );
    assert_eq!(
        rep.iter().map(|x| x.0).collect::<Vec<_>>(),
        [proto::REP_ACK]
    );
    assert_eq!(
        r.meta(set, "nope", &[]).last().unwrap().0,
        proto::REP_ERR_UNKNOWN
    );
    // Selecting it for another export does not enable it for this one...
    let rep = r.meta(set, "ro", &[proto::BASE_ALLOCATION]);
    assert_eq!(rep[0].1, proto::rep_meta_context(1, proto::BASE_ALLOCATION));
    let mut other = Raw::hello(&f.sock);
    other.option(proto::OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(other.option_reply().0, proto::REP_ACK);
    other.meta(set, "ro", &[proto::BASE_ALLOCATION]);
    other.go_on("vol");
    other.request(proto::CMD_BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    let (flags, kind, _, d) = other.chunk();
    assert_eq!(
        (flags, kind),
        (proto::REPLY_FLAG_DONE, proto::REPLY_TYPE_ERROR)
    );
    assert_eq!(d[..4], errno::EINVAL.to_be_bytes());
    // ...selecting it for this one does.
    r.meta(set, "vol", &[proto::BASE_ALLOCATION]);
    r.go_on("vol");
    let data = vec![0x5au8; 1 << 20];
    r.request(proto::CMD_WRITE, 0, 7, 4 << 20, 1 << 20, &data);
    assert_eq!(r.chunk(), (1, proto::REPLY_TYPE_NONE, 7, vec![]));
    // A read comes back as one data chunk at its offset.
    r.request(proto::CMD_READ, 0, 8, (4 << 20) + 4096, 8192, &[]);
    let (flags, kind, cookie, d) = r.chunk();
    assert_eq!((flags, kind, cookie), (1, proto::REPLY_TYPE_OFFSET_DATA, 8));
    assert_eq!(d[..8], ((4u64 << 20) + 4096).to_be_bytes());
    assert_eq!(&d[8..], &data[..8192]);
    // An error is an error chunk, with the errno; the connection goes on.
    r.request(proto::CMD_READ, 0, 9, 16 << 20, 4096, &[]);
    let (flags, kind, cookie, d) = r.chunk();
    assert_eq!((flags, kind, cookie), (1, proto::REPLY_TYPE_ERROR, 9));
    assert_eq!(d, [&errno::EINVAL.to_be_bytes()[..], &[0, 0]].concat());
    // Block status: the holes of a sparse file, all data for memory.
    r.request(proto::CMD_BLOCK_STATUS, 0, 10, 0, 16 << 20, &[]);
    let (flags, kind, cookie, d) = r.chunk();
    assert_eq!(
        (flags, kind, cookie),
        (1, proto::REPLY_TYPE_BLOCK_STATUS, 10)
    );
    let hole = proto::STATE_HOLE | proto::STATE_ZERO;
    let want = match backing {
        Backing::Mem => vec![(16 << 20, 0)],
        Backing::File(_) => vec![(4 << 20, hole), (1 << 20, 0), (11 << 20, hole)],
    };
    assert_eq!(descriptors(&d), want, "{backing:?}");
    // REQ_ONE: one descriptor, no longer than asked.
    r.request(
        proto::CMD_BLOCK_STATUS,
        proto::CMD_FLAG_REQ_ONE,
        11,
        4096,
        8192,
        &[],
    );
    let (_, _, _, d) = r.chunk();
    let first = if matches!(backing, Backing::Mem) {
        0
    } else {
        hole
    };
    assert_eq!(descriptors(&d), vec![(8192, first)]);
    // Past the end, or of no length: EINVAL.
    for (cookie, offset, len) in [(12, 16 << 20, 4096), (13, 0, 0)] {
        r.request(proto::CMD_BLOCK_STATUS, 0, cookie, offset, len, &[]);
        let (_, kind, c, d) = r.chunk();
        assert_eq!((kind, c), (proto::REPLY_TYPE_ERROR, cookie));
        assert_eq!(d[..4], errno::EINVAL.to_be_bytes());
    }
    // Without structured replies, nothing changes: simple replies.
    let mut plain = Raw::go(&f.sock, "vol");
    plain.request(proto::CMD_BLOCK_STATUS, 0, 20, 0, 4096, &[]);
    assert_eq!(plain.reply(), (errno::EINVAL, 20));
    still_serving(&f);
}

/// An option on a raw TCP connection after the greeting: its reply code, or None if the
/// server closed the connection.
fn tcp_option(s: &mut std::net::TcpStream, opt: u32, data: &[u8]) -> Option<u32> {
    let mut v = proto::IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&opt.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    s.write_all(&v).ok()?;
    let mut h = [0u8; 20];
    s.read_exact(&mut h).ok()?;
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d).ok()?;
    Some(u32::from_be_bytes(h[12..16].try_into().unwrap()))
}

#[test]
fn starttls_policy_before_the_tls_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let (cp, kp) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    std::fs::write(&cp, cert.pem()).unwrap();
    std::fs::write(&kp, key.serialize_pem()).unwrap();
    let f = fixture(8 << 20);
    // A Unix socket offers no TLS.
    let mut r = Raw::hello(&f.sock);
    r.option(proto::OPT_STARTTLS, &[]);
    assert_eq!(r.option_reply().0, proto::REP_ERR_POLICY);
    let tls = sce_nbd::ServerTls::from_files(sce_nbd::TlsMode::Require, &cp, &kp, None).unwrap();
    let opts = sce_nbd::ListenOptions {
        tls: Some(tls),
        ..Default::default()
    };
    let l = sce_nbd::listen_with(&f.server, &ListenAddr::Tcp("127.0.0.1:0".into()), &opts).unwrap();
    let addr = l.local.strip_prefix("tcp:").unwrap().to_string();
    let hello = || {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut h = [0u8; 18];
        s.read_exact(&mut h).unwrap();
        s.write_all(&(proto::FLAG_C_FIXED_NEWSTYLE | proto::FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        s
    };
    // Required: every option but STARTTLS and ABORT is refused until TLS is up...
    let mut s = hello();
    let mut go = 3u32.to_be_bytes().to_vec();
    go.extend_from_slice(b"vol");
    go.extend_from_slice(&0u16.to_be_bytes());
    for (opt, data) in [
        (proto::OPT_GO, &go[..]),
        (proto::OPT_INFO, &go[..]),
        (proto::OPT_LIST, &[][..]),
        (proto::OPT_STRUCTURED_REPLY, &[][..]),
    ] {
        assert_eq!(tcp_option(&mut s, opt, data), Some(proto::REP_ERR_TLS_REQD));
    }
    assert_eq!(
        tcp_option(&mut s, proto::OPT_STARTTLS, b"x"),
        Some(proto::REP_ERR_INVALID)
    );
    assert_eq!(
        tcp_option(&mut s, proto::OPT_ABORT, &[]),
        Some(proto::REP_ACK)
    );
    // ...and EXPORT_NAME, which has no error reply, closes the connection.
    let mut s = hello();
    assert_eq!(tcp_option(&mut s, proto::OPT_EXPORT_NAME, b"vol"), None);
    // STARTTLS is acknowledged, and a client that then sends garbage instead of a TLS
    // hello is dropped; the server goes on serving.
    let mut s = hello();
    assert_eq!(
        tcp_option(&mut s, proto::OPT_STARTTLS, &[]),
        Some(proto::REP_ACK)
    );
    s.write_all(&[0x55; 64]).unwrap();
    let mut b = [0u8; 64];
    let n = s.read(&mut b).unwrap_or(0);
    assert!(n < 64, "the server answered garbage with {n} bytes");
    still_serving(&f);
}
