//! The power-cut loop of issue 44, in process: the server's exports (`group::build_all`,
//! the `Attachable`s `sce serve` serves, their live mode switches) over a cache device and
//! sources that are each a model of a volatile write cache (`sce_io::PowerCutDevice`): at a
//! cut every write not followed by a flush is kept, dropped or torn (at 512 bytes or 4 KiB),
//! on every device at the same instant. Four writers (QD1, one region each) write
//! self-describing 512-byte sectors, FLUSH, write with FUA and discard; at a random moment
//! the power goes; everything restarts from the durable images and every sector is read
//! and judged against what its writer knows was flushed: its last flushed value or a newer
//! one issued is right; an older one is STALE, bytes nobody wrote there GARBAGE, a failed
//! read EIO. Printed per run: cuts, sectors checked, stale, garbage, EIO.
//!
//! Runs: write-back; write-back with live switches to write-through and back (the drain
//! under load, the reopen); two exports on one cache device; one source block that fails
//! every write. `SCE_POWERCUTS` sets the cuts per run (default 50); `SCE_POWERCUT_SEED` the
//! seed.

use sce_core::{Retune, WriteMode};
use sce_io::{BlockDevice, FaultDevice, Op, Power, PowerCutDevice};
use sce_server::attach::{Attachable, Drain, Watch};
use sce_server::config::{ExportConfig, ServeConfig};
use sce_server::log_size::LogSize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECT: u64 = 512;
const MIB: u64 = 1 << 20;
/// Each writer's region (in its export).
const REGION: u64 = MIB;
const WRITERS: u64 = 4;
const SOURCE: u64 = 8 * MIB;
const CACHE: u64 = 48 * MIB;

/// With `SCE_POWERCUT_TRACE`: what the writers and the switcher did, to print when a check
/// fails.
static EVENTS: Mutex<Vec<(f64, String)>> = Mutex::new(Vec::new());
static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

fn trace(what: impl FnOnce() -> String) {
    if std::env::var("SCE_POWERCUT_TRACE").is_ok() {
        let t = T0.get_or_init(Instant::now).elapsed().as_secs_f64();
        EVENTS.lock().unwrap().push((t, what()));
    }
}

/// The traced events about sector `s` (or every switch), printed.
fn dump(s: u64) {
    let ev = EVENTS.lock().unwrap();
    // Every event of the cycle the cut ended (the one before the last start), and those
    // about `s` before it.
    let starts: Vec<usize> = (ev.iter().enumerate())
        .filter(|(_, (_, e))| e.starts_with("cycle start"))
        .map(|(i, _)| i)
        .collect();
    let last = starts.len().checked_sub(2).map(|k| starts[k]);
    for (i, (t, e)) in ev.iter().enumerate() {
        if e.contains("switch") || e.contains(&format!("[{s}]")) || last.is_some_and(|l| i >= l) {
            eprintln!("  {t:9.4} {}", e.chars().take(200).collect::<String>());
        }
    }
}

/// What a run varies.
#[derive(Clone, Copy, Debug)]
struct Shape {
    exports: usize,
    switch: bool,
    bad_block: bool,
    grain: usize,
    /// Each source write's latency, in milliseconds (0: none).
    source_ms: u64,
    /// The mode each run starts in.
    start: WriteMode,
}

/// The bytes of sector `s` at generation `gen` (0: zeroes).
fn sector(s: u64, gen: u32) -> Vec<u8> {
    sce_testkit::stamp::stamped(SECT as usize, b"RT4S", s, gen)
}

/// The generation of sector `s`'s bytes, or None for garbage.
fn decode(s: u64, b: &[u8]) -> Option<u32> {
    sce_testkit::stamp::version_of(b, b"RT4S", s)
}

/// A writer's knowledge of its sectors: every generation it issued since the last check,
/// the index of the one known flushed (-1: the value at the check), and what is pending a
/// FLUSH.
struct Model {
    hist: Vec<Vec<u32>>,
    base: Vec<u32>,
    flushed: Vec<i64>,
    pending: Vec<(usize, usize)>,
}

