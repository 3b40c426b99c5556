//! Flush rounds: snapshot the changed records under the core shards' locks (one at a
//! time, never two at once; slot numbers on the device are global), flush the data they
//! vouch for, write and read back the units, then forget stale claims and clear quiet
//! intents; the scrub after a bad unit write (the clean close is `close.rs`).

use super::intents::State;
use super::{Persist, UnitImage};
use crate::cores::Cores;
use crate::crcs::{CrcCache, UnitPin};
use crate::devices::Devices;
use sce_core::{CacheCore, FragNo, GlobalCore};

/// A core shard as a round sees it: locked, in global addresses.
type Shard<'a> = GlobalCore<'a, &'a mut CacheCore>;
use sce_io::{AlignedBuf, BlockDevice};
use sce_store::layout::SLOTS_PER_INTENT_BLOCK;
use sce_store::unit::{EntryIn, UnitBuilder, NO_FRAGMENT};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering::Relaxed;

/// Quiet intents to clear: slots no write touched since the round took them.
type Quiet = Vec<u32>;

/// What every record of a round carries: the volume's id and generation, the device's uuid.
struct Record {
    /// Per volume served, in address order: (base fragment, id, generation).
    volumes: Vec<(u64, u16, u32)>,
    uuid: [u8; 16],
}

impl Record {
    /// The (base, id, generation) of the volume that cache fragment `f` belongs to.
    fn volume_of(&self, f: u64) -> (u64, u16, u32) {
        let k = self.volumes.partition_point(|v| v.0 <= f).saturating_sub(1);
        self.volumes[k]
    }
}

impl Persist {
    /// One flush round: snapshots changed slots and quiet intents, flushes the data, writes
    /// and verifies the records, then clears the intents that stayed quiet. `force` treats
    /// every intent as quiet (clean shutdown, nothing in flight). Returns the number of
    /// metadata errors. `cores` are the volume's core shards (each locked twice, one at a
    /// time, for the snapshot), `crcs` its page checksums, and `dev` its devices: the
    /// source is flushed before a record vouches for a copy of what was written to it.
    /// Also returns whether the round was put off because the source could not flush (no
    /// record written: not the cache device's error, but nothing it was to make durable is).
    pub(crate) fn round(
        &self,
        cores: &Cores,
        crcs: &CrcCache,
        dev: &Devices,
        force: bool,
    ) -> (u64, bool) {
        let _one_at_a_time = self.round_lock.lock();
        let put_off = std::cell::Cell::new(false);
        let errors = self.round_locked(cores, crcs, (dev, &put_off), force);
        (errors, put_off.get())
    }

    /// `round`, under the round lock.
    fn round_locked(
        &self,
        cores: &Cores,
        crcs: &CrcCache,
        (dev, put_off): (&Devices, &std::cell::Cell<bool>),
        force: bool,
    ) -> u64 {
        self.counters.flush_rounds.fetch_add(1, Relaxed);
        if std::mem::take(&mut self.st.lock().scrub) {
            self.scrub();
        }
        let record = {
            let sb = self.sb.lock();
            Record {
                volumes: self
                    .vols
                    .iter()
                    .map(|v| (v.base, v.id, sb.volumes[v.index].generation))
                    .collect(),
                uuid: sb.uuid,
            }
        };
        self.round_no.fetch_add(1, Relaxed);
        // Slots read while write-warm since the last round keep their intents.
        let read: Vec<u64> = self.read_touch.iter().map(|w| w.swap(0, Relaxed)).collect();
        // The journal blocks this round's records will cover: noted before the snapshot.
        let covered = self.st.lock().journal.covered();
        // 1. Snapshot under the core shards' locks.
        let (snap, unread) = self.snapshot(cores, crcs, (&record, covered), force, &read);
        let Some((images, clear)) = snap else {
            if unread > 0 {
                return unread;
            }
            // Nothing changed since the last round, whose records are durable (a failed
            // unit would have been queued again): they cover the journal up to here.
            return self.journal_covered(covered, 0);
        };
        // 2. Make the data the records vouch for durable.
        if let Err(errors) = self.data_durable(dev, &images) {
            put_off.set(errors == 0);
            return errors + unread;
        }
        // 3. Write the units, adjacent ones in one request; 4. read them back.
        let ok_units = self.write_units(&images);
        // 5. Forget claims the device no longer holds; clear intents that stayed quiet. The
        // checksums the durable images hold may leave memory.
        let (mut errors, blocks) = self.settle(&images, &ok_units, clear);
        self.checksums_written(crcs, &images, &ok_units, &record.uuid);
        if !blocks.is_empty() {
            let _io = self.intent_io.lock();
            if self.write_intent_blocks(&blocks).is_err() {
                errors += 1;
            }
        }
        self.counters.metadata_errors.fetch_add(errors, Relaxed);
        // Units left unwritten (counted already) keep the journal's tail where it is.
        errors += unread;
        // 6. Every record taken since `covered` was noted is durable: move the journal's tail.
        self.journal_covered(covered, errors)
    }

