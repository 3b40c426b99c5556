//! The admin socket `sce ctl` talks to, on a server assembled in process: one JSON request
//! per line and one reply per line; `status`, `stats`, `flush`, `exists`, `prefetch`,
//! `evict`, `forget`; requests it cannot serve (malformed, unknown verb, a range out of the
//! export, an export without a cache, too long) get an error saying why, and the same
//! connection and the server keep serving.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::admin::{self, Request, MAX_CLIENTS};
use serde_json::json;
use std::os::unix::net::UnixStream;

/// A server of a cached export "c" and an uncached one "u".
fn two(dir: &std::path::Path) -> Rig {
    let cfg = sce_server::ServeConfig {
        exports: vec![export(dir, "c", true), export(dir, "u", false)],
        ..base_config(dir)
    };
    Rig::start(dir, cfg, false)
}

fn range(verb: &str, export: &str, offset: u64, len: u64) -> Request {
    Request {
        offset: Some(offset),
        len: Some(len),
        ..req(verb, Some(export))
    }
}

#[test]
fn status_tells_each_export_s_state_and_settings() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let s = rig.verb("status", None).unwrap();
    assert_eq!(s["version"], json!(env!("CARGO_PKG_VERSION")));
    let ex = s["exports"].as_array().unwrap();
    assert_eq!(ex.len(), 2);
    let (c, u) = (&ex[0], &ex[1]);
    assert_eq!(
        (c["name"].as_str(), u["name"].as_str()),
        (Some("c"), Some("u"))
    );
    assert_eq!(c["size_bytes"], json!(SOURCE));
    assert_eq!(
        (c["cached"].clone(), c["state"].clone()),
        (json!(true), json!("active"))
    );
    assert_eq!(
        (u["cached"].clone(), u["state"].clone()),
        (json!(false), json!("uncached"))
    );
    assert_eq!(c["mode"], json!("writethrough"));
    assert_eq!(c["admission"], json!("sce"));
    assert_eq!(c["persistent"], json!(true));
    assert_eq!(c["read_only"], json!(false));
    assert_eq!(
        (
            c["line_size_bytes"].clone(),
            c["fragment_size_bytes"].clone()
        ),
        (json!(512 << 10), json!(1 << 20))
    );
    assert!(c["cache"].as_str().unwrap().ends_with("c.cache"), "{c}");
    assert!(c["cache_bytes"].as_u64().unwrap() > 0, "{c}");
    assert_eq!(c["occupancy_bytes"], json!(0));
    assert_eq!(c["source"]["up"], json!(true), "{c}");
    assert_eq!(u["source"]["up"], json!(true), "{u}");
    // One export by name; an unknown one is an error that lists the exports.
    let s = rig.verb("status", Some("u")).unwrap();
    let only: Vec<_> = s["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["name"].clone())
        .collect();
    assert_eq!(only, [json!("u")]);
    let e = rig.verb("status", Some("zz")).unwrap_err().to_string();
    assert_eq!(e, "no export \"zz\" (exports: \"c\", \"u\")");
}

#[test]
fn stats_count_what_clients_do_per_export() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let client = rig.client("c");
    let mut b = vec![0u8; 4096];
    for i in 0..8u64 {
        client.read_at(i * 4096, &mut b).unwrap();
        assert_eq!(b[..16], stamp(i));
    }
    client.write_at(0, &[5u8; 4096]).unwrap();
    let s = rig.verb("stats", None).unwrap();
    assert!(s["requests"].as_u64().unwrap() >= 9, "{s}");
    assert_eq!(s["open_connections"], json!(1));
    let ex = s["exports"].as_object().unwrap();
    assert_eq!(ex.keys().collect::<Vec<_>>(), ["c", "u"]);
    assert_eq!(ex["u"]["cached"], json!(false));
    let c = &ex["c"];
    assert_eq!(
        (c["cached"].clone(), c["state"].clone()),
        (json!(true), json!("active"))
    );
    assert!(
        c.get("read_hit_ratio").is_some() && c.get("persist_uuid").is_some(),
        "{c}"
    );
    let st = rig.verb("status", Some("c")).unwrap();
    let e = &st["exports"][0];
    assert_eq!(e["export_read_requests"], json!(8), "{e}");
    assert!(e["read_pages"].as_u64().unwrap() >= 8, "{e}");
    // One export only.
    let s = rig.verb("stats", Some("u")).unwrap();
    assert_eq!(
        s["exports"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["u"]
    );
    let e = rig.verb("stats", Some("nope")).unwrap_err().to_string();
    assert!(e.starts_with("no export \"nope\""), "{e}");
}

