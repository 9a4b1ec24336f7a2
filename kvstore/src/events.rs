//! Block events (stored, removed, per tier) for watchers such as the admin API's `Watch` and
//! cache-aware routers. Delivery is best effort: a watcher that falls behind loses events
//! (counted, in all and by its own [`Subscription::lost`], so that it can tell its view is
//! void and start again), it never slows the store down.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender, TrySendError};

use crate::sync::{level, Mutex};

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

/// A subscriber's end ([`Events::subscribe`]): its events (the channel's receiving side,
/// which it derefs to), and how many it lost to a full channel. A subscriber that lost any
/// no longer knows what the store holds: it must start again (the admin API's Watch ends
/// its stream with `DATA_LOSS`, and a watcher subscribes again with a snapshot).
pub struct Subscription {
    rx: Receiver<BlockEvent>,
    lost: Arc<AtomicU64>,
}

impl Subscription {
    /// Events this subscriber lost to its full channel so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Relaxed)
    }
}

impl std::ops::Deref for Subscription {
    type Target = Receiver<BlockEvent>;
    fn deref(&self) -> &Receiver<BlockEvent> {
        &self.rx
    }
}

/// Fan-out of block events to subscribers through bounded channels, shared by the store and
/// its tiers.
///
/// **Order.** A block's events in host memory are emitted under its index shard's lock (the
/// subscribers' list is a leaf lock), as the disk tier's are under its own: every change to a
/// block's place in a tier is made under that lock, so each subscriber receives a block's
/// events in the order of its changes (a Stored then a Removed never arrive swapped, which
/// would leave a watcher believing in a block that is gone).
pub struct Events {
    any: AtomicBool,
    /// Each subscriber's channel and its count of lost events.
    subs: Mutex<Vec<(Sender<BlockEvent>, Arc<AtomicU64>)>>,
    dropped: AtomicU64,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            any: AtomicBool::new(false),
            subs: Mutex::new(level::LEAF, "events", Vec::new()),
            dropped: AtomicU64::new(0),
        }
    }
}

impl Events {
    /// A new subscriber with a channel of `capacity` events.
    pub fn subscribe(&self, capacity: usize) -> Subscription {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        let lost = Arc::new(AtomicU64::new(0));
        let mut s = self.subs.lock();
        s.push((tx, lost.clone()));
        self.any.store(true, Relaxed);
        Subscription { rx, lost }
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
        s.retain(|(tx, lost)| match tx.try_send(ev) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Relaxed);
                lost.fetch_add(1, Relaxed);
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
        let subs = self.subs.lock().clone();
        for (tx, lost) in subs {
            let deadline = std::time::Instant::now() + patience;
            for (i, ev) in evs.iter().enumerate() {
                if tx.send_deadline(*ev, deadline).is_err() {
                    self.dropped.fetch_add((evs.len() - i) as u64, Relaxed);
                    lost.fetch_add((evs.len() - i) as u64, Relaxed);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(i: u128) -> (EventKind, BlockKey, Tier, u16) {
        (EventKind::Stored, BlockKey(i), Tier::Host, 0)
    }

    #[test]
    fn a_subscriber_knows_the_events_it_lost() {
        let events = Events::default();
        let slow = events.subscribe(2);
        let fast = events.subscribe(8);
        for i in 0..5 {
            let (k, key, t, ns) = ev(i);
            events.emit(k, key, t, ns);
        }
        assert_eq!((slow.lost(), fast.lost(), events.dropped()), (3, 0, 3));
        assert_eq!(slow.try_iter().count(), 2);
        assert_eq!(fast.try_iter().count(), 5);
        // A burst with patience: the slow one loses what does not fit in time, and counts it.
        let burst: Vec<BlockEvent> = (0..4)
            .map(|i| {
                let (kind, key, tier, ns) = ev(i);
                BlockEvent {
                    kind,
                    key,
                    tier,
                    ns,
                }
            })
            .collect();
        events.emit_all(&burst, std::time::Duration::ZERO);
        assert_eq!((slow.lost(), fast.lost()), (5, 0));
        assert_eq!(slow.capacity(), Some(2));
    }
}
