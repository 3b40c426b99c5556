//! The concurrency tests' deadlock detector and hang guard.
//!
//! The test build turns on parking_lot's `deadlock_detection` feature (a dev-dependency of
//! this crate; Cargo's resolver 2 unifies it into the engine's own parking_lot for test
//! builds). The detector sees every parking_lot `Mutex`, `ReentrantMutex` and `RwLock`, shared
//! and exclusive holders alike (the engine's core lock is a `parking_lot::RwLock`); it does not
//! see `std::sync` locks, `Condvar` waits, channels, or a thread re-taking a `RwLock` it holds.
//! `tests/deadlock.rs` checks that the detector reports a cycle through a `Mutex` and a
//! `RwLock`, so a build without the feature, or a detector that misses the lock kinds the
//! engine uses, fails there.
//!
//! The detector misses cycles, though. parking_lot_core 0.9's `check_deadlock` finds the
//! wait-graph cycles only where its depth-first search enters the cycle at a thread; when it
//! enters at a lock (another thread, outside the cycle, waits on a lock held inside it, as the
//! many readers queued on the core lock do), the back edge ends at that lock and the cycle is
//! not reported. Seen here: the engine's shard/core cycle was reported in some runs and missed
//! in others (gdb showed the two threads each holding what the other waited for, and the
//! detector's thread alive). So the detector comes with a stall guard.
//!
//! One detector thread per test process calls `parking_lot::deadlock::check_deadlock` every
//! 100 ms and keeps what it finds (each cycle is reported once, with every thread's
//! backtrace). [`run_watched`] runs a test's load on its own thread and fails the calling test
//! (a panic, so `cargo test` reports it) as soon as a cycle appears anywhere in the process;
//! or when the load's progress counter has not moved for [`STALL`] (a hang: a cycle the
//! detector missed, or a wait it cannot see), after printing every thread's stack if `gdb` is
//! installed; or when the load has not finished within the caller's bound. These bounds only
//! guard against hangs; no test asserts on timing.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::sync::{Arc, Mutex, Once, RwLock};
use std::time::{Duration, Instant};

/// How often the detector looks for cycles.
const CHECK_EVERY: Duration = Duration::from_millis(100);

/// A load whose progress counter stands still this long is taken as hung.
pub const STALL: Duration = Duration::from_secs(20);

/// A load's progress: bump it after every completed operation.
pub type Progress = Arc<AtomicU64>;

/// Cycles found so far, as printable reports. A `std` lock: the detector must not watch it.
static REPORTS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Held shared while a watched load runs and exclusively by a test that makes a deadlock on
/// purpose, so that the deliberate cycle fails no other test.
static GATE: RwLock<()> = RwLock::new(());

static START: Once = Once::new();

