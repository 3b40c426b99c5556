//! `ShardMap`: a volume cut into shards by fragment, each an ordinary [`CacheCore`] of its
//! own, so that a multi-threaded driver can lock them independently.
//!
//! The source is striped over the shards in stripes of one heat region (`heat_size` bytes;
//! one fragment unless fragments are lines of a larger region): stripe `r` belongs to shard
//! `r % n`, so a hot area spreads over every shard while each region, whose heat decides what
//! is populated, stays whole in one. Shard `k` sees its stripes compacted, as a source of its
//! own: its local stripe `r / n` is global stripe `r`, so the byte at global offset `o` is at
//! local offset `(r / n) * stripe + o % stripe`, and fragments keep their order within it. Shard `k` owns a contiguous
//! range of the cache's slots, `[base(k), base(k + 1))`; its local slot `s` is global slot
//! `base(k) + s`, and local cache offsets shift by `base(k) * fragment_size`.
//!
//! The map is pure arithmetic, like the core: it does no I/O and holds no lock. A request is
//! cut into [`Piece`]s, one per fragment (with one shard, one piece: the whole request), each
//! of which lies in one shard and maps contiguously to its local source; plans made by a
//! shard's core are translated back to global addresses with [`ShardMap::globalize_plan`]
//! and the `to_global_*` methods. With one shard every translation is the identity and the
//! shard's core is the volume's core, configured as given.

use crate::addr::{CacheOffset, FragNo, SlotNo, SourceOffset};
use crate::cache::{CacheCore, PopulationJob, ReadPlan, RunTarget};
use crate::config::{ConfigError, CoreConfig};

/// Core shards of `core_shards: 0` (automatic) on a large enough cache.
pub const AUTO_CORE_SHARDS: usize = 4;
/// `core_shards: 0` gives each automatic shard at least this many slots.
pub const MIN_SLOTS_PER_AUTO_SHARD: u64 = 64;

/// The shards asked for with `core_shards` on a cache of `slots` slots: 0 is the automatic
/// choice, [`AUTO_CORE_SHARDS`], fewer if the cache holds fewer than
/// [`MIN_SLOTS_PER_AUTO_SHARD`] slots per shard; any other number is taken as asked
/// ([`ShardMap::new`] clamps it further). The server and the simulator both use it.
pub fn shards_for(core_shards: usize, slots: u64) -> usize {
    match core_shards {
        0 => (slots / MIN_SLOTS_PER_AUTO_SHARD).clamp(1, AUTO_CORE_SHARDS as u64) as usize,
        n => n,
    }
}

/// A volume's cut into shards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMap {
    n: u64,
    /// log2 of the fragment (slot) size.
    shift: u32,
    /// log2 of the stripe (the heat region, at least one fragment).
    stripe: u32,
    source_size: u64,
    /// `n + 1` entries: shard `k` owns global slots `[base[k], base[k + 1])`.
    base: Box<[u32]>,
}

/// One piece of a request: the part that lies in one fragment (or, with one shard, the
/// whole request).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The shard it belongs to.
    pub shard: usize,
    /// Its global source offset.
    pub offset: u64,
    /// Its offset on the shard's local source.
    pub local: u64,
    /// Its length.
    pub len: u64,
    /// Its offset within the request.
    pub buf_offset: u64,
}

impl ShardMap {
    /// Cuts a volume of `source_size` bytes cached in `slots` slots of `fragment_size` bytes
    /// into `wanted` shards, or fewer: never more than `slots / 2` (a shard needs two slots)
    /// nor more than the source's fragments; at least one.
    pub fn new(wanted: usize, fragment_size: u64, source_size: u64, slots: u32) -> Self {
        Self::striped(wanted, fragment_size, fragment_size, source_size, slots)
    }

    /// Like [`ShardMap::new`], striped in regions of `heat_size` bytes (a power of two, at
    /// least `fragment_size`): never more shards than the source has regions.
    pub fn striped(
        wanted: usize,
        fragment_size: u64,
        heat_size: u64,
        source_size: u64,
        slots: u32,
    ) -> Self {
        let shift = fragment_size.trailing_zeros();
        let stripe = heat_size.max(fragment_size).trailing_zeros();
        let stripes = source_size.div_ceil(1 << stripe).max(1);
        let n = (wanted as u64).min(slots as u64 / 2).min(stripes).max(1);
        let mut base = Vec::with_capacity(n as usize + 1);
        let (per, extra) = (slots as u64 / n, slots as u64 % n);
        let mut at = 0u64;
        for k in 0..n {
            base.push(at as u32);
            at += per + (k < extra) as u64;
        }
        base.push(at as u32);
        ShardMap {
            n,
            shift,
            stripe,
            source_size,
            base: base.into_boxed_slice(),
        }
    }

