//! The remote tier: a [`LowerTier`] whose blocks live on the other members of the cluster.
//! Blocking sockets (the store's tiering worker and the engine threads call it from their own
//! threads), a small pool of authenticated connections per peer, one deadline
//! (`cluster.timeout_ms`) per call, requests to all owners sent before any reply is read, and a
//! circuit breaker per peer. A block read from a peer is read straight into its reserved host
//! slot and checked against its xxh3 checksum before the store publishes it; anything short of
//! a whole, verified block is a miss.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use kvstore::{
    BlockInfo, BlockKey, Fingerprint, LatencyBuckets, LowerTier, NsUsage, ReadItem, ReadOutcome,
    Tier, TierStats, WriteItem, WriteOutcome,
};
use kvtier_proto::cluster::{request::Op, Auth, AuthReply, Block, Hello, Reply, Request};
use kvtier_proto::CLUSTER_VERSION;
use parking_lot::{Mutex, RwLock};

use crate::placement::{Member, Placement};
use crate::wire::{self, PutOutcome};

/// Consecutive failures that open a peer's breaker.
const BREAKER_FAILURES: u32 = 3;
/// First and longest pause of an open breaker.
const BREAKER_MIN: Duration = Duration::from_millis(500);
const BREAKER_MAX: Duration = Duration::from_secs(30);
/// Idle connections kept per peer.
const POOL: usize = 4;
/// Bytes read (and hashed) at a time.
const PIECE: usize = 256 << 10;
/// PUT requests written ahead of their replies.
const WINDOW: usize = 32;

/// How the remote tier reaches the cluster.
#[derive(Clone, Debug)]
pub struct RemoteConfig {
    /// This node's data-plane address as the members list names it.
    pub me: String,
    /// The members (this node included), with weights.
    pub members: Vec<Member>,
    /// The cluster secret ("" = none).
    pub secret: String,
    /// Deadline of every call (connect, request and reply).
    pub timeout: Duration,
    /// Owners per block (the first is asked first; pushes go to all of them).
    pub replicas: usize,
}

/// What one member holds of a prefix (see [`RemoteTier::node_prefixes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePrefix {
    /// Its data-plane address.
    pub addr: String,
    /// The tier of each leading block it holds.
    pub tiers: Vec<Tier>,
    /// Why it did not answer.
    pub error: Option<String>,
}

/// A peer's state, for `kvtier cluster` and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerStatus {
    /// Its data-plane address.
    pub addr: String,
    /// `self`, `up` (answered last time), `down` (breaker open) or `unknown` (not asked yet).
    pub state: &'static str,
    /// Payload bytes received from it.
    pub bytes_in: u64,
    /// Payload bytes sent to it.
    pub bytes_out: u64,
    /// Requests that failed (timeout, refused, broken connection).
    pub failures: u64,
    /// Requests that succeeded.
    pub requests: u64,
}

#[derive(Default)]
struct Breaker {
    failures: u32,
    open_until: Option<Instant>,
    pause: Duration,
    ever_ok: bool,
}

struct Peer {
    addr: String,
    pool: Mutex<Vec<TcpStream>>,
    breaker: Mutex<Breaker>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    failures: AtomicU64,
    requests: AtomicU64,
}

impl Peer {
    fn new(addr: String) -> Self {
        Self {
            addr,
            pool: Mutex::default(),
            breaker: Mutex::default(),
            bytes_in: AtomicU64::new(0),
            bytes_out: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            requests: AtomicU64::new(0),
        }
    }

    /// Whether the breaker lets a request through now.
    fn allowed(&self) -> bool {
        let b = self.breaker.lock();
        b.open_until.is_none_or(|t| Instant::now() >= t)
    }

    fn ok(&self) {
        self.requests.fetch_add(1, Relaxed);
        let mut b = self.breaker.lock();
        if b.open_until.is_some() {
            tracing::info!(peer = %self.addr, "cluster: peer answers again");
        }
        *b = Breaker {
            ever_ok: true,
            ..Default::default()
        };
    }

