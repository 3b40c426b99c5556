//! Write-back data in the read slots, left by an sce before issue 45 (a device formatted
//! without a write-back log, whose write-back kept dirty pages in the slots): a start drains
//! it to the source before anything is served, and the device is then formatted afresh
//! with a log (`Persist::open_laid_out`). The slots' write side is gone; this is its reader.
//!
//! The order makes every crash safe: the drain writes the dirty pages to the source and
//! flushes it before the format touches the device, so a crash before the new superblock
//! finds the old dirty claims again and drains the same bytes again (no client was served
//! in between); `sce_store::reformat` makes every old record stale before it clears the
//! intents.

use crate::open::checksum_cache;
use crate::persist::{OpenVolume, Persist};
use crate::volume::{EngineConfig, EngineError};
use sce_core::PAGE_SIZE;
use sce_io::{AlignedBuf, BlockDevice};
use sce_store::{page_checksum, page_seed, Loaded, VolumeDirt};
use std::sync::Arc;

/// Why a start must format the device afresh, if it must: dirty pages in its slots (which
/// it drains first), or write-back wanted of a device without a log.
pub(crate) fn relayout_needed(
    persist: &Persist,
    loaded: &Loaded,
    writeback: bool,
) -> Result<bool, EngineError> {
    let r = &loaded.report;
    let in_slots = r.pages_dirty + r.dirty_pages_lost > 0;
    if in_slots && persist.log_info().is_some() {
        // No sce writes such a device (one with a log served write-back through it):
        // formatting it afresh would drop the log's dirty data.
        return Err(sce_core::ConfigError::new(
            "cache",
            format!(
                "the cache device holds {} dirty pages in its read slots beside a write-back \
                 log; no sce writes such a device, and it is not drained",
                r.pages_dirty + r.dirty_pages_lost
            ),
        )
        .into());
    }
    Ok(in_slots || (writeback && persist.log_info().is_none()))
}

/// What the drain did.
#[derive(Debug, Default)]
pub(crate) struct Drained {
    /// Dirty pages written to the source.
    pub pages: u64,
    /// Dirty pages it could not write: their only copy is lost (never written, or failing
    /// its checksum), per volume (given up by the operator, or the start was refused).
    pub lost: Vec<VolumeDirt>,
}

/// Writes every dirty page the slots hold (as `loaded` found them) to `source` and flushes
/// it. A page without a sound copy is lost: the start is refused unless the operator gave
/// its volume's dirty data up (`--discard-dirty`), as a reformat would be.
pub(crate) fn drain(
    source: &dyn BlockDevice,
    device: Arc<dyn BlockDevice>,
    persist: &Persist,
    loaded: &Loaded,
    (config, vols): (&EngineConfig, &[OpenVolume]),
) -> Result<Drained, EngineError> {
    let l = persist.layout;
    let words = l.bitmap_words();
    let ppf = l.pages_per_fragment;
    let crcs = checksum_cache(config, persist, device.clone(), loaded);
    let seeds = persist.seeds();
    let mut out = Drained::default();
    let mut lost = vec![0u64; vols.len()];
    let mut buf = AlignedBuf::new(l.fragment_size as usize);
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        let dirty = &loaded.dirty[i * words..(i + 1) * words];
        let valid = &loaded.bitmaps[i * words..(i + 1) * words];
        let base = f * l.fragment_size;
        let pages = ppf.min(source.size().saturating_sub(base).div_ceil(PAGE_SIZE) as u32);
        // Runs of dirty pages: one device read each, then the sound pages written to the
        // source in runs of their own.
        let mut p = 0;
        while p < pages {
            if !bit(dirty, p) {
                p += 1;
                continue;
            }
            let mut q = p;
            while q < pages && bit(dirty, q) {
                q += 1;
            }
            let run = &mut buf[..((q - p) as u64 * PAGE_SIZE) as usize];
            device.read_at(slot_page(persist, s, p), run)?;
            let mut sound = Vec::with_capacity((q - p) as usize);
            for r in p..q {
                let at = base + u64::from(r) * PAGE_SIZE;
                let len = PAGE_SIZE.min(source.size() - at) as usize;
                let k = seeds
                    .partition_point(|x| x.0 <= at / PAGE_SIZE)
                    .saturating_sub(1);
                let (page_base, id) = seeds[k];
                let o = ((r - p) as u64 * PAGE_SIZE) as usize;
                let ok = bit(valid, r)
                    && crcs.get_or_load(s, r)?
                        == page_checksum(
                            &run[o..o + len],
                            page_seed(id, at / PAGE_SIZE - page_base),
                        );
                if !ok {
                    lost[k] += 1;
                }
                sound.push(ok);
            }
            write_sound(source, base + u64::from(p) * PAGE_SIZE, run, &sound)?;
            out.pages += sound.iter().filter(|&&x| x).count() as u64;
            p = q;
        }
    }
    source.flush()?;
    out.lost = vols
        .iter()
        .zip(lost)
        .filter(|(_, n)| *n > 0)
        .map(|(v, n)| VolumeDirt {
            name: v.name.clone(),
            dirty: 0,
            lost: n,
        })
        .collect();
    let action = "a start that drains the read slots' write-back data";
    sce_store::refuse_dirty_drop(&out.lost, &persist.cfg.discard_dirty, action)?;
    crate::persist::log_dropped(&out.lost, action);
    Ok(out)
}

/// Writes the pages of `run` (read from the slots, for the source from `at`) that are
/// `sound` to the source, adjacent ones in one write; the last page may end past the
/// source's end (written up to it).
fn write_sound(
    source: &dyn BlockDevice,
    at: u64,
    run: &[u8],
    sound: &[bool],
) -> Result<(), sce_io::IoError> {
    let mut i = 0;
    while i < sound.len() {
        if !sound[i] {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < sound.len() && sound[j] {
            j += 1;
        }
        let from = at + i as u64 * PAGE_SIZE;
        let end = (at + j as u64 * PAGE_SIZE).min(source.size());
        let o = (i as u64 * PAGE_SIZE) as usize;
        source.write_at(from, &run[o..o + (end - from) as usize])?;
        i = j;
    }
    Ok(())
}

/// Bit `p` of a page bitmap.
fn bit(words: &[u64], p: u32) -> bool {
    words[p as usize / 64] >> (p % 64) & 1 == 1
}

/// The device offset of page `p` of slot `s`.
fn slot_page(persist: &Persist, s: u32, p: u32) -> u64 {
    let l = persist.layout;
    l.data_offset + u64::from(s) * l.fragment_size + u64::from(p) * PAGE_SIZE
}
