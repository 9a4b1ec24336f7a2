//! `kvtier`: the command line of a kvtierd. Human tables by default, `--json` for scripts.

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use kvtier_client::{connect, explain, hex, parse_key, pb, tier_name, DEFAULT_ADDR};
use serde_json::json;
use tokio_stream::StreamExt;

#[derive(Parser)]
#[command(name = "kvtier", version, about = "Talk to a kvtierd")]
struct Cli {
    /// kvtierd's admin address.
    #[arg(long, env = "KVTIER_ADDR", default_value = DEFAULT_ADDR, global = true)]
    addr: String,
    /// Bearer token, when kvtierd requires one.
    #[arg(long, env = "KVTIER_TOKEN", global = true, hide_env_values = true)]
    token: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Liveness, version, uptime, I/O engine.
    Status,
    /// Counters per tier and per namespace.
    Stats,
    /// Longest present prefix of a key chain (32-hex-digit keys, in order), or of a prompt
    /// (`--tokens`) or an engine's block hashes (`--hashes`) in a namespace; `--cluster`: where
    /// in the cluster (per node and tier).
    Lookup {
        /// Keys.
        keys: Vec<String>,
        /// Token ids, comma-separated (kvtier's token keys, one per full block).
        #[arg(long, value_delimiter = ',')]
        tokens: Vec<u32>,
        /// The engine's block hashes, hex, comma-separated.
        #[arg(long, value_delimiter = ',')]
        hashes: Vec<String>,
        #[command(flatten)]
        ns: NsArgs,
        /// Answer per node of the cluster.
        #[arg(long)]
        cluster: bool,
    },
    /// Preload: promote the keys found only on disk into host memory in the background (a hint
    /// that these blocks will be loaded soon).
    Prefetch {
        /// Keys, in prefix order.
        keys: Vec<String>,
        /// 0..255, higher first.
        #[arg(long, default_value_t = 0)]
        priority: u32,
        /// Drop what has not started by then (0: the daemon's preload.deadline_ms).
        #[arg(long, default_value_t = 0)]
        deadline_ms: u64,
        /// A tag of the caller's choice, to cancel the hint with `cancel-prefetch`.
        #[arg(long, default_value_t = 0)]
        tag: u64,
    },
    /// Retain: keep a session's blocks (the present prefix of the keys) out of eviction's reach
    /// until the TTL; a later retain of the same session adds to it.
    Retain {
        /// Keys, in prefix order.
        keys: Vec<String>,
        /// The session's name (none: an anonymous retention, ended by its TTL or `demote`).
        #[arg(long, default_value = "")]
        session: String,
        /// Seconds (0: the daemon's preload.max_retain_ms).
        #[arg(long, default_value_t = 0)]
        ttl: u64,
        /// 0..255: a retain may end retentions of lower priority to make room.
        #[arg(long, default_value_t = 0)]
        priority: u32,
    },
    /// Demote: a session (and/or keys) is done for now: end its retention and move its blocks
    /// from host memory to disk at once.
    Demote {
        /// Keys.
        keys: Vec<String>,
        /// The session's name.
        #[arg(long, default_value = "")]
        session: String,
    },
    /// End the admin API's hints of one tag: their queued preloads and the blocks they hold.
    CancelPrefetch {
        /// The tag given to `prefetch --tag`.
        tag: u64,
    },
    /// Remove every block of a namespace (by id, see `stats`).
    Clear {
        /// Namespace id.
        namespace: u32,
    },
    /// Pin the leading present keys for a while.
    Pin {
        /// Keys.
        keys: Vec<String>,
        /// How long, in seconds.
        #[arg(long, default_value_t = 30)]
        ttl: u64,
    },
    /// Release a pin.
    Unpin {
        /// Lease id printed by `pin`.
        lease: u64,
    },
    /// The remote tier: members, their state, bytes in and out per peer, pushes.
    Cluster,
    /// Stream block events.
    Watch {
        /// Stop after this many events.
        #[arg(long)]
        count: Option<usize>,
        /// First every block held (host memory and disk) as a `stored` event, then a
        /// `snapshot-end` line, then the events.
        #[arg(long)]
        snapshot: bool,
    },
}

