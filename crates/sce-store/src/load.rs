//! Loading a device's records for the volumes a start serves, then replaying the live
//! journal over them (`replay.rs`).

use crate::unit::{EntryRef, NO_FRAGMENT};
use crate::{
    any_valid, bit, count_bad_units, journal, read_intents, replay, scan_units, DeviceState,
    Loaded, ScanReport, StoreError, Superblock,
};
use sce_io::BlockDevice;
use std::collections::BTreeSet;

/// Loads the contents of a formatted device for volume `volume` of a source of
/// `source_fragments` fragments. Entries under a write intent, of another generation, or in
/// rejected units are dropped.
pub fn load(
    dev: &dyn BlockDevice,
    sb: Superblock,
    volume: usize,
    source_fragments: u64,
) -> Result<Loaded, StoreError> {
    let one = LoadVolume {
        index: volume,
        fragments: source_fragments,
        base: 0,
    };
    load_volumes(dev, sb, &[one])
}

/// A volume to load, and where its fragments go in the caller's address space.
#[derive(Clone, Copy, Debug)]
pub struct LoadVolume {
    /// Index of the volume in the table.
    pub index: usize,
    /// The volume's size in fragments.
    pub fragments: u64,
    /// The fragment number its fragment 0 gets in [`Loaded::entries`].
    pub base: u64,
}

/// Loads the contents of a formatted device for several volumes of its table at once (one
/// scan), each volume's fragments numbered from its `base`: the address space of one cache
/// that serves them all. Entries of volumes not named are dropped as stale.
pub fn load_volumes(
    dev: &dyn BlockDevice,
    sb: Superblock,
    vols: &[LoadVolume],
) -> Result<Loaded, StoreError> {
    let l = sb.layout;
    let want = wanted(&sb, vols);
    let intents = read_intents(dev, &l)?;
    let journal = journal::scan_journal(dev, &sb)?;
    let mut loaded = Loaded {
        superblock: sb.clone(),
        volume: vols.first().map_or(0, |v| v.index),
        entries: Vec::new(),
        bitmaps: Vec::new(),
        dirty: Vec::new(),
        replayed_crcs: Vec::new(),
        unit_seqs: vec![0; l.units as usize],
        report: ScanReport {
            intents_set: intents.iter().map(|w| w.count_ones() as u64).sum(),
            ..ScanReport::default()
        },
        intents,
        unloaded_claims: Vec::new(),
        rewrite_units: Vec::new(),
        refill: Vec::new(),
        journal,
        journal_slots: Vec::new(),
        notes: vec![0u64; l.slots as usize],
    };
    let failed = sb.state == DeviceState::Failed;
    let mut rewrite = BTreeSet::new();
    let mut bad_units = Vec::new();
    let mut repaired = Vec::new();
    let mut seqs = std::mem::take(&mut loaded.unit_seqs);
    scan_units(
        dev,
        &sb,
        |s, e, note| loaded.record(&want, failed, (s, e, note), &mut rewrite),
        |u, err| bad_units.push((u, err)),
        |u| repaired.push(u),
        |u, seq| seqs[u as usize] = seq as u32,
    )?;
    loaded.unit_seqs = seqs;
    // A damaged copy is rewritten from the other before anything is served.
    loaded.report.units_repaired = repaired.len() as u32;
    rewrite.extend(repaired);
    count_bad_units(&l, &bad_units, &mut loaded.report, &mut rewrite);
    loaded.rewrite_units = rewrite.into_iter().collect();
    let bases: Vec<(u16, u64)> = want.iter().map(|w| (w.0, w.3)).collect();
    replay::replay(dev, &mut loaded, &bases)?;
    Ok(loaded)
}

impl Loaded {
    /// Takes the record of slot `s` (in a unit with journal note `note`) if it is the
    /// volumes' (`want`): clean pages need the current generation and a clear intent;
    /// dirty pages (write-back) are the only copy of their data, newer than the source's,
    /// and are kept whatever the generation and the intent (a slot is never given to
    /// another fragment while its record may claim dirty pages: the engine holds it until a
    /// clean record is durable, so they are still its own).
    fn record(
        &mut self,
        want: &[(u16, u32, u64, u64)],
        failed: bool,
        (s, e, note): (u32, EntryRef<'_>, u64),
        rewrite: &mut BTreeSet<u32>,
    ) {
        let l = self.superblock.layout;
        let words = l.bitmap_words();
        if e.reflects() {
            self.notes[s as usize] = note;
        }
        let has_dirty = (0..words).any(|w| e.dirty_word(w) != 0);
        if e.frag() == NO_FRAGMENT || !(has_dirty || any_valid(&e, words)) {
            return;
        }
        if has_dirty {
            // Written again before anything is served: whatever becomes of its dirty pages
            // (restored, replaced, found clean), the record must say so before the slot can
            // hold anything else.
            rewrite.insert(l.unit_of(s).0);
        }
        let mine = want
            .iter()
            .filter(|w| w.0 == e.volume())
            .find(|w| has_dirty || w.1 == e.generation());
        let Some(&(_, generation, source_fragments, base)) = mine.filter(|_| !failed) else {
            self.report.slots_stale += 1;
            return;
        };
        let intent = bit(&self.intents, s);
        let r = &mut self.report;
        let dropped = if e.frag() >= source_fragments {
            Some(&mut r.slots_out_of_range)
        } else if intent && !has_dirty {
            self.refill.push((s, base + e.frag()));
            Some(&mut r.slots_dropped_intent)
        } else {
            None
        };
        if let Some(count) = dropped {
            *count += 1;
            self.unloaded_claims.push(s);
            rewrite.insert(l.unit_of(s).0);
            return;
        }
        r.slots_valid += 1;
        self.entries.push((s, base + e.frag()));
        let dirty_only = intent || generation != e.generation();
        if dirty_only {
            // Its record claims clean pages that are not loaded: rewritten under an intent.
            self.journal_slots.push(s);
        }
        for w in 0..words {
            let d = e.dirty_word(w);
            let v = e.bitmap_word(w);
            let bits = if dirty_only { d & v } else { v };
            r.pages_valid += bits.count_ones() as u64;
            self.bitmaps.push(bits);
            self.dirty.push(d);
        }
    }
}

/// (id, generation, fragments, base) of each volume to load.
fn wanted(sb: &Superblock, vols: &[LoadVolume]) -> Vec<(u16, u32, u64, u64)> {
    vols.iter()
        .map(|v| {
            let t = &sb.volumes[v.index];
            (t.id, t.generation, v.fragments, v.base)
        })
        .collect()
}
