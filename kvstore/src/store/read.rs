//! Reads: the side-effect-free lookup, and the one path that makes a prefix resident and pins
//! it (`pin_prefix`), on which `get`, `load` and the daemon's load-and-lease stand. A block
//! promoted from a lower tier is reserved with the caller's pin already on it, so the pin that
//! the promotion took *is* the caller's: there is no moment at which it could be evicted.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::StoreError;
use crate::events::EventKind;
use crate::key::BlockKey;
use crate::types::{BlockInfo, KeyMix, LeaseId, MapKey, Tier};

use super::config::PAGE;
use super::index::{Entry, Life, PinRead, Removed, Slot};
use super::lease::Pin;
use super::table;
use super::tiering::{Promote, Ticket};
use super::{Inner, Store};

/// Result of a longest-prefix lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixMatch {
    /// How many leading keys are present.
    pub n: usize,
    /// The tier of each of the `n` leading keys (the fastest tier holding it).
    pub tiers: Vec<Tier>,
    /// Keys right after the `n` present ones that are being saved now (reserved, not committed
    /// yet: another engine is writing them). A load that asks for them waits for their commit
    /// within its deadline; an aborted or lapsed save is a miss there.
    pub pending: usize,
}

/// Leading present keys pinned until [`Store::release`] or expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The lease, or `None` when nothing was found (nothing to release).
    pub id: Option<LeaseId>,
    /// Leading keys found and pinned.
    pub n: usize,
    /// The tier of each pinned key.
    pub tiers: Vec<Tier>,
    /// When the pins lapse on their own.
    pub expires: Instant,
}

/// Where a loaded block lies in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockLoc {
    /// Byte offset in the arena.
    pub offset: u64,
    /// Block length.
    pub len: u32,
    /// Its commit checksum (xxh3-64).
    pub checksum: u64,
}

/// A block pinned in host memory.
#[derive(Clone, Copy)]
pub(crate) struct Pinned {
    key: BlockKey,
    slot: Slot,
    page: u32,
    len: u32,
    checksum: u64,
}

enum Step {
    Host(Pinned),
    /// Our own promotion: item `1` of batch `0`.
    Own(usize, usize),
    /// Someone else is promoting it.
    Wait(BlockKey),
}

/// Keys hashed together by [`Inner::host_prefix`].
const STEP: usize = 8;

/// Keys hashed together by [`Inner::host_prefix_far`] (an engine's lookup is often one run)…
const FAR_RUN: usize = 64;
/// …how many keys ahead of the one it reads it prefetches…
const FAR_AHEAD: usize = 20;
/// …and how many lines of each, from its home bucket's on.
const FAR_LINES: usize = 5;

/// How far ahead of the key it looks up a walk along a prefix prefetches ([`HostView`]).
const PREFETCH_AHEAD: usize = 8;
/// Prefetching pays only when the index is larger than the CPU's caches: from this many
/// buckets in all (2 MiB of buckets). Below, it costs a quarter of a lookup's time
/// (`match_prefix chain 1000`, 1,000 blocks) and saves nothing.
const PREFETCH_FROM_BUCKETS: usize = 1 << 16;

/// A walk along a prefix's keys (positions in increasing order) that, in an index larger
/// than the caches, prefetches the home bucket of the key `PREFETCH_AHEAD` places ahead of the
/// one it is at (no lock: `table::Hint`), so the keys' cache misses overlap instead of each
/// waiting behind the previous key's lock (a locked instruction waits for every load before
/// it). It hands out each key's hash, computed once, and holds the epoch in which the walk
/// reads the index without locks (`table::Hint::read`).
pub(crate) struct Prefetcher {
    /// Keys before this one have been prefetched (none when `on` is false)…
    prefetched: usize,
    /// …and their hashes kept here, at their position modulo 16.
    hashes: [u32; 16],
    on: bool,
    guard: crossbeam_epoch::Guard,
}

const _: () = assert!(PREFETCH_AHEAD < 16);

impl Prefetcher {
    pub(crate) fn new(inner: &Inner, keys: &[BlockKey]) -> Self {
        let guard = crossbeam_epoch::pin();
        // The first shard's size stands for every shard's (keys spread evenly).
        let buckets = inner.hints[0].capacity(&guard) * inner.shards.len();
        Prefetcher {
            prefetched: 0,
            hashes: [0; 16],
            on: keys.len() > 1 && buckets >= PREFETCH_FROM_BUCKETS,
            guard,
        }
    }

    /// Skips the walk to `pos`: the keys before it are not asked for.
    pub(crate) fn skip_to(&mut self, pos: usize) {
        self.prefetched = self.prefetched.max(pos);
    }

    /// The hash of `keys[pos]` (`table::hash`), prefetching ahead of it.
    #[inline(always)]
    pub(crate) fn hash(&mut self, inner: &Inner, keys: &[BlockKey], pos: usize) -> u32 {
        if !self.on {
            return table::hash(MapKey::from(keys[pos]));
        }
        self.ahead(inner, keys, pos)
    }

    /// [`Prefetcher::hash`] when prefetching: out of line, as the walk through a small
    /// index (no prefetching) is a loop of a few dozen instructions a key.
    #[inline(never)]
    fn ahead(&mut self, inner: &Inner, keys: &[BlockKey], pos: usize) -> u32 {
        if pos + 16 <= self.prefetched {
            return table::hash(MapKey::from(keys[pos]));
        }
        let ahead = keys.len().min(pos + PREFETCH_AHEAD + 1);
        while self.prefetched < ahead {
            let h = table::hash(MapKey::from(keys[self.prefetched]));
            inner.hints[inner.shard_of(h)].prefetch(h, &self.guard);
            self.hashes[self.prefetched % 16] = h;
            self.prefetched += 1;
        }
        self.hashes[pos % 16]
    }
}

