//! The persistence threads: the metadata flusher (a flush round every `flush_interval`, then
//! the source's identity once its writes settled) and the intent writer (makes the intents
//! set ahead of need durable, in the background). The rounds themselves are
//! `persist::round`'s, given the core shards and the checksums (`Engine::flush_metadata`).

use crate::engine::Engine;

/// What the metadata flusher, the intent writer and the fill writers (`fills.rs`) work
/// with, built by `Engine::keeper`; the rounds and the device's error count are the
/// engine's (`Engine::flush_metadata_background`, `Engine::device_errors`).
pub(crate) struct Keeper<'a> {
    pub(crate) dev: &'a crate::devices::Devices,
    pub(crate) health: &'a crate::health::Health,
    pub(crate) persist: Option<&'a crate::persist::Persist>,
    pub(crate) signals: &'a crate::engine::Signals,
    pub(crate) fills: &'a crate::fills::FillQueue,
    pub(crate) fill_parts: crate::fills::FillParts<'a>,
}

/// Makes the intents set ahead of need durable, in the background, as they come; runs a
/// flush round early when the write journal's ring is half full.
pub(crate) fn intent_writer(s: &Engine) {
    let k = s.keeper();
    let Some(p) = k.persist else { return };
    while k.signals.wait_intent_work() {
        if k.health.passthrough() {
            continue;
        }
        if let Err(e) = p.write_pending() {
            s.device_errors(1, &format!("intent write failed: {e}"));
        }
        // The write journal's ring is half full: a round now frees its blocks.
        if p.take_round_wanted() {
            let errors = s.flush_metadata_background();
            if errors > 0 {
                s.device_errors(errors, "metadata write failed or read back wrong");
            }
        }
    }
}

/// The metadata flusher: a round every `flush_interval`, then the source's identity.
pub(crate) fn flusher(s: &Engine) {
    let k = s.keeper();
    let Some(p) = k.persist else { return };
    loop {
        if !k.signals.sleep(p.cfg.flush_interval) {
            return;
        }
        if k.health.passthrough() {
            continue;
        }
        let mut errors = s.flush_metadata_background();
        // Record the source's identity once its writes have settled (our own writes change
        // a file's modification time), so that a start after a crash can tell whether anyone
        // else changed it since.
        if let Some(done) = k.dev.settled() {
            let (identities, taken) = k.dev.identities();
            if k.dev.settled() != Some(done) {
                k.dev.restore_written(&taken);
            } else if p.record_identity(&identities, done).is_err() {
                k.dev.restore_written(&taken);
                errors += 1;
            }
        }
        if errors > 0 {
            s.device_errors(errors, "metadata write failed or read back wrong");
        }
    }
}
