//! ZMQ's PUB and ROUTER sockets as kvtierd's KV events need them (ZMTP 3.0, NULL mechanism;
//! RFC 23 and 29), spoken by the daemon itself so that no subscriber or replay requester can
//! make it hoard memory or wait.
//!
//! The `zeromq` crate, used before, queues up to 100,000 messages per peer and writes them
//! with no deadline. A subscriber that stops reading with its connection open (a router hung
//! or stopped, a network that drops without a reset) so held the last 100,000 batches (up to
//! 4,096 events, ~80 KiB, each: gigabytes in a burst of saves) for as long as it stayed
//! connected, and its writer waited forever. Here:
//! - [`PubSocket`]: each subscriber has a queue bounded in bytes ([`MAX_QUEUED_BYTES`]: past
//!   it, batches are not sent to it, counted, as libzmq's high-water mark drops them; the
//!   subscriber sees the gap in the sequence numbers and asks the replay socket), and each
//!   write has a deadline ([`WRITE_DEADLINE`]): past it the subscriber is disconnected (ZMQ SUB
//!   sockets reconnect on their own), counted.
//! - [`ReplaySocket`]: each requester is served by a task of its own that writes straight to
//!   its socket, each write within [`REPLAY_WRITE_DEADLINE`] and each replay within
//!   [`REPLAY_DEADLINE`]; past either it is disconnected, counted.
//! - Both: the handshake has a deadline, a peer's frames are bounded ([`MAX_INBOUND_FRAME`]),
//!   and so is the number of connections ([`MAX_CONNECTIONS`], [`MAX_PER_ADDRESS`] from one
//!   address). TCP keepalive finds peers that vanished without a reset; a subscriber that
//!   subscribes to nothing within [`SUBSCRIBE_DEADLINE`], and a replay requester that asks
//!   nothing for [`REPLAY_IDLE`], are disconnected (a ZMQ socket reconnects on its own).
//!
//! Every message of the PUB socket has the socket's topic as its first frame, so only the
//! subscriptions that are prefixes of the topic can match; they are all a subscriber's state
//! kept (counts by length: a few bytes, whatever it sends). Subscriptions come as ZMTP 3.0
//! messages (`0x01` + topic, `0x00` + topic to cancel) or as ZMTP 3.1's `SUBSCRIBE` / `CANCEL`
//! commands. A `PING` is answered with a `PONG` (its context cut to 16 bytes, RFC 37), one at a
//! time: pings sent while a `PONG` waits are not answered.

use std::net::SocketAddr;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

/// Most bytes of messages queued for one subscriber; past it, messages are not sent to it.
pub const MAX_QUEUED_BYTES: u64 = 32 << 20;
/// Longest one write to a subscriber may wait for its socket (a message, or the handshake's);
/// past it the subscriber is disconnected.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// Longest a connection may take to complete its handshake.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);
/// Largest frame a subscriber may send (subscriptions, commands).
pub const MAX_INBOUND_FRAME: u64 = 64 << 10;
/// Most connections at once (subscribers and handshakes): past it, new ones are closed at
/// once (counted as cut). A subscriber's connection waits for its subscriptions with no
/// deadline (it may say nothing for hours), so their number is what is bounded.
pub const MAX_CONNECTIONS: u64 = 1024;
/// Most connections at once from one address.
pub const MAX_PER_ADDRESS: u64 = 64;
/// Longest a subscriber may stay connected with no subscription a message could match.
pub const SUBSCRIBE_DEADLINE: Duration = Duration::from_secs(30);
/// Longest a replay requester's connection may stay without a request.
pub const REPLAY_IDLE: Duration = Duration::from_secs(120);

/// Counters of the socket.
#[derive(Default)]
pub struct PubStats {
    /// Subscribers connected (handshake done).
    pub subscribers: AtomicU64,
    /// Messages not sent to a subscriber because [`MAX_QUEUED_BYTES`] were queued for it.
    pub skipped: AtomicU64,
    /// Subscribers disconnected: a write waited past [`WRITE_DEADLINE`], or a broken
    /// handshake or frame.
    pub cut: AtomicU64,
}

/// One subscriber: its subscriptions, and its writer's queue.
struct Sub {
    id: u64,
    /// Its subscriptions that are prefixes of the topic, counted by their length (a CANCEL
    /// takes back one SUBSCRIBE of the same bytes).
    prefixes: Vec<u32>,
    /// Their sum: the subscriber gets every message while it is above 0.
    active: u32,
    tx: mpsc::UnboundedSender<Out>,
    queued: Arc<AtomicU64>,
}

impl Sub {
    /// A SUBSCRIBE (`on`) or CANCEL of `t`, for a socket of topic `topic`.
    fn subscribe(&mut self, topic: &[u8], t: &[u8], on: bool) {
        if !topic.starts_with(t) {
            // It matches no message: nothing to keep.
            return;
        }
        let Some(n) = self.prefixes.get_mut(t.len()) else {
            return;
        };
        if on {
            // (`active` is the sum of the counts: neither passes u32::MAX.)
            if self.active < u32::MAX {
                *n += 1;
                self.active += 1;
            }
        } else if *n > 0 {
            *n -= 1;
            self.active -= 1;
        }
    }
}

/// What a subscriber's writer sends: a message's frames, or a PONG with its context.
enum Out {
    Message(Arc<[Bytes]>),
    Pong(Bytes),
}