impl Model {
    fn new(n: usize) -> Model {
        Model {
            hist: vec![Vec::new(); n],
            base: vec![0; n],
            flushed: vec![-1; n],
            pending: Vec::new(),
        }
    }
    /// The generations sector `i` may read as: its flushed one and every later one.
    fn valid(&self, i: usize) -> Vec<u32> {
        let f = self.flushed[i];
        let mut v: Vec<u32> = if f < 0 {
            vec![self.base[i]]
        } else {
            Vec::new()
        };
        v.extend(&self.hist[i][f.max(0) as usize..]);
        v
    }
    /// Sector `i` was read as `g` (one of `valid`): that is its state from now on.
    fn rebase(&mut self, i: usize, g: u32) {
        self.base[i] = g;
        self.hist[i].clear();
        self.flushed[i] = -1;
    }
}

#[derive(Debug, Default)]
struct Counts {
    cuts: u64,
    sectors: u64,
    stale: u64,
    garbage: u64,
    eio: u64,
    writes: u64,
    flushes: u64,
    fua: u64,
    discards: u64,
    switches: u64,
    switch_failures: u64,
    unflushed: sce_io::CutCounts,
    /// Write-through restarts whose every sector was read, the cache forgotten and the
    /// sector read again; sectors that read differently the second time.
    forgets: u64,
    changed_by_forget: u64,
    /// Chunks of read slots the write-back log lent (format 9), and cuts that found some
    /// lent.
    lends: u64,
    cuts_lent: u64,
}

/// The devices and the server's exports over them.
struct Rig {
    dir: tempfile::TempDir,
    shape: Shape,
    images: HashMap<String, Vec<u8>>,
    power: Arc<Power>,
    devs: HashMap<String, Arc<PowerCutDevice>>,
    bad: Option<Arc<sce_io::FaultControl>>,
    exports: Vec<Arc<Attachable>>,
    mode: WriteMode,
}

impl Rig {
    fn new(shape: Shape) -> Rig {
        let mut images = HashMap::new();
        images.insert("cache".to_string(), vec![0u8; CACHE as usize]);
        for k in 0..shape.exports {
            images.insert(format!("src{k}"), vec![0u8; SOURCE as usize]);
        }
        Rig {
            dir: tempfile::tempdir().unwrap(),
            shape,
            images,
            power: Power::new(),
            devs: HashMap::new(),
            bad: None,
            exports: Vec::new(),
            mode: shape.start,
        }
    }

    fn name(&self, n: &str) -> String {
        self.dir
            .path()
            .join(format!("{n}.pc"))
            .display()
            .to_string()
    }

    /// Powers the devices up from their images and starts the server's exports in `mode`
    /// (in write-back if a log with dirty data refuses another mode).
    fn up(&mut self, first: bool) {
        self.power = Power::new();
        let mut cfg = ServeConfig {
            state_dir: self.dir.path().join("state"),
            writeback_log: LogSize::Bytes(2 * MIB),
            metadata_interval: Duration::from_millis(200),
            force: first,
            ..ServeConfig::default()
        };
        for (n, img) in &self.images {
            let d = PowerCutDevice::new(img.clone(), 512, self.shape.grain, &self.power);
            self.devs.insert(n.clone(), d.clone());
            let dev: Arc<dyn BlockDevice> = if n == "src0" && self.shape.bad_block {
                let f = Arc::new(FaultDevice::new(d));
                // A block in writer 0's region that fails every write (a medium error).
                f.control().fail_range(&[Op::Write], 40960..45056);
                self.bad = Some(f.control());
                f
            } else {
                d
            };
            // A slow source (the shape's, or `SCE_POWERCUT_SOURCE_MS`): the cleaner falls
            // behind, drains last.
            let ms: u64 = std::env::var("SCE_POWERCUT_SOURCE_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(self.shape.source_ms);
            let dev: Arc<dyn BlockDevice> = if ms > 0 && n.starts_with("src") {
                let mut lat = sce_io::LatencyConfig::disk(Duration::from_millis(ms), 64);
                lat.read = sce_io::Delay::None;
                Arc::new(sce_io::LatencyDevice::new(dev, lat))
            } else {
                dev
            };
            cfg.devices.put(&self.name(n), dev);
        }
        for k in 0..self.shape.exports {
            cfg.exports.push(ExportConfig {
                name: format!("e{k}"),
                source: self.name(&format!("src{k}")),
                cache: Some(self.name("cache").into()),
                cache_size: None,
                mode: Some(self.mode.to_string()),
                fragment_size: Some("64KiB".into()),
                ..ExportConfig::default()
            });
        }
        let built = match sce_server::group::build_all(&cfg) {
            Ok(b) => b,
            Err(e) if self.mode != WriteMode::WriteBack => {
                // A log with dirty data refuses another mode: write-back it is.
                assert!(format!("{e:#}").contains("dirty"), "{e:#}");
                self.mode = WriteMode::WriteBack;
                for k in 0..self.shape.exports {
                    cfg.exports[k].mode = Some("writeback".into());
                }
                sce_server::group::build_all(&cfg).unwrap()
            }
            Err(e) => panic!("the restart was refused: {e:#}"),
        };
        self.exports = built.into_iter().map(|b| b.volume.unwrap()).collect();
    }

    /// After a cut: the exports go, and the devices' durable images are what the next
    /// start finds.
    fn down(&mut self) {
        assert!(self.power.is_cut());
        self.exports.clear();
        // A host that loses power stops with its devices; here the process goes on a moment
        // and may mark a device it finds failing in the state directory, which a real cut
        // never lets it do.
        for f in std::fs::read_dir(self.dir.path().join("state"))
            .into_iter()
            .flatten()
        {
            let f = f.unwrap().path();
            if f.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("failed-"))
            {
                std::fs::remove_file(f).unwrap();
            }
        }
        for (n, d) in &self.devs {
            self.images.insert(n.clone(), d.durable());
        }
        self.devs.clear();
    }
}