#[test]
fn malformed_requests_get_errors_and_the_connection_keeps_serving() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let replies = rig.raw(&[
        "this is not json",
        r#"{"verb":"dance"}"#,
        r#"{"export":"c"}"#,
        r#"{"verb":"exists"}"#,
        r#"{"verb":"exists","export":"c"}"#,
        r#"{"verb":"exists","export":"c","offset":0,"len":16777217}"#,
        r#"{"verb":"evict","export":"c","offset":18446744073709551615,"len":2}"#,
        r#"{"verb":"prefetch","export":"u","offset":0,"len":4096}"#,
        r#"{"verb":"forget","export":"u"}"#,
        r#"{"verb":"status","export":"c","colour":"red"}"#,
    ]);
    let err = |i: usize| -> String {
        assert_eq!(replies[i]["ok"], json!(false), "{}", replies[i]);
        replies[i]["error"].as_str().unwrap().to_string()
    };
    assert!(err(0).starts_with("bad request: "), "{}", err(0));
    assert!(
        err(1).starts_with("unknown verb \"dance\" (status, stats, flush"),
        "{}",
        err(1)
    );
    assert!(
        err(2).starts_with("bad request: ") && err(2).contains("verb"),
        "{}",
        err(2)
    );
    assert_eq!(err(3), "name the export: \"c\", \"u\"");
    assert_eq!(err(4), "exists needs an offset and a length");
    assert_eq!(
        err(5),
        "exists: the range 0+16777217 is out of range: the export has 16777216 bytes"
    );
    assert!(
        err(6).starts_with("evict: the range 18446744073709551615+2 is out of range"),
        "{}",
        err(6)
    );
    assert_eq!(err(7), "export \"u\" has no cache");
    assert_eq!(err(8), "export \"u\" has no cache");
    // Unknown fields are ignored; the same connection still answers.
    assert_eq!(replies[9]["ok"], json!(true), "{}", replies[9]);
    assert_eq!(replies[9]["result"]["exports"][0]["name"], json!("c"));
}

#[test]
fn a_request_line_too_long_closes_only_its_connection() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    use std::io::{BufRead, BufReader, Read, Write};
    let c = UnixStream::connect(&rig.ctl).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .unwrap();
    let long = format!(
        "{{\"verb\":\"status\",\"export\":\"{}\"}}\n",
        "x".repeat(70 << 10)
    );
    // The server may close before it read everything: a broken pipe here is its answer.
    let _ = (&c).write_all(long.as_bytes());
    let mut r = BufReader::new(&c);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let v: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v, json!({"ok": false, "error": "request too long"}));
    let mut rest = Vec::new();
    let _ = r.read_to_end(&mut rest);
    assert!(
        !String::from_utf8_lossy(&rest).contains("\"ok\""),
        "closed after the refusal"
    );
    // The server serves the next connection.
    assert_eq!(
        rig.verb("status", Some("c")).unwrap()["exports"][0]["name"],
        json!("c")
    );
}

