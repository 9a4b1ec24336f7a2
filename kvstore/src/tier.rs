//! The seam below the host arena: a tier that holds blocks the host tier can read back into a
//! slot and write out of one. The store walks an ordered chain of them (today: the disk tier;
//! next: the remote tier); it never knows their internals, and they never know the store's.

use std::io;

use crate::io::IoBuf;
use crate::key::{BlockKey, Fingerprint};
use crate::types::{BlockInfo, Tier};

/// One block to read into a host slot.
pub struct ReadItem {
    /// The block.
    pub key: BlockKey,
    /// Where its bytes go: at least the block's length rounded up to 4096.
    pub buf: IoBuf,
}

/// One block to write out of a host slot.
pub struct WriteItem {
    /// The block.
    pub key: BlockKey,
    /// Its namespace id in the owning store.
    pub ns: u16,
    /// Its bytes: at least `len` rounded up to 4096 (the tail of the last page zero).
    pub buf: IoBuf,
    /// Block length.
    pub len: u32,
    /// xxh3-64 of the block as committed to the host tier: a tier that finds other bytes in
    /// `buf` (an engine wrote into a slot it no longer owned) stores nothing and says
    /// [`WriteOutcome::Corrupt`].
    pub checksum: u64,
}

/// What happened to one block of a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Durable and visible now.
    Written,
    /// Already there.
    Present,
    /// Not now, try again later: another write of the key is in flight, or an earlier copy is
    /// still being removed.
    Busy,
    /// Not stored, and not worth retrying (no space, I/O error); counted and logged.
    Failed,
    /// The bytes did not match the block's commit checksum: the host copy is damaged.
    Corrupt,
    /// The block was removed while being written: not stored (its removal wins).
    Cancelled,
}

/// What happened to one block of a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// The buffer holds the block, its checksum verified.
    Hit(BlockInfo),
    /// Not there, or unreadable / corrupt (counted and logged): never served.
    Miss,
}

/// Usage of one namespace in one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NsUsage {
    /// Namespace id.
    pub ns: u16,
    /// Blocks.
    pub blocks: u64,
    /// Bytes of block payload.
    pub bytes: u64,
}

/// Upper bounds, in microseconds, of the latency buckets exported to Prometheus; one more
/// bucket holds everything above the last bound.
pub const LATENCY_BOUNDS_US: [u64; 16] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000,
    1_000_000, 5_000_000,
];

/// A latency distribution since start in the fixed buckets of [`LATENCY_BOUNDS_US`]: a
/// Prometheus histogram, taken from the HdrHistogram a tier records into.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LatencyBuckets {
    /// Values per bucket (not cumulative): one per bound, then the overflow bucket. Empty
    /// when nothing was recorded.
    pub counts: Vec<u64>,
    /// Sum of every recorded value, microseconds.
    pub sum_us: u64,
}

impl LatencyBuckets {
    /// Buckets the values recorded in `h` (microseconds), at its precision.
    pub fn from_hdr(h: &hdrhistogram::Histogram<u64>) -> Self {
        if h.is_empty() {
            return Self::default();
        }
        let mut counts = vec![0u64; LATENCY_BOUNDS_US.len() + 1];
        let mut sum = 0u64;
        for v in h.iter_recorded() {
            let value = h.median_equivalent(v.value_iterated_to());
            let n = v.count_at_value();
            sum = sum.saturating_add(value.saturating_mul(n));
            let i = LATENCY_BOUNDS_US.partition_point(|&b| b < value);
            counts[i] += n;
        }
        Self {
            counts,
            sum_us: sum,
        }
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }
}

