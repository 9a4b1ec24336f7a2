//! Preloading from hints: an engine's scheduler says which blocks a request will load (in
//! prefix order) as soon as the request arrives, and the tiering worker's reader promotes the
//! ones found only in a lower tier into host memory while the request waits in the queue, so
//! the load that follows reads host memory only.
//!
//! - A hint reserves host slots (without waiting for room) and queues one preload job per
//!   lower tier; blocks in host memory or already being promoted are counted, not queued again
//!   (a shared prefix is read once, however many requests hint it).
//! - Bytes of preloads queued or being read are bounded (`prefetch_max_inflight_bytes`); what
//!   does not fit is dropped from the hint (counted) and can be hinted again later.
//! - Real loads go first: the reader takes every load's promotion before any preload, and a
//!   load that waits for a block a queued preload holds moves that job to the front.
//! - A preload whose deadline passed before the reader reached it is dropped unread; `cancel`
//!   drops the queued preloads of a tag (an aborted or finished request).
//! - Preloaded blocks are ordinary clean host blocks: unused ones age out by the eviction
//!   policy (their bytes are counted as wasted when evicted unused).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use crate::key::BlockKey;
use crate::types::{FoldMap, MapKey};

use super::index::{Entry, Life};
use super::tiering::{Hint, Promote};
use super::{Inner, Store};

/// Counters of preload hints.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Blocks queued for preloading by hints.
    pub hinted: u64,
    /// Preloaded blocks a load found in host memory (the preload finished in time).
    pub in_time: u64,
    /// Preloaded blocks a load had to wait for (the preload was still queued or being read).
    pub late: u64,
    /// Preloads cancelled before they were read (their request went away).
    pub cancelled: u64,
    /// Preloads dropped unread because their deadline passed first.
    pub expired: u64,
    /// Blocks a hint found below but did not queue (past the bound on preload bytes in flight,
    /// or no host room without waiting).
    pub dropped: u64,
    /// Bytes of preloaded blocks evicted before any load used them.
    pub wasted_bytes: u64,
    /// Bytes of preloads queued or being read now.
    pub inflight_bytes: u64,
    /// Preload jobs queued now.
    pub queued_jobs: u64,
}

/// What one hint did, along the prefix of its keys.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Prefetch {
    /// Leading keys present in some tier (the prefix the hint covers).
    pub present: usize,
    /// Of those, in host memory already.
    pub in_host: usize,
    /// Being promoted already (by a load or an earlier hint): joined, not read twice.
    pub joined: usize,
    /// Queued for preloading by this hint.
    pub queued: usize,
    /// Found below but not queued (see [`PrefetchStats::dropped`]).
    pub dropped: usize,
}

impl Store {
    /// Hints that `keys` (a prefix, in order) will be loaded soon: blocks found only in a
    /// lower tier are promoted into host memory in the background, in `priority` order (higher
    /// first, after every real load), unless `deadline` passes before the worker gets to them.
    /// `tag` names the hint for [`Store::cancel_prefetch`]. Never waits and never does I/O
    /// itself.
    pub fn prefetch(
        &self,
        keys: &[BlockKey],
        priority: u8,
        deadline: Instant,
        tag: u64,
    ) -> Prefetch {
        self.inner.prefetch(keys, priority, deadline, tag)
    }

    /// Cancels the preloads of `tag` that have not started; returns how many blocks they held.
    /// Preloads being read finish (their blocks age out if unused).
    pub fn cancel_prefetch(&self, tag: u64) -> usize {
        self.inner.cancel_prefetch(tag)
    }
}

