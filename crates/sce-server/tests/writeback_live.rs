//! Write-back entered and left while an export serves (`sce ctl set mode`), through the
//! admin socket and an NBD client: in write-back an acknowledged write is in the cache and
//! not yet on the source; `flush --to-source`, `clean`, a detach and leaving write-back
//! each put it there; `--no-wait` refuses to leave with dirty data; a shared device and a
//! volatile cache refuse the switch, saying why.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::admin::Request;
use sce_server::{ExportConfig, ServeConfig};
use serde_json::json;
use std::path::Path;

/// An export "w" whose cleaner waits until the log is nearly full (so dirty data stays
/// dirty until a verb cleans it).
fn rig(dir: &Path, persist: bool) -> Rig {
    let e = ExportConfig {
        writeback_low_watermark: Some("90%".into()),
        writeback_high_watermark: Some("95%".into()),
        ..export(dir, "w", true)
    };
    let cfg = ServeConfig {
        exports: vec![e],
        persist,
        ..base_config(dir)
    };
    Rig::start(dir, cfg, false)
}

fn set_mode(mode: &str, no_wait: bool) -> Request {
    Request {
        key: Some("mode".into()),
        value: Some(mode.into()),
        no_wait,
        ..req("set", Some("w"))
    }
}

fn status(rig: &Rig) -> serde_json::Value {
    rig.verb("status", Some("w")).unwrap()["exports"][0].clone()
}

fn dirty(rig: &Rig) -> u64 {
    let s = status(rig);
    s["writeback"]["dirty_bytes"]
        .as_u64()
        .unwrap_or_else(|| panic!("{s}"))
}

/// The bytes of the source file at `off`.
fn on_source(dir: &Path, off: u64, len: usize) -> Vec<u8> {
    let src = std::fs::read(dir.join("w.src")).unwrap();
    src[off as usize..][..len].to_vec()
}

#[test]
fn write_back_keeps_writes_off_the_source_until_leaving_it() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path(), true);
    let r = rig.call(&set_mode("writeback", false)).unwrap();
    assert_eq!(
        (r["mode"].clone(), r["reopened"].clone()),
        (json!("writeback"), json!(true))
    );
    assert_eq!(status(&rig)["mode"], json!("writeback"));
    let client = rig.client("w");
    client.write_at(0, &[5u8; 65536]).unwrap();
    assert!(dirty(&rig) >= 65536, "{}", status(&rig));
    assert_eq!(
        on_source(d.path(), 0, 16),
        stamp(0),
        "not on the source yet"
    );
    let mut b = vec![0u8; 65536];
    client.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 5), "read from the cache");
    // --no-wait: refused with the dirty bytes said, still write-back.
    let e = text(&rig.call(&set_mode("writethrough", true)).unwrap_err());
    assert!(
        e.contains("of write-back data the source lacks: not leaving writeback"),
        "{e}"
    );
    assert_eq!(status(&rig)["mode"], json!("writeback"));
    // Leaving, waiting: drained to the source first.
    let r = rig.call(&set_mode("writethrough", false)).unwrap();
    assert_eq!(r["mode"], json!("writethrough"));
    assert!(r["drained_bytes"].as_u64().unwrap() >= 65536, "{r}");
    assert!(on_source(d.path(), 0, 65536).iter().all(|&x| x == 5));
    client.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 5));
    assert!(status(&rig).get("writeback").is_none() || dirty(&rig) == 0);
}

#[test]
fn flush_to_source_and_clean_write_dirty_data_back() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path(), true);
    rig.call(&set_mode("writeback", false)).unwrap();
    let client = rig.client("w");
    client.write_at(MIB, &[6u8; 8192]).unwrap();
    let clean = Request {
        offset: Some(MIB),
        len: Some(MIB),
        ..req("clean", Some("w"))
    };
    let r = rig.call(&clean).unwrap();
    assert!(r["bytes_written_back"].as_u64().unwrap() >= 8192, "{r}");
    assert!(on_source(d.path(), MIB, 8192).iter().all(|&x| x == 6));
    // (The cleaner goes through the log in order: it may clean more than the range.)
    client.write_at(4 * MIB, &[7u8; 8192]).unwrap();
    assert_eq!(on_source(d.path(), 4 * MIB, 16), stamp(4 * MIB / 4096));
    let mut f = req("flush", Some("w"));
    f.to_source = true;
    let r = rig.call(&f).unwrap();
    assert_eq!(r["flushed"], json!(["w"]));
    assert!(
        r["to_source"][0]["bytes_written_back"].as_u64().unwrap() >= 8192,
        "{r}"
    );
    assert!(on_source(d.path(), 4 * MIB, 8192).iter().all(|&x| x == 7));
    assert_eq!(dirty(&rig), 0);
}

