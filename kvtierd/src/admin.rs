//! The admin gRPC service.

// tonic fixes `Status` as the error type of handlers and interceptors.
#![allow(clippy::result_large_err)]

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvstore::{BlockKey, EventKind, LeaseId, NsId, Tier};
use kvtier_proto::admin::admin_server::Admin;
use kvtier_proto::admin::{self as pb, block_event};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use crate::Daemon;

/// The service.
pub struct AdminService {
    pub d: Arc<Daemon>,
}

fn keys(raw: &[Vec<u8>]) -> Result<Vec<BlockKey>, Status> {
    raw.iter()
        .enumerate()
        .map(|(i, k)| {
            BlockKey::from_bytes(k).map_err(|e| Status::invalid_argument(format!("key {i}: {e}")))
        })
        .collect()
}

/// The keys a Lookup names: given, or derived from the engine's block hashes or the prompt's
/// token ids in the request's namespace.
fn lookup_keys(r: &pb::LookupRequest) -> Result<Vec<BlockKey>, Status> {
    let derived = !r.block_hashes.is_empty() || !r.token_ids.is_empty();
    if !derived {
        return keys(&r.keys);
    }
    if !r.keys.is_empty() || (!r.block_hashes.is_empty() && !r.token_ids.is_empty()) {
        return Err(Status::invalid_argument(
            "name the blocks one way: keys, block_hashes or token_ids",
        ));
    }
    let spec = r.namespace.as_ref().ok_or_else(|| {
        Status::invalid_argument("block_hashes and token_ids need the namespace they belong to")
    })?;
    let ns = kvstore::Namespace {
        model: spec.model.clone(),
        dtype: spec.dtype.clone(),
        layout: spec.layout.clone(),
        block_tokens: spec.block_tokens,
        tp: if spec.tp_size == 0 {
            kvstore::TpShard::Shared
        } else {
            kvstore::TpShard::Rank {
                size: spec.tp_size,
                rank: spec.tp_rank,
            }
        },
        tenant: spec.tenant.clone(),
        lora: spec.lora.clone(),
    };
    ns.validate()
        .map_err(|e| Status::invalid_argument(format!("namespace: {e}")))?;
    if !r.token_ids.is_empty() {
        return Ok(ns.token_keys(&r.token_ids, &[]));
    }
    let fp = ns.fingerprint();
    r.block_hashes
        .iter()
        .enumerate()
        .map(|(i, h)| {
            BlockKey::from_engine_hash(&fp, h)
                .map_err(|e| Status::invalid_argument(format!("block hash {i}: {e}")))
        })
        .collect()
}

/// A store's block event as the Watch stream sends it.
fn event_msg(ev: &kvstore::BlockEvent) -> pb::BlockEvent {
    pb::BlockEvent {
        kind: match ev.kind {
            EventKind::Stored => block_event::Kind::Stored as i32,
            EventKind::Removed => block_event::Kind::Removed as i32,
        },
        key: ev.key.to_bytes().to_vec(),
        tier: tier(ev.tier),
        namespace_id: u32::from(ev.ns),
        unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
    }
}

fn tier(t: Tier) -> i32 {
    match t {
        Tier::Disk => pb::Tier::Disk as i32,
        Tier::Remote => pb::Tier::Remote as i32,
        _ => pb::Tier::Host as i32,
    }
}

/// Rejects calls without the configured bearer token.
pub fn check_token(token: String) -> impl Fn(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        if token.is_empty() {
            return Ok(req);
        }
        let want = format!("Bearer {token}");
        match req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
        {
            Some(got) if same(got.as_bytes(), want.as_bytes()) => Ok(req),
            Some(_) => Err(Status::unauthenticated("wrong bearer token")),
            None => Err(Status::unauthenticated(
                "this kvtierd requires a bearer token (authorization: Bearer <token>)",
            )),
        }
    }
}

