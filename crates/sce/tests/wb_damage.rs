//! The write-back crash-and-damage loop (issue 27): through the real `sce` binary, write
//! self-describing pages in write-back, FLUSH, SIGKILL, damage one on-device structure (a
//! metadata unit, one record inside a unit, a live journal block, a dirty data page, the
//! newest superblock copy), restart, and classify every written page: its last acknowledged
//! content (NEW), the source's old bytes (SOURCE: a dirty page served stale), a failed read
//! (EIO: lost) or anything else (OTHER). No dirty page may read SOURCE or OTHER, pages lost
//! are bounded by what the damaged structure could vouch for, a start is refused only when
//! both copies of something are gone, and `sce ctl flush --to-source` then gives the source
//! every NEW page and no garbage.
//!
//! `SCE_DAMAGE_ROUNDS` (default 4) rounds per target, `SCE_DAMAGE_SEED` the seed;
//! `SCE_BIN=/path/to/sce` runs another build (an old release) through the same loop.

mod common;
#[path = "wb_damage/device.rs"]
mod device;

use common::blocks::{block, decode, BLOCK};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use sce_io::{AlignedBuf, BlockDevice};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use device::Device;

const MIB: u64 = 1 << 20;
const SOURCE_SIZE: u64 = 64 * MIB;

/// The on-device structure a round damages.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Target {
    Unit,
    Record,
    Journal,
    Page,
    Superblock,
}

const TARGETS: [Target; 5] = [
    Target::Unit,
    Target::Record,
    Target::Journal,
    Target::Page,
    Target::Superblock,
];

/// What one round saw.
#[derive(Default, Debug)]
struct Outcome {
    written: u64,
    new: u64,
    eio: u64,
    source: u64,
    other: u64,
    /// Pages the damaged structure could vouch for, and lost pages outside them.
    vouched: u64,
    eio_outside: u64,
    /// The damaged structure has another sound copy (a format-5 unit or journal block, a
    /// superblock): nothing may be lost.
    repairable: bool,
    /// The restart was refused: its message.
    refused: Option<String>,
    /// After flush --to-source: NEW pages the source misses, lost pages holding garbage.
    source_missing: u64,
    source_garbage: u64,
    flush_failed: Option<String>,
}

impl Outcome {
    fn add(&mut self, o: &Outcome) {
        self.written += o.written;
        self.new += o.new;
        self.vouched += o.vouched;
        self.eio += o.eio;
        self.source += o.source;
        self.other += o.other;
    }
}

/// Self-describing pages, (page, version) each, written by four threads at once (so group
/// commits carry several journal entries).
fn write_pages(c: &sce_nbd::NbdClient, pages: &[(u64, u64)]) {
    std::thread::scope(|sc| {
        for part in pages.chunks(pages.len().div_ceil(4)) {
            sc.spawn(move || {
                let mut b = AlignedBuf::new(BLOCK as usize);
                for &(idx, ver) in part {
                    block(idx, ver, &mut b);
                    c.write_at(idx * BLOCK, &b).unwrap();
                }
            });
        }
    });
}

/// The write phase: pages in a random 2 MiB window (two of the 15 slots: below the
/// cleaner's 20% start, so the data stays dirty; nothing is evicted), half of them written
/// and FLUSHed, then (with `records`) a pause of a few metadata intervals kept busy by
/// reads so the cleaner does not drain it, then the other half, a quarter of all
/// rewritten, and a FLUSH. Returns page -> last version.
fn write_phase(c: &sce_nbd::NbdClient, rng: &mut SmallRng, records: bool) -> BTreeMap<u64, u64> {
    let window = 2 * MIB / BLOCK;
    let first = rng.gen_range(0..SOURCE_SIZE / MIB - 2) * (MIB / BLOCK);
    let n = rng.gen_range(64..=256usize);
    let mut set = BTreeSet::new();
    while set.len() < n {
        set.insert(first + rng.gen_range(0..window));
    }
    let mut pages: Vec<u64> = set.into_iter().collect();
    for i in (1..pages.len()).rev() {
        pages.swap(i, rng.gen_range(0..=i));
    }
    let first_half: Vec<_> = pages[..n / 2].iter().map(|&p| (p, 1)).collect();
    write_pages(c, &first_half);
    c.flush().unwrap();
    if records {
        let mut b = AlignedBuf::new(BLOCK as usize);
        for _ in 0..14 {
            std::thread::sleep(std::time::Duration::from_millis(50));
            c.read_at(pages[0] * BLOCK, &mut b).unwrap();
        }
    }
    let second_half: Vec<_> = pages[n / 2..].iter().map(|&p| (p, 1)).collect();
    write_pages(c, &second_half);
    let again: Vec<_> = pages.iter().step_by(4).map(|&p| (p, 2)).collect();
    write_pages(c, &again);
    let mut last: BTreeMap<u64, u64> = first_half.into_iter().chain(second_half).collect();
    last.extend(again);
    c.flush().unwrap();
    last
}

