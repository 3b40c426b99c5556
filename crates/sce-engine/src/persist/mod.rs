//! Persistence of the cache contents on the cache device (format: `sce-store`,
//! `docs/FORMAT.md`), with the ordering that keeps a restarted cache from ever serving stale
//! data.
//!
//! # The rule
//! A slot's on-device record may claim pages of a fragment (its *claims*). Claims are only
//! trusted at load if the slot's write-intent bit is clear. So:
//!
//! * **Before a source write to fragment F** is sent, the slot whose possible on-device
//!   claims name F (`owner[F]`) must have its intent bit durably set.
//! * **Before data is written into slot S for fragment G** (population, inline fill, a write's
//!   cache copy), if S's possible claims name another fragment, S's intent bit must be durably
//!   set.
//! * **A bit is cleared** only by the flusher, after it rewrote S's record from the in-memory
//!   state, flushed it, read it back, and saw no write touch S since it took the snapshot
//!   (a per-slot touched bit) and for a whole flush period before (so hot fragments keep their bit
//!   and repeated writes cost no synchronous I/O, like md's write-intent bitmap).
//!
//! "Possible claims" (`mirror`, `owner`) are an over-approximation of what the device may
//! hold: the flusher adds a snapshot's claims before writing it and removes old ones only once
//! the new record is durable. Each slot's possible claims name at most one fragment, and each
//! fragment is claimed by at most one slot: a snapshot that would break this is written as an
//! empty record and retried next round.
//!
//! Records claim only pages whose data was flushed: the flusher flushes the cache device
//! after taking its snapshot and before writing records.
//!
//! # The write journal (`journal.rs`, on by default)
//! With the journal, a source write to fragment F whose owner slot S has no intent set
//! does not set S's intent: it appends an entry naming the exact pages to the write journal
//! and waits until the entry is durable; a load drops just those pages. Intents remain for
//! data written into a slot whose possible claims name another fragment, and for writes
//! that find the journal ring full. Reads no longer set intents ahead of need; a slot
//! written again within `warm_rounds` rounds turns write-hot instead (`intents.rs`,
//! `guard_write`): its intent is set ahead of the next write, and writes to it need nothing
//! durable while the intent is.

mod claims;
mod close;
mod intents;
mod journal;
mod open;
mod refuse;
pub(crate) use refuse::log_dropped;
mod round;
mod state_dir;
use state_dir::StateSeq;
use state_dir::{marker, record_state_seq, state_seq};
mod vols;

pub use vols::OpenVolume;
use vols::PVol;

