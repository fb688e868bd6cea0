//! What crates link, read from `cargo tree` (normal dependencies, any
//! depth): a dependency that pulls in what a crate must not link fails
//! here, rather than silently changing what it is.
//!
//! - gpuctl-core stays pure: no async runtime, RPC or HTTP stack.
//! - gpuctl-engine (the state machine, the allocator, the scheduler's
//!   decisions) links none of that either, nor storage or consensus, so it
//!   cannot block, do I/O or reach into Raft.
//! - gpuctl, the command line, links no daemon: neither the master's
//!   storage and consensus (sled, raft) nor the agent's Docker client and
//!   NVML. `gpuctl demo` runs the daemon binaries instead.
//!
//! And what the sources say: no two modules of a crate depend on each
//! other, directly or round a circle (read from the `crate::` and `super::`
//! paths of their non-test code); no product file is over 800 non-test
//! lines, and no function over 120 but the dispatches named here.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

/// Every crate `package` links, by name.
fn linked(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            package,
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect()
}

/// Fails naming what of `forbidden` `package` links; `expected` must be
/// there (the output is what it seems).
fn check(package: &str, expected: &str, forbidden: &[&str]) {
    let crates = linked(package);
    assert!(crates.iter().any(|c| c == package), "{crates:?}");
    assert!(crates.iter().any(|c| c == expected), "{crates:?}");
    let bad: Vec<&String> = crates
        .iter()
        .filter(|c| forbidden.contains(&c.as_str()))
        .collect();
    assert!(bad.is_empty(), "{package} links {bad:?}:\n{crates:?}");
}

/// An async runtime, an RPC or HTTP stack: what a pure crate never links.
const NO_RUNTIME_RPC_OR_HTTP: &[&str] = &[
    "tokio",
    "tonic",
    "axum",
    "hyper",
    "h2",
    "mio",
    "tower",
    "async-std",
    "futures",
    "reqwest",
];

#[test]
fn the_core_links_no_async_runtime_rpc_or_http_stack() {
    check("gpuctl-core", "prost", NO_RUNTIME_RPC_OR_HTTP);
}

#[test]
fn the_engine_links_no_runtime_rpc_storage_or_raft() {
    let mut forbidden = NO_RUNTIME_RPC_OR_HTTP.to_vec();
    forbidden.extend([
        "sled",
        "raft",
        "raft-proto",
        "protobuf",
        "gpuctl-proto",
        "gpuctl-master",
        "tracing",
    ]);
    check("gpuctl-engine", "gpuctl-core", &forbidden);
}

#[test]
fn gpuctl_links_neither_sled_raft_bollard_nor_nvml() {
    check(
        "gpuctl",
        "tonic",
        &[
            "gpuctl-master",
            "gpuctl-agent",
            "sled",
            "raft",
            "bollard",
            "nvml-wrapper",
        ],
    );
}

/// The modules of the crate whose sources are under `src`, cut at `depth`
/// path segments, and the modules each names (`crate::a::b`, `super::x`)
/// outside its tests, with a file that names it. A module and its own
/// children are not edges: a parent that declares and uses its children,
/// and children that use their parent's items, are one module's insides.
fn module_edges(src: &Path, depth: usize) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut edges: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for (file, text) in product_sources(src) {
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        let rel = file.strip_prefix(src).unwrap().with_extension("");
        let mut path: Vec<String> = rel
            .iter()
            .map(|c| c.to_string_lossy().to_string())
            .collect();
        let is_dir_module = matches!(name.as_str(), "mod.rs" | "lib.rs" | "main.rs");
        if is_dir_module {
            path.pop();
        }
        if path.is_empty() {
            continue;
        }
        // `super::` from a directory's mod.rs is the directory's parent.
        let mut sup = path.clone();
        sup.pop();
        let me = path[..path.len().min(depth)].join("::");
        for line in text.lines() {
            let code = line.split("//").next().unwrap_or("");
            for (prefix, base) in [("crate::", Vec::new()), ("super::", sup.clone())] {
                let mut rest = code;
                while let Some(i) = rest.find(prefix) {
                    let before = rest[..i].chars().last();
                    rest = &rest[i + prefix.len()..];
                    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                        continue;
                    }
                    let mut target = base.clone();
                    let mut tail = rest;
                    while let Some(seg) = tail
                        .split(|c: char| {
                            !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                        })
                        .next()
                        .filter(|s| !s.is_empty())
                    {
                        target.push(seg.to_string());
                        tail = &tail[seg.len()..];
                        match tail.strip_prefix("::") {
                            Some(t) if target.len() < depth + base.len() => tail = t,
                            _ => break,
                        }
                    }
                    let to = target[..target.len().min(depth)].join("::");
                    let inside = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}::"));
                    if to.is_empty() || inside(&me, &to) || inside(&to, &me) {
                        continue;
                    }
                    edges
                        .entry(me.clone())
                        .or_default()
                        .entry(to)
                        .or_insert_with(|| rel.display().to_string());
                }
            }
        }
    }
    edges
}

