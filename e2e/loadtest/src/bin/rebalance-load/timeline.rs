//! Objects per shard over time during the scale-out: samples taken from the placement tracker,
//! written as CSV and drawn as an SVG line chart (hand-written SVG: no plotting dependency).

use std::fmt::Write as _;
use std::time::Duration;

/// Counts of one sample, `secs` after the 4th shard was started.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Sample {
    pub(crate) secs: f64,
    /// Secrets per shard, in the order of [`Timeline::shards`].
    pub(crate) secrets: Vec<usize>,
    /// ConfigMaps per shard, in the same order.
    pub(crate) configmaps: Vec<usize>,
    /// Secrets that carry the drain label.
    pub(crate) draining: usize,
}

/// The samples of one scale-out.
#[derive(Debug, Clone)]
pub(crate) struct Timeline {
    pub(crate) shards: Vec<String>,
    /// Secrets in the ring (each with one ConfigMap).
    pub(crate) objects: usize,
    /// Seconds after the start at which convergence was reached, if it was.
    pub(crate) converged_secs: Option<f64>,
    pub(crate) samples: Vec<Sample>,
}

/// One colour per shard (colour-blind safe palette), repeated beyond eight shards.
const COLOURS: [&str; 8] = [
    "#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#f0e442", "#000000",
];

const WIDTH: f64 = 900.0;
const HEIGHT: f64 = 520.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

impl Timeline {
    /// One row per sample: `seconds,secrets_<shard>…,configmaps_<shard>…,draining`.
    pub(crate) fn csv(&self) -> String {
        let mut out = String::from("seconds");
        for kind in ["secrets", "configmaps"] {
            for shard in &self.shards {
                let _ = write!(out, ",{kind}_{shard}");
            }
        }
        out.push_str(",draining\n");
        for s in &self.samples {
            let _ = write!(out, "{:.3}", s.secs);
            for n in s.secrets.iter().chain(&s.configmaps) {
                let _ = write!(out, ",{n}");
            }
            let _ = writeln!(out, ",{}", s.draining);
        }
        out
    }

