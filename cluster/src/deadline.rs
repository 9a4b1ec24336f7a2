//! Deadlines over a whole exchange on a blocking socket, and host names resolved by one: what
//! the remote tier (kvtierd peers) and the Redis tier share. A socket timeout bounds one
//! `read` or `write`; a peer that paces its bytes could stretch an exchange of many without
//! end, so every read and write of an exchange goes through one [`Deadlined`].

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// How far past its deadline a [`Deadlined`] read or write may end: its socket timeout is set
/// again once this much time has passed since it was last set.
const DEADLINE_SLACK: Duration = Duration::from_millis(5);

/// A stream read and written within a deadline, however the peer paces its bytes: a socket
/// timeout set once bounds each `read` or `write`, not their sum, so a peer that trickles a
/// header or a payload a few bytes at a time (or reads ours that way) could stretch it
/// without end. Each call fails once the deadline has passed, and the socket's timeout for
/// that direction is set again to what is left whenever more than [`DEADLINE_SLACK`] has
/// passed since it was set: no call ends more than that past the deadline, and a transfer
/// that runs at speed sets it about once (a `setsockopt` per call would cost a 2 MiB block
/// dozens of system calls).
pub(crate) struct Deadlined<'a> {
    s: &'a TcpStream,
    deadline: Instant,
    /// When the read timeout was last set (to what was left of the deadline then)…
    read_set: Option<Instant>,
    /// …and the write timeout.
    write_set: Option<Instant>,
}

impl<'a> Deadlined<'a> {
    pub(crate) fn new(s: &'a TcpStream, deadline: Instant) -> Self {
        Deadlined {
            s,
            deadline,
            read_set: None,
            write_set: None,
        }
    }

    /// What is left of the deadline, and whether the timeout last set at `set` is due to be
    /// set again (then `set` becomes now).
    fn due(deadline: Instant, set: &mut Option<Instant>) -> io::Result<Option<Duration>> {
        let left = remaining(deadline)?;
        let now = Instant::now();
        if set.is_none_or(|t| now.duration_since(t) > DEADLINE_SLACK) {
            *set = Some(now);
            return Ok(Some(left));
        }
        Ok(None)
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(left) = Self::due(self.deadline, &mut self.read_set)? {
            self.s.set_read_timeout(Some(left))?;
        }
        (&mut &*self.s).read(buf)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if let Some(left) = Self::due(self.deadline, &mut self.write_set)? {
            self.s.set_write_timeout(Some(left))?;
        }
        (&mut &*self.s).write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        (&mut &*self.s).flush()
    }
}

/// Every address `addr` (`host:port`) names, in the resolver's order (never empty), by
/// `deadline`: an IP address at once; a host name on a thread of its own, left behind if it
/// is late (`getaddrinfo` takes no timeout, and waits out an unreachable DNS server for
/// seconds a try).
pub(crate) fn resolve_all(addr: &str, deadline: Instant) -> io::Result<Vec<SocketAddr>> {
    resolve_with(addr, deadline, |a| a.to_socket_addrs().map(|i| i.collect()))
}

/// Name lookups that may wait on the resolver at once, process-wide. A thread left behind by
/// [`resolve_all`] lives until `getaddrinfo` gives up (seconds a try against an unreachable
/// DNS server); while the resolver hangs, each new connection to a named peer or Redis
/// server would leave one more. Past this many, a lookup fails at once instead, with a
/// timeout (a miss for the call, as the lookup's own timeout would have been).
const MAX_RESOLVING: usize = 32;

/// Lookups on their own threads now ([`MAX_RESOLVING`]).
static RESOLVING: AtomicUsize = AtomicUsize::new(0);

/// [`resolve_all`] with `lookup` for the resolver.
pub(crate) fn resolve_with(
    addr: &str,
    deadline: Instant,
    lookup: impl FnOnce(&str) -> io::Result<Vec<SocketAddr>> + Send + 'static,
) -> io::Result<Vec<SocketAddr>> {
    resolve_in(addr, deadline, lookup, &RESOLVING, MAX_RESOLVING)
}

/// [`resolve_with`], counting the lookups on their own threads in `resolving`, at most `max`.
fn resolve_in(
    addr: &str,
    deadline: Instant,
    lookup: impl FnOnce(&str) -> io::Result<Vec<SocketAddr>> + Send + 'static,
    resolving: &'static AtomicUsize,
    max: usize,
) -> io::Result<Vec<SocketAddr>> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let left = remaining(deadline)?;
    if resolving
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < max).then_some(n + 1)
        })
        .is_err()
    {
        // A timeout, as the lookup would have ended: a caller that leaves a timed-out peer
        // to a background probe (`RemoteTier::usable_now`) does so here too, rather than
        // doubling a healthy peer's pause because the resolver hangs.
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("resolving {addr}: {max} name lookups already wait on the resolver"),
        ));
    }
    /// Gives the lookup's place back when its thread ends (or was never started).
    struct Slot(&'static AtomicUsize);
    impl Drop for Slot {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::AcqRel);
        }
    }
    let slot = Slot(resolving);
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let name = addr.to_string();
    std::thread::Builder::new()
        .name("kvtier-resolve".into())
        .spawn(move || {
            let _slot = slot;
            let _ = tx.send(lookup(&name));
        })?;
    let found = match rx.recv_timeout(left) {
        Ok(r) => r?,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("resolving {addr}: cluster.timeout_ms passed"),
            ))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            return Err(io::Error::other(format!(
                "resolving {addr}: the resolver failed"
            )))
        }
    };
    if found.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{addr}: no address"),
        ));
    }
    Ok(found)
}

