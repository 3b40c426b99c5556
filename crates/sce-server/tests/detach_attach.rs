//! `sce ctl detach` and `attach` while an export serves, through the admin socket and an NBD
//! client: a detached export serves its source alone and counts the writes it sends there;
//! reads see the newest data across the detach and the attach; the attach of the same
//! device is warm less what was written meanwhile; the settings changed at run time stick;
//! verbs that need the cache say it is detached; a device that is another export's source
//! is refused.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::admin::Request;
use sce_server::{ExportConfig, ServeConfig};
use serde_json::json;

fn rig(dir: &std::path::Path) -> Rig {
    let cfg = ServeConfig {
        exports: vec![export(dir, "c", true), export(dir, "u", false)],
        ..base_config(dir)
    };
    Rig::start(dir, cfg, false)
}

fn status_of(rig: &Rig, export: &str) -> serde_json::Value {
    rig.verb("status", Some(export)).unwrap()["exports"][0].clone()
}

fn attach(export: &str, cache: Option<&std::path::Path>) -> Request {
    Request {
        value: cache.map(|c| c.display().to_string()),
        ..req("attach", Some(export))
    }
}

fn range(verb: &str, export: &str, offset: u64, len: u64) -> Request {
    Request {
        offset: Some(offset),
        len: Some(len),
        ..req(verb, Some(export))
    }
}

fn read4k(c: &sce_nbd::NbdClient, off: u64) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    c.read_at(off, &mut b).unwrap();
    b
}

#[test]
fn reads_see_the_newest_data_across_a_detach_and_an_attach() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let client = rig.client("c");
    rig.call(&range("prefetch", "c", 0, 4 * MIB)).unwrap();
    client.write_at(0, &[1u8; 4096]).unwrap();
    let r = rig.verb("detach", Some("c")).unwrap();
    assert_eq!(r["export"], json!("c"));
    assert!(r["cache"].as_str().unwrap().ends_with("c.cache"), "{r}");
    assert_eq!(r["left_clean"], json!(true), "{r}");
    let s = status_of(&rig, "c");
    assert_eq!(
        (s["state"].clone(), s["cached"].clone()),
        (json!("detached"), json!(false))
    );
    assert_eq!(s["writes_while_detached"], json!(0));
    // Detached: the source alone, which has every acknowledged write.
    assert!(read4k(&client, 0).iter().all(|&b| b == 1));
    client.write_at(MIB, &[2u8; 4096]).unwrap();
    client.write_at(3 * MIB, &[3u8; 4096]).unwrap();
    assert_eq!(status_of(&rig, "c")["writes_while_detached"], json!(2));
    let src = std::fs::read(d.path().join("c.src")).unwrap();
    assert!(
        src[MIB as usize..][..4096].iter().all(|&b| b == 2),
        "on the source"
    );
    let r = rig.call(&attach("c", None)).unwrap();
    assert_eq!(r["export"], json!("c"));
    assert!(r["cache"].as_str().unwrap().ends_with("c.cache"), "{r}");
    let s = status_of(&rig, "c");
    assert_eq!(
        (s["state"].clone(), s["cached"].clone()),
        (json!("active"), json!(true))
    );
    // The ranges written while detached are the source's now, never the stale cache's.
    assert!(read4k(&client, MIB).iter().all(|&b| b == 2));
    assert!(read4k(&client, 3 * MIB).iter().all(|&b| b == 3));
    assert!(read4k(&client, 0).iter().all(|&b| b == 1));
    assert_eq!(read4k(&client, 2 * MIB)[..16], stamp(2 * MIB / 4096));
    // Writes after the attach go through the cache again and are read back.
    client.write_at(MIB, &[4u8; 4096]).unwrap();
    assert!(read4k(&client, MIB).iter().all(|&b| b == 4));
}