/// Writer `t`'s sectors: (export, first byte in it).
fn region(t: u64, exports: usize) -> (usize, u64) {
    ((t % exports as u64) as usize, (t / exports as u64) * REGION)
}

/// One writer until `stop` or its first error: writes of one to 24 sectors (mostly whole
/// pages, some over a hot page), FUA now and then, discards, FLUSH, and reads that must see
/// its own last writes.
fn writer(
    dev: &Attachable,
    at: u64,
    model: &Mutex<Model>,
    gen: &AtomicU64,
    seed: u64,
    stop: &AtomicBool,
    c: &Mutex<Counts>,
) {
    let n = (REGION / SECT) as usize;
    let mut x = seed | 1;
    let mut rnd = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let hot = [rnd(n as u64 / 8) * 8, rnd(n as u64 / 8) * 8];
    while !stop.load(Relaxed) {
        let op = rnd(100);
        if op < 62 {
            let (s0, len) = match rnd(10) {
                0..=2 => (hot[rnd(2) as usize], 8),
                3..=7 => (rnd(n as u64 / 8) * 8, 8 * (1 + rnd(16))),
                _ => (rnd(n as u64), 1 + rnd(24)),
            };
            let len = len.min(n as u64 - s0);
            let zero = rnd(100) < 4;
            let fua = rnd(100) < 7;
            let g = if zero {
                0
            } else {
                gen.fetch_add(1, Relaxed) as u32 + 1
            };
            let idx: Vec<usize> = {
                let mut m = model.lock().unwrap();
                (s0..s0 + len)
                    .map(|s| {
                        m.hist[s as usize].push(g);
                        m.hist[s as usize].len() - 1
                    })
                    .collect()
            };
            let off = at + s0 * SECT;
            let first = at / SECT + s0;
            trace(|| {
                let mut v = format!("write gen {g} sectors {first}+{len} zero {zero} fua {fua}");
                for x in first..first + len {
                    v += &format!(" [{x}]");
                }
                v
            });
            let r = if zero {
                dev.discard(off, len * SECT)
            } else {
                let b: Vec<u8> = (s0..s0 + len)
                    .flat_map(|s| sector(at / SECT + s, g))
                    .collect();
                dev.write_at(off, &b)
            };
            let r = r.and_then(|()| if fua { dev.flush() } else { Ok(()) });
            trace(|| format!("acked gen {g} sectors {first}+{len}: {}", r.is_ok()));
            if r.is_err() {
                return;
            }
            let mut m = model.lock().unwrap();
            for (s, i) in (s0..s0 + len).zip(idx) {
                if fua {
                    m.flushed[s as usize] = m.flushed[s as usize].max(i as i64);
                } else {
                    m.pending.push((s as usize, i));
                }
            }
            let mut c = c.lock().unwrap();
            c.writes += 1;
            c.fua += fua as u64;
            c.discards += zero as u64;
        } else if op < 80 {
            let snap = std::mem::take(&mut model.lock().unwrap().pending);
            let r = dev.flush();
            trace(|| format!("flush by the writer at {at}: {}", r.is_ok()));
            if r.is_err() {
                return;
            }
            let mut m = model.lock().unwrap();
            for (s, i) in snap {
                m.flushed[s] = m.flushed[s].max(i as i64);
            }
            c.lock().unwrap().flushes += 1;
        } else {
            let s0 = rnd(n as u64 / 8) * 8;
            let len = (8 * (1 + rnd(8))).min(n as u64 - s0);
            let mut b = vec![0u8; (len * SECT) as usize];
            if dev.read_at(at + s0 * SECT, &mut b).is_err() {
                return;
            }
            let m = model.lock().unwrap();
            for k in 0..len as usize {
                let s = s0 as usize + k;
                let want = m.hist[s].last().copied().unwrap_or(m.base[s]);
                let got = decode(
                    at / SECT + s as u64,
                    &b[k * SECT as usize..(k + 1) * SECT as usize],
                );
                if got != Some(want) {
                    dump(at / SECT + s as u64);
                }
                assert_eq!(
                    got,
                    Some(want),
                    "read-your-write: sector {s} of writer at {at}"
                );
            }
        }
    }
}

