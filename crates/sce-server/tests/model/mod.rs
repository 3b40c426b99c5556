//! The pieces of the in-process shared-mode model test (`tests/shared_model.rs`): hosts
//! running sce-server's real shared mode over memory devices and the in-memory etcd, a
//! source each host sees through a gate the test can close (its writes then wait), and the
//! model of acknowledged writes every read is checked against.

use sce_coord::{Coord, EtcdError, Faults, MemEtcd};
use sce_io::{AlignedBuf, BlockDevice, IoError, MemDevice};
use sce_server::attach::Attachable;
use sce_server::coherent::{Coherence, Coherent, HostIdentity};
use sce_server::config::{ExportConfig, ServeConfig, SharedConfig};
use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub const BLOCK: u64 = 4096;
pub const MIB: u64 = 1 << 20;
pub const VOLUME: u64 = 4 * MIB;
pub const BLOCKS: u64 = VOLUME / BLOCK;
pub const REGION: u64 = 256 << 10;
/// The last four regions are the probes' alone: the random workload never touches them.
pub const PROBE_FIRST: u64 = (VOLUME - 4 * REGION) / BLOCK;

/// The bytes of block `b` at version `v` (0: what the source starts with): a header naming
/// both, then a pattern of both.
pub fn stamp(b: u64, v: u32) -> Vec<u8> {
    let mut out = vec![0u8; BLOCK as usize];
    for (j, w) in out.chunks_mut(8).enumerate() {
        let x = ((b << 32) | v as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ j as u64;
        w.copy_from_slice(&x.to_le_bytes());
    }
    out[..8].copy_from_slice(&b.to_le_bytes());
    out[8..12].copy_from_slice(&v.to_le_bytes());
    out
}

/// The version block `b` holds, if its bytes are one of its versions whole.
pub fn version_of(b: u64, bytes: &[u8]) -> Option<u32> {
    let named = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let v = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
    (named == b && bytes == stamp(b, v)).then_some(v)
}

/// A gate on a host's writes to the source: closed, they wait (a slow source, or a host
/// stalled in the middle of a write).
#[derive(Default)]
pub struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
    /// Writes waiting at it.
    waiting: AtomicU64,
}

impl Gate {
    pub fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }

    /// Waits while closed (at most a minute: a test that forgets to open it fails
    /// elsewhere rather than hanging).
    fn pass(&self) {
        let g = self.closed.lock().unwrap();
        self.waiting.fetch_add(1, SeqCst);
        drop(
            (self.opened)
                .wait_timeout_while(g, Duration::from_secs(60), |c| *c)
                .unwrap(),
        );
        self.waiting.fetch_sub(1, SeqCst);
    }

    /// Writes waiting at the gate now.
    pub fn waiting(&self) -> u64 {
        self.waiting.load(SeqCst)
    }
}

/// The shared source as one host sees it: its writes pass its gate.
pub struct GatedSource {
    inner: Arc<MemDevice>,
    gate: Arc<Gate>,
}

impl BlockDevice for GatedSource {
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
        self.gate.pass();
        self.inner.write_at(offset, buf)
    }
    fn flush(&self) -> Result<(), IoError> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.gate.pass();
        self.inner.discard(offset, len)
    }
    fn identity(&self) -> Option<String> {
        Some("model-source".into())
    }
}

/// A host's network to etcd: a fault domain per client shared mode makes, in the order it
/// makes them (`Coherence::start_with`: the main one, the membership's, the tracker's, the
/// listener's, the background thread's); what is done to the host is done to all.
pub struct Net {
    domains: Vec<Arc<Faults>>,
}

/// The listener's client: the fourth made.
const LISTENER: usize = 3;

impl Net {
    pub fn pause(&self) {
        self.domains.iter().for_each(|f| f.pause())
    }
    pub fn hold_replies(&self) {
        self.domains.iter().for_each(|f| f.hold_replies())
    }
    pub fn partition(&self) {
        self.domains.iter().for_each(|f| f.partition())
    }
    pub fn heal(&self) {
        self.domains.iter().for_each(|f| f.heal())
    }
    /// Pauses the listener's client only (its watch goes quiet).
    pub fn pause_listener(&self) {
        self.domains[LISTENER].pause()
    }
    /// Heals every client but the listener's.
    pub fn heal_but_listener(&self) {
        let others = self
            .domains
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != LISTENER);
        others.for_each(|(_, f)| f.heal())
    }
    /// Expires the host's leases in `etcd`: the revision of the expiry, or of the last one
    /// (the store's clock may have expired them already), if any.
    pub fn expire(&self, etcd: &MemEtcd) -> Option<i64> {
        let now = self
            .domains
            .iter()
            .filter_map(|f| etcd.expire_leases_of(f))
            .max();
        now.or_else(|| {
            self.domains
                .iter()
                .filter_map(|f| etcd.last_expiry_of(f))
                .max()
        })
    }
}

