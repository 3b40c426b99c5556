//! Two exports on one cache device (a TOML file names the same cache for both), through
//! `sce serve`: fio verify on both at once, then writers on both with a log of every
//! acknowledged write, SIGKILL amid the writes, restart: both come back warm and no block
//! reads as anything but its last acknowledged write (or the one in flight at the kill).
//! `forget` of one leaves the other's cached data and hit ratio alone; `detach` and
//! `attach` of one leave the other attached; `sce check` reports both volumes.

mod common;

use common::Server;
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::BlockDevice;
use sce_nbd::{NbdClient, NbdUri};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;

const MIB: u64 = 1 << 20;
const BLOCK: u64 = 4096;
/// (name, size) of the two exports.
const EXPORTS: [(&str, u64); 2] = [("a", 24 * MIB), ("b", 16 * MIB)];

fn ctl(sock: &Path, args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("ctl")
        .arg("-s")
        .arg(sock)
        .arg("--json")
        .args(args)
        .env_remove("SCE_CTL")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sce ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn client(sock: &Path, export: &str) -> NbdClient {
    let uri = NbdUri::Unix {
        socket: sock.to_path_buf(),
        name: export.to_string(),
    };
    NbdClient::connect(&uri, 1).unwrap()
}

/// nbdkit serving a file, killed on drop.
struct Nbdkit(std::process::Child);

impl Drop for Nbdkit {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sources (random bytes in files, each served by nbdkit: the SAN volumes; an NBD
/// source's identity is not changed by our own writes, so a restart after a SIGKILL amid
/// writes can be warm) and the config file naming one cache for both exports.
fn setup(d: &Path) -> (PathBuf, Vec<Nbdkit>) {
    let mut toml = String::new();
    let mut kits = Vec::new();
    for (i, (name, size)) in EXPORTS.iter().enumerate() {
        let src = d.join(format!("{name}.img"));
        let mut data = vec![0u8; *size as usize];
        SmallRng::seed_from_u64(i as u64).fill(&mut data[..]);
        std::fs::write(&src, &data).unwrap();
        let ksock = d.join(format!("{name}.nbdkit"));
        let kit = Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(&ksock)
            .arg("file")
            .arg(&src)
            .spawn()
            .unwrap();
        kits.push(Nbdkit(kit));
        common::wait_for(&ksock);
        toml += &format!(
            "[[export]]\nname = \"{name}\"\nsource = \"nbd+unix:///?socket={}\"\ncache = \"{}\"\nfragment_size = \"256KiB\"\n{}\n",
            ksock.display(),
            d.join("cache").display(),
            if i == 0 {
                "cache_size = \"16MiB\"\n"
            } else {
                "cache_share = \"50%\"\n"
            }
        );
    }
    let cfg = d.join("sce.toml");
    std::fs::write(&cfg, toml).unwrap();
    (cfg, kits)
}

fn start(d: &Path, cfg: &Path) -> Server {
    Server::start(
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--state-dir",
            d.to_str().unwrap(),
            "--allow-buffered",
            "--metadata-interval",
            "200ms",
        ],
        &d.join("s.sock"),
    )
}

fn export_status(sock: &Path, name: &str) -> serde_json::Value {
    ctl(sock, &["status", name])["exports"][0].clone()
}

/// Reads all of an export twice, the second pass's hit ratio (by the export's own counts).
fn pass_hit_ratio(sock: &Path, name: &str, c: &NbdClient, size: u64) -> f64 {
    let mut buf = vec![0u8; 256 * 1024];
    let mut read = || {
        let mut at = 0;
        while at < size {
            c.read_at(at, &mut buf).unwrap();
            at += buf.len() as u64;
        }
    };
    read();
    let s0 = export_status(sock, name);
    read();
    let s1 = export_status(sock, name);
    let f = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap();
    let reads = f(&s1, "export_read_requests") - f(&s0, "export_read_requests");
    let hits = f(&s1, "export_read_hit_ratio") * f(&s1, "export_read_requests")
        - f(&s0, "export_read_hit_ratio") * f(&s0, "export_read_requests");
    hits / reads
}

/// A block stamped with (export, block, version).
fn stamp(export: u64, block: u64, version: u64) -> Vec<u8> {
    let mut b = vec![0u8; BLOCK as usize];
    for (i, w) in b.chunks_mut(8).enumerate() {
        let x = (export << 56) ^ (block << 24) ^ (version << 4) ^ i as u64;
        w.copy_from_slice(&x.to_le_bytes());
    }
    b
}

/// Per export: the last acknowledged version of each block written (0: never), and a
/// version in flight when the server died.
type Log = Vec<(Vec<u64>, Option<(u64, u64)>)>;

#[test]
fn two_exports_share_a_cache_device() {
    if !sce_testkit::require_known_tool("fio") || !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (cfg, _kits) = setup(d.path());
    let sock = d.path().join("s.sock");
    let server = start(d.path(), &cfg);
    let st = ctl(&sock, &["status"]);
    assert_eq!(st["exports"][0]["shared_with"], serde_json::json!(["b"]));
    assert_eq!(st["exports"][1]["shared_with"], serde_json::json!(["a"]));
    let human = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("ctl")
        .arg("-s")
        .arg(&sock)
        .arg("status")
        .env_remove("SCE_CTL")
        .output()
        .unwrap();
    let human = String::from_utf8_lossy(&human.stdout);
    assert!(
        human.contains("with b (the figures above are the device's)")
            && human.contains("this export"),
        "{human}"
    );
    // fio verify on both exports at once, through population and eviction (24 + 16 MiB
    // of data, a 16 MiB cache).
    let fio: Vec<_> = EXPORTS
        .iter()
        .map(|(name, size)| {
            Command::new("fio")
                .current_dir(d.path())
                .args([
                    &format!("--name=v{name}"),
                    "--ioengine=nbd",
                    &format!("--uri=nbd+unix:///{name}?socket={}", sock.display()),
                    "--rw=randrw",
                    "--bs=4k",
                    "--iodepth=8",
                    &format!("--size={size}"),
                    "--io_size=12M",
                    "--verify=crc32c",
                    "--verify_fatal=1",
                    "--randrepeat=0",
                    "--output-format=terse",
                ])
                .output_async()
        })
        .collect();
    for (f, (name, _)) in fio.into_iter().zip(EXPORTS) {
        let out = f.join().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "fio on {name} failed:\n{text}");
        assert!(!text.contains("verify: bad"), "{text}");
    }
    // fio's verify pattern is the export's content now: the model starts from it.
    let mut base: Vec<Vec<u8>> = Vec::new();
    for (name, size) in EXPORTS {
        let c = client(&sock, name);
        let mut b = vec![0u8; size as usize];
        c.read_at(0, &mut b).unwrap();
        base.push(b);
    }
    // Warm both, then writers on both, and a SIGKILL amid their writes.
    for (name, size) in EXPORTS {
        let c = client(&sock, name);
        let mut r = 0.0;
        for _ in 0..50 {
            r = pass_hit_ratio(&sock, name, &c, size);
            if r > 0.3 {
                break;
            }
        }
        assert!(r > 0.3, "export {name} never warmed: {r}");
    }
    // b, read all over and over, holds at most its share: half the device (plus a
    // fragment per core shard of rounding).
    let cb = client(&sock, "b");
    for _ in 0..5 {
        pass_hit_ratio(&sock, "b", &cb, EXPORTS[1].1);
    }
    let sb = export_status(&sock, "b");
    let (held, device) = (
        sb["export_cached_bytes"].as_u64().unwrap(),
        sb["cache_bytes"].as_u64().unwrap(),
    );
    assert!(
        held > 0 && held <= device / 2 + 4 * 256 * 1024,
        "b holds {held} of {device} bytes with a 50% share"
    );
    // A few metadata rounds make the records durable.
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = EXPORTS
        .iter()
        .enumerate()
        .map(|(k, &(name, size))| {
            let (c, stop) = (client(&sock, name), stop.clone());
            std::thread::spawn(move || {
                let mut acked = vec![0u64; (size / BLOCK) as usize];
                let mut rng = SmallRng::seed_from_u64(k as u64 + 10);
                let mut v = 0;
                while !stop.load(Relaxed) {
                    v += 1;
                    let blk = rng.gen_range(0..size / BLOCK);
                    if c.write_at(blk * BLOCK, &stamp(k as u64, blk, v)).is_err() {
                        return (acked, Some((blk, v)));
                    }
                    acked[blk as usize] = v;
                }
                (acked, None)
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    server.kill();
    stop.store(true, Relaxed);
    let log: Log = writers.into_iter().map(|w| w.join().unwrap()).collect();
    let written: usize = log
        .iter()
        .map(|l| l.0.iter().filter(|&&v| v > 0).count())
        .sum();
    assert!(written > 100, "the writers wrote {written} blocks");
    // Restart: both warm, nothing stale. Slots written within the write-hot hold were
    // dropped by their intents and are filled again from the source in the background
    // (`refill.rs`): wait for that (no time limit is asserted; a generous bound on the
    // polling only keeps a hang from running for ever).
    let server = start(d.path(), &cfg);
    let mut pending = u64::MAX;
    for _ in 0..600 {
        let s = ctl(&sock, &["stats"]);
        pending = EXPORTS
            .iter()
            .map(|(n, _)| s["exports"][n]["persist_refill_pending"].as_u64().unwrap())
            .max()
            .unwrap();
        if pending == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(pending, 0, "the refill never ended\n{}", server.log());
    let st = ctl(&sock, &["status"]);
    for (k, (name, size)) in EXPORTS.iter().enumerate() {
        let e = &st["exports"][k];
        assert!(
            e["export_cached_bytes"].as_u64().unwrap() > MIB,
            "export {name} is cold after the restart: {e}\n{}",
            server.log()
        );
        let c = client(&sock, name);
        let mut got = vec![0u8; *size as usize];
        c.read_at(0, &mut got).unwrap();
        let (acked, inflight) = &log[k];
        let mut stale = 0;
        for blk in 0..size / BLOCK {
            let at = (blk * BLOCK) as usize;
            let now = &got[at..at + BLOCK as usize];
            let want = match acked[blk as usize] {
                0 => base[k][at..at + BLOCK as usize].to_vec(),
                v => stamp(k as u64, blk, v),
            };
            let in_flight = inflight
                .filter(|f| f.0 == blk)
                .is_some_and(|f| now == stamp(k as u64, blk, f.1));
            if now != want && !in_flight {
                stale += 1;
            }
        }
        assert_eq!(stale, 0, "export {name}: blocks not as last acknowledged");
    }
    eprintln!(
        "{written} blocks written before the SIGKILL; both exports warm after it, none stale"
    );
    // Forget b: a keeps every cached byte and its hit ratio.
    let (ca, cb) = (client(&sock, "a"), client(&sock, "b"));
    ctl(&sock, &["prefetch", "--export", "a", "0", "8MiB"]);
    let hit_a = pass_hit_ratio(&sock, "a", &ca, 8 * MIB);
    let cached_a = export_status(&sock, "a")["export_cached_bytes"]
        .as_u64()
        .unwrap();
    let f = ctl(&sock, &["forget", "b"]);
    assert!(f["fragments_dropped"].as_u64().unwrap() > 0, "{f}");
    assert_eq!(export_status(&sock, "b")["export_cached_bytes"], 0);
    // (Population still running from a's reads may add to it, never take away.)
    let after = export_status(&sock, "a")["export_cached_bytes"]
        .as_u64()
        .unwrap();
    assert!(
        after >= cached_a,
        "a held {cached_a} bytes, {after} after forget b"
    );
    let hit_a2 = pass_hit_ratio(&sock, "a", &ca, 8 * MIB);
    eprintln!("export a's hit ratio {hit_a:.3} before forget b, {hit_a2:.3} after");
    // Not all of it: a's share of the 16 MiB device, and population still running from the
    // fio phase, leave 0.78-0.94 of its 256 KiB reads whole hits (seven runs on a 2-CPU
    // machine); without the prefetch it would be near 0.
    assert!(hit_a > 0.6, "a's prefetched 8 MiB hit {hit_a}");
    assert!(hit_a2 >= 0.99 * hit_a, "{hit_a2} after, {hit_a} before");
    // Detach b, write to it, attach it again: a stays attached; b is cold and current.
    ctl(&sock, &["prefetch", "--export", "b", "0", "1MiB"]);
    let det = ctl(&sock, &["detach", "b"]);
    assert_eq!(det["left_clean"], false, "{det}");
    assert_eq!(export_status(&sock, "a")["state"], "active");
    let new = stamp(1, 3, 999_999);
    cb.write_at(3 * BLOCK, &new).unwrap();
    // A setting given to detached b is the shared device's at once (a has it too), and
    // entering write-back, which a shared device chooses at its start, is refused.
    let set = ctl(&sock, &["set", "b", "admission", "nhit:3"]);
    assert_eq!(
        (&set["admission"], &set["detached"]),
        (&"nhit:3".into(), &true.into()),
        "{set}"
    );
    assert_eq!(export_status(&sock, "a")["admission"], "nhit:3");
    let out = common::ctl_output(&sock, &["set", "b", "mode", "writeback"]);
    assert!(!out.status.success());
    let att = ctl(&sock, &["attach", "b"]);
    assert_eq!(att["warm"], false, "{att}");
    assert_eq!(att["admission"], "nhit:3", "{att}");
    let mut got = vec![0u8; BLOCK as usize];
    cb.read_at(3 * BLOCK, &mut got).unwrap();
    assert_eq!(got, new, "b serves the write made while detached");
    assert!(server.term().success());
    // Both volumes are in the device's table, clean and sound.
    let cache = d.path().join("cache");
    let chk = common::sce_json(&["check", cache.to_str().unwrap(), "--json", "--verify-data"]);
    assert_eq!(chk["superblock"]["state"], "clean", "{chk}");
    assert_eq!(chk["volumes"].as_array().unwrap().len(), 2, "{chk}");
    assert_eq!(chk["data_pages_bad"], 0, "{chk}");
}

/// `Command::output` on a thread.
trait OutputAsync {
    fn output_async(&mut self) -> std::thread::JoinHandle<std::process::Output>;
}

impl OutputAsync for Command {
    fn output_async(&mut self) -> std::thread::JoinHandle<std::process::Output> {
        let child = self
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::spawn(move || child.wait_with_output().unwrap())
    }
}

/// Exports that share a device must agree on what belongs to the device.
#[test]
fn exports_sharing_a_device_must_agree_on_its_settings() {
    if !sce_testkit::require_known_tool("nbdkit") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let (cfg, _kits) = setup(d.path());
    let text = std::fs::read_to_string(&cfg).unwrap();
    // `sce serve` with the config `text`, which must fail: its error.
    let refused = |text: String| {
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_sce"))
            .args(["serve", "--config", cfg.to_str().unwrap(), "--listen"])
            .arg(format!("unix:{}", d.path().join("s.sock").display()))
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = refused(text.replacen("fragment_size = \"256KiB\"", "fragment_size = \"1MiB\"", 1));
    assert!(
        err.contains("share the cache device") && err.contains("cache settings"),
        "{err}"
    );
    let err = refused(text.replace("cache_share = \"50%\"", "cache_share = \"150%\""));
    assert!(err.contains("cache_share"), "{err}");
}
