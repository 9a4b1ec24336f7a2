//! `kvtier-bench cluster-sim`: the remote tier's placement at fleet sizes no machine here can
//! run, simulated without processes with the real [`Placement`] (weighted rendezvous hashing).
//! A trace's requests enter the nodes round-robin; each block lives at its owner (a bounded LRU
//! of blocks per node) and a request's prefix hits while its blocks are found where kvtier's
//! remote tier looks: the owner, the previous owner during a hand-over, the next member. Every
//! `--churn-every` requests a node leaves (handing its blocks to their next owners, as a clean
//! stop does) or joins (pulling nothing). Per cluster size it reports:
//!
//! - `hit ratio with churn, N nodes`: block hit ratio against the same replay with no change;
//! - `load skew, N nodes`: most blocks on one node over the mean, against the same keys placed
//!   uniformly at random (balls into bins: what any hash placement can at best approach);
//! - `keys moved per change, N nodes`: the share of keys whose owner changed, against the
//!   share of the node that left or joined (rendezvous moves exactly that share);
//! - `bytes moved per leave, N nodes`: bytes a leaving node hands over, against its share of
//!   all cached bytes.

use std::collections::{BTreeMap, HashMap};

use anyhow::{ensure, Result};
use clap::Args;
use kvstore::BlockKey;
use kvtier_cluster::{Member, Placement};

use crate::report::{row, Report, Row};
use crate::rng::Rng;

/// Options of `kvtier-bench cluster-sim`.
#[derive(Args, Debug)]
pub struct ClusterSimArgs {
    /// Cluster sizes.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512")]
    pub nodes: Vec<usize>,
    /// Trace (Mooncake JSONL, or `gen:chat|agent|docqa`).
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_synthetic_trace.jsonl"
    )]
    pub trace: std::path::PathBuf,
    /// Requests of a generated trace.
    #[arg(long, default_value_t = 4000)]
    pub trace_requests: usize,
    /// Pooled capacity of the cluster, percent of the trace's distinct blocks.
    #[arg(long, default_value_t = 50.0)]
    pub pooled_pct: f64,
    /// A membership change every this many requests (0: a tenth of the trace).
    #[arg(long, default_value_t = 0)]
    pub churn_every: usize,
    /// Block bytes (for bytes moved).
    #[arg(long, default_value = "256K", value_parser = crate::parse_size)]
    pub block_bytes: u64,
    /// Keys of the synthetic population the load skew is also measured on.
    #[arg(long, default_value_t = 1_000_000)]
    pub skew_keys: usize,
    /// Print the JSON report as the last line.
    #[arg(long)]
    pub json: bool,
}

fn member(i: usize) -> Member {
    Member::new(
        format!("10.{}.{}.{}:7070", i >> 16, (i >> 8) & 255, i & 255),
        1.0,
    )
}

fn block_key(id: u64) -> BlockKey {
    BlockKey((u128::from(id) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835))
}

/// The best and second-best member of `key` (the owner and where a push goes when it fails),
/// by index into `p.members()`: one scan, no sort.
fn top2(p: &Placement, key: &BlockKey) -> (usize, Option<usize>) {
    let (mut a, mut b) = ((f64::NEG_INFINITY, 0usize), None::<(f64, usize)>);
    for (i, m) in p.members().iter().enumerate() {
        let s = m.score(key);
        if s > a.0 {
            b = Some(a);
            a = (s, i);
        } else if b.is_none_or(|b| s > b.0) {
            b = Some((s, i));
        }
    }
    (a.1, b.filter(|b| b.0.is_finite()).map(|b| b.1))
}

/// A node's cache: LRU over blocks.
#[derive(Default)]
struct Lru {
    at: HashMap<u64, u64>,
    order: BTreeMap<u64, u64>,
}

impl Lru {
    fn has(&self, k: u64) -> bool {
        self.at.contains_key(&k)
    }

    fn touch(&mut self, k: u64, tick: u64, cap: usize) {
        if let Some(t) = self.at.insert(k, tick) {
            self.order.remove(&t);
        }
        self.order.insert(tick, k);
        while self.at.len() > cap {
            match self.order.pop_first() {
                Some((_, old)) => {
                    self.at.remove(&old);
                }
                None => break,
            }
        }
    }
}

