//! `sce ctl set` on a serving export, through the admin socket: the mode and the admission
//! settings change live (status shows them), a bad key or value changes nothing, settings
//! of a shared cache device apply to every export on it, and `--save` writes the new value
//! into the TOML file the server started with, comments kept, checked before anything
//! changes (a value that would not start, an export the file does not declare: refused,
//! nothing changed).

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::admin::Request;
use sce_server::{ExportConfig, ServeConfig};
use serde_json::json;
use std::path::{Path, PathBuf};

fn set(export: &str, key: &str, value: &str, save: bool) -> Request {
    Request {
        key: Some(key.into()),
        value: Some(value.into()),
        save,
        ..req("set", Some(export))
    }
}

fn status_of(rig: &Rig, export: &str) -> serde_json::Value {
    rig.verb("status", Some(export)).unwrap()["exports"][0].clone()
}

#[test]
fn the_mode_switches_live_and_the_data_stays() {
    let d = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        exports: vec![export(d.path(), "c", true)],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let client = rig.client("c");
    client.write_at(0, &[1u8; 4096]).unwrap();
    let r = rig.call(&set("c", "mode", "passthrough", false)).unwrap();
    assert_eq!(r["mode"], json!("passthrough"));
    assert_eq!(r["export"], json!("c"));
    assert_eq!(r["also_applies_to"], json!([]));
    assert_eq!(r["saved_to"], json!(null));
    let s = status_of(&rig, "c");
    assert_eq!(
        (s["state"].clone(), s["mode"].clone()),
        (json!("passthrough"), json!("passthrough"))
    );
    client.write_at(4096, &[2u8; 4096]).unwrap();
    let r = rig.call(&set("c", "mode", "writearound", false)).unwrap();
    assert_eq!(r["mode"], json!("writearound"));
    let s = status_of(&rig, "c");
    assert_eq!(
        (s["state"].clone(), s["mode"].clone()),
        (json!("active"), json!("writearound"))
    );
    let mut b = vec![0u8; 8192];
    client.read_at(0, &mut b).unwrap();
    assert!(b[..4096].iter().all(|&x| x == 1) && b[4096..].iter().all(|&x| x == 2));
    let r = rig.call(&set("c", "admission", "always", false)).unwrap();
    assert_eq!(r["admission"], json!("always"));
    assert_eq!(status_of(&rig, "c")["admission"], json!("always"));
    let r = rig.call(&set("c", "seq-cutoff", "8MiB", false)).unwrap();
    assert_eq!(r["sequential_cutoff_bytes"], json!(8 * MIB));
    let r = rig
        .call(&set("c", "population-rate", "16MiB", false))
        .unwrap();
    assert_eq!(r["population_rate_bytes_per_second"], json!(16 * MIB));
    assert_eq!(r["population_rate_adaptive"], json!(false));
}

#[test]
fn a_bad_set_changes_nothing_and_says_why() {
    let d = tempfile::tempdir().unwrap();
    let cfg = ServeConfig {
        exports: vec![export(d.path(), "c", true), export(d.path(), "u", false)],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg, false);
    let e = |r: &Request| text(&rig.call(r).unwrap_err());
    assert_eq!(e(&req("set", Some("c"))), "set needs a key and a value");
    let mut only_key = req("set", Some("c"));
    only_key.key = Some("mode".into());
    assert_eq!(e(&only_key), "set needs a key and a value");
    assert!(
        e(&set("c", "hot-window", "3", false)).starts_with("cannot set \"hot-window\" at run time")
    );
    assert!(e(&set("c", "mode", "sideways", false)).contains("sideways"));
    assert_eq!(
        e(&set("u", "mode", "passthrough", false)),
        "export \"u\" has no cache"
    );
    // --save without a file: refused before anything changed.
    let why = e(&set("c", "mode", "passthrough", true));
    assert!(
        why.starts_with("--save: this server was started without --config"),
        "{why}"
    );
    assert!(why.ends_with("(nothing was changed)"), "{why}");
    assert_eq!(status_of(&rig, "c")["mode"], json!("writethrough"));
}