/// The bound PUB socket. Sending never waits.
pub struct PubSocket {
    subs: Arc<Mutex<Vec<Sub>>>,
    stats: Arc<PubStats>,
    topic: Bytes,
    /// Where it listens (the port filled in).
    pub local: SocketAddr,
}

impl PubSocket {
    /// Binds `addr` and accepts subscribers in a task of its own; every message sent has
    /// `topic` as its first frame.
    pub async fn bind(addr: &str, topic: Bytes, stats: Arc<PubStats>) -> Result<Self> {
        let subs: Arc<Mutex<Vec<Sub>>> = Arc::default();
        let (s, st, tp) = (subs.clone(), stats.clone(), topic.clone());
        let mut next_id = 0u64;
        let local = accept(addr, stats.clone(), "subscriber", move |stream, peer| {
            next_id += 1;
            serve(stream, peer, next_id, tp.clone(), s.clone(), st.clone())
        })
        .await?;
        Ok(PubSocket {
            subs,
            stats,
            topic,
            local,
        })
    }

    /// Queues the message `[topic, rest...]` for every subscriber with a subscription (a
    /// prefix of the topic); a subscriber with [`MAX_QUEUED_BYTES`] queued does not get it.
    pub fn send(&self, rest: &[Bytes]) {
        let bytes: u64 =
            (self.topic.len() as u64 + 9) + rest.iter().map(|f| f.len() as u64 + 9).sum::<u64>();
        let mut msg: Option<Arc<[Bytes]>> = None;
        let subs = self.subs.lock();
        for s in subs.iter() {
            if s.active == 0 {
                continue;
            }
            if s.queued.load(Relaxed) + bytes > MAX_QUEUED_BYTES {
                self.stats.skipped.fetch_add(1, Relaxed);
                continue;
            }
            let m = msg
                .get_or_insert_with(|| {
                    std::iter::once(self.topic.clone())
                        .chain(rest.iter().cloned())
                        .collect()
                })
                .clone();
            s.queued.fetch_add(bytes, Relaxed);
            // A closed queue: the subscriber is going away.
            let _ = s.tx.send(Out::Message(m));
        }
    }
}

/// Binds `addr` and, in a task of its own, hands each connection (at most
/// [`MAX_CONNECTIONS`] at once and [`MAX_PER_ADDRESS`] from one address, under a
/// [`crate::conns::Gate`]; past either one is closed at once and counted in `stats.cut`), with
/// TCP keepalive on, to `serve`.
async fn accept<F, Fut>(
    addr: &str,
    stats: Arc<PubStats>,
    what: &'static str,
    mut serve: F,
) -> Result<SocketAddr>
where
    F: FnMut(TcpStream, SocketAddr) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = l.local_addr()?;
    let limits = crate::conns::Limits {
        total: MAX_CONNECTIONS as usize,
        per_address: MAX_PER_ADDRESS as usize,
        preface: 0, // (the handshake has its own deadline)
    };
    let gate = crate::conns::Gate::new("events", limits, Arc::default());
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match l.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: a while later, try again.
                    tracing::warn!(error = %e, "events: accepting a {what} failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let Some(slot) = gate.enter(peer) else {
                stats.cut.fetch_add(1, Relaxed);
                continue;
            };
            let _ = stream.set_nodelay(true);
            // A peer gone without a reset (a host down, a cut network) is found in ~1 min.
            let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(
                &socket2::TcpKeepalive::new()
                    .with_time(Duration::from_secs(30))
                    .with_interval(Duration::from_secs(10))
                    .with_retries(3),
            );
            let fut = serve(stream, peer);
            tokio::spawn(async move {
                let _slot = slot;
                fut.await;
            });
        }
    });
    Ok(local)
}

