//! The data-plane server: answers peers' EXISTS, GET and PUT from this node's own tiers (never
//! asking further: a peer asks the owner, the owner answers for itself). GET payloads are
//! written straight from the pinned arena slots; PUT payloads are read straight into reserved
//! arena slots and committed only when the whole block arrived and its checksum matched.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{BlockKey, NsId, Reserve, Store};
use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};
use kvtier_proto::CLUSTER_VERSION;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use crate::wire::{self, PutOutcome};

/// Bytes read (and hashed) at a time.
const PIECE: usize = 256 << 10;

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
        let (cfg, stats, store) = (cfg.clone(), stats.clone(), store.clone());
        conns.spawn(async move {
            if let Err(e) = connection(sock, &store, &cfg, &stats).await {
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

async fn connection(
    sock: TcpStream,
    store: &Store,
    cfg: &ServerConfig,
    stats: &ServerStats,
) -> io::Result<()> {
    sock.set_nodelay(true)?;
    let (rd, wr) = sock.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut wr = BufWriter::with_capacity(64 << 10, wr);
    let nonce: [u8; 32] = rand::random();
    wire::write_header_async(
        &mut wr,
        &Hello {
            version: CLUSTER_VERSION,
            nonce: nonce.to_vec(),
            node: cfg.node.clone(),
            capacity: cfg.capacity,
        },
    )
    .await?;
    wr.flush().await?;
    let auth: Auth = tokio::time::timeout(cfg.timeout, wire::read_header_async(&mut rd))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no Auth in time"))??;
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
        wire::write_header_async(&mut wr, &AuthReply { error }).await?;
        wr.flush().await?;
        return Ok(());
    }
    wire::write_header_async(&mut wr, &AuthReply::default()).await?;
    wr.flush().await?;
    stats.connections.fetch_add(1, Relaxed);
    let mut scratch = vec![0u8; 256 << 10];
    loop {
        let req: Request = match wire::read_header_async(&mut rd).await {
            Ok(r) => r,
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        stats.requests.fetch_add(1, Relaxed);
        match Op::try_from(req.op) {
            Ok(Op::Exists) => {
                let reply = match wire::unpack_keys(&req.keys) {
                    Some(keys) => Reply {
                        id: req.id,
                        blocks: exists(store, &keys),
                        ..Default::default()
                    },
                    None => bad(req.id, "keys are not a whole number of 16-byte keys"),
                };
                wire::write_header_async(&mut wr, &reply).await?;
            }
            Ok(Op::Get) => {
                let Some(keys) = wire::unpack_keys(&req.keys) else {
                    wire::write_header_async(&mut wr, &bad(req.id, "bad keys")).await?;
                    wr.flush().await?;
                    continue;
                };
                let deadline = Instant::now() + cfg.timeout;
                let loaded = tokio::task::block_in_place(|| store.load_local(&keys, deadline));
                let loaded = match loaded {
                    Ok(l) => l,
                    Err(e) => {
                        wire::write_header_async(&mut wr, &bad(req.id, &e.to_string())).await?;
                        wr.flush().await?;
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
                wire::write_header_async(&mut wr, &reply).await?;
                wr.flush().await?;
                // Straight from the pinned slots: the kernel copies out of the arena (engines
                // map it writable: never a Rust reference into it, and no copy of ours; the
                // peer checks what it received against the checksum above).
                for i in 0..n {
                    let b = loaded.arena_block(i);
                    send_arena(wr.get_ref().as_ref(), b).await?;
                    stats.bytes_out.fetch_add(b.len() as u64, Relaxed);
                }
                drop(loaded);
            }
            Ok(Op::Put) => {
                let mut outcomes = Vec::with_capacity(req.blocks.len());
                for b in &req.blocks {
                    if b.len == 0 || b.len > wire::MAX_BLOCK {
                        // The stream cannot be resynchronised past a length we refuse.
                        let error = format!("block of {} bytes", b.len);
                        wire::write_header_async(&mut wr, &bad(req.id, &error)).await?;
                        wr.flush().await?;
                        return Err(io::Error::new(io::ErrorKind::InvalidData, error));
                    }
                    let o = put_one(store, cfg, stats, b, &mut rd, &mut scratch).await?;
                    outcomes.push(o as u32);
                }
                let reply = Reply {
                    id: req.id,
                    outcomes,
                    ..Default::default()
                };
                wire::write_header_async(&mut wr, &reply).await?;
            }
            _ => {
                wire::write_header_async(&mut wr, &bad(req.id, "unknown operation")).await?;
            }
        }
        wr.flush().await?;
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
                rd.read_exact(&mut piece[..n]).await?;
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
                rd.read_exact(&mut scratch[..n]).await?;
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
