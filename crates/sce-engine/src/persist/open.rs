//! Opening the store: read or format the superblock, decide whether what the device
//! holds for the volume can be trusted, load it, and start.

use super::intents::State;
use super::refuse::{
    dropping_dirty, older_copy, refuse_leaving_dirty_out, refuse_older_copy_with_dirty_data,
    refuse_unlocatable_damage, unreadable_may_hold_dirty,
};
use super::vols::{OpenVolume, PVol};
use super::{
    full_identity, marker, record_state_seq, state_seq, Counters, Opened, Persist, PersistConfig,
    PersistStats,
};

/// Whether the device `sb` can serve the volumes `wanted`: it holds one of them at least
/// (a device of other sources may be another export's cache) and can take the others.
fn fits(sb: &Superblock, wanted: &[(String, u64)]) -> Result<Vec<usize>, StoreError> {
    if !wanted
        .iter()
        .any(|(n, _)| sb.volumes.iter().any(|v| &v.name == n))
    {
        sce_store::find_volume(sb, &wanted[0].0, wanted[0].1)?;
    }
    sce_store::ensure_volumes(&mut sb.clone(), wanted)
}

/// The volumes `vols` (table indices `indices`) as the load takes them and as the store
/// keeps them.
pub(super) fn placed(
    vols: &[OpenVolume],
    indices: &[usize],
    sb: &Superblock,
    fragment_size: u64,
) -> (Vec<sce_store::LoadVolume>, Vec<PVol>) {
    vols.iter()
        .zip(indices)
        .map(|(v, &index)| {
            let base = v.base / fragment_size;
            let load = sce_store::LoadVolume {
                index,
                fragments: v.size.div_ceil(fragment_size),
                base,
            };
            let keep = PVol {
                index,
                id: sb.volumes[index].id,
                base,
                source_generation: v.source_generation.clone(),
            };
            (load, keep)
        })
        .unzip()
}

/// What a load found, as the persistence counters report it.
fn load_stats(sb: &Superblock, r: &ScanReport, formatted_now: bool, why: String) -> PersistStats {
    PersistStats {
        format_version: sb.version,
        uuid: sce_store::uuid_string(&sb.uuid),
        previous_shutdown_clean: sb.state == sce_store::DeviceState::Clean,
        last_clean_shutdown: sb.last_clean_shutdown,
        formatted_now,
        fragments_restored: 0,
        invalidated_because: why,
        fragments_dropped_intent: r.slots_dropped_intent,
        journal_pages_dropped: r.journal_pages_dropped,
        journal_fragments_hit: r.journal_fragments_hit,
        journal_blocks_replayed: r.journal_blocks_live,
        dirty_pages_restored: r.pages_dirty,
        dirty_pages_replayed: r.dirty_pages_replayed,
        dirty_pages_lost: r.dirty_pages_lost,
        fragments_dropped_bad_metadata: r.slots_in_bad_units,
        units_rejected: (r.units_corrupt + r.units_misplaced + r.units_foreign) as u64,
        ..PersistStats::default()
    }
}

/// Why what the device holds for volume `v` (its table entry `t`) cannot be trusted, if
/// it cannot (besides the device being an older copy). `identity_hash`: the source's now,
/// to compare with the recorded one (None: the device was formatted now).
fn reasons(
    v: &Trusted<'_>,
    t: &sce_store::Volume,
    (reattach, own_writes): (bool, bool),
    identity_hash: Option<[u8; sce_store::superblock::IDENTITY_BYTES]>,
) -> Vec<String> {
    let zero = [0; sce_store::superblock::IDENTITY_BYTES];
    let mut why = Vec::new();
    if v.forget {
        why.push("asked to forget the volume".to_string());
    }
    if t.detached && !reattach {
        why.push(
            "the cache was detached from the source (sce ctl detach): writes may have reached it since"
                .to_string(),
        );
    }
    // An attach that drops what was written while detached: the source changed by those
    // writes only (served by this process, the source held), so a changed identity is
    // theirs.
    let Some(identity_hash) = identity_hash.filter(|_| !own_writes) else {
        return why;
    };
    match &v.identity {
        None => why.push("the source cannot be identified".into()),
        Some(_) if t.identity == zero => {
            why.push("no identity of the source was recorded yet (`sce format`)".into())
        }
        Some(id) if t.identity != identity_hash => why.push(format!(
            "the source changed since the cache last recorded it (now {id})"
        )),
        Some(_) => {}
    }
    why
}

