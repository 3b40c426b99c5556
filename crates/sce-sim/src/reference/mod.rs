//! The reference policies over 4 KiB blocks, as other simulators (libCacheSim) count them:
//! every block a request covers is one access, a lookup that inserts the block on a miss,
//! reads and writes alike (except LARC, which admits a block only on its second recent
//! miss). Block `b` covers bytes `b*4096 .. (b+1)*4096`; a request covers blocks
//! `offset/4096 ..= (offset+len-1)/4096`.
//!
//! LRU and FIFO keep an intrusive doubly-linked list over preallocated nodes (O(1) per
//! access); LFU keeps an ordered set of (count, last access, slot) and evicts the least
//! frequently used block, the least recently used among equals (O(log n) per access).
//! Counts are kept for cached blocks only (in-cache LFU, as libCacheSim's `LFU`).
//!
//! S3-FIFO (Yang et al., SOSP 2023) keeps two FIFO lists over the same nodes, a small one
//! (10% of the capacity) and a main one (90%), a 2-bit frequency per cached block and a
//! ghost FIFO of block ids (90% of the capacity); it follows libCacheSim's `S3FIFO.c`, so
//! that the miss counts agree exactly (see [`ReferencePolicy::S3Fifo`]). LARC (Huang et al.,
//! MSST 2013) is an LRU cache behind an LRU ghost queue of candidates whose size adapts
//! (see [`ReferencePolicy::Larc`]). Both are O(1) per access (amortised for S3-FIFO, whose
//! eviction passes over at most three reinsertions per hit).
//!
//! [`BlockCache::inserts`] counts the blocks written into the cache: every miss for LRU,
//! FIFO, LFU and S3-FIFO, admissions only for LARC. [`BlockCache::updates`] counts the
//! blocks a write ([`BlockCache::write`]) found cached and rewrote: a cache device writes
//! those 4 KiB too (a write-through cache keeps its copy current), so flash writes are
//! both together.

use sce_core::hotness::IntMap;
use std::collections::BTreeSet;

mod lists;
#[cfg(test)]
mod tests;

pub use lists::NO_SLOT;
use lists::{Ghost, Links, List, EMPTY};

/// A reference replacement policy.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReferencePolicy {
    /// Least recently used.
    Lru,
    /// First in, first out.
    Fifo,
    /// Least frequently used (ties: least recently used).
    Lfu,
    /// S3-FIFO as libCacheSim's `S3FIFO` (small-size-ratio 0.1, ghost-size-ratio 0.9,
    /// move-to-main-threshold 2): a missed block goes into the main FIFO if its id is in the
    /// ghost, else into the small FIFO (or, until the first eviction, into the main FIFO
    /// once the small one is full). A hit adds one to the block's frequency (at most 3).
    /// The cache evicts from the main FIFO when that holds more than its share or the small
    /// one is empty, else from the small one. The oldest small block moves to the main FIFO
    /// (frequency 0) if it was hit at least twice, else leaves, its id going into the ghost;
    /// the oldest main block is reinserted with its frequency less one if it was hit, else
    /// leaves. The small FIFO holds `floor(0.1 C)` blocks (at least 1), the ghost
    /// `floor(0.9 C)` ids; libCacheSim refuses caches under 20 blocks, this one does not.
    S3Fifo,
    /// LARC: a cache block is written only on a block's second recent miss. A missed block
    /// in the ghost queue leaves it and enters the cache (LRU); any other missed block only
    /// enters the ghost queue (LRU of ids, at most `C_r` of them). `C_r` starts at `0.1 C`;
    /// a hit shrinks it, `C_r = max(0.1 C, C_r - C/(C - C_r))`, a miss grows it,
    /// `C_r = min(0.9 C, C_r + C/C_r)`. As in the paper's algorithm, one ghost id leaves per
    /// ghost insertion that finds the queue longer than `C_r`.
    Larc,
}

impl ReferencePolicy {
    /// Every policy.
    pub const ALL: [ReferencePolicy; 5] = [
        ReferencePolicy::Lru,
        ReferencePolicy::Fifo,
        ReferencePolicy::Lfu,
        ReferencePolicy::S3Fifo,
        ReferencePolicy::Larc,
    ];
}

/// What one access did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// The block was cached.
    pub hit: bool,
    /// The slot that holds the block now ([`NO_SLOT`] if the policy did not admit it:
    /// LARC on a first miss).
    pub slot: u32,
    /// The block evicted to make room, and the slot it had (the new block's slot).
    pub evicted: Option<u64>,
}

/// S3-FIFO's per-slot state: frequency in the low two bits, and this bit if the block is
/// in the main FIFO.
const IN_MAIN: u8 = 0x80;
const FREQ: u8 = 0x03;

