//! TLS on TCP against real clients: nbdinfo and nbdcopy (libnbd, GnuTLS) and qemu-img and
//! qemu-io (QEMU's tls-creds-x509), with X.509 certificates made here (rcgen): a client
//! with the CA connects, a plain client is refused by `--tls require`, and with
//! `--tls-client-ca` a client without a certificate is refused.

mod common;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, KeyUsagePurpose};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

struct Pki {
    _dir: tempfile::TempDir,
    /// The server's certificate and key, and the CA.
    server: PathBuf,
    /// A client directory with the CA only (libnbd and QEMU names).
    anon: PathBuf,
    /// A client directory with the CA and a client certificate.
    with_cert: PathBuf,
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let mk = |name: &str| {
        let p = dir.path().join(name);
        std::fs::create_dir(&p).unwrap();
        p
    };
    let (server, anon, with_cert) = (mk("server"), mk("anon"), mk("with-cert"));
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().unwrap();
    let ca = ca.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (scert, skey) = leaf(vec!["localhost".into(), "127.0.0.1".into()]);
    let (ccert, ckey) = leaf(vec!["client".into()]);
    let w = |d: &Path, f: &str, s: &str| std::fs::write(d.join(f), s).unwrap();
    w(&server, "server-cert.pem", &scert);
    w(&server, "server-key.pem", &skey);
    w(&server, "ca-cert.pem", &ca.pem());
    w(&anon, "ca-cert.pem", &ca.pem());
    w(&with_cert, "ca-cert.pem", &ca.pem());
    w(&with_cert, "client-cert.pem", &ccert);
    w(&with_cert, "client-key.pem", &ckey);
    Pki {
        _dir: dir,
        server,
        anon,
        with_cert,
    }
}

/// `sce serve` on tcp:127.0.0.1 (a free port) with `extra` flags; killed on drop.
struct Serve {
    child: Child,
    port: u16,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(src: &Path, extra: &[&str]) -> Serve {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src.to_str().unwrap()])
        .args(["--listen", "tcp:127.0.0.1:0"])
        .args(extra)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let port = loop {
        let l = lines
            .next()
            .expect("sce serve exited before listening")
            .unwrap();
        if let Some(a) = l.split("listening on tcp:").nth(1) {
            break a.trim().rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    // Keep reading the log so that the server never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    Serve { child, port }
}

fn run(cmd: &mut Command) -> Output {
    cmd.stdin(Stdio::null()).output().unwrap()
}

fn text(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr)
}

/// A client run that succeeded and printed `want`.
fn assert_ok_saying(o: &Output, want: &str) {
    assert!(o.status.success() && text(o).contains(want), "{}", text(o));
}

/// A `qemu-io` run that succeeded and whose every `read -P` found its pattern.
fn assert_patterns_verified(o: &Output) {
    assert!(
        o.status.success() && !text(o).contains("Pattern verification failed"),
        "{}",
        text(o)
    );
}

/// `sce serve` over `src` on TCP with `args` fails at its start (exit 1 or 2), its stderr
/// saying `want`.
fn serve_fails(src: &Path, args: &[&str], want: &str) {
    let o = run(Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["serve", "--source", src.to_str().unwrap()])
        .args(["--listen", "tcp:127.0.0.1:0"])
        .args(args));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(matches!(o.status.code(), Some(1 | 2)), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
}

fn nbdinfo(s: &Serve, tls_dir: Option<&Path>) -> Output {
    let uri = match tls_dir {
        Some(d) => format!(
            "nbds://127.0.0.1:{}/?tls-certificates={}",
            s.port,
            d.display()
        ),
        None => format!("nbd://127.0.0.1:{}/", s.port),
    };
    run(Command::new("nbdinfo").arg(uri))
}

/// `qemu-img info` or `qemu-io -c ...` (`args`) over TLS with the credentials in `dir`.
fn qemu(tool: &str, s: &Serve, dir: &Path, args: &[&str]) -> Output {
    let creds = format!(
        "tls-creds-x509,id=tls0,endpoint=client,dir={}",
        dir.display()
    );
    qemu_with(tool, s, &creds, args)
}

/// `qemu(...)` with the QEMU credentials object `creds` (id `tls0`).
fn qemu_with(tool: &str, s: &Serve, creds: &str, args: &[&str]) -> Output {
    let mut c = Command::new(tool);
    if tool == "qemu-img" {
        c.args(args);
    }
    c.arg("--object").arg(creds).arg("--image-opts");
    if tool != "qemu-img" {
        c.args(args);
    }
    run(c.arg(format!(
        "driver=nbd,host=127.0.0.1,port={},tls-creds=tls0",
        s.port
    )))
}

