//! How deep a YAML text nests, found in one pass over it before the YAML
//! reader sees it. libyaml's scanner (under serde_yaml_ng) takes time
//! quadratic in the depth of flow collections: a job file of 30,000 `[`
//! took gpuctl 4.4 s to refuse, 30,000 `{a: ` 8.1 s (debug builds), and
//! tens of thousands more a minute. A job file is 2 deep.
//!
//! The scan follows YAML's structure closely enough to count it: block
//! collections by their columns (each `- ` and `? ` opening one, `- - - x`
//! on one line included), flow collections by their brackets. Block
//! scalars (`|`, `>`), the lines a plain scalar goes on to, quoted scalars
//! and comments are skipped, and a bracket inside a plain scalar (`echo
//! [x`) is text, as in YAML; what is skipped is only what the reader too
//! reads as text (or refuses at once). Its depth is within a level of the
//! reader's, but for a flow sequence of `k: v` pairs, which the reader
//! counts as maps of their own (the brackets are what costs). Text that
//! is not YAML at all is left to the reader's own errors.

/// The text nests deeper than the limit, first at `line` (1-based).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: nested more than {limit} levels deep")]
pub struct TooDeep {
    pub line: usize,
    pub limit: usize,
}

/// Refuses `text` at the first line where it nests deeper than `limit`.
pub fn check(text: &str, limit: usize) -> Result<(), TooDeep> {
    let mut scan = Scan {
        limit,
        line: 0,
        blocks: Vec::new(),
        flow: 0,
        flow_base: 0,
        flow_col: 0,
        flow_node_start: false,
        quote: None,
        block_scalar: None,
        plain: None,
    };
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, line) in text.lines().enumerate() {
        scan.line = i + 1;
        scan.line(line.as_bytes())?;
    }
    Ok(())
}

struct Scan {
    limit: usize,
    line: usize,
    /// The open block collections by column, innermost last. A mapping's
    /// value may be a sequence at the mapping's own column.
    blocks: Vec<(usize, Kind)>,
    /// Open flow collections, and the block depth and column the
    /// outermost opened at.
    flow: usize,
    flow_base: usize,
    flow_col: usize,
    /// In flow context, where a node may start (after `[`, `{`, `,`, `:`).
    flow_node_start: bool,
    /// Inside a quoted scalar that goes on to the next line.
    quote: Option<u8>,
    /// Inside a block scalar, whose lines are indented at least this.
    block_scalar: Option<usize>,
    /// After a plain scalar, whose lines go on while indented this much.
    plain: Option<usize>,
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Map,
    Seq,
}

/// Where a line's scan is: at a place where a node may start, or in text
/// that cannot hold one (a plain scalar, a key, what follows a quote).
#[derive(PartialEq)]
enum At {
    NodeStart,
    Text,
}

impl Scan {
    fn too_deep(&self, depth: usize) -> Result<(), TooDeep> {
        if depth > self.limit {
            return Err(TooDeep {
                line: self.line,
                limit: self.limit,
            });
        }
        Ok(())
    }

    /// A block collection of `kind` at `col`: the one open there, or a
    /// new one. A mapping's key at the column of a sequence ends the
    /// sequence (it was the value of that mapping).
    fn open_block(&mut self, col: usize, kind: Kind) -> Result<(), TooDeep> {
        if kind == Kind::Map && self.blocks.last() == Some(&(col, Kind::Seq)) {
            self.blocks.pop();
        }
        if self.blocks.last() != Some(&(col, kind)) {
            self.blocks.push((col, kind));
        }
        self.too_deep(self.blocks.len())
    }

