//! Portable engine: pread/pwrite on a pool of threads (as many as the queue depth, at most 16).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use super::{check, IoDone, IoEngine, IoKind, IoReq};

type Job = (IoReq, Sender<IoDone>);

/// The pread/pwrite engine.
pub struct PsyncEngine {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    nfiles: usize,
    qd: u32,
}

impl PsyncEngine {
    /// Starts the worker threads.
    pub fn new(files: Vec<File>, qd: u32) -> Self {
        let nfiles = files.len();
        let files = Arc::new(files);
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let threads = (0..qd.clamp(1, 16))
            .filter_map(|i| {
                let rx = rx.clone();
                let files = files.clone();
                std::thread::Builder::new()
                    .name(format!("kvtier-psync-{i}"))
                    .spawn(move || {
                        for (req, done) in rx {
                            let result = transfer(&files[req.file as usize], &req);
                            let _ = done.send(IoDone { req, result });
                        }
                    })
                    .ok()
            })
            .collect();
        tracing::info!(queue_depth = qd, "io engine: psync");
        Self {
            tx: Some(tx),
            threads,
            nfiles,
            qd,
        }
    }
}

fn transfer(file: &File, req: &IoReq) -> io::Result<()> {
    let len = req.len as usize;
    match req.kind {
        IoKind::Read => {
            // SAFETY: `check` verified len <= cap; the IoBuf's creator guarantees the memory is
            // valid and not used by anyone else until the request is handed back.
            let buf = unsafe { std::slice::from_raw_parts_mut(req.buf.as_ptr(), len) };
            let mut done = 0;
            while done < len {
                match file.read_at(&mut buf[done..], req.offset + done as u64) {
                    Ok(0) => {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "read made no progress at offset {}",
                                req.offset + done as u64
                            ),
                        ))
                    }
                    Ok(n) => done += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(())
        }
        IoKind::Write => {
            // SAFETY: as above; the memory is only read.
            let buf = unsafe { std::slice::from_raw_parts(req.buf.as_ptr(), len) };
            file.write_all_at(buf, req.offset)
        }
    }
}

impl IoEngine for PsyncEngine {
    fn name(&self) -> &'static str {
        "psync"
    }

    fn queue_depth(&self) -> u32 {
        self.qd
    }

    fn submit(&self, reqs: Vec<IoReq>, done: Sender<IoDone>) {
        for req in reqs {
            if let Err(e) = check(&req, self.nfiles) {
                let _ = done.send(IoDone {
                    req,
                    result: Err(e),
                });
                continue;
            }
            match &self.tx {
                Some(tx) => {
                    if let Err(crossbeam_channel::SendError((req, done))) =
                        tx.send((req, done.clone()))
                    {
                        let _ = done.send(IoDone {
                            req,
                            result: Err(io::Error::other("psync engine stopped")),
                        });
                    }
                }
                None => {
                    let _ = done.send(IoDone {
                        req,
                        result: Err(io::Error::other("psync engine stopped")),
                    });
                }
            }
        }
    }
}

impl Drop for PsyncEngine {
    fn drop(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
