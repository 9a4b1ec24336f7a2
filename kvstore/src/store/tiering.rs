//! The tiering worker: the threads that move blocks between the host arena and the lower tiers,
//! so that no engine request ever does I/O it did not ask for.
//!
//! - **writer**: demotions (dirty blocks written to the first lower tier, in batches of at most
//!   `max_batch_bytes`), queued by allocations (write-back) and commits (write-through). A
//!   removal cancels a queued demotion (it is skipped) and an in-flight one (the tier asks
//!   `still_wanted` before the block becomes visible below).
//! - **pusher** (with a write-behind tier, the remote tier): committed blocks pushed to it in
//!   batches, each pinned while queued; the queue is bounded by bytes and a block past it is
//!   not pushed (counted), so no commit ever waits for the network.
//! - **readers**, one per lower tier: promotions (blocks read from that tier into reserved host
//!   slots), queued by loads; a load waits for its own batch with one deadline and may abandon
//!   it. A peer that stopped answering holds up only the remote tier's reader.
//! - **populator** (with `Populate::Background`): faults the arena in segment by segment and
//!   hands each segment to the allocator as it is ready.
//!
//! Queues are bounded: demotions by bytes (an allocation that finds the queue full waits for
//! room, counted in `waits`).

use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::events::EventKind;
use crate::io::IoBuf;
use crate::key::BlockKey;
use crate::tier::{ReadItem, ReadOutcome, WriteItem, WriteOutcome};
use crate::types::{FoldMap, MapKey, Tier};

use super::index::{Copy, Removed, Slot};
use super::Inner;

/// A host block queued for writing below (or pushing to the write-behind tier); it holds one
/// pin until written.
#[derive(Clone, Copy)]
pub(crate) struct Demote {
    pub key: BlockKey,
    pub slot: Slot,
    pub page: u32,
    pub cap: usize,
    pub len: u32,
    pub ns: u16,
}

/// Tries of a failed push after the first, and the wait before the first of them (then 4×
/// longer each time: 1 s, 4 s, 16 s, long enough for an owner's restart).
const PUSH_RETRIES: u8 = 3;
const PUSH_RETRY_FIRST: Duration = Duration::from_secs(1);

/// A host slot reserved (Promoting, one pin held for the load that asked) to read a block into.
#[derive(Clone, Copy)]
pub(crate) struct Promote {
    pub key: BlockKey,
    pub slot: Slot,
    pub page: u32,
    pub cap: usize,
    pub len: u32,
}

/// How a load and the reader meet: the reader fills in the outcome; a load that stops waiting
/// abandons it, and then the reader drops the pins it would have handed over.
#[derive(Default)]
pub(crate) struct Ticket {
    state: Mutex<TicketState>,
    cv: Condvar,
}

#[derive(Default)]
enum TicketState {
    #[default]
    Pending,
    Done(Vec<bool>),
    Abandoned,
}

impl Ticket {
    /// The outcome (one bool per item: published and pinned for the caller), or `None` if
    /// `until` passed first (the ticket is then abandoned: nothing is pinned for the caller).
    pub(crate) fn wait(&self, until: Instant) -> Option<Vec<bool>> {
        let mut s = self.state.lock();
        loop {
            match std::mem::take(&mut *s) {
                TicketState::Done(v) => return Some(v),
                TicketState::Abandoned => return None,
                TicketState::Pending => {}
            }
            if self.cv.wait_until(&mut s, until).timed_out() {
                if let TicketState::Done(v) = std::mem::take(&mut *s) {
                    return Some(v);
                }
                *s = TicketState::Abandoned;
                return None;
            }
        }
    }

    /// Nobody will wait for it (a preload): the reader drops the pins it would hand over.
    fn abandon(&self) {
        *self.state.lock() = TicketState::Abandoned;
    }

    /// Hands the outcome over; false if the load gave up (the caller then owns the pins).
    fn complete(&self, outcome: Vec<bool>) -> bool {
        let mut s = self.state.lock();
        match *s {
            TicketState::Pending => {
                *s = TicketState::Done(outcome);
                self.cv.notify_all();
                true
            }
            _ => false,
        }
    }
}

struct PromoteJob {
    tier: usize,
    items: Vec<Promote>,
    ticket: Arc<Ticket>,
    /// A preload (from a hint): nobody waits on its ticket (abandoned from the start, so the
    /// reader drops the promotion's pins once the blocks are published).
    hint: Option<Hint>,
}

