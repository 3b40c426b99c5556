//! Upgrades in place. Issue 44's: a cache device written by the sce before it (format 7, a
//! commit record's copies side by side; `tests/data/README.md` says how it was made) with
//! flushed dirty data in its write-back log, found after a crash, opens under this build:
//! every page reads as it was written, `flush --to-source` writes them all back, and once
//! the log holds nothing a restart gives it its mirror area (format 8). Issue 45's: a cache
//! device whose write-back kept dirty pages in its read slots (format 5, no log; made by
//! be0c79c) drains them to the source at start and is formatted afresh with a log.

mod common;

use common::{ctl, sce_bin, unix_client, Server};
use sce_io::BlockDevice;
use std::io::Read;
use std::path::Path;

const PAGE: u64 = 4096;

/// Generation `g` of page `p`, as the fixture's writer wrote it.
fn page(p: u64, g: u32) -> Vec<u8> {
    let mut b = vec![0u8; PAGE as usize];
    for c in b.chunks_mut(16) {
        c[..4].copy_from_slice(b"UPGR");
        c[4..8].copy_from_slice(&g.to_le_bytes());
        c[8..16].copy_from_slice(&p.to_le_bytes());
    }
    b
}

/// Every page the fixture's writer wrote, as it should read: (page, bytes).
fn expected() -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = (0..64)
        .map(|p| (p, page(p, if p % 2 == 0 { 2 } else { 1 })))
        .collect();
    let mut partial = vec![0u8; PAGE as usize];
    partial[512..1024].fill(0x77);
    out.push((100, partial));
    out
}

fn check_json(cache: &Path) -> serde_json::Value {
    let out = std::process::Command::new(sce_bin())
        .args(["check", "--json"])
        .arg(cache)
        .output()
        .unwrap();
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_format_7_device_with_flushed_dirty_data_opens_reads_and_drains() {
    let d = tempfile::tempdir().unwrap();
    let (cache, src) = fixture("log-format7-1cb482d.cache.gz", d.path());
    let before = check_json(&cache);
    assert_eq!(before["superblock"]["version"], 7, "{before}");
    let sock = d.path().join("s.sock");
    let args = serve_args(d.path(), "writeback");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args, &sock);
    let client = unix_client(&sock, 1);
    let mut b = vec![0u8; PAGE as usize];
    for (p, want) in expected() {
        client.read_at(p * PAGE, &mut b).unwrap();
        assert!(b == want, "page {p} after the upgrade");
    }
    drop(client);
    let (ok, out) = ctl(&sock, &["flush", "--to-source"]);
    assert!(ok, "{out}");
    let on_source = std::fs::read(&src).unwrap();
    for (p, want) in expected() {
        let at = (p * PAGE) as usize;
        assert!(
            on_source[at..at + PAGE as usize] == want[..],
            "page {p} on the source"
        );
    }
    assert!(server.term().success());
    // The log is empty: the next start lays out its mirror area.
    let server = Server::start(&args, &sock);
    let client = unix_client(&sock, 1);
    for (p, want) in expected() {
        client.read_at(p * PAGE, &mut b).unwrap();
        assert!(b == want, "page {p} after the mirror area");
    }
    drop(client);
    assert!(server.term().success());
    let after = check_json(&cache);
    assert_eq!(after["superblock"]["version"], 9, "{after}");
    assert!(
        after["superblock"]["log"]["mirror_blocks"].as_u64() > Some(0),
        "{after}"
    );
}

/// The pages of the slots fixture (`tests/data/README.md`), as they should read: pages 0-63
/// (even ones rewritten), then page 100 with 512 bytes written at 512.
fn slots_expected() -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = (0..64u64)
        .map(|p| {
            let b = if p % 2 == 0 {
                0x80 + p / 2
            } else {
                0x10 + p / 8
            };
            (p, vec![b as u8; PAGE as usize])
        })
        .collect();
    let mut partial = vec![0u8; PAGE as usize];
    partial[512..1024].fill(0x77);
    out.push((100, partial));
    out
}

/// The fixture `name` (`tests/data`) unpacked into `dir`, with a blank 16 MiB source:
/// (cache, source).
fn fixture(name: &str, dir: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cache, src) = (dir.join("cache.img"), dir.join("src.img"));
    let gz = std::fs::File::open(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap();
    let mut img = Vec::new();
    flate2::read::GzDecoder::new(gz)
        .read_to_end(&mut img)
        .unwrap();
    std::fs::write(&cache, &img).unwrap();
    common::sized_file(&src, 16 << 20);
    (cache, src)
}