/// A fixed-capacity block cache with intrusive lists over preallocated nodes.
pub struct BlockCache {
    policy: ReferencePolicy,
    index: IntMap<u64, u32>,
    keys: Vec<u64>,
    links: Links,
    /// LRU, FIFO, LARC: the cache, most recent first; S3-FIFO: the main FIFO.
    main: List,
    /// S3-FIFO: the small FIFO.
    small: List,
    capacity: usize,
    free: Vec<u32>,
    lfu: BTreeSet<(u32, u64, u32)>,
    counts: Vec<(u32, u64)>,
    tick: u64,
    /// S3-FIFO: per slot, frequency and queue.
    s3: Vec<u8>,
    /// S3-FIFO: blocks of the small FIFO, ids of the ghost.
    small_capacity: usize,
    ghost_capacity: usize,
    /// S3-FIFO: the cache has evicted once (until then a full small FIFO sends new blocks
    /// to the main one).
    has_evicted: bool,
    /// S3-FIFO's and LARC's ghost.
    ghost: Ghost,
    /// LARC: the ghost queue's target size `C_r`.
    ghost_target: f64,
    /// Block accesses.
    pub accesses: u64,
    /// Misses.
    pub misses: u64,
    /// Blocks written into the cache (misses, but LARC's admissions only).
    pub inserts: u64,
    /// Blocks a write found cached and rewrote in the cache.
    pub updates: u64,
}

impl BlockCache {
    /// The most blocks a cache can hold (slots are 32-bit).
    pub const MAX_BLOCKS: usize = (u32::MAX - 1) as usize;

    /// A cache of `capacity_blocks` 4 KiB blocks (at least 1, at most [`Self::MAX_BLOCKS`]).
    /// Memory is reserved up to a million blocks at once and grows with the contents, so a
    /// cache larger than the trace costs only what the trace fills.
    pub fn new(policy: ReferencePolicy, capacity_blocks: usize) -> Self {
        let capacity = capacity_blocks.clamp(1, Self::MAX_BLOCKS);
        let reserve = capacity.min(1 << 20);
        let mut index = IntMap::default();
        index.reserve(reserve);
        // As libCacheSim: the small FIFO has floor(0.1 C) blocks, the ghost floor(0.9 C) ids.
        let small_capacity = ((capacity as f64 * 0.1) as usize).clamp(1, capacity);
        let ghost_capacity = (capacity as f64 * 0.9) as usize;
        let ghost_reserve = match policy {
            ReferencePolicy::S3Fifo | ReferencePolicy::Larc => ghost_capacity.min(1 << 20),
            _ => 0,
        };
        BlockCache {
            policy,
            index,
            keys: Vec::with_capacity(reserve),
            links: Links::with_capacity(reserve),
            main: EMPTY,
            small: EMPTY,
            capacity,
            free: Vec::new(),
            lfu: BTreeSet::new(),
            counts: Vec::new(),
            tick: 0,
            s3: Vec::with_capacity(if policy == ReferencePolicy::S3Fifo {
                reserve
            } else {
                0
            }),
            small_capacity,
            ghost_capacity,
            has_evicted: false,
            ghost: Ghost::new(ghost_reserve),
            ghost_target: 0.1 * capacity as f64,
            accesses: 0,
            misses: 0,
            inserts: 0,
            updates: 0,
        }
    }

    /// The policy.
    pub fn policy(&self) -> ReferencePolicy {
        self.policy
    }

    /// Bytes of memory the cache's structures take now (capacity of the index, the node
    /// arrays, the LFU order and the ghost; the allocator's own overhead excluded).
    pub fn memory_bytes(&self) -> u64 {
        let index = self.index.capacity() * (std::mem::size_of::<(u64, u32)>() + 1);
        let nodes = self.keys.capacity() * 8 + self.links.bytes() + self.s3.capacity();
        let lfu = self.counts.capacity() * std::mem::size_of::<(u32, u64)>()
            + self.lfu.len() * (std::mem::size_of::<(u32, u64, u32)>() + 8);
        (index + nodes + lfu + self.free.capacity() * 4 + self.ghost.memory_bytes()) as u64
    }

    /// One access to block `b`; true on a hit.
    #[inline]
    pub fn access(&mut self, b: u64) -> bool {
        if !matches!(self.policy, ReferencePolicy::Lru | ReferencePolicy::Fifo) {
            return self.access_detailed(b).hit;
        }
        // The LRU/FIFO fast path: the benchmark's inner loop.
        self.accesses += 1;
        if let Some(&i) = self.index.get(&b) {
            if self.policy == ReferencePolicy::Lru && self.main.head != i {
                self.links.unlink(&mut self.main, i);
                self.links.push_front(&mut self.main, i);
            }
            return true;
        }
        self.misses += 1;
        let (i, _) = self.take_slot(b);
        self.links.push_front(&mut self.main, i);
        false
    }

