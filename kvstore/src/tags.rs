//! Engine tags: what an engine calls a block (its own hash, and its parent's), kept beside the
//! block in the disk tier's journal so that a restarted daemon can publish its disk blocks under
//! the hashes routers knew. The store never reads them: they are labels, not keys (a block is
//! found, checked and served by its kvtier key alone).

use std::sync::Arc;

use crate::key::BlockKey;

/// Longest engine hash kept (vLLM's SHA-256 block hashes are 32 bytes).
pub const MAX_ENGINE_HASH: usize = 32;

/// An engine's own hash of a block, inline (1 to [`MAX_ENGINE_HASH`] bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineHash {
    len: u8,
    bytes: [u8; MAX_ENGINE_HASH],
}

impl EngineHash {
    /// `None` when empty or longer than [`MAX_ENGINE_HASH`].
    pub fn new(h: &[u8]) -> Option<Self> {
        if h.is_empty() || h.len() > MAX_ENGINE_HASH {
            return None;
        }
        let mut bytes = [0; MAX_ENGINE_HASH];
        bytes[..h.len()].copy_from_slice(h);
        Some(Self {
            len: h.len() as u8,
            bytes,
        })
    }

    /// The hash as the engine gave it.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }

    /// vLLM's integer form: `int.from_bytes(h, "big") & (2**64 - 1)`.
    pub fn low64(&self) -> u64 {
        self.as_bytes()
            .iter()
            .fold(0u64, |a, &b| (a << 8) | u64::from(b))
    }
}

/// A block's engine hash and, when the engine said, its parent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineTag {
    /// The block's hash.
    pub hash: EngineHash,
    /// The hash of the block before it in its sequence (None: not said, or the first).
    pub parent: Option<EngineHash>,
}

/// Where the disk tier asks for the tags of the blocks it writes (and of its live blocks at a
/// checkpoint): one call per batch, one answer per key, in order. The daemon answers from its
/// engine-hash map (a leaf lock; the disk tier calls it holding at most its journal lock).
pub type Tagger = Arc<dyn Fn(&[BlockKey]) -> Vec<Option<EngineTag>> + Send + Sync>;