/// A circle among `edges`, as the modules on it and the file of each step.
fn a_circle(edges: &BTreeMap<String, BTreeMap<String, String>>) -> Option<Vec<String>> {
    fn visit(
        at: &str,
        edges: &BTreeMap<String, BTreeMap<String, String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut circle = path[i..].to_vec();
            circle.push(at.to_string());
            return Some(circle);
        }
        if !done.insert(at.to_string()) {
            return None;
        }
        path.push(at.to_string());
        for to in edges.get(at).into_iter().flat_map(|m| m.keys()) {
            if let Some(c) = visit(to, edges, done, path) {
                return Some(c);
            }
        }
        path.pop();
        None
    }
    let mut done = BTreeSet::new();
    for start in edges.keys() {
        if let Some(c) = visit(start, edges, &mut done, &mut Vec::new()) {
            return Some(c);
        }
    }
    None
}

#[test]
fn no_circles_between_the_modules_of_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    let mut named = 0;
    for krate in [
        "core", "engine", "proto", "auth", "master", "console", "agent", "cli",
    ] {
        let src = root.join(krate).join("src");
        // Top-level modules, then their children, then one level more.
        for depth in 1..=3 {
            let edges = module_edges(&src, depth);
            named += edges.values().map(|e| e.len()).sum::<usize>();
            if let Some(circle) = a_circle(&edges) {
                let steps: Vec<String> = circle
                    .windows(2)
                    .map(|w| format!("{} -> {} ({})", w[0], w[1], edges[&w[0]][&w[1]]))
                    .collect();
                found.push(format!("{krate}: {}", steps.join(", ")));
                break;
            }
        }
    }
    // The scan read the sources: the crates' modules name each other.
    assert!(named > 100, "{named}");
    assert!(
        found.is_empty(),
        "modules that depend on each other:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_circle_check_finds_a_circle() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path();
    std::fs::create_dir_all(src.join("a")).unwrap();
    std::fs::write(src.join("lib.rs"), "mod a; mod b;\n").unwrap();
    std::fs::write(src.join("a/mod.rs"), "use super::b::X; // crate::c\n").unwrap();
    std::fs::write(src.join("b.rs"), "fn f() { crate::a::g() }\n").unwrap();
    let edges = module_edges(src, 1);
    let circle = a_circle(&edges).expect("a and b depend on each other");
    assert_eq!(circle.len(), 3, "{circle:?}");
    // The comment's path is not an edge; a module's own children are not.
    assert!(!edges["a"].contains_key("c"), "{edges:?}");
    std::fs::write(src.join("b.rs"), "fn f() { crate::b::inner::g() }\n").unwrap();
    assert_eq!(a_circle(&module_edges(src, 1)), None);
}

/// Every `.rs` file under `src` that is not a test file, with its text up
/// to its trailing test module.
fn product_sources(src: &Path) -> Vec<(std::path::PathBuf, String)> {
    let mut out = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                dirs.push(p);
            } else if name.ends_with(".rs") && !name.ends_with("tests.rs") && name != "testkit.rs" {
                let text = std::fs::read_to_string(&p).unwrap();
                let lines: Vec<&str> = text.lines().collect();
                let end = (0..lines.len())
                    .find(|&i| {
                        lines[i].starts_with("#[cfg(test)]")
                            && lines[i + 1..(i + 4).min(lines.len())]
                                .iter()
                                .any(|l| l.starts_with("mod tests"))
                    })
                    .unwrap_or(lines.len());
                out.push((p, lines[..end].join("\n")));
            }
        }
    }
    out
}

