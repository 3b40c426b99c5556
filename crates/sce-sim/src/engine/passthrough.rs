//! Reads that pass the cache by: in shared mode with ownership (issue 31), a host reads a
//! region another host owns straight from the source, as the server does; the core sees
//! nothing of it (no hit, no fill, no heat).

use super::EngineSim;

impl EngineSim {
    /// A read of `[offset, offset + len)` issued at trace time `time_ns`, served from the
    /// source past the cache. Returns its completion, in the clock of `time_ns`; its latency
    /// is counted with the other reads', and its bytes with the source's.
    pub fn read_uncached(&mut self, time_ns: u64, offset: u64, len: u64) -> u64 {
        let origin = *self.origin.get_or_insert(time_ns);
        let t = time_ns.saturating_sub(origin).max(self.now);
        self.run_until(t);
        let size = self.core.geometry().source_size();
        let off = (offset / 512 * 512).min(size);
        let end = offset
            .saturating_add(len)
            .div_ceil(512)
            .saturating_mul(512)
            .min(size);
        if end <= off {
            return origin + t;
        }
        self.res.requests += 1;
        self.last_request = t;
        self.res.source_bytes_read += end - off;
        let done = self.source.io(t, end - off, false);
        self.lat.record(done - t);
        origin + done
    }
}
