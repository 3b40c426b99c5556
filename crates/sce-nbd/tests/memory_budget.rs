//! Memory under a client that never reads its replies (issue 12): 200 reads of 32 MiB
//! pipelined and never read raise the server's resident memory by no more than the
//! connection's in-flight budget, and the client is dropped by the reply timeout; for a
//! memory device run by the workers and for a file served through io_uring. These tests run
//! one after the other (a lock), and alone in their binary: resident memory is the
//! process's, and other tests running beside them would add theirs.

use sce_nbd::proto;
use sce_nbd::ServerConfig;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use sce_testkit::within;

mod common;
use common::*;

#[test]
fn a_client_that_never_reads_replies_is_bounded_then_dropped() {
    bounded_then_dropped(None);
}

/// The same against a file served through io_uring: its reads are submitted by the reader
/// and answered from completions, under the same tickets.
#[test]
fn the_same_through_io_uring() {
    bounded_then_dropped(Some(sce_io::Backend::IoUring));
}

fn bounded_then_dropped(backend: Option<sce_io::Backend>) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The shipped budgets: 64 MiB per connection, 256 MiB for the server.
    let cfg = ServerConfig {
        reply_timeout: Duration::from_secs(5),
        ..ServerConfig::default()
    };
    let budget = cfg.connection_inflight_bytes;
    let f = fixture_on(cfg, backend);
    let rss0 = rss();
    let mut bad = try_go(&f.sock).unwrap();
    // 200 reads of 32 MiB, 6.4 GiB of replies, none of them ever read.
    for cookie in 0..200 {
        request(&mut bad, proto::CMD_READ, cookie, 0, 32 << 20);
    }
    let stats = f.server.stats();
    let mut rss_peak = rss();
    wait_until("the connection's budget fills", 60, || {
        rss_peak = rss_peak.max(rss());
        stats.inflight_bytes.load(Relaxed) >= budget
    });
    served(&f.sock, 0);
    wait_until("the reply-write timeout drops the client", 60, || {
        rss_peak = rss_peak.max(rss());
        stats.reply_timeouts.load(Relaxed) >= 1
    });
    eprintln!(
        "{backend:?}: 200 reads of 32 MiB never read: RSS {} MiB before, {} MiB at the peak (budget {} MiB)",
        rss0 >> 20,
        rss_peak >> 20,
        budget >> 20
    );
    // The non-reader pins at most its connection's budget; the healthy client's 4 KiB come
    // on top.
    let peak = stats.inflight_bytes_peak.load(Relaxed);
    assert!(
        peak > 0 && peak <= budget + (1 << 20),
        "peak {peak} bytes in flight"
    );
    // Memory follows: the budget, plus slack for socket buffers, stacks and the allocator.
    assert!(
        rss_peak.saturating_sub(rss0) <= budget + (32 << 20),
        "RSS grew by {} MiB",
        (rss_peak - rss0) >> 20
    );
    assert!(within("closed", 60, move || closed_by_server(&mut bad)));
    wait_until("its budget is released", 60, || {
        stats.inflight_bytes.load(Relaxed) == 0
    });
    served(&f.sock, 4096);
}
