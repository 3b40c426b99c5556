//! Replaying the live write journal over the loaded records, in sequence order (see
//! `journal.rs` for the entries): source-write entries drop the pages they name; dirty
//! entries (write-back) bring back pages written only to the cache, each checked against
//! the checksums its entry recorded.

use crate::journal::{DirtyPage, PrevPage};
use crate::{page_checksum, page_seed, Loaded};
use sce_io::{AlignedBuf, BlockDevice, IoError};
use std::collections::{BTreeMap, HashMap};

/// A slot's claims while replaying.
struct Claim {
    frag: u64,
    valid: Vec<u64>,
    dirty: Vec<u64>,
    /// Its on-device record claims pages that the replay dropped or replaced.
    touched: bool,
}

/// The newest dirty entry of a page: the entry, its volume id, the fragment's number within
/// the volume, and the journal block it is in.
type Newest = (DirtyPage, u16, u64, u64);

fn clear(words: &mut [u64], p: u32) -> bool {
    let (w, b) = (p as usize / 64, 1u64 << (p % 64));
    let was = words[w] & b != 0;
    words[w] &= !b;
    was
}

fn set(words: &mut [u64], p: u32) {
    words[p as usize / 64] |= 1 << (p % 64);
}

/// The replay's state: every slot's claims, which slot claims each fragment, the order
/// slots were loaded in, and the newest dirty entry of each page.
#[derive(Default)]
struct Replay {
    claims: HashMap<u32, Claim>,
    by_frag: HashMap<u64, u32>,
    order: Vec<u32>,
    newest: BTreeMap<(u32, u32), Newest>,
    /// Slots whose claims a dirty entry of their fragment in another slot voided.
    voided: Vec<u32>,
    dropped: u64,
    hit_frags: u64,
}

impl Replay {
    /// A source entry: pages `[lo, hi)` of fragment `gf` were about to change on the
    /// source, so no copy of them is current.
    fn source_entry(&mut self, gf: u64, lo: u32, hi: u32) {
        let Some(&s) = self.by_frag.get(&gf) else {
            return;
        };
        let c = self.claims.get_mut(&s).expect("claimed");
        let mut any = false;
        for p in lo..hi {
            if clear(&mut c.valid, p) {
                self.dropped += 1;
                any = true;
            }
            clear(&mut c.dirty, p);
            self.newest.remove(&(s, p));
        }
        if any && !c.touched {
            self.hit_frags += 1;
        }
        c.touched |= any;
    }

    /// True if fragment `gf` is claimed, by a slot other than `slot` (a dirty entry's),
    /// through a record that reflects the journal from beyond block `seq`.
    fn newer_elsewhere(&self, gf: u64, seq: u64, notes: &[u64], slot: u32) -> bool {
        self.by_frag
            .get(&gf)
            .is_some_and(|&s2| s2 != slot && seq < notes[s2 as usize])
    }

    /// A dirty entry of page `p` of fragment `gf` (volume `volume`, fragment `frag` in it):
    /// the slot now holds `gf`, whatever it claimed before is void, and so is any other
    /// slot's older claim of `gf`.
    fn dirty_entry(
        &mut self,
        d: DirtyPage,
        (gf, volume, frag, seq): (u64, u16, u64, u64),
        p: u32,
        words: usize,
    ) {
        let stale = self.claims.get(&d.slot).is_some_and(|c| c.frag != gf);
        if stale {
            let c = self.claims.remove(&d.slot).expect("claimed");
            self.by_frag.remove(&c.frag);
            self.newest.retain(|k, _| k.0 != d.slot);
        }
        if let Some(&s2) = self.by_frag.get(&gf).filter(|&&s2| s2 != d.slot) {
            self.claims.remove(&s2);
            self.by_frag.remove(&gf);
            self.newest.retain(|k, _| k.0 != s2);
            self.voided.push(s2);
        }
        if !self.claims.contains_key(&d.slot) {
            self.order.push(d.slot);
        }
        let c = self.claims.entry(d.slot).or_insert_with(|| Claim {
            frag: gf,
            valid: vec![0; words],
            dirty: vec![0; words],
            touched: false,
        });
        c.touched |= stale;
        self.by_frag.insert(gf, d.slot);
        self.newest.insert((d.slot, p), (d, volume, frag, seq));
    }
}

