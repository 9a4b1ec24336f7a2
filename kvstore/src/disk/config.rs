//! The disk tier's configuration and errors.

use std::io;
use std::path::PathBuf;

use crate::io::IoConfig;
use crate::policy::PolicyKind;

/// Which host blocks are written below.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Admission {
    /// Every block leaving the host tier.
    Always,
    /// Only blocks seen at least twice: read while in host memory, or put again after being
    /// dropped once without admission. One-off blocks never cost disk bandwidth.
    #[default]
    SeenTwice,
}

impl Admission {
    /// Parses `always` or `seen-twice`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "always" => Some(Self::Always),
            "seen-twice" | "twice" => Some(Self::SeenTwice),
            _ => None,
        }
    }
}

/// [`DiskConfig::admit_all_below`]'s default: seen-twice once the disk is nine tenths full.
pub const DEFAULT_ADMIT_ALL_BELOW: f64 = 0.9;

/// Bounce buffers a store gives its disk tier when its arena is in 4 KiB pages (at most an
/// eighth of the arena): 48 reads of 2 MiB, the queue full while completions are copied out.
pub const BOUNCE_BYTES: u64 = 96 << 20;

/// Configuration of the disk tier.
#[derive(Clone, Debug)]
pub struct DiskConfig {
    /// Directory of the data files and the journal (created if absent).
    pub dir: PathBuf,
    /// Bytes of block data across all files (rounded down to 4096 per file).
    pub capacity_bytes: u64,
    /// Data files to spread blocks over (one per drive, typically).
    pub files: u32,
    /// I/O engine settings.
    pub io: IoConfig,
    /// Eviction policy of the disk tier.
    pub policy: PolicyKind,
    /// Which host blocks get written to disk.
    pub admission: Admission,
    /// Seen-twice admission admits every block while the disk holds less than this fraction
    /// of its capacity: writing into free room displaces nothing, and a block refused once is
    /// recomputed when it comes back (a turn's newest blocks, which leave host memory before
    /// the next turn reads them). 0: seen-twice from the first block.
    pub admit_all_below: f64,
    /// Write admitted blocks to disk when they are committed (write-through) instead of when the
    /// host tier evicts them (write-back). Either way the tiering worker writes them.
    pub write_through: bool,
    /// Most bytes one write batch carries (bounds in-flight demotion).
    pub max_batch_bytes: u64,
    /// Bytes of huge-page bounce buffers that reads and writes go through (0: none, the I/O
    /// goes straight to and from the blocks' memory). A store given 0 chooses: 96 MiB (at
    /// most an eighth of its arena) when its arena is in 4 KiB pages and private memory can
    /// have huge ones, else none; a store given more keeps it. A 2 MiB read scattered over
    /// 512 pages ran at 0.7 of the device's rate here, into huge pages and then copied at
    /// 0.84-1.04 (bench/RESULTS.md).
    pub bounce_bytes: u64,
}

impl Default for DiskConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("kvtier-data"),
            capacity_bytes: 8 << 30,
            files: 1,
            io: IoConfig::default(),
            policy: PolicyKind::default(),
            bounce_bytes: 0,
            admission: Admission::default(),
            admit_all_below: DEFAULT_ADMIT_ALL_BELOW,
            write_through: false,
            max_batch_bytes: 256 << 20,
        }
    }
}

/// Errors opening the disk tier.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiskError {
    /// File system error on a path.
    // The I/O error is part of the message, not a `source`: error reporters that print the
    // chain would say it twice.
    #[error("disk tier: {path}: {error}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        error: io::Error,
    },
    /// Existing files do not match the configuration or each other.
    #[error("disk tier: {0}")]
    Mismatch(String),
    /// Configuration is invalid.
    #[error("disk tier: invalid configuration: {0}")]
    Config(String),
    /// Another process uses the directory.
    #[error("disk tier: {dir} is in use by another process (it holds {lock}): give each kvtierd its own disk.dir")]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// Its lock file.
        lock: PathBuf,
    },
}
