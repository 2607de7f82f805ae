//! The plot model shared by the SVG and PNG outputs: one panel per measured plugin, x = block size
//! (log scale), y = GB/s; per blocks-per-transfer count a solid kvgate line and a dashed reference
//! line of the same colour, and for shm a grey dashed line of the machine's copy limit. Geometry
//! only; never writes a file.

use super::results::BenchReport;

pub const WIDTH: u32 = 900;
pub const PANEL_HEIGHT: u32 = 320;
pub const MARGIN_LEFT: f64 = 70.0;
pub const MARGIN_RIGHT: f64 = 190.0;
pub const MARGIN_TOP: f64 = 40.0;
pub const MARGIN_BOTTOM: f64 = 50.0;

/// Colours per blocks-per-transfer series, in order.
pub const PALETTE: [(u8, u8, u8); 6] =
    [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)];

/// The machine's copy limit's line (shm's panel).
pub const LIMIT_COLOR: (u8, u8, u8) = (110, 110, 110);

#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: (u8, u8, u8),
    pub dashed: bool,
    /// (block bytes, GB/s)
    pub points: Vec<(u64, f64)>,
    /// Text written next to each point (the ratio to the reference), or empty.
    pub point_labels: Vec<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
    pub x_min: u64,
    pub x_max: u64,
    pub y_max: f64,
}

/// Panels of every measured plugin with at least one cell.
pub fn panels(report: &BenchReport) -> Vec<Panel> {
    let mut out = Vec::new();
    for p in report.data_path.iter().filter(|p| p.status == "measured" && !p.cells.is_empty()) {
        let mut counts: Vec<u64> = p.cells.iter().map(|c| c.blocks).collect();
        counts.sort_unstable();
        counts.dedup();
        let mut series = Vec::new();
        for (i, &blocks) in counts.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let cells: Vec<_> = p.cells.iter().filter(|c| c.blocks == blocks).collect();
            let point_labels = cells
                .iter()
                .map(|c| if c.reference_gbps > 0.0 { format!("x{:.2}", c.ratio) } else { String::new() })
                .collect();
            series.push(Series {
                label: format!("kvgate, {blocks} block(s)"),
                color,
                dashed: false,
                points: cells.iter().map(|c| (c.block_bytes, c.throughput_gbps)).collect(),
                point_labels,
            });
            let reference: Vec<_> =
                cells.iter().filter(|c| c.reference_gbps > 0.0).map(|c| (c.block_bytes, c.reference_gbps)).collect();
            if !reference.is_empty() {
                series.push(Series {
                    label: format!("reference, {blocks} block(s)"),
                    color,
                    dashed: true,
                    points: reference,
                    point_labels: vec![],
                });
            }
        }
        // The machine's copy limit (shm), grey: per block size, the median of the cells' limits.
        let mut limit_points = Vec::new();
        for block in p.cells.iter().map(|c| c.block_bytes).collect::<std::collections::BTreeSet<u64>>() {
            let mut limits: Vec<f64> = p
                .cells
                .iter()
                .filter(|c| c.block_bytes == block)
                .filter_map(|c| c.copy_limit.as_ref())
                .map(|l| l.gbps)
                .filter(|g| *g > 0.0)
                .collect();
            limits.sort_by(f64::total_cmp);
            if let Some(median) = limits.get(limits.len().saturating_sub(1) / 2) {
                limit_points.push((block, *median));
            }
        }
        if !limit_points.is_empty() {
            series.push(Series {
                label: "copy limit".into(),
                color: LIMIT_COLOR,
                dashed: true,
                points: limit_points,
                point_labels: vec![],
            });
        }
        let x_min = p.cells.iter().map(|c| c.block_bytes).min().unwrap_or(4096);
        let x_max = p.cells.iter().map(|c| c.block_bytes).max().unwrap_or(4096).max(x_min * 2);
        let y_peak = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max);
        out.push(Panel {
            title: format!("{}: throughput vs block size (reference: {})", p.plugin, p.reference),
            series,
            x_min,
            x_max,
            y_max: nice_ceiling(y_peak),
        });
    }
    out
}

