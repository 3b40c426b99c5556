//! `sce footprint` against what `sce serve` really takes.
//!
//! # Method
//! The footprint of a 64 GiB cache over a 256 GiB source, with `serve`'s defaults (page
//! checksums on, persistence on), is compared with the resident memory a real `sce serve`
//! gains by caching: two servers run one after the other on sparse files, the same way but
//! for `--cache`; each one's resident set (`VmRSS` in `/proc/PID/status`) is read once it
//! listens (it listens only after the volume is open), and the growth is cached minus
//! baseline. Binary, libraries, NBD listener and metrics thread cancel out; what is left is
//! the volume. The metadata flusher is put to sleep (`--metadata-interval 3600s`) so that no
//! round runs while the numbers are read.
//!
//! Compared: the footprint's `bytes_at_open` (what the volume holds once open, without the
//! fragment-map leaves that the first cached fragments allocate). RSS counts touched pages
//! only; a zero-filled vector the engine does not touch at open (calloc'd, so it is fresh
//! untouched memory) is allocated but not resident yet. The footprint counts it anyway: it
//! becomes resident as the cache is used, and an operator must budget for it. For this
//! geometry the untouched part is small (per-slot epochs, a few hundred KiB against about
//! 70 MiB), so the two must agree within 10%; a footprint that missed a structure (the page
//! checksums are 64 MiB of the 70) fails.
//!
//! The command counts with the allocator every build installs, which counts in `sce
//! footprint` and `sce sim` only.

mod common;

use common::Server;
use std::path::Path;
use std::process::Command;