#[test]
fn a_detach_in_write_back_puts_every_write_on_the_source() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path(), true);
    rig.call(&set_mode("writeback", false)).unwrap();
    let client = rig.client("w");
    client.write_at(2 * MIB, &[8u8; 4096]).unwrap();
    assert!(dirty(&rig) > 0);
    let r = rig.verb("detach", Some("w")).unwrap();
    assert_eq!(r["left_clean"], json!(true), "{r}");
    assert!(on_source(d.path(), 2 * MIB, 4096).iter().all(|&x| x == 8));
    let mut b = vec![0u8; 4096];
    client.read_at(2 * MIB, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 8));
    // The attach comes back in write-back, the mode it left in.
    let r = rig.verb("attach", Some("w")).unwrap();
    assert_eq!(r["mode"], json!("writeback"), "{r}");
    client.read_at(2 * MIB, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 8));
}

#[test]
fn a_volatile_cache_refuses_write_back_saying_why() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path(), false);
    assert_eq!(status(&rig)["persistent"], json!(false));
    let e = text(&rig.call(&set_mode("writeback", false)).unwrap_err());
    // Refused by the server before the volume is closed (the engine would refuse the
    // reopen too, later, with a message of its own).
    assert!(
        e.contains("writeback needs a persistent cache (this one runs with --no-persist)"),
        "{e}"
    );
    let s = status(&rig);
    assert_eq!(
        (s["mode"].clone(), s["state"].clone()),
        (json!("writethrough"), json!("active"))
    );
}

#[test]
fn a_shared_device_enters_write_back_only_at_its_start() {
    let d = tempfile::tempdir().unwrap();
    let cache = d.path().join("shared.cache");
    let member = |n: &str| ExportConfig {
        cache: Some(cache.clone()),
        ..export(d.path(), n, true)
    };
    let cfg = ServeConfig {
        exports: vec![member("a"), member("b")],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let mut set = set_mode("writeback", false);
    set.export = Some("a".into());
    let e = text(&rig.call(&set).unwrap_err());
    assert!(e.contains("the cache device is shared with [\"b\"]"), "{e}");
    assert!(e.contains("restart with --mode"), "{e}");
    let st = rig.verb("status", Some("b")).unwrap();
    assert_eq!(st["exports"][0]["mode"], json!("writethrough"));
}

#[test]
fn a_device_started_in_write_back_serves_dirty_data_after_a_restart() {
    let d = tempfile::tempdir().unwrap();
    let e = ExportConfig {
        mode: Some("writeback".into()),
        writeback_low_watermark: Some("90%".into()),
        writeback_high_watermark: Some("95%".into()),
        ..export(d.path(), "w", true)
    };
    let cfg = ServeConfig {
        exports: vec![e],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg.clone(), false);
    rig.client("w").write_at(0, &[9u8; 4096]).unwrap();
    assert!(dirty(&rig) > 0);
    assert!(rig.shut_down().iter().all(|&c| c), "left clean");
    // Still dirty across the restart, read from the cache: the source never had it.
    assert_eq!(on_source(d.path(), 0, 16), stamp(0));
    let dir2 = d.path().join("again");
    std::fs::create_dir(&dir2).unwrap();
    let rig = Rig::start(&dir2, cfg, false);
    let mut b = vec![0u8; 4096];
    rig.client("w").read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 9));
    assert!(dirty(&rig) > 0);
}

#[test]
fn write_back_status_and_metrics_say_what_is_dirty_and_the_tuning() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path(), true);
    let text_of = |rig: &Rig| {
        sce_server::metrics::prometheus(&rig.server, &rig.volumes, &rig.sources, Some(&rig.rates))
    };
    assert!(
        status(&rig).get("writeback").is_none(),
        "write-through has no log in use"
    );
    rig.call(&set_mode("writeback", false)).unwrap();
    rig.client("w").write_at(0, &[1u8; 32768]).unwrap();
    let s = status(&rig);
    let wb = &s["writeback"];
    assert_eq!(wb["low_watermark"], json!(0.9), "{s}");
    assert_eq!(wb["high_watermark"], json!(0.95), "{s}");
    assert_eq!(wb["last_clean_error"], json!(""), "{s}");
    assert!(wb["dirty_bytes"].as_u64().unwrap() >= 32768, "{s}");
    assert_eq!(s["export_dirty_bytes"], wb["dirty_bytes"], "{s}");
    assert_eq!(s["state"], json!("active"));
    let m = text_of(&rig);
    let line = m
        .lines()
        .find(|l| l.starts_with("sce_export_dirty_bytes{export=\"w\"}"))
        .unwrap_or_else(|| panic!("{m}"));
    let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(v >= 32768.0, "{line}");
    assert!(
        m.contains("# TYPE sce_writeback_"),
        "write-back families: {m}"
    );
    let stats = rig.verb("stats", Some("w")).unwrap();
    let e = &stats["exports"]["w"];
    assert!(
        e["writeback_dirty_bytes"].as_u64().unwrap() >= 32768,
        "{stats}"
    );
    // Set at run time: the tuning in status follows.
    let mut set = set_mode("x", false);
    (set.key, set.value) = (Some("writeback-low-watermark".into()), Some("50%".into()));
    let r = rig.call(&set).unwrap();
    assert_eq!(r["writeback_low_watermark"], json!(0.5));
    assert_eq!(status(&rig)["writeback"]["low_watermark"], json!(0.5));
}
