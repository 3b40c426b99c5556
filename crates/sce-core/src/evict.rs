//! Eviction policies over cache slots: generalized CLOCK (the SCE default), LRU and FIFO.
//!
//! Contract: the core calls `inserted` when a slot starts holding a fragment, `accessed` on
//! every access to a cached fragment, and `removed` when the slot stops holding it. `victim`
//! MUST return a slot for which `skip` is false, or `None` if there is none; it never blocks
//! and never changes which fragment a slot holds (the core does that).

use crate::addr::SlotNo;

/// Which eviction policy to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EvictionKind {
    /// Generalized CLOCK with a reference counter (ceiling 4 in SCE).
    #[default]
    Clock,
    /// Least recently used.
    Lru,
    /// First in, first out.
    Fifo,
}

impl std::str::FromStr for EvictionKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "clock" => Ok(EvictionKind::Clock),
            "lru" => Ok(EvictionKind::Lru),
            "fifo" => Ok(EvictionKind::Fifo),
            _ => Err(format!(
                "unknown eviction policy {s:?} (expected clock, lru or fifo)"
            )),
        }
    }
}

impl std::fmt::Display for EvictionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EvictionKind::Clock => "clock",
            EvictionKind::Lru => "lru",
            EvictionKind::Fifo => "fifo",
        })
    }
}

/// An eviction policy instance.
#[derive(Debug)]
pub enum Eviction {
    /// Generalized CLOCK.
    Clock(Clock),
    /// LRU or FIFO on an intrusive list.
    List(SlotList),
}

impl Eviction {
    /// A policy for `slots` slots.
    pub fn new(kind: EvictionKind, slots: u32, clock_ceiling: u8) -> Self {
        match kind {
            EvictionKind::Clock => Eviction::Clock(Clock::new(slots, clock_ceiling)),
            EvictionKind::Lru => Eviction::List(SlotList::new(slots, true)),
            EvictionKind::Fifo => Eviction::List(SlotList::new(slots, false)),
        }
    }
    /// A slot now holds a fragment.
    pub fn inserted(&mut self, s: SlotNo) {
        match self {
            Eviction::Clock(c) => c.counters[s.0 as usize] = 1,
            Eviction::List(l) => l.push_front(s.0),
        }
    }
    /// The fragment in slot `s` was accessed.
    #[inline]
    pub fn accessed(&mut self, s: SlotNo) {
        match self {
            Eviction::Clock(c) => {
                let x = &mut c.counters[s.0 as usize];
                if *x < c.ceiling {
                    *x += 1;
                }
            }
            Eviction::List(l) => {
                if l.move_on_access {
                    l.unlink(s.0);
                    l.push_front(s.0);
                }
            }
        }
    }
    /// Slot `s` no longer holds a fragment.
    pub fn removed(&mut self, s: SlotNo) {
        match self {
            Eviction::Clock(c) => c.counters[s.0 as usize] = 0,
            Eviction::List(l) => l.unlink(s.0),
        }
    }
    /// Chooses a victim among slots for which `skip` is false.
    pub fn victim(&mut self, skip: impl Fn(SlotNo) -> bool) -> Option<SlotNo> {
        match self {
            Eviction::Clock(c) => c.victim(skip),
            Eviction::List(l) => l.victim(skip),
        }
    }
}

/// Generalized CLOCK: a counter per slot, incremented on access up to a ceiling, decremented
/// by the sweeping hand; a slot whose counter is 0 when the hand reaches it is the victim.
#[derive(Debug)]
pub struct Clock {
    counters: Box<[u8]>,
    hand: u32,
    ceiling: u8,
}

impl Clock {
    fn new(slots: u32, ceiling: u8) -> Self {
        Clock {
            counters: vec![0; slots as usize].into_boxed_slice(),
            hand: 0,
            ceiling,
        }
    }

    fn victim(&mut self, skip: impl Fn(SlotNo) -> bool) -> Option<SlotNo> {
        let n = self.counters.len() as u64;
        // Each slot can be passed at most `ceiling + 1` times before reaching 0.
        let limit = n * (self.ceiling as u64 + 2);
        for _ in 0..limit {
            let s = self.hand;
            self.hand = if s + 1 == n as u32 { 0 } else { s + 1 };
            if skip(SlotNo(s)) {
                continue;
            }
            let c = &mut self.counters[s as usize];
            if *c == 0 {
                return Some(SlotNo(s));
            }
            *c -= 1;
        }
        None
    }
}

const NIL: u32 = u32::MAX;

/// An intrusive doubly linked list of slots, most recent at the front. With `move_on_access`
/// it is LRU, without it FIFO.
#[derive(Debug)]
pub struct SlotList {
    prev: Box<[u32]>,
    next: Box<[u32]>,
    head: u32,
    tail: u32,
    move_on_access: bool,
}

impl SlotList {
    fn new(slots: u32, move_on_access: bool) -> Self {
        SlotList {
            prev: vec![NIL; slots as usize].into_boxed_slice(),
            next: vec![NIL; slots as usize].into_boxed_slice(),
            head: NIL,
            tail: NIL,
            move_on_access,
        }
    }

    fn push_front(&mut self, s: u32) {
        self.prev[s as usize] = NIL;
        self.next[s as usize] = self.head;
        if self.head != NIL {
            self.prev[self.head as usize] = s;
        } else {
            self.tail = s;
        }
        self.head = s;
    }

    fn unlink(&mut self, s: u32) {
        let (p, n) = (self.prev[s as usize], self.next[s as usize]);
        if p == NIL && n == NIL && self.head != s {
            return; // not linked
        }
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
        self.prev[s as usize] = NIL;
        self.next[s as usize] = NIL;
    }

    fn victim(&self, skip: impl Fn(SlotNo) -> bool) -> Option<SlotNo> {
        let mut s = self.tail;
        while s != NIL {
            if !skip(SlotNo(s)) {
                return Some(SlotNo(s));
            }
            s = self.prev[s as usize];
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_prefers_unreferenced_and_respects_ceiling() {
        let mut e = Eviction::new(EvictionKind::Clock, 3, 4);
        for s in 0..3 {
            e.inserted(SlotNo(s));
        }
        for _ in 0..10 {
            e.accessed(SlotNo(0));
        }
        e.accessed(SlotNo(1));
        // Counters: 4, 2, 1. Slot 2 reaches 0 first.
        assert_eq!(e.victim(|_| false), Some(SlotNo(2)));
        assert_eq!(e.victim(|s| s == SlotNo(2)), Some(SlotNo(1)));
        assert_eq!(e.victim(|_| true), None);
    }

    #[test]
    fn lru_and_fifo_order() {
        let mut lru = Eviction::new(EvictionKind::Lru, 3, 4);
        let mut fifo = Eviction::new(EvictionKind::Fifo, 3, 4);
        for e in [&mut lru, &mut fifo] {
            for s in 0..3 {
                e.inserted(SlotNo(s));
            }
            e.accessed(SlotNo(0));
        }
        assert_eq!(lru.victim(|_| false), Some(SlotNo(1)));
        assert_eq!(fifo.victim(|_| false), Some(SlotNo(0)));
        lru.removed(SlotNo(1));
        assert_eq!(lru.victim(|_| false), Some(SlotNo(2)));
        assert_eq!(lru.victim(|s| s == SlotNo(2)), Some(SlotNo(0)));
    }
}