#[test]
fn an_attach_of_the_same_device_is_warm_less_what_was_written() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.call(&range("prefetch", "c", 0, 4 * MIB)).unwrap();
    rig.verb("detach", Some("c")).unwrap();
    let r = rig.call(&attach("c", None)).unwrap();
    assert_eq!(r["warm"], json!(true), "{r}");
    assert_eq!(r["cold_because"], json!(null), "{r}");
    assert!(r["fragments_restored"].as_u64().unwrap() >= 4, "{r}");
    let e = rig.call(&range("exists", "c", 0, 4 * MIB)).unwrap();
    assert_eq!(e["cached_bytes"], json!(4 * MIB), "{e}");
    // Written while detached: that range is dropped, the rest stays.
    rig.verb("detach", Some("c")).unwrap();
    rig.client("c").write_at(MIB, &[9u8; 4096]).unwrap();
    rig.call(&attach("c", None)).unwrap();
    let e = rig.call(&range("exists", "c", 0, 4 * MIB)).unwrap();
    let cached = e["cached_bytes"].as_u64().unwrap();
    assert!((2 * MIB..4 * MIB).contains(&cached), "{e}");
    let e = rig.call(&range("exists", "c", MIB, 4096)).unwrap();
    assert_eq!(e["cached_bytes"], json!(0), "{e}");
    assert!(read4k(&rig.client("c"), MIB).iter().all(|&b| b == 9));
}

#[test]
fn detach_and_attach_refuse_what_does_not_apply() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let e = |r: &Request| text(&rig.call(r).unwrap_err());
    assert_eq!(e(&req("detach", Some("u"))), "export \"u\" has no cache");
    assert_eq!(e(&req("attach", Some("u"))), "export \"u\" has no cache");
    let why = e(&attach("c", None));
    assert!(
        why.contains("has a cache attached already; detach it first"),
        "{why}"
    );
    rig.verb("detach", Some("c")).unwrap();
    let why = e(&req("detach", Some("c")));
    assert!(why.contains("detached already"), "{why}");
    for verb in ["exists", "prefetch", "evict"] {
        let why = e(&range(verb, "c", 0, 4096));
        assert_eq!(
            why, "export \"c\" has its cache detached (sce ctl attach)",
            "{verb}"
        );
    }
    // Another export's source is never a cache.
    let other = d.path().join("u.src");
    let before = std::fs::read(&other).unwrap();
    let why = e(&attach("c", Some(&other)));
    assert!(why.contains("same storage"), "{why}");
    assert_eq!(std::fs::read(&other).unwrap(), before, "left untouched");
    assert_eq!(status_of(&rig, "c")["state"], json!("detached"));
    // Flush and status still serve it.
    assert_eq!(
        rig.verb("flush", Some("c")).unwrap()["flushed"],
        json!(["c"])
    );
    rig.call(&attach("c", None)).unwrap();
    assert_eq!(status_of(&rig, "c")["state"], json!("active"));
}

#[test]
fn settings_changed_at_run_time_stick_across_a_detach() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let mut set = req("set", Some("c"));
    (set.key, set.value) = (Some("mode".into()), Some("writearound".into()));
    rig.call(&set).unwrap();
    rig.verb("detach", Some("c")).unwrap();
    // Set while detached: kept for the attach.
    (set.key, set.value) = (Some("seq-cutoff".into()), Some("2MiB".into()));
    let r = rig.call(&set).unwrap();
    assert_eq!(r["detached"], json!(true), "{r}");
    let r = rig.call(&attach("c", None)).unwrap();
    assert_eq!(r["settings_kept"], json!(true), "{r}");
    assert_eq!(r["mode"], json!("writearound"), "{r}");
    assert_eq!(r["sequential_cutoff_bytes"], json!(2 * MIB), "{r}");
    assert_eq!(status_of(&rig, "c")["mode"], json!("writearound"));
}

#[test]
fn an_attach_to_a_new_device_starts_cold_after_writes() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    let client = rig.client("c");
    rig.call(&range("prefetch", "c", 0, MIB)).unwrap();
    rig.verb("detach", Some("c")).unwrap();
    client.write_at(0, &[7u8; 4096]).unwrap();
    // Another device, made by hand at the cache's size (an attach never creates one).
    let other = d.path().join("other.cache");
    std::fs::File::create(&other)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let r = rig.call(&attach("c", Some(&other))).unwrap();
    assert!(r["cache"].as_str().unwrap().ends_with("other.cache"), "{r}");
    assert_eq!(r["fragments_restored"], json!(0), "{r}");
    let s = status_of(&rig, "c");
    assert!(s["cache"].as_str().unwrap().ends_with("other.cache"), "{s}");
    assert!(read4k(&client, 0).iter().all(|&b| b == 7));
    // The old device, written meanwhile behind its back: attaching it again forgets it.
    rig.verb("detach", Some("c")).unwrap();
    client.write_at(0, &[8u8; 4096]).unwrap();
    let old = d.path().join("c.cache");
    let r = rig.call(&attach("c", Some(&old))).unwrap();
    assert_eq!(r["warm"], json!(false), "{r}");
    let why = r["cold_because"].as_str().unwrap();
    assert!(
        why.contains("1 write(s) reached the source while the cache was detached"),
        "{why}"
    );
    assert!(read4k(&client, 0).iter().all(|&b| b == 8));
}