/// The host index's entries of a prefix's keys, each read as a walk along the prefix reaches
/// it (with a [`Prefetcher`]): without the shard's lock (`table::Hint::read`), or under it
/// when a write got in the way.
pub(crate) struct HostView<'a> {
    inner: &'a Inner,
    keys: &'a [BlockKey],
    prefetcher: Prefetcher,
}

impl<'a> HostView<'a> {
    pub(crate) fn new(inner: &'a Inner, keys: &'a [BlockKey]) -> Self {
        HostView {
            inner,
            keys,
            prefetcher: Prefetcher::new(inner, keys),
        }
    }

    /// The entry of `keys[pos]` (positions asked in increasing order).
    #[inline(always)]
    pub(crate) fn get(&mut self, pos: usize) -> Option<Entry> {
        let mk = MapKey::from(*self.keys.get(pos)?);
        let h = self.prefetcher.hash(self.inner, self.keys, pos);
        let shard = self.inner.shard_of(h);
        if let Some(e) = self.inner.hints[shard].read(h, &mk, &self.prefetcher.guard) {
            return e;
        }
        self.locked(shard, h, &mk)
    }

    /// [`HostView::get`] when a write got in the way: under the shard's lock.
    #[cold]
    #[inline(never)]
    fn locked(&self, shard: usize, h: u32, mk: &MapKey) -> Option<Entry> {
        self.inner.shards[shard].lock().map.get_hashed(h, mk)
    }
}

impl Store {
    /// Longest run of leading keys that are present, and the fastest tier of each. No side
    /// effects: no pins, no policy updates, no hit counters.
    pub fn match_prefix(&self, keys: &[BlockKey]) -> PrefixMatch {
        self.inner.match_prefix(keys)
    }

    /// [`Store::match_prefix`] with break-even admission: a block is worth loading only if
    /// loading it is expected to beat computing it. Host blocks cost nothing; a block in a lower
    /// tier costs its bytes at the tier's measured read bandwidth, plus the tier's batch latency
    /// once; computing costs `tokens_per_block / prefill_tokens_per_s` per block. The answer is
    /// the prefix length that minimises load time of the prefix + compute time of the rest
    /// (the longest of equals); `present` is the prefix found before the cut. A tier not
    /// measured yet is trusted (no cut). Returns (the priced match, present).
    ///
    /// This is an engine's lookup for a request it is about to run (`tokens_per_block` 0: no
    /// pricing), and the store learns from it: when a prefix is present, the blocks after it
    /// count as seen once for seen-twice admission (a conversation's new turn is the next
    /// turn's prefix). Probes that must leave no trace (a router's) use
    /// [`Store::match_prefix`].
    pub fn match_prefix_priced(
        &self,
        keys: &[BlockKey],
        tokens_per_block: u32,
        prefill_tokens_per_s: f64,
    ) -> (PrefixMatch, usize) {
        self.inner
            .match_prefix_priced(keys, tokens_per_block, prefill_tokens_per_s)
    }

    /// Per key, what this node's own tiers (host memory, disk) say of it, never asking the
    /// remote tier: the cluster's data plane answers peers with it. `ns` is this store's id.
    pub fn probe_local(&self, keys: &[BlockKey]) -> Vec<Option<(BlockInfo, Tier)>> {
        self.inner.probe_local(keys)
    }

    /// [`Store::load`] from this node's own tiers only (never the remote tier), waiting for
    /// promotions at most until `deadline`: what the cluster's data plane serves peers from.
    pub fn load_local(&self, keys: &[BlockKey], deadline: Instant) -> Result<Loaded, StoreError> {
        let pins = self.inner.pin_prefix_in(keys, deadline, false, false)?;
        Ok(Loaded {
            inner: self.inner.clone(),
            pins,
        })
    }

    /// The expected seconds to bring blocks into host memory, each given as (the tier holding
    /// it, its bytes), from each lower tier's measured read speed (a batch per tier: its
    /// latency once plus bytes / bandwidth; host blocks cost nothing), and whether every tier
    /// involved has been measured (a tier not measured yet counts nothing). What the cluster
    /// Lookup answers per member, so a router compares loading there with recomputing.
    pub fn load_seconds(&self, blocks: &[(Tier, u64)]) -> (f64, bool) {
        let inner = &self.inner;
        let mut bytes = vec![0u64; inner.tiers.len()];
        for (t, b) in blocks {
            if *t == Tier::Host {
                continue;
            }
            if let Some(i) = inner.tiers.iter().position(|x| x.kind() == *t) {
                bytes[i] += b;
            }
        }
        let mut secs = 0.0;
        let mut measured = true;
        for (i, b) in bytes.into_iter().enumerate().filter(|(_, b)| *b > 0) {
            match inner.speed[i].lock().cost(b) {
                Some(c) => secs += c,
                None => measured = false,
            }
        }
        (secs, measured)
    }

