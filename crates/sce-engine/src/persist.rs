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
//!   (per-slot epochs) and for a whole flush period before (so hot fragments keep their bit
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

use crate::volume::Shared;
use parking_lot::Mutex;
use sce_core::hotness::IntMap;
use sce_core::{CacheCore, FragNo, SlotNo};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use sce_store::layout::{BLOCK, SLOTS_PER_INTENT_BLOCK};
use sce_store::unit::{EntryIn, UnitBuilder, NO_FRAGMENT};
use sce_store::{Layout, ScanReport, Superblock};
use std::collections::BTreeSet;
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
    /// Flush rounds after a write during which the slot counts as "write-warm": a read of it
    /// keeps (or sets ahead of time) its write intent, so the next write need not wait for
    /// the cache device. The cost: a crash drops the write-warm slots that were read lately.
    pub warm_rounds: u32,
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
        }
    }
}

/// What loading found, and the persistence counters.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PersistStats {
    /// Format version of the device.
    pub format_version: u32,
    /// The device UUID.
    pub uuid: String,
    /// True if the previous run shut down cleanly.
    pub previous_shutdown_clean: bool,
    /// Unix seconds of the last clean shutdown (0: never).
    pub last_clean_shutdown: u64,
    /// True if the device was formatted by this open.
    pub formatted_now: bool,
    /// Fragments restored at start.
    pub fragments_restored: u64,
    /// Why the volume was invalidated at start ("" if it was not): the source's identity
    /// changed or is unknown, the device was rolled back to an older copy, or asked to.
    pub invalidated_because: String,
    /// Fragments dropped at start because their intent bit was set.
    pub fragments_dropped_intent: u64,
    /// Fragments dropped at start because their metadata unit was rejected (upper bound).
    pub fragments_dropped_bad_metadata: u64,
    /// Metadata units rejected at start.
    pub units_rejected: u64,
    /// Milliseconds the start-up load took.
    pub load_millis: u64,
    /// Intent bits set now (fragments whose cached copy would be dropped after a crash).
    pub dirty_intents: u64,
    /// Synchronous intent writes (a write or population waited for them).
    pub intent_syncs: u64,
    /// Intents set ahead of need, on reads of recently written slots.
    pub intent_presets: u64,
    /// Metadata units written.
    pub units_written: u64,
    /// Metadata bytes written (units, intent blocks, superblocks).
    pub metadata_bytes_written: u64,
    /// Metadata write or read-back failures.
    pub metadata_errors: u64,
    /// Flush rounds.
    pub flush_rounds: u64,
}

#[derive(Debug, Default)]
struct Counters {
    intent_syncs: AtomicU64,
    intent_presets: AtomicU64,
    units_written: AtomicU64,
    metadata_bytes_written: AtomicU64,
    metadata_errors: AtomicU64,
    flush_rounds: AtomicU64,
}

/// A unit's index, its image, and its slots with whether each record claims pages.
type UnitImage = (u32, Vec<u8>, Vec<(u32, bool)>);

/// A request to wait until intent block `block` is durable at `version`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    block: u32,
    version: u64,
}

struct State {
    /// Per slot: the fragment its on-device record may claim, or NO_FRAGMENT.
    mirror: Vec<u64>,
    /// Fragment -> the slot whose record may claim it.
    owner: IntMap<u64, u32>,
    /// The intent bitmap as wanted (one bit per slot).
    intents: Vec<u64>,
    /// Per intent block: version of the in-memory content, and version known durable.
    version: Vec<u64>,
    durable: Vec<u64>,
    /// Per slot: bumped by every write that touches its claims.
    epoch: Vec<u32>,
    /// Per slot: the epoch seen by the previous flush round.
    epoch_seen: Vec<u32>,
    /// Slots whose record must be written next round.
    redo: Vec<u32>,
    /// Units to rewrite next round.
    units: BTreeSet<u32>,
    /// A unit write went wrong: scan every unit next round for one it may have hit.
    scrub: bool,
    /// The intent bits, readable without this lock (kept equal to `intents`).
    intent_bits: Arc<[AtomicU64]>,
    /// Per slot: the version of its intent block that set its bit (the bit is durable once
    /// the block is durable at that version).
    set_version: Vec<u64>,
}