/// Owners of every key under one membership: addresses, so two memberships compare.
struct Epoch {
    owner: HashMap<u64, (String, Option<String>)>,
}

impl Epoch {
    fn new(members: &[Member], ids: &[u64]) -> Self {
        let p = Placement::new(members.to_vec());
        let owner = ids
            .iter()
            .map(|&id| {
                let (a, b) = top2(&p, &block_key(id));
                let addr = |i: usize| p.members()[i].addr.clone();
                (id, (addr(a), b.map(addr)))
            })
            .collect();
        Self { owner }
    }
}

struct Outcome {
    hits: u64,
    lookups: u64,
    moved: Vec<(f64, f64)>,
    handed: Vec<(f64, f64)>,
}

/// Replays `reqs` over `n` nodes; with `churn`, a leave or join every `every` requests.
fn replay(
    reqs: &[Vec<u64>],
    ids: &[u64],
    n: usize,
    cap: usize,
    churn: bool,
    every: usize,
    bb: u64,
) -> Outcome {
    let mut next = n;
    let mut members: Vec<Member> = (0..n).map(member).collect();
    let mut now = Epoch::new(&members, ids);
    let mut prev: Option<Epoch> = None;
    let mut caches: HashMap<String, Lru> = HashMap::new();
    let mut rng = Rng(7);
    let mut out = Outcome {
        hits: 0,
        lookups: 0,
        moved: Vec::new(),
        handed: Vec::new(),
    };
    let mut tick = 0u64;
    let mut leave = true;
    for (r, req) in reqs.iter().enumerate() {
        if churn && r > 0 && r % every == 0 {
            let before = now;
            let share;
            if leave && members.len() > 2 {
                let gone = members.remove(rng.below(members.len() as u64) as usize);
                share = before.owner.values().filter(|o| o.0 == gone.addr).count() as f64
                    / ids.len() as f64;
                now = Epoch::new(&members, ids);
                // A clean stop: its blocks go to their new owners.
                let cached: u64 = caches.values().map(|c| c.at.len() as u64).sum();
                let its = caches.remove(&gone.addr).unwrap_or_default();
                out.handed.push((
                    (its.at.len() as u64 * bb) as f64,
                    cached as f64 / (members.len() + 1) as f64 * bb as f64,
                ));
                for &k in its.order.values() {
                    if let Some((o, _)) = now.owner.get(&k) {
                        tick += 1;
                        caches.entry(o.clone()).or_default().touch(k, tick, cap);
                    }
                }
            } else {
                let m = member(next);
                next += 1;
                members.push(m.clone());
                now = Epoch::new(&members, ids);
                share =
                    now.owner.values().filter(|o| o.0 == m.addr).count() as f64 / ids.len() as f64;
            }
            let moved = ids
                .iter()
                .filter(|id| before.owner[id].0 != now.owner[id].0)
                .count() as f64
                / ids.len() as f64;
            out.moved.push((moved, share));
            prev = Some(before);
            leave = !leave;
        }
        // The prefix, as the remote tier looks for it.
        for &k in req {
            out.lookups += 1;
            let (o, spare) = &now.owner[&k];
            let found = |a: &str| caches.get(a).is_some_and(|c| c.has(k));
            let hit = found(o)
                || prev.as_ref().is_some_and(|p| found(&p.owner[&k].0))
                || spare.as_deref().is_some_and(found);
            if !hit {
                break;
            }
            out.hits += 1;
        }
        // Then saved: every block at its owner.
        for &k in req {
            tick += 1;
            let o = now.owner[&k].0.clone();
            caches.entry(o).or_default().touch(k, tick, cap);
        }
    }
    out
}

