//! io_uring engine: one dedicated thread owns the ring, keeps up to `queue_depth` requests in
//! flight, submits in batches, retries short transfers and EINTR/EAGAIN, and uses registered
//! files and (when the buffer lies in a registered region) fixed buffers.

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use io_uring::{opcode, types, IoUring};

use super::{check, IoConfig, IoDone, IoEngine, IoKind, IoReq};

type Batch = (Vec<IoReq>, Sender<IoDone>);

/// What the ring's thread is asked to do.
enum Msg {
    Batch(Batch),
    /// Register these regions as fixed buffers (once; later requests inside them use
    /// READ_FIXED / WRITE_FIXED).
    Register(Vec<(usize, usize)>),
}

/// Splits regions into iovecs of at most 1 GiB each (the kernel's limit per fixed buffer).
fn split_regions(regions: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for &(start, len) in regions {
        let mut off = 0;
        while off < len {
            let l = (len - off).min(1 << 30);
            out.push((start + off, l));
            off += l;
        }
    }
    out
}

/// Registers regions as the ring's fixed buffers; the regions registered (none on failure).
fn register(ring: &IoUring, regions: &[(usize, usize)]) -> Vec<(usize, usize)> {
    register_once(ring, &split_regions(regions), true)
}

/// [`register`] of regions already split; with `retry`, a failure tries once more without the
/// last one.
fn register_once(ring: &IoUring, regions: &[(usize, usize)], retry: bool) -> Vec<(usize, usize)> {
    let iovecs: Vec<libc::iovec> = regions
        .iter()
        .map(|&(s, l)| libc::iovec {
            iov_base: s as *mut libc::c_void,
            iov_len: l,
        })
        .collect();
    if iovecs.is_empty() || iovecs.len() > u16::MAX as usize {
        return Vec::new();
    }
    let start = std::time::Instant::now();
    // SAFETY: the regions are memory the caller keeps mapped for the engine's life (the host
    // arena, which outlives the store's engine: `IoEngine::register_buffers`'s contract).
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => {
            tracing::info!(
                regions = regions.len(),
                secs = format!("{:.2}", start.elapsed().as_secs_f64()),
                "io_uring: fixed buffers registered (host arena, bounce buffers)"
            );
            regions.to_vec()
        }
        Err(e) if retry && regions.len() > 1 => {
            // The last region is the least needed (the disk tier's bounce buffers go last):
            // without it the arena may still fit under RLIMIT_MEMLOCK. Once.
            tracing::warn!(error = %e, "io_uring: fixed buffers not registered; trying again without the last region");
            register_once(ring, &regions[..regions.len() - 1], false)
        }
        Err(e) => {
            tracing::warn!(error = %e, "io_uring: fixed buffers not registered (RLIMIT_MEMLOCK?); using plain reads/writes");
            Vec::new()
        }
    }
}

/// The io_uring engine.
pub struct UringEngine {
    tx: Option<Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    qd: u32,
}

