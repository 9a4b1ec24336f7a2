//! Removal. Removal wins over work in flight: a block being written (a put or a promotion) is
//! cancelled and its commit frees it; a block queued for or being written below never appears
//! there (the writer skips it, the tier asks `still_wanted` before publishing it); a pinned
//! block disappears from view at once and its slot is freed by the last unpin.

use std::collections::HashSet;
use std::sync::atomic::Ordering::Relaxed;

use crate::events::EventKind;
use crate::key::BlockKey;
use crate::types::{MapKey, NsId, Tier};

use super::index::{Life, Removed};
use super::{Inner, Store};

impl Store {
    /// Removes a committed block from every tier; `false` if absent. A pinned block becomes
    /// invisible now and its space is freed when the last pin goes.
    pub fn remove(&self, key: &BlockKey) -> bool {
        let host = self.inner.remove_host(key);
        let mut below = false;
        for t in &self.inner.tiers {
            below |= t.remove(key);
        }
        host || below
    }

    /// Removes every committed block of a namespace from every tier (and cancels its writes in
    /// flight); returns how many distinct blocks.
    pub fn clear_namespace(&self, ns: NsId) -> usize {
        let inner = &self.inner;
        let mut removed: HashSet<BlockKey> = HashSet::new();
        for s in inner.shards.iter() {
            let mut free = Vec::new();
            let mut gone = Vec::new();
            {
                let mut sh = s.lock();
                let keys: Vec<MapKey> = sh
                    .map
                    .iter()
                    .filter(|(_, e)| u32::from(e.ns) == ns.0 && e.life() != Life::Cancelled)
                    .map(|(k, _)| k)
                    .collect();
                for k in keys {
                    let ns = match sh.remove(k) {
                        Removed::Freed(slot, ns) => {
                            free.push(slot);
                            ns
                        }
                        Removed::Doomed(ns) => ns,
                        Removed::Cancelled | Removed::Absent => continue,
                    };
                    // Under the shard's lock (see `Events`).
                    inner
                        .events
                        .emit(EventKind::Removed, BlockKey::from(k), Tier::Host, ns);
                    gone.push(k);
                }
            }
            for slot in free {
                inner.free_published(slot);
            }
            for k in gone {
                inner.stats.blocks.fetch_sub(1, Relaxed);
                removed.insert(BlockKey::from(k));
            }
        }
        if let Ok(id) = u16::try_from(ns.0) {
            for t in &inner.tiers {
                removed.extend(t.clear_namespace(id));
            }
        }
        removed.len()
    }
}

impl Inner {
    pub(crate) fn remove_host(&self, key: &BlockKey) -> bool {
        let r = {
            let mut sh = self.shard(*key).lock();
            let r = sh.remove(MapKey::from(*key));
            // Under the shard's lock (see `Events`).
            if let Removed::Freed(_, ns) | Removed::Doomed(ns) = r {
                self.events.emit(EventKind::Removed, *key, Tier::Host, ns);
            }
            r
        };
        match r {
            Removed::Absent => return false,
            Removed::Cancelled => return true,
            Removed::Freed(slot, _) => self.free_published(slot),
            Removed::Doomed(_) => {}
        }
        self.stats.blocks.fetch_sub(1, Relaxed);
        true
    }
}
