//! The growth curve of `scale-bench --compare ... --plot FILE.svg`: three
//! panels against the agent count (log scale): one-GPU placements/s, idle
//! submit → RUNNING p50 and the idle allocation cycle. Plain SVG written
//! here (no plotting library); a PNG beside it when headless chromium is
//! installed, which renders the SVG.

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use super::BenchResult;

const PANELS: &[(&str, &str, Option<f64>)] = &[
    ("placements_per_sec", "one-GPU placements/s", None),
    (
        "idle_submit_to_running_p50_ms",
        "idle submit → RUNNING p50 (ms)",
        Some(30.0),
    ),
    (
        "idle_allocation_cycle_mean_ms",
        "idle allocation cycle (ms)",
        Some(5.0),
    ),
];

const W: f64 = 360.0;
const H: f64 = 260.0;
const PAD: f64 = 48.0;

pub fn draw(path: &Path, by_size: &[Value]) -> BenchResult<()> {
    let points = |name: &str| -> Vec<(f64, f64)> {
        by_size
            .iter()
            .filter_map(|s| {
                let n = s["agents"].as_f64()?;
                let v = s["figures"][name].as_f64()?;
                Some((n, v))
            })
            .collect()
    };
    let mut svg = String::new();
    let total_w = W * PANELS.len() as f64;
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{total_w}" height="{H}" font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>"#
    );
    for (i, (name, title, target)) in PANELS.iter().enumerate() {
        let x0 = i as f64 * W;
        let pts = points(name);
        panel(&mut svg, x0, title, &pts, *target);
    }
    svg.push_str("</svg>\n");
    std::fs::write(path, &svg).map_err(|e| format!("write {}: {e}", path.display()))?;
    println!("growth curve: {}", path.display());
    let png = path.with_extension("png");
    let chromium = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            &format!("--window-size={},{}", total_w as u32, H as u32),
            &format!("--screenshot={}", png.display()),
        ])
        .arg(format!(
            "file://{}",
            std::fs::canonicalize(path)
                .map_err(|e| e.to_string())?
                .display()
        ))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
    match chromium {
        Ok(s) if s.success() => println!("growth curve: {}", png.display()),
        _ => println!("no PNG: headless chromium did not run (the SVG is there)"),
    }
    Ok(())
}

fn panel(svg: &mut String, x0: f64, title: &str, pts: &[(f64, f64)], target: Option<f64>) {
    let (left, right, top, bottom) = (x0 + PAD, x0 + W - 16.0, 28.0, H - 36.0);
    let _ = write!(
        svg,
        r#"<text x="{}" y="16" font-weight="bold">{title}</text>"#,
        x0 + PAD
    );
    let _ = write!(
        svg,
        r##"<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/><line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>"##
    );
    if pts.is_empty() {
        return;
    }
    let lx = |n: f64| n.max(1.0).log10();
    let (xmin, xmax) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), (n, _)| {
        (a.min(lx(*n)), b.max(lx(*n)))
    });
    let xspan = (xmax - xmin).max(1e-9);
    let ymax = pts
        .iter()
        .map(|(_, v)| *v)
        .chain(target)
        .fold(0.0f64, f64::max)
        * 1.15;
    let ymax = if ymax > 0.0 { ymax } else { 1.0 };
    let sx = |n: f64| left + (lx(n) - xmin) / xspan * (right - left - 12.0) + 6.0;
    let sy = |v: f64| bottom - v / ymax * (bottom - top);
    for k in 0..=4 {
        let v = ymax * f64::from(k) / 4.0;
        let y = sy(v);
        let _ = write!(
            svg,
            r##"<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
            left - 4.0,
            y + 4.0,
            short(v)
        );
    }
    if let Some(t) = target {
        let y = sy(t);
        let _ = write!(
            svg,
            r##"<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#c33" stroke-dasharray="4 3"/><text x="{right}" y="{}" text-anchor="end" fill="#c33">target {}</text>"##,
            y - 3.0,
            short(t)
        );
    }
    let path: Vec<String> = pts
        .iter()
        .map(|(n, v)| format!("{},{}", sx(*n), sy(*v)))
        .collect();
    let _ = write!(
        svg,
        r##"<polyline points="{}" fill="none" stroke="#1f6fb2" stroke-width="2"/>"##,
        path.join(" ")
    );
    for (n, v) in pts {
        let _ = write!(
            svg,
            r##"<circle cx="{}" cy="{}" r="3" fill="#1f6fb2"/><text x="{}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="middle">{}</text>"##,
            sx(*n),
            sy(*v),
            sx(*n),
            sy(*v) - 7.0,
            short(*v),
            sx(*n),
            bottom + 14.0,
            short(*n)
        );
    }
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">agents (log scale)</text>"#,
        (left + right) / 2.0,
        H - 6.0
    );
}

fn short(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.0}k", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}