/// Counters of a tier below the host arena.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Which tier.
    pub tier: Option<Tier>,
    /// The engine under it (`io_uring`, `psync`, a fault injector's name, `tcp`).
    pub engine: &'static str,
    /// Engine queue depth.
    pub queue_depth: u32,
    /// Bytes of block space.
    pub capacity_bytes: u64,
    /// Bytes of committed blocks (payload).
    pub used_bytes: u64,
    /// Committed blocks.
    pub blocks: u64,
    /// Blocks recovered at open.
    pub recovered_blocks: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Read operations.
    pub reads: u64,
    /// Write operations.
    pub writes: u64,
    /// Failed reads (the block was a miss).
    pub read_errors: u64,
    /// Failed writes (the block was not stored).
    pub write_errors: u64,
    /// Blocks whose checksum failed (served as misses, then dropped).
    pub checksum_failures: u64,
    /// Blocks evicted to make room.
    pub evictions: u64,
    /// Read latency percentiles, microseconds (p50, p99).
    pub read_us: (u64, u64),
    /// Write latency percentiles, microseconds (p50, p99).
    pub write_us: (u64, u64),
    /// Read latency distribution since start (what `/metrics` exports as a histogram).
    pub read_latency: LatencyBuckets,
    /// Write latency distribution since start.
    pub write_latency: LatencyBuckets,
    /// Achieved read bandwidth of promotions from this tier, bytes/s, exponentially weighted
    /// over read batches (0 until the first one): what break-even admission prices loads with.
    pub read_bandwidth: u64,
    /// Fixed cost of a read batch from this tier, nanoseconds (same weighting).
    pub read_latency_ns: u64,
    /// For a tier whose eviction policy switches between orders (the duel): the order choosing
    /// victims now (`"s3fifo"`, or `"lru"` / `"clock"`: the duel's recency order).
    pub policy_leader: Option<&'static str>,
}

/// A tier below the host arena. Every method is safe to call from several threads; reads and
/// writes block the calling thread (the store's tiering worker) until their I/O completed.
pub trait LowerTier: Send + Sync {
    /// Which tier this is.
    fn kind(&self) -> Tier;
    /// Whether [`LowerTier::lookup`] is cheap enough for an engine's request path (a local
    /// index, no network round trip).
    fn local(&self) -> bool {
        true
    }
    /// A committed block's length, namespace and checksum, if present (no side effects).
    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo>;
    /// [`LowerTier::lookup`] of many keys at once, one answer per key in order: a tier whose
    /// lookup is a network round trip asks once per batch. The store asks it for the suffix of
    /// a prefix that the local tiers do not hold.
    fn lookup_batch(&self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        keys.iter().map(|k| self.lookup(k)).collect()
    }
    /// Whether committed host blocks are pushed to this tier in the background as soon as they
    /// are committed (write-behind, the remote tier), rather than written to it on eviction
    /// (the disk tier). Such a tier is never a demotion target.
    fn write_behind(&self) -> bool {
        false
    }
    /// Pins a committed block against eviction (a lease); false if absent.
    fn pin(&self, key: &BlockKey) -> bool;
    /// Drops a pin taken by [`LowerTier::pin`].
    fn unpin(&self, key: &BlockKey);
    /// Reads blocks into the items' buffers, verifying checksums; one outcome per item.
    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome>;
    /// Writes blocks durably; one outcome per item. `still_wanted(key)` is asked, under the
    /// tier's own lock, right before a written block becomes visible: a block the store removed
    /// meanwhile is dropped ([`WriteOutcome::Cancelled`]) instead of coming back.
    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome>;
    /// [`LowerTier::write`] of a write-behind tier's late tries (the pusher's, minutes after
    /// a push failed): a tier that stops asking a failing target for a while (the remote
    /// tier's breakers) asks one whose pause has ended there and then, rather than counting
    /// the try as failed while it finds out in the background. With no other traffic to
    /// that target, nothing else would find out before the try (the last one given up).
    fn write_late(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        self.write(items, still_wanted)
    }
    /// Removes a block (an in-flight write of it is cancelled); false if absent.
    fn remove(&self, key: &BlockKey) -> bool;
    /// Removes every block of a namespace; returns their keys.
    fn clear_namespace(&self, ns: u16) -> Vec<BlockKey>;
    /// Blocks and bytes per namespace (scans: for admin use).
    fn namespace_usage(&self) -> Vec<NsUsage>;
    /// Counters.
    fn stats(&self) -> TierStats;
    /// Bytes in use and capacity, cheaply (no histograms), where the tier has a fixed
    /// capacity of its own: seen-twice admission admits every block while there is room.
    fn fill(&self) -> Option<(u64, u64)> {
        None
    }
    /// Records a namespace id durably, if the tier persists ids (the disk tier does).
    fn note_namespace(&self, _id: u16, _fp: Fingerprint) -> io::Result<()> {
        Ok(())
    }
    /// Namespace fingerprints the tier recovered, by id.
    fn recovered_namespaces(&self) -> Vec<Fingerprint> {
        Vec::new()
    }
    /// Makes the tier's index compact and durable (the disk tier rewrites its journal).
    fn checkpoint(&self) -> io::Result<()> {
        Ok(())
    }
    /// Memory the tier's I/O will target (the host arena, once populated), to register with
    /// its engine for faster I/O; a no-op by default. It stays mapped for the tier's life.
    fn register_memory(&self, _regions: Vec<(usize, usize)>) {}
    /// The tier as `Any` (tests reach a concrete tier to inject faults).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// A shared tier is a tier (the daemon keeps a handle on its remote tier for its own status).
impl<T: LowerTier + ?Sized> LowerTier for std::sync::Arc<T> {
    fn kind(&self) -> Tier {
        (**self).kind()
    }
    fn local(&self) -> bool {
        (**self).local()
    }
    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo> {
        (**self).lookup(key)
    }
    fn lookup_batch(&self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        (**self).lookup_batch(keys)
    }
    fn write_behind(&self) -> bool {
        (**self).write_behind()
    }
    fn pin(&self, key: &BlockKey) -> bool {
        (**self).pin(key)
    }
    fn unpin(&self, key: &BlockKey) {
        (**self).unpin(key)
    }
    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        (**self).read(items)
    }
    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        (**self).write(items, still_wanted)
    }
    fn write_late(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        (**self).write_late(items, still_wanted)
    }
    fn remove(&self, key: &BlockKey) -> bool {
        (**self).remove(key)
    }
    fn clear_namespace(&self, ns: u16) -> Vec<BlockKey> {
        (**self).clear_namespace(ns)
    }
    fn namespace_usage(&self) -> Vec<NsUsage> {
        (**self).namespace_usage()
    }
    fn stats(&self) -> TierStats {
        (**self).stats()
    }
    fn fill(&self) -> Option<(u64, u64)> {
        (**self).fill()
    }
    fn note_namespace(&self, id: u16, fp: Fingerprint) -> io::Result<()> {
        (**self).note_namespace(id, fp)
    }
    fn recovered_namespaces(&self) -> Vec<Fingerprint> {
        (**self).recovered_namespaces()
    }
    fn checkpoint(&self) -> io::Result<()> {
        (**self).checkpoint()
    }
    fn register_memory(&self, regions: Vec<(usize, usize)>) {
        (**self).register_memory(regions)
    }
    fn as_any(&self) -> &dyn std::any::Any {
        (**self).as_any()
    }
}