/// What a preload job carries besides its blocks.
#[derive(Clone, Copy)]
pub(crate) struct Hint {
    pub tag: u64,
    pub priority: u8,
    pub deadline: Instant,
    pub bytes: u64,
    /// The hint's owner (see `PrefetchQuota`).
    pub owner: u64,
}

#[derive(Default)]
struct Queues {
    demote: VecDeque<Demote>,
    demote_bytes: u64,
    /// Demotions taken by the writer and not finished.
    writing: usize,
    promote: VecDeque<PromoteJob>,
    /// Preload jobs not started, in arrival order (the reader takes the highest priority
    /// first, after every real load's job).
    prefetch: Vec<PromoteJob>,
    /// Bytes of preload jobs queued or being read.
    prefetch_bytes: u64,
    /// Hints (their rest) waiting for room, in order.
    waiting: VecDeque<super::prefetch::Waiting>,
    waiting_keys: usize,
    /// Preload bytes queued or being read, and keys waiting, per hint owner.
    inflight_by_owner: super::prefetch::PerOwner,
    waiting_by_owner: super::prefetch::PerOwner,
    /// The first waiting hint made no progress when last resumed: not again until room
    /// changes.
    resume_stalled: bool,
    /// The hints the readers have in hand (a preload job one reads, a waiting hint one
    /// resumes): (reader, (tag, owner), cancelled meanwhile). A reader cancels its hint again
    /// once done with it if a cancel came meanwhile (`done_reading`).
    reading: Vec<(usize, (u64, u64), bool)>,
    /// Committed blocks to push to the write-behind tier (each holds one pin), and their bytes
    /// (retries included).
    push: VecDeque<Demote>,
    push_bytes: u64,
    /// Pushes that failed, waiting for their next try (due time, tries so far), due order.
    push_retry: VecDeque<(Instant, u8, Demote)>,
    stop: bool,
}

/// The worker's queues.
#[derive(Default)]
pub(crate) struct Work {
    q: Mutex<Queues>,
    writer_cv: Condvar,
    reader_cv: Condvar,
    pusher_cv: Condvar,
}

/// Queue depths, for stats.
pub(crate) struct Depths {
    pub demote_blocks: u64,
    pub demote_bytes: u64,
    pub promote_jobs: u64,
    pub prefetch_jobs: u64,
    pub prefetch_bytes: u64,
    pub push_bytes: u64,
}

impl Work {
    pub(crate) fn depths(&self) -> Depths {
        let q = self.q.lock();
        Depths {
            demote_blocks: q.demote.len() as u64,
            demote_bytes: q.demote_bytes,
            promote_jobs: q.promote.len() as u64,
            prefetch_jobs: q.prefetch.len() as u64,
            prefetch_bytes: q.prefetch_bytes,
            push_bytes: q.push_bytes,
        }
    }

    /// Bytes of preloads queued or being read.
    pub(crate) fn prefetch_bytes(&self) -> u64 {
        self.q.lock().prefetch_bytes
    }

    /// Whether hints wait for room (a new one waits behind them).
    pub(crate) fn hints_waiting(&self) -> bool {
        !self.q.lock().waiting.is_empty()
    }

    /// Keys of hints waiting for room.
    pub(crate) fn waiting_keys(&self) -> usize {
        self.q.lock().waiting_keys
    }

    /// Preload bytes of `owner` queued or being read.
    pub(crate) fn owner_inflight(&self, owner: u64) -> u64 {
        self.q.lock().inflight_by_owner.get(owner)
    }

    /// Puts a hint's rest on the waiting list (at the front: a resumed one keeps its place);
    /// false if the list is full (or the worker stopped).
    pub(crate) fn wait_hint(
        &self,
        w: super::prefetch::Waiting,
        front: bool,
        max_keys: usize,
    ) -> bool {
        let mut q = self.q.lock();
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
            self.reader_cv.notify_all();
        }
        true
    }

    /// Preload room may have come back: the reader tries the waiting hints again.
    pub(crate) fn room_changed(&self) {
        let mut q = self.q.lock();
        if !q.waiting.is_empty() {
            q.resume_stalled = false;
            self.reader_cv.notify_all();
        }
    }

    /// Whether demotions are queued or being written (room is coming).
    pub(crate) fn demotions_pending(&self) -> bool {
        let q = self.q.lock();
        !q.demote.is_empty() || q.writing > 0
    }

    /// Whether the demotion queue takes more (bounded to a few batches).
    pub(crate) fn demote_room(&self, batch: u64) -> bool {
        self.q.lock().demote_bytes < 4 * batch
    }

    fn stopped(&self) -> bool {
        self.q.lock().stop
    }
}

