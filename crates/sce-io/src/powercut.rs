//! A device with a volatile write cache that loses power: the crash model of the power-cut
//! tests (issue 44), in process, so that they need no FUSE.
//!
//! Writes (and discards, as writes of zeroes) land in the device's cache: reads see them at
//! once, but only a flush makes them durable. At a power cut ([`Power::cut`]) every write
//! not followed by a flush, in the order it was made, is kept whole, dropped, or torn (a
//! random subset of its sectors of [`PowerCutDevice::grain`] bytes lands), as a disk or an
//! SSD without power-loss protection may leave it; from then on every operation of every
//! device on that power fails at once. [`PowerCutDevice::durable`] is the image the next
//! start finds (a new device over it).
//!
//! Several devices share one [`Power`]: a cut takes them all at the same instant, as a host
//! that loses power takes its cache device and the volatile cache of a disk array with it.

use crate::order::{levels, OrderedMutex};
use crate::{check_range, BlockDevice, IoError, Op};
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;

/// The power of one host: cut once, every device on it stops.
#[derive(Debug, Default)]
pub struct Power {
    cut: AtomicBool,
    devices: Mutex<Vec<std::sync::Weak<PowerCutDevice>>>,
}

/// What a cut did to the writes a device had not flushed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CutCounts {
    /// Written whole.
    pub kept: u64,
    /// Lost whole.
    pub dropped: u64,
    /// Torn: some of their sectors landed.
    pub torn: u64,
}

impl std::ops::AddAssign for CutCounts {
    fn add_assign(&mut self, o: CutCounts) {
        self.kept += o.kept;
        self.dropped += o.dropped;
        self.torn += o.torn;
    }
}

impl Power {
    /// A host's power, on.
    pub fn new() -> Arc<Power> {
        Arc::new(Power::default())
    }

    /// True once the power was cut.
    pub fn is_cut(&self) -> bool {
        self.cut.load(SeqCst)
    }

    /// Cuts the power of every device on it at once, deciding each unflushed write's fate
    /// from `seed`: the counts, summed over the devices.
    pub fn cut(&self, seed: u64) -> CutCounts {
        let devs: Vec<Arc<PowerCutDevice>> = self
            .devices
            .lock()
            .iter()
            .filter_map(|d| d.upgrade())
            .collect();
        // Every device stops taking writes first, under its own lock, so no write lands on
        // one device after another lost power.
        let mut guards: Vec<_> = devs.iter().map(|d| d.st.lock()).collect();
        self.cut.store(true, SeqCst);
        let mut total = CutCounts::default();
        for (i, (d, st)) in devs.iter().zip(guards.iter_mut()).enumerate() {
            total += d.lose(st, seed.wrapping_add(i as u64 * 0x9e37_79b9));
        }
        total
    }
}

/// Unflushed writes, and the images (under the device's lock).
struct State {
    /// What reads see: every write so far.
    current: Vec<u8>,
    /// What a flush made durable.
    durable: Vec<u8>,
    /// Writes since the last flush, in order: (offset, bytes).
    pending: Vec<(u64, Vec<u8>)>,
}

/// A device with a volatile write cache on a [`Power`] that may be cut (see the module's
/// doc).
pub struct PowerCutDevice {
    st: OrderedMutex<levels::PowerCut, State>,
    power: Arc<Power>,
    size: u64,
    lbs: u32,
    grain: usize,
    writes: AtomicU64,
    flushes: AtomicU64,
}

impl std::fmt::Debug for PowerCutDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PowerCutDevice")
            .field("size", &self.size)
            .field("grain", &self.grain)
            .finish()
    }
}

/// A small xorshift generator: the fates of a cut, repeatable from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

impl PowerCutDevice {
    /// A device holding `image` durably (its size must be a multiple of `lbs`), on `power`,
    /// whose torn writes keep or lose each `grain` bytes on their own (512 or 4096).
    pub fn new(image: Vec<u8>, lbs: u32, grain: usize, power: &Arc<Power>) -> Arc<Self> {
        assert!(image.len().is_multiple_of(lbs as usize) && grain > 0);
        let d = Arc::new(PowerCutDevice {
            size: image.len() as u64,
            st: OrderedMutex::new(State {
                current: image.clone(),
                durable: image,
                pending: Vec::new(),
            }),
            power: power.clone(),
            lbs,
            grain,
            writes: AtomicU64::new(0),
            flushes: AtomicU64::new(0),
        });
        power.devices.lock().push(Arc::downgrade(&d));
        d
    }

    /// The torn-write grain.
    pub fn grain(&self) -> usize {
        self.grain
    }

    /// The durable image: what a start after a cut finds.
    pub fn durable(&self) -> Vec<u8> {
        self.st.lock().durable.clone()
    }

