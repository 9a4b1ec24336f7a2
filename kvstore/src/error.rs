//! Error types. A miss is never an error: lookups return `Option` or an outcome enum.

use thiserror::Error;

/// Bad key or namespace input.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// A key must be exactly 16 bytes.
    #[error("a block key is {expected} bytes, got {got}: pass the 16-byte big-endian key")]
    WrongLength {
        /// Expected length.
        expected: usize,
        /// Length given.
        got: usize,
    },
    /// A hex key must be 32 hex digits.
    #[error("{0:?} is not a block key: expected 32 hex digits")]
    BadHex(String),
    /// Engine block hashes are 1..=64 bytes.
    #[error("an engine block hash must be 1 to 64 bytes, got {0}")]
    EngineHashLength(usize),
    /// A namespace field is invalid.
    #[error("invalid namespace: {0}")]
    BadNamespace(String),
    /// The store's namespace table is full.
    #[error(
        "the namespace table is full ({0} namespaces): clear namespaces that are no longer used"
    )]
    TableFull(usize),
}

/// Errors of the host arena and store configuration.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Capacity must hold at least one segment.
    #[error("host capacity {capacity} bytes is smaller than one segment ({segment} bytes): raise capacity_bytes")]
    CapacityTooSmall {
        /// Configured capacity.
        capacity: u64,
        /// Segment size.
        segment: u64,
    },
    /// A size-class list is invalid.
    #[error("invalid size classes: {0}")]
    BadSizeClasses(String),
    /// The segment size is invalid.
    #[error("segment_bytes {0} must be a multiple of 4096 and at least the largest size class")]
    BadSegment(u64),
    /// Shard count must be a power of two.
    #[error("shards = {0} must be a power of two between 1 and 65536")]
    BadShards(usize),
    /// The disk tier could not be opened.
    #[error(transparent)]
    Disk(#[from] crate::disk::DiskError),
    /// A worker thread could not be started.
    #[error("cannot start the store's worker threads: {0}")]
    Thread(String),
    /// The arena could not be created or mapped.
    #[error("cannot create the host arena of {bytes} bytes: {source}{hint}")]
    Arena {
        /// Requested size.
        bytes: u64,
        /// The OS error.
        source: std::io::Error,
        /// What to do about it.
        hint: &'static str,
    },
}

/// Errors of store operations.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreError {
    /// The block does not fit any size class.
    #[error("block of {len} bytes is larger than the largest size class ({max} bytes)")]
    TooLarge {
        /// Block length.
        len: usize,
        /// Largest class.
        max: usize,
    },
    /// Zero-length blocks are not stored.
    #[error("a block must not be empty")]
    Empty,
    /// No slot could be freed: everything that could hold the block is pinned or being written.
    #[error(
        "no space for a {len}-byte block: every candidate slot is pinned, leased or being written"
    )]
    NoSpace {
        /// Block length.
        len: usize,
    },
    /// Namespace id not registered with this store.
    #[error("namespace id {0} is not registered with this store")]
    UnknownNamespace(u32),
    /// Too many leases outstanding.
    #[error("too many leases outstanding (limit {0}): release leases or raise max_leases")]
    TooManyLeases(usize),
    /// A block is pinned by 2^32 - 1 readers already.
    #[error("too many pins on one block: release some first")]
    TooManyPins,
    /// The destination buffer is too small.
    #[error("destination buffer of {got} bytes is smaller than the {need}-byte block")]
    BufferTooSmall {
        /// Block length.
        need: usize,
        /// Buffer length.
        got: usize,
    },
    /// The data written into a reservation has the wrong length.
    #[error("reservation is for {reserved} bytes, commit claims {got}")]
    LengthMismatch {
        /// Reserved length.
        reserved: usize,
        /// Length passed.
        got: usize,
    },
}
