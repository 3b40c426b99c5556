//! The classic reference policies over 4 KiB blocks, as other simulators (libCacheSim)
//! count them: every block a request covers is one access, a lookup that inserts the block on
//! a miss, reads and writes alike. Block `b` covers bytes `b*4096 .. (b+1)*4096`; a request
//! covers blocks `offset/4096 ..= (offset+len-1)/4096`.
//!
//! LRU and FIFO keep an intrusive doubly-linked list over preallocated nodes (O(1) per
//! access); LFU keeps an ordered set of (count, last access, slot) and evicts the least
//! frequently used block, the least recently used among equals (O(log n) per access).
//! Counts are kept for cached blocks only (in-cache LFU, as libCacheSim's `LFU`).

use sce_core::hotness::IntMap;
use std::collections::BTreeSet;

/// LRU, FIFO or LFU.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReferencePolicy {
    /// Least recently used.
    Lru,
    /// First in, first out.
    Fifo,
    /// Least frequently used (ties: least recently used).
    Lfu,
}

/// What one access did.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// The block was cached.
    pub hit: bool,
    /// The slot that holds the block now.
    pub slot: u32,
    /// The block evicted to make room, and the slot it had (the new block's slot).
    pub evicted: Option<u64>,
}

const NIL: u32 = u32::MAX;

/// A fixed-capacity block cache with an intrusive list over preallocated nodes.
pub struct BlockCache {
    policy: ReferencePolicy,
    index: IntMap<u64, u32>,
    keys: Vec<u64>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    capacity: usize,
    free: Vec<u32>,
    lfu: BTreeSet<(u32, u64, u32)>,
    counts: Vec<(u32, u64)>,
    tick: u64,
    /// Block accesses.
    pub accesses: u64,
    /// Misses.
    pub misses: u64,
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
        BlockCache {
            policy,
            index,
            keys: Vec::with_capacity(reserve),
            prev: Vec::with_capacity(reserve),
            next: Vec::with_capacity(reserve),
            head: NIL,
            tail: NIL,
            capacity,
            free: Vec::new(),
            lfu: BTreeSet::new(),
            counts: Vec::new(),
            tick: 0,
            accesses: 0,
            misses: 0,
        }
    }

    /// Bytes of memory the cache's structures take now (capacity of the index, the node
    /// arrays and the LFU order; the allocator's own overhead excluded).
    pub fn memory_bytes(&self) -> u64 {
        let index = self.index.capacity() * (std::mem::size_of::<(u64, u32)>() + 1);
        let nodes = self.keys.capacity() * 8 + (self.prev.capacity() + self.next.capacity()) * 4;
        let lfu = self.counts.capacity() * std::mem::size_of::<(u32, u64)>()
            + self.lfu.len() * (std::mem::size_of::<(u32, u64, u32)>() + 8);
        (index + nodes + lfu + self.free.capacity() * 4) as u64
    }

    fn unlink(&mut self, i: u32) {
        let (p, n) = (self.prev[i as usize], self.next[i as usize]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
    }

    fn push_front(&mut self, i: u32) {
        self.prev[i as usize] = NIL;
        self.next[i as usize] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = i;
        } else {
            self.tail = i;
        }
        self.head = i;
    }

    /// One access to block `b`; true on a hit.
    #[inline]
    pub fn access(&mut self, b: u64) -> bool {
        if self.policy == ReferencePolicy::Lfu {
            return self.access_detailed(b).hit;
        }
        // The LRU/FIFO fast path: the benchmark's inner loop.
        self.accesses += 1;
        if let Some(&i) = self.index.get(&b) {
            if self.policy == ReferencePolicy::Lru && self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return true;
        }
        self.misses += 1;
        self.insert_missed(b);
        false
    }

    fn insert_missed(&mut self, b: u64) -> (u32, Option<u64>) {
        let (i, evicted) = if let Some(i) = self.free.pop() {
            self.keys[i as usize] = b;
            (i, None)
        } else if self.keys.len() < self.capacity {
            self.keys.push(b);
            self.prev.push(NIL);
            self.next.push(NIL);
            if self.policy == ReferencePolicy::Lfu {
                self.counts.push((0, 0));
            }
            ((self.keys.len() - 1) as u32, None)
        } else {
            let v = if self.policy == ReferencePolicy::Lfu {
                let first = self.lfu.pop_first().expect("a full cache has entries");
                first.2
            } else {
                let v = self.tail;
                self.unlink(v);
                v
            };
            let old = self.keys[v as usize];
            self.index.remove(&old);
            self.keys[v as usize] = b;
            (v, Some(old))
        };
        self.index.insert(b, i);
        if self.policy == ReferencePolicy::Lfu {
            self.tick += 1;
            self.counts[i as usize] = (1, self.tick);
            self.lfu.insert((1, self.tick, i));
        } else {
            self.push_front(i);
        }
        (i, evicted)
    }

    /// One access to block `b`, saying which slot holds it and what it evicted.
    pub fn access_detailed(&mut self, b: u64) -> Access {
        self.accesses += 1;
        if let Some(&i) = self.index.get(&b) {
            match self.policy {
                ReferencePolicy::Lru if self.head != i => {
                    self.unlink(i);
                    self.push_front(i);
                }
                ReferencePolicy::Lfu => {
                    let (c, t) = self.counts[i as usize];
                    self.lfu.remove(&(c, t, i));
                    self.tick += 1;
                    let e = (c.saturating_add(1), self.tick);
                    self.counts[i as usize] = e;
                    self.lfu.insert((e.0, e.1, i));
                }
                _ => {}
            }
            return Access {
                hit: true,
                slot: i,
                evicted: None,
            };
        }
        self.misses += 1;
        let (slot, evicted) = self.insert_missed(b);
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

    /// Drops block `b` (another host wrote it). Returns the slot it had.
    pub fn remove(&mut self, b: u64) -> Option<u32> {
        let i = self.index.remove(&b)?;
        if self.policy == ReferencePolicy::Lfu {
            let (c, t) = self.counts[i as usize];
            self.lfu.remove(&(c, t, i));
        } else {
            self.unlink(i);
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
        assert_eq!((c.accesses, c.misses), (9, 5));
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
}
