//! Synthetic traces in the Mooncake format, each built from a public description of a workload
//! whose prefix structure differs from the others. Block ids are chained as an engine's block
//! hashes are: a block shared by two requests has the same id only if everything before it is
//! the same too. Every generator is deterministic for its seed.
//!
//! - `chat`: multi-turn conversations (ShareGPT / LMSYS-Chat-1M style, as described by the
//!   Mooncake and CachedAttention (ATC'24) papers): a few shared system prompts; each turn's
//!   prompt is the whole conversation so far plus the new user message; users think for a
//!   minute between turns, many leave after one or two turns.
//! - `agent`: agent loops with tool calls (SWE-agent / ReAct style, as in "KVFlow" and
//!   "Continuum" (2025) descriptions): a large tool-definition prefix per agent type, then a
//!   task, then each step appends the tool call and its output; steps follow each other within
//!   seconds; a tenth of the steps retry from an earlier point (a branch).
//! - `docqa`: document question answering (the long-context RAG workloads of CacheBlend and
//!   LMCache's docs): one system prompt, a document from a catalogue with Zipf(1.1) popularity
//!   (a few hot documents, a long tail seen once), and a one-block question.
//!
//! Each takes parameters after its name, to write out workloads far from the defaults
//! (`chat:gap=200,think=5000,turns=12,prefixes=64,burst=8`): `gap`, the mean milliseconds
//! between new conversations / tasks / questions; `think`, the mean milliseconds between a
//! conversation's turns or a task's steps; `turns`, the mean turns or steps per conversation or
//! task; `prefixes`, how many shared prefixes (system prompts, tool sets, documents); `burst`,
//! how many conversations start at once (the mean gap between bursts grows as much, so the
//! rate stays).

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use crate::rng::Rng;
use crate::trace::Request;

/// Tokens per block (the Mooncake trace's).
const BLOCK_TOKENS: u64 = 512;

/// The generators' names.
pub const KINDS: [&str; 3] = ["chat", "agent", "docqa"];

/// Zipf(`s`) over `n` ranks by inverse transform on the cumulative weights.
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let cum = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect::<Vec<_>>();
        Self(cum)
    }

    fn sample(&self, rng: &mut Rng) -> usize {
        let total = self.0.last().copied().unwrap_or(1.0);
        let x = rng.unit() * total;
        self.0.partition_point(|&c| c < x).min(self.0.len() - 1)
    }
}

/// Fresh block ids.
struct Ids(u64);

impl Ids {
    fn take(&mut self, n: u64) -> Vec<u64> {
        let v = (self.0..self.0 + n).collect();
        self.0 += n;
        v
    }
}

/// A generator's parameters (see the module's doc); `None`: the generator's default.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Params {
    pub gap_ms: Option<f64>,
    pub think_ms: Option<f64>,
    pub turns: Option<f64>,
    pub prefixes: Option<usize>,
    pub burst: Option<u64>,
}

impl Params {
    /// Parses `key=value,...` (empty: all defaults); an unknown key or a value that is not a
    /// positive number is an error naming it.
    pub fn parse(s: &str) -> Result<Self> {
        let mut p = Params::default();
        for kv in s.split(',').filter(|kv| !kv.is_empty()) {
            let Some((k, v)) = kv.split_once('=') else {
                bail!("synthetic trace parameter {kv:?}: expected key=value");
            };
            let x: f64 = match v.parse() {
                Ok(x) if x > 0.0 && f64::is_finite(x) => x,
                _ => bail!("synthetic trace parameter {k}: {v:?} is not a positive number"),
            };
            let whole = || -> Result<u64> {
                if x.fract() != 0.0 || x > 1e9 {
                    bail!("synthetic trace parameter {k}: {v:?} is not a whole number");
                }
                Ok(x as u64)
            };
            match k {
                "gap" => p.gap_ms = Some(x),
                "think" => p.think_ms = Some(x),
                "turns" => p.turns = Some(x.max(1.0)),
                "prefixes" => p.prefixes = Some(whole()? as usize),
                "burst" => p.burst = Some(whole()?),
                other => bail!(
                    "no synthetic trace parameter {other:?}: use gap, think, turns, prefixes or burst"
                ),
            }
        }
        Ok(p)
    }
}

