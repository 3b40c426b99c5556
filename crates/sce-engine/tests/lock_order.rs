//! Lock levels (`sce_engine::order`): in a debug build, a lock taken while the thread holds
//! one of a higher level (or of its own, unless the level allows several) panics before it
//! blocks, so an order that could deadlock fails the first test that walks it, whether or
//! not another thread ever closes the cycle. (The core shards' own test is in `cores.rs`.)
#![cfg(debug_assertions)]

use sce_engine::order::{levels, OrderedMutex, OrderedRwLock, Token};
use std::panic::{catch_unwind, AssertUnwindSafe};

fn panic_of(f: impl FnOnce()) -> Option<String> {
    let e = catch_unwind(AssertUnwindSafe(f)).err()?;
    Some(
        e.downcast_ref::<String>()
            .cloned()
            .unwrap_or_else(|| "a panic without text".into()),
    )
}

#[test]
fn locks_taken_in_order_pass_and_out_of_order_panic() {
    let ops = OrderedMutex::<levels::AttachOps, u32>::new(0);
    let gate = OrderedRwLock::<levels::AttachGate, u32>::new(0);
    let round = OrderedMutex::<levels::PersistRound, u32>::new(0);
    let leaf = OrderedMutex::<levels::Leaf, u32>::new(0);
    {
        // Outermost first, down to a leaf: the order of docs/ARCHITECTURE.md.
        let _o = ops.lock();
        let _g = gate.read();
        let _r = round.lock();
        *leaf.lock() += 1;
    }
    // Out of order: each panics, naming both locks, and leaves nothing recorded behind.
    let p = panic_of(|| {
        let _r = round.lock();
        let _g = gate.write();
    })
    .expect("gate under a flush round did not panic");
    assert!(
        p.contains("took AttachGate (level 2) while holding PersistRound (level 9)"),
        "{p}"
    );
    let p = panic_of(|| {
        let _l = leaf.lock();
        let _o = ops.lock();
    })
    .expect("a lock under a leaf did not panic");
    assert!(p.contains("while holding Leaf"), "{p}");
    // After the panics unwound, the thread holds nothing: the order starts afresh.
    let _o = ops.lock();
    let _l = leaf.lock();
}

#[test]
fn a_level_that_allows_one_panics_on_a_second_and_one_that_allows_several_does_not() {
    let a = OrderedMutex::<levels::PersistState, ()>::new(());
    let b = OrderedMutex::<levels::PersistState, ()>::new(());
    let p = panic_of(|| {
        let _a = a.lock();
        let _b = b.lock();
    })
    .expect("two locks of one level did not panic");
    assert!(
        p.contains("took PersistState (level 12) while holding PersistState"),
        "{p}"
    );
    // Read-log shards are taken together, in index order.
    let shards: Vec<_> = (0..4)
        .map(|_| OrderedMutex::<levels::LogShard, u32>::new(0))
        .collect();
    let held: Vec<_> = shards.iter().map(|s| s.lock()).collect();
    assert_eq!(held.len(), 4);
    // But a plain leaf under them is still taken under a leaf.
    let leaf = OrderedMutex::<levels::Leaf, ()>::new(());
    let p = panic_of(|| drop(leaf.lock())).expect("a leaf under log shards did not panic");
    assert!(p.contains("while holding LogShard"), "{p}");
}

#[test]
fn a_try_lock_out_of_order_never_blocks_so_it_is_recorded_not_checked() {
    let gate = OrderedRwLock::<levels::AttachGate, ()>::new(());
    let shard_token = Token::<levels::CoreShard>::enter();
    // A try under a core shard cannot close a cycle: allowed.
    let g = gate.try_read().expect("free");
    // What is taken under it is checked against it.
    let config = OrderedMutex::<levels::EngineConfig, ()>::new(());
    let p = panic_of(|| drop(config.lock())).expect("no panic");
    assert!(p.contains("took EngineConfig"), "{p}");
    drop(g);
    drop(shard_token);
    drop(config.lock());
}

#[test]
fn the_cycle_two_threads_could_close_panics_on_the_first_that_walks_it() {
    // Thread 1 takes the gate, then the ops lock: the reverse of the order. Alone, it would
    // never deadlock; beside a detach (ops, then gate) it could. The check fails it alone.
    let ops = std::sync::Arc::new(OrderedMutex::<levels::AttachOps, ()>::new(()));
    let gate = std::sync::Arc::new(OrderedRwLock::<levels::AttachGate, ()>::new(()));
    let (o, g) = (ops.clone(), gate.clone());
    let t = std::thread::spawn(move || {
        let _g = g.read();
        let _o = o.lock();
    });
    let e = t.join().expect_err("the reversed order did not panic");
    let p = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        p.contains("took AttachOps (level 1) while holding AttachGate (level 2)"),
        "{p}"
    );
    // The locks were released by the unwinding: the right order works.
    let _o = ops.lock();
    let _g = gate.write();
}