/// A connection to the first of `addrs` that takes one, in order (`localhost` may resolve to
/// `::1` first while the server listens on 127.0.0.1 only), by `deadline`.
pub(crate) fn connect_any(addrs: &[SocketAddr], deadline: Instant) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for a in addrs {
        match TcpStream::connect_timeout(a, remaining(deadline)?) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

pub(crate) fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "cluster.timeout_ms passed",
        ))
    } else {
        Ok(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resolver_that_never_answers_costs_the_deadline_only() {
        // The resolver blocks until the test ends (its sender is dropped then).
        let (hold, wait) = std::sync::mpsc::channel::<()>();
        let deadline = Instant::now() + Duration::from_millis(200);
        // On a thread of its own, waited for with a deadline: a regression fails, not hangs.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(resolve_with(
                "kv-7.cluster.invalid:7070",
                deadline,
                move |_| {
                    let _ = wait.recv();
                    Ok(Vec::new())
                },
            ));
        });
        let e = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("resolve_with did not return by its deadline")
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("kv-7.cluster.invalid:7070"), "{e}");
        drop(hold);
    }

    #[test]
    fn lookups_left_waiting_on_the_resolver_are_bounded() {
        use std::sync::{mpsc, Arc, Mutex};
        // A counter of this test's own: other tests resolve names meanwhile.
        static RESOLVING: AtomicUsize = AtomicUsize::new(0);
        let deadline = Instant::now() + Duration::from_secs(30);
        let (hold, wait) = mpsc::channel::<()>();
        let wait = Arc::new(Mutex::new(wait));
        let (started_tx, started) = mpsc::channel();
        // Three lookups that hang on the resolver, each asked on a thread of its own…
        let callers: Vec<_> = (0..3)
            .map(|i| {
                let (wait, started_tx) = (wait.clone(), started_tx.clone());
                std::thread::spawn(move || {
                    let hung = move |_: &str| {
                        let _ = started_tx.send(());
                        // Blocks until the test lets go (its sender is dropped then).
                        let _ = wait.lock().map(|w| w.recv());
                        Ok(Vec::new())
                    };
                    resolve_in(&format!("kv-{i}.invalid:1"), deadline, hung, &RESOLVING, 3)
                })
            })
            .collect();
        for _ in 0..3 {
            let left = deadline.saturating_duration_since(Instant::now());
            started.recv_timeout(left).expect("a lookup never started");
        }
        assert_eq!(RESOLVING.load(Ordering::Acquire), 3);
        // …so a fourth fails at once, as a timeout, with no thread started.
        let e = resolve_in(
            "kv-3.invalid:1",
            deadline,
            |_| unreachable!(),
            &RESOLVING,
            3,
        )
        .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("3 name lookups already wait"), "{e}");
        // An address needs no lookup, and still resolves.
        let a = resolve_in("127.0.0.1:1", deadline, |_| unreachable!(), &RESOLVING, 3).unwrap();
        assert_eq!(a, vec!["127.0.0.1:1".parse().unwrap()]);
        // Once the resolver answers (no address), the callers have their answers…
        drop(hold);
        for c in callers {
            let e = c.join().expect("a caller panicked").unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        }
        // …and the places come back as the lookups' threads end, just after.
        let settled = || {
            while RESOLVING.load(Ordering::Acquire) > 0 {
                assert!(
                    Instant::now() < deadline,
                    "the lookups' places never came back"
                );
                std::thread::yield_now();
            }
        };
        settled();
        let local = "127.0.0.1:7".parse().unwrap();
        let a = resolve_in(
            "kv-4.invalid:7",
            deadline,
            move |_| Ok(vec![local]),
            &RESOLVING,
            3,
        );
        assert_eq!(a.unwrap(), vec![local]);
        settled();
    }

    #[test]
    fn every_address_is_tried_in_order() {
        let good = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        // A port nobody listens on any more: refused.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let s = connect_any(&[closed, good.local_addr().unwrap()], deadline).unwrap();
        assert_eq!(s.peer_addr().unwrap(), good.local_addr().unwrap());
        let e = connect_any(&[closed], deadline).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
    }

    #[test]
    fn names_and_addresses_resolve() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let a = resolve_all("127.0.0.1:7070", deadline).unwrap()[0];
        assert_eq!(a, "127.0.0.1:7070".parse().unwrap());
        let a = resolve_all("localhost:7070", deadline).unwrap()[0];
        assert!(a.ip().is_loopback() && a.port() == 7070, "{a}");
        let e = resolve_with("nowhere:1", deadline, |_| Ok(Vec::new())).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound, "{e}");
        let e =
            resolve_with("nowhere:1", deadline, |_| Err(io::Error::other("NXDOMAIN"))).unwrap_err();
        assert!(e.to_string().contains("NXDOMAIN"), "{e}");
    }
}