#[test]
fn tls_with_real_clients_and_refusals() {
    for t in ["nbdinfo", "nbdcopy", "qemu-img", "qemu-io"] {
        if !sce_testkit::require_known_tool(t) {
            return;
        }
    }
    let pki = pki();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    common::sized_file(&src, 32 << 20);
    let (cert, key) = (
        pki.server.join("server-cert.pem"),
        pki.server.join("server-key.pem"),
    );
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let cache = d.path().join("cache");
    let s = serve(
        &src,
        &[
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "8MiB",
        ],
    );
    // The CA is enough for a client; it sees TLS and structured replies.
    let o = nbdinfo(&s, Some(&pki.anon));
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("newstyle-fixed with TLS"), "{}", text(&o));
    let o = qemu("qemu-img", &s, &pki.anon, &["info"]);
    assert_ok_saying(&o, "33554432");
    // Data goes through TLS and the cache both ways, checked by pattern.
    let o = qemu(
        "qemu-io",
        &s,
        &pki.anon,
        &[
            "-c",
            "write -P 0x5a 1M 4M",
            "-c",
            "read -P 0x5a 1M 4M",
            "-c",
            "read -P 0 8M 1M",
        ],
    );
    assert_patterns_verified(&o);
    let copy = d.path().join("copy.img");
    let uri = format!(
        "nbds://127.0.0.1:{}/?tls-certificates={}",
        s.port,
        pki.anon.display()
    );
    let o = run(Command::new("nbdcopy").arg(&uri).arg(&copy));
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(&copy).unwrap() == std::fs::read(&src).unwrap());
    // --tls require (the default with a certificate): a plain client is refused.
    let o = nbdinfo(&s, None);
    assert!(
        !o.status.success(),
        "a plain client was served: {}",
        text(&o)
    );
    drop(s);

    // Mutual TLS: only clients with a certificate the CA signed.
    let ca = pki.server.join("ca-cert.pem");
    let s = serve(
        &src,
        &[
            "--tls-cert",
            cert,
            "--tls-key",
            key,
            "--tls-client-ca",
            ca.to_str().unwrap(),
        ],
    );
    let o = nbdinfo(&s, Some(&pki.with_cert));
    assert!(o.status.success(), "{}", text(&o));
    let o = qemu("qemu-img", &s, &pki.with_cert, &["info"]);
    assert!(o.status.success(), "{}", text(&o));
    for o in [
        nbdinfo(&s, Some(&pki.anon)),
        qemu("qemu-img", &s, &pki.anon, &["info"]),
        nbdinfo(&s, None),
    ] {
        assert!(
            !o.status.success(),
            "a client without a certificate was served: {}",
            text(&o)
        );
    }
    drop(s);

    // --tls on: TLS offered, plain clients served too.
    let s = serve(&src, &["--tls", "on", "--tls-cert", cert, "--tls-key", key]);
    for o in [nbdinfo(&s, Some(&pki.anon)), nbdinfo(&s, None)] {
        assert!(o.status.success(), "{}", text(&o));
    }
    let plain = text(&nbdinfo(&s, None));
    assert!(plain.contains("without TLS"), "{plain}");
}

#[test]
fn tls_configuration_errors_are_clear() {
    let pki = pki();
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    common::sized_file(&src, 1 << 20);
    let key = pki.server.join("server-key.pem");
    let fail = |args: &[&str], want: &str| serve_fails(&src, args, want);
    fail(
        &["--tls", "require"],
        "needs --tls-cert FILE and --tls-key FILE",
    );
    // `--tls-cert CERT --tls-key KEY` refused, naming the file at fault.
    let fail_pair = |cert: &Path, key: &Path, want: &str| {
        let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
        fail(&["--tls-cert", cert, "--tls-key", key], want);
    };
    let junk = d.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").unwrap();
    fail_pair(&junk, &key, "junk.pem");
    // The key of another certificate.
    let other = pki.with_cert.join("client-key.pem");
    let cert = pki.server.join("server-cert.pem");
    fail_pair(&cert, &other, "server-cert.pem");
    fail(&["--tls", "sometimes"], "unknown TLS mode");
}

