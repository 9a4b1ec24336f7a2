//! kvtier's store: block keys and namespaces, a sharded index, the host-memory tier, the disk
//! tier (O_DIRECT through io_uring or pread/pwrite, crash-safe journal) and eviction policies.
//!
//! ```
//! use kvstore::{BlockKey, Namespace, StoreConfig, TpShard};
//! let store = StoreConfig { capacity_bytes: 64 << 20, ..Default::default() }.build()?;
//! let ns = Namespace {
//!     model: "meta-llama/Llama-3.1-8B".into(), dtype: "bfloat16".into(), layout: "nhd".into(),
//!     block_tokens: 256, tp: TpShard::Rank { size: 1, rank: 0 },
//!     tenant: String::new(), lora: String::new(),
//! };
//! let id = store.register_namespace(&ns)?;
//! let keys = ns.token_keys(&[1; 512], &[]);
//! store.put(id, keys[0], b"kv bytes")?;
//! assert_eq!(store.match_prefix(&keys).n, 1);
//! assert_eq!(&*store.get(&keys[0]).unwrap(), b"kv bytes");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod arena;
pub mod checksum;
pub mod disk;
mod error;
mod events;
#[cfg(test)]
mod fuzz_tests;
pub mod io;
mod key;
pub mod policy;
mod store;
mod sync;
mod tags;
mod tier;
mod types;

pub use arena::{fill_pattern, AlignedBuf, Arena, ArenaSlice};
pub use checksum::{
    checksum, checksum_with_leaves, copy_hashed, copy_nt, copy_out_hashed, gather_hashed,
    Checksummer, RunChecksummer,
};
pub use disk::{Admission, DiskConfig, DiskError, DiskTier, DEFAULT_ADMIT_ALL_BELOW};
pub use error::{ConfigError, KeyError, StoreError};
pub use events::{BlockEvent, EventKind, Events, Subscription};
pub use key::{BlockKey, Fingerprint, Namespace, TpShard};
pub use policy::{EvictionPolicy, PolicyKind};
pub use store::{
    BlockLoc, BlockRef, Demoted, Lease, Loaded, NamespaceStats, Populate, Prefetch, PrefetchQuota,
    PrefetchStats, PrefixMatch, PutOutcome, Reservation, Reserve, RetainBound, Retained,
    RetentionStats, Store, StoreConfig, StoreStats, MAX_RETENTIONS, MAX_SESSION_BYTES,
    PREFETCH_WAITING_KEYS_MAX,
};
pub use tags::{EngineHash, EngineTag, Tagger, MAX_ENGINE_HASH};
pub use tier::{
    LatencyBuckets, LowerTier, NsUsage, ReadItem, ReadOutcome, SharedTier, TierStats, WriteItem,
    WriteOutcome, LATENCY_BOUNDS_US,
};
pub use types::{BlockInfo, FoldHasher, FoldMap, LeaseId, MapKey, NsId, Tier};