/// One connection: the handshake, then its reader (subscriptions, pings) and its writer.
async fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    id: u64,
    topic: Bytes,
    subs: Arc<Mutex<Vec<Sub>>>,
    stats: Arc<PubStats>,
) {
    let Some((mut rd, wr)) = greet(stream, peer, b"PUB", &[b"SUB", b"XSUB"], &stats.cut).await
    else {
        return;
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let queued = Arc::new(AtomicU64::new(0));
    let pong = Arc::new(AtomicBool::new(false));
    subs.lock().push(Sub {
        id,
        prefixes: vec![0; topic.len() + 1],
        active: 0,
        tx: tx.clone(),
        queued: queued.clone(),
    });
    stats.subscribers.fetch_add(1, Relaxed);
    let mut writer = tokio::spawn(write_loop(wr, rx, queued, pong.clone()));
    let reading = read_loop(&mut rd, id, &topic, &subs, &tx, &pong);
    // A deadline (the timer, raced against the connection below), not a pause.
    let subscribed = async {
        tokio::time::sleep(SUBSCRIBE_DEADLINE).await;
        let on = |s: &Sub| s.id == id && s.active > 0;
        if subs.lock().iter().any(on) {
            std::future::pending::<()>().await;
        }
    };
    // Whichever ends first ends the connection.
    let outcome = tokio::select! {
        r = reading => r.map_err(|e| format!("{e:#}")),
        () = subscribed => Err(format!(
            "no subscription to {:?} within {} s",
            String::from_utf8_lossy(&topic),
            SUBSCRIBE_DEADLINE.as_secs()
        )),
        w = &mut writer => match w {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(e.to_string()),
        },
    };
    writer.abort();
    subs.lock().retain(|s| s.id != id);
    stats.subscribers.fetch_sub(1, Relaxed);
    if let Err(e) = outcome {
        stats.cut.fetch_add(1, Relaxed);
        tracing::warn!(%peer, error = %e, "events: a subscriber was disconnected");
    }
}

/// `stream` split, buffered, and through [`handshake`] within [`HANDSHAKE_DEADLINE`]; None
/// (logged, counted in `cut`) if not.
async fn greet(
    stream: TcpStream,
    peer: SocketAddr,
    ours: &[u8],
    theirs: &[&[u8]],
    cut: &AtomicU64,
) -> Option<(OwnedReadHalf, BufWriter<OwnedWriteHalf>)> {
    let (mut rd, wr) = stream.into_split();
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let e = match tokio::time::timeout(
        HANDSHAKE_DEADLINE,
        handshake(&mut rd, &mut wr, ours, theirs),
    )
    .await
    {
        Ok(Ok(())) => return Some((rd, wr)),
        Ok(Err(e)) => format!("{e:#}"),
        Err(_) => format!("no handshake within {} s", HANDSHAKE_DEADLINE.as_secs()),
    };
    cut.fetch_add(1, Relaxed);
    tracing::warn!(%peer, error = %e, "events: a {} socket's peer failed its handshake", String::from_utf8_lossy(ours));
    None
}

/// The greeting (ZMTP 3.0, NULL, as server) and READY both ways, as a socket of type `ours`;
/// the peer's type must be one of `theirs`.
async fn handshake<R, W>(rd: &mut R, wr: &mut W, ours: &[u8], theirs: &[&[u8]]) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3; // version 3.0
    g[12..16].copy_from_slice(b"NULL");
    wr.write_all(&g).await?;
    wr.flush().await?;
    let mut peer = [0u8; 64];
    rd.read_exact(&mut peer)
        .await
        .context("reading the greeting")?;
    anyhow::ensure!(
        peer[0] == 0xff && peer[9] == 0x7f,
        "not a ZMTP peer (its greeting's signature)"
    );
    anyhow::ensure!(peer[10] >= 3, "ZMTP {}.x: 3.0 or later needed", peer[10]);
    anyhow::ensure!(
        &peer[12..16] == b"NULL" && peer[16..32].iter().all(|&b| b == 0),
        "security mechanism {:?}: only NULL is spoken",
        String::from_utf8_lossy(&peer[12..32]).trim_end_matches('\0')
    );
    let mut ready = Vec::with_capacity(32);
    ready.push(5);
    ready.extend_from_slice(b"READY");
    property(&mut ready, "Socket-Type", ours);
    write_frame(wr, 0x04, &ready).await?;
    wr.flush().await?;
    let (flags, body) = read_frame(rd).await?;
    anyhow::ensure!(flags & 0x04 != 0, "the peer sent a message before READY");
    let name = command_name(&body)?;
    anyhow::ensure!(name == b"READY", "the peer's first command was not READY");
    let ty = properties(&body[1 + name.len()..])?
        .into_iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(b"Socket-Type"))
        .map(|(_, v)| v);
    anyhow::ensure!(
        ty.as_deref().is_some_and(|t| theirs.contains(&t)),
        "the peer is a {} socket: a {} socket speaks to {}",
        ty.map_or("(unnamed)".into(), |t| String::from_utf8_lossy(&t)
            .into_owned()),
        String::from_utf8_lossy(ours),
        theirs
            .iter()
            .map(|t| String::from_utf8_lossy(t))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The first batch still buffered from sequence `start` on, and the newest sequence buffered:
/// `(sequence, payload, newest)`. A replay takes its batches one at a time, up to the newest
/// when it began, so a requester that reads slowly holds one batch, not a copy of the buffer
/// (a batch that leaves the buffer meanwhile is not replayed).
pub type Replayer = Arc<dyn Fn(u64) -> Option<(u64, Bytes, u64)> + Send + Sync>;

/// Longest one write of a replay may wait for the requester's socket, plus
/// [`REPLAY_WRITE_PER_MIB`] per MiB of the message; past it the requester is disconnected (it
/// stopped reading), counted in `abandoned`.
pub const REPLAY_WRITE_DEADLINE: Duration = Duration::from_secs(1);
/// What a MiB adds to a replay write's deadline (a batch of a burst of saves may be ~20 MiB).
pub const REPLAY_WRITE_PER_MIB: Duration = Duration::from_millis(250);
/// Longest one replay may take, however slowly the requester reads.
pub const REPLAY_DEADLINE: Duration = Duration::from_secs(60);

/// Counters of the replay socket.
#[derive(Default)]
pub struct ReplayStats {
    /// Replay requests answered (whole or not).
    pub replays: AtomicU64,
    /// Requesters disconnected in a replay: a write waited past [`REPLAY_WRITE_DEADLINE`], or
    /// the replay past [`REPLAY_DEADLINE`].
    pub abandoned: AtomicU64,
    /// Connections, and those refused or broken (see [`PubStats`]).
    pub conns: Arc<PubStats>,
}

/// The replay socket: a ROUTER socket as vLLM's publisher has one. A REQ or DEALER peer sends
/// `[empty, start sequence (8 bytes, big-endian)]`; the answer, on its connection, is one
/// message `[empty, topic, sequence, payload]` per batch from that sequence on, then `[empty,
/// empty, -1, empty]`. Each connection is served by a task of its own, writing straight to its
/// socket (no queue): a requester that stops reading holds one replay's references to buffered
/// batches for [`REPLAY_WRITE_DEADLINE`] and is disconnected, and never delays another.
pub struct ReplaySocket {
    /// Where it listens (the port filled in).
    pub local: SocketAddr,
}

impl ReplaySocket {
    /// Binds `addr`; `replayer` answers each request, every batch under `topic`.
    pub async fn bind(
        addr: &str,
        topic: Bytes,
        replayer: Replayer,
        stats: Arc<ReplayStats>,
    ) -> Result<Self> {
        let conns = stats.conns.clone();
        let local = accept(addr, conns, "replay requester", move |stream, peer| {
            serve_replays(stream, peer, topic.clone(), replayer.clone(), stats.clone())
        })
        .await?;
        Ok(ReplaySocket { local })
    }
}

/// One requester's connection: the handshake, then its requests one after another.
async fn serve_replays(
    stream: TcpStream,
    peer: SocketAddr,
    topic: Bytes,
    replayer: Replayer,
    stats: Arc<ReplayStats>,
) {
    let cut = &stats.conns.cut;
    let Some((mut rd, mut wr)) = greet(stream, peer, b"ROUTER", &[b"REQ", b"DEALER"], cut).await
    else {
        return;
    };
    // Since the last replay (or the handshake): PINGs and requests it cannot read do not
    // extend it.
    let mut idle_until = tokio::time::Instant::now() + REPLAY_IDLE;
    loop {
        let frames = match tokio::time::timeout_at(idle_until, read_message(&mut rd)).await {
            Ok(Ok(Some(Inbound::Message(f)))) => f,
            Ok(Ok(Some(Inbound::Ping(ctx)))) => {
                let sent = async {
                    write_frame(&mut wr, 0x04, &pong(&ctx)).await?;
                    wr.flush().await
                };
                if let Err(e) = timed(REPLAY_WRITE_DEADLINE, sent).await {
                    stats.abandoned.fetch_add(1, Relaxed);
                    tracing::warn!(%peer, error = %e, "events: a replay requester stopped reading: disconnected");
                    return;
                }
                continue;
            }
            Ok(Ok(None)) => return,
            Err(_) => {
                tracing::debug!(%peer, "events: a replay requester idle for {} s: disconnected", REPLAY_IDLE.as_secs());
                return;
            }
            Ok(Err(e)) => {
                stats.conns.cut.fetch_add(1, Relaxed);
                tracing::warn!(%peer, error = %e, "events: a replay requester was disconnected");
                return;
            }
        };
        // [empty delimiter, start sequence]: what REQ sends (a DEALER sends the delimiter
        // itself).
        let start = match frames.as_slice() {
            [e, s] if e.is_empty() && s.len() == 8 => {
                u64::from_be_bytes([s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7]])
            }
            _ => {
                tracing::warn!(
                    %peer,
                    frames = frames.len(),
                    "events: a replay request that is not [empty, start sequence]: ignored"
                );
                continue;
            }
        };
        stats.replays.fetch_add(1, Relaxed);
        let send = async {
            // What was buffered when the request came, not what is published while it is
            // answered (the requester gets that on its SUB socket).
            let mut next = start;
            let mut last = None;
            while let Some((seq, payload, newest)) = replayer(next) {
                let last = *last.get_or_insert(newest);
                if seq > last {
                    break;
                }
                next = seq + 1;
                let deadline =
                    REPLAY_WRITE_DEADLINE + REPLAY_WRITE_PER_MIB * (payload.len() >> 20) as u32;
                let seq = Bytes::copy_from_slice(&seq.to_be_bytes());
                let msg = [Bytes::new(), topic.clone(), seq, payload];
                timed(deadline, write_message(&mut wr, &msg)).await?;
            }
            let end_seq = Bytes::copy_from_slice(&(-1i64).to_be_bytes());
            let end = [Bytes::new(), Bytes::new(), end_seq, Bytes::new()];
            timed(REPLAY_WRITE_DEADLINE, write_message(&mut wr, &end)).await
        };
        let outcome = match tokio::time::timeout(REPLAY_DEADLINE, send).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the replay took longer than {} s",
                    REPLAY_DEADLINE.as_secs()
                ),
            )),
        };
        if let Err(e) = outcome {
            stats.abandoned.fetch_add(1, Relaxed);
            tracing::warn!(%peer, error = %e, "events: a replay requester stopped reading: disconnected");
            return;
        }
        idle_until = tokio::time::Instant::now() + REPLAY_IDLE;
    }
}