impl Inner {
    fn prefetch(&self, keys: &[BlockKey], priority: u8, deadline: Instant, tag: u64) -> Prefetch {
        let mut out = Prefetch::default();
        let budget = self
            .prefetch_max_inflight
            .saturating_sub(self.work.prefetch_bytes());
        let mut planned = 0u64;
        let mut full = false;
        // (tier, items, bytes)
        let mut batches: Vec<(usize, Vec<Promote>, u64)> = Vec::new();
        let mut seen = FoldMap::default();
        for k in keys {
            let mk = MapKey::from(*k);
            if seen.insert(mk, ()).is_some() {
                break;
            }
            match self.shard(*k).lock().map.get(&mk).map(Entry::life) {
                Some(Life::Ready) => {
                    out.present += 1;
                    out.in_host += 1;
                    continue;
                }
                Some(Life::Promoting) => {
                    out.present += 1;
                    out.joined += 1;
                    continue;
                }
                // Being written or removed: the prefix ends here for now.
                Some(Life::Filling | Life::Cancelled) => break,
                None => {}
            }
            let Some((ti, info)) = self
                .tiers
                .iter()
                .enumerate()
                .filter(|(_, t)| t.local())
                .find_map(|(i, t)| t.lookup(k).map(|info| (i, info)))
            else {
                break;
            };
            out.present += 1;
            let len = u64::from(info.len);
            if full || planned + len > budget {
                full = true;
                out.dropped += 1;
                continue;
            }
            let Ok(class) = self.class_for(info.len as usize) else {
                break;
            };
            // No waiting for room: a hint that finds none now is dropped (and can come again).
            let Ok((slot, page)) = self.alloc(class, *k, info.len as usize, Instant::now()) else {
                full = true;
                out.dropped += 1;
                continue;
            };
            {
                let mut sh = self.shard(*k).lock();
                if sh.map.contains_key(&mk) {
                    drop(sh);
                    self.free_slot(slot);
                    out.joined += 1;
                    continue;
                }
                sh.map
                    .insert(mk, Entry::new(slot, info.len, info.ns, Life::Promoting, 1));
            }
            let item = Promote {
                key: *k,
                slot,
                page,
                cap: self.class_sizes[class],
                len: info.len,
            };
            planned += len;
            match batches.iter_mut().find(|(t, _, _)| *t == ti) {
                Some(b) => {
                    b.1.push(item);
                    b.2 += len;
                }
                None => batches.push((ti, vec![item], len)),
            }
        }
        for (ti, items, bytes) in batches {
            let n = items.len();
            let hint = Hint {
                tag,
                priority,
                deadline,
                bytes,
            };
            match self.enqueue_prefetch(ti, items, hint, self.prefetch_max_inflight) {
                Ok(()) => out.queued += n,
                Err(items) => {
                    // Another hint took the room meanwhile: undone, counted as dropped.
                    self.undo_prefetch(&items);
                    out.dropped += n;
                }
            }
        }
        self.stats
            .prefetch_hinted
            .fetch_add(out.queued as u64, Relaxed);
        self.stats
            .prefetch_dropped
            .fetch_add(out.dropped as u64, Relaxed);
        out
    }

    /// Gives back the slots of preload items that were never queued.
    fn undo_prefetch(&self, items: &[Promote]) {
        for p in items {
            self.shard(p.key).lock().abort(MapKey::from(p.key), p.slot);
            self.free_slot(p.slot);
        }
        self.progress.bump();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Admission, DiskConfig, Namespace, StoreConfig, TpShard};
    use std::time::Duration;

    fn store(dir: &std::path::Path, inflight: u64) -> Store {
        StoreConfig {
            capacity_bytes: 8 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![64 << 10],
            shards: 4,
            prefetch_max_inflight_bytes: inflight,
            disk: Some(DiskConfig {
                dir: dir.to_path_buf(),
                capacity_bytes: 64 << 20,
                admission: Admission::Always,
                write_through: true,
                ..Default::default()
            }),
            ..Default::default()
        }
        .build()
        .unwrap()
    }

    fn key(i: u64) -> BlockKey {
        BlockKey((u128::from(i) + 11).wrapping_mul(0x9E37_79B9_7F4A_7C15_F39C_C060_5CED_C835))
    }

    fn data(i: u64) -> Vec<u8> {
        let mut v = vec![0u8; 60_000];
        crate::fill_pattern(&mut v, i);
        v
    }

    fn ns(s: &Store) -> crate::NsId {
        s.register_namespace(&Namespace {
            model: "prefetch".into(),
            dtype: "bf16".into(),
            layout: "nhd".into(),
            block_tokens: 16,
            tp: TpShard::Shared,
            tenant: String::new(),
            lora: String::new(),
        })
        .unwrap()
    }

