//! The read queue, owned by the readers: promotion jobs of real loads, preload jobs of hints,
//! the rest of hints waiting for room, hints watching blocks not stored yet (tagged hints
//! whose prefix ends where an earlier request is still computing), the hints a reader has in hand, and the per-owner
//! bytes of preloads (queued, being read, and held). All preload bookkeeping that a reader or
//! a hint needs together lives behind this one lock, so no thread takes a second lock to
//! answer "how much does this owner have" (issue 35: a hint held the per-owner holds' lock
//! while taking the queue's, and reader 0 the other way round).
//!
//! Its lock is a leaf: nothing else is taken while it is held; the work a decision leads to
//! (publishing, freeing slots, ending holds) runs after it is released.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::key::BlockKey;
use crate::sync::MutexGuard;
use crate::types::MapKey;

use super::super::prefetch::{PerOwner, Waiting};
use super::ticket::Ticket;
use super::{Hint, Promote, Queue};

/// A batch of blocks one reader reads from its tier.
pub(crate) struct PromoteJob {
    pub tier: usize,
    pub items: Vec<Promote>,
    pub ticket: Arc<Ticket>,
    /// A preload (from a hint): nobody waits on its ticket (abandoned from the start, so the
    /// reader drops the promotion's pins once the blocks are published).
    pub hint: Option<Hint>,
}

#[derive(Default)]
pub(crate) struct State {
    pub promote: VecDeque<PromoteJob>,
    /// Preload jobs not started, in arrival order (a reader takes the highest priority first,
    /// after every real load's job).
    pub prefetch: Vec<PromoteJob>,
    /// Bytes of preload jobs queued or being read.
    pub prefetch_bytes: u64,
    /// Hints (their rest) waiting for room, in order.
    pub waiting: VecDeque<Waiting>,
    pub waiting_keys: usize,
    /// Preload bytes queued or being read, keys waiting, and bytes held, per hint owner.
    pub inflight_by_owner: PerOwner,
    pub waiting_by_owner: PerOwner,
    pub held_by_owner: PerOwner,
    /// Hints whose prefix ended at a block not stored yet (absent everywhere, or being
    /// written), by that block: once it is committed the hint's rest goes on the waiting list
    /// (a request further back in the queue shares blocks an earlier one is computing: they
    /// are held for it as they arrive, so they cannot go down to disk before its load).
    pub watching: std::collections::HashMap<MapKey, Vec<Waiting>>,
    pub watching_keys: usize,
    pub watching_by_owner: PerOwner,
    /// The first waiting hint made no progress when last resumed: not again until room
    /// changes.
    pub resume_stalled: bool,
    /// The hints the readers have in hand (a preload job one reads, a waiting hint one
    /// resumes): (reader, (tag, owner), cancelled meanwhile). A reader cancels its hint again
    /// once done with it if a cancel came meanwhile (`done_reading`).
    pub reading: Vec<(usize, (u64, u64), bool)>,
    pub stop: bool,
}

impl State {
    /// Bytes `owner`'s hints hold or have in flight.
    pub fn owner_bytes(&self, owner: u64) -> u64 {
        self.held_by_owner.get(owner) + self.inflight_by_owner.get(owner)
    }

    /// A preload job left the queue (read, expired, cancelled): its bytes are no longer in
    /// flight.
    pub fn unqueued(&mut self, h: &Hint) {
        self.prefetch_bytes -= h.bytes;
        self.inflight_by_owner.sub(h.owner, h.bytes);
    }

    /// Takes the first waiting hint whose owner may have room: one its quota cut waits until
    /// that owner's holds or preloads shrink, without holding up the others' hints.
    pub fn next_waiting(&mut self) -> Option<Waiting> {
        let i = self.waiting.iter().position(|w| match w.owner_full_at {
            None => true,
            Some(at) => self.owner_bytes(w.quota.owner) < at,
        })?;
        let w = self.waiting.remove(i)?;
        self.waiting_keys -= w.keys.len();
        self.waiting_by_owner
            .sub(w.quota.owner, w.keys.len() as u64);
        Some(w)
    }
}

/// The read queue and the readers' condition variable.
pub(crate) struct Reads(Queue<State>);

impl Default for Reads {
    fn default() -> Self {
        Self(Queue::new("reads"))
    }
}

