//! `GET /metrics` in the OpenMetrics text format (the `prometheus-client` crate's encoder),
//! read from the store's counters at scrape time; `/healthz` and `/readyz` for probes. Served
//! by axum (hyper) on the metrics listener.

use std::fmt;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use kvstore::{LatencyBuckets, LATENCY_BOUNDS_US};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;

use crate::Daemon;

/// The OpenMetrics content type Prometheus negotiates.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A sample's labels.
type Labels = Vec<(&'static str, String)>;

fn no_labels() -> Labels {
    Vec::new()
}

fn label(k: &'static str, v: impl Into<String>) -> Labels {
    vec![(k, v.into())]
}

/// Writes metric families through the OpenMetrics encoder. Counter names are given without
/// `_total` (the encoder adds it); histogram names without their unit.
struct Out<'a>(DescriptorEncoder<'a>);

impl Out<'_> {
    fn counter(&mut self, name: &str, help: &str, samples: &[(Labels, u64)]) -> fmt::Result {
        let mut m = self
            .0
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        for (l, v) in samples {
            m.encode_family(l)?
                .encode_counter::<NoLabelSet, u64, u64>(v, None)?;
        }
        Ok(())
    }

    /// A counter of seconds (`<name>_seconds_total`).
    fn counter_secs(&mut self, name: &str, help: &str, secs: f64) -> fmt::Result {
        let mut m =
            self.0
                .encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Counter)?;
        m.encode_family(&no_labels())?
            .encode_counter::<NoLabelSet, f64, u64>(&secs, None)?;
        Ok(())
    }

    fn gauge(&mut self, name: &str, help: &str, samples: &[(Labels, f64)]) -> fmt::Result {
        let mut m = self
            .0
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (l, v) in samples {
            m.encode_family(l)?.encode_gauge(v)?;
        }
        Ok(())
    }

    /// A latency histogram in seconds (`<name>_seconds_bucket`, `_sum`, `_count`).
    fn latency(
        &mut self,
        name: &str,
        help: &str,
        samples: &[(Labels, &LatencyBuckets)],
    ) -> fmt::Result {
        let mut m =
            self.0
                .encode_descriptor(name, help, Some(&Unit::Seconds), MetricType::Histogram)?;
        for (l, h) in samples {
            // An empty distribution (no counts yet) still lists every bucket, all zero.
            let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_US
                .iter()
                .map(|&b| b as f64 / 1e6)
                .chain([f64::INFINITY])
                .enumerate()
                .map(|(i, le)| (le, h.counts.get(i).copied().unwrap_or(0)))
                .collect();
            m.encode_family(l)?.encode_histogram::<NoLabelSet>(
                h.sum_us as f64 / 1e6,
                h.count(),
                &buckets,
                None,
            )?;
        }
        Ok(())
    }
}

/// The daemon's metrics, read at scrape time.
struct Scrape(Arc<Daemon>);

impl fmt::Debug for Scrape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

impl Collector for Scrape {
    fn encode(&self, e: DescriptorEncoder) -> fmt::Result {
        collect(&self.0, &mut Out(e))
    }
}

/// Renders every metric (OpenMetrics text, ending in `# EOF`).
pub fn render(d: &Arc<Daemon>) -> String {
    let mut r = Registry::with_prefix("kvtier");
    r.register_collector(Box::new(Scrape(d.clone())));
    let mut o = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut o, &r) {
        tracing::warn!("metrics: encoding failed: {e}");
    }
    o
}

