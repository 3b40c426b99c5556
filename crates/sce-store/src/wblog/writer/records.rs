//! Where a commit's second copies go (the mirror area) and its records' bytes.

use super::super::record::{encode_record, record_link, RecordHeader};
use super::super::{COPIES_APART, ENTRIES_PER_RECORD, LOG_BLOCK};
use super::{LogWriter, PreparedCommit};
use crate::wblog::LogEntry;
use sce_io::AlignedBuf;

impl LogWriter {
    /// The first of `records` consecutive mirror slots for the second copies of a commit
    /// whose first copies go to ring position `lpos`, if there are such slots whose records
    /// replay no longer needs (older than the durable anchor) lying far enough from the ring
    /// copies ([`COPIES_APART`], or half the mirror area if it is smaller).
    pub(super) fn mirror_slots(&self, records: u64, lpos: u64) -> Option<u64> {
        let m = self.region.mirror_blocks;
        if m < records {
            return None;
        }
        let needed = self.anchor.seq();
        let len = records * LOG_BLOCK;
        let ring = self.region.offset_of(lpos);
        let want = COPIES_APART.min(m * LOG_BLOCK / 2);
        let ok = |s: u64| {
            let mirror = self.region.mirror_at(s);
            let gap = if ring + len <= mirror {
                mirror - (ring + len)
            } else {
                ring.saturating_sub(mirror + len)
            };
            gap >= want && (s..s + records).all(|i| self.mirror_seq[i as usize] < needed)
        };
        let next = if self.mirror_next + records > m {
            0
        } else {
            self.mirror_next
        };
        // The next slots in turn (they hold the oldest records); else the far end.
        [next, m - records].into_iter().find(|&s| ok(s))
    }

    pub(super) fn encode(
        &self,
        lpos: u64,
        seq: u64,
        tail: u64,
        entries: &[LogEntry],
        slot: Option<u64>,
    ) -> PreparedCommit {
        let records = entries.len().div_ceil(ENTRIES_PER_RECORD).max(1);
        let block = LOG_BLOCK as usize;
        let per = if slot.is_some() { 1 } else { 2 };
        let mut bytes = AlignedBuf::new(per * records * block);
        let mut link = self.link.unwrap_or(0);
        for i in 0..records {
            let h = RecordHeader {
                seq: seq + i as u64,
                lpos: lpos + (per * i) as u64,
                tail,
                link,
                epoch: self.epoch,
                resumed_from: self.resumed_from,
                group_index: i as u16,
                group_len: records as u16,
                copy2: slot.map_or(0, |s| (s + i as u64 + 1) as u32),
            };
            let part = &entries[(i * ENTRIES_PER_RECORD).min(entries.len())
                ..((i + 1) * ENTRIES_PER_RECORD).min(entries.len())];
            let mine = &mut bytes[per * i * block..(per * i + per) * block];
            let (first, second) = mine.split_at_mut(block);
            encode_record(&self.key, &h, part, first);
            if per == 2 {
                second.copy_from_slice(first);
            }
            link = record_link(first);
        }
        PreparedCommit {
            lpos,
            seqs: seq..seq + records as u64,
            bytes,
            mirror_at: slot.map(|s| self.region.mirror_at(s)),
            entries: entries.len(),
        }
    }
}
