//! Opening the log: the region found from the superblock, replayed from its anchor, the
//! index rebuilt. A replay that ends before the newest commit the superblock knew durable,
//! or that lost its anchor commit, met damage, and a start is refused rather than served
//! with older versions; so is a start in another mode than write-back while the log holds
//! dirty pages, and one that leaves out a volume with dirty pages in the log.

use super::{LogBack, St, Vol};
use crate::order::OrderedMutex as Mutex;
use crate::persist::Persist;
use crate::through::WriteThrough;
use parking_lot::Condvar;
use sce_io::{BlockDevice, IoError};
use sce_store::wblog::{self, LogRegion, LogWriter, Replayed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The log of the cache device `cache` (the whole device), if the superblock has one:
/// replayed, ready to serve in write-back (`writeback`), or empty and idle otherwise.
/// `ends` are the global bytes where the volumes end, in address order.
pub(crate) fn open_log(
    cache: &Arc<dyn BlockDevice>,
    persist: &Arc<Persist>,
    through: WriteThrough,
    writeback: bool,
    limits: (Duration, Duration),
    ends: &[u64],
) -> Result<Option<LogBack>, IoError> {
    let opened = Opening {
        cache,
        persist,
        writeback,
        limits,
        ends,
    };
    let Some(info) = persist.log_info() else {
        return Ok(None);
    };
    let region = info.region(&persist.layout);
    let r = wblog::replay_lent(&**cache, region, &info.key, info.anchor(), info.lent)
        .map_err(|e| IoError::Failed(format!("the write-back log cannot be read: {e}")))?;
    refuse_damage(&r, info.durable_seq)?;
    let (region, w) = match upgraded(persist, &r)? {
        Some(up) => up,
        None => (region, LogWriter::resume(region, info.key, &r)),
    };
    opened.replayed(through, region, w, &r)
}

/// What `open_log` was given.
struct Opening<'a> {
    cache: &'a Arc<dyn BlockDevice>,
    persist: &'a Arc<Persist>,
    writeback: bool,
    limits: (Duration, Duration),
    ends: &'a [u64],
}

/// Refuses a log whose chain damage broke: a commit the superblock knew durable that
/// replay did not reach, a lost anchor commit, or a commit damaged in both copies with a
/// sound later commit after it. Serving such a log would return older bytes for the pages
/// the unreadable commit named, and which those are cannot be told.
pub(crate) fn refuse_damage(r: &Replayed, durable_seq: u64) -> Result<(), IoError> {
    let drop = "`sce check` shows the damage; `sce format --force` (or a start with \
                --reformat --discard-dirty all) gives up every dirty page the log holds";
    if let Some(b) = r.broken {
        return Err(IoError::Failed(format!(
            "the write-back log's commit {} is damaged in both copies, and commit {} (at log \
             position {}) was written after it, so it had been durable: the pages it named \
             cannot be told, and serving the log would return older data for them; {drop}",
            b.missing, b.evidence, b.evidence_lpos
        )));
    }
    if r.anchor_missing() || r.last_seq < durable_seq {
        return Err(IoError::Failed(format!(
            "the write-back log ends at commit {} but commit {} was durable (or its anchor \
             commit is gone): its records are damaged, and serving would return older data; \
             {drop}",
            r.last_seq, durable_seq
        )));
    }
    Ok(())
}

/// A log written before format 8 that holds nothing gets its mirror area now (a start is
/// the one moment nothing is written to it): the new region, and a writer of it.
fn upgraded(
    persist: &Arc<Persist>,
    r: &Replayed,
) -> Result<Option<(LogRegion, LogWriter)>, IoError> {
    if !r.index.is_empty() || !r.lost.is_empty() {
        return Ok(None);
    }
    let anchor = wblog::Anchor::Empty {
        lpos: r.head,
        next_seq: r.next_seq,
    };
    let Some(info) = persist.give_log_mirror(anchor)? else {
        return Ok(None);
    };
    let region = info.region(&persist.layout);
    let w = LogWriter::new(region, info.key, r.head, r.next_seq)
        .map_err(|e| IoError::Failed(format!("the write-back log: {e}")))?;
    tracing::info!(
        mirror_blocks = region.mirror_blocks,
        "write-back log: its records' second copies go to a mirror area from now on (format 8)"
    );
    Ok(Some((region, w)))
}

impl Opening<'_> {
    /// The rest of `open_log` once the writer is known.
    fn replayed(
        &self,
        through: WriteThrough,
        region: LogRegion,
        w: LogWriter,
        r: &Replayed,
    ) -> Result<Option<LogBack>, IoError> {
        let p = self.persist;
        let vols: Vec<Vol> = (p.seeds().into_iter().zip(self.ends))
            .map(|((base, id), &end)| Vol { base, id, end })
            .collect();
        let lb = LogBack::new(self.cache.clone(), region, p, through, w, self.limits, vols);
        let dropped = lb.restore(r, self.writeback)?;
        if dropped > 0 {
            lb.settle_dropped(self.cache, dropped)?;
        }
        if !r.index.is_empty() || !r.lost.is_empty() {
            tracing::info!(
                pages = r.index.len(),
                lost = r.lost.len(),
                commits = r.commits,
                skipped = r.skipped,
                repaired = r.repaired,
                "write-back log replayed: dirty pages restored"
            );
        }
        Ok(Some(lb))
    }
}

