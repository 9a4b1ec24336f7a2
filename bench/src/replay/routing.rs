//! Requests spread over several nodes: round-robin against prefix-aware routing.

use super::*;

/// One routing's outcome over the nodes: (block hits, blocks asked, prompt tokens saved,
/// prompt tokens).
pub(super) fn route(
    args: &ReplayArgs,
    reqs: &[Request],
    prefix: bool,
) -> Result<(u64, u64, u64, u64)> {
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
pub(super) fn routing(args: &ReplayArgs, reqs: &[Request]) -> Result<()> {
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
