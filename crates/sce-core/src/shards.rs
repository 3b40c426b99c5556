//! `ShardMap`: a volume cut into shards by fragment, each an ordinary [`CacheCore`] of its
//! own, so that a multi-threaded driver can lock them independently.
//!
//! Fragment `f` belongs to shard `f % n` (a stripe of one fragment: a hot region spreads
//! over every shard). Shard `k` sees its fragments compacted, as a source of its own: its
//! local fragment `f / n` is global fragment `f`, so the byte at global offset `o` is at
//! local offset `(f / n) * fragment_size + o % fragment_size`. Shard `k` owns a contiguous
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
use crate::cache::{CacheCore, CleanJob, PopulationJob, ReadPlan, RunTarget, WriteBackPlan};
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
    shift: u32,
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
        let shift = fragment_size.trailing_zeros();
        let frags = source_size.div_ceil(fragment_size).max(1);
        let n = (wanted as u64).min(slots as u64 / 2).min(frags).max(1);
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
        ShardMap::new(
            if ok {
                shards_for(core_shards, slots)
            } else {
                1
            },
            cfg.fragment_size,
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
        let fsize = 1u64 << self.shift;
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

    /// The shard of global fragment `f`, and its local number there.
    pub fn frag_to_local(&self, f: FragNo) -> (usize, FragNo) {
        ((f.0 % self.n) as usize, FragNo(f.0 / self.n))
    }

    /// Shard `k`'s first local fragment whose global fragment is `g` or after: where a
    /// range of global fragments starting at `g` starts in shard `k`.
    pub fn first_local_from(&self, k: usize, g: FragNo) -> FragNo {
        FragNo(g.0.saturating_sub(k as u64).div_ceil(self.n))
    }

    /// Global fragment of shard `k`'s local fragment `f`.
    pub fn frag_to_global(&self, k: usize, f: FragNo) -> FragNo {
        FragNo(f.0 * self.n + k as u64)
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
        let f = o.0 >> self.shift;
        let within = o.0 & ((1 << self.shift) - 1);
        (
            (f % self.n) as usize,
            SourceOffset(((f / self.n) << self.shift) | within),
        )
    }

    /// Global source offset of offset `o` on shard `k`'s local source.
    pub fn source_to_global(&self, k: usize, o: SourceOffset) -> SourceOffset {
        let lf = o.0 >> self.shift;
        let within = o.0 & ((1 << self.shift) - 1);
        SourceOffset(((lf * self.n + k as u64) << self.shift) | within)
    }

    /// Global cache-device offset of shard `k`'s local cache offset `c`.
    pub fn cache_to_global(&self, k: usize, c: CacheOffset) -> CacheOffset {
        CacheOffset(c.0 + ((self.base[k] as u64) << self.shift))
    }

    /// The pieces of a request of `len` bytes at global `offset`: with one shard the request
    /// itself, otherwise one per fragment it covers (none if `len` is 0).
    pub fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = Piece> + '_ {
        let one = self.n == 1;
        let fsize = 1u64 << self.shift;
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
            let next = ((at >> self.shift) + 1) * fsize;
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

    /// Rewrites a cleaning job made by shard `k`'s core to global addresses.
    pub(crate) fn globalize_clean(&self, k: usize, job: &mut CleanJob) {
        if self.n == 1 {
            return;
        }
        job.frag = self.frag_to_global(k, job.frag);
        for r in &mut job.runs {
            *r = (
                self.source_to_global(k, r.0),
                self.cache_to_global(k, r.1),
                r.2,
            );
        }
    }

    /// Rewrites a write-back plan made by shard `k`'s core for a piece at `buf_base` of its
    /// request: global cache offsets, offsets within the whole request.
    pub(crate) fn globalize_writeback(&self, k: usize, buf_base: u64, plan: &mut WriteBackPlan) {
        for c in &mut plan.copies {
            c.cache = self.cache_to_global(k, c.cache);
            c.buf_offset += buf_base;
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
}