impl Reads {
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.0.q.lock()
    }

    /// Wakes the readers (a job was queued).
    pub(super) fn notify(&self) {
        self.0.cv.notify_all();
    }

    /// A reader waits for work (the lock released meanwhile).
    pub(super) fn wait(&self, q: &mut MutexGuard<'_, State>) {
        self.0.cv.wait(q);
    }

    /// (promotion jobs, preload jobs, preload bytes queued or being read).
    pub(crate) fn depth(&self) -> (u64, u64, u64) {
        let q = self.0.q.lock();
        (
            q.promote.len() as u64,
            q.prefetch.len() as u64,
            q.prefetch_bytes,
        )
    }

    /// Bytes of preloads queued or being read.
    pub(crate) fn prefetch_bytes(&self) -> u64 {
        self.0.q.lock().prefetch_bytes
    }

    /// Whether hints wait for room (a new one waits behind them).
    pub(crate) fn hints_waiting(&self) -> bool {
        !self.0.q.lock().waiting.is_empty()
    }

    /// Keys of hints waiting for room.
    pub(crate) fn waiting_keys(&self) -> usize {
        self.0.q.lock().waiting_keys
    }

    /// Bytes `owner`'s hints hold or have in flight.
    pub(crate) fn owner_bytes(&self, owner: u64) -> u64 {
        if owner == 0 {
            return 0;
        }
        self.0.q.lock().owner_bytes(owner)
    }

    /// Counts `bytes` more held for `owner`.
    pub(crate) fn add_held(&self, owner: u64, bytes: u64) {
        self.0.q.lock().held_by_owner.add(owner, bytes);
    }

    /// Counts a hold of `owner` ended (the caller says `room_changed` once its pin is gone).
    pub(crate) fn sub_held(&self, owner: u64, bytes: u64) {
        self.0.q.lock().held_by_owner.sub(owner, bytes);
    }

    /// Puts a hint's rest on the waiting list (at the front: a resumed one keeps its place);
    /// false if the list is full (or the readers stopped).
    pub(crate) fn wait_hint(&self, w: Waiting, front: bool, max_keys: usize) -> bool {
        let mut q = self.0.q.lock();
        let n = w.keys.len();
        let mine = q.waiting_by_owner.get(w.quota.owner) as usize;
        if q.stop || q.waiting_keys + n > max_keys || mine + n > w.quota.max_waiting_keys {
            return false;
        }
        q.waiting_keys += n;
        q.waiting_by_owner.add(w.quota.owner, n as u64);
        if front {
            q.waiting.push_front(w);
        } else {
            q.waiting.push_back(w);
            q.resume_stalled = false;
            self.0.cv.notify_all();
        }
        true
    }

    /// Keeps a hint's rest (from `at`, a block not stored yet) until `at` is committed; false
    /// if the watched keys are at their bound (those of hints past their deadline are let go
    /// first) or the readers stopped.
    pub(crate) fn watch(&self, at: BlockKey, w: Waiting, max_keys: usize) -> bool {
        let mut q = self.0.q.lock();
        let n = w.keys.len();
        if q.stop {
            return false;
        }
        if q.watching_keys + n > max_keys {
            let now = Instant::now();
            let gone: Vec<Waiting> = q
                .watching
                .values_mut()
                .flat_map(|ws| {
                    let (gone, keep) = std::mem::take(ws)
                        .into_iter()
                        .partition(|w| w.deadline <= now);
                    *ws = keep;
                    gone
                })
                .collect();
            q.watching.retain(|_, ws| !ws.is_empty());
            for g in &gone {
                q.watching_keys -= g.keys.len();
                q.watching_by_owner.sub(g.quota.owner, g.keys.len() as u64);
            }
        }
        let mine = q.watching_by_owner.get(w.quota.owner) as usize;
        if q.watching_keys + n > max_keys || mine + n > w.quota.max_waiting_keys {
            return false;
        }
        q.watching_keys += n;
        q.watching_by_owner.add(w.quota.owner, n as u64);
        q.watching.entry(MapKey::from(at)).or_default().push(w);
        true
    }

    /// `key` was committed: the hints watching it go on the waiting list (the first reader
    /// resumes them as room allows).
    pub(crate) fn arrived(&self, key: BlockKey) {
        let mut q = self.0.q.lock();
        if q.watching.is_empty() {
            return;
        }
        let Some(ws) = q.watching.remove(&MapKey::from(key)) else {
            return;
        };
        for w in ws {
            let n = w.keys.len();
            q.watching_keys -= n;
            q.watching_by_owner.sub(w.quota.owner, n as u64);
            q.waiting_keys += n;
            q.waiting_by_owner.add(w.quota.owner, n as u64);
            q.waiting.push_back(w);
        }
        q.resume_stalled = false;
        self.0.cv.notify_all();
    }

    /// Keys of hints watching blocks not stored yet.
    pub(crate) fn watching_keys(&self) -> usize {
        self.0.q.lock().watching_keys
    }

    /// Preload room may have come back: the first reader tries the waiting hints again.
    pub(crate) fn room_changed(&self) {
        let mut q = self.0.q.lock();
        if !q.waiting.is_empty() {
            q.resume_stalled = false;
            self.0.cv.notify_all();
        }
    }

    /// The readers end (each drops what it has queued).
    pub(super) fn stop(&self) {
        let mut q = self.0.q.lock();
        q.stop = true;
        q.watching.clear();
        q.watching_keys = 0;
        q.watching_by_owner.clear();
        drop(q);
        self.0.cv.notify_all();
    }

    /// Every job left once the readers ended: promotions nobody will read.
    pub(super) fn drain(&self) -> Vec<PromoteJob> {
        let mut q = self.0.q.lock();
        let mut v: Vec<PromoteJob> = q.promote.drain(..).collect();
        v.append(&mut q.prefetch);
        q.prefetch_bytes = 0;
        q.inflight_by_owner.clear();
        v
    }

    /// A load waits for `key`, which a queued preload will read: that job goes to the front
    /// of the real loads' queue (and can no longer be cancelled).
    pub(crate) fn escalate(&self, key: BlockKey) {
        let mut q = self.0.q.lock();
        if let Some(i) = q
            .prefetch
            .iter()
            .position(|j| j.items.iter().any(|p| p.key == key))
        {
            let job = q.prefetch.remove(i);
            q.promote.push_front(job);
            self.0.cv.notify_all();
        }
    }
}