#[test]
fn prefetch_exists_evict_and_forget_act_on_the_cache() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let r = rig.call(&range("exists", "c", 0, 2 * MIB)).unwrap();
    assert_eq!(r["cached_bytes"], json!(0), "{r}");
    let r = rig.call(&range("prefetch", "c", 0, 2 * MIB)).unwrap();
    assert_eq!(
        (r["export"].clone(), r["offset"].clone(), r["len"].clone()),
        (json!("c"), json!(0), json!(2 * MIB))
    );
    assert_eq!(r["cached_bytes"], json!(2 * MIB), "{r}");
    assert_eq!(r["fetched_bytes"], json!(2 * MIB), "{r}");
    assert_eq!(r["short_because"], json!(null), "{r}");
    // A second prefetch fetches nothing.
    let r = rig.call(&range("prefetch", "c", 0, 2 * MIB)).unwrap();
    assert_eq!(r["fetched_bytes"], json!(0), "{r}");
    let r = rig.call(&range("exists", "c", 0, 4 * MIB)).unwrap();
    assert_eq!(r["cached_bytes"], json!(2 * MIB), "{r}");
    let frags = r["fragments"].as_array().unwrap();
    let cached: u64 = frags
        .iter()
        .map(|f| f["cached_bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(cached, 2 * MIB, "{r}");
    assert!(
        frags
            .iter()
            .all(|f| f["offset"].as_u64().unwrap() < 2 * MIB),
        "{r}"
    );
    // A cached read is a hit and reads the source's data.
    let client = rig.client("c");
    let mut b = vec![0u8; 4096];
    client.read_at(MIB, &mut b).unwrap();
    assert_eq!(b[..16], stamp(MIB / 4096));
    let st = rig.verb("status", Some("c")).unwrap();
    assert_eq!(st["exports"][0]["occupancy_bytes"], json!(2 * MIB), "{st}");
    assert_eq!(
        st["exports"][0]["export_read_hit_ratio"],
        json!(1.0),
        "{st}"
    );
    let r = rig.call(&range("evict", "c", 0, MIB)).unwrap();
    assert_eq!(r["evicted_bytes"], json!(MIB), "{r}");
    let r = rig.call(&range("exists", "c", 0, 4 * MIB)).unwrap();
    assert_eq!(r["cached_bytes"], json!(MIB), "{r}");
    let r = rig.verb("forget", Some("c")).unwrap();
    assert_eq!(r["export"], json!("c"));
    assert!(r["fragments_dropped"].as_u64().unwrap() >= 1, "{r}");
    assert_eq!(r["dirty_pages_kept"], json!(0), "{r}");
    let r = rig.call(&range("exists", "c", 0, 4 * MIB)).unwrap();
    assert_eq!(r["cached_bytes"], json!(0), "{r}");
    // The data is still the source's.
    client.read_at(MIB, &mut b).unwrap();
    assert_eq!(b[..16], stamp(MIB / 4096));
}

#[test]
fn a_prefetch_in_write_around_says_why_it_fetched_nothing() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let mut set = req("set", Some("c"));
    (set.key, set.value) = (Some("mode".into()), Some("passthrough".into()));
    rig.call(&set).unwrap();
    let r = rig.call(&range("prefetch", "c", 0, MIB)).unwrap();
    assert_eq!(r["fetched_bytes"], json!(0), "{r}");
    let why = r["short_because"].as_str().unwrap();
    assert!(
        why.contains("passthrough") && why.contains("nothing is populated"),
        "{why}"
    );
}

#[test]
fn flush_names_what_it_flushed() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    rig.client("u").write_at(0, &[3u8; 4096]).unwrap();
    let r = rig.verb("flush", None).unwrap();
    assert_eq!(r["flushed"], json!(["c", "u"]));
    let r = rig.verb("flush", Some("u")).unwrap();
    assert_eq!(r["flushed"], json!(["u"]));
    let mut to_source = req("flush", Some("c"));
    to_source.to_source = true;
    let r = rig.call(&to_source).unwrap();
    assert_eq!(r["flushed"], json!(["c"]));
    assert_eq!(r["to_source"][0]["bytes_written_back"], json!(0), "{r}");
    assert!(rig.verb("flush", Some("zz")).is_err());
    // The write reached the source file.
    let src = std::fs::read(d.path().join("u.src")).unwrap();
    assert!(src[..4096].iter().all(|&b| b == 3));
}

