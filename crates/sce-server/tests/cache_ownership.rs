//! sce never formats or overwrites what is not its own: a cache path that is (or overlaps)
//! a source, a device holding data that is not an sce cache, a persistent cache about to be
//! used as a volatile one, a file it would have to resize. Each refusal says what it found
//! and which flag overrides it, and leaves the device as it was; a start that fails after
//! creating its cache file removes it again.

mod common;
use common::*;
use sce_io::{BlockDevice, MemDevice};
use sce_server::ownership::{
    canonical_name, contents, contents_at, mark_volatile, refuse_overlaps, storage, Claim,
    Contents, Storage, VOLATILE_HEADER, VOLATILE_MAGIC,
};
use sce_server::{ExportConfig, ServeConfig};
use std::path::Path;

#[test]
fn overlap_of_block_ranges_and_files() {
    let d = |s, e| Storage::Block {
        disk: (8, 0),
        start: s,
        end: e,
    };
    assert!(d(0, 100).overlaps(&d(50, 60)));
    assert!(d(50, 60).overlaps(&d(0, 100)));
    assert!(d(0, 100).overlaps(&d(99, 200)));
    assert!(!d(0, 100).overlaps(&d(100, 200)));
    assert!(!d(100, 200).overlaps(&d(0, 100)));
    let other_disk = Storage::Block {
        disk: (8, 16),
        start: 0,
        end: 100,
    };
    assert!(!d(0, 100).overlaps(&other_disk));
    let f = Storage::File { dev: 1, ino: 2 };
    assert!(f.overlaps(&f.clone()));
    assert!(!f.overlaps(&Storage::File { dev: 1, ino: 3 }));
    assert!(!f.overlaps(&Storage::File { dev: 2, ino: 2 }));
    assert!(!f.overlaps(&d(0, 100)));
    let m = |p: &str| Storage::Missing(p.into());
    assert!(m("/a").overlaps(&m("/a")));
    assert!(!m("/a").overlaps(&m("/b")));
}

fn claim(role: &'static str, p: &Path) -> Claim {
    Claim {
        export: String::new(),
        role,
        path: p.display().to_string(),
    }
}

#[test]
fn same_file_by_another_name_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("src.img");
    std::fs::write(&p, vec![7u8; 4096]).unwrap();
    let link = dir.path().join("alias.img");
    std::fs::hard_link(&p, &link).unwrap();
    let claims = [claim("source", &p), claim("cache", &link)];
    let e = refuse_overlaps(&claims).unwrap_err().to_string();
    assert!(e.contains("same storage"), "{e}");
    // The default export is not named "export \"\"".
    assert!(
        e.contains("the source (") && e.contains("the cache ("),
        "{e}"
    );
    // Two read uses of one source are fine.
    let mut two = claims.clone();
    two[1].role = "source";
    refuse_overlaps(&two).unwrap();
    // Two caches not yet created, by one name: one cache, shared. By a symbolic link to the
    // directory: the same name once canonical.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let via = dir.path().join("via");
    std::os::unix::fs::symlink(&sub, &via).unwrap();
    let (a, b) = (sub.join("new.cache"), via.join("new.cache"));
    assert_eq!(canonical_name(&a), canonical_name(&b));
    refuse_overlaps(&[claim("cache", &a), claim("cache", &b)]).unwrap();
    // A source not yet there and a cache of the same name: refused.
    let e = refuse_overlaps(&[claim("source", &a), claim("cache", &b)]).unwrap_err();
    assert!(e.to_string().contains("same storage"), "{e}");
    // URIs are not paths.
    let uri = Claim {
        export: "x".into(),
        role: "cache",
        path: "nbd://h:1/x".into(),
    };
    refuse_overlaps(&[
        uri.clone(),
        Claim {
            role: "source",
            ..uri
        },
    ])
    .unwrap();
}