/// Arrival times of new conversations: bursts of `burst` at once, `gap × burst` apart on
/// average (the rate stays one per `gap`).
struct Arrivals {
    t: f64,
    left: u64,
    gap: f64,
    burst: u64,
}

impl Arrivals {
    fn new(gap: f64, burst: u64) -> Self {
        Self {
            t: 0.0,
            left: 0,
            gap,
            burst: burst.max(1),
        }
    }

    fn next(&mut self, rng: &mut Rng) -> f64 {
        if self.left == 0 {
            self.t += rng.exp(self.gap * self.burst as f64);
            self.left = self.burst;
        }
        self.left -= 1;
        self.t
    }
}

/// `requests` requests of the named workload: `KIND` or `KIND:key=value,...` (see [`Params`]).
pub fn generate(spec: &str, seed: u64, requests: usize) -> Result<Vec<Request>> {
    let mut rng = Rng(seed ^ 0x6B76_7469_6572);
    let (kind, params) = spec.split_once(':').unwrap_or((spec, ""));
    let p = Params::parse(params)?;
    let mut out = match kind {
        "chat" => chat(&mut rng, requests, &p),
        "agent" => agent(&mut rng, requests, &p),
        "docqa" => docqa(&mut rng, requests, &p),
        other => bail!("no synthetic trace {other:?}: use one of {KINDS:?}"),
    };
    out.sort_by_key(|r| r.0);
    out.truncate(requests);
    Ok(out
        .into_iter()
        .map(|(t, ids, output)| Request {
            timestamp: t,
            input_length: ids.len() as u64 * BLOCK_TOKENS,
            output_length: output,
            hash_ids: ids,
        })
        .collect())
}

type Raw = (u64, Vec<u64>, u64);

fn chat(rng: &mut Rng, requests: usize, p: &Params) -> Vec<Raw> {
    let mut ids = Ids(0);
    let systems: Vec<Vec<u64>> = (0..p.prefixes.unwrap_or(8))
        .map(|_| ids.take(rng.range(1, 6)))
        .collect();
    let pick = Zipf::new(systems.len(), 1.0);
    let mut out = Vec::new();
    // A new conversation every 1.5 s on average.
    let mut arrivals = Arrivals::new(p.gap_ms.unwrap_or(1500.0), p.burst.unwrap_or(1));
    // Turns: geometric, mean 3.5 (0.71 odds of one more), at most 24 (7 times the mean).
    let (more, most) = match p.turns {
        None => (0.71, 24),
        Some(mean) => (1.0 - 1.0 / mean, (7.0 * mean).ceil() as usize),
    };
    let think = p.think_ms.unwrap_or(60_000.0);
    while out.len() < requests * 2 {
        let mut at = arrivals.next(rng);
        let mut ctx = systems[pick.sample(rng)].clone();
        let turns = 1 + (1..most).take_while(|_| rng.unit() < more).count();
        for _ in 0..turns {
            ctx.extend(ids.take(rng.range(1, 3))); // the user's message
            out.push((at as u64, ctx.clone(), rng.range(100, 600)));
            ctx.extend(ids.take(rng.range(1, 2))); // the answer
            at += rng.exp(think); // the user reads and types
            if ctx.len() > 120 {
                break;
            }
        }
    }
    out
}