    fn failed(&self, e: &io::Error) {
        self.failures.fetch_add(1, Relaxed);
        self.pool.lock().clear();
        let mut b = self.breaker.lock();
        b.failures += 1;
        if b.failures >= BREAKER_FAILURES {
            b.pause = (b.pause * 2).clamp(BREAKER_MIN, BREAKER_MAX);
            b.open_until = Some(Instant::now() + b.pause);
            tracing::warn!(peer = %self.addr, error = %e, pause_ms = b.pause.as_millis() as u64,
                "cluster: peer keeps failing: not asked until the pause ends");
        } else {
            tracing::debug!(peer = %self.addr, error = %e, "cluster: request to peer failed");
        }
    }
}

#[derive(Default)]
struct Counters {
    lookups: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    read_errors: AtomicU64,
    write_errors: AtomicU64,
    checksum_failures: AtomicU64,
}

/// The remote tier (see the module docs).
pub struct RemoteTier {
    cfg: RemoteConfig,
    placement: RwLock<Arc<Placement>>,
    peers: RwLock<HashMap<String, Arc<Peer>>>,
    /// Namespace fingerprints by local id, and back.
    ns: crate::nsmap::NsMap,
    stats: Counters,
    next_id: AtomicU64,
    /// Read and write call latencies, microseconds.
    lat: Mutex<(Histogram<u64>, Histogram<u64>)>,
}

/// A request to one peer: the keys' (or items') positions in the caller's batch.
struct Sent {
    peer: Arc<Peer>,
    conn: Option<TcpStream>,
    idx: Vec<usize>,
    id: u64,
}

