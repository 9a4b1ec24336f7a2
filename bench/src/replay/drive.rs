//! The trace driver: an engine's longest-prefix lookups, loads of the hit blocks and saves of
//! the missing ones through the store (embedded, or through kvtierd's socket), timed per
//! request, with or without preload hints.

use super::*;

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
    /// Session retention: blocks retained after each request (summed), blocks left out by the
    /// bound, retentions ended by their TTL.
    pub retained_blocks: u64,
    /// See `retained_blocks`.
    pub retain_clipped: u64,
    /// See `retained_blocks`.
    pub retain_ended: u64,
    /// Sessions demoted at their last request.
    pub demoted_sessions: u64,
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
pub(super) fn request_keys(fp: &kvstore::Fingerprint, r: &Request) -> Result<Vec<BlockKey>> {
    Ok(r.hash_ids
        .iter()
        .map(|id| BlockKey::from_engine_hash(fp, &id.to_le_bytes()))
        .collect::<Result<_, _>>()?)
}

impl RunCfg {
    /// When `r` arrives, after `start` (`None` without pacing).
    fn arrival(&self, r: &Request, start: Instant) -> Option<Instant> {
        let speedup = self.pace?;
        let due = Duration::try_from_secs_f64(r.timestamp as f64 / 1000.0 / speedup).ok()?;
        start.checked_add(due)
    }

    /// With pacing, sleeps until the request's (scaled) arrival time: the replay plays the
    /// trace's clock, so a sleep to the next arrival is what it measures against, not a wait
    /// for a condition.
    fn wait_for(&self, r: &Request, start: Instant) {
        if let Some(wait) = self
            .arrival(r, start)
            .and_then(|at| at.checked_duration_since(Instant::now()))
        {
            std::thread::sleep(wait);
        }
    }
}

pub(super) fn tokens_in_block(r: &Request, i: usize) -> u64 {
    let start = i as u64 * TRACE_BLOCK_TOKENS;
    r.input_length.saturating_sub(start).min(TRACE_BLOCK_TOKENS)
}

/// Configuration of one replay run against an embedded store.
#[derive(Clone)]
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
    /// Seen-twice admits every block while the disk is less full than this fraction.
    pub admit_all_below: f64,
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
    /// Session retention: after each request's saves, its blocks are retained under its
    /// session (see [`sessions`]) for `ttl_ms` of trace time.
    pub retain: Option<RetainCfg>,
}

/// Session retention in a replay.
#[derive(Clone, Copy, Debug)]
pub struct RetainCfg {
    /// A session's retention ends this long (trace time) after its last request: a fast replay
    /// compresses time, so the driver ends it itself (a retain with a 1 ms TTL) once the
    /// trace's clock passes it.
    pub ttl_ms: u64,
    /// The store's bound on retained bytes, a fraction of the host tier (embedded mode; kvtierd
    /// keeps its own, a quarter by default).
    pub max_frac: f64,
    /// At a session's last request, Demote it (the application knows the task or the
    /// conversation is over) instead of retaining it.
    pub demote_at_end: bool,
}

/// The session of each request of a trace that names none: a request continues the session
/// that introduced the last block of its longest previously seen prefix when that prefix
/// covers the session's first prompt (a conversation's next turn, an agent's next step or a
/// retry from an earlier one); otherwise (a new conversation sharing only a system prompt or a
/// tool preamble) it starts one.
pub(super) fn sessions(reqs: &[Request]) -> Vec<u64> {
    let mut owner: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
    let mut first_len: Vec<usize> = Vec::new();
    reqs.iter()
        .map(|r| {
            let seen = r
                .hash_ids
                .iter()
                .take_while(|h| owner.contains_key(h))
                .count();
            let s = seen
                .checked_sub(1)
                .and_then(|j| owner.get(&r.hash_ids[j]).copied())
                .filter(|s| seen >= first_len[*s as usize]);
            let s = s.unwrap_or_else(|| {
                first_len.push(r.hash_ids.len());
                first_len.len() as u64 - 1
            });
            for h in &r.hash_ids {
                owner.entry(*h).or_insert(s);
            }
            s
        })
        .collect()
}

/// The host tier of a replay: (bytes per block slot, segment bytes, host bytes). Segments of
/// up to 16 blocks (and 64 MiB), so small host capacities stay exact.
fn host_sizing(cfg: &RunCfg) -> (u64, u64, u64) {
    let block = cfg.block_bytes.div_ceil(4096) * 4096;
    let per_seg = cfg
        .host_blocks
        .clamp(1, 16)
        .min(((64u64 << 20) / block).max(1));
    let seg = block * per_seg;
    (block, seg, cfg.host_blocks.max(1).div_ceil(per_seg) * seg)
}

