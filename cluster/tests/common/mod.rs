//! What the cluster tests share: stores in one process, each with its data-plane server on a
//! real loopback socket and the remote tier in its chain; a fault proxy for links.

#![allow(dead_code)]

pub mod proxy;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstore::{BlockKey, Namespace, NsId, Store, StoreConfig, TpShard};
use kvtier_cluster::{serve, Member, RemoteConfig, RemoteTier, ServerConfig, ServerStats};

/// Runs `f` on a thread of its own and waits for its answer: a test that would hang fails
/// instead once `limit` passed (many times any deadline under test: a hang, not a slow machine).
pub fn answered<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what}: no answer within {limit:?}"))
}

pub struct Node {
    pub addr: String,
    pub store: &'static Store,
    pub remote: Arc<RemoteTier>,
    pub stats: Arc<ServerStats>,
    pub server: tokio::task::JoinHandle<()>,
}

pub fn ns() -> Namespace {
    Namespace {
        model: "cluster-test".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 16,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

/// `n` nodes with 1.5 s deadlines.
pub async fn cluster(n: usize, secrets: &[&str]) -> Vec<Node> {
    cluster_timed(n, secrets, DEADLINE).await
}

/// `n` nodes with deadlines of `timeout` (set-up, requests, peers' requests).
pub async fn cluster_timed(n: usize, secrets: &[&str], timeout: Duration) -> Vec<Node> {
    cluster_with(n, secrets, timeout, StoreConfig::default().push_retry_first).await
}

/// [`cluster_timed`], a failed push's first retry after `push_retry_first`.
pub async fn cluster_with(
    n: usize,
    secrets: &[&str],
    timeout: Duration,
    push_retry_first: Duration,
) -> Vec<Node> {
    let mut listeners = Vec::new();
    for _ in 0..n {
        listeners.push(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let addrs: Vec<String> = listeners
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect();
    let mut nodes = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let secret = secrets[i.min(secrets.len() - 1)];
        nodes.push(node_with(
            l,
            &addrs[i],
            &addrs,
            secret,
            timeout,
            push_retry_first,
        ));
    }
    nodes
}

/// The tests' deadline per peer request and connection set-up.
pub const DEADLINE: Duration = Duration::from_millis(1500);

/// One node serving on `l`, named `me` among `members` (its data-plane address, or that of
/// a proxy in front of it), with 1.5 s deadlines.
pub fn node(l: tokio::net::TcpListener, me: &str, members: &[String], secret: &str) -> Node {
    node_timed(l, me, members, secret, DEADLINE)
}

/// [`node`] with deadlines of `timeout`.
pub fn node_timed(
    l: tokio::net::TcpListener,
    me: &str,
    members: &[String],
    secret: &str,
    timeout: Duration,
) -> Node {
    let first = StoreConfig::default().push_retry_first;
    node_with(l, me, members, secret, timeout, first)
}

/// [`node_timed`], a failed push's first retry after `push_retry_first`.
pub fn node_with(
    l: tokio::net::TcpListener,
    me: &str,
    members: &[String],
    secret: &str,
    timeout: Duration,
    push_retry_first: Duration,
) -> Node {
    let members: Vec<Member> = members
        .iter()
        .map(|a| Member::new(a.clone(), 1.0))
        .collect();
    let remote = Arc::new(
        RemoteTier::new(RemoteConfig {
            me: me.to_string(),
            members,
            secret: secret.to_string(),
            timeout,
            replicas: 1,
            handoff: Duration::from_secs(600),
        })
        .unwrap(),
    );
    let store: &'static Store = Box::leak(Box::new(
        StoreConfig {
            capacity_bytes: 64 << 20,
            segment_bytes: 16 << 20,
            remote: Some(kvstore::SharedTier(remote.clone())),
            push_retry_first,
            ..Default::default()
        }
        .build()
        .unwrap(),
    ));
    let stats = Arc::new(ServerStats::default());
    let server = tokio::spawn(serve(
        l,
        store,
        ServerConfig {
            node: me.to_string(),
            secret: secret.to_string(),
            capacity: store.capacity_bytes(),
            timeout,
        },
        stats.clone(),
    ));
    Node {
        addr: me.to_string(),
        store,
        remote,
        stats,
        server,
    }
}

/// `node`'s data-plane server started again on its address (its store as it is), with
/// deadlines of `timeout`.
pub async fn serve_again(
    node: &Node,
    secret: &str,
    timeout: Duration,
) -> tokio::task::JoinHandle<()> {
    let l = tokio::net::TcpListener::bind(&node.addr).await.unwrap();
    tokio::spawn(serve(
        l,
        node.store,
        ServerConfig {
            node: node.addr.clone(),
            secret: secret.into(),
            capacity: node.store.capacity_bytes(),
            timeout,
        },
        node.stats.clone(),
    ))
}

/// Saves each of `data` under its key in `node`'s store; returns how many of the keys
/// placement (as `node` sees it) gives `owner`.
pub fn put_owned(
    node: &Node,
    id: NsId,
    keys: &[BlockKey],
    data: &[Vec<u8>],
    owner: &Node,
) -> usize {
    for (k, d) in keys.iter().zip(data) {
        node.store.put(id, *k, d).unwrap();
    }
    let p = node.remote.placement();
    keys.iter()
        .filter(|k| p.owner(k) == Some(owner.addr.as_str()))
        .count()
}

pub fn blocks(n: usize, seed: u8) -> (Vec<BlockKey>, Vec<Vec<u8>>) {
    let keys = ns().token_keys(&vec![u32::from(seed) + 1; 16 * n], &[]);
    let data = (0..n)
        .map(|i| {
            (0..100_000 + i * 4096)
                .map(|j| (j as u8) ^ (i as u8) ^ seed)
                .collect()
        })
        .collect();
    (keys, data)
}

/// [`blocks`] of the first seed from `seed` on whose keys `placement` gives `owner` at least one
/// (placement hashes the members' addresses, which are random ports: a test about one
/// member's blocks must not depend on the draw).
pub fn blocks_owned_by(
    n: usize,
    seed: u8,
    placement: &kvtier_cluster::Placement,
    owner: &str,
) -> (Vec<BlockKey>, Vec<Vec<u8>>) {
    (seed..=u8::MAX)
        .map(|s| blocks(n, s))
        .find(|(keys, _)| keys.iter().any(|k| placement.owner(k) == Some(owner)))
        .expect("some seed gives the owner a block")
}

pub fn register(nodes: &[Node]) -> NsId {
    let mut id = None;
    for n in nodes {
        id = Some(n.store.register_namespace(&ns()).unwrap());
    }
    id.unwrap()
}

/// Whether `f` held within `secs` seconds, asked every 20 ms. The conditions tests wait for
/// here are other stores' contents, counters and sockets, with no event to wait on: this is
/// the one place they are polled, always against a deadline.
pub fn poll_until(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `f` holds; fails the test naming `what` past `secs` seconds.
pub fn wait_until(what: &str, secs: u64, f: impl FnMut() -> bool) {
    assert!(poll_until(secs, f), "{what}: not within {secs} s");
}

/// Waits until every key is held by its owner.
pub fn wait_placed(nodes: &[Node], keys: &[BlockKey]) {
    let p = nodes[0].remote.placement();
    let missing = || -> Vec<(BlockKey, String)> {
        keys.iter()
            .filter(|k| {
                let owner = p.owner(k).unwrap();
                let n = nodes.iter().find(|n| n.addr == owner).unwrap();
                n.store.probe_local(std::slice::from_ref(k))[0].is_none()
            })
            .map(|k| (*k, p.owner(k).unwrap().to_string()))
            .collect()
    };
    // (A push that timed out is tried again 1, 4 and 16 s later.)
    if !poll_until(60, || missing().is_empty()) {
        panic!(
            "blocks did not reach their owners: {:?}; saver: {:?}",
            missing(),
            nodes[0].store.stats()
        );
    }
}

/// What `node`'s remote tier says of its peer at `addr` (breaker state, failures).
pub fn peer_status(node: &Node, addr: &str) -> kvtier_cluster::PeerStatus {
    node.remote
        .peers()
        .into_iter()
        .find(|p| p.addr == addr)
        .expect("a member")
}

/// One block to write through a remote tier directly (as the store's pusher does).
pub fn write_item(key: BlockKey, ns: NsId, data: &[u8]) -> kvstore::WriteItem {
    kvstore::WriteItem {
        key,
        ns: ns.0 as u16,
        // SAFETY: the tests keep `data` alive past the write and never write it.
        buf: unsafe { kvstore::io::IoBuf::from_raw(data.as_ptr() as *mut u8, data.len()) },
        len: data.len() as u32,
        checksum: kvstore::checksum(data),
    }
}

/// The first of `keys` that `owner` owns in `node`'s placement.
pub fn first_owned_by(node: &Node, keys: &[BlockKey], owner: &str) -> usize {
    let p = node.remote.placement();
    (0..keys.len())
        .find(|&i| p.owner(&keys[i]) == Some(owner))
        .expect("a key of the owner's")
}