impl State {
    fn intent(&self, s: u32) -> bool {
        sce_store::bit(&self.intents, s)
    }

    fn set_intent(&mut self, s: u32, on: bool) {
        let (w, b) = (s as usize / 64, s % 64);
        if on {
            self.intents[w] |= 1 << b;
        } else {
            self.intents[w] &= !(1 << b);
        }
        self.intent_bits[w].store(self.intents[w], Relaxed);
        let block = (s as u64 / SLOTS_PER_INTENT_BLOCK) as usize;
        self.version[block] += 1;
        if on {
            self.set_version[s as usize] = self.version[block];
        }
    }

    /// A write touches slot `s`'s claims: bump its epoch, set its intent; the ticket to wait
    /// for, if the intent is not durable yet. Only the version that set *this* bit matters:
    /// other bits of the block changing since (presets, clears) do not make it wait.
    fn touch(&mut self, s: u32) -> Option<Ticket> {
        self.epoch[s as usize] = self.epoch[s as usize].wrapping_add(1);
        if !self.intent(s) {
            self.set_intent(s, true);
        }
        let block = (s as u64 / SLOTS_PER_INTENT_BLOCK) as u32;
        let v = self.set_version[s as usize];
        (self.durable[block as usize] < v).then_some(Ticket { block, version: v })
    }
}

/// The persistent side of a cached volume.
pub(crate) struct Persist {
    dev: Arc<dyn BlockDevice>,
    pub(crate) layout: Layout,
    sb: Mutex<Superblock>,
    volume: usize,
    st: Mutex<State>,
    intent_io: Mutex<()>,
    /// One flush round at a time (the flusher's, `flush_metadata`'s, `close`'s): two rounds
    /// would write images of the same unit with different sequence numbers, and each one's
    /// read-back would find the other's and count a metadata error.
    round_lock: Mutex<()>,
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
}

/// What `open` hands back to the volume.
pub(crate) struct Opened {
    pub persist: Persist,
    pub loaded: sce_store::Loaded,
}