impl Inner {
    /// Queues a committed block (pinned for the push) for the write-behind tier; when the
    /// queue is full it is not pushed (its pin is dropped, counted).
    pub(crate) fn enqueue_push(&self, d: Demote) {
        let mut q = self.work.q.lock();
        if q.stop || q.push_bytes + u64::from(d.len) > self.push_queue_bytes {
            drop(q);
            self.stats.push_dropped.fetch_add(1, Relaxed);
            self.unpin(d.key, d.slot);
            return;
        }
        q.push_bytes += u64::from(d.len);
        q.push.push_back(d);
        self.work.pusher_cv.notify_one();
    }

    /// Queues demotions (their blocks are pinned and marked Demoting).
    pub(crate) fn enqueue_demotions(&self, items: Vec<Demote>) {
        let mut q = self.work.q.lock();
        for d in items {
            q.demote_bytes += u64::from(d.len);
            q.demote.push_back(d);
        }
        self.work.writer_cv.notify_one();
    }

    /// Queues a promotion batch from lower tier `tier`; returns its ticket.
    pub(crate) fn enqueue_promotions(&self, tier: usize, items: Vec<Promote>) -> Arc<Ticket> {
        let ticket = Arc::new(Ticket::default());
        let mut q = self.work.q.lock();
        if q.stop {
            drop(q);
            // No reader any more: the items fail now (nothing was read).
            self.finish_promotions(&items, &[], None);
            ticket.complete(vec![false; items.len()]);
            return ticket;
        }
        q.promote.push_back(PromoteJob {
            tier,
            items,
            ticket: ticket.clone(),
            hint: None,
        });
        self.work.reader_cv.notify_all();
        ticket
    }

    /// Queues a preload batch from lower tier `tier` (its blocks reserved Promoting with one
    /// pin each, which holds them once published, until used or the hint's deadline). Refused
    /// (nothing queued; the caller undoes the items) if the bytes do not fit the preload bound
    /// beside those queued, being read and held.
    pub(crate) fn enqueue_prefetch(
        &self,
        tier: usize,
        items: Vec<Promote>,
        hint: Hint,
    ) -> Result<(), Vec<Promote>> {
        let mut q = self.work.q.lock();
        let held = self.held_bytes.load(Relaxed);
        if q.stop
            || q.prefetch_bytes + hint.bytes > self.prefetch_max_inflight
            || q.prefetch_bytes + held + hint.bytes > self.prefetch_max_held
        {
            return Err(items);
        }
        q.prefetch_bytes += hint.bytes;
        q.inflight_by_owner.add(hint.owner, hint.bytes);
        let ticket = Arc::new(Ticket::default());
        ticket.abandon();
        q.prefetch.push(PromoteJob {
            tier,
            items,
            ticket,
            hint: Some(hint),
        });
        self.work.reader_cv.notify_all();
        Ok(())
    }

    /// A load waits for `key`, which a queued preload will read: that job goes to the front
    /// of the real loads' queue (and can no longer be cancelled).
    pub(crate) fn escalate_prefetch(&self, key: BlockKey) {
        let mut q = self.work.q.lock();
        if let Some(i) = q
            .prefetch
            .iter()
            .position(|j| j.items.iter().any(|p| p.key == key))
        {
            let job = q.prefetch.remove(i);
            q.promote.push_front(job);
        }
    }