    /// Step 2 of a round: the data the records `images` vouch for made durable, first on
    /// the source, whose writes the valid pages copy (a page is valid only once its source
    /// write completed, so a flush begun after the snapshot covers every one it found), for
    /// a source with a volatile cache loses unflushed writes at a power cut, and a record
    /// must never outlive the write its copy holds (the cache would serve it, newer than the
    /// source, until an eviction brought the source's older bytes back); then on the cache
    /// device. On failure the images' units wait for the next round; `Err` holds the
    /// metadata errors to count (none if the source could not flush: the cache device is
    /// not at fault).
    fn data_durable(&self, dev: &Devices, images: &[UnitImage]) -> Result<(), u64> {
        // The two flushes at once: a round (and the journal blocks it frees) waits for the
        // slower of them, not for both in turn.
        let (source, device) = if dev.owes_source_flush() {
            std::thread::scope(|sc| {
                let s = sc.spawn(|| dev.sync_source());
                let d = self.dev.flush();
                (s.join().expect("the source flush panicked"), d)
            })
        } else {
            (Ok(()), self.dev.flush())
        };
        if let Err(e) = source {
            self.st.lock().units.extend(images.iter().map(|i| i.unit));
            tracing::debug!("metadata round put off: the source cannot flush: {e}");
            return Err(0);
        }
        if device.is_err() {
            self.st.lock().units.extend(images.iter().map(|i| i.unit));
            self.counters.metadata_errors.fetch_add(1, Relaxed);
            return Err(1);
        }
        Ok(())
    }

    /// After a round's unit writes (`ok_units`: which are durable): the checksums the durable
    /// images hold may leave memory; those of the others stay, dirty, until written (the
    /// copies on the device may both be bad now).
    fn checksums_written(
        &self,
        crcs: &CrcCache,
        images: &[UnitImage],
        ok_units: &[bool],
        uuid: &[u8; 16],
    ) {
        for (img, &ok) in images.iter().zip(ok_units) {
            if !ok {
                if let Some(c) = sce_store::image_crcs(&self.layout, uuid, img.unit, &img.image) {
                    crcs.unwritten(img.unit, &c);
                }
                continue;
            }
            crcs.image_written(img.unit, sce_store::unit::unit_seq(&img.image));
            if img.whole {
                crcs.written(img.unit, img.changes);
            }
        }
        crcs.trim();
    }

    /// The end of a round with `errors` metadata errors: if none, the journal blocks below
    /// `covered` are no longer needed. Returns the errors, counting a failed tail write.
    fn journal_covered(&self, covered: u64, errors: u64) -> u64 {
        if errors > 0 {
            return errors;
        }
        match self.advance_journal(covered) {
            Ok(()) => 0,
            Err(_) => {
                self.counters.metadata_errors.fetch_add(1, Relaxed);
                1
            }
        }
    }

