//! The classic reference policies over 4 KiB blocks, as other simulators (libCacheSim)
//! count them: every block a request covers is one access, a lookup that inserts the block on
//! a miss, reads and writes alike. Block `b` covers bytes `b*4096 .. (b+1)*4096`; a request
//! covers blocks `offset/4096 ..= (offset+len-1)/4096`.

use sce_core::hotness::IntMap;

/// LRU or FIFO.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ReferencePolicy {
    /// Least recently used.
    Lru,
    /// First in, first out.
    Fifo,
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
    /// Block accesses.
    pub accesses: u64,
    /// Misses.
    pub misses: u64,
}

impl BlockCache {
    /// A cache of `capacity_blocks` 4 KiB blocks (at least 1).
    pub fn new(policy: ReferencePolicy, capacity_blocks: usize) -> Self {
        let capacity = capacity_blocks.max(1);
        let mut index = IntMap::default();
        index.reserve(capacity);
        BlockCache {
            policy,
            index,
            keys: Vec::with_capacity(capacity),
            prev: Vec::with_capacity(capacity),
            next: Vec::with_capacity(capacity),
            head: NIL,
            tail: NIL,
            capacity,
            accesses: 0,
            misses: 0,
        }
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
        self.accesses += 1;
        if let Some(&i) = self.index.get(&b) {
            if self.policy == ReferencePolicy::Lru && self.head != i {
                self.unlink(i);
                self.push_front(i);
            }
            return true;
        }
        self.misses += 1;
        let i = if self.keys.len() < self.capacity {
            self.keys.push(b);
            self.prev.push(NIL);
            self.next.push(NIL);
            (self.keys.len() - 1) as u32
        } else {
            let v = self.tail;
            self.unlink(v);
            self.index.remove(&self.keys[v as usize]);
            self.keys[v as usize] = b;
            v
        };
        self.index.insert(b, i);
        self.push_front(i);
        false
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
}
