//! The admin gRPC and metrics listeners' connections: how many at once (in all, and per
//! address), and a deadline for a connection's first byte, so that idle or half-open
//! connections can neither exhaust the daemon's file descriptors nor hold every slot.
//!
//! A connection past either cap is closed at accept (counted). A connection that has not sent
//! its listener's [`Limits::preface`] bytes within [`FIRST_BYTE`] (the 24 bytes of HTTP/2's
//! preface: h2 waits for them with no deadline, and keepalive pings start only after) is
//! closed (counted). A write that makes no progress for [`WRITE_STALL`] (a peer that stopped
//! reading a response) fails, and the connection goes (counted). What comes after the preface
//! is the servers': hyper's header deadline on the metrics listener, HTTP/2 keepalive pings
//! on the admin one (a peer that answers none is dropped).

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// Longest a new connection may take to send its preface.
pub const FIRST_BYTE: Duration = Duration::from_secs(10);
/// Longest a write may wait for the peer to read.
pub const WRITE_STALL: Duration = Duration::from_secs(30);

/// Caps of one listener.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections at once.
    pub total: usize,
    /// Connections at once from one address.
    pub per_address: usize,
    /// Bytes a new connection must send within [`FIRST_BYTE`] ([`Gate::admit`]).
    pub preface: usize,
}

/// Counters of one listener.
#[derive(Default)]
pub struct ConnStats {
    /// Connections closed at accept: a cap was reached.
    pub refused: AtomicU64,
    /// Connections closed because they sent no preface within [`FIRST_BYTE`].
    pub silent: AtomicU64,
    /// Connections closed because a write waited [`WRITE_STALL`] for the peer.
    pub stalled: AtomicU64,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_address: HashMap<IpAddr, usize>,
}

/// Admits connections to one listener within its [`Limits`].
pub struct Gate {
    limits: Limits,
    counts: Mutex<Counts>,
    /// Its counters.
    pub stats: Arc<ConnStats>,
    /// What the listener is, for the log.
    what: &'static str,
}

impl Gate {
    pub fn new(what: &'static str, limits: Limits, stats: Arc<ConnStats>) -> Arc<Self> {
        Arc::new(Gate {
            limits,
            counts: Mutex::default(),
            stats,
            what,
        })
    }

    /// `stream` from `peer` with its slot, or None (closed, counted) past a cap.
    pub fn admit(self: &Arc<Self>, stream: TcpStream, peer: SocketAddr) -> Option<Guarded> {
        let slot = self.enter(peer)?;
        let _ = stream.set_nodelay(true);
        Some(Guarded {
            io: stream,
            first: Some(Box::pin(tokio::time::sleep(FIRST_BYTE))),
            want: self.limits.preface.max(1),
            stall: None,
            _slot: slot,
        })
    }

    /// A slot for a connection from `peer`, or None (counted in `refused`, logged) past a
    /// cap: for a listener that serves its connections itself (the events sockets).
    pub fn enter(self: &Arc<Self>, peer: SocketAddr) -> Option<Slot> {
        let ip = peer.ip();
        {
            let mut c = self.counts.lock();
            let from = c.per_address.get(&ip).copied().unwrap_or(0);
            if c.total >= self.limits.total || from >= self.limits.per_address {
                drop(c);
                self.stats.refused.fetch_add(1, Relaxed);
                tracing::warn!(
                    %peer,
                    total = self.limits.total,
                    per_address = self.limits.per_address,
                    "{}: a connection refused: too many open",
                    self.what
                );
                return None;
            }
            c.total += 1;
            *c.per_address.entry(ip).or_insert(0) += 1;
        }
        Some(Slot {
            gate: self.clone(),
            ip,
        })
    }
}

/// A connection's place under its gate's caps, given back when dropped (however the
/// connection goes).
pub struct Slot {
    gate: Arc<Gate>,
    ip: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut c = self.gate.counts.lock();
        c.total -= 1;
        if let Some(n) = c.per_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                c.per_address.remove(&self.ip);
            }
        }
    }
}

/// An admitted connection: its reads fail with `TimedOut` if the preface does not come within
/// [`FIRST_BYTE`], and its writes if one waits [`WRITE_STALL`] for the peer.
pub struct Guarded {
    io: TcpStream,
    /// Until the preface: its deadline.
    first: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Bytes of the preface still to come.
    want: usize,
    /// While a write waits for the peer: its deadline.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    _slot: Slot,
}

