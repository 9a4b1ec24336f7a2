//! Logging that never stops the daemon: events are formatted on the thread that logs them and
//! handed to a writer thread through a bounded queue. A full queue (a stalled reader of stderr)
//! or a failed write (stderr a closed pipe, the log on a full file system) drops the line and
//! counts it; nothing panics, nothing on a request path blocks on the log.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crossbeam_channel::{Sender, TrySendError};

/// Lines queued for the writer thread at most.
const QUEUE: usize = 16 * 1024;

/// Lines dropped (queue full or write failed).
#[derive(Default)]
pub struct LogStats {
    /// Lines dropped because the queue was full.
    pub dropped_full: AtomicU64,
    /// Lines whose write failed.
    pub dropped_errors: AtomicU64,
}

/// A `MakeWriter` handing each formatted event to the writer thread.
#[derive(Clone)]
pub struct NonBlocking {
    tx: Sender<Vec<u8>>,
    stats: Arc<LogStats>,
}

/// One event's bytes, sent when dropped.
pub struct Line {
    buf: Vec<u8>,
    tx: Sender<Vec<u8>>,
    stats: Arc<LogStats>,
}

impl Write for Line {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for Line {
    fn drop(&mut self) {
        if self.buf.is_empty() {
            return;
        }
        match self.tx.try_send(std::mem::take(&mut self.buf)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.stats.dropped_full.fetch_add(1, Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {
                self.stats.dropped_errors.fetch_add(1, Relaxed);
            }
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for NonBlocking {
    type Writer = Line;
    fn make_writer(&'a self) -> Line {
        Line {
            buf: Vec::with_capacity(256),
            tx: self.tx.clone(),
            stats: self.stats.clone(),
        }
    }
}

/// Starts the writer thread over `out`; returns the writer to give the subscriber and its
/// counters.
pub fn non_blocking(
    mut out: impl Write + Send + 'static,
) -> std::io::Result<(NonBlocking, Arc<LogStats>)> {
    let (tx, rx) = crossbeam_channel::bounded::<Vec<u8>>(QUEUE);
    let stats: Arc<LogStats> = Arc::default();
    let s = stats.clone();
    std::thread::Builder::new()
        .name("kvtierd-log".into())
        .spawn(move || {
            for line in rx {
                if out.write_all(&line).is_err() {
                    s.dropped_errors.fetch_add(1, Relaxed);
                }
            }
        })?;
    Ok((
        NonBlocking {
            tx,
            stats: stats.clone(),
        },
        stats,
    ))
}

/// Writes a line to stdout or stderr, ignoring failures (a closed pipe must not kill us).
pub fn say(mut to: impl Write, msg: &str) {
    let _ = writeln!(to, "{msg}");
    let _ = to.flush();
}