use crate::order::{levels, OrderedMutex};
use intents::State;
use sce_io::{BlockDevice, IoError};
use sce_store::layout::BLOCK;
use sce_store::{Layout, Superblock};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// Settings of a persistent cache.
#[derive(Clone, Debug)]
pub struct PersistConfig {
    /// The source's name in the volume table (its path or URI). A device that holds another
    /// name, or the same name with another size, is refused unless `reformat`.
    pub volume_name: String,
    /// Reformat a device that is foreign, corrupt, of another version or geometry, or failed.
    pub reformat: bool,
    /// Invalidate this volume's cached fragments at start (bumps its generation).
    pub forget_volume: bool,
    /// How often the flusher writes changed records and clears quiet intents.
    pub flush_interval: Duration,
    /// Read back every metadata unit after writing it (catches lost and misdirected writes).
    pub verify_metadata: bool,
    /// A host directory for the failure marker: if the cache device fails so badly that it
    /// cannot even be marked failed, a file `failed-<uuid>` is written here, and a later open
    /// of that device refuses it (its records may be stale: source writes went on without
    /// their intents). None: no marker.
    pub state_dir: Option<std::path::PathBuf>,
    /// An operator's version string for the source's content (`--source-generation`),
    /// appended to the source's own identity: bumping it invalidates what the device holds
    /// for the volume. The only way to tell sce that an NBD export changed while it was down.
    pub source_generation: Option<String>,
    /// Flush rounds after a write during which the slot counts as "write-warm". Without the
    /// journal, a read of it keeps (or sets ahead of time) its write intent; with it, a
    /// second write turns the slot write-hot (its intent set ahead of the next write). Either
    /// way the next write need not wait for the cache device; the cost: a crash drops those
    /// slots whole. 0: never (with the journal, every write to a cached fragment is
    /// journaled).
    pub warm_rounds: u32,
    /// Journal writes page by page (on by default): before a source write to a cached slot,
    /// one group-committed write of a journal block to the cache device names the pages it
    /// changes, and a crash drops only those pages. Off: the write sets its slot's intent,
    /// and a crash drops every slot written lately, whole.
    pub journal: bool,
    /// Blocks of the on-device journal ring to use: 0 for all of them (the layout's), fewer
    /// to make the ring fill up sooner (tests of the full-ring fallback).
    pub journal_blocks: u32,
    /// The caller knows that nothing reached the source while the cache was detached from
    /// it (`sce ctl attach` after a detach with no write): a volume marked detached is
    /// trusted as any other. Otherwise a start drops a volume marked detached.
    pub reattach: bool,
    /// With `reattach`: the volumes' "detached" marks stay on the device after the start
    /// (the caller drops what was written while detached, makes that durable, then clears
    /// them with `CacheVolume::set_detached`); a crash before that finds them and trusts
    /// nothing.
    pub keep_detached_mark: bool,
    /// With `reattach`: the source's identity changed by the caller's own writes (served
    /// while the cache was detached, the source held): a changed identity drops nothing.
    pub own_writes: bool,
    /// The start serves its volumes in write-back (set by the engine from the mode): their
    /// table entries are marked so (`sce_store::Volume::writeback`).
    pub writeback: bool,
    /// Volumes (names in the device's table, or "all") whose dirty data the operator gave
    /// up (`--discard-dirty`): a reformat or a start that leaves them out may drop it.
    /// Without it such a start is refused.
    pub discard_dirty: Vec<String>,
    /// Bytes of the device to give a write-back log when this start formats it (format 6;
    /// 0: none, or in write-back, which needs one, the default size:
    /// [`sce_store::wblog::auto_log_bytes`]). Write-back is served through the log (issue
    /// 29, docs/WRITEBACK.md); a device without one is given one at a write-back start.
    pub writeback_log: u64,
    /// Bytes of the read slots the log of a format may lend as dirty data outgrows it
    /// (format 9; None: [`sce_store::wblog::auto_lend_bytes`], up to half the device in
    /// all; 0: none).
    pub writeback_grow: Option<u64>,
    /// Metadata units whose page checksums stay in memory (0: the default, one in 32 of
    /// the device's units; `crcs.rs`): the rest are read from the records when used.
    pub checksum_units: usize,
}

impl PersistConfig {
    /// Defaults for a source named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        PersistConfig {
            volume_name: name.into(),
            reformat: false,
            forget_volume: false,
            flush_interval: Duration::from_secs(1),
            verify_metadata: true,
            state_dir: None,
            source_generation: None,
            warm_rounds: 30,
            journal: true,
            journal_blocks: 0,
            reattach: false,
            keep_detached_mark: false,
            own_writes: false,
            writeback: false,
            discard_dirty: Vec::new(),
            writeback_log: 0,
            writeback_grow: None,
            checksum_units: 0,
        }
    }
}

impl PersistConfig {
    /// The bytes of write-back log a format gives a device of `device` bytes: the
    /// configured size, or in write-back the default if that is 0 (on a device too small
    /// for the default, of at least 2 MiB, the least log: 1 MiB).
    pub(crate) fn log_bytes(&self, device: u64) -> u64 {
        const MIB: u64 = 1 << 20;
        match sce_store::wblog::auto_log_bytes(device) {
            _ if !self.writeback || self.writeback_log > 0 => self.writeback_log,
            0 if device >= 2 * MIB => MIB,
            auto => auto,
        }
    }

    /// The read slots the log of a format may lend when dirty data outgrows it: up to half
    /// the device in all (`wblog::auto_lend_bytes`).
    pub(crate) fn lend_bytes(&self, device: u64) -> u64 {
        match self.writeback_grow {
            Some(b) if self.log_bytes(device) > 0 => b,
            Some(_) => 0,
            None => sce_store::wblog::auto_lend_bytes(device, self.log_bytes(device)),
        }
    }
}