/// `f` (a write and its flush) within `deadline`.
async fn timed(
    deadline: Duration,
    f: impl std::future::Future<Output = std::io::Result<()>>,
) -> std::io::Result<()> {
    match tokio::time::timeout(deadline, f).await {
        Ok(r) => r,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("a write waited {:.1} s", deadline.as_secs_f64()),
        )),
    }
}

/// One message (its frames), flushed.
async fn write_message<W: AsyncWrite + Unpin>(wr: &mut W, frames: &[Bytes]) -> std::io::Result<()> {
    let n = frames.len();
    for (i, f) in frames.iter().enumerate() {
        write_frame(wr, if i + 1 < n { 0x01 } else { 0 }, f).await?;
    }
    wr.flush().await
}

/// What a replay requester sent.
enum Inbound {
    /// A message: its frames.
    Message(Vec<Vec<u8>>),
    /// A `PING`: the context to echo in the `PONG`.
    Ping(Vec<u8>),
}

/// A message from the peer, or a `PING` between messages (other commands skipped; at most 16
/// frames). None: the peer closed.
async fn read_message<R: AsyncRead + Unpin>(rd: &mut R) -> Result<Option<Inbound>> {
    let mut frames = Vec::new();
    loop {
        let (flags, body) = match read_frame(rd).await {
            Ok(f) => f,
            Err(e) if is_eof(&e) && frames.is_empty() => return Ok(None),
            Err(e) => return Err(e),
        };
        if flags & 0x04 != 0 {
            if command_name(&body)? == b"PING" && frames.is_empty() {
                return Ok(Some(Inbound::Ping(ping_context(&body).to_vec())));
            }
            continue;
        }
        anyhow::ensure!(frames.len() < 16, "a message of more than 16 frames");
        frames.push(body);
        if flags & 0x01 == 0 {
            return Ok(Some(Inbound::Message(frames)));
        }
    }
}

