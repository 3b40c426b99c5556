//! `LatencyDevice`: wraps a device to behave like a slow SAN volume or disk: a latency per
//! operation (fixed or drawn from a distribution), a bound on operations served at once
//! (more wait in a queue), and optionally a link of limited bandwidth shared by all I/O.

use crate::error::IoError;
use crate::order::{levels, OrderedMutex};
use crate::BlockDevice;
use parking_lot::Condvar;
/// This file's locks are a device's own (`order.rs`).
type Mutex<T> = OrderedMutex<levels::Device, T>;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

/// A latency distribution, sampled once per operation.
#[derive(Clone, Debug, PartialEq)]
pub enum Delay {
    /// No added latency.
    None,
    /// Always this long.
    Fixed(Duration),
    /// Uniform between the bounds (inclusive; `min` if `max <= min`).
    Uniform {
        /// Lower bound.
        min: Duration,
        /// Upper bound.
        max: Duration,
    },
    /// Exponential with this mean.
    Exponential {
        /// Mean.
        mean: Duration,
    },
}

impl Delay {
    fn sample(&self, rng: &mut SmallRng) -> Duration {
        match *self {
            Delay::None => Duration::ZERO,
            Delay::Fixed(d) => d,
            Delay::Uniform { min, max } if max > min => {
                Duration::from_nanos(rng.gen_range(min.as_nanos() as u64..=max.as_nanos() as u64))
            }
            Delay::Uniform { min, .. } => min,
            Delay::Exponential { mean } => {
                let u: f64 = rng.gen_range(f64::EPSILON..1.0);
                Duration::from_secs_f64(-u.ln() * mean.as_secs_f64())
            }
        }
    }
}

/// How slow the wrapped device is.
#[derive(Clone, Debug)]
pub struct LatencyConfig {
    /// Latency of reads.
    pub read: Delay,
    /// Latency of writes (and discards).
    pub write: Delay,
    /// Latency of flushes.
    pub flush: Delay,
    /// Operations served at once (0 counts as 1); callers beyond it wait in a queue, as
    /// requests do on a real device. The latency of an operation starts when it is served.
    pub max_in_flight: usize,
    /// Bytes per second of a link shared by all reads and writes (None = unlimited). An I/O of
    /// `len` bytes reserves the link for `len / bandwidth` seconds, from when the link is free
    /// (queued behind earlier reservations), and completes at the end of its reservation plus
    /// its latency.
    pub bandwidth: Option<u64>,
    /// Seed of the latency draws (one seeded generator shared by all operations).
    pub seed: u64,
}

impl LatencyConfig {
    /// A disk or SAN: a fixed `latency` on every operation, `max_in_flight` served at once,
    /// unlimited bandwidth.
    pub fn disk(latency: Duration, max_in_flight: usize) -> Self {
        LatencyConfig {
            read: Delay::Fixed(latency),
            write: Delay::Fixed(latency),
            flush: Delay::Fixed(latency),
            max_in_flight,
            bandwidth: None,
            seed: 1,
        }
    }
}

/// A device made slow: every operation is performed on the inner device (the data is real)
/// and returns once its emulated service time has passed (measured with `thread::sleep`, so a
/// lower bound). Discards take the write latency and do not use the link.
#[derive(Debug)]
pub struct LatencyDevice<D> {
    inner: D,
    cfg: LatencyConfig,
    in_flight: Mutex<usize>,
    slot_free: Condvar,
    link_free_at: Mutex<Instant>,
    rng: Mutex<SmallRng>,
}

impl<D: BlockDevice> LatencyDevice<D> {
    /// Wraps `inner`, slowed down as `cfg` says.
    pub fn new(inner: D, cfg: LatencyConfig) -> Self {
        LatencyDevice {
            inner,
            rng: Mutex::new(SmallRng::seed_from_u64(cfg.seed)),
            cfg,
            in_flight: Mutex::new(0),
            slot_free: Condvar::new(),
            link_free_at: Mutex::new(Instant::now()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &LatencyConfig {
        &self.cfg
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Runs `f` as one operation of the emulated device: waits for one of `max_in_flight`
    /// slots, reserves the link for `bytes`, performs the operation, and returns no earlier
    /// than the end of the link reservation plus the sampled latency.
    fn with_delay<T>(&self, delay: &Delay, bytes: u64, f: impl FnOnce() -> T) -> T {
        let _slot = self.acquire_slot();
        let latency = delay.sample(&mut self.rng.lock());
        let now = Instant::now();
        let transferred = match self.cfg.bandwidth {
            Some(bw) if bytes > 0 => {
                let transfer = Duration::from_secs_f64(bytes as f64 / bw.max(1) as f64);
                let mut link = self.link_free_at.lock();
                let end = (*link).max(now) + transfer;
                *link = end;
                end
            }
            _ => now,
        };
        let until = transferred + latency;
        let r = f();
        let now = Instant::now();
        if until > now {
            std::thread::sleep(until - now);
        }
        r
    }

    fn acquire_slot(&self) -> Slot<'_> {
        let mut n = self.in_flight.lock();
        while *n >= self.cfg.max_in_flight.max(1) {
            n.wait(&self.slot_free);
        }
        *n += 1;
        Slot {
            in_flight: &self.in_flight,
            slot_free: &self.slot_free,
        }
    }
}

/// One of the `max_in_flight` slots; released on drop, so a panicking inner device does not
/// leave the queue blocked.
struct Slot<'a> {
    in_flight: &'a Mutex<usize>,
    slot_free: &'a Condvar,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        *self.in_flight.lock() -= 1;
        self.slot_free.notify_one();
    }
}

impl<D: BlockDevice> BlockDevice for LatencyDevice<D> {
    // Metadata (extents too): answered without the simulated latency.
    forward_metadata!();
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        let n = buf.len() as u64;
        self.with_delay(&self.cfg.read, n, || self.inner.read_at(offset, buf))
    }
    fn write_at(&self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.with_delay(&self.cfg.write, buf.len() as u64, || {
            self.inner.write_at(offset, buf)
        })
    }
    fn flush(&self) -> Result<(), IoError> {
        self.with_delay(&self.cfg.flush, 0, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), IoError> {
        self.with_delay(&self.cfg.write, 0, || self.inner.discard(offset, len))
    }
}
