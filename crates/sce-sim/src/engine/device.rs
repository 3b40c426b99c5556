//! The modelled devices and the latency histogram of the simulations.

/// A device: per-I/O latency plus transfer time, with `channels` I/Os served at once.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceModel {
    /// Latency of a read, nanoseconds.
    pub read_ns: u64,
    /// Read bandwidth, bytes per second.
    pub read_bw: u64,
    /// Latency of a write, nanoseconds.
    pub write_ns: u64,
    /// Write bandwidth, bytes per second.
    pub write_bw: u64,
    /// I/Os served at once.
    pub channels: usize,
}

impl DeviceModel {
    /// Mercury's Table I "SSD Y": random read 240 µs at 110 MB/s, random write 225 µs at
    /// 39 MB/s; 8 channels.
    pub fn mercury_ssd() -> Self {
        DeviceModel {
            read_ns: 240_000,
            read_bw: 110_000_000,
            write_ns: 225_000,
            write_bw: 39_000_000,
            channels: 8,
        }
    }
    /// A disk-backed volume: 5 ms per I/O, 100 MB/s, 4 at once.
    pub fn disk() -> Self {
        DeviceModel {
            read_ns: 5_000_000,
            read_bw: 100_000_000,
            write_ns: 5_000_000,
            write_bw: 100_000_000,
            channels: 4,
        }
    }
}

/// The state of a modelled device: when each channel is next free, and how long it has been
/// busy. Both the engine and the reference policies of a [`crate::layers::Stack`] use it.
#[derive(Debug)]
pub(crate) struct Device {
    model: DeviceModel,
    free_at: Vec<u64>,
    /// Service time of every I/O issued so far, summed over the channels, nanoseconds.
    busy_ns: u64,
}

impl Device {
    pub(crate) fn new(model: DeviceModel) -> Self {
        let n = model.channels.max(1);
        Device {
            model,
            free_at: vec![0; n],
            busy_ns: 0,
        }
    }
    /// Issues an I/O at `now`; returns its completion time.
    pub(crate) fn io(&mut self, now: u64, bytes: u64, write: bool) -> u64 {
        let (lat, bw) = if write {
            (self.model.write_ns, self.model.write_bw)
        } else {
            (self.model.read_ns, self.model.read_bw)
        };
        let service = lat + bytes.saturating_mul(1_000_000_000) / bw.max(1);
        let (i, &free) = self
            .free_at
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .expect("channels >= 1");
        let done = free.max(now) + service;
        self.free_at[i] = done;
        self.busy_ns = self.busy_ns.saturating_add(service);
        done
    }
    /// How long an I/O issued at `now` would wait for a channel: 0 while one is idle.
    pub(crate) fn backlog_ns(&self, now: u64) -> u64 {
        self.free_at
            .iter()
            .min()
            .map_or(0, |&t| t.saturating_sub(now))
    }

    /// Nanoseconds one read of `bytes` takes on this device, without queueing.
    pub(crate) fn read_service_ns(&self, bytes: u64) -> u64 {
        self.model.read_ns + bytes.saturating_mul(1_000_000_000) / self.model.read_bw.max(1)
    }

    /// Busy time per channel so far: the summed service times over the channels. Over a span
    /// of time, this divided by the span is the device's utilization (above 1, the I/O
    /// offered in the span needs more time than the span: it queues).
    pub(crate) fn busy_ns(&self) -> u64 {
        self.busy_ns / self.free_at.len() as u64
    }
}

/// Log-bucketed latency histogram (8 buckets per octave of nanoseconds): bounded memory on
/// any trace length; quantiles are the upper bound of their bucket, within 9%.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyHistogram {
    buckets: Vec<u64>,
    sum: f64,
    n: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram::new()
    }
}

impl LatencyHistogram {
    const PER_OCTAVE: f64 = 8.0;
    /// An empty histogram.
    pub fn new() -> Self {
        LatencyHistogram {
            buckets: vec![0; 64 * 8 + 1],
            sum: 0.0,
            n: 0,
        }
    }
    /// Records one latency of `ns` nanoseconds.
    pub fn record(&mut self, ns: u64) {
        let b = ((ns.max(1) as f64).log2() * Self::PER_OCTAVE) as usize;
        let last = self.buckets.len() - 1;
        self.buckets[b.min(last)] += 1;
        self.sum += ns as f64;
        self.n += 1;
    }
    /// Adds every latency `o` recorded.
    pub fn merge(&mut self, o: &LatencyHistogram) {
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            *a += b;
        }
        self.sum += o.sum;
        self.n += o.n;
    }
    /// Latencies recorded.
    pub fn count(&self) -> u64 {
        self.n
    }
    /// Mean latency, seconds (0 if none was recorded).
    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum / self.n as f64 / 1e9
        }
    }
    /// The `q` quantile, seconds: the upper bound of the bucket that holds it (0 if none).
    pub fn quantile(&self, q: f64) -> f64 {
        let target = (self.n as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (i, &c) in self.buckets.iter().enumerate() {
            seen += c;
            if seen >= target && c > 0 {
                return 2f64.powf((i as f64 + 1.0) / Self::PER_OCTAVE) / 1e9;
            }
        }
        0.0
    }
}

impl super::EngineSim {
    /// Models the I/O of a population job started at `now` (`PopulationJob::len` and
    /// `runs`): the source span is read, then
    /// each run is written to the cache device. Returns when the last of them completes: the
    /// runs go to different channels, so a later run may complete before an earlier one.
    pub(super) fn population_io(
        &mut self,
        now: u64,
        len: u64,
        runs: &[(u64, u64, sce_core::CacheOffset)],
    ) -> u64 {
        let read_done = self.source.io(now, len, false);
        self.res.source_bytes_read += len;
        let mut done = read_done;
        for &(_, l, _) in runs {
            done = done.max(self.ssd.io(read_done, l, true));
            self.res.cache_bytes_written += l;
        }
        done
    }
}
