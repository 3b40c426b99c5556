//! `sce footprint`: the memory `sce serve` takes for a cached volume of a given geometry and
//! options, counted by the allocator, per part and in total. It needs a build with the cargo
//! feature `footprint`, which installs the counting allocator ([`crate::alloc`]); without it
//! the command says so and fails.
//!
//! # Method
//! It opens a real [`CacheVolume`] (the same `CacheVolume::open` `serve` calls, with the same
//! engine settings) over two [`SparseDevice`]s of the requested sizes, which store nothing
//! but the few metadata blocks written to them (and those outside the count), and counts
//! the allocator's growth across the open: whatever the engine keeps for the volume is in
//! that number, including structures added after this command was written. Only the split
//! into parts is computed beside it:
//!
//! * **core**: a `CacheCore` of the same geometry built alone (slot table, eviction state,
//!   hotness, the fragment map's directory);
//! * **page checksums**: without persistence (verify on), a `CrcTable` built alone for the
//!   volume's slots (4 bytes per page: nothing else holds them); with persistence, the
//!   checksums live in the device's records and in memory for the units in use, up to a
//!   capacity (one unit in 32 by default): counted as the growth of filling the open
//!   volume's checksum cache to that capacity, and added to the total like the map's
//!   leaves (at open none is resident);
//! * **engine**: the rest of a plain open (no persistence, no verify): read-log shards,
//!   queues, threads' bookkeeping;
//! * **persistence**: what is left of the real open (mirror of the on-device records, owner
//!   index, intents, touched bits ...).
//!
//! Not in the totals: the fragment map's leaves, allocated as fragments are first cached
//! (reported as the worst case, every leaf allocated), I/O buffers in flight (AWT copies,
//! population buffers: they scale with the load, not the geometry), and thread stacks
//! (reserved, not resident until used). Population is off while measuring (the workers would
//! only add their lazily allocated buffers); their threads are counted.

use crate::alloc::{grown_since, live_bytes};
use crate::sparse::SparseDevice;
use crate::units::format_size;
use anyhow::{Context, Result};
use sce_core::map::FragmentMap;
use sce_core::{CacheCore, CoreConfig};
use sce_engine::{CacheVolume, EngineConfig, PersistConfig};
use sce_io::BlockDevice;
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// What to measure: the geometry and the options `serve` would run with.
#[derive(Clone, Debug)]
pub struct Options {
    /// The core's settings (fragment size, eviction ...).
    pub core: CoreConfig,
    /// Cache device size in bytes.
    pub cache_size: u64,
    /// Source size in bytes.
    pub source_size: u64,
    /// Keep page checksums and verify reads (`EngineConfig::verify`).
    pub verify: bool,
    /// Persistence on (`serve` without `--no-persist`).
    pub persist: bool,
    /// Also measure write-back's index of dirty data (needs persistence).
    pub writeback: bool,
}

/// One part of the footprint.
#[derive(Serialize, Debug, Clone)]
pub struct Part {
    /// Short name.
    pub name: &'static str,
    /// Bytes allocated.
    pub bytes: u64,
    /// What it holds.
    pub what: &'static str,
}