    /// Whether a committed block with this key is present in any tier (no side effects).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.match_prefix(std::slice::from_ref(key)).n == 1
    }

    /// Whether a committed block with this key is in host memory (no side effects).
    pub fn in_host(&self, key: &BlockKey) -> bool {
        self.inner
            .shard(*key)
            .lock()
            .map
            .get(&MapKey::from(*key))
            .is_some_and(|e| e.ready())
    }

    /// Pins a committed block and borrows its bytes; `None` is a miss. A block found only in a
    /// lower tier is first promoted into host memory (checksum verified; a failed check is a
    /// miss).
    pub fn get(&self, key: &BlockKey) -> Option<BlockRef> {
        let deadline = Instant::now() + self.inner.wait;
        let mut p = self
            .inner
            .pin_prefix_in(std::slice::from_ref(key), deadline, true, false)
            .ok()?;
        let p = p.pop()?;
        Some(BlockRef {
            inner: self.inner.clone(),
            p,
        })
    }

    /// Copies a committed block into `dst`; `Ok(None)` is a miss, `Ok(Some(len))` a hit. The
    /// bytes are checked against the block's commit checksum as they are copied (each chunk
    /// hashed while in cache): a damaged block is dropped and is a miss.
    pub fn get_into(&self, key: &BlockKey, dst: &mut [u8]) -> Result<Option<usize>, StoreError> {
        let Some(b) = self.get(key) else {
            return Ok(None);
        };
        if dst.len() < b.len() {
            return Err(StoreError::BufferTooSmall {
                need: b.len(),
                got: dst.len(),
            });
        }
        let sum = crate::checksum::copy_out_hashed(&mut dst[..b.len()], &b);
        if sum != b.p.checksum {
            self.inner.damaged(&b.p);
            return Ok(None);
        }
        Ok(Some(b.len()))
    }

    /// Makes the longest present prefix of `keys` resident in host memory (reading the blocks
    /// that are only below in one batch per tier) and pins it; the pins go when the returned
    /// guard drops. A block that fails its checksum, a read that fails and a promotion that
    /// takes longer than the store's `wait` end the prefix.
    pub fn load(&self, keys: &[BlockKey]) -> Result<Loaded, StoreError> {
        let deadline = Instant::now() + self.inner.wait;
        let pins = self.inner.pin_prefix(keys, deadline)?;
        Ok(Loaded {
            inner: self.inner.clone(),
            pins,
        })
    }

    /// [`Store::load`] for another process that mapped the arena: the pins become a lease
    /// (released by [`Store::release`] or after `ttl`), and each block's arena location is
    /// returned. `deadline` bounds the wait for promotions.
    pub fn load_and_lease(
        &self,
        keys: &[BlockKey],
        ttl: Duration,
        deadline: Instant,
    ) -> Result<(Lease, Vec<BlockLoc>), StoreError> {
        let inner = &self.inner;
        inner.reap_expired_leases_at(Instant::now());
        if inner.leases.lock().len() >= inner.max_leases {
            return Err(StoreError::TooManyLeases(inner.max_leases));
        }
        let pins = inner.pin_prefix(keys, deadline)?;
        let locs = pins
            .iter()
            .map(|p| BlockLoc {
                offset: u64::from(p.page) * PAGE as u64,
                len: p.len,
                checksum: p.checksum,
            })
            .collect();
        let n = pins.len();
        let expires = Instant::now() + ttl;
        let id = (n > 0).then(|| {
            inner.leases.lock().insert(
                pins.iter().map(|p| Pin::Host(p.key, p.slot)).collect(),
                expires,
            )
        });
        Ok((
            Lease {
                id,
                n,
                tiers: vec![Tier::Host; n],
                expires,
            },
            locs,
        ))
    }

    /// Pins the leading present keys (in any tier, without loading them) until
    /// [`Store::release`] or until `ttl` passes. Repeated keys are pinned once. Like
    /// [`Store::match_prefix_priced`], an engine's lookup: the blocks after a present prefix
    /// count as seen once for admission.
    pub fn lease(&self, keys: &[BlockKey], ttl: Duration) -> Result<Lease, StoreError> {
        let inner = &self.inner;
        inner.reap_expired_leases_at(Instant::now());
        let expires = Instant::now() + ttl;
        if inner.leases.lock().len() >= inner.max_leases {
            return Err(StoreError::TooManyLeases(inner.max_leases));
        }
        let mut pinned = Vec::new();
        let mut tiers = Vec::new();
        let mut seen = crate::types::FoldMap::default();
        for k in keys {
            if seen.insert(MapKey::from(*k), ()).is_some() {
                continue;
            }
            let host = inner.shard(*k).lock().pin(MapKey::from(*k));
            match host {
                Ok(Some(e)) => {
                    pinned.push(Pin::Host(*k, e.slot()));
                    tiers.push(Tier::Host);
                    continue;
                }
                Ok(None) => {}
                Err(e) => {
                    inner.drop_pins(pinned);
                    return Err(e);
                }
            }
            let below = inner
                .tiers
                .iter()
                .enumerate()
                .find(|(_, t)| t.local() && t.pin(k));
            match below {
                Some((i, t)) => {
                    pinned.push(Pin::Lower(i as u8, *k));
                    tiers.push(t.kind());
                }
                None => break,
            }
        }
        let n = pinned.len();
        inner.continues(keys, n);
        let id = (n > 0).then(|| inner.leases.lock().insert(pinned, expires));
        Ok(Lease {
            id,
            n,
            tiers,
            expires,
        })
    }

    /// Releases a lease; `false` if it was unknown (already released or expired).
    pub fn release(&self, id: LeaseId) -> bool {
        let pins = self.inner.leases.lock().remove(id);
        match pins {
            Some(p) => {
                self.inner.drop_pins(p);
                true
            }
            None => false,
        }
    }

    /// Releases every lease whose deadline has passed; returns how many.
    pub fn reap_expired_leases(&self) -> usize {
        self.inner.reap_expired_leases_at(Instant::now())
    }

    /// Releases every lease whose deadline is at or before `now`; returns how many.
    pub fn reap_expired_leases_at(&self, now: Instant) -> usize {
        self.inner.reap_expired_leases_at(now)
    }
}

