//! S3-FIFO and LRU (or CLOCK, in `duel-clock`) in a duel: both order the same blocks, and the
//! one whose miniature copy gets more hits on the recent references chooses the victims.
//!
//! No single policy wins on every KV workload (bench/RESULTS.md, wave 2): S3-FIFO's small
//! queue drops the single-use tails of fresh prompts and document questions early, which is
//! what the Mooncake and document-QA traces reward; LRU keeps everything for the whole cache
//! time, which is what conversations and agent loops, whose new blocks come back one turn
//! later, reward. Which of the two is right changes with the traffic, so the policy measures
//! it, as set dueling does in CPU caches (Qureshi et al., ISCA'07) and as Caffeine's
//! hill climber does with its window: two *shadow* caches, a plain S3-FIFO and a plain LRU,
//! replay a spatial sample of the references (SHARDS, Waldspurger et al., FAST'15: the keys
//! whose hash falls in 1/2^k of the space, in a cache 1/2^k the size), and their hits, halved
//! every few cache lifetimes, elect the leader once per such round. Both real orders see every
//! insert, access and removal, so switching leaders loses no history.
//!
//! Memory: the real cache carries both orders (LRU's 8 B per block beside S3-FIFO's); each
//! shadow holds at most [`SHADOW_MAX`] keys however large the cache (the sample shrinks as
//! the cache grows), so at 10 M blocks the shadows add under 1 B per block.

use super::{EvictionPolicy, Lru, Offer, S3Fifo};
use crate::types::FoldMap;

/// Most keys one shadow cache tracks; past it, the sample halves.
const SHADOW_MAX: usize = 1 << 16;
/// A round of the duel lasts this many shadow-cache capacities of sampled references. Chosen
/// on the Mooncake and `chat` traces (4 and 16 were close; 1, 2 and 32 worse), checked on
/// `agent` and `docqa` (bench/RESULTS.md).
const ROUND_LIFETIMES: usize = 8;

/// A miniature cache replaying the sampled references under one policy.
#[derive(Default)]
struct Shadow<P> {
    policy: P,
    /// Keys are engines' (the low word of a block key): hashed with the process's secret,
    /// and fast. With std's SipHash, the shadows' two lookups a sampled reference were 38% of
    /// a 64-key load's time in a store of 65,536 blocks (all of them sampled).
    id_of: FoldMap<u64, u32>,
    key_of: Vec<u64>,
    free: Vec<u32>,
    hits: u64,
}

impl<P: EvictionPolicy> Shadow<P> {
    /// One sampled reference, in a cache of `cap` blocks (`None`: not full yet, never evicts).
    fn reference(&mut self, key: u64, cap: Option<usize>) {
        if let Some(&id) = self.id_of.get(&key) {
            self.hits += 1;
            self.policy.access(id, key);
            return;
        }
        if cap.is_some_and(|c| self.id_of.len() >= c.max(1)) && !self.evict_one() {
            return;
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.key_of.push(0);
                (self.key_of.len() - 1) as u32
            }
        };
        self.key_of[id as usize] = key;
        self.id_of.insert(key, id);
        self.policy.insert(id, key);
    }

    /// Keeps only the keys `keep` accepts, and at most `cap` of them.
    fn resample(&mut self, keep: impl Fn(u64) -> bool, cap: Option<usize>) {
        let drop: Vec<(u64, u32)> = self
            .id_of
            .iter()
            .filter(|&(&k, _)| !keep(k))
            .map(|(&k, &id)| (k, id))
            .collect();
        for (k, id) in drop {
            self.id_of.remove(&k);
            self.policy.remove(id);
            self.free.push(id);
        }
        if let Some(c) = cap {
            while self.id_of.len() > c.max(1) && self.evict_one() {}
        }
    }

    /// Drops the policy's victim; false if it has none.
    fn evict_one(&mut self) -> bool {
        let key_of = &self.key_of;
        let Some(v) = self.policy.evict(&mut |v| Some(key_of[v as usize])) else {
            return false;
        };
        self.id_of.remove(&self.key_of[v as usize]);
        self.free.push(v);
        true
    }
}