    /// Step 1 of a round: the images of every unit to write (changed slots, queued units,
    /// the units of quiet intents) and the quiet intents to clear.
    /// None if nothing is to be written. Two passes over the shards, each shard under its
    /// own lock and the state lock (core, then state): the changed slots and quiet intents,
    /// then the records. A slot that changes between the passes is dirty again and written
    /// next round; a write that touches a quiet intent between them marks it touched, so
    /// the intent is not cleared.
    fn snapshot(
        &self,
        cores: &Cores,
        crcs: &CrcCache,
        (record, covered): (&Record, u64),
        force: bool,
        read: &[u64],
    ) -> (Option<(Vec<UnitImage>, Quiet)>, u64) {
        let l = self.layout;
        let mut units: BTreeSet<u32> = {
            let mut st = self.st.lock();
            let mut units = std::mem::take(&mut st.units);
            units.extend(std::mem::take(&mut st.redo).iter().map(|&s| l.unit_of(s).0));
            units
        };
        let mut clear = Vec::new();
        let held = |s: u32| !force && self.write_hot_lately(s);
        cores.each_global(|core| {
            let mut st = self.st.lock();
            for s in core.take_dirty() {
                units.insert(l.unit_of(s).0);
            }
            clear.extend(Self::quiet_intents(&mut st, core, force, read, &held));
        });
        units.extend(clear.iter().map(|&s| l.unit_of(s).0));
        units.extend(crcs.take_dirty());
        if units.is_empty() {
            return (None, 0);
        }
        // Every page's checksum of the units to write, read from the records where not in
        // memory (no lock held), in parts of at most the checksum cache's capacity (a round
        // after `forget` writes every unit: pinned all at once they would fill memory). A
        // unit whose records cannot be read waits for a round that can (its intents stay,
        // and the round counts an error: the journal's tail does not move past it).
        let seq = self.seq.fetch_add(1, Relaxed);
        let list: Vec<u32> = units.into_iter().collect();
        let mut images = Vec::with_capacity(list.len());
        let mut unread = Vec::new();
        for part in list.chunks(crcs.round_part()) {
            let mut pins = Vec::with_capacity(part.len());
            let mut set = BTreeSet::new();
            for &u in part {
                match crcs.pin(u) {
                    Ok(pin) => {
                        pins.push(pin);
                        set.insert(u);
                    }
                    Err(_) => unread.push(u),
                }
            }
            images.extend(self.unit_images(cores, (crcs, &pins), record, &set, (seq, covered)));
        }
        let n = unread.len() as u64;
        if n > 0 {
            self.counters.metadata_errors.fetch_add(n, Relaxed);
            clear.retain(|&s| !unread.contains(&l.unit_of(s).0));
            self.st.lock().units.extend(unread);
        }
        if images.is_empty() {
            return (None, n);
        }
        (Some((images, clear)), n)
    }

    /// The intents of core shard `k`'s slots that stayed quiet since the last round (no
    /// write touched their slot, no read while write-warm, not `held`: written within
    /// `warm_rounds` rounds; or `force`) and whose fragments have nothing in flight. Forgets
    /// the touches it looked at: a write from now on marks the slot again, and `settle`
    /// then leaves its intent set.
    fn quiet_intents(
        st: &mut State,
        core: &Shard,
        force: bool,
        read: &[u64],
        held: &dyn Fn(u32) -> bool,
    ) -> Quiet {
        let std::ops::Range { start: lo, end: hi } = core.slots();
        let mut clear = Vec::new();
        for w in lo as usize / 64..(hi as usize).div_ceil(64).min(st.intents.len()) {
            let mut bits = st.intents[w];
            while bits != 0 {
                let s = (w * 64) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                if s < lo || s >= hi {
                    continue;
                }
                let touched = st.take_touched(s);
                let quiet = force || (!touched && !sce_store::bit(read, s) && !held(s));
                if !quiet {
                    continue;
                }
                let (x, _) = core.slot_state(s);
                let m = st.claims.of(s);
                // A slot's possible claims are always of its own shard's fragments; if one
                // were not, it would count as busy (its intent stays).
                let m_busy = m != NO_FRAGMENT && core.fragment_busy(m);
                if x.is_some_and(|x| core.fragment_busy(x)) || m_busy {
                    continue;
                }
                clear.push(s);
            }
        }
        clear
    }

