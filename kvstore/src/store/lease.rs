//! Leases: pins held on behalf of a client until released or until their deadline. Ids are
//! drawn from a CSPRNG (ChaCha12, `rand`'s `StdRng`, seeded from the OS), so one id says
//! nothing of the others: a client cannot release another client's pins by guessing. (They were
//! a seeded XXH3 of a counter, which one known id reverses for 8-byte input.)

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

use crate::key::BlockKey;
use crate::types::LeaseId;

use super::index::Slot;

/// One pinned block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pin {
    /// A host block (by key and the slot it was pinned in).
    Host(BlockKey, Slot),
    /// A block of the lower tier at this index of the chain.
    Lower(u8, BlockKey),
}

pub(crate) struct Leases {
    rng: StdRng,
    live: HashMap<u64, (Instant, Vec<Pin>)>,
    by_deadline: BTreeMap<(Instant, u64), ()>,
}

impl Default for Leases {
    fn default() -> Self {
        Self {
            rng: StdRng::from_entropy(),
            live: HashMap::new(),
            by_deadline: BTreeMap::new(),
        }
    }
}

impl Leases {
    /// Records pins as a lease.
    pub(crate) fn insert(&mut self, pins: Vec<Pin>, expires: Instant) -> LeaseId {
        let id = loop {
            let id = self.rng.next_u64();
            if id != 0 && !self.live.contains_key(&id) {
                break id;
            }
        };
        self.live.insert(id, (expires, pins));
        self.by_deadline.insert((expires, id), ());
        LeaseId(id)
    }

    /// Takes a lease's pins out (release).
    pub(crate) fn remove(&mut self, id: LeaseId) -> Option<Vec<Pin>> {
        let (deadline, pins) = self.live.remove(&id.0)?;
        self.by_deadline.remove(&(deadline, id.0));
        Some(pins)
    }

    /// Takes out every lease whose deadline is at or before `now`.
    pub(crate) fn expired(&mut self, now: Instant) -> Vec<Vec<Pin>> {
        let mut out = Vec::new();
        while let Some((&(deadline, id), _)) = self.by_deadline.first_key_value() {
            if deadline > now {
                break;
            }
            self.by_deadline.remove(&(deadline, id));
            if let Some((_, pins)) = self.live.remove(&id) {
                out.push(pins);
            }
        }
        out
    }

    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }

    /// Pinned blocks over every lease.
    pub(crate) fn pinned(&self) -> usize {
        self.live.values().map(|(_, p)| p.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn ids_are_unguessable_and_expire_in_order() {
        let mut l = Leases::default();
        let now = Instant::now();
        let a = l.insert(
            vec![Pin::Lower(0, BlockKey(1))],
            now + Duration::from_secs(1),
        );
        let b = l.insert(vec![], now + Duration::from_secs(2));
        assert_ne!(a, b);
        assert_ne!(b.0.wrapping_sub(a.0), 1, "ids are not sequential");
        assert_eq!(l.len(), 2);
        assert_eq!(l.pinned(), 1);
        assert_eq!(l.expired(now + Duration::from_millis(1500)).len(), 1);
        assert!(l.remove(a).is_none(), "expired");
        assert_eq!(l.remove(b), Some(vec![]));
        assert_eq!(l.len(), 0);
        // Another table draws other ids.
        let mut m = Leases::default();
        assert_ne!(m.insert(vec![], now), a);
    }

    #[test]
    fn consecutive_ids_share_no_structure() {
        // From a CSPRNG: no two of 4096 ids collide, and the difference of consecutive ids
        // (constant or small for a counter, whatever its keyed hash) takes every bit.
        let mut l = Leases::default();
        let far = Instant::now() + Duration::from_secs(60);
        let ids: Vec<u64> = (0..4096).map(|_| l.insert(vec![], far).0).collect();
        let set: std::collections::HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(set.len(), ids.len());
        let or = ids.windows(2).fold(0u64, |a, w| a | (w[1] ^ w[0]));
        assert_eq!(or, u64::MAX);
        let ones: u32 = ids.iter().map(|v| v.count_ones()).sum();
        let mean = f64::from(ones) / ids.len() as f64;
        assert!((30.0..34.0).contains(&mean), "{mean} bits set on average");
    }
}