sce_core::stats_table! {
    /// What loading found, and the persistence counters. In /stats each JSON name has the
    /// prefix `persist_`.
    #[derive(Clone, Debug, Default, PartialEq)]
    pub struct PersistStats {
        /// Format version of the device.
        format_version: u32, Gauge("sce_persist_format_version", "", "Format version of the cache device.");
        /// True if the previous run shut down cleanly.
        previous_shutdown_clean: bool, Gauge("sce_persist_previous_shutdown_clean", "", "1 if the previous stop was clean.");
        /// Unix seconds of the last clean shutdown (0: never).
        last_clean_shutdown: u64, Gauge("sce_persist_last_clean_shutdown_timestamp_seconds", "seconds", "Unix time of the last clean shutdown (0: never).");
        /// Fragments restored at start.
        fragments_restored: u64, Gauge("sce_persist_restored_fragments", "", "Fragments restored at start.");
        /// Fragments dropped at start because their intent bit was set.
        fragments_dropped_intent: u64, Gauge("sce_persist_dropped_by_intent_fragments", "", "Fragments dropped at start because a write intent covered them.");
        /// Pages of restored fragments dropped at start because the write journal names them.
        journal_pages_dropped: u64, Gauge("sce_persist_journal_dropped_pages", "", "Pages the journal replay dropped at start.");
        /// Fragments that lost pages to the journal at start (restored with the rest, or
        /// dropped if nothing was left).
        journal_fragments_hit: u64, Gauge("sce_persist_journal_hit_fragments", "", "Fragments the journal replay touched at start.");
        /// Live journal blocks found at start.
        journal_blocks_replayed: u64, Gauge("sce_persist_journal_replayed_blocks", "", "Write-journal blocks replayed at start.");
        /// Milliseconds the start-up load took.
        load_millis: u64, Gauge("sce_persist_load_seconds", "seconds", "Time the start-up load of the cache device took.") / 1e3;
        /// Fragments dropped by intent at start that are still to be filled again from the
        /// source (`refill.rs`).
        refill_pending: u64, Gauge("sce_persist_refill_pending_fragments", "", "Fragments dropped by a write intent at start, still to be filled again from the source.");
        /// Fragments dropped by intent at start and filled again from the source.
        refilled: u64, Counter("sce_persist_refilled_fragments_total", "", "Fragments dropped by a write intent at start and filled again from the source.");
        /// Intent bits set now (fragments whose cached copy would be dropped after a crash).
        dirty_intents: u64, Gauge("sce_persist_dirty_intents", "", "Fragments whose cached copy a crash now would drop.");
        /// Synchronous intent writes (a write or population waited for them).
        intent_syncs: u64, Counter("sce_persist_intent_syncs_total", "", "Write-intent block writes.");
        /// Intents set ahead of need: on reads of recently written slots (without the
        /// journal), on a slot's second write within `warm_rounds` rounds (with it).
        intent_presets: u64, Counter("sce_persist_intent_presets_total", "", "Intents set ahead of need.");
        /// Writes to cached fragments that waited for nothing: their slot's intent was
        /// durably set (write-hot), so no journal entry was needed.
        intent_hits: u64, Counter("sce_persist_intent_hit_writes_total", "", "Writes covered by a durable write intent, with no journal entry and no wait.");
        /// Metadata units written.
        units_written: u64, Counter("sce_persist_metadata_units_written_total", "", "Metadata units written.");
        /// Metadata bytes written (units, intent blocks, superblocks).
        metadata_bytes_written: u64, Counter("sce_persist_metadata_written_bytes_total", "bytes", "Bytes of metadata written.");
        /// Metadata write or read-back failures.
        metadata_errors: u64, Counter("sce_persist_metadata_errors_total", "", "Failed metadata writes.");
        /// Whether writes are journaled.
        journal: bool, Gauge("sce_persist_journal_enabled", "", "1 if writes to cached pages are journaled (--crash-journal on).");
        /// Journal entries appended (pages ranges of writes to cached slots).
        journal_appends: u64, Counter("sce_persist_journal_appends_total", "", "Write-journal entries appended.");
        /// Journal blocks written (one per group commit).
        journal_blocks: u64, Counter("sce_persist_journal_blocks_total", "", "Write-journal blocks written.");
        /// Journal bytes written.
        journal_bytes: u64, Counter("sce_persist_journal_written_bytes_total", "bytes", "Bytes of write-journal blocks written.");
        /// Writes that found the journal ring full and set their slot's intent instead.
        journal_full_fallbacks: u64, Counter("sce_persist_journal_full_fallbacks_total", "", "Writes that found the journal ring full and fell back to a fragment intent.");
        /// Metadata units whose page checksums are in memory now (the rest are read from
        /// the records when used).
        checksum_units_resident: u64, Gauge("sce_persist_checksum_units_resident", "", "Metadata units whose page checksums are in memory.");
        /// Bytes the page checksums take in memory (the units' table and the resident units).
        checksum_memory_bytes: u64, Gauge("sce_persist_checksum_memory_bytes", "bytes", "Memory taken by page checksums.");
        /// Units whose checksums were read from the records (a read, write or round needed
        /// them and they were not in memory).
        checksum_unit_loads: u64, Counter("sce_persist_checksum_unit_loads_total", "", "Metadata units read for their page checksums.");
        /// Units whose checksums left memory.
        checksum_unit_evictions: u64, Counter("sce_persist_checksum_unit_evictions_total", "", "Metadata units whose page checksums left memory.");
        /// Units read for their checksums whose two copies were both damaged (their pages
        /// fail verification, as damaged data does).
        checksum_units_damaged: u64, Counter("sce_persist_checksum_units_damaged_total", "", "Metadata units read for their checksums with both copies damaged.");
    }
    also {
        /// The device UUID.
        pub uuid: String,
        /// True if the device was formatted by this open.
        pub formatted_now: bool,
        /// Why the volume was invalidated at start ("" if it was not): the source's identity
        /// changed or is unknown, the device was rolled back to an older copy, or asked to.
        pub invalidated_because: String,
        /// Dirty (write-back) pages restored at start.
        pub dirty_pages_restored: u64,
        /// Pages of live dirty journal entries checked against their data at start.
        pub dirty_pages_replayed: u64,
        /// Dirty pages found torn or bad at start: lost (reads of them fail).
        pub dirty_pages_lost: u64,
        /// Fragments dropped at start because their metadata unit was rejected (upper bound).
        pub fragments_dropped_bad_metadata: u64,
        /// Metadata units rejected at start.
        pub units_rejected: u64,
        /// Flush rounds.
        pub flush_rounds: u64,
    }
}

