//! Membership on etcd: each node registers itself (address, capacity, version) under a lease
//! it keeps alive, and watches the member prefix; a member whose lease lapses leaves the
//! placement. etcd unreachable: the last known membership stays (the node reports itself
//! degraded and keeps serving); once etcd answers again the node registers anew.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_proto::etcd::{
    event::EventType, kv_client::KvClient, lease_client::LeaseClient, watch_client::WatchClient,
    watch_request::RequestUnion, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest,
    PutRequest, RangeRequest, WatchCreateRequest, WatchRequest,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::placement::Member;
use crate::remote::RemoteTier;

/// How this node takes part.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// etcd client URLs (`http://host:port`), tried in order.
    pub endpoints: Vec<String>,
    /// Key prefix of the members (one key per member: prefix + its address).
    pub prefix: String,
    /// Lease TTL: a member that stops renewing leaves after it.
    pub ttl: Duration,
    /// Deadline of each request to etcd.
    pub timeout: Duration,
    /// This node's data-plane address.
    pub me: String,
    /// Bytes of block space it advertises (its placement weight).
    pub capacity: u64,
    /// Its version.
    pub version: String,
}

/// Membership state, for status and metrics.
#[derive(Debug, Default)]
pub struct MembershipState {
    /// etcd is unreachable: the last known membership is in use.
    pub degraded: AtomicBool,
    /// Members in the placement now.
    pub members: AtomicU64,
    /// Membership changes applied.
    pub changes: AtomicU64,
    /// This node's lease (0: none).
    lease: AtomicI64,
}

