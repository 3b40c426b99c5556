//! `Engine`: a cached volume's subsystems, each owning its state, and the few operations
//! that involve several of them (device I/O counted and judged, disabling the cache, the
//! store's rounds). Its fields are private to this file: every other file works through a
//! role or a view built here, a struct of the subsystems it uses ([`Engine::reader`],
//! [`Engine::writer`], [`Engine::populator`], [`Engine::verifier`], [`Engine::log_io`],
//! [`Engine::hit_io`], [`Engine::keeper`], [`Engine::admin`]; docs/ARCHITECTURE.md has the
//! table). Each reaches the engine's judged I/O only through [`DeviceFaults`].
//!
//! | field | owns |
//! |---|---|
//! | `dev` | the source, the cache device, the volumes and their identities (`devices.rs`) |
//! | `cores` | the core's shards, their locks, map, pins and read logs, the clock (`cores.rs`) |
//! | `checks` | page checksums (`checks.rs`) |
//! | `health` | device errors, passthrough (`health.rs`) |
//! | `persist` | the on-device store (`persist/`) |
//! | `counters` | the engine's counters (`stats.rs`) |
//! | `signals` | shutdown and the background threads' wake-ups (here) |
//! | `source_load` | whether the source has room for population (`load.rs`) |

use crate::checks::Checks;
use crate::cores::Cores;
use crate::devices::Devices;
use crate::flusher::Keeper;
use crate::health::Health;
use crate::log::LogIo;
use crate::order::{levels, OrderedMutex};
use crate::persist::{Persist, Ticket};
use crate::population::Populator;
use crate::read::Reader;
use crate::stats::Counters;
use crate::through::{HitIo, Writer};
use crate::verify::Verifier;
use crate::volume::Admin;
use parking_lot::Condvar;
use sce_core::CoreConfig;
use sce_io::IoError;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// What the threads of one cached volume share.
pub(crate) struct Engine {
    dev: Devices,
    cores: Cores,
    /// The volume's core configuration (each shard's is derived from it), as last retuned.
    /// Level `EngineConfig` (`order.rs`): `CacheVolume::retune` holds it while it takes each core
    /// shard in turn, so that two retunes cannot leave the shards differing.
    config: OrderedMutex<levels::EngineConfig, CoreConfig>,
    checks: Checks,
    health: Health,
    persist: Option<Arc<Persist>>,
    counters: Counters,
    signals: Signals,
    /// log2 of the fragment size.
    fshift: u32,
    /// Write-back (through the log): the cache device holds the only copy of dirty data
    /// (disabling the cache keeps the device unmarked, and refuses writes).
    holds_dirty: bool,
    /// The clients' source read latency against its floor (population's gate, with miss
    /// fills).
    source_load: crate::load::SourceLoad,
    /// Reads' inline fills, written after the reads are answered (`fills.rs`).
    fills: crate::fills::FillQueue,
}

/// What `open.rs` builds an engine from (the rest starts empty).
pub(crate) struct EngineParts {
    pub(crate) dev: Devices,
    pub(crate) cores: Cores,
    pub(crate) config: CoreConfig,
    pub(crate) checks: Checks,
    pub(crate) health: Health,
    pub(crate) persist: Option<Arc<Persist>>,
    pub(crate) fshift: u32,
    pub(crate) holds_dirty: bool,
}

/// Shutdown, and the background threads' sleeps and wake-ups (leaf locks).
#[derive(Default)]
pub(crate) struct Signals {
    shutdown: AtomicBool,
    sleep_lock: OrderedMutex<levels::Leaf, ()>,
    wake: Condvar,
    /// Intents were set ahead of need: the intent writer has work.
    intent_pending: OrderedMutex<levels::Leaf, bool>,
    intent_wake: Condvar,
}

impl Signals {
    /// True once the volume is shutting down.
    pub(crate) fn shutting_down(&self) -> bool {
        self.shutdown.load(Relaxed)
    }

    /// Sleeps up to `d`, waking early on shutdown or `wake_all`. False if shutting down.
    pub(crate) fn sleep(&self, d: Duration) -> bool {
        let mut g = self.sleep_lock.lock();
        if self.shutting_down() {
            return false;
        }
        g.wait_for(&self.wake, d);
        !self.shutting_down()
    }

    /// Gives the intent writer work.
    pub(crate) fn want_intents(&self) {
        *self.intent_pending.lock() = true;
        self.intent_wake.notify_one();
    }

    /// Waits until the intent writer has work: false on shutdown.
    pub(crate) fn wait_intent_work(&self) -> bool {
        let mut pending = self.intent_pending.lock();
        while !*pending && !self.shutting_down() {
            pending.wait(&self.intent_wake);
        }
        *pending = false;
        !self.shutting_down()
    }

