//! `kvtier-bench replay`: drives the store with a Mooncake-format trace as an engine would
//! (longest-prefix lookup, load of the hit blocks, save of the missing ones), and sweeps the
//! eviction policies against Belady's optimum over a range of capacities.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use clap::Args;
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use kvstore::io::IoConfig;
use kvstore::{
    Admission, AlignedBuf, BlockKey, DiskConfig, Namespace, PolicyKind, StoreConfig, Tier, TpShard,
};
use kvtier_connector::Backend;

use crate::report::{row, Report, Row, SweepTags};
use crate::sim;
use crate::trace::{self, Request};

mod drive;
mod routing;
mod sweep;

pub use drive::*;
use routing::*;
pub use sweep::*;

/// Tokens per block in Mooncake traces.
const TRACE_BLOCK_TOKENS: u64 = 512;

/// Options of `kvtier-bench replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The trace (Mooncake JSONL), or `gen:chat`, `gen:agent`, `gen:docqa` for a synthetic
    /// one (`--seed`, `--synthetic-requests`).
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_synthetic_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Bytes per 512-token block in the replay (scales the trace to this machine; a real
    /// Llama-3.1-8B block is 64 MiB).
    #[arg(long, default_value = "32K", value_parser = crate::parse_size)]
    pub block_bytes: u64,
    /// Host capacity: a percentage of the trace's distinct blocks ("5%") or bytes ("256M").
    #[arg(long, default_value = "5%")]
    pub host: String,
    /// Disk capacity, same forms; "0" for no disk tier.
    #[arg(long, default_value = "20%")]
    pub disk: String,
    /// Eviction policy: duel, duel-clock, wtinylfu, s3fifo, s3fifo-adaptive, lru, clock, sieve or arc (default: the
    /// store's default).
    #[arg(long)]
    pub policy: Option<String>,
    /// Disk admission: seen-twice or always.
    #[arg(long, default_value = "seen-twice")]
    pub admission: String,
    /// Seen-twice admits every block while the disk is less full than this fraction
    /// (`disk.admit_all_below`; 0: seen-twice from the first block).
    #[arg(long, default_value_t = kvstore::DEFAULT_ADMIT_ALL_BELOW)]
    pub admit_all_below: f64,
    /// Write admitted blocks to disk at commit instead of at eviction.
    #[arg(long)]
    pub write_through: bool,
    /// Replay as fast as possible ("fast") or paced by the trace's timestamps ("timestamps").
    #[arg(long, default_value = "fast")]
    pub pace: String,
    /// Speed-up factor for paced replay.
    #[arg(long, default_value_t = 60.0)]
    pub speedup: f64,
    /// Modelled prefill rate, tokens/s, to price recomputation.
    #[arg(long, default_value_t = 10_000.0)]
    pub prefill_rate: f64,
    /// Real KV bytes per token, to project load times to full-size blocks (Llama-3.1-8B bf16).
    #[arg(long, default_value = "128K", value_parser = crate::parse_size)]
    pub real_bytes_per_token: u64,
    /// Capacities (percent of distinct blocks) for the policy-vs-Belady sweep.
    #[arg(long, value_delimiter = ',', default_value = "1,2,5,10,25,50")]
    pub sweep: Vec<f64>,
    /// Skip the sweep.
    #[arg(long)]
    pub no_sweep: bool,
    /// Synthetic traces swept beside `--trace` (comma-separated among chat, agent, docqa;
    /// "none" for none).
    #[arg(long, value_delimiter = ',', default_value = "chat,agent,docqa")]
    pub synthetic: Vec<String>,
    /// Seed of the synthetic traces.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Requests per synthetic trace.
    #[arg(long, default_value_t = 4000)]
    pub synthetic_requests: usize,
    /// The order the simulated policies see a request's blocks: "forward" (as the store does:
    /// hits, then the saved misses, in prefix order) or "tail-first".
    #[arg(long, default_value = "forward")]
    pub sim_order: String,
    /// Replay only the first N requests.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Directory of the disk tier (created, removed afterwards).
    #[arg(long, default_value = "kvtier-replay-data")]
    pub dir: PathBuf,
    /// "embedded" (the store in this process) or "kvtierd" (a daemon started for the run,
    /// driven through its engine socket and shared arena, as an engine would).
    #[arg(long, default_value = "embedded")]
    pub mode: String,
    /// The kvtierd binary for --mode kvtierd (default: next to this one).
    #[arg(long)]
    pub kvtierd: Option<PathBuf>,
    /// Write a Markdown summary and PNG plots into this directory.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
    /// With `--pace timestamps`: model one engine serving the requests in arrival order
    /// (computing missed tokens at `--prefill-rate`, scaled by `--speedup`) and run the trace
    /// twice, without and with preload hints sent at each request's arrival; reports the
    /// fraction of the load time of requests with disk hits that hints took off the critical
    /// path (case `load time hidden by hints`).
    #[arg(long)]
    pub hints: bool,
    /// With `--hints`: the most hints may hold in host memory or have in flight, a percentage
    /// of the host tier ("25%"; default: the store's own bound). Embedded mode only.
    #[arg(long)]
    pub preload_held: Option<String>,
    /// Run the trace twice at the same capacities, without and with session retention: after
    /// each request its blocks are retained under its session (sessions inferred from shared
    /// prefixes: a conversation or an agent task), until `--retain-ttl-s` of trace time after
    /// the session's last request. Reports the prefix-hit gain (cases `prefix hits with
    /// session retention vs none`, `host hits with session retention vs none`).
    #[arg(long)]
    pub retain: bool,
    /// With `--retain`: seconds of trace time a session stays retained after its last request.
    #[arg(long, default_value_t = 300.0)]
    pub retain_ttl_s: f64,
    /// With `--retain`: the store's bound on retained bytes, a percentage of the host tier
    /// (embedded mode).
    #[arg(long, default_value = "25%")]
    pub retain_bytes: String,
    /// With `--retain`: a session's last request demotes it instead (the application knows the
    /// task or the conversation is over: its blocks leave host memory for disk at once).
    #[arg(long)]
    pub demote_at_end: bool,
    /// Spread the requests over this many nodes (each its own store, host tier `--host` of
    /// the trace's distinct blocks, no disk) and compare routings in the same run.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// With `--nodes`: the routing measured (`prefix`: the node whose own tiers hold the
    /// longest prefix, by kvtier's lookup, within 25% of an even load) against the other
    /// (`round-robin`).
    #[arg(long, default_value = "prefix")]
    pub routing: String,
}