/// A host: its export in shared mode, its network to etcd, its gate on the source.
pub struct Host {
    pub name: String,
    pub dev: Arc<Coherent>,
    pub coh: Arc<Coherence>,
    pub att: Arc<Attachable>,
    pub faults: Net,
    pub gate: Arc<Gate>,
    _id: Arc<HostIdentity>,
}

/// The shared volume's source, every block at version 0.
pub fn source() -> Arc<MemDevice> {
    let d = MemDevice::new(VOLUME);
    for b in 0..BLOCKS {
        d.write_at(b * BLOCK, &stamp(b, 0)).unwrap();
    }
    Arc::new(d)
}

impl Host {
    /// Host `name`: an 8 MiB memory cache over `src` (write-through, 64 KiB fragments,
    /// every read miss admitted), in shared mode over `etcd`, taking regions if `owns`.
    pub fn start(dir: &Path, name: &str, src: &Arc<MemDevice>, etcd: &MemEtcd, owns: bool) -> Host {
        let gate = Arc::new(Gate::default());
        let cfg = ServeConfig {
            state_dir: dir.join(name),
            persist: false,
            ..ServeConfig::default()
        };
        let dev = GatedSource {
            inner: src.clone(),
            gate: gate.clone(),
        };
        cfg.devices.put("src", Arc::new(dev));
        cfg.devices.put("cache", Arc::new(MemDevice::new(8 * MIB)));
        let mut cfg = cfg;
        cfg.exports.push(ExportConfig {
            name: "vol".into(),
            source: "src".into(),
            cache: Some("cache".into()),
            mode: Some("writethrough".into()),
            fragment_size: Some("64KiB".into()),
            admission: Some("always".into()),
            persist: Some(false),
            ..ExportConfig::default()
        });
        let built = sce_server::group::build_all(&cfg).expect("the export");
        let att = built.into_iter().next().unwrap().volume.unwrap();
        let id = Arc::new(HostIdentity::load(&cfg.state_dir, name).unwrap());
        let sc = SharedConfig {
            endpoints: Vec::new(),
            prefix: "/model".into(),
            host: name.into(),
            lease_ttl: 1,
            region_size: if owns { REGION } else { 0 },
            ownership_idle: Duration::from_millis(300),
        };
        let faults = Net {
            domains: (0..5).map(|_| etcd.faults()).collect(),
        };
        let made = AtomicU64::new(0);
        let connect = || -> Result<Box<dyn Coord>, EtcdError> {
            let i = (made.fetch_add(1, SeqCst) as usize).min(faults.domains.len() - 1);
            Ok(Box::new(
                etcd.client(&faults.domains[i], Duration::from_secs(1)),
            ))
        };
        let coh = Coherence::start_with(&sc, &id, "vol", att.clone(), &connect).unwrap();
        let dev = Coherent::new(att.clone(), coh.clone());
        Host {
            name: name.into(),
            dev,
            coh,
            att,
            faults,
            gate,
            _id: id,
        }
    }

    pub fn status(&self, what: &str) -> serde_json::Value {
        self.coh.status()[what].clone()
    }