impl Inner {
    /// The first local lower tier that holds `key` (its index in `tiers`) and what it says of it.
    pub(crate) fn find_below(&self, key: &BlockKey) -> Option<(usize, crate::types::BlockInfo)> {
        self.tiers
            .iter()
            .enumerate()
            .filter(|(_, t)| t.local())
            .find_map(|(i, t)| t.lookup(key).map(|info| (i, info)))
    }

    pub(crate) fn match_prefix_priced(
        &self,
        keys: &[BlockKey],
        tokens_per_block: u32,
        rate: f64,
    ) -> (PrefixMatch, usize) {
        let (mut m, below) = self.match_prefix_in(keys, true);
        let present = m.n;
        self.continues(keys, present);
        if tokens_per_block == 0 || rate.is_nan() || rate <= 0.0 {
            return (m, present);
        }
        // `as` saturates: an infinite rate reads as u64::MAX.
        self.stats.break_even_prefill.store(rate as u64, Relaxed);
        if m.tiers.iter().all(|t| *t == Tier::Host) {
            return (m, present);
        }
        let compute = f64::from(tokens_per_block) / rate;
        // Load time of the first i blocks: per tier, its latency once plus bytes / bandwidth.
        let mut best = (compute * m.n as f64, 0usize);
        let mut bytes_below = vec![0u64; self.tiers.len()];
        for (i, b) in below.iter().enumerate() {
            if let Some((ti, info)) = b {
                bytes_below[*ti] += u64::from(info.len);
            }
            let mut load = 0.0;
            for (ti, &b) in bytes_below.iter().enumerate() {
                // A tier not measured yet is trusted (costs nothing).
                if let Some(c) = self.speed[ti].lock().cost(b).filter(|_| b > 0) {
                    load += c;
                }
            }
            let total = load + compute * (m.n - i - 1) as f64;
            if total <= best.0 {
                best = (total, i + 1);
            }
        }
        if best.1 < m.n {
            self.stats.break_even_cuts.fetch_add(1, Relaxed);
            self.stats
                .break_even_blocks_cut
                .fetch_add((m.n - best.1) as u64, Relaxed);
            m.n = best.1;
            m.tiers.truncate(best.1);
            // Blocks being saved after the present prefix are past the cut too.
            m.pending = 0;
        }
        (m, present)
    }

    pub(crate) fn match_prefix(&self, keys: &[BlockKey]) -> PrefixMatch {
        self.match_prefix_in(keys, true).0
    }

    /// The non-local tier (the remote tier), if any: its index in `tiers`.
    pub(crate) fn remote_tier(&self) -> Option<usize> {
        self.tiers.iter().position(|t| !t.local())
    }

    /// Where `keys[pos]` is below host memory: the first local lower tier holding it, else
    /// (with `remote`) what the remote tier says. The remote tier is asked once per walk of a
    /// prefix, for every key from the first the local tiers miss, and its answer kept in
    /// `far` for the later keys (which are still looked up locally first).
    pub(crate) fn find_below_or_far(
        &self,
        keys: &[BlockKey],
        pos: usize,
        remote: bool,
        far: &mut Option<(usize, Vec<Option<BlockInfo>>)>,
    ) -> Option<(usize, BlockInfo)> {
        if let Some(x) = self.find_below(&keys[pos]) {
            return Some(x);
        }
        let ri = self.remote_tier().filter(|_| remote)?;
        let (start, infos) =
            far.get_or_insert_with(|| (pos, self.tiers[ri].lookup_batch(&keys[pos..])));
        infos
            .get(pos - *start)
            .copied()
            .flatten()
            .map(|info| (ri, info))
    }

    /// The longest present prefix: the local chain first, then (with `remote`) one batched
    /// question to the remote tier for the rest. Beside it, for each block below host memory,
    /// its tier's index and what that tier says of it (`below` is as long as the prefix, or
    /// empty when every block of it is in host memory).
    pub(crate) fn match_prefix_in(
        &self,
        keys: &[BlockKey],
        remote: bool,
    ) -> (PrefixMatch, Vec<Option<(usize, BlockInfo)>>) {
        let mut host = HostView::new(self, keys);
        // Most of a prefix is usually in host memory: walk that part on the fast path.
        let start = self.host_prefix(keys, &host.prefetcher.guard, host.prefetcher.on);
        host.prefetcher.skip_to(start);
        let mut tiers = Vec::with_capacity(keys.len());
        tiers.resize(start, Tier::Host);
        // Filled from the first block below host memory on (most prefixes have none).
        let mut below = Vec::new();
        let mut far = None;
        for pos in start..keys.len() {
            if host.get(pos).is_some_and(|e| e.ready()) {
                tiers.push(Tier::Host);
                if !below.is_empty() {
                    below.push(None);
                }
                continue;
            }
            let Some((i, info)) = self.find_below_or_far(keys, pos, remote, &mut far) else {
                break;
            };
            tiers.push(self.tiers[i].kind());
            if below.is_empty() {
                below.reserve(keys.len());
                below.resize(pos, None);
            }
            below.push(Some((i, info)));
        }
        // Read-your-writes: the run of keys being written right after the present prefix.
        let n = tiers.len();
        let pending = (n..keys.len())
            .take_while(|&pos| host.get(pos).is_some_and(|e| e.life() == Life::Filling))
            .count();
        (PrefixMatch { n, tiers, pending }, below)
    }

