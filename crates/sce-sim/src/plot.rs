//! The SVG plot of `sce sim --plot`: two panels over the replay's time, one line per policy:
//! the interval read hit ratio above, the cumulative bytes written to the cache device below.

use crate::layers::Replay;
use crate::run::{PolicyResult, SimConfig};
use sce_core::units::format_size;

const W: f64 = 800.0;
const L: f64 = 96.0;
const R: f64 = 30.0;
const T: f64 = 40.0;
// Height of a panel, and the gap between them (for the upper one's time labels).
const P: f64 = 300.0;
const GAP: f64 = 60.0;
const T2: f64 = T + P + GAP;
const H: f64 = T2 + P + 50.0;
const COLOURS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// The scales of the two panels.
struct Frame {
    /// The latest interval end, seconds.
    tmax: f64,
    /// The most bytes a policy wrote to the cache device.
    bmax: f64,
}

impl Frame {
    fn new(results: &[PolicyResult]) -> Frame {
        let tmax = results
            .iter()
            .flat_map(|r| r.intervals.iter().map(|x| x.0))
            .fold(0.0f64, f64::max)
            .max(1e-9);
        let bmax = results
            .iter()
            .map(|r| r.interval_cache_bytes_written.iter().sum::<u64>())
            .max()
            .unwrap_or(0)
            .max(1) as f64;
        Frame { tmax, bmax }
    }

    fn x(&self, t: f64) -> f64 {
        L + t / self.tmax * (W - L - R)
    }

    fn y(&self, h: f64) -> f64 {
        T + (1.0 - h) * P
    }

