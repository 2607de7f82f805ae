//! `--plot FILE.svg`: the plot model written as hand-made SVG (axes, ticks, labels, a legend; the
//! reference dashed; each kvgate point labelled with its ratio to the reference). Text only; never measures and never reads the report's raw cells itself.

use super::plot::{image_height, plot_area, to_pixel, x_ticks, Panel, WIDTH};
use super::stats::size_label;
use std::fmt::Write;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

pub fn render(panels: &[Panel]) -> String {
    let height = image_height(panels);
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    if panels.is_empty() {
        let _ = writeln!(out, r#"<text x="20" y="40">no plugin measured</text>"#);
    }
    for (i, panel) in panels.iter().enumerate() {
        let (left, top, right, bottom) = plot_area(i);
        let _ = writeln!(
            out,
            r#"<text x="{left}" y="{}" font-size="14" font-weight="bold">{}</text>"#,
            top - 14.0,
            escape(&panel.title)
        );
        let _ = writeln!(
            out,
            r#"<rect x="{left}" y="{top}" width="{}" height="{}" fill="none" stroke="black"/>"#,
            right - left,
            bottom - top
        );
        for tick in x_ticks(panel) {
            let (x, _) = to_pixel(panel, i, tick, 0.0);
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{bottom}" stroke="#ddd"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                bottom + 16.0,
                size_label(tick)
            );
        }
        for k in 0..=4 {
            let value = panel.y_max * k as f64 / 4.0;
            let (_, y) = to_pixel(panel, i, panel.x_min, value);
            let _ = writeln!(
                out,
                r##"<line x1="{left}" y1="{y:.1}" x2="{right}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{value:.2}</text>"##,
                left - 6.0,
                y + 4.0
            );
        }
        let _ = writeln!(
            out,
            r#"<text x="{}" y="{}" text-anchor="middle">block size</text>"#,
            (left + right) / 2.0,
            bottom + 36.0
        );
        let _ = writeln!(
            out,
            r#"<text x="16" y="{}" transform="rotate(-90 16 {})" text-anchor="middle">GB/s</text>"#,
            (top + bottom) / 2.0,
            (top + bottom) / 2.0
        );
        for (s_index, series) in panel.series.iter().enumerate() {
            let (r, g, b) = series.color;
            let points: Vec<String> = series
                .points
                .iter()
                .map(|&(x, y)| to_pixel(panel, i, x, y))
                .map(|(x, y)| format!("{x:.1},{y:.1}"))
                .collect();
            let dash = if series.dashed { r#" stroke-dasharray="6 4""# } else { "" };
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="rgb({r},{g},{b})" stroke-width="2"{dash}/>"#,
                points.join(" ")
            );
            if !series.dashed {
                for (k, p) in points.iter().enumerate() {
                    let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
                    let _ = writeln!(out, r#"<circle cx="{x}" cy="{y}" r="3" fill="rgb({r},{g},{b})"/>"#);
                    if let Some(text) = series.point_labels.get(k).filter(|t| !t.is_empty()) {
                        let (x, y) = (x.parse::<f64>().unwrap_or(0.0), y.parse::<f64>().unwrap_or(0.0));
                        let _ = writeln!(
                            out,
                            r#"<text x="{:.1}" y="{:.1}" font-size="10" fill="rgb({r},{g},{b})">{}</text>"#,
                            x + 5.0,
                            y - 5.0,
                            escape(text)
                        );
                    }
                }
            }
            let ly = top + 10.0 + s_index as f64 * 18.0;
            let _ = writeln!(
                out,
                r#"<line x1="{}" y1="{ly}" x2="{}" y2="{ly}" stroke="rgb({r},{g},{b})" stroke-width="2"{dash}/>"#,
                right + 10.0,
                right + 36.0
            );
            let _ = writeln!(out, r#"<text x="{}" y="{}">{}</text>"#, right + 42.0, ly + 4.0, escape(&series.label));
        }
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::Series;

    #[test]
    fn every_series_becomes_a_polyline_and_the_reference_is_dashed() {
        let panel = Panel {
            title: "shm <&>".into(),
            series: vec![
                Series {
                    label: "kvgate, 1 block(s)".into(),
                    color: (1, 2, 3),
                    dashed: false,
                    points: vec![(4096, 1.0), (1 << 20, 2.0)],
                    point_labels: vec!["x0.50".into(), "x0.50".into()],
                },
                Series {
                    label: "reference, 1 block(s)".into(),
                    color: (1, 2, 3),
                    dashed: true,
                    points: vec![(4096, 2.0), (1 << 20, 4.0)],
                    point_labels: vec![],
                },
            ],
            x_min: 4096,
            x_max: 1 << 20,
            y_max: 5.0,
        };
        let svg = render(&[panel]);
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("stroke-dasharray").count(), 2, "dashed line and its legend swatch");
        assert!(svg.contains("shm &lt;&amp;&gt;"));
        assert_eq!(svg.matches(">x0.50</text>").count(), 2, "each kvgate point carries its ratio");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