/// Most keys on one node over the mean: rendezvous placement, and the same count of keys
/// thrown uniformly at random.
fn skew(n: usize, keys: impl Iterator<Item = BlockKey> + Clone) -> (f64, f64) {
    let p = Placement::new((0..n).map(member).collect());
    let mut per = vec![0u64; n];
    let mut random = vec![0u64; n];
    let mut rng = Rng(11);
    let mut total = 0u64;
    for k in keys {
        per[top2(&p, &k).0] += 1;
        random[rng.below(n as u64) as usize] += 1;
        total += 1;
    }
    let mean = total as f64 / n as f64;
    let max = |v: &[u64]| v.iter().copied().max().unwrap_or(0) as f64 / mean;
    (max(&per), max(&random))
}

pub fn run(args: ClusterSimArgs) -> Result<()> {
    ensure!(!args.nodes.is_empty(), "--nodes: at least one size");
    let reqs = crate::replay::load_trace(&args.trace, 1, args.trace_requests)?;
    let reqs: Vec<Vec<u64>> = reqs.into_iter().map(|r| r.hash_ids).collect();
    let mut ids: Vec<u64> = reqs.iter().flatten().copied().collect();
    ids.sort_unstable();
    ids.dedup();
    let every = if args.churn_every == 0 {
        (reqs.len() / 10).max(1)
    } else {
        args.churn_every
    };
    let name = args
        .trace
        .file_stem()
        .map_or("trace".into(), |s| s.to_string_lossy().to_string());
    eprintln!(
        "cluster-sim: {name}, {} requests, {} distinct blocks, a change every {every} requests",
        reqs.len(),
        ids.len()
    );
    let mut rows: Vec<Row> = Vec::new();
    for &n in &args.nodes {
        ensure!(n >= 2, "--nodes: a cluster has at least 2 nodes");
        let cap = ((ids.len() as f64 * args.pooled_pct / 100.0) / n as f64).ceil() as usize;
        let steady = replay(&reqs, &ids, n, cap.max(1), false, every, args.block_bytes);
        let churned = replay(&reqs, &ids, n, cap.max(1), true, every, args.block_bytes);
        let ratio = |o: &Outcome| o.hits as f64 / o.lookups.max(1) as f64;
        rows.push(row(
            format!("hit ratio with churn, {n} nodes"),
            "hit ratio",
            "the same replay with no membership change",
            &[(ratio(&churned), ratio(&steady))],
        ));
        rows.push(row(
            format!("keys moved per change, {n} nodes"),
            "share of keys",
            "the share of the node that left or joined",
            &churned.moved,
        ));
        rows.push(row(
            format!("bytes moved per leave, {n} nodes"),
            "bytes",
            "the leaving node's share of all cached bytes",
            &churned.handed,
        ));
        let (rv, ra) = skew(n, ids.iter().map(|&i| block_key(i)));
        rows.push(row(
            format!("load skew, {n} nodes, {name} blocks"),
            "max/mean",
            "the same keys placed uniformly at random",
            &[(rv, ra)],
        ));
        // What placing one key costs (every lookup and push does it), against one hash of the
        // key.
        let p = Placement::new((0..n).map(member).collect());
        let sample: Vec<BlockKey> = ids.iter().take(20_000).map(|&i| block_key(i)).collect();
        let t = std::time::Instant::now();
        let mut sink = 0usize;
        for k in &sample {
            sink = sink.wrapping_add(top2(&p, k).0);
        }
        let per_key = t.elapsed().as_nanos() as f64 / sample.len() as f64;
        let t = std::time::Instant::now();
        for k in &sample {
            sink = sink.wrapping_add(kvstore::checksum(&k.0.to_le_bytes()) as usize);
        }
        let per_hash = t.elapsed().as_nanos() as f64 / sample.len() as f64;
        std::hint::black_box(sink);
        rows.push(row(
            format!("owner of a key, {n} nodes"),
            "ns",
            "one xxh3 hash of the key",
            &[(per_key, per_hash.max(0.1))],
        ));
        let (sv, sa) = skew(n, (0..args.skew_keys as u64).map(block_key));
        rows.push(row(
            format!("load skew, {n} nodes, {} blocks", args.skew_keys),
            "max/mean",
            "the same keys placed uniformly at random",
            &[(sv, sa)],
        ));
    }
    Report {
        bench: "cluster-sim",
        results: rows,
    }
    .print(args.json)
}