#[test]
fn with_one_export_requests_need_no_name() {
    let d = tempfile::tempdir().unwrap();
    let cfg = sce_server::ServeConfig {
        exports: vec![export(d.path(), "only", true)],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let r = rig
        .call(&Request {
            offset: Some(0),
            len: Some(4096),
            ..req("prefetch", None)
        })
        .unwrap();
    assert_eq!(r["export"], json!("only"));
    let r = rig.verb("forget", None).unwrap();
    assert_eq!(r["export"], json!("only"));
}

#[test]
fn the_default_export_is_the_one_without_a_name() {
    let d = tempfile::tempdir().unwrap();
    let cfg = sce_server::ServeConfig {
        exports: vec![export(d.path(), "a", true), export(d.path(), "", true)],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let r = rig
        .call(&Request {
            offset: Some(0),
            len: Some(4096),
            ..req("prefetch", None)
        })
        .unwrap();
    assert_eq!(r["export"], json!(""));
    let r = rig.call(&range("exists", "", 0, 4096)).unwrap();
    assert_eq!(r["cached_bytes"], json!(4096), "{r}");
    let r = rig.call(&range("exists", "a", 0, 4096)).unwrap();
    assert_eq!(r["cached_bytes"], json!(0), "{r}");
}

#[test]
fn connections_beyond_the_limit_are_told_to_wait_and_the_rest_served() {
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let held: Vec<UnixStream> = (0..MAX_CLIENTS)
        .map(|_| UnixStream::connect(&rig.ctl).unwrap())
        .collect();
    // Each held connection is served: it answers.
    let first = &held[0];
    use std::io::{BufRead, BufReader, Write};
    writeln!(&*first, r#"{{"verb":"status","export":"u"}}"#).unwrap();
    let mut line = String::new();
    BufReader::new(first).read_line(&mut line).unwrap();
    assert!(line.contains("\"ok\":true"), "{line}");
    wait_until("the over-limit connection is refused", 60, || {
        let v = raw(&rig.ctl, &[r#"{"verb":"status"}"#]);
        v[0]["ok"] == json!(false)
    });
    let v = raw(&rig.ctl, &[r#"{"verb":"status"}"#]);
    let e = v[0]["error"].as_str().unwrap();
    assert_eq!(
        e,
        format!("too many admin connections ({MAX_CLIENTS}); try again")
    );
    drop(held);
    wait_until("a place comes free", 60, || {
        rig.verb("status", Some("u")).is_ok()
    });
}

#[test]
fn the_socket_is_private_refuses_a_second_server_and_goes_with_its_server() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let m = std::fs::metadata(&rig.ctl).unwrap();
    assert!(m.file_type().is_socket());
    assert_eq!(m.mode() & 0o777, 0o600);
    let again = admin::start(
        &rig.ctl,
        admin::AdminAccess::new(None).unwrap(),
        rig.server.clone(),
        (rig.volumes.clone(), rig.sources.clone()),
        rig.rates.clone(),
        (rig.cfg.exports.clone(), None),
    );
    let e = text(&again.err().expect("a live socket is refused"));
    assert!(e.starts_with("admin socket ") && e.contains(".ctl"), "{e}");
    assert!(
        rig.verb("status", None).is_ok(),
        "the first server still answers"
    );
    let ctl = rig.ctl.clone();
    drop(rig);
    assert!(!ctl.exists(), "dropping the server removes its socket");
    let e = text(&admin::call(&ctl, &req("status", None)).unwrap_err());
    assert!(e.contains("is sce serve running?"), "{e}");
}

#[test]
fn a_stale_socket_is_replaced_and_a_regular_file_is_not() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("nbd.sock");
    let ctl = admin::default_path(&sock);
    assert_eq!(ctl, d.path().join("nbd.sock.ctl"));
    // A socket file nobody answers on (its server is gone).
    drop(std::os::unix::net::UnixListener::bind(&ctl).unwrap());
    assert!(ctl.exists());
    let rig = two(d.path());
    assert!(rig.verb("status", None).is_ok());
    drop(rig);
    std::fs::write(&ctl, b"not a socket").unwrap();
    let cfg = sce_server::ServeConfig {
        exports: vec![export(d.path(), "x", false)],
        ..base_config(d.path())
    };
    let e = Rig::try_start(d.path(), cfg, false).err().expect("refused");
    assert!(text(&e).starts_with("admin socket "), "{e}");
    assert_eq!(std::fs::read(&ctl).unwrap(), b"not a socket");
}

/// Without a group the socket is 0600; with `--admin-group` it belongs to the group and is
/// 0660, or the group's members could not even connect. An unknown group is refused.
#[test]
fn the_socket_s_mode_and_group_follow_the_admin_group() {
    use std::os::unix::fs::MetadataExt;
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    // SAFETY: getegid has no preconditions and cannot fail.
    let own = unsafe { libc::getegid() };
    let grouped = d.path().join("grouped.ctl");
    let _admin = admin::start(
        &grouped,
        admin::AdminAccess::new(Some(&own.to_string())).unwrap(),
        rig.server.clone(),
        (rig.volumes.clone(), rig.sources.clone()),
        rig.rates.clone(),
        (rig.cfg.exports.clone(), None),
    )
    .unwrap();
    let m = std::fs::metadata(&grouped).unwrap();
    assert_eq!((m.mode() & 0o777, m.gid()), (0o660, own));
    let r = admin::call(&grouped, &req("status", Some("u"))).unwrap();
    assert_eq!(r["exports"][0]["name"], json!("u"));
    let e = admin::AdminAccess::new(Some("no-such-group-sce")).unwrap_err();
    assert!(text(&e).contains("no-such-group-sce"), "{e}");
    assert!(admin::AdminAccess::new(Some("root")).is_ok());
}

/// Status, stats and exists from several connections at once, while another switches the
/// mode back and forth and a client reads: every request is answered, each reply whole and
/// about the export asked for.
#[test]
fn concurrent_requests_are_each_answered_while_the_mode_switches() {
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::Arc;
    let d = tempfile::tempdir().unwrap();
    let rig = two(d.path());
    let stop = Arc::new(AtomicBool::new(false));
    let mut askers = Vec::new();
    for k in 0..4 {
        let (ctl, stop) = (rig.ctl.clone(), stop.clone());
        askers.push(std::thread::spawn(move || {
            let mut answered = 0;
            while !stop.load(SeqCst) || answered == 0 {
                let r = match k % 3 {
                    0 => admin::call(&ctl, &req("status", Some("c"))).unwrap()["exports"][0]
                        ["name"]
                        .clone(),
                    1 => json!(
                        admin::call(&ctl, &req("stats", Some("c"))).unwrap()["exports"]
                            .as_object()
                            .unwrap()
                            .keys()
                            .next()
                            .unwrap()
                    ),
                    _ => {
                        admin::call(&ctl, &range("exists", "c", 0, MIB)).unwrap()["export"].clone()
                    }
                };
                assert_eq!(r, json!("c"));
                answered += 1;
            }
            answered
        }));
    }
    let client = rig.client("c");
    let mut b = vec![0u8; 4096];
    for (i, mode) in ["passthrough", "writearound", "writethrough"]
        .iter()
        .cycle()
        .take(9)
        .enumerate()
    {
        let mut set = req("set", Some("c"));
        (set.key, set.value) = (Some("mode".into()), Some(mode.to_string()));
        assert_eq!(rig.call(&set).unwrap()["mode"], json!(mode));
        client.read_at(i as u64 * 4096, &mut b).unwrap();
        assert_eq!(b[..16], stamp(i as u64));
    }
    stop.store(true, SeqCst);
    let answered: u64 = askers.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(answered >= 4);
    assert_eq!(
        rig.verb("status", Some("c")).unwrap()["exports"][0]["mode"],
        json!("writethrough")
    );
}
