//! Helpers shared by the CLI integration tests: a `sce serve` child whose log is captured,
//! a tiny HTTP client for its /stats and /metrics endpoints, `sce ctl`, sparse source files,
//! and NBD clients of a server's Unix socket.

#![allow(dead_code)]

pub mod coherence;

use parking_lot::Mutex;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The `sce` binary the tests run: `SCE_BIN` if set (to run a test against another build,
/// e.g. an old release, and see it fail), else this build's.
pub fn sce_bin() -> String {
    std::env::var("SCE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_sce").to_string())
}

/// `sce ARGS`, which must succeed (its stderr in the failure): its stdout, as JSON.
pub fn sce_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(sce_bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "sce {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("sce {args:?}: {e}"))
}

/// `sce ctl` on the admin socket of the server listening on `sock` (`SOCK.ctl`): whether
/// it succeeded, and its stdout and stderr.
pub fn ctl(sock: &Path, args: &[&str]) -> (bool, String) {
    let out = ctl_output(Path::new(&format!("{}.ctl", sock.display())), args);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// `sce ctl -s ADMIN ARGS`, with `SCE_CTL` unset: its output.
pub fn ctl_output(admin: &Path, args: &[&str]) -> std::process::Output {
    Command::new(sce_bin())
        .arg("ctl")
        .arg("-s")
        .arg(admin)
        .args(args)
        .env_remove("SCE_CTL")
        .output()
        .unwrap()
}

/// Creates `path` (truncating it) as a sparse file of `len` zero bytes.
pub fn sized_file(path: &Path, len: u64) {
    std::fs::File::create(path).unwrap().set_len(len).unwrap();
}

/// A temporary directory holding `src`, a sparse source file of `size` bytes: the directory
/// (removed on drop) and the source's path.
pub fn temp_source(size: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src");
    sized_file(&src, size);
    (d, src)
}

/// A client of the default export of the server on the Unix socket `sock`, with `conns`
/// connections.
pub fn unix_client(sock: &Path, conns: usize) -> sce_nbd::NbdClient {
    sce_nbd::NbdClient::connect(
        &sce_nbd::NbdUri::Unix {
            socket: sock.to_path_buf(),
            name: String::new(),
        },
        conns,
    )
    .unwrap()
}

/// The `HOST:PORT` of a server's metrics endpoint: reads its log `lines` up to the one that
/// announces it.
pub fn metrics_addr(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> String {
    loop {
        let l = lines.next().expect("server output").unwrap();
        if let Some(rest) = l.split_once("metrics on http://").map(|x| x.1) {
            break rest.trim_end_matches("/metrics").to_string();
        }
    }
}

/// `GET /PATH HTTP/1.0` on `addr` (`HOST:PORT`): the whole response, head and body.
pub fn http_get(addr: &str, path: &str) -> String {
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    write!(c, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = String::new();
    c.read_to_string(&mut resp).unwrap();
    resp
}

/// Waits up to 20 s for `path` to exist.
pub fn wait_for(path: &Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A running `sce serve`, killed on drop, with its stderr collected.
pub struct Server {
    child: Option<Child>,
    log: Arc<Mutex<Vec<String>>>,
    /// HOST:PORT of its metrics endpoint.
    pub metrics: String,
}

impl Server {
    /// Starts `sce serve ARGS --listen unix:SOCK --metrics 127.0.0.1:0` and waits until it
    /// listens.
    pub fn start(args: &[&str], sock: &Path) -> Server {
        Server::try_start(args, sock).unwrap_or_else(|e| panic!("{e}"))
    }

    /// As `start`, but a server that exits before it listens is an `Err` naming its exit
    /// status and holding its log (a refused start).
    pub fn try_start(args: &[&str], sock: &Path) -> Result<Server, String> {
        let _ = std::fs::remove_file(sock);
        let mut child = Command::new(sce_bin())
            .arg("serve")
            .args(args)
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .args(["--metrics", "127.0.0.1:0"])
            .env("SCE_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let err = child.stderr.take().unwrap();
        let l = log.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                l.lock().push(line);
            }
        });
        let t0 = Instant::now();
        let metrics = loop {
            let found = log.lock().iter().find_map(|l| {
                l.split_once("metrics on http://")
                    .map(|x| x.1.trim_end_matches("/metrics").to_string())
            });
            if let Some(m) = found {
                break m;
            }
            if let Ok(Some(st)) = child.try_wait() {
                let _ = reader.join();
                return Err(format!(
                    "sce serve exited with {st}: {}",
                    log.lock().join("\n")
                ));
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "sce serve did not start"
            );
            std::thread::sleep(Duration::from_millis(10));
        };
        wait_for(sock);
        Ok(Server {
            child: Some(child),
            log,
            metrics,
        })
    }

    /// The /stats document of the default export.
    pub fn export_stats(&self) -> serde_json::Value {
        let mut c = std::net::TcpStream::connect(&self.metrics).unwrap_or_else(|e| {
            panic!(
                "metrics endpoint {}: {e}; the server logged:\n{}",
                self.metrics,
                self.log()
            )
        });
        write!(c, "GET /stats HTTP/1.0\r\n\r\n").unwrap();
        let mut resp = String::new();
        c.read_to_string(&mut resp).unwrap();
        let body = resp.split_once("\r\n\r\n").unwrap().1;
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        v["exports"][""].clone()
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// Everything it logged so far.
    pub fn log(&self) -> String {
        self.log.lock().join("\n")
    }

    fn signal(&mut self, sig: i32) -> std::process::ExitStatus {
        let mut child = self.child.take().unwrap();
        // SAFETY: kill(2) on our own child's pid has no memory-safety preconditions.
        unsafe { libc::kill(child.id() as i32, sig) };
        child.wait().unwrap()
    }

    /// SIGTERM, and the exit status.
    pub fn term(mut self) -> std::process::ExitStatus {
        self.signal(libc::SIGTERM)
    }

    /// SIGKILL.
    pub fn kill(mut self) {
        self.signal(libc::SIGKILL);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Flips the bits of the byte at `at` of `file` (damage, in place).
pub fn flip_byte(file: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0xa5], at).unwrap();
}

/// The value of environment variable `name` (a test's knob), or `default`.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A number field of a stats document.
pub fn num(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("no number {k} in {v}"))
}

/// Blocks that say what they are, for crash tests: the model of what was acknowledged.
pub mod blocks {
    use sce_io::{AlignedBuf, BlockDevice};
    use sce_nbd::NbdClient;

    const MIB: u64 = 1 << 20;

    pub const BLOCK: u64 = 4096;

    /// Writes `size` bytes of blocks at counter 0 (the content no write has replaced) to
    /// `path`.
    pub fn initial_source(path: &std::path::Path, size: u64) {
        let mut init = vec![0u8; size as usize];
        for (b, d) in init.chunks_mut(BLOCK as usize).enumerate() {
            block(b as u64, 0, d);
        }
        std::fs::write(path, &init).unwrap();
    }

    /// A block's content: its index, its write counter, and a filler derived from both, so a
    /// stale block and a torn one are both recognised.
    pub fn block(idx: u64, counter: u64, out: &mut [u8]) {
        out[..8].copy_from_slice(&idx.to_le_bytes());
        out[8..16].copy_from_slice(&counter.to_le_bytes());
        let mut x = idx.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ counter;
        for w in out[16..].chunks_mut(8) {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
        }
    }

    /// Decodes a block: Some(counter) if it is whole and belongs at `idx`.
    pub fn decode(idx: u64, data: &[u8]) -> Option<u64> {
        let i = u64::from_le_bytes(data[..8].try_into().unwrap());
        let c = u64::from_le_bytes(data[8..16].try_into().unwrap());
        let mut want = vec![0u8; BLOCK as usize];
        block(idx, c, &mut want);
        (i == idx && want[..] == data[..]).then_some(c)
    }

    /// Reads the whole volume through `c` and asserts every block reads as its last
    /// acknowledged write or the write that was in flight on it (`what` names the round);
    /// with `flushed_ok`, a write acknowledged since the last completed FLUSH may also read
    /// as any write between it and the flushed one (block-device semantics after a crash:
    /// nothing older than the last FLUSH).
    pub fn assert_never_stale(c: &NbdClient, m: &[BlockState], what: &str, flushed_ok: bool) {
        for (b, got) in read_blocks(c, m.len() as u64 * BLOCK)
            .into_iter()
            .enumerate()
        {
            let st = m[b];
            let since_flush = flushed_ok && got.is_some_and(|g| g >= st.flushed && g <= st.acked);
            assert!(
                got == Some(st.acked) || (got.is_some() && got == st.in_flight) || since_flush,
                "{what}: block {b} reads {got:?}; acknowledged {}, in flight {:?}, flushed {}",
                st.acked,
                st.in_flight,
                st.flushed
            );
        }
    }

    /// Reads the first `size` bytes through `c`, 1 MiB at a time: each block's counter, or
    /// None where it does not describe itself.
    fn read_blocks(c: &NbdClient, size: u64) -> Vec<Option<u64>> {
        let mut buf = AlignedBuf::new(MIB as usize);
        let mut out = Vec::with_capacity((size / BLOCK) as usize);
        for chunk in 0..size / MIB {
            c.read_at(chunk * MIB, &mut buf).unwrap();
            for k in 0..MIB / BLOCK {
                let b = chunk * MIB / BLOCK + k;
                out.push(decode(
                    b,
                    &buf[(k * BLOCK) as usize..((k + 1) * BLOCK) as usize],
                ));
            }
        }
        out
    }

    /// Per block: the last acknowledged write counter, and one in flight (if any), and the
    /// one its writer's last completed FLUSH covered (counters of a block only grow).
    #[derive(Clone, Copy, Default)]
    pub struct BlockState {
        pub acked: u64,
        pub in_flight: Option<u64>,
        pub flushed: u64,
    }

    /// What a kill loop saw: the export's stats at each kill and after each restart, the
    /// blocks that had a write in flight at the kills, and the server of the last round
    /// (verified, no load) with a client.
    pub struct KillReport {
        pub at_kill: Vec<serde_json::Value>,
        pub after_restart: Vec<serde_json::Value>,
        pub in_flight: u64,
        pub model: Vec<BlockState>,
        pub server: crate::common::Server,
        pub client: NbdClient,
        /// The source file and the server's socket.
        pub src: std::path::PathBuf,
        pub sock: std::path::PathBuf,
    }

    /// A client of the server listening on `sock`.
    pub fn client(sock: &std::path::Path, conns: usize) -> NbdClient {
        let uri: sce_nbd::NbdUri = format!("nbd+unix:///?socket={}", sock.display())
            .parse()
            .unwrap();
        NbdClient::connect(&uri, conns).unwrap()
    }

    /// The SIGKILL loop: writes a 16 MiB source of self-describing blocks to `DIR/src`, then
    /// `iterations` times starts `sce serve` over it with an 8 MiB cache (`DIR/cache`, 256
    /// KiB fragments, 50 ms metadata interval) and `extra` arguments on `DIR/s`, checks that
    /// every block reads as its last acknowledged write or the write in flight on it, runs four verifying
    /// writer/reader threads (each its own blocks) and kills the server at a random moment.
    /// Every fourth kill comes after the writers stopped and the server had a few metadata
    /// intervals to settle.
    pub fn kill_loop(
        dir: &std::path::Path,
        extra: &[&str],
        iterations: u32,
        seed: u64,
    ) -> KillReport {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        use std::sync::Arc;
        let (src, cache, sock) = (dir.join("src"), dir.join("cache"), dir.join("s"));
        let (src_s, cache_s) = (src.to_str().unwrap(), cache.to_str().unwrap());
        let mut args = vec![
            "--source",
            src_s,
            "--cache",
            cache_s,
            "--cache-size",
            "8MiB",
            "--fragment-size",
            "256KiB",
            "--metadata-interval",
            "50ms",
            "--allow-buffered",
        ];
        args.extend_from_slice(extra);
        let (args, sock) = (&args[..], sock.as_path());
        let size = 16 * MIB;
        let blocks = size / BLOCK;
        initial_source(&src, size);
        const THREADS: u64 = 4;
        let model = Arc::new(parking_lot::Mutex::new(vec![
            BlockState::default();
            blocks as usize
        ]));
        let mut rng = SmallRng::seed_from_u64(seed);
        // Write-back through the log (the default for a new cache in writeback, unless
        // `--writeback-log 0`) commits at FLUSH: a kill may take back what was acknowledged
        // since the last one (the writers then FLUSH now and then).
        let log_size = extra
            .iter()
            .position(|a| *a == "--writeback-log")
            .map(|i| extra[i + 1]);
        let flushes = extra.contains(&"writeback") && log_size != Some("0");
        let (mut at_kill, mut after_restart, mut in_flight) = (Vec::new(), Vec::new(), 0u64);
        let mut counter = 0u64;
        let mut it = 0;
        loop {
            let s = crate::common::Server::start(args, sock);
            let c = client(sock, THREADS as usize);
            if it > 0 {
                after_restart.push(s.export_stats());
            }
            let m = model.lock().clone();
            assert_never_stale(&c, &m, &format!("iteration {it}"), flushes);
            relearn(&c, &mut model.lock(), size);
            reads_the_same_after_forget(&c, sock, &model.lock(), size, it);
            if it == iterations {
                let model = model.lock().clone();
                return KillReport {
                    at_kill,
                    after_restart,
                    in_flight,
                    model,
                    server: s,
                    client: c,
                    src,
                    sock: sock.to_path_buf(),
                };
            }
            let c = Arc::new(c);
            let stop = Arc::new(AtomicBool::new(false));
            let mut handles = Vec::new();
            for t in 0..THREADS {
                let (c, model, stop) = (c.clone(), model.clone(), stop.clone());
                let seed = rng.gen::<u64>();
                let base = counter + (t + 1) * 1_000_000;
                let per = blocks / THREADS;
                handles.push(std::thread::spawn(move || {
                    load(&c, &model, &stop, (t * per, per), (seed, base, flushes))
                }));
            }
            std::thread::sleep(std::time::Duration::from_millis(rng.gen_range(20..400)));
            if it % 4 == 3 {
                stop.store(true, Relaxed);
                for h in handles.drain(..) {
                    h.join().expect("a load thread failed a live check");
                }
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            at_kill.push(s.export_stats());
            s.kill();
            stop.store(true, Relaxed);
            for h in handles {
                h.join().expect("a load thread failed a live check");
            }
            in_flight += model
                .lock()
                .iter()
                .filter(|b| b.in_flight.is_some())
                .count() as u64;
            counter += 100_000_000;
            it += 1;
        }
    }

    /// Issue 46: after a restart, what a block reads as is what it reads as once the cache
    /// has forgotten everything clean (`sce ctl forget`): a write in flight at the kill
    /// never reads as its old bytes from the cache and its new ones from the source later.
    fn reads_the_same_after_forget(
        c: &NbdClient,
        sock: &std::path::Path,
        m: &[BlockState],
        size: u64,
        it: u32,
    ) {
        let (ok, out) = crate::common::ctl(sock, &["forget", ""]);
        assert!(ok, "forget: {out}");
        for (b, got) in read_blocks(c, size).into_iter().enumerate() {
            assert_eq!(
                got,
                Some(m[b].acked),
                "iteration {it}: block {b} read otherwise before forget"
            );
        }
    }

    /// Re-reads every block through `c` into the model (after the check, so the round
    /// starts exact).
    fn relearn(c: &NbdClient, m: &mut [BlockState], size: u64) {
        for (b, got) in read_blocks(c, size).into_iter().enumerate() {
            let got = got.expect("checked above");
            m[b] = BlockState {
                acked: got,
                in_flight: None,
                flushed: got,
            };
        }
    }

    /// Writes blocks `b0..` (as many as `buf` holds) with counter `n` through `c`, the model
    /// saying the write is in flight until it is acknowledged. False if it failed (the
    /// server died): the blocks stay "in flight" in the model.
    pub fn write_logged(
        c: &NbdClient,
        model: &parking_lot::Mutex<Vec<BlockState>>,
        (b0, n): (u64, u64),
        buf: &mut [u8],
    ) -> bool {
        let k = buf.len() as u64 / BLOCK;
        {
            let mut m = model.lock();
            for j in 0..k {
                m[(b0 + j) as usize].in_flight = Some(n);
            }
        }
        for j in 0..k {
            block(
                b0 + j,
                n,
                &mut buf[(j * BLOCK) as usize..((j + 1) * BLOCK) as usize],
            );
        }
        if c.write_at(b0 * BLOCK, buf).is_err() {
            return false;
        }
        let mut m = model.lock();
        for j in 0..k {
            let b = &mut m[(b0 + j) as usize];
            b.acked = n;
            b.in_flight = None;
        }
        true
    }

    /// One load thread over blocks `[first, first + per)`: 20% writes (counters from
    /// `base`), 80% reads checked live against the model, half the traffic in the first
    /// eighth of the range; until `stop` or an error (the server died).
    fn load(
        c: &NbdClient,
        model: &parking_lot::Mutex<Vec<BlockState>>,
        stop: &std::sync::atomic::AtomicBool,
        (first, per): (u64, u64),
        (seed, base, flushes): (u64, u64, bool),
    ) {
        use rand::{rngs::SmallRng, Rng, SeedableRng};
        let mut r = SmallRng::seed_from_u64(seed);
        let mut n = base;
        let mut wbuf = AlignedBuf::new(16 * BLOCK as usize);
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if flushes && r.gen_bool(0.05) {
                // This thread's writes were all acknowledged before the FLUSH was sent.
                if c.flush().is_err() {
                    return;
                }
                let mut m = model.lock();
                for b in &mut m[first as usize..(first + per) as usize] {
                    b.flushed = b.acked;
                }
                continue;
            }
            let k = r.gen_range(1..=16u64);
            let span = if r.gen_bool(0.5) { per / 8 } else { per };
            let b0 = first + r.gen_range(0..span - k);
            let data = &mut wbuf[..(k * BLOCK) as usize];
            let at = |j: u64| (j * BLOCK) as usize..((j + 1) * BLOCK) as usize;
            if r.gen_bool(0.2) {
                n += 1;
                if !write_logged(c, model, (b0, n), data) {
                    return;
                }
            } else {
                if c.read_at(b0 * BLOCK, data).is_err() {
                    return;
                }
                let m = model.lock();
                for j in 0..k {
                    let got = decode(b0 + j, &data[at(j)]);
                    assert_eq!(
                        got,
                        Some(m[(b0 + j) as usize].acked),
                        "live read of block {}",
                        b0 + j
                    );
                }
            }
        }
    }
}

/// An nbdkit serving on a Unix socket, killed on drop.
pub struct Nbdkit {
    child: Child,
    /// Its NBD URI (the default export).
    pub uri: String,
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `nbdkit -f -U SOCK ARGS` (its stderr dropped when `quiet`) and waits for its socket.
pub fn nbdkit(sock: &Path, args: &[&str], quiet: bool) -> Nbdkit {
    let mut cmd = Command::new("nbdkit");
    cmd.args(["-f", "-U"]).arg(sock).args(args);
    if quiet {
        cmd.stderr(Stdio::null());
    }
    let child = cmd.spawn().unwrap();
    let kit = Nbdkit {
        child,
        uri: format!("nbd+unix:///?socket={}", sock.display()),
    };
    wait_for(sock);
    kit
}

/// An nbdkit memory disk of `size` (e.g. "32M") whose writes all fail while the file `flag`
/// exists (its error filter; one stderr line per error, dropped): a source outage.
pub fn nbdkit_with_outage(sock: &Path, flag: &Path, size: &str) -> Nbdkit {
    let file = format!("error-pwrite-file={}", flag.display());
    let args = [
        "--filter=error",
        "memory",
        size,
        "error-pwrite-rate=100%",
        &file,
    ];
    nbdkit(sock, &args, true)
}

/// fio's verify load against the export on `sock`: random writes, then random reads and
/// writes, 16 in flight over 64 MiB (`fio_verify` each).
pub fn fio_verify_rounds(dir: &Path, sock: &Path) {
    let u = format!("nbd+unix:///?socket={}", sock.display());
    for rw in ["randwrite", "randrw"] {
        let load = [
            &format!("--rw={rw}"),
            "--iodepth=16",
            "--size=64M",
            "--io_size=48M",
        ];
        fio_verify(dir, &u, &load);
    }
}

/// fio's nbd engine on `uri`, 4 KiB requests verified by crc32c (fatally), run in `dir`
/// (where fio leaves its verify state files), with `load` (`--rw`, `--size`, ...). Fails
/// the test if fio fails or reports a verify error; returns what it printed.
pub fn fio_verify(dir: &Path, uri: &str, load: &[&str]) -> String {
    let out = Command::new("fio")
        .current_dir(dir)
        .args([
            "--name=v",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--bs=4k",
        ])
        .args(load)
        .args([
            "--verify=crc32c",
            "--verify_fatal=1",
            "--randrepeat=0",
            "--output-format=terse",
        ])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "fio {load:?} failed:\n{text}");
    assert!(
        !text.contains("verify: bad") && !text.contains("verify failed"),
        "fio {load:?}: {text}"
    );
    text
}