    /// Waits (up to `secs`) until `f` holds of this host; whether it did.
    pub fn wait(&self, secs: u64, f: impl Fn(&Host) -> bool) -> bool {
        let t0 = Instant::now();
        while !f(self) {
            if t0.elapsed() > Duration::from_secs(secs) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// True if this host's cache holds all of block `b`.
    pub fn caches(&self, b: u64) -> bool {
        let held = self.att.exists(b * BLOCK, BLOCK).unwrap_or_default();
        held.iter().map(|x| x.1).sum::<u64>() >= BLOCK
    }

    pub fn hits(&self) -> u64 {
        self.att
            .live_volume()
            .map_or(0, |v| v.stats().read_pages_hit)
    }
}

#[derive(Default, Clone, Copy)]
struct Blk {
    /// The next version to write.
    next: u32,
    /// The newest acknowledged version.
    floor: u32,
    /// A write is in flight (one at a time per block, so versions are in order).
    busy: bool,
}

/// What the hosts were told was written, and what the reads found.
#[derive(Default)]
pub struct Model {
    blocks: Mutex<Vec<Blk>>,
    recent: Mutex<VecDeque<u64>>,
    pub reads: AtomicU64,
    pub blocks_checked: AtomicU64,
    pub acked: AtomicU64,
    pub failed: AtomicU64,
    pub failures: Mutex<Vec<String>>,
}

impl Model {
    pub fn new() -> Model {
        let m = Model::default();
        *m.blocks.lock().unwrap() = vec![
            Blk {
                next: 1,
                ..Blk::default()
            };
            BLOCKS as usize
        ];
        m
    }

    /// Blocks written lately (reads favour them).
    pub fn recent(&self, pick: usize) -> Option<u64> {
        let r = self.recent.lock().unwrap();
        r.get(pick % r.len().max(1)).copied()
    }

    /// Writes blocks `first..first+n` through host `h`, each its next version: Some(whether
    /// it was acknowledged), None if a write of one of them is in flight.
    pub fn write(&self, h: &Host, first: u64, n: u64) -> Option<bool> {
        let versions: Vec<u32> = {
            let mut bl = self.blocks.lock().unwrap();
            let range = first as usize..(first + n) as usize;
            if bl[range.clone()].iter().any(|b| b.busy) {
                return None;
            }
            bl[range]
                .iter_mut()
                .map(|b| {
                    b.busy = true;
                    b.next += 1;
                    b.next - 1
                })
                .collect()
        };
        {
            let mut r = self.recent.lock().unwrap();
            r.extend(first..first + n);
            while r.len() > 64 {
                r.pop_front();
            }
        }
        let mut buf = AlignedBuf::new((n * BLOCK) as usize);
        for (i, v) in versions.iter().enumerate() {
            let at = i * BLOCK as usize;
            buf[at..at + BLOCK as usize].copy_from_slice(&stamp(first + i as u64, *v));
        }
        let ok = h.dev.write_at(first * BLOCK, &buf).is_ok();
        let mut bl = self.blocks.lock().unwrap();
        for (i, v) in versions.iter().enumerate() {
            let b = &mut bl[(first + i as u64) as usize];
            b.busy = false;
            if ok {
                b.floor = b.floor.max(*v);
            }
        }
        let counter = if ok { &self.acked } else { &self.failed };
        counter.fetch_add(1, SeqCst);
        Some(ok)
    }

    /// Reads blocks `first..first+n` through host `h` and checks each: it must hold the
    /// newest version acknowledged before the read started, or a newer one written since
    /// (in flight, acknowledged meanwhile, or failed: a failed write may have landed).
    pub fn read(&self, h: &Host, first: u64, n: u64, why: &str) {
        let floors: Vec<u32> = {
            let bl = self.blocks.lock().unwrap();
            bl[first as usize..(first + n) as usize]
                .iter()
                .map(|b| b.floor)
                .collect()
        };
        let mut buf = AlignedBuf::new((n * BLOCK) as usize);
        if let Err(e) = h.dev.read_at(first * BLOCK, &mut buf) {
            self.fail(format!(
                "{why}: host {} read of blocks {first}+{n} failed: {e}",
                h.name
            ));
            return;
        }
        let bl = self.blocks.lock().unwrap();
        for (i, floor) in floors.iter().enumerate() {
            let b = first + i as u64;
            let bytes = &buf[i * BLOCK as usize..(i + 1) * BLOCK as usize];
            let next = bl[b as usize].next;
            match version_of(b, bytes) {
                None => self.fail(format!("{why}: host {} block {b}: GARBAGE", h.name)),
                Some(v) if v < *floor => self.fail(format!(
                    "{why}: host {} block {b}: STALE: read version {v}, but version {floor} was acknowledged before the read started",
                    h.name
                )),
                Some(v) if v >= next => {
                    self.fail(format!("{why}: host {} block {b}: version {v} was never written", h.name))
                }
                Some(_) => {}
            }
        }
        self.reads.fetch_add(1, SeqCst);
        self.blocks_checked.fetch_add(n, SeqCst);
    }

    fn fail(&self, what: String) {
        eprintln!("{what}");
        self.failures.lock().unwrap().push(what);
    }

    pub fn failed_any(&self) -> bool {
        !self.failures.lock().unwrap().is_empty()
    }
}
