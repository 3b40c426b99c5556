//! Group commit of invalidations: the writes that finish their source write while one
//! publication is out join the next one, so N writes in flight cost about one etcd put and
//! one wait for the other hosts, not N (as the write journal's group commit).
//!
//! A writer that finds no publication out leads: it publishes the open batch (its own range
//! and whatever joined), then hands over: the writers of the next batch wake and one of them
//! leads. No writer publishes more than its own batch, so none waits behind an endless
//! stream of others. One lock (`state`) and one condition variable; none is held while
//! publishing.

use parking_lot::Condvar;
use sce_engine::order::{levels, OrderedMutex};
/// This file's locks, unless named otherwise (`sce_io::order`).
type Mutex<T> = OrderedMutex<levels::Leaf, T>;

use std::collections::HashMap;

/// What one publication answered: its revision, or why it failed.
pub type Outcome = Result<i64, String>;

/// Publishes a batch of ranges.
pub type Publish<'a> = &'a dyn Fn(&[(u64, u64)]) -> Outcome;

#[derive(Default)]
struct State {
    /// The ranges of the open batch (not yet published), its number and its writers.
    open: Vec<(u64, u64)>,
    open_no: u64,
    open_writers: usize,
    /// A writer is publishing.
    leader: bool,
    /// Outcomes of published batches, with the writers yet to take them.
    done: HashMap<u64, (Outcome, usize)>,
}

/// Writers hand their ranges in and wait for the publication that carried them.
#[derive(Default)]
pub struct Batcher {
    state: Mutex<State>,
    changed: Condvar,
}

impl Batcher {
    /// Publishes `range` with whatever else is waiting, through `publish` (called by one
    /// writer at a time, with no lock held), and returns the outcome of the publication
    /// that carried it.
    pub fn submit(&self, range: (u64, u64), publish: Publish) -> Outcome {
        let mut st = self.state.lock();
        st.open.push(range);
        st.open_writers += 1;
        let mine = st.open_no;
        loop {
            if let Some((outcome, left)) = st.done.get_mut(&mine) {
                let out = outcome.clone();
                *left -= 1;
                if *left == 0 {
                    st.done.remove(&mine);
                }
                return out;
            }
            if !st.leader && st.open_no == mine {
                // Lead: publish the open batch (ours), then hand over.
                st.leader = true;
                let ranges = std::mem::take(&mut st.open);
                let writers = std::mem::take(&mut st.open_writers);
                st.open_no += 1;
                drop(st);
                let outcome = publish(&coalesce(ranges));
                st = self.state.lock();
                st.done.insert(mine, (outcome, writers));
                st.leader = false;
                self.changed.notify_all();
                continue;
            }
            st.wait(&self.changed);
        }
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
    use std::sync::Arc;

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

    /// Writers that come while a publication is out share the next one, which one of them
    /// leads; the first leader publishes only its own batch.
    #[test]
    fn writers_during_a_publication_share_the_next() {
        let b = Arc::new(Batcher::default());
        let seen = Arc::new(Mutex::new(Vec::<Vec<(u64, u64)>>::new()));
        let first = {
            let (b, seen) = (b.clone(), seen.clone());
            std::thread::spawn(move || {
                let b2 = b.clone();
                b.submit((0, 1), &|r| {
                    // Hold the first publication until three more writers wait.
                    while b2.state.lock().open.len() < 3 {
                        std::thread::yield_now();
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
                let (b, seen) = (b.clone(), seen.clone());
                std::thread::spawn(move || {
                    b.submit((i * 10, 1), &|r| {
                        seen.lock().push(r.to_vec());
                        Ok(2)
                    })
                })
            })
            .collect();
        for t in others {
            assert_eq!(t.join().unwrap(), Ok(2));
        }
        assert_eq!(first.join().unwrap(), Ok(1));
        {
            let seen = seen.lock();
            assert_eq!(seen.len(), 2, "{seen:?}");
            assert_eq!(seen[1], vec![(10, 1), (20, 1), (30, 1)]);
        }
        assert!(b.state.lock().done.is_empty(), "outcomes left behind");
    }
}