#[test]
fn storage_tells_files_apart_by_inode() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("f");
    std::fs::write(&f, b"x").unwrap();
    let s = storage(&f).unwrap();
    assert_eq!(s.len(), 1);
    assert!(matches!(s[0], Storage::File { .. }), "{s:?}");
    let g = d.path().join("g");
    std::fs::write(&g, b"x").unwrap();
    assert_ne!(storage(&g).unwrap(), s);
    assert_eq!(storage(&d.path().join("missing")), None);
    assert_eq!(
        storage(d.path()).unwrap(),
        Vec::new(),
        "a directory holds no bytes"
    );
    assert_eq!(
        canonical_name(Path::new("rel.cache"))
            .parent()
            .map(|p| p.is_absolute()),
        Some(true)
    );
}

#[test]
fn contents_tell_blank_volatile_sce_and_foreign_apart() {
    let dev = MemDevice::new(4 << 20);
    assert!(matches!(contents(&dev).unwrap(), Contents::Blank));
    mark_volatile(&dev).unwrap();
    assert!(matches!(contents(&dev).unwrap(), Contents::VolatileCache));
    let mut head = vec![0u8; VOLATILE_HEADER as usize];
    dev.read_at(0, &mut head).unwrap();
    assert!(head.starts_with(VOLATILE_MAGIC));
    assert!(head[VOLATILE_MAGIC.len()..].iter().all(|&b| b == 0));
    let dev = MemDevice::new(4 << 20);
    let mut b = vec![0u8; 4096];
    b[..12].copy_from_slice(b"\x7fELF\x02\x01ext4fs");
    dev.write_at(0, &b).unwrap();
    match contents(&dev).unwrap() {
        Contents::Foreign(what) => {
            assert!(what.contains("not an sce cache"), "{what}");
            assert!(what.contains("\".ELF..ext4fs....\""), "{what}");
        }
        c => panic!("{c:?}"),
    }
    // A byte at the end of the first MiB is enough; beyond it, only a file's extents tell.
    let dev = MemDevice::new(4 << 20);
    dev.write_at((1 << 20) - 4096, &[1u8; 4096]).unwrap();
    assert!(matches!(contents(&dev).unwrap(), Contents::Foreign(_)));
    let dev = MemDevice::new(4 << 20);
    dev.write_at(2 << 20, &[1u8; 4096]).unwrap();
    assert!(matches!(contents(&dev).unwrap(), Contents::Blank));
    // A device smaller than a MiB is read whole.
    let small = MemDevice::new(64 << 10);
    assert!(matches!(contents(&small).unwrap(), Contents::Blank));
}

#[test]
fn a_file_zero_at_its_start_but_with_data_further_in_is_foreign() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("disk.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(8 << 20).unwrap();
    let open = |p: &Path| {
        let opts = sce_io::FileOptions {
            direct: sce_io::DirectMode::Off,
            ..Default::default()
        };
        sce_io::FileDevice::open(p, &opts).unwrap()
    };
    assert!(matches!(
        contents_at(&open(&p), Some(&p)).unwrap(),
        Contents::Blank
    ));
    use std::os::unix::fs::FileExt;
    f.write_all_at(&[9u8; 4096], 4 << 20).unwrap();
    f.sync_all().unwrap();
    match contents_at(&open(&p), Some(&p)).unwrap() {
        Contents::Foreign(w) => assert!(w.contains("holds data further in"), "{w}"),
        c => panic!("{c:?}"),
    }
    // Without its path, only the first MiB is looked at.
    assert!(matches!(
        contents_at(&open(&p), None).unwrap(),
        Contents::Blank
    ));
}

/// A config serving `spec` from `dir`.
fn cfg_of(dir: &Path, spec: ExportConfig) -> ServeConfig {
    ServeConfig {
        exports: vec![spec],
        ..base_config(dir)
    }
}

/// Builds the one export of `cfg`: its error's text, or None if it was built (and then
/// shut down cleanly).
fn build(cfg: &ServeConfig) -> Option<String> {
    match sce_server::group::build(&cfg.exports[0], cfg) {
        Ok(b) => {
            if let Some(v) = b.volume.and_then(|a| a.live_volume()) {
                v.flush().unwrap();
                let persistent = v.persist_stats().is_some();
                assert!(v.shutdown() || !persistent, "left clean");
            }
            None
        }
        Err(e) => Some(text(&e)),
    }
}