/// Live mode switches, write-back to write-through (AWT, the default), write-through-sync
/// or write-around in turn, and back, until `stop`.
fn switcher(
    rig_exports: &[Arc<Attachable>],
    mode: &Mutex<WriteMode>,
    seed: u64,
    stop: &AtomicBool,
    c: &Mutex<Counts>,
) {
    let mut x = seed | 1;
    while !stop.load(Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::thread::sleep(Duration::from_millis(20 + x % 200));
        if stop.load(Relaxed) {
            return;
        }
        let cur = *mode.lock().unwrap();
        let next = if cur == WriteMode::WriteBack {
            [
                WriteMode::Awt,
                WriteMode::WriteThrough,
                WriteMode::WriteAround,
            ][(x % 3) as usize]
        } else {
            WriteMode::WriteBack
        };
        let t = Retune {
            write_mode: Some(next),
            ..Retune::default()
        };
        trace(|| format!("switch from {cur} to {next} begins"));
        let r = rig_exports[0].set(&t, Drain::Wait, Watch::never());
        trace(|| format!("switch from {cur} to {next} ends: {:?}", r.as_ref().err()));
        match r {
            Ok(_) => {
                if next == WriteMode::WriteBack {
                    trace(|| {
                        let w = rig_exports[0].volume().and_then(|v| v.writeback_stats());
                        format!("switch into writeback reopened with {w:?}")
                    });
                }
                *mode.lock().unwrap() = next;
                c.lock().unwrap().switches += 1;
            }
            Err(e) => {
                if std::env::var("SCE_POWERCUT_TRACE").is_ok() && !stop.load(Relaxed) {
                    eprintln!("  a switch to {next} failed before the cut: {e:#}");
                }
                c.lock().unwrap().switch_failures += 1;
            }
        }
    }
}

/// Reads every sector of every writer and judges it; then rebases the models on what was
/// read (a FLUSH first, so that it is what a later cut keeps).
fn verify(rig: &Rig, models: &[Mutex<Model>], c: &mut Counts, what: &str) {
    let n = (REGION / SECT) as usize;
    for (t, model) in models.iter().enumerate() {
        let (e, at) = region(t as u64, rig.shape.exports);
        let dev = &rig.exports[e];
        let mut m = model.lock().unwrap();
        let mut b = vec![0u8; REGION as usize];
        let whole = dev.read_at(at, &mut b).is_ok();
        for i in 0..n {
            let s = at / SECT + i as u64;
            let bytes = if whole {
                b[i * SECT as usize..(i + 1) * SECT as usize].to_vec()
            } else {
                let mut one = vec![0u8; SECT as usize];
                if dev.read_at(at + i as u64 * SECT, &mut one).is_err() {
                    c.eio += 1;
                    continue;
                }
                one
            };
            c.sectors += 1;
            let valid = m.valid(i);
            match decode(s, &bytes) {
                Some(g) if valid.contains(&g) => m.rebase(i, g),
                Some(g) => {
                    if c.stale == 0 {
                        dump(s);
                    }
                    c.stale += 1;
                    let src = &rig.images[&format!("src{e}")];
                    let on_source = decode(s, &src[(s * SECT) as usize..((s + 1) * SECT) as usize]);
                    eprintln!(
                        "{what}: STALE sector {s} of export {e}: {g}, flushed {valid:?}; the \
                         source holds {on_source:?}"
                    );
                    m.rebase(i, g);
                }
                None => {
                    c.garbage += 1;
                    eprintln!("{what}: GARBAGE sector {s} of export {e}");
                }
            }
        }
        m.pending.clear();
    }
    for d in &rig.exports {
        d.flush().unwrap();
    }
}

