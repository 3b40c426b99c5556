//! The private control planes (issue 27, items 7 and 8): the admin socket refuses another
//! uid even while the server starts under umask 000, and the metrics endpoint stays small
//! and answers scrapes while clients misbehave. setpriv missing: the racer test skips, or
//! fails under `CI=true` (`sce_testkit`).

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The racer, run as a child of [`another_uid_never_gets_in_during_start`] under setpriv:
/// loops connect() on `$SCE_RACE_PATH` until `$SCE_RACE_STOP` exists (once with
/// `$SCE_RACE_ONCE`), sends a `status`
/// request on every connection it gets, and prints what it got as one JSON line.
#[test]
#[ignore = "run by another_uid_never_gets_in_during_start as another uid"]
fn admin_racer() {
    let (Ok(path), Ok(stop)) = (
        std::env::var("SCE_RACE_PATH"),
        std::env::var("SCE_RACE_STOP"),
    ) else {
        return;
    };
    let (mut attempts, mut connected, mut answered, mut refused) = (0u64, 0u64, 0u64, 0u64);
    let mut last_refusal = String::new();
    let once = std::env::var("SCE_RACE_ONCE").is_ok();
    while if once {
        attempts == 0
    } else {
        !Path::new(&stop).exists()
    } {
        attempts += 1;
        let Ok(c) = UnixStream::connect(&path) else {
            continue;
        };
        connected += 1;
        let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
        if writeln!(&c, r#"{{"verb":"status"}}"#).is_err() {
            continue;
        }
        let mut line = String::new();
        let _ = BufReader::new(&c).read_line(&mut line);
        if line.contains(r#""ok":true"#) {
            answered += 1;
        } else if !line.is_empty() {
            refused += 1;
            last_refusal = line.trim().to_string();
        }
    }
    println!(
        "RACE {}",
        serde_json::json!({"attempts": attempts, "connected": connected,
            "answered": answered, "refused": refused, "last_refusal": last_refusal})
    );
}

/// Starts `sce serve` on a small file, no cache, under umask 000, and waits for its data
/// socket (made after the admin socket); then kills it.
fn start_and_kill(src: &Path, sock: &Path) {
    let _ = std::fs::remove_file(sock);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_sce"));
    cmd.arg("serve")
        .args(["--source", src.to_str().unwrap()])
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .env("SCE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // SAFETY: umask(2) is async-signal-safe and cannot fail.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    while !sock.exists() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("sce serve exited with {st}");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "sce serve did not start"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Item 7: a process of uid 65534 looping connect() on the admin socket's path while
/// `sce serve` starts 200 times (umask 000) never has a request answered.
#[test]
fn another_uid_never_gets_in_during_start() {
    if !sce_testkit::require_known_tool("setpriv") {
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "the racer needs root to run as uid 65534"
        );
        eprintln!("SKIP: not root, so the racer cannot run as another uid");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let src = d.path().join("src");
    std::fs::File::create(&src)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let sock = d.path().join("s.sock");
    let admin: PathBuf = format!("{}.ctl", sock.display()).into();
    let stop = d.path().join("stop");
    let looping = racer(&admin, &stop, false);
    let starts = common::env_or("SCE_RACE_STARTS", 200);
    for _ in 0..starts {
        start_and_kill(&src, &sock);
    }
    std::fs::write(&stop, b"").unwrap();
    let r = race_report(looping);
    println!("{starts} starts under umask 000, racer as uid 65534: {r}");
    assert!(r["attempts"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["answered"], 0, "another uid had requests answered: {r}");

    // The peer check on its own: with the socket opened to everyone by hand, uid 65534
    // connects, is told no in one line, and the server logs it at WARN.
    let s = common::Server::start(&["--source", src.to_str().unwrap()], &sock);
    std::fs::set_permissions(&admin, std::fs::Permissions::from_mode(0o777)).unwrap();
    let r = race_report(racer(&admin, &stop, true));
    println!("connect to a socket chmodded 0777 by hand: {r}");
    assert_eq!(r["connected"], 1, "{r}");
    assert_eq!(r["answered"], 0, "{r}");
    let why = r["last_refusal"].as_str().unwrap();
    assert!(why.contains("permission denied: uid 65534"), "{r}");
    let t0 = Instant::now();
    let warned = || {
        s.log().lines().any(|l| {
            l.contains("WARN") && l.contains("refused a connection") && l.contains("uid 65534")
        })
    };
    while !warned() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(warned(), "{}", s.log());
}

/// The racer as uid 65534 (see [`admin_racer`]).
fn racer(admin: &Path, stop: &Path, once: bool) -> std::process::Child {
    let mut c = Command::new("setpriv");
    c.args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "admin_racer", "--ignored", "--nocapture"])
        .env("SCE_RACE_PATH", admin)
        .env("SCE_RACE_STOP", stop)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if once {
        c.env("SCE_RACE_ONCE", "1");
    }
    c.spawn().unwrap()
}

/// What the racer printed when it ended.
fn race_report(racer: std::process::Child) -> serde_json::Value {
    let out = racer.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("RACE "))
        .unwrap_or_else(|| panic!("the racer said nothing: {text}"));
    serde_json::from_str(line).unwrap()
}

