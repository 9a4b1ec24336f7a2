//! The pusher thread and the push queue it owns (with a write-behind tier, the remote tier):
//! committed blocks pushed to it in batches, each pinned while queued; the queue is bounded by
//! bytes and a block past it is not pushed (counted), so no commit ever waits for the network.
//! A failed push is tried again after 1 s, 4 s and 16 s holding its block's pin, then after
//! 64 s, 256 s and 1,024 s holding only its key (pinned again for the try, if the block is
//! still in host memory): an owner down for minutes still gets the block once it is back,
//! and its blocks never hold host memory or the queue's bytes that long.
//!
//! Its lock is a leaf: nothing else is taken while it is held.

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use crate::events::EventKind;
use crate::io::IoBuf;
use crate::key::BlockKey;
use crate::tier::{WriteItem, WriteOutcome};
use crate::types::MapKey;

use super::super::Inner;
use super::{Demote, Queue};

/// Tries of a failed push after the first that hold the block's pin (the waits are
/// `push_retry_first`, 1 s by default, then 4× longer each time: 1 s, 4 s, 16 s, long enough
/// for an owner's restart)...
const PUSH_RETRIES: u8 = 3;
/// ...and those after them that hold only its key (64 s, 256 s, 1,024 s: an owner down for
/// minutes, a breaker open at its longest pause).
const LATE_RETRIES: u8 = 3;
/// Most keys waiting for a late try; past it a failed push is given up.
const MAX_LATE: usize = 1 << 16;

#[derive(Default)]
struct State {
    /// Committed blocks to push (each holds one pin).
    push: VecDeque<Demote>,
    /// Their bytes, retries included.
    bytes: u64,
    /// Pushes that failed, waiting for their next try (due time, tries so far), due order.
    retry: VecDeque<(Instant, u8, Demote)>,
    /// Pushes that failed [`PUSH_RETRIES`] + 1 times: their keys (no pin), the same way.
    late: VecDeque<(Instant, u8, BlockKey)>,
    stop: bool,
}

/// The push queue.
pub(crate) struct Pushes(Queue<State>);

impl Default for Pushes {
    fn default() -> Self {
        Self(Queue::new("pushes"))
    }
}

/// What the pusher takes next.
enum Next {
    /// Queued and retried blocks (tries so far), and the keys due for a late try.
    Batch(Vec<(u8, Demote)>, Vec<(u8, BlockKey)>),
    /// Stopped: these were queued and are not pushed.
    Stopped(Vec<Demote>),
}

impl Pushes {
    /// Bytes queued (retries included).
    pub(crate) fn bytes(&self) -> u64 {
        self.0.q.lock().bytes
    }

    pub(super) fn stop(&self) {
        self.0.q.lock().stop = true;
        self.0.cv.notify_all();
    }

    /// Queues `d` unless the queue is full or stopped (then it is handed back).
    fn push(&self, d: Demote, max_bytes: u64) -> Result<(), Demote> {
        let mut q = self.0.q.lock();
        if q.stop || q.bytes + u64::from(d.len) > max_bytes {
            return Err(d);
        }
        q.bytes += u64::from(d.len);
        q.push.push_back(d);
        self.0.cv.notify_one();
        Ok(())
    }

    /// Queues a failed push for its next try at `at`; false if stopped.
    fn retry(&self, at: Instant, tries: u8, d: Demote) -> bool {
        let mut q = self.0.q.lock();
        if q.stop {
            return false;
        }
        q.bytes += u64::from(d.len);
        // Due order: a first retry (1 s) may come due before a later one (16 s) queued
        // earlier.
        let pos = q.retry.partition_point(|r| r.0 <= at);
        q.retry.insert(pos, (at, tries, d));
        true
    }

    /// Queues `key`, whose push failed for the `tries`th time, for a late try at `at`; false
    /// if stopped or [`MAX_LATE`] keys wait.
    fn late(&self, at: Instant, tries: u8, key: BlockKey) -> bool {
        let mut q = self.0.q.lock();
        if q.stop || q.late.len() >= MAX_LATE {
            return false;
        }
        let pos = q.late.partition_point(|r| r.0 <= at);
        q.late.insert(pos, (at, tries, key));
        true
    }