#[test]
fn a_missing_cache_needs_a_size_and_an_existing_one_is_never_resized() {
    let d = tempfile::tempdir().unwrap();
    let mut spec = export(d.path(), "e", true);
    spec.cache_size = None;
    let e = build(&cfg_of(d.path(), spec.clone())).unwrap();
    assert!(
        e.contains("does not exist; give a cache size to create it"),
        "{e}"
    );
    assert!(e.starts_with("export \"e\": cache "), "{e}");
    spec.cache_size = Some("32MiB".into());
    assert_eq!(build(&cfg_of(d.path(), spec.clone())), None);
    let cache = spec.cache.clone().unwrap();
    assert_eq!(std::fs::metadata(&cache).unwrap().len(), 32 * MIB);
    spec.cache_size = Some("64MiB".into());
    let e = build(&cfg_of(d.path(), spec.clone())).unwrap();
    assert!(e.contains("sce never resizes a cache"), "{e}");
    assert_eq!(std::fs::metadata(&cache).unwrap().len(), 32 * MIB);
    // Its own size, or none: used as it is.
    spec.cache_size = None;
    assert_eq!(build(&cfg_of(d.path(), spec)), None);
    let e = build(&ServeConfig {
        exports: vec![ExportConfig {
            cache_size: Some("a lot".into()),
            ..export(d.path(), "f", true)
        }],
        ..base_config(d.path())
    })
    .unwrap();
    assert!(e.starts_with("export \"f\": cache_size: "), "{e}");
}

#[test]
fn foreign_data_is_refused_without_force_and_left_untouched() {
    let d = tempfile::tempdir().unwrap();
    let spec = export(d.path(), "e", true);
    let cache = spec.cache.clone().unwrap();
    let mut foreign = vec![0u8; 32 * MIB as usize];
    foreign[..16].copy_from_slice(b"MY-FILESYSTEM!!!");
    std::fs::write(&cache, &foreign).unwrap();
    let mut cfg = cfg_of(d.path(), spec);
    let e = build(&cfg).unwrap();
    assert!(e.contains("holds data that is not an sce cache"), "{e}");
    assert!(e.contains("MY-FILESYSTEM") && e.contains("--force"), "{e}");
    assert_eq!(std::fs::read(&cache).unwrap(), foreign, "left untouched");
    assert!(cache.exists(), "a file it did not create is never removed");
    cfg.force = true;
    assert_eq!(build(&cfg), None);
    let dev = MemDevice::new(1 << 20);
    dev.write_at(0, &std::fs::read(&cache).unwrap()[..1 << 20])
        .unwrap();
    assert!(matches!(contents(&dev).unwrap(), Contents::SceCache));
    // Now ours: no --force needed.
    cfg.force = false;
    assert_eq!(build(&cfg), None);
}

#[test]
fn a_persistent_cache_is_not_made_volatile_without_reformat() {
    let d = tempfile::tempdir().unwrap();
    let spec = export(d.path(), "e", true);
    let cache = spec.cache.clone().unwrap();
    let mut cfg = cfg_of(d.path(), spec);
    assert_eq!(build(&cfg), None);
    let before = std::fs::read(&cache).unwrap();
    cfg.persist = false;
    let e = build(&cfg).unwrap();
    assert!(
        e.contains("holds a persistent sce cache; --no-persist would overwrite it"),
        "{e}"
    );
    assert!(e.contains("--reformat"), "{e}");
    assert_eq!(std::fs::read(&cache).unwrap(), before, "left untouched");
    // An export's persist = false is the same.
    cfg.persist = true;
    cfg.exports[0].persist = Some(false);
    assert!(build(&cfg)
        .unwrap()
        .contains("holds a persistent sce cache"));
    cfg.reformat = true;
    assert_eq!(build(&cfg), None);
    assert!(std::fs::read(&cache).unwrap().starts_with(VOLATILE_MAGIC));
    // A volatile cache is sce's to overwrite: volatile again, or persistent, without flags.
    cfg.reformat = false;
    assert_eq!(build(&cfg), None);
    cfg.exports[0].persist = None;
    assert_eq!(build(&cfg), None);
    assert!(!std::fs::read(&cache).unwrap().starts_with(VOLATILE_MAGIC));
}

