//! Write-back's dirty data is the only copy (issue 27): a start that leaves out the export
//! holding it, `--reformat` and `sce format --force` refuse to drop it unless the operator
//! says `--discard-dirty`, and then say at ERROR what they dropped; `sce check` names it.

mod common;

use sce_io::BlockDevice;
use sce_nbd::{NbdClient, NbdUri};
use std::path::Path;
use std::process::{Command, Output};

const MIB: u64 = 1 << 20;

fn sce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(args)
        .env("SCE_LOG", "info")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
}

fn client(sock: &Path, export: &str) -> NbdClient {
    let uri: NbdUri = format!("nbd+unix:///{export}?socket={}", sock.display())
        .parse()
        .unwrap();
    NbdClient::connect(&uri, 1).unwrap()
}

/// `sce serve --config CONFIG` run to its end (a refused start) within 60 s.
fn refused_start(args: &[&str]) -> String {
    let mut all = vec!["serve"];
    all.extend_from_slice(args);
    let o = sce(&all);
    assert!(
        !o.status.success(),
        "the start was not refused: {}",
        text(&o)
    );
    text(&o)
}

/// A TOML file with exports `a` and (if `with_b`) `b` on one write-back cache device.
fn config(d: &Path, with_b: bool) -> std::path::PathBuf {
    let mut t = format!(
        "[[export]]\nname = \"a\"\nsource = \"{0}/a.img\"\ncache = \"{0}/cache.img\"\n\
         cache_size = \"32MiB\"\nmode = \"writeback\"\n",
        d.display()
    );
    if with_b {
        t += &format!(
            "[[export]]\nname = \"b\"\nsource = \"{0}/b.img\"\ncache = \"{0}/cache.img\"\n\
             mode = \"writeback\"\n",
            d.display()
        );
    }
    let p = d.join(if with_b { "both.toml" } else { "a_only.toml" });
    std::fs::write(&p, t).unwrap();
    p
}

fn source_file(p: &Path) {
    common::sized_file(p, 64 * MIB);
}

/// Item 1 of the issue: a restart whose config lacks export `b` used to drop b's dirty data
/// (logged at INFO); now it is refused naming b's volume, and b still reads its writes.
#[test]
fn a_start_that_leaves_out_an_export_with_dirty_data_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a.img"), d.path().join("b.img"));
    source_file(&a);
    source_file(&b);
    let sock = d.path().join("s.sock");
    let state = d.path().join("state");
    let st = state.to_str().unwrap();
    let both = config(d.path(), true);
    let a_only = config(d.path(), false);
    let s = common::Server::start(
        &["--config", both.to_str().unwrap(), "--state-dir", st],
        &sock,
    );
    let data = vec![0xb7u8; 256 * 1024];
    {
        let c = client(&sock, "b");
        c.write_at(0, &data).unwrap();
        c.flush().unwrap();
    }
    s.kill();
    let cache = d.path().join("cache.img");
    let check = text(&sce(&["check", cache.to_str().unwrap()]));
    println!("{check}");
    assert!(check.contains("64 dirty pages"), "check text: {check}");
    assert!(check.contains("only copy"), "check text: {check}");
    let sock_arg = format!("unix:{}", sock.display());
    let listen = ["--listen", sock_arg.as_str(), "--state-dir", st];
    let mut args = vec!["--config", a_only.to_str().unwrap()];
    args.extend_from_slice(&listen);
    let why = refused_start(&args);
    println!("restart without b: {why}");
    let b_name = std::fs::canonicalize(&b).unwrap().display().to_string();
    assert!(why.contains(&b_name) && why.contains("64 dirty"), "{why}");
    assert!(why.contains("--discard-dirty"), "{why}");
    // Nothing was dropped: a start with both reads b's writes.
    let s = common::Server::start(
        &["--config", both.to_str().unwrap(), "--state-dir", st],
        &sock,
    );
    let mut back = vec![0u8; data.len()];
    client(&sock, "b").read_at(0, &mut back).unwrap();
    assert!(back == data, "b lost its dirty data");
    s.kill();
    // With the explicit word the start goes on, and says at ERROR what it dropped.
    let s = common::Server::start(
        &[
            "--config",
            a_only.to_str().unwrap(),
            "--state-dir",
            st,
            "--discard-dirty",
            &b_name,
        ],
        &sock,
    );
    let log = s.log();
    assert!(
        log.lines()
            .any(|l| l.contains("ERROR") && l.contains("64 dirty")),
        "{log}"
    );
    s.term();
    // What was given up stays given up: b, served again, reads its source's bytes, not the
    // dropped writes (through the log, its pages were put out of a replay's reach).
    let s = common::Server::start(
        &["--config", both.to_str().unwrap(), "--state-dir", st],
        &sock,
    );
    client(&sock, "b").read_at(0, &mut back).unwrap();
    let source = std::fs::read(&b).unwrap();
    assert!(
        back[..] == source[..data.len()],
        "b read the dropped writes"
    );
    s.term();
}