#[test]
fn one_export_of_a_shared_device_detaches_while_the_other_serves() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("shared.cache");
    let member = |n: &str| ExportConfig {
        cache: Some(cache.clone()),
        cache_size: Some("32MiB".into()),
        ..export(d.path(), n, true)
    };
    let cfg = ServeConfig {
        exports: vec![member("a"), member("b")],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let (a, b) = (rig.client("a"), rig.client("b"));
    a.write_at(0, &[1u8; 4096]).unwrap();
    b.write_at(0, &[2u8; 4096]).unwrap();
    rig.call(&range("prefetch", "b", 0, MIB)).unwrap();
    rig.verb("detach", Some("a")).unwrap();
    assert_eq!(status_of(&rig, "a")["state"], json!("detached"));
    assert_eq!(status_of(&rig, "b")["state"], json!("active"));
    let e = rig.call(&range("exists", "b", 0, MIB)).unwrap();
    assert_eq!(
        e["cached_bytes"],
        json!(MIB),
        "the sibling keeps its cache: {e}"
    );
    a.write_at(4096, &[3u8; 4096]).unwrap();
    assert!(read4k(&a, 0).iter().all(|&x| x == 1));
    assert!(
        read4k(&b, 0).iter().all(|&x| x == 2),
        "each export its own data"
    );
    rig.call(&attach("a", None)).unwrap();
    assert_eq!(status_of(&rig, "a")["state"], json!("active"));
    assert!(read4k(&a, 4096).iter().all(|&x| x == 3));
    assert!(read4k(&b, 0).iter().all(|&x| x == 2));
    // A shutdown closes the shared volume once, clean.
    assert!(rig.shut_down().iter().all(|&c| c));
}

/// Per block: the version its writer last started writing and the last one acknowledged.
struct Versions {
    started: Vec<std::sync::atomic::AtomicU32>,
    acked: Vec<std::sync::atomic::AtomicU32>,
}

const LOAD_BLOCKS: u64 = 128;

/// What block `i` holds at `version` (0: the source's own bytes).
fn version_bytes(i: u64, version: u32) -> Vec<u8> {
    if version == 0 {
        let mut b = vec![0u8; 4096];
        b[..16].copy_from_slice(&stamp(i));
        return b;
    }
    sce_testkit::stamp::stamped(4096, b"DTAT", i, version)
}

/// Writes versions 1, 2, ... of blocks `blocks` until `stop`.
fn writer(
    c: sce_nbd::NbdClient,
    v: &Versions,
    blocks: std::ops::Range<u64>,
    stop: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering::SeqCst;
    let mut version = 0u32;
    while !stop.load(SeqCst) {
        version += 1;
        for i in blocks.clone() {
            v.started[i as usize].store(version, SeqCst);
            c.write_at(i * 4096, &version_bytes(i, version)).unwrap();
            v.acked[i as usize].store(version, SeqCst);
        }
    }
}

/// Reads every block until `stop`: a read no write overlapped gives exactly the version last
/// acknowledged; one that a write overlapped gives that or a newer one, or a mix (a read
/// racing a write of the same bytes is not atomic), never an older one. Returns the reads.
fn reader(c: sce_nbd::NbdClient, v: &Versions, stop: &std::sync::atomic::AtomicBool) -> u64 {
    use std::sync::atomic::Ordering::SeqCst;
    let (mut reads, mut buf) = (0u64, vec![0u8; 4096]);
    while !stop.load(SeqCst) {
        for i in 0..LOAD_BLOCKS {
            let k = i as usize;
            let (s0, a0) = (v.started[k].load(SeqCst), v.acked[k].load(SeqCst));
            c.read_at(i * 4096, &mut buf).unwrap();
            let s1 = v.started[k].load(SeqCst);
            let got = (a0..=s1).find(|&g| buf == version_bytes(i, g));
            if s0 == a0 && s1 == a0 {
                assert_eq!(
                    got,
                    Some(a0),
                    "block {i}: not the acknowledged version {a0}"
                );
            } else if got.is_none() {
                let older = (0..a0).find(|&g| buf == version_bytes(i, g));
                assert_eq!(older, None, "block {i}: an older version than {a0}");
            }
            reads += 1;
        }
    }
    reads
}