#[test]
fn a_start_that_fails_removes_the_cache_file_it_created_only() {
    let d = tempfile::tempdir().unwrap();
    let spec = ExportConfig {
        source_name: Some("n".repeat(300)),
        ..export(d.path(), "e", true)
    };
    let cache = spec.cache.clone().unwrap();
    let e = build(&cfg_of(d.path(), spec.clone())).unwrap();
    assert!(e.contains("the source name is longer than"), "{e}");
    assert!(e.contains("--source-name"), "{e}");
    assert!(!cache.exists(), "the file this start created is removed");
    // A file that was there stays.
    std::fs::File::create(&cache)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let e = build(&cfg_of(d.path(), spec)).unwrap();
    assert!(e.contains("the source name is longer than"), "{e}");
    assert!(cache.exists(), "a file this start did not create stays");
}

#[test]
fn a_share_of_a_device_nobody_shares_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let spec = ExportConfig {
        cache_share: Some("50%".into()),
        ..export(d.path(), "e", true)
    };
    let cache = spec.cache.clone().unwrap();
    let e = build(&cfg_of(d.path(), spec)).unwrap();
    assert!(
        e.contains("cache_share applies to exports that share a cache device"),
        "{e}"
    );
    assert!(!cache.exists());
}

#[test]
fn a_source_that_cannot_be_opened_is_named() {
    let d = tempfile::tempdir().unwrap();
    let spec = ExportConfig {
        source: d.path().join("nope.img").display().to_string(),
        ..export(d.path(), "e", true)
    };
    let cache = spec.cache.clone().unwrap();
    let e = build(&cfg_of(d.path(), spec)).unwrap();
    assert!(
        e.starts_with("export \"e\": source ") && e.contains("nope.img"),
        "{e}"
    );
    assert!(!cache.exists(), "nothing created before the source opened");
}

#[test]
fn a_damaged_superblock_is_an_sce_cache_not_foreign_data() {
    let d = tempfile::tempdir().unwrap();
    let spec = export(d.path(), "e", true);
    let cache = spec.cache.clone().unwrap();
    let cfg = cfg_of(d.path(), spec);
    assert_eq!(build(&cfg), None);
    let mut img = std::fs::read(&cache).unwrap();
    img[64] ^= 0xff;
    img[65] ^= 0xff;
    std::fs::write(&cache, &img).unwrap();
    let dev = MemDevice::new(1 << 20);
    dev.write_at(0, &img[..1 << 20]).unwrap();
    assert!(matches!(contents(&dev).unwrap(), Contents::SceCache));
    // Never refused as foreign data: --force is not what it needs.
    if let Some(e) = build(&cfg) {
        assert!(!e.contains("not an sce cache"), "{e}");
    }
}

/// A cache too small for what it must hold is refused naming the export and the device,
/// persistent or not (a volatile one needs room for its 8 KiB marker first), and the file
/// this start created is removed.
#[test]
fn a_cache_too_small_is_refused_naming_the_export_and_the_device() {
    for (persist, size) in [
        (true, "1MiB"),
        (false, "512"),
        (false, "4KiB"),
        (false, "1MiB"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let spec = ExportConfig {
            cache_size: Some(size.into()),
            ..export(d.path(), "e", true)
        };
        let cache = spec.cache.clone().unwrap();
        let mut cfg = cfg_of(d.path(), spec);
        cfg.persist = persist;
        let e = build(&cfg).unwrap();
        assert!(e.starts_with("export \"e\": "), "{persist} {size}: {e}");
        if size == "1MiB" {
            assert!(e.contains("fragment"), "{persist} {size}: {e}");
        } else {
            assert!(e.contains("e.cache: "), "{persist} {size}: {e}");
            assert!(
                e.contains("too few for a cache that does not persist"),
                "{size}: {e}"
            );
        }
        assert!(!cache.exists(), "{persist} {size}: the new file is removed");
    }
}