fn agent(rng: &mut Rng, requests: usize, p: &Params) -> Vec<Raw> {
    let mut ids = Ids(0);
    let tools: Vec<Vec<u64>> = (0..p.prefixes.unwrap_or(4))
        .map(|_| ids.take(rng.range(10, 30)))
        .collect();
    let pick = Zipf::new(tools.len(), 0.8);
    let mut out = Vec::new();
    // A new task every 4 s on average.
    let mut arrivals = Arrivals::new(p.gap_ms.unwrap_or(4000.0), p.burst.unwrap_or(1));
    // Steps: uniform, 3 to 25 (mean 14); with `turns`, from half the mean to one and a half.
    let (lo, hi) = match p.turns {
        None => (3, 25),
        Some(mean) => {
            let lo = (mean / 2.0).round().max(1.0) as u64;
            (lo, ((2.0 * mean).round() as u64).saturating_sub(lo).max(lo))
        }
    };
    let think = p.think_ms.unwrap_or(3000.0);
    while out.len() < requests * 2 {
        let mut at = arrivals.next(rng);
        let mut ctx = tools[pick.sample(rng)].clone();
        ctx.extend(ids.take(rng.range(2, 4))); // the task
        let mut marks = vec![ctx.len()];
        let steps = rng.range(lo, hi);
        for _ in 0..steps {
            out.push((at as u64, ctx.clone(), rng.range(30, 200)));
            if rng.unit() < 0.1 && marks.len() > 1 {
                // Retry from an earlier step: the history after it is dropped.
                let back = marks[rng.range(0, marks.len() as u64 - 1) as usize];
                ctx.truncate(back);
                marks.retain(|&m| m <= back);
            }
            ctx.extend(ids.take(rng.range(1, 6))); // the tool call and its output
            marks.push(ctx.len());
            at += rng.exp(think); // the tool runs
            if ctx.len() > 160 {
                break;
            }
        }
    }
    out
}

