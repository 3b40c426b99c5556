//! Failing devices under a serving server, put in by the device table (`ServeConfig::devices`):
//! a source that fails makes its export `degraded` in status, /stats and /metrics, with the
//! error and since when, and `active` again once it answers; a cache device that fails its
//! reads makes the export `degraded` while clients still read the source's data; one that
//! fails past the error limit passes everything through (`failed-passthrough`) and refuses
//! mode switches that need it.

mod common;
use common::*;
use sce_io::{BlockDevice, FaultControl, FaultDevice, MemDevice, Op};
use sce_server::admin::Request;
use sce_server::{ExportConfig, ServeConfig};
use serde_json::json;
use std::sync::Arc;

/// A memory device of `size` bytes with faults on command, named `name` in `cfg`'s table,
/// its blocks stamped as a source file's are (when `stamped`).
fn faulty(cfg: &ServeConfig, name: &str, size: u64, stamped: bool) -> Arc<FaultControl> {
    let mem = MemDevice::new(size);
    if stamped {
        for i in 0..size / 4096 {
            let mut b = vec![0u8; 4096];
            b[..16].copy_from_slice(&stamp(i));
            mem.write_at(i * 4096, &b).unwrap();
        }
    }
    let dev = FaultDevice::new(mem);
    let control = dev.control();
    cfg.devices.put(name, Arc::new(dev));
    control
}

fn status_of(rig: &Rig, export: &str) -> serde_json::Value {
    rig.verb("status", Some(export)).unwrap()["exports"][0].clone()
}

#[test]
fn a_failing_source_makes_its_export_degraded_until_it_answers() {
    let d = tempfile::tempdir().unwrap();
    let mut cfg = base_config(d.path());
    let faults = faulty(&cfg, "mem:src", SOURCE, true);
    cfg.exports.push(ExportConfig {
        name: "s".into(),
        source: "mem:src".into(),
        ..ExportConfig::default()
    });
    let rig = Rig::start(d.path(), cfg, true);
    let addr = rig.metrics.clone().unwrap();
    let client = rig.client("s");
    let mut b = vec![0u8; 4096];
    client.read_at(0, &mut b).unwrap();
    assert_eq!(status_of(&rig, "s")["state"], json!("uncached"));
    faults.fail_from(&[Op::Read], 0);
    let e = client.read_at(4096, &mut b).unwrap_err();
    assert_eq!(e.errno(), libc::EIO, "{e}");
    let s = status_of(&rig, "s");
    assert_eq!(s["state"], json!("degraded"), "{s}");
    let why = s["state_reason"].as_str().unwrap();
    assert!(
        why.starts_with("the source is failing (1 failed requests since"),
        "{why}"
    );
    assert_eq!(s["source"]["up"], json!(false));
    assert_eq!(s["source"]["errors"]["read"], json!(1));
    assert!(s["source"]["last_error"].is_string(), "{s}");
    assert!(s["source"]["down_since"].as_f64().unwrap() > 0.0, "{s}");
    let stats = rig.verb("stats", Some("s")).unwrap();
    assert_eq!(
        stats["exports"]["s"]["source"]["up"],
        json!(false),
        "{stats}"
    );
    let m = get(&addr, "/metrics").2;
    assert!(m.contains("sce_source_up{export=\"s\"} 0"), "{m}");
    assert!(
        m.contains("sce_source_errors_total{export=\"s\",op=\"read\"} 1"),
        "{m}"
    );
    // It answers again: up, and the outage is over (its errors stay counted).
    faults.clear();
    client.read_at(4096, &mut b).unwrap();
    assert_eq!(b[..16], stamp(1));
    let s = status_of(&rig, "s");
    assert_eq!(s["state"], json!("uncached"), "{s}");
    assert_eq!(s["source"]["up"], json!(true));
    assert_eq!(s["source"]["down_since"], json!(null));
    assert_eq!(s["source"]["errors"]["read"], json!(1));
    let m = get(&addr, "/metrics").2;
    assert!(m.contains("sce_source_up{export=\"s\"} 1"), "{m}");
}

/// A cached export "c" of a stamped memory source over a memory cache device with faults.
fn cached(d: &std::path::Path, error_limit: u64) -> (Rig, Arc<FaultControl>) {
    let cfg = ServeConfig {
        error_limit,
        ..base_config(d)
    };
    faulty(&cfg, "mem:src", SOURCE, true);
    let faults = faulty(&cfg, "mem:cache", 32 * MIB, false);
    let cfg = ServeConfig {
        exports: vec![ExportConfig {
            name: "c".into(),
            source: "mem:src".into(),
            cache: Some("mem:cache".into()),
            ..ExportConfig::default()
        }],
        ..cfg
    };
    (Rig::start(d, cfg, false), faults)
}