/// Item 5: `--reformat` and `sce format --force` used to discard dirty data (INFO only);
/// both are refused now, and go on with `--discard-dirty`.
#[test]
fn reformat_and_format_force_refuse_to_drop_dirty_data() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    source_file(&src);
    let (cache, sock) = (d.path().join("cache.img"), d.path().join("s.sock"));
    let st = d.path().join("state");
    let (srcs, caches, sts) = (
        src.to_str().unwrap(),
        cache.to_str().unwrap(),
        st.to_str().unwrap(),
    );
    let base = [
        "--source",
        srcs,
        "--cache",
        caches,
        "--mode",
        "writeback",
        "--state-dir",
        sts,
        "--allow-buffered",
    ];
    let mut first = base.to_vec();
    first.extend_from_slice(&["--cache-size", "16MiB"]);
    let s = common::Server::start(&first, &sock);
    {
        let c = client(&sock, "");
        c.write_at(0, &vec![0x5a; 256 * 1024]).unwrap();
        c.flush().unwrap();
    }
    s.kill();
    let sock_arg = format!("unix:{}", sock.display());
    // Another fragment size makes the device unusable as it is: --reformat would format it.
    let mut again = base.to_vec();
    again.extend_from_slice(&[
        "--listen",
        &sock_arg,
        "--fragment-size",
        "256KiB",
        "--reformat",
    ]);
    let why = refused_start(&again);
    println!("--reformat: {why}");
    assert!(
        why.contains("64 dirty") && why.contains("--discard-dirty"),
        "{why}"
    );
    let o = sce(&["format", caches, "--source", srcs, "--force"]);
    println!("format --force: {}", text(&o));
    assert!(!o.status.success(), "format --force dropped dirty data");
    assert!(text(&o).contains("64 dirty"), "{}", text(&o));
    // Still there.
    assert!(text(&sce(&["check", caches])).contains("64 dirty pages"));
    let o = sce(&[
        "format",
        caches,
        "--source",
        srcs,
        "--force",
        "--discard-dirty",
        "all",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("ERROR") && text(&o).contains("64 dirty"),
        "{}",
        text(&o)
    );
    assert!(text(&sce(&["check", caches])).contains("0 dirty pages"));
}

/// Item 10: a refused start left the cache file it had just created behind. Refused before
/// anything is created (shared mode with write-back), or after (etcd unreachable), no new
/// cache file remains; an existing one is never removed.
#[test]
fn a_refused_start_leaves_no_cache_file_it_created() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    source_file(&src);
    let cache = d.path().join("new.img");
    let (srcs, caches) = (src.to_str().unwrap(), cache.to_str().unwrap());
    let sock = format!("unix:{}", d.path().join("s.sock").display());
    let st = d.path().join("state");
    let base = [
        "--source",
        srcs,
        "--cache",
        caches,
        "--cache-size",
        "16MiB",
        "--listen",
        &sock,
        "--state-dir",
        st.to_str().unwrap(),
        "--allow-buffered",
        // Nothing listens on port 1: joining shared mode fails after the cache was built.
        "--shared",
        "etcd://127.0.0.1:1/sce",
    ];
    let mut wb = base.to_vec();
    wb.extend_from_slice(&["--mode", "writeback"]);
    let why = refused_start(&wb);
    assert!(why.contains("writethrough"), "{why}");
    assert!(!cache.exists(), "a refused start left {caches} behind");
    let why = refused_start(&base);
    assert!(why.contains("etcd"), "{why}");
    assert!(!cache.exists(), "a refused start left {caches} behind");
    // A cache that existed before the refused start stays.
    common::sized_file(&cache, 16 * MIB);
    refused_start(&base);
    assert!(
        cache.exists(),
        "a refused start removed a cache it did not create"
    );
}