impl Guarded {
    /// `r`, the outcome of a write: while it waits, whether it waited past [`WRITE_STALL`].
    fn stalled<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if !r.is_pending() {
            self.stall = None;
            return r;
        }
        // The write's deadline: a timer armed while it waits, polled beside it (no pause).
        let s = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL)));
        match s.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.stall = None;
                self._slot.gate.stats.stalled.fetch_add(1, Relaxed);
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("the peer read nothing for {} s", WRITE_STALL.as_secs()),
                )))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        let Some(deadline) = self.first.as_mut() else {
            return r;
        };
        match r {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                self.want = self.want.saturating_sub(buf.filled().len() - before);
                if self.want == 0 {
                    self.first = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    self.first = None;
                    self._slot.gate.stats.silent.fetch_add(1, Relaxed);
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no preface within {} s", FIRST_BYTE.as_secs()),
                    )))
                }
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.stalled(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.stalled(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Guarded {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// The admitted connections of `listener`, as tonic's server takes them. Accept errors (out
/// of descriptors) are logged and waited out a moment, not passed on.
pub fn incoming(
    listener: tokio::net::TcpListener,
    gate: Arc<Gate>,
) -> impl tokio_stream::Stream<Item = io::Result<Guarded>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let (s, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "{}: accepting a connection failed", gate.what);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if let Some(g) = gate.admit(s, peer) {
                if tx.send(Ok(g)).await.is_err() {
                    return;
                }
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn caps_hold_and_slots_come_back_and_a_silent_connection_is_closed() {
        tokio::time::pause();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let stats = Arc::new(ConnStats::default());
        let gate = Gate::new(
            "test",
            Limits {
                total: 3,
                per_address: 2,
                preface: 4,
            },
            stats.clone(),
        );
        let mut held = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
            let (s, peer) = l.accept().await.unwrap();
            held.push(gate.admit(s, peer));
        }
        // Two from 127.0.0.1, then the per-address cap.
        assert!(held[0].is_some() && held[1].is_some() && held[2].is_none());
        assert_eq!(stats.refused.load(Relaxed), 1);
        held.pop();
        held.pop();
        clients.push(TcpStream::connect(addr).await.unwrap());
        let (s, peer) = l.accept().await.unwrap();
        let mut g = gate.admit(s, peer).expect("a slot came back");
        // It sends nothing: its read fails at the deadline.
        let mut b = [0u8; 8];
        let e = g.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(stats.silent.load(Relaxed), 1);
        // One that sends part of its preface and waits: closed at the deadline too.
        drop(g);
        let mut c = TcpStream::connect(addr).await.unwrap();
        let (s, peer) = l.accept().await.unwrap();
        let mut g = gate.admit(s, peer).unwrap();
        c.write_all(b"P").await.unwrap();
        assert_eq!(g.read(&mut b).await.unwrap(), 1);
        let e = g.read(&mut b).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(stats.silent.load(Relaxed), 2);
        // One that sends its preface reads on, past the deadline.
        let mut c = clients.pop().unwrap();
        drop(g);
        clients.push(TcpStream::connect(addr).await.unwrap());
        let (s, peer) = l.accept().await.unwrap();
        let mut g = gate.admit(s, peer).unwrap();
        let c2 = clients.last_mut().unwrap();
        c2.write_all(b"hi").await.unwrap();
        assert_eq!(g.read(&mut b).await.unwrap(), 2);
        c2.write_all(b"there").await.unwrap();
        assert_eq!(g.read(&mut b).await.unwrap(), 5);
        tokio::time::advance(FIRST_BYTE * 2).await;
        c2.write_all(b"again").await.unwrap();
        assert_eq!(g.read(&mut b).await.unwrap(), 5);
        assert_eq!(stats.silent.load(Relaxed), 2);
        // A peer that reads nothing: the write that fills its socket fails at the deadline.
        let chunk = vec![0u8; 1 << 20];
        let e = loop {
            if let Err(e) = g.write(&chunk).await {
                break e;
            }
        };
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(stats.stalled.load(Relaxed), 1);
        c.shutdown().await.unwrap();
    }
}
