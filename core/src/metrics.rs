//! Prometheus text exposition (format 0.0.4) and a fixed-bucket histogram,
//! shared by master and agent (the HTTP server that serves it is
//! `gpuctl_core::metrics_server`, built for the daemons only).
//!
//! Hand-written instead of using the `prometheus` crate: the surface we need is tiny and we want
//! no global registry. Each process renders its metrics from its own state at scrape time.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::Mutex;

/// The `Content-Type` of the Prometheus text format served on `/metrics`.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Histogram upper bounds (seconds) for latencies from 100 µs to 60 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0,
];

/// The type of a metric family, as written on its `# TYPE` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// Builder for one scrape's worth of Prometheus text exposition.
///
/// Call [`Exposition::family`] before the samples of each family, then
/// [`Exposition::sample`] for each sample, then [`Exposition::finish`].
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
    families: HashSet<String>,
}

impl Exposition {
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes the `# HELP` and `# TYPE` lines of a family. Only the first call for a given
    /// `name` writes anything, so it is safe to call in a loop.
    pub fn family(&mut self, name: &str, help: &str, kind: Kind) {
        debug_assert!(is_metric_name(name), "invalid metric name {name:?}");
        if !self.families.insert(name.to_owned()) {
            return;
        }
        self.out.push_str("# HELP ");
        self.out.push_str(name);
        self.out.push(' ');
        escape_help(help, &mut self.out);
        self.out.push_str("\n# TYPE ");
        self.out.push_str(name);
        self.out.push(' ');
        self.out.push_str(kind.as_str());
        self.out.push('\n');
    }

    /// Writes one sample line. `name` may carry a suffix such as `_bucket`, `_sum`, `_count`.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        debug_assert!(is_metric_name(name), "invalid metric name {name:?}");
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (key, val)) in labels.iter().enumerate() {
                debug_assert!(is_label_name(key), "invalid label name {key:?}");
                if i > 0 {
                    self.out.push(',');
                }
                self.out.push_str(key);
                self.out.push_str("=\"");
                escape_label_value(val, &mut self.out);
                self.out.push('"');
            }
            self.out.push('}');
        }
        self.out.push(' ');
        format_value(value, &mut self.out);
        self.out.push('\n');
    }

    pub fn finish(self) -> String {
        self.out
    }
}

/// A thread-safe histogram with fixed upper bounds (an implicit `+Inf` bucket is added).
#[derive(Debug)]
pub struct Histogram {
    bounds: Box<[f64]>,
    state: Mutex<HistogramState>,
}

#[derive(Debug, Clone)]
struct HistogramState {
    /// Per-bucket (non-cumulative) counts; one more than `bounds`, the last is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// Creates a histogram with the given upper bounds.
    ///
    /// # Panics
    /// If the bounds are not finite and strictly increasing (they are constants in our code).
    pub fn new(bounds: &[f64]) -> Self {
        assert!(
            bounds.iter().all(|b| b.is_finite()),
            "histogram bounds must be finite: {bounds:?}"
        );
        assert!(
            bounds.windows(2).all(|w| w[0] < w[1]),
            "histogram bounds must be strictly increasing: {bounds:?}"
        );
        Self {
            bounds: bounds.into(),
            state: Mutex::new(HistogramState {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
                count: 0,
            }),
        }
    }

    /// Records one observation. NaN is ignored (it would poison `_sum` forever).
    pub fn observe(&self, value: f64) {
        if value.is_nan() {
            return;
        }
        // First bucket whose upper bound is >= value (`le` is inclusive); `+Inf` if none.
        let idx = self.bounds.partition_point(|b| *b < value);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.counts[idx] += 1;
        state.sum += value;
        state.count += 1;
    }

