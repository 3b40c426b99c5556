//! Opening the log: the region found from the superblock, replayed from its anchor, the
//! index rebuilt. A replay that ends before the newest commit the superblock knew durable,
//! or that lost its anchor commit, met damage, and a start is refused rather than served
//! with older versions; so is a start in another mode than write-back while the log holds
//! dirty pages, and one that leaves out a volume with dirty pages in the log.

use super::{Dirty, LogBack, St};
use crate::persist::Persist;
use crate::through::WriteThrough;
use parking_lot::{Condvar, Mutex};
use sce_io::{BlockDevice, IoError};
use sce_store::wblog::{self, LogRegion, LogWriter, Replayed};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The log of the cache device `cache` (the whole device), if the superblock has one:
/// replayed, ready to serve in write-back (`writeback`), or empty and idle otherwise.
pub(crate) fn open_log(
    cache: &Arc<dyn BlockDevice>,
    persist: &Arc<Persist>,
    through: WriteThrough,
    writeback: bool,
    limits: (Duration, Duration),
) -> Result<Option<LogBack>, IoError> {
    let Some(info) = persist.log_info() else {
        return Ok(None);
    };
    let region = info.region(&persist.layout);
    let r = wblog::replay(&**cache, region, &info.key, info.anchor())
        .map_err(|e| IoError::Failed(format!("the write-back log cannot be read: {e}")))?;
    if r.anchor_missing() || r.last_seq < info.durable_seq {
        return Err(IoError::Failed(format!(
            "the write-back log ends at commit {} but commit {} was durable (or its anchor \
             commit is gone): its records are damaged, and serving would return older data; \
             `sce format --force` drops it",
            r.last_seq, info.durable_seq
        )));
    }
    let w = LogWriter::resume(region, info.key, &r);
    let lb = LogBack::new(cache.clone(), region, persist, through, w, limits);
    lb.restore(&r, writeback)?;
    if !r.index.is_empty() || !r.lost.is_empty() {
        tracing::info!(
            pages = r.index.len(),
            lost = r.lost.len(),
            commits = r.commits,
            skipped = r.skipped,
            "write-back log replayed: dirty pages restored"
        );
    }
    Ok(Some(lb))
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
    ) -> LogBack {
        LogBack {
            through,
            dev,
            region,
            seeds: persist.seeds(),
            persist: persist.clone(),
            st: Mutex::new(St {
                w,
                index: Default::default(),
                live: Default::default(),
                older: Default::default(),
                pending: Default::default(),
                inflight: Default::default(),
                lost: Default::default(),
                written: 0,
                committed: 0,
            }),
            commit_io: Mutex::new(()),
            clean_io: Mutex::new(()),
            ranges: Default::default(),
            queue: OnceLock::new(),
            progress: Default::default(),
            wanted: Mutex::new(false),
            wanted_cv: Condvar::new(),
            forced: Default::default(),
            last_request: Default::default(),
            waits: Default::default(),
            bytes_cleaned: Default::default(),
            clean_errors: Default::default(),
            source_writes: Default::default(),
            commits: Default::default(),
            last_clean_error: Mutex::new(String::new()),
            wait_limit,
            idle,
        }
    }

    /// Puts back what replay `r` found: the newest version of each page, the lost pages.
    /// Refused if a volume it names is not served, or if it holds anything and the start is
    /// not in write-back (`writeback`).
    fn restore(&self, r: &Replayed, writeback: bool) -> Result<(), IoError> {
        let served = |volume: u32, page: u64| {
            self.global(volume, page).ok_or_else(|| {
                IoError::Failed(format!(
                    "the write-back log holds dirty pages of volume {volume}, which this start \
                     does not serve: start with it, and `sce ctl flush --to-source`"
                ))
            })
        };
        let mut st = self.st.lock();
        for &(volume, page) in &r.lost {
            st.lost.insert(served(volume, page)?);
        }
        let mut by_pos = Vec::with_capacity(r.index.len());
        for ((volume, page), v) in r.index.iter() {
            by_pos.push((v.lpos, served(volume, page)?, v.crc));
        }
        by_pos.sort_unstable();
        for (lpos, g, crc) in by_pos {
            st.newest(g, Dirty { lpos, crc }, false);
        }
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
        Ok(())
    }
}