    /// The images of `units` with sequence `seq`, their records taken shard by shard.
    fn unit_images(
        &self,
        cores: &Cores,
        (crcs, pins): (&CrcCache, &[UnitPin]),
        record: &Record,
        units: &BTreeSet<u32>,
        (seq, covered): (u64, u64),
    ) -> Vec<UnitImage> {
        let l = self.layout;
        // The changes counted before the checksums are read: a change made meanwhile keeps
        // the unit in memory until a later round writes it.
        let mut b: Vec<_> = units
            .iter()
            .zip(pins)
            .map(|(&u, pin)| {
                debug_assert_eq!(pin.unit(), u);
                let mut b = UnitBuilder::new(&l, &record.uuid, u, seq);
                b.set_note(covered);
                (u, b, Vec::new(), crcs.changes(pin), true)
            })
            .collect();
        cores.each_global(|core| {
            let std::ops::Range { start: lo, end: hi } = core.slots();
            let mut st = self.st.lock();
            for (u, builder, slots, _, whole) in b.iter_mut() {
                let (first, end) = l.unit_slots(*u);
                for s in first.max(lo)..end.min(hi) {
                    let redo = st.redo.len();
                    let ok = self.slot_record(&mut st, core, record, builder, s);
                    *whole &= st.redo.len() == redo;
                    // Every page's checksum, valid or not: a page becomes valid after its
                    // checksum is set, and may after this snapshot; the records must hold
                    // what memory does once the unit may leave memory.
                    builder.set_crcs(s - first, |p| crcs.pinned(s, p));
                    slots.push((s, ok));
                }
            }
        });
        b.into_iter()
            .map(|(unit, builder, slots, changes, whole)| UnitImage {
                unit,
                image: builder.finish(),
                slots,
                changes,
                whole,
            })
            .collect()
    }

    /// Sets global slot `s`'s record (`core` is its shard's) in its unit's builder: a
    /// claim only if it keeps every slot's possible claims to one fragment and every
    /// fragment's to one slot (otherwise it is written empty and redone next round). Adds
    /// the claim to the possible claims; true if the record claims pages.
    #[allow(clippy::too_many_arguments)]
    fn slot_record(
        &self,
        st: &mut State,
        core: &Shard,
        record: &Record,
        b: &mut UnitBuilder,
        s: u32,
    ) -> bool {
        let l = self.layout;
        let words = l.bitmap_words();
        let first = l.unit_slots(l.unit_of(s).0).0;
        let (x, bits) = core.slot_state(s);
        let x = x.map(FragNo);
        let claim = x.filter(|_| bits.iter().any(|&w| w != 0));
        let m = st.claims.of(s);
        let ok = claim.filter(|x| {
            (m == NO_FRAGMENT || m == x.0) && st.claims.owner(x.0).is_none_or(|o| o == s)
        });
        if claim.is_some() && ok.is_none() {
            st.redo.push(s);
            // Written empty: it must not hide the journal's entries of what the slot holds.
            b.unreflect(s - first);
        }
        if let Some(x) = ok {
            let (base, volume, generation) = record.volume_of(x.0);
            let entry = EntryIn {
                frag: x.0 - base,
                volume,
                generation,
                bitmap: &bits[..words],
                // The slots hold no dirty pages: write-back goes through the log.
                dirty: &[],
            };
            // Its checksums: every page's, written by the caller (`unit_images`).
            b.set_entry(s - first, &entry);
            let claimed = st.claims.claim(s, x.0);
            debug_assert!(claimed, "checked above");
        }
        ok.is_some()
    }