fn collect(d: &Daemon, o: &mut Out) -> fmt::Result {
    let s = d.store.stats();
    let disk = s.disk().cloned().unwrap_or_default();
    let has_disk = s.disk().is_some();
    let tiered = |host: u64, dsk: u64| -> Vec<(Labels, u64)> {
        let mut v = vec![(label("tier", "host"), host)];
        if has_disk {
            v.push((label("tier", "disk"), dsk));
        }
        v
    };
    let as_gauge = |v: Vec<(Labels, u64)>| -> Vec<(Labels, f64)> {
        v.into_iter().map(|(l, x)| (l, x as f64)).collect()
    };
    let one = |v: u64| vec![(no_labels(), v)];
    let one_f = |v: f64| vec![(no_labels(), v)];
    o.counter("hits", "Block gets served.", &one(s.hits))?;
    o.counter("misses", "Block gets not found.", &one(s.misses))?;
    // Of `hits`, by the tier each block was in when its load asked (a block a preload had
    // brought up counts as host memory's); remote only with a remote tier.
    let mut tier_hits = tiered(
        s.hits.saturating_sub(s.disk_hits + s.remote_hits),
        s.disk_hits,
    );
    if d.cluster.is_some() || s.remote_hits > 0 {
        tier_hits.push((label("tier", "remote"), s.remote_hits));
    }
    o.counter(
        "tier_hits",
        "Blocks served, by the tier each was in when its load asked.",
        &tier_hits,
    )?;
    o.gauge(
        "capacity_bytes",
        "Bytes of block space per tier.",
        &as_gauge(tiered(s.capacity_bytes, disk.capacity_bytes)),
    )?;
    o.gauge(
        "used_bytes",
        "Bytes of committed blocks per tier.",
        &as_gauge(tiered(s.used_bytes, disk.used_bytes)),
    )?;
    o.gauge(
        "blocks",
        "Committed blocks per tier.",
        &as_gauge(tiered(s.blocks, disk.blocks)),
    )?;
    o.counter(
        "evictions",
        "Blocks evicted per tier.",
        &tiered(s.evictions, disk.evictions),
    )?;
    o.counter(
        "read_bytes",
        "Bytes read out of each tier.",
        &tiered(s.bytes_out, disk.bytes_read),
    )?;
    o.counter(
        "written_bytes",
        "Bytes written into each tier.",
        &tiered(s.bytes_in, disk.bytes_written),
    )?;
    if let Some(c) = &d.cluster {
        let peers: Vec<_> = c
            .remote
            .peers()
            .into_iter()
            .filter(|p| p.state != "self")
            .collect();
        let per = |f: &dyn Fn(&kvtier_cluster::PeerStatus) -> u64| -> Vec<(Labels, u64)> {
            peers
                .iter()
                .map(|p| (label("peer", p.addr.to_string()), f(p)))
                .collect()
        };
        o.gauge(
            "remote_peer_up",
            "1 while a peer answers (or was not asked yet), 0 while it fails or its breaker is open.",
            &as_gauge(per(&|p| u64::from(matches!(p.state, "up" | "unknown")))),
        )?;
        o.counter(
            "remote_peer_received_bytes",
            "Block payload bytes read from each peer.",
            &per(&|p| p.bytes_in),
        )?;
        o.counter(
            "remote_peer_sent_bytes",
            "Block payload bytes pushed to each peer.",
            &per(&|p| p.bytes_out),
        )?;
        o.counter(
            "remote_peer_failures",
            "Requests to each peer that failed (timeout, refused, broken connection).",
            &per(&|p| p.failures),
        )?;
        o.counter(
            "remote_pushes",
            "Saved blocks pushed to their owners (pushed), not pushed because the queue was full (dropped), failed and tried again later (retried), or failed for good.",
            &[
                (label("outcome", "pushed"), s.pushes),
                (label("outcome", "dropped"), s.push_dropped),
                (label("outcome", "retried"), s.push_retries),
                (label("outcome", "failed"), s.push_failed),
            ],
        )?;
        o.gauge(
            "remote_push_queue_bytes",
            "Bytes of saved blocks waiting to be pushed to their owners.",
            &one_f(s.push_queue_bytes as f64),
        )?;
        let r = s
            .tiers
            .iter()
            .find(|t| t.tier == Some(kvstore::Tier::Remote))
            .cloned()
            .unwrap_or_default();
        o.counter(
            "remote_checksum_failures",
            "Blocks from peers that failed their checksum (misses, never served).",
            &one(r.checksum_failures),
        )?;
        o.latency(
            "remote_latency",
            "Requests to peers: completion time of a batched read (op=read) or push (op=write).",
            &[
                (label("op", "read"), &r.read_latency),
                (label("op", "write"), &r.write_latency),
            ],
        )?;
        o.counter(
            "remote_served_bytes",
            "Block payload bytes this node served to peers (get) and stored for them (put).",
            &[
                (label("op", "get"), c.server.bytes_out.load(Relaxed)),
                (label("op", "put"), c.server.bytes_in.load(Relaxed)),
            ],
        )?;
        o.gauge(
            "cluster_degraded",
            "1 while etcd is unreachable (the last known membership is in use, local tiers serve); always 0 with static members.",
            &one_f(f64::from(u8::from(c.state() == "degraded"))),
        )?;
        if let Some((_, m)) = &c.etcd {
            o.counter(
                "cluster_membership_changes",
                "Membership changes applied from etcd.",
                &one(m.changes.load(Relaxed)),
            )?;
        }
        o.gauge(
            "cluster_members",
            "Members in the placement (this node included).",
            &one_f(c.remote.peers().len() as f64),
        )?;
        o.counter(
            "remote_auth_failures",
            "Peer connections refused at set-up (wrong cluster secret or protocol version).",
            &one(c.server.auth_failures.load(Relaxed)),
        )?;
        let sv = &c.server;
        o.counter(
            "cluster_auth_failures",
            "Data-plane connections that never authenticated, by reason: secret (wrong secret or protocol version), timeout (no Auth within cluster.timeout_ms), frame (an oversized or undecodable set-up frame), refused (closed at accept: too many connections setting up, in all or from its address).",
            &[
                (label("reason", "secret"), sv.auth_failures.load(Relaxed)),
                (label("reason", "timeout"), sv.auth_timeouts.load(Relaxed)),
                (label("reason", "frame"), sv.auth_bad_frames.load(Relaxed)),
                (label("reason", "refused"), sv.refused.load(Relaxed)),
            ],
        )?;
    }
    o.counter(
        "promotions",
        "Blocks copied disk to host.",
        &one(s.promotions),
    )?;
    let p = &s.prefetch;
    o.counter(
        "prefetch_blocks",
        "Preload hints: blocks queued (hinted), used from host memory (in_time), waited for (late), cancelled, expired unread, given up (dropped).",
        &[
            (label("outcome", "hinted"), p.hinted),
            (label("outcome", "in_time"), p.in_time),
            (label("outcome", "late"), p.late),
            (label("outcome", "cancelled"), p.cancelled),
            (label("outcome", "expired"), p.expired),
            (label("outcome", "dropped"), p.dropped),
        ],
    )?;
    o.counter(
        "prefetch_wasted_bytes",
        "Bytes of preloaded blocks no load used before their hint ended (deadline or cancel).",
        &one(p.wasted_bytes),
    )?;
    o.gauge(
        "policy_lru_leading_classes",
        "Host size classes whose duel policy has its recency order (LRU, or CLOCK in duel-clock) choosing victims (the rest: S3-FIFO).",
        &one_f(s.policy_lru_leading_classes as f64),
    )?;
    o.gauge(
        "prefetch_held_bytes",
        "Bytes of blocks held in host memory for the load a hint announced.",
        &one_f(p.held_bytes as f64),
    )?;
    o.gauge(
        "prefetch_waiting_keys",
        "Keys of hints waiting for preload room.",
        &one_f(p.waiting_keys as f64),
    )?;
    o.gauge(
        "prefetch_inflight_bytes",
        "Bytes of preloads queued or being read.",
        &one_f(p.inflight_bytes as f64),
    )?;
    let r = d.store.retention_stats();
    o.gauge(
        "retained_bytes",
        "Bytes (any tier) held by Retain hints for sessions that will come back.",
        &one_f(r.bytes as f64),
    )?;
    o.gauge(
        "retentions",
        "Retentions (sessions and anonymous retains) live.",
        &one_f(r.retentions as f64),
    )?;
    o.counter(
        "retain_blocks",
        "Retained blocks ended early or left out: by a higher-priority retain (displaced, retentions), by their TTL (expired, retentions), left out by a bound (clipped, blocks).",
        &[
            (label("outcome", "displaced"), r.displaced),
            (label("outcome", "expired"), r.expired),
            (label("outcome", "clipped"), r.clipped_blocks),
        ],
    )?;
    o.counter(
        "demoted_blocks",
        "Host blocks Demote hints moved down: dropped at once (freed: a copy was below) or written first (queued).",
        &[
            (label("outcome", "freed"), r.demoted_freed),
            (label("outcome", "queued"), r.demoted_queued),
        ],
    )?;
    o.gauge(
        "tier_policy_lru_leading",
        "1 while the recency order (LRU, or CLOCK in duel-clock) chooses the victims of a lower tier's duel policy (0: S3-FIFO, or no duel).",
        &[(
            label("tier", "disk"),
            f64::from(u8::from(disk.policy_leader.is_some_and(|l| l != "s3fifo"))),
        )],
    )?;
    o.gauge(
        "tier_read_bandwidth_bytes_per_second",
        "Measured read bandwidth of promotions per lower tier (what break-even admission uses).",
        &[(label("tier", "disk"), disk.read_bandwidth as f64)],
    )?;
    o.gauge(
        "break_even_prefill_tokens_per_s",
        "The prefill rate the last priced lookup stated (what break-even admission weighs loads against).",
        &one_f(s.break_even_prefill_tokens_per_s as f64),
    )?;
    o.counter(
        "break_even_cuts",
        "Priced lookups cut short by break-even admission.",
        &one(s.break_even_cuts),
    )?;
    o.counter(
        "demotions",
        "Blocks written host to disk.",
        &one(s.demotions),
    )?;
    o.counter(
        "admission_rejects",
        "Blocks the disk admission policy refused.",
        &one(s.admission_rejects),
    )?;
    o.counter(
        "checksum_failures",
        "Disk blocks that failed their checksum (served as misses).",
        &one(disk.checksum_failures),
    )?;
    o.counter(
        "io_errors",
        "Failed disk reads and writes.",
        &[
            (label("op", "read"), disk.read_errors),
            (label("op", "write"), disk.write_errors),
        ],
    )?;
    if has_disk {
        o.latency(
            "disk_latency",
            "Disk I/O completion time within a batch.",
            &[
                (label("op", "read"), &disk.read_latency),
                (label("op", "write"), &disk.write_latency),
            ],
        )?;
    }
    o.gauge("leases", "Leases outstanding.", &one_f(s.leases as f64))?;
    o.counter(
        "leases_expired",
        "Leases that lapsed without release.",
        &one(s.leases_expired),
    )?;
    o.gauge(
        "ipc_clients",
        "Engine connections.",
        &one_f(d.ipc_clients.load(Relaxed) as f64),
    )?;
    o.counter(
        "ipc_errors",
        "Engine requests answered with an error.",
        &one(d.ipc_errors.load(Relaxed)),
    )?;
    for (name, help, v) in [
        (
            "events_published",
            "Block events published on the KV event socket ([events]).",
            &d.events.events,
        ),
        (
            "event_batches",
            "KV event batches published (and buffered for replay).",
            &d.events.batches,
        ),
        (
            "event_batches_dropped",
            "KV event batches dropped: events.hwm batches (or 64 MiB) were queued; each drop resets subscribers' view.",
            &d.events.dropped_batches,
        ),
        (
            "events_lost",
            "Block events a store dropped: it ran events.backlog events ahead of the KV event publisher; each loss resets subscribers' view.",
            &d.events.lost_events,
        ),
        (
            "event_resets",
            "Resets of KV event subscribers' view after events were lost: AllBlocksCleared, then every block held (at most once per 5 s per store).",
            &d.events.resets,
        ),
        (
            "event_replays",
            "KV event replay requests served.",
            &d.events.replay.replays,
        ),
        (
            "event_subscriber_skips",
            "KV event batches not sent to a subscriber that had 32 MiB queued (it sees the gap in the sequence and can ask the replay socket).",
            &d.events.socket.skipped,
        ),
        (
            "event_subscribers_cut",
            "KV event subscribers disconnected: a write waited 10 s (the subscriber read nothing), or a broken handshake or frame.",
            &d.events.socket.cut,
        ),
        (
            "event_replays_abandoned",
            "KV event replay requesters disconnected in a replay: a write waited 1 s (it stopped reading), or the replay took 60 s; the live stream and other requesters never wait on one.",
            &d.events.replay.abandoned,
        ),
    ] {
        o.counter(name, help, &one(v.load(Relaxed)))?;
    }
    let mut closed = Vec::new();
    for (listener, c) in [("admin", &d.admin_conns), ("metrics", &d.metrics_conns)] {
        for (reason, v) in [
            ("refused", &c.refused),
            ("silent", &c.silent),
            ("stalled", &c.stalled),
        ] {
            let mut l = label("listener", listener);
            l.push(("reason", reason.into()));
            closed.push((l, v.load(Relaxed)));
        }
    }
    o.counter(
        "connections_closed",
        "Admin gRPC and metrics connections closed by the daemon, by reason: refused (at accept: too many open, in all or from its address), silent (no preface within 10 s of connecting: HTTP/2's 24 bytes, a request's first byte), stalled (a response the peer read nothing of for 30 s).",
        &closed,
    )?;
    o.gauge(
        "event_subscribers",
        "KV event subscribers connected to the PUB socket.",
        &one_f(d.events.socket.subscribers.load(Relaxed) as f64),
    )?;
    if let Some(h) = &d.engine_hashes {
        o.gauge(
            "event_engine_hashes",
            "Stored blocks whose KV events go under the engine's own hash (kept while events are on).",
            &one_f(h.len() as f64),
        )?;
        o.counter(
            "event_engine_hashes_refused",
            "Engine hashes not kept (the table was full): those blocks' events use kvtier keys.",
            &one(h.refused.load(Relaxed)),
        )?;
        o.counter(
            "event_engine_hashes_swept",
            "Engine hashes forgotten after lost events: blocks no tier held any more (their BlockRemoved was lost).",
            &one(h.swept.load(Relaxed)),
        )?;
    }
    let lat = d.latency_buckets();
    let samples: Vec<(Labels, &LatencyBuckets)> =
        lat.iter().map(|(op, h)| (label("op", *op), h)).collect();
    o.latency(
        "ipc_request",
        "Engine request service time, per request kind.",
        &samples,
    )?;
    let counts: Vec<(Labels, u64)> = lat
        .iter()
        .map(|(op, h)| (label("op", *op), h.count()))
        .collect();
    o.counter("ipc_requests", "Engine requests served.", &counts)?;
    o.counter(
        "events_dropped",
        "Block events lost because a watcher fell behind.",
        &one(d.store.events_dropped()),
    )?;
    o.counter(
        "host_checksum_failures",
        "Host blocks whose bytes no longer matched their commit checksum (dropped, never served).",
        &one(s.checksum_failures),
    )?;
    o.counter(
        "waits",
        "Requests that waited for room or for another request's promotion.",
        &one(s.waits),
    )?;
    o.counter_secs(
        "load_wait",
        "Seconds loads spent waiting for blocks to come up from a lower tier (disk, remote): the lower tiers' time on the engines' critical path.",
        s.load_wait_ns as f64 / 1e9,
    )?;
    o.gauge(
        "demote_queue_bytes",
        "Bytes queued for the tiering worker to write below.",
        &one_f(s.demote_queue_bytes as f64),
    )?;
    o.gauge(
        "promote_queue",
        "Promotion batches queued for the tiering worker.",
        &one_f(s.promote_queue as f64),
    )?;
    o.gauge(
        "host_populated_ratio",
        "Share of the host arena faulted in and usable.",
        &one_f(s.populated_segments as f64 / (s.total_segments.max(1)) as f64),
    )?;
    if !d.tenants.is_empty() {
        let per: Vec<(String, kvstore::StoreStats)> = d
            .tenants
            .iter()
            .map(|t| (t.cfg.name.clone(), t.store.stats()))
            .collect();
        for (name, help, f) in [
            (
                "tenant_host_capacity_bytes",
                "A tenant's host quota.",
                (|s: &kvstore::StoreStats| s.capacity_bytes) as fn(&kvstore::StoreStats) -> u64,
            ),
            (
                "tenant_host_used_bytes",
                "A tenant's host blocks, bytes.",
                |s| s.used_bytes,
            ),
            (
                "tenant_disk_capacity_bytes",
                "A tenant's disk quota.",
                |s| s.disk().map_or(0, |k| k.capacity_bytes),
            ),
            (
                "tenant_disk_used_bytes",
                "A tenant's disk blocks, bytes.",
                |s| s.disk().map_or(0, |k| k.used_bytes),
            ),
        ] {
            let samples: Vec<(Labels, f64)> = per
                .iter()
                .map(|(t, s)| (label("tenant", t.as_str()), f(s) as f64))
                .collect();
            o.gauge(name, help, &samples)?;
        }
    }
    o.counter(
        "log_lines_dropped",
        "Log lines dropped because stderr was gone, failing or stalled.",
        &one(d.log.dropped_full.load(Relaxed) + d.log.dropped_errors.load(Relaxed)),
    )
}