/// Replays `reqs` against a fresh embedded store.
pub fn run_embedded(
    reqs: &[Request],
    cfg: &RunCfg,
    progress: &ProgressBar,
) -> Result<ReplayOutcome> {
    let (block, seg, host_bytes) = host_sizing(cfg);
    let _ = std::fs::remove_dir_all(&cfg.dir);
    let store = StoreConfig {
        capacity_bytes: host_bytes,
        segment_bytes: seg,
        size_classes: vec![cfg.block_bytes as usize],
        policy: cfg.host_policy,
        prefetch_max_held_bytes: cfg
            .preload_held
            .map_or(0, |f| ((host_bytes as f64 * f) as u64).max(1)),
        retain_max_bytes: cfg
            .retain
            .map(|r| ((host_bytes as f64 * r.max_frac) as u64).max(1)),
        disk: (cfg.disk_blocks > 0).then(|| DiskConfig {
            dir: cfg.dir.clone(),
            capacity_bytes: cfg.disk_blocks * block + (1 << 20),
            io: IoConfig::default(),
            policy: cfg.policy,
            admission: cfg.admission,
            admit_all_below: cfg.admit_all_below,
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
pub(super) fn replay_through(
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
    // A hint's deadline is a safety net only: the replay, as the vLLM connector does, cancels
    // each hint once its request has loaded, however long it queued (a fixed 60 s let hints of
    // a queue longer than that lapse before their loads: issue 30's prefill-5k cell).
    let hint_deadline = Duration::from_secs(3600);
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
                if let Ok(p) = backend.prefetch(&keys, 0, hint_deadline, next.0 as u64) {
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
    // Session retention: each request's session, and when (trace time) each retention ends.
    let session_of = cfg.retain.map(|_| sessions(reqs)).unwrap_or_default();
    // Whether each request is its session's last.
    let last_of: Vec<bool> = {
        let mut seen = std::collections::HashSet::new();
        let mut v: Vec<bool> = session_of.iter().rev().map(|s| seen.insert(*s)).collect();
        v.reverse();
        v
    };
    let mut retained_until: std::collections::HashMap<u64, u64> = Default::default();
    let mut ends: std::collections::BTreeSet<(u64, u64)> = Default::default();
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
            if cfg.retain.is_some() {
                // Retentions whose TTL (trace time) passed end now (their blocks stay where
                // they are, eviction's again).
                while let Some(&(t, s)) = ends.first() {
                    if t > r.timestamp {
                        break;
                    }
                    ends.pop_first();
                    if retained_until.get(&s) == Some(&t) {
                        retained_until.remove(&s);
                        out.retain_ended += 1;
                        backend.retain(&[], Some(&format!("s{s}")), Duration::from_millis(1), 0)?;
                    }
                }
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
            if let Some(rc) = cfg.retain.filter(|rc| rc.demote_at_end && last_of[i]) {
                // The session's last request: the application is done with it (an agent's
                // task finished, a conversation closed): Demote, so its blocks leave host
                // memory for disk now instead of pushing out sessions still running.
                let _ = rc;
                let s = session_of[i];
                backend.demote(&[], Some(&format!("s{s}")))?;
                if let Some(old) = retained_until.remove(&s) {
                    ends.remove(&(old, s));
                }
                out.demoted_sessions += 1;
            } else if let Some(rc) = cfg.retain {
                // The application will come back to this session: its blocks are retained.
                let s = session_of[i];
                let got = backend.retain(&keys, Some(&format!("s{s}")), Duration::ZERO, 0)?;
                out.retained_blocks += got.retained as u64;
                out.retain_clipped += got.clipped as u64;
                let until = r.timestamp + rc.ttl_ms;
                if let Some(old) = retained_until.insert(s, until) {
                    ends.remove(&(old, s));
                }
                ends.insert((until, s));
            }
            if let (Some(rate), Some(speedup)) = (cfg.engine, cfg.pace) {
                // The engine computes what it did not load; later requests queue meanwhile
                // (a sleep models that compute time: the replay has no engine).
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
pub(super) struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

pub(super) fn namespace() -> Namespace {
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
    let (block, seg, host_bytes) = host_sizing(cfg);
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
            format!("disk.admit_all_below={}", cfg.admit_all_below),
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