    /// Steps 3 and 4: writes the units, adjacent ones in one request, flushes, writes their
    /// mirror copies and flushes again (so that a crash tears at most one copy of a unit: the
    /// other is the previous round's, which the live journal still covers), and reads both
    /// back (`verify_metadata`). Per image: true if both copies are durable as written.
    fn write_units(&self, images: &[UnitImage]) -> Vec<bool> {
        let l = self.layout;
        let mut ok_units = vec![true; images.len()];
        for mirror in [false, true] {
            let at = |u: u32| match mirror {
                false => l.unit_offset(u),
                true => l.unit_mirror_offset(u),
            };
            self.write_unit_copies(images, at, &mut ok_units);
            if self.dev.flush().is_err() {
                ok_units.fill(false);
            }
        }
        if self.cfg.verify_metadata {
            let mut back = AlignedBuf::new(l.unit_size as usize);
            for (k, img) in images.iter().enumerate() {
                for at in [l.unit_offset(img.unit), l.unit_mirror_offset(img.unit)] {
                    if ok_units[k]
                        && (self.dev.read_at(at, &mut back).is_err() || back[..] != img.image[..])
                    {
                        ok_units[k] = false;
                    }
                }
            }
        }
        ok_units
    }

    /// Writes one copy of each unit image (at `at(unit)`), adjacent ones in one request;
    /// clears `ok_units` of those whose write failed.
    fn write_unit_copies(
        &self,
        images: &[UnitImage],
        at: impl Fn(u32) -> u64,
        ok_units: &mut [bool],
    ) {
        let us = self.layout.unit_size as usize;
        let mut i = 0;
        while i < images.len() {
            let mut j = i + 1;
            while j < images.len() && images[j].unit == images[j - 1].unit + 1 && j - i < 256 {
                j += 1;
            }
            let mut buf = AlignedBuf::new((j - i) * us);
            for (k, img) in images[i..j].iter().enumerate() {
                buf[k * us..(k + 1) * us].copy_from_slice(&img.image);
            }
            let ok = self.dev.write_at(at(images[i].unit), &buf).is_ok();
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
    }

    /// Step 5, under the state lock: forgets the claims the device no longer holds, queues
    /// the units that failed (and a scrub), and clears the intents that stayed quiet through
    /// the round. Returns the errors and the intent blocks to write.
    fn settle(&self, images: &[UnitImage], ok_units: &[bool], clear: Quiet) -> (u64, Vec<u32>) {
        let l = self.layout;
        let mut errors = 0;
        let mut blocks = Vec::new();
        let mut st = self.st.lock();
        for (k, img) in images.iter().enumerate() {
            let (u, slots) = (&img.unit, &img.slots);
            if !ok_units[k] {
                errors += 1;
                st.units.insert(*u);
                // A misdirected write damaged some other unit: find it next round.
                st.scrub = true;
                continue;
            }
            for &(s, claimed) in slots {
                if !claimed {
                    st.claims.clear(s);
                }
            }
        }
        for s in clear {
            let k = images
                .binary_search_by_key(&l.unit_of(s).0, |i| i.unit)
                .expect("unit snapshotted");
            if ok_units[k] && !st.touched(s) && st.intent(s) {
                st.set_intent(s, false);
                blocks.push((s as u64 / SLOTS_PER_INTENT_BLOCK) as u32);
            }
        }
        drop(st);
        blocks.sort_unstable();
        blocks.dedup();
        (errors, blocks)
    }

    /// Reads every unit (both copies) and queues the rejected ones (torn, misplaced, foreign) for rewriting.
    /// Runs after a unit write went wrong, since a misdirected write lands on another unit.
    pub(super) fn scrub(&self) {
        let l = self.layout;
        let uuid = self.sb.lock().uuid;
        let per = ((8 << 20) / l.unit_size).max(1);
        let mut buf = AlignedBuf::new((per * l.unit_size) as usize);
        let mut bad = Vec::new();
        let mut u = 0;
        while u < l.units {
            let n = per.min(l.units - u);
            for at in [l.unit_offset(u), l.unit_mirror_offset(u)] {
                let bytes = (n * l.unit_size) as usize;
                if self.dev.read_at(at, &mut buf[..bytes]).is_err() {
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
            }
            u += n;
        }
        self.st.lock().units.extend(bad);
    }
}