    /// How many leading keys are ready in host memory, read without locks: the part of a
    /// prefix match that most lookups are made of, in a loop with nothing else in it. It
    /// stops at the first key that is not ready here (absent, being written, below host
    /// memory) or whose read a write got in the way of; [`Inner::match_prefix_in`]'s general
    /// walk goes on from there, and answers for that key exactly. The keys' hashes are
    /// computed a step of [`STEP`] at a time, the next step's before this step's buckets are
    /// read. With `prefetch` (an index larger than the caches) the walk is
    /// [`Inner::host_prefix_far`]'s instead. `guard`: the epoch in which the buckets are read
    /// ([`table::Hint::read`]).
    ///
    /// The general walk costs ~10 ns a key from cache (`match_prefix chain 1000`, 3 GHz
    /// Xeon): per key it reloads the secret (a lazily set static), the shard mask and the
    /// hints' address (the compiler cannot keep them in registers across its stores), grows
    /// the answer's vector, and asks whether it prefetches and whether a tier below was met;
    /// and its probe builds an empty-table slice and checks bounds a bucket. This loop, with
    /// [`table::Hint::read_ready`], takes ~5.3 ns (the keyed hash ~0.8 of them: 4.5–4.7 with
    /// the hashes computed beforehand). Out of line: inlined, its registers spilled around
    /// the caller's.
    #[inline(never)]
    fn host_prefix(
        &self,
        keys: &[BlockKey],
        guard: &crossbeam_epoch::Guard,
        prefetch: bool,
    ) -> usize {
        if prefetch {
            return self.host_prefix_far(keys, guard);
        }
        let mix = KeyMix::new();
        let mask = (1usize << self.shard_bits) - 1;
        // As long as the mask allows (there are that many shards): no bounds check a key.
        let hints: &[table::Hint] = &self.hints[..=mask];
        let hash = |chunk: &[BlockKey], out: &mut [u32; STEP]| {
            for (o, k) in out.iter_mut().zip(chunk) {
                *o = table::hash_with(mix, *k);
            }
        };
        let mut chunks = keys.chunks(STEP);
        let Some(mut chunk) = chunks.next() else {
            return 0;
        };
        let mut next = [0u32; STEP];
        hash(chunk, &mut next);
        let mut n = 0;
        loop {
            let now = next;
            let following = chunks.next();
            if let Some(c) = following {
                hash(c, &mut next);
            }
            for (k, &h) in chunk.iter().zip(&now) {
                if !hints[h as usize & mask].read_ready(h, &MapKey::from(*k), guard) {
                    return n;
                }
                n += 1;
            }
            match following {
                Some(c) => chunk = c,
                None => return n,
            }
        }
    }

    /// [`Inner::host_prefix`] in an index larger than the caches: the hashes of up to
    /// [`FAR_RUN`] keys at a time computed first (the run's first [`FAR_AHEAD`] keys'
    /// [`FAR_LINES`] lines prefetched as their hashes come), then each later key's
    /// [`FAR_LINES`] lines from its home bucket on prefetched [`FAR_AHEAD`] keys before the
    /// walk reads it. A run past the first starts its prefetches only once it is hashed, so
    /// its first keys wait longer (an engine's lookup of up to 64 blocks is one run).
    ///
    /// Measured at 10 M blocks (Zen 5, `kvtier-bench host --metadata-blocks 10000000`, p50
    /// of 64-key lookups, against the same at 65,536 blocks; bench/RESULTS.md): 3 lines 8
    /// keys ahead (the general walk's [`Prefetcher`]) 2.7–3.1 µs; 3 lines 24 ahead 2.5–2.6;
    /// 5 lines 12 ahead 2.0–2.1, 16 ahead 1.7–1.9, **20 ahead 1.7–1.75**, 24 ahead 1.8–1.9;
    /// 6–7 lines 16 ahead 1.6–1.9. The fourth and fifth lines are what a deep look-ahead
    /// buys: at 84% full, one key in eight lies past its home bucket's third line, and its
    /// probe then waits for DRAM with the probe's exit branch unresolved, so the walk
    /// stalls there for a whole miss. Fewer keys ahead ask for the lines too late; more keep
    /// lines in flight that are wanted later, and the prefetches wait for fill buffers.
    #[inline(never)]
    fn host_prefix_far(&self, keys: &[BlockKey], guard: &crossbeam_epoch::Guard) -> usize {
        let mix = KeyMix::new();
        let mask = (1usize << self.shard_bits) - 1;
        let hints: &[table::Hint] = &self.hints[..=mask];
        let mut n = 0;
        for run in keys.chunks(FAR_RUN) {
            let mut hs = [0u32; FAR_RUN];
            for (j, (o, k)) in hs.iter_mut().zip(run).enumerate() {
                let h = table::hash_with(mix, *k);
                *o = h;
                if j < FAR_AHEAD {
                    hints[h as usize & mask].prefetch_lines::<FAR_LINES>(h, guard);
                }
            }
            let hs = &hs[..run.len()];
            for (j, (k, &h)) in run.iter().zip(hs).enumerate() {
                if let Some(&a) = hs.get(j + FAR_AHEAD) {
                    hints[a as usize & mask].prefetch_lines::<FAR_LINES>(a, guard);
                }
                if !hints[h as usize & mask].read_ready(h, &MapKey::from(*k), guard) {
                    return n;
                }
                n += 1;
            }
        }
        n
    }

