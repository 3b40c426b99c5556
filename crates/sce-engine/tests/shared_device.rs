//! Several volumes on one cache device: they share its slots, each keeps its own entry in
//! the volume table, a restart brings every one back warm, and forgetting one (at runtime,
//! or at start because its source changed) leaves the others' cached data alone.

mod common;

use common::random_source;
use sce_core::CoreConfig;
use sce_engine::{CacheVolume, EngineConfig, PersistConfig, VolumePart};
use sce_io::{AlignedBuf, BlockDevice, MemDevice};
use std::sync::Arc;
use std::time::Duration;

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

fn config() -> EngineConfig {
    let mut p = PersistConfig::new("unused: the parts name the volumes");
    p.flush_interval = Duration::from_millis(200);
    EngineConfig {
        core: CoreConfig {
            fragment_size: 64 * KIB,
            ..CoreConfig::default()
        },
        background_population: false,
        persist: Some(p),
        ..EngineConfig::default()
    }
}

fn parts(a: &Arc<MemDevice>, b: &Arc<MemDevice>, gen_a: &str) -> Vec<VolumePart> {
    vec![
        VolumePart {
            source_generation: Some(gen_a.into()),
            ..VolumePart::new("volume-a", a.clone())
        },
        VolumePart::new("volume-b", b.clone()),
    ]
}

/// Reads every 16 KiB block of volume `k` through the cache and checks it against its
/// source.
fn read_check(vol: &CacheVolume, k: usize, source: &dyn BlockDevice) {
    let at = vol.volumes()[k].1.clone();
    let mut a = AlignedBuf::new(16 * KIB as usize);
    let mut b = AlignedBuf::new(16 * KIB as usize);
    let mut off = 0;
    while off < at.size {
        let n = (at.size - off).min(16 * KIB) as usize;
        vol.read_at(at.base + off, &mut a[..n]).unwrap();
        source.read_at(off, &mut b[..n]).unwrap();
        assert!(a[..n] == b[..n], "volume {k}: stale or wrong data at {off}");
        off += n as u64;
    }
}

/// Bytes of volume `k` the cache holds.
fn cached(vol: &CacheVolume, k: usize) -> u64 {
    let at = vol.volumes()[k].1.clone();
    let len = (at.size.div_ceil(4096) * 4096).min(vol.size() - at.base);
    vol.exists(at.base, len).unwrap().iter().map(|e| e.1).sum()
}

/// The read hit ratio of one pass over volume `k`.
fn hit_ratio(vol: &CacheVolume, k: usize, source: &dyn BlockDevice) -> f64 {
    let s0 = vol.stats();
    read_check(vol, k, source);
    vol.stats().delta(&s0).read_hit_ratio()
}

#[test]
fn two_volumes_share_a_device_survive_a_restart_and_are_forgotten_one_at_a_time() {
    // Sizes that are no multiples of the fragment: the second volume starts at the next
    // fragment boundary, and the last one ends inside a page.
    let a = random_source(3 * MIB + 12 * KIB, 1);
    let b = random_source(2 * MIB + 1024, 2);
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(16 * MIB));
    {
        let vol = CacheVolume::open_shared(parts(&a, &b, "1"), cache.clone(), config()).unwrap();
        let v = vol.volumes();
        assert_eq!(v[0].1.base, 0);
        assert_eq!(v[1].1.base, 3 * MIB + 64 * KIB, "fragment-aligned");
        read_check(&vol, 0, &*a);
        read_check(&vol, 1, &*b);
        vol.populate_now(10_000);
        // A write through the cache to each volume lands on its own source.
        let w = vec![0x5a; 8192];
        vol.write_at(v[0].1.base + 4096, &w).unwrap();
        vol.write_at(v[1].1.base + 2 * MIB - 8192, &w).unwrap();
        vol.flush().unwrap();
        let mut got = vec![0; 8192];
        a.read_at(4096, &mut got).unwrap();
        assert_eq!(got, w);
        b.read_at(2 * MIB - 8192, &mut got).unwrap();
        assert_eq!(got, w);
        assert!(hit_ratio(&vol, 0, &*a) > 0.99 && hit_ratio(&vol, 1, &*b) > 0.99);
        assert!(vol.shutdown());
    }
    // The device's table holds both; `check` finds both clean and their data sound.
    let report = sce_store::check(&*cache, true).unwrap();
    assert_eq!(report.volumes.len(), 2, "{report:?}");
    assert!(!report.damaged(), "{report:?}");
    assert!(report.data_pages_checked > 1000, "{report:?}");
    // A restart brings both back warm.
    let vol = CacheVolume::open_shared(parts(&a, &b, "1"), cache.clone(), config()).unwrap();
    let p = vol.persist_stats().unwrap();
    assert!(p.fragments_restored > 80, "{p:?}");
    assert!(p.invalidated_because.is_empty(), "{p:?}");
    let (ra, rb) = (hit_ratio(&vol, 0, &*a), hit_ratio(&vol, 1, &*b));
    assert!(ra > 0.99 && rb > 0.99, "warm after restart: {ra} {rb}");
    // Forget volume a at runtime: b keeps every cached byte and its hit ratio.
    let b_cached = cached(&vol, 1);
    let (bytes, errors) = vol.forget_volume(0).unwrap();
    assert!(bytes > 3 * MIB && errors == 0, "{bytes} {errors}");
    assert_eq!(cached(&vol, 0), 0);
    assert_eq!(cached(&vol, 1), b_cached);
    assert!(hit_ratio(&vol, 1, &*b) > 0.99);
    // Volume a's source changes behind the cache's back after it is cached again; the
    // operator says so with a new generation string.
    read_check(&vol, 0, &*a);
    vol.populate_now(10_000);
    assert!(cached(&vol, 0) > 3 * MIB);
    drop(vol);
    a.write_at(0, &[0xee; 65536]).unwrap();
    let vol = CacheVolume::open_shared(parts(&a, &b, "2"), cache.clone(), config()).unwrap();
    let p = vol.persist_stats().unwrap();
    assert!(
        p.invalidated_because.starts_with("volume-a: "),
        "only a is dropped: {p:?}"
    );
    assert_eq!(cached(&vol, 0), 0, "nothing of a comes back");
    assert!(cached(&vol, 1) >= b_cached, "b comes back whole");
    read_check(&vol, 0, &*a);
    assert!(hit_ratio(&vol, 1, &*b) > 0.99);
    drop(vol);
    // A start without volume b drops what the device held for b (its slots will be reused
    // untracked); a start with b again finds nothing of it.
    let one = vec![parts(&a, &b, "2").remove(0)];
    drop(CacheVolume::open_shared(one, cache.clone(), config()).unwrap());
    let vol = CacheVolume::open_shared(parts(&a, &b, "2"), cache.clone(), config()).unwrap();
    assert_eq!(cached(&vol, 1), 0);
    read_check(&vol, 1, &*b);
}

