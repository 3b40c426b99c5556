//! The writer's side of lent chunks (format 9, `super::super::lend`): which chunks writes
//! may use, which a replay or a write still needs, where positions go, and the positions
//! skipped, which count as used in the ring's arithmetic but not toward the gap between
//! commits or the room in use.

use super::super::commit_reserve;
use super::LogWriter;

/// What [`LogWriter::lend_step`] says the log should do with its chunks of read slots now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LendStep {
    /// Lend chunk `c` (the c-th in lap order; lent already if the superblock says so) and
    /// let writes use it (`set_usable(c + 1)`).
    Lend(u64),
    /// Writes stop using the last chunk they may use (`set_usable(usable - 1)`); it goes
    /// back once no replay reads it.
    Unuse,
    /// Nothing to change.
    Stay,
}

impl LogWriter {
    /// Positions skipped at or after `from`.
    pub(super) fn skipped_since(&self, from: u64) -> u64 {
        (self.skips.iter().rev())
            .take_while(|s| s.0 >= from)
            .map(|s| s.1)
            .sum()
    }

    /// Of a skip from `from` to `to`, the positions the gap between commits does not
    /// count: those of the chunks a lap leaves unused, at most all the chunks' (replay's
    /// window allows that much more), and only where the skip crosses into the next lap (at
    /// most once in a gap: the log's own blocks lie between). What a write that does not
    /// fit leaves at the end of a segment counts, as it always did.
    fn unused(&self, from: u64, to: u64) -> u64 {
        let lap = self.region.lap();
        if to / lap > from / lap {
            (to - from).min(self.region.lend.blocks())
        } else {
            0
        }
    }

    /// Chunks writes may use from now on (at most the region's): the head goes on into the
    /// next chunk if it is usable when the head gets there, else to the next lap. The
    /// caller lends a chunk (its slots evicted, that durable, the chunks lent recorded)
    /// before it makes it usable.
    pub fn set_usable(&mut self, u: u64) {
        self.usable = u.min(self.region.lend.chunks);
    }
    /// Chunks writes may use from now on.
    pub fn usable(&self) -> u64 {
        self.usable
    }
    /// Chunks a replay must read or a write may still use: those holding a position from
    /// the durable anchor to the head, and those writes may use from now on (chunks are
    /// lent, and given back, from the first). Chunks beyond it may go back to the read
    /// slots.
    pub fn needed_lent(&self) -> u64 {
        let lap = self.region.lap();
        let a = self.anchor.lpos();
        let (a_lap, q_a) = (a / lap, a % lap);
        let mut need = self.usable;
        if a_lap == self.head_lap {
            // Live positions from the anchor to the head: the chunks among them. (Past the
            // head, only chunks still usable are written.)
            let head_q = self.head - self.head_lap * lap;
            if q_a < head_q {
                need = need.max(self.head_chunks);
            }
        } else if a_lap + 1 == self.head_lap {
            need = need.max(self.head_chunks);
            if q_a < self.region.used_end(self.prev_chunks) {
                need = need.max(self.prev_chunks);
            }
        }
        need
    }
    /// The lending rule (the server's cleaner and the simulator both follow it, one step at
    /// a look): lend the next chunk while the positions in use reach half of what the log
    /// holds with the chunks it uses, or `writers_wait` for room, so that a write never waits
    /// while a chunk is left; stop using the last one while the log would be under a
    /// quarter full without it. The caller lends (evicts the chunk's slots, makes that
    /// durable) before it makes the chunk usable, and gives back what [`Self::needed_lent`]
    /// no longer needs.
    pub fn lend_step(&self, writers_wait: bool) -> LendStep {
        let lend = self.region.lend;
        if lend.chunks == 0 {
            return LendStep::Stay;
        }
        let used = self.region.lap() - self.room();
        let cap = self.usable_capacity();
        let short = used * 2 >= cap || writers_wait;
        if short && self.usable < lend.chunks {
            LendStep::Lend(self.usable)
        } else if !short && self.usable > 0 && used * 4 < cap - lend.chunk_blocks {
            LendStep::Unuse
        } else {
            LendStep::Stay
        }
    }