impl LogBack {
    /// The path over the log `region` of `dev`, written by `w`.
    fn new(
        dev: Arc<dyn BlockDevice>,
        region: LogRegion,
        persist: &Arc<Persist>,
        through: WriteThrough,
        w: LogWriter,
        (wait_limit, idle): (Duration, Duration),
        vols: Vec<Vol>,
    ) -> LogBack {
        let bases = vols.iter().map(|v| v.base).collect();
        LogBack {
            through,
            dev,
            region,
            vols,
            persist: persist.clone(),
            st: Mutex::new(St::new(w, bases)),
            commit_io: Mutex::new(()),
            clean_io: Mutex::new(()),
            anchor_io: Mutex::new(()),
            ranges: Default::default(),
            source_order: Default::default(),
            queue: OnceLock::new(),
            progress: Default::default(),
            wanted: Mutex::new(false),
            wanted_cv: Condvar::new(),
            forced: Default::default(),
            draining: Default::default(),
            through_writes: Default::default(),
            waiting: Default::default(),
            last_request: Default::default(),
            waits: Default::default(),
            bytes_cleaned: Default::default(),
            clean_errors: Default::default(),
            source_writes: Default::default(),
            clean_busy: Default::default(),
            clean_busy_writes: Default::default(),
            commits: Default::default(),
            relocated: Default::default(),
            damaged_found: Default::default(),
            last_clean_error: Mutex::new(String::new()),
            seq: super::seq::Bypass::new(0),
            bypassed: Default::default(),
            outage: Default::default(),
            read_pages: Default::default(),
            read_requests: Default::default(),
            tuning: super::tune::Tuning::new(&sce_core::WritebackTuning::default()),
            shares: Default::default(),
            wait_limit,
            idle,
            lent: Default::default(),
            lends: Default::default(),
            give_backs: Default::default(),
        }
    }

    /// Puts back what replay `r` found: the newest version of each page, the lost pages.
    /// The pages of a volume of the table this start does not serve are left out (the
    /// persistence layer refused the start unless the operator gave them up with
    /// `--discard-dirty`); returns how many. Refused if a page names a volume the table does
    /// not hold, or if the log holds anything and the start is not in write-back
    /// (`writeback`).
    fn restore(&self, r: &Replayed, writeback: bool) -> Result<u64, IoError> {
        let mut dropped = 0;
        let mut served = |volume: u32, page: u64| match self.global(volume, page) {
            Some(g) => Ok(Some(g)),
            None if self.persist.table_has(volume) => {
                dropped += 1;
                Ok(None)
            }
            None => Err(IoError::Failed(format!(
                "the write-back log holds dirty pages of volume id {volume}, which the volume \
                 table does not hold: `sce check` the device"
            ))),
        };
        let mut lost = Vec::with_capacity(r.lost.len());
        for &(volume, page) in &r.lost {
            if let Some(g) = served(volume, page)? {
                let at = r.lost_at.get(&(volume, page)).copied();
                lost.push((g, at.unwrap_or(r.tail)));
            }
        }
        let mut versions = Vec::with_capacity(r.index.len());
        for ((volume, page), v) in r.index.iter() {
            if let Some(g) = served(volume, page)? {
                versions.push((v.lpos, g, v.crc));
            }
        }
        let mut st = self.st.lock();
        st.restore(lost, versions);
        let holds = !st.index.is_empty() || !st.lost.is_empty();
        if holds && !writeback {
            return Err(IoError::Failed(format!(
                "the write-back log holds {} dirty pages and {} lost ones (data the source \
                 does not have): start with --mode writeback and run `sce ctl flush \
                 --to-source` before another mode",
                st.index.len(),
                st.lost.len()
            )));
        }
        Ok(dropped)
    }

    /// Makes the `dropped` pages of volumes this start does not serve unreachable before
    /// anything is served: the anchor moves past them now, durably, so that no later replay
    /// finds them (their volume's place in the table may be given to another volume).
    /// Checked by replaying again; refused if older dirty pages of a served volume hold the
    /// anchor behind them.
    fn settle_dropped(&self, cache: &Arc<dyn BlockDevice>, dropped: u64) -> Result<(), IoError> {
        // Lost pages of served volumes are carried past the dropped ones first.
        self.carry_losses(u64::MAX);
        self.autocommit();
        {
            let mut st = self.st.lock();
            let tail = st.tail();
            st.w.set_tail(tail);
        }
        self.advance_anchor()?;
        let info = self.persist.log_info().expect("a device with a log");
        let r = wblog::replay_lent(&**cache, self.region, &info.key, info.anchor(), info.lent)
            .map_err(|e| IoError::Failed(format!("the write-back log cannot be read: {e}")))?;
        refuse_damage(&r, info.durable_seq)?;
        let left = (r.index.iter().map(|((v, _), _)| v))
            .chain(r.lost.iter().map(|&(v, _)| v))
            .filter(|&v| self.vols.iter().all(|x| x.id as u32 != v))
            .count();
        if left > 0 {
            return Err(IoError::Failed(format!(
                "--discard-dirty: {left} dirty pages of volumes this start does not serve lie \
                 in the write-back log behind older dirty pages of a served volume, so \
                 they cannot be dropped yet: start with every volume, run `sce ctl flush \
                 --to-source`, then start without them"
            )));
        }
        tracing::warn!(
            pages = dropped,
            "--discard-dirty: the write-back log's pages of volumes this start does not serve \
             are dropped"
        );
        Ok(())
    }
}
