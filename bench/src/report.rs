//! The JSON report every subcommand prints as its last line, and a human table.

use serde::Serialize;

/// One measured case.
#[derive(Serialize, Clone, Debug)]
pub struct Row {
    /// What was measured.
    pub case: String,
    /// Unit of `value` and `baseline`.
    pub unit: &'static str,
    /// kvtier's figure (median over rounds).
    pub value: f64,
    /// The baseline measured in the same run (median over rounds).
    pub baseline: f64,
    /// value / baseline, median of the per-round ratios.
    pub ratio: f64,
    /// Smallest and largest per-round ratio.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_spread: Option<[f64; 2]>,
    /// What the baseline is.
    pub baseline_is: &'static str,
    /// Fields of a policy-sweep row (other tools select rows by them).
    #[serde(flatten)]
    pub sweep: Option<SweepTags>,
}

/// The fields a policy-sweep row carries besides the case.
#[derive(Serialize, Clone, Debug)]
pub struct SweepTags {
    /// The trace's name.
    pub trace: String,
    /// The policy's name (as config and `--policy` spell it).
    pub policy: &'static str,
    /// Capacity, percent of the trace's distinct blocks.
    pub capacity_pct: f64,
    /// "prefix" (hits an engine can use) or "block" (every present block).
    pub metric: &'static str,
    /// Whether this is the store's default policy.
    pub default: bool,
}

/// A benchmark's report.
#[derive(Serialize, Debug)]
pub struct Report {
    /// Subcommand name.
    pub bench: &'static str,
    /// The rows.
    pub results: Vec<Row>,
}

impl Report {
    /// Prints a table, then (with `json`) the JSON object as the last line.
    pub fn print(&self, json: bool) -> anyhow::Result<()> {
        self.print_with(json, None)
    }

    /// [`Report::print`], the JSON object also carrying `counts` (figures that are not
    /// measured against a baseline: operations done, restarts, ...).
    pub fn print_with(
        &self,
        json: bool,
        counts: Option<&std::collections::BTreeMap<String, f64>>,
    ) -> anyhow::Result<()> {
        println!(
            "{:<34} {:>12} {:>12} {:>8} {:>15}  unit / baseline",
            "case", "value", "baseline", "ratio", "ratio spread"
        );
        for r in &self.results {
            let spread = r
                .ratio_spread
                .map(|[a, b]| format!("{a:.2}..{b:.2}"))
                .unwrap_or_default();
            println!(
                "{:<34} {:>12.3} {:>12.3} {:>8.3} {:>15}  {} / {}",
                r.case, r.value, r.baseline, r.ratio, spread, r.unit, r.baseline_is
            );
        }
        if json {
            let mut v = serde_json::to_value(self)?;
            if let (Some(c), Some(o)) = (counts, v.as_object_mut()) {
                o.insert("counts".into(), serde_json::to_value(c)?);
            }
            println!("{}", serde_json::to_string(&v)?);
        }
        Ok(())
    }
}

/// Median of a non-empty slice (sorted copy).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

/// A row from per-round (value, baseline) pairs.
pub fn row(
    case: String,
    unit: &'static str,
    baseline_is: &'static str,
    rounds: &[(f64, f64)],
) -> Row {
    let values: Vec<f64> = rounds.iter().map(|r| r.0).collect();
    let bases: Vec<f64> = rounds.iter().map(|r| r.1).collect();
    let ratios: Vec<f64> = rounds.iter().map(|r| r.0 / r.1).collect();
    let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    Row {
        case,
        unit,
        value: median(&values),
        baseline: median(&bases),
        ratio: median(&ratios),
        ratio_spread: (rounds.len() > 1).then_some([lo, hi]),
        baseline_is,
        sweep: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_row() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let r = row(
            "c".into(),
            "GB/s",
            "memcpy",
            &[(1.0, 2.0), (3.0, 3.0), (2.0, 4.0)],
        );
        assert_eq!(r.value, 2.0);
        assert_eq!(r.baseline, 3.0);
        assert_eq!(r.ratio, 0.5);
        assert_eq!(r.ratio_spread, Some([0.5, 1.0]));
    }
}
