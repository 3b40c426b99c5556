//! A cache device of a machine that can lose power: writes since the last flush are kept,
//! dropped, or torn at 512-byte granularity at the crash; every write or flush after it
//! fails. Every write is logged (offset, length), to count them.

use rand::{rngs::SmallRng, Rng};
use sce_io::{check_range, BlockDevice, IoError, Op};
use std::sync::Mutex;

/// The sector a torn write keeps or loses as a whole.
pub const SECTOR: usize = 512;

#[derive(Default)]
struct State {
    durable: Vec<u8>,
    pending: Vec<(u64, Vec<u8>)>,
    crashed: bool,
    writes: Vec<(u64, u64)>,
}

/// What a crash did to the unflushed writes.
#[derive(Clone, Copy, Debug, Default)]
pub struct CrashCounts {
    pub kept: u64,
    pub dropped: u64,
    pub torn: u64,
}

pub struct CrashDev {
    st: Mutex<State>,
    size: u64,
}

impl CrashDev {
    pub fn new(size: u64) -> Self {
        Self::from_image(vec![0; size as usize])
    }
    fn from_image(durable: Vec<u8>) -> Self {
        CrashDev {
            size: durable.len() as u64,
            st: Mutex::new(State {
                durable,
                ..State::default()
            }),
        }
    }
    /// Power loss: each unflushed write, in order, is kept, dropped or torn (each of its
    /// sectors kept or lost on its own).
    pub fn crash(&self, rng: &mut SmallRng) -> CrashCounts {
        let mut st = self.st.lock().unwrap();
        let mut c = CrashCounts::default();
        let pending = std::mem::take(&mut st.pending);
        for (off, data) in pending {
            let at = off as usize;
            match rng.gen_range(0..3) {
                0 => {
                    st.durable[at..at + data.len()].copy_from_slice(&data);
                    c.kept += 1;
                }
                1 => c.dropped += 1,
                _ => {
                    for (i, s) in data.chunks(SECTOR).enumerate() {
                        if rng.gen_bool(0.5) {
                            let o = at + i * SECTOR;
                            st.durable[o..o + s.len()].copy_from_slice(s);
                        }
                    }
                    c.torn += 1;
                }
            }
        }
        st.crashed = true;
        c
    }
    /// The machine restarted: a device holding what survived.
    pub fn restart(&self) -> CrashDev {
        let st = self.st.lock().unwrap();
        assert!(st.crashed && st.pending.is_empty(), "restart after a crash");
        Self::from_image(st.durable.clone())
    }
    /// Every write so far: (offset, length).
    pub fn writes(&self) -> Vec<(u64, u64)> {
        self.st.lock().unwrap().writes.clone()
    }
    /// Flips a byte of the durable image (damage).
    pub fn flip(&self, at: u64) {
        let mut st = self.st.lock().unwrap();
        assert!(st.pending.is_empty(), "damage a flushed device");
        st.durable[at as usize] ^= 0x5a;
    }
}

impl BlockDevice for CrashDev {
    fn size(&self) -> u64 {
        self.size
    }
    fn logical_block_size(&self) -> u32 {
        SECTOR as u32
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        check_range(Op::Read, offset, buf.len() as u64, self.size, SECTOR as u32)?;
        let st = self.st.lock().unwrap();
        let (a, b) = (offset, offset + buf.len() as u64);
        buf.copy_from_slice(&st.durable[a as usize..b as usize]);
        for (off, data) in &st.pending {
            let (c, d) = (*off, off + data.len() as u64);
            let (lo, hi) = (a.max(c), b.min(d));
            if lo < hi {
                buf[(lo - a) as usize..(hi - a) as usize]
                    .copy_from_slice(&data[(lo - c) as usize..(hi - c) as usize]);
            }
        }
        Ok(())
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        check_range(
            Op::Write,
            offset,
            buf.len() as u64,
            self.size,
            SECTOR as u32,
        )?;
        let mut st = self.st.lock().unwrap();
        if st.crashed {
            return Err(IoError::Failed("the machine crashed".into()));
        }
        st.writes.push((offset, buf.len() as u64));
        st.pending.push((offset, buf.to_vec()));
        Ok(())
    }
    fn flush(&self) -> Result<(), IoError> {
        let mut st = self.st.lock().unwrap();
        if st.crashed {
            return Err(IoError::Failed("the machine crashed".into()));
        }
        let pending = std::mem::take(&mut st.pending);
        for (off, data) in pending {
            st.durable[off as usize..off as usize + data.len()].copy_from_slice(&data);
        }
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> Result<(), IoError> {
        Err(IoError::Unsupported { op: Op::Discard })
    }
}