    /// The map of a volume of `source_size` bytes on a cache of `cache_size` bytes with
    /// `cfg`, cut as `core_shards` asks ([`shards_for`]). An invalid configuration gets one
    /// shard, so that the core itself reports what is wrong with it.
    pub fn for_cache(
        core_shards: usize,
        cfg: &CoreConfig,
        source_size: u64,
        cache_size: u64,
    ) -> Self {
        let slots = cache_size / cfg.fragment_size.max(1);
        let ok = cfg.validate().is_ok() && slots < u32::MAX as u64;
        ShardMap::striped(
            if ok {
                shards_for(core_shards, slots)
            } else {
                1
            },
            cfg.fragment_size,
            if ok {
                cfg.heat_bytes()
            } else {
                cfg.fragment_size
            },
            source_size,
            slots.min(u32::MAX as u64 - 1) as u32,
        )
    }

    /// Number of shards.
    pub fn shards(&self) -> usize {
        self.n as usize
    }

    /// The slots shard `k` owns.
    pub fn slots(&self, k: usize) -> u32 {
        self.base[k + 1] - self.base[k]
    }

    /// The first global slot shard `k` owns.
    pub fn slot_base(&self, k: usize) -> u32 {
        self.base[k]
    }

    /// The size of shard `k`'s local source: its fragments, compacted (the volume's last
    /// fragment may be partial).
    fn local_source_size(&self, k: usize) -> u64 {
        let fsize = 1u64 << self.stripe;
        let frags = self.source_size.div_ceil(fsize);
        let k = k as u64;
        if k >= frags {
            return 0;
        }
        let count = (frags - 1 - k) / self.n + 1;
        if (frags - 1) % self.n == k {
            (count - 1) * fsize + (self.source_size - (frags - 1) * fsize)
        } else {
            count * fsize
        }
    }

    /// The configuration of shard `k`'s core: `cfg` with its volume-wide budgets (population
    /// rate and floor, endurance, AWT bytes in flight), its hotness window and its sequential
    /// cutoff divided among the shards, since each shard sees `1/n` of the fragments and of
    /// a stream's bytes. With one shard, `cfg` itself.
    pub fn shard_config(&self, cfg: &CoreConfig) -> CoreConfig {
        if self.n == 1 {
            return cfg.clone();
        }
        let n = self.n;
        let part = |x: u64| if x == 0 { 0 } else { (x / n).max(1) };
        let mut c = cfg.clone();
        c.population_rate = part(cfg.population_rate);
        c.population_min_rate = part(cfg.population_min_rate).min(c.population_rate.max(1));
        c.max_cache_writes = cfg.max_cache_writes.map(part);
        c.awt_budget = part(cfg.awt_budget).max(cfg.fragment_size.min(cfg.awt_budget));
        c.hot_window = cfg.hot_window.div_ceil(n as usize).max(1);
        c.sequential_cutoff = cfg.sequential_cutoff.div_ceil(n);
        c
    }

    /// Builds every shard's core for `cfg` and a cache of `cache_size` bytes (with one
    /// shard, exactly `CacheCore::new(cfg, source_size, cache_size)`).
    pub fn build(&self, cfg: &CoreConfig, cache_size: u64) -> Result<Vec<CacheCore>, ConfigError> {
        if self.n == 1 {
            return Ok(vec![CacheCore::new(
                cfg.clone(),
                self.source_size,
                cache_size,
            )?]);
        }
        let c = self.shard_config(cfg);
        (0..self.shards())
            .map(|k| {
                CacheCore::new(
                    c.clone(),
                    self.local_source_size(k),
                    (self.slots(k) as u64) << self.shift,
                )
            })
            .collect()
    }

    /// log2 of the fragments per stripe.
    fn per_stripe(&self) -> u32 {
        self.stripe - self.shift
    }

    /// The shard of global fragment `f`, and its local number there.
    pub fn frag_to_local(&self, f: FragNo) -> (usize, FragNo) {
        let b = self.per_stripe();
        let (r, i) = (f.0 >> b, f.0 & ((1 << b) - 1));
        ((r % self.n) as usize, FragNo(((r / self.n) << b) | i))
    }