    /// A slot for the missed block `b`: a free one, a new one, or the victim's (evicted per
    /// the policy; returned with it). Indexes `b` there and counts the insertion; placing the
    /// slot in the policy's order is the caller's.
    fn take_slot(&mut self, b: u64) -> (u32, Option<u64>) {
        let (i, evicted) = if let Some(i) = self.free.pop() {
            self.keys[i as usize] = b;
            (i, None)
        } else if self.keys.len() < self.capacity {
            self.keys.push(b);
            self.links.add_node();
            match self.policy {
                ReferencePolicy::Lfu => self.counts.push((0, 0)),
                ReferencePolicy::S3Fifo => self.s3.push(0),
                _ => {}
            }
            ((self.keys.len() - 1) as u32, None)
        } else {
            let v = match self.policy {
                ReferencePolicy::Lfu => self.lfu.pop_first().expect("a full cache has entries").2,
                ReferencePolicy::S3Fifo => self.s3_evict(),
                _ => {
                    let v = self.main.tail;
                    self.links.unlink(&mut self.main, v);
                    v
                }
            };
            let old = self.keys[v as usize];
            self.index.remove(&old);
            self.keys[v as usize] = b;
            (v, Some(old))
        };
        self.index.insert(b, i);
        self.inserts += 1;
        (i, evicted)
    }

    /// S3-FIFO: evicts one block and returns its slot (unlinked, still indexed).
    fn s3_evict(&mut self) -> u32 {
        self.has_evicted = true;
        let main_capacity = self.capacity - self.small_capacity;
        loop {
            if self.main.len > main_capacity || self.small.len == 0 {
                // The main FIFO with reinsertion: a block hit since it was (re)inserted
                // goes round again with one hit less.
                loop {
                    let v = self.main.tail;
                    self.links.unlink(&mut self.main, v);
                    let f = self.s3[v as usize] & FREQ;
                    if f == 0 {
                        return v;
                    }
                    self.s3[v as usize] = IN_MAIN | (f - 1);
                    self.links.push_front(&mut self.main, v);
                }
            }
            // The small FIFO: blocks hit twice move to main; the first other one leaves,
            // its id going into the ghost. If every block moved, evict from main instead.
            while self.small.len > 0 {
                let v = self.small.tail;
                self.links.unlink(&mut self.small, v);
                if self.s3[v as usize] & FREQ >= 2 {
                    self.s3[v as usize] = IN_MAIN;
                    self.links.push_front(&mut self.main, v);
                } else {
                    let old = self.keys[v as usize];
                    if self.ghost_capacity > 0 && !self.ghost.contains(old) {
                        if self.ghost.len() >= self.ghost_capacity {
                            self.ghost.pop_oldest();
                        }
                        self.ghost.push(old);
                    }
                    return v;
                }
            }
        }
    }

    /// One access to block `b`, saying which slot holds it and what it evicted.
    pub fn access_detailed(&mut self, b: u64) -> Access {
        self.accesses += 1;
        if let Some(&i) = self.index.get(&b) {
            self.on_hit(i);
            return Access {
                hit: true,
                slot: i,
                evicted: None,
            };
        }
        self.misses += 1;
        let (slot, evicted) = self.on_miss(b);
        Access {
            hit: false,
            slot,
            evicted,
        }
    }

    /// Updates the policy's state on a hit of slot `i`.
    fn on_hit(&mut self, i: u32) {
        match self.policy {
            ReferencePolicy::Lru | ReferencePolicy::Larc => {
                if self.main.head != i {
                    self.links.unlink(&mut self.main, i);
                    self.links.push_front(&mut self.main, i);
                }
                if self.policy == ReferencePolicy::Larc {
                    let c = self.capacity as f64;
                    let cr = self.ghost_target;
                    self.ghost_target = (cr - c / (c - cr)).max(0.1 * c);
                }
            }
            ReferencePolicy::Lfu => {
                let (c, t) = self.counts[i as usize];
                self.lfu.remove(&(c, t, i));
                self.tick += 1;
                let e = (c.saturating_add(1), self.tick);
                self.counts[i as usize] = e;
                self.lfu.insert((e.0, e.1, i));
            }
            ReferencePolicy::S3Fifo => {
                let m = &mut self.s3[i as usize];
                if *m & FREQ < 3 {
                    *m += 1;
                }
            }
            ReferencePolicy::Fifo => {}
        }
    }