/// The namespace of `--tokens` / `--hashes` (as the engine registered it).
#[derive(clap::Args)]
struct NsArgs {
    /// Model id (and revision) as the engine names it.
    #[arg(long, default_value = "")]
    model: String,
    /// KV dtype.
    #[arg(long, default_value = "bfloat16")]
    dtype: String,
    /// KV layout name.
    #[arg(long, default_value = "nhd")]
    layout: String,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u32,
    /// Tensor-parallel size (0: KV shared by every rank, MLA).
    #[arg(long, default_value_t = 1)]
    tp_size: u32,
    /// Tensor-parallel rank.
    #[arg(long, default_value_t = 0)]
    tp_rank: u32,
    /// Cache salt / tenant of the namespace.
    #[arg(long, default_value = "")]
    salt: String,
    /// LoRA adapter.
    #[arg(long, default_value = "")]
    lora: String,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvtier: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

async fn run() -> Result<()> {
    let cli = Cli::parse();
    // Bad input is reported before trying to reach the daemon.
    if let Cmd::Lookup { keys, .. }
    | Cmd::Pin { keys, .. }
    | Cmd::Prefetch { keys, .. }
    | Cmd::Retain { keys, .. }
    | Cmd::Demote { keys, .. } = &cli.cmd
    {
        for k in keys {
            parse_key(k)?;
        }
    }
    let mut c = connect(&cli.addr, cli.token.as_deref()).await?;
    match cli.cmd {
        Cmd::Status => {
            let h = c
                .health(pb::HealthRequest {})
                .await
                .map_err(explain)?
                .into_inner();
            let pct = if h.total_segments == 0 {
                100.0
            } else {
                h.populated_segments as f64 * 100.0 / h.total_segments as f64
            };
            if cli.json {
                println!(
                    "{}",
                    json!({"version": h.version, "uptime_ms": h.uptime_ms, "io_engine": h.io_engine,
                        "host_capacity_bytes": h.host_capacity_bytes,
                        "populated_segments": h.populated_segments,
                        "total_segments": h.total_segments, "cluster": h.cluster})
                );
            } else {
                println!(
                    "kvtierd {} up {:.1} s, disk engine {}, host arena {} ({:.0}% populated), cluster {}",
                    h.version,
                    h.uptime_ms as f64 / 1000.0,
                    h.io_engine,
                    gib(h.host_capacity_bytes),
                    pct,
                    h.cluster
                );
            }
        }
        Cmd::Cluster => {
            let r = c
                .cluster(pb::ClusterRequest {})
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                let members: Vec<_> = r
                    .members
                    .iter()
                    .map(|m| {
                        json!({"addr": m.addr, "state": m.state, "bytes_in": m.bytes_in,
                            "bytes_out": m.bytes_out, "failures": m.failures, "requests": m.requests})
                    })
                    .collect();
                println!(
                    "{}",
                    json!({"enabled": r.enabled, "listen": r.listen, "membership": r.membership,
                        "degraded": r.degraded, "membership_changes": r.membership_changes,
                        "replicas": r.replicas, "members": members, "pushes": r.pushes,
                        "push_dropped": r.push_dropped, "push_failed": r.push_failed,
                        "push_retries": r.push_retries,
                        "push_queue_bytes": r.push_queue_bytes, "served_bytes": r.served_bytes,
                        "received_bytes": r.received_bytes, "stored_for_peers": r.stored_for_peers,
                        "auth_failures": r.auth_failures})
                );
            } else if !r.enabled {
                println!("no remote tier (set cluster.listen and cluster.members)");
            } else {
                println!(
                    "node {} ({} membership{}, {} replica(s)); pushed {}, dropped {}, retried {}, failed {}; served {} to peers, stored {} blocks for them",
                    r.listen, r.membership, if r.degraded { ", DEGRADED: etcd unreachable" } else { "" }, r.replicas, r.pushes, r.push_dropped, r.push_retries, r.push_failed,
                    gib(r.served_bytes), r.stored_for_peers
                );
                println!(
                    "{:<24} {:<8} {:>12} {:>12} {:>10} {:>10}",
                    "member", "state", "in", "out", "requests", "failures"
                );
                for m in &r.members {
                    println!(
                        "{:<24} {:<8} {:>12} {:>12} {:>10} {:>10}",
                        m.addr,
                        m.state,
                        gib(m.bytes_in),
                        gib(m.bytes_out),
                        m.requests,
                        m.failures
                    );
                }
            }
        }
        Cmd::Stats => {
            let s = c
                .stats(pb::StatsRequest::default())
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                let tiers: Vec<_> = s
                    .tiers
                    .iter()
                    .map(|t| {
                        json!({"tier": tier_name(t.tier), "capacity_bytes": t.capacity_bytes,
                            "used_bytes": t.used_bytes, "blocks": t.blocks, "bytes_read": t.bytes_read,
                            "bytes_written": t.bytes_written, "evictions": t.evictions,
                            "checksum_failures": t.checksum_failures, "read_errors": t.read_errors,
                            "write_errors": t.write_errors,
                            "read_bandwidth_bytes_per_s": t.read_bandwidth_bytes_per_s,
                            "read_latency_s": t.read_latency_s})
                    })
                    .collect();
                let ns: Vec<_> = s
                    .namespaces
                    .iter()
                    .map(|n| {
                        json!({"id": n.id, "fingerprint": hex(&n.fingerprint), "host_blocks": n.host_blocks,
                            "host_bytes": n.host_bytes, "disk_blocks": n.disk_blocks, "disk_bytes": n.disk_bytes})
                    })
                    .collect();
                let p = s.prefetch.unwrap_or_default();
                let r = s.retention.unwrap_or_default();
                println!(
                    "{}",
                    json!({"tiers": tiers, "namespaces": ns, "hits": s.hits, "misses": s.misses,
                        "leases": s.leases, "promotions": s.promotions, "demotions": s.demotions,
                        "ipc_clients": s.ipc_clients,
                        "prefetch": {"hinted": p.hinted, "in_time": p.in_time, "late": p.late,
                            "cancelled": p.cancelled, "expired": p.expired, "dropped": p.dropped,
                            "wasted_bytes": p.wasted_bytes, "inflight_bytes": p.inflight_bytes,
                            "held_bytes": p.held_bytes, "waited": p.waited,
                            "waiting_keys": p.waiting_keys},
                        "retention": {"retentions": r.retentions, "blocks": r.blocks,
                            "bytes": r.bytes, "max_bytes": r.max_bytes, "retains": r.retains,
                            "clipped_blocks": r.clipped_blocks, "displaced": r.displaced,
                            "expired": r.expired, "demotes": r.demotes,
                            "demoted_freed": r.demoted_freed, "demoted_queued": r.demoted_queued},
                        "break_even_cuts": s.break_even_cuts,
                        "break_even_blocks_cut": s.break_even_blocks_cut,
                        "break_even_prefill_tokens_per_s": s.break_even_prefill_tokens_per_s})
                );
            } else {
                println!(
                    "{:<6} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10} {:>9}",
                    "tier",
                    "capacity",
                    "used",
                    "blocks",
                    "read",
                    "written",
                    "evictions",
                    "bad sums"
                );
                for t in &s.tiers {
                    println!(
                        "{:<6} {:>12} {:>12} {:>10} {:>12} {:>12} {:>10} {:>9}",
                        tier_name(t.tier),
                        gib(t.capacity_bytes),
                        gib(t.used_bytes),
                        t.blocks,
                        gib(t.bytes_read),
                        gib(t.bytes_written),
                        t.evictions,
                        t.checksum_failures
                    );
                }
                println!(
                    "hits {}  misses {}  leases {}  promotions {}  demotions {}  engines {}",
                    s.hits, s.misses, s.leases, s.promotions, s.demotions, s.ipc_clients
                );
                for t in s
                    .tiers
                    .iter()
                    .filter(|t| t.read_bandwidth_bytes_per_s > 0.0)
                {
                    println!(
                        "{} reads measured at {:.2} GB/s + {:.2} ms per batch (break-even admission at the stated prefill rate {} tokens/s: {} lookups cut, {} blocks)",
                        tier_name(t.tier),
                        t.read_bandwidth_bytes_per_s / 1e9,
                        t.read_latency_s * 1e3,
                        s.break_even_prefill_tokens_per_s,
                        s.break_even_cuts,
                        s.break_even_blocks_cut
                    );
                }
                if let Some(r) = s.retention.as_ref().filter(|r| r.retains + r.demotes > 0) {
                    println!(
                        "retention: {} sessions hold {} blocks ({} of {}); {} blocks clipped, {} retentions displaced, {} expired; demoted {} blocks at once, {} after writing",
                        r.retentions,
                        r.blocks,
                        gib(r.bytes),
                        gib(r.max_bytes),
                        r.clipped_blocks,
                        r.displaced,
                        r.expired,
                        r.demoted_freed,
                        r.demoted_queued
                    );
                }
                if let Some(p) = &s.prefetch {
                    println!(
                        "preloads: hinted {}  in time {}  late {}  cancelled {}  expired {}  dropped {}  wasted {}  in flight {}  held {}  waited {} (waiting keys {})",
                        p.hinted, p.in_time, p.late, p.cancelled, p.expired, p.dropped,
                        gib(p.wasted_bytes), gib(p.inflight_bytes), gib(p.held_bytes),
                        p.waited, p.waiting_keys
                    );
                }
                if !s.namespaces.is_empty() {
                    println!(
                        "\n{:<4} {:<32} {:>10} {:>12} {:>10} {:>12}",
                        "ns", "fingerprint", "host", "host bytes", "disk", "disk bytes"
                    );
                    for n in &s.namespaces {
                        println!(
                            "{:<4} {:<32} {:>10} {:>12} {:>10} {:>12}",
                            n.id,
                            hex(&n.fingerprint),
                            n.host_blocks,
                            gib(n.host_bytes),
                            n.disk_blocks,
                            gib(n.disk_bytes)
                        );
                    }
                }
            }
        }
        Cmd::Lookup {
            keys,
            tokens,
            hashes,
            ns,
            cluster,
        } => {
            let keys = keys
                .iter()
                .map(|k| parse_key(k))
                .collect::<Result<Vec<_>>>()?;
            let block_hashes = hashes
                .iter()
                .map(|h| unhex(h))
                .collect::<Result<Vec<_>>>()?;
            let namespace =
                (!tokens.is_empty() || !block_hashes.is_empty()).then_some(pb::NamespaceSpec {
                    model: ns.model,
                    dtype: ns.dtype,
                    layout: ns.layout,
                    block_tokens: ns.block_tokens,
                    tp_size: ns.tp_size,
                    tp_rank: ns.tp_rank,
                    tenant: ns.salt,
                    lora: ns.lora,
                });
            let r = c
                .lookup(pb::LookupRequest {
                    keys,
                    namespace,
                    block_hashes,
                    token_ids: tokens,
                    cluster,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            let tiers: Vec<&str> = r.tiers.iter().map(|t| tier_name(*t)).collect();
            if cli.json {
                let nodes: Vec<_> = r
                    .nodes
                    .iter()
                    .map(|n| {
                        let t: Vec<&str> = n.tiers.iter().map(|t| tier_name(*t)).collect();
                        json!({"node": n.node, "n": n.n, "tiers": t, "local": n.local,
                            "error": n.error, "load_seconds": n.load_seconds,
                            "load_measured": n.load_measured})
                    })
                    .collect();
                println!("{}", json!({"n": r.n, "tiers": tiers, "nodes": nodes}));
            } else {
                println!("{} leading keys present: {}", r.n, tiers.join(" "));
                for n in &r.nodes {
                    let t: Vec<&str> = n.tiers.iter().map(|t| tier_name(*t)).collect();
                    if n.error.is_empty() {
                        let load = if n.load_measured {
                            format!("{:.4} s to load", n.load_seconds)
                        } else {
                            format!("{:.4} s to load (a tier not measured yet)", n.load_seconds)
                        };
                        println!("  {:<24} {:>4}  {}  {load}", n.node, n.n, t.join(" "));
                    } else {
                        println!("  {:<24}    ?  ({})", n.node, n.error);
                    }
                }
            }
        }
        Cmd::Prefetch {
            keys,
            priority,
            deadline_ms,
            tag,
        } => {
            let keys = keys
                .iter()
                .map(|k| parse_key(k))
                .collect::<Result<Vec<_>>>()?;
            let r = c
                .prefetch(pb::PrefetchRequest {
                    keys,
                    priority,
                    deadline_ms,
                    tag,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!(
                    "{}",
                    json!({"present": r.present, "in_host": r.in_host, "joined": r.joined,
                        "queued": r.queued, "dropped": r.dropped, "held": r.held,
                        "waiting": r.waiting})
                );
            } else {
                println!(
                    "{} leading keys present: {} in host memory ({} held for the load), {} being promoted, {} queued now, {} waiting for room, {} given up",
                    r.present, r.in_host, r.held, r.joined, r.queued, r.waiting, r.dropped
                );
            }
        }
        Cmd::Retain {
            keys,
            session,
            ttl,
            priority,
        } => {
            let keys = keys
                .iter()
                .map(|k| parse_key(k))
                .collect::<Result<Vec<_>>>()?;
            let r = c
                .retain(pb::RetainRequest {
                    keys,
                    session,
                    ttl_ms: ttl.saturating_mul(1000),
                    priority,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!(
                    "{}",
                    json!({"present": r.present, "retained": r.retained, "clipped": r.clipped,
                        "clipped_by": r.clipped_by, "refused": r.refused, "ttl_ms": r.ttl_ms,
                        "retained_bytes": r.retained_bytes, "displaced": r.displaced})
                );
            } else if !r.refused.is_empty() {
                bail!("retain refused: {}", r.refused);
            } else {
                println!(
                    "{} leading keys present: {} blocks ({}) retained for {} s, {} left out{}; {} blocks of lower-priority retentions ended",
                    r.present,
                    r.retained,
                    gib(r.retained_bytes),
                    r.ttl_ms / 1000,
                    r.clipped,
                    if r.clipped_by.is_empty() {
                        String::new()
                    } else {
                        format!(" (bounded by {})", r.clipped_by.join(", "))
                    },
                    r.displaced
                );
            }
        }
        Cmd::Demote { keys, session } => {
            if keys.is_empty() && session.is_empty() {
                bail!("demote: name a session (--session) or keys");
            }
            let keys = keys
                .iter()
                .map(|k| parse_key(k))
                .collect::<Result<Vec<_>>>()?;
            let r = c
                .demote(pb::DemoteRequest {
                    keys,
                    session,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!(
                    "{}",
                    json!({"released": r.released, "freed": r.freed, "queued": r.queued,
                        "busy": r.busy, "not_in_host": r.not_in_host, "kept": r.kept})
                );
            } else {
                println!(
                    "{} retained blocks released; {} dropped from host memory now, {} being written to disk first, {} in use (left), {} not in host memory, {} with nowhere to go",
                    r.released, r.freed, r.queued, r.busy, r.not_in_host, r.kept
                );
            }
        }
        Cmd::CancelPrefetch { tag } => {
            let r = c
                .cancel_prefetch(pb::CancelPrefetchRequest {
                    tag,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!("{}", json!({"cancelled": r.cancelled}));
            } else {
                println!(
                    "{} hints, queued preloads and holds of tag {tag} ended",
                    r.cancelled
                );
            }
        }
        Cmd::Clear { namespace } => {
            let r = c
                .clear_namespace(pb::ClearRequest {
                    namespace_id: namespace,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!("{}", json!({"removed": r.removed}));
            } else {
                println!("removed {} blocks of namespace {namespace}", r.removed);
            }
        }
        Cmd::Pin { keys, ttl } => {
            let keys = keys
                .iter()
                .map(|k| parse_key(k))
                .collect::<Result<Vec<_>>>()?;
            let r = c
                .pin(pb::PinRequest {
                    keys,
                    ttl_ms: ttl.saturating_mul(1000),
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!("{}", json!({"lease_id": r.lease_id, "n": r.n}));
            } else if r.n == 0 {
                println!("nothing to pin: the first key is not present");
            } else {
                println!("pinned {} blocks for {ttl} s: lease {}", r.n, r.lease_id);
            }
        }
        Cmd::Unpin { lease } => {
            let r = c
                .unpin(pb::UnpinRequest {
                    lease_id: lease,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            if cli.json {
                println!("{}", json!({"released": r.released}));
            } else if r.released {
                println!("released lease {lease}");
            } else {
                anyhow::bail!("lease {lease} is not held (released or expired)");
            }
        }
        Cmd::Watch { count, snapshot } => {
            let mut stream = c
                .watch(pb::WatchRequest {
                    snapshot,
                    ..Default::default()
                })
                .await
                .map_err(explain)?
                .into_inner();
            let mut seen = 0;
            while let Some(ev) = stream.next().await {
                let ev = ev.map_err(explain)?;
                let kind = match pb::block_event::Kind::try_from(ev.kind) {
                    Ok(pb::block_event::Kind::Stored) => "stored",
                    Ok(pb::block_event::Kind::Removed) => "removed",
                    Ok(pb::block_event::Kind::SnapshotEnd) => "snapshot-end",
                    _ => "?",
                };
                if ev.kind == pb::block_event::Kind::SnapshotEnd as i32 {
                    if cli.json {
                        println!("{}", json!({ "kind": kind }));
                    } else {
                        println!("{kind}");
                    }
                    continue;
                }
                if cli.json {
                    println!(
                        "{}",
                        json!({"kind": kind, "key": hex(&ev.key), "tier": tier_name(ev.tier),
                            "namespace": ev.namespace_id, "unix_ms": ev.unix_ms})
                    );
                } else {
                    println!(
                        "{:<8} {} {:<5} ns {}",
                        kind,
                        hex(&ev.key),
                        tier_name(ev.tier),
                        ev.namespace_id
                    );
                }
                seen += 1;
                if count.is_some_and(|c| seen >= c) {
                    break;
                }
            }
        }
    }
    Ok(())
}

/// Bytes from hex (an engine block hash).
fn unhex(h: &str) -> Result<Vec<u8>> {
    let h = h.trim();
    anyhow::ensure!(
        h.len().is_multiple_of(2) && !h.is_empty() && h.len() <= 128,
        "{h:?} is not a hex block hash (2 to 128 hex digits)"
    );
    (0..h.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&h[i..i + 2], 16)
                .map_err(|_| anyhow::anyhow!("{h:?} is not a hex block hash"))
        })
        .collect()
}