/// After a restart in a write-through mode: every writer's region read, the cache of every
/// export forgotten (the source's bytes from then on), read again; a sector that reads
/// differently was served from a cache that held what the source does not (a write the cut
/// lost on the source, kept in the cache), and would change with no write at its eviction.
fn forget_check(rig: &Rig, c: &mut Counts, what: &str) {
    let read_all = || -> Vec<Vec<u8>> {
        (0..WRITERS)
            .map(|t| {
                let (e, at) = region(t, rig.shape.exports);
                let mut b = vec![0u8; REGION as usize];
                rig.exports[e].read_at(at, &mut b).unwrap();
                b
            })
            .collect()
    };
    let before = read_all();
    for a in &rig.exports {
        a.forget().unwrap();
    }
    let after = read_all();
    for (t, (b, a)) in before.iter().zip(&after).enumerate() {
        for (i, (x, y)) in b
            .chunks(SECT as usize)
            .zip(a.chunks(SECT as usize))
            .enumerate()
        {
            if x != y {
                c.changed_by_forget += 1;
                let s = region(t as u64, rig.shape.exports).1 / SECT + i as u64;
                eprintln!(
                    "{what}: sector {s} read {:?} from the cache, {:?} after forget",
                    decode(s, x),
                    decode(s, y)
                );
            }
        }
    }
    c.forgets += 1;
}