fn block_image(intents: &[u64], block: u32) -> AlignedBuf {
    let mut buf = AlignedBuf::new(BLOCK as usize);
    let first = block as usize * (BLOCK as usize / 8);
    for (i, w) in intents
        .iter()
        .skip(first)
        .take(BLOCK as usize / 8)
        .enumerate()
    {
        buf[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    buf
}

impl Persist {
    /// Opens (or formats) the persistent store on `dev` for a source of `source_size` bytes
    /// and loads its contents. Does not touch the core.
    pub(crate) fn open(
        dev: Arc<dyn BlockDevice>,
        cfg: PersistConfig,
        fragment_size: u64,
        source_size: u64,
        source_identity: Option<String>,
    ) -> Result<Opened, sce_store::StoreError> {
        use sce_store::StoreError;
        let started = std::time::Instant::now();
        let identity = full_identity(source_identity, &cfg);
        let identity_hash = identity.as_deref().map_or(
            [0; sce_store::superblock::IDENTITY_BYTES],
            sce_store::identity_hash,
        );
        let volume = sce_store::Volume {
            id: 1,
            generation: 1,
            source_size,
            name: cfg.volume_name.clone(),
            identity: identity_hash,
        };
        let fmt = |dev: &dyn BlockDevice| {
            sce_store::format(
                dev,
                &sce_store::FormatOptions {
                    fragment_size,
                    volume: volume.clone(),
                    size: None,
                },
            )
        };
        let mut formatted_now = false;
        let sb = match sce_store::read_superblock(&*dev) {
            Ok(sb) => {
                let usable = sb.state != sce_store::DeviceState::Failed
                    && sb.layout.fragment_size == fragment_size
                    && sce_store::find_volume(&sb, &cfg.volume_name, source_size).is_ok();
                if usable {
                    sb
                } else if cfg.reformat {
                    formatted_now = true;
                    fmt(&*dev)?
                } else if sb.state == sce_store::DeviceState::Failed {
                    return Err(StoreError::Failed);
                } else if sb.layout.fragment_size != fragment_size {
                    return Err(StoreError::Geometry(format!(
                        "the cache device is formatted with {}-byte fragments, not {fragment_size}; pass --reformat to change it",
                        sb.layout.fragment_size
                    )));
                } else {
                    sce_store::find_volume(&sb, &cfg.volume_name, source_size)?;
                    sb
                }
            }
            Err(StoreError::NotFormatted) => {
                formatted_now = true;
                fmt(&*dev)?
            }
            Err(e) if cfg.reformat && !matches!(e, StoreError::Io(_)) => {
                formatted_now = true;
                fmt(&*dev)?
            }
            Err(e) => return Err(e),
        };
        let mut sb = sb;
        if let Some(m) = marker(&cfg, &sb.uuid) {
            if m.exists() {
                if !cfg.reformat {
                    return Err(StoreError::Failed);
                }
                let _ = std::fs::remove_file(&m);
                formatted_now = true;
                sb = fmt(&*dev)?;
            }
        }
        let vi = sce_store::find_volume(&sb, &cfg.volume_name, source_size)?;
        // Never stale across a restart: what the device holds for this volume is dropped
        // (one generation bump) unless the source is provably the one it cached, unchanged,
        // and the device is the newest copy this host wrote.
        let mut why = Vec::new();
        let seen_seq = state_seq(&cfg, &sb.uuid);
        if cfg.forget_volume {
            why.push("asked to forget the volume".to_string());
        }
        if !formatted_now {
            match &identity {
                None => why.push("the source cannot be identified".into()),
                Some(_)
                    if sb.volumes[vi].identity == [0; sce_store::superblock::IDENTITY_BYTES] =>
                {
                    why.push("no identity of the source was recorded yet (`sce format`)".into())
                }
                Some(_) if sb.volumes[vi].identity != identity_hash => why.push(format!(
                    "the source changed since the cache last recorded it (now {})",
                    identity.as_deref().unwrap_or("")
                )),
                Some(_) => {}
            }
            if let Some(seen) = seen_seq {
                if seen > sb.seq {
                    why.push(format!(
                        "the cache device is an older copy: its superblock sequence is {}, this host wrote {seen}",
                        sb.seq
                    ));
                }
            }
        }
        if !why.is_empty() || sb.volumes[vi].identity != identity_hash {
            if !why.is_empty() {
                sb.volumes[vi].generation = sb.volumes[vi].generation.wrapping_add(1);
                if sb.volumes[vi].identity == [0; sce_store::superblock::IDENTITY_BYTES] {
                    tracing::info!(volume = %cfg.volume_name, "{}", why.join("; "));
                } else {
                    tracing::warn!(
                        volume = %cfg.volume_name,
                        "dropping everything cached for the volume: {}",
                        why.join("; ")
                    );
                }
            }
            sb.volumes[vi].identity = identity_hash;
            sb.seq = sb.seq.max(seen_seq.unwrap_or(0)) + 1;
            sce_store::write_superblock(&*dev, &sb)?;
            record_state_seq(&cfg, &sb.uuid, sb.seq, true);
        }
        let frags = source_size.div_ceil(fragment_size);
        let loaded = sce_store::load(&*dev, sb.clone(), vi, frags)?;
        let layout = sb.layout;
        let r: &ScanReport = &loaded.report;
        let stats = PersistStats {
            format_version: sb.version,
            uuid: sce_store::uuid_string(&sb.uuid),
            previous_shutdown_clean: sb.state == sce_store::DeviceState::Clean,
            last_clean_shutdown: sb.last_clean_shutdown,
            formatted_now,
            fragments_restored: 0,
            invalidated_because: why.join("; "),
            fragments_dropped_intent: r.slots_dropped_intent,
            fragments_dropped_bad_metadata: r.slots_in_bad_units,
            units_rejected: (r.units_corrupt + r.units_misplaced + r.units_foreign) as u64,
            load_millis: started.elapsed().as_millis() as u64,
            ..PersistStats::default()
        };
        let slots = layout.slots as usize;
        let blocks = layout.intent_blocks as usize;
        let intent_bits: Arc<[AtomicU64]> =
            loaded.intents.iter().map(|&w| AtomicU64::new(w)).collect();
        let warm_rounds = cfg.warm_rounds;
        let st = State {
            intent_bits: intent_bits.clone(),
            set_version: vec![1; slots],
            mirror: vec![NO_FRAGMENT; slots],
            owner: IntMap::default(),
            intents: loaded.intents.clone(),
            version: vec![1; blocks],
            durable: vec![1; blocks],
            epoch: vec![0; slots],
            epoch_seen: vec![0; slots],
            redo: Vec::new(),
            units: loaded.rewrite_units.iter().copied().collect(),
            scrub: false,
        };
        Ok(Opened {
            persist: Persist {
                dev,
                layout,
                seq: AtomicU64::new(sb.seq + 1),
                sb: Mutex::new(sb),
                volume: vi,
                st: Mutex::new(st),
                intent_io: Mutex::new(()),
                round_lock: Mutex::new(()),
                cfg,
                counters: Counters::default(),
                loaded: stats,
                // The identity stored now is the source's as opened, before any write.
                identity_writes: AtomicU64::new(0),
                round_no: AtomicU32::new(0),
                // Every slot starts write-warm: the first reads after a start set the intents
                // of the slots they hit ahead of the first writes.
                warm_until: (0..slots).map(|_| AtomicU32::new(warm_rounds)).collect(),
                read_touch: (0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
                intent_bits,
            },
            loaded,
        })
    }

    /// After the core restored what it could: records the claims of restored slots, puts an
    /// intent on every slot whose record claims something that was not restored, and marks
    /// the device open. Must run before the volume serves anything.
    pub(crate) fn start(
        &mut self,
        core: &CacheCore,
        loaded: &sce_store::Loaded,
    ) -> Result<(), IoError> {
        let mut tickets = Vec::new();
        let mut restored = 0;
        {
            let st = self.st.get_mut();
            for &(s, f) in &loaded.entries {
                if core.slot_state(SlotNo(s)).0 == Some(FragNo(f)) {
                    st.mirror[s as usize] = f;
                    st.owner.insert(f, s);
                    restored += 1;
                } else {
                    // A duplicate claim: it must not survive a crash unguarded.
                    tickets.extend(st.touch(s));
                    st.units.insert(self.layout.unit_of(s).0);
                }
            }
            for &s in &loaded.unloaded_claims {
                tickets.extend(st.touch(s));
                st.units.insert(self.layout.unit_of(s).0);
            }
        }
        self.loaded.fragments_restored = restored;
        self.sync(&tickets)?;
        let mut sb = self.sb.lock();
        if sb.state != sce_store::DeviceState::Clean {
            sb.unclean_starts += 1;
        }
        sb.state = sce_store::DeviceState::Open;
        sb.last_open = sce_store::unix_now();
        self.write_sb(&mut sb)
    }

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
        record_state_seq(&self.cfg, &sb.uuid, sb.seq, sync_state);
        Ok(())
    }

    /// The volume's id in the table (it seeds the page checksums).
    pub(crate) fn volume_id(&self) -> u16 {
        self.sb.lock().volumes[self.volume].id
    }

    /// Records the source's current identity in the superblock if it differs from the
    /// stored one. The caller guarantees that `writes_done` source writes have completed and
    /// none was in flight when `identity` was taken, so the identity reflects every write
    /// this cache made: after a crash, a source whose identity still matches was not changed
    /// by anyone since. Cheap when nothing changed.
    pub(crate) fn record_identity(
        &self,
        identity: Option<String>,
        writes_done: u64,
    ) -> Result<(), IoError> {
        // No write of ours since the last record: nothing of ours to record, and a change
        // would be someone else's (left for the next start to find).
        if self.identity_writes.load(Relaxed) == writes_done {
            return Ok(());
        }
        let Some(id) = full_identity(identity, &self.cfg) else {
            return Ok(());
        };
        let h = sce_store::identity_hash(&id);
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return Ok(());
        }
        if sb.volumes[self.volume].identity != h {
            sb.volumes[self.volume].identity = h;
            self.write_sb(&mut sb)?;
        }
        self.identity_writes.store(writes_done, Relaxed);
        Ok(())
    }

    /// Under the core lock, before a write's source write and cache copies are sent: the
    /// intents it needs. `frags` are the fragments written, `copies` the slots its cache
    /// copies go to, with the fragment each holds.
    pub(crate) fn guard_write(
        &self,
        frags: impl Iterator<Item = u64>,
        copies: impl Iterator<Item = (u32, u64)>,
    ) -> Vec<Ticket> {
        let mut st = self.st.lock();
        let mut t = Vec::new();
        let warm = self
            .round_no
            .load(Relaxed)
            .saturating_add(self.cfg.warm_rounds);
        for f in frags {
            if let Some(&s) = st.owner.get(&f) {
                t.extend(st.touch(s));
                self.warm_until[s as usize].store(warm, Relaxed);
            }
        }
        for (s, f) in copies {
            let m = st.mirror[s as usize];
            if m != NO_FRAGMENT && m != f {
                t.extend(st.touch(s));
            }
        }
        t
    }

    /// Under the core lock, before data for fragment `f` is written into slot `s`
    /// (population, inline fill).
    pub(crate) fn guard_slot(&self, s: u32, f: u64) -> Option<Ticket> {
        let mut st = self.st.lock();
        let m = st.mirror[s as usize];
        if m != NO_FRAGMENT && m != f {
            st.touch(s)
        } else {
            None
        }
    }

    /// A read hit slot `s`. If the slot was written in the last `warm_rounds` flush rounds,
    /// its intent is kept set (or set now, ahead of the next write, which then need not wait
    /// for the cache device). Returns true if an intent was set that the intent writer must
    /// make durable (`write_pending`). Lock-free unless it sets the intent.
    pub(crate) fn preset(&self, s: u32) -> bool {
        let Some(warm) = self.warm_until.get(s as usize) else {
            return false;
        };
        if warm.load(Relaxed) < self.round_no.load(Relaxed) {
            return false;
        }
        let (w, b) = (s as usize / 64, 1u64 << (s % 64));
        if self.read_touch[w].load(Relaxed) & b == 0 {
            self.read_touch[w].fetch_or(b, Relaxed);
        }
        if self.intent_bits[w].load(Relaxed) & b != 0 {
            return false;
        }
        let mut st = self.st.lock();
        if st.intent(s) {
            return false;
        }
        st.set_intent(s, true);
        self.counters.intent_presets.fetch_add(1, Relaxed);
        true
    }

    /// Slot `s` was just populated: it counts as write-warm for `warm_rounds` flush rounds,
    /// so the first reads of it set its intent ahead of a first write.
    pub(crate) fn warm(&self, s: u32) {
        if let Some(w) = self.warm_until.get(s as usize) {
            let until = self
                .round_no
                .load(Relaxed)
                .saturating_add(self.cfg.warm_rounds);
            w.fetch_max(until, Relaxed);
        }
    }

    /// Writes every intent block whose in-memory content is newer than what is durable
    /// (the intents set ahead of need), without anyone waiting for it. A write that needs
    /// one of these intents meanwhile waits only for the rest of this write.
    pub(crate) fn write_pending(&self) -> Result<(), IoError> {
        let _io = self.intent_io.lock();
        let blocks: Vec<u32> = {
            let st = self.st.lock();
            (0..st.version.len() as u32)
                .filter(|&b| st.durable[b as usize] < st.version[b as usize])
                .collect()
        };
        if blocks.is_empty() {
            return Ok(());
        }
        self.write_intent_blocks(&blocks)
    }

    /// Waits until the intent blocks of `tickets` are durable at their versions, writing
    /// them if needed. Concurrent callers share writes (group commit).
    pub(crate) fn sync(&self, tickets: &[Ticket]) -> Result<(), IoError> {
        if tickets.is_empty() {
            return Ok(());
        }
        let _io = self.intent_io.lock();
        let mut blocks: Vec<u32> = {
            let st = self.st.lock();
            tickets
                .iter()
                .filter(|t| st.durable[t.block as usize] < t.version)
                .map(|t| t.block)
                .collect()
        };
        blocks.sort_unstable();
        blocks.dedup();
        if blocks.is_empty() {
            return Ok(());
        }
        self.counters.intent_syncs.fetch_add(1, Relaxed);
        self.write_intent_blocks(&blocks)
    }

    /// Writes the current content of intent blocks (caller holds `intent_io`), then flushes.
    fn write_intent_blocks(&self, blocks: &[u32]) -> Result<(), IoError> {
        let mut done = Vec::new();
        for &b in blocks {
            let (img, v) = {
                let st = self.st.lock();
                (block_image(&st.intents, b), st.version[b as usize])
            };
            self.dev
                .write_at(self.layout.intent_offset + b as u64 * BLOCK, &img)?;
            self.counters
                .metadata_bytes_written
                .fetch_add(BLOCK, Relaxed);
            done.push((b, v));
        }
        // The superblock goes with every intent write, with a new sequence number that the
        // state directory records too: a copy of the device taken before this write (a file
        // copy, a snapshot) then carries an older sequence, and a start that is handed that
        // copy back after a crash recognises it, although the copy's intents and records are
        // each sound. Its write flushes the intent blocks as well.
        {
            let mut sb = self.sb.lock();
            if sb.state == sce_store::DeviceState::Failed {
                self.dev.flush()?;
            } else {
                self.write_sb_with(&mut sb, false)?;
            }
        }
        let mut st = self.st.lock();
        for (b, v) in done {
            let d = &mut st.durable[b as usize];
            *d = (*d).max(v);
        }
        Ok(())
    }

    /// One flush round: snapshots changed slots and quiet intents, flushes the data, writes
    /// and verifies the records, then clears the intents that stayed quiet. `force` treats
    /// every intent as quiet (clean shutdown, nothing in flight). Returns the number of
    /// metadata errors.
    pub(crate) fn round(&self, shared: &Shared, force: bool) -> u64 {
        let _one_at_a_time = self.round_lock.lock();
        self.counters.flush_rounds.fetch_add(1, Relaxed);
        let l = self.layout;
        if std::mem::take(&mut self.st.lock().scrub) {
            self.scrub();
        }
        let words = l.bitmap_words();
        let (vol_id, generation, uuid) = {
            let sb = self.sb.lock();
            let v = &sb.volumes[self.volume];
            (v.id, v.generation, sb.uuid)
        };
        // 1. Snapshot under the core lock.
        let mut images: Vec<UnitImage> = Vec::new();
        let mut clear: Vec<(u32, u32)> = Vec::new();
        self.round_no.fetch_add(1, Relaxed);
        // Slots read while write-warm since the last round keep their intents.
        let read: Vec<u64> = self.read_touch.iter().map(|w| w.swap(0, Relaxed)).collect();
        {
            let mut core = shared.core.write();
            let mut st = self.st.lock();
            let mut units: BTreeSet<u32> = std::mem::take(&mut st.units);
            for s in core.take_dirty() {
                units.insert(l.unit_of(s.0).0);
            }
            for s in std::mem::take(&mut st.redo) {
                units.insert(l.unit_of(s).0);
            }
            for w in 0..st.intents.len() {
                let mut bits = st.intents[w];
                while bits != 0 {
                    let s = (w * 64) as u32 + bits.trailing_zeros();
                    bits &= bits - 1;
                    let e = st.epoch[s as usize];
                    let quiet =
                        force || (e == st.epoch_seen[s as usize] && !sce_store::bit(&read, s));
                    st.epoch_seen[s as usize] = e;
                    if !quiet {
                        continue;
                    }
                    let (x, _) = core.slot_state(SlotNo(s));
                    let m = st.mirror[s as usize];
                    if x.is_some_and(|x| core.fragment_busy(x))
                        || (m != NO_FRAGMENT && core.fragment_busy(FragNo(m)))
                    {
                        continue;
                    }
                    clear.push((s, e));
                    units.insert(l.unit_of(s).0);
                }
            }
            if units.is_empty() {
                return 0;
            }
            let seq = self.seq.fetch_add(1, Relaxed);
            let crcs = shared.crcs.as_ref().expect("persistence keeps checksums");
            for u in units {
                let mut b = UnitBuilder::new(&l, &uuid, u, seq);
                let mut slots = Vec::new();
                let (first, end) = l.unit_slots(u);
                for s in first..end {
                    let (x, bits) = core.slot_state(SlotNo(s));
                    let claim = x.filter(|_| bits.iter().any(|&w| w != 0));
                    let m = st.mirror[s as usize];
                    let ok = claim.filter(|x| {
                        (m == NO_FRAGMENT || m == x.0) && st.owner.get(&x.0).is_none_or(|&o| o == s)
                    });
                    if claim.is_some() && ok.is_none() {
                        st.redo.push(s);
                    }
                    if let Some(x) = ok {
                        b.set(
                            s - first,
                            &EntryIn {
                                frag: x.0,
                                volume: vol_id,
                                generation,
                                bitmap: &bits[..words],
                            },
                            |p| crcs.get(s, p),
                        );
                        st.mirror[s as usize] = x.0;
                        st.owner.insert(x.0, s);
                    }
                    slots.push((s, ok.is_some()));
                }
                images.push((u, b.finish(), slots));
            }
        }
        // 2. Make the data the records vouch for durable.
        let mut errors = 0;
        if self.dev.flush().is_err() {
            errors += 1;
            let mut st = self.st.lock();
            st.units.extend(images.iter().map(|i| i.0));
            self.counters.metadata_errors.fetch_add(errors, Relaxed);
            return errors;
        }
        // 3. Write the units, adjacent ones in one request; 4. read them back.
        let mut ok_units = vec![true; images.len()];
        let mut i = 0;
        while i < images.len() {
            let mut j = i + 1;
            while j < images.len() && images[j].0 == images[j - 1].0 + 1 && j - i < 256 {
                j += 1;
            }
            let us = l.unit_size as usize;
            let mut buf = AlignedBuf::new((j - i) * us);
            for (k, img) in images[i..j].iter().enumerate() {
                buf[k * us..(k + 1) * us].copy_from_slice(&img.1);
            }
            let at = l.unit_offset(images[i].0);
            let ok = self.dev.write_at(at, &buf).is_ok();
            self.counters
                .metadata_bytes_written
                .fetch_add(buf.len() as u64, Relaxed);
            self.counters
                .units_written
                .fetch_add((j - i) as u64, Relaxed);
            if !ok {
                ok_units[i..j].fill(false);
            }
            i = j;
        }
        if self.dev.flush().is_err() {
            ok_units.fill(false);
        }
        if self.cfg.verify_metadata {
            let us = l.unit_size as usize;
            let mut back = AlignedBuf::new(us);
            for (k, img) in images.iter().enumerate() {
                if ok_units[k]
                    && (self.dev.read_at(l.unit_offset(img.0), &mut back).is_err()
                        || back[..] != img.1[..])
                {
                    ok_units[k] = false;
                }
            }
        }
        // 5. Forget claims the device no longer holds; clear intents that stayed quiet.
        let mut blocks = Vec::new();
        {
            let mut st = self.st.lock();
            for (k, (u, _, slots)) in images.iter().enumerate() {
                if !ok_units[k] {
                    errors += 1;
                    st.units.insert(*u);
                    // A misdirected write damaged some other unit: find it next round.
                    st.scrub = true;
                    continue;
                }
                for &(s, claimed) in slots {
                    let m = st.mirror[s as usize];
                    if !claimed && m != NO_FRAGMENT {
                        if st.owner.get(&m) == Some(&s) {
                            st.owner.remove(&m);
                        }
                        st.mirror[s as usize] = NO_FRAGMENT;
                    }
                }
            }
            for (s, e) in clear {
                let k = images
                    .binary_search_by_key(&l.unit_of(s).0, |i| i.0)
                    .expect("unit snapshotted");
                if ok_units[k] && st.epoch[s as usize] == e && st.intent(s) {
                    st.set_intent(s, false);
                    blocks.push((s as u64 / SLOTS_PER_INTENT_BLOCK) as u32);
                }
            }
        }
        blocks.sort_unstable();
        blocks.dedup();
        if !blocks.is_empty() {
            let _io = self.intent_io.lock();
            if self.write_intent_blocks(&blocks).is_err() {
                errors += 1;
            }
        }
        self.counters.metadata_errors.fetch_add(errors, Relaxed);
        errors
    }

    /// Reads every unit and queues the rejected ones (torn, misplaced, foreign) for rewriting.
    /// Runs after a unit write went wrong, since a misdirected write lands on another unit.
    fn scrub(&self) {
        let l = self.layout;
        let uuid = self.sb.lock().uuid;
        let per = ((8 << 20) / l.unit_size).max(1);
        let mut buf = AlignedBuf::new((per * l.unit_size) as usize);
        let mut bad = Vec::new();
        let mut u = 0;
        while u < l.units {
            let n = per.min(l.units - u);
            if self
                .dev
                .read_at(l.unit_offset(u), &mut buf[..(n * l.unit_size) as usize])
                .is_err()
            {
                self.st.lock().scrub = true;
                return;
            }
            for k in 0..n {
                let img = &buf[(k * l.unit_size) as usize..((k + 1) * l.unit_size) as usize];
                match sce_store::unit::decode_unit(&l, &uuid, u + k, img, |_, _| {}) {
                    Ok(()) | Err(sce_store::unit::UnitError::Blank) => {}
                    Err(_) => bad.push(u + k),
                }
            }
            u += n;
        }
        self.st.lock().units.extend(bad);
    }

    /// True if every intent is clear and nothing is queued.
    fn settled(&self) -> bool {
        let st = self.st.lock();
        st.redo.is_empty() && st.units.is_empty() && st.intents.iter().all(|&w| w == 0)
    }

    /// Clean shutdown (nothing in flight): writes every record, clears every intent and marks
    /// the device clean. Returns false if it could not (the device stays "open" and the next
    /// start recovers as after a crash).
    pub(crate) fn close(
        &self,
        shared: &Shared,
        identity: Option<String>,
        writes_done: u64,
    ) -> bool {
        for _ in 0..4 {
            if self.round(shared, true) > 0 {
                return false;
            }
            if self.settled() {
                break;
            }
        }
        if !self.settled() {
            return false;
        }
        let mut sb = self.sb.lock();
        if sb.state == sce_store::DeviceState::Failed {
            return false;
        }
        // Only a change this cache's own writes can explain is recorded: if it made none since
        // the identity was last recorded, a changed identity is someone else's doing, and is
        // left for the next start to find.
        if self.identity_writes.load(Relaxed) != writes_done {
            if let Some(id) = full_identity(identity, &self.cfg) {
                sb.volumes[self.volume].identity = sce_store::identity_hash(&id);
            }
        }
        sb.state = sce_store::DeviceState::Clean;
        sb.last_clean_shutdown = sce_store::unix_now();
        sb.clean_shutdowns += 1;
        self.write_sb(&mut sb).is_ok()
    }

    /// The cache device failed: invalidate every record at once (bump the generation) and
    /// mark the device failed, so no later start trusts it.
    pub(crate) fn fail(&self) -> Result<(), IoError> {
        let mut sb = self.sb.lock();
        let v = &mut sb.volumes[self.volume];
        v.generation = v.generation.wrapping_add(1);
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
            units_written: c.units_written.load(Relaxed),
            metadata_bytes_written: c.metadata_bytes_written.load(Relaxed),
            metadata_errors: c.metadata_errors.load(Relaxed),
            flush_rounds: c.flush_rounds.load(Relaxed),
            ..self.loaded.clone()
        }
    }
}

