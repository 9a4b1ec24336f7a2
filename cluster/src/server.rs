//! The data-plane server: answers peers' EXISTS, GET and PUT from this node's own tiers (never
//! asking further: a peer asks the owner, the owner answers for itself). GET payloads are
//! written straight from the pinned arena slots; PUT payloads are read straight into reserved
//! arena slots and committed only when the whole block arrived and its checksum matched.
//!
//! Every peer is untrusted until it authenticates, and fallible after: at most
//! [`MAX_UNAUTHENTICATED`] connections may be setting up at once, [`MAX_UNAUTHENTICATED_PER_IP`]
//! from one address (more are closed at accept and counted: a flood from one host leaves room
//! for the members), a connection holds no buffer until it authenticated, a frame before
//! `Auth` is at most [`wire::MAX_AUTH_HEADER`] bytes, every read
//! and write past the first byte of a request has a deadline (`cluster.timeout_ms`), and TCP
//! keepalive notices a peer that vanished from an idle connection. A PUT whose payload stops
//! coming frees its reservation when its deadline passes; a GET to a peer that stopped
//! reading unpins its blocks when its deadline passes.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{BlockKey, NsId, Reserve, Store};
use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};
use kvtier_proto::CLUSTER_VERSION;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use crate::wire::{self, PutOutcome};

/// Bytes read (and hashed) at a time.
const PIECE: usize = 256 << 10;
/// Connections accepted but not yet authenticated, at most (more are closed at once).
pub const MAX_UNAUTHENTICATED: usize = 256;
/// The same, from one IP address.
pub const MAX_UNAUTHENTICATED_PER_IP: usize = 16;

/// Connections setting up, by source address.
#[derive(Default)]
pub(crate) struct SettingUp(
    parking_lot::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
);

/// One connection's place among those setting up; given back when dropped.
pub(crate) struct Permit(Arc<SettingUp>, std::net::IpAddr);

impl SettingUp {
    pub(crate) fn enter(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<Permit> {
        let mut g = self.0.lock();
        let (total, by_ip) = &mut *g;
        let n = by_ip.entry(ip).or_default();
        if *total >= MAX_UNAUTHENTICATED || *n >= MAX_UNAUTHENTICATED_PER_IP {
            return None;
        }
        *n += 1;
        *total += 1;
        Some(Permit(self.clone(), ip))
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut g = self.0 .0.lock();
        let (total, by_ip) = &mut *g;
        *total -= 1;
        if let Some(n) = by_ip.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                by_ip.remove(&self.1);
            }
        }
    }
}

/// What the server needs to know.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// This node's data-plane address as the cluster names it.
    pub node: String,
    /// The cluster secret ("" = none: loopback only).
    pub secret: String,
    /// Bytes of block space advertised in Hello.
    pub capacity: u64,
    /// Longest a peer's request may wait for room or a promotion, and for its next bytes.
    pub timeout: Duration,
}

/// The server's counters.
#[derive(Debug, Default)]
pub struct ServerStats {
    /// Connections accepted and authenticated.
    pub connections: AtomicU64,
    /// Connections refused at set-up (wrong secret or version).
    pub auth_failures: AtomicU64,
    /// Connections closed before authenticating: no `Auth` within the timeout.
    pub auth_timeouts: AtomicU64,
    /// Connections closed before authenticating: an oversized or undecodable frame.
    pub auth_bad_frames: AtomicU64,
    /// Connections closed at accept: [`MAX_UNAUTHENTICATED`] (or as many from its address)
    /// were setting up already.
    pub refused: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Payload bytes sent to peers (GET).
    pub bytes_out: AtomicU64,
    /// Payload bytes received from peers (PUT).
    pub bytes_in: AtomicU64,
    /// Blocks stored for peers.
    pub stored: AtomicU64,
    /// Blocks peers sent whose bytes did not match their checksum (not stored).
    pub corrupt: AtomicU64,
}