/// A server of exports "a" (cached) and "b" (cached) declared in the TOML file `sce.toml`
/// in `dir` (its text returned), or given by the command line for those in `cli_only`.
fn from_file(dir: &Path, cli_only: &[&str]) -> (Rig, PathBuf) {
    let f = dir.join("sce.toml");
    let mut text = String::from("# the server\nlisten = [\"unix:/unused.sock\"]\n");
    let mut cfg = base_config(dir);
    for n in ["a", "b"] {
        let e = export(dir, n, true);
        if cli_only.contains(&n) {
            cfg.exports.push(e);
            continue;
        }
        text.push_str(&format!(
            "\n[[export]]\nname = \"{n}\"\nsource = \"{}\"   # the LUN\ncache = \"{}\"\n\
             cache_size = \"32MiB\"\nawt = true\n",
            e.source,
            e.cache.unwrap().display()
        ));
    }
    std::fs::write(&f, text).unwrap();
    let file = sce_server::ConfigFile::load(&f).unwrap();
    cfg.merge_file(file).unwrap();
    cfg.config_file = Some(f.clone());
    (Rig::start(dir, cfg, false), f)
}

fn file_export(f: &Path, i: usize) -> toml::Value {
    let v: toml::Value = toml::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
    v["export"][i].clone()
}

#[test]
fn save_writes_the_named_export_keeping_comments() {
    let d = tempfile::tempdir().unwrap();
    let (rig, f) = from_file(d.path(), &[]);
    let r = rig
        .call(&set("a", "population-rate", "64MiB", true))
        .unwrap();
    assert_eq!(
        r["saved_to"],
        json!(std::fs::canonicalize(&f).unwrap().display().to_string())
    );
    rig.call(&set("a", "mode", "writearound", true)).unwrap();
    rig.call(&set("a", "sequential-cutoff", "8MiB", true))
        .unwrap();
    let got = std::fs::read_to_string(&f).unwrap();
    assert!(
        got.contains("# the server") && got.contains("# the LUN"),
        "{got}"
    );
    let a = file_export(&f, 0);
    assert_eq!(a["population_rate"].as_str(), Some("64MiB"));
    assert_eq!(a["mode"].as_str(), Some("writearound"));
    assert_eq!(a["sequential_cutoff"].as_str(), Some("8MiB"));
    assert!(a.get("awt").is_none(), "saving a mode drops awt: {got}");
    let b = file_export(&f, 1);
    assert!(b.get("mode").is_none() && b.get("awt").is_some(), "{got}");
    // What was saved is what runs.
    assert_eq!(status_of(&rig, "a")["mode"], json!("writearound"));
    assert_eq!(status_of(&rig, "b")["mode"], json!("writethrough"));
    // A value that would not start: refused, neither saved nor applied.
    rig.call(&set("a", "writeback-high-watermark", "50%", true))
        .unwrap();
    let e = text(
        &rig.call(&set("a", "writeback-low-watermark", "80%", true))
            .unwrap_err(),
    );
    assert!(e.contains("would not start"), "{e}");
    assert!(file_export(&f, 0).get("writeback_low_watermark").is_none());
    let kept = std::fs::read_to_string(&f).unwrap();
    assert!(ServeConfig::default()
        .merge_file(sce_server::ConfigFile::load(&f).unwrap())
        .is_ok());
    assert_eq!(kept, std::fs::read_to_string(&f).unwrap());
}

#[test]
fn save_refuses_an_export_the_file_does_not_declare_changing_nothing() {
    let d = tempfile::tempdir().unwrap();
    let (rig, f) = from_file(d.path(), &["b"]);
    let before = std::fs::read_to_string(&f).unwrap();
    let e = text(
        &rig.call(&set("b", "mode", "passthrough", true))
            .unwrap_err(),
    );
    assert!(e.contains("not declared"), "{e}");
    assert_eq!(
        status_of(&rig, "b")["mode"],
        json!("writethrough"),
        "not applied"
    );
    assert_eq!(std::fs::read_to_string(&f).unwrap(), before, "not written");
    // Without --save it applies.
    rig.call(&set("b", "mode", "passthrough", false)).unwrap();
    assert_eq!(status_of(&rig, "b")["mode"], json!("passthrough"));
}