#[derive(Debug, Default)]
struct Counters {
    journal_appends: AtomicU64,
    journal_blocks: AtomicU64,
    journal_bytes: AtomicU64,
    journal_full_fallbacks: AtomicU64,
    intent_syncs: AtomicU64,
    intent_presets: AtomicU64,
    intent_hits: AtomicU64,
    units_written: AtomicU64,
    metadata_bytes_written: AtomicU64,
    metadata_errors: AtomicU64,
    flush_rounds: AtomicU64,
    refill_pending: AtomicU64,
    refilled: AtomicU64,
}

/// A unit's index, its image, and its slots with whether each record claims pages.
struct UnitImage {
    unit: u32,
    image: Vec<u8>,
    slots: Vec<(u32, bool)>,
    /// The unit's checksum changes the image holds (`CrcCache::changes`).
    changes: crate::crcs::Changes,
    /// Every record that claims pages was written as it is (none left for the next round).
    whole: bool,
}

/// What a write or population waits for before it sends anything.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ticket {
    /// Intent block `block` durable at `version`.
    Intent { block: u32, version: u64 },
    /// Journal block `seq` durable.
    Journal(u64),
}

/// The persistent side of a cached volume.
pub(crate) struct Persist {
    dev: Arc<dyn BlockDevice>,
    pub(crate) layout: Layout,
    /// The device's UUID (journal blocks carry it).
    uuid: [u8; 16],
    sb: OrderedMutex<levels::Leaf, Superblock>,
    /// The volumes served, in address order (one unless several share the device).
    vols: Vec<PVol>,
    st: OrderedMutex<levels::PersistState, State>,
    intent_io: OrderedMutex<levels::PersistIntentIo, ()>,
    /// One flush round at a time (the flusher's, `flush_metadata`'s, `close`'s): two rounds
    /// would write images of the same unit with different sequence numbers, and each one's
    /// read-back would find the other's and count a metadata error.
    round_lock: OrderedMutex<levels::PersistRound, ()>,
    seq: AtomicU64,
    pub(crate) cfg: PersistConfig,
    counters: Counters,
    loaded: PersistStats,
    /// The source writes completed when the source's identity was last recorded.
    identity_writes: AtomicU64,
    /// Flush rounds so far: the clock of `warm_until`.
    round_no: AtomicU32,
    /// Per slot: the round until which the slot counts as written recently ("write-warm"),
    /// so that a read of it sets its intent ahead of the next write.
    warm_until: Box<[AtomicU32]>,
    /// Per slot: read since the last flush round while write-warm (keeps its intent set).
    read_touch: Box<[AtomicU64]>,
    /// The intent bits, readable without the state lock.
    intent_bits: Arc<[AtomicU64]>,
    /// The journal ring is half full: a flush round should run early.
    round_wanted: std::sync::atomic::AtomicBool,
    /// Writes set intents ahead of need (write-hot slots) that the intent writer has not
    /// been asked to make durable yet.
    presets_pending: std::sync::atomic::AtomicBool,
    /// The state file that records the superblock's sequence, kept open.
    state_seq: StateSeq,
    /// Fragments the start dropped by intent, to fill again from the source (`refill.rs`).
    refill: OrderedMutex<levels::Leaf, Vec<(u32, u64)>>,
}

