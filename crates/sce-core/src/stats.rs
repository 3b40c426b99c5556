//! Counters kept by the core, and [`stats_table!`](crate::stats_table), the one place a stats struct of sce is
//! written: each figure is one line that gives its field, its JSON name, and, if it is
//! exported to Prometheus, its family (name, kind, unit, HELP). The core's counters count
//! decisions (pages hit, fragments populated); byte counts of device I/O are kept by the
//! driver, which does the I/O.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// How Prometheus reads a figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only grows (its family's name ends in `_total`).
    Counter,
    /// A value now.
    Gauge,
}

impl Kind {
    /// A figure now relative to `then`: a counter's increase, a gauge's value now.
    pub fn delta(self, now: u64, then: u64) -> u64 {
        match self {
            Kind::Counter => now - then,
            Kind::Gauge => now,
        }
    }
}

/// A figure's Prometheus family.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Metric {
    /// The family's name (the unit in it, and `_total` for a counter).
    pub name: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// The base unit the name ends in ("" for a count of things).
    pub unit: &'static str,
    /// The HELP text.
    pub help: &'static str,
    /// Stored units per exported unit (1000 for milliseconds exported as seconds).
    pub per: f64,
}

/// One figure of a stats struct `T`: its JSON name, how to read it, and its Prometheus
/// family if it is exported.
#[derive(Clone, Copy, Debug)]
pub struct Stat<T: 'static> {
    /// The JSON name (the field's name unless the table says otherwise).
    pub key: &'static str,
    /// Reads the figure.
    pub get: fn(&T) -> u64,
    /// Its family, None if it is not exported to Prometheus.
    pub metric: Option<Metric>,
}

impl<T> Stat<T> {
    /// The figure in `t`.
    pub fn value(&self, t: &T) -> u64 {
        (self.get)(t)
    }

    /// The figure in `t` in its family's unit.
    pub fn metric_value(&self, t: &T) -> f64 {
        self.value(t) as f64 / self.metric.map_or(1.0, |m| m.per)
    }
}

/// What a figure's field can hold: read as a number.
pub trait StatValue {
    /// The figure (1 or 0 for a flag).
    fn stat_value(&self) -> u64;
}

impl StatValue for u64 {
    fn stat_value(&self) -> u64 {
        *self
    }
}

impl StatValue for u32 {
    fn stat_value(&self) -> u64 {
        u64::from(*self)
    }
}

impl StatValue for bool {
    fn stat_value(&self) -> u64 {
        u64::from(*self)
    }
}

impl StatValue for AtomicU64 {
    fn stat_value(&self) -> u64 {
        self.load(Relaxed)
    }
}

