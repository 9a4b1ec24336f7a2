//! Mooncake-format traces: one JSON object per line with `timestamp` (ms), `input_length`,
//! `output_length` and `hash_ids` (the prompt's blocks; equal leading runs are shared prefixes).

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct Request {
    /// Arrival time, milliseconds from the start of the trace.
    pub timestamp: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Generated tokens.
    pub output_length: u64,
    /// Block ids of the prompt, in order.
    pub hash_ids: Vec<u64>,
}

/// Parses a whole trace; a malformed line is an error naming its line number.
pub fn parse(text: &str) -> Result<Vec<Request>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r: Request = serde_json::from_str(line)
            .with_context(|| format!("trace line {}: not a request object", i + 1))?;
        if r.input_length == 0 && !r.hash_ids.is_empty() {
            bail!(
                "trace line {}: input_length 0 with {} blocks",
                i + 1,
                r.hash_ids.len()
            );
        }
        if let Some(prev) = out.last().map(|p: &Request| p.timestamp) {
            if r.timestamp < prev {
                bail!(
                    "trace line {}: timestamp {} goes back in time (previous {prev})",
                    i + 1,
                    r.timestamp
                );
            }
        }
        out.push(r);
    }
    if out.is_empty() {
        bail!("the trace holds no request");
    }
    Ok(out)
}

/// Reads and parses a trace file.
pub fn load(path: &std::path::Path) -> Result<Vec<Request>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the trace {}", path.display()))?;
    parse(&text).with_context(|| format!("in {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_names_the_bad_line() {
        let ok = "{\"timestamp\": 0, \"input_length\": 1024, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\n{\"timestamp\": 3, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [1]}\n";
        let t = parse(ok).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].hash_ids, vec![1, 2]);
        let bad = format!("{ok}{{\"timestamp\": 4, \"input_length\": \"x\"}}\n");
        let e = format!("{:#}", parse(&bad).unwrap_err());
        assert!(e.contains("line 4"), "{e}");
        let back = "{\"timestamp\": 5, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 4, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}";
        let e = format!("{:#}", parse(back).unwrap_err());
        assert!(e.contains("line 2") && e.contains("back in time"), "{e}");
        assert!(parse("").is_err());
        assert!(parse("{not json")
            .unwrap_err()
            .to_string()
            .contains("line 1"));
    }
}