    /// Caches block `b` on a miss, as the policy admits it: its slot (or [`NO_SLOT`]) and
    /// the block evicted for it.
    fn on_miss(&mut self, b: u64) -> (u32, Option<u64>) {
        match self.policy {
            ReferencePolicy::Lru | ReferencePolicy::Fifo => {
                let (i, e) = self.take_slot(b);
                self.links.push_front(&mut self.main, i);
                (i, e)
            }
            ReferencePolicy::Lfu => {
                let (i, e) = self.take_slot(b);
                self.tick += 1;
                self.counts[i as usize] = (1, self.tick);
                self.lfu.insert((1, self.tick, i));
                (i, e)
            }
            ReferencePolicy::S3Fifo => {
                let from_ghost = self.ghost.remove(b);
                let (i, e) = self.take_slot(b);
                let to_main =
                    from_ghost || (!self.has_evicted && self.small.len >= self.small_capacity);
                if to_main {
                    self.s3[i as usize] = IN_MAIN;
                    self.links.push_front(&mut self.main, i);
                } else {
                    self.s3[i as usize] = 0;
                    self.links.push_front(&mut self.small, i);
                }
                (i, e)
            }
            ReferencePolicy::Larc => {
                let c = self.capacity as f64;
                let cr = self.ghost_target;
                self.ghost_target = (cr + c / cr).min(0.9 * c);
                if self.ghost.remove(b) {
                    let (i, e) = self.take_slot(b);
                    self.links.push_front(&mut self.main, i);
                    (i, e)
                } else {
                    self.ghost.push(b);
                    if self.ghost.len() as f64 > self.ghost_target {
                        self.ghost.pop_oldest();
                    }
                    (NO_SLOT, None)
                }
            }
        }
    }

    /// True if block `b` is cached (no access is counted, nothing moves).
    pub fn contains(&self, b: u64) -> bool {
        self.index.contains_key(&b)
    }

    /// Drops block `b` (another host wrote it). Returns the slot it had. A ghost keeps its
    /// ids: they record accesses, not data.
    pub fn remove(&mut self, b: u64) -> Option<u32> {
        let i = self.index.remove(&b)?;
        match self.policy {
            ReferencePolicy::Lfu => {
                let (c, t) = self.counts[i as usize];
                self.lfu.remove(&(c, t, i));
            }
            ReferencePolicy::S3Fifo if self.s3[i as usize] & IN_MAIN == 0 => {
                self.links.unlink(&mut self.small, i);
            }
            _ => self.links.unlink(&mut self.main, i),
        }
        self.free.push(i);
        Some(i)
    }

    /// Drops every cached block of `first..end` (another host wrote them, or took their
    /// region), in ascending order, calling `dropped` with each one's slot; returns true if
    /// any was cached. Walks the cached blocks instead of the range when they are fewer (a
    /// whole region of a shared volume is far more blocks than a cache holds).
    pub fn remove_range(&mut self, first: u64, end: u64, mut dropped: impl FnMut(u32)) -> bool {
        let mut any = false;
        let mut drop_one = |c: &mut Self, b: u64| {
            if let Some(slot) = c.remove(b) {
                dropped(slot);
                any = true;
            }
        };
        if end.saturating_sub(first) > self.index.len() as u64 {
            let mut blocks: Vec<u64> = (self.index.keys().copied())
                .filter(|b| (first..end).contains(b))
                .collect();
            blocks.sort_unstable();
            for b in blocks {
                drop_one(self, b);
            }
        } else {
            for b in first..end {
                drop_one(self, b);
            }
        }
        any
    }

    /// The cached blocks and their slots, in no particular order.
    pub fn cached(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.index.iter().map(|(&b, &s)| (b, s))
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True if no block is cached.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Accesses every block of a request.
    pub fn request(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        for b in offset / 4096..=(offset + len - 1) / 4096 {
            self.access(b);
        }
    }

    /// A write: the same accesses as [`Self::request`]; each block it hits is rewritten in
    /// the cache ([`Self::updates`]). Returns the blocks the cache holds afterwards (hit or
    /// inserted): the ones the cache device writes.
    pub fn write(&mut self, offset: u64, len: u64) -> u64 {
        if len == 0 {
            return 0;
        }
        let mut written = 0;
        for b in offset / 4096..=(offset + len - 1) / 4096 {
            let i0 = self.inserts;
            if self.access(b) {
                self.updates += 1;
                written += 1;
            } else if self.inserts > i0 {
                written += 1;
            }
        }
        written
    }

    /// Blocks the cache device wrote: insertions and updates.
    pub fn blocks_written(&self) -> u64 {
        self.inserts + self.updates
    }

    /// Misses over accesses (0 before any access).
    pub fn miss_ratio(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.misses as f64 / self.accesses as f64
        }
    }
}
