//! Room that follows the work (issue 45, format 9): the log lends chunks of the read slots
//! while dirty data outgrows its own region, and gives them back once cleaning emptied
//! them (`sce_store::wblog::Lend` has the layout and the rules replay follows).
//!
//! Lending chunk c: its slots are evicted from the read cache and kept out of it (an
//! operation in flight on one is waited for), their records made safe (an intent durable
//! where a record may still claim a fragment), the superblock records one more chunk lent,
//! and only then may writes use it (the lap the head is in too, if the head is before it).
//! Giving back: writes stop using the chunk (when the log holds less than a quarter of what
//! it could without it); once no position a replay reads lies in it, the superblock records
//! one chunk fewer, and the slots go back to the read cache. The cleaner does both, between batches; a start takes the chunks the
//! superblock records lent out of the read cache before anything is served.
//!
//! Lock order: no log lock is held while the core's shards or the superblock are.

use super::LogBack;
use super::LogIo;
use sce_io::IoError;
use sce_store::wblog::LendStep;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

impl LogBack {
    /// At a start, before anything is served: the chunks the superblock records lent (a
    /// write since the anchor may have gone there) are taken out of the read cache.
    /// In another mode than write-back (whose start the log allowed only if it holds no
    /// dirty data) no write uses a chunk: those no replay reads go back first.
    pub(crate) fn claim_lent(&self, e: &LogIo<'_>, writeback: bool) -> Result<(), IoError> {
        let mut lent = self.persist.log_info().map_or(0, |i| i.lent);
        if !writeback {
            let needed = {
                let mut st = self.st.lock();
                st.w.set_usable(0);
                st.w.needed_lent()
            };
            if needed < lent && self.persist.record_lent(needed).is_ok() {
                lent = needed;
            }
        }
        self.lent.store(lent, Relaxed);
        for c in 0..lent {
            lend_slots(e, self.region.lend.slots_of_lent(c))?;
        }
        Ok(())
    }

    /// The cleaner's look at the room: lends one more chunk while the log is half full of
    /// what it holds with the chunks it uses (or writers wait for room), so that a write
    /// never waits while a chunk is left; stops using one while it would be under a quarter
    /// full without it; and gives back the chunks no replay reads and no write uses.
    pub(super) fn adjust_lending(&self, e: &LogIo<'_>) {
        if self.region.lend.chunks == 0 {
            return;
        }
        // Up to four chunks at a look: a burst may fill a chunk between two batches.
        for _ in 0..4 {
            let waiting = self.waiting.load(Relaxed) > 0;
            let step = self.st.lock().w.lend_step(waiting);
            match step {
                LendStep::Lend(c) => {
                    if let Err(err) = self.lend_one(e, c) {
                        tracing::warn!("write-back log: lending read slots failed: {err}");
                        break;
                    }
                    continue;
                }
                LendStep::Unuse => {
                    let mut st = self.st.lock();
                    let u = st.w.usable();
                    st.w.set_usable(u.saturating_sub(1));
                }
                LendStep::Stay => {}
            }
            break;
        }
        if let Err(err) = self.give_back(e) {
            tracing::warn!("write-back log: giving read slots back failed: {err}");
        }
    }

    /// Lends chunk number `c` (the c-th lent) and lets writes use it.
    fn lend_one(&self, e: &LogIo<'_>, c: u64) -> Result<(), IoError> {
        if c >= self.lent.load(Relaxed) {
            lend_slots(e, self.region.lend.slots_of_lent(c))?;
            self.persist.record_lent(c + 1)?;
            self.lent.store(c + 1, Relaxed);
            self.lends.fetch_add(1, Relaxed);
        }
        self.st.lock().w.set_usable(c + 1);
        self.progress.bump();
        Ok(())
    }

    /// Gives back the chunks lent beyond what a replay would read.
    fn give_back(&self, e: &LogIo<'_>) -> Result<(), IoError> {
        let needed = self.st.lock().w.needed_lent();
        let lent = self.lent.load(Relaxed);
        if needed >= lent {
            return Ok(());
        }
        self.persist.record_lent(needed)?;
        self.lent.store(needed, Relaxed);
        for c in needed..lent {
            give_back_slots(e, self.region.lend.slots_of_lent(c));
        }
        self.give_backs.fetch_add(lent - needed, Relaxed);
        Ok(())
    }
}

/// Takes global slots `slots` out of the read cache for the log: each evicted and lent in
/// its shard (one pinned by an operation in flight is waited for), then the records that
/// may still claim them guarded.
fn lend_slots(e: &LogIo<'_>, slots: std::ops::Range<u64>) -> Result<(), IoError> {
    let mut left: Vec<u32> = slots.clone().map(|s| s as u32).collect();
    // A slot an operation pins is waited for a while (its pages no longer hit), then left
    // for the cleaner's next look: the cleaner's other duties never wait on it. Each shard
    // takes its slots in one go (one pass over its free list).
    for _ in 0..100 {
        let mut by_shard: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
        for &g in &left {
            by_shard
                .entry(e.cores.shard_of_slot(g))
                .or_default()
                .push(g);
        }
        left.clear();
        for (k, ss) in by_shard {
            left.extend(e.cores.global(k, |core| core.lend_slots(&ss)));
        }
        if left.is_empty() || e.signals.shutting_down() {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if !left.is_empty() {
        // Not lent: what was taken of the chunk goes back to the read cache meanwhile (the
        // superblock does not record it, no write uses it).
        give_back_slots(e, slots.clone());
        return Err(IoError::Failed(format!(
            "{} slots of a chunk are still in use: lent at a later look",
            left.len()
        )));
    }
    match e.persist {
        Some(p) => p.guard_lent(slots.start as u32..slots.end as u32),
        None => Ok(()),
    }
}

/// Gives global slots `slots` back to the read cache (those not lent are left as they are).
fn give_back_slots(e: &LogIo<'_>, slots: std::ops::Range<u64>) {
    for g in slots {
        let g = g as u32;
        e.cores.at_slot(g, |core| core.give_back_slot(g));
    }
}
