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
    /// Eviction policy: duel, wtinylfu, s3fifo, s3fifo-adaptive, lru, sieve or arc (default: the
    /// store's default).
    #[arg(long)]
    pub policy: Option<String>,
    /// Disk admission: seen-twice or always.
    #[arg(long, default_value = "seen-twice")]
    pub admission: String,
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

/// Counters of one replay.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ReplayOutcome {
    /// Requests replayed.
    pub requests: u64,
    /// Block references (sum of prompt blocks).
    pub blocks: u64,
    /// Leading blocks found in host memory / on disk.
    pub host_hits: u64,
    /// See `host_hits`.
    pub disk_hits: u64,
    /// Prompt tokens, and tokens covered by loaded blocks.
    pub tokens: u64,
    /// See `tokens`.
    pub hit_tokens: u64,
    /// Blocks found by lookup but not loaded (lost between lookup and load).
    pub load_failures: u64,
    /// Total time spent loading, seconds.
    pub load_secs: f64,
    /// Load latency per request with a hit, microseconds (p50, p99).
    pub load_us: (u64, u64),
    /// Blocks saved, and saves skipped (present, in flight elsewhere, or no space).
    pub saves: u64,
    /// See `saves`.
    pub save_skips: u64,
    /// Bytes saved into the host tier, read from / written to disk.
    pub host_bytes_in: u64,
    /// See `host_bytes_in`.
    pub disk_bytes_read: u64,
    /// See `host_bytes_in`.
    pub disk_bytes_written: u64,
    /// Per request: seconds its load took (on the engine's critical path), whether its lookup
    /// found blocks below host memory, and how many blocks it loaded.
    pub req_load: Vec<(f64, bool, usize)>,
    /// Per request: seconds its load waited for blocks to come up from disk, as the store
    /// measured it (embedded store only; empty otherwise).
    pub req_wait: Vec<f64>,
    /// Per request: seconds from its arrival (when its hint is sent) to the start of its load
    /// (it waited in the engine's queue meanwhile); 0 without pacing.
    pub req_queue: Vec<f64>,
}

impl ReplayOutcome {
    /// Counts a request's hits: `found` leading blocks were present, `n` of them loaded.
    fn count_hits(&mut self, r: &Request, tiers: &[Tier], found: usize, n: usize) {
        self.load_failures += (found - n) as u64;
        for (i, tier) in tiers.iter().take(n).enumerate() {
            match tier {
                Tier::Host => self.host_hits += 1,
                _ => self.disk_hits += 1,
            }
            self.hit_tokens += tokens_in_block(r, i);
        }
    }
}

/// The request's block keys (the trace's hash ids as engine block hashes).
fn request_keys(fp: &kvstore::Fingerprint, r: &Request) -> Result<Vec<BlockKey>> {
    Ok(r.hash_ids
        .iter()
        .map(|id| BlockKey::from_engine_hash(fp, &id.to_le_bytes()))
        .collect::<Result<_, _>>()?)
}

impl RunCfg {
    /// With pacing, sleeps until the request's (scaled) arrival time.
    /// When `r` arrives, after `start` (`None` without pacing).
    fn arrival(&self, r: &Request, start: Instant) -> Option<Instant> {
        let speedup = self.pace?;
        let due = Duration::try_from_secs_f64(r.timestamp as f64 / 1000.0 / speedup).ok()?;
        start.checked_add(due)
    }