    /// Shard `k`'s first local fragment whose global fragment is `g` or after: where a
    /// range of global fragments starting at `g` starts in shard `k`.
    pub fn first_local_from(&self, k: usize, g: FragNo) -> FragNo {
        let b = self.per_stripe();
        let (r, i) = (g.0 >> b, g.0 & ((1 << b) - 1));
        let j = r.saturating_sub(k as u64).div_ceil(self.n);
        if j * self.n + k as u64 == r {
            FragNo((j << b) | i)
        } else {
            FragNo(j << b)
        }
    }

    /// Global fragment of shard `k`'s local fragment `f`.
    pub fn frag_to_global(&self, k: usize, f: FragNo) -> FragNo {
        let b = self.per_stripe();
        let (r, i) = (f.0 >> b, f.0 & ((1 << b) - 1));
        FragNo(((r * self.n + k as u64) << b) | i)
    }

    /// The shard owning global slot `s`, and its local number there.
    pub fn slot_to_local(&self, s: SlotNo) -> (usize, SlotNo) {
        let k = self.base.partition_point(|&b| b <= s.0) - 1;
        (k.min(self.shards() - 1), SlotNo(s.0 - self.base[k]))
    }

    /// Global slot of shard `k`'s local slot `s`.
    pub fn slot_to_global(&self, k: usize, s: SlotNo) -> SlotNo {
        SlotNo(self.base[k] + s.0)
    }

    /// The shard holding global source offset `o`, and the offset on its local source.
    pub fn source_to_local(&self, o: SourceOffset) -> (usize, SourceOffset) {
        let r = o.0 >> self.stripe;
        let within = o.0 & ((1 << self.stripe) - 1);
        (
            (r % self.n) as usize,
            SourceOffset(((r / self.n) << self.stripe) | within),
        )
    }

    /// Global source offset of offset `o` on shard `k`'s local source.
    pub fn source_to_global(&self, k: usize, o: SourceOffset) -> SourceOffset {
        let lr = o.0 >> self.stripe;
        let within = o.0 & ((1 << self.stripe) - 1);
        SourceOffset(((lr * self.n + k as u64) << self.stripe) | within)
    }

    /// Global cache-device offset of shard `k`'s local cache offset `c`.
    pub fn cache_to_global(&self, k: usize, c: CacheOffset) -> CacheOffset {
        CacheOffset(c.0 + ((self.base[k] as u64) << self.shift))
    }

