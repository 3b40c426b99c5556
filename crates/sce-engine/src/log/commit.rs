//! Commits and the anchor. An NBD FLUSH (or FUA) commits every write acknowledged before
//! it: one commit record (two copies, one device write) and one cache-device flush, shared
//! by concurrent callers (whoever holds `commit_io` commits for all; the others find theirs
//! done). The cleaner commits at least every [`AUTOCOMMIT`] too, which bounds what a crash
//! without a FLUSH loses. The anchor, where a replay starts, moves once cleaning moved the
//! tail (a superblock write, flushed): only then may the ring reuse the blocks before it.

use super::LogBack;
use crate::engine::Engine;
use sce_io::IoError;
use sce_store::wblog::PreparedCommit;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Longest time completed writes stay uncommitted without a FLUSH.
pub(super) const AUTOCOMMIT: Duration = Duration::from_secs(1);

/// What one try at a commit came to.
enum Try {
    Done,
    /// Some of it committed; more is pending (a commit takes a bounded number of entries).
    More,
    /// No room in the ring for the commit records: cleaning must move the anchor first.
    NoRoom,
}

impl LogBack {
    /// A client's FLUSH: every write acknowledged before it durable on the cache device.
    pub(crate) fn flush(&self, _e: &Engine) -> Result<(), IoError> {
        self.commit()
    }

    /// Commits every write completed so far, waiting for room if the ring is full (up to
    /// the wait limit).
    pub(crate) fn commit(&self) -> Result<(), IoError> {
        let mark = self.st.lock().written;
        let started = std::time::Instant::now();
        loop {
            let seen = self.progress.now();
            match self.try_commit(mark)? {
                Try::Done => return Ok(()),
                Try::More => {}
                Try::NoRoom if started.elapsed() > self.wait_limit => {
                    return Err(IoError::NoRoom(format!(
                        "no room in the write-back log for a commit after {:?}: it is full of \
                         dirty data the source is not taking",
                        self.wait_limit
                    )))
                }
                Try::NoRoom => {
                    // The cleaner makes room (it never waits for `commit_io`).
                    self.cleaner_wanted();
                    self.progress.wait(seen, Duration::from_millis(20));
                }
            }
        }
    }

    /// The cleaner's autocommit (and a clean stop's): commits what it can now, never waits
    /// for room.
    pub(crate) fn autocommit(&self) {
        let mark = self.st.lock().written;
        while let Ok(Try::More) = self.try_commit(mark) {}
    }

    /// One commit toward the first `mark` write completions (group commit).
    fn try_commit(&self, mark: u64) -> Result<Try, IoError> {
        let _io = self.commit_io.lock();
        let (prep, upto) = {
            let mut st = self.st.lock();
            if st.committed >= mark {
                return Ok(Try::Done);
            }
            let upto = st.written;
            match st.w.prepare_commit() {
                Ok(p) => (p, upto),
                Err(_) => return Ok(Try::NoRoom),
            }
        };
        let Some(p) = prep else {
            // Every completion is listed by a commit already durable or this flush's.
            self.dev.flush()?;
            self.st.lock().committed = upto;
            return Ok(Try::Done);
        };
        let result = self
            .dev
            .write_at(self.at(p.lpos), &p.bytes)
            .and_then(|()| self.dev.flush());
        self.committed(p, upto, result)
    }

    /// After a commit's write and flush (`result`): the writer told, the counters moved.
    fn committed(
        &self,
        p: PreparedCommit,
        upto: u64,
        result: Result<(), IoError>,
    ) -> Result<Try, IoError> {
        let mut st = self.st.lock();
        if let Err(err) = result {
            st.w.commit_failed(&p);
            return Err(IoError::Failed(format!(
                "the write-back log could not be committed on the cache device: {err}"
            )));
        }
        st.w.committed(&p);
        st.committed(p.entries);
        self.commits.fetch_add(1, Relaxed);
        let more = st.w.pending() > 0;
        if !more {
            st.committed = st.committed.max(upto);
        }
        drop(st);
        self.progress.bump();
        Ok(if more { Try::More } else { Try::Done })
    }

    /// True if completed writes wait for a commit.
    pub(super) fn uncommitted(&self) -> bool {
        let st = self.st.lock();
        st.committed < st.written
    }

    /// Makes the newest anchor the writer allows durable in the superblock (with the
    /// newest commit known durable), then lets the ring reuse what lies before it. Not
    /// while pages are lost: the replay that found them must find them again.
    pub(super) fn advance_anchor(&self) -> Result<(), IoError> {
        let (anchor, durable) = {
            let st = self.st.lock();
            let a = st.w.anchor_candidate();
            if a == st.w.anchor() || !st.lost.is_empty() {
                return Ok(());
            }
            (a, st.w.next_seq() - 1)
        };
        self.persist.record_log(anchor, durable)?;
        self.st.lock().w.set_anchor(anchor);
        self.progress.bump();
        Ok(())
    }
}