/// A psktool key file with one user's random 32-byte key.
fn psk_file(dir: &Path, user: &str, seed: u8) -> PathBuf {
    let key: String = (0..32u8)
        .map(|i| format!("{:02x}", i.wrapping_mul(37).wrapping_add(seed)))
        .collect();
    let f = dir.join("keys.psk");
    std::fs::write(&f, format!("{user}:{key}\n")).unwrap();
    f
}

/// TLS-PSK as qemu-nbd and nbdkit do it: nbdinfo (libnbd's tls-psk-file), qemu-img and
/// qemu-io (QEMU's tls-creds-psk) connect with the key; a wrong key, no key, and a plain
/// client are refused; data written and read over it is intact.
#[test]
fn tls_psk_with_real_clients_and_refusals() {
    for t in ["nbdinfo", "nbdcopy", "qemu-img", "qemu-io"] {
        if !sce_testkit::require_known_tool(t) {
            return;
        }
    }
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    common::sized_file(&src, 64 << 20);
    let server_dir = d.path().join("server");
    let (good, bad) = (d.path().join("good"), d.path().join("bad"));
    for p in [&server_dir, &good, &bad] {
        std::fs::create_dir(p).unwrap();
    }
    let keys = psk_file(&server_dir, "alice", 1);
    psk_file(&good, "alice", 1);
    psk_file(&bad, "alice", 2);
    let cache = d.path().join("cache");
    let s = serve(
        &src,
        &[
            "--cache",
            cache.to_str().unwrap(),
            "--cache-size",
            "16MiB",
            "--allow-buffered",
            "--tls-psk",
            keys.to_str().unwrap(),
        ],
    );
    let uri = |dir: &Path| {
        format!(
            "nbds://alice@127.0.0.1:{}/?tls-psk-file={}",
            s.port,
            dir.join("keys.psk").display()
        )
    };
    let o = text(&run(Command::new("nbdinfo").arg(uri(&good))));
    assert!(o.contains("with TLS") && o.contains("67108864"), "{o}");
    let psk = |tool: &str, dir: &Path, args: &[&str]| {
        let creds = format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={},username=alice",
            dir.display()
        );
        qemu_with(tool, &s, &creds, args)
    };
    let o = psk("qemu-img", &good, &["info"]);
    assert_ok_saying(&o, "64 MiB");
    let o = psk(
        "qemu-io",
        &good,
        &["-c", "write -P 0x5a 1M 4M", "-c", "read -P 0x5a 1M 4M"],
    );
    assert_patterns_verified(&o);
    // nbdcopy over PSK: byte for byte what the source holds.
    let copy = d.path().join("copy.img");
    let o = run(Command::new("nbdcopy").arg(uri(&good)).arg(&copy));
    assert!(o.status.success(), "{}", text(&o));
    assert!(std::fs::read(&copy).unwrap() == std::fs::read(&src).unwrap());
    // Refused: the wrong key, no key at all, no TLS at all.
    let o = run(Command::new("nbdinfo").arg(uri(&bad)));
    assert!(!o.status.success(), "a wrong key was let in: {}", text(&o));
    let o = psk("qemu-img", &bad, &["info"]);
    assert!(!o.status.success(), "a wrong key was let in: {}", text(&o));
    let o = run(Command::new("nbdinfo").arg(format!("nbds://127.0.0.1:{}/", s.port)));
    assert!(!o.status.success(), "a client without a key was let in");
    let plain = text(&nbdinfo(&s, None));
    assert!(
        !plain.contains("67108864"),
        "a plain client was served: {plain}"
    );
}

#[test]
fn tls_psk_configuration_errors_are_clear() {
    let d = tempfile::tempdir().unwrap();
    let src = d.path().join("src.img");
    common::sized_file(&src, 1 << 20);
    let fail = |args: &[&str], want: &str| serve_fails(&src, args, want);
    let f = d.path().join("keys.psk");
    for (content, want) in [
        ("", "no key in it"),
        ("alice\n", "line 1: expected USERNAME:HEXKEY"),
        ("alice:abc\n", "line 1: the key must be"),
        (":00112233445566778899aabbccddeeff\n", "no username"),
    ] {
        std::fs::write(&f, content).unwrap();
        fail(&["--tls-psk", f.to_str().unwrap()], want);
    }
    fail(
        &["--tls-psk", "/nonexistent/keys.psk"],
        "/nonexistent/keys.psk",
    );
    fail(
        &[
            "--tls-psk",
            f.to_str().unwrap(),
            "--tls-cert",
            "c.pem",
            "--tls-key",
            "k.pem",
        ],
        "cannot be used with",
    );
}
