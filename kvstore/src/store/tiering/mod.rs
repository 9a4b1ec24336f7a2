//! The tiering worker: the threads that move blocks between the host arena and the lower tiers,
//! so that no engine request ever does I/O it did not ask for. One file per thread, and each
//! queue belongs to the thread that drains it, behind a lock of its own that nothing else is
//! taken under (a leaf in the store's lock order, ARCHITECTURE.md "Locks"):
//!
//! - `writer.rs` — the **writer** and the demotion queue: dirty blocks written to the first
//!   lower tier, in batches of at most `max_batch_bytes`.
//! - `pusher.rs` — the **pusher** and the push queue (with a write-behind tier, the remote
//!   tier): committed blocks pushed in batches, with retries.
//! - `reader.rs`, `reads.rs` — the **readers**, one per lower tier, and the read queue they
//!   share: promotions for loads, preloads for hints, hints waiting for room, and the
//!   per-owner preload bytes.
//! - `ticket.rs` — how a load waits for its promotion batch.
//! - this file — the queues together ([`Work`]), starting and stopping the threads, the
//!   **populator** (with `Populate::Background`: faults the arena in segment by segment),
//!   `flush` and `sync`.
//!
//! Queues are bounded: demotions by bytes (an allocation that finds the queue full waits for
//! room, counted in `waits`), pushes by bytes, preloads by the preload bounds.

mod pusher;
mod reader;
pub(crate) mod reads;
mod ticket;
mod writer;

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::key::BlockKey;
use crate::sync::{level, spawn, Condvar, JoinHandle, Mutex};

use super::index::{Copy, Slot};
use super::Inner;

pub(crate) use ticket::Ticket;

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

/// A host slot reserved (Promoting, one pin held for the load that asked) to read a block into.
#[derive(Clone, Copy)]
pub(crate) struct Promote {
    pub key: BlockKey,
    pub slot: Slot,
    pub page: u32,
    pub cap: usize,
    pub len: u32,
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

/// A queue's state behind a lock of its own (a leaf of the lock order), and the condition
/// variable its thread waits on.
pub(crate) struct Queue<S> {
    q: Mutex<S>,
    cv: Condvar,
}

impl<S: Default> Queue<S> {
    fn new(name: &'static str) -> Self {
        Self {
            q: Mutex::new(level::LEAF, name, S::default()),
            cv: Condvar::default(),
        }
    }
}

/// The worker's queues, each owned by its thread(s).
#[derive(Default)]
pub(crate) struct Work {
    pub(crate) demote: writer::Demotions,
    pub(crate) push: pusher::Pushes,
    pub(crate) reads: reads::Reads,
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
        let (demote_blocks, demote_bytes) = self.demote.depth();
        let (promote_jobs, prefetch_jobs, prefetch_bytes) = self.reads.depth();
        Depths {
            demote_blocks,
            demote_bytes,
            promote_jobs,
            prefetch_jobs,
            prefetch_bytes,
            push_bytes: self.push.bytes(),
        }
    }
}

impl Inner {
    /// Faults the arena in segment by segment, handing each to the allocator when ready.
    fn populate_loop(&self) {
        let seg_bytes = self.seg_pages as usize * super::PAGE;
        let start = Instant::now();
        let mut next_log = 0.1;
        for seg in 0..self.n_segments {
            if self.work.demote.stopped() {
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
        // Retained blocks are written whatever admission says: a retention outlives a restart
        // only for the blocks on disk.
        let retained = self.retained_keys();
        for s in self.shards.iter() {
            let mut queue = Vec::new();
            {
                let mut sh = s.lock();
                let super::index::Shard { map, pins } = &mut *sh;
                for (k, mut e) in map.iter_mut() {
                    let key = BlockKey::from(k);
                    if e.ready()
                        && e.copy() == Copy::Dirty
                        && (retained.contains_key(&k) || self.admitted(key, e.accessed()))
                        && pins.add(&mut e).is_ok()
                    {
                        e.set_copy(Copy::Demoting);
                        tracing::trace!(%key, "flush: queued");
                        queue.push((key, e.slot(), e.ns));
                    }
                }
            }
            let demote = queue
                .into_iter()
                .map(|(key, slot, ns)| {
                    // Pinned for the writer: its slot and length stay.
                    let (page, len) = {
                        let c = self.classes[slot.class as usize].lock();
                        (
                            c.page_of(slot.idx, self.seg_pages),
                            c.lens[slot.idx as usize],
                        )
                    };
                    Demote {
                        key,
                        slot,
                        page,
                        cap: self.class_sizes[slot.class as usize],
                        len,
                        ns,
                    }
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
            if !self.work.demote.pending() {
                return true;
            }
            if self.work.demote.stopped() || Instant::now() >= until {
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
    handles: Vec<JoinHandle>,
}

impl Threads {
    pub(crate) fn start(inner: &Arc<Inner>, populate: bool) -> std::io::Result<Self> {
        let mut handles = Vec::new();
        let spawn_fn = |name: String, f: fn(&Inner)| {
            let i = inner.clone();
            spawn(name, move || f(&i))
        };
        if !inner.tiers.is_empty() {
            handles.push(spawn_fn("kvtier-writer".into(), Inner::writer_loop)?);
        }
        // One reader per lower tier: a remote peer that times out holds up only its own reads.
        for t in 0..inner.tiers.len() {
            let i = inner.clone();
            handles.push(spawn(format!("kvtier-reader-{t}"), move || {
                i.reader_loop(t)
            })?);
        }
        if inner.push_to.is_some() {
            handles.push(spawn_fn("kvtier-pusher".into(), Inner::pusher_loop)?);
        }
        if populate {
            handles.push(spawn_fn("kvtier-populate".into(), Inner::populate_loop)?);
        }
        Ok(Self { handles })
    }

    /// Stops the threads: queued demotions are written first (the writer drains its queue),
    /// queued promotions fail.
    pub(crate) fn stop(&mut self, inner: &Inner) {
        inner.work.demote.stop();
        inner.work.reads.stop();
        inner.work.push.stop();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
        // Promotions nobody will read: fail them so their slots come back.
        for job in inner.work.reads.drain() {
            let ok = inner.finish_promotions(&job.items, &[], None);
            job.ticket.complete(ok);
        }
    }
}