/// Defines a stats struct from one table: every row is a figure, and everything else is
/// generated from the rows: the struct (each row a `pub` field), `STATS` (the JSON name,
/// reader and Prometheus family of each figure, in row order) and, when asked for after
/// the table, `delta` (`impl delta;`: counters' increase since an earlier snapshot, gauges'
/// value now) and `+=` (`impl add;`: the sum of two disjoint parts). Fields that are no
/// figures follow in an `also { ... }` block, written as in a struct.
///
/// A row: doc comment, `name: Type`, then optionally `= "json_name"`, then optionally the
/// family `, Counter("sce_..._total", "unit", "HELP")` or `, Gauge(...)`, optionally
/// followed by `/ 1e3` (stored units per exported unit); then `;`.
///
/// ```
/// sce_core::stats_table! {
///     /// Example counts.
///     #[derive(Clone, Debug, Default, PartialEq)]
///     pub struct Example {
///         /// Bytes read.
///         read_bytes: u64, Counter("x_read_bytes_total", "bytes", "Bytes read.");
///         /// Slots free now.
///         free: u64 = "free_slots", Gauge("x_free_slots", "", "Free slots.");
///     }
///     impl delta, add;
/// }
/// let (a, b) = (Example { read_bytes: 5, free: 3 }, Example { read_bytes: 2, free: 4 });
/// assert_eq!(a.delta(&b), Example { read_bytes: 3, free: 3 });
/// assert_eq!(Example::STATS[1].key, "free_slots");
/// ```
#[macro_export]
macro_rules! stats_table {
    (
        $(#[$sm:meta])*
        $vis:vis struct $name:ident $rows:tt
        $(also $other:tt)?
        $(impl $($opt:ident),+;)?
    ) => {
        $crate::stats_table!(@struct [$(#[$sm])* $vis struct $name] [$($other)?] $rows);
        $crate::stats_table!(@stats $name $rows);
        $($($crate::stats_table!(@$opt $name $rows);)+)?
    };
    (@struct [$(#[$sm:meta])* $vis:vis struct $name:ident] [$({$($other:tt)*})?] {
        $($(#[$m:meta])* $f:ident : $t:ty $(= $key:literal)?
            $(, $kind:ident ($($family:tt)*) $(/ $per:literal)?)?;)*
    }) => {
        $(#[$sm])*
        $vis struct $name {
            $($(#[$m])* pub $f: $t,)*
            $($($other)*)?
        }
    };
    (@stats $name:ident {
        $($(#[$m:meta])* $f:ident : $t:ty $(= $key:literal)?
            $(, $kind:ident ($pn:literal, $unit:literal, $help:literal $(,)?) $(/ $per:literal)?)?;)*
    }) => {
        impl $name {
            /// Every figure, in table order: its JSON name, how to read it, its family.
            #[allow(dead_code)]
            pub const STATS: &'static [$crate::stats::Stat<$name>] = &[$(
                $crate::stats::Stat {
                    key: $crate::__stats_or!($($key)?, stringify!($f)),
                    get: |s: &$name| $crate::stats::StatValue::stat_value(&s.$f),
                    metric: $crate::__stats_or!($(Some($crate::stats::Metric {
                        name: $pn,
                        kind: $crate::stats::Kind::$kind,
                        unit: $unit,
                        help: $help,
                        per: $crate::__stats_or!($($per)?, 1.0),
                    }))?, None),
                },
            )*];
        }
    };
    (@delta $name:ident {
        $($(#[$m:meta])* $f:ident : $t:ty $(= $key:literal)?
            $(, $kind:ident ($($family:tt)*) $(/ $per:literal)?)?;)*
    }) => {
        impl $name {
            /// The change since `earlier`: counters' increase, gauges' value now.
            pub fn delta(&self, earlier: &$name) -> $name {
                $name {$(
                    $f: $crate::__stats_or!(
                        $($crate::stats::Kind::$kind)?,
                        $crate::stats::Kind::Counter
                    )
                    .delta(self.$f, earlier.$f),
                )*}
            }
        }
    };
    (@carry $name:ident {
        $($(#[$m:meta])* $f:ident : $t:ty $(= $key:literal)?
            $(, $kind:ident ($($family:tt)*) $(/ $per:literal)?)?;)*
    }) => {
        impl $name {
            /// Adds `other`'s counters, not its gauges (a figure without a family counts as
            /// a counter, as in `delta`): the figures of a part that is gone, carried into
            /// those of what replaced it, so that counters only grow.
            pub fn add_counters(&mut self, other: &$name) {
                $(if $crate::__stats_or!(
                    $($crate::stats::Kind::$kind)?,
                    $crate::stats::Kind::Counter
                ) == $crate::stats::Kind::Counter
                {
                    self.$f += other.$f;
                })*
            }
        }
    };
    (@add $name:ident {
        $($(#[$m:meta])* $f:ident : $t:ty $(= $key:literal)?
            $(, $kind:ident ($($family:tt)*) $(/ $per:literal)?)?;)*
    }) => {
        /// Adds a disjoint part's figures, counters and gauges alike.
        impl ::core::ops::AddAssign<&$name> for $name {
            fn add_assign(&mut self, other: &$name) {
                $(self.$f += other.$f;)*
            }
        }
    };
}

/// The first expression if there is one, else the second (for [`stats_table!`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __stats_or {
    (, $b:expr) => {
        $b
    };
    ($a:expr, $b:expr) => {
        $a
    };
}

stats_table! {
    /// Core counters. Monotonic except where noted.
    #[derive(Clone, Debug, Default, PartialEq, Eq)]
    pub struct CoreStats {
        /// Read requests.
        read_requests: u64;
        /// Read requests served entirely from the cache.
        read_requests_full_hit: u64;
        /// 4 KiB pages of reads served from the cache.
        read_pages_hit: u64;
        /// 4 KiB pages of reads served from the source.
        read_pages_missed: u64;
        /// Write requests (including discards).
        write_requests: u64;
        /// Pages touched by writes.
        write_pages: u64;
        /// Populations started (background and inline).
        populations_started: u64;
        /// Populations that completed and validated pages.
        populations_completed: u64;
        /// Populations that failed (source read or cache write error).
        populations_failed: u64;
        /// Pages made valid by population.
        pages_populated: u64;
        /// Fragments evicted from their slot (by the eviction policy, FlashTier's `evict`, or
        /// the cache disabling itself; not by `forget`).
        fragments_evicted: u64;
        /// Fragments dropped by `forget` (an operator said the source changed).
        fragments_forgotten: u64;
        /// Writes that sent a copy to the cache (AWT or synchronous write-through).
        awt_started: u64;
        /// Such writes whose copy completed and re-validated at least one page.
        awt_completed: u64;
        /// Writes that fell back to write-around because the AWT budget was exhausted.
        awt_fallbacks: u64;
        /// Writes that skipped the cache copy because another write or a population was in flight
        /// on the same pages (duplicate-write tracking).
        awt_duplicates: u64;
        /// Cache copies of writes that failed.
        awt_cache_failures: u64;
        /// Source writes that failed.
        source_write_failures: u64;
        /// Pages that a completing write or population could not validate because a concurrent
        /// write touched them.
        pages_spoiled: u64;
        /// Pages invalidated because their cached copy was found bad.
        pages_invalidated: u64;
        /// Candidates refused by the admission duel (not hotter than the fragment they would
        /// evict).
        admissions_rejected: u64;
        /// Requests found to be part of a sequential stream (no heat, no admission, writes
        /// bypass).
        sequential_requests: u64;
        /// Fills from a read miss's own data (admission `sce`): pages the read brought from the
        /// source written to the cache with it, costing the source nothing more.
        miss_fills: u64;
        /// Pages made valid in the page area (single pages of sparse lines, issue 47).
        sparse_pages_filled: u64;
        /// Population picks deferred because the population budget was spent.
        population_budget_waits: u64;
        /// Cache writes (populations, fills, write copies) refused by the endurance budget.
        endurance_refusals: u64;
        /// Bytes the core planned to write to the cache device (populations, fills, copies).
        cache_bytes_planned: u64;
    }
    impl delta, add;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_gives_deltas_sums_and_names() {
        let a = CoreStats {
            read_requests: 7,
            pages_populated: 3,
            ..CoreStats::default()
        };
        let mut b = CoreStats {
            read_requests: 2,
            ..CoreStats::default()
        };
        assert_eq!(a.delta(&b).read_requests, 5);
        assert_eq!(a.delta(&b).pages_populated, 3);
        b += &a;
        assert_eq!((b.read_requests, b.pages_populated), (9, 3));
        let s = &CoreStats::STATS[0];
        assert_eq!((s.key, s.value(&a), s.metric), ("read_requests", 7, None));
        assert_eq!(CoreStats::STATS.len(), 27);
        assert_eq!(Kind::Gauge.delta(4, 9), 4);
    }

    crate::stats_table! {
        /// A counter, a gauge, and a figure with no family (a counter).
        #[derive(Clone, Debug, Default, PartialEq)]
        struct Carried {
            done: u64, Counter("x_done_total", "", "Done.");
            free: u64, Gauge("x_free", "", "Free now.");
            seen: u64;
        }
        impl carry;
    }

    #[test]
    fn carrying_adds_counters_and_keeps_the_live_gauges() {
        let mut live = Carried {
            done: 2,
            free: 5,
            seen: 1,
        };
        let gone = Carried {
            done: 10,
            free: 7,
            seen: 4,
        };
        live.add_counters(&gone);
        assert_eq!(
            live,
            Carried {
                done: 12,
                free: 5,
                seen: 5
            }
        );
    }
}