/// The source's identity with the operator's generation string, if any.
fn full_identity(source: Option<String>, cfg: &PersistConfig) -> Option<String> {
    let id = source?;
    Some(match &cfg.source_generation {
        Some(g) => format!("{id}:generation={g}"),
        None => id,
    })
}

/// The state file that remembers the newest superblock sequence this host wrote to device
/// `uuid`.
fn state_file(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<std::path::PathBuf> {
    cfg.state_dir
        .as_ref()
        .map(|d| d.join(format!("seq-{}", sce_store::uuid_string(uuid))))
}

/// The newest superblock sequence this host recorded for device `uuid`, if any.
fn state_seq(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<u64> {
    let text = std::fs::read_to_string(state_file(cfg, uuid)?).ok()?;
    text.trim().parse().ok()
}

/// Records `seq` as the newest superblock sequence of device `uuid` (write, fsync, rename).
/// Best effort: a failure only weakens the detection of a rolled-back device, and is logged.
fn record_state_seq(cfg: &PersistConfig, uuid: &[u8; 16], seq: u64, sync: bool) {
    let Some(path) = state_file(cfg, uuid) else {
        return;
    };
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let tmp = path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        writeln!(f, "{seq}")?;
        if sync {
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)
    };
    if let Err(e) = write() {
        tracing::warn!(
            "cannot record the superblock sequence in {}: {e}",
            path.display()
        );
    }
}

/// The failure marker file of device `uuid`, if a state directory is configured.
fn marker(cfg: &PersistConfig, uuid: &[u8; 16]) -> Option<std::path::PathBuf> {
    cfg.state_dir
        .as_ref()
        .map(|d| d.join(format!("failed-{}", sce_store::uuid_string(uuid))))
}