fn docqa(rng: &mut Rng, requests: usize, p: &Params) -> Vec<Raw> {
    let mut ids = Ids(0);
    let system = ids.take(2);
    let docs: Vec<Vec<u64>> = (0..p.prefixes.unwrap_or(3000))
        .map(|_| ids.take(rng.range(8, 64)))
        .collect();
    let pick = Zipf::new(docs.len(), 1.1);
    // A question every 0.5 s on average (one-turn: `think` and `turns` do not apply).
    let mut arrivals = Arrivals::new(p.gap_ms.unwrap_or(500.0), p.burst.unwrap_or(1));
    (0..requests)
        .map(|_| {
            let t = arrivals.next(rng);
            let mut ctx = system.clone();
            ctx.extend(&docs[pick.sample(rng)]);
            ctx.extend(ids.take(1)); // the question
            (t as u64, ctx, rng.range(20, 300))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn generators_are_deterministic_and_chained() {
        for kind in KINDS {
            let a = generate(kind, 1, 500).unwrap();
            assert_eq!(a, generate(kind, 1, 500).unwrap(), "{kind}");
            assert_ne!(a, generate(kind, 2, 500).unwrap(), "{kind}");
            assert_eq!(a.len(), 500);
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
            // Chained ids: a block id always follows the same parent.
            let mut parent = std::collections::HashMap::new();
            let mut shared = 0;
            for r in &a {
                let mut prev = u64::MAX;
                for &b in &r.hash_ids {
                    let p = *parent.entry(b).or_insert(prev);
                    assert_eq!(p, prev, "{kind}: block {b} has two parents");
                    prev = b;
                }
                shared += r.hash_ids.len();
            }
            let distinct: HashSet<u64> = a.iter().flat_map(|r| r.hash_ids.clone()).collect();
            // Every workload reuses blocks.
            assert!(distinct.len() * 10 < shared * 9, "{kind}: no reuse");
        }
        assert!(generate("nope", 1, 1).is_err());
    }

    #[test]
    fn parameters_change_the_workload_and_bad_ones_are_named() {
        // No parameters: the default workload, exactly.
        assert_eq!(
            generate("chat:", 4, 300).unwrap(),
            generate("chat", 4, 300).unwrap()
        );
        let mean_len = |t: &[Request]| {
            t.iter().map(|r| r.hash_ids.len()).sum::<usize>() as f64 / t.len() as f64
        };
        // Longer conversations: longer prompts (each turn carries the ones before).
        let long = generate("chat:turns=12,think=2000", 4, 2000).unwrap();
        let short = generate("chat", 4, 2000).unwrap();
        assert!(mean_len(&long) > 1.5 * mean_len(&short));
        // Bursts: requests arriving at the same millisecond.
        let same = |t: &[Request]| {
            t.windows(2)
                .filter(|w| w[0].timestamp == w[1].timestamp)
                .count()
        };
        let bursty = generate("docqa:burst=8", 4, 2000).unwrap();
        assert!(same(&bursty) > 1500, "{}", same(&bursty));
        assert!(same(&generate("docqa", 4, 2000).unwrap()) < 200);
        // A faster arrival rate: a shorter trace.
        let span = |t: &[Request]| t.last().map_or(0, |r| r.timestamp);
        assert!(
            span(&generate("agent:gap=400", 4, 2000).unwrap()) * 3
                < span(&generate("agent", 4, 2000).unwrap())
        );
        // More shared prefixes: more distinct blocks.
        let distinct = |t: &[Request]| {
            t.iter()
                .flat_map(|r| r.hash_ids.clone())
                .collect::<HashSet<u64>>()
                .len()
        };
        assert!(
            distinct(&generate("agent:prefixes=200", 4, 2000).unwrap())
                > distinct(&generate("agent", 4, 2000).unwrap())
        );
        for (spec, named) in [
            ("chat:nope=1", "nope"),
            ("chat:gap=-1", "gap"),
            ("chat:gap", "gap"),
            ("agent:prefixes=1.5", "prefixes"),
            ("docqa:burst=0", "burst"),
        ] {
            let e = generate(spec, 1, 10).unwrap_err().to_string();
            assert!(e.contains(named), "{spec}: {e}");
        }
    }
}

/// The formats `kvtier-bench tracegen` writes.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    /// One JSON object per line: `timestamp` (ms), `input_length`, `output_length`,
    /// `hash_ids` (what `replay --trace` and `vllm bench serve --dataset-name timed_trace`
    /// read).
    Mooncake,
}

/// `kvtier-bench tracegen`: writes a synthetic trace out, for other tools (vLLM's benchmark
/// client through `bench/serving/run.py`) to replay.
#[derive(Args, Debug)]
pub struct TracegenArgs {
    /// The generator and its parameters (`chat`, `agent`, `docqa`, e.g.
    /// `chat:gap=200,think=5000`; see the module's doc).
    #[arg(long)]
    pub kind: String,
    /// Requests to write.
    #[arg(long, default_value_t = 2000)]
    pub requests: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    #[arg(long, value_enum, default_value_t = Format::Mooncake)]
    pub format: Format,
    /// The file to write (default: standard output, and no summary).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// Print the trace's summary as one JSON object on the last line.
    #[arg(long)]
    pub json: bool,
}

/// Writes the trace; with `--out`, a summary (requests, blocks, distinct blocks, span).
pub fn run(a: TracegenArgs) -> Result<()> {
    let reqs = generate(&a.kind, a.seed, a.requests)?;
    let mut text = String::new();
    for r in &reqs {
        text.push_str(&serde_json::to_string(r)?);
        text.push('\n');
    }
    let Some(out) = &a.out else {
        std::io::stdout().write_all(text.as_bytes())?;
        return Ok(());
    };
    std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    let blocks: usize = reqs.iter().map(|r| r.hash_ids.len()).sum();
    let distinct = reqs
        .iter()
        .flat_map(|r| r.hash_ids.iter())
        .collect::<std::collections::HashSet<_>>()
        .len();
    let span_s = reqs.last().map_or(0, |r| r.timestamp) as f64 / 1000.0;
    println!(
        "tracegen: {} requests of {}, {blocks} blocks ({distinct} distinct) over {span_s:.0} s \
         to {}",
        reqs.len(),
        a.kind,
        out.display()
    );
    if a.json {
        let counts: std::collections::BTreeMap<String, f64> = [
            ("requests", reqs.len() as f64),
            ("blocks", blocks as f64),
            ("distinct_blocks", distinct as f64),
            ("span_s", span_s),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        println!(
            "{}",
            serde_json::json!({"bench": "tracegen", "results": [], "counts": counts})
        );
    }
    Ok(())
}