    fn line(&mut self, b: &[u8]) -> Result<(), TooDeep> {
        let indent = b.iter().take_while(|c| **c == b' ').count();
        let blank = b[indent..].iter().all(|c| c.is_ascii_whitespace());
        if let Some(min) = self.block_scalar {
            if blank || indent >= min {
                return Ok(());
            }
            self.block_scalar = None;
        }
        if let Some(min) = self.plain {
            // A plain scalar's next lines: text (a comment ends it).
            if blank || (indent >= min && b[indent] != b'#' && !marker(b)) {
                return Ok(());
            }
            self.plain = None;
        }
        if let Some(q) = self.quote {
            let Some(end) = end_of_quote(b, 0, q) else {
                return Ok(());
            };
            self.quote = None;
            return self.scan(b, end, At::Text, indent + 1);
        }
        if self.flow > 0 {
            return self.scan(b, 0, At::Text, indent + 1);
        }
        if blank || b[indent] == b'#' {
            return Ok(());
        }
        if marker(b) {
            // A document starts from nothing.
            self.blocks.clear();
            return self.scan(b, 3, At::NodeStart, 0);
        }
        while self.blocks.last().is_some_and(|top| top.0 > indent) {
            self.blocks.pop();
        }
        // A node first on its line belongs to the collection it is in.
        let min = self.blocks.last().map_or(0, |top| top.0 + 1);
        self.scan(b, indent, At::NodeStart, min)
    }

    /// The line `b` from `i`, at `at`; a scalar that starts next goes on
    /// on the lines indented at least `min` (past the key or `- ` it
    /// belongs to). One loop, no recursion, however the line goes on.
    fn scan(&mut self, b: &[u8], mut i: usize, mut at: At, mut min: usize) -> Result<(), TooDeep> {
        loop {
            if self.flow > 0 {
                match self.scan_flow(b, i, min)? {
                    Some(next) => (i, at, min) = next,
                    None => return Ok(()),
                }
            }
            i = skip_spaces(b, i);
            if i >= b.len() || (b[i] == b'#' && (i == 0 || b[i - 1] == b' ')) {
                return Ok(());
            }
            // Where the node starts: a key's mapping is there, its anchor
            // and tag included.
            let node_col = i;
            if at == At::NodeStart {
                // Anchors and tags come before the node they name.
                while i < b.len() && (b[i] == b'&' || b[i] == b'!') {
                    i = skip_spaces(b, skip_word(b, i));
                }
                // The node itself may be on the next line.
                if i >= b.len() || b[i] == b'#' {
                    return Ok(());
                }
                let c = b[i];
                match c {
                    // An alias is a whole node: no lines follow it.
                    b'*' => {
                        i = skip_word(b, i);
                        at = At::Text;
                        continue;
                    }
                    // A block sequence entry or complex key: a collection
                    // whose content sits after the indicator.
                    b'-' | b'?' if b.get(i + 1).is_none_or(|c| *c == b' ') => {
                        let kind = if c == b'-' { Kind::Seq } else { Kind::Map };
                        self.open_block(i, kind)?;
                        min = i + 1;
                        i = skip_spaces(b, i + 1);
                        continue;
                    }
                    b'[' | b'{' => {
                        self.flow_base = self.blocks.len();
                        self.flow_col = node_col;
                        self.flow = 1;
                        self.flow_node_start = true;
                        self.too_deep(self.flow_base + 1)?;
                        i += 1;
                        continue;
                    }
                    b'|' | b'>' => {
                        self.block_scalar = Some(min);
                        return Ok(());
                    }
                    b'"' | b'\'' => match end_of_quote(b, i + 1, c) {
                        Some(end) => {
                            // A quoted key: its mapping is at the quote.
                            if let Some(colon) = key_colon(b, end) {
                                self.open_block(node_col, Kind::Map)?;
                                min = node_col + 1;
                                i = colon + 1;
                            } else {
                                i = end;
                                at = At::Text;
                            }
                            continue;
                        }
                        None => {
                            self.quote = Some(c);
                            return Ok(());
                        }
                    },
                    _ => {}
                }
            }
            // Plain text up to a mapping's ':' (the key's value follows)
            // or the end of the line; brackets in it are text.
            let Some(colon) = plain_until_colon(b, i) else {
                if at == At::NodeStart {
                    self.plain = Some(min);
                }
                return Ok(());
            };
            // A key that is not first on its line ("- key: v") opens its
            // mapping at its column.
            if at == At::NodeStart {
                self.open_block(node_col, Kind::Map)?;
                min = node_col + 1;
            }
            i = colon + 1;
            at = At::NodeStart;
        }
    }

