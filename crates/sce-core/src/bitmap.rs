//! Page bitmaps: bit `i` stands for page `i` of a fragment. Functions work on word slices so
//! that the slot table can keep every slot's bitmap in one flat arena.

/// Tests bit `i`.
#[inline]
pub fn test(words: &[u64], i: u32) -> bool {
    words[(i / 64) as usize] & (1u64 << (i % 64)) != 0
}

/// Applies `f(word_index, mask)` to the words covering bits `lo..hi`.
#[inline]
fn for_range(lo: u32, hi: u32, mut f: impl FnMut(usize, u64)) {
    let mut i = lo;
    while i < hi {
        let w = i / 64;
        let b = i % 64;
        let n = (64 - b).min(hi - i);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << b
        };
        f(w as usize, mask);
        i += n;
    }
}

/// Sets bits `lo..hi`.
pub fn set_range(words: &mut [u64], lo: u32, hi: u32) {
    for_range(lo, hi, |w, m| words[w] |= m);
}

/// Clears bits `lo..hi`.
pub fn clear_range(words: &mut [u64], lo: u32, hi: u32) {
    for_range(lo, hi, |w, m| words[w] &= !m);
}

/// True if every bit in `lo..hi` is set.
pub fn all_set(words: &[u64], lo: u32, hi: u32) -> bool {
    let mut ok = true;
    for_range(lo, hi, |w, m| ok &= words[w] & m == m);
    ok
}

/// True if any bit in `lo..hi` is set.
pub fn any_set(words: &[u64], lo: u32, hi: u32) -> bool {
    let mut any = false;
    for_range(lo, hi, |w, m| any |= words[w] & m != 0);
    any
}

/// Number of set bits in `lo..hi`.
pub fn count(words: &[u64], lo: u32, hi: u32) -> u32 {
    let mut c = 0;
    for_range(lo, hi, |w, m| c += (words[w] & m).count_ones());
    c
}

/// End of the run starting at `i` whose bits all equal `test(words, i)`, capped at `hi`.
pub fn run_end(words: &[u64], i: u32, hi: u32) -> u32 {
    let v = test(words, i);
    let mut j = i + 1;
    while j < hi {
        let w = words[(j / 64) as usize];
        let b = j % 64;
        // Bits from b upwards, inverted if looking for the end of a run of ones.
        let x = if v { !w } else { w } >> b;
        if x == 0 {
            j = (j - b) + 64;
        } else {
            j += x.trailing_zeros();
            return j.min(hi);
        }
    }
    hi
}

/// An owned page bitmap for side tables (population fill sets, spoiled pages).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PageSet {
    words: Box<[u64]>,
}

impl PageSet {
    /// An empty set able to hold `pages` bits.
    pub fn new(pages: u32) -> Self {
        PageSet {
            words: vec![0; (pages as usize).div_ceil(64)].into_boxed_slice(),
        }
    }
    /// The words.
    pub fn words(&self) -> &[u64] {
        &self.words
    }
    /// The words, mutably.
    pub fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }
    /// Tests bit `i` (false beyond the capacity).
    pub fn contains(&self, i: u32) -> bool {
        (i as usize) < self.words.len() * 64 && test(&self.words, i)
    }
    /// Sets bits `lo..hi`.
    pub fn insert_range(&mut self, lo: u32, hi: u32) {
        set_range(&mut self.words, lo, hi)
    }
    /// Clears bits `lo..hi`.
    pub fn remove_range(&mut self, lo: u32, hi: u32) {
        clear_range(&mut self.words, lo, hi)
    }
    /// True if no bit is set.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|w| *w == 0)
    }
    /// Number of set bits.
    pub fn len(&self) -> u32 {
        self.words.iter().map(|w| w.count_ones()).sum()
    }
    /// The set bits, in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                (w != 0).then(|| {
                    let b = w.trailing_zeros();
                    w &= w - 1;
                    i as u32 * 64 + b
                })
            })
        })
    }
    /// Iterates over maximal runs `[lo, hi)` of set bits below `limit`.
    pub fn runs(&self, limit: u32) -> impl Iterator<Item = (u32, u32)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            while i < limit {
                let end = run_end(&self.words, i, limit);
                let set = test(&self.words, i);
                let lo = i;
                i = end;
                if set {
                    return Some((lo, end));
                }
            }
            None
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_runs() {
        let mut s = PageSet::new(300);
        s.insert_range(3, 70);
        s.insert_range(128, 129);
        s.insert_range(200, 300);
        assert_eq!(s.len(), 67 + 1 + 100);
        assert_eq!(
            s.runs(300).collect::<Vec<_>>(),
            vec![(3, 70), (128, 129), (200, 300)]
        );
        assert!(all_set(s.words(), 3, 70));
        assert!(!all_set(s.words(), 2, 70));
        assert!(any_set(s.words(), 0, 4));
        assert!(!any_set(s.words(), 70, 128));
        assert_eq!(count(s.words(), 0, 300), 168);
        s.remove_range(10, 250);
        assert_eq!(s.runs(300).collect::<Vec<_>>(), vec![(3, 10), (250, 300)]);
        assert_eq!(run_end(s.words(), 10, 300), 250);
        assert_eq!(run_end(s.words(), 0, 300), 3);
    }
}
