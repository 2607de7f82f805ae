//! The plot model shared by the SVG and PNG outputs: one panel per measured plugin, x = block size
//! (log scale), y = GB/s; per blocks-per-transfer count a solid kvgate line and a dashed reference
//! line of the same colour. Geometry only; never writes a file.

use super::results::BenchReport;

pub const WIDTH: u32 = 900;
pub const PANEL_HEIGHT: u32 = 320;
pub const MARGIN_LEFT: f64 = 70.0;
pub const MARGIN_RIGHT: f64 = 190.0;
pub const MARGIN_TOP: f64 = 40.0;
pub const MARGIN_BOTTOM: f64 = 50.0;

/// Colours per blocks-per-transfer series, in order.
pub const PALETTE: [(u8, u8, u8); 6] = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)];

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
            let point_labels = cells.iter().map(|c| if c.reference_gbps > 0.0 { format!("x{:.2}", c.ratio) } else { String::new() }).collect();
            series.push(Series {
                label: format!("kvgate, {blocks} block(s)"),
                color,
                dashed: false,
                points: cells.iter().map(|c| (c.block_bytes, c.throughput_gbps)).collect(),
                point_labels,
            });
            let reference: Vec<_> = cells.iter().filter(|c| c.reference_gbps > 0.0).map(|c| (c.block_bytes, c.reference_gbps)).collect();
            if !reference.is_empty() {
                series.push(Series { label: format!("reference, {blocks} block(s)"), color, dashed: true, points: reference, point_labels: vec![] });
            }
        }
        let x_min = p.cells.iter().map(|c| c.block_bytes).min().unwrap_or(4096);
        let x_max = p.cells.iter().map(|c| c.block_bytes).max().unwrap_or(4096).max(x_min * 2);
        let y_peak = series.iter().flat_map(|s| s.points.iter().map(|p| p.1)).fold(0.0, f64::max);
        out.push(Panel { title: format!("{}: throughput vs block size (reference: {})", p.plugin, p.reference), series, x_min, x_max, y_max: nice_ceiling(y_peak) });
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