/// `text` with string and character literals emptied, so that the braces
/// left are blocks.
fn without_literals(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < c.len() {
        match c[i] {
            '"' => {
                // A raw string's hashes, if it is one (`r#"`).
                let mut hashes = 0;
                let mut j = i;
                while j > 0 && c[j - 1] == '#' {
                    hashes += 1;
                    j -= 1;
                }
                let raw = j > 0 && c[j - 1] == 'r';
                i += 1;
                while i < c.len() {
                    if !raw && c[i] == '\\' {
                        i += 2;
                        continue;
                    }
                    if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
                        break;
                    }
                    if c[i] == '\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
                out.push_str("\"\"");
                i += 1;
            }
            // A char literal ('{', '\n'), not a lifetime ('a).
            '\'' if c.get(i + 2) == Some(&'\'') || c.get(i + 1) == Some(&'\\') => {
                // After an escape's first character (`'\\'`, `'\''`,
                // `'\u{..}'`), the next quote closes it.
                let from = if c[i + 1] == '\\' { i + 3 } else { i + 2 };
                let end = (from..c.len()).find(|&k| c[k] == '\'');
                out.push_str("' '");
                i = end.map_or(c.len(), |e| e + 1);
            }
            '/' if c.get(i + 1) == Some(&'/') => {
                while i < c.len() && c[i] != '\n' {
                    i += 1;
                }
            }
            ch => {
                out.push(ch);
                i += 1;
            }
        }
    }
    out
}

/// The functions of `text` and how many lines each spans.
fn function_lengths(text: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let words: Vec<&str> = lines[i].split_whitespace().collect();
        let at = words.iter().position(|w| *w == "fn").filter(|&p| {
            words[..p].iter().all(|w| {
                matches!(*w, "pub" | "async" | "const" | "unsafe" | "extern")
                    || w.starts_with("pub(")
            })
        });
        let Some(name) = at.and_then(|p| words.get(p + 1)) else {
            i += 1;
            continue;
        };
        let name: String = name
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut opened) = (0i64, false);
        let mut j = i;
        while j < lines.len() {
            for ch in lines[j].chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if (opened && depth <= 0) || (!opened && lines[j].trim_end().ends_with(';')) {
                break;
            }
            j += 1;
        }
        if opened {
            out.push((name, j - i + 1));
        }
        i = j + 1;
    }
    out
}

/// Functions over the length that are one `match` (or `select!`) over
/// their cases, each case a line or a call: a dispatch, which reads best
/// whole.
const DISPATCHES: &[&str] = &[
    // Every Raft command to the file of its table.
    "apply_command",
    // The built-in scheduler's events while it leads.
    "lead",
    // How an attempt ends, by what stopped it.
    "stopped_outcome",
];

#[test]
fn no_product_file_over_800_lines_nor_function_over_120() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let (mut long_files, mut long_fns, mut seen) = (Vec::new(), Vec::new(), 0);
    for krate in [
        "core", "engine", "proto", "auth", "master", "console", "agent", "cli",
    ] {
        for (path, text) in product_sources(&root.join(krate).join("src")) {
            let lines = text.lines().count();
            if lines > 800 {
                long_files.push(format!("{} ({lines})", path.display()));
            }
            for (name, n) in function_lengths(&without_literals(&text)) {
                seen += 1;
                if n > 120 && !DISPATCHES.contains(&name.as_str()) {
                    long_fns.push(format!("{}: {name} ({n})", path.display()));
                }
            }
        }
    }
    // The scan read the sources.
    assert!(seen > 2000, "{seen} functions");
    assert!(
        long_files.is_empty(),
        "files over 800 non-test lines: {long_files:?}"
    );
    assert!(
        long_fns.is_empty(),
        "functions over 120 lines: {long_fns:?}"
    );
}

#[test]
fn the_shape_check_counts_blocks_not_braces_in_literals() {
    let text = "fn a() {\n    let s = \"}}}\";\n    let c = '{';\n    // }\n}\nfn b<'x>(v: &'x str) {\n    let r = r#\"{\"#;\n    let e = (b'\\\\', '\\'', '}');\n}\nfn c();\n";
    let lengths = function_lengths(&without_literals(text));
    assert_eq!(
        lengths,
        vec![("a".to_string(), 5), ("b".to_string(), 4)],
        "{}",
        without_literals(text)
    );
}