    /// Inside a flow collection: every bracket outside quotes and comments
    /// opens or closes a collection (YAML keeps them out of plain scalars
    /// there). A quote starts a scalar only where a node may start;
    /// elsewhere (`a'b`) it is text. `None` when the line ends inside it;
    /// else where the line goes on once it closed, and how.
    fn scan_flow(
        &mut self,
        b: &[u8],
        mut i: usize,
        min: usize,
    ) -> Result<Option<(usize, At, usize)>, TooDeep> {
        loop {
            let Some(&c) = b.get(i) else {
                return Ok(None);
            };
            let node_start = self.flow_node_start;
            self.flow_node_start = false;
            match c {
                b'[' | b'{' => {
                    self.flow += 1;
                    self.too_deep(self.flow_base + self.flow)?;
                    self.flow_node_start = true;
                }
                b']' | b'}' => {
                    self.flow -= 1;
                    if self.flow == 0 {
                        i += 1;
                        // A flow collection as a key.
                        if let Some(colon) = key_colon(b, i) {
                            self.open_block(self.flow_col, Kind::Map)?;
                            return Ok(Some((colon + 1, At::NodeStart, self.flow_col + 1)));
                        }
                        return Ok(Some((i, At::Text, min)));
                    }
                }
                b',' => self.flow_node_start = true,
                // An indicator only before a space (`a:b` is text).
                b':' | b'?' => {
                    self.flow_node_start = b.get(i + 1).is_none_or(|c| *c == b' ' || *c == b'\t');
                }
                b' ' | b'\t' => self.flow_node_start = node_start,
                b'&' | b'!' if node_start => {
                    i = skip_word(b, i);
                    self.flow_node_start = true;
                    continue;
                }
                b'"' | b'\'' if node_start => match end_of_quote(b, i + 1, c) {
                    Some(end) => {
                        i = end;
                        continue;
                    }
                    None => {
                        self.quote = Some(c);
                        return Ok(None);
                    }
                },
                b'#' if i == 0 || b[i - 1] == b' ' => {
                    self.flow_node_start = node_start;
                    return Ok(None);
                }
                _ => {}
            }
            i += 1;
        }
    }
}

/// A document's start or end (`---`, `...`).
fn marker(b: &[u8]) -> bool {
    (b.starts_with(b"---") || b.starts_with(b"...")) && b.get(3).is_none_or(|c| *c == b' ')
}

fn skip_spaces(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && (b[i] == b' ' || b[i] == b'\t') {
        i += 1;
    }
    i
}

fn skip_word(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i] != b' ' && b[i] != b'\t' {
        i += 1;
    }
    i
}

/// Where the quoted scalar that started before `i` ends (just past its
/// closing quote), if on this line: `\"` escapes in double quotes, `''`
/// in single ones.
fn end_of_quote(b: &[u8], mut i: usize, q: u8) -> Option<usize> {
    while i < b.len() {
        if q == b'"' && b[i] == b'\\' {
            i += 2;
            continue;
        }
        if b[i] == q {
            if q == b'\'' && b.get(i + 1) == Some(&b'\'') {
                i += 2;
                continue;
            }
            return Some(i + 1);
        }
        i += 1;
    }
    None
}

/// After a quoted or flow key ending before `i`: its ':' if one follows
/// (then a space or the line's end).
fn key_colon(b: &[u8], i: usize) -> Option<usize> {
    let j = skip_spaces(b, i);
    (b.get(j) == Some(&b':') && b.get(j + 1).is_none_or(|c| *c == b' ' || *c == b'\t')).then_some(j)
}