/// The measured footprint.
#[derive(Serialize, Debug)]
pub struct Footprint {
    /// Cache size in bytes.
    pub cache_size: u64,
    /// Source size in bytes.
    pub source_size: u64,
    /// Fragment size in bytes: the unit of heat (`--fragment-size`).
    pub fragment_size: u64,
    /// Line size in bytes: the unit of cache space, one per slot (`--line-size`; the
    /// fragment size when fragments are not cut into lines).
    pub line_size: u64,
    /// Cache slots (with persistence, what fits beside the on-device metadata).
    pub cached_fragments: u64,
    /// Source fragments.
    pub source_fragments: u64,
    /// Bits per fragment-map entry.
    pub map_entry_bits: u32,
    /// Page checksums kept (verify on, or persistence on).
    pub verify: bool,
    /// Persistence on.
    pub persist: bool,
    /// The parts of `bytes_at_open`; they add up to it.
    pub parts: Vec<Part>,
    /// Allocated by opening the volume, as measured: what `serve` holds once it listens.
    pub bytes_at_open: u64,
    /// The fragment map's leaves when every one is allocated (the worst case; they are
    /// allocated as fragments are first cached).
    pub map_leaves_worst_case: u64,
    /// With persistence: the page checksums of the units kept in memory, the cache's
    /// capacity of them resident (none is at open).
    pub checksums_resident: u64,
    /// `bytes_at_open + map_leaves_worst_case + checksums_resident`: what to budget for.
    pub bytes_total: u64,
    /// Threads the volume runs (AWT writers, metadata flusher, population workers). Their
    /// stacks are reserved address space, resident only as far as used; not in the totals.
    pub threads: u64,
    /// The core's slot descriptors, eviction state and fixed structures, per cache slot.
    pub bytes_per_cached_fragment: f64,
    /// Everything but the fragment map, per cache slot.
    pub bytes_per_cached_fragment_all: f64,
    /// `bytes_at_open` per MiB of cache slots (the issue-30 goal: at most 160).
    pub bytes_per_cached_mib_at_open: f64,
    /// Everything but the fragment map, per MiB of cache slots.
    pub bytes_per_cached_mib_all: f64,
    /// The fragment map with every leaf allocated, per source fragment.
    pub bytes_per_source_fragment: f64,
    /// The fragment map before any fragment is cached.
    pub map_bytes_untouched: u64,
    /// What the SCE paper reports per cached 1 MiB fragment (core metadata only).
    pub paper_bytes_per_cached_fragment: u64,
    /// With persistence: the write-back index's bytes per dirty MiB, measured over
    /// `dirty_measured_bytes` of dirty data (`footprint_dirty.rs`); on top of the rest.
    pub bytes_per_dirty_mib: Option<f64>,
    pub dirty_measured_bytes: u64,
    /// That rate for half the cache dirty (the issue-45 goal: at most 2 KiB per dirty MiB).
    pub bytes_half_cache_dirty: Option<u64>,
    /// The page area at capacity (every slot packed with single pages, as a load of sparse
    /// reads over the whole cache leaves it) and its sketches, counted by the allocator: on
    /// top of `bytes_total`. 0 without a page area (`--dense-line off`, admission other than
    /// sce, lines under 16 pages).
    pub page_area_bytes_at_capacity: u64,
    /// The pages the page area then holds.
    pub page_area_pages: u64,
    /// `page_area_bytes_at_capacity` per page held (the issue-47 goal: at most 8).
    pub page_area_bytes_per_page: f64,
    /// `bytes_total + page_area_bytes_at_capacity`: what to budget for with a sparse load.
    pub bytes_total_sparse: u64,
}

/// Bytes `f` leaves allocated, and its result.
fn growth<R>(f: impl FnOnce() -> R) -> (u64, R) {
    let before = live_bytes();
    let r = f();
    (grown_since(before), r)
}

/// Threads of this process (Linux), or 0 if unknown.
fn threads() -> u64 {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count() as u64)
}

/// Opens a volume over sparse devices as `serve` would; returns the bytes it allocated and
/// the threads it started.
fn open(o: &Options, verify: bool, persist: bool) -> Result<(u64, u64, u64)> {
    let source: Arc<dyn BlockDevice> = Arc::new(SparseDevice::new(o.source_size)?);
    let cache: Arc<dyn BlockDevice> = Arc::new(SparseDevice::new(o.cache_size)?);
    let config = EngineConfig {
        core: o.core.clone(),
        background_population: false,
        verify,
        persist: persist.then(|| PersistConfig {
            // The flusher has nothing to write; keep it asleep while we count.
            flush_interval: Duration::from_secs(3600),
            ..PersistConfig::new("footprint")
        }),
        ..EngineConfig::default()
    };
    let t0 = threads();
    let (bytes, volume) = growth(|| CacheVolume::open(source, cache, config));
    let volume = volume.context("opening a volume over sparse devices")?;
    let started = threads().saturating_sub(t0);
    // With persistence, the checksums of the units in use, at the cache's capacity.
    let (resident, _) = growth(|| volume.fill_checksum_cache());
    volume.shutdown();
    drop(volume);
    Ok((bytes, started, resident))
}

/// A core of the volume's geometry, measured alone.
struct CoreSizes {
    /// Bytes at open (the map's leaves not allocated yet).
    at_open: u64,
    /// Bytes with every map leaf allocated (with `touch`).
    touched: u64,
    /// Cache slots.
    slots: u64,
    /// The map alone, before and after every leaf is allocated (with `touch`).
    map_untouched: u64,
    map_touched: u64,
    /// Bits per map entry.
    map_bits: u32,
    /// With `touch`: the page area with every slot packed, and its sketches (bytes, and the
    /// pages it holds; 0 and 0 without a page area).
    area: (u64, u64),
}