/// Replays `loaded.journal.entries` (sequence order) over `loaded`'s records for the volumes
/// `(id, base)` loaded, reading the pages of dirty entries from `dev` to check them.
pub(crate) fn replay(
    dev: &dyn BlockDevice,
    loaded: &mut Loaded,
    volumes: &[(u16, u64)],
) -> Result<(), IoError> {
    let l = loaded.superblock.layout;
    let words = l.bitmap_words();
    let mut r = Replay::default();
    for (i, &(s, f)) in loaded.entries.iter().enumerate() {
        r.order.push(s);
        r.by_frag.insert(f, s);
        let claim = Claim {
            frag: f,
            valid: loaded.bitmaps[i * words..(i + 1) * words].to_vec(),
            dirty: loaded.dirty[i * words..(i + 1) * words].to_vec(),
            touched: false,
        };
        r.claims.insert(s, claim);
    }
    if loaded.journal.blocks_missing > 0 {
        // A journal block of an earlier commit is gone: the source writes it named are
        // unknown, so no clean page can be trusted. Dirty pages (newer than the source)
        // stay; a start in write-back is refused by the engine, whose pages it may have named.
        for c in r.claims.values_mut() {
            for (v, d) in c.valid.iter_mut().zip(&c.dirty) {
                r.dropped += (*v & !d).count_ones() as u64;
                *v &= d;
            }
            c.touched = true;
        }
    }
    for (e, &seq) in loaded.journal.entries.iter().zip(&loaded.journal.seqs) {
        let Some(&(_, base)) = volumes.iter().find(|v| v.0 == e.volume) else {
            continue;
        };
        let lo = e.first as u32;
        let hi = (lo + e.pages as u32).min(l.pages_per_fragment);
        match e.dirty {
            None => r.source_entry(base + e.frag, lo, hi),
            // A dirty entry its slot's record was taken after: the record says what
            // became of it.
            Some(d) if d.slot >= l.slots || lo >= hi || seq < loaded.notes[d.slot as usize] => {}
            // Another slot claims the fragment by a record taken after this entry: that
            // record is the newer word (the fragment moved there since).
            Some(d) if r.newer_elsewhere(base + e.frag, seq, &loaded.notes, d.slot) => {}
            Some(d) => r.dirty_entry(d, (base + e.frag, e.volume, e.frag, seq), lo, words),
        }
    }
    loaded.unloaded_claims.extend(r.voided.iter().copied());
    // Slots the dirty entries touched: their records are written again before anything is
    // served (see `Loaded::record`).
    let touched = r.newest.keys().map(|k| k.0).chain(r.voided.iter().copied());
    let units: Vec<u32> = touched.map(|s| l.unit_of(s).0).collect();
    loaded.rewrite_units.extend(units);
    loaded.rewrite_units.sort_unstable();
    loaded.rewrite_units.dedup();
    check_pages(dev, loaded, &mut r.claims, &r.newest)?;
    let rep = &mut loaded.report;
    rep.journal_blocks_live = loaded.journal.blocks_live as u64;
    rep.journal_blocks_bad = loaded.journal.blocks_bad as u64;
    rep.journal_blocks_repaired = loaded.journal.blocks_repaired as u64;
    rep.journal_blocks_missing = loaded.journal.blocks_missing as u64;
    rep.journal_pages_dropped = r.dropped;
    rep.journal_fragments_hit = r.hit_frags;
    rebuild(loaded, r.order, r.claims);
    Ok(())
}