/// The context a `PING` command (`body`) asks to be echoed: after its TTL (2 bytes), at most
/// 16 bytes (RFC 37).
fn ping_context(body: &[u8]) -> &[u8] {
    let ctx = body.get(1 + 4 + 2..).unwrap_or_default();
    &ctx[..ctx.len().min(16)]
}

/// A `PONG` command's body echoing `ctx`.
fn pong(ctx: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(5 + ctx.len());
    b.push(4);
    b.extend_from_slice(b"PONG");
    b.extend_from_slice(ctx);
    b
}

/// Subscriptions and pings until the peer goes.
async fn read_loop<R: AsyncRead + Unpin>(
    rd: &mut R,
    id: u64,
    topic: &[u8],
    subs: &Mutex<Vec<Sub>>,
    tx: &mpsc::UnboundedSender<Out>,
    pong_waits: &AtomicBool,
) -> Result<()> {
    // Whether the next data frame starts a message (only a message's first frame may be a
    // subscription, as libzmq's XPUB reads them).
    let mut first = true;
    loop {
        let (flags, body) = match read_frame(rd).await {
            Ok(f) => f,
            Err(e) if is_eof(&e) => return Ok(()),
            Err(e) => return Err(e),
        };
        let starts = first;
        if flags & 0x04 == 0 {
            first = flags & 0x01 == 0;
        }
        let (subscribe, t) = if flags & 0x04 != 0 {
            let name = command_name(&body)?;
            let rest = &body[1 + name.len()..];
            match name {
                b"SUBSCRIBE" => (true, rest.to_vec()),
                b"CANCEL" => (false, rest.to_vec()),
                b"PING" => {
                    // One PONG waits at a time, whatever the peer sends.
                    let ctx = ping_context(&body);
                    if !pong_waits.swap(true, Relaxed) {
                        let _ = tx.send(Out::Pong(Bytes::copy_from_slice(ctx)));
                    }
                    continue;
                }
                _ => continue,
            }
        } else if !starts {
            continue;
        } else {
            match body.split_first() {
                Some((1, t)) => (true, t.to_vec()),
                Some((0, t)) => (false, t.to_vec()),
                // Anything else a SUB sends a PUB is ignored, as libzmq does.
                _ => continue,
            }
        };
        if let Some(s) = subs.lock().iter_mut().find(|s| s.id == id) {
            s.subscribe(topic, &t, subscribe);
        }
    }
}

/// The subscriber's queue, written with a deadline per message. Err: a write failed or
/// waited past [`WRITE_DEADLINE`].
async fn write_loop<W: AsyncWrite + Unpin>(
    mut wr: W,
    mut rx: mpsc::UnboundedReceiver<Out>,
    queued: Arc<AtomicU64>,
    pong_waits: Arc<AtomicBool>,
) -> Result<(), String> {
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        let work = async {
            // What is queued already goes out before one flush.
            while let Some(out) = next.take() {
                match out {
                    Out::Message(frames) => {
                        let n = frames.len();
                        for (i, f) in frames.iter().enumerate() {
                            let more = if i + 1 < n { 0x01 } else { 0 };
                            write_frame(&mut wr, more, f).await?;
                        }
                        let bytes: u64 = frames.iter().map(|f| f.len() as u64 + 9).sum();
                        queued.fetch_sub(bytes, Relaxed);
                    }
                    Out::Pong(ctx) => {
                        pong_waits.store(false, Relaxed);
                        write_frame(&mut wr, 0x04, &pong(&ctx)).await?;
                    }
                }
                next = rx.try_recv().ok();
            }
            wr.flush().await
        };
        match tokio::time::timeout(WRITE_DEADLINE, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("writing: {e}")),
            Err(_) => {
                return Err(format!(
                    "it read nothing for {} s: it lost its connection (a SUB socket \
                     reconnects, and asks the replay socket for what it missed)",
                    WRITE_DEADLINE.as_secs()
                ))
            }
        }
    }
    Ok(())
}

