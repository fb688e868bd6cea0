//! What a task may do on its agent: its user, host mounts, root, and the id ranges that bound them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a task may do on its agent beyond the defaults (docs/isolation.md,
/// "What a task may do"). Checked when a job enters the cluster
/// (`convert::check_security`) and enforced by the agent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskSecurity {
    /// Run as `UID` or `UID:GID` (numeric: names differ between hosts and
    /// images; `UID` alone is `UID:UID`). A container gets it as Docker's
    /// `User`; a host process switches to it before exec. `None`: the
    /// image's user, or the agent's `task_user` for a host process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Host paths bind-mounted into a container (containers only); the
    /// agent refuses any outside its `allowed_mounts`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<HostMount>,
    /// Only so that asking is refused clearly: never allowed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub privileged: bool,
    /// A host-process task runs as root; only on agents with
    /// `allow_root_tasks`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub run_as_root: bool,
}

impl TaskSecurity {
    pub fn is_default(&self) -> bool {
        *self == TaskSecurity::default()
    }
}

/// A host path bind-mounted into a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMount {
    pub host_path: String,
    pub container_path: String,
    /// Read-only unless asked otherwise.
    #[serde(default = "yes")]
    pub read_only: bool,
}

fn yes() -> bool {
    true
}

/// Whether `path` is one of `prefixes` or below one, by whole components:
/// `/data` covers `/data` and `/data/x`, not `/database`; `/` covers all.
/// Paths are compared as written (the agent resolves symlinks first).
pub fn path_within<S: AsRef<str>>(prefixes: &[S], path: &str) -> bool {
    prefixes.iter().any(|p| {
        let p = p.as_ref().trim_end_matches('/');
        path == p
            || path
                .strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('/'))
    })
}

/// A numeric user and group, as `UID:GID`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserIds {
    pub uid: u32,
    pub gid: u32,
}

impl UserIds {
    /// Root: uid 0, or gid 0 (the root group reads what root's files share
    /// with it).
    pub fn is_root(&self) -> bool {
        self.uid == 0 || self.gid == 0
    }
}

impl fmt::Display for UserIds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.uid, self.gid)
    }
}

impl std::str::FromStr for UserIds {
    type Err = String;
    /// `UID` (read as `UID:UID`) or `UID:GID`, decimal.
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |p: &str| {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!("{s:?} is not UID or UID:GID (numbers)"));
            }
            p.parse::<u32>()
                .ok()
                // (u32::MAX is -1 to the kernel: "leave unchanged".)
                .filter(|n| *n != u32::MAX)
                .ok_or_else(|| format!("{s:?}: {p} is not a valid id"))
        };
        match s.split_once(':') {
            Some((u, g)) => Ok(UserIds {
                uid: num(u)?,
                gid: num(g)?,
            }),
            None => {
                let uid = num(s)?;
                Ok(UserIds { uid, gid: uid })
            }
        }
    }
}

/// Numeric user or group ids as inclusive ranges (`1000-1999,2500`), kept
/// sorted and merged; empty is "none". Used for the ids a token lets its
/// holder choose (`gpuctl tokens create --allow-uids`), the ids an agent
/// lets jobs choose (`allowed_users`) and an agent's own range for tasks
/// (`task_users`). Never 0 (root is asked for with `run_as_root`) nor
/// 4294967295 (-1 to the kernel: "leave unchanged").
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IdRanges(Vec<(u32, u32)>);

impl IdRanges {
    /// Most ranges one list may hold (a token's and an agent's lists are
    /// replicated and shown; a short list is all a policy needs).
    pub const MAX_RANGES: usize = 32;

    /// No id at all.
    pub fn none() -> IdRanges {
        IdRanges(Vec::new())
    }

    /// Every id a job may name: 1 to 4294967294.
    pub fn all() -> IdRanges {
        IdRanges(vec![(1, u32::MAX - 1)])
    }

    /// From `(first, last)` pairs, checked (each first <= last, within
    /// 1..=4294967294, at most [`Self::MAX_RANGES`]); overlapping and
    /// touching ranges are merged.
    pub fn from_ranges(mut ranges: Vec<(u32, u32)>) -> Result<IdRanges, String> {
        if ranges.len() > Self::MAX_RANGES {
            return Err(format!(
                "{} ranges, at most {}",
                ranges.len(),
                Self::MAX_RANGES
            ));
        }
        for &(a, b) in &ranges {
            if a == 0 || b == u32::MAX {
                return Err(format!(
                    "{a}-{b}: ids are 1 to 4294967294 (0 is root, asked for with run_as_root)"
                ));
            }
            if a > b {
                return Err(format!("{a}-{b}: the range is empty ({a} > {b})"));
            }
        }
        ranges.sort_unstable();
        let mut merged: Vec<(u32, u32)> = Vec::with_capacity(ranges.len());
        for (a, b) in ranges {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        Ok(IdRanges(merged))
    }

    /// Parses `none` (or nothing) or a comma-separated list of `ID` and
    /// `FIRST-LAST`, decimal.
    pub fn parse(s: &str) -> Result<IdRanges, String> {
        let t = s.trim();
        if t.is_empty() || t == "none" {
            return Ok(IdRanges::none());
        }
        let num = |v: &str| -> Result<u32, String> {
            let v = v.trim();
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "{s:?}: {v:?} is not an id (expected ID or FIRST-LAST, comma separated, or none)"
                ));
            }
            v.parse::<u32>()
                .map_err(|_| format!("{s:?}: {v} is not a valid id"))
        };
        let ranges = t
            .split(',')
            .map(|part| match part.split_once('-') {
                Some((a, b)) => Ok((num(a)?, num(b)?)),
                None => num(part).map(|n| (n, n)),
            })
            .collect::<Result<Vec<_>, String>>()?;
        IdRanges::from_ranges(ranges).map_err(|e| format!("{s:?}: {e}"))
    }

    pub fn ranges(&self) -> &[(u32, u32)] {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn contains(&self, id: u32) -> bool {
        self.0.iter().any(|&(a, b)| (a..=b).contains(&id))
    }

    /// Whether some id is in both.
    pub fn overlaps(&self, other: &IdRanges) -> bool {
        self.0
            .iter()
            .any(|&(a, b)| other.0.iter().any(|&(c, d)| a <= d && c <= b))
    }

    /// How many ids it holds.
    pub fn count(&self) -> u64 {
        self.0
            .iter()
            .map(|&(a, b)| u64::from(b) - u64::from(a) + 1)
            .sum()
    }

    /// Its ids in order, from the first one at or after `from`, then
    /// around from the start: the order in which an agent tries ids for
    /// tasks, so the one most recently given out is tried last.
    pub fn ids_from(&self, from: u32) -> impl Iterator<Item = u32> + '_ {
        let after = self
            .0
            .iter()
            .filter(move |&&(_, b)| b >= from)
            .flat_map(move |&(a, b)| a.max(from)..=b);
        let before = self
            .0
            .iter()
            .filter(move |&&(a, _)| a < from)
            .flat_map(move |&(a, b)| a..=b.min(from.saturating_sub(1)));
        after.chain(before)
    }
}

impl fmt::Display for IdRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none");
        }
        for (i, &(a, b)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            if a == b {
                write!(f, "{a}")?;
            } else {
                write!(f, "{a}-{b}")?;
            }
        }
        Ok(())
    }
}