    /// Per key, what the local tiers (host memory first) say of it: for the cluster's data
    /// plane, which answers for the blocks this node owns and never asks further.
    pub(crate) fn probe_local(&self, keys: &[BlockKey]) -> Vec<Option<(BlockInfo, Tier)>> {
        let mut host = HostView::new(self, keys);
        keys.iter()
            .enumerate()
            .map(|(pos, k)| match host.get(pos).filter(|e| e.ready()) {
                Some(e) => {
                    let slot = e.slot();
                    let (len, checksum) = {
                        let c = self.classes[slot.class as usize].lock();
                        (c.lens[slot.idx as usize], c.sums[slot.idx as usize])
                    };
                    Some((
                        BlockInfo {
                            len,
                            ns: e.ns,
                            checksum,
                        },
                        Tier::Host,
                    ))
                }
                None => self
                    .find_below(k)
                    .map(|(i, info)| (info, self.tiers[i].kind())),
            })
            .collect()
    }

    /// The one load path: pins the longest prefix of `keys` that is (or can be made) resident
    /// in host memory by `deadline`, promoting blocks from the lower tiers. Every returned block
    /// holds one pin for the caller.
    pub(crate) fn pin_prefix(
        &self,
        keys: &[BlockKey],
        deadline: Instant,
    ) -> Result<Vec<Pinned>, StoreError> {
        self.pin_prefix_in(keys, deadline, true, true)
    }