fn is_eof(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .is_some_and(|e| e.kind() == std::io::ErrorKind::UnexpectedEof)
}

/// A frame: flags (0x01 more, 0x04 command; 0x02 long is set here by size), size, body.
async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    flags: u8,
    body: &[u8],
) -> std::io::Result<()> {
    if body.len() <= 255 {
        wr.write_all(&[flags, body.len() as u8]).await?;
    } else {
        let mut h = [0u8; 9];
        h[0] = flags | 0x02;
        h[1..].copy_from_slice(&(body.len() as u64).to_be_bytes());
        wr.write_all(&h).await?;
    }
    wr.write_all(body).await
}

/// A frame from the peer: (flags, body), at most [`MAX_INBOUND_FRAME`] bytes.
async fn read_frame<R: AsyncRead + Unpin>(rd: &mut R) -> Result<(u8, Vec<u8>)> {
    let flags = rd.read_u8().await?;
    anyhow::ensure!(
        flags & !0x07 == 0 && flags & 0x05 != 0x05,
        "a frame with flags {flags:#04x}"
    );
    let len = if flags & 0x02 != 0 {
        rd.read_u64().await?
    } else {
        u64::from(rd.read_u8().await?)
    };
    anyhow::ensure!(
        len <= MAX_INBOUND_FRAME,
        "a frame of {len} bytes from a subscriber (at most {MAX_INBOUND_FRAME})"
    );
    let mut body = vec![0u8; len as usize];
    rd.read_exact(&mut body).await?;
    Ok((flags, body))
}

/// A command's name (its first byte is the name's length).
fn command_name(body: &[u8]) -> Result<&[u8]> {
    let n = usize::from(*body.first().context("an empty command")?);
    body.get(1..1 + n)
        .context("a command shorter than its name")
}

fn property(b: &mut Vec<u8>, name: &str, value: &[u8]) {
    b.push(name.len() as u8);
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(&(value.len() as u32).to_be_bytes());
    b.extend_from_slice(value);
}