    /// The next batch: retries that are due, then queued blocks up to `max_bytes`; and the
    /// keys due for a late try.
    fn next(&self, max_bytes: u64) -> Next {
        let mut q = self.0.q.lock();
        loop {
            if q.stop {
                let mut left: Vec<Demote> = q.push.drain(..).collect();
                left.extend(q.retry.drain(..).map(|r| r.2));
                q.late.clear();
                q.bytes = 0;
                return Next::Stopped(left);
            }
            let now = Instant::now();
            let due = q.retry.front().is_some_and(|r| r.0 <= now)
                || q.late.front().is_some_and(|r| r.0 <= now);
            if !q.push.is_empty() || due {
                break;
            }
            let first = match (q.retry.front(), q.late.front()) {
                (Some(a), Some(b)) => Some(a.0.min(b.0)),
                (a, b) => a.map(|r| r.0).or(b.map(|r| r.0)),
            };
            match first {
                Some(at) => {
                    self.0.cv.wait_until(&mut q, at);
                }
                None => self.0.cv.wait(&mut q),
            }
        }
        let mut batch = Vec::new();
        let mut bytes = 0u64;
        let now = Instant::now();
        while q.retry.front().is_some_and(|r| r.0 <= now) {
            let Some((_, tries, d)) = q.retry.pop_front() else {
                break;
            };
            bytes += u64::from(d.len);
            batch.push((tries, d));
        }
        while let Some(d) = q.push.front() {
            if !batch.is_empty() && bytes + u64::from(d.len) > max_bytes {
                break;
            }
            bytes += u64::from(d.len);
            batch.extend(q.push.pop_front().map(|d| (0, d)));
        }
        q.bytes -= bytes;
        let mut late = Vec::new();
        while q.late.front().is_some_and(|r| r.0 <= now) {
            late.extend(q.late.pop_front().map(|(_, tries, k)| (tries, k)));
        }
        Next::Batch(batch, late)
    }
}

impl Inner {
    /// The wait before the try after the `tries`th: `push_retry_first`, 4× longer each time.
    fn retry_wait(&self, tries: u8) -> Duration {
        self.push_retry_first
            .saturating_mul(1 << (2 * u32::from(tries)))
            .min(Duration::from_secs(24 * 3600))
    }

    /// `key`'s block pinned for a late push try, if it is Ready in host memory.
    fn pin_for_push(&self, key: BlockKey) -> Option<Demote> {
        let e = self.shard(key).lock().pin(MapKey::from(key)).ok()??;
        let slot = e.slot();
        // The class's lock after the shard's is released (a class's comes first in the order).
        let (page, len) = {
            let c = self.classes[slot.class as usize].lock();
            (
                c.page_of(slot.idx, self.seg_pages),
                c.lens[slot.idx as usize],
            )
        };
        Some(Demote {
            key,
            slot,
            page,
            cap: self.class_sizes[slot.class as usize],
            len,
            ns: e.ns,
        })
    }

    /// Queues a committed block (pinned for the push) for the write-behind tier; when the
    /// queue is full it is not pushed (its pin is dropped, counted).
    pub(crate) fn enqueue_push(&self, d: Demote) {
        if let Err(d) = self.work.push.push(d, self.push_queue_bytes) {
            self.stats.push_dropped.fetch_add(1, Relaxed);
            self.unpin(d.key, d.slot);
        }
    }

