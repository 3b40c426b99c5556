//! `sce footprint`: builds the metadata structures for a geometry and reports the bytes the
//! counting allocator saw them allocate, per cached fragment and per source fragment.

use crate::alloc::live_bytes;
use crate::units::format_size;
use anyhow::Result;
use sce_core::map::FragmentMap;
use sce_core::{CacheCore, CoreConfig};
use serde::Serialize;

/// The measured footprint.
#[derive(Serialize, Debug)]
pub struct Footprint {
    /// Cache size in bytes.
    pub cache_size: u64,
    /// Source size in bytes.
    pub source_size: u64,
    /// Fragment size in bytes.
    pub fragment_size: u64,
    /// Cache slots.
    pub cached_fragments: u64,
    /// Source fragments.
    pub source_fragments: u64,
    /// Bits per fragment-map entry.
    pub map_entry_bits: u32,
    /// All metadata with every map leaf allocated (the worst case).
    pub bytes_total: u64,
    /// Slot descriptors, eviction state and fixed structures, per cache slot.
    pub bytes_per_cached_fragment: f64,
    /// The fragment map with every leaf allocated, per source fragment.
    pub bytes_per_source_fragment: f64,
    /// The fragment map before any fragment is cached (leaves allocated on first touch).
    pub map_bytes_untouched: u64,
    /// What the SCE paper reports per cached 1 MiB fragment.
    pub paper_bytes_per_cached_fragment: u64,
}

/// Measures the footprint of a cache of `cache_size` over `source_size`.
pub fn measure(cfg: CoreConfig, cache_size: u64, source_size: u64) -> Result<Footprint> {
    // The map alone, empty and then fully touched.
    let before = live_bytes();
    let slots = cache_size / cfg.fragment_size;
    let frags = source_size.div_ceil(cfg.fragment_size);
    let mut map = FragmentMap::new(frags, slots.min(u32::MAX as u64) as u32);
    let map_untouched = live_bytes() - before;
    map.touch_all();
    let map_bytes = live_bytes() - before;
    let bits = map.entry_bits();
    drop(map);

    let before = live_bytes();
    let mut core = CacheCore::new(cfg.clone(), source_size, cache_size)?;
    core.map_mut().touch_all();
    let total = live_bytes() - before;
    drop(core);
    let per_cached = (total - map_bytes) as f64 / slots as f64;
    Ok(Footprint {
        cache_size,
        source_size,
        fragment_size: cfg.fragment_size,
        cached_fragments: slots,
        source_fragments: frags,
        map_entry_bits: bits,
        bytes_total: total as u64,
        bytes_per_cached_fragment: per_cached,
        bytes_per_source_fragment: map_bytes as f64 / frags as f64,
        map_bytes_untouched: map_untouched as u64,
        paper_bytes_per_cached_fragment: 76,
    })
}

/// Prints a footprint for people.
pub fn print(f: &Footprint) {
    println!(
        "geometry: {} cache over {} source, {} fragments",
        format_size(f.cache_size),
        format_size(f.source_size),
        format_size(f.fragment_size)
    );
    println!("  cached fragments (slots): {}", f.cached_fragments);
    println!("  source fragments:         {}", f.source_fragments);
    println!("allocated (counted by the allocator):");
    println!(
        "  total:                    {} ({} bytes)",
        format_size(f.bytes_total),
        f.bytes_total
    );
    println!(
        "  per cached fragment:      {:.2} B   (SCE paper: {} B)",
        f.bytes_per_cached_fragment, f.paper_bytes_per_cached_fragment
    );
    println!(
        "  per source fragment:      {:.4} B   ({}-bit packed map entries)",
        f.bytes_per_source_fragment, f.map_entry_bits
    );
    println!(
        "  map before first use:     {}",
        format_size(f.map_bytes_untouched)
    );
}