/// Reads the page of every newest dirty entry and decides what it holds: the new bytes
/// (valid, dirty), the bytes from before (valid, as they were), or neither (invalid; lost if
/// they were dirty). An entry below the superblock's `journal_landed` belongs to a write
/// whose data a completed flush made durable: a page that does not hold its new bytes was
/// damaged since, and is lost (never the source's older bytes, never the bytes from before).
fn check_pages(
    dev: &dyn BlockDevice,
    loaded: &mut Loaded,
    claims: &mut HashMap<u32, Claim>,
    newest: &BTreeMap<(u32, u32), Newest>,
) -> Result<(), IoError> {
    let l = loaded.superblock.layout;
    let landed = loaded.superblock.journal_landed;
    let ps = crate::layout::BLOCK;
    let mut page = AlignedBuf::new(ps as usize);
    for (&(s, p), &(d, volume, frag, seq)) in newest {
        let at = l.data_offset + s as u64 * l.fragment_size + p as u64 * ps;
        dev.read_at(at, &mut page)?;
        let len = (d.len as usize).clamp(1, ps as usize);
        let seed = page_seed(volume, frag * l.pages_per_fragment as u64 + p as u64);
        let crc = page_checksum(&page[..len], seed);
        let c = claims.get_mut(&s).expect("claimed");
        loaded.report.dirty_pages_replayed += 1;
        let (valid, dirty, want) = match d.prev {
            _ if crc == d.crc => (true, true, d.crc),
            // Flushed, then damaged: the acknowledged bytes are gone.
            _ if seq < landed => (false, true, 0),
            // The bytes from before, which the source had then. Dirty all the same: should
            // the source have received the lost newer bytes meanwhile, cleaning makes it
            // agree again (a re-clean of equal bytes costs one write).
            PrevPage::Clean(x) if crc == x => (true, true, x),
            PrevPage::Dirty(x) if crc == x => (true, true, x),
            // Torn, and dirty before: lost (kept as a dirty bit on an invalid page).
            PrevPage::Dirty(_) => (false, true, 0),
            _ => (false, false, 0),
        };
        clear(&mut c.valid, p);
        clear(&mut c.dirty, p);
        if valid {
            set(&mut c.valid, p);
            loaded.replayed_crcs.push((s, p, want));
        }
        if dirty {
            set(&mut c.dirty, p);
        }
    }
    Ok(())
}

/// Puts the replayed claims back into `loaded`: slots left with no valid page are not
/// loaded (their records are rewritten), and slots whose records claim what the replay
/// dropped or replaced keep their intents until they are (`journal_slots`).
fn rebuild(loaded: &mut Loaded, order: Vec<u32>, mut claims: HashMap<u32, Claim>) {
    let l = loaded.superblock.layout;
    let words = l.bitmap_words();
    let (mut entries, mut bitmaps, mut dirty) = (Vec::new(), Vec::new(), Vec::new());
    let mut rewrite: std::collections::BTreeSet<u32> =
        loaded.rewrite_units.iter().copied().collect();
    let r = &mut loaded.report;
    r.slots_valid = 0;
    r.pages_valid = 0;
    r.pages_dirty = 0;
    r.dirty_pages_lost = 0;
    for s in order {
        let Some(c) = claims.remove(&s) else {
            rewrite.insert(l.unit_of(s).0);
            continue;
        };
        if c.valid.iter().all(|&w| w == 0) && c.dirty.iter().all(|&w| w == 0) {
            loaded.unloaded_claims.push(s);
            rewrite.insert(l.unit_of(s).0);
            continue;
        }
        if c.touched {
            loaded.journal_slots.push(s);
            rewrite.insert(l.unit_of(s).0);
        }
        r.slots_valid += 1;
        r.pages_valid += c.valid.iter().map(|w| w.count_ones() as u64).sum::<u64>();
        let both = c.valid.iter().zip(&c.dirty);
        r.pages_dirty += both
            .clone()
            .map(|(v, d)| (v & d).count_ones() as u64)
            .sum::<u64>();
        // Dirty bits of invalid pages: the pages whose dirty data was lost.
        r.dirty_pages_lost += both.map(|(v, d)| (d & !v).count_ones() as u64).sum::<u64>();
        entries.push((s, c.frag));
        bitmaps.extend_from_slice(&c.valid[..words]);
        // Dirty bits of invalid pages stay: they are the lost pages.
        dirty.extend_from_slice(&c.dirty[..words]);
    }
    loaded.entries = entries;
    loaded.bitmaps = bitmaps;
    loaded.dirty = dirty;
    loaded.unloaded_claims.sort_unstable();
    loaded.unloaded_claims.dedup();
    loaded.rewrite_units = rewrite.into_iter().collect();
}
