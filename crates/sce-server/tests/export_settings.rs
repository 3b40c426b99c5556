//! An export's cache settings as the TOML file gives them (text), checked when the export is
//! built (`export::core_of`): every field parsed, a bad one refused with the export's name
//! and the field's, sizes in units (`1GiB`, `512KiB`), the default geometry (1 MiB fragments
//! in 512 KiB lines under admission sce), and `cache_share` and the ownership checks of a
//! configuration's exports.

use sce_server::export::{check_ownership, core_of, share};
use sce_server::ExportConfig;

/// An export named "e" declared by the TOML `text`.
fn spec(text: &str) -> ExportConfig {
    toml::from_str(&format!("name = \"e\"\nsource = \"/a\"\n{text}"))
        .unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// The error of `core_of` for the export declared by `text`.
fn refused(text: &str) -> String {
    match core_of(&spec(text)) {
        Ok(c) => panic!("{text}: accepted as {c:?}"),
        Err(e) => sce_server::error_text(&e),
    }
}

#[test]
fn every_bad_field_is_refused_naming_the_export_and_the_field() {
    for (text, field) in [
        ("mode = \"sometimes\"", "mode"),
        ("admission = \"maybe\"", "admission"),
        ("eviction = \"random\"", "eviction"),
        ("fragment_size = \"lots\"", "fragment_size"),
        ("chunk_size = \"1.5 bananas\"", "fragment_size"),
        ("line_size = \"big\"", "line_size"),
        ("awt_budget = \"-1\"", "awt_budget"),
        ("period = \"soon\"", "period"),
        ("min_free_pcnt = 101.0", "min_free_pcnt"),
        ("min_free_pcnt = -1.0", "min_free_pcnt"),
        (
            "writeback_low_watermark = \"lots\"",
            "writeback_low_watermark",
        ),
        (
            "writeback_high_watermark = \"150%\"",
            "writeback_high_watermark",
        ),
        ("writeback_rate = \"fast\"", "writeback_rate"),
        ("population_rate = \"0\"", "population_rate"),
        ("population_rate = \"quick\"", "population_rate"),
        ("sequential_cutoff = \"long\"", "sequential_cutoff"),
        ("miss_fills = \"sometimes\"", "miss_fills"),
        ("recency_window = \"90%\"", "recency_window"),
        ("dense_line = \"0.5%\"", "dense_line"),
        ("max_cache_writes = \"0dwpd\"", "max_cache_writes"),
        ("max_cache_writes = \"plenty\"", "max_cache_writes"),
    ] {
        let e = refused(text);
        assert!(
            e.starts_with(&format!("export \"e\": {field}: ")),
            "{text}: {e}"
        );
    }
}

#[test]
fn a_line_larger_than_its_fragment_is_refused_with_both_sizes() {
    let e = refused("fragment_size = \"256KiB\"\nline_size = \"1MiB\"");
    assert!(
        e.contains("line_size 1048576 is larger than the fragment size 262144"),
        "{e}"
    );
    // Without a fragment size, the default one (1 MiB) is the bound.
    let e = refused("line_size = \"2MiB\"");
    assert!(e.contains("larger than the fragment size 1048576"), "{e}");
    // Equal is a fragment of one line.
    let c = core_of(&spec("fragment_size = \"1MiB\"\nline_size = \"1MiB\"")).unwrap();
    assert_eq!((c.fragment_size, c.heat_bytes()), (1 << 20, 1 << 20));
}

#[test]
fn sizes_take_units_and_the_core_checks_what_they_make() {
    let c = core_of(&spec(
        "fragment_size = \"4MiB\"\nline_size = \"256KiB\"\nawt_budget = \"24MiB\"\n\
         sequential_cutoff = \"16MiB\"",
    ))
    .unwrap();
    assert_eq!((c.fragment_size, c.heat_bytes()), (256 << 10, 4 << 20));
    assert_eq!((c.awt_budget, c.sequential_cutoff), (24 << 20, 16 << 20));
    // A fragment size that is not a power of two is the core's to refuse, with the export.
    let e = refused("fragment_size = \"3MiB\"");
    assert!(e.starts_with("export \"e\": "), "{e}");
    // A line under a 64th of its fragment, too.
    let e = refused("fragment_size = \"64MiB\"\nline_size = \"4KiB\"");
    assert!(e.starts_with("export \"e\": "), "{e}");
}

#[test]
fn the_tuning_fields_reach_the_core_configuration() {
    let c = core_of(&spec(
        "mode = \"writearound\"\nadmission = \"always\"\neviction = \"fifo\"\nperiod = \"3s\"\n\
         min_free_pcnt = 12.5\nevict_for_population = false\ntarget_missrate = 0.3\n\
         hot_window = 5\nwriteback_low_watermark = \"10%\"\nwriteback_high_watermark = \"0.9\"\n\
         writeback_rate = \"32MiB\"",
    ))
    .unwrap();
    assert_eq!(c.write_mode.to_string(), "writearound");
    assert_eq!(c.admission.to_string(), "always");
    assert_eq!(c.eviction.to_string(), "fifo");
    assert_eq!(c.throttle.period, std::time::Duration::from_secs(3));
    assert_eq!(c.throttle.min_free_pcnt, 12.5);
    assert!(!c.throttle.allow_eviction);
    assert_eq!(c.throttle.target_missrate, 0.3);
    assert_eq!(c.hot_window, 5);
    assert_eq!(c.writeback.low_watermark, 0.1);
    assert_eq!(c.writeback.high_watermark, 0.9);
    assert_eq!(c.writeback.rate, 32 << 20);
    // Crossed watermarks: the core refuses them.
    let e = refused("writeback_low_watermark = \"80%\"\nwriteback_high_watermark = \"50%\"");
    assert!(e.starts_with("export \"e\": "), "{e}");
}

#[test]
fn awt_turns_writethrough_synchronous_or_not() {
    let on = core_of(&spec("mode = \"writethrough\"\nawt = true")).unwrap();
    let off = core_of(&spec("mode = \"writethrough\"\nawt = false")).unwrap();
    assert_ne!(on.write_mode, off.write_mode);
    assert_eq!(off.write_mode.to_string(), "writethrough-sync");
    assert_eq!(on.write_mode.to_string(), "writethrough");
}

/// An export's geometry and miss fills as the TOML file gives them, and their defaults:
/// 1 MiB fragments in 512 KiB lines with miss fills while the source is busy under
/// admission sce; whole fragments when a size is asked for or under another admission.
#[test]
fn lines_and_miss_fills_from_an_export() {
    let core = |text: &str| core_of(&spec(text));
    let geometry = |c: &sce_core::CoreConfig| (c.fragment_size, c.heat_bytes());
    for (text, fills) in [
        ("", (true, true)),
        ("miss_fills = \"auto\"", (true, true)),
        ("miss_fills = \"on\"", (true, false)),
        ("miss_fills = true", (true, false)),
        ("miss_fills = false", (false, false)),
    ] {
        let c = core(text).unwrap();
        assert_eq!((c.miss_fills, c.miss_fills_when_busy), fills, "{text}");
        assert_eq!(geometry(&c), (512 << 10, 1 << 20), "{text}");
    }
    let c = core("line_size = \"256KiB\"").unwrap();
    assert_eq!(geometry(&c), (256 << 10, 1 << 20));
    let c = core("fragment_size = \"1MiB\"").unwrap();
    assert_eq!(geometry(&c), (1 << 20, 1 << 20));
    let c = core("admission = \"sce-paper\"").unwrap();
    assert_eq!(geometry(&c), (1 << 20, 1 << 20));
    let e = core("miss_fills = \"sometimes\"").unwrap_err().to_string();
    assert!(
        e.contains("miss_fills") && e.contains("on, off or auto"),
        "{e}"
    );
}

#[test]
fn admission_text_fields_reach_the_core_and_parsed_options_replace_them() {
    let c = core_of(&spec(
        "population_rate = \"64MiB\"\nsequential_cutoff = \"0\"\nadmission_margin = 4\n\
         partial_fill = true\nrecency_window = \"2%\"\ndense_line = \"off\"\n\
         max_cache_writes = \"10GiB\"",
    ))
    .unwrap();
    assert_eq!(
        (c.population_rate, c.population_adaptive),
        (64 << 20, false)
    );
    assert_eq!((c.sequential_cutoff, c.admission_margin), (0, 4));
    assert!(c.partial_fill);
    assert_eq!((c.recency_window, c.dense_line_percent), (20, 0));
    assert_eq!(c.max_cache_writes, Some(10 << 30));
    // Parsed options (the command line's) replace the text fields, bad ones included.
    let mut s = spec("population_rate = \"not a rate\"");
    s.admission_options = Some(sce_server::admission::AdmissionOptions {
        admission_margin: Some(9),
        ..Default::default()
    });
    let c = core_of(&s).unwrap();
    assert_eq!(c.admission_margin, 9);
}

#[test]
fn a_cache_share_is_a_fraction_above_zero_up_to_one() {
    let s = |t: &str| {
        let mut e = spec("");
        e.cache_share = Some(t.into());
        share(&e)
    };
    assert_eq!(share(&spec("")).unwrap(), None);
    assert_eq!(s("40%").unwrap(), Some(0.4));
    assert_eq!(s(" 25 % ").unwrap(), Some(0.25));
    assert_eq!(s("0.5").unwrap(), Some(0.5));
    assert_eq!(s("1").unwrap(), Some(1.0));
    assert_eq!(s("100%").unwrap(), Some(1.0));
    for bad in ["0", "0%", "1.5", "101%", "-10%", "half", ""] {
        let e = s(bad).unwrap_err().to_string();
        assert!(
            e.starts_with("export \"e\": cache_share: ") && e.contains("not a share"),
            "{bad}: {e}"
        );
    }
}

/// Exports of `(name, source, cache)`.
fn exports(list: &[(&str, &str, Option<&str>)]) -> Vec<ExportConfig> {
    list.iter()
        .map(|(n, s, c)| ExportConfig {
            name: n.to_string(),
            source: s.to_string(),
            cache: c.map(Into::into),
            ..ExportConfig::default()
        })
        .collect()
}

#[test]
fn no_export_may_use_a_source_as_a_cache_nor_cache_one_nbd_export_twice() {
    let d = tempfile::tempdir().unwrap();
    let a = d.path().join("a.img");
    let b = d.path().join("b.img");
    std::fs::write(&a, [1u8; 4096]).unwrap();
    std::fs::write(&b, [2u8; 4096]).unwrap();
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let cache = d.path().join("c.cache");
    let c = cache.to_str().unwrap();
    check_ownership(&exports(&[("x", a, Some(c)), ("y", b, None)])).unwrap();
    // Another export's source as this one's cache.
    let e = check_ownership(&exports(&[("x", a, Some(b)), ("y", b, None)]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("the cache of export \"x\"") && e.contains("the source of export \"y\""),
        "{e}"
    );
    assert!(e.contains("same storage"), "{e}");
    // Its own source as its cache.
    let e = check_ownership(&exports(&[("x", a, Some(a))])).unwrap_err();
    assert!(e.to_string().contains("same storage"), "{e}");
    // Two exports naming the same cache share it: allowed here (the group checks the rest).
    check_ownership(&exports(&[("x", a, Some(c)), ("y", b, Some(c))])).unwrap();
    // Two exports of one source, neither cached: allowed.
    check_ownership(&exports(&[("x", a, None), ("y", a, None)])).unwrap();
    // Two caches of one NBD export would never see each other's writes.
    let uri = "nbd://127.0.0.1:10809/lun";
    let c2 = d.path().join("c2.cache");
    let e = check_ownership(&exports(&[
        ("x", uri, Some(c)),
        ("y", uri, Some(c2.to_str().unwrap())),
    ]))
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("two exports cache the same source nbd://127.0.0.1:10809/lun"),
        "{e}"
    );
    // One of them uncached: fine.
    check_ownership(&exports(&[("x", uri, Some(c)), ("y", uri, None)])).unwrap();
}

#[test]
fn a_cache_named_twice_by_another_path_is_two_caches_on_one_file() {
    let d = tempfile::tempdir().unwrap();
    let src_a = d.path().join("a.img");
    let src_b = d.path().join("b.img");
    std::fs::write(&src_a, [1u8; 4096]).unwrap();
    std::fs::write(&src_b, [1u8; 4096]).unwrap();
    let cache = d.path().join("c.cache");
    std::fs::write(&cache, [0u8; 4096]).unwrap();
    let alias = d.path().join("alias.cache");
    std::fs::hard_link(&cache, &alias).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let list = exports(&[
        ("x", &s(&src_a), Some(&s(&cache))),
        ("y", &s(&src_b), Some(&s(&alias))),
    ]);
    let e = check_ownership(&list).unwrap_err().to_string();
    assert!(
        e.contains("the cache of export \"x\"") && e.contains("alias.cache"),
        "{e}"
    );
    // The same file by the same name through a "./" path is one cache.
    let dotted = d.path().join(".").join("c.cache");
    let list = exports(&[
        ("x", &s(&src_a), Some(&s(&cache))),
        ("y", &s(&src_b), Some(&s(&dotted))),
    ]);
    check_ownership(&list).unwrap();
}