    /// [`Inner::pin_prefix`]; with `remote` false the remote tier is not asked (the cluster's
    /// data plane serves only what this node holds); with `saves` a block being saved (another
    /// engine's reservation, not committed yet) is waited for like a promotion (an engine's
    /// load: read-your-writes), else it ends the prefix at once (a single get, a peer's read).
    pub(crate) fn pin_prefix_in(
        &self,
        keys: &[BlockKey],
        deadline: Instant,
        remote: bool,
        saves: bool,
    ) -> Result<Vec<Pinned>, StoreError> {
        // Preloads held past their deadline go back to the eviction policy.
        self.reap_preloads(Instant::now());
        let mut steps: Vec<Step> = Vec::with_capacity(keys.len());
        // Own promotions, one batch per lower tier.
        let mut batches: Vec<(usize, Vec<Promote>)> = Vec::new();
        let mut seen = crate::types::FoldMap::default();
        let mut far = None;
        let mut prefetcher = Prefetcher::new(self, keys);
        'keys: for (pos, k) in keys.iter().enumerate() {
            let mk = MapKey::from(*k);
            if seen.insert(mk, ()).is_some() {
                // A repeated key cannot be a prefix of distinct blocks: stop here.
                break;
            }
            let h = prefetcher.hash(self, keys, pos);
            for attempt in 0..2 {
                match self.try_pin_hashed(*k, h)? {
                    Found::Pinned(p, preloaded) => {
                        if preloaded {
                            self.stats.prefetch_in_time.fetch_add(1, Relaxed);
                        }
                        steps.push(Step::Host(p));
                        continue 'keys;
                    }
                    Found::Promoting => {
                        // A queued preload holding it is read next, before other preloads.
                        self.escalate_prefetch(*k);
                        steps.push(Step::Wait(*k));
                        continue 'keys;
                    }
                    Found::Filling if saves => {
                        // Another engine is saving it: wait for its commit (read-your-writes),
                        // within the same deadline; an abort or a lapse ends the prefix there.
                        steps.push(Step::Wait(*k));
                        continue 'keys;
                    }
                    Found::Busy | Found::Filling => break 'keys,
                    Found::Absent if attempt == 1 => break 'keys,
                    Found::Absent => {}
                }
                let Some((ti, info)) = self.find_below_or_far(keys, pos, remote, &mut far) else {
                    break 'keys;
                };
                let Ok(class) = self.class_for(info.len as usize) else {
                    break 'keys;
                };
                let Ok((slot, page)) = self.alloc(class, *k, info.len as usize, deadline) else {
                    break 'keys;
                };
                let mut sh = self.shard(*k).lock();
                if sh.map.contains_key(&mk) {
                    // Someone got there first: give the slot back, look again.
                    drop(sh);
                    self.free_slot(slot);
                    continue;
                }
                sh.insert_promoting(mk, slot, info.ns);
                drop(sh);
                let b = match batches.iter().position(|(t, _)| *t == ti) {
                    Some(b) => b,
                    None => {
                        batches.push((ti, Vec::new()));
                        batches.len() - 1
                    }
                };
                batches[b].1.push(Promote {
                    key: *k,
                    slot,
                    page,
                    cap: self.class_sizes[class],
                    len: info.len,
                });
                steps.push(Step::Own(b, batches[b].1.len() - 1));
                continue 'keys;
            }
        }
        // Its epoch pin is not held through the waits below: a pinned reader keeps a grown
        // table's old buckets from being freed.
        drop(prefetcher);
        // Submit our promotions, then wait for them and for others', with one deadline.
        let from: Vec<Tier> = batches
            .iter()
            .map(|(ti, _)| self.tiers[*ti].kind())
            .collect();
        let mut promoted: Vec<(Vec<Promote>, Arc<Ticket>)> = batches
            .into_iter()
            .map(|(ti, items)| (items.clone(), self.enqueue_promotions(ti, items)))
            .collect();
        let waits = !promoted.is_empty() || steps.iter().any(|s| matches!(s, Step::Wait(_)));
        if waits {
            self.stats.waits.fetch_add(1, Relaxed);
        }
        let waiting_since = waits.then(Instant::now);
        let outcomes: Vec<Option<Vec<bool>>> =
            promoted.iter().map(|(_, t)| t.wait(deadline)).collect();
        let mut out = Vec::with_capacity(steps.len());
        let mut ended = false;
        for s in steps {
            let got = if ended {
                None
            } else {
                match s {
                    Step::Host(p) => Some(p),
                    Step::Own(b, i) => match &outcomes[b] {
                        Some(ok) if ok[i] => {
                            self.pinned_now(promoted[b].0[i].key, promoted[b].0[i].slot)
                        }
                        _ => None,
                    },
                    Step::Wait(k) => self.wait_promoted(k, deadline),
                }
            };
            match got {
                Some(p) => {
                    if let Step::Own(b, _) = s {
                        match from[b] {
                            Tier::Disk => self.stats.disk_hits.fetch_add(1, Relaxed),
                            Tier::Remote => self.stats.remote_hits.fetch_add(1, Relaxed),
                            Tier::Host => 0,
                        };
                    }
                    out.push(p)
                }
                None => {
                    ended = true;
                    // Pins past the end are dropped (ours, by promotions that succeeded).
                    match s {
                        Step::Host(p) => self.unpin(p.key, p.slot),
                        Step::Own(b, i) => {
                            if outcomes[b].as_ref().is_some_and(|ok| ok[i]) {
                                let p = &promoted[b].0[i];
                                self.unpin(p.key, p.slot);
                            }
                        }
                        Step::Wait(_) => {}
                    }
                }
            }
        }
        promoted.clear();
        if let Some(t) = waiting_since {
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.stats.load_wait_ns.fetch_add(ns, Relaxed);
        }
        // Host blocks are checked against their commit checksum before anyone copies them.
        if self.verify_reads {
            if let Some(bad) = out.iter().position(|p| !self.verify(p)) {
                for p in out.drain(bad..) {
                    self.unpin(p.key, p.slot);
                }
            }
        }
        // The policy sees the served blocks tail first: at equal recency a parent outlives its
        // children (evicting a parent would kill their hits), as SGLang's radix cache and
        // vLLM's block pool evict chain tails first.
        // One class lock per run of same-class blocks (a request's blocks share one size).
        let mut rest = &out[..];
        while let Some(last) = rest.last() {
            let class = last.slot.class;
            let mut c = self.classes[class as usize].lock();
            while let Some((p, before)) = rest.split_last() {
                if p.slot.class != class {
                    break;
                }
                c.policy.access(p.slot.idx, p.key.0 as u64);
                rest = before;
            }
        }
        let served: u64 = out.iter().map(|p| u64::from(p.len)).sum();
        self.stats.hits.fetch_add(out.len() as u64, Relaxed);
        self.stats.bytes_out.fetch_add(served, Relaxed);
        if out.len() < keys.len() {
            self.stats.misses.fetch_add(1, Relaxed);
        }
        Ok(out)
    }

    /// Pins `key` if Ready; says why not otherwise.
    fn try_pin(&self, key: BlockKey) -> Result<Found, StoreError> {
        self.try_pin_hashed(key, table::hash(MapKey::from(key)))
    }

    /// [`Inner::try_pin`] of a key whose `table::hash` is `h`.
    fn try_pin_hashed(&self, key: BlockKey, h: u32) -> Result<Found, StoreError> {
        let read = self.shards[self.shard_of(h)]
            .lock()
            .pin_read(h, MapKey::from(key))?;
        let (e, preloaded) = match read {
            PinRead::Absent => return Ok(Found::Absent),
            PinRead::Promoting => return Ok(Found::Promoting),
            PinRead::Filling => return Ok(Found::Filling),
            PinRead::Cancelled => return Ok(Found::Busy),
            PinRead::Pinned(e, preloaded) => (e, preloaded),
        };
        // Used: a hint's hold ends (the caller has its own pin now); "preloaded" if the hint's
        // preload read it.
        let preloaded = preloaded && self.release_preload(key);
        Ok(Found::Pinned(self.pinned(key, &e), preloaded))
    }

    /// The location and checksum of a block we hold a pin on.
    /// (The policy learns of the access once the load is done: [`Inner::pin_prefix_in`].)
    fn pinned(&self, key: BlockKey, e: &Entry) -> Pinned {
        let slot = e.slot();
        let (page, len, checksum) = {
            let c = self.classes[slot.class as usize].lock();
            (
                c.page_of(slot.idx, self.seg_pages),
                c.lens[slot.idx as usize],
                c.sums[slot.idx as usize],
            )
        };
        Pinned {
            key,
            slot,
            page,
            len,
            checksum,
        }
    }

    /// A promoted block (published Ready with our pin on it).
    fn pinned_now(&self, key: BlockKey, slot: Slot) -> Option<Pinned> {
        let e = self
            .shard(key)
            .lock()
            .map
            .get(&MapKey::from(key))
            .filter(|e| e.slot() == slot && e.ready())?;
        Some(self.pinned(key, &e))
    }

    /// Waits for another request's promotion (or save) of `key`, then pins it.
    fn wait_promoted(&self, key: BlockKey, deadline: Instant) -> Option<Pinned> {
        loop {
            let seen = self.progress.current();
            match self.try_pin(key).ok()? {
                Found::Pinned(p, preloaded) => {
                    if preloaded {
                        self.stats.prefetch_late.fetch_add(1, Relaxed);
                    }
                    return Some(p);
                }
                Found::Promoting | Found::Filling if Instant::now() < deadline => {
                    self.progress.wait(seen, deadline);
                }
                _ => return None,
            }
        }
    }

    /// Whether a pinned host block still has the bytes it was committed with; a damaged one is
    /// dropped (counted, logged, never served).
    fn verify(&self, p: &Pinned) -> bool {
        // SAFETY: the block is committed and pinned: its slot is neither freed nor reused.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr(p.page), p.len as usize) };
        if crate::checksum::checksum(bytes) == p.checksum {
            return true;
        }
        self.damaged(p);
        false
    }

    /// Drops a pinned host block whose bytes no longer match its commit checksum (counted,
    /// logged; its slot is freed by the last unpin).
    fn damaged(&self, p: &Pinned) {
        self.stats.checksum_failures.fetch_add(1, Relaxed);
        tracing::warn!(key = %p.key, "host block no longer matches its commit checksum (written after its commit?): served as a miss and dropped");
        let removed = {
            let mut sh = self.shard(p.key).lock();
            let mk = MapKey::from(p.key);
            let same = sh.map.get(&mk).is_some_and(|e| e.slot() == p.slot);
            let removed = if same { sh.remove(mk) } else { Removed::Absent };
            if let Removed::Doomed(ns) | Removed::Freed(_, ns) = removed {
                self.events.emit(EventKind::Removed, p.key, Tier::Host, ns);
            }
            removed
        };
        // We hold a pin, so it is doomed: its slot is freed by the last unpin.
        match removed {
            Removed::Doomed(_) => {}
            Removed::Freed(slot, _) => self.free_published(slot),
            Removed::Absent | Removed::Cancelled => return,
        }
        self.stats.blocks.fetch_sub(1, Relaxed);
    }

    /// Drops one pin of a host block (freeing its slot if it was removed meanwhile).
    pub(crate) fn unpin(&self, key: BlockKey, slot: Slot) {
        let freed = self.shard(key).lock().unpin(MapKey::from(key), slot);
        if freed {
            self.free_published(slot);
        } else {
            self.progress.bump();
        }
    }

    pub(crate) fn drop_pins(&self, pins: Vec<Pin>) {
        for p in pins {
            match p {
                Pin::Host(k, slot) => self.unpin(k, slot),
                Pin::Lower(t, k) => {
                    if let Some(t) = self.tiers.get(t as usize) {
                        t.unpin(&k);
                    }
                }
            }
        }
    }

    pub(crate) fn reap_expired_leases_at(&self, now: Instant) -> usize {
        let expired = self.leases.lock().expired(now);
        let n = expired.len();
        for pins in expired {
            self.drop_pins(pins);
        }
        if n > 0 {
            self.stats.leases_expired.fetch_add(n as u64, Relaxed);
            tracing::debug!(n, "leases expired");
        }
        n
    }
}

