//! What `sce serve` and `sce format` must never do to data that is not theirs, and how a
//! persistent cache notices that its source changed while it was down (issue 10, items 2-5
//! and 14): the source given as its own cache, a foreign file as the cache, a second server
//! on a live cache or source, a changed `--cache-size`, a source edited, replaced or
//! re-generated offline, a cache file rolled back to an older copy, and a failed start that
//! must leave nothing behind.

mod common;

use common::{num, Server};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::{AlignedBuf, BlockDevice};
use sce_nbd::{NbdClient, NbdUri};
use sce_testkit::within;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn sce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(args)
        .output()
        .unwrap()
}

/// `sce serve ARGS --listen unix:SOCK`, expected to fail at start: its stderr. A server
/// that starts instead is killed after 30 s and fails the test (a hang guard).
fn serve_fails(args: &[&str], sock: &Path) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("serve")
        .args(args)
        .args(["--listen", &format!("unix:{}", sock.display())])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    });
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "sce serve {args:?} started and kept serving: {}",
                reader.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let err = reader.join().unwrap();
    assert!(!status.success(), "sce serve {args:?} exited 0: {err}");
    err
}

fn client(sock: &Path) -> NbdClient {
    let uri: NbdUri = format!("nbd+unix:///?socket={}", sock.display())
        .parse()
        .unwrap();
    NbdClient::connect(&uri, 2).unwrap()
}

/// A file of `size` random bytes from `seed`.
fn random_file(path: &Path, size: u64, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; size as usize];
    SmallRng::seed_from_u64(seed).fill(&mut data[..]);
    std::fs::write(path, &data).unwrap();
    data
}