    /// Starts the shutdown: every thread wakes and ends.
    pub(crate) fn stop(&self) {
        self.shutdown.store(true, Relaxed);
        {
            let _g = self.sleep_lock.lock();
            self.wake.notify_all();
        }
        let _g = self.intent_pending.lock();
        self.intent_wake.notify_all();
    }
}

/// The cache device's I/O as the engine judges it: writes counted, errors counted towards
/// the limit that disables the cache, intents waited for (the cache disabled if they cannot
/// be written). `Engine` implements it; a role holds it as `&dyn DeviceFaults`, so its
/// dependency is this and not the engine.
pub(crate) trait DeviceFaults: Sync {
    /// Counts a failed cache read towards the error limit.
    fn cache_read_failed(&self, e: &IoError);
    /// Counts `n` cache-device errors; disables the cache once they reach the limit.
    fn device_errors(&self, n: u64, what: &str);
    /// Writes to the cache device; false (counted as a device error) if it failed.
    fn cache_write(&self, offset: u64, data: &[u8]) -> bool;
    /// Waits for intents to be durable; false (the cache disabled) if they could not be.
    fn wait_intents(&self, tickets: &[Ticket]) -> bool;
}

impl DeviceFaults for Engine {
    fn cache_read_failed(&self, e: &IoError) {
        Engine::cache_read_failed(self, e);
    }

    fn device_errors(&self, n: u64, what: &str) {
        Engine::device_errors(self, n, what);
    }

    fn cache_write(&self, offset: u64, data: &[u8]) -> bool {
        Engine::cache_write(self, offset, data)
    }

    fn wait_intents(&self, tickets: &[Ticket]) -> bool {
        Engine::wait_intents(self, tickets)
    }
}

impl Engine {
    /// The engine over its subsystems, built by `open.rs`.
    pub(crate) fn new(p: EngineParts) -> Engine {
        Engine {
            dev: p.dev,
            cores: p.cores,
            config: OrderedMutex::new(p.config),
            checks: p.checks,
            health: p.health,
            persist: p.persist,
            counters: Counters::default(),
            signals: Signals::default(),
            fshift: p.fshift,
            holds_dirty: p.holds_dirty,
            source_load: Default::default(),
            fills: Default::default(),
        }
    }