    fn wait_for(&self, r: &Request, start: Instant) {
        if let Some(speedup) = self.pace {
            let due = Duration::try_from_secs_f64(r.timestamp as f64 / 1000.0 / speedup)
                .unwrap_or(Duration::MAX);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
}

fn tokens_in_block(r: &Request, i: usize) -> u64 {
    let start = i as u64 * TRACE_BLOCK_TOKENS;
    r.input_length.saturating_sub(start).min(TRACE_BLOCK_TOKENS)
}

/// Prefix hit ratio of an infinite cache (every block ever seen stays).
pub fn infinite_hits(reqs: &[Request]) -> (u64, u64) {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hits, mut refs) = (0, 0);
    for r in reqs {
        let n = r.hash_ids.iter().take_while(|b| seen.contains(b)).count();
        hits += n as u64;
        refs += r.hash_ids.len() as u64;
        seen.extend(r.hash_ids.iter().copied());
    }
    (hits, refs)
}

/// Configuration of one replay run against an embedded store.
pub struct RunCfg {
    /// Host capacity in blocks.
    pub host_blocks: u64,
    /// Disk capacity in blocks (0: none).
    pub disk_blocks: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Eviction policy of the disk tier.
    pub policy: PolicyKind,
    /// Eviction policy of host memory.
    pub host_policy: PolicyKind,
    /// Disk admission.
    pub admission: Admission,
    /// Write-through.
    pub write_through: bool,
    /// Pace by timestamps divided by this factor (None: as fast as possible).
    pub pace: Option<f64>,
    /// Disk tier directory.
    pub dir: PathBuf,
    /// Model one engine serving requests in arrival order (with `pace`): after its load, each
    /// request computes its missed tokens for `tokens / prefill_rate / speedup` seconds, so
    /// later requests queue. `Some(prefill_rate)`.
    pub engine: Option<f64>,
    /// Send each request's preload hint at its arrival (from a thread of its own), so blocks
    /// found only on disk are read while it waits in the queue.
    pub hints: bool,
    /// The store's bound on bytes hints hold or have in flight, a fraction of the host tier
    /// (None: the store's default).
    pub preload_held: Option<f64>,
}

/// Replays `reqs` against a fresh embedded store.
pub fn run_embedded(
    reqs: &[Request],
    cfg: &RunCfg,
    progress: &ProgressBar,
) -> Result<ReplayOutcome> {
    let block = cfg.block_bytes.div_ceil(4096) * 4096;
    // Segments of up to 16 blocks (and 64 MiB), so small host capacities stay exact.
    let per_seg = cfg
        .host_blocks
        .clamp(1, 16)
        .min(((64u64 << 20) / block).max(1));
    let seg = block * per_seg;
    let host_bytes = cfg.host_blocks.max(1).div_ceil(per_seg) * seg;
    let _ = std::fs::remove_dir_all(&cfg.dir);
    let store = StoreConfig {
        capacity_bytes: host_bytes,
        segment_bytes: seg,
        size_classes: vec![cfg.block_bytes as usize],
        policy: cfg.host_policy,
        prefetch_max_held_bytes: cfg
            .preload_held
            .map_or(0, |f| ((host_bytes as f64 * f) as u64).max(1)),
        disk: (cfg.disk_blocks > 0).then(|| DiskConfig {
            dir: cfg.dir.clone(),
            capacity_bytes: cfg.disk_blocks * block + (1 << 20),
            io: IoConfig::default(),
            policy: cfg.policy,
            admission: cfg.admission,
            write_through: cfg.write_through,
            ..Default::default()
        }),
        ..Default::default()
    }
    .build()
    .context("building the replay store")?;
    let backend = Backend::embedded(store);
    let mut out = replay_through(&backend, reqs, cfg, progress)?;
    if cfg.hints {
        if let Some(st) = backend.store().map(|s| s.stats()) {
            eprintln!(
                "hints: {:?}; blocks the loads read from disk themselves: {}",
                st.prefetch, st.disk_hits
            );
        }
    }
    if let Some(d) = backend
        .store()
        .map(|s| s.stats())
        .and_then(|st| st.disk().cloned())
    {
        out.disk_bytes_read = d.bytes_read;
        out.disk_bytes_written = d.bytes_written;
        ensure!(
            d.checksum_failures == 0,
            "checksum failures during the replay: {d:?}"
        );
    }
    drop(backend);
    let _ = std::fs::remove_dir_all(&cfg.dir);
    Ok(out)
}

/// The replay loop, through the connector's transfer API (embedded or kvtierd alike), as an
/// engine does it: longest-prefix lookup; load of the hit blocks, each copied out of the store
/// into the engine's memory; save of the missing ones, each gathered into a reserved slot.
fn replay_through(
    backend: &Backend,
    reqs: &[Request],
    cfg: &RunCfg,
    progress: &ProgressBar,
) -> Result<ReplayOutcome> {
    let ns_def = namespace();
    let fp = ns_def.fingerprint();
    let ns = backend.register_namespace(&ns_def)?;
    let bb = cfg.block_bytes as usize;
    let longest = reqs
        .iter()
        .map(|r| r.hash_ids.len())
        .max()
        .unwrap_or(0)
        .max(1);
    // The engine's memory: a block-sized page per key of the longest request.
    let mut scratch = AlignedBuf::new(bb * longest)?;
    // What a save writes: each block's key, then a shared pattern.
    let mut data = AlignedBuf::new(bb)?;
    data.fill_pattern(1);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 600_000_000, 2)?;
    let mut out = ReplayOutcome::default();
    let start = Instant::now();
    let ttl = Duration::from_secs(60);
    let stop = std::sync::atomic::AtomicBool::new(false);
    // The next request whose hint is to be sent: whoever gets there first (the hint thread at
    // its arrival, or the replay loop when it reaches a request whose hint was not sent yet)
    // sends it, under this lock, so a request's hint always precedes its load and its cancel.
    // Beside it, what each hint found: (blocks present, keys left waiting for room).
    let next_hint = std::sync::Mutex::new((0usize, Vec::<(usize, usize)>::new()));
    let send_hints = |upto: usize| {
        let Ok(mut next) = next_hint.lock() else {
            return;
        };
        while next.0 <= upto && next.0 < reqs.len() {
            let mut found = (0, 0);
            if let Ok(keys) = request_keys(&fp, &reqs[next.0]) {
                if let Ok(p) = backend.prefetch(&keys, 0, Duration::from_secs(60), next.0 as u64) {
                    found = (p.present, p.waiting);
                }
            }
            next.1.push(found);
            next.0 += 1;
        }
    };
    // Blocks still below host memory at a hinted request's load: within the prefix its hint
    // found, past it (stored after the hint), past it with the hint cut for room.
    let mut below = [0u64; 3];
    std::thread::scope(|sc| -> Result<()> {
        if cfg.hints {
            // The scheduler's side: each request's hint as it arrives, whether or not the engine
            // is busy with earlier ones.
            let (stop, send_hints) = (&stop, &send_hints);
            sc.spawn(move || {
                for (i, r) in reqs.iter().enumerate() {
                    cfg.wait_for(r, start);
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        return;
                    }
                    send_hints(i);
                }
            });
        }
        let stopper = StopOnDrop(&stop);
        for (i, r) in reqs.iter().enumerate() {
            cfg.wait_for(r, start);
            out.req_queue.push(
                cfg.arrival(r, start)
                    .map_or(0.0, |a| a.elapsed().as_secs_f64()),
            );
            if cfg.hints {
                send_hints(i);
            }
            let keys = request_keys(&fp, r)?;
            let m = backend.lookup(&keys)?;
            if cfg.hints {
                let (present, waiting) = next_hint
                    .lock()
                    .ok()
                    .and_then(|h| h.1.get(i).copied())
                    .unwrap_or((0, 0));
                for (j, _) in m
                    .tiers
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| **t != Tier::Host)
                {
                    below[usize::from(j >= present) + usize::from(j >= present && waiting > 0)] +=
                        1;
                }
            }
            let mut n = 0;
            let mut load_secs = 0.0;
            let waited_before = backend.store().map(|s| s.stats().load_wait_ns);
            if m.n > 0 {
                let t = Instant::now();
                let mut pages: Vec<Vec<&mut [u8]>> =
                    scratch.chunks_mut(bb).take(m.n).map(|p| vec![p]).collect();
                n = backend
                    .read_segments(&keys[..m.n], &mut pages, ttl)?
                    .iter()
                    .take_while(|ok| **ok)
                    .count();
                load_secs = t.elapsed().as_secs_f64();
                out.load_secs += load_secs;
                let _ = hist.record((t.elapsed().as_micros() as u64).max(1));
            }
            if cfg.hints {
                // Its load is done: the hint ends (as the vLLM connector's does), so what it
                // still holds or has waiting no longer takes the room of the requests behind.
                let _ = backend.cancel_prefetch(i as u64);
            }
            out.req_load
                .push((load_secs, m.tiers.iter().any(|t| *t != Tier::Host), n));
            let waited_after = backend.store().map(|s| s.stats().load_wait_ns);
            if let (Some(a), Some(b)) = (waited_before, waited_after) {
                out.req_wait.push(b.saturating_sub(a) as f64 / 1e9);
            }
            out.count_hits(r, &m.tiers, m.n, n);
            let hit_tokens: u64 = (0..n).map(|i| tokens_in_block(r, i)).sum();
            let rest = &keys[n..];
            if !rest.is_empty() {
                let stamps: Vec<[u8; 16]> = rest.iter().map(|k| k.to_bytes()).collect();
                let pages: Vec<Vec<&[u8]>> =
                    stamps.iter().map(|st| vec![&st[..], &data[16..]]).collect();
                for ok in backend.write_segments(ns, rest, &pages)? {
                    if ok {
                        out.saves += 1;
                    } else {
                        out.save_skips += 1;
                    }
                }
            }
            if let (Some(rate), Some(speedup)) = (cfg.engine, cfg.pace) {
                // The engine computes what it did not load; later requests queue meanwhile.
                let secs = r.input_length.saturating_sub(hit_tokens) as f64 / rate / speedup;
                std::thread::sleep(Duration::from_secs_f64(secs));
            }
            out.requests += 1;
            out.blocks += keys.len() as u64;
            out.tokens += r.input_length;
            progress.inc(1);
        }
        drop(stopper);
        Ok(())
    })?;
    if cfg.hints {
        eprintln!(
            "hints: blocks still below host memory at their load: {} within the prefix the hint found, {} stored after it, {} past a hint cut for room",
            below[0], below[1], below[2]
        );
    }
    out.load_us = (hist.value_at_quantile(0.5), hist.value_at_quantile(0.99));
    out.host_bytes_in = out.saves * cfg.block_bytes;
    Ok(out)
}