fn footprint(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .arg("footprint")
        .args(args)
        .arg("--json")
        .output()
        .expect("run sce footprint");
    assert!(
        out.status.success(),
        "sce footprint {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// A field of /proc/PID/status, in bytes.
fn status_bytes(pid: u32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let line = s
        .lines()
        .find(|l| l.starts_with(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("bad line {line:?}"));
    kib * 1024
}

fn sparse(path: &Path, size: u64) {
    std::fs::File::create(path).unwrap().set_len(size).unwrap();
}

/// (VmRSS, RssAnon) of a server started with `args`, once it listens.
fn serve_rss(args: &[&str], sock: &Path) -> (u64, u64) {
    let s = Server::start(args, sock);
    let rss = (
        status_bytes(s.pid(), "VmRSS"),
        status_bytes(s.pid(), "RssAnon"),
    );
    assert!(s.term().success());
    rss
}

#[test]
fn footprint_is_what_serve_takes() {
    // 64 KiB fragments: a million slots, so that what is measured (some 60 MiB) stands well
    // above the noise of the RSS (untouched zeroed pages, the allocator's arenas). With
    // 1 MiB fragments the volume takes under 10 MiB at open, now that page checksums are
    // not all in memory.
    let geometry = ["--cache-size", "64GiB", "--fragment-size", "64KiB"];
    let f = footprint(&[&geometry[..], &["--source-size", "256GiB"]].concat());
    let at_open = f["bytes_at_open"].as_u64().expect("bytes_at_open");
    let parts: u64 = f["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .map(|p| p["bytes"].as_u64().expect("bytes"))
        .sum();
    assert_eq!(parts, at_open, "the parts add up to the total: {f}");

    let d = tempfile::tempdir().unwrap();
    let p = |name: &str| d.path().join(name);
    sparse(&p("src-a"), 256 << 30);
    sparse(&p("src-b"), 256 << 30);
    std::fs::create_dir(p("state")).unwrap();
    let s = |x: &str| p(x).to_str().unwrap().to_string();
    let (src_a, src_b, cache, state) = (s("src-a"), s("src-b"), s("cache"), s("state"));
    let common = ["--state-dir", &state, "--metadata-interval", "3600s"];

    let base_args = [&["--source", &src_a][..], &common].concat();
    let (base, base_anon) = serve_rss(&base_args, &p("a.sock"));
    let cached_args = [
        &[
            "--source",
            &src_b,
            "--cache",
            &cache,
            geometry[0],
            geometry[1],
            geometry[2],
            geometry[3],
            // Some temp directories refuse O_DIRECT; it changes no memory.
            "--allow-buffered",
        ][..],
        &common,
    ]
    .concat();
    let (cached, cached_anon) = serve_rss(&cached_args, &p("b.sock"));

    let growth = cached.saturating_sub(base);
    let anon = cached_anon.saturating_sub(base_anon);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let msg = format!(
        "footprint at open {:.1} MiB; serve's RSS grew {:.1} MiB ({:.1} -> {:.1}), \
         anonymous {:.1} MiB; footprint: {f}",
        mib(at_open),
        mib(growth),
        mib(base),
        mib(cached),
        mib(anon)
    );
    eprintln!("{msg}");
    // The footprint is what serve allocates: its RSS never grows more (10% for the
    // allocator's own overhead). It may grow less: zeroed arrays (the persistence's per-slot
    // words) are not resident until written, which the cache does as it fills. Measured:
    // 94.9 MiB allocated, 55.8 MiB resident at open. When every page's checksum was in
    // memory, a table written whole at open, the two were within 10%.
    assert!(growth * 10 <= at_open * 11, "serve holds more: {msg}");
    assert!(growth * 2 >= at_open, "serve holds under half: {msg}");
}

fn part(f: &serde_json::Value, name: &str) -> Option<u64> {
    f["parts"]
        .as_array()
        .expect("parts")
        .iter()
        .find(|p| p["name"] == name)
        .map(|p| p["bytes"].as_u64().expect("bytes"))
}

/// The flags change what is measured as they change what `serve` allocates: without
/// persistence, checksums are 4 bytes per 4 KiB page of every slot, kept with `--verify
/// on`; with persistence they live in the records and in memory for one metadata unit (3
/// slots) in 32, at least 8,192 units, counted beside the total at open; persistence has its
/// own part; the total adds the map's leaves and the resident checksums.
#[test]
fn flags_change_the_parts_as_serve_allocates() {
    let geo = [
        "--cache-size",
        "4GiB",
        "--source-size",
        "64GiB",
        "--fragment-size",
        "1MiB",
    ];
    let with = |extra: &[&str]| footprint(&[&geo[..], extra].concat());
    let plain = with(&["--verify", "off", "--no-persist"]);
    let verify = with(&["--no-persist"]);
    let persist_only = with(&["--verify", "off"]);
    let full = with(&[]);

    assert_eq!(plain["cached_fragments"], 4096);
    assert_eq!(part(&plain, "page checksums"), None, "{plain}");
    assert_eq!(part(&plain, "persistence"), None, "{plain}");
    assert_eq!(
        part(&verify, "page checksums"),
        Some(4096 * 256 * 4),
        "{verify}"
    );
    assert_eq!(part(&verify, "persistence"), None, "{verify}");
    for f in [&persist_only, &full] {
        // Fewer slots: the metadata takes its share of the device.
        let slots = f["cached_fragments"].as_u64().unwrap();
        assert!(slots < 4096, "{f}");
        assert_eq!(part(f, "page checksums"), None, "{f}");
        let units = slots.div_ceil(3);
        let crcs = (units / 32).max(8192).min(units) * 3 * 256 * 4;
        let resident = f["checksums_resident"].as_u64().unwrap();
        assert!(
            resident >= crcs && resident <= crcs + crcs / 5,
            "resident checksums {resident}, their crcs {crcs}: {f}"
        );
        // At least a mirror word, an owner index entry and an intent's version per slot.
        assert!(part(f, "persistence").unwrap() >= slots * 16, "{f}");
        assert_eq!(f["verify"], true, "persistence keeps checksums: {f}");
    }
    for f in [&plain, &verify, &persist_only, &full] {
        let at_open = f["bytes_at_open"].as_u64().unwrap();
        let leaves = f["map_leaves_worst_case"].as_u64().unwrap();
        let resident = f["checksums_resident"].as_u64().unwrap();
        assert_eq!(resident > 0, f["persist"] == true, "{f}");
        assert_eq!(
            f["bytes_total"].as_u64(),
            Some(at_open + leaves + resident),
            "{f}"
        );
        let parts: u64 = f["parts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["bytes"].as_u64().unwrap())
            .sum();
        assert_eq!(parts, at_open, "{f}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_sce"))
        .args(["footprint", "--verify", "maybe"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("on or off"));
}

#[test]
fn footprint_meets_the_memory_goals() {
    // A 2 TiB cache over a 100 TiB source, with `extra`.
    let big = |extra: &[&str]| {
        footprint(&[&["--cache-size", "2TiB", "--source-size", "100TiB"], extra].concat())
    };
    // The core and the map alone: no page checksums, no persistence (the full footprint is
    // tested below), whole 1 MiB fragments, the SCE paper's unit (its 76 B per cached
    // fragment).
    let v = big(&["--fragment-size", "1MiB", "--verify", "off", "--no-persist"]);
    let per_cached = v["bytes_per_cached_fragment"].as_f64().unwrap();
    let per_source = v["bytes_per_source_fragment"].as_f64().unwrap();
    let total = v["bytes_total"].as_u64().unwrap();
    assert_eq!(v["cached_fragments"].as_u64(), Some(2 << 20));
    // Measured by the allocator: 2 Mi slots at ~43 B plus a 100 Mi-entry map: sanity bounds.
    assert!(
        per_cached > 40.0 && per_cached <= 48.0,
        "per cached fragment: {per_cached}"
    );
    assert!(
        per_source > 2.0 && per_source <= 4.0,
        "per source fragment: {per_source}"
    );
    assert!(total > 300 << 20 && total < 400 << 20, "total {total}");

    // Issue 30's goal: with checksums and persistence on, at most 160 bytes per cached MiB
    // at open (SCE's 76 B is the core's alone). The default geometry (1 MiB fragments in
    // lines of 512 KiB, twice the slots) meets it even in all but the fragment map, the
    // checksums of the units kept in memory and the owner index counted at capacity: 122 B at
    // open and 156 B in all measured. Whole 1 MiB fragments: 86 B and 119 B (152 B in all
    // before write-back state was kept only for the slots that have some, the owner index
    // was sized at open, and the epochs became a bit; 1,135 B with every page's checksum in
    // memory).
    let full = big(&[]);
    assert_eq!(full["line_size"].as_u64(), Some(512 << 10), "{full}");
    assert_eq!(full["fragment_size"].as_u64(), Some(1 << 20), "{full}");
    let open = full["bytes_per_cached_mib_at_open"].as_f64().unwrap();
    let all = full["bytes_per_cached_mib_all"].as_f64().unwrap();
    assert!(open <= 130.0, "per cached MiB at open: {open}: {full}");
    assert!(
        all <= 160.0,
        "all but the map per cached MiB: {all}: {full}"
    );
    assert!(
        full["checksums_resident"].as_u64().unwrap() > 32 << 20,
        "the resident checksums are counted: {full}"
    );
    // Issue 47's goal for data held at a finer grain: at most 8 bytes per 4 KiB page, the
    // page area at capacity (every slot packed: 6 B per way, a byte per set of 16, the
    // sketches capped at 4 MiB each, and the vectors' growth slack), counted by the
    // allocator; 6.12 B measured.
    let pages = full["page_area_pages"].as_u64().unwrap();
    let per_page = full["page_area_bytes_per_page"].as_f64().unwrap();
    assert_eq!(
        pages,
        full["cached_fragments"].as_u64().unwrap() * 128,
        "{full}"
    );
    assert!(
        (6.0..=8.0).contains(&per_page),
        "page area per page: {per_page}: {full}"
    );
    assert_eq!(
        full["bytes_total_sparse"].as_u64(),
        Some(
            full["bytes_total"].as_u64().unwrap()
                + full["page_area_bytes_at_capacity"].as_u64().unwrap()
        ),
        "{full}"
    );
    let whole = big(&["--fragment-size", "1MiB"]);
    assert_eq!(whole["line_size"].as_u64(), Some(1 << 20), "{whole}");
    let all = whole["bytes_per_cached_mib_all"].as_f64().unwrap();
    assert!(
        all <= 130.0,
        "whole fragments, all but the map per MiB: {all}: {whole}"
    );
}

#[test]
fn footprint_scales_with_geometry() {
    let small = footprint(&["--cache-size", "1GiB", "--source-size", "16GiB"]);
    let lru = footprint(&[
        "--cache-size",
        "1GiB",
        "--source-size",
        "16GiB",
        "--eviction",
        "lru",
    ]);
    // LRU links cost 8 B per slot more than CLOCK's 1 B counter.
    let d = lru["bytes_per_cached_fragment"].as_f64().unwrap()
        - small["bytes_per_cached_fragment"].as_f64().unwrap();
    assert!((6.5..=7.5).contains(&d), "LRU - CLOCK per slot = {d}");
}

/// Issue 45: `--writeback` measures the index of dirty data per dirty MiB (on top of the
/// read cache's) and what half the cache dirty would take at that rate. The goal
/// (at most 2 KiB per dirty MiB, 8 B per dirty page) is not met yet: the figure is printed
/// and bounded by what the index's maps take (a page's newest version and the position
/// that holds the tail: two map entries), so a structure added per dirty page shows.
#[test]
fn footprint_measures_the_write_back_index_per_dirty_mib() {
    let v = footprint(&[
        "--cache-size",
        "2TiB",
        "--source-size",
        "100TiB",
        "--writeback",
    ]);
    let per_mib = v["bytes_per_dirty_mib"].as_f64().expect("measured");
    let half = v["bytes_half_cache_dirty"].as_u64().unwrap();
    println!(
        "write-back index: {per_mib:.0} B per dirty MiB ({:.1} B per dirty page), {} GiB with \
         half of a 2 TiB cache dirty",
        per_mib / 256.0,
        half >> 30
    );
    assert_eq!(v["dirty_measured_bytes"].as_u64(), Some(256 << 20));
    assert!(
        per_mib > 256.0 * 24.0 && per_mib < 256.0 * 128.0,
        "{per_mib} B per dirty MiB"
    );
    let want = per_mib * (1u64 << 20) as f64;
    assert!(
        (half as f64 - want).abs() < want * 0.01,
        "{half} against {want}"
    );
    // Without the flag nothing is measured.
    let v = footprint(&["--cache-size", "64GiB", "--source-size", "1TiB"]);
    assert!(v["bytes_per_dirty_mib"].is_null(), "{v}");
}