fn prefetch(rig: &Rig, len: u64) {
    let r = rig
        .call(&Request {
            offset: Some(0),
            len: Some(len),
            ..req("prefetch", Some("c"))
        })
        .unwrap();
    assert_eq!(r["cached_bytes"], json!(len), "{r}");
}

#[test]
fn a_cache_device_that_fails_reads_degrades_the_export_but_not_its_data() {
    let d = tempfile::tempdir().unwrap();
    let (rig, faults) = cached(d.path(), 1000);
    prefetch(&rig, 2 * MIB);
    faults.fail_from(&[Op::Read], 0);
    let client = rig.client("c");
    let mut b = vec![0u8; 4096];
    for i in 0..4 {
        client.read_at(i * 4096, &mut b).unwrap();
        assert_eq!(b[..16], stamp(i), "the source's data, not an error");
    }
    let s = status_of(&rig, "c");
    assert_eq!(s["state"], json!("degraded"), "{s}");
    let why = s["state_reason"].as_str().unwrap();
    assert!(why.starts_with("the cache device returned"), "{why}");
    assert!(s["errors"]["cache_read"].as_u64().unwrap() >= 1, "{s}");
    assert!(s["cache_last_error"].is_string(), "{s}");
    assert_eq!(s["source"]["up"], json!(true));
}

#[test]
fn past_the_error_limit_the_cache_passes_everything_through() {
    let d = tempfile::tempdir().unwrap();
    let (rig, faults) = cached(d.path(), 2);
    prefetch(&rig, 2 * MIB);
    faults.fail_from(&[Op::Read, Op::Write], 0);
    let client = rig.client("c");
    let mut b = vec![0u8; 4096];
    for i in 0..64 {
        client.read_at(i * 4096, &mut b).unwrap();
        assert_eq!(b[..16], stamp(i));
    }
    wait_until("the cache disables itself", 60, || {
        status_of(&rig, "c")["state"] == json!("failed-passthrough")
    });
    // Writes go to the source and read back.
    client.write_at(0, &[4u8; 4096]).unwrap();
    client.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 4));
    let set = Request {
        key: Some("mode".into()),
        value: Some("writeback".into()),
        ..req("set", Some("c"))
    };
    let e = text(&rig.call(&set).unwrap_err());
    assert!(
        e.contains("the cache device failed (it passes I/O through)"),
        "{e}"
    );
    let stats = rig.verb("stats", Some("c")).unwrap();
    assert_eq!(
        stats["exports"]["c"]["state"],
        json!("passthrough"),
        "{stats}"
    );
    // A prefetch says why it fetched nothing.
    let r = rig
        .call(&Request {
            offset: Some(4 * MIB),
            len: Some(MIB),
            ..req("prefetch", Some("c"))
        })
        .unwrap();
    let why = r["short_because"].as_str().unwrap_or_default();
    assert!(why.contains("the cache device failed"), "{r}");
}

#[test]
fn exports_of_named_devices_share_one_cache_device_and_keep_their_data_apart() {
    let d = tempfile::tempdir().unwrap();
    let cfg = base_config(d.path());
    faulty(&cfg, "mem:a", SOURCE, true);
    faulty(&cfg, "mem:b", SOURCE, false);
    faulty(&cfg, "mem:cache", 32 * MIB, false);
    let member = |n: &str, src: &str| ExportConfig {
        name: n.into(),
        source: src.into(),
        cache: Some("mem:cache".into()),
        ..ExportConfig::default()
    };
    let cfg = ServeConfig {
        exports: vec![member("a", "mem:a"), member("b", "mem:b")],
        ..cfg
    };
    let rig = Rig::start(d.path(), cfg, false);
    let (a, b) = (rig.client("a"), rig.client("b"));
    let mut buf = vec![0u8; 4096];
    for i in 0..16u64 {
        b.write_at(i * 4096, &[i as u8 + 1; 4096]).unwrap();
    }
    for i in 0..16u64 {
        a.read_at(i * 4096, &mut buf).unwrap();
        assert_eq!(buf[..16], stamp(i), "a reads its own source");
        b.read_at(i * 4096, &mut buf).unwrap();
        assert!(
            buf.iter().all(|&x| x == i as u8 + 1),
            "b reads its own writes"
        );
    }
    let sa = status_of(&rig, "a");
    let sb = status_of(&rig, "b");
    assert_eq!(
        (sa["shared_with"].clone(), sb["shared_with"].clone()),
        (json!(["b"]), json!(["a"]))
    );
    assert_eq!(sa["cache_bytes"], sb["cache_bytes"], "one device");
    // A request past the end of an export never reaches its neighbour's volume.
    let e = b.read_at(SOURCE, &mut buf).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let att = rig.attachable("a");
    let e = att.read_at(SOURCE, &mut buf).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = att.write_at(SOURCE - 2048, &buf).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    rig.attachable("b").read_at(0, &mut buf).unwrap();
    assert!(buf.iter().all(|&x| x == 1), "b's first block is untouched");
}
