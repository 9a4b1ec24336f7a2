//! The writer thread and the demotion queue it owns: dirty blocks written to the first lower
//! tier in batches of at most `max_batch_bytes`, queued by allocations (write-back) and
//! commits (write-through). A removal cancels a queued demotion (it is skipped) and an
//! in-flight one (the tier asks `still_wanted` before the block becomes visible below).
//!
//! Its lock is a leaf: nothing else is taken while it is held.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;

use crate::events::EventKind;
use crate::io::IoBuf;
use crate::key::BlockKey;
use crate::tier::{WriteItem, WriteOutcome};
use crate::types::{FoldMap, MapKey, Tier};

use super::super::index::{Copy, Removed, Slot};
use super::super::Inner;
use super::{Demote, Queue};

#[derive(Default)]
struct State {
    demote: VecDeque<Demote>,
    bytes: u64,
    /// Demotions taken by the writer and not finished.
    writing: usize,
    stop: bool,
}

/// The demotion queue (bounded by bytes: an allocation that finds it full waits for room,
/// counted in `waits`).
pub(crate) struct Demotions(Queue<State>);

impl Default for Demotions {
    fn default() -> Self {
        Self(Queue::new("demotions"))
    }
}

impl Demotions {
    /// Queues demotions (their blocks are pinned and marked Demoting).
    pub(crate) fn push(&self, items: Vec<Demote>) {
        let mut q = self.0.q.lock();
        for d in items {
            q.bytes += u64::from(d.len);
            q.demote.push_back(d);
        }
        self.0.cv.notify_one();
    }

    /// Whether demotions are queued or being written (room is coming).
    pub(crate) fn pending(&self) -> bool {
        let q = self.0.q.lock();
        !q.demote.is_empty() || q.writing > 0
    }

    /// Whether the queue takes more (bounded to a few batches).
    pub(crate) fn room(&self, batch: u64) -> bool {
        self.0.q.lock().bytes < 4 * batch
    }

    /// (blocks, bytes) queued.
    pub(crate) fn depth(&self) -> (u64, u64) {
        let q = self.0.q.lock();
        (q.demote.len() as u64, q.bytes)
    }

    pub(crate) fn stopped(&self) -> bool {
        self.0.q.lock().stop
    }

    /// The writer ends once the queue is drained.
    pub(super) fn stop(&self) {
        self.0.q.lock().stop = true;
        self.0.cv.notify_all();
    }

    /// The next batch (at most `max_bytes`, at least one block), or `None` once stopped and
    /// drained; marks it being written.
    fn next_batch(&self, max_bytes: u64) -> Option<Vec<Demote>> {
        let mut q = self.0.q.lock();
        while q.demote.is_empty() && !q.stop {
            self.0.cv.wait(&mut q);
        }
        if q.demote.is_empty() {
            return None;
        }
        let mut batch = Vec::new();
        let mut bytes = 0u64;
        while let Some(d) = q.demote.front() {
            if !batch.is_empty() && bytes + u64::from(d.len) > max_bytes {
                break;
            }
            bytes += u64::from(d.len);
            q.bytes -= u64::from(d.len);
            batch.extend(q.demote.pop_front());
        }
        q.writing += batch.len();
        Some(batch)
    }

    fn written(&self, n: usize) {
        self.0.q.lock().writing -= n;
    }
}

impl Inner {
    /// Queues demotions (their blocks are pinned and marked Demoting).
    pub(crate) fn enqueue_demotions(&self, items: Vec<Demote>) {
        self.work.demote.push(items);
    }

    /// The writer: one batch of queued demotions at a time.
    pub(super) fn writer_loop(&self) {
        while let Some(batch) = self.work.demote.next_batch(self.max_batch_bytes) {
            let n = batch.len();
            self.write_back(batch);
            self.work.demote.written(n);
            self.work.reads.room_changed();
            self.progress.bump();
        }
    }

