//! Leases: pins held on behalf of a client until released or until their deadline. Ids are a
//! keyed hash of a counter (the key drawn from the OS at start), so they cannot be guessed from
//! one another: a client cannot release another client's pins by counting.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use xxhash_rust::xxh3::xxh3_64_with_seed;

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
    secret: u64,
    counter: u64,
    live: HashMap<u64, (Instant, Vec<Pin>)>,
    by_deadline: BTreeMap<(Instant, u64), ()>,
}

/// 8 random bytes from the OS (a hash of the time and pid if that fails).
pub(crate) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into the valid buffer.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if n == 8 {
        return u64::from_le_bytes(b);
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    xxh3_64_with_seed(&t.to_le_bytes(), u64::from(std::process::id()))
}

impl Default for Leases {
    fn default() -> Self {
        Self {
            secret: random_u64(),
            counter: 0,
            live: HashMap::new(),
            by_deadline: BTreeMap::new(),
        }
    }
}

impl Leases {
    /// Records pins as a lease.
    pub(crate) fn insert(&mut self, pins: Vec<Pin>, expires: Instant) -> LeaseId {
        let id = loop {
            self.counter += 1;
            let id = xxh3_64_with_seed(&self.counter.to_le_bytes(), self.secret);
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
}