impl UringEngine {
    /// Sets up a ring (fails if the kernel refuses io_uring) and starts its thread.
    pub fn new(files: Vec<File>, qd: u32, cfg: &IoConfig) -> io::Result<Self> {
        let entries = qd.next_power_of_two().max(8);
        let mut builder = IoUring::builder();
        if cfg.sqpoll {
            builder.setup_sqpoll(1000);
        }
        let ring = builder.build(entries)?;
        let fds: Vec<i32> = files.iter().map(|f| f.as_raw_fd()).collect();
        ring.submitter().register_files(&fds)?;
        // Registering pins (and faults in) the regions: with `defer_fixed_buffers` that is
        // left for `register_buffers`, later, on the ring's own thread.
        let fixed = if cfg.defer_fixed_buffers {
            Vec::new()
        } else {
            register(&ring, &cfg.fixed_buffers)
        };
        let (tx, rx) = crossbeam_channel::unbounded::<Msg>();
        let thread = std::thread::Builder::new()
            .name("kvtier-uring".into())
            .spawn(move || Worker::new(ring, files, fixed, qd).run(rx))?;
        tracing::info!(queue_depth = qd, sqpoll = cfg.sqpoll, "io engine: io_uring");
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            qd,
        })
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn queue_depth(&self) -> u32 {
        self.qd
    }

    fn submit(&self, reqs: Vec<IoReq>, done: Sender<IoDone>) {
        if let Some(tx) = &self.tx {
            if let Err(crossbeam_channel::SendError(Msg::Batch((reqs, done)))) =
                tx.send(Msg::Batch((reqs, done)))
            {
                for req in reqs {
                    let _ = done.send(IoDone {
                        req,
                        result: Err(io::Error::other("io_uring engine stopped")),
                    });
                }
            }
        }
    }

    fn register_buffers(&self, regions: Vec<(usize, usize)>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Register(regions));
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Flight {
    req: IoReq,
    done: Sender<IoDone>,
    /// Bytes transferred so far.
    moved: u32,
}

struct Worker {
    ring: IoUring,
    /// Kept open for the ring's registered file table.
    _files: Vec<File>,
    nfiles: usize,
    fixed: Vec<(usize, usize)>,
    qd: usize,
    slots: Vec<Option<Flight>>,
    free: Vec<usize>,
    pending: VecDeque<(IoReq, Sender<IoDone>)>,
    again: Vec<usize>,
}

impl Worker {
    fn new(ring: IoUring, files: Vec<File>, fixed: Vec<(usize, usize)>, qd: u32) -> Self {
        let qd = qd as usize;
        Self {
            ring,
            nfiles: files.len(),
            _files: files,
            fixed,
            qd,
            slots: (0..qd).map(|_| None).collect(),
            free: (0..qd).rev().collect(),
            pending: VecDeque::new(),
            again: Vec::new(),
        }
    }

    fn inflight(&self) -> usize {
        self.qd - self.free.len()
    }

    fn take(&mut self, m: Msg) {
        match m {
            Msg::Batch(b) => self.take_batch(b),
            Msg::Register(regions) => {
                if self.fixed.is_empty() {
                    // Requests in flight keep using plain reads/writes until they complete;
                    // the kernel quiesces the ring for the registration.
                    self.fixed = register(&self.ring, &regions);
                }
            }
        }
    }

    fn take_batch(&mut self, (reqs, done): Batch) {
        for req in reqs {
            if let Err(e) = check(&req, self.nfiles) {
                let _ = done.send(IoDone {
                    req,
                    result: Err(e),
                });
            } else {
                self.pending.push_back((req, done.clone()));
            }
        }
    }

    fn run(mut self, rx: Receiver<Msg>) {
        let mut open = true;
        loop {
            if self.inflight() == 0 && self.pending.is_empty() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(m) => self.take(m),
                    Err(_) => return,
                }
            }
            while open {
                match rx.try_recv() {
                    Ok(m) => self.take(m),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            self.fill();
            let want = usize::from(self.inflight() > 0);
            if let Err(e) = self.ring.submit_and_wait(want) {
                match e.raw_os_error() {
                    // Interrupted, or a transient shortage (EBUSY: the completion queue is full;
                    // EAGAIN: no kernel resources now): reap what completed and go again.
                    Some(libc::EINTR) => {}
                    Some(libc::EBUSY) | Some(libc::EAGAIN) => {
                        std::thread::sleep(std::time::Duration::from_micros(100));
                    }
                    _ => {
                        tracing::error!(error = %e, "io_uring submit failed: failing the requests");
                        self.fail_all(&e);
                        continue;
                    }
                }
            }
            self.reap();
        }
    }