    /// Positions a lap holds with the chunks now usable: the most the log can hold before
    /// it lends more.
    pub fn usable_capacity(&self) -> u64 {
        self.region.blocks + self.usable * self.region.lend.chunk_blocks
    }

    /// Where `n` positions from the head go (see `LogRegion::place`).
    pub(super) fn place(&self, n: u64) -> u64 {
        self.region.place(self.head, n, self.usable)
    }

    /// Positions a commit reserve of `k` after `end` takes, with the chunks a lap skips if
    /// the commits reach the end of the chunks it uses.
    pub(super) fn reserve_after(&self, end: u64, k: u64) -> u64 {
        let r = commit_reserve(k);
        let lap = self.region.lap();
        let used_end = self.region.used_end(self.usable);
        if end % lap + r > used_end {
            r + (lap - used_end)
        } else {
            r
        }
    }

    /// The head moves to `end`, the positions from the head to `at` skipped.
    pub(super) fn advance(&mut self, at: u64, end: u64) {
        if at > self.head {
            let unused = self.unused(self.head, at);
            self.skips.push_back((self.head, at - self.head, unused));
        }
        let lap_len = self.region.lap();
        let lap = at / lap_len;
        if lap > self.head_lap {
            self.prev_chunks = self.head_chunks;
            self.head_chunks = 0;
            self.head_lap = lap;
        }
        let q = (end - 1) % lap_len;
        if q >= self.region.blocks {
            let c = (q - self.region.blocks) / self.region.lend.chunk_blocks + 1;
            self.head_chunks = self.head_chunks.max(c);
        }
        self.head = end;
    }

    /// Positions from the end of the last commit to `end`, those of chunks a lap left
    /// unused not counted (`at`: where a write of positions up to `end` starts).
    pub(super) fn gap(&self, at: u64, end: u64) -> u64 {
        let unused: u64 = (self.skips.iter().rev())
            .take_while(|s| s.0 >= self.committed_end)
            .map(|s| s.2)
            .sum();
        end - self.committed_end - unused - self.unused(self.head, at)
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::{Full, Lend, LogRegion};
    use super::{LendStep, LogWriter};

    /// A ring of 960 blocks of its own that may lend four chunks of 256.
    fn writer() -> LogWriter {
        let lend = Lend {
            chunks: 4,
            chunk_blocks: 256,
            area_offset: 1 << 30,
            area_slots: 64,
            slot_bytes: 1 << 20,
        };
        let region = LogRegion {
            lend,
            ..LogRegion::laid_out(0, 1024)
        };
        LogWriter::new(region, [7; 16], 0, 1).unwrap()
    }

    /// Takes `n` positions, committing whenever the gap since the last commit is full.
    fn take(w: &mut LogWriter, n: u64) {
        for _ in 0..n {
            match w.allocate(1) {
                Ok(_) => {}
                Err(Full::Commit) => {
                    let p = w.prepare_commit().unwrap().unwrap();
                    w.committed(&p);
                    w.allocate(1).unwrap();
                }
                Err(e) => panic!("{e:?}"),
            }
        }
    }

    #[test]
    fn the_lending_rule_lends_at_half_and_unuses_below_a_quarter() {
        let mut w = writer();
        assert_eq!(w.region().blocks, 960);
        assert_eq!(w.lend_step(false), LendStep::Stay, "an empty log");
        assert_eq!(w.lend_step(true), LendStep::Lend(0), "writers wait: lend");
        take(&mut w, 470);
        assert_eq!(w.lend_step(false), LendStep::Stay, "under half of 960");
        take(&mut w, 20);
        assert_eq!(w.lend_step(false), LendStep::Lend(0), "half of 960 in use");
        w.set_usable(1);
        assert_eq!(w.usable_capacity(), 1216);
        assert_eq!(w.lend_step(false), LendStep::Stay, "under half of 1216");
        w.set_usable(4);
        assert_eq!(w.lend_step(true), LendStep::Stay, "every chunk in use");
        // A fresh log allowed chunks: under a quarter full without the last, it stops.
        let mut w = writer();
        w.set_usable(2);
        assert_eq!(w.lend_step(false), LendStep::Unuse);
        take(&mut w, 400);
        assert_eq!(
            w.lend_step(false),
            LendStep::Stay,
            "400 of 1472: over a quarter of 1216"
        );
    }
}