fn digest(path: &Path) -> (u64, u64) {
    let data = std::fs::read(path).unwrap();
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for &b in &data {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    (data.len() as u64, h)
}

/// Reads the whole volume through the server.
fn read_all(sock: &Path, size: u64) -> Vec<u8> {
    let c = client(sock);
    let mut out = vec![0u8; size as usize];
    let mut buf = AlignedBuf::new(MIB as usize);
    for at in (0..size).step_by(MIB as usize) {
        c.read_at(at, &mut buf).unwrap();
        out[at as usize..(at + MIB) as usize].copy_from_slice(&buf);
    }
    out
}

/// Reads the first `hot` bytes until they are all cache hits (population runs in the
/// background), at most 200 passes.
fn warm(s: &Server, sock: &Path, hot: u64) {
    let c = client(sock);
    let mut buf = AlignedBuf::new(256 * 1024);
    for _ in 0..200 {
        let before = s.export_stats();
        for at in (0..hot).step_by(buf.len()) {
            c.read_at(at, &mut buf).unwrap();
        }
        let after = s.export_stats();
        if num(&after, "read_pages_missed") == num(&before, "read_pages_missed") {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the cache never warmed: {}", s.export_stats());
}

struct Setup {
    _dir: tempfile::TempDir,
    src: PathBuf,
    cache: PathBuf,
    sock: PathBuf,
    state: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().to_path_buf();
    Setup {
        src: p.join("src.img"),
        cache: p.join("cache.img"),
        sock: p.join("s.sock"),
        state: p.join("state"),
        _dir: dir,
    }
}

impl Setup {
    fn args(&self) -> Vec<String> {
        [
            "--source",
            self.src.to_str().unwrap(),
            "--cache",
            self.cache.to_str().unwrap(),
            "--cache-size",
            "64MiB",
            "--allow-buffered",
            "--metadata-interval",
            "50ms",
            "--state-dir",
            self.state.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn the_source_is_never_its_own_cache() {
    let t = setup();
    random_file(&t.src, 64 * MIB, 1);
    let before = digest(&t.src);
    let src = t.src.to_str().unwrap();
    // The same path, with and without a size that would truncate it.
    for extra in [&[][..], &["--cache-size", "8MiB"][..]] {
        let mut args = vec!["--source", src, "--cache", src, "--allow-buffered"];
        args.extend_from_slice(extra);
        let err = serve_fails(&args, &t.sock);
        assert!(err.contains("same storage"), "{err}");
        assert_eq!(digest(&t.src), before, "the source changed");
    }
    // Another name of the same file.
    let alias = t.src.with_extension("alias");
    std::fs::hard_link(&t.src, &alias).unwrap();
    let err = serve_fails(
        &["--source", src, "--cache", alias.to_str().unwrap()],
        &t.sock,
    );
    assert!(err.contains("same storage"), "{err}");
    let out = sce(&[
        "format",
        alias.to_str().unwrap(),
        "--source",
        src,
        "--force",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("same storage"));
    assert_eq!(digest(&t.src), before, "the source changed");
    // Two exports of one file: one's cache is the other's source.
    let other = t.src.with_extension("other");
    random_file(&other, 16 * MIB, 2);
    let cfg = t.src.with_extension("toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\nsource = \"{}\"\ncache = \"{}\"\n\n[[export]]\nname = \"b\"\nsource = \"{}\"\n",
            other.display(),
            t.src.display(),
            t.src.display()
        ),
    )
    .unwrap();
    let err = serve_fails(&["--config", cfg.to_str().unwrap()], &t.sock);
    assert!(err.contains("same storage"), "{err}");
    assert_eq!(digest(&t.src), before, "the source changed");
}

#[test]
fn data_that_is_not_an_sce_cache_needs_force() {
    let t = setup();
    random_file(&t.src, 16 * MIB, 3);
    // A file with someone's data in it, the size the cache would have.
    random_file(&t.cache, 64 * MIB, 4);
    let before = digest(&t.cache);
    let args = t.args();
    let err = serve_fails(&strs(&args), &t.sock);
    assert!(
        err.contains("not an sce cache") && err.contains("--force"),
        "{err}"
    );
    let mut np = strs(&args);
    np.push("--no-persist");
    let err = serve_fails(&np, &t.sock);
    assert!(err.contains("--force"), "--no-persist: {err}");
    let out = sce(&[
        "format",
        t.cache.to_str().unwrap(),
        "--source",
        t.src.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
    assert_eq!(digest(&t.cache), before, "the foreign file was written");
    // With --force it is taken.
    let mut forced = strs(&args);
    forced.push("--force");
    let s = Server::start(&forced, &t.sock);
    assert!(s.term().success());
    // A persistent cache is not turned into a cold one without --reformat (or --force).
    let err = serve_fails(&np, &t.sock);
    assert!(err.contains("--reformat"), "{err}");
    let mut np_reformat = np.clone();
    np_reformat.push("--reformat");
    let s = Server::start(&np_reformat, &t.sock);
    assert!(s.term().success());
    // A cache file that was ours, persistent or not, is reused without --force.
    let s = Server::start(&np, &t.sock);
    assert!(s.term().success());
    let s = Server::start(&strs(&args), &t.sock);
    assert!(s.term().success());
    // A file whose first MiB is zero but that holds data further in is not blank.
    let zero_head = t.cache.with_extension("zerohead");
    let mut data = vec![0u8; (64 * MIB) as usize];
    SmallRng::seed_from_u64(5).fill(&mut data[(MIB as usize)..]);
    std::fs::write(&zero_head, &data).unwrap();
    let before = digest(&zero_head);
    let mut zh = strs(&args);
    let i = zh
        .iter()
        .position(|a| *a == t.cache.to_str().unwrap())
        .unwrap();
    zh[i] = zero_head.to_str().unwrap();
    let err = serve_fails(&zh, &t.sock);
    assert!(
        err.contains("data further in") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(digest(&zero_head), before);
}

#[test]
fn two_caches_of_one_nbd_export_are_refused() {
    let t = setup();
    let cfg = t.src.with_extension("toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\nsource = \"nbd://127.0.0.1:1/lun\"\ncache = \"{}\"\ncache_size = \"64MiB\"\n\n\
             [[export]]\nname = \"b\"\nsource = \"nbd://127.0.0.1:1/lun\"\ncache = \"{}\"\ncache_size = \"64MiB\"\n",
            t.cache.display(),
            t.cache.with_extension("b").display()
        ),
    )
    .unwrap();
    let err = serve_fails(&["--config", cfg.to_str().unwrap()], &t.sock);
    assert!(err.contains("cache the same source"), "{err}");
    assert!(!t.cache.exists());
}

#[test]
fn one_server_per_cache_and_per_source() {
    let t = setup();
    random_file(&t.src, 16 * MIB, 5);
    let args = t.args();
    let s = Server::start(&strs(&args), &t.sock);
    let cache_before = digest(&t.cache);
    // A second server on the same cache (and source), on another socket.
    let sock2 = t.sock.with_extension("2");
    let mut second = strs(&args);
    let i = second.iter().position(|a| *a == "64MiB").unwrap();
    second[i] = "256MiB";
    let err = serve_fails(&second, &sock2);
    assert!(err.contains("in use"), "{err}");
    assert!(
        err.contains(&format!("process {}", s.pid())),
        "names the holder: {err}"
    );
    // Another cache of the same source.
    let cache2 = t.cache.with_extension("2");
    let err = serve_fails(
        &[
            "--source",
            t.src.to_str().unwrap(),
            "--cache",
            cache2.to_str().unwrap(),
            "--cache-size",
            "64MiB",
            "--allow-buffered",
        ],
        &sock2,
    );
    assert!(err.contains("in use"), "{err}");
    assert!(
        !cache2.exists(),
        "the failed start left its cache file behind"
    );
    assert_eq!(
        digest(&t.cache).0,
        cache_before.0,
        "the live cache was resized"
    );
    // The first server still serves, and is still a cache.
    let st = s.export_stats();
    assert_eq!(st["state"], "active", "{st}");
    let data = read_all(&t.sock, 16 * MIB);
    assert!(data == std::fs::read(&t.src).unwrap());
    // Two exports of one TOML file whose caches are one file under two names (the same
    // name is a shared cache device: tests/shared_cache.rs).
    let cfg = t.src.with_extension("toml");
    let other = t.src.with_extension("other");
    random_file(&other, 16 * MIB, 6);
    let cache3 = t.cache.with_extension("3");
    std::fs::File::create(&cache3)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let alias = t.cache.with_extension("3-alias");
    std::fs::hard_link(&cache3, &alias).unwrap();
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\nsource = \"{}\"\ncache = \"{}\"\n\n\
             [[export]]\nname = \"b\"\nsource = \"{}\"\ncache = \"{}\"\n",
            other.display(),
            cache3.display(),
            other.with_extension("x").display(),
            alias.display()
        ),
    )
    .unwrap();
    random_file(&other.with_extension("x"), 16 * MIB, 7);
    let err = serve_fails(
        &["--config", cfg.to_str().unwrap(), "--allow-buffered"],
        &sock2,
    );
    assert!(err.contains("same storage"), "{err}");
    assert!(s.term().success());
}

#[test]
fn a_different_cache_size_is_refused_before_anything_is_written() {
    let t = setup();
    random_file(&t.src, 16 * MIB, 8);
    let args = t.args();
    let s = Server::start(&strs(&args), &t.sock);
    warm(&s, &t.sock, 8 * MIB);
    assert!(s.term().success());
    let before = digest(&t.cache);
    for size in ["8MiB", "256MiB"] {
        let mut a = strs(&args);
        let i = a.iter().position(|x| *x == "64MiB").unwrap();
        a[i] = size;
        let err = serve_fails(&a, &t.sock);
        assert!(err.contains("never resizes"), "{size}: {err}");
        assert_eq!(digest(&t.cache), before, "{size}: the cache file changed");
    }
    // Without --cache-size it is used as it is, still warm.
    let mut a = strs(&args);
    let i = a.iter().position(|x| *x == "--cache-size").unwrap();
    a.drain(i..i + 2);
    let s = Server::start(&a, &t.sock);
    assert!(num(&s.export_stats(), "persist_fragments_restored") > 0);
    assert!(s.term().success());
}

#[test]
fn a_failed_start_leaves_no_cache_file_and_bad_intervals_are_refused() {
    let t = setup();
    random_file(&t.src, 16 * MIB, 9);
    // Too small to hold the metadata and one fragment.
    let err = serve_fails(
        &[
            "--source",
            t.src.to_str().unwrap(),
            "--cache",
            t.cache.to_str().unwrap(),
            "--cache-size",
            "64KiB",
            "--allow-buffered",
        ],
        &t.sock,
    );
    assert!(!err.is_empty());
    assert!(!t.cache.exists(), "left behind: {err}");
    let mut a = t.args();
    let i = a.iter().position(|x| x == "50ms").unwrap();
    a[i] = "0s".into();
    let err = serve_fails(&strs(&a), &t.sock);
    assert!(err.contains("at least 10ms"), "{err}");
}

/// Serves with a warm cache, stops the server (SIGTERM or SIGKILL after the writes
/// settled), lets `change` alter the world, restarts, and checks that every byte read is
/// the source's current one. Returns the restarted server's stats.
fn offline_change(
    kill: bool,
    extra: &[&str],
    change: impl FnOnce(&Setup),
    extra_after: &[&str],
) -> serde_json::Value {
    let t = setup();
    let size = 32 * MIB;
    random_file(&t.src, size, 10);
    let owned = t.args();
    let mut args = strs(&owned);
    args.extend_from_slice(extra);
    let s = Server::start(&args, &t.sock);
    warm(&s, &t.sock, size);
    // A write through the cache, so that our own writes are part of the story.
    let c = client(&t.sock);
    c.write_at(3 * MIB, &AlignedBuf::new(64 * 1024)).unwrap();
    drop(c);
    if kill {
        // Let the flusher record the source's identity after the write, then crash.
        std::thread::sleep(Duration::from_millis(600));
        s.kill();
    } else {
        assert!(s.term().success());
    }
    change(&t);
    let owned = t.args();
    let mut args = strs(&owned);
    args.extend_from_slice(extra_after);
    let s = Server::start(&args, &t.sock);
    let want = std::fs::read(&t.src).unwrap();
    let got = read_all(&t.sock, size);
    let bad = (0..size as usize)
        .step_by(4096)
        .filter(|&p| got[p..p + 4096] != want[p..p + 4096])
        .count();
    let st = s.export_stats();
    assert_eq!(bad, 0, "{bad} stale pages after the change; {}", s.log());
    assert!(s.term().success());
    st
}

/// `nbdkit file FILE` on the Unix socket `sock` (replacing a stale one), once it listens.
fn nbdkit_file(sock: &Path, file: &Path) -> std::process::Child {
    let _ = std::fs::remove_file(sock);
    let child = Command::new("nbdkit")
        .args(["-f", "--exit-with-parent", "-U"])
        .arg(sock)
        .arg("file")
        .arg(file)
        .spawn()
        .unwrap();
    common::wait_for(sock);
    child
}

/// Overwrites 1 MiB in the middle of the source, as `dd conv=notrunc` would.
fn overwrite_part(t: &Setup) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&t.src)
        .unwrap();
    f.write_all_at(&vec![0xee; MIB as usize], 5 * MIB).unwrap();
}

#[test]
fn a_source_edited_offline_is_never_served_stale() {
    for kill in [false, true] {
        let st = offline_change(kill, &[], overwrite_part, &[]);
        println!("edited offline, kill={kill}: {st}");
    }
    // Warm restarts still work when nothing changed (SIGTERM, and SIGKILL after settling).
    for kill in [false, true] {
        let st = offline_change(kill, &[], |_| {}, &[]);
        assert!(
            num(&st, "persist_fragments_restored") > 0,
            "kill={kill}: nothing restored though nothing changed: {st}"
        );
    }
}

#[test]
fn a_source_replaced_at_the_same_path_and_size_is_never_served_stale() {
    offline_change(
        false,
        &[],
        |t| {
            let tmp = t.src.with_extension("new");
            random_file(&tmp, 32 * MIB, 11);
            std::fs::rename(&tmp, &t.src).unwrap();
        },
        &[],
    );
}

#[test]
fn a_cache_rolled_back_to_an_older_copy_is_never_served_stale() {
    let t = setup();
    let size = 32 * MIB;
    let mut data = random_file(&t.src, size, 12);
    let args = t.args();
    let s = Server::start(&strs(&args), &t.sock);
    warm(&s, &t.sock, size);
    assert!(s.term().success());
    let copy = t.cache.with_extension("copy");
    std::fs::copy(&t.cache, &copy).unwrap();
    // A second run rewrites cached data, through the cache, and stops cleanly.
    let s = Server::start(&strs(&args), &t.sock);
    let c = client(&t.sock);
    let mut buf = AlignedBuf::new(MIB as usize);
    buf.fill(0x77);
    for i in [1u64, 7, 20] {
        c.write_at(i * MIB, &buf).unwrap();
        data[(i * MIB) as usize..((i + 1) * MIB) as usize].fill(0x77);
    }
    drop(c);
    assert!(s.term().success());
    // Roll the cache back; the source keeps the new bytes.
    std::fs::copy(&copy, &t.cache).unwrap();
    let s = Server::start(&strs(&args), &t.sock);
    let got = read_all(&t.sock, size);
    assert!(got == data, "stale data after a rollback; {}", s.log());
    assert!(
        s.log().contains("older copy"),
        "the rollback was not recognised: {}",
        s.log()
    );
    assert!(s.term().success());
}

#[test]
fn an_nbd_source_with_a_new_generation_is_never_served_stale() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let t = setup();
    let size = 32 * MIB;
    random_file(&t.src, size, 13);
    let nbd_sock = t.src.with_extension("nbd.sock");
    let uri = format!("nbd+unix:///?socket={}", nbd_sock.display());
    let args = |generation: &str| -> Vec<String> {
        let mut a = t.args();
        a[1] = uri.clone();
        a.extend(["--source-generation".into(), generation.into()]);
        a
    };
    let mut nbdkit = nbdkit_file(&nbd_sock, &t.src);
    let s = Server::start(&strs(&args("1")), &t.sock);
    warm(&s, &t.sock, size);
    assert!(s.term().success());
    nbdkit.kill().unwrap();
    nbdkit.wait().unwrap();
    // The export changes while everything is down; the operator bumps the generation.
    overwrite_part(&t);
    let mut nbdkit = nbdkit_file(&nbd_sock, &t.src);
    let s = Server::start(&strs(&args("2")), &t.sock);
    let got = read_all(&t.sock, size);
    assert!(got == std::fs::read(&t.src).unwrap(), "stale: {}", s.log());
    warm(&s, &t.sock, size);
    assert!(s.term().success());
    // The same generation again: trusted, warm.
    let s = Server::start(&strs(&args("2")), &t.sock);
    assert!(num(&s.export_stats(), "persist_fragments_restored") > 0);
    assert!(s.term().success());
    nbdkit.kill().unwrap();
    let _ = nbdkit.wait();
}

#[test]
fn a_live_socket_is_never_taken_over_and_sockets_are_private() {
    let t = setup();
    random_file(&t.src, 16 * MIB, 14);
    // A permissive umask must not make the socket world-writable.
    // SAFETY: umask only changes this process's file-creation mask.
    let old = unsafe { libc::umask(0) };
    let s = Server::start(&strs(&t.args()), &t.sock);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&t.sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    // A second server (its own source and cache) on the same socket path is refused.
    let other = t.src.with_extension("other");
    random_file(&other, 16 * MIB, 15);
    let err = serve_fails(
        &[
            "--source",
            other.to_str().unwrap(),
            "--cache",
            t.cache.with_extension("other").to_str().unwrap(),
            "--cache-size",
            "64MiB",
            "--allow-buffered",
        ],
        &t.sock,
    );
    assert!(
        err.contains(t.sock.to_str().unwrap()),
        "names the path: {err}"
    );
    // The first server still answers on it, with its own data.
    assert!(read_all(&t.sock, 16 * MIB) == std::fs::read(&t.src).unwrap());
    assert!(s.term().success());
}

#[test]
fn an_nbd_source_that_restarts_never_hangs_sce() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let t = setup();
    let size = 16 * MIB;
    let data = random_file(&t.src, size, 16);
    let nbd_sock = t.src.with_extension("nbd.sock");
    let mut nbdkit = nbdkit_file(&nbd_sock, &t.src);
    let mut args = t.args();
    args[1] = format!("nbd+unix:///?socket={}", nbd_sock.display());
    args.extend(["--source-timeout".into(), "5s".into()]);
    let s = Server::start(&strs(&args), &t.sock);
    assert!(read_all(&t.sock, size) == data);
    // The source goes away: reads of what is not cached fail, every time, and never hang.
    nbdkit.kill().unwrap();
    nbdkit.wait().unwrap();
    let sock = t.sock.clone();
    let failures = within("reads while the source is away", 120, move || {
        let c = client(&sock);
        let mut buf = AlignedBuf::new(MIB as usize);
        (0..8)
            .filter(|i| c.read_at((i % 16) * MIB, &mut buf).is_err())
            .count()
    });
    println!("{failures} of 8 reads failed while the source was away (the rest were hits)");
    // It comes back at the same place: everything reads right again.
    let mut nbdkit = nbdkit_file(&nbd_sock, &t.src);
    let sock = t.sock.clone();
    // Requests fail at once until the client's reconnection backoff (at most 5 s) lets it
    // try again; then they succeed. (A read that succeeds may be a hit: only a whole pass
    // without an error says the source is back.)
    let got = within("reads after the source came back", 120, move || loop {
        let c = client(&sock);
        let mut out = vec![0u8; size as usize];
        let mut buf = AlignedBuf::new(MIB as usize);
        let whole = (0..size).step_by(MIB as usize).all(|at| {
            let ok = c.read_at(at, &mut buf).is_ok();
            out[at as usize..(at + MIB) as usize].copy_from_slice(&buf);
            ok
        });
        if whole {
            break out;
        }
        std::thread::sleep(Duration::from_millis(100));
    });
    assert!(got == data, "wrong data after the source came back");
    // Away again: SIGTERM still stops the server.
    nbdkit.kill().unwrap();
    nbdkit.wait().unwrap();
    let st = within("SIGTERM while the source is away", 120, move || s.term());
    println!("sce serve exited with {st} while its source was away");
}