/// Measures a core of the volume's geometry alone (with dirty tracking for persistence), and
/// with `touch` also with every map leaf allocated.
fn core_sizes(o: &Options, data_size: u64, persist: bool, touch: bool) -> Result<CoreSizes> {
    let (at_open, core) = growth(|| CacheCore::new(o.core.clone(), o.source_size, data_size));
    let mut core = core?;
    let (dirty, ()) = growth(|| {
        if persist {
            core.track_dirty();
        }
    });
    let (leaves, ()) = growth(|| {
        if touch {
            core.map_mut().touch_all()
        }
    });
    let slots = core.geometry().slots() as u64;
    let area = if touch {
        match growth(|| core.pack_free_slots()) {
            (_, 0) => (0, 0),
            measured => measured,
        }
    } else {
        (0, 0)
    };
    drop(core);
    let frags = o.source_size.div_ceil(o.core.fragment_size);
    let (map_untouched, mut map) =
        growth(|| FragmentMap::new(frags, slots.min(u32::MAX as u64) as u32));
    let (map_leaves, ()) = growth(|| {
        if touch {
            map.touch_all()
        }
    });
    let map_bits = map.entry_bits();
    drop(map);
    Ok(CoreSizes {
        at_open: at_open + dirty,
        touched: at_open + dirty + leaves,
        slots,
        map_untouched,
        map_touched: map_untouched + map_leaves,
        map_bits,
        area,
    })
}

/// Measures the footprint of `serve` for the options (the allocator counts from here on).
pub fn measure(o: &Options) -> Result<Footprint> {
    crate::alloc::start_counting();
    o.core.validate()?;
    let checksums = o.verify || o.persist;
    // The data area: with persistence, what the layout leaves beside the metadata.
    let data_size = if o.persist {
        sce_store::Layout::compute(o.cache_size - o.cache_size % 4096, o.core.fragment_size)?
            .data_bytes()
    } else {
        o.cache_size
    };
    let core = core_sizes(o, data_size, o.persist, true)?;
    let (plain, plain_threads, _) = open(o, false, false)?;
    let plain_core = core_sizes(o, o.cache_size, false, false)?.at_open;
    let engine = plain.saturating_sub(plain_core);
    let (at_open, threads, resident) = if checksums {
        open(o, o.verify, o.persist)?
    } else {
        (plain, plain_threads, 0)
    };
    let pages = (o.core.fragment_size / 4096) as u32;
    let (crcs, table) = if checksums && !o.persist {
        growth(|| sce_store::CrcTable::new(core.slots as u32, pages))
    } else {
        (0, sce_store::CrcTable::new(0, pages))
    };
    drop(table);
    let parts = parts(o, core.at_open, crcs, at_open, engine);
    // What the parts do not explain (the core or table measured alone came out larger than
    // in the volume) would show as a sum above the measured total; keep the total measured.
    let map_leaves = core.touched - core.at_open;
    let frags = o.source_size.div_ceil(o.core.fragment_size);
    let slots = core.slots.max(1) as f64;
    let mibs = slots * o.core.fragment_size as f64 / f64::from(1 << 20);
    let bytes_total = at_open + map_leaves + resident;
    let dirty = if o.persist && o.writeback {
        crate::footprint_dirty::measure(&o.core, o.cache_size, o.source_size)?
    } else {
        None
    };
    let (area_bytes, area_pages) = core.area;
    let sample_mib = (crate::footprint_dirty::SAMPLE_PAGES * 4096) as f64 / f64::from(1 << 20);
    let per_dirty_mib = dirty.map(|b| b as f64 / sample_mib);
    Ok(Footprint {
        bytes_per_dirty_mib: per_dirty_mib,
        dirty_measured_bytes: dirty.map_or(0, |_| crate::footprint_dirty::SAMPLE_PAGES * 4096),
        bytes_half_cache_dirty: per_dirty_mib
            .map(|r| (r * (o.cache_size / 2) as f64 / f64::from(1 << 20)) as u64),
        cache_size: o.cache_size,
        source_size: o.source_size,
        fragment_size: o.core.heat_bytes(),
        line_size: o.core.fragment_size,
        cached_fragments: core.slots,
        source_fragments: frags,
        map_entry_bits: core.map_bits,
        verify: checksums,
        persist: o.persist,
        parts,
        bytes_at_open: at_open,
        map_leaves_worst_case: map_leaves,
        checksums_resident: resident,
        bytes_total,
        threads: threads + o.core.throttle.max_workers as u64,
        bytes_per_cached_fragment: (core.touched - core.map_touched) as f64 / slots,
        bytes_per_cached_fragment_all: (bytes_total - core.map_touched) as f64 / slots,
        bytes_per_cached_mib_at_open: at_open as f64 / mibs,
        bytes_per_cached_mib_all: (bytes_total - core.map_touched) as f64 / mibs,
        bytes_per_source_fragment: core.map_touched as f64 / frags.max(1) as f64,
        map_bytes_untouched: core.map_untouched,
        paper_bytes_per_cached_fragment: 76,
        page_area_bytes_at_capacity: area_bytes,
        page_area_pages: area_pages,
        page_area_bytes_per_page: area_bytes as f64 / area_pages.max(1) as f64,
        bytes_total_sparse: bytes_total + area_bytes,
    })
}