/// A `sce serve` of a small file (no cache) with its metrics endpoint, in `d`.
fn small_server(d: &Path) -> common::Server {
    let src = d.join("src");
    std::fs::File::create(&src)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    common::Server::start(&["--source", src.to_str().unwrap()], &d.join("s.sock"))
}

/// A field of /proc/PID/status in bytes (VmRSS, VmHWM).
fn proc_bytes(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

/// Item 8: `GET /` followed by 1 GiB without a newline: the server cuts the connection
/// early and its peak RSS grows by less than 64 MiB.
#[test]
fn a_gib_request_line_is_cut_off_and_memory_stays_bounded() {
    let d = tempfile::tempdir().unwrap();
    let s = small_server(d.path());
    let before = proc_bytes(s.pid(), "VmRSS:");
    let mut c = std::net::TcpStream::connect(&s.metrics).unwrap();
    c.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
    let chunk = vec![b'a'; 1 << 20];
    let mut sent = 0u64;
    let cut = c.write_all(b"GET /").is_err()
        || loop {
            if sent >= 1 << 30 {
                break false;
            }
            match c.write_all(&chunk) {
                Ok(()) => sent += chunk.len() as u64,
                Err(_) => break true,
            }
        };
    let peak = proc_bytes(s.pid(), "VmHWM:");
    println!(
        "sent {} MiB before the server cut the connection ({cut}); RSS {} MiB before, peak {} MiB",
        sent >> 20,
        before >> 20,
        peak >> 20
    );
    assert!(cut && sent < 1 << 30, "the server read the whole GiB");
    assert!(
        peak < before + (64 << 20),
        "peak RSS {peak} grew over 64 MiB from {before}"
    );
    // Still serving.
    assert!(s.export_stats().is_object());
}

/// Item 8: a scrape is answered while 100 idle connections (half sent nothing, half an
/// unfinished request) are open; they are still open after the answer.
#[test]
fn a_scrape_is_answered_while_100_idle_connections_are_open() {
    let d = tempfile::tempdir().unwrap();
    let s = small_server(d.path());
    let idle: Vec<std::net::TcpStream> = (0..100)
        .map(|i| {
            let mut c = std::net::TcpStream::connect(&s.metrics).unwrap();
            if i % 2 == 1 {
                c.write_all(b"GET /metrics HTTP/1.0\r\n").unwrap();
            }
            c
        })
        .collect();
    let t0 = Instant::now();
    let mut c = std::net::TcpStream::connect(&s.metrics).unwrap();
    // Not a timing assertion: a bound so that the old single-threaded endpoint, which
    // answers after every idle connection's 5 s timeout, fails instead of hanging.
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut resp = String::new();
    let got = std::io::Read::read_to_string(&mut c, &mut resp);
    let latency = t0.elapsed();
    println!("scrape answered in {latency:?} with 100 idle connections open");
    got.unwrap();
    assert!(resp.starts_with("HTTP/1.0 200"), "{resp}");
    assert!(resp.contains("sce_"), "{resp}");
    // The ordering: every idle connection is still open (a read would block, not see EOF).
    let open = idle
        .iter()
        .filter(|c| {
            c.set_nonblocking(true).unwrap();
            let mut b = [0u8; 1];
            matches!(std::io::Read::read(&mut &**c, &mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
        .count();
    println!("{open} of 100 idle connections still open after the scrape");
    assert_eq!(
        open, 100,
        "the scrape waited for idle connections to be closed"
    );
}