/// Flips 8 bytes at seeded offsets in `[start, start + len)` of the cache file.
fn flip(cache: &Path, start: u64, len: u64, rng: &mut SmallRng) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(cache)
        .unwrap();
    for _ in 0..8 {
        let off = start + rng.gen_range(0..len);
        let mut b = [0u8];
        f.read_exact_at(&mut b, off).unwrap();
        f.write_all_at(&[b[0] ^ 0xff], off).unwrap();
    }
    f.sync_all().unwrap();
}

/// Reads every written page through the restarted server and classifies it.
fn classify(
    c: &sce_nbd::NbdClient,
    last: &BTreeMap<u64, u64>,
    vouched: &BTreeSet<u64>,
    o: &mut Outcome,
) -> BTreeSet<u64> {
    let mut lost = BTreeSet::new();
    let mut b = AlignedBuf::new(BLOCK as usize);
    for (&p, &v) in last {
        if c.read_at(p * BLOCK, &mut b).is_err() {
            o.eio += 1;
            o.eio_outside += !vouched.contains(&p) as u64;
            lost.insert(p);
            continue;
        }
        match decode(p, &b) {
            Some(got) if got == v => o.new += 1,
            Some(0) => o.source += 1,
            got => {
                o.other += 1;
                println!("    page {p}: read {got:?}, acknowledged version {v}");
            }
        }
    }
    lost
}

/// `sce ctl flush --to-source`, then the source file: every page read NEW must hold its
/// last version, and every lost page the source's old bytes or a version written to it.
fn check_source(
    sock: &Path,
    src: &Path,
    last: &BTreeMap<u64, u64>,
    lost: &BTreeSet<u64>,
    o: &mut Outcome,
) {
    let (ok, out) = common::ctl(sock, &["flush", "--to-source"]);
    if !ok {
        o.flush_failed = Some(out);
        return;
    }
    let source = std::fs::read(src).unwrap();
    for (&p, &v) in last {
        let got = decode(p, &source[(p * BLOCK) as usize..((p + 1) * BLOCK) as usize]);
        if lost.contains(&p) {
            o.source_garbage += !matches!(got, Some(g) if g <= v) as u64;
        } else {
            o.source_missing += (got != Some(v)) as u64;
        }
    }
}

/// One round: write, FLUSH, SIGKILL, damage `t`, restart, read, flush to the source.
fn round(t: Target, r: u32, seed: u64) -> Outcome {
    let mut rng = SmallRng::seed_from_u64(seed);
    let records = r % 2 == 1;
    let d = tempfile::tempdir().unwrap();
    let (src, cache, sock, st) = (
        d.path().join("src"),
        d.path().join("cache"),
        d.path().join("s"),
        d.path().join("st"),
    );
    common::blocks::initial_source(&src, SOURCE_SIZE);
    let (src_s, cache_s, st_s) = (
        src.to_str().unwrap(),
        cache.to_str().unwrap(),
        st.to_str().unwrap(),
    );
    let args = [
        "--source",
        src_s,
        "--cache",
        cache_s,
        "--cache-size",
        "16MiB",
        "--mode",
        "writeback",
        // The slots' structures (a device without a log); the log's damage loop is
        // wb_damage_loop.rs.
        "--writeback-log",
        "0",
        "--state-dir",
        st_s,
        "--metadata-interval",
        // Killed at once: the default 1 s, so the kill usually comes before a flush round
        // wrote records of the writes; else rounds every 250 ms during a pause.
        if records { "250ms" } else { "1s" },
        "--allow-buffered",
    ];
    let s = common::Server::start(&args, &sock);
    let c = common::blocks::client(&sock, 4);
    let last = write_phase(&c, &mut rng, records);
    let dirty = s.export_stats()["writeback_dirty_bytes"]
        .as_u64()
        .unwrap_or(0);
    s.kill();
    drop(c);
    let dev = Device::read(&cache);
    let mut o = Outcome {
        written: last.len() as u64,
        ..Default::default()
    };
    let dmg = device::choose(&dev, t, &last, &mut rng, r);
    let vouched = dmg.as_ref().map(|x| x.vouched.clone()).unwrap_or_default();
    o.vouched = vouched.len() as u64;
    o.repairable =
        dmg.is_some() && (t == Target::Superblock || (t != Target::Page && dev.mirrored()));
    let when = if records {
        "after metadata rounds"
    } else {
        "at once"
    };
    match &dmg {
        Some(x) => flip(&cache, x.start, x.len, &mut rng),
        None => println!("    no {t:?} worth damaging on the device: nothing damaged"),
    }
    println!(
        "  {t:?} round {r} (seed {seed}): {} pages written, {dirty} B dirty, killed {when}; \
         damaged: {}; it could vouch for {} pages",
        o.written,
        dmg.as_ref().map_or("nothing".into(), |x| x.what.clone()),
        o.vouched
    );
    let s = match common::Server::try_start(&args, &sock) {
        Ok(s) => s,
        Err(e) => {
            let tail: Vec<_> = e.lines().rev().take(3).collect();
            o.refused = Some(tail.join(" | "));
            return o;
        }
    };
    let c = common::blocks::client(&sock, 1);
    let lost = classify(&c, &last, &vouched, &mut o);
    drop(c);
    check_source(&sock, &src, &last, &lost, &mut o);
    let _ = s.term();
    o
}

