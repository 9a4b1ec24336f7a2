//! A fault-injecting TCP proxy for tests between real processes (toxiproxy's idea, in-tree):
//! each connection is forwarded byte for byte until the proxy is told to stall it, cut it now,
//! cut it a number of bytes later, trickle its replies or read its requests slowly. A member
//! named by the proxy's address is reached only through it, so the fault sits on the link,
//! not in the code under test.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// What the proxy does to its links.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything.
    None,
    /// Accept connections and hold every link: nothing is forwarded either way, nothing is
    /// closed (a stalled peer, a black hole, a partition).
    Stall,
    /// Close every link now, and new ones at once (a dead peer, a broken link).
    Cut,
    /// Forward this many more bytes toward the upstream (over all links), then close the link
    /// that crossed it (a peer that dies mid-frame).
    CutAfter(u64),
    /// Forward toward the upstream as it comes, and back from it `bytes` at a time, one such
    /// piece per `every` (a peer that answers, slowly enough to hold a reader forever).
    Trickle { bytes: usize, every: Duration },
    /// Forward back from the upstream as it comes, and toward it `bytes` at a time, one such
    /// piece per `every` (a peer that reads what it is sent, slowly enough to hold a writer
    /// forever once the sockets' buffers are full).
    SlowReader { bytes: usize, every: Duration },
}

impl Fault {
    /// The pace of a paced fault in this direction (`upstream`: toward the proxied server).
    fn pace(self, upstream: bool) -> Option<(usize, Duration)> {
        match self {
            Fault::Trickle { bytes, every } if !upstream => Some((bytes.max(1), every)),
            Fault::SlowReader { bytes, every } if upstream => Some((bytes.max(1), every)),
            _ => None,
        }
    }
}

struct Shared {
    fault: Mutex<(Fault, Vec<TcpStream>)>,
    changed: Condvar,
}

/// The proxy: listening on `addr`, forwarding to its upstream.
pub struct Proxy {
    /// Where peers connect.
    pub addr: String,
    shared: Arc<Shared>,
}

impl Proxy {
    /// A proxy on a fresh loopback port in front of `upstream`.
    pub fn start(upstream: String) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let shared = Arc::new(Shared {
            fault: Mutex::new((Fault::None, Vec::new())),
            changed: Condvar::new(),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            for down in l.incoming() {
                let Ok(down) = down else { continue };
                if sh.fault.lock().unwrap().0 == Fault::Cut {
                    continue;
                }
                let Ok(up) = TcpStream::connect(&upstream) else {
                    continue;
                };
                {
                    let mut g = sh.fault.lock().unwrap();
                    g.1.push(down.try_clone().unwrap());
                    g.1.push(up.try_clone().unwrap());
                }
                let (d2, u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
                let (s1, s2) = (sh.clone(), sh.clone());
                std::thread::spawn(move || pump(down, up, &s1, true));
                std::thread::spawn(move || pump(u2, d2, &s2, false));
            }
        });
        Self { addr, shared }
    }

    /// A member that accepts connections and never answers (nor closes them): no upstream.
    pub fn black_hole() -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let shared = Arc::new(Shared {
            fault: Mutex::new((Fault::Stall, Vec::new())),
            changed: Condvar::new(),
        });
        let sh = shared.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let mut g = sh.fault.lock().unwrap();
                if g.0 == Fault::Cut {
                    return;
                }
                g.1.push(s);
            }
        });
        Self { addr, shared }
    }

    /// Applies `f` from now on (to open links too).
    pub fn set(&self, f: Fault) {
        let mut g = self.shared.fault.lock().unwrap();
        g.0 = f;
        if f == Fault::Cut {
            for s in g.1.drain(..) {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        self.shared.changed.notify_all();
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.set(Fault::Cut);
    }
}

/// Forwards `from` to `to` under the proxy's fault; `upstream`: toward the proxied server.
fn pump(mut from: TcpStream, mut to: TcpStream, sh: &Shared, upstream: bool) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let allow = {
            let mut g = sh.fault.lock().unwrap();
            while g.0 == Fault::Stall {
                g = sh.changed.wait(g).unwrap();
            }
            match g.0 {
                Fault::Cut => 0,
                Fault::CutAfter(left) if upstream => {
                    let k = left.min(n as u64);
                    g.0 = Fault::CutAfter(left - k);
                    k as usize
                }
                _ => n,
            }
        };
        if let Some(sent) = trickle(&mut to, &buf[..allow], sh, upstream) {
            if sent < allow {
                break;
            }
            continue;
        }
        if to.write_all(&buf[..allow]).is_err() || allow < n {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
    let _ = from.shutdown(Shutdown::Both);
}

/// Under a fault paced in this direction ([`Fault::Trickle`] back from the upstream,
/// [`Fault::SlowReader`] toward it), writes `data` to `to` a piece at a time, one piece per
/// tick (the wait ends early when the fault changes), and returns how much it wrote; `None`
/// when the fault is not paced this way.
fn trickle(to: &mut TcpStream, data: &[u8], sh: &Shared, upstream: bool) -> Option<usize> {
    let mut at = 0;
    let mut g = sh.fault.lock().unwrap();
    g.0.pace(upstream)?;
    while at < data.len() {
        let (bytes, every) = match (g.0.pace(upstream), g.0) {
            (Some(p), _) => p,
            (None, Fault::Cut) => return Some(at),
            (None, Fault::Stall) => {
                g = sh.changed.wait(g).unwrap();
                continue;
            }
            (None, _) => (data.len() - at, Duration::ZERO),
        };
        let n = bytes.min(data.len() - at);
        drop(g);
        if to.write_all(&data[at..at + n]).is_err() {
            return Some(at);
        }
        at += n;
        g = sh.fault.lock().unwrap();
        if at < data.len() && !every.is_zero() {
            // The pace of the fault, not a wait for a condition: a change of fault ends it.
            g = sh.changed.wait_timeout(g, every).unwrap().0;
        }
    }
    Some(at)
}
