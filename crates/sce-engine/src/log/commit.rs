//! Commits and the anchor. An NBD FLUSH (or FUA) commits every write acknowledged before
//! it: one commit record (two copies, one device write) and one cache-device flush, shared
//! by concurrent callers (whoever holds `commit_io` commits for all; the others find theirs
//! done). The cleaner commits at least every [`AUTOCOMMIT`] too, which bounds what a crash
//! without a FLUSH loses. The anchor, where a replay starts, moves once cleaning moved the
//! tail (a superblock write, flushed): only then may the ring reuse the blocks before it.

use super::LogBack;
use super::LogIo;
use sce_io::IoError;
use sce_store::wblog::PreparedCommit;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

/// Longest time completed writes stay uncommitted without a FLUSH.
pub(super) const AUTOCOMMIT: Duration = Duration::from_secs(1);

/// A commit that listed pages and that no later commit followed for this long gets a seal
/// (an empty commit, written and flushed by the cleaner): until then, a replay after a
/// crash cannot tell damage to that commit's pages from a write the crash tore, and gives
/// such a page its older version. Under a steady stream of FLUSHes the next commit is the
/// seal, and no extra one is written.
pub(super) const SEAL_AFTER: Duration = Duration::from_millis(10);

/// What one try at a commit came to.
pub(super) enum Try {
    Done,
    /// Some of it committed; more is pending (a commit takes a bounded number of entries).
    More,
    /// No room in the ring for the commit records: cleaning must move the anchor first.
    NoRoom,
}

impl LogBack {
    /// A client's FLUSH: every write acknowledged before it durable on the cache device,
    /// and on the source for those a drain sent through to it.
    pub(crate) fn flush(&self, e: &LogIo<'_>) -> Result<(), IoError> {
        // Writes through are counted once they completed: those counted now are covered
        // by a source flush started after this point, this one's or another FLUSH's that
        // completed with them counted.
        self.through_writes.flush_if_owed(|| e.dev.flush_source())?;
        self.commit(e)
    }

    /// Commits every write completed so far, waiting for room if the ring is full (up to
    /// the wait limit; not past a shutdown, or the cache device failing: nothing would
    /// make room then).
    pub(crate) fn commit(&self, e: &LogIo<'_>) -> Result<(), IoError> {
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
                Try::NoRoom if e.signals.shutting_down() => {
                    return Err(IoError::ShuttingDown("the cache is shutting down".into()))
                }
                Try::NoRoom if e.health.passthrough() => {
                    return Err(IoError::Failed(
                        "the cache device failed: no commit of the write-back log".into(),
                    ))
                }
                Try::NoRoom => {
                    // The cleaner makes room (it never waits for `commit_io`).
                    self.waiting.fetch_add(1, Relaxed);
                    self.cleaner_wanted();
                    self.progress.wait(seen, Duration::from_millis(20));
                    self.waiting.fetch_sub(1, Relaxed);
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
        self.try_commit_with(mark, false)
    }

    /// A commit even if every completion is committed: the seal the writer was asked for.
    pub(super) fn try_commit_forced(&self, mark: u64) -> Result<Try, IoError> {
        self.try_commit_with(mark, true)
    }

    fn try_commit_with(&self, mark: u64, seal: bool) -> Result<Try, IoError> {
        let _io = self.commit_io.lock();
        let (prep, upto) = {
            let mut st = self.st.lock();
            // Done unless a commit is wanted anyway: a seal, or a writer that found the
            // gap since the last commit full (`Full::Commit`: only a commit lets it on,
            // whether or not anything completed since).
            let wanted = (seal && st.unsealed.is_some()) || st.w.commit_wanted();
            if st.committed >= mark && !wanted {
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
        // The ring copies, the mirror area's second copies (another place on the device),
        // then one flush for both.
        let result = self
            .dev
            .write_at(self.at(p.lpos), &p.bytes)
            .and_then(|()| {
                p.mirror_at
                    .map_or(Ok(()), |m| self.dev.write_at(m, &p.bytes))
            })
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
        let more = st.commit_done(&p, std::time::Instant::now());
        self.commits.fetch_add(1, Relaxed);
        if !more {
            st.committed = st.committed.max(upto);
        }
        drop(st);
        self.progress.bump();
        Ok(if more { Try::More } else { Try::Done })
    }

    /// Writes a seal after the last commit if it listed pages and has stood alone for
    /// [`SEAL_AFTER`] (the cleaner's, never waiting for room).
    pub(super) fn seal_if_due(&self) {
        {
            let mut st = self.st.lock();
            if st.unsealed.is_none_or(|t| t.elapsed() < SEAL_AFTER) {
                return;
            }
            st.w.request_seal();
        }
        let mark = self.st.lock().written;
        let failed = match self.try_commit_forced(mark) {
            Ok(Try::NoRoom) => Some(None),
            Err(err) => Some(Some(err)),
            Ok(_) => None,
        };
        if let Some(err) = failed {
            // Tried again in a second, not at once: a device that fails its writes or a
            // ring without room would have it retried a thousand times a second.
            let mut st = self.st.lock();
            if st.unsealed.is_some() {
                st.unsealed = Some(std::time::Instant::now() + Duration::from_secs(1));
            }
            drop(st);
            if let Some(err) = err {
                tracing::warn!("write-back log: the seal after the last commit failed: {err}");
            }
        }
    }

    /// How long the cleaner may nap, at most `idle`: less while a seal is due sooner.
    pub(super) fn seal_wait(&self, idle: Duration) -> Duration {
        match self.st.lock().unsealed {
            Some(t) => SEAL_AFTER
                .saturating_sub(t.elapsed())
                .max(Duration::from_millis(1))
                .min(idle),
            None => idle,
        }
    }

    /// True if completed writes wait for a commit (or tombstones and cleaned entries).
    pub(super) fn uncommitted(&self) -> bool {
        let st = self.st.lock();
        st.committed < st.written || st.w.commit_wanted()
    }

    /// Makes the newest anchor the writer allows durable in the superblock (with the
    /// newest commit known durable), then lets the ring reuse what lies before it. A lost
    /// page's record holds the tail, so the replay from any anchor finds the loss. Returns
    /// true if the anchor moved.
    ///
    /// One at a time (`anchor_io`): two callers that each took a candidate could otherwise
    /// record them out of order, leaving the superblock's anchor behind the one the ring
    /// already reuses the blocks before.
    pub(super) fn advance_anchor(&self) -> Result<bool, IoError> {
        let _one = self.anchor_io.lock();
        let (anchor, durable) = {
            let st = self.st.lock();
            let Some(a) = st.anchor_due() else {
                return Ok(false);
            };
            (a, st.w.next_seq() - 1)
        };
        self.persist.record_log(anchor, durable)?;
        self.st.lock().anchored(anchor);
        self.progress.bump();
        Ok(true)
    }
}