/// What `open` hands back to the volume.
pub(crate) struct Opened {
    pub persist: Persist,
    pub loaded: sce_store::Loaded,
    /// The dirty data of volumes this start leaves out that the operator gave up
    /// (`--discard-dirty`): dropped only if the whole open succeeds, and logged then.
    pub given_up: Vec<sce_store::VolumeDirt>,
}

impl Persist {
    /// Writes the superblock with the next sequence number, then records that number in the
    /// state directory (so that a later start recognises an older copy of the device).
    fn write_sb(&self, sb: &mut Superblock) -> Result<(), IoError> {
        self.write_sb_with(sb, true)
    }

    /// `write_sb`; `sync_state`: fsync the state file too (not on the intent path, where a
    /// lost state-file update after a power failure only weakens the rollback check).
    fn write_sb_with(&self, sb: &mut Superblock, sync_state: bool) -> Result<(), IoError> {
        sb.seq = self.seq.fetch_add(1, Relaxed);
        self.counters
            .metadata_bytes_written
            .fetch_add(BLOCK, Relaxed);
        sce_store::write_superblock(&*self.dev, sb)?;
        self.state_seq
            .record(&self.cfg, &sb.uuid, sb.seq, sync_state);
        Ok(())
    }

    /// Records the source's current identity in the superblock if it differs from the
    /// stored one. The caller guarantees that `writes_done` source writes have completed and
    /// none was in flight when `identity` was taken, so the identity reflects every write
    /// this cache made: after a crash, a source whose identity still matches was not changed
    /// by anyone since. Cheap when nothing changed.
    pub(crate) fn record_identity(
        &self,
        identities: &[Option<String>],
        writes_done: u64,
    ) -> Result<(), IoError> {
        // No write of ours since the last record: nothing of ours to record, and a change
        // would be someone else's (left for the next start to find).
        if self.identity_writes.load(Relaxed) == writes_done {
            return Ok(());
        }
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        if self.set_identities(&mut sb, identities) {
            self.write_sb(&mut sb)?;
        }
        self.identity_writes.store(writes_done, Relaxed);
        Ok(())
    }

