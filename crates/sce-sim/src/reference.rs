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
//! FIFO, LFU and S3-FIFO, admissions only for LARC.

use sce_core::hotness::IntMap;
use std::collections::BTreeSet;

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

const NIL: u32 = u32::MAX;

/// The slot of a block the policy did not cache (LARC's first miss).
pub const NO_SLOT: u32 = NIL;

/// Ends and length of a list threaded through [`Links`].
#[derive(Copy, Clone, Debug)]
struct List {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// Previous and next node of every node; the lists over them keep their own ends.
struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
}

impl Links {
    fn with_capacity(n: usize) -> Self {
        Links {
            prev: Vec::with_capacity(n),
            next: Vec::with_capacity(n),
        }
    }

    fn add_node(&mut self) {
        self.prev.push(NIL);
        self.next.push(NIL);
    }

    fn unlink(&mut self, l: &mut List, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            l.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            l.tail = p;
        }
        l.len -= 1;
    }

    fn push_front(&mut self, l: &mut List, i: u32) {
        self.prev[i as usize] = NIL;
        self.next[i as usize] = l.head;
        if l.head != NIL {
            self.prev[l.head as usize] = i;
        } else {
            l.tail = i;
        }
        l.head = i;
        l.len += 1;
    }

    fn bytes(&self) -> usize {
        (self.prev.capacity() + self.next.capacity()) * 4
    }
}

/// Block ids without data, newest first: S3-FIFO's ghost FIFO and LARC's ghost LRU (an id
/// leaves it on its next access, so it is never moved and FIFO order is LRU order).
struct Ghost {
    index: IntMap<u64, u32>,
    keys: Vec<u64>,
    links: Links,
    list: List,
    free: Vec<u32>,
}

impl Ghost {
    fn new(reserve: usize) -> Self {
        let mut index = IntMap::default();
        index.reserve(reserve);
        Ghost {
            index,
            keys: Vec::with_capacity(reserve),
            links: Links::with_capacity(reserve),
            list: EMPTY,
            free: Vec::new(),
        }
    }

    fn len(&self) -> usize {
        self.list.len
    }

    fn contains(&self, b: u64) -> bool {
        self.index.contains_key(&b)
    }

    /// Removes `b`; true if it was there.
    fn remove(&mut self, b: u64) -> bool {
        let Some(i) = self.index.remove(&b) else {
            return false;
        };
        self.links.unlink(&mut self.list, i);
        self.free.push(i);
        true
    }

    /// Adds `b` (not there) as the newest.
    fn push(&mut self, b: u64) {
        let i = if let Some(i) = self.free.pop() {
            self.keys[i as usize] = b;
            i
        } else {
            self.keys.push(b);
            self.links.add_node();
            (self.keys.len() - 1) as u32
        };
        self.index.insert(b, i);
        self.links.push_front(&mut self.list, i);
    }

    /// Drops the oldest id.
    fn pop_oldest(&mut self) {
        let i = self.list.tail;
        if i != NIL {
            self.links.unlink(&mut self.list, i);
            self.index.remove(&self.keys[i as usize]);
            self.free.push(i);
        }
    }

