//! The readers, one per lower tier: promotions (blocks read from that tier into reserved host
//! slots), queued by loads, and preloads, queued by hints (see `reads.rs` for the queue they
//! own). A load waits for its own batch with one deadline and may abandon it. A peer that
//! stopped answering holds up only the remote tier's reader. The first tier's reader also
//! resumes hints waiting for room.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use crate::events::EventKind;
use crate::io::IoBuf;
use crate::key::BlockKey;
use crate::tier::{ReadItem, ReadOutcome};
use crate::types::{MapKey, Tier};

use super::super::index::Copy;
use super::super::prefetch::Held;
use super::super::Inner;
use super::reads::{PromoteJob, State};
use super::ticket::Ticket;
use super::{Hint, Promote};

impl Inner {
    /// Queues a promotion batch from lower tier `tier`; returns its ticket.
    pub(crate) fn enqueue_promotions(&self, tier: usize, items: Vec<Promote>) -> Arc<Ticket> {
        let ticket = Arc::new(Ticket::default());
        let mut q = self.work.reads.lock();
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
        self.work.reads.notify();
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
        let ticket = Arc::new(Ticket::default());
        ticket.abandon();
        let mut q = self.work.reads.lock();
        let held = self.held_bytes.load(Relaxed);
        if q.stop
            || q.prefetch_bytes + hint.bytes > self.prefetch_max_inflight
            || q.prefetch_bytes + held + hint.bytes > self.prefetch_max_held
        {
            return Err(items);
        }
        q.prefetch_bytes += hint.bytes;
        q.inflight_by_owner.add(hint.owner, hint.bytes);
        q.prefetch.push(PromoteJob {
            tier,
            items,
            ticket,
            hint: Some(hint),
        });
        self.work.reads.notify();
        Ok(())
    }

    /// A load waits for `key`, which a queued preload will read: that job goes to the front
    /// of the real loads' queue (and can no longer be cancelled).
    pub(crate) fn escalate_prefetch(&self, key: BlockKey) {
        self.work.reads.escalate(key);
    }

    /// Cancels the queued (not yet started, not escalated) preloads of hints that `cancel`
    /// picks (by tag and owner), their rest still waiting for room, and ends the holds they
    /// made; returns how many blocks that was. A preload being read (or a waiting hint being
    /// resumed) is marked: its reader cancels what it published or queued once done.
    pub(crate) fn cancel_prefetch_where(&self, cancel: impl Fn(u64, u64) -> bool) -> usize {
        let gone: Vec<PromoteJob> = {
            let mut q = self.work.reads.lock();
            let (gone, keep): (Vec<PromoteJob>, Vec<PromoteJob>) = std::mem::take(&mut q.prefetch)
                .into_iter()
                .partition(|j| j.hint.is_some_and(|h| cancel(h.tag, h.owner)));
            q.prefetch = keep;
            let (dropped, waiting): (std::collections::VecDeque<_>, _) =
                std::mem::take(&mut q.waiting)
                    .into_iter()
                    .partition(|w| cancel(w.tag, w.quota.owner));
            q.waiting = waiting;
            let mut unwatched = Vec::new();
            for ws in q.watching.values_mut() {
                let (gone, keep): (Vec<_>, Vec<_>) = std::mem::take(ws)
                    .into_iter()
                    .partition(|w| cancel(w.tag, w.quota.owner));
                *ws = keep;
                unwatched.extend(gone);
            }
            if !unwatched.is_empty() {
                q.watching.retain(|_, ws| !ws.is_empty());
                for w in &unwatched {
                    q.watching_keys -= w.keys.len();
                    q.watching_by_owner.sub(w.quota.owner, w.keys.len() as u64);
                }
            }
            for r in q.reading.iter_mut().filter(|r| cancel(r.1 .0, r.1 .1)) {
                r.2 = true;
            }
            for w in &dropped {
                q.waiting_keys -= w.keys.len();
                q.waiting_by_owner.sub(w.quota.owner, w.keys.len() as u64);
            }
            for j in &gone {
                if let Some(h) = j.hint {
                    q.unqueued(&h);
                }
            }
            gone
        };
        let mut n = 0;
        for j in gone {
            self.finish_promotions(&j.items, &[], None);
            n += j.items.len();
        }
        // Blocks a preload read and no load used: wasted.
        n += self.end_holds_where(|h| cancel(h.tag, h.owner), true);
        self.stats.prefetch_cancelled.fetch_add(n as u64, Relaxed);
        self.work.reads.room_changed();
        self.progress.bump();
        n
    }