#[test]
fn a_device_of_other_volumes_is_refused() {
    let a = random_source(MIB, 1);
    let b = random_source(MIB, 2);
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    drop(CacheVolume::open_shared(parts(&a, &b, "1"), cache.clone(), config()).unwrap());
    let mut other = parts(&a, &b, "1");
    other[0].name = "volume-c".into();
    other[1].name = "volume-d".into();
    let e = CacheVolume::open_shared(other, cache.clone(), config()).unwrap_err();
    assert!(e.to_string().contains("belongs to another source"), "{e}");
    // A volume of another size is refused by name.
    let small = random_source(MIB / 2, 3);
    let e = CacheVolume::open_shared(parts(&small, &b, "1"), cache, config()).unwrap_err();
    assert!(e.to_string().contains("volume-a"), "{e}");
}

/// A volume with a share holds at most its share of the slots however hard it is read,
/// and takes its new fragments' slots from its own; the other volume, uncapped, gets the
/// rest, and the capped one's data stays correct.
#[test]
fn a_share_caps_a_volume_and_leaves_the_rest_to_the_others() {
    let a = random_source(8 * MIB, 1);
    let b = random_source(4 * MIB, 2);
    // 32 slots of 64 KiB (with its metadata, the device holds a little less).
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(2 * MIB + 256 * KIB));
    let mut p = parts(&a, &b, "1");
    p[0].share = Some(0.25);
    let vol = CacheVolume::open_shared(p, cache, config()).unwrap();
    let total = vol.stats().total_slots;
    assert!(total >= 24, "{total} slots");
    // Volume a, four times the whole cache, read over and over.
    for _ in 0..4 {
        read_check(&vol, 0, &*a);
        vol.populate_now(10_000);
    }
    let used = vol.share_used();
    let shards = vol.core_shards() as u64;
    let cap = (total as f64 * 0.25) as u64 + shards;
    println!(
        "{total} slots; volume a (share 25%) holds {}, cap {cap}",
        used[0]
    );
    assert!(
        used[0] > 0 && used[0] <= cap,
        "a holds {} slots, cap {cap}",
        used[0]
    );
    assert!(
        vol.stats().free_slots >= total - cap,
        "the rest stays free for the others"
    );
    // Volume b takes the rest.
    for _ in 0..3 {
        read_check(&vol, 1, &*b);
        vol.populate_now(10_000);
    }
    let used = vol.share_used();
    assert!(
        used[1] >= total - cap - shards,
        "b holds {} of {total}",
        used[1]
    );
    assert!(used[0] <= cap);
    read_check(&vol, 0, &*a);
    read_check(&vol, 1, &*b);
}

