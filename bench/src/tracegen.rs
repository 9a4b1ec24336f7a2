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

use anyhow::{bail, Result};

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

/// `requests` requests of the named workload.
pub fn generate(kind: &str, seed: u64, requests: usize) -> Result<Vec<Request>> {
    let mut rng = Rng(seed ^ 0x6B76_7469_6572);
    let mut out = match kind {
        "chat" => chat(&mut rng, requests),
        "agent" => agent(&mut rng, requests),
        "docqa" => docqa(&mut rng, requests),
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

fn chat(rng: &mut Rng, requests: usize) -> Vec<Raw> {
    let mut ids = Ids(0);
    let systems: Vec<Vec<u64>> = (0..8).map(|_| ids.take(rng.range(1, 6))).collect();
    let pick = Zipf::new(systems.len(), 1.0);
    let mut out = Vec::new();
    let mut t = 0.0;
    while out.len() < requests * 2 {
        // A new conversation every 1.5 s on average.
        t += rng.exp(1500.0);
        let mut ctx = systems[pick.sample(rng)].clone();
        let mut at = t;
        // Turns: geometric, mean 3.5, at most 24.
        let turns = 1 + (0..23).take_while(|_| rng.unit() < 0.71).count();
        for _ in 0..turns {
            ctx.extend(ids.take(rng.range(1, 3))); // the user's message
            out.push((at as u64, ctx.clone(), rng.range(100, 600)));
            ctx.extend(ids.take(rng.range(1, 2))); // the answer
            at += rng.exp(60_000.0); // the user reads and types
            if ctx.len() > 120 {
                break;
            }
        }
    }
    out
}

fn agent(rng: &mut Rng, requests: usize) -> Vec<Raw> {
    let mut ids = Ids(0);
    let tools: Vec<Vec<u64>> = (0..4).map(|_| ids.take(rng.range(10, 30))).collect();
    let pick = Zipf::new(tools.len(), 0.8);
    let mut out = Vec::new();
    let mut t = 0.0;
    while out.len() < requests * 2 {
        // A new task every 4 s on average.
        t += rng.exp(4000.0);
        let mut ctx = tools[pick.sample(rng)].clone();
        ctx.extend(ids.take(rng.range(2, 4))); // the task
        let mut marks = vec![ctx.len()];
        let mut at = t;
        let steps = rng.range(3, 25);
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
            at += rng.exp(3000.0); // the tool runs
            if ctx.len() > 160 {
                break;
            }
        }
    }
    out
}

fn docqa(rng: &mut Rng, requests: usize) -> Vec<Raw> {
    let mut ids = Ids(0);
    let system = ids.take(2);
    let docs: Vec<Vec<u64>> = (0..3000).map(|_| ids.take(rng.range(8, 64))).collect();
    let pick = Zipf::new(docs.len(), 1.1);
    let mut t = 0.0;
    (0..requests)
        .map(|_| {
            t += rng.exp(500.0);
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
}
