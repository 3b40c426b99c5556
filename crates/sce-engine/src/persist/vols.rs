//! The volumes a store serves (one, or several sharing the device: `crate::parts`), and the
//! translation between the cache's address space and each volume's own fragment numbers,
//! which are what the device's records and journal entries hold.

use super::Persist;

/// A volume to open: its table name, size, where it starts in the cache's address space
/// and what identifies its source's content now.
#[derive(Clone, Debug)]
pub struct OpenVolume {
    /// The name in the volume table.
    pub name: String,
    /// The source's size in bytes.
    pub size: u64,
    /// Where its byte 0 is in the cache's address space (a multiple of the fragment size).
    pub base: u64,
    /// The source's identity now (None: it cannot be identified).
    pub identity: Option<String>,
    /// The operator's version string of the source's content.
    pub source_generation: Option<String>,
    /// Drop what the device holds for it at start.
    pub forget: bool,
    /// The most of the cache it may hold (a fraction of the slots; None: no cap).
    pub share: Option<f64>,
}

/// A volume the store serves.
#[derive(Clone, Debug)]
pub(crate) struct PVol {
    /// Its index in the volume table.
    pub index: usize,
    /// Its id (records, journal entries and page checksums carry it).
    pub id: u16,
    /// The cache fragment its fragment 0 is.
    pub base: u64,
    /// The operator's version string of its source's content.
    pub source_generation: Option<String>,
}

impl Persist {
    /// The volume that cache fragment `f` belongs to (its index in `vols`).
    pub(super) fn vol_of(&self, f: u64) -> usize {
        self.vols.partition_point(|v| v.base <= f).saturating_sub(1)
    }

    /// Cache fragment `f` as (volume id, the volume's own fragment number).
    pub(super) fn local(&self, f: u64) -> (u16, u64) {
        let v = &self.vols[self.vol_of(f)];
        (v.id, f - v.base)
    }

    /// The checksum seeds of the volumes: (first source page in the cache's address space,
    /// volume id), in address order.
    pub(crate) fn seeds(&self) -> Vec<(u64, u16)> {
        let pages = self.layout.fragment_size / sce_core::PAGE_SIZE;
        self.vols.iter().map(|v| (v.base * pages, v.id)).collect()
    }
}

impl Persist {
    /// Bumps the generation of volume `k` (in address order): every record of it on the
    /// device stops counting at once. The caller dropped its pages in memory first.
    pub(crate) fn bump_generation(&self, k: usize) -> Result<(), sce_io::IoError> {
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        let v = &mut sb.volumes[self.vols[k].index];
        v.generation = v.generation.wrapping_add(1);
        self.write_sb(&mut sb)
    }
}

impl Persist {
    /// Marks volume `k` (in address order) detached, or not, durably: a start drops a
    /// volume marked detached (unless told nothing was written meanwhile).
    pub(crate) fn set_detached(&self, k: usize, on: bool) -> Result<(), sce_io::IoError> {
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        let v = &mut sb.volumes[self.vols[k].index];
        if v.detached == on {
            return Ok(());
        }
        v.detached = on;
        self.write_sb(&mut sb)
    }
}

impl Persist {
    /// The device's write-back log, if it was formatted with one (format 6).
    pub(crate) fn log_info(&self) -> Option<sce_store::LogInfo> {
        self.sb.lock().log
    }

    /// True if volume `id` is in the device's volume table (served or not).
    pub(crate) fn table_has(&self, id: u32) -> bool {
        self.sb.lock().volumes.iter().any(|v| v.id as u32 == id)
    }

    /// Records the log's new anchor and the newest commit known durable in the superblock
    /// (written and flushed before this returns).
    pub(crate) fn record_log(
        &self,
        anchor: sce_store::wblog::Anchor,
        durable: u64,
    ) -> Result<(), sce_io::IoError> {
        let mut sb = self.sb.lock();
        let Some(log) = sb.log.as_mut() else {
            return Ok(());
        };
        log.set_anchor(anchor);
        log.durable_seq = log.durable_seq.max(durable);
        if sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        self.write_sb_with(&mut sb, false)
    }

    /// Records that the log's laps use the last `lent` of its lendable chunks of read slots
    /// (format 9; replay reads those): written and flushed before this returns.
    pub(crate) fn record_lent(&self, lent: u64) -> Result<(), sce_io::IoError> {
        let mut sb = self.sb.lock();
        let failed = sb.state == sce_store::DeviceState::Failed;
        let Some(log) = sb.log.as_mut() else {
            return Ok(());
        };
        let was = log.lent;
        if was == lent {
            return Ok(());
        }
        if failed {
            return Err(sce_io::IoError::Failed(
                "the cache device failed: the write-back log lends no read slots".into(),
            ));
        }
        log.lent = lent;
        let written = self.write_sb_with(&mut sb, false);
        if written.is_err() {
            // Not durable: the value the device holds stays the one every later superblock
            // write (an anchor's) records, and a retry writes it again.
            if let Some(log) = sb.log.as_mut() {
                log.lent = was;
            }
        }
        written
    }

    /// Gives a log written before format 8 its mirror area (the last blocks of its region),
    /// which changes where ring positions lie: only for a log that holds nothing, whose
    /// replay starts afresh at `anchor` (an empty log's). Written and flushed before this
    /// returns; the new region's state.
    pub(crate) fn give_log_mirror(
        &self,
        anchor: sce_store::wblog::Anchor,
    ) -> Result<Option<sce_store::LogInfo>, sce_io::IoError> {
        let mut sb = self.sb.lock();
        let failed = sb.state == sce_store::DeviceState::Failed;
        let Some(log) = sb.log.as_mut() else {
            return Ok(None);
        };
        let mirror = sce_store::wblog::LogRegion::mirror_for(log.blocks);
        if log.mirror_blocks > 0 || mirror == 0 || failed {
            return Ok(None);
        }
        log.mirror_blocks = mirror;
        log.set_anchor(anchor);
        let info = *log;
        self.write_sb_with(&mut sb, false)?;
        Ok(Some(info))
    }
}