    /// Writes the cumulative `_bucket` lines (including `le="+Inf"`), `_sum` and `_count`.
    /// The caller writes the family header (`Kind::Histogram`) once.
    pub fn write(&self, out: &mut Exposition, name: &str, labels: &[(&str, &str)]) {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0u64;
        for (i, count) in state.counts.iter().enumerate() {
            cumulative += count;
            let mut le = String::new();
            match self.bounds.get(i) {
                Some(bound) => format_value(*bound, &mut le),
                None => le.push_str("+Inf"),
            }
            let mut with_le: Vec<(&str, &str)> = Vec::with_capacity(labels.len() + 1);
            with_le.extend_from_slice(labels);
            with_le.push(("le", &le));
            out.sample(&bucket, &with_le, cumulative as f64);
        }
        out.sample(&format!("{name}_sum"), labels, state.sum);
        out.sample(&format!("{name}_count"), labels, state.count as f64);
    }
}

/// `[a-zA-Z_:][a-zA-Z0-9_:]*`
fn is_metric_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `[a-zA-Z_][a-zA-Z0-9_]*`
fn is_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn escape_label_value(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

fn escape_help(s: &str, out: &mut String) {
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
}

/// Whole numbers below 2^53 print as integers; NaN and infinities as Prometheus spells them;
/// very large or small magnitudes in exponent notation; everything else as the shortest
/// decimal that round-trips.
fn format_value(v: f64, out: &mut String) {
    const TWO_POW_53: f64 = 9_007_199_254_740_992.0;
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else if v.fract() == 0.0 && v.abs() < TWO_POW_53 {
        // Exact: |v| < 2^53 fits an i64 without loss. (-0.0 prints as 0.)
        let _ = write!(out, "{}", v as i64);
    } else if v.abs() >= 1e15 || v.abs() < 1e-4 {
        let _ = write!(out, "{v:e}");
    } else {
        let _ = write!(out, "{v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead as _;
    use std::sync::OnceLock;

    fn fmt(v: f64) -> String {
        let mut s = String::new();
        format_value(v, &mut s);
        s
    }

    /// Inverse of the exposition escaping (`\\`, `\"`, `\n`), applied to what the parser hands
    /// back: `prometheus-parse` returns label values and HELP text still escaped.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match chars.next() {
                Some('\\') => out.push('\\'),
                Some('"') => out.push('"'),
                Some('n') => out.push('\n'),
                other => panic!("bad escape \\{other:?} in {s:?}"),
            }
        }
        out
    }

    /// Like `unescape`, for a label value: a bare `"` cannot occur inside a quoted value.
    fn unescape_label(s: &str) -> String {
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => panic!("unescaped quote in label value {s:?}"),
                _ => {}
            }
        }
        unescape(s)
    }

    fn parse(text: &str) -> prometheus_parse::Scrape {
        let lines = std::io::BufReader::new(text.as_bytes()).lines();
        prometheus_parse::Scrape::parse(lines).expect("parse exposition")
    }

    // Label values chosen to need escaping. They avoid `,`, `=`, `}` and a quote right at
    // either end, which the simple split-based `prometheus-parse` cannot handle even when
    // correctly escaped.
    const PATH_VALUE: &str = r"C:\gpu\0";
    const QUOTED_VALUE: &str = r#"model "A100" 80GB"#;
    const NEWLINE_VALUE: &str = "line one\nline two";

    fn realistic() -> (String, Histogram) {
        let hist = Histogram::new(&[0.01, 0.1, 1.0]);
        for v in [0.005, 0.01, 0.05, 0.5, 0.7, 2.0, 30.0] {
            hist.observe(v);
        }
        let mut e = Exposition::new();
        e.family(
            "gpuctl_jobs_submitted_total",
            "Jobs submitted.\nCounts every accepted \\ submission.",
            Kind::Counter,
        );
        e.sample("gpuctl_jobs_submitted_total", &[], 3.0);
        e.family(
            "gpuctl_gpu_memory_used_bytes",
            "GPU memory in use.",
            Kind::Gauge,
        );
        e.sample(
            "gpuctl_gpu_memory_used_bytes",
            &[("node", "n1"), ("gpu", "0"), ("path", PATH_VALUE)],
            81_920_000_000.0,
        );
        e.sample(
            "gpuctl_gpu_memory_used_bytes",
            &[("node", "n1"), ("gpu", "1"), ("model", QUOTED_VALUE)],
            0.5,
        );
        e.sample(
            "gpuctl_gpu_memory_used_bytes",
            &[("node", "n2"), ("gpu", "0"), ("note", NEWLINE_VALUE)],
            f64::NAN,
        );
        // A second call for the same family must not repeat the header.
        e.family(
            "gpuctl_gpu_memory_used_bytes",
            "GPU memory in use.",
            Kind::Gauge,
        );
        e.sample(
            "gpuctl_gpu_memory_used_bytes",
            &[("node", "n2"), ("gpu", "1")],
            f64::INFINITY,
        );
        e.family(
            "gpuctl_rpc_duration_seconds",
            "RPC latency.",
            Kind::Histogram,
        );
        hist.write(
            &mut e,
            "gpuctl_rpc_duration_seconds",
            &[("method", "Submit")],
        );
        (e.finish(), hist)
    }

    #[test]
    fn metrics_exposition_parses_with_independent_parser() {
        let (text, _) = realistic();
        let scrape = parse(&text);

        // HELP text, after unescaping, is what was written.
        assert_eq!(
            unescape(&scrape.docs["gpuctl_jobs_submitted_total"]),
            "Jobs submitted.\nCounts every accepted \\ submission."
        );
        assert_eq!(
            scrape.docs["gpuctl_gpu_memory_used_bytes"],
            "GPU memory in use."
        );
        assert_eq!(
            text.matches("# TYPE gpuctl_gpu_memory_used_bytes").count(),
            1
        );
        assert_eq!(
            text.matches("# HELP gpuctl_gpu_memory_used_bytes").count(),
            1
        );

        let find = |metric: &str, label: &str, value: &str| {
            let matches: Vec<_> = scrape
                .samples
                .iter()
                .filter(|s| {
                    s.metric == metric
                        && s.labels.get(label).map(unescape_label).as_deref() == Some(value)
                })
                .collect();
            assert_eq!(matches.len(), 1, "{metric}{{{label}={value:?}}} in\n{text}");
            matches[0].clone()
        };
        use prometheus_parse::Value;

        let counter: Vec<_> = scrape
            .samples
            .iter()
            .filter(|s| s.metric == "gpuctl_jobs_submitted_total")
            .collect();
        assert_eq!(counter.len(), 1);
        assert!(counter[0].labels.is_empty());
        assert_eq!(counter[0].value, Value::Counter(3.0));

        let g = find("gpuctl_gpu_memory_used_bytes", "path", PATH_VALUE);
        assert_eq!(g.value, Value::Gauge(81_920_000_000.0));
        assert_eq!(g.labels.len(), 3);
        assert_eq!(g.labels.get("node"), Some("n1"));
        assert_eq!(g.labels.get("gpu"), Some("0"));

        let g = find("gpuctl_gpu_memory_used_bytes", "model", QUOTED_VALUE);
        assert_eq!(g.value, Value::Gauge(0.5));
        assert_eq!(g.labels.get("gpu"), Some("1"));

        let g = find("gpuctl_gpu_memory_used_bytes", "note", NEWLINE_VALUE);
        assert!(matches!(g.value, Value::Gauge(v) if v.is_nan()));
        assert_eq!(g.labels.get("node"), Some("n2"));

        let g = scrape
            .samples
            .iter()
            .find(|s| {
                s.metric == "gpuctl_gpu_memory_used_bytes"
                    && s.labels.get("node") == Some("n2")
                    && s.labels.get("gpu") == Some("1")
            })
            .expect("n2/1 sample");
        assert_eq!(g.value, Value::Gauge(f64::INFINITY));
        assert_eq!(g.labels.len(), 2);

        // Histogram: cumulative buckets, +Inf equal to _count, _sum exact.
        let h = find("gpuctl_rpc_duration_seconds", "method", "Submit");
        let Value::Histogram(buckets) = &h.value else {
            panic!("not a histogram: {h:?}");
        };
        let got: Vec<(f64, f64)> = buckets.iter().map(|b| (b.less_than, b.count)).collect();
        assert_eq!(
            got,
            vec![(0.01, 2.0), (0.1, 3.0), (1.0, 5.0), (f64::INFINITY, 7.0)]
        );
        assert!(got.windows(2).all(|w| w[0].1 <= w[1].1));
        let count = find("gpuctl_rpc_duration_seconds_count", "method", "Submit");
        assert_eq!(count.value, Value::Untyped(7.0));
        assert_eq!(got.last().map(|b| b.1), Some(7.0));
        let sum = find("gpuctl_rpc_duration_seconds_sum", "method", "Submit");
        let expected_sum = 0.005 + 0.01 + 0.05 + 0.5 + 0.7 + 2.0 + 30.0;
        let Value::Untyped(s) = sum.value else {
            panic!("sum: {sum:?}");
        };
        assert!((s - expected_sum).abs() < 1e-9, "{s} vs {expected_sum}");

        // Every sample line is accounted for: 1 counter + 4 gauges + 1 histogram + sum + count.
        assert_eq!(scrape.samples.len(), 8, "{text}");
    }

    #[test]
    fn metrics_exact_text() {
        let mut e = Exposition::new();
        e.family("up", "Whether \\ the\nprocess \"is\" up.", Kind::Gauge);
        e.sample("up", &[], 1.0);
        e.sample(
            "up",
            &[("a", "x\\y"), ("b", "say \"hi\""), ("c", "1\n2")],
            2.5,
        );
        let hist = Histogram::new(&[0.5, 1.0]);
        hist.observe(1.0);
        hist.observe(0.25);
        e.family("lat_seconds", "Latency.", Kind::Histogram);
        hist.write(&mut e, "lat_seconds", &[]);
        assert_eq!(
            e.finish(),
            concat!(
                "# HELP up Whether \\\\ the\\nprocess \"is\" up.\n",
                "# TYPE up gauge\n",
                "up 1\n",
                "up{a=\"x\\\\y\",b=\"say \\\"hi\\\"\",c=\"1\\n2\"} 2.5\n",
                "# HELP lat_seconds Latency.\n",
                "# TYPE lat_seconds histogram\n",
                "lat_seconds_bucket{le=\"0.5\"} 1\n",
                "lat_seconds_bucket{le=\"1\"} 2\n",
                "lat_seconds_bucket{le=\"+Inf\"} 2\n",
                "lat_seconds_sum 1.25\n",
                "lat_seconds_count 2\n",
            )
        );
    }

    #[test]
    fn metrics_number_formatting() {
        assert_eq!(fmt(3.0), "3");
        assert_eq!(fmt(0.0), "0");
        assert_eq!(fmt(-0.0), "0");
        assert_eq!(fmt(-42.0), "-42");
        assert_eq!(fmt(9_007_199_254_740_991.0), "9007199254740991");
        assert_eq!(fmt(0.5), "0.5");
        assert_eq!(fmt(-1.25), "-1.25");
        assert_eq!(fmt(0.0001), "0.0001");
        assert_eq!(fmt(f64::NAN), "NaN");
        assert_eq!(fmt(f64::INFINITY), "+Inf");
        assert_eq!(fmt(f64::NEG_INFINITY), "-Inf");
        // Beyond 2^53 and tiny magnitudes: exponent notation that still round-trips.
        for v in [
            9_007_199_254_740_992.0,
            1e300,
            -1e20,
            1.5e-7,
            f64::MIN_POSITIVE,
            0.1 + 0.2,
        ] {
            let s = fmt(v);
            assert!(!s.is_empty());
            assert_eq!(s.parse::<f64>().ok(), Some(v), "{v} -> {s}");
        }
        assert_eq!(fmt(1e300), "1e300");
        assert_eq!(fmt(1.5e-7), "1.5e-7");
    }

    #[test]
    fn metrics_escaping() {
        let mut s = String::new();
        escape_label_value("a\\b\"c\nd\te", &mut s);
        assert_eq!(s, "a\\\\b\\\"c\\nd\te");
        let mut s = String::new();
        escape_help("a\\b\"c\nd", &mut s);
        assert_eq!(s, "a\\\\b\"c\\nd");
        // Non-ASCII passes through unchanged.
        let mut s = String::new();
        escape_label_value("Grüße ✓", &mut s);
        assert_eq!(s, "Grüße ✓");
    }

    #[test]
    fn metrics_name_validation() {
        for ok in ["a", "_x", "ns:sub_total", "A9"] {
            assert!(is_metric_name(ok), "{ok}");
        }
        for bad in ["", "9a", "a-b", "a b", "ä"] {
            assert!(!is_metric_name(bad), "{bad}");
        }
        for ok in ["le", "_a", "gpu0"] {
            assert!(is_label_name(ok), "{ok}");
        }
        for bad in ["", "a:b", "0a", "a-b"] {
            assert!(!is_label_name(bad), "{bad}");
        }
    }

    #[test]
    fn metrics_histogram_buckets() {
        let h = Histogram::new(&[1.0, 2.0]);
        // Upper bounds are inclusive; above the last bound goes to +Inf; NaN is ignored.
        for v in [-5.0, 1.0, 1.0000001, 2.0, 2.5, f64::INFINITY, f64::NAN] {
            h.observe(v);
        }
        let mut e = Exposition::new();
        h.write(&mut e, "h", &[("k", "v")]);
        let text = e.finish();
        assert!(text.contains("h_bucket{k=\"v\",le=\"1\"} 2\n"), "{text}");
        assert!(text.contains("h_bucket{k=\"v\",le=\"2\"} 4\n"), "{text}");
        assert!(text.contains("h_bucket{k=\"v\",le=\"+Inf\"} 6\n"), "{text}");
        assert!(text.contains("h_count{k=\"v\"} 6\n"), "{text}");
        assert!(text.contains("h_sum{k=\"v\"} +Inf\n"), "{text}");
    }

    #[test]
    fn metrics_latency_buckets_are_valid() {
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(LATENCY_BUCKETS.first(), Some(&0.0001));
        assert_eq!(LATENCY_BUCKETS.last(), Some(&60.0));
        let h = Histogram::new(LATENCY_BUCKETS);
        h.observe(0.003);
        let mut e = Exposition::new();
        h.write(&mut e, "x", &[]);
        let text = e.finish();
        assert_eq!(
            text.lines().filter(|l| l.starts_with("x_bucket")).count(),
            LATENCY_BUCKETS.len() + 1
        );
        assert!(text.contains("x_bucket{le=\"0.0025\"} 0\n"), "{text}");
        assert!(text.contains("x_bucket{le=\"0.005\"} 1\n"), "{text}");
    }

    #[test]
    #[should_panic(expected = "strictly increasing")]
    fn metrics_histogram_rejects_unsorted_bounds() {
        let _ = Histogram::new(&[1.0, 0.5]);
    }

    #[test]
    fn metrics_histogram_is_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Histogram>();

        static HIST: OnceLock<Histogram> = OnceLock::new();
        let hist = HIST.get_or_init(|| Histogram::new(&[10.0]));
        std::thread::scope(|s| {
            for t in 0..8 {
                s.spawn(move || {
                    for i in 0..1000 {
                        hist.observe(if (i + t) % 2 == 0 { 1.0 } else { 100.0 });
                    }
                });
            }
        });
        let mut e = Exposition::new();
        hist.write(&mut e, "t", &[]);
        let text = e.finish();
        assert!(text.contains("t_bucket{le=\"10\"} 4000\n"), "{text}");
        assert!(text.contains("t_bucket{le=\"+Inf\"} 8000\n"), "{text}");
        assert!(text.contains("t_count 8000\n"), "{text}");
        assert!(text.contains("t_sum 404000\n"), "{text}");
    }
}