/// In a plain scalar from `i`: the ':' that ends it as a mapping key (one
/// followed by a space or the line's end), unless a comment comes first.
fn plain_until_colon(b: &[u8], mut i: usize) -> Option<usize> {
    while i < b.len() {
        match b[i] {
            b':' if b.get(i + 1).is_none_or(|c| *c == b' ' || *c == b'\t') => return Some(i),
            b'#' if i > 0 && b[i - 1] == b' ' => return None,
            _ => {}
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depth_ok(text: &str, limit: usize) -> bool {
        check(text, limit).is_ok()
    }

    /// The smallest limit `text` passes; for YAML the reader takes, it is
    /// checked against the depth the reader finds.
    fn depth(text: &str) -> usize {
        let ours = (0..200).find(|l| depth_ok(text, *l)).unwrap_or(usize::MAX);
        match serde_yaml_ng::from_str::<serde_yaml_ng::Value>(text) {
            Ok(v) => assert_eq!(ours, real_depth(&v), "{text}"),
            Err(e) => panic!("not YAML ({e}): {text}"),
        }
        ours
    }

    fn real_depth(v: &serde_yaml_ng::Value) -> usize {
        use serde_yaml_ng::Value;
        match v {
            Value::Sequence(s) => 1 + s.iter().map(real_depth).max().unwrap_or(0),
            Value::Mapping(m) => {
                1 + m
                    .iter()
                    .map(|(k, v)| real_depth(k).max(real_depth(v)))
                    .max()
                    .unwrap_or(0)
            }
            Value::Tagged(t) => real_depth(&t.value),
            _ => 0,
        }
    }

    /// Texts made of YAML's pieces, fragment by fragment: wherever the
    /// reader takes one, our depth is the reader's.
    #[test]
    fn depths_agree_with_the_reader() {
        let pieces = [
            "a: ",
            "- ",
            "? ",
            ": ",
            "[",
            "]",
            "{",
            "}",
            ", ",
            "x",
            "\"q [\"",
            "'s {'",
            "|\n",
            ">-\n",
            "\n",
            "\n  ",
            "\n    ",
            "# c [\n",
            "k: [",
            "&a ",
            "!!str ",
            "b:\n",
            "- - ",
            "url://x:y",
            "echo [x",
            "\"k\": ",
            "*a ",
            "a'b",
            ":'x'",
            "[k]: ",
        ];
        // A small deterministic generator (no dependency): xorshift.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut checked = 0;
        for _ in 0..20_000 {
            let n = 1 + next() % 12;
            let text: String = (0..n)
                .map(|_| pieces[(next() % pieces.len() as u64) as usize])
                .collect();
            if let Ok(v) = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(&text) {
                let ours = (0..200).find(|l| depth_ok(&text, *l)).unwrap_or(usize::MAX);
                let real = real_depth(&v);
                // Never much above the reader's depth (a file is refused
                // only for what it is); below it only where a flow
                // sequence holds `k: v` pairs, each a map of its own to
                // the reader and no bracket (the brackets are the cost).
                assert!(ours <= real + 1, "{ours} > {real}: {text:?}");
                assert!(2 * ours + 1 >= real, "{ours} << {real}: {text:?}");
                checked += 1;
            }
        }
        assert!(checked > 1000, "{checked}");
    }

    #[test]
    fn a_job_file_is_a_few_levels_deep() {
        let job = "\
# a training job
name: train
image: pytorch:2.3
command: [python, train.py, --epochs, 3]
env:
  EPOCHS: 3
  NAME: \"a [quoted] {text}\"
mount:
  - /data:/data
  - /out:/out:rw
constraint: {zone: a}
";
        assert_eq!(depth(job), 2);
        assert_eq!(depth("name: x\n"), 1);
        assert_eq!(depth(""), 0);
    }

    #[test]
    fn flow_collections_count_their_brackets() {
        assert_eq!(depth("command: [[[x]]]\n"), 4);
        assert_eq!(depth("env: {a: {a: {a: b}}}\n"), 4);
        // Across lines, and back to block after.
        assert_eq!(depth("a: [\n  [\n   [x],\n  ],\n]\nb: c\n"), 4);
        assert_eq!(depth("a: &x !!seq [[x]]\n"), 3);
        // Quoted brackets and comments in flow are text.
        assert_eq!(depth("a: [\"[[[\", '{{{', x] # [[[[\n"), 2);
    }

    #[test]
    fn block_collections_count_their_levels() {
        assert_eq!(depth("a:\n  b:\n    c:\n      d: e\n"), 4);
        assert_eq!(depth("- - - - x\n"), 4);
        // A mapping's sequence at its own column is a level of its own.
        assert_eq!(depth("a:\n- - x\n- y\nb: c\n"), 3);
        assert_eq!(depth("- a: 1\n  b:\n    - c\n"), 3);
        assert_eq!(depth("a:\n- b:\n  - c:\n    - d\n"), 6);
        assert_eq!(depth("? - a\n: b\n"), 2);
        // Dedented lines close what they leave.
        assert_eq!(depth("a:\n  b:\n    c: d\ne:\n  f: g\n"), 3);
    }

    #[test]
    fn scalars_with_brackets_and_indentation_are_text() {
        let script = "\
name: build
command:
  - sh
  - -c
  - |
    for i in [1 2 3]; do
        if [[ -f x ]]; then { echo [[[[[[[[[[; }
            - - - - - - - - - - - -
        fi
    done
env:
  A: echo [x
  B: '[[[[[[[[[[['
  C: \"{{{{{{{{{{{{{\\\"[[[[[[\"
  D: >-
    {{{{{{{{{{{{{{{{{{{{{{{{{{
        [[[[[[[[[[[[[[[[[[[[
  E: \"a: b [[[[[[[[[[[[[[\"
  F: x # [[[[[[[[[[[[[[[[[
  G: \"multi [[[[[[[[[[[[[
    line [[[[[[[[[[[[ \"
  H: url://x:y/[[[[[[[[[[[[[
";
        assert_eq!(depth(script), 2);
    }

    #[test]
    fn deep_text_is_refused_at_the_line_it_passes_the_limit() {
        let flow = format!(
            "name: x\ncommand: {}{}\n",
            "[".repeat(30_000),
            "]".repeat(30_000)
        );
        assert_eq!(check(&flow, 64), Err(TooDeep { line: 2, limit: 64 }));
        let map = format!(
            "name: x\nenv: {}b{}\n",
            "{a: ".repeat(30_000),
            "}".repeat(30_000)
        );
        assert_eq!(check(&map, 64), Err(TooDeep { line: 2, limit: 64 }));
        let dashes = format!("name: x\ncommand:\n{}x\n", "- ".repeat(30_000));
        assert_eq!(check(&dashes, 64), Err(TooDeep { line: 3, limit: 64 }));
        let indented: String = (0..100).map(|i| format!("{}a:\n", " ".repeat(i))).collect();
        assert_eq!(
            check(&indented, 64),
            Err(TooDeep {
                line: 65,
                limit: 64
            })
        );
        // Flow inside block: the levels add up.
        let mixed = format!("{}x: {}\n", "- ".repeat(40), "[".repeat(30));
        assert_eq!(check(&mixed, 64), Err(TooDeep { line: 1, limit: 64 }));
        // Anchors and tags do not hide a flow collection.
        let tagged = format!("a: &x !!seq {}\n", "[".repeat(100));
        assert!(check(&tagged, 64).is_err());
    }

    /// A block scalar's lines are those indented past the node that owns
    /// it, no further: a sibling key after it is read.
    #[test]
    fn block_scalars_hide_no_structure_after_them() {
        let deep = "[".repeat(100);
        for owner in ["- \"k\": |", "- 'k': |", "- [k]: |", "- k: |", "- ? |"] {
            let text = format!("{owner}\n    text\n  b: {deep}\n");
            let err = check(&text, 64);
            assert_eq!(err, Err(TooDeep { line: 3, limit: 64 }), "{text}");
        }
        // Nothing hides what follows: a node's properties alone on a
        // line, an alias, a quote inside a flow scalar.
        for text in [
            format!("a: &x # c\n  b: {deep}\n"),
            format!("a: *x\nb: {deep}\n"),
            format!("a: [x'y,\n {deep}]\n"),
            format!("a: [\"x\", y\"z, {deep}]\n"),
        ] {
            assert!(check(&text, 64).is_err(), "{text}");
        }
        // A quote left open on one line goes on on the next.
        assert_eq!(depth("a: \"x\n  [[[[[[[\"\nb: [[x]]\n"), 3);
        assert_eq!(depth("a: [\"x\n  [[[[[[[\", [y]]\n"), 3);
    }
}