/// A READY command's properties: (name, value) pairs.
fn properties(mut b: &[u8]) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
    let mut out = Vec::new();
    while let Some((&n, rest)) = b.split_first() {
        let name = rest.get(..usize::from(n)).context("a property's name")?;
        let rest = &rest[usize::from(n)..];
        let len = rest.get(..4).context("a property's length")?;
        let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
        let value = rest.get(4..4 + len).context("a property's value")?;
        out.push((name.to_vec(), value.to_vec()));
        b = &rest[4 + len..];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that does the handshake as a `socket_type` socket (by hand, as RFC 23 says).
    async fn peer(addr: SocketAddr, socket_type: &[u8]) -> TcpStream {
        peer_from([127, 0, 0, 1], addr, socket_type).await
    }

    /// [`peer`] from address `ip`.
    async fn peer_from(ip: [u8; 4], addr: SocketAddr, socket_type: &[u8]) -> TcpStream {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(SocketAddr::from((ip, 0))).unwrap();
        let mut s = sock.connect(addr).await.unwrap();
        let mut g = [0u8; 64];
        g[0] = 0xff;
        g[9] = 0x7f;
        g[10] = 3;
        g[12..16].copy_from_slice(b"NULL");
        s.write_all(&g).await.unwrap();
        let mut ready = vec![5];
        ready.extend_from_slice(b"READY");
        property(&mut ready, "Socket-Type", socket_type);
        write_frame(&mut s, 0x04, &ready).await.unwrap();
        s
    }

    /// Waits for `cond` (deadline 30 s).
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let end = std::time::Instant::now() + Duration::from_secs(30);
        while !cond() {
            assert!(std::time::Instant::now() < end, "{what}: never");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_subscriber_that_reads_nothing_never_has_more_than_its_queue_held_for_it() {
        let stats = Arc::new(PubStats::default());
        let p = PubSocket::bind("127.0.0.1:0", Bytes::new(), stats.clone())
            .await
            .unwrap();
        let mut stalled = peer(p.local, b"SUB").await;
        write_frame(&mut stalled, 0, &[1]).await.unwrap(); // every topic
        until("the subscription", || {
            p.subs.lock().first().is_some_and(|s| s.active > 0)
        })
        .await;
        // 64 MiB offered to a peer that reads nothing.
        let big = Bytes::from(vec![7u8; 1 << 20]);
        for i in 0u64..64 {
            p.send(&[Bytes::copy_from_slice(&i.to_be_bytes()), big.clone()]);
            let queued = p.subs.lock()[0].queued.load(Relaxed);
            assert!(queued <= MAX_QUEUED_BYTES, "{queued} bytes queued");
        }
        // (What the kernel's buffers took while the writer ran was not queued.)
        let skipped = stats.skipped.load(Relaxed);
        assert!(skipped > 0, "{skipped} of 64 skipped");
        // Once it cancels its subscription nothing is queued for it.
        write_frame(&mut stalled, 0, &[0]).await.unwrap();
        until("the cancel", || p.subs.lock()[0].active == 0).await;
        let before = stats.skipped.load(Relaxed);
        p.send(std::slice::from_ref(&big));
        assert_eq!(stats.skipped.load(Relaxed), before);
        drop(stalled);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_is_not_a_subscriber_or_sends_a_huge_frame_is_cut_off() {
        let stats = Arc::new(PubStats::default());
        let p = PubSocket::bind("127.0.0.1:0", Bytes::new(), stats.clone())
            .await
            .unwrap();
        // Another PUB socket: refused at the handshake.
        let mut other = peer(p.local, b"PUB").await;
        until("the PUB peer cut off", || stats.cut.load(Relaxed) == 1).await;
        let mut rest = Vec::new();
        // What it was sent (the greeting, READY), then the end of the connection.
        let _ = other.read_to_end(&mut rest).await;
        assert_eq!(stats.subscribers.load(Relaxed), 0);
        // A subscriber that sends a frame of 1 MiB.
        let mut big = peer(p.local, b"SUB").await;
        until("the subscriber", || stats.subscribers.load(Relaxed) == 1).await;
        let mut h = [0u8; 9];
        h[0] = 0x02;
        h[1..].copy_from_slice(&(1u64 << 20).to_be_bytes());
        big.write_all(&h).await.unwrap();
        until("the huge frame's sender cut off", || {
            stats.cut.load(Relaxed) == 2
        })
        .await;
        until("no subscriber left", || {
            stats.subscribers.load(Relaxed) == 0
        })
        .await;
        assert!(p.subs.lock().is_empty());
    }

    /// A subscriber's state is a count per prefix of the topic, whatever it sends: a
    /// subscription to anything else matches no message and is not kept; a CANCEL takes back
    /// one SUBSCRIBE of the same bytes, and one of bytes never subscribed takes nothing.
    #[test]
    fn subscriptions_are_counts_of_the_topics_prefixes() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let mut s = Sub {
            id: 1,
            prefixes: vec![0; 3],
            active: 0,
            tx,
            queued: Arc::default(),
        };
        let topic = b"kv";
        for t in [&b""[..], b"k", b"k", b"x", b"kvx", &[b'k'; 60_000][..]] {
            s.subscribe(topic, t, true);
        }
        assert_eq!((s.active, s.prefixes.len()), (3, 3));
        s.subscribe(topic, b"kv", false); // never subscribed
        s.subscribe(topic, b"x", false);
        assert_eq!(s.active, 3);
        s.subscribe(topic, b"k", false);
        s.subscribe(topic, b"", false);
        assert_eq!(s.active, 1, "one \"k\" left");
        s.subscribe(topic, b"k", false);
        s.subscribe(topic, b"k", false);
        assert_eq!(s.active, 0);
    }

    /// Subscriber 1 of a socket whose topic is empty, queueing into `tx`.
    fn one_sub(tx: &mpsc::UnboundedSender<Out>) -> Mutex<Vec<Sub>> {
        Mutex::new(vec![Sub {
            id: 1,
            prefixes: vec![0; 1],
            active: 0,
            tx: tx.clone(),
            queued: Arc::default(),
        }])
    }

    /// [`read_loop`] of subscriber 1 of a socket whose topic is empty, over `wire`.
    async fn feed(
        wire: &[u8],
        subs: &Mutex<Vec<Sub>>,
        tx: &mpsc::UnboundedSender<Out>,
    ) -> Result<()> {
        read_loop(&mut &wire[..], 1, b"", subs, tx, &AtomicBool::new(false)).await
    }

    /// A peer that floods PINGs and reads nothing has one PONG queued for it, not one per PING.
    #[tokio::test]
    async fn a_ping_flood_queues_one_pong() {
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING");
        ping.extend_from_slice(&[0, 100]); // TTL
        ping.extend_from_slice(&[9u8; 200]); // a context longer than RFC 37's 16 bytes
        let mut wire = Vec::new();
        for _ in 0..10_000 {
            write_frame(&mut wire, 0x04, &ping).await.unwrap();
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        let subs = one_sub(&tx);
        feed(&wire, &subs, &tx).await.unwrap();
        assert_eq!(rx.len(), 1);
        match rx.try_recv() {
            Ok(Out::Pong(ctx)) => assert_eq!(ctx.len(), 16),
            _ => panic!("not a PONG"),
        }
    }

    /// Only a message's first frame may be a subscription (a second frame that starts with
    /// 0x01 is data); a command frame marked MORE breaks the connection.
    #[tokio::test]
    async fn only_a_messages_first_frame_subscribes_and_a_command_with_more_is_an_error() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let subs = one_sub(&tx);
        let mut wire = Vec::new();
        write_frame(&mut wire, 0x01, b"x").await.unwrap();
        write_frame(&mut wire, 0, &[1]).await.unwrap();
        feed(&wire, &subs, &tx).await.unwrap();
        assert_eq!(subs.lock()[0].active, 0);
        write_frame(&mut wire, 0, &[1]).await.unwrap();
        feed(&wire, &subs, &tx).await.unwrap();
        assert_eq!(subs.lock()[0].active, 1);
        let mut bad = Vec::new();
        write_frame(&mut bad, 0x05, b"\x04PING\0\0").await.unwrap();
        assert!(feed(&bad, &subs, &tx).await.is_err());
    }

    /// The replay socket answers a requester's PING (a DEALER with `ZMQ_HEARTBEAT_IVL`
    /// would drop a peer that does not).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_replay_socket_answers_pings() {
        let stats = Arc::new(ReplayStats::default());
        let r = ReplaySocket::bind("127.0.0.1:0", Bytes::new(), Arc::new(|_| None), stats)
            .await
            .unwrap();
        let mut s = peer(r.local, b"DEALER").await;
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING");
        ping.extend_from_slice(&[0, 10]);
        ping.extend_from_slice(b"ctx");
        write_frame(&mut s, 0x04, &ping).await.unwrap();
        let mut greeting = [0u8; 64];
        s.read_exact(&mut greeting).await.unwrap();
        let (_, ready) = read_frame(&mut s).await.unwrap();
        assert_eq!(command_name(&ready).unwrap(), b"READY");
        let (flags, body) = tokio::time::timeout(Duration::from_secs(30), read_frame(&mut s))
            .await
            .expect("a PONG within 30 s")
            .unwrap();
        assert_eq!((flags, body), (0x04, pong(b"ctx")));
    }

    /// A replay answers with what was buffered when the request came, not what is published
    /// while it is answered (the requester's SUB socket gets that), so it ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_replay_ends_at_what_was_buffered_when_it_was_asked_for() {
        let ring = Arc::new(Mutex::new((0u64..3).collect::<Vec<u64>>()));
        let r = ring.clone();
        let replayer: Replayer = Arc::new(move |start| {
            let mut r = r.lock();
            let newest = *r.last()?;
            let found = r.iter().find(|&&s| s >= start).copied();
            // Published meanwhile: a batch each time a batch is taken.
            r.push(newest + 1);
            found.map(|s| (s, Bytes::from_static(b"payload"), newest))
        });
        let stats = Arc::new(ReplayStats::default());
        let sock = ReplaySocket::bind("127.0.0.1:0", Bytes::new(), replayer, stats)
            .await
            .unwrap();
        let mut s = peer(sock.local, b"DEALER").await;
        write_frame(&mut s, 0x01, b"").await.unwrap();
        write_frame(&mut s, 0, &0u64.to_be_bytes()).await.unwrap();
        let mut greeting = [0u8; 64];
        s.read_exact(&mut greeting).await.unwrap();
        read_frame(&mut s).await.unwrap(); // READY
        let mut seqs = Vec::new();
        loop {
            let mut frames = Vec::new();
            loop {
                let (flags, body) =
                    tokio::time::timeout(Duration::from_secs(30), read_frame(&mut s))
                        .await
                        .expect("the replay goes on within 30 s")
                        .unwrap();
                frames.push(body);
                if flags & 0x01 == 0 {
                    break;
                }
            }
            let seq = i64::from_be_bytes(frames[2].as_slice().try_into().unwrap());
            if seq == -1 {
                break;
            }
            seqs.push(seq);
        }
        assert_eq!(seqs, [0, 1, 2]);
        assert!(
            ring.lock().len() > 3,
            "batches were published during the replay"
        );
    }

    /// One address holds at most [`MAX_PER_ADDRESS`] connections (another is still let in),
    /// and a subscriber that subscribes to nothing is disconnected after
    /// [`SUBSCRIBE_DEADLINE`] while one that did stays. (Set up in real time, with real
    /// sockets; then the clock is paused and moved past the deadline.)
    #[tokio::test]
    async fn one_address_cannot_hold_every_slot_and_an_idle_peer_goes() {
        let stats = Arc::new(PubStats::default());
        let p = PubSocket::bind("127.0.0.1:0", Bytes::from_static(b"kv"), stats.clone())
            .await
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..MAX_PER_ADDRESS {
            held.push(peer(p.local, b"SUB").await);
        }
        until("the handshakes", || {
            stats.subscribers.load(Relaxed) == MAX_PER_ADDRESS
        })
        .await;
        let mut refused = TcpStream::connect(p.local).await.unwrap();
        let mut rest = Vec::new();
        let _ = refused.read_to_end(&mut rest).await;
        assert!(rest.is_empty(), "the 65th connection was served");
        assert_eq!(stats.cut.load(Relaxed), 1);
        let mut other = peer_from([127, 0, 0, 2], p.local, b"SUB").await;
        write_frame(&mut other, 0, b"\x01kv").await.unwrap();
        until("the other address's subscriber", || {
            p.subs.lock().iter().any(|s| s.active > 0)
        })
        .await;
        // Past the deadline, the 64 that subscribed to nothing are gone, the other is not.
        tokio::time::pause();
        tokio::time::advance(SUBSCRIBE_DEADLINE + Duration::from_secs(1)).await;
        until("the idle ones cut", || stats.subscribers.load(Relaxed) == 1).await;
        assert_eq!(stats.cut.load(Relaxed), 1 + MAX_PER_ADDRESS);
        assert_eq!(p.subs.lock()[0].active, 1);
    }

    #[test]
    fn ready_properties_round_trip_and_a_short_one_is_an_error() {
        let mut b = Vec::new();
        property(&mut b, "Socket-Type", b"SUB");
        property(&mut b, "Identity", b"");
        let p = properties(&b).unwrap();
        assert_eq!(
            p,
            vec![
                (b"Socket-Type".to_vec(), b"SUB".to_vec()),
                (b"Identity".to_vec(), Vec::new())
            ]
        );
        assert!(properties(&b[..b.len() - 1]).is_err());
        assert!(properties(&b[..5]).is_err());
    }
}