/// Serves `/metrics` (bearer token when `server.token` is set) and `/healthz`, `/readyz` (no
/// token: they tell nothing but up / ready) until `stop` turns true.
pub async fn serve(
    listener: TcpListener,
    d: Arc<Daemon>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .fallback(|| async { (StatusCode::NOT_FOUND, "GET /metrics, /healthz or /readyz\n") })
        .with_state(d.clone());
    let d_conns = d.metrics_conns.clone();
    let gate = crate::conns::Gate::new("metrics", METRICS_CONNS, d_conns);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of descriptors and the like: a moment later, again.
                    tracing::warn!(error = %e, "metrics: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let Some(io) = gate.admit(stream, peer) else {
            continue;
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_DEADLINE)
                .serve_connection(hyper_util::rt::TokioIo::new(io), svc);
            tokio::pin!(conn);
            // A scraper's keep-alive connection is closed between requests after
            // MAX_CONNECTION_AGE (it opens another), and at shutdown.
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = tokio::time::sleep(MAX_CONNECTION_AGE) => {}
                _ = stop.changed() => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(HEADER_DEADLINE, conn).await;
        });
    }
}

/// Connections to the metrics listener at once: in all, and from one address.
const METRICS_CONNS: crate::conns::Limits = crate::conns::Limits {
    total: 256,
    per_address: 64,
    // The request line's first byte (hyper's header deadline bounds the rest).
    preface: 1,
};
/// Longest a request's head may take to arrive (and an idle keep-alive connection to wait for
/// the next one).
const HEADER_DEADLINE: Duration = Duration::from_secs(10);
/// A connection is closed between requests after this long.
const MAX_CONNECTION_AGE: Duration = Duration::from_secs(300);

async fn ready(State(d): State<Arc<Daemon>>) -> Response {
    if d.stopping() {
        (StatusCode::SERVICE_UNAVAILABLE, "stopping\n").into_response()
    } else if d.store.stats().populated_segments == 0 {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "host arena not usable yet\n",
        )
            .into_response()
    } else {
        "ready\n".into_response()
    }
}

async fn metrics(State(d): State<Arc<Daemon>>, headers: HeaderMap) -> Response {
    let token = &d.cfg.server.token;
    if !token.is_empty() {
        let want = format!("Bearer {token}");
        let ok = headers
            .get(header::AUTHORIZATION)
            .is_some_and(|v| crate::admin::same(v.as_bytes(), want.as_bytes()));
        if !ok {
            return (StatusCode::UNAUTHORIZED, "bearer token required\n").into_response();
        }
    }
    match tokio::task::spawn_blocking(move || render(&d)).await {
        Ok(text) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], text).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}