/// A volume as `trust` judges it.
struct Trusted<'a> {
    index: usize,
    identity: Option<&'a str>,
    forget: bool,
    name: &'a str,
}
use crate::order::OrderedMutex as Mutex;

use sce_io::{BlockDevice, IoError};
use sce_store::{ScanReport, StoreError, Superblock};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::Arc;

impl Persist {
    /// Opens (or formats) the persistent store on `dev` for the volumes `vols` (in address
    /// order; one unless several share the device) and loads their contents. Does not touch
    /// the core.
    pub(crate) fn open(
        dev: Arc<dyn BlockDevice>,
        cfg: PersistConfig,
        fragment_size: u64,
        vols: &[OpenVolume],
    ) -> Result<Opened, StoreError> {
        Self::open_laid_out(dev, cfg, fragment_size, vols, false)
    }

    /// [`Persist::open`], formatting a usable device afresh if `relayout` (its slots' dirty
    /// data was drained to the source, or write-back needs a log it lacks: `crate::slots`).
    pub(crate) fn open_laid_out(
        dev: Arc<dyn BlockDevice>,
        cfg: PersistConfig,
        fragment_size: u64,
        vols: &[OpenVolume],
        relayout: bool,
    ) -> Result<Opened, StoreError> {
        let started = std::time::Instant::now();
        let identities: Vec<Option<String>> = vols
            .iter()
            .map(|v| full_identity(v.identity.clone(), v.source_generation.as_deref()))
            .collect();
        let wanted: Vec<(String, u64)> = vols.iter().map(|v| (v.name.clone(), v.size)).collect();
        let first = identities[0].as_deref().map_or(
            [0; sce_store::superblock::IDENTITY_BYTES],
            sce_store::identity_hash,
        );
        let (mut sb, formatted_now) =
            Self::superblock(&dev, &cfg, (fragment_size, relayout), &wanted, first)?;
        let given_up = if formatted_now {
            Vec::new()
        } else {
            refuse_leaving_dirty_out(&dev, &cfg, &sb, &wanted)?
        };
        let indices = sce_store::ensure_volumes(&mut sb, &wanted)?;
        let trusted: Vec<Trusted> = (0..vols.len())
            .map(|k| Trusted {
                index: indices[k],
                identity: identities[k].as_deref(),
                forget: vols[k].forget || cfg.forget_volume,
                name: &vols[k].name,
            })
            .collect();
        refuse_older_copy_with_dirty_data(&dev, &cfg, &sb, formatted_now, (vols, &indices))?;
        let why = Self::trust(&dev, &cfg, &mut sb, &trusted, formatted_now)?;
        let (lv, pvols) = placed(vols, &indices, &sb, fragment_size);
        let loaded = sce_store::load_volumes(&*dev, sb.clone(), &lv)?;
        if !formatted_now {
            refuse_unlocatable_damage(&sb, &indices, &loaded)?;
        }
        let layout = sb.layout;
        let mut stats = load_stats(&sb, &loaded.report, formatted_now, why.join("; "));
        stats.load_millis = started.elapsed().as_millis() as u64;
        let slots = layout.slots as usize;
        let blocks = layout.intent_blocks as usize;
        let intent_bits: Arc<[AtomicU64]> =
            loaded.intents.iter().map(|&w| AtomicU64::new(w)).collect();
        let warm_until = warm_until(&cfg, slots);
        let journal = journal_of(&cfg, &layout, loaded.journal.next_seq(sb.journal_tail));
        let st = State::loaded(&loaded, intent_bits.clone(), (slots, blocks), journal);
        Ok(Opened {
            persist: Persist {
                dev,
                layout,
                uuid: sb.uuid,
                vols: pvols,
                seq: AtomicU64::new(sb.seq + 1),
                sb: Mutex::new(sb),
                st: Mutex::new(st),
                intent_io: Mutex::new(()),
                round_lock: Mutex::new(()),
                state_seq: Default::default(),
                refill: Default::default(),
                cfg,
                counters: Counters::default(),
                loaded: stats,
                // The identity stored now is the source's as opened, before any write.
                identity_writes: AtomicU64::new(0),
                round_no: AtomicU32::new(0),
                warm_until,
                read_touch: (0..slots.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
                intent_bits,
                round_wanted: Default::default(),
                presets_pending: Default::default(),
            },
            loaded,
            given_up,
        })
    }

    /// Reads the superblock of `dev`, or formats the device if it is blank, or (with
    /// `reformat`) foreign, corrupt, of another geometry, failed or marked failed, or if it
    /// holds one of the volumes `wanted` at another size. Returns it and whether it was
    /// formatted now (for the first volume wanted, whose identity is `identity_hash`).
    fn superblock(
        dev: &Arc<dyn BlockDevice>,
        cfg: &PersistConfig,
        (fragment_size, relayout): (u64, bool),
        wanted: &[(String, u64)],
        identity_hash: [u8; sce_store::superblock::IDENTITY_BYTES],
    ) -> Result<(Superblock, bool), StoreError> {
        let opts = sce_store::FormatOptions {
            fragment_size,
            volume: sce_store::Volume {
                id: 1,
                generation: 1,
                source_size: wanted[0].1,
                name: wanted[0].0.clone(),
                identity: identity_hash,
                detached: false,
                writeback: false,
            },
            size: None,
            log_bytes: cfg.log_bytes(dev.size()),
            lend_bytes: cfg.lend_bytes(dev.size()),
        };
        let fmt = |dev: &dyn BlockDevice| sce_store::format(dev, &opts);
        // The device must already hold one of the volumes (a device of other sources is
        // refused: it may be another export's cache), and may gain the others.
        let fits = |sb: &Superblock| fits(sb, wanted);
        let mut formatted_now = false;
        let sb = match sce_store::read_superblock(&**dev) {
            Ok(sb) => {
                let usable = sb.state != sce_store::DeviceState::Failed
                    && sb.layout.fragment_size == fragment_size
                    && fits(&sb).is_ok();
                if usable && relayout {
                    formatted_now = true;
                    sce_store::reformat(&**dev, &sb, &opts)?
                } else if usable {
                    sb
                } else if cfg.reformat {
                    let dirt = sce_store::dirty_by_volume(&**dev, &sb, |_| true)?;
                    dropping_dirty(&dirt, cfg, "--reformat")?;
                    formatted_now = true;
                    sce_store::reformat(&**dev, &sb, &opts)?
                } else if sb.state == sce_store::DeviceState::Failed {
                    return Err(StoreError::Failed);
                } else if sb.layout.fragment_size != fragment_size {
                    return Err(StoreError::Geometry(format!(
                        "the cache device is formatted with {}-byte fragments, not {fragment_size}; pass --reformat to change it",
                        sb.layout.fragment_size
                    )));
                } else {
                    fits(&sb)?;
                    sb
                }
            }
            Err(StoreError::NotFormatted) => {
                formatted_now = true;
                fmt(&**dev)?
            }
            Err(e) if cfg.reformat && !matches!(e, StoreError::Io(_)) => {
                unreadable_may_hold_dirty(&e, cfg)?;
                formatted_now = true;
                fmt(&**dev)?
            }
            Err(e) => return Err(e),
        };
        let mut sb = sb;
        if let Some(m) = marker(cfg, &sb.uuid) {
            if m.exists() {
                if !cfg.reformat {
                    return Err(StoreError::Failed);
                }
                let dirt = sce_store::dirty_by_volume(&**dev, &sb, |_| true)?;
                dropping_dirty(&dirt, cfg, "--reformat")?;
                let _ = std::fs::remove_file(&m);
                formatted_now = true;
                sb = sce_store::reformat(&**dev, &sb, &opts)?;
            }
        }
        Ok((sb, formatted_now))
    }

    /// Never stale across a restart: what the device holds for a volume is dropped (one
    /// generation bump) unless its source is provably the one it cached, unchanged, and the
    /// device is the newest copy this host wrote. A volume of the table that this start does
    /// not serve is dropped too: its slots will be reused without its records being
    /// tracked. Records each source's identity (with its generation string) and a new
    /// sequence if anything changed. Returns why volumes were dropped (empty if none was).
    fn trust(
        dev: &Arc<dyn BlockDevice>,
        cfg: &PersistConfig,
        sb: &mut Superblock,
        vols: &[Trusted<'_>],
        formatted_now: bool,
    ) -> Result<Vec<String>, StoreError> {
        let zero = [0; sce_store::superblock::IDENTITY_BYTES];
        let seen_seq = state_seq(cfg, &sb.uuid);
        let older = older_copy(cfg, sb, formatted_now).map(|seen| {
            format!(
                "the cache device is an older copy: its superblock sequence is {}, this host wrote {seen}",
                sb.seq
            )
        });
        // The newest copy damaged: the volume table found may be one write behind (a forget,
        // a changed identity). Clean data is dropped; dirty pages, trusted whatever the
        // generation, stay.
        let older = older.or_else(|| {
            (sb.other_copy_damaged && !formatted_now).then(|| {
                "a superblock copy is damaged: the other one, possibly a write older, is used"
                    .to_string()
            })
        });
        let mut all_why = Vec::new();
        let mut changed = false;
        for v in vols {
            let vi = v.index;
            let identity_hash = v.identity.map_or(zero, sce_store::identity_hash);
            // A device formatted now has nothing of the source to doubt.
            let source = (!formatted_now).then_some(identity_hash);
            let own_writes = cfg.reattach && cfg.own_writes;
            let mut why = reasons(v, &sb.volumes[vi], (cfg.reattach, own_writes), source);
            if sb.volumes[vi].detached && !(cfg.reattach && cfg.keep_detached_mark) {
                sb.volumes[vi].detached = false;
                changed = true;
            }
            why.extend(older.clone());
            if !why.is_empty() {
                sb.volumes[vi].generation = sb.volumes[vi].generation.wrapping_add(1);
                if sb.volumes[vi].identity == zero {
                    tracing::info!(volume = %v.name, "{}", why.join("; "));
                } else {
                    tracing::warn!(
                        volume = %v.name,
                        "dropping everything clean cached for the volume (dirty write-back \
                         data, newer than the source, is kept): {}",
                        why.join("; ")
                    );
                }
                changed = true;
                all_why.push(if vols.len() > 1 {
                    format!("{}: {}", v.name, why.join("; "))
                } else {
                    why.join("; ")
                });
            }
            if sb.volumes[vi].identity != identity_hash {
                sb.volumes[vi].identity = identity_hash;
                changed = true;
            }
        }
        for (i, t) in sb.volumes.iter_mut().enumerate() {
            if !vols.iter().any(|v| v.index == i) {
                tracing::info!(volume = %t.name, "not served by this start: what the device holds for it is dropped");
                t.generation = t.generation.wrapping_add(1);
                changed = true;
            }
        }
        if changed {
            sb.seq = sb.seq.max(seen_seq.unwrap_or(0)) + 1;
            sce_store::write_superblock(&**dev, sb)?;
            record_state_seq(cfg, &sb.uuid, sb.seq, true);
        }
        Ok(all_why)
    }

    /// After the core shards restored what they could (`holds(s)`: the global fragment
    /// global slot `s` holds now): records the claims of restored slots, puts an intent on
    /// every slot whose record claims something that was not restored or pages the journal
    /// dropped, and marks the device open with the journal reset (its new tail above every
    /// block found, written after those intents are durable). Must run before the volume
    /// serves anything.
    pub(crate) fn start(
        &mut self,
        holds: impl Fn(u32) -> Option<u64>,
        loaded: &sce_store::Loaded,
    ) -> Result<(), IoError> {
        self.fill_journal_gaps(&loaded.journal.gaps)?;
        let mut tickets = Vec::new();
        let mut restored = 0;
        {
            let st = self.st.get_mut();
            for &(s, f) in &loaded.entries {
                if holds(s) == Some(f) && st.claims.claim(s, f) {
                    restored += 1;
                } else {
                    // A duplicate claim: it must not survive a crash unguarded.
                    tickets.extend(st.touch(s));
                    st.units.insert(self.layout.unit_of(s).0);
                }
            }
            // Records that claim pages the journal dropped, like records not loaded: their
            // intents must be durable before the journal is reset, and they are rewritten.
            for &s in loaded.unloaded_claims.iter().chain(&loaded.journal_slots) {
                tickets.extend(st.touch(s));
                st.units.insert(self.layout.unit_of(s).0);
            }
        }
        self.loaded.fragments_restored = restored;
        // Dropped by intent: written lately, so likely hot. Filled again from the source
        // once serving (`refill.rs`), unless a restored record holds the fragment anyway.
        let held: std::collections::HashSet<u64> = loaded.entries.iter().map(|e| e.1).collect();
        let refill: Vec<(u32, u64)> = loaded
            .refill
            .iter()
            .copied()
            .filter(|(_, f)| !held.contains(f))
            .collect();
        self.counters
            .refill_pending
            .store(refill.len() as u64, std::sync::atomic::Ordering::Relaxed);
        *self.refill.get_mut() = refill;
        self.sync(&tickets)?;
        let tail = self.st.get_mut().journal.tail();
        let mut sb = self.sb.lock();
        if sb.state != sce_store::DeviceState::Clean {
            sb.unclean_starts += 1;
        }
        sb.state = sce_store::DeviceState::Open;
        sb.last_open = sce_store::unix_now();
        // Marked only by a start that got this far: a refused one leaves the flag as found.
        for v in &self.vols {
            sb.volumes[v.index].writeback |= self.cfg.writeback;
        }
        sb.journal_tail = sb.journal_tail.max(tail);
        self.write_sb(&mut sb)
    }
}

impl State {
    /// The state of a store just loaded: no possible claims yet (`Persist::start` records
    /// the restored ones), the intents as found, every block durable at version 1.
    fn loaded(
        loaded: &sce_store::Loaded,
        intent_bits: Arc<[AtomicU64]>,
        (slots, blocks): (usize, usize),
        journal: super::journal::Journal,
    ) -> Self {
        State {
            intent_bits,
            set_version: vec![1; slots],
            touched: vec![0; slots.div_ceil(64)],
            claims: super::claims::Claims::new(slots),
            intents: loaded.intents.clone(),
            version: vec![1; blocks],
            durable: vec![1; blocks],
            redo: Vec::new(),
            units: loaded.rewrite_units.iter().copied().collect(),
            scrub: false,
            journal,
        }
    }
}

/// Per slot, the round until which it counts as written lately. Without the journal every
/// slot starts write-warm: the first reads after a start set the intents of the slots they
/// hit ahead of the first writes. With it, a slot turns write-hot at its second write
/// (`write_hot`).
fn warm_until(cfg: &PersistConfig, slots: usize) -> Box<[AtomicU32]> {
    let start = if cfg.journal { 0 } else { cfg.warm_rounds };
    (0..slots).map(|_| AtomicU32::new(start)).collect()
}

/// The write journal's ring in memory: the ring of the layout (or fewer blocks, for tests),
/// its next block `next`.
fn journal_of(
    cfg: &PersistConfig,
    layout: &sce_store::Layout,
    next: u64,
) -> super::journal::Journal {
    let half = super::journal::mirror_half(layout);
    let ring = match cfg.journal_blocks {
        0 => half,
        n => n.min(half),
    };
    super::journal::Journal::new(ring as u64, next)
}