    /// A store whose keys 0..n are on disk only (written through, then the store reopened).
    fn on_disk(name: &str, n: u64, inflight: u64) -> (Store, std::path::PathBuf) {
        let d = std::env::temp_dir().join(format!("kvtier-prefetch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let s = store(&d, inflight);
        let id = ns(&s);
        for i in 0..n {
            s.put(id, key(i), &data(i)).unwrap();
        }
        assert!(s.sync(Duration::from_secs(30)));
        s.flush();
        drop(s);
        let s = store(&d, inflight);
        for i in 0..n {
            assert!(!s.in_host(&key(i)));
        }
        (s, d)
    }

    fn wait_in_host(s: &Store, keys: &[BlockKey]) {
        let until = Instant::now() + Duration::from_secs(20);
        while !keys.iter().all(|k| s.in_host(k)) {
            assert!(Instant::now() < until, "preloads never arrived");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn a_hint_promotes_the_prefix_before_the_load_and_a_repeat_joins() {
        let (s, d) = on_disk("basic", 6, 0);
        let keys: Vec<BlockKey> = (0..6).map(key).collect();
        let far = Instant::now() + Duration::from_secs(60);
        let p = s.prefetch(&keys[..4], 0, far, 1);
        assert_eq!((p.present, p.queued, p.in_host), (4, 4, 0));
        // The same prefix hinted by 1,000 more requests: read once.
        for t in 0..1000 {
            let again = s.prefetch(&keys[..4], 0, far, 100 + t);
            assert_eq!((again.queued, again.present), (0, 4));
        }
        wait_in_host(&s, &keys[..4]);
        assert_eq!(s.stats().disk().unwrap().reads, 4, "one read per block");
        let reads = s.stats().disk().unwrap().reads;
        // The load reads host memory only: no disk read during it, and the blocks are exact.
        let l = s.load(&keys[..4]).unwrap();
        assert_eq!(l.len(), 4);
        for i in 0..4 {
            assert_eq!(l.block(i), &data(i as u64)[..]);
        }
        drop(l);
        assert_eq!(s.stats().disk().unwrap().reads, reads);
        let st = s.stats().prefetch;
        assert_eq!((st.hinted, st.in_time), (4, 4));
        // A hint stops where the prefix ends.
        let gap = [key(0), key(99), key(5)];
        assert_eq!(s.prefetch(&gap, 0, far, 3).present, 1);
        drop(s);
        let _ = std::fs::remove_dir_all(d);
    }

    #[test]
    fn the_staging_bound_holds_and_cancel_and_deadlines_drop_queued_preloads() {
        // Room for two 64 KiB blocks in flight.
        let (s, d) = on_disk("bound", 8, 128 << 10);
        let keys: Vec<BlockKey> = (0..8).map(key).collect();
        let far = Instant::now() + Duration::from_secs(60);
        // A flood of hints: never more than the bound in flight.
        let mut queued = 0;
        for i in 0..8 {
            let p = s.prefetch(&keys[i..i + 1], 0, far, 10 + i as u64);
            queued += p.queued;
            assert!(s.stats().prefetch.inflight_bytes <= 128 << 10);
        }
        assert!((2..8).contains(&queued), "{queued}");
        assert!(s.stats().prefetch.dropped > 0);
        drop(s);
        let _ = std::fs::remove_dir_all(&d);

        // Cancel: queued preloads of a tag are dropped unread and their slots come back. A
        // slow disk (200 ms a read) keeps the reader busy with the first hint.
        let (mut s, d) = on_disk("cancel", 8, 0);
        s.wrap_disk_engine(|inner| {
            let f = crate::io::fault::FaultEngine::new(inner);
            f.set_plan(crate::io::fault::FaultPlan {
                delay: Duration::from_millis(200),
                ..Default::default()
            });
            std::sync::Arc::new(f)
        });
        let keys: Vec<BlockKey> = (0..8).map(key).collect();
        assert_eq!(s.prefetch(&keys[..2], 0, far, 7).queued, 2);
        std::thread::sleep(Duration::from_millis(50)); // the reader has taken it
        assert_eq!(s.prefetch(&keys[2..4], 0, far, 8).queued, 2);
        assert_eq!(s.cancel_prefetch(8), 2);
        assert_eq!(s.cancel_prefetch(8), 0);
        assert_eq!(s.stats().prefetch.cancelled, 2);
        wait_in_host(&s, &keys[..2]);
        std::thread::sleep(Duration::from_millis(300));
        assert!(!s.in_host(&keys[2]) && !s.in_host(&keys[3]));
        // A later load still finds them (from disk).
        let l = s.load(&keys[2..4]).unwrap();
        assert_eq!(l.len(), 2);
        drop(l);
        // An expired deadline: dropped unread.
        let past = Instant::now() - Duration::from_millis(1);
        assert_eq!(s.prefetch(&keys[4..8], 0, past, 9).queued, 4);
        let until = Instant::now() + Duration::from_secs(10);
        while s.stats().prefetch.queued_jobs > 0 {
            assert!(Instant::now() < until);
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(s.stats().prefetch.expired, 4);
        assert!(!s.in_host(&keys[4]));
        assert_eq!(s.stats().prefetch.inflight_bytes, 0);
        drop(s);
        let _ = std::fs::remove_dir_all(d);
    }
}
