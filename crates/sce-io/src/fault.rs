//! `FaultDevice`: wraps a device and injects faults chosen at run time through a shared
//! `FaultControl`: errors on chosen operations, from the N-th on, on the N-th only, or on
//! ranges; silent corruption of reads or writes; lost, torn and misdirected writes. Every
//! fault is deterministic. Meant for tests, but an ordinary device in code: no test branches
//! in the paths it wraps.
//!
//! Rules:
//! - An operation filter is a slice of `Op` kinds (`&[Op::Read, Op::Write]`).
//! - Requests are checked first: a bad request gets `OutOfRange`/`Unaligned`, never an
//!   injected fault, and is not counted.
//! - A range rule applies to an operation whose byte range `[offset, offset + len)` overlaps
//!   the rule's range. A zero-length operation touches nothing, and a flush has no range, so
//!   neither ever matches a range rule.
//! - Error rules win over data rules. Among the data rules that match a write (corrupt, drop,
//!   tear, misdirect), the one added first applies.

use crate::error::{check_range, IoError, Op};
use crate::order::{levels, OrderedMutex};
use crate::BlockDevice;
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// The bit flipped by silent corruption.
const CORRUPT_BIT: u8 = 0x10;

#[derive(Debug, Clone)]
enum Rule {
    FailFrom { ops: Vec<Op>, n: u64 },
    FailNth { op: Op, n: u64 },
    FailRange { ops: Vec<Op>, range: Range<u64> },
    CorruptReads(Range<u64>),
    CorruptWrites(Range<u64>),
    DropWrites(Range<u64>),
    TearWrites(Range<u64>),
    MisdirectWrites { range: Range<u64>, delta: i64 },
}

/// What the rules say about one operation.
enum Verdict {
    /// No rule applies.
    Pass,
    /// Fail with `IoError::Injected`.
    Fail,
    /// Apply this data rule (the one added first among those that match).
    Data(Rule),
}

/// The run-time controls of a `FaultDevice`, shared with the test through an `Arc` so faults
/// can be changed while I/O runs.
#[derive(Debug, Default)]
pub struct FaultControl {
    rules: Mutex<Vec<Rule>>,
    counts: [AtomicU64; 4],
    fired: AtomicU64,
}

fn idx(op: Op) -> usize {
    match op {
        Op::Read => 0,
        Op::Write => 1,
        Op::Flush => 2,
        Op::Discard => 3,
    }
}

/// True if `[offset, offset + len)` and `r` share a byte.
fn overlaps(r: &Range<u64>, offset: u64, len: u64) -> bool {
    len > 0 && offset < r.end && r.start < offset.saturating_add(len)
}

/// The index, in a buffer holding `[offset, offset + len)`, of the byte to corrupt: the middle
/// of the part that overlaps `r` (the caller checked that they overlap).
fn corrupt_index(r: &Range<u64>, offset: u64, len: u64) -> usize {
    let start = r.start.max(offset);
    let end = r.end.min(offset + len);
    (start + (end - start) / 2 - offset) as usize
}

impl FaultControl {
    /// Every operation of the kinds in `ops` from the `n`-th onward fails with
    /// `IoError::Injected`. `n` counts operations of that kind since the device was made
    /// (0-based, as `ops` reports them), so `n = 0` fails all of them and
    /// `fail_from(ops, c.ops(op))` fails from the next one.
    pub fn fail_from(&self, ops: &[Op], n: u64) {
        self.push(Rule::FailFrom {
            ops: ops.to_vec(),
            n,
        });
    }

    /// Exactly the `n`-th operation of kind `op` (0-based, counted since the device was made)
    /// fails with `IoError::Injected`.
    pub fn fail_nth(&self, op: Op, n: u64) {
        self.push(Rule::FailNth { op, n });
    }

    /// Operations of the kinds in `ops` overlapping `range` fail with `IoError::Injected`.
    pub fn fail_range(&self, ops: &[Op], range: Range<u64>) {
        self.push(Rule::FailRange {
            ops: ops.to_vec(),
            range,
        });
    }

    /// Reads overlapping `range` succeed but return data with one bit flipped, in the middle
    /// of the part of the buffer that overlaps `range`. The stored data is intact.
    pub fn corrupt_reads(&self, range: Range<u64>) {
        self.push(Rule::CorruptReads(range));
    }

    /// Writes overlapping `range` succeed but store data with one bit flipped, in the middle
    /// of the part of the write that overlaps `range`.
    pub fn corrupt_writes(&self, range: Range<u64>) {
        self.push(Rule::CorruptWrites(range));
    }

    /// Lost writes: writes overlapping `range` report success and store nothing.
    pub fn drop_writes(&self, range: Range<u64>) {
        self.push(Rule::DropWrites(range));
    }

    /// Torn writes: writes overlapping `range` store only their first half, rounded down to
    /// the logical block size, and report success. A one-block write stores nothing (a
    /// block is written whole or not at all).
    pub fn tear_writes(&self, range: Range<u64>) {
        self.push(Rule::TearWrites(range));
    }

    /// Misdirected writes: writes overlapping `range` report success but land at
    /// `offset + delta` instead. If that target is out of range or not aligned to the
    /// logical block size, the write is lost.
    pub fn misdirect_writes(&self, range: Range<u64>, delta: i64) {
        self.push(Rule::MisdirectWrites { range, delta });
    }

