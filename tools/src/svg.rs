//! A small line chart in SVG, for curves that say more than a table (hit
//! rate against cache size). No dependencies; viewable in any browser.

use std::fmt::Write;

pub struct Series<'a> {
    pub name: &'a str,
    pub color: &'a str,
    pub points: Vec<(f64, f64)>,
}

/// Renders series on shared axes; `y` is a fraction shown in percent.
pub fn line_chart(title: &str, x_label: &str, y_label: &str, series: &[Series<'_>]) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 420.0, 70.0, 190.0, 40.0, 50.0);
    let (pw, ph) = (w - left - right, h - top - bottom);
    let x_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-9);
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0f64, f64::max)
        .clamp(0.01, 1.0);
    let y_top = (y_max * 10.0).ceil() / 10.0;
    let sx = |x: f64| left + pw * x / x_max;
    let sy = |y: f64| top + ph * (1.0 - y / y_top);
    let mut out = String::new();
    let _ = write!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>
"#,
        left + pw / 2.0,
        escape(title)
    );
    for i in 0..=5 {
        let y = y_top * i as f64 / 5.0;
        let _ = writeln!(
            out,
            r##"<line x1="{left}" x2="{}" y1="{py:.1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}%</text>"##,
            left + pw,
            left - 6.0,
            sy(y) + 4.0,
            y * 100.0,
            py = sy(y)
        );
    }
    for i in 0..=5 {
        let x = x_max * i as f64 / 5.0;
        let _ = writeln!(
            out,
            r##"<line x1="{px:.1}" x2="{px:.1}" y1="{top}" y2="{}" stroke="#eee"/><text x="{px:.1}" y="{}" text-anchor="middle">{}</text>"##,
            top + ph,
            top + ph + 16.0,
            fmt_count(x),
            px = sx(x)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>
<text x="{}" y="{}" text-anchor="middle">{}</text>
<text transform="translate(18 {}) rotate(-90)" text-anchor="middle">{}</text>"##,
        left + pw / 2.0,
        h - 12.0,
        escape(x_label),
        top + ph / 2.0,
        escape(y_label)
    );
    for (i, s) in series.iter().enumerate() {
        let pts: Vec<String> = s
            .points
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", sx(*x), sy(*y)))
            .collect();
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            s.color,
            pts.join(" ")
        );
        for (x, y) in &s.points {
            let _ = writeln!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="2.5" fill="{}"/>"#,
                sx(*x),
                sy(*y),
                s.color
            );
        }
        let ly = top + 10.0 + 20.0 * i as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{}" x2="{}" y1="{ly}" y2="{ly}" stroke="{}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            left + pw + 12.0,
            left + pw + 32.0,
            s.color,
            left + pw + 38.0,
            ly + 4.0,
            escape(s.name)
        );
    }
    out.push_str("</svg>\n");
    out
}

fn fmt_count(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.1}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.0}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_is_well_formed_svg_with_every_series() {
        let svg = line_chart(
            "t <1>",
            "x",
            "y",
            &[Series {
                name: "a",
                color: "red",
                points: vec![(1.0, 0.1), (2.0, 0.5)],
            }],
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("<polyline") && svg.contains("t &lt;1&gt;"));
    }
}