    /// The pieces of a request of `len` bytes at global `offset`: with one shard the request
    /// itself, otherwise one per stripe it covers (none if `len` is 0).
    pub fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + '_ {
        let one = self.n == 1;
        let fsize = 1u64 << self.stripe;
        let end = offset.saturating_add(len);
        let mut at = offset;
        let mut first = true;
        std::iter::from_fn(move || {
            if one {
                let p = first.then_some(Piece {
                    shard: 0,
                    offset,
                    local: offset,
                    len,
                    buf_offset: 0,
                });
                first = false;
                return p;
            }
            if at >= end {
                return None;
            }
            let next = ((at >> self.stripe) + 1) * fsize;
            let b = next.min(end);
            let (shard, local) = self.source_to_local(SourceOffset(at));
            let p = Piece {
                shard,
                offset: at,
                local: local.0,
                len: b - at,
                buf_offset: at - offset,
            };
            at = b;
            Some(p)
        })
    }

    /// Rewrites a population job made by shard `k`'s core to global addresses (its
    /// fragment, slot, source span and cache runs).
    pub(crate) fn globalize_job(&self, k: usize, job: &mut PopulationJob) {
        if self.n == 1 {
            return;
        }
        job.frag = self.frag_to_global(k, job.frag);
        job.slot = self.slot_to_global(k, job.slot);
        job.source = self.source_to_global(k, job.source);
        for r in &mut job.runs {
            r.2 = self.cache_to_global(k, r.2);
        }
    }

    /// Rewrites the runs and fills of a plan made by shard `k`'s core to global addresses.
    /// The plan must come from one piece (contiguous on the local source).
    ///
    /// Raw: the property tests only; drivers use [`crate::PinnedRead::globalize`] or
    /// [`crate::ShardedCore::begin_read`].
    #[doc(hidden)]
    pub fn globalize_plan(&self, k: usize, plan: &mut ReadPlan) {
        if self.n == 1 {
            return;
        }
        for r in &mut plan.runs {
            r.target = match r.target {
                RunTarget::Source(s) => RunTarget::Source(self.source_to_global(k, s)),
                RunTarget::Cache(c) => RunTarget::Cache(self.cache_to_global(k, c)),
            };
        }
        for f in &mut plan.fills {
            f.cache = self.cache_to_global(k, f.cache);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_is_the_identity() {
        let m = ShardMap::new(1, 1 << 20, 10 << 20, 8);
        assert_eq!(m.shards(), 1);
        assert_eq!(m.local_source_size(0), 10 << 20);
        assert_eq!(
            m.source_to_local(SourceOffset(12345)),
            (0, SourceOffset(12345))
        );
        assert_eq!(m.slot_to_local(SlotNo(7)), (0, SlotNo(7)));
        let p: Vec<_> = m.pieces(4096, 3 << 20).collect();
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].offset, p[0].local, p[0].len), (4096, 4096, 3 << 20));
    }

    #[test]
    fn shards_are_clamped_to_slots_and_fragments() {
        assert_eq!(ShardMap::new(8, 1 << 20, 100 << 20, 6).shards(), 3);
        assert_eq!(ShardMap::new(8, 1 << 20, 2 << 20, 100).shards(), 2);
        assert_eq!(ShardMap::new(0, 1 << 20, 2 << 20, 100).shards(), 1);
    }

    #[test]
    fn translations_round_trip_and_sizes_add_up() {
        let fs = 4096u64;
        let size = 10 * fs + 1536;
        let m = ShardMap::new(3, fs, size, 7);
        assert_eq!((0..3).map(|k| m.slots(k)).sum::<u32>(), 7);
        assert_eq!((0..3).map(|k| m.local_source_size(k)).sum::<u64>(), size);
        for o in (0..size).step_by(512) {
            let (k, l) = m.source_to_local(SourceOffset(o));
            assert_eq!(k as u64, (o / fs) % 3);
            assert!(l.0 < m.local_source_size(k));
            assert_eq!(m.source_to_global(k, l), SourceOffset(o));
        }
        for s in 0..7 {
            let (k, l) = m.slot_to_local(SlotNo(s));
            assert!(l.0 < m.slots(k));
            assert_eq!(m.slot_to_global(k, l), SlotNo(s));
        }
        let p: Vec<_> = m.pieces(fs - 512, fs + 1024).collect();
        assert_eq!(p.len(), 3);
        assert_eq!(p.iter().map(|p| p.len).sum::<u64>(), fs + 1024);
        assert_eq!((p[1].shard, p[1].local, p[1].buf_offset), (1, 0, 512));
        assert_eq!(m.pieces(0, 0).count(), 0);
    }

    #[test]
    fn striped_by_region_keeps_each_region_in_one_shard() {
        let (fs, heat) = (4096u64, 16384u64);
        let size = 23 * fs + 1024;
        let m = ShardMap::striped(3, fs, heat, size, 9);
        assert_eq!((0..3).map(|k| m.local_source_size(k)).sum::<u64>(), size);
        let frags = size.div_ceil(fs);
        for f in 0..frags {
            let (k, l) = m.frag_to_local(FragNo(f));
            assert_eq!(k as u64, (f * fs / heat) % 3, "fragment {f}");
            assert_eq!(m.frag_to_global(k, l), FragNo(f));
            let (ks, ls) = m.source_to_local(SourceOffset(f * fs + 512));
            assert_eq!((ks, ls.0), (k, l.0 * fs + 512));
            assert_eq!(m.source_to_global(k, ls), SourceOffset(f * fs + 512));
            for j in 0..3 {
                // The first local fragment at or after global f, by brute force.
                let want = (0..frags)
                    .filter(|&g| g >= f && m.frag_to_local(FragNo(g)).0 == j)
                    .map(|g| m.frag_to_local(FragNo(g)).1 .0)
                    .min();
                let got = m.first_local_from(j, FragNo(f)).0;
                if let Some(w) = want {
                    assert_eq!(got, w, "shard {j} from {f}");
                }
            }
        }
        let p: Vec<_> = m.pieces(heat - 512, heat + 1024).collect();
        assert_eq!(p.len(), 3);
        assert_eq!((p[1].shard, p[1].local, p[1].len), (1, 0, heat));
    }
}
