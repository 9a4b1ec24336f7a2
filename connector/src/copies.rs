//! A small bounded pool of copy threads. A save or load of many blocks is split into a few
//! contiguous groups of blocks of about equal bytes, one per thread; small transfers stay on the
//! calling thread (waking threads costs more than it saves below ~1 MiB per thread). The threads
//! are made on first use and kept (a rayon pool of exactly `threads` threads, so the engine's
//! own thread pools are not oversubscribed beyond what was configured).

use std::sync::OnceLock;

/// Below this many bytes per thread a transfer is not split.
pub const MIN_BYTES_PER_THREAD: usize = 1 << 20;

/// The most copy threads the default picks. A thread copies and hashes, or hashes a shared slot
/// for a GPU load's check, at 4-5.5 GB/s out of DRAM on an H200 server's Xeon: with 8 threads
/// that check took 33% of a 4,096-token load beside the DMA, with 16 threads 11%
/// (`scripts/gpu_check.py`; bench/RESULTS.md).
pub const DEFAULT_MAX_THREADS: usize = 16;

/// The share of the cores the default leaves to the engine's own threads (one in this many,
/// rounded down): with every core hashing, the thread that launches the engine's kernels
/// waited for a core and the layers' compute no longer overlapped the loads.
pub const ENGINE_CORES_ONE_IN: usize = 8;

/// Copy threads for one backend.
pub struct Copies {
    threads: usize,
    pool: OnceLock<Option<rayon::ThreadPool>>,
}

impl std::fmt::Debug for Copies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copies")
            .field("threads", &self.threads)
            .finish()
    }
}

impl Default for Copies {
    fn default() -> Self {
        Self::new(0)
    }
}

impl Copies {
    /// `threads` copy threads; 0 means the cores available to this process (its affinity mask
    /// and cgroup quota), at most [`DEFAULT_MAX_THREADS`]. 1 copies on the calling thread.
    pub fn new(threads: usize) -> Self {
        let threads = if threads == 0 {
            Self::default_threads()
        } else {
            threads
        };
        Self {
            threads,
            pool: OnceLock::new(),
        }
    }

    /// The default thread count: the cores available to this process less one in
    /// [`ENGINE_CORES_ONE_IN`], at least 1 and at most [`DEFAULT_MAX_THREADS`] (2 cores: 2;
    /// 16: 14; 128: 16).
    pub fn default_threads() -> usize {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        (n - n / ENGINE_CORES_ONE_IN).clamp(1, DEFAULT_MAX_THREADS)
    }

    /// How many threads copies may use.
    pub fn threads(&self) -> usize {
        self.threads
    }

    fn pool(&self) -> Option<&rayon::ThreadPool> {
        self.pool
            .get_or_init(|| {
                match rayon::ThreadPoolBuilder::new()
                    .num_threads(self.threads)
                    .thread_name(|i| format!("kvtier-copy-{i}"))
                    .build()
                {
                    Ok(p) => Some(p),
                    Err(e) => {
                        tracing::warn!(error = %e, "kvtier: cannot start copy threads: copying on one");
                        None
                    }
                }
            })
            .as_ref()
    }

    /// `f(i)` for every `i < sizes.len()` (`sizes[i]`: the bytes item `i` copies), results in
    /// order; items run in parallel when the transfer is large enough. `f` must be safe to run
    /// for different items at once (each item touches its own memory).
    pub fn map<R: Send>(&self, sizes: &[usize], f: impl Fn(usize) -> R + Sync) -> Vec<R> {
        let mut items = vec![(); sizes.len()];
        self.map_mut(&mut items, sizes, |i, _| f(i))
    }

    /// [`Copies::map`] with each call also given its own `items[i]` (e.g. the destination
    /// segments of a page).
    pub fn map_mut<T: Send, R: Send>(
        &self,
        items: &mut [T],
        sizes: &[usize],
        f: impl Fn(usize, &mut T) -> R + Sync,
    ) -> Vec<R> {
        let n = sizes.len().min(items.len());
        let total: usize = sizes[..n].iter().sum();
        let groups = self.threads.min(n).min(total / MIN_BYTES_PER_THREAD).max(1);
        let pool = if groups > 1 { self.pool() } else { None };
        let Some(pool) = pool else {
            return items[..n]
                .iter_mut()
                .enumerate()
                .map(|(i, t)| f(i, t))
                .collect();
        };
        // Contiguous groups of about total/groups bytes each.
        let mut bounds = Vec::with_capacity(groups + 1);
        bounds.push(0);
        let mut acc = 0usize;
        for (i, s) in sizes[..n].iter().enumerate() {
            acc += s;
            if bounds.len() < groups && acc * groups >= total * bounds.len() && i + 1 < n {
                bounds.push(i + 1);
            }
        }
        bounds.push(n);
        let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
        let f = &f;
        pool.scope(|s| {
            let mut rest_out = &mut out[..];
            let mut rest_items = &mut items[..n];
            for w in bounds.windows(2) {
                let (start, end) = (w[0], w[1]);
                let (mine, tail) = std::mem::take(&mut rest_out).split_at_mut(end - start);
                rest_out = tail;
                let (its, tail) = std::mem::take(&mut rest_items).split_at_mut(end - start);
                rest_items = tail;
                s.spawn(move |_| {
                    for (j, (o, t)) in mine.iter_mut().zip(its.iter_mut()).enumerate() {
                        *o = Some(f(start + j, t));
                    }
                });
            }
        });
        out.into_iter()
            .map(|o| o.expect("every group ran to its end"))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_item_runs_once_in_order_whatever_the_split() {
        for threads in [1, 2, 3, 8] {
            let c = Copies::new(threads);
            for sizes in [
                vec![],
                vec![10],
                vec![4 << 20; 7],
                vec![1, 8 << 20, 1, 1, 3 << 20, 1],
                vec![1 << 20; 33],
            ] {
                let runs = AtomicUsize::new(0);
                let got = c.map(&sizes, |i| {
                    runs.fetch_add(1, Ordering::Relaxed);
                    i * 3
                });
                assert_eq!(got, (0..sizes.len()).map(|i| i * 3).collect::<Vec<_>>());
                assert_eq!(runs.load(Ordering::Relaxed), sizes.len());
            }
        }
    }

    #[test]
    fn large_transfers_use_several_threads_small_ones_the_caller() {
        let c = Copies::new(2);
        let me = std::thread::current().id();
        let ids = c.map(&[16], |_| std::thread::current().id());
        assert_eq!(ids, vec![me]);
        // Two groups of four items. The first item of each waits (up to 10 s) until the other
        // group started too: a thread waiting there cannot run the other group, so another
        // thread must have taken it, however late the pool's threads start.
        let started = AtomicUsize::new(0);
        let ids = c.map(&[4 << 20; 8], |i| {
            if i % 4 == 0 {
                started.fetch_add(1, Ordering::SeqCst);
                let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while started.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < until {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            std::thread::current().id()
        });
        let mut distinct = ids.clone();
        distinct.sort_by_key(|t| format!("{t:?}"));
        distinct.dedup();
        assert_eq!(distinct.len(), 2, "{ids:?}");
        assert!(!ids.contains(&me));
        assert_eq!(Copies::new(0).threads(), Copies::default_threads());
    }
}