    /// Writes and flushes so far.
    pub fn ops(&self) -> (u64, u64) {
        (self.writes.load(SeqCst), self.flushes.load(SeqCst))
    }

    /// Applies the cut to `st`: each unflushed write kept, dropped or torn.
    fn lose(&self, st: &mut State, seed: u64) -> CutCounts {
        let mut rng = Rng(seed | 1);
        let mut c = CutCounts::default();
        for (off, data) in std::mem::take(&mut st.pending) {
            let at = off as usize;
            match rng.next() % 3 {
                0 => {
                    st.durable[at..at + data.len()].copy_from_slice(&data);
                    c.kept += 1;
                }
                1 => c.dropped += 1,
                _ => {
                    for (i, s) in data.chunks(self.grain).enumerate() {
                        if rng.next().is_multiple_of(2) {
                            let o = at + i * self.grain;
                            st.durable[o..o + s.len()].copy_from_slice(s);
                        }
                    }
                    c.torn += 1;
                }
            }
        }
        st.current = st.durable.clone();
        c
    }

    fn alive(&self, op: Op, offset: u64, len: u64) -> Result<(), IoError> {
        if self.power.is_cut() {
            return Err(IoError::Injected { op, offset, len });
        }
        Ok(())
    }

    fn put(&self, op: Op, offset: u64, data: Vec<u8>) -> Result<(), IoError> {
        check_range(op, offset, data.len() as u64, self.size, self.lbs)?;
        let mut st = self.st.lock();
        self.alive(op, offset, data.len() as u64)?;
        let at = offset as usize;
        st.current[at..at + data.len()].copy_from_slice(&data);
        st.pending.push((offset, data));
        self.writes.fetch_add(1, SeqCst);
        Ok(())
    }
}

impl BlockDevice for PowerCutDevice {
    fn size(&self) -> u64 {
        self.size
    }
    fn logical_block_size(&self) -> u32 {
        self.lbs
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, self.lbs)?;
        let st = self.st.lock();
        self.alive(Op::Read, offset, buf.len() as u64)?;
        buf.copy_from_slice(&st.current[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.put(Op::Write, offset, buf.to_vec())
    }
    fn flush(&self) -> Result<(), IoError> {
        let mut st = self.st.lock();
        self.alive(Op::Flush, 0, 0)?;
        for (off, data) in std::mem::take(&mut st.pending) {
            let at = off as usize;
            st.durable[at..at + data.len()].copy_from_slice(&data);
        }
        self.flushes.fetch_add(1, SeqCst);
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        check_range(Op::Discard, offset, len, self.size, self.lbs)?;
        self.put(Op::Discard, offset, vec![0; len as usize])
    }
    fn identity(&self) -> Option<String> {
        // The same content across a restart over its durable image: a model of one disk.
        Some(format!("powercut:{}", self.size))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_conforms_while_powered() {
        let p = Power::new();
        let d = PowerCutDevice::new(vec![0; 8 << 20], 512, 512, &p);
        crate::conformance::run_all(&*d);
    }

    #[test]
    fn a_cut_keeps_flushed_writes_and_decides_the_rest_then_stops_everything() {
        let p = Power::new();
        let a = PowerCutDevice::new(vec![0; 64 << 10], 512, 512, &p);
        let b = PowerCutDevice::new(vec![0; 64 << 10], 512, 4096, &p);
        a.write_at(0, &[1; 4096]).unwrap();
        a.flush().unwrap();
        for k in 1..13u64 {
            a.write_at(k * 4096, &[k as u8 + 1; 4096]).unwrap();
            b.write_at(k * 4096, &[k as u8 + 1; 4096]).unwrap();
        }
        let mut r = vec![0; 4096];
        b.read_at(4096, &mut r).unwrap();
        assert_eq!(r, vec![2; 4096], "reads see unflushed writes");
        let c = p.cut(7);
        assert_eq!(c.kept + c.dropped + c.torn, 24);
        assert!(c.kept > 0 && c.dropped > 0 && c.torn > 0, "{c:?}");
        assert!(a.write_at(0, &[9; 512]).is_err() && b.flush().is_err());
        assert!(a.read_at(0, &mut r).is_err(), "no power, no reads");
        let img = a.durable();
        assert_eq!(&img[..4096], &[1; 4096][..], "flushed data survives");
        // Every sector holds the write's bytes or the older ones, never anything else; b
        // tears at 4 KiB, so its pages are whole.
        for (dev, grain) in [(&a, 512), (&b, 4096)] {
            let img = dev.durable();
            for k in 1..13usize {
                for s in img[k * 4096..(k + 1) * 4096].chunks(grain) {
                    assert!(s.iter().all(|&x| x == 0) || s.iter().all(|&x| x == k as u8 + 1));
                }
            }
        }
    }
}
