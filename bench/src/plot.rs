//! `--report DIR`: a Markdown summary and PNG plots (plotters).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::replay::{ReplayArgs, ReplayOutcome, SweepPoint};
use crate::report::Report;

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a system font for plot text (plotters draws no text without one).
fn ensure_font() -> Result<()> {
    static DONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        for p in FONTS {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        false
    });
    anyhow::ensure!(
        ok,
        "no font for the plots: install Debian's fonts-dejavu-core (looked in {FONTS:?})"
    );
    Ok(())
}

/// One line of a plot.
pub struct Series {
    /// Legend.
    pub name: String,
    /// Points, x ascending.
    pub points: Vec<(f64, f64)>,
    /// Draw as a dashed baseline.
    pub baseline: bool,
}

/// Draws lines into a PNG; `log_x` puts x on a log2 scale.
pub fn lines(
    path: &Path,
    title: &str,
    x: &str,
    y: &str,
    series: &[Series],
    log_x: bool,
) -> Result<()> {
    ensure_font()?;
    let root = BitMapBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let all = series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y1) = (f64::MAX, f64::MIN, 0.0f64);
    for &(a, b) in all {
        x0 = x0.min(a);
        x1 = x1.max(a);
        y1 = y1.max(b);
    }
    if x0 >= x1 {
        x1 = x0 + 1.0;
    }
    let fx = |v: f64| if log_x { v.log2() } else { v };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(fx(x0)..fx(x1), 0.0..(y1 * 1.1).max(1e-9))?;
    chart
        .configure_mesh()
        .x_desc(x)
        .y_desc(y)
        .x_label_formatter(&|v| {
            let v = if log_x { v.exp2() } else { *v };
            if v >= 1024.0 * 1024.0 {
                format!("{:.0}M", v / 1048576.0)
            } else if v >= 1024.0 && log_x {
                format!("{:.0}K", v / 1024.0)
            } else {
                format!("{v:.0}")
            }
        })
        .draw()?;
    for (i, s) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(a, b)| (fx(a), b)).collect();
        let style = color.stroke_width(if s.baseline { 1 } else { 3 });
        let drawn = if s.baseline {
            chart.draw_series(DashedLineSeries::new(pts.clone(), 8, 5, style))?
        } else {
            chart.draw_series(LineSeries::new(pts.clone(), style))?
        };
        drawn.label(s.name.clone()).legend(move |(x, y)| {
            PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
        });
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The rows as a Markdown table.
pub fn table(report: &Report) -> String {
    let mut s = String::from(
        "| case | value | baseline | ratio | unit | baseline is |\n|---|---|---|---|---|---|\n",
    );
    for r in &report.results {
        let _ = writeln!(
            s,
            "| {} | {:.4} | {:.4} | {:.3} | {} | {} |",
            r.case, r.value, r.baseline, r.ratio, r.unit, r.baseline_is
        );
    }
    s
}

