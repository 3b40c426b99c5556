//! The write-back log's storage layer (issue 29, `sce_store::wblog`): its crash model, its
//! records' defences, and one device write per data write and per commit.

#[path = "wblog/crash.rs"]
mod crash;
#[path = "wblog/model.rs"]
mod model;

use model::{Config, Model};

fn print_totals(name: &str, t: &model::Totals) {
    println!(
        "{name}: {} crashes, {} pages checked, {} from the log, {} from the source, {} at a \
         newer-than-flushed version; {} data writes, {} commits ({} of several records), \
         refused for a commit {} and for a full ring {}; unflushed writes at the crashes: {} \
         kept, {} dropped, {} torn; replay found {} commit records and skipped {} torn \
         entries; {} laps of the ring",
        t.crashes,
        t.pages_checked,
        t.from_log,
        t.from_source,
        t.newer,
        t.data_writes,
        t.commits,
        t.multi_record_commits,
        t.refused_commit,
        t.refused_ring,
        t.writes_kept,
        t.writes_dropped,
        t.writes_torn,
        t.replayed_commits,
        t.replayed_skipped,
        t.laps
    );
}

/// 450 crashes on a ring of 128 blocks (512 KiB) over a volume of 48 pages: frequent
/// commits, overwrites, many laps.
#[test]
fn crash_model_small_ring() {
    let mut m = Model::new(Config {
        blocks: 128,
        pages: 48,
        max_write: 8,
        crashes: 450,
        max_steps: 80,
        flush_pct: 8,
        seed: 29,
    });
    m.run();
    print_totals("small ring", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 450 && t.laps >= 20 && t.writes_torn > 0);
    assert!(t.from_log > 0 && t.from_source > 0 && t.newer > 0 && t.replayed_skipped > 0);
}

/// 150 crashes on a ring of 1,024 blocks over 1,024 pages with rare FLUSHes: commits of
/// more entries than one record holds (several records in one write).
#[test]
fn crash_model_multi_record_commits() {
    let mut m = Model::new(Config {
        blocks: 1024,
        pages: 1024,
        max_write: 8,
        crashes: 150,
        max_steps: 400,
        flush_pct: 1,
        seed: 2929,
    });
    m.run();
    print_totals("multi-record", &m.t);
    let t = &m.t;
    assert!(t.crashes >= 150 && t.multi_record_commits > 0 && t.laps >= 2);
    assert!(t.from_log > 0 && t.newer > 0);
}