/// The parts of the footprint: the core (`core` bytes), the page checksums (`crcs`), and
/// what the volume adds to them (`at_open` in all, of which `engine` without persistence).
fn parts(o: &Options, core: u64, crcs: u64, at_open: u64, engine: u64) -> Vec<Part> {
    let checksums = o.verify || o.persist;
    let mut parts = vec![Part {
        name: "core",
        bytes: core,
        what: "slot descriptors, eviction state, hotness, fragment-map directory",
    }];
    if checksums && !o.persist {
        parts.push(Part {
            name: "page checksums",
            bytes: crcs,
            what: "4 bytes per 4 KiB page of every slot",
        });
    }
    let rest = at_open.saturating_sub(core + crcs);
    if o.persist {
        let engine = engine.min(rest);
        parts.push(Part {
            name: "engine",
            bytes: engine,
            what: "read-log shards, queues, threads",
        });
        parts.push(Part {
            name: "persistence",
            bytes: rest - engine,
            what: "record mirror, owner index, intents, touched bits, checksum units' table",
        });
    } else {
        parts.push(Part {
            name: "engine",
            bytes: rest,
            what: "read-log shards, queues, threads",
        });
    }
    parts
}

/// Prints a footprint for people.
pub fn print(f: &Footprint) {
    let on = |b: bool| if b { "on" } else { "off" };
    let lines = if f.line_size == f.fragment_size {
        String::new()
    } else {
        format!(" in lines of {}", format_size(f.line_size))
    };
    println!(
        "geometry: {} cache over {} source, {} fragments{lines}; checksums {}, persistence {}",
        format_size(f.cache_size),
        format_size(f.source_size),
        format_size(f.fragment_size),
        on(f.verify),
        on(f.persist)
    );
    println!("  cached fragments (slots): {}", f.cached_fragments);
    println!("  source fragments:         {}", f.source_fragments);
    println!("allocated by `sce serve` for this volume (counted by the allocator):");
    for p in &f.parts {
        println!("  {:<16} {:>12}   {}", p.name, format_size(p.bytes), p.what);
    }
    println!(
        "  {:<16} {:>12}   ({} bytes)",
        "at open",
        format_size(f.bytes_at_open),
        f.bytes_at_open
    );
    println!(
        "  {:<16} {:>12}   every fragment-map leaf allocated, the worst case",
        "+ map leaves",
        format_size(f.map_leaves_worst_case)
    );
    if f.persist {
        println!(
            "  {:<16} {:>12}   page checksums of the units kept in memory, at capacity",
            "+ checksums",
            format_size(f.checksums_resident)
        );
    }
    println!(
        "  {:<16} {:>12}   ({} bytes) to budget, plus I/O buffers in flight",
        "total",
        format_size(f.bytes_total),
        f.bytes_total
    );
    println!(
        "  threads:          {} (stacks reserved, resident as used)",
        f.threads
    );
    println!(
        "per cached fragment:        {:.2} B core (SCE paper: {} B), {:.2} B all but the map",
        f.bytes_per_cached_fragment,
        f.paper_bytes_per_cached_fragment,
        f.bytes_per_cached_fragment_all
    );
    println!(
        "per cached MiB:             {:.2} B at open, {:.2} B all but the map",
        f.bytes_per_cached_mib_at_open, f.bytes_per_cached_mib_all
    );
    println!(
        "per source fragment:        {:.4} B   ({}-bit packed map entries)",
        f.bytes_per_source_fragment, f.map_entry_bits
    );
    println!(
        "map before first use:       {}",
        format_size(f.map_bytes_untouched)
    );
    print_extras(f);
}

/// The parts of a footprint on top of the total: the page area at capacity, and
/// write-back's index of dirty data.
fn print_extras(f: &Footprint) {
    if f.page_area_pages > 0 {
        println!(
            "page area at capacity:      {} for {} pages ({:.2} B per page: every slot packed \
             with single pages, as sparse reads over the whole cache leave it); total {} ({} \
             bytes)",
            format_size(f.page_area_bytes_at_capacity),
            f.page_area_pages,
            f.page_area_bytes_per_page,
            format_size(f.bytes_total_sparse),
            f.bytes_total_sparse
        );
    }
    if let (Some(r), Some(half)) = (f.bytes_per_dirty_mib, f.bytes_half_cache_dirty) {
        println!(
            "write-back, per dirty MiB:  {r:.0} B (measured over {} dirty), {} with half the \
             cache dirty, on top of the above",
            format_size(f.dirty_measured_bytes),
            format_size(half)
        );
    }
}