    /// Pushes SQEs for retries, then for new requests, while slots are free.
    fn fill(&mut self) {
        while let Some(slot) = self.again.pop() {
            if !self.push(slot) {
                self.again.push(slot);
                return;
            }
        }
        while !self.free.is_empty() {
            let Some((req, done)) = self.pending.pop_front() else {
                break;
            };
            let Some(slot) = self.free.pop() else { break };
            self.slots[slot] = Some(Flight {
                req,
                done,
                moved: 0,
            });
            if !self.push(slot) {
                self.again.push(slot);
                return;
            }
        }
    }

    fn fixed_index(&self, addr: usize, len: usize) -> Option<u16> {
        self.fixed
            .iter()
            .position(|&(s, l)| addr >= s && addr + len <= s + l)
            .map(|i| i as u16)
    }

    /// Builds and pushes the SQE for `slot`'s remaining bytes; false if the SQ is full.
    fn push(&mut self, slot: usize) -> bool {
        let Some(f) = self.slots[slot].as_ref() else {
            return true;
        };
        let moved = f.moved as usize;
        // SAFETY: `moved < len <= cap`, so the address stays inside the request's buffer.
        let addr = unsafe { f.req.buf.as_ptr().add(moved) };
        let len = f.req.len - f.moved;
        let off = f.req.offset + moved as u64;
        let fd = types::Fixed(f.req.file);
        let fixed = self.fixed_index(addr as usize, len as usize);
        let sqe = match (f.req.kind, fixed) {
            (IoKind::Read, Some(i)) => opcode::ReadFixed::new(fd, addr, len, i).offset(off).build(),
            (IoKind::Write, Some(i)) => opcode::WriteFixed::new(fd, addr, len, i)
                .offset(off)
                .build(),
            (IoKind::Read, None) => opcode::Read::new(fd, addr, len).offset(off).build(),
            (IoKind::Write, None) => opcode::Write::new(fd, addr, len).offset(off).build(),
        }
        .user_data(slot as u64);
        // SAFETY: the buffer stays owned by the Flight in `slots[slot]` (and so alive and
        // untouched by anyone else) until its completion is reaped; the fd is registered.
        unsafe { self.ring.submission().push(&sqe).is_ok() }
    }

    fn reap(&mut self) {
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in cqes {
            let slot = ud as usize;
            let Some(f) = self.slots.get_mut(slot).and_then(|s| s.as_mut()) else {
                continue;
            };
            if res == -libc::EINTR || res == -libc::EAGAIN {
                self.again.push(slot);
                continue;
            }
            let result = if res < 0 {
                Err(io::Error::from_raw_os_error(-res))
            } else if res == 0 {
                Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "{:?} made no progress at offset {}",
                        f.req.kind,
                        f.req.offset + u64::from(f.moved)
                    ),
                ))
            } else {
                f.moved += res as u32;
                if f.moved < f.req.len {
                    self.again.push(slot);
                    continue;
                }
                Ok(())
            };
            self.complete(slot, result);
        }
    }

    fn complete(&mut self, slot: usize, result: io::Result<()>) {
        if let Some(f) = self.slots[slot].take() {
            self.free.push(slot);
            let _ = f.done.send(IoDone { req: f.req, result });
        }
    }

    fn fail_all(&mut self, e: &io::Error) {
        // Wait for the kernel to finish with every buffer before handing them back: handing
        // back a buffer the kernel may still write would be unsound, so never give up here.
        let mut tries = 0u64;
        while self.inflight() > self.again.len() {
            if let Err(err) = self.ring.submit_and_wait(1) {
                tries += 1;
                if tries % 1000 == 1 {
                    tracing::error!(error = %err, in_flight = self.inflight(), "io_uring: still waiting for the kernel to finish in-flight requests");
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            let cqes: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for ud in cqes {
                self.complete(ud as usize, Err(io::Error::new(e.kind(), e.to_string())));
            }
        }
        for slot in std::mem::take(&mut self.again) {
            self.complete(slot, Err(io::Error::new(e.kind(), e.to_string())));
        }
    }
}
