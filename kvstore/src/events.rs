//! Block events (stored, removed, per tier) for watchers such as the admin API's `Watch` and
//! cache-aware routers. Delivery is best effort: a watcher that falls behind loses events
//! (counted), it never slows the store down.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use parking_lot::Mutex;

use crate::key::BlockKey;
use crate::types::Tier;

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// The block became visible in the tier.
    Stored,
    /// The block left the tier (evicted, removed, cleared, or failed its checksum).
    Removed,
}

/// One block event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockEvent {
    /// Stored or removed.
    pub kind: EventKind,
    /// The block.
    pub key: BlockKey,
    /// Where.
    pub tier: Tier,
    /// Its namespace id in the store.
    pub ns: u16,
}

/// Fan-out of block events to subscribers through bounded channels, shared by the store and
/// its tiers.
#[derive(Default)]
pub struct Events {
    any: AtomicBool,
    subs: Mutex<Vec<Sender<BlockEvent>>>,
    dropped: AtomicU64,
}

impl Events {
    /// A new subscriber with a channel of `capacity` events.
    pub fn subscribe(&self, capacity: usize) -> Receiver<BlockEvent> {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        let mut s = self.subs.lock();
        s.push(tx);
        self.any.store(true, Relaxed);
        rx
    }

    /// Sends an event to every subscriber that has room (the others lose it, counted).
    pub fn emit(&self, kind: EventKind, key: BlockKey, tier: Tier, ns: u16) {
        if !self.any.load(Relaxed) {
            return;
        }
        let ev = BlockEvent {
            kind,
            key,
            tier,
            ns,
        };
        let mut s = self.subs.lock();
        s.retain(|tx| match tx.try_send(ev) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Relaxed);
                true
            }
            Err(TrySendError::Disconnected(_)) => false,
        });
        if s.is_empty() {
            self.any.store(false, Relaxed);
        }
    }

    /// Sends `evs`, in order, to every subscriber, waiting for room up to `patience` in all for
    /// each subscriber (one that does not drain in time loses the rest, counted); the
    /// subscriber list is not locked while waiting. For announcements of many blocks at once.
    pub fn emit_all(&self, evs: &[BlockEvent], patience: std::time::Duration) {
        if !self.any.load(Relaxed) || evs.is_empty() {
            return;
        }
        let subs: Vec<Sender<BlockEvent>> = self.subs.lock().clone();
        for tx in subs {
            let deadline = std::time::Instant::now() + patience;
            for (i, ev) in evs.iter().enumerate() {
                if tx.send_deadline(*ev, deadline).is_err() {
                    self.dropped.fetch_add((evs.len() - i) as u64, Relaxed);
                    break;
                }
            }
        }
    }

    /// Events lost to full subscriber channels.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Relaxed)
    }
}
