//! Exports that name one cache device share it (`group::build_all`): one cached volume over
//! their sources, each export its own part and its own data, in the configuration's order
//! whatever the grouping; a group refuses what a lone export refuses (no size for a device
//! that is not there, a source name too long, a bad share) naming the exports, and removes
//! a device file it created when it fails.

mod common;
use common::*;
use sce_io::BlockDevice;
use sce_server::group::build_all;
use sce_server::{ExportConfig, ServeConfig};
use std::path::Path;

fn member(dir: &Path, name: &str, cache: &Path) -> ExportConfig {
    ExportConfig {
        cache: Some(cache.to_path_buf()),
        ..export(dir, name, true)
    }
}

fn refused(cfg: &ServeConfig) -> String {
    match build_all(cfg) {
        Ok(_) => panic!("built"),
        Err(e) => text(&e),
    }
}

#[test]
fn exports_keep_the_configuration_s_order_around_a_group() {
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared.cache");
    let cfg = ServeConfig {
        exports: vec![
            export(d.path(), "plain", false),
            member(d.path(), "g1", &shared),
            export(d.path(), "alone", true),
            member(d.path(), "g2", &shared),
        ],
        ..base_config(d.path())
    };
    let built = build_all(&cfg).unwrap();
    let names: Vec<&str> = built.iter().map(|b| b.export.name.as_str()).collect();
    assert_eq!(names, ["plain", "g1", "alone", "g2"]);
    assert!(built[0].volume.is_none());
    assert!(built[0].export.description.ends_with("(no cache)"));
    let (g1, g2) = (
        built[1].volume.as_ref().unwrap(),
        built[3].volume.as_ref().unwrap(),
    );
    let alone = built[2].volume.as_ref().unwrap();
    assert!(alone.part().is_none());
    assert!(
        std::sync::Arc::ptr_eq(&g1.volume().unwrap(), &g2.volume().unwrap()),
        "one volume"
    );
    assert!(!std::sync::Arc::ptr_eq(
        &g1.volume().unwrap(),
        &alone.volume().unwrap()
    ));
    assert_eq!(g1.part().unwrap().siblings, ["g2"]);
    assert_eq!(g2.part().unwrap().siblings, ["g1"]);
    assert_eq!((g1.part().unwrap().index, g2.part().unwrap().index), (0, 1));
    // Each member's bytes are its own.
    g1.write_at(0, &[1u8; 4096]).unwrap();
    g2.write_at(0, &[2u8; 4096]).unwrap();
    let mut b = vec![0u8; 4096];
    g1.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 1));
    g2.read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 2));
    g2.read_at(4096, &mut b).unwrap();
    assert_eq!(b[..16], stamp(1));
    assert_eq!(g1.size(), SOURCE);
    assert!(std::fs::read(d.path().join("g2.src")).unwrap()[..4096]
        .iter()
        .all(|&x| x == 2));
}

#[test]
fn a_group_refuses_what_a_lone_export_refuses_naming_its_exports() {
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared.cache");
    let no_size = |n: &str| ExportConfig {
        cache_size: None,
        ..member(d.path(), n, &shared)
    };
    let cfg = ServeConfig {
        exports: vec![no_size("a"), no_size("b")],
        ..base_config(d.path())
    };
    let e = refused(&cfg);
    assert!(e.starts_with("exports [\"a\", \"b\"]: cache "), "{e}");
    assert!(
        e.contains("does not exist; give a cache size to create it"),
        "{e}"
    );
    // One size is enough: the device's.
    let cfg = ServeConfig {
        exports: vec![no_size("a"), member(d.path(), "b", &shared)],
        ..base_config(d.path())
    };
    drop(build_all(&cfg).unwrap());
    assert_eq!(std::fs::metadata(&shared).unwrap().len(), 32 * MIB);
    let long = ExportConfig {
        source_name: Some("x".repeat(300)),
        ..member(d.path(), "b", &shared)
    };
    let cfg = ServeConfig {
        exports: vec![member(d.path(), "a", &shared), long],
        ..base_config(d.path())
    };
    let e = refused(&cfg);
    assert!(
        e.starts_with("export \"b\": the source name is longer than"),
        "{e}"
    );
    for bad in ["0%", "150%", "most"] {
        let mut b = member(d.path(), "b", &shared);
        b.cache_share = Some(bad.into());
        let cfg = ServeConfig {
            exports: vec![member(d.path(), "a", &shared), b],
            ..base_config(d.path())
        };
        let e = refused(&cfg);
        assert!(e.contains("export \"b\": cache_share: "), "{bad}: {e}");
    }
}

#[test]
fn a_group_that_fails_removes_the_device_file_it_created() {
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared.cache");
    let mut b = member(d.path(), "b", &shared);
    b.source_name = Some("y".repeat(300));
    let cfg = ServeConfig {
        exports: vec![member(d.path(), "a", &shared), b],
        ..base_config(d.path())
    };
    refused(&cfg);
    assert!(
        !shared.exists(),
        "nothing was created before the sources' names were checked"
    );
    // A failure after the device was created (too small for two fragments): removed.
    let small = |n: &str| ExportConfig {
        cache_size: Some("1MiB".into()),
        ..member(d.path(), n, &shared)
    };
    let cfg = ServeConfig {
        exports: vec![small("a"), small("b")],
        ..base_config(d.path())
    };
    let e = refused(&cfg);
    assert!(e.starts_with("exports [\"a\", \"b\"] sharing "), "{e}");
    assert!(e.contains("fewer than 2 fragments"), "{e}");
    assert!(!shared.exists(), "the file this start created is removed");
    // One that was there stays.
    std::fs::File::create(&shared)
        .unwrap()
        .set_len(MIB)
        .unwrap();
    let cfg = ServeConfig {
        exports: vec![small("a"), small("b")],
        ..base_config(d.path())
    };
    refused(&cfg);
    assert!(shared.exists());
}

#[test]
fn a_group_restarts_warm_with_each_export_s_cached_data() {
    let d = tempfile::tempdir().unwrap();
    let shared = d.path().join("shared.cache");
    let cfg = ServeConfig {
        exports: vec![
            member(d.path(), "a", &shared),
            member(d.path(), "b", &shared),
        ],
        ..base_config(d.path())
    };
    let rig = Rig::start(d.path(), cfg.clone(), false);
    let pre = |e: &str, off: u64| sce_server::admin::Request {
        offset: Some(off),
        len: Some(MIB),
        ..req("prefetch", Some(e))
    };
    rig.call(&pre("a", 0)).unwrap();
    rig.call(&pre("b", 2 * MIB)).unwrap();
    assert_eq!(rig.shut_down(), [true], "one device, shut down once, clean");
    let dir2 = d.path().join("again");
    std::fs::create_dir(&dir2).unwrap();
    let rig = Rig::start(&dir2, cfg, false);
    let exists = |e: &str, off: u64| {
        let r = rig
            .call(&sce_server::admin::Request {
                offset: Some(off),
                len: Some(MIB),
                ..req("exists", Some(e))
            })
            .unwrap();
        r["cached_bytes"].as_u64().unwrap()
    };
    assert_eq!((exists("a", 0), exists("b", 2 * MIB)), (MIB, MIB));
    assert_eq!(
        (exists("a", 2 * MIB), exists("b", 0)),
        (0, 0),
        "nothing crossed over"
    );
}
