//! After a crash, the fragments whose records a write intent voided are filled again from
//! the source, in the background once the volume serves: their slots were written within
//! the last `warm_rounds` metadata rounds (write-hot slots keep their intents that long, so
//! that writes to them wait for no journal write), so they are likely the hottest data, and
//! dropping them whole would leave a crashed cache cold where it was busiest. Nothing of the
//! old copies is trusted: each fragment is read from the source and written to a slot as
//! any population is (the core's population token keeps a client write that lands meanwhile
//! from being overwritten by older data), one at a time, pausing while the source shows a
//! queue (`SourceLoad`, as population does). A fragment the clients brought back by then,
//! or one whose old slot is lent to the write-back log now, is skipped.

use crate::engine::Engine;

use sce_io::AlignedBuf;

/// How long the refill waits before it looks again at a source that shows a queue.
const BUSY_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);

/// Fills again, on the calling thread (`sce-refill`), the fragments the start dropped by
/// intent; ends early at shutdown or in passthrough.
pub(crate) fn refill(engine: &Engine) {
    let e = engine.populator();
    let Some(p) = e.persist else {
        return;
    };
    let todo = p.take_refill();
    if todo.is_empty() {
        return;
    }
    let fsize = 1u64 << e.fshift;
    let mut buf = AlignedBuf::new(fsize as usize);
    let started = std::time::Instant::now();
    let mut filled = 0u64;
    for (slot, f) in todo {
        // Like population, it leaves a source that shows a queue to the clients (whose
        // misses fill the cache meanwhile).
        while !e.source_load.has_room() && e.signals.sleep(BUSY_PAUSE) {}
        if e.signals.shutting_down() || e.health.passthrough() {
            p.refill_stopped();
            break;
        }
        let ks = e.cores.shard_of_slot(slot);
        let lent = e.cores.global_read(ks, |core| core.slot_is_lent(slot));
        let offset = f * fsize;
        let job = if lent || offset >= e.dev.size {
            None
        } else {
            e.cores.at_source(offset, |core| core.prefetch(offset))
        };
        let done = job.is_some_and(|job| e.run(job, &mut buf));
        filled += u64::from(done);
        p.refill_done(done);
    }
    tracing::info!(
        fragments = filled,
        seconds = started.elapsed().as_secs_f64(),
        "filled again from the source the fragments a crash's write intents dropped"
    );
}