    fn y2(&self, b: f64) -> f64 {
        T2 + (1.0 - b / self.bmax) * P
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// An SVG plot of two panels over the replay's time, one line per policy: the interval read
/// hit ratio above, the cumulative bytes written to the cache device below.
pub fn plot_svg(results: &[PolicyResult], a: &SimConfig, replay: Replay) -> String {
    let f = Frame::new(results);
    let width = W + legend_width(results) + 16.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{H}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">{} \u{2014} cache {} \u{2014} replay {replay}</text>\n",
        (W - R + L) / 2.0,
        esc(&a.trace.file_name().map_or(String::new(), |f| f.to_string_lossy().into_owned())),
        format_size(a.cache_size)
    );
    s += &grid(&f);
    s += &axes(&f, a.interval, replay);
    for (i, r) in results.iter().enumerate() {
        s += &policy_lines(&f, i, r);
    }
    s += &legends(results);
    s += "</svg>\n";
    s
}

/// Grid lines and value labels of both panels.
fn grid(f: &Frame) -> String {
    let mut s = String::new();
    for i in 0..=10 {
        let h = i as f64 / 10.0;
        s += &grid_line(f.y(h), &format!("{h:.1}"));
    }
    for i in 0..=5 {
        let b = f.bmax * i as f64 / 5.0;
        let label = if i == 0 {
            "0".to_string()
        } else {
            format_size(b as u64)
        };
        s += &grid_line(f.y2(b), &label);
    }
    s
}

/// One grid line across the plot at height `y`, with its value label left of the axis.
fn grid_line(y: f64, label: &str) -> String {
    format!(
        "<line x1=\"{L}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/>\
         <text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{label}</text>\n",
        W - R,
        L - 6.0,
        y + 4.0,
    )
}

/// The axes of both panels, their time labels and titles, and the time axis' title.
fn axes(f: &Frame, interval: f64, replay: Replay) -> String {
    let mut s = String::new();
    let time = if replay == Replay::Open {
        "trace time (s)".to_string()
    } else {
        format!("virtual time (s), replay {replay}")
    };
    for (top, title) in [
        (T, format!("read hit ratio per {interval} s interval")),
        (T2, "cache bytes written, cumulative".to_string()),
    ] {
        let bottom = top + P;
        for i in 0..=5 {
            let t = f.tmax * i as f64 / 5.0;
            s += &format!(
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{:.0}</text>\n",
                f.x(t),
                bottom + 18.0,
                t
            );
        }
        let mid = top + P / 2.0;
        s += &format!(
            "<line x1=\"{L}\" x2=\"{L}\" y1=\"{top}\" y2=\"{bottom}\" stroke=\"black\"/>\
             <line x1=\"{L}\" x2=\"{}\" y1=\"{bottom}\" y2=\"{bottom}\" stroke=\"black\"/>\n\
             <text x=\"14\" y=\"{mid}\" text-anchor=\"middle\" transform=\"rotate(-90 14 {mid})\">{title}</text>\n",
            W - R,
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        (W - R + L) / 2.0,
        H - 12.0,
        esc(&time)
    );
    s
}

/// The lines of the `i`-th policy in both panels.
fn policy_lines(f: &Frame, i: usize, r: &PolicyResult) -> String {
    let mut s = String::new();
    let c = COLOURS[i % COLOURS.len()];
    // A gap (an interval with no read) breaks the line.
    let mut segs: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
    for &(t, h) in &r.intervals {
        match h {
            Some(h) => segs.last_mut().expect("one").push((f.x(t), f.y(h))),
            None => segs.push(Vec::new()),
        }
    }
    // Bytes written accumulate from zero at time zero.
    let mut total = 0u64;
    let mut written = vec![(f.x(0.0), f.y2(0.0))];
    for (&(t, _), &b) in r.intervals.iter().zip(&r.interval_cache_bytes_written) {
        total += b;
        written.push((f.x(t), f.y2(total as f64)));
    }
    segs.push(written);
    for seg in segs.iter().filter(|s| !s.is_empty()) {
        let pts: Vec<String> = seg.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
        s += &format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
            pts.join(" ")
        );
    }
    s
}

/// Width of a legend's text, in pixels, at the 12-pixel font (a generous estimate: SVG has
/// no text metrics, and a box too wide is better than a label cut off).
fn text_width(s: &str) -> f64 {
    s.chars().count() as f64 * 7.2
}

/// Each panel's legend labels: policy and its figure (hit ratio above, bytes below).
fn legend_labels(results: &[PolicyResult], panel: usize) -> Vec<String> {
    results
        .iter()
        .map(|r| {
            let value = if panel == 0 {
                format!("{:.3}", r.read_hit_ratio)
            } else {
                format_size(r.interval_cache_bytes_written.iter().sum())
            };
            format!("{} ({value})", r.policy)
        })
        .collect()
}

/// The width of the legends' column, to the right of the panels.
fn legend_width(results: &[PolicyResult]) -> f64 {
    let widest = [0, 1]
        .iter()
        .flat_map(|&p| legend_labels(results, p))
        .map(|l| text_width(&l))
        .fold(0.0, f64::max);
    widest + 44.0
}

/// A legend beside each panel, at its top right, outside the area the lines are drawn in:
/// it never hides a line.
fn legends(results: &[PolicyResult]) -> String {
    let mut s = String::new();
    let bw = legend_width(results);
    for panel in [0, 1] {
        let labels = legend_labels(results, panel);
        let bh = 20.0 * labels.len() as f64 + 8.0;
        let x = W - R + 8.0;
        let y = if panel == 0 { T } else { T2 };
        s += &format!(
            "<rect class=\"legend\" x=\"{x:.1}\" y=\"{y:.1}\" width=\"{bw:.1}\" height=\"{bh:.1}\" \
             fill=\"white\" fill-opacity=\"0.85\" stroke=\"#999\"/>\n"
        );
        for (i, label) in labels.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            let ly = y + 14.0 + 20.0 * i as f64;
            s += &format!(
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ly:.1}\" y2=\"{ly:.1}\" stroke=\"{c}\" stroke-width=\"3\"/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{}</text>\n",
                x + 8.0,
                x + 28.0,
                x + 34.0,
                ly + 4.0,
                esc(label),
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attr(tag: &str, name: &str) -> f64 {
        let at = tag.find(&format!(" {name}=\"")).expect(name) + name.len() + 3;
        tag[at..].split('"').next().unwrap().parse().unwrap()
    }

    #[test]
    fn legends_sit_beside_their_panels_whatever_the_names() {
        let results: Vec<PolicyResult> = ["sce", "flashcache-like", "a-very-long-policy-name:42"]
            .iter()
            .map(|p| PolicyResult {
                policy: p.to_string(),
                read_hit_ratio: 0.5,
                intervals: vec![(60.0, Some(0.5))],
                interval_cache_bytes_written: vec![123 << 30],
                ..Default::default()
            })
            .collect();
        let svg = legends(&results);
        let boxes: Vec<&str> = svg.split("<rect").skip(1).collect();
        assert_eq!(boxes.len(), 2);
        for (b, top) in boxes.iter().zip([T, T2]) {
            let (x, y, w, h) = (
                attr(b, "x"),
                attr(b, "y"),
                attr(b, "width"),
                attr(b, "height"),
            );
            // Right of the area lines are drawn in, inside the canvas.
            let canvas = W + legend_width(&results) + 16.0;
            assert!(
                x > W - R && x + w <= canvas,
                "{x} + {w} outside ({}, {canvas}]",
                W - R
            );
            assert!(y >= top && y + h <= top + P, "{y} + {h}");
        }
        // Every label's estimated end is inside its box.
        let right = W - R + 8.0 + legend_width(&results);
        for t in svg.split("<text").skip(1) {
            let label = t.split('>').nth(1).unwrap().split('<').next().unwrap();
            assert!(attr(t, "x") + text_width(label) <= right, "{label}");
        }
        assert!(svg.contains("a-very-long-policy-name:42 (0.500)"));
    }
}