    /// Removes every rule. Counters keep counting.
    pub fn clear(&self) {
        self.rules.lock().clear();
    }

    /// Valid operations of kind `op` seen so far (failed or not).
    pub fn ops(&self, op: Op) -> u64 {
        self.counts[idx(op)].load(Relaxed)
    }

    /// Operations a rule applied to so far.
    pub fn faults_fired(&self) -> u64 {
        self.fired.load(Relaxed)
    }

    fn push(&self, r: Rule) {
        self.rules.lock().push(r);
    }

    /// Counts the operation and decides its fate.
    fn consult(&self, op: Op, offset: u64, len: u64) -> Verdict {
        let n = self.counts[idx(op)].fetch_add(1, Relaxed);
        let rules = self.rules.lock();
        let mut data = None;
        for r in rules.iter() {
            let hit = |range: &Range<u64>| overlaps(range, offset, len);
            let (fails, is_data) = match r {
                Rule::FailFrom { ops, n: from } => (ops.contains(&op) && n >= *from, false),
                Rule::FailNth { op: o, n: k } => (*o == op && n == *k, false),
                Rule::FailRange { ops, range } => (ops.contains(&op) && hit(range), false),
                Rule::CorruptReads(range) => (false, op == Op::Read && hit(range)),
                Rule::CorruptWrites(range)
                | Rule::DropWrites(range)
                | Rule::TearWrites(range)
                | Rule::MisdirectWrites { range, .. } => (false, op == Op::Write && hit(range)),
            };
            if fails {
                self.fired.fetch_add(1, Relaxed);
                return Verdict::Fail;
            }
            if is_data && data.is_none() {
                data = Some(r.clone());
            }
        }
        match data {
            Some(r) => {
                self.fired.fetch_add(1, Relaxed);
                Verdict::Data(r)
            }
            None => Verdict::Pass,
        }
    }
}

/// A device with injectable faults, controlled through `control()`.
#[derive(Debug)]
pub struct FaultDevice<D> {
    inner: D,
    control: Arc<FaultControl>,
}

impl<D: BlockDevice> FaultDevice<D> {
    /// Wraps `inner` with no fault configured.
    pub fn new(inner: D) -> Self {
        FaultDevice {
            inner,
            control: Arc::new(FaultControl::default()),
        }
    }

    /// The controls, to change faults while I/O runs.
    pub fn control(&self) -> Arc<FaultControl> {
        self.control.clone()
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    fn check(&self, op: Op, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(
            op,
            offset,
            len,
            self.inner.size(),
            self.inner.logical_block_size(),
        )
    }
}

impl<D: BlockDevice> BlockDevice for FaultDevice<D> {
    // Metadata is never faulted.
    forward_metadata!();

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        self.check(Op::Read, offset, len)?;
        match self.control.consult(Op::Read, offset, len) {
            Verdict::Fail => Err(IoError::Injected {
                op: Op::Read,
                offset,
                len,
            }),
            Verdict::Pass => self.inner.read_at(offset, buf),
            Verdict::Data(rule) => {
                self.inner.read_at(offset, buf)?;
                if let Rule::CorruptReads(range) = rule {
                    buf[corrupt_index(&range, offset, len)] ^= CORRUPT_BIT;
                }
                Ok(())
            }
        }
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        self.check(Op::Write, offset, len)?;
        let rule = match self.control.consult(Op::Write, offset, len) {
            Verdict::Fail => {
                return Err(IoError::Injected {
                    op: Op::Write,
                    offset,
                    len,
                })
            }
            Verdict::Pass => return self.inner.write_at(offset, buf),
            Verdict::Data(rule) => rule,
        };
        let lbs = u64::from(self.inner.logical_block_size().max(1));
        match rule {
            Rule::DropWrites(_) => Ok(()),
            Rule::TearWrites(_) => {
                let half = (len / 2) / lbs * lbs;
                self.inner.write_at(offset, &buf[..half as usize])
            }
            Rule::CorruptWrites(range) => {
                let mut v = buf.to_vec();
                v[corrupt_index(&range, offset, len)] ^= CORRUPT_BIT;
                self.inner.write_at(offset, &v)
            }
            Rule::MisdirectWrites { delta, .. } => {
                let to = i128::from(offset) + i128::from(delta);
                match u64::try_from(to) {
                    Ok(to)
                        if to.is_multiple_of(lbs)
                            && to.checked_add(len).is_some_and(|e| e <= self.size()) =>
                    {
                        self.inner.write_at(to, buf)
                    }
                    _ => Ok(()),
                }
            }
            // Only write rules are returned for writes.
            Rule::FailFrom { .. }
            | Rule::FailNth { .. }
            | Rule::FailRange { .. }
            | Rule::CorruptReads(_) => self.inner.write_at(offset, buf),
        }
    }

    fn flush(&self) -> Result<(), IoError> {
        match self.control.consult(Op::Flush, 0, 0) {
            Verdict::Fail => Err(IoError::Injected {
                op: Op::Flush,
                offset: 0,
                len: 0,
            }),
            Verdict::Pass | Verdict::Data(_) => self.inner.flush(),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.check(Op::Discard, offset, len)?;
        match self.control.consult(Op::Discard, offset, len) {
            Verdict::Fail => Err(IoError::Injected {
                op: Op::Discard,
                offset,
                len,
            }),
            Verdict::Pass | Verdict::Data(_) => self.inner.discard(offset, len),
        }
    }
}