impl RemoteTier {
    /// A remote tier over `cfg.members`; `cfg.me` must be one of them.
    pub fn new(cfg: RemoteConfig) -> io::Result<Self> {
        if !cfg.members.iter().any(|m| m.addr == cfg.me) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "cluster.members does not name this node's cluster.listen ({})",
                    cfg.me
                ),
            ));
        }
        let t = Self {
            placement: RwLock::new(Arc::new(Placement::new(cfg.members.clone()))),
            peers: RwLock::default(),
            ns: Default::default(),
            stats: Counters::default(),
            next_id: AtomicU64::new(1),
            lat: Mutex::new((hist()?, hist()?)),
            cfg,
        };
        t.sync_peers();
        Ok(t)
    }

    /// Replaces the members (membership changed); only blocks whose owner changed move.
    pub fn set_members(&self, members: Vec<Member>) {
        *self.placement.write() = Arc::new(Placement::new(members));
        self.sync_peers();
    }

    /// The current placement.
    pub fn placement(&self) -> Arc<Placement> {
        self.placement.read().clone()
    }

    fn sync_peers(&self) {
        let p = self.placement();
        let mut peers = self.peers.write();
        for m in p.members() {
            if m.addr != self.cfg.me && !peers.contains_key(&m.addr) {
                peers.insert(m.addr.clone(), Arc::new(Peer::new(m.addr.clone())));
            }
        }
        peers.retain(|a, _| p.members().iter().any(|m| &m.addr == a));
    }

    /// Every member's state.
    pub fn peers(&self) -> Vec<PeerStatus> {
        let p = self.placement();
        let peers = self.peers.read();
        p.members()
            .iter()
            .map(|m| match peers.get(&m.addr) {
                None => PeerStatus {
                    addr: m.addr.clone(),
                    state: "self",
                    bytes_in: 0,
                    bytes_out: 0,
                    failures: 0,
                    requests: 0,
                },
                Some(peer) => {
                    let b = peer.breaker.lock();
                    let state = if b.open_until.is_some_and(|t| Instant::now() < t) {
                        "down"
                    } else if b.failures > 0 {
                        "failing"
                    } else if b.ever_ok {
                        "up"
                    } else {
                        "unknown"
                    };
                    PeerStatus {
                        addr: m.addr.clone(),
                        state,
                        bytes_in: peer.bytes_in.load(Relaxed),
                        bytes_out: peer.bytes_out.load(Relaxed),
                        failures: peer.failures.load(Relaxed),
                        requests: peer.requests.load(Relaxed),
                    }
                }
            })
            .collect()
    }

    /// The peers to ask for `key`, best first: its owners other than this node whose breaker
    /// is closed. Empty when this node owns it (first) or no owner is reachable.
    fn owners_of(&self, p: &Placement, key: &BlockKey, for_write: bool) -> Vec<Arc<Peer>> {
        let peers = self.peers.read();
        let mut out = Vec::new();
        for (n, i) in p.owners(key, self.cfg.replicas).into_iter().enumerate() {
            let addr = &p.members()[i].addr;
            if *addr == self.cfg.me {
                if n == 0 && !for_write {
                    // Its owner is this node: the local tiers answered already.
                    return Vec::new();
                }
                continue;
            }
            if let Some(peer) = peers.get(addr).filter(|p| p.allowed()) {
                out.push(peer.clone());
            }
        }
        out
    }

    fn connect(&self, peer: &Peer, deadline: Instant) -> io::Result<TcpStream> {
        if let Some(c) = peer.pool.lock().pop() {
            return Ok(c);
        }
        let left = remaining(deadline)?;
        let addr: SocketAddr = peer
            .addr
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"))?;
        let mut s = TcpStream::connect_timeout(&addr, left)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(remaining(deadline)?))?;
        s.set_write_timeout(Some(remaining(deadline)?))?;
        let hello: Hello = wire::read_header(&mut s)?;
        if hello.version != CLUSTER_VERSION {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("peer speaks cluster protocol {}", hello.version),
            ));
        }
        wire::write_header(
            &mut s,
            &Auth {
                version: CLUSTER_VERSION,
                mac: wire::mac(&self.cfg.secret, &hello.nonce),
                node: self.cfg.me.clone(),
            },
        )?;
        let r: AuthReply = wire::read_header(&mut s)?;
        if !r.error.is_empty() {
            tracing::error!(peer = %peer.addr, error = %r.error, "cluster: the peer refused this node");
            return Err(io::Error::new(io::ErrorKind::PermissionDenied, r.error));
        }
        Ok(s)
    }

    /// Sends one request (no payload) to `peer` on a fresh or pooled connection.
    fn send(&self, peer: &Arc<Peer>, req: &Request, deadline: Instant) -> io::Result<TcpStream> {
        let mut c = self.connect(peer, deadline)?;
        c.set_write_timeout(Some(remaining(deadline)?))?;
        c.write_all(&wire::encode_header(req))?;
        Ok(c)
    }

    /// Sends one request of `op` to each peer for its keys (`key_of` each position), all
    /// before any reply is read.
    fn ask_each(
        &self,
        groups: Vec<(Arc<Peer>, Vec<usize>)>,
        op: Op,
        key_of: impl Fn(usize) -> BlockKey,
        deadline: Instant,
    ) -> Vec<(Sent, io::Result<()>)> {
        groups
            .into_iter()
            .map(|(peer, idx)| {
                let id = self.id();
                let req = Request {
                    id,
                    op: op as i32,
                    keys: wire::pack_keys(&idx.iter().map(|&i| key_of(i)).collect::<Vec<_>>()),
                    blocks: Vec::new(),
                };
                let (conn, res) = match self.send(&peer, &req, deadline) {
                    Ok(c) => (Some(c), Ok(())),
                    Err(e) => (None, Err(e)),
                };
                let s = Sent {
                    peer,
                    conn,
                    idx,
                    id,
                };
                (s, res)
            })
            .collect()
    }

    /// Reads the reply to request `id` on `c`.
    fn reply(c: &mut TcpStream, id: u64, n: usize, deadline: Instant) -> io::Result<Reply> {
        c.set_read_timeout(Some(remaining(deadline)?))?;
        let r: Reply = wire::read_header(c)?;
        if r.id != id {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("reply {} to request {id}", r.id),
            ));
        }
        if !r.error.is_empty() {
            return Err(io::Error::other(r.error));
        }
        if r.blocks.len() != n && r.outcomes.len() != n {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "reply does not answer every key",
            ));
        }
        Ok(r)
    }

    /// Records a request's outcome on `peer`; a connection that served it goes back to the
    /// pool.
    fn done(&self, peer: &Peer, conn: Option<TcpStream>, res: io::Result<()>) {
        match res {
            Ok(()) => {
                peer.ok();
                if let Some(c) = conn {
                    let mut pool = peer.pool.lock();
                    if pool.len() < POOL {
                        pool.push(c);
                    }
                }
            }
            Err(e) => peer.failed(&e),
        }
    }

    /// Groups positions by the first reachable owner of each key.
    fn group(
        &self,
        keys: impl Iterator<Item = BlockKey>,
        for_write: bool,
    ) -> Vec<(Arc<Peer>, Vec<usize>)> {
        let p = self.placement();
        let mut groups: Vec<(Arc<Peer>, Vec<usize>)> = Vec::new();
        for (i, k) in keys.enumerate() {
            let owners = self.owners_of(&p, &k, for_write);
            let take = if for_write { owners.len() } else { 1 };
            for peer in owners.into_iter().take(take) {
                match groups.iter_mut().find(|(q, _)| Arc::ptr_eq(q, &peer)) {
                    Some((_, v)) => v.push(i),
                    None => groups.push((peer, vec![i])),
                }
            }
        }
        groups
    }

    /// For routers: the longest run of leading `keys` each other member holds in its own
    /// tiers, with the tier of each block; one EXISTS to every member, all sent before any
    /// answer is read (one round trip, bounded by the deadline). A member that fails answers
    /// with its error.
    pub fn node_prefixes(&self, keys: &[BlockKey]) -> Vec<NodePrefix> {
        let deadline = Instant::now() + self.cfg.timeout;
        let (asked, paused): (Vec<Arc<Peer>>, Vec<Arc<Peer>>) = {
            let p = self.placement();
            let peers = self.peers.read();
            p.members()
                .iter()
                .filter_map(|m| peers.get(&m.addr).cloned())
                .partition(|peer| peer.allowed())
        };
        let mut out: Vec<NodePrefix> = paused
            .iter()
            .map(|peer| NodePrefix {
                addr: peer.addr.clone(),
                tiers: Vec::new(),
                error: Some("breaker open: the peer keeps failing".into()),
            })
            .collect();
        let all: Vec<usize> = (0..keys.len()).collect();
        let groups = asked.into_iter().map(|p| (p, all.clone())).collect();
        for (mut s, res) in self.ask_each(groups, Op::Exists, |i| keys[i], deadline) {
            let mut tiers = Vec::new();
            let res = res.and_then(|()| {
                let c = s
                    .conn
                    .as_mut()
                    .ok_or_else(|| io::Error::other("no connection"))?;
                let r = Self::reply(c, s.id, keys.len(), deadline)?;
                tiers = r
                    .blocks
                    .iter()
                    .take_while(|b| b.present)
                    .map(|b| if b.tier == 1 { Tier::Host } else { Tier::Disk })
                    .collect();
                Ok(())
            });
            out.push(NodePrefix {
                addr: s.peer.addr.clone(),
                tiers,
                error: res.as_ref().err().map(|e| e.to_string()),
            });
            self.done(&s.peer, s.conn, res);
        }
        out.sort_by(|a, b| a.addr.cmp(&b.addr));
        out
    }

    /// This node's data-plane address.
    pub fn me(&self) -> &str {
        &self.cfg.me
    }

    fn local_ns(&self, fp: &[u8]) -> Option<u16> {
        self.ns.id_of(&wire::fingerprint(fp)?)
    }

    fn fp_of(&self, ns: u16) -> Option<Fingerprint> {
        self.ns.fp_of(ns)
    }

    fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed)
    }
}