/// The duel: S3-FIFO against a recency order `R`, LRU (`PolicyKind::Duel`) or CLOCK
/// (`PolicyKind::DuelClock`, 8 bytes a block less, hits a little lower where recency wins).
#[derive(Default)]
pub struct Duel<R = Lru> {
    s3: S3Fifo,
    recent: R,
    shadow_s3: Shadow<S3Fifo>,
    shadow_recent: Shadow<R>,
    /// The sample: keys whose mixed hash has its top `shift` bits zero (1 in 2^shift).
    shift: u32,
    /// Most blocks the real cache held when it had to evict (its capacity, as far as seen).
    cap: usize,
    /// Sampled references in this round.
    since_halving: usize,
    /// The recency order leads (chooses victims); S3-FIFO otherwise.
    recent_leads: bool,
}

fn mix(key: u64) -> u64 {
    let x = (key ^ (key >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// Whether `key` is in the sample of 1 in 2^`shift`.
fn in_sample(key: u64, shift: u32) -> bool {
    shift == 0 || mix(key) >> (64 - shift) == 0
}

impl<R: EvictionPolicy + Default> Duel<R> {
    fn shadow_cap(&self) -> Option<usize> {
        (self.cap > 0).then(|| (self.cap >> self.shift).max(1))
    }

    fn reference(&mut self, key: u64) {
        if !in_sample(key, self.shift) {
            return;
        }
        let cap = self.shadow_cap();
        self.shadow_s3.reference(key, cap);
        self.shadow_recent.reference(key, cap);
        if self
            .shadow_s3
            .id_of
            .len()
            .max(self.shadow_recent.id_of.len())
            > SHADOW_MAX
        {
            self.shift += 1;
            self.rebuild_sample();
        }
        // One round of the duel every few shadow-cache lifetimes: the leader is whichever got
        // more hits, counting earlier rounds at half weight, then half again, and so on.
        // Deciding per round rather than per reference keeps the real cache from flapping
        // between the two orders on near-ties (a mix of the two did worse than either).
        self.since_halving += 1;
        if self.since_halving >= ROUND_LIFETIMES * cap.unwrap_or(SHADOW_MAX).max(256) {
            self.since_halving = 0;
            self.recent_leads = self.shadow_recent.hits > self.shadow_s3.hits;
            self.shadow_s3.hits /= 2;
            self.shadow_recent.hits /= 2;
        }
    }

    fn rebuild_sample(&mut self) {
        let shift = self.shift;
        let cap = self.shadow_cap();
        self.shadow_s3.resample(|k| in_sample(k, shift), cap);
        self.shadow_recent.resample(|k| in_sample(k, shift), cap);
    }

    /// The real cache is full at `len` blocks: the shadows' capacity follows.
    fn learn_capacity(&mut self, len: usize) {
        if len > self.cap {
            self.cap = len;
            let shift = self.shift;
            while self.shift < 63 && self.cap >> self.shift > SHADOW_MAX {
                self.shift += 1;
            }
            // A larger capacity at the same sample needs nothing now (the shadows fill up);
            // a finer sample drops the keys outside it (a pass over at most 2 x 65,536 keys,
            // once per halving of the sample).
            if self.shift != shift {
                self.rebuild_sample();
            }
        }
    }
}

impl<R: EvictionPolicy + Default> EvictionPolicy for Duel<R> {
    fn name(&self) -> &'static str {
        match self.recent.name() {
            "lru" => "duel",
            _ => "duel-clock",
        }
    }

    fn reserve(&mut self, ids: usize) {
        self.s3.reserve(ids);
        self.recent.reserve(ids);
    }

    fn insert(&mut self, id: u32, key_hash: u64) {
        self.s3.insert(id, key_hash);
        self.recent.insert(id, key_hash);
        self.reference(key_hash);
    }

    fn access(&mut self, id: u32, key_hash: u64) {
        let tracked = self.s3.tracks(id);
        self.s3.access(id, key_hash);
        self.recent.access(id, key_hash);
        if tracked {
            self.reference(key_hash);
        }
    }

    fn remove(&mut self, id: u32) {
        self.s3.remove(id);
        self.recent.remove(id);
    }

    fn cool(&mut self, id: u32) {
        self.s3.cool(id);
        self.recent.cool(id);
    }

    fn evict(&mut self, try_evict: &mut Offer<'_>) -> Option<u32> {
        self.learn_capacity(self.s3.len());
        let victim = if self.recent_leads {
            self.recent.evict(try_evict)
        } else {
            self.s3.evict(try_evict)
        }?;
        if self.recent_leads {
            self.s3.remove(victim);
        } else {
            self.recent.remove(victim);
        }
        Some(victim)
    }

    fn leader(&self) -> Option<&'static str> {
        Some(if self.recent_leads {
            self.recent.name()
        } else {
            "s3fifo"
        })
    }

    fn len(&self) -> usize {
        self.s3.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Clock;

    /// Ids 0..cap; `refs` are keys; returns hits.
    fn run<R: EvictionPolicy + Default>(
        p: &mut Duel<R>,
        cap: usize,
        refs: impl Iterator<Item = u64>,
    ) -> u64 {
        let mut id_of: std::collections::HashMap<u64, u32> = Default::default();
        let mut key_of: Vec<u64> = Vec::new();
        let mut hits = 0;
        for k in refs {
            if let Some(&id) = id_of.get(&k) {
                hits += 1;
                p.access(id, k);
                continue;
            }
            let id = if key_of.len() < cap {
                key_of.push(k);
                (key_of.len() - 1) as u32
            } else {
                let v = p
                    .evict(&mut |v| Some(key_of[v as usize]))
                    .expect("a victim");
                id_of.remove(&key_of[v as usize]);
                key_of[v as usize] = k;
                v
            };
            id_of.insert(k, id);
            p.insert(id, k);
        }
        hits
    }

    #[test]
    fn the_leader_follows_the_traffic() {
        leader_follows::<Lru>("lru");
        leader_follows::<Clock>("clock");
    }

    fn leader_follows<R: EvictionPolicy + Default>(recent: &str) {
        let mut p = Duel::<R>::default();
        // A loop slightly larger than the small queue's share but inside the cache, each key
        // reused once a lap: LRU keeps it all, S3-FIFO's small queue drops it.
        let cap = 100;
        let lap = |i: u64| (0..80).map(move |k| (i << 32) | k);
        run(&mut p, cap, (0..50).flat_map(|i| lap(i / 2)));
        assert_eq!(
            p.leader(),
            Some(recent),
            "keys reused once a lap: the recency order should lead"
        );
        // Then a hot set of 70 keys, each back every 110 references, under a scan of
        // single-use keys: LRU (100 blocks) loses the hot set to the scan; S3-FIFO's ghost
        // catches it and its main queue keeps it.
        let (mut next, mut hot) = (1u64 << 40, 0u64);
        let refs = (0..22_000u64).map(move |i| {
            if i % 11 < 7 {
                hot += 1;
                hot % 70
            } else {
                next += 1;
                next
            }
        });
        run(&mut p, cap, refs);
        assert_eq!(
            p.leader(),
            Some("s3fifo"),
            "a hot set under a scan: S3-FIFO should lead"
        );
        assert_eq!(p.s3.len(), p.recent.len());
        assert_eq!(p.len(), cap);
    }

    #[test]
    fn shadows_stay_bounded_on_a_large_cache() {
        let mut p = Duel::<Lru>::default();
        let cap = 3 * SHADOW_MAX;
        run(&mut p, cap, 0..(4 * cap as u64));
        assert!(p.shift >= 2, "shift {}", p.shift);
        assert!(p.shadow_s3.id_of.len() <= SHADOW_MAX + 1);
        assert!(p.shadow_recent.id_of.len() <= SHADOW_MAX + 1);
        assert_eq!(p.len(), cap);
    }
}
