//! The cleaner's read-ahead of the log: a batch's versions, read in spans of neighbouring
//! positions (one device read of up to 1 MiB each) instead of one 4 KiB read per page. The
//! oldest versions a batch takes sit together at the ring's tail, so a batch of 1,024 pages
//! is a few reads, not 1,024 (each a sleep and a wake-up, on two cores that the clients'
//! writes need). A version's blocks stay as they are until the tail passes them, and only
//! the cleaner moves the tail, so what a span read holds for a version stays true for the
//! batch; a version that is not in a span (a newer one came meanwhile, or its span's read
//! failed) is read on its own, and every page is checked against its checksum either way.

use super::LogBack;
use sce_core::PAGE_SIZE;
use sce_io::AlignedBuf;

/// Unused positions a span may read through to join two versions (cheaper than a read).
const SPAN_GAP: u64 = 4;
/// Positions of one span read, at most (1 MiB).
const SPAN_MAX: u64 = 256;

/// Spans of the log read ahead: (first position, its blocks), by position.
pub(super) struct Prefetched {
    spans: Vec<(u64, AlignedBuf)>,
}

impl Prefetched {
    /// Reads the spans covering `positions` (versions' log positions). A span whose read
    /// fails is left out: its versions are read one by one, and report their own error.
    pub(super) fn read(lb: &LogBack, mut positions: Vec<u64>) -> Self {
        positions.sort_unstable();
        positions.dedup();
        let mut spans = Vec::new();
        for (first, n) in cut(&positions, |p| lb.region.segment_end(p)) {
            let mut buf = AlignedBuf::new((n * PAGE_SIZE) as usize);
            if lb.dev.read_at(lb.at(first), &mut buf).is_ok() {
                spans.push((first, buf));
            }
        }
        Prefetched { spans }
    }

    /// The 4 KiB at log position `lpos`, if a span holds it.
    pub(super) fn block(&self, lpos: u64) -> Option<&[u8]> {
        let i = self.spans.partition_point(|(first, _)| *first <= lpos);
        let (first, buf) = self.spans.get(i.checked_sub(1)?)?;
        let at = ((lpos - first) * PAGE_SIZE) as usize;
        buf.get(at..at + PAGE_SIZE as usize)
    }
}

/// Sorted, distinct positions cut into spans (first, blocks): neighbours at most
/// `SPAN_GAP` unused positions apart join, a span holds at most `SPAN_MAX` positions, and
/// none crosses the end of a contiguous stretch of the device (`segment_end`: the ring's
/// end, or a chunk of read slots the log lent).
fn cut(positions: &[u64], segment_end: impl Fn(u64) -> u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &p in positions {
        if let Some((first, n)) = out.last_mut() {
            let end = *first + *n;
            let same_segment = segment_end(*first) == segment_end(p);
            if same_segment && p < end + SPAN_GAP + 1 && p + 1 - *first <= SPAN_MAX {
                *n = p + 1 - *first;
                continue;
            }
        }
        out.push((p, 1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn spans_join_near_neighbours_and_stop_at_the_ring_end_and_their_size() {
        // 10, 11 and 14 join (two unused between); 30 is too far; 98, 99 | 100 cross the
        // end of a 100-block ring.
        assert_eq!(
            cut(&[10, 11, 14, 30, 98, 99, 100, 101], ring(100)),
            vec![(10, 5), (30, 1), (98, 2), (100, 2)]
        );
        // Five unused positions are one too many.
        assert_eq!(cut(&[0, 6], ring(1000)), vec![(0, 1), (6, 1)]);
        assert_eq!(cut(&[0, 5], ring(1000)), vec![(0, 6)]);
        // A long run is cut at SPAN_MAX positions.
        let run: Vec<u64> = (0..600).collect();
        assert_eq!(
            cut(&run, ring(10_000)),
            vec![(0, 256), (256, 256), (512, 88)]
        );
        assert!(cut(&[], ring(10)).is_empty());
        // Chunks of 8 blocks lent (contiguous only within each).
        assert_eq!(
            cut(&[6, 7, 8, 9], |p| (p / 8 + 1) * 8),
            vec![(6, 2), (8, 2)]
        );
    }

    fn ring(blocks: u64) -> impl Fn(u64) -> u64 {
        move |p| (p / blocks + 1) * blocks
    }
}
