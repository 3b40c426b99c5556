//! At start, write-back's data as the store loaded it: dirty pages put back into the core
//! shards, their slots held, and a device holding dirty data refused in another mode.

use sce_core::{CacheCore, SlotHold};

/// Restores what the store loaded into the core shards: each record goes to the shard that
/// owns its (global) slot, and is dropped if its fragment belongs to another shard (the
/// shard count changed): `Persist::start` then puts an intent on the slot, so the record is
/// never trusted again. Dirty pages come back dirty, and lost ones (a dirty bit on an
/// invalid page) lost, both by `restore_dirty`. Returns the dirty pages
/// of records it could not restore (their data is on the device, but this start cannot
/// serve it: the caller refuses to start).
pub(crate) fn restore(
    cores: &mut [CacheCore],
    map: &sce_core::ShardMap,
    loaded: &sce_store::Loaded,
    words: usize,
) -> u64 {
    let mut skipped = 0;
    use sce_core::{FragNo, SlotNo};
    type Restored<'a> = (SlotNo, FragNo, &'a [u64]);
    let mut per: Vec<Vec<Restored>> = vec![Vec::new(); cores.len()];
    let mut dirty: Vec<Vec<(FragNo, &[u64])>> = vec![Vec::new(); cores.len()];
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        let (k, local) = map.slot_to_local(SlotNo(s));
        let (kf, lf) = map.frag_to_local(FragNo(f));
        if k == kf && local.0 < map.slots(k) {
            per[k].push((local, lf, &loaded.bitmaps[i * words..(i + 1) * words]));
            let d = &loaded.dirty[i * words..(i + 1) * words];
            if d.iter().any(|&w| w != 0) {
                dirty[k].push((lf, d));
            }
        } else {
            let d = &loaded.dirty[i * words..(i + 1) * words];
            skipped += d.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        }
    }
    for ((core, entries), dirty) in cores.iter_mut().zip(per).zip(dirty) {
        core.track_dirty();
        core.restore(entries);
        let ppf = core.geometry().pages_per_fragment();
        for (f, words) in dirty {
            let mut pages = sce_core::bitmap::PageSet::new(ppf);
            for p in 0..ppf {
                if words[p as usize / 64] >> (p % 64) & 1 == 1 {
                    pages.insert_range(p, p + 1);
                }
            }
            core.restore_dirty(f, &pages);
        }
    }
    skipped
}

/// Refuses to start a cache device holding dirty data in a mode other than writeback: the
/// source is older than the cache there.
pub(crate) fn check_dirty(
    cfg: &sce_core::CoreConfig,
    loaded: &sce_store::Loaded,
) -> Result<(), crate::EngineError> {
    let r = &loaded.report;
    if cfg.write_mode == sce_core::WriteMode::WriteBack
        || (r.pages_dirty == 0 && r.dirty_pages_lost == 0)
    {
        return Ok(());
    }
    Err(sce_core::ConfigError::new(
        "mode",
        format!(
            "the cache device holds {} dirty pages (write-back data not yet on the source){}: \
             start it with --mode writeback and run `sce ctl flush --to-source` before \
             changing the mode",
            r.pages_dirty,
            if r.dirty_pages_lost == 0 {
                String::new()
            } else {
                format!(" and {} lost ones", r.dirty_pages_lost)
            }
        ),
    )
    .into())
}

/// Holds the slots that came back with dirty pages (their records claim them).
pub(crate) fn hold_dirty(
    cores: &mut [CacheCore],
    map: &sce_core::ShardMap,
    persist: &crate::persist::Persist,
    loaded: &sce_store::Loaded,
) {
    let words = loaded.superblock.layout.bitmap_words();
    for (i, &(s, _)) in loaded.entries.iter().enumerate() {
        if loaded.dirty[i * words..(i + 1) * words]
            .iter()
            .any(|&w| w != 0)
        {
            let (k, local) = map.slot_to_local(sce_core::SlotNo(s));
            if local.0 >= map.slots(k) {
                continue;
            }
            if let Some(hold) = SlotHold::take(&mut cores[k], local) {
                persist.restored_dirty(s, hold);
            }
        }
    }
}