/// Tells the hint thread to stop when the replay loop ends (or fails).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

fn namespace() -> Namespace {
    Namespace {
        model: "trace/mooncake".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: TRACE_BLOCK_TOKENS as u32,
        tp: TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    }
}

/// Replays `reqs` through a fresh kvtierd, as an engine would: lookup, load + copy out of the
/// arena + release, reserve + copy into the arena + commit.
pub fn run_sidecar(
    reqs: &[Request],
    cfg: &RunCfg,
    bin: &std::path::Path,
    progress: &ProgressBar,
) -> Result<ReplayOutcome> {
    let block = cfg.block_bytes.div_ceil(4096) * 4096;
    let per_seg = cfg
        .host_blocks
        .clamp(1, 16)
        .min(((64u64 << 20) / block).max(1));
    let seg = block * per_seg;
    let host_bytes = cfg.host_blocks.max(1).div_ceil(per_seg) * seg;
    let mut args: Vec<String> = vec![
        "--host-capacity".into(),
        host_bytes.to_string(),
        "--set".into(),
        format!("host.segment={seg}"),
        "--set".into(),
        format!("host.size_classes=[{}]", cfg.block_bytes),
        "--set".into(),
        format!("host.policy={}", cfg.host_policy.name()),
    ];
    if cfg.disk_blocks > 0 {
        args.extend([
            "--disk-capacity".into(),
            (cfg.disk_blocks * block + (1 << 20)).to_string(),
            "--set".into(),
            format!("disk.policy={}", cfg.policy.name()),
            "--set".into(),
            format!(
                "disk.admission={}",
                if cfg.admission == Admission::Always {
                    "always"
                } else {
                    "seen-twice"
                }
            ),
            "--set".into(),
            format!("disk.write_through={}", cfg.write_through),
        ]);
    } else {
        args.push("--no-disk".into());
    }
    let side = crate::sidecar::Sidecar::start(bin, cfg.dir.clone(), &args)?;
    // Host memory still being populated is taken by evicting, not by waiting: like the
    // embedded store (populated as it is built), start with all of it there.
    side.wait_populated(std::time::Duration::from_secs(600))?;
    let backend = Backend::sidecar(&side.socket, "kvtier-bench replay")?;
    let mut out = replay_through(&backend, reqs, cfg, progress)?;
    // Disk counters come from the admin API.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let s = rt.block_on(async {
        let mut a = kvtier_client::connect(&side.grpc, None).await?;
        a.stats(kvtier_client::pb::StatsRequest::default())
            .await
            .map_err(kvtier_client::explain)
            .map(|r| r.into_inner())
    })?;
    for t in &s.tiers {
        if t.tier == kvtier_client::pb::Tier::Disk as i32 {
            out.disk_bytes_read = t.bytes_read;
            out.disk_bytes_written = t.bytes_written;
            ensure!(
                t.checksum_failures == 0,
                "checksum failures during the replay"
            );
        }
    }
    Ok(out)
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