/// Serves peers on `listener` until the task is dropped. `store`: a `&'static Store` (the
/// daemon's) or an `Arc<Store>`.
pub async fn serve<S>(listener: TcpListener, store: S, cfg: ServerConfig, stats: Arc<ServerStats>)
where
    S: std::ops::Deref<Target = Store> + Clone + Send + Sync + 'static,
{
    let cfg = Arc::new(cfg);
    let setting_up = Arc::new(SettingUp::default());
    // Connections live in the set: when this task is dropped (the daemon stops serving),
    // they end with it.
    let mut conns = tokio::task::JoinSet::new();
    loop {
        while conns.try_join_next().is_some() {}
        let (sock, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "cluster: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(permit) = setting_up.enter(peer.ip()) else {
            // A flood of connections that never authenticate: the newest are closed at once
            // (peers retry; a pooled authenticated connection is not affected).
            if stats.refused.fetch_add(1, Relaxed).is_multiple_of(1000) {
                tracing::warn!(%peer, "cluster: too many connections setting up: refused");
            }
            drop(sock);
            continue;
        };
        let (cfg, stats, store) = (cfg.clone(), stats.clone(), store.clone());
        conns.spawn(async move {
            if let Err(e) = connection(sock, &store, &cfg, &stats, permit).await {
                if !matches!(
                    e.kind(),
                    io::ErrorKind::UnexpectedEof
                        | io::ErrorKind::ConnectionReset
                        | io::ErrorKind::BrokenPipe
                ) {
                    tracing::warn!(%peer, error = %e, "cluster: peer connection ended");
                }
            }
        });
    }
}

/// `f`, or `TimedOut` once `deadline` passed.
async fn by<T>(
    deadline: tokio::time::Instant,
    what: &str,
    f: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    tokio::time::timeout_at(deadline, f)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what}: cluster.timeout_ms passed"),
            ))
        })
}

fn soon(cfg: &ServerConfig) -> tokio::time::Instant {
    tokio::time::Instant::now() + cfg.timeout
}