fn run(name: &str, shape: Shape) -> Counts {
    let cuts: u64 = std::env::var("SCE_POWERCUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50);
    let seed0: u64 = std::env::var("SCE_POWERCUT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(44);
    let mut rig = Rig::new(shape);
    let models: Vec<Mutex<Model>> = (0..WRITERS)
        .map(|_| Mutex::new(Model::new((REGION / SECT) as usize)))
        .collect();
    let gen = AtomicU64::new(0);
    let c = Mutex::new(Counts::default());
    let t0 = Instant::now();
    for cycle in 0..=cuts {
        if std::env::var("SCE_POWERCUT_TRACE").is_ok() {
            eprintln!(
                "{name}: cycle {cycle} at {:.1} s, mode {}",
                t0.elapsed().as_secs_f64(),
                rig.mode
            );
        }
        rig.up(cycle == 0);
        trace(|| {
            let w = rig.exports[0].volume().and_then(|v| v.writeback_stats());
            format!("cycle start {cycle} in {}: {w:?}", rig.mode)
        });
        if cycle > 0 {
            let mut cc = c.lock().unwrap();
            verify(&rig, &models, &mut cc, &format!("{name} cut {cycle}"));
            if rig.mode != WriteMode::WriteBack {
                forget_check(&rig, &mut cc, &format!("{name} cut {cycle}"));
            }
        }
        if cycle == cuts {
            break;
        }
        let seed = seed0 * 1000 + cycle;
        let stop = AtomicBool::new(false);
        let mode = Mutex::new(rig.mode);
        let load = Duration::from_millis(100 + seed * 7919 % 400);
        std::thread::scope(|sc| {
            for t in 0..WRITERS {
                let (e, at) = region(t, shape.exports);
                let (dev, m, gen, stop, c) =
                    (&rig.exports[e], &models[t as usize], &gen, &stop, &c);
                sc.spawn(move || writer(dev, at, m, gen, seed * 31 + t, stop, c));
            }
            if shape.switch {
                let (ex, mode, stop, c) = (&rig.exports, &mode, &stop, &c);
                sc.spawn(move || switcher(ex, mode, seed, stop, c));
            }
            std::thread::sleep(load);
            let lent = (rig.exports.iter().filter_map(|a| a.volume()))
                .filter_map(|v| v.writeback_stats())
                .map(|w| (w.log_lends, w.log_lent_bytes))
                .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
            {
                let mut cc = c.lock().unwrap();
                cc.lends += lent.0;
                cc.cuts_lent += (lent.1 > 0) as u64;
            }
            if std::env::var("SCE_POWERCUT_TRACE").is_ok() {
                for a in &rig.exports {
                    if let Some(v) = a.volume() {
                        eprintln!("  before the cut: {:?}", v.writeback_stats());
                    }
                }
            }
            let lost = rig.power.cut(seed);
            c.lock().unwrap().unflushed += lost;
            stop.store(true, Relaxed);
            // The process dies with the power: requests waiting for room give up.
            for a in &rig.exports {
                if let Some(v) = a.live_volume() {
                    v.shutdown();
                }
            }
        });
        rig.mode = *mode.lock().unwrap();
        rig.down();
        c.lock().unwrap().cuts += 1;
    }
    // The end: the power stays; every dirty byte to the sources, which then hold what was
    // read last.
    if let Some(f) = &rig.bad {
        f.clear();
    }
    for d in &rig.exports {
        d.flush_to_source(Watch::never()).unwrap();
    }
    let c = c.into_inner().unwrap();
    for (t, model) in models.iter().enumerate() {
        let (e, at) = region(t as u64, shape.exports);
        let src = rig.devs[&format!("src{e}")].durable();
        let m = model.lock().unwrap();
        for i in 0..(REGION / SECT) as usize {
            let s = at / SECT + i as u64;
            let b = &src[(s * SECT) as usize..((s + 1) * SECT) as usize];
            assert_eq!(
                decode(s, b),
                Some(m.base[i]),
                "{name}: the source's sector {s} after flush --to-source"
            );
        }
    }
    println!(
        "power cuts, {name}: {} cuts in {:.0} s, {} sectors checked: {} stale, {} garbage, {} EIO; {} writes ({} FUA, {} discards), {} FLUSHes; unflushed writes at the cuts: {} kept, {} dropped, {} torn at {} bytes; {} mode switches ({} refused or cut short); {} restarts in write-through read, forgotten and read again: {} sectors changed; {} chunks of read slots lent to the log, {} cuts with some lent",
        c.cuts, t0.elapsed().as_secs_f64(), c.sectors, c.stale, c.garbage, c.eio, c.writes, c.fua, c.discards, c.flushes,
        c.unflushed.kept, c.unflushed.dropped, c.unflushed.torn, shape.grain, c.switches, c.switch_failures, c.forgets, c.changed_by_forget,
        c.lends, c.cuts_lent
    );
    assert!(
        c.writes > 0 && c.flushes > 0 && c.unflushed.torn > 0,
        "{c:?}"
    );
    assert_eq!((c.stale, c.garbage, c.eio), (0, 0, 0), "{name}: {c:?}");
    assert_eq!(c.changed_by_forget, 0, "{name}: {c:?}");
    c
}

#[test]
fn power_cuts_in_write_back_lose_nothing_flushed() {
    let c = run(
        "write-back",
        Shape {
            exports: 1,
            switch: false,
            bad_block: false,
            grain: 512,
            source_ms: 0,
            start: WriteMode::WriteBack,
        },
    );
    // The 2 MiB log outgrows its own region: cuts find chunks of read slots lent to it
    // (format 9), whose restarts replay them.
    assert!(c.lends > 0 && c.cuts_lent > 0, "{c:?}");
}

#[test]
fn power_cuts_in_write_through_lose_nothing_flushed() {
    let c = run(
        "write-through",
        Shape {
            exports: 1,
            switch: false,
            bad_block: false,
            grain: 512,
            // Source writes slower than the cache copies beside them (AWT): a metadata round
            // finds the copies done before the source has flushed the writes they copy.
            source_ms: 2,
            start: WriteMode::Awt,
        },
    );
    assert!(c.forgets > 0, "{c:?}");
}

#[test]
fn power_cuts_amid_live_mode_switches_lose_nothing_flushed() {
    let c = run(
        "mode switches",
        Shape {
            exports: 1,
            switch: true,
            bad_block: false,
            grain: 4096,
            // A slow source: drains take long enough for writes to wait for room in them
            // (a write that took log positions after a drain found its range clean was
            // dropped by the drain's end; ~half of 100-cut runs found it stale).
            source_ms: 10,
            start: WriteMode::WriteBack,
        },
    );
    assert!(c.switches > 0, "no switch went through: {c:?}");
}

#[test]
fn power_cuts_with_two_exports_on_one_cache_device_lose_nothing_flushed() {
    run(
        "two exports",
        Shape {
            exports: 2,
            switch: false,
            bad_block: false,
            grain: 512,
            source_ms: 0,
            start: WriteMode::WriteBack,
        },
    );
}

#[test]
fn power_cuts_with_a_source_block_that_fails_writes_lose_nothing_flushed() {
    run(
        "a failing source block",
        Shape {
            exports: 1,
            switch: false,
            bad_block: true,
            grain: 512,
            source_ms: 0,
            start: WriteMode::WriteBack,
        },
    );
}
