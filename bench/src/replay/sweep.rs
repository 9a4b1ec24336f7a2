//! The eviction policies against Belady's optimum: a simulated sweep over capacities, and the
//! rows other tools read from it.

use super::*;

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
