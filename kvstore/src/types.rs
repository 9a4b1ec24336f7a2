//! Types shared by the store and every tier below it (so that neither imports the other): where
//! a block lives, namespace and lease ids, the index's map key and hasher, and what a tier says
//! about a block.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::key::BlockKey;

/// Where a block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Tier {
    /// The shared host-memory arena.
    Host,
    /// The local disk tier.
    Disk,
    /// Another node (or an external store) reached over the network.
    Remote,
}

impl Tier {
    /// Lowercase name for logs, stats and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Host => "host",
            Tier::Disk => "disk",
            Tier::Remote => "remote",
        }
    }
}

/// A registered namespace's id inside one store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NsId(pub u32);

/// A lease id: unguessable (drawn from a keyed hash of a counter), so one client cannot release
/// another's pins by counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// What a tier knows of one committed block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// Block length in bytes.
    pub len: u32,
    /// Namespace id in the owning store.
    pub ns: u16,
    /// xxh3-64 of the block's bytes.
    pub checksum: u64,
}

/// The index's map key: a `BlockKey` as two words (8-byte aligned, so a map bucket with a
/// 16-byte entry is 32 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct MapKey(pub(crate) [u64; 2]);

impl From<BlockKey> for MapKey {
    fn from(k: BlockKey) -> Self {
        MapKey([(k.0 >> 64) as u64, k.0 as u64])
    }
}

impl From<MapKey> for BlockKey {
    fn from(k: MapKey) -> Self {
        BlockKey((u128::from(k.0[0]) << 64) | u128::from(k.0[1]))
    }
}

/// Keys are already uniform hashes: fold the two words instead of hashing again.
#[derive(Default)]
pub struct FoldHasher(u64);

impl Hasher for FoldHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = self.0.rotate_left(29) ^ x;
    }
    fn write_usize(&mut self, x: usize) {
        self.write_u64(x as u64);
    }
}

/// A hash map keyed by already-uniform hashes.
pub type FoldMap<K, V> = HashMap<K, V, BuildHasherDefault<FoldHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_key_roundtrip() {
        let k = BlockKey(0x0123_4567_89ab_cdef_fedc_ba98_7654_3210);
        assert_eq!(BlockKey::from(MapKey::from(k)), k);
        assert_eq!(Tier::Disk.name(), "disk");
    }
}