/// 1, 2 or 5 times a power of ten, at least `v` (and at least 0.1).
pub fn nice_ceiling(v: f64) -> f64 {
    let v = v.max(0.1);
    let magnitude = 10f64.powf(v.log10().floor());
    for step in [1.0, 2.0, 5.0, 10.0] {
        if step * magnitude >= v {
            return step * magnitude;
        }
    }
    10.0 * magnitude
}

/// Pixel position of a point in panel `index`.
pub fn to_pixel(panel: &Panel, index: usize, x_bytes: u64, y: f64) -> (f64, f64) {
    let top = index as f64 * PANEL_HEIGHT as f64;
    let plot_w = WIDTH as f64 - MARGIN_LEFT - MARGIN_RIGHT;
    let plot_h = PANEL_HEIGHT as f64 - MARGIN_TOP - MARGIN_BOTTOM;
    let span = (panel.x_max as f64).log2() - (panel.x_min as f64).log2();
    let fx = if span > 0.0 { ((x_bytes as f64).log2() - (panel.x_min as f64).log2()) / span } else { 0.5 };
    let fy = if panel.y_max > 0.0 { (y / panel.y_max).clamp(0.0, 1.0) } else { 0.0 };
    (MARGIN_LEFT + fx * plot_w, top + MARGIN_TOP + (1.0 - fy) * plot_h)
}

/// The plot area of panel `index`: (left, top, right, bottom) in pixels.
pub fn plot_area(index: usize) -> (f64, f64, f64, f64) {
    let top = index as f64 * PANEL_HEIGHT as f64;
    (MARGIN_LEFT, top + MARGIN_TOP, WIDTH as f64 - MARGIN_RIGHT, top + PANEL_HEIGHT as f64 - MARGIN_BOTTOM)
}

/// Block sizes to label on the x axis: powers of four from `x_min` to `x_max`.
pub fn x_ticks(panel: &Panel) -> Vec<u64> {
    let mut ticks = Vec::new();
    let mut x = panel.x_min.next_power_of_two();
    while x <= panel.x_max {
        ticks.push(x);
        x = x.saturating_mul(4);
    }
    ticks
}

pub fn image_height(panels: &[Panel]) -> u32 {
    PANEL_HEIGHT * panels.len().max(1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_panels_draw_the_copy_limit_per_block_size() {
        use crate::results::{CellResult, CopyLimit, PluginResult};
        let cell = |block: u64, blocks: u64, limit: f64| CellResult {
            block_bytes: block,
            blocks,
            throughput_gbps: 1.0,
            copy_limit: (limit > 0.0).then(|| CopyLimit { gbps: limit, ..Default::default() }),
            ..Default::default()
        };
        let report = BenchReport {
            data_path: vec![PluginResult {
                plugin: "shm".into(),
                status: "measured".into(),
                cells: vec![
                    cell(4096, 1, 9.0),
                    cell(4096, 100, 11.0),
                    cell(4096, 1000, 10.0),
                    cell(1 << 20, 1, 8.0),
                    cell(1 << 22, 1, 0.0),
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let panel = &panels(&report)[0];
        let limit = panel.series.iter().find(|s| s.label == "copy limit").expect("a limit line");
        assert_eq!(
            limit.points,
            vec![(4096, 10.0), (1 << 20, 8.0)],
            "the median per block size; none where unmeasured"
        );
        assert!(limit.dashed && limit.color == LIMIT_COLOR);
        assert_eq!(panel.y_max, 10.0, "the limit counts for the scale");
    }

    #[test]
    fn ceilings_and_pixels() {
        assert_eq!(nice_ceiling(3.3), 5.0);
        assert_eq!(nice_ceiling(0.01), 0.1);
        assert_eq!(nice_ceiling(10.0), 10.0);
        let panel = Panel { title: String::new(), series: vec![], x_min: 4096, x_max: 4096 * 16, y_max: 10.0 };
        let (left, top, right, bottom) = plot_area(0);
        assert_eq!(to_pixel(&panel, 0, 4096, 0.0), (left, bottom));
        assert_eq!(to_pixel(&panel, 0, 4096 * 16, 10.0), (right, top));
        assert_eq!(x_ticks(&panel), vec![4096, 16384, 65536]);
    }
}