    fn memory_bytes(&self) -> usize {
        self.index.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.keys.capacity() * 8
            + self.links.bytes()
            + self.free.capacity() * 4
    }
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
            return Access {
                hit: true,
                slot: i,
                evicted: None,
            };
        }
        self.misses += 1;
        let (slot, evicted) = match self.policy {
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
        };
        Access {
            hit: false,
            slot,
            evicted,
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

    /// Misses over accesses (0 before any access).
    pub fn miss_ratio(&self) -> f64 {
        if self.accesses == 0 {
            0.0
        } else {
            self.misses as f64 / self.accesses as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_and_fifo_differ_as_expected() {
        let mut lru = BlockCache::new(ReferencePolicy::Lru, 2);
        let mut fifo = BlockCache::new(ReferencePolicy::Fifo, 2);
        for c in [&mut lru, &mut fifo] {
            for b in [1, 2, 1, 3, 1] {
                c.access(b);
            }
        }
        // LRU keeps 1 (recently used), so the last access hits; FIFO evicted 1 for 3.
        assert_eq!((lru.accesses, lru.misses), (5, 3));
        assert_eq!((fifo.accesses, fifo.misses), (5, 4));
        assert_eq!(
            (lru.inserts, fifo.inserts),
            (3, 4),
            "one insertion per miss"
        );
        let mut c = BlockCache::new(ReferencePolicy::Lru, 10);
        c.request(4095, 2);
        assert_eq!(
            c.accesses, 2,
            "a request straddling a block boundary covers two blocks"
        );
        c.request(8192, 0);
        assert_eq!(c.accesses, 2);
    }

    #[test]
    fn lfu_keeps_the_frequent_and_remove_frees_a_slot() {
        let mut c = BlockCache::new(ReferencePolicy::Lfu, 2);
        for b in [1, 1, 1, 2, 3, 1, 3, 4, 3] {
            c.access(b);
        }
        // 1 (count 4) stays throughout; 2 is evicted by 3, 3 (count 2) by 4, then 3 misses.
        assert_eq!((c.accesses, c.misses, c.inserts), (9, 5, 5));
        assert!(c.contains(1) && c.contains(3) && !c.contains(4));
        let mut l = BlockCache::new(ReferencePolicy::Lru, 2);
        l.access(1);
        l.access(2);
        assert!(l.remove(1).is_some());
        assert!(l.remove(1).is_none());
        let a = l.access_detailed(3);
        assert_eq!(
            (a.hit, a.evicted),
            (false, None),
            "the freed slot is reused"
        );
        let a = l.access_detailed(4);
        assert_eq!(a.evicted, Some(2));
        assert_eq!(l.len(), 2);
    }

    fn in_main(c: &BlockCache, b: u64) -> bool {
        let i = c.index[&b];
        c.s3[i as usize] & IN_MAIN != 0
    }

    /// A scan of blocks seen once passes through the small FIFO and leaves the blocks used
    /// often alone, where LRU loses them all; a block whose id is in the ghost comes back
    /// into the main FIFO, any other missed block into the small one.
    #[test]
    fn s3fifo_resists_a_scan_and_ghost_hits_go_to_main() {
        let mut s3 = BlockCache::new(ReferencePolicy::S3Fifo, 100);
        let mut lru = BlockCache::new(ReferencePolicy::Lru, 100);
        assert_eq!((s3.small_capacity, s3.ghost_capacity), (10, 90));
        for c in [&mut s3, &mut lru] {
            for _ in 0..3 {
                for b in 0..50 {
                    c.access(b);
                }
            }
            for b in 1000..3000 {
                c.access(b);
            }
        }
        // The first ten filled the small FIFO; the next forty went straight to main while
        // nothing had been evicted; the small ten, hit twice, moved to main on eviction.
        assert!((0..50).all(|b| s3.contains(b) && in_main(&s3, b)));
        let (s3_misses, lru_misses) = (s3.misses, lru.misses);
        for c in [&mut s3, &mut lru] {
            for b in 0..50 {
                c.access(b);
            }
        }
        assert_eq!(s3.misses, s3_misses, "S3-FIFO kept every frequent block");
        assert_eq!(lru.misses, lru_misses + 50, "LRU kept none");
        assert_eq!(s3.inserts, s3.misses);
        // The ghost holds the ids of the 90 scan blocks evicted last (the small FIFO holds
        // the 10 after them).
        assert_eq!(s3.ghost.len(), 90);
        assert!(s3.ghost.contains(2900) && !s3.ghost.contains(2899));
        assert!((2990..3000).all(|b| s3.contains(b) && !in_main(&s3, b)));
        let a = s3.access_detailed(2950);
        assert!(!a.hit && a.slot != NO_SLOT);
        assert!(in_main(&s3, 2950), "a ghost hit goes to main");
        assert!(!s3.ghost.contains(2950), "and leaves the ghost");
        s3.access(1000);
        assert!(
            s3.contains(1000) && !in_main(&s3, 1000),
            "not in the ghost: small"
        );
        assert!(s3.main.len + s3.small.len == s3.len() && s3.len() == 100);
    }

    /// In the main FIFO, a block hit since its insertion goes round again instead of
    /// leaving, with one hit less each time round.
    #[test]
    fn s3fifo_main_is_fifo_with_reinsertion() {
        // 20 blocks: small 2, main 18. Before the first eviction, 0 and 1 fill small and
        // 2..=19 go to main.
        let mut c = BlockCache::new(ReferencePolicy::S3Fifo, 20);
        for b in 0..20 {
            c.access(b);
        }
        assert!((2..20).all(|b| in_main(&c, b)) && !in_main(&c, 0));
        // The oldest of main, hit once.
        c.access(2);
        // Each new block evicts from the small FIFO (main is within its share): 0, 1, 20...
        for b in 20..23 {
            c.access(b);
        }
        assert!(!c.contains(0) && !c.contains(1) && !c.contains(20));
        assert!(c.ghost.contains(0) && c.ghost.contains(1) && c.ghost.contains(20));
        // A ghost hit makes main hold 19 > 18: the next eviction is main's, where 2 goes
        // round (its hit spent) and 3 leaves.
        c.access(0);
        assert!(in_main(&c, 0) && c.main.len == 19);
        c.access(100);
        assert!(c.contains(2) && !c.contains(3));
        assert_eq!(c.s3[c.index[&2] as usize] & FREQ, 0);
        assert_eq!(c.main.len, 18);
    }

    /// LARC writes a block into the cache on its second miss only, and counts only those.
    #[test]
    fn larc_admits_on_the_second_miss() {
        let mut c = BlockCache::new(ReferencePolicy::Larc, 10);
        let a = c.access_detailed(7);
        assert_eq!((a.hit, a.slot, a.evicted), (false, NO_SLOT, None));
        assert!(!c.contains(7) && c.ghost.contains(7) && c.inserts == 0);
        let a = c.access_detailed(7);
        assert!(!a.hit && a.slot != NO_SLOT);
        assert!(c.contains(7) && !c.ghost.contains(7) && c.inserts == 1);
        assert!(c.access(7));
        assert_eq!((c.accesses, c.misses, c.inserts), (3, 2, 1));
        // A scan is never written: every block is a first miss.
        for b in 100..1100 {
            assert!(!c.access(b));
        }
        assert_eq!((c.inserts, c.len()), (1, 1));
        // The misses grew the ghost to its bound, 0.9 C = 9 ids.
        assert!((c.ghost_target - 9.0).abs() < 1e-9);
        assert_eq!(c.ghost.len(), 9);
        assert!(c.ghost.contains(1099) && !c.ghost.contains(1090));
        // A hit shrinks it, by C/(C - C_r) = 10 here, but not below 0.1 C; the ids stay (the
        // paper drops one per insertion into a ghost longer than C_r).
        c.access(7);
        assert!((c.ghost_target - 1.0).abs() < 1e-9);
        assert_eq!(c.ghost.len(), 9);
        c.access(5000);
        assert_eq!(c.ghost.len(), 9, "one in, one out");
        // Starting from 0.1 C = 10 in a cache of 100: two misses, then a hit.
        let mut d = BlockCache::new(ReferencePolicy::Larc, 100);
        d.access(1);
        assert!((d.ghost_target - 20.0).abs() < 1e-9, "10 + 100/10");
        d.access(1);
        assert!((d.ghost_target - 25.0).abs() < 1e-9, "20 + 100/20");
        d.access(1);
        assert!(
            (d.ghost_target - (25.0 - 100.0 / 75.0)).abs() < 1e-9,
            "a hit"
        );
        // LRU inside: with the cache full, an admission evicts the least recently used.
        let mut c = BlockCache::new(ReferencePolicy::Larc, 2);
        for b in [1, 1, 2, 2, 1, 3, 3] {
            c.access(b);
        }
        assert!(c.contains(1) && c.contains(3) && !c.contains(2));
        assert_eq!(c.inserts, 3);
    }

    /// Random accesses and removals over every policy keep the structures consistent:
    /// slots unique and within the capacity, lists as long as the index, ghosts bounded,
    /// insertions as documented.
    #[test]
    fn every_policy_stays_consistent() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for policy in ReferencePolicy::ALL {
            for cap in [1usize, 2, 5, 20, 64] {
                let mut c = BlockCache::new(policy, cap);
                let mut misses_not_written = 0;
                for step in 0..5000 {
                    let b = rng.gen_range(0..(cap as u64 * 3));
                    if step % 17 == 0 {
                        c.remove(b);
                        continue;
                    }
                    let a = c.access_detailed(b);
                    if a.hit || a.slot != NO_SLOT {
                        assert!((a.slot as usize) < cap && c.index[&b] == a.slot);
                    } else {
                        assert_eq!(policy, ReferencePolicy::Larc);
                        misses_not_written += 1;
                    }
                    if let Some(old) = a.evicted {
                        assert!(!c.contains(old) && old != b);
                    }
                }
                assert!(c.len() <= cap);
                let mut slots: Vec<u32> = c.cached().map(|x| x.1).collect();
                slots.sort_unstable();
                slots.dedup();
                assert_eq!(slots.len(), c.len(), "{policy:?} {cap}");
                let listed = match policy {
                    ReferencePolicy::Lfu => c.lfu.len(),
                    _ => c.main.len + c.small.len,
                };
                assert_eq!(listed, c.len(), "{policy:?} {cap}");
                assert!(c.ghost.len() <= c.ghost_capacity, "{policy:?} {cap}");
                assert_eq!(c.inserts + misses_not_written, c.misses, "{policy:?} {cap}");
                if policy == ReferencePolicy::S3Fifo {
                    assert!(c.cached().all(|(b, _)| !c.ghost.contains(b)));
                }
            }
        }
    }
}
