//! Prometheus text exposition on `GET /metrics`, rendered from the store's counters at scrape
//! time.

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::Daemon;

/// Renders every metric.
pub fn render(d: &Daemon) -> String {
    let s = d.store.stats();
    let mut o = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, f64)]| {
        let _ = writeln!(
            o,
            "# HELP kvtier_{name} {help}\n# TYPE kvtier_{name} {kind}"
        );
        for (labels, v) in samples {
            if labels.is_empty() {
                let _ = writeln!(o, "kvtier_{name} {v}");
            } else {
                let _ = writeln!(o, "kvtier_{name}{{{labels}}} {v}");
            }
        }
    };
    let disk = s.disk().cloned().unwrap_or_default();
    let has_disk = s.disk().is_some();
    let tiered = |host: u64, dsk: u64| -> Vec<(&'static str, f64)> {
        let mut v = vec![("tier=\"host\"", host as f64)];
        if has_disk {
            v.push(("tier=\"disk\"", dsk as f64));
        }
        v
    };
    metric(
        "hits_total",
        "counter",
        "Block gets served.",
        &[("", s.hits as f64)],
    );
    metric(
        "misses_total",
        "counter",
        "Block gets not found.",
        &[("", s.misses as f64)],
    );
    metric(
        "capacity_bytes",
        "gauge",
        "Bytes of block space per tier.",
        &tiered(s.capacity_bytes, disk.capacity_bytes),
    );
    metric(
        "used_bytes",
        "gauge",
        "Bytes of committed blocks per tier.",
        &tiered(s.used_bytes, disk.used_bytes),
    );
    metric(
        "blocks",
        "gauge",
        "Committed blocks per tier.",
        &tiered(s.blocks, disk.blocks),
    );
    metric(
        "evictions_total",
        "counter",
        "Blocks evicted per tier.",
        &tiered(s.evictions, disk.evictions),
    );
    metric(
        "read_bytes_total",
        "counter",
        "Bytes read out of each tier.",
        &tiered(s.bytes_out, disk.bytes_read),
    );
    metric(
        "written_bytes_total",
        "counter",
        "Bytes written into each tier.",
        &tiered(s.bytes_in, disk.bytes_written),
    );
    if let Some(c) = &d.cluster {
        use std::sync::atomic::Ordering::Relaxed;
        let peers = c.remote.peers();
        let labels: Vec<String> = peers
            .iter()
            .map(|p| format!("peer=\"{}\"", p.addr))
            .collect();
        let per = |f: &dyn Fn(&kvtier_cluster::PeerStatus) -> f64| -> Vec<(&str, f64)> {
            peers
                .iter()
                .zip(&labels)
                .filter(|(p, _)| p.state != "self")
                .map(|(p, l)| (l.as_str(), f(p)))
                .collect()
        };
        metric(
            "remote_peer_up",
            "gauge",
            "1 while a peer answers (or was not asked yet), 0 while it fails or its breaker is open.",
            &per(&|p| f64::from(u8::from(matches!(p.state, "up" | "unknown")))),
        );
        metric(
            "remote_peer_received_bytes_total",
            "counter",
            "Block payload bytes read from each peer.",
            &per(&|p| p.bytes_in as f64),
        );
        metric(
            "remote_peer_sent_bytes_total",
            "counter",
            "Block payload bytes pushed to each peer.",
            &per(&|p| p.bytes_out as f64),
        );
        metric(
            "remote_peer_failures_total",
            "counter",
            "Requests to each peer that failed (timeout, refused, broken connection).",
            &per(&|p| p.failures as f64),
        );
        metric(
            "remote_pushes_total",
            "counter",
            "Saved blocks pushed to their owners (pushed), not pushed because the queue was full (dropped), or failed.",
            &[
                ("outcome=\"pushed\"", s.pushes as f64),
                ("outcome=\"dropped\"", s.push_dropped as f64),
                ("outcome=\"failed\"", s.push_failed as f64),
            ],
        );
        metric(
            "remote_push_queue_bytes",
            "gauge",
            "Bytes of saved blocks waiting to be pushed to their owners.",
            &[("", s.push_queue_bytes as f64)],
        );
        let r = s
            .tiers
            .iter()
            .find(|t| t.tier == Some(kvstore::Tier::Remote))
            .cloned()
            .unwrap_or_default();
        metric(
            "remote_checksum_failures_total",
            "counter",
            "Blocks from peers that failed their checksum (misses, never served).",
            &[("", r.checksum_failures as f64)],
        );
        metric(
            "remote_served_bytes_total",
            "counter",
            "Block payload bytes this node served to peers (get) and stored for them (put).",
            &[
                ("op=\"get\"", c.server.bytes_out.load(Relaxed) as f64),
                ("op=\"put\"", c.server.bytes_in.load(Relaxed) as f64),
            ],
        );
        metric(
            "cluster_degraded",
            "gauge",
            "1 while etcd is unreachable (the last known membership is in use, local tiers serve); always 0 with static members.",
            &[("", f64::from(u8::from(c.state() == "degraded")))],
        );
        if let Some((_, m)) = &c.etcd {
            metric(
                "cluster_membership_changes_total",
                "counter",
                "Membership changes applied from etcd.",
                &[("", m.changes.load(Relaxed) as f64)],
            );
        }
        metric(
            "cluster_members",
            "gauge",
            "Members in the placement (this node included).",
            &[("", peers.len() as f64)],
        );
        metric(
            "remote_auth_failures_total",
            "counter",
            "Peer connections refused at set-up (wrong cluster secret or protocol version).",
            &[("", c.server.auth_failures.load(Relaxed) as f64)],
        );
    }
    metric(
        "promotions_total",
        "counter",
        "Blocks copied disk to host.",
        &[("", s.promotions as f64)],
    );
    metric(
        "prefetch_blocks_total",
        "counter",
        "Preload hints: blocks queued (hinted), used from host memory (in_time), waited for (late), cancelled, expired unread, given up (dropped).",
        &[
            ("outcome=\"hinted\"", s.prefetch.hinted as f64),
            ("outcome=\"in_time\"", s.prefetch.in_time as f64),
            ("outcome=\"late\"", s.prefetch.late as f64),
            ("outcome=\"cancelled\"", s.prefetch.cancelled as f64),
            ("outcome=\"expired\"", s.prefetch.expired as f64),
            ("outcome=\"dropped\"", s.prefetch.dropped as f64),
        ],
    );
    metric(
        "prefetch_wasted_bytes_total",
        "counter",
        "Bytes of preloaded blocks no load used before their hint's deadline.",
        &[("", s.prefetch.wasted_bytes as f64)],
    );
    metric(
        "prefetch_held_bytes",
        "gauge",
        "Bytes of blocks held in host memory for the load a hint announced.",
        &[("", s.prefetch.held_bytes as f64)],
    );
    metric(
        "prefetch_waiting_keys",
        "gauge",
        "Keys of hints waiting for preload room.",
        &[("", s.prefetch.waiting_keys as f64)],
    );
    metric(
        "prefetch_inflight_bytes",
        "gauge",
        "Bytes of preloads queued or being read.",
        &[("", s.prefetch.inflight_bytes as f64)],
    );
    metric(
        "tier_read_bandwidth_bytes_per_second",
        "gauge",
        "Measured read bandwidth of promotions per lower tier (what break-even admission uses).",
        &[("tier=\"disk\"", disk.read_bandwidth as f64)],
    );
    metric(
        "break_even_cuts_total",
        "counter",
        "Priced lookups cut short by break-even admission.",
        &[("", s.break_even_cuts as f64)],
    );
    metric(
        "demotions_total",
        "counter",
        "Blocks written host to disk.",
        &[("", s.demotions as f64)],
    );
    metric(
        "admission_rejects_total",
        "counter",
        "Blocks the disk admission policy refused.",
        &[("", s.admission_rejects as f64)],
    );
    metric(
        "checksum_failures_total",
        "counter",
        "Disk blocks that failed their checksum (served as misses).",
        &[("", disk.checksum_failures as f64)],
    );
    metric(
        "io_errors_total",
        "counter",
        "Failed disk reads and writes.",
        &[
            ("op=\"read\"", disk.read_errors as f64),
            ("op=\"write\"", disk.write_errors as f64),
        ],
    );
    metric(
        "disk_latency_us",
        "summary",
        "Disk I/O completion latency within a batch, microseconds.",
        &[
            ("op=\"read\",quantile=\"0.5\"", disk.read_us.0 as f64),
            ("op=\"read\",quantile=\"0.99\"", disk.read_us.1 as f64),
            ("op=\"write\",quantile=\"0.5\"", disk.write_us.0 as f64),
            ("op=\"write\",quantile=\"0.99\"", disk.write_us.1 as f64),
        ],
    );
    metric(
        "leases",
        "gauge",
        "Leases outstanding.",
        &[("", s.leases as f64)],
    );
    metric(
        "leases_expired_total",
        "counter",
        "Leases that lapsed without release.",
        &[("", s.leases_expired as f64)],
    );
    metric(
        "ipc_clients",
        "gauge",
        "Engine connections.",
        &[("", d.ipc_clients.load(Relaxed) as f64)],
    );
    metric(
        "ipc_errors_total",
        "counter",
        "Engine requests answered with an error.",
        &[("", d.ipc_errors.load(Relaxed) as f64)],
    );
    for (name, help, v) in [
        (
            "events_published_total",
            "Block events published on the KV event socket ([events]).",
            &d.events.events,
        ),
        (
            "event_batches_total",
            "KV event batches published (and buffered for replay).",
            &d.events.batches,
        ),
        (
            "event_batches_dropped_total",
            "KV event batches dropped: events.hwm batches were queued.",
            &d.events.dropped_batches,
        ),
        (
            "event_replays_total",
            "KV event replay requests served.",
            &d.events.replays,
        ),
    ] {
        metric(name, "counter", help, &[("", v.load(Relaxed) as f64)]);
    }
    let lat = d.latency_quantiles();
    let samples: Vec<(String, f64)> = lat
        .iter()
        .flat_map(|(op, _, p50, p99)| {
            [
                (format!("op=\"{op}\",quantile=\"0.5\""), *p50 as f64),
                (format!("op=\"{op}\",quantile=\"0.99\""), *p99 as f64),
            ]
        })
        .collect();
    let refs: Vec<(&str, f64)> = samples.iter().map(|(l, v)| (l.as_str(), *v)).collect();
    metric(
        "ipc_request_us",
        "summary",
        "Engine request service time, microseconds.",
        &refs,
    );
    let counts: Vec<(String, f64)> = lat
        .iter()
        .map(|(op, n, _, _)| (format!("op=\"{op}\""), *n as f64))
        .collect();
    let refs: Vec<(&str, f64)> = counts.iter().map(|(l, v)| (l.as_str(), *v)).collect();
    metric(
        "ipc_requests_total",
        "counter",
        "Engine requests served.",
        &refs,
    );
    metric(
        "events_dropped_total",
        "counter",
        "Block events lost because a watcher fell behind.",
        &[("", d.store.events_dropped() as f64)],
    );
    metric(
        "host_checksum_failures_total",
        "counter",
        "Host blocks whose bytes no longer matched their commit checksum (dropped, never served).",
        &[("", s.checksum_failures as f64)],
    );
    metric(
        "waits_total",
        "counter",
        "Requests that waited for room or for another request's promotion.",
        &[("", s.waits as f64)],
    );
    metric(
        "demote_queue_bytes",
        "gauge",
        "Bytes queued for the tiering worker to write below.",
        &[("", s.demote_queue_bytes as f64)],
    );
    metric(
        "promote_queue",
        "gauge",
        "Promotion batches queued for the tiering worker.",
        &[("", s.promote_queue as f64)],
    );
    metric(
        "host_populated_ratio",
        "gauge",
        "Share of the host arena faulted in and usable.",
        &[(
            "",
            s.populated_segments as f64 / (s.total_segments.max(1)) as f64,
        )],
    );
    if !d.tenants.is_empty() {
        let per: Vec<(String, kvstore::StoreStats)> = d
            .tenants
            .iter()
            .map(|t| (format!("tenant=\"{}\"", t.cfg.name), t.store.stats()))
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
            let samples: Vec<(&str, f64)> =
                per.iter().map(|(l, s)| (l.as_str(), f(s) as f64)).collect();
            metric(name, "gauge", help, &samples);
        }
    }
    metric(
        "log_lines_dropped_total",
        "counter",
        "Log lines dropped because stderr was gone, failing or stalled.",
        &[(
            "",
            (d.log.dropped_full.load(Relaxed) + d.log.dropped_errors.load(Relaxed)) as f64,
        )],
    );
    o
}

