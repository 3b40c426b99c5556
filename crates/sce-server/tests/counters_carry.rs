//! An export's counters are the server's life's, not its current volume's: a detach and an
//! attach, or a switch into write-back and out (each closes the volume and opens another),
//! carry the closed volume's counters, so that /stats, status and every Prometheus counter
//! never go back. And the admin protocol's request on the wire, as `sce ctl` sends it.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::admin::Request;
use sce_server::ServeConfig;
use serde_json::json;

fn rig(dir: &std::path::Path) -> Rig {
    let cfg = ServeConfig {
        exports: vec![export(dir, "c", true)],
        ..base_config(dir)
    };
    Rig::start(dir, cfg, false)
}

/// The export's counter `key` in /stats, through the admin socket.
fn counter(rig: &Rig, key: &str) -> u64 {
    let s = rig.verb("stats", Some("c")).unwrap();
    s["exports"]["c"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key}: {s}"))
}

/// The value of the Prometheus sample `name{export="c"}`.
fn sample(rig: &Rig, name: &str) -> f64 {
    let m = sce_server::metrics::prometheus(&rig.server, &rig.volumes, &rig.sources, None);
    let head = format!("{name}{{export=\"c\"}} ");
    let line = m.lines().find(|l| l.starts_with(&head));
    line.unwrap_or_else(|| panic!("{head}: {m}"))[head.len()..]
        .parse()
        .unwrap()
}

fn read_blocks(rig: &Rig, n: u64) {
    let c = rig.client("c");
    let mut b = vec![0u8; 4096];
    for i in 0..n {
        c.read_at(i * 4096, &mut b).unwrap();
        assert_eq!(b[..16], stamp(i));
    }
}

#[test]
fn counters_never_go_back_across_a_detach_and_an_attach() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    rig.call(&Request {
        offset: Some(0),
        len: Some(MIB),
        ..req("prefetch", Some("c"))
    })
    .unwrap();
    read_blocks(&rig, 32);
    let hits = counter(&rig, "read_pages_hit");
    assert!(hits >= 32, "{hits}");
    let total = sample(&rig, "sce_read_hit_pages_total");
    assert_eq!(total, hits as f64);
    rig.verb("detach", Some("c")).unwrap();
    assert_eq!(
        rig.verb("stats", Some("c")).unwrap()["exports"]["c"]["cached"],
        json!(false)
    );
    rig.verb("attach", Some("c")).unwrap();
    assert!(
        counter(&rig, "read_pages_hit") >= hits,
        "carried, not reset"
    );
    read_blocks(&rig, 32);
    let after = counter(&rig, "read_pages_hit");
    assert!(after >= hits + 32, "{after} after {hits}");
    assert!(sample(&rig, "sce_read_hit_pages_total") >= after as f64);
    let st = rig.verb("status", Some("c")).unwrap();
    assert!(
        st["exports"][0]["read_pages"].as_u64().unwrap() >= 64,
        "{st}"
    );
    assert_eq!(st["exports"][0]["export_read_requests"], json!(64), "{st}");
}

#[test]
fn counters_never_go_back_across_a_switch_into_write_back_and_out() {
    let d = tempfile::tempdir().unwrap();
    let rig = rig(d.path());
    read_blocks(&rig, 16);
    let missed = counter(&rig, "read_pages_missed");
    assert!(missed >= 16, "{missed}");
    for mode in ["writeback", "writethrough"] {
        let r = rig
            .call(&Request {
                key: Some("mode".into()),
                value: Some(mode.into()),
                ..req("set", Some("c"))
            })
            .unwrap();
        assert_eq!(r["reopened"], json!(true), "{r}");
        assert!(counter(&rig, "read_pages_missed") >= missed, "after {mode}");
        assert!(sample(&rig, "sce_read_missed_pages_total") >= missed as f64);
    }
}

#[test]
fn a_request_on_the_wire_carries_only_what_is_set() {
    let r = req("status", None);
    assert_eq!(serde_json::to_string(&r).unwrap(), r#"{"verb":"status"}"#);
    let full = Request {
        verb: "set".into(),
        export: Some("lun0".into()),
        offset: Some(1),
        len: Some(2),
        key: Some("mode".into()),
        value: Some("writeback".into()),
        to_source: true,
        no_wait: true,
        save: true,
    };
    let text = serde_json::to_string(&full).unwrap();
    assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), full);
    for k in [
        "to_source",
        "no_wait",
        "save",
        "offset",
        "len",
        "key",
        "value",
        "export",
    ] {
        assert!(text.contains(&format!("\"{k}\":")), "{k}: {text}");
    }
    // An older client's line, with only some fields, is read with the rest unset.
    let r: Request = serde_json::from_str(r#"{"verb":"flush","to_source":true}"#).unwrap();
    assert_eq!(
        (r.verb.as_str(), r.to_source, r.save, r.export),
        ("flush", true, false, None)
    );
}