    /// Cancels the queued (not yet started, not escalated) preloads of hints that `cancel`
    /// picks (by tag and owner), their rest still waiting for room, and ends the holds they
    /// made; returns how many blocks that was. A preload being read (or a waiting hint being
    /// resumed) is marked: its reader cancels what it published or queued once done.
    pub(crate) fn cancel_prefetch_where(&self, cancel: impl Fn(u64, u64) -> bool) -> usize {
        let gone: Vec<PromoteJob> = {
            let mut q = self.work.q.lock();
            let (gone, keep) = std::mem::take(&mut q.prefetch)
                .into_iter()
                .partition(|j| j.hint.is_some_and(|h| cancel(h.tag, h.owner)));
            q.prefetch = keep;
            let (dropped, waiting): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut q.waiting)
                .into_iter()
                .partition(|w| cancel(w.tag, w.quota.owner));
            q.waiting = waiting;
            for r in q.reading.iter_mut().filter(|r| cancel(r.1 .0, r.1 .1)) {
                r.2 = true;
            }
            for w in &dropped {
                q.waiting_keys -= w.keys.len();
                q.waiting_by_owner.sub(w.quota.owner, w.keys.len() as u64);
            }
            for j in &gone {
                if let Some(h) = j.hint {
                    q.prefetch_bytes -= h.bytes;
                    q.inflight_by_owner.sub(h.owner, h.bytes);
                }
            }
            gone
        };
        let mut n = 0;
        for j in gone {
            self.finish_promotions(&j.items, &[], None);
            n += j.items.len();
        }
        n += self.end_holds_where(|h| cancel(h.tag, h.owner), false);
        self.stats.prefetch_cancelled.fetch_add(n as u64, Relaxed);
        self.work.room_changed();
        self.progress.bump();
        n
    }

    /// The reader is done with the hint it took (a preload job read and published, or a
    /// waiting hint resumed): if the hint was cancelled meanwhile, the cancel missed what the
    /// reader had in hand, so it runs again now (the holds it published, the jobs and waiting
    /// rest a resume queued). A cancel after this point finds them itself.
    fn done_reading(&self, reader: usize, hint: (u64, u64)) {
        let cancelled = {
            let mut q = self.work.q.lock();
            match q.reading.iter().position(|r| r.0 == reader) {
                Some(i) => q.reading.swap_remove(i).2,
                None => false,
            }
        };
        if cancelled {
            self.cancel_prefetch_where(|t, o| (t, o) == hint);
        }
    }

    /// Takes the first waiting hint whose owner may have room: one its quota cut waits until
    /// that owner's holds or preloads shrink, without holding up the others' hints.
    fn next_waiting(&self, q: &mut Queues) -> Option<super::prefetch::Waiting> {
        let held = self.held_by_owner.lock();
        let i = q.waiting.iter().position(|w| match w.owner_full_at {
            None => true,
            Some(at) => held.get(w.quota.owner) + q.inflight_by_owner.get(w.quota.owner) < at,
        })?;
        drop(held);
        q.waiting.remove(i)
    }

    /// Whether the reader should resume the first waiting hint: there is one, room for
    /// preloads, and it did not stall since room last changed.
    fn can_resume(&self, q: &Queues) -> bool {
        let held = self.held_bytes.load(Relaxed);
        !q.waiting.is_empty()
            && !q.resume_stalled
            && q.prefetch_bytes < self.prefetch_max_inflight
            && q.prefetch_bytes + held < self.prefetch_max_held
    }

    /// The writer: one batch of queued demotions at a time.
    fn writer_loop(&self) {
        loop {
            let batch = {
                let mut q = self.work.q.lock();
                while q.demote.is_empty() && !q.stop {
                    self.work.writer_cv.wait(&mut q);
                }
                if q.demote.is_empty() {
                    return;
                }
                let mut batch = Vec::new();
                let mut bytes = 0u64;
                while let Some(d) = q.demote.front() {
                    if !batch.is_empty() && bytes + u64::from(d.len) > self.max_batch_bytes {
                        break;
                    }
                    bytes += u64::from(d.len);
                    q.demote_bytes -= u64::from(d.len);
                    batch.extend(q.demote.pop_front());
                }
                q.writing += batch.len();
                batch
            };
            let n = batch.len();
            self.write_back(batch);
            self.work.q.lock().writing -= n;
            self.work.room_changed();
            self.progress.bump();
        }
    }

    /// The pusher: batches of committed blocks to the write-behind tier (the remote tier), in
    /// commit order. A failed push is tried again after 1 s, 4 s and 16 s (an owner that
    /// restarts or a breaker that closes again still gets the block), holding its pin and its
    /// bytes of the push queue meanwhile; after that the block stays local only. Nothing waits
    /// for a push.
    fn pusher_loop(&self) {
        let Some(tier) = self.push_to.and_then(|i| self.tiers.get(i)) else {
            return;
        };
        loop {
            let batch: Vec<(u8, Demote)> = {
                let mut q = self.work.q.lock();
                loop {
                    if q.stop {
                        // Shutting down: what is queued is not pushed.
                        let mut left: Vec<Demote> = q.push.drain(..).collect();
                        left.extend(q.push_retry.drain(..).map(|r| r.2));
                        q.push_bytes = 0;
                        drop(q);
                        for d in left {
                            self.unpin(d.key, d.slot);
                        }
                        return;
                    }
                    let due = q.push_retry.front().is_some_and(|r| r.0 <= Instant::now());
                    if !q.push.is_empty() || due {
                        break;
                    }
                    match q.push_retry.front().map(|r| r.0) {
                        Some(at) => {
                            self.work.pusher_cv.wait_until(&mut q, at);
                        }
                        None => self.work.pusher_cv.wait(&mut q),
                    }
                }
                let mut batch = Vec::new();
                let mut bytes = 0u64;
                let now = Instant::now();
                while q.push_retry.front().is_some_and(|r| r.0 <= now) {
                    let Some((_, tries, d)) = q.push_retry.pop_front() else {
                        break;
                    };
                    bytes += u64::from(d.len);
                    batch.push((tries, d));
                }
                while let Some(d) = q.push.front() {
                    if !batch.is_empty() && bytes + u64::from(d.len) > self.max_batch_bytes {
                        break;
                    }
                    bytes += u64::from(d.len);
                    batch.extend(q.push.pop_front().map(|d| (0, d)));
                }
                q.push_bytes -= bytes;
                batch
            };
            let items = batch
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
            let outcomes = tier.write(items, &still_wanted);
            for ((tries, d), o) in batch.iter().zip(outcomes) {
                match o {
                    WriteOutcome::Written | WriteOutcome::Present => {
                        self.stats.pushes.fetch_add(1, Relaxed);
                        // Now also loadable from the remote tier (its owner publishes its
                        // own copy, and that copy's removal, as its host or disk tier's).
                        self.events
                            .emit(EventKind::Stored, d.key, tier.kind(), d.ns);
                    }
                    WriteOutcome::Cancelled => {}
                    WriteOutcome::Busy | WriteOutcome::Failed if *tries < PUSH_RETRIES => {
                        // Keeps its pin and its share of the queue until the next try.
                        let at = Instant::now() + PUSH_RETRY_FIRST * (1 << (2 * tries));
                        let mut q = self.work.q.lock();
                        if !q.stop {
                            q.push_bytes += u64::from(d.len);
                            // Due order: a first retry (1 s) may come due before a later
                            // one (16 s) queued earlier.
                            let pos = q.push_retry.partition_point(|r| r.0 <= at);
                            q.push_retry.insert(pos, (at, tries + 1, *d));
                            self.stats.push_retries.fetch_add(1, Relaxed);
                            continue;
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
        let freed = {
            let mut sh = self.shard(d.key).lock();
            if let Some(e) = sh.map.get_mut(&mk).filter(|e| e.slot() == d.slot) {
                e.set_copy(match o {
                    WriteOutcome::Written | WriteOutcome::Present => Copy::Clean,
                    // Another write of it is in flight, or an older copy is being removed:
                    // dirty again, written at a later eviction.
                    WriteOutcome::Busy | WriteOutcome::Cancelled => Copy::Dirty,
                    WriteOutcome::Failed => Copy::Unwritable,
                    WriteOutcome::Corrupt => Copy::Unwritable,
                });
                if o == WriteOutcome::Corrupt {
                    damaged = true;
                    if let Removed::Doomed(len, _) = sh.remove(mk) {
                        self.stats.blocks.fetch_sub(1, Relaxed);
                        self.stats.used_bytes.fetch_sub(u64::from(len), Relaxed);
                    }
                }
            }
            sh.unpin(mk, d.slot)
        };
        if damaged {
            self.stats.checksum_failures.fetch_add(1, Relaxed);
            tracing::warn!(key = %d.key, "host block no longer matches its commit checksum (written after its commit?): dropped, never written below");
            self.events
                .emit(EventKind::Removed, d.key, Tier::Host, d.ns);
        }
        if freed {
            self.free_slot(d.slot);
        }
    }

    /// The reader of lower tier `me`: one promotion batch of that tier at a time (a slow
    /// peer's reads never hold up the disk's). The first tier's reader also resumes the
    /// waiting hints.
    fn reader_loop(&self, me: usize) {
        let resumer = me == 0;
        let mine = |q: &Queues| {
            q.promote.iter().any(|j| j.tier == me) || q.prefetch.iter().any(|j| j.tier == me)
        };
        loop {
            let job = {
                let mut q = self.work.q.lock();
                // Until there is a job of this tier, a waiting hint to resume (the first
                // tier's reader), or the store stops.
                let ready = |q: &Queues| mine(q) || (resumer && self.can_resume(q)) || q.stop;
                while !ready(&q) {
                    self.work.reader_cv.wait(&mut q);
                }
                if q.stop && !q.waiting.is_empty() {
                    q.waiting.clear();
                    q.waiting_keys = 0;
                    q.waiting_by_owner.clear();
                }
                if q.stop && !q.prefetch.is_empty() {
                    // Shutting down: preloads are dropped unread.
                    let gone = std::mem::take(&mut q.prefetch);
                    q.prefetch_bytes = 0;
                    q.inflight_by_owner.clear();
                    drop(q);
                    for j in gone {
                        self.finish_promotions(&j.items, &[], None);
                    }
                    continue;
                }
                if let Some(i) = q.promote.iter().position(|j| j.tier == me) {
                    match q.promote.remove(i) {
                        Some(j) => j,
                        None => continue,
                    }
                } else if let Some(i) = (0..q.prefetch.len())
                    .filter(|&i| q.prefetch[i].tier == me)
                    .max_by_key(|&i| (q.prefetch[i].hint.map_or(0, |h| h.priority), usize::MAX - i))
                {
                    let j = q.prefetch.remove(i);
                    if let Some(h) = j.hint {
                        q.reading.push((me, (h.tag, h.owner), false));
                    }
                    j
                } else if resumer && !q.stop && !q.waiting.is_empty() {
                    // Room came back: the first waiting hint's turn (whose owner has room).
                    let Some(w) = self.next_waiting(&mut q) else {
                        // Every waiting hint's owner is at its quota: until room changes.
                        q.resume_stalled = true;
                        continue;
                    };
                    q.waiting_keys -= w.keys.len();
                    q.waiting_by_owner.sub(w.quota.owner, w.keys.len() as u64);
                    let hint = (w.tag, w.quota.owner);
                    q.reading.push((me, hint, false));
                    drop(q);
                    let progress = self.resume_hint(w);
                    if !progress {
                        self.work.q.lock().resume_stalled = true;
                    }
                    self.done_reading(me, hint);
                    continue;
                } else if q.stop {
                    return;
                } else {
                    continue;
                }
            };
            if let Some(h) = job.hint.filter(|h| Instant::now() >= h.deadline) {
                // Its request no longer waits for it: not read at all.
                self.finish_promotions(&job.items, &[], None);
                self.stats
                    .prefetch_expired
                    .fetch_add(job.items.len() as u64, Relaxed);
                {
                    let mut q = self.work.q.lock();
                    q.prefetch_bytes -= h.bytes;
                    q.inflight_by_owner.sub(h.owner, h.bytes);
                }
                self.done_reading(me, (h.tag, h.owner));
                self.progress.bump();
                continue;
            }
            let items: Vec<ReadItem> = job
                .items
                .iter()
                .map(|p| ReadItem {
                    key: p.key,
                    // SAFETY: the slot is reserved for this promotion (Promoting: invisible,
                    // in no free list) until `finish_promotions` publishes or frees it.
                    buf: unsafe { IoBuf::from_raw(self.ptr(p.page), p.cap) },
                })
                .collect();
            let bytes: u64 = job.items.iter().map(|p| u64::from(p.len)).sum();
            let started = Instant::now();
            let outcomes = match self.tiers.get(job.tier) {
                Some(t) => t.read(items),
                None => vec![ReadOutcome::Miss; job.items.len()],
            };
            if let Some(sp) = self.speed.get(job.tier) {
                sp.lock().observe(bytes, started.elapsed().as_secs_f64());
            }
            let ok = self.finish_promotions(
                &job.items,
                &outcomes,
                job.hint.map(|h| (h.deadline, h.owner, h.tag)),
            );
            if let Some(h) = job.hint {
                {
                    let mut q = self.work.q.lock();
                    q.prefetch_bytes -= h.bytes;
                    q.inflight_by_owner.sub(h.owner, h.bytes);
                }
                self.done_reading(me, (h.tag, h.owner));
                // Published preloads keep their pin (held, see `Inner::release_preload`).
                self.reap_preloads(Instant::now());
                self.work.room_changed();
                self.progress.bump();
                continue;
            }
            if !job.ticket.complete(ok.clone()) {
                // The load gave up waiting: the pins it would have taken over are dropped.
                for (p, _) in job.items.iter().zip(&ok).filter(|(_, ok)| **ok) {
                    self.unpin(p.key, p.slot);
                }
            }
            self.progress.bump();
        }
    }

    /// Publishes promoted blocks whose read succeeded with the expected length (Ready, clean,
    /// still pinned for the load); frees the others' slots. One bool per item.
    /// With `preload` (the hint's deadline), published blocks are held for their load: their
    /// pin stays, recorded in `preloads`.
    fn finish_promotions(
        &self,
        items: &[Promote],
        outcomes: &[ReadOutcome],
        preload: Option<(Instant, u64, u64)>,
    ) -> Vec<bool> {
        let read = |i: usize, p: &Promote| match outcomes.get(i) {
            Some(ReadOutcome::Hit(info)) if info.len == p.len => Some(*info),
            _ => None,
        };
        // Into the policy first (an evictor skips slots not Ready yet), tail first (items are
        // in prefix order): at equal recency a parent outlives its children. Published (and
        // announced) in prefix order below.
        for (i, p) in items.iter().enumerate().rev() {
            if let Some(info) = read(i, p) {
                let mut c = self.classes[p.slot.class as usize].lock();
                c.sums[p.slot.idx as usize] = info.checksum;
                c.policy.insert(p.slot.idx, p.key.0 as u64);
            }
        }
        let mut ok = Vec::with_capacity(items.len());
        for (i, p) in items.iter().enumerate() {
            let mk = MapKey::from(p.key);
            let published = match read(i, p) {
                Some(info) => {
                    if let Some((deadline, owner, tag)) = preload {
                        // Recorded before it is visible: a load that finds it preloaded
                        // always finds the hold to release.
                        let old = self.preloads.lock().insert(
                            mk,
                            super::prefetch::Held {
                                slot: p.slot,
                                deadline,
                                bytes: u64::from(info.len),
                                read: true,
                                owner,
                                tag,
                            },
                        );
                        self.add_hold_bytes(owner, u64::from(info.len));
                        if let Some(old) = old {
                            // The hold of a copy removed while held.
                            self.drop_hold(p.key, old);
                        }
                    }
                    let e = {
                        let mut sh = self.shard(p.key).lock();
                        let e = sh.publish(mk, p.slot, Copy::Clean);
                        if let (Some(_), Some(_), Some(x)) = (preload, e, sh.map.get_mut(&mk)) {
                            x.set_preloaded(true);
                        }
                        e
                    };
                    if preload.is_some() && e.is_none() {
                        // Removed meanwhile: nothing to hold.
                        let h = self.preloads.lock().remove(&mk);
                        if let Some(h) = h {
                            self.held_bytes.fetch_sub(h.bytes, Relaxed);
                            self.held_by_owner.lock().sub(h.owner, h.bytes);
                        }
                    }
                    if let Some(e) = e {
                        self.stats.blocks.fetch_add(1, Relaxed);
                        self.stats.used_bytes.fetch_add(u64::from(e.len), Relaxed);
                        self.stats.promotions.fetch_add(1, Relaxed);
                        self.events.emit(EventKind::Stored, p.key, Tier::Host, e.ns);
                        true
                    } else {
                        false
                    }
                }
                None => {
                    self.shard(p.key).lock().abort(mk, p.slot);
                    false
                }
            };
            if !published {
                self.free_slot(p.slot);
            }
            ok.push(published);
        }
        ok
    }

    /// Faults the arena in segment by segment, handing each to the allocator when ready.
    fn populate_loop(&self) {
        let seg_bytes = self.seg_pages as usize * super::PAGE;
        let start = Instant::now();
        let mut next_log = 0.1;
        for seg in 0..self.n_segments {
            if self.work.stopped() {
                return;
            }
            let base = self.ptr(seg * self.seg_pages);
            // SAFETY: the range is one segment inside the arena mapping; no slot of it is in
            // use yet (the segment is in no class and not in the pool), so writing zeros into
            // its first byte per page (the fallback) changes no block.
            unsafe { populate(base, seg_bytes) };
            self.segments.lock().push(seg);
            let done = self.populated.fetch_add(1, Relaxed) + 1;
            self.progress.bump();
            let frac = f64::from(done) / f64::from(self.n_segments);
            if done == self.n_segments {
                // Now the whole arena is resident: register it for the lower tiers' I/O.
                for t in &self.tiers {
                    t.register_memory(vec![(self.arena.base() as usize, self.arena.len())]);
                }
            }
            if frac >= next_log || done == self.n_segments {
                next_log += 0.1;
                tracing::info!(
                    segments = done,
                    of = self.n_segments,
                    secs = format!("{:.1}", start.elapsed().as_secs_f64()),
                    "host arena populated {:.0}%",
                    frac * 100.0
                );
            }
        }
    }

    /// Every dirty admitted block written below, then every lower tier checkpointed.
    pub(crate) fn flush(&self) -> usize {
        if self.demote_to.is_none() {
            return 0;
        }
        let before = self.stats.demotions.load(Relaxed);
        for s in self.shards.iter() {
            let mut queue = Vec::new();
            {
                let mut sh = s.lock();
                for (k, e) in sh.map.iter_mut() {
                    let key = BlockKey::from(*k);
                    if e.ready() && e.copy() == Copy::Dirty && self.admitted(key, e.accessed()) {
                        e.set_copy(Copy::Demoting);
                        e.pins += 1;
                        tracing::trace!(%key, "flush: queued");
                        queue.push((key, e.slot(), e.len, e.ns));
                    }
                }
            }
            let demote = queue
                .into_iter()
                .map(|(key, slot, len, ns)| Demote {
                    key,
                    slot,
                    page: self.classes[slot.class as usize]
                        .lock()
                        .page_of(slot.idx, self.seg_pages),
                    cap: self.class_sizes[slot.class as usize],
                    len,
                    ns,
                })
                .collect::<Vec<_>>();
            if !demote.is_empty() {
                self.enqueue_demotions(demote);
            }
        }
        if !self.sync(Duration::from_secs(600)) {
            tracing::warn!("flush: writes still queued after 10 minutes");
        }
        for t in &self.tiers {
            if let Err(e) = t.checkpoint() {
                tracing::warn!(error = %e, "checkpoint failed (the journal stays valid)");
            }
        }
        (self.stats.demotions.load(Relaxed) - before) as usize
    }

    /// Waits until no demotion is queued or being written.
    pub(crate) fn sync(&self, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        loop {
            let seen = self.progress.current();
            if !self.work.demotions_pending() {
                return true;
            }
            if self.work.stopped() || Instant::now() >= until {
                return false;
            }
            self.progress
                .wait(seen, until.min(Instant::now() + Duration::from_millis(50)));
        }
    }
}

/// Faults `len` bytes at `base` in, writable.
///
/// # Safety
/// `base..base+len` must be mapped shared memory that nobody reads or writes meanwhile.
unsafe fn populate(base: *mut u8, len: usize) {
    // SAFETY: the caller's range; MADV_POPULATE_WRITE does not change data.
    let r = unsafe { libc::madvise(base.cast(), len, libc::MADV_POPULATE_WRITE) };
    if r != 0 {
        // Before Linux 5.14: touch each page (a write keeps the page from being a shared zero
        // page; the byte written is 0, which is what a fresh memfd page holds).
        for off in (0..len).step_by(4096) {
            // SAFETY: within the caller's range.
            unsafe { std::ptr::write_volatile(base.add(off), 0) };
        }
    }
}

/// The worker's threads.
pub(crate) struct Threads {
    handles: Vec<JoinHandle<()>>,
}

impl Threads {
    pub(crate) fn start(inner: &Arc<Inner>, populate: bool) -> std::io::Result<Self> {
        let mut handles = Vec::new();
        let spawn = |name: &str, f: fn(&Inner)| {
            let i = inner.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || f(&i))
        };
        if !inner.tiers.is_empty() {
            handles.push(spawn("kvtier-writer", Inner::writer_loop)?);
        }
        // One reader per lower tier: a remote peer that times out holds up only its own reads.
        for t in 0..inner.tiers.len() {
            let i = inner.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("kvtier-reader-{t}"))
                    .spawn(move || i.reader_loop(t))?,
            );
        }
        if inner.push_to.is_some() {
            handles.push(spawn("kvtier-pusher", Inner::pusher_loop)?);
        }
        if populate {
            handles.push(spawn("kvtier-populate", Inner::populate_loop)?);
        }
        Ok(Self { handles })
    }

    /// Stops the threads: queued demotions are written first (the writer drains its queue),
    /// queued promotions fail.
    pub(crate) fn stop(&mut self, inner: &Inner) {
        {
            let mut q = inner.work.q.lock();
            q.stop = true;
        }
        inner.work.writer_cv.notify_all();
        inner.work.reader_cv.notify_all();
        inner.work.pusher_cv.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
        // Promotions nobody will read: fail them so their slots come back.
        let left: Vec<PromoteJob> = {
            let mut q = inner.work.q.lock();
            let mut v: Vec<PromoteJob> = q.promote.drain(..).collect();
            v.append(&mut q.prefetch);
            q.prefetch_bytes = 0;
            q.inflight_by_owner.clear();
            v
        };
        for job in left {
            let ok = inner.finish_promotions(&job.items, &[], None);
            job.ticket.complete(ok);
        }
    }
}