    /// Puts the volumes' current identities (one per volume, in address order) into `sb`;
    /// true if one changed.
    fn set_identities(&self, sb: &mut Superblock, identities: &[Option<String>]) -> bool {
        let mut changed = false;
        for (v, id) in self.vols.iter().zip(identities) {
            // A detached volume's source is written behind the cache's back: its identity
            // is not ours to record (the start drops it anyway).
            if sb.volumes[v.index].detached {
                continue;
            }
            let Some(id) = full_identity(id.clone(), v.source_generation.as_deref()) else {
                continue;
            };
            let h = sce_store::identity_hash(&id);
            if sb.volumes[v.index].identity != h {
                sb.volumes[v.index].identity = h;
                changed = true;
            }
        }
        changed
    }

    /// The cache device failed: invalidate every record at once (bump the generation) and
    /// mark the device failed, so no later start trusts it.
    pub(crate) fn fail(&self) -> Result<(), IoError> {
        let mut sb = self.sb.lock();
        for v in &self.vols {
            let v = &mut sb.volumes[v.index];
            v.generation = v.generation.wrapping_add(1);
        }
        sb.state = sce_store::DeviceState::Failed;
        let r = self.write_sb(&mut sb);
        if r.is_err() {
            if let Some(m) = marker(&self.cfg, &sb.uuid) {
                let text = format!(
                    "sce: cache device {} failed and could not be marked failed; reformat it before reuse\n",
                    sce_store::uuid_string(&sb.uuid)
                );
                let written = m
                    .parent()
                    .map_or(Ok(()), std::fs::create_dir_all)
                    .and_then(|()| std::fs::write(&m, text));
                if let Err(e) = written {
                    tracing::error!("cannot write the failure marker {}: {e}", m.display());
                } else {
                    tracing::error!("wrote the failure marker {}", m.display());
                    return Ok(());
                }
            }
        }
        r
    }

    /// Takes the (slot, fragment) records the start dropped by intent (`refill.rs` fills the
    /// fragments again).
    pub(crate) fn take_refill(&self) -> Vec<(u32, u64)> {
        // `start` counted them as pending already.
        std::mem::take(&mut *self.refill.lock())
    }

    /// One fragment of `take_refill`'s list done (`filled`: populated again, else skipped
    /// or failed).
    pub(crate) fn refill_done(&self, filled: bool) {
        let c = &self.counters;
        let _ = c
            .refill_pending
            .fetch_update(Relaxed, Relaxed, |n| n.checked_sub(1));
        if filled {
            c.refilled.fetch_add(1, Relaxed);
        }
    }

    /// The refill stopped early (shutdown, passthrough): nothing is pending any more.
    pub(crate) fn refill_stopped(&self) {
        self.counters.refill_pending.store(0, Relaxed);
    }

    /// True if the start left fragments to fill again.
    pub(crate) fn has_refill(&self) -> bool {
        !self.refill.lock().is_empty()
    }

    /// The device's uuid.
    pub(crate) fn uuid(&self) -> [u8; 16] {
        self.sb.lock().uuid
    }

    /// A snapshot of the counters.
    pub(crate) fn stats(&self) -> PersistStats {
        let c = &self.counters;
        PersistStats {
            dirty_intents: self
                .st
                .lock()
                .intents
                .iter()
                .map(|w| w.count_ones() as u64)
                .sum(),
            intent_syncs: c.intent_syncs.load(Relaxed),
            intent_presets: c.intent_presets.load(Relaxed),
            intent_hits: c.intent_hits.load(Relaxed),
            units_written: c.units_written.load(Relaxed),
            metadata_bytes_written: c.metadata_bytes_written.load(Relaxed),
            metadata_errors: c.metadata_errors.load(Relaxed),
            flush_rounds: c.flush_rounds.load(Relaxed),
            journal: self.cfg.journal,
            journal_appends: c.journal_appends.load(Relaxed),
            journal_blocks: c.journal_blocks.load(Relaxed),
            journal_bytes: c.journal_bytes.load(Relaxed),
            journal_full_fallbacks: c.journal_full_fallbacks.load(Relaxed),
            refill_pending: c.refill_pending.load(Relaxed),
            refilled: c.refilled.load(Relaxed),
            ..self.loaded.clone()
        }
    }
}

/// The source's identity with the operator's generation string, if any.
fn full_identity(source: Option<String>, generation: Option<&str>) -> Option<String> {
    let id = source?;
    Some(match generation {
        Some(g) => format!("{id}:generation={g}"),
        None => id,
    })
}