    /// Writes demotions to the first lower tier and settles each block's copy state.
    fn write_back(&self, batch: Vec<Demote>) {
        let Some(tier) = self.demote_to.and_then(|i| self.tiers.get(i)) else {
            for d in batch {
                self.settle(&d, WriteOutcome::Failed);
            }
            return;
        };
        // A block removed since it was queued is skipped (its removal wins).
        let (live, gone): (Vec<Demote>, Vec<Demote>) = batch.into_iter().partition(|d| {
            let sh = self.shard(d.key).lock();
            sh.map
                .get(&MapKey::from(d.key))
                .is_some_and(|e| e.slot() == d.slot && e.copy() == Copy::Demoting)
        });
        for d in &gone {
            self.settle(d, WriteOutcome::Cancelled);
        }
        if live.is_empty() {
            return;
        }
        let slots: FoldMap<MapKey, Slot> =
            live.iter().map(|d| (MapKey::from(d.key), d.slot)).collect();
        let items = live
            .iter()
            .map(|d| {
                let checksum = self.classes[d.slot.class as usize].lock().sums[d.slot.idx as usize];
                WriteItem {
                    key: d.key,
                    ns: d.ns,
                    // SAFETY: the block is committed and pinned by its Demoting pin until
                    // `settle` below, so its slot is neither freed nor reused while the tier
                    // reads it.
                    buf: unsafe { IoBuf::from_raw(self.ptr(d.page), d.cap) },
                    len: d.len,
                    checksum,
                }
            })
            .collect();
        let still_wanted = |k: &BlockKey| {
            let mk = MapKey::from(*k);
            let sh = self.shard(*k).lock();
            sh.map
                .get(&mk)
                .is_some_and(|e| e.ready() && Some(&e.slot()) == slots.get(&mk))
        };
        let outcomes = tier.write(items, &still_wanted);
        self.note_lower_fill();
        for (d, o) in live.iter().zip(outcomes) {
            self.settle(d, o);
        }
    }

    /// Records a demotion's outcome on its host block and drops the demotion's pin.
    fn settle(&self, d: &Demote, o: WriteOutcome) {
        tracing::trace!(key = %d.key, outcome = ?o, "demotion settled");
        if o == WriteOutcome::Written {
            self.stats.demotions.fetch_add(1, Relaxed);
        }
        let mk = MapKey::from(d.key);
        let mut damaged = false;
        let mut dropped = None;
        let freed = {
            let mut sh = self.shard(d.key).lock();
            let found = match sh.map.get_mut(&mk).filter(|e| e.slot() == d.slot) {
                Some(mut e) => {
                    e.set_copy(match o {
                        WriteOutcome::Written | WriteOutcome::Present => Copy::Clean,
                        // Another write of it is in flight, or an older copy is being removed:
                        // dirty again, written at a later eviction.
                        WriteOutcome::Busy | WriteOutcome::Cancelled => Copy::Dirty,
                        WriteOutcome::Failed => Copy::Unwritable,
                        WriteOutcome::Corrupt => Copy::Unwritable,
                    });
                    true
                }
                None => false,
            };
            if found && o == WriteOutcome::Corrupt {
                damaged = true;
                // Our pin holds it: doomed, its bytes counted until the last unpin frees it.
                if let Removed::Doomed(_) = sh.remove(mk) {
                    self.stats.blocks.fetch_sub(1, Relaxed);
                }
                // Under the shard's lock, as every host event of a block (see `Events`).
                self.events
                    .emit(EventKind::Removed, d.key, Tier::Host, d.ns);
            }
            // Demoted by the application ([`Store::demote`]): written, and nobody else holds
            // it, so the host copy goes now.
            let super::super::index::Shard { map, pins } = &mut *sh;
            let drop_now = match map.get_mut(&mk).filter(|e| e.slot() == d.slot) {
                Some(mut e) if e.drop_when_written() => {
                    e.set_drop_when_written(false);
                    e.copy() == Copy::Clean && pins.count(&e) == 1 && e.ready()
                }
                _ => false,
            };
            if drop_now {
                // Ours was its one pin.
                if let Some(e) = map.remove(&mk) {
                    pins.forget(d.slot);
                    self.events
                        .emit(EventKind::Removed, d.key, Tier::Host, e.ns);
                    dropped = Some(e.ns);
                }
                true
            } else {
                sh.unpin(mk, d.slot)
            }
        };
        if dropped.is_some() {
            self.stats.blocks.fetch_sub(1, Relaxed);
        }
        if damaged {
            self.stats.checksum_failures.fetch_add(1, Relaxed);
            tracing::warn!(key = %d.key, "host block no longer matches its commit checksum (written after its commit?): dropped, never written below");
        }
        if freed {
            // A published block's slot (dropped now, or doomed and this was its last pin).
            self.free_published(d.slot);
        }
    }
}