#[test]
fn an_admission_keeps_the_geometry_it_ran_with_and_links_are_followed() {
    let d = tempfile::tempdir().unwrap();
    let e = export(d.path(), "", true);
    let real = d.path().join("real.toml");
    std::fs::write(
        &real,
        format!(
            "export = [{{ name = \"\", source = \"{}\", cache = \"{}\", cache_size = \"32MiB\" }}]\n",
            e.source,
            e.cache.as_ref().unwrap().display()
        ),
    )
    .unwrap();
    let link = d.path().join("sce.toml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let mut cfg = base_config(d.path());
    cfg.merge_file(sce_server::ConfigFile::load(&link).unwrap())
        .unwrap();
    cfg.config_file = Some(link.clone());
    let rig = Rig::start(d.path(), cfg, false);
    rig.call(&set("", "admission", "always", true)).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let v: toml::Value = toml::from_str(&std::fs::read_to_string(&real).unwrap()).unwrap();
    let e = &v["export"][0];
    assert_eq!(e["admission"].as_str(), Some("always"));
    // The default geometry under admission sce: 1 MiB fragments in 512 KiB lines.
    assert_eq!(e["fragment_size"].as_str(), Some("1MiB"), "{v}");
    assert_eq!(e["line_size"].as_str(), Some("512KiB"), "{v}");
    let mut names: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".toml") || n.contains(".toml."))
        .collect();
    names.sort();
    assert_eq!(names, ["real.toml", "sce.toml"], "no temporary file left");
}

/// Exports "a" and "b" on one cache device.
fn shared_cfg(dir: &Path) -> ServeConfig {
    let cache = dir.join("shared.cache");
    let member = |n: &str| ExportConfig {
        cache: Some(cache.clone()),
        cache_size: Some("32MiB".into()),
        ..export(dir, n, true)
    };
    ServeConfig {
        exports: vec![member("a"), member("b")],
        ..base_config(dir)
    }
}

#[test]
fn a_setting_of_a_shared_device_applies_to_every_export_on_it() {
    let d = tempfile::tempdir().unwrap();
    let rig = Rig::start(d.path(), shared_cfg(d.path()), false);
    let s = status_of(&rig, "a");
    assert_eq!(s["shared_with"], json!(["b"]), "{s}");
    let r = rig.call(&set("a", "mode", "writearound", false)).unwrap();
    assert_eq!(r["also_applies_to"], json!(["b"]));
    assert_eq!(status_of(&rig, "b")["mode"], json!("writearound"));
    let r = rig.call(&set("b", "admission", "always", false)).unwrap();
    assert_eq!(r["also_applies_to"], json!(["a"]));
    assert_eq!(status_of(&rig, "a")["admission"], json!("always"));
}

/// Saves from two connections at once, of two keys of one export: one at a time, so the
/// file ends with both, loadable, and no save is lost.
#[test]
fn concurrent_saves_do_not_lose_each_other() {
    let d = tempfile::tempdir().unwrap();
    let (rig, f) = from_file(d.path(), &[]);
    let ctl = rig.ctl.clone();
    let ctl2 = ctl.clone();
    let a = std::thread::spawn(move || {
        for i in 1..=6u64 {
            let r =
                sce_server::admin::call(&ctl, &set("a", "seq-cutoff", &format!("{i}MiB"), true));
            r.unwrap();
        }
    });
    let b = std::thread::spawn(move || {
        for i in 1..=6u64 {
            let r = sce_server::admin::call(
                &ctl2,
                &set("a", "population-rate", &format!("{}MiB", i * 10), true),
            );
            r.unwrap();
        }
    });
    a.join().unwrap();
    b.join().unwrap();
    let e = file_export(&f, 0);
    assert_eq!(e["sequential_cutoff"].as_str(), Some("6MiB"), "{e}");
    assert_eq!(e["population_rate"].as_str(), Some("60MiB"), "{e}");
    let mut cfg = ServeConfig::default();
    cfg.merge_file(sce_server::ConfigFile::load(&f).unwrap())
        .unwrap();
    let st = rig.verb("status", Some("a")).unwrap();
    assert_eq!(
        st["exports"][0]["population_rate_limit_bytes_per_second"],
        json!(60 * MIB)
    );
}
