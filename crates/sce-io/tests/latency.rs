//! `LatencyDevice`: the concurrency bound holds, delays happen (lower bounds only: a loaded
//! machine is slower, never faster), bandwidth is shared, data is real, a panicking inner
//! device does not block the queue.

use sce_io::*;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Counts concurrent operations of the inner device; reads at offset 0 take 2 ms, reads at
/// `PANIC_AT` panic.
struct Probe {
    inner: MemDevice,
    now: AtomicUsize,
    max: AtomicUsize,
}

const PANIC_AT: u64 = 4096;

impl Probe {
    fn new() -> Self {
        Probe {
            inner: MemDevice::new(1 << 20),
            now: AtomicUsize::new(0),
            max: AtomicUsize::new(0),
        }
    }
    fn enter(&self) {
        let n = self.now.fetch_add(1, SeqCst) + 1;
        self.max.fetch_max(n, SeqCst);
    }
}

impl BlockDevice for Probe {
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        512
    }
    fn read_at(&self, o: u64, b: &mut [u8]) -> Result<(), IoError> {
        assert_ne!(o, PANIC_AT, "the probe panics here on purpose");
        self.enter();
        std::thread::sleep(Duration::from_millis(2));
        self.now.fetch_sub(1, SeqCst);
        self.inner.read_at(o, b)
    }
    fn write_at(&self, o: u64, b: &[u8]) -> Result<(), IoError> {
        self.enter();
        std::thread::sleep(Duration::from_millis(2));
        self.now.fetch_sub(1, SeqCst);
        self.inner.write_at(o, b)
    }
    fn flush(&self) -> Result<(), IoError> {
        Ok(())
    }
    fn discard(&self, o: u64, l: u64) -> Result<(), IoError> {
        self.inner.discard(o, l)
    }
}

#[test]
fn concurrency_limit_is_respected() {
    let d = Arc::new(LatencyDevice::new(
        Probe::new(),
        LatencyConfig::disk(Duration::from_millis(3), 3),
    ));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let d = d.clone();
            s.spawn(move || {
                let mut b = vec![0u8; 512];
                for _ in 0..4 {
                    if t % 2 == 0 {
                        d.read_at(0, &mut b).unwrap();
                    } else {
                        d.write_at(8192 * t, &b).unwrap();
                    }
                }
            });
        }
    });
    let max = d.inner().max.load(SeqCst);
    assert!((1..=3).contains(&max), "at most 3 in flight, saw {max}");
    // 32 operations, 3 at a time, each at least 3 ms: at least 11 rounds of 3 ms.
    let e = t0.elapsed();
    assert!(e >= Duration::from_millis(33), "{e:?}");
}

#[test]
fn queued_operations_wait_their_turn() {
    let d = LatencyDevice::new(
        MemDevice::new(1 << 20),
        LatencyConfig::disk(Duration::from_millis(10), 1),
    );
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let d = &d;
            s.spawn(move || d.write_at(i * 4096, &[1u8; 4096]).unwrap());
        }
    });
    let e = t0.elapsed();
    assert!(e >= Duration::from_millis(40), "one at a time: {e:?}");
}

#[test]
fn each_operation_takes_at_least_its_latency() {
    let cfg = LatencyConfig {
        read: Delay::Fixed(Duration::from_millis(15)),
        write: Delay::Uniform {
            min: Duration::from_millis(10),
            max: Duration::from_millis(12),
        },
        flush: Delay::Fixed(Duration::from_millis(20)),
        max_in_flight: 4,
        bandwidth: None,
        seed: 7,
    };
    let d = LatencyDevice::new(MemDevice::new(1 << 20), cfg);
    let timed = |f: &dyn Fn()| {
        let t0 = Instant::now();
        f();
        t0.elapsed()
    };
    let mut b = vec![0u8; 4096];
    for _ in 0..3 {
        let e = timed(&|| d.write_at(0, &[5u8; 4096]).unwrap());
        assert!(e >= Duration::from_millis(10), "write: {e:?}");
        let e = timed(&|| d.discard(8192, 4096).unwrap());
        assert!(
            e >= Duration::from_millis(10),
            "discard takes the write latency: {e:?}"
        );
        let e = timed(&|| d.flush().unwrap());
        assert!(e >= Duration::from_millis(20), "flush: {e:?}");
    }
    let t0 = Instant::now();
    d.read_at(0, &mut b).unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(15),
        "read: {:?}",
        t0.elapsed()
    );
    assert!(b.iter().all(|&x| x == 5), "the data is real");
    d.inner().read_at(0, &mut b).unwrap();
    assert!(b.iter().all(|&x| x == 5), "and stored in the inner device");
    assert_eq!(d.config().seed, 7);
    // Errors of the inner device come through (after their delay).
    assert!(matches!(
        d.read_at(1 << 20, &mut b),
        Err(IoError::OutOfRange { .. })
    ));
}

#[test]
fn exponential_delays_average_near_their_mean() {
    let cfg = LatencyConfig {
        read: Delay::Exponential {
            mean: Duration::from_millis(2),
        },
        ..LatencyConfig::disk(Duration::ZERO, 1)
    };
    let d = LatencyDevice::new(MemDevice::new(1 << 20), cfg);
    let mut b = vec![0u8; 512];
    let t0 = Instant::now();
    for _ in 0..100 {
        d.read_at(0, &mut b).unwrap();
    }
    // The mean of 100 draws is below half the true mean with negligible probability.
    let e = t0.elapsed();
    assert!(e >= Duration::from_millis(100), "{e:?}");
}

#[test]
fn bandwidth_is_shared() {
    let cfg = LatencyConfig {
        bandwidth: Some(64 << 20),
        ..LatencyConfig::disk(Duration::ZERO, 8)
    };
    let d = Arc::new(LatencyDevice::new(MemDevice::new(8 << 20), cfg));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let d = d.clone();
            s.spawn(move || {
                let mut b = AlignedBuf::new(1 << 20);
                d.read_at(i << 20, &mut b).unwrap();
            });
        }
    });
    // 4 MiB over a 64 MiB/s link takes at least 62.5 ms, however many threads.
    let e = t0.elapsed();
    assert!(e >= Duration::from_micros(62_500), "{e:?}");
}

#[test]
fn bandwidth_and_latency_add_up() {
    let cfg = LatencyConfig {
        bandwidth: Some(32 << 20),
        ..LatencyConfig::disk(Duration::from_millis(10), 1)
    };
    let d = LatencyDevice::new(MemDevice::new(4 << 20), cfg);
    let t0 = Instant::now();
    d.write_at(0, &AlignedBuf::new(1 << 20)).unwrap();
    // 1 MiB at 32 MiB/s is 31.25 ms on the link, then 10 ms of latency.
    let e = t0.elapsed();
    assert!(e >= Duration::from_micros(41_250), "{e:?}");
}

#[test]
fn a_panicking_inner_device_does_not_block_the_queue() {
    let d = LatencyDevice::new(Probe::new(), LatencyConfig::disk(Duration::ZERO, 1));
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            let mut b = vec![0u8; 512];
            d.read_at(PANIC_AT, &mut b)
        })
        .join()
    });
    assert!(r.is_err(), "the inner device panicked");
    // With the only slot leaked, this would wait forever.
    let mut b = vec![0u8; 512];
    d.read_at(0, &mut b).unwrap();
}