/// One point of a sweep: one trace at one capacity.
pub struct SweepPoint {
    /// The trace's name.
    pub trace: String,
    /// Percent of distinct blocks.
    pub pct: f64,
    /// Capacity in blocks.
    pub blocks: usize,
    /// Belady's MIN.
    pub belady: sim::SimResult,
    /// Every policy, the default first.
    pub policies: Vec<(PolicyKind, sim::SimResult)>,
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

/// Simulates every policy and MIN at each capacity of one trace (in parallel over capacities).
pub fn sweep(trace: &str, reqs: &[Request], pcts: &[f64], order: sim::Order) -> Vec<SweepPoint> {
    let distinct = distinct_blocks(reqs);
    let views: Vec<&[u64]> = reqs.iter().map(|r| r.hash_ids.as_slice()).collect();
    let pb = bar(
        pcts.len() as u64 * (1 + PolicyKind::ALL.len() as u64),
        &format!("policy sweep {trace}"),
    );
    let out = std::thread::scope(|sc| {
        let handles: Vec<_> = pcts
            .iter()
            .map(|&pct| {
                let (views, pb) = (&views, &pb);
                sc.spawn(move || {
                    let blocks = ((distinct as f64) * pct / 100.0).round().max(1.0) as usize;
                    let belady = sim::belady(views, blocks);
                    pb.inc(1);
                    let policies = PolicyKind::ALL
                        .into_iter()
                        .map(|p| {
                            let r = sim::simulate(views, blocks, p, order);
                            pb.inc(1);
                            (p, r)
                        })
                        .collect();
                    SweepPoint {
                        trace: trace.to_string(),
                        pct,
                        blocks,
                        belady,
                        policies,
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().ok())
            .collect::<Vec<_>>()
    });
    pb.finish_and_clear();
    out
}

/// The sweep's rows: per point and policy, prefix and block hit ratios against MIN's.
pub fn sweep_rows(points: &[SweepPoint]) -> Vec<Row> {
    let mut rows = Vec::new();
    for p in points {
        for &(policy, r) in &p.policies {
            for (metric, value, base, is) in [
                (
                    "prefix",
                    r.prefix_ratio(),
                    p.belady.prefix_ratio(),
                    "Belady MIN (its prefix hits)",
                ),
                (
                    "block",
                    r.block_ratio(),
                    p.belady.block_ratio(),
                    "Belady MIN",
                ),
            ] {
                rows.push(Row {
                    case: format!(
                        "sim {} {metric} {}% {} ({} blocks)",
                        policy.name(),
                        p.pct,
                        p.trace,
                        p.blocks
                    ),
                    unit: "hit ratio",
                    value,
                    baseline: base,
                    ratio: if base > 0.0 { value / base } else { 0.0 },
                    ratio_spread: None,
                    baseline_is: is,
                    sweep: Some(SweepTags {
                        trace: p.trace.clone(),
                        policy: policy.name(),
                        capacity_pct: p.pct,
                        metric,
                        default: policy == PolicyKind::default(),
                    }),
                });
            }
        }
    }
    rows
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
                "--policy must be duel, wtinylfu, s3fifo, s3fifo-adaptive, lru, sieve or arc, not {p:?}"
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
            ..run_cfg
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

/// One routing's outcome over the nodes: (block hits, blocks asked, prompt tokens saved,
/// prompt tokens).
fn route(args: &ReplayArgs, reqs: &[Request], prefix: bool) -> Result<(u64, u64, u64, u64)> {
    let distinct = distinct_blocks(reqs);
    let bb = args.block_bytes.max(64 << 10);
    let host_blocks = capacity_blocks(&args.host, distinct, bb)?.max(1);
    let seg = 16u64 << 20;
    let capacity = (host_blocks * bb).div_ceil(seg).max(2) * seg;
    let stores: Vec<kvstore::Store> = (0..args.nodes)
        .map(|_| {
            kvstore::StoreConfig {
                capacity_bytes: capacity,
                segment_bytes: seg,
                policy: args
                    .policy
                    .as_deref()
                    .and_then(PolicyKind::parse)
                    .unwrap_or_default(),
                ..Default::default()
            }
            .build()
        })
        .collect::<Result<_, _>>()?;
    let ns = kvstore::Namespace {
        model: "bench/routing".into(),
        dtype: "bfloat16".into(),
        layout: "nhd".into(),
        block_tokens: 512,
        tp: kvstore::TpShard::Rank { size: 1, rank: 0 },
        tenant: String::new(),
        lora: String::new(),
    };
    let ids: Vec<kvstore::NsId> = stores
        .iter()
        .map(|s| s.register_namespace(&ns))
        .collect::<Result<_, _>>()?;
    let data = vec![7u8; bb as usize];
    let mut load = vec![0u64; stores.len()];
    let (mut hits, mut asked, mut saved, mut tokens) = (0u64, 0u64, 0u64, 0u64);
    for (i, r) in reqs.iter().enumerate() {
        let keys: Vec<BlockKey> = r
            .hash_ids
            .iter()
            .map(|&h| {
                BlockKey(u128::from(h).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835) | 1)
            })
            .collect();
        let n = if prefix {
            // kvtier's lookup on every node (what `kvtier lookup --cluster` answers), the
            // longest own prefix wins among nodes within 25% of an even load; ties go to the
            // least loaded.
            let even = (i as f64 + 1.0) / stores.len() as f64;
            let mut best: Option<(usize, usize)> = None;
            for (j, s) in stores.iter().enumerate() {
                if load[j] as f64 > 1.25 * even + 1.0 {
                    continue;
                }
                let held = s
                    .probe_local(&keys)
                    .iter()
                    .take_while(|x| x.is_some())
                    .count();
                let better = match best {
                    None => true,
                    Some((b, h)) => held > h || (held == h && load[j] < load[b]),
                };
                if better {
                    best = Some((j, held));
                }
            }
            best.map_or(i % stores.len(), |b| b.0)
        } else {
            i % stores.len()
        };
        load[n] += 1;
        let s = &stores[n];
        let l = s.load(&keys)?;
        let got = l.len();
        drop(l);
        for k in &keys[got..] {
            s.put(ids[n], *k, &data)?;
        }
        hits += got as u64;
        asked += keys.len() as u64;
        let per = r.input_length / (keys.len().max(1) as u64);
        saved += (got as u64 * per).min(r.input_length);
        tokens += r.input_length;
    }
    Ok((hits, asked, saved, tokens))
}

/// `--nodes N`: the trace over N nodes, the chosen routing against the other.
fn routing(args: &ReplayArgs, reqs: &[Request]) -> Result<()> {
    let prefix_first = match args.routing.as_str() {
        "prefix" => true,
        "round-robin" => false,
        other => bail!("--routing must be prefix or round-robin, not {other:?}"),
    };
    let rr = route(args, reqs, false)?;
    let px = route(args, reqs, true)?;
    let (value, base) = if prefix_first { (px, rr) } else { (rr, px) };
    let (vname, bname) = if prefix_first {
        ("prefix", "round-robin")
    } else {
        ("round-robin", "prefix")
    };
    let n = args.nodes;
    let name = trace_name(&args.trace);
    let hr = |x: (u64, u64, u64, u64)| x.0 as f64 / x.1.max(1) as f64;
    let ts = |x: (u64, u64, u64, u64)| x.2 as f64 / x.3.max(1) as f64;
    let base_is: &'static str = if prefix_first {
        "round-robin over the same nodes"
    } else {
        "prefix routing over the same nodes"
    };
    let rows = vec![
        row(
            format!("{name} {n} nodes {vname} vs {bname} block hit ratio"),
            "hit ratio",
            base_is,
            &[(hr(value), hr(base))],
        ),
        row(
            format!("{name} {n} nodes {vname} vs {bname} prefill tokens saved"),
            "fraction",
            base_is,
            &[(ts(value), ts(base))],
        ),
    ];
    Report {
        bench: "replay",
        results: rows,
    }
    .print(args.json)
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
                write_through: false,
                pace: None,
                dir: dir.clone(),
                engine: None,
                hints: false,
                preload_held: None,
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
                write_through: true,
                pace: Some(1000.0),
                dir,
                engine: None,
                hints: false,
                preload_held: None,
            },
            &ProgressBar::hidden(),
        )
        .unwrap();
        assert_eq!(o.host_hits + o.disk_hits, 5, "{o:?}");
        assert!(o.disk_hits > 0 && o.disk_bytes_read > 0, "{o:?}");
        assert_eq!(o.load_failures, 0);
    }
}