pub(crate) async fn connection(
    sock: TcpStream,
    store: &Store,
    cfg: &ServerConfig,
    stats: &ServerStats,
    permit: Permit,
) -> io::Result<()> {
    sock.set_nodelay(true)?;
    wire::keepalive(&sock)?;
    // No buffers until the peer authenticated: set-up frames are small and few.
    let (mut rd, mut wr) = sock.into_split();
    let nonce: [u8; 32] = rand::random();
    let setup = soon(cfg);
    by(setup, "Hello", async {
        let hello = Hello {
            version: CLUSTER_VERSION,
            nonce: nonce.to_vec(),
            node: cfg.node.clone(),
            capacity: cfg.capacity,
        };
        wire::write_header_async(&mut wr, &hello).await
    })
    .await?;
    let auth: Auth = match by(
        setup,
        "Auth",
        wire::read_header_async(&mut rd, wire::MAX_AUTH_HEADER),
    )
    .await
    {
        Ok(a) => a,
        Err(e) => {
            match e.kind() {
                io::ErrorKind::TimedOut => &stats.auth_timeouts,
                io::ErrorKind::InvalidData => &stats.auth_bad_frames,
                _ => return Err(e),
            }
            .fetch_add(1, Relaxed);
            return Err(e);
        }
    };
    let refuse = if auth.version != CLUSTER_VERSION {
        Some(format!(
            "cluster protocol version {} (this node speaks {CLUSTER_VERSION})",
            auth.version
        ))
    } else if !wire::mac_ok(&cfg.secret, &nonce, &auth.mac) {
        Some("wrong cluster secret (cluster.secret differs between the nodes)".to_string())
    } else {
        None
    };
    if let Some(error) = refuse {
        stats.auth_failures.fetch_add(1, Relaxed);
        tracing::warn!(peer = %auth.node, %error, "cluster: peer refused");
        let reply = AuthReply { error };
        by(
            setup,
            "AuthReply",
            wire::write_header_async(&mut wr, &reply),
        )
        .await?;
        return Ok(());
    }
    let reply = AuthReply::default();
    by(
        setup,
        "AuthReply",
        wire::write_header_async(&mut wr, &reply),
    )
    .await?;
    drop(permit);
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    stats.connections.fetch_add(1, Relaxed);
    let mut scratch = vec![0u8; 256 << 10];
    loop {
        // An authenticated connection may idle between requests (peers pool them; keepalive
        // notices a vanished one); once a request starts, all of it has a deadline.
        if rd.fill_buf().await?.is_empty() {
            return Ok(());
        }
        let deadline = soon(cfg);
        let req: Request = by(
            deadline,
            "request",
            wire::read_header_async(&mut rd, wire::MAX_HEADER),
        )
        .await?;
        stats.requests.fetch_add(1, Relaxed);
        match Op::try_from(req.op) {
            Ok(Op::Exists) => {
                let reply = match wire::unpack_keys(&req.keys) {
                    Some(keys) => {
                        let blocks = exists(store, &keys);
                        let (load_seconds, load_measured) = load_seconds(store, &blocks);
                        Reply {
                            id: req.id,
                            blocks,
                            load_seconds,
                            load_measured,
                            ..Default::default()
                        }
                    }
                    None => bad(req.id, "keys are not a whole number of 16-byte keys"),
                };
                by(deadline, "reply", wire::write_header_async(&mut wr, &reply)).await?;
            }
            Ok(Op::Get) => {
                let Some(keys) = wire::unpack_keys(&req.keys) else {
                    let reply = bad(req.id, "bad keys");
                    by(deadline, "reply", wire::write_header_async(&mut wr, &reply)).await?;
                    by(deadline, "reply", wr.flush()).await?;
                    continue;
                };
                let load_by = Instant::now() + cfg.timeout;
                let loaded = tokio::task::block_in_place(|| store.load_local(&keys, load_by));
                let loaded = match loaded {
                    Ok(l) => l,
                    Err(e) => {
                        let reply = bad(req.id, &e.to_string());
                        by(deadline, "reply", wire::write_header_async(&mut wr, &reply)).await?;
                        by(deadline, "reply", wr.flush()).await?;
                        continue;
                    }
                };
                let n = loaded.len();
                let fps = exists(store, &keys[..n]);
                let blocks = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| {
                        if i < n {
                            Block {
                                key: k.0.to_be_bytes().to_vec(),
                                present: true,
                                len: loaded.arena_block(i).len() as u32,
                                checksum: loaded.checksum(i),
                                fingerprint: fps[i].fingerprint.clone(),
                                tier: fps[i].tier,
                            }
                        } else {
                            absent(k)
                        }
                    })
                    .collect();
                let reply = Reply {
                    id: req.id,
                    blocks,
                    ..Default::default()
                };
                // The blocks stay pinned while they are sent: to a peer that stopped reading,
                // until the deadline (then the connection ends and the pins go).
                let send_by = soon(cfg);
                by(send_by, "GET reply", async {
                    wire::write_header_async(&mut wr, &reply).await?;
                    wr.flush().await?;
                    // Straight from the pinned slots: the kernel copies out of the arena
                    // (engines map it writable: never a Rust reference into it, and no copy of
                    // ours; the peer checks what it received against the checksum above).
                    for i in 0..n {
                        let b = loaded.arena_block(i);
                        send_arena(wr.get_ref().as_ref(), b).await?;
                        stats.bytes_out.fetch_add(b.len() as u64, Relaxed);
                    }
                    Ok(())
                })
                .await?;
                drop(loaded);
            }
            Ok(Op::Put) => {
                let mut outcomes = Vec::with_capacity(req.blocks.len());
                for b in &req.blocks {
                    if b.len == 0 || b.len > wire::MAX_BLOCK {
                        // The stream cannot be resynchronised past a length we refuse.
                        let error = format!("block of {} bytes", b.len);
                        let reply = bad(req.id, &error);
                        by(deadline, "reply", async {
                            wire::write_header_async(&mut wr, &reply).await?;
                            wr.flush().await
                        })
                        .await?;
                        return Err(io::Error::new(io::ErrorKind::InvalidData, error));
                    }
                    // The payload follows its header at once: all of it within a deadline
                    // (else the reservation is dropped, its slot freed, and the connection
                    // ends).
                    let o = put_one(store, cfg, stats, b, &mut rd, &mut scratch).await?;
                    outcomes.push(o as u32);
                }
                let reply = Reply {
                    id: req.id,
                    outcomes,
                    ..Default::default()
                };
                by(
                    soon(cfg),
                    "reply",
                    wire::write_header_async(&mut wr, &reply),
                )
                .await?;
            }
            _ => {
                let reply = bad(req.id, "unknown operation");
                by(deadline, "reply", wire::write_header_async(&mut wr, &reply)).await?;
            }
        }
        by(soon(cfg), "reply", wr.flush()).await?;
    }
}

