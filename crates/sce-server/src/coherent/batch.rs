//! Group commit of invalidations: the writes that finish their source write while one
//! publication is out join the next one, so N writes in flight cost about one etcd put and
//! one wait for the other hosts, not N (as the write journal's group commit).
//!
//! Lock order: `Batcher::state`, then a batch's `Slot::result`, never the other way; no lock
//! is held while publishing.

use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// What one publication answered: its revision, or why it failed.
pub type Outcome = Result<i64, String>;

/// Publishes a batch of ranges.
pub type Publish<'a> = &'a dyn Fn(&[(u64, u64)]) -> Outcome;

/// One publication's waiters.
#[derive(Default)]
struct Slot {
    result: Mutex<Option<Outcome>>,
    done: Condvar,
}

#[derive(Default)]
struct State {
    /// The ranges of the batch not yet published, and its waiters' slot.
    open: Vec<(u64, u64)>,
    slot: Arc<Slot>,
    /// A writer is publishing (it publishes the open batch next, once its own is done).
    leader: bool,
}

/// Writers hand their ranges in and wait for the publication that carried them.
#[derive(Default)]
pub struct Batcher {
    state: Mutex<State>,
}

impl Batcher {
    /// Publishes `range` with whatever else is waiting, through `publish` (called by one
    /// writer at a time, with no lock held), and returns the outcome of the publication
    /// that carried it.
    pub fn submit(&self, range: (u64, u64), publish: Publish) -> Outcome {
        let mut st = self.state.lock();
        st.open.push(range);
        let mine = st.slot.clone();
        if st.leader {
            drop(st);
            let mut r = mine.result.lock();
            while r.is_none() {
                mine.done.wait(&mut r);
            }
            return r.clone().expect("set before the wake");
        }
        // Lead: publish batches until none is open (the first is ours).
        st.leader = true;
        loop {
            if st.open.is_empty() {
                st.leader = false;
                break;
            }
            let ranges = std::mem::take(&mut st.open);
            let slot = std::mem::take(&mut st.slot);
            drop(st);
            let outcome = publish(&coalesce(ranges));
            *slot.result.lock() = Some(outcome);
            slot.done.notify_all();
            st = self.state.lock();
        }
        drop(st);
        let r = mine.result.lock().clone();
        r.expect("the leader published its own batch first")
    }
}

/// Sorts ranges and merges those that touch or overlap.
pub fn coalesce(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (o, l) in ranges {
        match out.last_mut() {
            Some(last) if o <= last.0 + last.1 => {
                let end = (last.0 + last.1).max(o + l);
                last.1 = end - last.0;
            }
            _ => out.push((o, l)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    #[test]
    fn ranges_coalesce() {
        assert_eq!(
            coalesce(vec![(8, 4), (0, 4), (4, 2), (20, 1)]),
            vec![(0, 6), (8, 4), (20, 1)]
        );
        assert_eq!(coalesce(vec![(0, 10), (2, 3)]), vec![(0, 10)]);
    }

    /// Every writer's range is in the publication whose outcome it gets, and writers that
    /// overlap share publications (fewer than writers), and a failure reaches the writers
    /// of that batch.
    #[test]
    fn writers_share_publications_and_get_their_outcome() {
        let b = Arc::new(Batcher::default());
        let published = Arc::new(Mutex::new(Vec::<(i64, Vec<(u64, u64)>)>::new()));
        let calls = Arc::new(AtomicUsize::new(0));
        // No claim on how many publications: that depends on the scheduler.
        let threads: Vec<_> = (0..8u64)
            .map(|t| {
                let (b, published, calls) = (b.clone(), published.clone(), calls.clone());
                std::thread::spawn(move || {
                    for i in 0..50u64 {
                        let range = (t * 1_000_000 + i * 10, 10);
                        let publish = |r: &[(u64, u64)]| {
                            let n = calls.fetch_add(1, SeqCst) as i64;
                            std::thread::sleep(std::time::Duration::from_micros(200));
                            published.lock().push((n, r.to_vec()));
                            if n % 7 == 3 {
                                Err(format!("failed {n}"))
                            } else {
                                Ok(n)
                            }
                        };
                        let out = b.submit(range, &publish);
                        let n = match &out {
                            Ok(n) => *n,
                            Err(e) => e.trim_start_matches("failed ").parse().unwrap(),
                        };
                        let p = published.lock();
                        let (_, ranges) = p.iter().find(|x| x.0 == n).unwrap();
                        assert!(
                            ranges
                                .iter()
                                .any(|r| r.0 <= range.0 && range.0 + range.1 <= r.0 + r.1),
                            "{range:?} not in publication {n}: {ranges:?}"
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }

    /// Writers that come while a publication is out share the next one.
    #[test]
    fn writers_during_a_publication_share_the_next() {
        let b = Arc::new(Batcher::default());
        let seen = Arc::new(Mutex::new(Vec::<Vec<(u64, u64)>>::new()));
        let first = {
            let (b, seen) = (b.clone(), seen.clone());
            std::thread::spawn(move || {
                let b2 = b.clone();
                b.submit((0, 1), &|r| {
                    if seen.lock().is_empty() {
                        // Hold the first publication until three more writers wait.
                        while b2.state.lock().open.len() < 3 {
                            std::thread::yield_now();
                        }
                    }
                    seen.lock().push(r.to_vec());
                    Ok(1)
                })
            })
        };
        while !b.state.lock().leader {
            std::thread::yield_now();
        }
        let others: Vec<_> = (1..4u64)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || b.submit((i * 10, 1), &|_| unreachable!()))
            })
            .collect();
        for t in others {
            assert_eq!(t.join().unwrap(), Ok(1));
        }
        assert_eq!(first.join().unwrap(), Ok(1));
        let seen = seen.lock();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert_eq!(seen[1], vec![(10, 1), (20, 1), (30, 1)]);
    }
}
