//! The writer's side of lent chunks (format 9, `super::super::lend`): which chunks writes
//! may use, which a replay or a write still needs, where positions go, and the positions
//! skipped, which count as used in the ring's arithmetic but not toward the gap between
//! commits or the room in use.

use super::super::commit_reserve;
use super::LogWriter;

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
