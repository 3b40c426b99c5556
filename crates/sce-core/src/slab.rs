//! A small generational slab for in-flight operations (writes, populations). Ids carry a
//! generation so that a stale or forged id is rejected instead of touching another operation.

/// Storage for values addressed by generational ids.
#[derive(Debug)]
pub struct Slab<T> {
    entries: Vec<(u32, Option<T>)>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab {
            entries: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Stores a value and returns its id.
    pub fn insert(&mut self, v: T) -> u64 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            let e = &mut self.entries[i as usize];
            e.0 = e.0.wrapping_add(1);
            e.1 = Some(v);
            return ((e.0 as u64) << 32) | i as u64;
        }
        self.entries.push((0, Some(v)));
        (self.entries.len() - 1) as u64
    }

    fn slot(&self, id: u64) -> Option<usize> {
        let i = (id & u32::MAX as u64) as usize;
        let g = (id >> 32) as u32;
        (i < self.entries.len() && self.entries[i].0 == g).then_some(i)
    }

    /// The value for `id`, if it is live.
    pub fn get(&self, id: u64) -> Option<&T> {
        self.slot(id).and_then(|i| self.entries[i].1.as_ref())
    }

    /// The value for `id`, mutably.
    pub fn get_mut(&mut self, id: u64) -> Option<&mut T> {
        self.slot(id).and_then(|i| self.entries[i].1.as_mut())
    }

    /// Removes and returns the value for `id`.
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let i = self.slot(id)?;
        let v = self.entries[i].1.take()?;
        self.free.push(i as u32);
        self.len -= 1;
        Some(v)
    }

    /// Every live value, mutably.
    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries.iter_mut().filter_map(|e| e.1.as_mut())
    }

    /// Number of live values.
    pub fn len(&self) -> usize {
        self.len
    }
}