fn hist() -> io::Result<Histogram<u64>> {
    Histogram::new_with_bounds(1, 60_000_000, 2).map_err(|e| io::Error::other(e.to_string()))
}

fn remaining(deadline: Instant) -> io::Result<Duration> {
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

fn info_of(b: &Block, ns: Option<u16>) -> Option<BlockInfo> {
    (b.present && b.len > 0 && b.len <= wire::MAX_BLOCK).then_some(BlockInfo {
        len: b.len,
        ns: ns?,
        checksum: b.checksum,
    })
}

impl LowerTier for RemoteTier {
    fn kind(&self) -> Tier {
        Tier::Remote
    }

    fn local(&self) -> bool {
        false
    }

    fn write_behind(&self) -> bool {
        true
    }

    fn lookup(&self, key: &BlockKey) -> Option<BlockInfo> {
        self.lookup_batch(std::slice::from_ref(key)).pop().flatten()
    }

    fn lookup_batch(&self, keys: &[BlockKey]) -> Vec<Option<BlockInfo>> {
        let mut out = vec![None; keys.len()];
        let groups = self.group(keys.iter().copied(), false);
        if groups.is_empty() {
            return out;
        }
        self.stats.lookups.fetch_add(1, Relaxed);
        let deadline = Instant::now() + self.cfg.timeout;
        // Every owner is asked before any answer is read.
        let sent = self.ask_each(groups, Op::Exists, |i| keys[i], deadline);
        for (mut s, res) in sent {
            let res = res.and_then(|()| {
                let c = s
                    .conn
                    .as_mut()
                    .ok_or_else(|| io::Error::other("no connection"))?;
                let r = Self::reply(c, s.id, s.idx.len(), deadline)?;
                for (&i, b) in s.idx.iter().zip(&r.blocks) {
                    if wire::key16(&b.key) == Some(keys[i]) {
                        out[i] = info_of(b, self.local_ns(&b.fingerprint));
                    }
                }
                Ok(())
            });
            self.done(&s.peer, s.conn, res);
        }
        out
    }

    fn pin(&self, _key: &BlockKey) -> bool {
        // Peers' blocks cannot be leased from here: a lease covers local tiers only.
        false
    }

    fn unpin(&self, _key: &BlockKey) {}

    fn read(&self, items: Vec<ReadItem>) -> Vec<ReadOutcome> {
        let mut out = vec![ReadOutcome::Miss; items.len()];
        let groups = self.group(items.iter().map(|it| it.key), false);
        let started = Instant::now();
        let deadline = started + self.cfg.timeout;
        let sent = self.ask_each(groups, Op::Get, |i| items[i].key, deadline);
        for (mut s, res) in sent {
            let res = res.and_then(|()| {
                let c = s
                    .conn
                    .as_mut()
                    .ok_or_else(|| io::Error::other("no connection"))?;
                let r = Self::reply(c, s.id, s.idx.len(), deadline)?;
                // Present blocks come first, their payloads in order.
                for (&i, b) in s.idx.iter().zip(&r.blocks) {
                    if !b.present {
                        break;
                    }
                    let it = &items[i];
                    let len = b.len as usize;
                    if wire::key16(&b.key) != Some(it.key) || len == 0 || len > it.buf.cap() {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            "a block that does not fit its slot",
                        ));
                    }
                    c.set_read_timeout(Some(remaining(deadline)?))?;
                    // SAFETY: the buffer is the block's reserved host slot (or an owned
                    // buffer), `cap` >= `len` bytes, ours to fill until this call returns;
                    // engines map the arena writable, so it is never a `&mut [u8]`.
                    let dst = unsafe { kvstore::ArenaSlice::new(it.buf.as_ptr(), len) };
                    // Each piece arrives in private memory and is hashed there (in cache),
                    // then copied into the slot.
                    let mut h = kvstore::Checksummer::new();
                    let mut piece = vec![0u8; PIECE.min(len)];
                    let mut at = 0;
                    while at < len {
                        let n = PIECE.min(len - at);
                        c.read_exact(&mut piece[..n])?;
                        h.update(&piece[..n]);
                        // SAFETY: within the reserved slot (above).
                        unsafe { dst.write(at, &piece[..n]) };
                        at += n;
                    }
                    s.peer.bytes_in.fetch_add(len as u64, Relaxed);
                    self.stats.bytes_read.fetch_add(len as u64, Relaxed);
                    if h.finish() != b.checksum {
                        self.stats.checksum_failures.fetch_add(1, Relaxed);
                        tracing::warn!(peer = %s.peer.addr, key = %it.key,
                            "cluster: a block from a peer failed its checksum: a miss");
                        continue;
                    }
                    let ns = self.local_ns(&b.fingerprint);
                    if let Some(info) = info_of(b, ns) {
                        out[i] = ReadOutcome::Hit(info);
                    }
                }
                Ok(())
            });
            if res.is_err() {
                self.stats.read_errors.fetch_add(1, Relaxed);
                // Nothing of a broken reply is served.
                for &i in &s.idx {
                    out[i] = ReadOutcome::Miss;
                }
            }
            self.done(&s.peer, s.conn, res);
        }
        self.stats.reads.fetch_add(1, Relaxed);
        let _ = self
            .lat
            .lock()
            .0
            .record((started.elapsed().as_micros() as u64).max(1));
        out
    }

    fn write(
        &self,
        items: Vec<WriteItem>,
        still_wanted: &(dyn Fn(&BlockKey) -> bool + Sync),
    ) -> Vec<WriteOutcome> {
        // Blocks this node owns alone are not pushed anywhere: "cancelled" (nothing to do).
        let mut out = vec![WriteOutcome::Cancelled; items.len()];
        let started = Instant::now();
        let deadline = started + self.cfg.timeout;
        let groups = self.group(items.iter().map(|it| it.key), true);
        // A block whose other owners all have their breaker open is not "nothing to do": it
        // is busy (the pusher tries it again later), never silently left out.
        let mut sent = vec![false; items.len()];
        for (_, idx) in &groups {
            for &i in idx {
                sent[i] = true;
            }
        }
        {
            let p = self.placement();
            for (i, it) in items.iter().enumerate() {
                let elsewhere = p
                    .owners(&it.key, self.cfg.replicas)
                    .into_iter()
                    .any(|m| p.members()[m].addr != self.cfg.me);
                // (A block removed here since it was queued is simply not pushed.)
                if !sent[i] && elsewhere && still_wanted(&it.key) {
                    out[i] = WriteOutcome::Busy;
                }
            }
        }
        // One PUT per block, pipelined: up to WINDOW requests are written before their replies
        // are read, so the peer stores block i while this thread checks and sends block i+1.
        for (peer, idx) in groups {
            let mut conn: Option<TcpStream> = None;
            let mut pending: std::collections::VecDeque<(usize, u64)> = Default::default();
            let settle = |c: &mut TcpStream, (i, id): (usize, u64), out: &mut [WriteOutcome]| {
                let r = Self::reply(c, id, 1, deadline)?;
                let o = match r.outcomes.first().map(|&o| PutOutcome::from_wire(o)) {
                    Some(PutOutcome::Stored) => WriteOutcome::Written,
                    Some(PutOutcome::Present) => WriteOutcome::Present,
                    _ => WriteOutcome::Failed,
                };
                // With replicas, the best outcome of any owner counts.
                if out[i] != WriteOutcome::Written {
                    out[i] = o;
                }
                io::Result::Ok(())
            };
            let res = (|| -> io::Result<()> {
                for &i in &idx {
                    let it = &items[i];
                    if !still_wanted(&it.key) {
                        continue;
                    }
                    let Some(fp) = self.fp_of(it.ns) else {
                        out[i] = WriteOutcome::Failed;
                        continue;
                    };
                    // SAFETY: the block's slot is pinned by the caller for this call, `len`
                    // <= cap; engines map it writable: read through copies, never referenced.
                    let shared =
                        unsafe { kvstore::ArenaSlice::new(it.buf.as_ptr(), it.len as usize) };
                    // Checked against the commit checksum before it leaves: a slot an engine
                    // wrote into after its commit is not pushed (one written between this check
                    // and the send is refused by the owner, which checks what it received).
                    if shared.checksum() != it.checksum {
                        out[i] = WriteOutcome::Corrupt;
                        continue;
                    }
                    let id = self.id();
                    let req = Request {
                        id,
                        op: Op::Put as i32,
                        keys: Vec::new(),
                        blocks: vec![Block {
                            key: it.key.0.to_be_bytes().to_vec(),
                            present: true,
                            len: it.len,
                            checksum: it.checksum,
                            fingerprint: wire::fp_bytes(fp),
                            tier: 0,
                        }],
                    };
                    let c = match conn.as_mut() {
                        Some(c) => c,
                        None => conn.insert(self.connect(&peer, deadline)?),
                    };
                    c.set_write_timeout(Some(remaining(deadline)?))?;
                    c.write_all(&wire::encode_header(&req))?;
                    wire::send_arena(c, shared)?;
                    peer.bytes_out.fetch_add(u64::from(it.len), Relaxed);
                    self.stats
                        .bytes_written
                        .fetch_add(u64::from(it.len), Relaxed);
                    pending.push_back((i, id));
                    while pending.len() > WINDOW {
                        if let Some(p) = pending.pop_front() {
                            settle(c, p, &mut out)?;
                        }
                    }
                }
                if let Some(c) = conn.as_mut() {
                    while let Some(p) = pending.pop_front() {
                        settle(c, p, &mut out)?;
                    }
                }
                Ok(())
            })();
            if res.is_err() {
                self.stats.write_errors.fetch_add(1, Relaxed);
                for &i in &idx {
                    if matches!(out[i], WriteOutcome::Cancelled) && still_wanted(&items[i].key) {
                        out[i] = WriteOutcome::Failed;
                    }
                }
            }
            if conn.is_some() || res.is_err() {
                self.done(&peer, conn, res);
            }
        }
        self.stats.writes.fetch_add(1, Relaxed);
        let _ = self
            .lat
            .lock()
            .1
            .record((started.elapsed().as_micros() as u64).max(1));
        out
    }

    fn remove(&self, _key: &BlockKey) -> bool {
        // A node removes only its own copies; the owner's copy ages out by its own policy.
        false
    }

    fn clear_namespace(&self, _ns: u16) -> Vec<BlockKey> {
        Vec::new()
    }

    fn namespace_usage(&self) -> Vec<NsUsage> {
        Vec::new()
    }

    fn stats(&self) -> TierStats {
        let s = &self.stats;
        let (r, w, rl, wl) = {
            let l = self.lat.lock();
            let pct = |h: &Histogram<u64>| (h.value_at_quantile(0.5), h.value_at_quantile(0.99));
            (
                pct(&l.0),
                pct(&l.1),
                LatencyBuckets::from_hdr(&l.0),
                LatencyBuckets::from_hdr(&l.1),
            )
        };
        TierStats {
            tier: Some(Tier::Remote),
            engine: "tcp",
            queue_depth: POOL as u32,
            reads: s.reads.load(Relaxed),
            writes: s.writes.load(Relaxed),
            bytes_read: s.bytes_read.load(Relaxed),
            bytes_written: s.bytes_written.load(Relaxed),
            read_errors: s.read_errors.load(Relaxed),
            write_errors: s.write_errors.load(Relaxed),
            checksum_failures: s.checksum_failures.load(Relaxed),
            read_us: r,
            write_us: w,
            read_latency: rl,
            write_latency: wl,
            ..Default::default()
        }
    }

    fn note_namespace(&self, id: u16, fp: Fingerprint) -> io::Result<()> {
        self.ns.note(id, fp);
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