/// `sce serve`'s arguments for a fixture unpacked into `dir` (`fixture`), in `mode`, with
/// its state in `dir/st`. The volume table names the source as the fixture's writer saw
/// it.
fn serve_args(dir: &Path, mode: &str) -> Vec<String> {
    let p = |n: &str| dir.join(n).to_str().unwrap().to_string();
    [
        "--source".into(),
        p("src.img"),
        "--source-name".into(),
        "/tmp/upg/src.img".into(),
        "--cache".into(),
        p("cache.img"),
        "--mode".into(),
        mode.into(),
        "--state-dir".into(),
        p("st"),
        "--allow-buffered".into(),
    ]
    .into()
}

/// The source's bytes hold every page of `slots_expected`.
fn assert_on_source(src: &Path, what: &str) {
    let on_source = std::fs::read(src).unwrap();
    for (p, want) in slots_expected() {
        let at = (p * PAGE) as usize;
        assert!(
            on_source[at..at + PAGE as usize] == want[..],
            "page {p} on the source {what}"
        );
    }
}

#[test]
fn a_device_with_dirty_data_in_its_slots_drains_at_start_and_gets_a_log() {
    for mode in ["writeback", "writethrough"] {
        let d = tempfile::tempdir().unwrap();
        let (cache, src) = fixture("slots-format5-be0c79c.cache.gz", d.path());
        let before = check_json(&cache);
        assert_eq!(before["superblock"]["version"], 5, "{before}");
        assert!(before["superblock"]["log"].is_null(), "{before}");
        assert_eq!(before["volumes"][0][1]["pages_dirty"], 65, "{before}");
        assert!(std::fs::read(&src).unwrap().iter().all(|&b| b == 0));
        let sock = d.path().join("s.sock");
        let args = serve_args(d.path(), mode);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = Server::start(&args, &sock);
        // Drained before anything was served: the source holds every dirty page.
        assert_on_source(&src, &format!("once {mode} serves"));
        let client = unix_client(&sock, 1);
        let mut b = vec![0u8; PAGE as usize];
        for (p, want) in slots_expected() {
            client.read_at(p * PAGE, &mut b).unwrap();
            assert!(b == want, "page {p} after the upgrade in {mode}");
        }
        drop(client);
        let (ok, out) = ctl(&sock, &["status", "--json"]);
        assert!(ok, "{out}");
        assert!(server.term().success());
        let after = check_json(&cache);
        assert_eq!(after["superblock"]["version"], 9, "{after}");
        assert!(
            after["superblock"]["log"]["blocks"].as_u64() > Some(0),
            "{mode}: {after}"
        );
        assert_eq!(after["volumes"][0][1]["pages_dirty"], 0, "{after}");
        // A second start finds nothing to drain and keeps the layout.
        let server = Server::start(&args, &sock);
        let client = unix_client(&sock, 1);
        for (p, want) in slots_expected() {
            client.read_at(p * PAGE, &mut b).unwrap();
            assert!(b == want, "page {p} after a second start in {mode}");
        }
        drop(client);
        assert!(server.term().success());
        assert_eq!(
            check_json(&cache)["superblock"]["uuid"],
            after["superblock"]["uuid"],
            "{mode}: a second start formatted the device again"
        );
    }
}

/// A dirty page of the slots fixture whose copy is damaged has no sound copy: the start is
/// refused, naming `--discard-dirty`, after writing the sound pages to the source; given up,
/// the start goes ahead, the damaged page reads as the source's bytes and the rest as
/// written.
#[test]
fn a_damaged_dirty_page_in_the_slots_refuses_the_start_until_given_up() {
    let d = tempfile::tempdir().unwrap();
    let (cache, _) = fixture("slots-format5-be0c79c.cache.gz", d.path());
    // Page 0 (its second generation: 0x80 over 4 KiB) is in one place on the device.
    let img = std::fs::read(&cache).unwrap();
    let at = img
        .chunks(PAGE as usize)
        .position(|c| c.iter().all(|&b| b == 0x80))
        .expect("page 0 on the device") as u64;
    common::flip_byte(&cache, at * PAGE + 100);
    let sock = d.path().join("s.sock");
    let args = serve_args(d.path(), "writeback");
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    let listen = format!("unix:{}", sock.display());
    let out = std::process::Command::new(sce_bin())
        .arg("serve")
        .args(&args)
        .args(["--listen", &listen])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started over a damaged dirty page: {err}"
    );
    assert!(
        err.contains("--discard-dirty") && err.contains("no sound copy"),
        "{err}"
    );
    args.extend(["--discard-dirty", "/tmp/upg/src.img"]);
    let server = Server::start(&args, &sock);
    assert!(
        server.log().contains("dropped 0 dirty and 1 lost pages"),
        "{}",
        server.log()
    );
    let client = unix_client(&sock, 1);
    let mut b = vec![0u8; PAGE as usize];
    for (p, want) in slots_expected() {
        client.read_at(p * PAGE, &mut b).unwrap();
        if p == 0 {
            assert!(
                b.iter().all(|&x| x == 0),
                "page 0 is the source's once given up"
            );
        } else {
            assert!(b == want, "page {p}");
        }
    }
    drop(client);
    assert!(server.term().success());
}