/// Starts the process's detector thread (once).
pub fn start_detector() {
    START.call_once(|| {
        std::thread::Builder::new()
            .name("deadlock-detector".into())
            .spawn(|| loop {
                std::thread::sleep(CHECK_EVERY);
                for (i, cycle) in parking_lot::deadlock::check_deadlock().iter().enumerate() {
                    let mut r = format!(
                        "deadlock: a cycle of {} threads, each parked on a lock another holds\n",
                        cycle.len()
                    );
                    for t in cycle {
                        r += &format!(
                            "--- thread {:?} (cycle {i}):\n{:?}\n",
                            t.thread_id(),
                            t.backtrace()
                        );
                    }
                    // Printed at once: a test that never looks again still leaves the evidence.
                    eprintln!("{r}");
                    lock(&REPORTS).push(r);
                }
            })
            .expect("spawn the deadlock detector");
    });
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The number of cycles reported so far.
pub fn reports_seen() -> usize {
    lock(&REPORTS).len()
}

/// The reports after the first `from`.
pub fn reports_since(from: usize) -> Vec<String> {
    lock(&REPORTS)[from..].to_vec()
}

/// Every thread's stack, from `gdb` attached to this process (None without gdb or ptrace
/// rights), keeping the lines that say where a thread is: its name, lock waits, and the
/// frames of this workspace.
fn all_stacks() -> Option<String> {
    // Into a file, not a pipe: gdb stops every thread of this process, the reader of a pipe
    // too, and would block once the pipe is full.
    let path = std::env::temp_dir().join(format!("sce-test-stacks-{}.txt", std::process::id()));
    let file = std::fs::File::create(&path).ok()?;
    std::process::Command::new("gdb")
        .args(["-p", &std::process::id().to_string(), "-batch", "-nx"])
        .args(["-ex", "thread apply all bt 24"])
        .stdout(file)
        .stderr(std::process::Stdio::null())
        .status()
        .ok()?;
    let text = std::fs::read_to_string(&path).ok()?;
    let _ = std::fs::remove_file(&path);
    let keep = |l: &&str| {
        l.starts_with("Thread ")
            || ["lock_slow (", "_slow (", "wait_for_readers", "crates/"]
                .iter()
                .any(|k| l.contains(k))
    };
    let lines: Vec<&str> = text.lines().filter(keep).collect();
    (!lines.is_empty()).then(|| lines.join("\n"))
}

/// Runs `load` on its own thread and returns its result; `load` bumps the [`Progress`] it is
/// given after each operation. Panics (failing the calling test) if `load` panics, if the
/// detector reports a deadlock while it runs, if its progress stalls for [`STALL`], or if it
/// has not finished after `bound` (hang guards only). On a deadlock or a hang the load's thread
/// is left parked and whatever it holds (the volume, whose drop would join the stuck engine
/// threads) is never dropped.
pub fn run_watched<T: Send + 'static>(
    what: &str,
    bound: Duration,
    load: impl FnOnce(Progress) -> T + Send + 'static,
) -> T {
    start_detector();
    let _shared = GATE.read().unwrap_or_else(|e| e.into_inner());
    let seen = reports_seen();
    let (tx, rx) = channel();
    let progress = Progress::default();
    let p = progress.clone();
    let handle = std::thread::Builder::new()
        .name(format!("load: {what}"))
        .spawn(move || {
            let _ = tx.send(load(p));
        })
        .expect("spawn the load");
    let started = Instant::now();
    let (mut last, mut moved) = (0, Instant::now());
    loop {
        match rx.recv_timeout(CHECK_EVERY) {
            Ok(v) => {
                handle.join().expect("the load thread ended");
                return v;
            }
            Err(RecvTimeoutError::Disconnected) => match handle.join() {
                Err(payload) => std::panic::resume_unwind(payload),
                Ok(()) => unreachable!("the load ended without a result"),
            },
            Err(RecvTimeoutError::Timeout) => {}
        }
        let new = reports_since(seen);
        if !new.is_empty() {
            panic!(
                "{what}: the deadlock detector found {} cycle(s):\n{}",
                new.len(),
                new.join("\n")
            );
        }
        let now = progress.load(Relaxed);
        if now != last {
            (last, moved) = (now, Instant::now());
        } else if moved.elapsed() > STALL {
            let stacks = all_stacks().unwrap_or_else(|| "(no stacks: gdb not available)".into());
            panic!(
                "{what}: hang guard: no progress for {STALL:?} (at {now} operations), and the \
                 deadlock detector reported no cycle (it misses cycles entered through a lock \
                 others also wait on; or a wait it cannot see: a std lock, a condvar, a channel). \
                 Threads:\n{stacks}"
            );
        }
        if started.elapsed() > bound {
            panic!(
                "{what}: hang guard: not finished after {bound:?}, and the deadlock detector \
                 found no cycle (a wait it cannot see: a std lock, a condvar, a channel, or a \
                 livelock)"
            );
        }
    }
}

/// Runs `f` while no watched load runs (a test that deadlocks threads on purpose). Returns
/// what `f` returns.
pub fn exclusively<T>(f: impl FnOnce() -> T) -> T {
    start_detector();
    let _alone = GATE.write().unwrap_or_else(|e| e.into_inner());
    f()
}