    /// A line chart: Secrets per shard (solid), ConfigMaps per shard (dashed), draining Secrets
    /// (grey), a vertical mark at convergence.
    pub(crate) fn svg(&self) -> String {
        let plot_w = WIDTH - LEFT - RIGHT;
        let plot_h = HEIGHT - TOP - BOTTOM;
        let max_t = self
            .samples
            .iter()
            .map(|s| s.secs)
            .fold(self.converged_secs.unwrap_or(0.0), f64::max)
            .max(1.0);
        let max_n = self
            .samples
            .iter()
            .flat_map(|s| s.secrets.iter().chain(&s.configmaps).copied())
            .chain(self.samples.iter().map(|s| s.draining))
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        let (t_step, t_end) = nice_axis(max_t);
        let (n_step, n_end) = nice_axis(max_n);
        let x = |t: f64| LEFT + t / t_end * plot_w;
        let y = |n: f64| TOP + plot_h - n / n_end * plot_h;

        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            out,
            r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
        );
        let _ = writeln!(
            out,
            r#"<text x="{}" y="24" font-size="16" text-anchor="middle">Objects per shard, {} Secrets + {} ConfigMaps, {} → {} shards</text>"#,
            LEFT + plot_w / 2.0,
            group(self.objects),
            group(self.objects),
            self.shards.len().saturating_sub(1),
            self.shards.len()
        );
        // Grid, ticks and tick labels.
        let mut t = 0.0;
        while t <= t_end + t_step / 2.0 {
            let _ = writeln!(
                out,
                r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#e5e5e5"/><text x="{0:.1}" y="{2:.1}" text-anchor="middle">{3}</text>"##,
                x(t),
                TOP + plot_h,
                TOP + plot_h + 18.0,
                trim(t)
            );
            t += t_step;
        }
        let mut n = 0.0;
        while n <= n_end + n_step / 2.0 {
            let _ = writeln!(
                out,
                r##"<line x1="{LEFT}" y1="{0:.1}" x2="{1:.1}" y2="{0:.1}" stroke="#e5e5e5"/><text x="{2:.1}" y="{3:.1}" text-anchor="end">{4}</text>"##,
                y(n),
                LEFT + plot_w,
                LEFT - 6.0,
                y(n) + 4.0,
                group(n as usize)
            );
            n += n_step;
        }
        // Axes and their titles.
        let _ = writeln!(
            out,
            r#"<path d="M{LEFT},{TOP} V{0:.1} H{1:.1}" fill="none" stroke="black"/>"#,
            TOP + plot_h,
            LEFT + plot_w
        );
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">seconds after starting {}</text>"#,
            LEFT + plot_w / 2.0,
            HEIGHT - 16.0,
            self.shards.last().map_or("the new shard", String::as_str)
        );
        let _ = writeln!(
            out,
            r#"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">objects</text>"#,
            TOP + plot_h / 2.0
        );
        if let Some(c) = self.converged_secs {
            // Near the right end the label goes left of the line, clear of the legend.
            let (label_x, anchor) = if x(c) > LEFT + 0.75 * plot_w {
                (x(c) - 4.0, "end")
            } else {
                (x(c) + 4.0, "start")
            };
            let _ = writeln!(
                out,
                r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{1:.1}" stroke="#555" stroke-dasharray="2,3"/><text x="{2:.1}" y="{3:.1}" fill="#555" text-anchor="{anchor}">converged {4:.1} s</text>"##,
                x(c),
                TOP + plot_h,
                label_x,
                TOP + 12.0,
                c
            );
        }
        // The series.
        let line = |out: &mut String, values: &dyn Fn(&Sample) -> usize, style: &str| {
            let points: Vec<String> = self
                .samples
                .iter()
                .map(|s| format!("{:.1},{:.1}", x(s.secs), y(values(s) as f64)))
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke-width="1.8" {style}/>"#,
                points.join(" ")
            );
        };
        for (i, _) in self.shards.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            line(
                &mut out,
                &|s| s.secrets.get(i).copied().unwrap_or(0),
                &format!(r#"stroke="{colour}""#),
            );
            line(
                &mut out,
                &|s| s.configmaps.get(i).copied().unwrap_or(0),
                &format!(r#"stroke="{colour}" stroke-dasharray="6,4""#),
            );
        }
        line(
            &mut out,
            &|s| s.draining,
            r##"stroke="#888" stroke-dasharray="1,2""##,
        );
        // Legend: one entry per shard, a gap, then the line styles.
        let lx = LEFT + plot_w + 20.0;
        let mut entries: Vec<(String, &str)> = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, shard)| {
                let colour = COLOURS[i % COLOURS.len()];
                (format!(r#"stroke="{colour}""#), shard.as_str())
            })
            .collect();
        entries.push((String::new(), ""));
        entries.push((r#"stroke="black""#.into(), "Secrets"));
        entries.push((
            r#"stroke="black" stroke-dasharray="6,4""#.into(),
            "ConfigMaps",
        ));
        entries.push((
            r##"stroke="#888" stroke-dasharray="1,2""##.into(),
            "draining Secrets",
        ));
        for (i, (style, label)) in entries.iter().enumerate() {
            if label.is_empty() {
                continue;
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let _ = writeln!(
                out,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke-width="2.5" {style}/><text x="{}" y="{}">{label}</text>"#,
                lx + 28.0,
                lx + 36.0,
                ly + 4.0
            );
        }
        out.push_str("</svg>\n");
        out
    }
}

/// A tick step of 1, 2 or 5 × 10ⁿ giving at most about 8 ticks, and the axis end (a multiple of
/// the step at or above `max`).
fn nice_axis(max: f64) -> (f64, f64) {
    let rough = max / 8.0;
    let magnitude = 10f64.powf(rough.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= rough)
        .unwrap_or(10.0 * magnitude);
    (step, (max / step).ceil() * step)
}

/// A tick value without needless decimals.
fn trim(value: f64) -> String {
    if (value - value.round()).abs() < 1e-9 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// An integer with thin spaces between thousands (`100 000`).
fn group(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('\u{2009}');
        }
        out.push(c);
    }
    out
}

/// Seconds with millisecond precision, for the report.
pub(crate) fn secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline() -> Timeline {
        Timeline {
            shards: vec!["a".into(), "b".into()],
            objects: 12_000,
            converged_secs: Some(1.5),
            samples: vec![
                Sample {
                    secs: 0.0,
                    secrets: vec![12_000, 0],
                    configmaps: vec![12_000, 0],
                    draining: 0,
                },
                Sample {
                    secs: 1.0,
                    secrets: vec![6_000, 6_000],
                    configmaps: vec![7_000, 5_000],
                    draining: 10,
                },
            ],
        }
    }

    #[test]
    fn csv_has_a_column_per_shard_and_kind() {
        assert_eq!(
            timeline().csv(),
            "seconds,secrets_a,secrets_b,configmaps_a,configmaps_b,draining\n\
             0.000,12000,0,12000,0,0\n\
             1.000,6000,6000,7000,5000,10\n"
        );
    }

    #[test]
    fn svg_draws_two_lines_per_shard_a_legend_and_the_convergence() {
        let svg = timeline().svg();
        assert!(svg.starts_with("<svg "));
        assert!(svg.ends_with("</svg>\n"));
        // 2 shards × (Secrets, ConfigMaps) + draining.
        assert_eq!(svg.matches("<polyline").count(), 5);
        assert!(svg.contains(">a</text>") && svg.contains(">b</text>"));
        assert!(svg.contains("12\u{2009}000 Secrets"));
        assert!(svg.contains("converged 1.5 s"));
        // The top sample sits at the top of the y axis (12 000 is a multiple of the 2 000 step).
        assert!(svg.contains(&format!("{LEFT:.1},{TOP:.1}")));
    }

    #[test]
    fn axes_end_on_a_round_step() {
        assert_eq!(nice_axis(33_400.0), (5_000.0, 35_000.0));
        assert_eq!(nice_axis(7.3), (1.0, 8.0));
        assert_eq!(nice_axis(140.0), (20.0, 140.0));
        assert_eq!(group(100_000), "100\u{2009}000");
        assert_eq!(group(999), "999");
        assert_eq!(trim(2.5), "2.5");
    }
}
