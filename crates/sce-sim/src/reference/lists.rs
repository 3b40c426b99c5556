//! The intrusive lists over preallocated nodes and the ghost queue of the policies.

use sce_core::hotness::IntMap;

pub(super) const NIL: u32 = u32::MAX;

/// The slot of a block the policy did not cache (LARC's first miss).
pub const NO_SLOT: u32 = NIL;

/// Ends and length of a list threaded through [`Links`].
#[derive(Copy, Clone, Debug)]
pub(super) struct List {
    pub(super) head: u32,
    pub(super) tail: u32,
    pub(super) len: usize,
}

pub(super) const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// Previous and next node of every node; the lists over them keep their own ends.
pub(super) struct Links {
    pub(super) prev: Vec<u32>,
    pub(super) next: Vec<u32>,
}

impl Links {
    pub(super) fn with_capacity(n: usize) -> Self {
        Links {
            prev: Vec::with_capacity(n),
            next: Vec::with_capacity(n),
        }
    }

    pub(super) fn add_node(&mut self) {
        self.prev.push(NIL);
        self.next.push(NIL);
    }

    pub(super) fn unlink(&mut self, l: &mut List, i: u32) {
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

    pub(super) fn push_front(&mut self, l: &mut List, i: u32) {
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

    pub(super) fn bytes(&self) -> usize {
        (self.prev.capacity() + self.next.capacity()) * 4
    }
}

/// Block ids without data, newest first: S3-FIFO's ghost FIFO and LARC's ghost LRU (an id
/// leaves it on its next access, so it is never moved and FIFO order is LRU order).
pub(super) struct Ghost {
    pub(super) index: IntMap<u64, u32>,
    pub(super) keys: Vec<u64>,
    pub(super) links: Links,
    pub(super) list: List,
    pub(super) free: Vec<u32>,
}

impl Ghost {
    pub(super) fn new(reserve: usize) -> Self {
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

    pub(super) fn len(&self) -> usize {
        self.list.len
    }

    pub(super) fn contains(&self, b: u64) -> bool {
        self.index.contains_key(&b)
    }

    /// Removes `b`; true if it was there.
    pub(super) fn remove(&mut self, b: u64) -> bool {
        let Some(i) = self.index.remove(&b) else {
            return false;
        };
        self.links.unlink(&mut self.list, i);
        self.free.push(i);
        true
    }

    /// Adds `b` (not there) as the newest.
    pub(super) fn push(&mut self, b: u64) {
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
    pub(super) fn pop_oldest(&mut self) {
        let i = self.list.tail;
        if i != NIL {
            self.links.unlink(&mut self.list, i);
            self.index.remove(&self.keys[i as usize]);
            self.free.push(i);
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        self.index.capacity() * (std::mem::size_of::<(u64, u32)>() + 1)
            + self.keys.capacity() * 8
            + self.links.bytes()
            + self.free.capacity() * 4
    }
}