    /// The reader is done with the hint it took (a preload job read and published, or a
    /// waiting hint resumed): if the hint was cancelled meanwhile, the cancel missed what the
    /// reader had in hand, so it runs again now (the holds it published, the jobs and waiting
    /// rest a resume queued). A cancel after this point finds them itself.
    /// The hint stays in hand until that second cancel is done, so that whoever sees no hint
    /// in hand (and nothing queued) sees its cancel complete.
    fn done_reading(&self, reader: usize, hint: (u64, u64)) {
        let cancelled = {
            let q = self.work.reads.lock();
            q.reading.iter().any(|r| r.0 == reader && r.2)
        };
        if cancelled {
            self.cancel_prefetch_where(|t, o| (t, o) == hint);
        }
        let mut q = self.work.reads.lock();
        if let Some(i) = q.reading.iter().position(|r| r.0 == reader) {
            q.reading.swap_remove(i);
        }
    }

    /// Whether the reader should resume the first waiting hint: there is one, room for
    /// preloads, and it did not stall since room last changed.
    fn can_resume(&self, q: &State) -> bool {
        let held = self.held_bytes.load(Relaxed);
        !q.waiting.is_empty()
            && !q.resume_stalled
            && q.prefetch_bytes < self.prefetch_max_inflight
            && q.prefetch_bytes + held < self.prefetch_max_held
    }

    /// The reader of lower tier `me`: one promotion batch of that tier at a time (a slow
    /// peer's reads never hold up the disk's). The first tier's reader also resumes the
    /// waiting hints.
    pub(super) fn reader_loop(&self, me: usize) {
        let resumer = me == 0;
        let mine = |q: &State| {
            q.promote.iter().any(|j| j.tier == me) || q.prefetch.iter().any(|j| j.tier == me)
        };
        loop {
            let job = {
                let mut q = self.work.reads.lock();
                // Until there is a job of this tier, a waiting hint to resume (the first
                // tier's reader), or the store stops.
                let ready = |q: &State| mine(q) || (resumer && self.can_resume(q)) || q.stop;
                while !ready(&q) {
                    self.work.reads.wait(&mut q);
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
                    let Some(w) = q.next_waiting() else {
                        // Every waiting hint's owner is at its quota: until room changes.
                        q.resume_stalled = true;
                        continue;
                    };
                    let hint = (w.tag, w.quota.owner);
                    q.reading.push((me, hint, false));
                    drop(q);
                    let progress = self.resume_hint(w);
                    if !progress {
                        self.work.reads.lock().resume_stalled = true;
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
                self.work.reads.lock().unqueued(&h);
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
                self.work.reads.lock().unqueued(&h);
                self.done_reading(me, (h.tag, h.owner));
                // Published preloads keep their pin (held, see `Inner::release_preload`).
                self.reap_preloads(Instant::now());
                self.work.reads.room_changed();
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
    pub(super) fn finish_promotions(
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
                    let e = if let Some((deadline, owner, tag)) = preload {
                        // Held with the publication, under the holds' lock and then the
                        // shard's: a load that finds the block preloaded finds the hold to
                        // release (it takes the holds' lock after), and a hold never owns
                        // the pin of a promotion that did not publish (a removal while it
                        // was promoting forgets that pin: a hold recorded before, ended
                        // meanwhile by a reap, would unpin a slot already given to another
                        // block). Counted under the holds' lock: a cancel that ends the hold
                        // at once subtracts only what was added.
                        let mut holds = self.preloads.lock();
                        let mut sh = self.shard(p.key).lock();
                        let e = sh.publish(mk, p.slot, Copy::Clean);
                        let mut old = None;
                        if let Some(e) = &e {
                            // Under the shard's lock, as every host event of a block.
                            self.events.emit(EventKind::Stored, p.key, Tier::Host, e.ns);
                        }
                        if e.is_some() {
                            if let Some(mut x) = sh.map.get_mut(&mk) {
                                x.set_preloaded(true);
                            }
                            old = holds.insert(
                                mk,
                                Held {
                                    slot: p.slot,
                                    deadline,
                                    bytes: u64::from(info.len),
                                    read: true,
                                    owner,
                                    tag,
                                },
                            );
                            self.add_hold_bytes(owner, u64::from(info.len));
                        }
                        drop(sh);
                        drop(holds);
                        if let Some(old) = old {
                            // The hold of a copy removed while held.
                            self.drop_hold(p.key, old);
                        }
                        e
                    } else {
                        let mut sh = self.shard(p.key).lock();
                        let e = sh.publish(mk, p.slot, Copy::Clean);
                        if let Some(e) = &e {
                            // Under the shard's lock, as every host event of a block.
                            self.events.emit(EventKind::Stored, p.key, Tier::Host, e.ns);
                        }
                        e
                    };
                    if e.is_some() {
                        self.stats.blocks.fetch_add(1, Relaxed);
                        self.stats.used_bytes.fetch_add(u64::from(p.len), Relaxed);
                        self.stats.promotions.fetch_add(1, Relaxed);
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
}