    /// The pusher: batches of committed blocks to the write-behind tier (the remote tier), in
    /// commit order. A failed push is tried again after 1 s, 4 s and 16 s (an owner that
    /// restarts or a breaker that closes again still gets the block), holding its pin and its
    /// bytes of the push queue meanwhile; then after 64 s, 256 s and 1,024 s holding only its
    /// key, if the block is still in host memory then; after that the block stays local only.
    /// A batch's late tries are written after its other pushes, apart
    /// ([`crate::tier::LowerTier::write_late`]): the remote tier may first probe an owner
    /// whose breaker's pause has ended, holding up the pusher (at most 500 ms a probe) but
    /// not the other pushes of that batch, whose owners are never probed inline. Nothing
    /// else waits for a push.
    pub(super) fn pusher_loop(&self) {
        let Some(tier) = self.push_to.and_then(|i| self.tiers.get(i)) else {
            return;
        };
        loop {
            let batch = match self.work.push.next(self.max_batch_bytes) {
                Next::Batch(mut b, late) => {
                    // Pinned again for their try (no lock of the queue's held), if still in
                    // host memory, up to the batch's bytes (they count in no queue): the rest
                    // go back, due now, for the next batch.
                    let mut bytes: u64 = b.iter().map(|(_, d)| u64::from(d.len)).sum();
                    let now = Instant::now();
                    for (tries, k) in late {
                        if !b.is_empty() && bytes >= self.max_batch_bytes {
                            if !self.work.push.late(now, tries, k) {
                                self.stats.push_failed.fetch_add(1, Relaxed);
                            }
                            continue;
                        }
                        match self.pin_for_push(k) {
                            Some(d) => {
                                bytes += u64::from(d.len);
                                b.push((tries, d));
                            }
                            // Gone from host memory since: given up.
                            None => {
                                self.stats.push_failed.fetch_add(1, Relaxed);
                            }
                        }
                    }
                    if b.is_empty() {
                        continue;
                    }
                    b
                }
                Next::Stopped(left) => {
                    // Shutting down: what is queued is not pushed.
                    for d in left {
                        self.unpin(d.key, d.slot);
                    }
                    return;
                }
            };
            // Late tries last (a stable sort: commit order within each part): they are
            // written apart, with `LowerTier::write_late`, which may probe an owner whose
            // breaker's pause has ended there and then; the others never wait for that.
            let mut batch = batch;
            batch.sort_by_key(|(tries, _)| *tries > PUSH_RETRIES);
            let late_from = batch.partition_point(|(tries, _)| *tries <= PUSH_RETRIES);
            let mut items: Vec<WriteItem> = batch
                .iter()
                .map(|(_, d)| {
                    let checksum =
                        self.classes[d.slot.class as usize].lock().sums[d.slot.idx as usize];
                    WriteItem {
                        key: d.key,
                        ns: d.ns,
                        // SAFETY: the block is committed and holds the push's pin until the
                        // `unpin` below, so its slot is neither freed nor reused meanwhile.
                        buf: unsafe { IoBuf::from_raw(self.ptr(d.page), d.cap) },
                        len: d.len,
                        checksum,
                    }
                })
                .collect();
            let still_wanted = |k: &BlockKey| {
                self.shard(*k)
                    .lock()
                    .map
                    .get(&MapKey::from(*k))
                    .is_some_and(|e| e.ready())
            };
            let late = items.split_off(late_from);
            let mut outcomes = Vec::with_capacity(batch.len());
            if !items.is_empty() {
                outcomes.extend(tier.write(items, &still_wanted));
            }
            if !late.is_empty() {
                outcomes.extend(tier.write_late(late, &still_wanted));
            }
            debug_assert_eq!(outcomes.len(), batch.len(), "an outcome a block");
            for ((tries, d), o) in batch.iter().zip(outcomes) {
                match o {
                    WriteOutcome::Written | WriteOutcome::Present => {
                        // Now also loadable from the remote tier (its owner publishes its
                        // own copy, and that copy's removal, as its host or disk tier's).
                        // The event goes first: whoever sees the push counted sees its event.
                        self.events
                            .emit(EventKind::Stored, d.key, tier.kind(), d.ns);
                        self.stats.pushes.fetch_add(1, Relaxed);
                    }
                    WriteOutcome::Cancelled => {}
                    WriteOutcome::Busy | WriteOutcome::Failed if *tries < PUSH_RETRIES => {
                        // Keeps its pin and its share of the queue until the next try.
                        let at = Instant::now() + self.retry_wait(*tries);
                        if self.work.push.retry(at, tries + 1, *d) {
                            self.stats.push_retries.fetch_add(1, Relaxed);
                            continue;
                        }
                    }
                    WriteOutcome::Busy | WriteOutcome::Failed
                        if *tries < PUSH_RETRIES + LATE_RETRIES =>
                    {
                        // Its key only: the pin goes below.
                        let at = Instant::now() + self.retry_wait(*tries);
                        if self.work.push.late(at, tries + 1, d.key) {
                            self.stats.push_retries.fetch_add(1, Relaxed);
                        } else {
                            self.stats.push_failed.fetch_add(1, Relaxed);
                        }
                    }
                    WriteOutcome::Busy | WriteOutcome::Failed => {
                        self.stats.push_failed.fetch_add(1, Relaxed);
                    }
                    WriteOutcome::Corrupt => {
                        self.stats.push_failed.fetch_add(1, Relaxed);
                        tracing::warn!(key = %d.key, "host block no longer matches its commit checksum: not pushed");
                    }
                }
                self.unpin(d.key, d.slot);
            }
        }
    }
}