/// A lower tier built outside the store (the remote tier lives in `kvtier-cluster`), handed to
/// [`crate::StoreConfig::remote`]; it goes last in the chain.
#[derive(Clone)]
pub struct SharedTier(pub std::sync::Arc<dyn LowerTier>);

impl std::fmt::Debug for SharedTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedTier({:?})", self.0.kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_buckets_place_each_value_under_its_first_bound() {
        let mut h = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap();
        assert_eq!(LatencyBuckets::from_hdr(&h), LatencyBuckets::default());
        for (v, n) in [(7, 3), (10, 1), (11, 2), (900, 4), (7_000_000, 1)] {
            h.record_n(v, n).unwrap();
        }
        let b = LatencyBuckets::from_hdr(&h);
        assert_eq!(b.counts.len(), LATENCY_BOUNDS_US.len() + 1);
        assert_eq!(b.count(), 11);
        assert_eq!(b.counts[0], 4, "7 and 10 are <= 10 µs: {:?}", b.counts);
        assert_eq!(b.counts[1], 2, "11 µs is in (10, 25]");
        assert_eq!(b.counts[6], 4, "900 µs is in (500, 1000]");
        assert_eq!(b.counts[16], 1, "7 s is past the last bound");
        // The sum is exact to the histogram's two significant digits.
        let exact = 7 * 3 + 10 + 11 * 2 + 900 * 4 + 7_000_000;
        assert!(
            b.sum_us.abs_diff(exact) * 100 <= exact,
            "{} vs {exact}",
            b.sum_us
        );
    }
}