enum Found {
    /// Pinned; true if a preload had brought it in and no load had used it yet.
    Pinned(Pinned, bool),
    Promoting,
    /// Being written by a put: loadable once committed.
    Filling,
    /// Removed while being written or read: not loadable.
    Busy,
    Absent,
}

/// Blocks made resident and pinned by [`Store::load`]; the pins go when this drops.
pub struct Loaded {
    inner: Arc<Inner>,
    pins: Vec<Pinned>,
}

impl Loaded {
    /// Leading keys loaded.
    pub fn len(&self) -> usize {
        self.pins.len()
    }

    /// Whether nothing was loaded.
    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }

    /// Block `i`'s bytes, for a store whose arena no other process maps (an engine's embedded
    /// store, a test). A daemon's arena is mapped writable by engines: it reads blocks through
    /// [`Loaded::arena_block`].
    pub fn block(&self, i: usize) -> &[u8] {
        let p = &self.pins[i];
        // SAFETY: the block is committed and pinned by this guard: its slot is neither freed,
        // evicted nor reserved until the guard drops, so this process does not write it; it
        // lies in the arena. (Another process mapping the arena could: see `arena_block`.)
        unsafe { std::slice::from_raw_parts(self.inner.ptr(p.page), p.len as usize) }
    }

    /// Block `i` as shared memory (copied out through raw pointers: see [`ArenaSlice`]).
    pub fn arena_block(&self, i: usize) -> crate::ArenaSlice<'_> {
        let p = &self.pins[i];
        // SAFETY: the slot lies in the arena, mapped while `self.inner` (held by this guard)
        // lives, and stays this block's until the guard drops.
        unsafe { crate::ArenaSlice::new(self.inner.ptr(p.page), p.len as usize) }
    }

    /// Block `i`'s commit checksum.
    pub fn checksum(&self, i: usize) -> u64 {
        self.pins[i].checksum
    }
}

impl Drop for Loaded {
    fn drop(&mut self) {
        for p in self.pins.drain(..) {
            self.inner.unpin(p.key, p.slot);
        }
    }
}

/// A pinned, committed block. Dereferences to its bytes; unpins on drop.
pub struct BlockRef {
    inner: Arc<Inner>,
    p: Pinned,
}

impl BlockRef {
    /// The block's key.
    pub fn key(&self) -> BlockKey {
        self.p.key
    }

    /// Byte offset of the block in the arena.
    pub fn arena_offset(&self) -> u64 {
        u64::from(self.p.page) * PAGE as u64
    }

    /// The block's commit checksum (xxh3-64).
    pub fn checksum(&self) -> u64 {
        self.p.checksum
    }
}

impl std::ops::Deref for BlockRef {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the block is committed and pinned: its slot cannot be freed, evicted or
        // reserved until this guard drops, so nobody writes it, and it lies in the arena.
        unsafe { std::slice::from_raw_parts(self.inner.ptr(self.p.page), self.p.len as usize) }
    }
}

impl Drop for BlockRef {
    fn drop(&mut self) {
        self.inner.unpin(self.p.key, self.p.slot);
    }
}
