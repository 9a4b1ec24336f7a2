//! The store's configuration.

use std::time::Duration;

use crate::disk::DiskConfig;
use crate::error::ConfigError;
use crate::policy::PolicyKind;

pub(crate) const PAGE: usize = 4096;

/// How the host arena's pages are faulted in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Populate {
    /// On first use (first-touch costs land in the hot path).
    Lazy,
    /// All of it before `build()` returns.
    #[default]
    Now,
    /// Segment by segment on a background thread; a segment takes blocks once populated, so
    /// the store serves at once and grows to its capacity (progress in [`crate::StoreStats`]).
    Background,
}

/// Configuration of a [`crate::Store`]; `build()` creates it.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// Bytes of host memory for block data. Rounded down to whole segments.
    pub capacity_bytes: u64,
    /// The arena is carved into segments of this size; each segment serves one size class at a
    /// time and returns to the pool when its class gives it up. Multiple of 4096, at least the
    /// largest size class.
    pub segment_bytes: u64,
    /// Slot sizes. Empty: 4 classes per power of two from 64 KiB up to `segment_bytes`.
    /// Each is rounded up to a multiple of 4096.
    pub size_classes: Vec<usize>,
    /// Index shards (power of two).
    pub shards: usize,
    /// Eviction policy (one instance per size class).
    pub policy: PolicyKind,
    /// Back the arena with explicit huge pages (MFD_HUGETLB); fails clearly if none are reserved.
    pub huge_pages: bool,
    /// When the arena's pages are faulted in.
    pub populate: Populate,
    /// Most leases outstanding at once.
    pub max_leases: usize,
    /// Verify a host block's commit checksum every time it is pinned for a load, before the
    /// caller copies it (a block an engine damaged after its commit is then a miss, never
    /// served). Off by default: it costs a read of every block (~30% of a single-thread copy,
    /// bench/RESULTS.md), and every copy out of the store through `get_into` and the connector
    /// checks the checksum as it copies at little cost. On for clients that copy blocks without
    /// checking (raw IPC clients).
    pub verify_reads: bool,
    /// Most bytes of blocks being preloaded (hinted with [`crate::Store::prefetch`]) at once,
    /// queued or being read; a hint past it is cut short (counted). 0: an eighth of the host
    /// tier.
    pub prefetch_max_inflight_bytes: u64,
    /// Most bytes of preloaded blocks held in host memory for the requests that hinted them
    /// (until a load uses them or the hint's deadline passes), preloads in flight included; a
    /// hint past it is cut short (counted). 0: an eighth of the host tier. Never below
    /// `prefetch_max_inflight_bytes`.
    pub prefetch_max_held_bytes: u64,
    /// Most bytes (in any tier) retained for sessions ([`crate::Store::retain`]) at once; a
    /// retain past it ends lower-priority retentions, then is clipped. `None`: a quarter of the
    /// host tier; `Some(0)`: retention off (every retain refused).
    pub retain_max_bytes: Option<u64>,
    /// Longest TTL a retain is granted (a longer one is shortened, and said so).
    pub retain_max_ttl: Duration,
    /// Longest a request waits for room (the tiering worker writing dirty blocks back) or for
    /// a block being promoted by someone else, before it gives up (no space / a miss).
    pub wait: Duration,
    /// The disk tier below the host tier, if any.
    pub disk: Option<DiskConfig>,
    /// A tier below the others reached over the network (`kvtier-cluster`'s remote tier), if
    /// any: asked for what the local tiers miss, and fed by write-behind pushes of committed
    /// blocks.
    pub remote: Option<crate::tier::SharedTier>,
    /// Most bytes of committed blocks queued for pushing to the remote tier (at most a quarter
    /// of the host tier: queued blocks are pinned); a block past it is not pushed (counted in
    /// `push_dropped`), so a slow network never holds up an engine.
    pub push_queue_bytes: u64,
    /// The wait before a failed push's first retry (then 4× longer each time; see the
    /// pusher: three tries holding the block's pin, three more without).
    pub push_retry_first: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            capacity_bytes: 1 << 30,
            segment_bytes: 64 << 20,
            size_classes: Vec::new(),
            shards: 64,
            policy: PolicyKind::default(),
            huge_pages: false,
            populate: Populate::Now,
            max_leases: 1 << 16,
            verify_reads: false,
            prefetch_max_inflight_bytes: 0,
            prefetch_max_held_bytes: 0,
            retain_max_bytes: None,
            retain_max_ttl: Duration::from_secs(3600),
            wait: Duration::from_secs(5),
            disk: None,
            remote: None,
            push_queue_bytes: 256 << 20,
            push_retry_first: Duration::from_secs(1),
        }
    }
}

