//! `FaultDevice`: wraps a device and injects faults chosen at run time through a shared
//! `FaultControl`: errors on chosen operations, after N operations or on ranges; silent
//! corruption of reads or writes; lost, torn and misdirected writes. For tests only in
//! spirit, but an ordinary device in code: no test branches in the paths it wraps.

use crate::error::{check_range, IoError, Op};
use crate::BlockDevice;
use parking_lot::Mutex;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

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

/// The run-time controls of a `FaultDevice`.
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

fn overlaps(r: &Range<u64>, offset: u64, len: u64) -> bool {
    offset < r.end && r.start < offset + len.max(1)
}

impl FaultControl {
    /// Every operation of the kinds in `ops` from the `n`-th (0-based, counted per kind
    /// since the device was made) onward fails with `IoError::Injected`.
    pub fn fail_from(&self, ops: &[Op], n: u64) {
        self.rules.lock().push(Rule::FailFrom {
            ops: ops.to_vec(),
            n,
        });
    }
    /// Exactly the `n`-th operation of kind `op` fails.
    pub fn fail_nth(&self, op: Op, n: u64) {
        self.rules.lock().push(Rule::FailNth { op, n });
    }
    /// Operations of the kinds in `ops` touching `range` fail.
    pub fn fail_range(&self, ops: &[Op], range: Range<u64>) {
        self.rules.lock().push(Rule::FailRange {
            ops: ops.to_vec(),
            range,
        });
    }
    /// Reads overlapping `range` return data with one bit flipped.
    pub fn corrupt_reads(&self, range: Range<u64>) {
        self.rules.lock().push(Rule::CorruptReads(range));
    }
    /// Writes overlapping `range` store data with one bit flipped.
    pub fn corrupt_writes(&self, range: Range<u64>) {
        self.rules.lock().push(Rule::CorruptWrites(range));
    }
    /// Writes overlapping `range` report success and store nothing.
    pub fn drop_writes(&self, range: Range<u64>) {
        self.rules.lock().push(Rule::DropWrites(range));
    }
    /// Writes overlapping `range` store only their first half and report success.
    pub fn tear_writes(&self, range: Range<u64>) {
        self.rules.lock().push(Rule::TearWrites(range));
    }
    /// Writes overlapping `range` land at `offset + delta` (dropped if that is out of range).
    pub fn misdirect_writes(&self, range: Range<u64>, delta: i64) {
        self.rules
            .lock()
            .push(Rule::MisdirectWrites { range, delta });
    }
    /// Removes every rule.
    pub fn clear(&self) {
        self.rules.lock().clear();
    }
    /// Operations of kind `op` seen so far.
    pub fn ops(&self, op: Op) -> u64 {
        self.counts[idx(op)].load(Relaxed)
    }
    /// Faults that fired so far.
    pub fn faults_fired(&self) -> u64 {
        self.fired.load(Relaxed)
    }

    /// Counts the operation and returns the rules that apply to it.
    fn consult(&self, op: Op, offset: u64, len: u64) -> (bool, Vec<Rule>) {
        let n = self.counts[idx(op)].fetch_add(1, Relaxed);
        let rules = self.rules.lock();
        let mut fail = false;
        let mut other = Vec::new();
        for r in rules.iter() {
            match r {
                Rule::FailFrom { ops, n: from } if ops.contains(&op) && n >= *from => fail = true,
                Rule::FailNth { op: o, n: k } if *o == op && n == *k => fail = true,
                Rule::FailRange { ops, range }
                    if ops.contains(&op) && overlaps(range, offset, len) =>
                {
                    fail = true
                }
                Rule::CorruptReads(range) if op == Op::Read && overlaps(range, offset, len) => {
                    other.push(r.clone())
                }
                Rule::CorruptWrites(range) | Rule::DropWrites(range) | Rule::TearWrites(range)
                    if op == Op::Write && overlaps(range, offset, len) =>
                {
                    other.push(r.clone())
                }
                Rule::MisdirectWrites { range, .. }
                    if op == Op::Write && overlaps(range, offset, len) =>
                {
                    other.push(r.clone())
                }
                _ => {}
            }
        }
        if fail || !other.is_empty() {
            self.fired.fetch_add(1, Relaxed);
        }
        (fail, other)
    }
}

/// A device with injectable faults.
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
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        self.check(Op::Read, offset, len)?;
        let (fail, rules) = self.control.consult(Op::Read, offset, len);
        if fail {
            return Err(IoError::Injected {
                op: Op::Read,
                offset,
                len,
            });
        }
        self.inner.read_at(offset, buf)?;
        if !rules.is_empty() && !buf.is_empty() {
            let i = buf.len() / 2;
            buf[i] ^= 0x10;
        }
        Ok(())
    }

    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let len = buf.len() as u64;
        self.check(Op::Write, offset, len)?;
        let (fail, rules) = self.control.consult(Op::Write, offset, len);
        if fail {
            return Err(IoError::Injected {
                op: Op::Write,
                offset,
                len,
            });
        }
        let lbs = self.inner.logical_block_size().max(1) as usize;
        match rules.first() {
            None => self.inner.write_at(offset, buf),
            Some(Rule::DropWrites(_)) => Ok(()),
            Some(Rule::TearWrites(_)) => {
                let half = (buf.len() / 2) / lbs * lbs;
                self.inner.write_at(offset, &buf[..half])
            }
            Some(Rule::CorruptWrites(_)) => {
                let mut v = buf.to_vec();
                if !v.is_empty() {
                    let i = v.len() / 2;
                    v[i] ^= 0x10;
                }
                self.inner.write_at(offset, &v)
            }
            Some(Rule::MisdirectWrites { delta, .. }) => {
                let to = offset as i128 + *delta as i128;
                if to >= 0
                    && (to as u64)
                        .checked_add(len)
                        .is_some_and(|e| e <= self.inner.size())
                {
                    self.inner.write_at(to as u64, buf)
                } else {
                    Ok(())
                }
            }
            Some(_) => self.inner.write_at(offset, buf),
        }
    }

    fn flush(&self) -> Result<(), IoError> {
        let (fail, _) = self.control.consult(Op::Flush, 0, 0);
        if fail {
            return Err(IoError::Injected {
                op: Op::Flush,
                offset: 0,
                len: 0,
            });
        }
        self.inner.flush()
    }

    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.check(Op::Discard, offset, len)?;
        let (fail, _) = self.control.consult(Op::Discard, offset, len);
        if fail {
            return Err(IoError::Injected {
                op: Op::Discard,
                offset,
                len,
            });
        }
        self.inner.discard(offset, len)
    }
}