/// A volume detached from its export is not populated again, and a start drops what the
/// device holds for it, whatever its source's identity says (a memory source's does not
/// change when written): writes made while detached never come back as stale reads.
#[test]
fn a_detached_volume_is_never_trusted_again_without_an_attach() {
    let a = random_source(MIB, 1);
    let b = random_source(MIB, 2);
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let vol = CacheVolume::open_shared(parts(&a, &b, "1"), cache.clone(), config()).unwrap();
    read_check(&vol, 0, &*a);
    read_check(&vol, 1, &*b);
    vol.populate_now(10_000);
    assert!(cached(&vol, 0) > 0);
    // Detach a: marked, then forgotten; populations find nothing of it to do, however hot
    // it was (its fragments are read again first, and their pages dropped, so that the
    // population window wants them).
    vol.evict(0, MIB).unwrap();
    read_check(&vol, 0, &*a);
    read_check(&vol, 0, &*a);
    vol.set_detached(0, true).unwrap();
    vol.forget_volume(0).unwrap();
    read_check(&vol, 1, &*b);
    vol.populate_now(10_000);
    assert_eq!(cached(&vol, 0), 0, "a detached volume was populated");
    // While detached, a's source is written behind the cache's back; b is written through it.
    a.write_at(0, &[0x77; 65536]).unwrap();
    let w = vec![0x11; 8192];
    vol.write_at(vol.volumes()[1].1.base, &w).unwrap();
    drop(vol);
    let vol = CacheVolume::open_shared(parts(&a, &b, "1"), cache.clone(), config()).unwrap();
    let p = vol.persist_stats().unwrap();
    assert!(
        p.invalidated_because.contains("detached"),
        "a start must drop the detached volume: {p:?}"
    );
    assert_eq!(cached(&vol, 0), 0);
    read_check(&vol, 0, &*a);
    read_check(&vol, 1, &*b);
    drop(vol);
    // The same for a volume alone on its device.
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    let mut one = config();
    one.persist.as_mut().unwrap().volume_name = "alone".into();
    let vol = CacheVolume::open(a.clone(), cache.clone(), one.clone()).unwrap();
    read_check(&vol, 0, &*a);
    vol.populate_now(10_000);
    assert!(cached(&vol, 0) > 0);
    vol.set_detached(0, true).unwrap();
    assert!(vol.shutdown(), "left clean");
    drop(vol);
    a.write_at(65536, &[0x55; 65536]).unwrap();
    let vol = CacheVolume::open(a.clone(), cache.clone(), one.clone()).unwrap();
    assert!(vol
        .persist_stats()
        .unwrap()
        .invalidated_because
        .contains("detached"));
    read_check(&vol, 0, &*a);
    // An attach that knows nothing was written keeps it warm.
    vol.populate_now(10_000);
    vol.set_detached(0, true).unwrap();
    drop(vol);
    one.persist.as_mut().unwrap().reattach = true;
    let vol = CacheVolume::open(a.clone(), cache, one).unwrap();
    let p = vol.persist_stats().unwrap();
    assert!(
        p.invalidated_because.is_empty() && p.fragments_restored > 0,
        "{p:?}"
    );
    read_check(&vol, 0, &*a);
}

/// Only a volume the cache wrote has its identity recorded: a write through the cache to
/// one volume must not make the device vouch for another volume's source that someone
/// else changed meanwhile (a file's identity changes with every write).
#[test]
fn writes_to_one_volume_never_vouch_for_another() {
    use sce_io::{DirectMode, FileDevice, FileOptions};
    use std::os::unix::fs::FileExt;
    let d = tempfile::tempdir().unwrap();
    let file = |name: &str, fill: u8| {
        let p = d.path().join(name);
        std::fs::write(&p, vec![fill; MIB as usize]).unwrap();
        let opts = FileOptions {
            direct: DirectMode::Off,
            ..FileOptions::default()
        };
        let dev: Arc<dyn BlockDevice> = Arc::new(FileDevice::open(&p, &opts).unwrap());
        (p, dev)
    };
    let (pa, a) = file("a", 1);
    let (_, b) = file("b", 2);
    let parts = || {
        vec![
            VolumePart::new("a", a.clone()),
            VolumePart::new("b", b.clone()),
        ]
    };
    let cache: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(8 * MIB));
    drop(CacheVolume::open_shared(parts(), cache.clone(), config()).unwrap());
    let vol = CacheVolume::open_shared(parts(), cache.clone(), config()).unwrap();
    read_check(&vol, 0, &*a);
    read_check(&vol, 1, &*b);
    vol.populate_now(10_000);
    assert!(cached(&vol, 0) > 0);
    // Someone else writes a's file; the cache writes b's.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pa)
        .unwrap()
        .write_all_at(&[9; 4096], 0)
        .unwrap();
    vol.write_at(vol.volumes()[1].1.base, &[3; 4096]).unwrap();
    drop(vol);
    let vol = CacheVolume::open_shared(parts(), cache, config()).unwrap();
    let why = vol.persist_stats().unwrap().invalidated_because;
    assert!(
        why.starts_with("a: the source changed"),
        "a's change must be found at the start: {why:?}"
    );
    read_check(&vol, 0, &*a);
    read_check(&vol, 1, &*b);
}