/// `replay.md` and `hit_ratio_vs_capacity.png`.
pub fn replay_report(
    dir: &Path,
    report: &Report,
    points: &[SweepPoint],
    args: &ReplayArgs,
    o: &ReplayOutcome,
    distinct: u64,
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut md = format!(
        "# Trace replay\n\nTrace `{}`: {} requests, {} block references, {distinct} distinct 512-token blocks, \
         replayed with {} bytes per block (scaled down from 64 MiB), host {} and disk {}, policy {}, admission {}.\n\n",
        args.trace.display(),
        o.requests,
        o.blocks,
        args.block_bytes,
        args.host,
        args.disk,
        args.policy.as_deref().unwrap_or("default"),
        args.admission
    );
    md.push_str(&table(report));
    let mut traces: Vec<&str> = Vec::new();
    for p in points {
        if !traces.contains(&p.trace.as_str()) {
            traces.push(&p.trace);
        }
    }
    for trace in traces {
        let pts: Vec<&SweepPoint> = points.iter().filter(|p| p.trace == trace).collect();
        let mut series = vec![Series {
            name: "Belady MIN".into(),
            points: pts
                .iter()
                .map(|p| (p.pct, p.belady.prefix_ratio()))
                .collect(),
            baseline: true,
        }];
        for (i, (policy, _)) in pts[0].policies.iter().enumerate() {
            series.push(Series {
                name: policy.name().into(),
                points: pts
                    .iter()
                    .map(|p| (p.pct, p.policies[i].1.prefix_ratio()))
                    .collect(),
                baseline: false,
            });
        }
        let png = format!("hit_ratio_vs_capacity_{trace}.png");
        lines(
            &dir.join(&png),
            &format!("Prefix hit ratio vs capacity, trace {trace} (simulated)"),
            "capacity, % of distinct blocks",
            "prefix hit ratio",
            &series,
            false,
        )?;
        let _ = write!(
            md,
            "\n## Trace {trace}\n\n![prefix hit ratio vs capacity]({png})\n\n\
             Prefix hits (per block hits in brackets), and policy / Belady MIN's prefix hits.\n\n\
             | capacity | blocks | Belady |"
        );
        for (policy, _) in &pts[0].policies {
            let _ = write!(md, " {} | / Belady |", policy.name());
        }
        md.push_str("\n|---|---|---|");
        for _ in &pts[0].policies {
            md.push_str("---|---|");
        }
        md.push('\n');
        for p in &pts {
            let b = p.belady;
            let _ = write!(
                md,
                "| {}% | {} | {:.4} ({:.4}) |",
                p.pct,
                p.blocks,
                b.prefix_ratio(),
                b.block_ratio()
            );
            for (_, r) in &p.policies {
                let _ = write!(
                    md,
                    " {:.4} ({:.4}) | {:.3} |",
                    r.prefix_ratio(),
                    r.block_ratio(),
                    r.prefix_ratio() / b.prefix_ratio().max(1e-12)
                );
            }
            md.push('\n');
        }
    }
    std::fs::write(dir.join("replay.md"), md)?;
    Ok(())
}

/// `NAME.md` and `NAME_bandwidth.png` for a bandwidth benchmark: one line per (operation),
/// x = block size, with each operation's baseline dashed.
pub fn bandwidth_report(dir: &Path, report: &Report, title: &str) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    // Cases look like "put 2MiB x1t" or "read 16MiB qd32": op, size, variant.
    let mut series: Vec<Series> = Vec::new();
    for r in &report.results {
        let parts: Vec<&str> = r.case.split_whitespace().collect();
        if parts.len() != 3 || r.unit != "GB/s" {
            continue;
        }
        let Some(size) = parse_human(parts[1]) else {
            continue;
        };
        let name = format!("{} {}", parts[0], parts[2]);
        let base = format!("{} ({})", name, r.baseline_is);
        for (n, v, b) in [(name, r.value, false), (base, r.baseline, true)] {
            match series.iter_mut().find(|s| s.name == n) {
                Some(s) => s.points.push((size, v)),
                None => series.push(Series {
                    name: n,
                    points: vec![(size, v)],
                    baseline: b,
                }),
            }
        }
    }
    let png = format!("{}_bandwidth.png", report.bench);
    if !series.is_empty() {
        lines(&dir.join(&png), title, "block size", "GB/s", &series, true)?;
    }
    let md = format!(
        "# {title}\n\n{}\n![bandwidth vs block size]({png})\n",
        table(report)
    );
    std::fs::write(dir.join(format!("{}.md", report.bench)), md)?;
    Ok(())
}

fn parse_human(s: &str) -> Option<f64> {
    let (n, m) = if let Some(n) = s.strip_suffix("MiB") {
        (n, 1048576.0)
    } else if let Some(n) = s.strip_suffix("KiB") {
        (n, 1024.0)
    } else {
        (s.strip_suffix('B')?, 1.0)
    };
    n.parse::<f64>().ok().map(|v| v * m)
}