/// What is wrong with a round's outcome, if anything.
fn failures(t: Target, o: &Outcome) -> Vec<String> {
    let mut f = Vec::new();
    if let Some(msg) = &o.refused {
        if t == Target::Superblock || o.repairable || !msg.to_lowercase().contains("damage") {
            f.push(format!("the restart was refused: {msg}"));
        }
        return f;
    }
    if o.source + o.other > 0 {
        f.push(format!(
            "{} dirty pages read the source's old bytes, {} other bytes",
            o.source, o.other
        ));
    }
    if o.eio > o.vouched {
        f.push(format!(
            "{} pages lost, the damage could vouch for {}",
            o.eio, o.vouched
        ));
    }
    if o.repairable && o.eio > 0 {
        f.push(format!(
            "{} pages lost though the damaged copy had a sound twin",
            o.eio
        ));
    }
    if o.eio_outside > 0 {
        f.push(format!(
            "{} lost pages lie outside what the damage vouched for",
            o.eio_outside
        ));
    }
    if let Some(e) = &o.flush_failed {
        f.push(format!("flush --to-source failed: {e}"));
    }
    if o.source_missing + o.source_garbage > 0 {
        f.push(format!(
            "after flush --to-source the source misses {} acknowledged pages that were not lost and holds garbage in {} lost ones",
            o.source_missing, o.source_garbage
        ));
    }
    f
}

#[test]
fn damage_after_a_writeback_crash_loses_at_most_what_it_vouched_for_and_never_serves_stale() {
    let rounds: u32 = common::env_or("SCE_DAMAGE_ROUNDS", 4);
    let seed: u64 = common::env_or("SCE_DAMAGE_SEED", 27);
    println!(
        "write-back damage loop: binary {}, {rounds} rounds per target, seed {seed}",
        common::sce_bin()
    );
    let mut rows = Vec::new();
    let mut bad = Vec::new();
    for (ti, &t) in TARGETS.iter().enumerate() {
        let mut sum = Outcome::default();
        let mut refused = 0;
        for r in 0..rounds {
            let o = round(t, r, seed ^ ((ti as u64) << 32 | r as u64));
            for f in failures(t, &o) {
                println!("    FAIL: {f}");
                bad.push(format!("{t:?} round {r}: {f}"));
            }
            if let Some(m) = &o.refused {
                println!("    refused: {m}");
                refused += 1;
            }
            sum.add(&o);
        }
        rows.push((t, sum, refused));
    }
    println!(
        "{:<11} {:>6} {:>7} {:>6} {:>7} {:>6} {:>6} {:>7} {:>7}",
        "target", "rounds", "written", "NEW", "vouched", "EIO", "SOURCE", "OTHER", "refused"
    );
    for (t, s, refused) in &rows {
        println!(
            "{:<11} {rounds:>6} {:>7} {:>6} {:>7} {:>6} {:>6} {:>7} {refused:>7}",
            format!("{t:?}"),
            s.written,
            s.new,
            s.vouched,
            s.eio,
            s.source,
            s.other
        );
    }
    assert!(
        bad.is_empty(),
        "{} failed rounds:\n{}",
        bad.len(),
        bad.join("\n")
    );
}