/// Keeps this node registered and the remote tier's members current, until the task is
/// dropped. Never returns.
pub async fn run_etcd(cfg: EtcdConfig, remote: Arc<RemoteTier>, state: Arc<MembershipState>) {
    let mut pause = Duration::from_millis(200);
    loop {
        let started = Instant::now();
        let e = session(&cfg, &remote, &state).await;
        state.lease.store(0, Relaxed);
        if !state.degraded.swap(true, Relaxed) {
            tracing::warn!(error = %e, "cluster: etcd unreachable: keeping the last known membership (degraded), still serving");
        } else {
            tracing::debug!(error = %e, "cluster: etcd still unreachable");
        }
        if started.elapsed() > Duration::from_secs(10) {
            pause = Duration::from_millis(200);
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Revokes this node's lease (a clean shutdown leaves the placement at once).
pub async fn leave(cfg: &EtcdConfig, state: &MembershipState) {
    let id = state.lease.swap(0, Relaxed);
    if id == 0 {
        return;
    }
    if let Ok(ch) = connect(&cfg.endpoints, cfg.timeout).await {
        let mut lease = LeaseClient::new(ch);
        let _ =
            tokio::time::timeout(cfg.timeout, lease.lease_revoke(LeaseRevokeRequest { id })).await;
    }
}

async fn connect(endpoints: &[String], timeout: Duration) -> Result<Channel, String> {
    let mut last = String::from("no cluster.etcd endpoint");
    for url in endpoints {
        let ep = match Endpoint::from_shared(url.clone()) {
            Ok(e) => e.connect_timeout(timeout),
            Err(e) => {
                last = format!("{url}: {e}");
                continue;
            }
        };
        match tokio::time::timeout(timeout, ep.connect()).await {
            Ok(Ok(ch)) => return Ok(ch),
            Ok(Err(e)) => last = format!("{url}: {e}"),
            Err(_) => last = format!("{url}: no answer within {timeout:?}"),
        }
    }
    Err(last)
}

/// The end of a prefix range: the prefix with its last byte incremented.
fn prefix_end(p: &[u8]) -> Vec<u8> {
    let mut e = p.to_vec();
    while let Some(last) = e.pop() {
        if last < 0xff {
            e.push(last + 1);
            return e;
        }
    }
    vec![0]
}

/// A member's record: `addr=… capacity=… version=…`.
fn record(cfg: &EtcdConfig) -> String {
    format!(
        "addr={} capacity={} version={}",
        cfg.me, cfg.capacity, cfg.version
    )
}

fn parse(value: &[u8]) -> Option<(String, f64)> {
    let text = std::str::from_utf8(value).ok()?;
    let mut addr = None;
    let mut cap = 1.0;
    for w in text.split_whitespace() {
        match w.split_once('=') {
            Some(("addr", a)) => addr = Some(a.to_string()),
            Some(("capacity", c)) => cap = c.parse::<f64>().ok().filter(|c| *c > 0.0)?,
            _ => {}
        }
    }
    Some((addr?, cap))
}

fn apply(
    remote: &RemoteTier,
    state: &MembershipState,
    cfg: &EtcdConfig,
    seen: &BTreeMap<Vec<u8>, (String, f64)>,
) {
    let mut members: Vec<Member> = seen
        .values()
        .map(|(a, w)| Member::new(a.clone(), *w))
        .collect();
    if !members.iter().any(|m| m.addr == cfg.me) {
        members.push(Member::new(cfg.me.clone(), cfg.capacity as f64));
    }
    let now: Vec<(String, u64)> = members
        .iter()
        .map(|m| (m.addr.clone(), m.weight as u64))
        .collect();
    let before: Vec<(String, u64)> = remote
        .placement()
        .members()
        .iter()
        .map(|m| (m.addr.clone(), m.weight as u64))
        .collect();
    let mut sorted = now.clone();
    sorted.sort();
    if sorted != before {
        tracing::info!(members = ?sorted.iter().map(|m| &m.0).collect::<Vec<_>>(), "cluster: membership changed");
        state.changes.fetch_add(1, Relaxed);
        remote.set_members(members);
    }
    state.members.store(now.len() as u64, Relaxed);
}

async fn session(cfg: &EtcdConfig, remote: &RemoteTier, state: &MembershipState) -> String {
    match session_inner(cfg, remote, state).await {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

enum Never {}

async fn session_inner(
    cfg: &EtcdConfig,
    remote: &RemoteTier,
    state: &MembershipState,
) -> Result<Never, String> {
    let t = cfg.timeout;
    let ch = connect(&cfg.endpoints, t).await?;
    let mut kv = KvClient::new(ch.clone());
    let mut lease = LeaseClient::new(ch.clone());
    let mut watch = WatchClient::new(ch);
    let unary = |what: &'static str| move |e: String| format!("etcd {what}: {e}");
    let ttl_s = cfg.ttl.as_secs().max(1) as i64;
    let id = tokio::time::timeout(
        t,
        lease.lease_grant(LeaseGrantRequest { ttl: ttl_s, id: 0 }),
    )
    .await
    .map_err(|_| "etcd lease grant: timed out".to_string())?
    .map_err(|e| unary("lease grant")(e.message().to_string()))?
    .into_inner()
    .id;
    state.lease.store(id, Relaxed);
    let prefix = cfg.prefix.as_bytes().to_vec();
    let key = [prefix.clone(), cfg.me.as_bytes().to_vec()].concat();
    tokio::time::timeout(
        t,
        kv.put(PutRequest {
            key,
            value: record(cfg).into_bytes(),
            lease: id,
            ..Default::default()
        }),
    )
    .await
    .map_err(|_| "etcd put: timed out".to_string())?
    .map_err(|e| unary("put")(e.message().to_string()))?;
    let (ka_tx, ka_rx) = tokio::sync::mpsc::channel(4);
    ka_tx
        .send(LeaseKeepAliveRequest { id })
        .await
        .map_err(|e| e.to_string())?;
    let mut ka = tokio::time::timeout(t, lease.lease_keep_alive(ReceiverStream::new(ka_rx)))
        .await
        .map_err(|_| "etcd keep-alive: timed out".to_string())?
        .map_err(|e| unary("keep-alive")(e.message().to_string()))?
        .into_inner();
    let end = prefix_end(&prefix);
    let r = tokio::time::timeout(
        t,
        kv.range(RangeRequest {
            key: prefix.clone(),
            range_end: end.clone(),
            ..Default::default()
        }),
    )
    .await
    .map_err(|_| "etcd range: timed out".to_string())?
    .map_err(|e| unary("range")(e.message().to_string()))?
    .into_inner();
    let mut seen: BTreeMap<Vec<u8>, (String, f64)> = BTreeMap::new();
    for kv in &r.kvs {
        if let Some(m) = parse(&kv.value) {
            seen.insert(kv.key.clone(), m);
        }
    }
    apply(remote, state, cfg, &seen);
    let rev = r.header.map_or(0, |h| h.revision);
    let (w_tx, w_rx) = tokio::sync::mpsc::channel(1);
    w_tx.send(WatchRequest {
        request_union: Some(RequestUnion::CreateRequest(WatchCreateRequest {
            key: prefix,
            range_end: end,
            start_revision: rev + 1,
            ..Default::default()
        })),
    })
    .await
    .map_err(|e| e.to_string())?;
    let mut ws = tokio::time::timeout(t, watch.watch(ReceiverStream::new(w_rx)))
        .await
        .map_err(|_| "etcd watch: timed out".to_string())?
        .map_err(|e| unary("watch")(e.message().to_string()))?
        .into_inner();
    if state.degraded.swap(false, Relaxed) {
        tracing::info!(
            members = seen.len(),
            "cluster: etcd reachable again: registered, membership current"
        );
    } else {
        tracing::info!(
            members = seen.len(),
            lease = id,
            "cluster: registered in etcd"
        );
    }
    let mut tick = tokio::time::interval((cfg.ttl / 3).max(Duration::from_millis(100)));
    let mut answered = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if answered.elapsed() > cfg.ttl {
                    return Err("etcd did not answer keep-alives within the lease TTL".into());
                }
                ka_tx.send(LeaseKeepAliveRequest { id }).await.map_err(|e| e.to_string())?;
            }
            m = ka.message() => match m {
                Ok(Some(r)) if r.ttl > 0 => answered = Instant::now(),
                Ok(Some(_)) => return Err("this node's lease expired".into()),
                Ok(None) => return Err("keep-alive stream ended".into()),
                Err(e) => return Err(format!("keep-alive: {}", e.message())),
            },
            w = ws.message() => match w {
                Ok(Some(resp)) => {
                    if resp.canceled {
                        return Err(format!("watch cancelled: {}", resp.cancel_reason));
                    }
                    for ev in resp.events {
                        let Some(kv) = ev.kv else { continue };
                        if ev.r#type == EventType::Delete as i32 {
                            seen.remove(&kv.key);
                        } else if let Some(m) = parse(&kv.value) {
                            seen.insert(kv.key, m);
                        }
                    }
                    apply(remote, state, cfg, &seen);
                }
                Ok(None) => return Err("watch stream ended".into()),
                Err(e) => return Err(format!("watch: {}", e.message())),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_parse_and_prefix_ranges_end_right() {
        assert_eq!(
            parse(b"addr=10.0.0.1:7070 capacity=4096 version=0.1.0"),
            Some(("10.0.0.1:7070".into(), 4096.0))
        );
        assert_eq!(parse(b"capacity=1"), None);
        assert_eq!(parse(b"addr=a:1 capacity=-3"), None);
        assert_eq!(
            prefix_end(b"/kvtier/members/"),
            b"/kvtier/members0".to_vec()
        );
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
    }
}
