//! Refusals at open: a start that would write back stale dirty data, serve older bytes
//! for data it cannot locate, or drop dirty data the operator did not give up.

use super::open::placed;
use super::vols::OpenVolume;
use super::PersistConfig;
use sce_io::BlockDevice;
use sce_store::{StoreError, Superblock};
use std::sync::Arc;

/// An older copy of the device (its superblock sequence is below the one this host last
/// wrote) that holds dirty data is refused before anything is written: its dirty pages may
/// be older than writes the source has since, and cleaning them would bring those back.
/// (Trusting dirty data across generations is right otherwise: it is the newest copy.)
pub(super) fn refuse_older_copy_with_dirty_data(
    dev: &Arc<dyn BlockDevice>,
    cfg: &PersistConfig,
    sb: &Superblock,
    formatted_now: bool,
    (vols, indices): (&[OpenVolume], &[usize]),
) -> Result<(), StoreError> {
    if formatted_now || older_copy(cfg, sb, false).is_none() {
        return Ok(());
    }
    let (lv, _) = placed(vols, indices, sb, sb.layout.fragment_size);
    let pre = sce_store::load_volumes(&**dev, sb.clone(), &lv)?;
    if pre.report.pages_dirty == 0 && pre.report.dirty_pages_lost == 0 {
        return Ok(());
    }
    Err(StoreError::Corrupt(format!(
        "the cache device is an older copy (superblock sequence {}, this host wrote a newer \
         one) and holds {} dirty (write-back) pages that may be older than the source: \
         refusing to write them back; `sce format --force` drops them",
        sb.seq, pre.report.pages_dirty
    )))
}

/// The superblock sequence this host recorded for the device, if the device is an older
/// copy than that: its sequence is below it, and not just one below because the newest
/// copy was damaged (then the other copy, one write older, was read).
pub(super) fn older_copy(cfg: &PersistConfig, sb: &Superblock, formatted_now: bool) -> Option<u64> {
    let damaged = sb.other_copy_damaged as u64;
    super::state_seq(cfg, &sb.uuid).filter(|&seen| !formatted_now && seen > sb.seq + damaged)
}

/// Metadata damage whose claims cannot be located: units neither of whose copies is sound
/// (their slots' fragments are unknown) and journal blocks of an earlier commit that neither
/// copy holds (their pages are unknown). Clean data they vouched for is simply not loaded;
/// but a volume served in write-back may have had its only copy of data there, and serving
/// the source's older bytes for it would be stale: such a start is refused, naming the damage.
pub(super) fn refuse_unlocatable_damage(
    sb: &Superblock,
    indices: &[usize],
    loaded: &sce_store::Loaded,
) -> Result<(), StoreError> {
    let r = &loaded.report;
    let units = r.units_corrupt + r.units_misplaced;
    let blocks = loaded.journal.blocks_missing;
    // A device with a write-back log keeps dirty data in the log, never in the slots that
    // units and journal blocks name (a volume's write-back flag says nothing then).
    let wb: Vec<&str> = indices
        .iter()
        .map(|&i| &sb.volumes[i])
        .filter(|v| v.writeback && sb.log.is_none())
        .map(|v| v.name.as_str())
        .collect();
    let dirty = r.pages_dirty + r.dirty_pages_lost > 0;
    if (units == 0 && blocks == 0) || (wb.is_empty() && !dirty) {
        return Ok(());
    }
    Err(StoreError::Unlocatable(format!(
        "{units} metadata unit(s) are damaged in both copies and {blocks} write-journal \
         block(s) of earlier commits are damaged in both copies; the volume(s) {wb:?} were \
         served in write-back, so what that metadata named may be the only copy of \
         acknowledged data and cannot be located. Refusing to start rather than serve older \
         bytes; `sce check` shows the damage. To give that data up, reformat the device \
         (`sce format --force`) and start cold"
    )))
}

/// Refuses an `action` that would drop the dirty data `dirt` unless the operator gave each
/// volume's up (`--discard-dirty`); logs at ERROR what is then dropped (the caller drops it
/// right after).
pub(super) fn dropping_dirty(
    dirt: &[sce_store::VolumeDirt],
    cfg: &PersistConfig,
    action: &str,
) -> Result<(), StoreError> {
    sce_store::refuse_dirty_drop(dirt, &cfg.discard_dirty, action)?;
    log_dropped(dirt, action);
    Ok(())
}

/// Logs at ERROR the dirty data `dirt` that `action` dropped.
pub(crate) fn log_dropped(dirt: &[sce_store::VolumeDirt], action: &str) {
    for d in dirt.iter().filter(|d| d.dirty + d.lost > 0) {
        tracing::error!(
            volume = %d.name,
            dirty_pages = d.dirty,
            lost_pages = d.lost,
            "--discard-dirty: {action} dropped {} dirty and {} lost pages (write-back data the \
             source never received)",
            d.dirty,
            d.lost
        );
    }
}

/// A volume of the table this start does not serve gets its generation bumped and its slots
/// reused (or its place in a full table given away): never with dirty data the operator did
/// not give up.
pub(super) fn refuse_leaving_dirty_out(
    dev: &Arc<dyn BlockDevice>,
    cfg: &PersistConfig,
    sb: &Superblock,
    wanted: &[(String, u64)],
) -> Result<Vec<sce_store::VolumeDirt>, StoreError> {
    let served = |v: &sce_store::Volume| wanted.iter().any(|w| w.0 == v.name);
    let dirt = sce_store::dirty_by_volume(&**dev, sb, |v| !served(v))?;
    sce_store::volumes::refuse_reusing_logged_volume(&**dev, sb, wanted)?;
    // What is given up is dropped only if the start goes through (it may still be refused,
    // e.g. when older dirty pages of a served volume hold the log's anchor): logged then.
    sce_store::refuse_dirty_drop(
        &dirt,
        &cfg.discard_dirty,
        "a start that does not serve them",
    )?;
    Ok(dirt)
}

/// `--reformat` of a device this sce cannot read (`e`: damaged superblocks, a newer format,
/// format 4): whether it holds write-back data not yet on the source cannot be told, so
/// it is refused unless `--discard-dirty all`. Formats 1 to 3 had no write-back.
pub(super) fn unreadable_may_hold_dirty(
    e: &StoreError,
    cfg: &PersistConfig,
) -> Result<(), StoreError> {
    if matches!(e, StoreError::OldVersion(v) if *v < 4) {
        return Ok(());
    }
    if cfg.discard_dirty.iter().any(|d| d == "all") {
        tracing::error!(
            "--discard-dirty all: --reformat drops whatever the unreadable device held ({e})"
        );
        return Ok(());
    }
    Err(StoreError::DirtyData(format!(
        "{e}. This sce cannot tell whether the device holds write-back data the source does \
         not have, and --reformat would drop it: serve it with the sce that wrote it and run \
         `sce ctl flush --to-source` first, or pass --discard-dirty all to give it up"
    )))
}