/// Two writers (each its own blocks) and two readers go on while the cache is detached and
/// attached again and again: no read goes back to an older version (see `reader`).
#[test]
fn reads_never_go_back_while_the_cache_comes_and_goes_under_load() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
    use std::sync::Arc;
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.call(&range("prefetch", "c", 0, 4 * MIB)).unwrap();
    let zeros = || (0..LOAD_BLOCKS).map(|_| AtomicU32::new(0)).collect();
    let v = Arc::new(Versions {
        started: zeros(),
        acked: zeros(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    for w in 0..2u64 {
        let (c, v, stop) = (rig.client("c"), v.clone(), stop.clone());
        let blocks = w * LOAD_BLOCKS / 2..(w + 1) * LOAD_BLOCKS / 2;
        threads.push(std::thread::spawn(move || {
            writer(c, &v, blocks, &stop);
            0
        }));
    }
    for _ in 0..2 {
        let (c, v, stop) = (rig.client("c"), v.clone(), stop.clone());
        threads.push(std::thread::spawn(move || reader(c, &v, &stop)));
    }
    for _ in 0..6 {
        rig.verb("detach", Some("c")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        rig.call(&attach("c", None)).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
    }
    stop.store(true, SeqCst);
    let reads: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(reads > 0);
    eprintln!("detach/attach cycles: 6, reads checked: {reads}");
    // At the end, every block reads as its last acknowledged version.
    let (c, mut buf) = (rig.client("c"), vec![0u8; 4096]);
    for i in 0..LOAD_BLOCKS {
        c.read_at(i * 4096, &mut buf).unwrap();
        assert!(
            buf == version_bytes(i, v.acked[i as usize].load(SeqCst)),
            "block {i}"
        );
    }
}

#[test]
fn too_many_ranges_written_while_detached_make_the_attach_cold() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.call(&range("prefetch", "c", 0, 8 * MIB)).unwrap();
    rig.verb("detach", Some("c")).unwrap();
    let client = rig.client("c");
    // 4097 ranges that neither touch nor merge: one more than are kept.
    for i in 0..4097u64 {
        client.write_at(i * 2048, &[0xEE; 512]).unwrap();
    }
    assert_eq!(status_of(&rig, "c")["writes_while_detached"], json!(4097));
    let r = rig.call(&attach("c", None)).unwrap();
    let why = r["cold_because"].as_str().unwrap_or_else(|| panic!("{r}"));
    assert!(why.contains("over more ranges than are kept"), "{why}");
    assert_eq!(r["fragments_restored"], json!(0), "{r}");
    let e = rig.call(&range("exists", "c", 0, 8 * MIB)).unwrap();
    assert_eq!(e["cached_bytes"], json!(0), "everything forgotten: {e}");
    let mut b = vec![0u8; 4096];
    client.read_at(4096 * 1000, &mut b).unwrap();
    assert!(b[..512].iter().all(|&x| x == 0xEE), "the newest data");
    assert!(
        b[512..2048].iter().all(|&x| x == 0),
        "the source's own bytes"
    );
    assert!(b[2048..2560].iter().all(|&x| x == 0xEE));
}

/// An attach to a path with nothing there does what a start does with the export's
/// settings: it creates the device at the export's `cache_size` and starts cold (nothing
/// to restore), or, without a size, refuses naming the path and creates nothing.
#[test]
fn an_attach_to_a_new_path_creates_the_device_as_a_start_would() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.verb("detach", Some("c")).unwrap();
    let fresh = d.path().join("fresh.cache");
    let r = rig.call(&attach("c", Some(&fresh))).unwrap();
    assert_eq!(r["fragments_restored"], json!(0), "{r}");
    assert_eq!(std::fs::metadata(&fresh).unwrap().len(), 32 * MIB);
    assert!(status_of(&rig, "c")["cache"]
        .as_str()
        .unwrap()
        .ends_with("fresh.cache"));
    // Without a cache size in the export's configuration: refused, nothing created.
    let d2 = tempfile::tempdir().unwrap();
    let mut e = export(d2.path(), "c", true);
    drop(sce_server::group::build_all(&ServeConfig {
        exports: vec![e.clone()],
        ..base_config(d2.path())
    }));
    e.cache_size = None;
    let cfg = ServeConfig {
        exports: vec![e],
        ..base_config(d2.path())
    };
    let rig = Rig::start(d2.path(), cfg, false);
    rig.verb("detach", Some("c")).unwrap();
    let missing = d2.path().join("missing.cache");
    let e = text(&rig.call(&attach("c", Some(&missing))).unwrap_err());
    assert!(
        e.contains("missing.cache does not exist; give a cache size"),
        "{e}"
    );
    assert!(!missing.exists());
    assert_eq!(status_of(&rig, "c")["state"], json!("detached"));
    // The last device is still the one to attach.
    let r = rig.call(&attach("c", None)).unwrap();
    assert!(r["cache"].as_str().unwrap().ends_with("c.cache"), "{r}");
}

/// Another export's cache device is never attached, whether that export holds it now or
/// has it detached: refused naming that export, the device untouched.
#[test]
fn an_attach_onto_another_export_s_cache_is_refused_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        exports: vec![export(d.path(), "a", true), export(d.path(), "b", true)],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    rig.verb("detach", Some("b")).unwrap();
    let a_cache = d.path().join("a.cache");
    for a_detached in [false, true] {
        if a_detached {
            rig.verb("detach", Some("a")).unwrap();
        }
        let before = std::fs::read(&a_cache).unwrap();
        let e = text(&rig.call(&attach("b", Some(&a_cache))).unwrap_err());
        assert!(e.contains("is the cache device of export \"a\""), "{e}");
        assert_eq!(std::fs::read(&a_cache).unwrap(), before, "untouched");
        assert_eq!(status_of(&rig, "b")["state"], json!("detached"));
    }
    rig.call(&attach("a", None)).unwrap();
    rig.call(&attach("b", None)).unwrap();
    assert_eq!(status_of(&rig, "b")["state"], json!("active"));
}