    /// The verifier of cached reads (`verify.rs`), over this engine's subsystems.
    pub(crate) fn verifier(&self) -> Verifier<'_> {
        Verifier {
            dev: &self.dev,
            cores: &self.cores,
            checks: &self.checks,
            counters: &self.counters,
            fshift: self.fshift,
            faults: self,
        }
    }

    /// The writer of the write-through path (`through/write.rs`), over this engine's
    /// subsystems.
    pub(crate) fn writer(&self) -> Writer<'_> {
        Writer {
            dev: &self.dev,
            cores: &self.cores,
            checks: &self.checks,
            counters: &self.counters,
            health: &self.health,
            persist: self.persist.as_deref(),
            signals: &self.signals,
            fshift: self.fshift,
            faults: self,
        }
    }

    /// The reader (`read.rs`), over this engine's subsystems.
    pub(crate) fn reader(&self) -> Reader<'_> {
        Reader {
            verify: self.verifier(),
            health: &self.health,
            persist: self.persist.as_deref(),
            signals: &self.signals,
            source_load: &self.source_load,
            fills: &self.fills,
        }
    }

    /// The populator (`population.rs`), over this engine's subsystems.
    pub(crate) fn populator(&self) -> Populator<'_> {
        Populator {
            dev: &self.dev,
            cores: &self.cores,
            checks: &self.checks,
            counters: &self.counters,
            persist: self.persist.as_deref(),
            fshift: self.fshift,
            faults: self,
            config: &self.config,
            source_load: &self.source_load,
            health: &self.health,
            signals: &self.signals,
        }
    }

    /// What the write-back log (`log/`) works with.
    pub(crate) fn log_io(&self) -> LogIo<'_> {
        LogIo {
            dev: &self.dev,
            cores: &self.cores,
            health: &self.health,
            signals: &self.signals,
            persist: self.persist.as_deref(),
            counters: &self.counters,
            faults: self,
            reader: self.reader(),
            writer: self.writer(),
        }
    }

    /// What a hit through the I/O queue (`through/hits.rs`) works with.
    pub(crate) fn hit_io(&self) -> HitIo<'_> {
        HitIo {
            dev: &self.dev,
            cores: &self.cores,
            checks: &self.checks,
            health: &self.health,
            persist: self.persist.as_deref(),
            signals: &self.signals,
            counters: &self.counters,
            fshift: self.fshift,
        }
    }

    /// What the volume's operator commands and request entry (`volume.rs`, `control.rs`,
    /// `device.rs`) work with.
    pub(crate) fn admin(&self) -> Admin<'_> {
        Admin {
            dev: &self.dev,
            cores: &self.cores,
            config: &self.config,
            checks: &self.checks,
            health: &self.health,
            persist: self.persist.as_deref(),
            counters: &self.counters,
            signals: &self.signals,
            fills: &self.fills,
            fshift: self.fshift,
        }
    }

    /// What the metadata flusher, the intent writer and the fill writers work with
    /// (`flusher.rs`, `fills.rs`).
    pub(crate) fn keeper(&self) -> Keeper<'_> {
        Keeper {
            dev: &self.dev,
            health: &self.health,
            persist: self.persist.as_deref(),
            signals: &self.signals,
            fills: &self.fills,
            fill_parts: (&self.cores, &self.checks, self),
        }
    }

    /// Writes to the cache device; false (counted as a device error) if it failed.
    pub(crate) fn cache_write(&self, offset: u64, data: &[u8]) -> bool {
        match self.dev.cache.write_at(offset, data) {
            Ok(()) => {
                self.counters
                    .cache_bytes_written
                    .fetch_add(data.len() as u64, Relaxed);
                true
            }
            Err(e) => {
                self.counters.cache_write_errors.fetch_add(1, Relaxed);
                self.device_errors(1, &format!("write error: {e}"));
                false
            }
        }
    }

    /// Counts a failed cache read towards the error limit.
    pub(crate) fn cache_read_failed(&self, e: &IoError) {
        self.counters.cache_read_errors.fetch_add(1, Relaxed);
        self.device_errors(1, &format!("read error: {e}"));
    }

    /// Counts `n` cache-device errors; disables the cache once they reach the limit.
    pub(crate) fn device_errors(&self, n: u64, what: &str) {
        let (total, limit) = self.health.count(n);
        if limit {
            self.disable(&format!("{total} cache device errors, the last: {what}"));
        } else {
            self.health.log(what, total);
        }
    }

    /// Disables the cache: from now on I/O passes through to the source.
    pub(crate) fn disable(&self, why: &str) {
        if self.health.enter_passthrough() {
            return;
        }
        if self.holds_dirty {
            // Write-back: the device holds the only copy of the dirty data. It is not marked
            // failed (a restart on a healthy device recovers what it holds, each page checked
            // against its checksum); until then dirty pages read as errors, writes are
            // refused (they could not be recorded), and clean reads go to the source.
            tracing::error!(
                "cache device failed in write-back: writes are refused and reads of data \
                 not yet on the source fail until a restart on a healthy device: {why}"
            );
            self.cores.each_shard(|_, core| {
                core.drop_all();
            });
            return;
        }
        tracing::error!("cache disabled, passing I/O through to the source: {why}");
        if let Some(p) = &self.persist {
            if let Err(e) = p.fail() {
                tracing::error!(
                    "could not mark the cache device failed ({e}); reformat it before reusing it"
                );
            }
        }
        self.cores.each_shard(|_, core| {
            core.drop_all();
        });
    }

    /// Waits for intents to be durable. False if they could not be written: the cache device
    /// failed, and the cache is disabled (so nothing it holds is served or trusted again).
    pub(crate) fn wait_intents(&self, tickets: &[Ticket]) -> bool {
        let Some(p) = &self.persist else { return true };
        match p.sync(tickets) {
            Ok(()) => true,
            Err(e) => {
                self.disable(&format!("cannot write the write-intent bitmap: {e}"));
                false
            }
        }
    }

    /// Runs one metadata flush round now; returns the metadata errors it met (0 without
    /// persistence), a round put off because the source could not flush counted as one:
    /// its records are not durable, and a caller that needs them so must not go on.
    pub(crate) fn flush_metadata(&self) -> u64 {
        let (errors, put_off) = self.metadata_round();
        errors + u64::from(put_off)
    }

    /// The background threads' round: one put off because the source could not flush is
    /// not the cache device's error (the next round writes its records).
    pub(crate) fn flush_metadata_background(&self) -> u64 {
        self.metadata_round().0
    }

    fn metadata_round(&self) -> (u64, bool) {
        match (&self.persist, self.checks.cache()) {
            (Some(p), Some(crcs)) => p.round(&self.cores, crcs, &self.dev, false),
            _ => (0, false),
        }
    }

    /// Clean shutdown of the store (nothing in flight): see `Persist::close`. False without
    /// persistence.
    pub(crate) fn close_store(&self) -> bool {
        let (Some(p), Some(crcs)) = (&self.persist, self.checks.cache()) else {
            return false;
        };
        let (ids, taken) = self.dev.identities();
        let closed = p.close(&self.cores, crcs, &self.dev, &ids);
        if !closed {
            self.dev.restore_written(&taken);
        }
        closed
    }
}