/// Constant-time comparison (the time taken does not tell how much of a guess was right).
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::BlockEvent, Status>> + Send>>;
type BatchStream = Pin<Box<dyn Stream<Item = Result<pb::BlockEvents, Status>> + Send>>;

impl AdminService {
    /// The store a request names (its `tenant`; "" = the default store).
    fn store(&self, tenant: &str) -> Result<(usize, &'static kvstore::Store), Status> {
        self.d
            .store_named(tenant)
            .ok_or_else(|| Status::not_found(format!("no tenant named {tenant:?}")))
    }

    /// A request's keys within `server.max_keys`.
    fn check_keys(&self, n: usize) -> Result<(), Status> {
        let max_keys = self.d.cfg.server.max_keys as usize;
        if n > max_keys {
            return Err(Status::invalid_argument(format!(
                "{n} keys in one request; the limit is {max_keys} (server.max_keys)"
            )));
        }
        Ok(())
    }

    /// Admin writes (pin, unpin, clear) need a token unless the operator allowed otherwise.
    fn write_allowed(&self) -> Result<(), Status> {
        let s = &self.d.cfg.server;
        if s.token.is_empty() && !s.allow_unauthenticated_admin {
            return Err(Status::permission_denied(
                "admin writes (pin, unpin, clear, prefetch, cancel-prefetch, retain, demote) need server.token (clients send it as a bearer token), or server.allow_unauthenticated_admin = true",
            ));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn health(
        &self,
        _: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthReply>, Status> {
        let s = self.d.store.stats();
        Ok(Response::new(pb::HealthReply {
            version: env!("CARGO_PKG_VERSION").into(),
            uptime_ms: self.d.started.elapsed().as_millis() as u64,
            io_engine: s
                .disk()
                .map(|d| d.engine.to_string())
                .unwrap_or_else(|| "none".into()),
            populated_segments: s.populated_segments,
            total_segments: s.total_segments,
            host_capacity_bytes: s.capacity_bytes,
            cluster: self.d.cluster.as_ref().map_or("off", |c| c.state()).into(),
        }))
    }

    async fn stats(
        &self,
        req: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::StatsReply>, Status> {
        let (_, store) = self.store(&req.get_ref().tenant)?;
        let d = self.d.clone();
        let (s, ns, fps, tenants) = tokio::task::spawn_blocking(move || {
            let tenants: Vec<pb::TenantStats> = d
                .tenants
                .iter()
                .map(|t| {
                    let s = t.store.stats();
                    let disk = s.disk().cloned().unwrap_or_default();
                    pb::TenantStats {
                        name: t.cfg.name.clone(),
                        host_capacity_bytes: s.capacity_bytes,
                        host_used_bytes: s.used_bytes,
                        host_blocks: s.blocks,
                        disk_capacity_bytes: disk.capacity_bytes,
                        disk_used_bytes: disk.used_bytes,
                        disk_blocks: disk.blocks,
                    }
                })
                .collect();
            (
                store.stats(),
                store.namespace_stats(),
                store.namespaces(),
                tenants,
            )
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        let mut tiers = vec![pb::TierStats {
            tier: pb::Tier::Host as i32,
            capacity_bytes: s.capacity_bytes,
            used_bytes: s.used_bytes,
            blocks: s.blocks,
            bytes_read: s.bytes_out,
            bytes_written: s.bytes_in,
            evictions: s.evictions,
            ..Default::default()
        }];
        if let Some(k) = s.disk() {
            tiers.push(pb::TierStats {
                tier: pb::Tier::Disk as i32,
                capacity_bytes: k.capacity_bytes,
                used_bytes: k.used_bytes,
                blocks: k.blocks,
                bytes_read: k.bytes_read,
                bytes_written: k.bytes_written,
                evictions: k.evictions,
                checksum_failures: k.checksum_failures,
                read_errors: k.read_errors,
                write_errors: k.write_errors,
                read_bandwidth_bytes_per_s: k.read_bandwidth as f64,
                read_latency_s: k.read_latency_ns as f64 / 1e9,
            });
        }
        for k in s
            .tiers
            .iter()
            .filter(|t| t.tier == Some(kvstore::Tier::Remote))
        {
            tiers.push(pb::TierStats {
                tier: pb::Tier::Remote as i32,
                bytes_read: k.bytes_read,
                bytes_written: k.bytes_written,
                checksum_failures: k.checksum_failures,
                read_errors: k.read_errors,
                write_errors: k.write_errors,
                read_bandwidth_bytes_per_s: k.read_bandwidth as f64,
                read_latency_s: k.read_latency_ns as f64 / 1e9,
                ..Default::default()
            });
        }
        let namespaces = ns
            .into_iter()
            .map(|n| pb::NamespaceStats {
                id: u32::from(n.id),
                fingerprint: fps
                    .get(n.id as usize)
                    .map(|f| f.0.to_bytes().to_vec())
                    .unwrap_or_default(),
                host_blocks: n.host_blocks,
                host_bytes: n.host_bytes,
                disk_blocks: n.disk_blocks,
                disk_bytes: n.disk_bytes,
            })
            .collect();
        Ok(Response::new(pb::StatsReply {
            tenants,
            tiers,
            namespaces,
            hits: s.hits,
            misses: s.misses,
            leases: s.leases,
            promotions: s.promotions,
            demotions: s.demotions,
            ipc_clients: self
                .d
                .ipc_clients
                .load(std::sync::atomic::Ordering::Relaxed),
            prefetch: Some(pb::PrefetchStats {
                hinted: s.prefetch.hinted,
                in_time: s.prefetch.in_time,
                late: s.prefetch.late,
                cancelled: s.prefetch.cancelled,
                expired: s.prefetch.expired,
                dropped: s.prefetch.dropped,
                wasted_bytes: s.prefetch.wasted_bytes,
                inflight_bytes: s.prefetch.inflight_bytes,
                held_bytes: s.prefetch.held_bytes,
                waited: s.prefetch.waited,
                waiting_keys: s.prefetch.waiting_keys,
            }),
            break_even_cuts: s.break_even_cuts,
            break_even_blocks_cut: s.break_even_blocks_cut,
            break_even_prefill_tokens_per_s: s.break_even_prefill_tokens_per_s,
            retention: Some({
                let r = store.retention_stats();
                pb::RetentionStats {
                    retentions: r.retentions,
                    blocks: r.blocks,
                    bytes: r.bytes,
                    max_bytes: r.max_bytes,
                    retains: r.retains,
                    clipped_blocks: r.clipped_blocks,
                    displaced: r.displaced,
                    expired: r.expired,
                    demotes: r.demotes,
                    demoted_freed: r.demoted_freed,
                    demoted_queued: r.demoted_queued,
                }
            }),
        }))
    }

    async fn lookup(
        &self,
        req: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupReply>, Status> {
        let r = req.into_inner();
        let ks = lookup_keys(&r)?;
        self.check_keys(ks.len())?;
        let (_, store) = self.store(&r.tenant)?;
        let d = self.d.clone();
        // The remote tier answers over the network: off the async threads.
        let reply = tokio::task::spawn_blocking(move || {
            let m = store.match_prefix(&ks);
            let mut nodes = Vec::new();
            if r.cluster {
                let held: Vec<(Tier, u64)> = store
                    .probe_local(&ks)
                    .into_iter()
                    .map_while(|x| x.map(|(i, t)| (t, u64::from(i.len))))
                    .collect();
                let (load_seconds, load_measured) = store.load_seconds(&held);
                let local: Vec<Tier> = held.into_iter().map(|(t, _)| t).collect();
                let me = d
                    .cluster
                    .as_ref()
                    .map_or("local".to_string(), |c| c.remote.me().to_string());
                nodes.push(pb::NodePrefix {
                    node: me,
                    n: local.len() as u32,
                    tiers: local.into_iter().map(tier).collect(),
                    local: true,
                    error: String::new(),
                    load_seconds,
                    load_measured,
                });
                if let Some(c) = &d.cluster {
                    for p in c.remote.node_prefixes(&ks) {
                        nodes.push(pb::NodePrefix {
                            node: p.addr,
                            n: p.tiers.len() as u32,
                            tiers: p.tiers.into_iter().map(tier).collect(),
                            local: false,
                            error: p.error.unwrap_or_default(),
                            load_seconds: p.load_seconds,
                            load_measured: p.load_measured,
                        });
                    }
                }
            }
            pb::LookupReply {
                n: m.n as u32,
                tiers: m.tiers.into_iter().map(tier).collect(),
                nodes,
            }
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(reply))
    }

    async fn clear_namespace(
        &self,
        req: Request<pb::ClearRequest>,
    ) -> Result<Response<pb::ClearReply>, Status> {
        self.write_allowed()?;
        let id = req.get_ref().namespace_id;
        let (_, store) = self.store(&req.get_ref().tenant)?;
        if !store.has_namespace(NsId(id)) {
            return Err(Status::not_found(format!(
                "namespace {id} is not registered"
            )));
        }
        let removed = tokio::task::spawn_blocking(move || store.clear_namespace(NsId(id)))
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        tracing::info!(namespace = id, removed, "namespace cleared");
        Ok(Response::new(pb::ClearReply {
            removed: removed as u64,
        }))
    }

    async fn pin(&self, req: Request<pb::PinRequest>) -> Result<Response<pb::PinReply>, Status> {
        self.write_allowed()?;
        let r = req.get_ref();
        self.check_keys(r.keys.len())?;
        let ks = keys(&r.keys)?;
        let (t, store) = self.store(&r.tenant)?;
        let max = self.d.cfg.server.max_admin_pinned;
        let pinned: u64 = self.d.admin_leases.lock().values().map(|(_, n)| n).sum();
        if pinned + ks.len() as u64 > max {
            return Err(Status::resource_exhausted(format!(
                "admin pins hold {pinned} blocks; the limit is {max} (server.max_admin_pinned): unpin some first"
            )));
        }
        let ttl = if r.ttl_ms == 0 {
            self.d.cfg.lease_ttl()
        } else {
            Duration::from_millis(r.ttl_ms.min(3_600_000))
        };
        let lease = store
            .lease(&ks, ttl)
            .map_err(|e| Status::resource_exhausted(e.to_string()))?;
        if let Some(id) = lease.id {
            self.d.admin_leases.lock().insert(id.0, (t, lease.n as u64));
        }
        Ok(Response::new(pb::PinReply {
            lease_id: lease.id.map_or(0, |i| i.0),
            n: lease.n as u32,
        }))
    }

    async fn prefetch(
        &self,
        req: Request<pb::PrefetchRequest>,
    ) -> Result<Response<pb::PrefetchReply>, Status> {
        self.write_allowed()?;
        let r = req.get_ref();
        self.check_keys(r.keys.len())?;
        let priority = u8::try_from(r.priority).map_err(|_| {
            Status::invalid_argument(format!("priority {} is not in 0..=255", r.priority))
        })?;
        let ks = keys(&r.keys)?;
        let (_, store) = self.store(&r.tenant)?;
        let p = store.prefetch(
            &ks,
            priority,
            self.d.preload_deadline(r.deadline_ms),
            crate::Daemon::preload_tag(0, r.tag),
        );
        Ok(Response::new(pb::PrefetchReply {
            present: p.present as u32,
            in_host: p.in_host as u32,
            joined: p.joined as u32,
            queued: p.queued as u32,
            dropped: p.dropped as u32,
            held: p.held as u32,
            waiting: p.waiting as u32,
        }))
    }

    async fn retain(
        &self,
        req: Request<pb::RetainRequest>,
    ) -> Result<Response<pb::RetainReply>, Status> {
        self.write_allowed()?;
        let r = req.get_ref();
        self.check_keys(r.keys.len())?;
        let priority = u8::try_from(r.priority).map_err(|_| {
            Status::invalid_argument(format!("priority {} is not in 0..=255", r.priority))
        })?;
        let ks = keys(&r.keys)?;
        let (_, store) = self.store(&r.tenant)?;
        let out = store.retain(
            (!r.session.is_empty()).then_some(r.session.as_str()),
            &ks,
            self.d.retain_ttl(r.ttl_ms),
            priority,
        );
        let x = crate::retain_reply(&out);
        Ok(Response::new(pb::RetainReply {
            present: x.present,
            retained: x.retained,
            clipped: x.clipped,
            clipped_by: x.clipped_by,
            refused: x.refused,
            ttl_ms: x.ttl_ms,
            retained_bytes: x.retained_bytes,
            displaced: x.displaced,
        }))
    }

    async fn demote(
        &self,
        req: Request<pb::DemoteRequest>,
    ) -> Result<Response<pb::DemoteReply>, Status> {
        self.write_allowed()?;
        let r = req.get_ref();
        self.check_keys(r.keys.len())?;
        if r.keys.is_empty() && r.session.is_empty() {
            return Err(Status::invalid_argument("name a session or keys"));
        }
        let ks = keys(&r.keys)?;
        let (_, store) = self.store(&r.tenant)?;
        let out = store.demote((!r.session.is_empty()).then_some(r.session.as_str()), &ks);
        Ok(Response::new(pb::DemoteReply {
            released: out.released as u32,
            freed: out.freed as u32,
            queued: out.queued as u32,
            busy: out.busy as u32,
            not_in_host: out.not_in_host as u32,
            kept: out.kept as u32,
        }))
    }

    async fn cancel_prefetch(
        &self,
        req: Request<pb::CancelPrefetchRequest>,
    ) -> Result<Response<pb::CancelPrefetchReply>, Status> {
        self.write_allowed()?;
        let r = req.get_ref();
        let (_, store) = self.store(&r.tenant)?;
        // The admin API's hints are owner 0 with tags in scope 0 (see `prefetch`).
        let n = store.cancel_prefetch_as(crate::Daemon::preload_tag(0, r.tag), 0);
        Ok(Response::new(pb::CancelPrefetchReply {
            cancelled: n as u32,
        }))
    }

    async fn cluster(
        &self,
        _req: Request<pb::ClusterRequest>,
    ) -> Result<Response<pb::ClusterReply>, Status> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(c) = &self.d.cluster else {
            return Ok(Response::new(pb::ClusterReply::default()));
        };
        let s = self.d.store.stats();
        let cfg = &self.d.cfg.cluster;
        Ok(Response::new(pb::ClusterReply {
            enabled: true,
            listen: cfg.listen.clone(),
            membership: if c.etcd.is_some() { "etcd" } else { "static" }.into(),
            degraded: c.state() == "degraded",
            membership_changes: c.etcd.as_ref().map_or(0, |(_, m)| m.changes.load(Relaxed)),
            replicas: cfg.replicas,
            members: c
                .remote
                .peers()
                .into_iter()
                .map(|p| pb::ClusterMember {
                    addr: p.addr,
                    state: p.state.into(),
                    bytes_in: p.bytes_in,
                    bytes_out: p.bytes_out,
                    failures: p.failures,
                    requests: p.requests,
                })
                .collect(),
            pushes: s.pushes,
            push_dropped: s.push_dropped,
            push_failed: s.push_failed,
            push_retries: s.push_retries,
            push_queue_bytes: s.push_queue_bytes,
            served_bytes: c.server.bytes_out.load(Relaxed),
            received_bytes: c.server.bytes_in.load(Relaxed),
            stored_for_peers: c.server.stored.load(Relaxed),
            auth_failures: c.server.auth_failures.load(Relaxed),
        }))
    }

    async fn unpin(
        &self,
        req: Request<pb::UnpinRequest>,
    ) -> Result<Response<pb::UnpinReply>, Status> {
        self.write_allowed()?;
        let id = req.get_ref().lease_id;
        // Only pins made through this API: an engine's leases are its own.
        let Some((t, _)) = self.d.admin_leases.lock().remove(&id) else {
            return Ok(Response::new(pb::UnpinReply { released: false }));
        };
        Ok(Response::new(pb::UnpinReply {
            released: self.d.store_at(t).release(LeaseId(id)),
        }))
    }

    type WatchStream = EventStream;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<EventStream>, Status> {
        // One message an event.
        let out = self.watch_with(req.get_ref(), 1024, |events, out| {
            events.into_iter().all(|e| out.send(Ok(e)))
        })?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }

    type WatchBatchedStream = BatchStream;

    async fn watch_batched(
        &self,
        req: Request<pb::WatchRequest>,
    ) -> Result<Response<BatchStream>, Status> {
        // One message a batch (up to 16 queued: 16,384 events).
        let out = self.watch_with(req.get_ref(), 16, |events, out| {
            out.send(Ok(pb::BlockEvents { events }))
        })?;
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(out),
        )))
    }
}

/// Events a Watch message carries at most: what the store's channel holds then, up to this.
const WATCH_BATCH: usize = 1024;

/// Where a Watch thread sends the stream's messages, each within `deadline`.
pub(crate) struct WatchOut<T> {
    tx: tokio::sync::mpsc::Sender<Result<T, Status>>,
    deadline: Duration,
}

/// Wakes the thread that polls a future by hand ([`WatchOut::send`]).
struct Unpark(std::thread::Thread);

impl std::task::Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

impl<T> WatchOut<T> {
    /// Sends `m`: false when the watcher is gone, or took nothing for `deadline` (a client
    /// that stopped reading, or vanished without closing its connection: its thread, its
    /// slot among `server.max_watchers` and its snapshot's copy of the disk index go).
    /// Waits for room on this thread, parked until the channel wakes it or the deadline: no
    /// runtime's timer (one that shuts down while a send waits would panic in it).
    fn send(&self, m: Result<T, Status>) -> bool {
        use std::future::Future;
        use tokio::sync::mpsc::error::TrySendError;
        let m = match self.tx.try_send(m) {
            Ok(()) => return true,
            Err(TrySendError::Closed(_)) => return false,
            Err(TrySendError::Full(m)) => m,
        };
        let end = std::time::Instant::now() + self.deadline;
        let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
        let mut cx = std::task::Context::from_waker(&waker);
        let mut room = std::pin::pin!(self.tx.reserve());
        loop {
            match room.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(Ok(permit)) => {
                    permit.send(m);
                    return true;
                }
                std::task::Poll::Ready(Err(_)) => return false,
                std::task::Poll::Pending => {}
            }
            let left = end.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            // Woken by the channel (room, or the receiver gone), else at the deadline; a
            // spurious wake polls again.
            std::thread::park_timeout(left);
        }
    }
}

/// What a Watch thread does: the snapshot when asked for (every block `store` holds, then
/// the end marker), then the events of `sub` (subscribed before the snapshot) as they come,
/// through `emit` (a batch of at most [`WATCH_BATCH`] events; `false`: the watcher is gone
/// or stuck), until the watcher goes or `stopping()`. A subscription that lost events (its
/// channel full while the watcher read slower than the store changed) ends the stream with
/// `DATA_LOSS`, before the snapshot's end marker or before the next batch: what the watcher
/// knows of the node may be wrong from then on, and it must subscribe again (with a
/// snapshot) rather than go on with a silently stale view.
fn forward<T>(
    store: &kvstore::Store,
    sub: &kvstore::Subscription,
    snapshot: bool,
    out: &WatchOut<T>,
    emit: fn(Vec<pb::BlockEvent>, &WatchOut<T>) -> bool,
    stopping: &dyn Fn() -> bool,
) {
    let lost = || {
        let n = sub.lost();
        n > 0 && {
            out.send(Err(Status::data_loss(format!(
                "this watcher fell behind and lost {n} block events (the node keeps {} for \
                 it): what it knows of the node may be wrong; subscribe again, with a \
                 snapshot",
                sub.capacity().unwrap_or(0)
            ))));
            true
        }
    };
    if snapshot {
        let mut open = true;
        store.resident_events(WATCH_BATCH, |batch| {
            open = batch
                .chunks(WATCH_BATCH)
                .all(|part| emit(part.iter().map(event_msg).collect(), out));
            open && !stopping()
        });
        let end = pb::BlockEvent {
            kind: block_event::Kind::SnapshotEnd as i32,
            ..Default::default()
        };
        if !open || stopping() || lost() || !emit(vec![end], out) {
            return;
        }
    }
    while !stopping() {
        let first = match sub.recv_timeout(Duration::from_millis(200)) {
            Ok(ev) => ev,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if out.tx.is_closed() || lost() {
                    return;
                }
                continue;
            }
            Err(_) => return,
        };
        let mut batch = vec![event_msg(&first)];
        batch.extend(sub.try_iter().take(WATCH_BATCH - 1).map(|e| event_msg(&e)));
        if lost() || !emit(batch, out) {
            return;
        }
    }
}

impl AdminService {
    /// A Watch stream (`req`): a thread (at most `server.max_watchers`) that runs
    /// [`forward`] into the stream returned (`queue` messages deep, each sent within
    /// `server.watch_send_timeout_ms`). Ends when the watcher goes away, stops reading, or
    /// falls behind, or the daemon stops.
    fn watch_with<T: Send + 'static>(
        &self,
        req: &pb::WatchRequest,
        queue: usize,
        emit: fn(Vec<pb::BlockEvent>, &WatchOut<T>) -> bool,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<T, Status>>, Status> {
        let (_, store) = self.store(&req.tenant)?;
        use std::sync::atomic::Ordering::SeqCst;
        let max = u64::from(self.d.cfg.server.max_watchers);
        // Each Watch holds a thread: bounded, refused beyond.
        if self
            .d
            .watchers
            .fetch_update(SeqCst, SeqCst, |n| (n < max).then_some(n + 1))
            .is_err()
        {
            return Err(Status::resource_exhausted(format!(
                "{max} Watch streams are open already (server.max_watchers): close one first"
            )));
        }
        let snapshot = req.snapshot;
        // A snapshot's watcher gets the events from here on after the snapshot: room for
        // what happens meanwhile.
        let sub = store.subscribe(if snapshot { 1 << 16 } else { 4096 });
        let (tx, rx) = tokio::sync::mpsc::channel(queue);
        let out = WatchOut {
            tx,
            deadline: Duration::from_millis(self.d.cfg.server.watch_send_timeout_ms),
        };
        let d = self.d.clone();
        let spawned = std::thread::Builder::new()
            .name("kvtierd-watch".into())
            .spawn(move || {
                struct Done(Arc<crate::Daemon>);
                impl Drop for Done {
                    fn drop(&mut self) {
                        self.0.watchers.fetch_sub(1, SeqCst);
                    }
                }
                let _done = Done(d.clone());
                forward(store, &sub, snapshot, &out, emit, &|| d.stopping());
            });
        if let Err(e) = spawned {
            self.d.watchers.fetch_sub(1, SeqCst);
            return Err(Status::resource_exhausted(format!(
                "cannot start a watch thread: {e}"
            )));
        }
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvstore::{Fingerprint, StoreConfig};

    /// A runtime for the test's reads of the stream, and a store with a namespace.
    fn setup() -> (tokio::runtime::Runtime, Arc<kvstore::Store>, NsId) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let store = StoreConfig {
            capacity_bytes: 4 << 20,
            segment_bytes: 1 << 20,
            size_classes: vec![4096],
            ..Default::default()
        }
        .build()
        .unwrap();
        let ns = store
            .register_fingerprint(Fingerprint(BlockKey(7)))
            .unwrap();
        (rt, Arc::new(store), ns)
    }

    /// A send that waits for room needs no runtime: it goes through once the reader takes a
    /// message, and fails at once when the reader goes.
    #[test]
    fn a_send_that_waits_for_room_needs_no_runtime() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Result<u32, Status>>(1);
        let out = Arc::new(WatchOut {
            tx,
            deadline: Duration::from_secs(60),
        });
        assert!(out.send(Ok(1)));
        let o = out.clone();
        let waiting = std::thread::spawn(move || o.send(Ok(2)));
        assert_eq!(rx.blocking_recv().map(|r| r.ok()), Some(Some(1)));
        assert_eq!(rx.blocking_recv().map(|r| r.ok()), Some(Some(2)));
        assert!(waiting.join().unwrap());
        let o = out.clone();
        assert!(out.send(Ok(3)));
        let waiting = std::thread::spawn(move || o.send(Ok(4)));
        drop(rx);
        assert!(!waiting.join().unwrap(), "the reader is gone");
    }

    fn one_a_message(events: Vec<pb::BlockEvent>, out: &WatchOut<pb::BlockEvent>) -> bool {
        events.into_iter().all(|e| out.send(Ok(e)))
    }

    /// [`forward`] on a thread of its own, into a stream one message deep: the thread, the
    /// stream, and a channel that says when the thread ended.
    fn watcher(
        store: &Arc<kvstore::Store>,
        sub_capacity: usize,
        deadline: Duration,
    ) -> (
        tokio::sync::mpsc::Receiver<Result<pb::BlockEvent, Status>>,
        std::sync::mpsc::Receiver<()>,
    ) {
        let sub = store.subscribe(sub_capacity);
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let out = WatchOut { tx, deadline };
        let (done_tx, done) = std::sync::mpsc::channel();
        let store = store.clone();
        std::thread::spawn(move || {
            forward(&store, &sub, false, &out, one_a_message, &|| false);
            let _ = done_tx.send(());
        });
        (rx, done)
    }

    #[test]
    fn a_watcher_that_falls_behind_gets_data_loss_not_a_stale_view() {
        let (rt, store, ns) = setup();
        // Room for 4 events in the subscription, 1 message in the stream, a batch in hand:
        // 20 stored while the client reads nothing cannot all reach it.
        let (mut rx, done) = watcher(&store, 4, Duration::from_secs(60));
        for i in 0..20u128 {
            store.put(ns, BlockKey(i + 1), &[1u8; 4096]).unwrap();
        }
        let (mut events, mut status) = (0, None);
        rt.block_on(async {
            while let Some(m) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
                .await
                .expect("the stream goes on or ends within 30 s")
            {
                match m {
                    Ok(_) => {
                        assert!(status.is_none(), "an event after the error");
                        events += 1;
                    }
                    Err(s) => status = Some(s),
                }
            }
        });
        let s = status.expect("the stream ends with an error, not silently");
        assert_eq!(s.code(), tonic::Code::DataLoss, "{s:?}");
        assert!(s.message().contains("fell behind"), "{s:?}");
        assert!(events < 20, "{events} events and a loss");
        done.recv_timeout(Duration::from_secs(30))
            .expect("the watch thread ends");
    }

    #[test]
    fn a_watcher_that_reads_nothing_is_dropped_after_the_send_deadline() {
        let (_rt, store, ns) = setup();
        let (rx, done) = watcher(&store, 1024, Duration::from_millis(100));
        // One message fits in the stream; the second waits for a reader that never reads.
        for i in 0..3u128 {
            store.put(ns, BlockKey(i + 1), &[1u8; 4096]).unwrap();
        }
        done.recv_timeout(Duration::from_secs(30))
            .expect("the thread of a watcher that reads nothing ends at the send deadline");
        drop(rx);
    }
}
