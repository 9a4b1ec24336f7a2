//! A fault-injecting engine for tests: wraps a real engine and, as its [`FaultPlan`] says, fails
//! requests, tears or shortens writes, corrupts reads and delays completions.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::{IoDone, IoEngine, IoKind, IoReq, ALIGN};

/// What to inject. Counters are consumed one per matching request.
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    /// Fail this many writes outright with `errno` (nothing written).
    pub fail_writes: u32,
    /// Fail this many reads outright with `errno`.
    pub fail_reads: u32,
    /// errno for outright failures (0 means EIO).
    pub errno: i32,
    /// Write only the first half of this many writes and report success (a torn write).
    pub torn_writes: u32,
    /// Write only the first half of this many writes and report ENOSPC (a partial write).
    pub short_writes: u32,
    /// Flip a byte in the data of this many successful reads.
    pub corrupt_reads: u32,
    /// Drop this many reads unanswered, as an engine whose thread died would: no completion,
    /// the sender gone (never submitted below, so no memory is in the kernel's hands).
    pub lose_reads: u32,
    /// Delay every completion by this much.
    pub delay: Duration,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Pass,
    Lose,
    Torn,
    Short,
    Corrupt,
}

/// The fault-injecting wrapper.
pub struct FaultEngine {
    inner: Arc<dyn IoEngine>,
    plan: Mutex<FaultPlan>,
    next: AtomicU64,
    injected: AtomicU64,
}

impl FaultEngine {
    /// Wraps `inner` with an empty plan.
    pub fn new(inner: Arc<dyn IoEngine>) -> Self {
        Self {
            inner,
            plan: Mutex::new(FaultPlan::default()),
            next: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        }
    }

    /// Replaces the plan.
    pub fn set_plan(&self, plan: FaultPlan) {
        *self.plan.lock() = plan;
    }

    /// Faults injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Relaxed)
    }

    fn decide(&self, kind: IoKind) -> (Option<i32>, Action, Duration) {
        let mut p = self.plan.lock();
        let errno = if p.errno == 0 { libc::EIO } else { p.errno };
        let take = |c: &mut u32| {
            if *c > 0 {
                *c -= 1;
                true
            } else {
                false
            }
        };
        let r = match kind {
            IoKind::Write if take(&mut p.fail_writes) => (Some(errno), Action::Pass),
            IoKind::Read if take(&mut p.fail_reads) => (Some(errno), Action::Pass),
            IoKind::Write if take(&mut p.torn_writes) => (None, Action::Torn),
            IoKind::Write if take(&mut p.short_writes) => (None, Action::Short),
            IoKind::Read if take(&mut p.corrupt_reads) => (None, Action::Corrupt),
            IoKind::Read if take(&mut p.lose_reads) => (None, Action::Lose),
            _ => (None, Action::Pass),
        };
        if r.0.is_some() || r.1 != Action::Pass || !p.delay.is_zero() {
            self.injected.fetch_add(1, Relaxed);
        }
        (r.0, r.1, p.delay)
    }
}

impl IoEngine for FaultEngine {
    fn name(&self) -> &'static str {
        "fault"
    }

    fn queue_depth(&self) -> u32 {
        self.inner.queue_depth()
    }

    fn register_buffers(&self, regions: Vec<(usize, usize)>) {
        self.inner.register_buffers(regions);
    }

    fn submit(&self, reqs: Vec<IoReq>, done: Sender<IoDone>) {
        let mut forward = Vec::new();
        let mut memo: HashMap<u64, (u64, u32, Action)> = HashMap::new();
        let mut delay = Duration::ZERO;
        for mut req in reqs {
            let (fail, action, d) = self.decide(req.kind);
            delay = d;
            if let Some(errno) = fail {
                std::thread::sleep(d);
                let _ = done.send(IoDone {
                    req,
                    result: Err(io::Error::from_raw_os_error(errno)),
                });
                continue;
            }
            if action == Action::Lose {
                continue;
            }
            let id = self.next.fetch_add(1, Relaxed);
            memo.insert(id, (req.tag, req.len, action));
            req.tag = id;
            if matches!(action, Action::Torn | Action::Short) {
                req.len = ((req.len / 2) as usize / ALIGN * ALIGN) as u32;
            }
            forward.push(req);
        }
        if forward.is_empty() {
            return;
        }
        // Zero-length halves (one-page writes) are not sent: nothing of them reaches the disk.
        let (empty, forward): (Vec<IoReq>, Vec<IoReq>) =
            forward.into_iter().partition(|r| r.len == 0);
        let (tx, rx) = crossbeam_channel::unbounded::<IoDone>();
        for r in empty {
            let _ = tx.send(IoDone {
                req: r,
                result: Ok(()),
            });
        }
        self.inner.submit(forward, tx);
        let total = memo.len();
        std::thread::spawn(move || {
            for mut d in rx.iter().take(total) {
                std::thread::sleep(delay);
                let Some((tag, len, action)) = memo.remove(&d.req.tag) else {
                    continue;
                };
                d.req.tag = tag;
                d.req.len = len;
                if d.result.is_ok() {
                    match action {
                        Action::Short => {
                            d.result = Err(io::Error::from_raw_os_error(libc::ENOSPC));
                        }
                        Action::Corrupt => {
                            let mid = (len / 2) as usize;
                            // SAFETY: the read succeeded into this buffer, which holds `len`
                            // bytes and is still owned by the request.
                            unsafe { *d.req.buf.as_ptr().add(mid) ^= 0x5a };
                        }
                        Action::Pass | Action::Torn | Action::Lose => {}
                    }
                }
                let _ = done.send(d);
            }
        });
    }
}
