//! `--png FILE.png`: the same plot model rasterised by hand into an RGB image and encoded with the
//! `png` crate. It draws axes, grid, lines (reference dashed), points and legend swatches but no
//! text: a text renderer would need a font file, which this machine need not have. Never measures.

use super::plot::{image_height, plot_area, to_pixel, x_ticks, Panel, WIDTH};

struct Canvas {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
}

const GRID: (u8, u8, u8) = (221, 221, 221);
const BLACK: (u8, u8, u8) = (0, 0, 0);

impl Canvas {
    fn new(width: u32, height: u32) -> Canvas {
        Canvas { width, height, rgb: vec![255; (width * height * 3) as usize] }
    }
    fn dot(&mut self, x: f64, y: f64, radius: f64, color: (u8, u8, u8)) {
        let r = radius.ceil() as i64;
        for dy in -r..=r {
            for dx in -r..=r {
                if ((dx * dx + dy * dy) as f64) <= radius * radius {
                    self.pixel(x.round() as i64 + dx, y.round() as i64 + dy, color);
                }
            }
        }
    }
    fn pixel(&mut self, x: i64, y: i64, color: (u8, u8, u8)) {
        if x >= 0 && y >= 0 && (x as u32) < self.width && (y as u32) < self.height {
            let i = ((y as u32 * self.width + x as u32) * 3) as usize;
            self.rgb[i..i + 3].copy_from_slice(&[color.0, color.1, color.2]);
        }
    }
    /// A line `width` pixels thick; `dash` = (on, off) lengths in pixels.
    fn line(&mut self, from: (f64, f64), to: (f64, f64), width: f64, color: (u8, u8, u8), dash: Option<(f64, f64)>) {
        let length = ((to.0 - from.0).powi(2) + (to.1 - from.1).powi(2)).sqrt();
        let steps = (length * 2.0).ceil().max(1.0) as usize;
        for s in 0..=steps {
            let t = s as f64 / steps as f64;
            if let Some((on, off)) = dash {
                if (t * length) % (on + off) > on {
                    continue;
                }
            }
            self.dot(from.0 + (to.0 - from.0) * t, from.1 + (to.1 - from.1) * t, width / 2.0, color);
        }
    }
}

/// The PNG bytes of the plot.
pub fn render(panels: &[Panel]) -> Result<Vec<u8>, png::EncodingError> {
    let mut canvas = Canvas::new(WIDTH, image_height(panels));
    for (i, panel) in panels.iter().enumerate() {
        let (left, top, right, bottom) = plot_area(i);
        for tick in x_ticks(panel) {
            let (x, _) = to_pixel(panel, i, tick, 0.0);
            canvas.line((x, top), (x, bottom), 1.0, GRID, None);
        }
        for k in 0..=4 {
            let (_, y) = to_pixel(panel, i, panel.x_min, panel.y_max * k as f64 / 4.0);
            canvas.line((left, y), (right, y), 1.0, GRID, None);
        }
        for (a, b) in [
            ((left, top), (right, top)),
            ((right, top), (right, bottom)),
            ((right, bottom), (left, bottom)),
            ((left, bottom), (left, top)),
        ] {
            canvas.line(a, b, 1.0, BLACK, None);
        }
        for (s_index, series) in panel.series.iter().enumerate() {
            let dash = series.dashed.then_some((6.0, 4.0));
            let points: Vec<(f64, f64)> = series.points.iter().map(|&(x, y)| to_pixel(panel, i, x, y)).collect();
            for pair in points.windows(2) {
                canvas.line(pair[0], pair[1], 2.0, series.color, dash);
            }
            if !series.dashed {
                for &(x, y) in &points {
                    canvas.dot(x, y, 3.0, series.color);
                }
            }
            let ly = top + 10.0 + s_index as f64 * 18.0;
            canvas.line((right + 10.0, ly), (right + 36.0, ly), 2.0, series.color, dash);
        }
    }
    let mut bytes = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut bytes, canvas.width, canvas.height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(&canvas.rgb)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::Series;

    #[test]
    fn the_png_has_the_signature_and_the_series_colour() {
        let panel = Panel {
            title: String::new(),
            series: vec![Series {
                label: String::new(),
                color: (10, 200, 30),
                dashed: false,
                points: vec![(4096, 1.0), (1 << 20, 2.0)],
                point_labels: vec![],
            }],
            x_min: 4096,
            x_max: 1 << 20,
            y_max: 5.0,
        };
        let bytes = render(&[panel]).expect("encodes");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut reader = decoder.read_info().expect("decodes");
        let mut buf = vec![0; reader.output_buffer_size().expect("size")];
        reader.next_frame(&mut buf).expect("frame");
        assert!(buf.chunks_exact(3).any(|p| p == [10, 200, 30]));
    }
}
