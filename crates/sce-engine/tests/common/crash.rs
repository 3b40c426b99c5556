//! A device of a machine that can crash (power loss), for the crash-consistency tests.

use parking_lot::Mutex;
use rand::{rngs::SmallRng, Rng};
use sce_io::{BlockDevice, IoError, MemDevice, Op};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::Arc;

type UndoLog = Vec<(u64, Vec<u8>)>;

/// A device of a machine that can crash. After the crash every write, discard and flush
/// fails. A *volatile* device (the cache) keeps its unflushed writes in an undo log, and
/// `crash` undoes a random subset of them (a volatile write cache losing its content at power
/// loss); a durable one (the source, the system of record) keeps every acknowledged write.
pub struct CrashDevice {
    inner: Arc<MemDevice>,
    undo: Option<Mutex<UndoLog>>,
    frozen: Arc<AtomicBool>,
}

impl CrashDevice {
    pub fn volatile(inner: Arc<MemDevice>, frozen: Arc<AtomicBool>) -> Self {
        CrashDevice {
            inner,
            undo: Some(Mutex::new(Vec::new())),
            frozen,
        }
    }
    pub fn durable(inner: Arc<MemDevice>, frozen: Arc<AtomicBool>) -> Self {
        CrashDevice {
            inner,
            undo: None,
            frozen,
        }
    }
    pub fn crash(&self, rng: &mut SmallRng) -> usize {
        self.crash_with(rng, false)
    }

    /// `crash`, with writes also *torn*: of the unflushed writes, a third are kept, a third
    /// lost whole and a third torn at 512-byte granularity (each sector kept or lost on its
    /// own), as a power loss may leave a device with a volatile cache and no atomic writes.
    pub fn crash_torn(&self, rng: &mut SmallRng) -> usize {
        self.crash_with(rng, true)
    }

    fn crash_with(&self, rng: &mut SmallRng, tear: bool) -> usize {
        let mut undo = self
            .undo
            .as_ref()
            .expect("only a volatile device loses writes")
            .lock();
        self.frozen.store(true, SeqCst);
        let mut lost = 0;
        // Newest first: a sector written twice since the flush comes back to its older
        // content step by step.
        for (off, old) in undo.drain(..).rev() {
            let fate = if tear {
                rng.gen_range(0..3)
            } else {
                rng.gen_range(0..2)
            };
            match fate {
                0 => {}
                1 => {
                    self.inner.write_at(off, &old).unwrap();
                    lost += 1;
                }
                _ => {
                    for (i, sector) in old.chunks(512).enumerate() {
                        if rng.gen_bool(0.5) {
                            self.inner.write_at(off + i as u64 * 512, sector).unwrap();
                        }
                    }
                    lost += 1;
                }
            }
        }
        lost
    }
    fn alive(&self, op: Op) -> Result<(), IoError> {
        if self.frozen.load(SeqCst) {
            return Err(IoError::Injected {
                op,
                offset: 0,
                len: 0,
            });
        }
        Ok(())
    }
}

impl BlockDevice for CrashDevice {
    /// The memory device's: in this model nobody else writes the source between runs.
    fn identity(&self) -> Option<String> {
        self.inner.identity()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        let Some(undo) = &self.undo else {
            self.alive(Op::Write)?;
            return self.inner.write_at(offset, buf);
        };
        // Held across the check and the write, so a crash sees the write whole or not at all.
        let mut undo = undo.lock();
        self.alive(Op::Write)?;
        let mut old = vec![0u8; buf.len()];
        self.inner.read_at(offset, &mut old)?;
        undo.push((offset, old));
        self.inner.write_at(offset, buf)
    }
    fn flush(&self) -> Result<(), IoError> {
        let Some(undo) = &self.undo else {
            return self.alive(Op::Flush);
        };
        let mut undo = undo.lock();
        self.alive(Op::Flush)?;
        undo.clear();
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.write_at(offset, &vec![0u8; len as usize])
    }
}

/// A machine that can crash: `cache` as a volatile cache device and `source` as a durable
/// one, frozen together by the cache's `crash`.
pub fn machine(
    cache: &Arc<MemDevice>,
    source: &Arc<MemDevice>,
) -> (Arc<CrashDevice>, Arc<dyn BlockDevice>) {
    let frozen = Arc::new(AtomicBool::new(false));
    let c = Arc::new(CrashDevice::volatile(cache.clone(), frozen.clone()));
    let s: Arc<dyn BlockDevice> = Arc::new(CrashDevice::durable(source.clone(), frozen));
    (c, s)
}