impl StoreConfig {
    /// Validates the configuration and creates the store (allocating the arena, opening and
    /// recovering the disk tier, starting the tiering worker).
    pub fn build(self) -> Result<crate::Store, ConfigError> {
        crate::Store::new(self)
    }

    pub(crate) fn classes(&self) -> Result<Vec<usize>, ConfigError> {
        let seg = self.segment_bytes as usize;
        let mut classes: Vec<usize> = if self.size_classes.is_empty() {
            let mut v = Vec::new();
            let mut base = 64 << 10;
            while base <= seg {
                for q in [4, 5, 6, 7] {
                    let c = base / 4 * q;
                    if c <= seg {
                        v.push(c);
                    }
                }
                base *= 2;
            }
            v
        } else {
            self.size_classes
                .iter()
                .map(|&c| c.div_ceil(PAGE) * PAGE)
                .collect()
        };
        classes.sort_unstable();
        classes.dedup();
        if classes.is_empty() || classes[0] == 0 {
            return Err(ConfigError::BadSizeClasses(
                "need at least one non-zero class".into(),
            ));
        }
        if classes.len() > 255 {
            return Err(ConfigError::BadSizeClasses(format!(
                "{} classes, at most 255",
                classes.len()
            )));
        }
        if let Some(&max) = classes.last() {
            if max > seg {
                return Err(ConfigError::BadSizeClasses(format!(
                    "class {max} is larger than segment_bytes {seg}"
                )));
            }
        }
        Ok(classes)
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.segment_bytes == 0
            || !self.segment_bytes.is_multiple_of(PAGE as u64)
            || self.segment_bytes > u64::from(u32::MAX)
        {
            return Err(ConfigError::BadSegment(self.segment_bytes));
        }
        if !self.shards.is_power_of_two() || self.shards > 65536 {
            return Err(ConfigError::BadShards(self.shards));
        }
        if self.capacity_bytes / self.segment_bytes == 0 {
            return Err(ConfigError::CapacityTooSmall {
                capacity: self.capacity_bytes,
                segment: self.segment_bytes,
            });
        }
        let seg_pages = self.segment_bytes / PAGE as u64;
        if self.capacity_bytes / self.segment_bytes * seg_pages > u64::from(u32::MAX) {
            return Err(ConfigError::BadSegment(self.segment_bytes));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_classes() {
        let c = StoreConfig::default().classes().unwrap();
        assert_eq!(c[0], 64 << 10);
        assert_eq!(c[1], 80 << 10);
        assert_eq!(*c.last().unwrap(), 64 << 20);
        assert!(c.iter().all(|x| x % PAGE == 0));
    }

    #[test]
    fn bad_configs_name_the_problem() {
        let e = StoreConfig {
            capacity_bytes: 1,
            ..Default::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("capacity"), "{e}");
        assert!(StoreConfig {
            shards: 3,
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(StoreConfig {
            size_classes: vec![2 << 20],
            segment_bytes: 1 << 20,
            ..Default::default()
        }
        .classes()
        .is_err());
    }
}