/// Parses "12.5%" (fraction of `distinct` blocks, in blocks) or a size (in blocks of
/// `block_bytes`, rounded down).
pub fn capacity_blocks(s: &str, distinct: u64, block_bytes: u64) -> Result<u64> {
    let s = s.trim();
    if let Some(p) = s.strip_suffix('%') {
        let p: f64 = p
            .trim()
            .parse()
            .with_context(|| format!("{s:?} is not a percentage"))?;
        ensure!(
            (0.0..=1000.0).contains(&p),
            "{s:?}: percentage out of range"
        );
        return Ok((distinct as f64 * p / 100.0).round() as u64);
    }
    if s == "0" {
        return Ok(0);
    }
    Ok(crate::parse_size(s)? / block_bytes)
}

/// A progress bar on stderr (hidden when stderr is not a terminal).
pub fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:>28} [{bar:40}] {pos}/{len} {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A trace's name for reports: the synthetic generator's, or the file's stem.
pub fn trace_name(path: &std::path::Path) -> String {
    let s = path.to_string_lossy();
    match s.strip_prefix("gen:") {
        Some(kind) => kind.to_string(),
        None => path
            .file_stem()
            .map(|x| x.to_string_lossy().into_owned())
            .unwrap_or_else(|| s.into_owned()),
    }
}

/// Reads `--trace`: a file, or `gen:KIND` for a synthetic trace.
pub fn load_trace(path: &std::path::Path, seed: u64, requests: usize) -> Result<Vec<Request>> {
    match path.to_string_lossy().strip_prefix("gen:") {
        Some(kind) => crate::tracegen::generate(kind, seed, requests),
        None => trace::load(path),
    }
}

/// Distinct blocks of a trace.
pub fn distinct_blocks(reqs: &[Request]) -> u64 {
    reqs.iter()
        .flat_map(|r| r.hash_ids.iter().copied())
        .collect::<HashSet<u64>>()
        .len() as u64
}

/// Runs the replay benchmark.
pub fn run(args: ReplayArgs) -> Result<()> {
    let sidecar_bin = match args.mode.as_str() {
        "embedded" => None,
        "kvtierd" => Some(crate::sidecar::binary(args.kvtierd.as_deref())?),
        other => bail!("--mode must be embedded or kvtierd, not {other:?}"),
    };
    // Without --policy, the store's defaults: the duel on disk, and in host memory LRU in front
    // of a disk tier (the duel without one).
    let (policy, host_policy) = match &args.policy {
        None => (PolicyKind::default(), None),
        Some(p) => match PolicyKind::parse(p) {
            Some(p) => (p, Some(p)),
            None => bail!(
                "--policy must be duel, duel-clock, wtinylfu, s3fifo, s3fifo-adaptive, lru, clock, sieve or arc, not {p:?}"
            ),
        },
    };
    let order = match args.sim_order.as_str() {
        "forward" => sim::Order::Forward,
        "tail-first" => sim::Order::TailFirst,
        other => bail!("--sim-order must be forward or tail-first, not {other:?}"),
    };
    let synthetic: Vec<&str> = args
        .synthetic
        .iter()
        .map(|x| x.trim())
        .filter(|x| !x.is_empty() && *x != "none")
        .collect();
    for k in &synthetic {
        ensure!(
            crate::tracegen::KINDS.contains(k),
            "--synthetic: no trace {k:?} (use chat, agent, docqa or none)"
        );
    }
    let Some(admission) = Admission::parse(&args.admission) else {
        bail!(
            "--admission must be seen-twice or always, not {:?}",
            args.admission
        );
    };
    let pace = match args.pace.as_str() {
        "fast" => None,
        "timestamps" => {
            ensure!(args.speedup > 0.0, "--speedup must be positive");
            Some(args.speedup)
        }
        other => bail!("--pace must be fast or timestamps, not {other:?}"),
    };
    ensure!(args.prefill_rate > 0.0, "--prefill-rate must be positive");
    ensure!(args.block_bytes >= 64, "--block-bytes must be at least 64");
    let mut reqs = load_trace(&args.trace, args.seed, args.synthetic_requests)?;
    if let Some(n) = args.limit {
        reqs.truncate(n);
    }
    if args.nodes > 1 {
        return routing(&args, &reqs);
    }
    let distinct = distinct_blocks(&reqs);
    let host_blocks = capacity_blocks(&args.host, distinct, args.block_bytes)?.max(1);
    let disk_blocks = capacity_blocks(&args.disk, distinct, args.block_bytes)?;
    let host_policy = host_policy.unwrap_or(PolicyKind::for_host(disk_blocks > 0));
    let (inf_hits, inf_refs) = infinite_hits(&reqs);
    let inf = inf_hits as f64 / inf_refs.max(1) as f64;

    let pb = bar(reqs.len() as u64, "replay");
    let run_cfg = RunCfg {
        host_blocks,
        disk_blocks,
        block_bytes: args.block_bytes,
        policy,
        host_policy,
        admission,
        admit_all_below: args.admit_all_below,
        write_through: args.write_through,
        pace,
        dir: args.dir.clone(),
        engine: args.hints.then_some(args.prefill_rate),
        hints: false,
        preload_held: match &args.preload_held {
            None => None,
            Some(p) => {
                let pct: f64 = p
                    .strip_suffix('%')
                    .and_then(|x| x.parse().ok())
                    .filter(|x: &f64| *x > 0.0 && *x <= 100.0)
                    .with_context(|| {
                        format!("--preload-held {p:?}: expected a percentage, such as \"25%\"")
                    })?;
                Some(pct / 100.0)
            }
        },
        retain: None,
    };
    ensure!(
        !args.hints || pace.is_some(),
        "--hints needs --pace timestamps (hints are sent at each request's arrival)"
    );
    let replay = |cfg: &RunCfg| match &sidecar_bin {
        None => run_embedded(&reqs, cfg, &pb),
        Some(bin) => run_sidecar(&reqs, cfg, bin, &pb),
    };
    let o = replay(&run_cfg)?;
    // The same trace again with hints (fresh store), for the hidden load time.
    let hinted = if args.hints {
        pb.reset();
        Some(replay(&RunCfg {
            hints: true,
            ..run_cfg.clone()
        })?)
    } else {
        None
    };
    // The same trace again with session retention (fresh store, same capacities).
    let retained = if args.retain {
        let pct: f64 = args
            .retain_bytes
            .strip_suffix('%')
            .and_then(|x| x.parse().ok())
            .filter(|x: &f64| *x > 0.0 && *x <= 100.0)
            .with_context(|| {
                format!(
                    "--retain-bytes {:?}: expected a percentage, such as \"25%\"",
                    args.retain_bytes
                )
            })?;
        ensure!(
            args.retain_ttl_s >= 0.0,
            "--retain-ttl-s must be at least 0"
        );
        pb.reset();
        Some(replay(&RunCfg {
            retain: Some(RetainCfg {
                ttl_ms: (args.retain_ttl_s * 1000.0) as u64,
                max_frac: pct / 100.0,
                demote_at_end: args.demote_at_end,
            }),
            hints: false,
            ..run_cfg.clone()
        })?)
    } else {
        None
    };
    pb.finish_and_clear();

    let hit_ratio = (o.host_hits + o.disk_hits) as f64 / o.blocks.max(1) as f64;
    let recompute_s = o.hit_tokens as f64 / args.prefill_rate;
    let loaded_bytes = (o.host_hits + o.disk_hits) * args.block_bytes;
    let bw = if o.load_secs > 0.0 {
        loaded_bytes as f64 / o.load_secs
    } else {
        f64::INFINITY
    };
    let projected_s = (o.hit_tokens * args.real_bytes_per_token) as f64 / bw;
    let one = |case: String, unit: &'static str, value: f64, baseline: f64, is: &'static str| Row {
        case,
        unit,
        value,
        baseline,
        ratio: if baseline > 0.0 {
            value / baseline
        } else {
            0.0
        },
        ratio_spread: None,
        baseline_is: is,
        sweep: None,
    };
    let label = format!(
        "{} host {}{} disk {}{}",
        policy.name(),
        args.host,
        if host_policy == policy {
            String::new()
        } else {
            format!(" ({})", host_policy.name())
        },
        args.disk,
        if sidecar_bin.is_some() {
            " kvtierd"
        } else {
            ""
        }
    );
    let mut rows = vec![
        one(
            format!("block hit ratio ({label})"),
            "ratio",
            hit_ratio,
            inf,
            "infinite cache",
        ),
        one(
            "host hit ratio".into(),
            "ratio",
            o.host_hits as f64 / o.blocks.max(1) as f64,
            hit_ratio,
            "all hits",
        ),
        one(
            "disk hit ratio".into(),
            "ratio",
            o.disk_hits as f64 / o.blocks.max(1) as f64,
            hit_ratio,
            "all hits",
        ),
        one(
            "token hit ratio".into(),
            "ratio",
            o.hit_tokens as f64 / o.tokens.max(1) as f64,
            inf,
            "infinite cache (blocks)",
        ),
        one(
            "load latency p50".into(),
            "ms",
            o.load_us.0 as f64 / 1e3,
            o.load_us.0 as f64 / 1e3,
            "itself",
        ),
        one(
            "load latency p99".into(),
            "ms",
            o.load_us.1 as f64 / 1e3,
            o.load_us.0 as f64 / 1e3,
            "p50",
        ),
        one(
            "load time, projected to full-size KV".into(),
            "s",
            projected_s,
            recompute_s,
            "recompute at --prefill-rate",
        ),
        one(
            "disk bytes read".into(),
            "GB",
            o.disk_bytes_read as f64 / 1e9,
            loaded_bytes as f64 / 1e9,
            "bytes loaded",
        ),
        one(
            "disk bytes written".into(),
            "GB",
            o.disk_bytes_written as f64 / 1e9,
            o.host_bytes_in as f64 / 1e9,
            "bytes saved to host",
        ),
    ];
    if let Some(h) = &hinted {
        // A load's time is its copies out of host memory plus its waits for disk reads. The
        // store measures the waits (embedded store); else the copy rate comes from the loads
        // that found everything in host memory (no-hint run), and for the requests whose lookup
        // found blocks on disk (no-hint run), the rest of their load time is disk time on the
        // critical path, with and without hints.
        let (mut hb, mut hs) = (0u64, 0.0f64);
        for a in o.req_load.iter().filter(|a| !a.1 && a.2 > 0) {
            hb += a.2 as u64 * args.block_bytes;
            hs += a.0;
        }
        let host_rate = if hs > 0.0 {
            hb as f64 / hs
        } else {
            f64::INFINITY
        };
        let copy = |n: usize| (n as u64 * args.block_bytes) as f64 / host_rate;
        let measured = o.req_wait.len() == o.req_load.len() && h.req_wait.len() == h.req_load.len();
        let disk_time = |out: &ReplayOutcome, i: usize| match measured {
            true => out.req_wait[i],
            false => (out.req_load[i].0 - copy(out.req_load[i].2)).max(0.0),
        };
        let (mut without, mut with, mut hideable) = (0.0, 0.0, 0.0);
        for (i, (a, queued)) in o.req_load.iter().zip(&h.req_queue).enumerate() {
            if a.1 && i < h.req_load.len() {
                // Its disk reads alone (no hints), and what of them fits in the time it
                // waited in the queue with hints on (from its hint to its load).
                let alone = disk_time(&o, i);
                without += alone;
                with += disk_time(h, i);
                hideable += alone.min(*queued);
            }
        }
        let hidden = if without > 0.0 {
            (1.0 - with / without).max(0.0)
        } else {
            0.0
        };
        eprintln!(
            "hints: disk time on the critical path {without:.3} s without hints, {with:.3} s with, {hideable:.3} s hideable ({}); hit ratio {:.3} with hints",
            if measured {
                "the loads' waits for disk, as the store measured them".to_string()
            } else {
                format!("host copies at {:.2} GB/s taken out", host_rate / 1e9)
            },
            (h.host_hits + h.disk_hits) as f64 / h.blocks.max(1) as f64
        );
        rows.push(Row {
            case: "load time hidden by hints".into(),
            unit: "fraction",
            value: hidden,
            baseline: 1.0,
            ratio: hidden,
            ratio_spread: None,
            baseline_is: "all of it",
            sweep: None,
        });
        rows.push(one(
            "disk load time on the critical path with hints".into(),
            "s",
            with,
            without,
            "without hints",
        ));
        // What hints could hide at best: per request, the disk time that fits in its wait.
        rows.push(one(
            "load time hideable".into(),
            "s",
            hideable,
            without,
            "disk load time on the critical path without hints",
        ));
        let hidden_s = (without - with).max(0.0);
        rows.push(Row {
            case: "load time hidden by hints vs hideable".into(),
            unit: "s",
            value: hidden_s,
            baseline: hideable,
            ratio: if hideable > 0.0 {
                hidden_s / hideable
            } else {
                1.0
            },
            ratio_spread: None,
            baseline_is: "load time hideable",
            sweep: None,
        });
    }
    // The store against the simulation of the same policy with its host + disk capacity.
    let views: Vec<&[u64]> = reqs.iter().map(|r| r.hash_ids.as_slice()).collect();
    let simulated = sim::simulate(
        &views,
        (host_blocks + disk_blocks) as usize,
        policy,
        sim::Order::Forward,
    );
    rows.push(one(
        format!("replay prefix hits vs simulation ({label})"),
        "hit ratio",
        hit_ratio,
        simulated.prefix_ratio(),
        "simulated prefix hits, same policy and capacity",
    ));
    if let Some(h) = &hinted {
        // With hints the store also learns each request's continuation (the blocks after its
        // cached prefix), which seen-twice admission counts.
        rows.push(one(
            format!("replay prefix hits with hints vs simulation ({label})"),
            "hit ratio",
            (h.host_hits + h.disk_hits) as f64 / h.blocks.max(1) as f64,
            simulated.prefix_ratio(),
            "simulated prefix hits, same policy and capacity",
        ));
        rows.push(one(
            "disk bytes written with hints".into(),
            "GB",
            h.disk_bytes_written as f64 / 1e9,
            o.disk_bytes_written as f64 / 1e9,
            "without hints",
        ));
    }
    let mut points = Vec::new();
    if !args.sweep.is_empty() && !args.no_sweep {
        let name = trace_name(&args.trace);
        points.extend(sweep(&name, &reqs, &args.sweep, order));
        for k in synthetic {
            if k == name {
                continue;
            }
            let t = crate::tracegen::generate(k, args.seed, args.synthetic_requests)?;
            points.extend(sweep(k, &t, &args.sweep, order));
        }
    }
    if let Some(rt) = &retained {
        let frac = |x: &ReplayOutcome, hits: u64| hits as f64 / x.blocks.max(1) as f64;
        eprintln!(
            "retention: {} sessions ({} demoted at their end); {} blocks retained after requests (summed), {} left out by the bound, {} retentions ended by their TTL; prefix hits {:.4} with, {:.4} without (host {:.4} / {:.4})",
            drive::sessions(&reqs).iter().max().map_or(0, |m| m + 1),
            rt.demoted_sessions,
            rt.retained_blocks,
            rt.retain_clipped,
            rt.retain_ended,
            frac(rt, rt.host_hits + rt.disk_hits),
            frac(&o, o.host_hits + o.disk_hits),
            frac(rt, rt.host_hits),
            frac(&o, o.host_hits)
        );
        rows.push(one(
            format!("prefix hits with session retention vs none ({label})"),
            "ratio",
            frac(rt, rt.host_hits + rt.disk_hits),
            frac(&o, o.host_hits + o.disk_hits),
            "no retention, same capacities",
        ));
        rows.push(one(
            format!("host hits with session retention vs none ({label})"),
            "ratio",
            frac(rt, rt.host_hits),
            frac(&o, o.host_hits),
            "no retention, same capacities",
        ));
    }
    rows.extend(sweep_rows(&points));
    eprintln!(
        "replayed {} requests, {} block refs, {distinct} distinct blocks; host {host_blocks} blocks, disk {disk_blocks} blocks of {} bytes; {} hits lost between lookup and load; {} saves, {} skipped",
        o.requests,
        o.blocks,
        args.block_bytes,
        o.load_failures,
        o.saves,
        o.save_skips
    );
    let report = Report {
        bench: "replay",
        results: rows,
    };
    if let Some(dir) = &args.report {
        crate::plot::replay_report(dir, &report, &points, &args, &o, distinct)?;
    }
    report.print(args.json)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(t: u64, ids: &[u64]) -> Request {
        Request {
            timestamp: t,
            input_length: ids.len() as u64 * 512 - 100,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn sessions_follow_conversations_not_shared_system_prompts() {
        // Two conversations on one system prompt (1, 2), their second turns, a third
        // conversation, a retry of the first from its first turn, and a request sharing only
        // the system prompt's first block.
        let reqs = [
            req(0, &[1, 2, 10]),
            req(1, &[1, 2, 20]),
            req(2, &[1, 2, 10, 11, 12]),
            req(3, &[1, 2, 20, 21]),
            req(4, &[1, 2, 30]),
            req(5, &[1, 2, 10, 13]),
            req(6, &[1, 40]),
        ];
        assert_eq!(drive::sessions(&reqs), vec![0, 1, 0, 1, 2, 0, 3]);
    }

    #[test]
    fn sessions_of_the_agent_trace_are_its_tasks() {
        // Every step of a task extends (or retries from) its own history: far fewer sessions
        // than requests, more than the tool preambles.
        let reqs = crate::tracegen::generate("agent", 1, 400).unwrap();
        let s = drive::sessions(&reqs);
        let n = s.iter().max().unwrap() + 1;
        assert!(n > 4 && n < 100, "{n} sessions for 400 requests");
    }

    #[test]
    fn sweep_rows_carry_the_fields_other_tools_read() {
        let reqs = crate::tracegen::generate("chat", 3, 300).unwrap();
        let points = sweep("chat", &reqs, &[10.0, 25.0], sim::Order::Forward);
        let rows = sweep_rows(&points);
        assert_eq!(rows.len(), 2 * PolicyKind::ALL.len() * 2);
        let v = serde_json::to_value(&rows).unwrap();
        for r in v.as_array().unwrap() {
            for f in [
                "policy",
                "capacity_pct",
                "metric",
                "default",
                "trace",
                "ratio",
            ] {
                assert!(r.get(f).is_some(), "{f} missing in {r}");
            }
            let is_default = r["policy"] == PolicyKind::default().name();
            assert_eq!(r["default"], is_default);
            assert!(r["metric"] == "prefix" || r["metric"] == "block");
            // MIN bounds the block hits of every policy.
            if r["metric"] == "block" {
                assert!(r["ratio"].as_f64().unwrap() <= 1.0 + 1e-9, "{r}");
            }
        }
        assert!(points
            .iter()
            .all(|p| p.belady.prefix_hits <= p.belady.block_hits));
    }

    #[test]
    fn capacities() {
        assert_eq!(capacity_blocks("10%", 1000, 4096).unwrap(), 100);
        assert_eq!(capacity_blocks("1M", 1000, 4096).unwrap(), 256);
        assert_eq!(capacity_blocks("0", 1000, 4096).unwrap(), 0);
        assert!(capacity_blocks("x%", 1000, 4096).is_err());
    }

    #[test]
    fn replay_counters_on_a_known_trace() {
        // r0: 1 2 3 (all miss) · r1: 1 2 4 (hits 1 2) · r2: 1 2 3 (hits 1 2 3) · r3: 5 (miss)
        let reqs = vec![
            req(0, &[1, 2, 3]),
            req(1, &[1, 2, 4]),
            req(2, &[1, 2, 3]),
            req(3, &[5]),
        ];
        assert_eq!(infinite_hits(&reqs), (5, 10));
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../target/tmp")
            .join(format!("replay-test-{}", std::process::id()));
        // Room for everything, no disk: the replay must match the infinite cache exactly.
        let o = run_embedded(
            &reqs,
            &RunCfg {
                host_blocks: 64,
                disk_blocks: 0,
                block_bytes: 8192,
                policy: PolicyKind::S3Fifo,
                host_policy: PolicyKind::S3Fifo,
                admission: Admission::Always,
                admit_all_below: kvstore::DEFAULT_ADMIT_ALL_BELOW,
                write_through: false,
                pace: None,
                dir: dir.clone(),
                engine: None,
                hints: false,
                preload_held: None,
                retain: None,
            },
            &ProgressBar::hidden(),
        )
        .unwrap();
        assert_eq!(
            (o.requests, o.blocks, o.host_hits, o.disk_hits),
            (4, 10, 5, 0)
        );
        assert_eq!(o.tokens, 10 * 512 - 400);
        // Hit tokens: r1 two full blocks, r2 two full + last block 412 tokens.
        assert_eq!(o.hit_tokens, 512 * 2 + 512 * 2 + 412);
        assert_eq!(
            o.host_bytes_in,
            5 * 8192,
            "five distinct blocks saved once each"
        );
        // Host holds three blocks (one request); with a disk tier (write-through, always)
        // every hit survives and the old blocks come back from disk.
        let o = run_embedded(
            &reqs,
            &RunCfg {
                host_blocks: 3,
                disk_blocks: 64,
                block_bytes: 1 << 20,
                policy: PolicyKind::Lru,
                host_policy: PolicyKind::Lru,
                admission: Admission::Always,
                admit_all_below: kvstore::DEFAULT_ADMIT_ALL_BELOW,
                write_through: true,
                pace: Some(1000.0),
                dir,
                engine: None,
                hints: false,
                preload_held: None,
                retain: None,
            },
            &ProgressBar::hidden(),
        )
        .unwrap();
        assert_eq!(o.host_hits + o.disk_hits, 5, "{o:?}");
        assert!(o.disk_hits > 0 && o.disk_bytes_read > 0, "{o:?}");
        assert_eq!(o.load_failures, 0);
    }
}