/// `--force`, `--reformat` and `--forget-volume` are for the devices the start found: a
/// later attach never overwrites foreign data it is pointed at, and a reopen (a switch into
/// write-back) never reformats or forgets the device it reopens.
#[test]
fn the_start_s_overrides_do_not_reach_a_later_attach_or_reopen() {
    for (force, reformat, forget_volume) in [(true, false, false), (false, true, true)] {
        let d = tempfile::tempdir().unwrap();
        let cfg = ServeConfig {
            exports: vec![export(d.path(), "c", true)],
            force,
            reformat,
            forget_volume,
            ..base_config(d.path())
        };
        let rig = Rig::start(d.path(), cfg, false);
        rig.call(&range("prefetch", "c", 0, 2 * MIB)).unwrap();
        let mut set = req("set", Some("c"));
        (set.key, set.value) = (Some("mode".into()), Some("writeback".into()));
        assert_eq!(rig.call(&set).unwrap()["reopened"], json!(true));
        let e = rig.call(&range("exists", "c", 0, 2 * MIB)).unwrap();
        assert_eq!(
            e["cached_bytes"],
            json!(2 * MIB),
            "{force} {reformat}: kept: {e}"
        );
        rig.verb("detach", Some("c")).unwrap();
        let precious = d.path().join("precious.img");
        let mut data = vec![0x5Au8; 32 * MIB as usize];
        data[..8].copy_from_slice(b"EXT4DATA");
        std::fs::write(&precious, &data).unwrap();
        let why = text(&rig.call(&attach("c", Some(&precious))).unwrap_err());
        assert!(why.contains("holds data that is not an sce cache"), "{why}");
        assert!(
            std::fs::read(&precious).unwrap() == data,
            "{force} {reformat}: untouched"
        );
        let r = rig.call(&attach("c", None)).unwrap();
        assert!(
            r["fragments_restored"].as_u64().unwrap() >= 4,
            "{force} {reformat}: {r}"
        );
    }
}