/// nbdkit serving a memory source whose every write fails: nothing gets cleaned, so dirty
/// pages stay dirty however slow the machine is. Killed when dropped.
struct FailingSource(std::process::Child);

impl FailingSource {
    fn start(sock: &Path) -> FailingSource {
        let kit = FailingSource(
            Command::new("nbdkit")
                .args(["-f", "-U"])
                .arg(sock)
                .args(["--filter=error", "memory", "64M", "error-pwrite-rate=100%"])
                .spawn()
                .unwrap(),
        );
        common::wait_for(sock);
        kit
    }
}

impl Drop for FailingSource {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sce ctl -s SOCK ARGS`: (success, stdout and stderr).
fn ctl(sock: &Path, args: &[&str]) -> (bool, String) {
    let o = common::ctl_output(sock, args);
    (o.status.success(), text(&o))
}

/// Forget (`sce ctl forget` at run time, `--forget-volume` at start) drops clean data only:
/// write-back's dirty pages stay, through a crash and a restart, and the reply says how
/// many were kept (it used to say only "forgot N fragments", as if everything went).
#[test]
fn forget_keeps_dirty_data_and_says_so() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (ksock, sock) = (d.path().join("src.sock"), d.path().join("s.sock"));
    let _kit = FailingSource::start(&ksock);
    let a = d.path().join("a.img");
    source_file(&a);
    let b_uri = format!("nbd+unix:///?socket={}", ksock.display());
    let toml = d.path().join("wb.toml");
    std::fs::write(
        &toml,
        format!(
            "[[export]]\nname = \"a\"\nsource = \"{0}/a.img\"\ncache = \"{0}/cache.img\"\n\
             cache_size = \"32MiB\"\nmode = \"writeback\"\n\
             [[export]]\nname = \"b\"\nsource = \"{b_uri}\"\nsource_name = \"vol-b\"\n\
             cache = \"{0}/cache.img\"\nmode = \"writeback\"\n",
            d.path().display()
        ),
    )
    .unwrap();
    let state = d.path().join("state");
    let args = [
        "--config",
        toml.to_str().unwrap(),
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let s = common::Server::start(&args, &sock);
    let data = vec![0xb7u8; 256 * 1024];
    let c = client(&sock, "b");
    c.write_at(0, &data).unwrap();
    c.flush().unwrap();
    let (ok, out) = ctl(&sock, &["--json", "forget", "b"]);
    println!("ctl forget b: {out}");
    assert!(ok, "{out}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["dirty_pages_kept"], 64, "{v}");
    assert_eq!(v["lost_pages_kept"], 0, "{v}");
    let (ok, out) = ctl(&sock, &["forget", "b"]);
    assert!(ok && out.contains("kept 64 dirty page(s)"), "{out}");
    let mut back = vec![0u8; data.len()];
    c.read_at(0, &mut back).unwrap();
    assert!(back == data, "forget dropped b's dirty data");
    drop(c);
    s.kill();
    // The forgets' records (a new generation) did not make the restart drop them either.
    let mut again = args.to_vec();
    again.push("--forget-volume");
    let s = common::Server::start(&again, &sock);
    let mut back = vec![0u8; data.len()];
    client(&sock, "b").read_at(0, &mut back).unwrap();
    assert!(
        back == data,
        "a restart after forget dropped b's dirty data"
    );
    s.kill();
    let check = text(&sce(&[
        "check",
        d.path().join("cache.img").to_str().unwrap(),
    ]));
    assert!(check.contains("64 dirty pages"), "{check}");
}

/// Item 10: a start refused after its cache was built, by a listener that cannot bind,
/// left the new cache file behind (only a refusal while building the exports removed it).
#[test]
fn a_start_refused_at_its_listener_leaves_no_cache_file_it_created() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    source_file(&src);
    let cache = d.path().join("new.img");
    // A loopback port that is taken for as long as the test runs.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = format!("tcp:{}", taken.local_addr().unwrap());
    let st = d.path().join("state");
    let args = [
        "--source",
        src.to_str().unwrap(),
        "--cache",
        cache.to_str().unwrap(),
        "--cache-size",
        "16MiB",
        "--state-dir",
        st.to_str().unwrap(),
        "--allow-buffered",
        "--listen",
        &listen,
    ];
    let why = refused_start(&args);
    println!("refused: {why}");
    assert!(why.contains("listening on"), "{why}");
    assert!(
        !cache.exists(),
        "a refused start left {} behind",
        cache.display()
    );
    // A cache file that was there before the refused start stays.
    let s = common::Server::start(&args[..9], &d.path().join("s.sock"));
    s.term();
    assert!(cache.exists());
    refused_start(&args);
    assert!(
        cache.exists(),
        "a refused start removed a cache it did not create"
    );
}

/// Issue 29: `--mode writeback` gives a cache sce formats a write-back log by default
/// (`sce check` shows it and counts its dirty pages); so does `sce format` (issue 45); a
/// device formatted without one (`--writeback-log 0`) is given one when write-back starts
/// on it (formatted afresh: there is no write-back in the slots since issue 45), and the
/// start says so.
#[test]
fn write_back_gets_a_log_by_default_and_a_device_without_one_is_given_one() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    source_file(&src);
    let (sock, state) = (d.path().join("s.sock"), d.path().join("state"));
    let cache = d.path().join("new.cache");
    let (src_s, st) = (src.to_str().unwrap(), state.to_str().unwrap());
    let args = |cache: &Path| {
        let c = cache.to_str().unwrap().to_string();
        vec![
            "--source".to_string(),
            src_s.into(),
            "--cache".into(),
            c,
            "--cache-size".into(),
            "64MiB".into(),
            "--mode".into(),
            "writeback".into(),
            "--state-dir".into(),
            st.into(),
            "--allow-buffered".into(),
        ]
    };
    let a = args(&cache);
    let s = common::Server::start(&a.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &sock);
    let c = client(&sock, "");
    c.write_at(0, &vec![0x5au8; 64 * 1024]).unwrap();
    c.flush().unwrap();
    assert!(!s_warned(&s.log()), "{}", s.log());
    s.kill();
    let check = text(&sce(&["check", cache.to_str().unwrap()]));
    println!("{check}");
    assert!(check.contains("write-back log: 16.00 MiB"), "{check}");
    assert!(check.contains("in the log: 16 dirty, 0 lost"), "{check}");
    // A device formatted without a log: given one at the write-back start, with a warning.
    let old = d.path().join("old.cache");
    let f = sce(&[
        "format",
        old.to_str().unwrap(),
        "--source",
        src_s,
        "--cache-size",
        "64MiB",
        "--writeback-log",
        "0",
    ]);
    assert!(f.status.success(), "{}", text(&f));
    let a = args(&old);
    let s = common::Server::start(&a.iter().map(|x| x.as_str()).collect::<Vec<_>>(), &sock);
    let log = s.log();
    assert!(s_warned(&log), "{log}");
    assert!(s.term().success());
    let check = text(&sce(&["check", old.to_str().unwrap()]));
    assert!(check.contains("write-back log: 16.00 MiB"), "{check}");
}

/// The start-up warning of a device formatted afresh to give write-back its log.
fn s_warned(log: &str) -> bool {
    log.contains("formatted afresh with a write-back log")
}