/// Serves `/metrics` (and `/healthz`, `/readyz` for probes) until shutdown.
pub async fn serve(
    listener: TcpListener,
    d: Arc<Daemon>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            c = listener.accept() => c,
            _ = stop.changed() => return,
        };
        let Ok((mut sock, _)) = conn else { continue };
        let d = d.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 8192];
            let mut n = 0;
            // Read the request head (bounded).
            while n < buf.len() {
                match tokio::time::timeout(
                    std::time::Duration::from_secs(5),
                    sock.read(&mut buf[n..]),
                )
                .await
                {
                    Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
                    Ok(Ok(k)) => {
                        n += k;
                        if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                            break;
                        }
                    }
                }
            }
            let head = String::from_utf8_lossy(&buf[..n]);
            let want = format!("Bearer {}", d.cfg.server.token);
            let authorized = d.cfg.server.token.is_empty()
                || head.lines().any(|l| {
                    l.to_ascii_lowercase().starts_with("authorization:")
                        && l.split_once(':').is_some_and(|x| {
                            crate::admin::same(x.1.trim().as_bytes(), want.as_bytes())
                        })
                });
            // Probes carry no token and learn nothing but up / ready.
            let (status, body) = if head.starts_with("GET /healthz ") {
                ("200 OK", "ok\n".to_string())
            } else if head.starts_with("GET /readyz ") {
                let st = d.store.stats();
                if d.stopping() {
                    ("503 Service Unavailable", "stopping\n".to_string())
                } else if st.populated_segments == 0 {
                    (
                        "503 Service Unavailable",
                        "host arena not usable yet\n".to_string(),
                    )
                } else {
                    ("200 OK", "ready\n".to_string())
                }
            } else if !head.starts_with("GET /metrics") {
                (
                    "404 Not Found",
                    "GET /metrics, /healthz or /readyz\n".to_string(),
                )
            } else if !authorized {
                ("401 Unauthorized", "bearer token required\n".to_string())
            } else {
                let d2 = d.clone();
                let text = tokio::task::spawn_blocking(move || render(&d2))
                    .await
                    .unwrap_or_default();
                ("200 OK", text)
            };
            let resp = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}