/// One block of a PUT: its payload is read into a reserved slot (or skipped), committed only
/// whole and with a matching checksum.
async fn put_one(
    store: &Store,
    cfg: &ServerConfig,
    stats: &ServerStats,
    b: &Block,
    rd: &mut (impl AsyncReadExt + Unpin),
    scratch: &mut [u8],
) -> io::Result<PutOutcome> {
    let len = b.len as usize;
    let target = match (wire::key16(&b.key), wire::fingerprint(&b.fingerprint)) {
        (Some(key), Some(fp)) => store.register_fingerprint(fp).ok().map(|ns| (key, ns)),
        _ => None,
    };
    let reserved = match target {
        Some((key, ns)) => {
            let deadline = Instant::now() + cfg.timeout;
            tokio::task::block_in_place(|| reserve(store, ns, key, len, deadline))
        }
        None => Err(PutOutcome::Failed),
    };
    // (Waiting for room took up to a timeout of its own: the payload gets a fresh one.)
    let deadline = soon(cfg);
    match reserved {
        Ok(mut r) => {
            // Each piece arrives in private memory, is hashed there, then copied into the
            // reserved slot (shared memory: never a `&mut [u8]` into it).
            let mut h = kvstore::Checksummer::new();
            // SAFETY: the reservation's slot, `len` bytes of the arena, reserved for this
            // writer until its commit or drop below.
            let slot = unsafe { kvstore::ArenaSlice::new(r.as_mut_ptr(), len) };
            let mut piece = vec![0u8; PIECE.min(len)];
            let mut off = 0;
            while off < len {
                let n = (len - off).min(PIECE);
                by(deadline, "PUT payload", rd.read_exact(&mut piece[..n])).await?;
                h.update(&piece[..n]);
                // SAFETY: within the reserved slot, which is ours to fill.
                unsafe { slot.write(off, &piece[..n]) };
                off += n;
            }
            stats.bytes_in.fetch_add(len as u64, Relaxed);
            let sum = h.finish();
            if sum != b.checksum {
                stats.corrupt.fetch_add(1, Relaxed);
                tracing::warn!(key = ?wire::key16(&b.key), "cluster: a peer's block failed its checksum: not stored");
                return Ok(PutOutcome::Corrupt);
            }
            match r.commit_with_checksum(sum) {
                Ok(true) => {
                    stats.stored.fetch_add(1, Relaxed);
                    Ok(PutOutcome::Stored)
                }
                _ => Ok(PutOutcome::Failed),
            }
        }
        Err(o) => {
            // Not stored: the payload is read and dropped (the stream goes on).
            let mut left = len;
            while left > 0 {
                let n = left.min(scratch.len());
                by(deadline, "PUT payload", rd.read_exact(&mut scratch[..n])).await?;
                left -= n;
            }
            stats.bytes_in.fetch_add(len as u64, Relaxed);
            Ok(o)
        }
    }
}

fn reserve(
    store: &Store,
    ns: NsId,
    key: BlockKey,
    len: usize,
    deadline: Instant,
) -> Result<kvstore::Reservation, PutOutcome> {
    match store.reserve_replica(ns, key, len, deadline) {
        Ok(Reserve::Slot(r)) => Ok(r),
        Ok(Reserve::AlreadyPresent) | Ok(Reserve::InFlight) => Err(PutOutcome::Present),
        Err(_) => Err(PutOutcome::Failed),
    }
}

/// One Block per key: what this node's own tiers hold (and in which tier).
fn exists(store: &Store, keys: &[BlockKey]) -> Vec<Block> {
    store
        .probe_local(keys)
        .into_iter()
        .zip(keys)
        .map(|(info, k)| {
            match info.and_then(|(i, t)| {
                store
                    .fingerprint(NsId(u32::from(i.ns)))
                    .map(|fp| (i, t, fp))
            }) {
                Some((i, t, fp)) => Block {
                    key: k.0.to_be_bytes().to_vec(),
                    present: true,
                    len: i.len,
                    checksum: i.checksum,
                    fingerprint: wire::fp_bytes(fp),
                    tier: match t {
                        kvstore::Tier::Host => 1,
                        _ => 2,
                    },
                },
                None => absent(k),
            }
        })
        .collect()
}

/// What bringing the leading present `blocks` into host memory costs here (see
/// `Store::load_seconds`).
fn load_seconds(store: &Store, blocks: &[Block]) -> (f64, bool) {
    let held: Vec<(kvstore::Tier, u64)> = blocks
        .iter()
        .take_while(|b| b.present)
        .map(|b| {
            let t = if b.tier == 1 {
                kvstore::Tier::Host
            } else {
                kvstore::Tier::Disk
            };
            (t, u64::from(b.len))
        })
        .collect();
    store.load_seconds(&held)
}

fn absent(k: &BlockKey) -> Block {
    Block {
        key: k.0.to_be_bytes().to_vec(),
        ..Default::default()
    }
}

fn bad(id: u64, error: &str) -> Reply {
    Reply {
        id,
        error: error.to_string(),
        ..Default::default()
    }
}

/// Sends `b`, bytes of the shared arena, on `sock` (`wire::send_arena_once`: no copy, no
/// reference).
async fn send_arena(sock: &TcpStream, b: kvstore::ArenaSlice<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let mut at = 0;
    while at < b.len() {
        sock.writable().await?;
        match sock.try_io(tokio::io::Interest::WRITABLE, || {
            wire::send_arena_once(sock.as_raw_fd(), b, at)
        }) {
            Ok(n) => at += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
