//! What a CUDA image asks of the host's NVIDIA driver: the
//! `NVIDIA_REQUIRE_*` expressions of NVIDIA's images (`NVIDIA_REQUIRE_CUDA=
//! "cuda>=12.2 brand=tesla,driver>=470,driver<471 ..."`), parsed once and
//! evaluated against what an agent reports. PURE.
//!
//! The semantics are those of NVIDIA's container stack, read in its code:
//!
//! - Which variables (nvidia-container-toolkit,
//!   `internal/config/image/cuda_image.go`, `GetRequirements`): the value of
//!   every `NVIDIA_REQUIRE_*` variable but `NVIDIA_REQUIRE_JETPACK*`, each a
//!   requirement of its own, all of which must hold (the runtime hook
//!   passes each to `nvidia-container-cli configure --require=...`, which
//!   checks them one after the other). A "legacy" image, with `CUDA_VERSION`
//!   and no (or an empty) `NVIDIA_REQUIRE_CUDA`, requires `cuda>=MAJOR.MINOR`
//!   of its `CUDA_VERSION`. `NVIDIA_DISABLE_REQUIRE` set to a true value of
//!   Go's `strconv.ParseBool` (`1`, `t`, `T`, `true`, `TRUE`, `True`)
//!   disables the check.
//! - The grammar (libnvidia-container, `src/cli/dsl.c`, `dsl_evaluate` and
//!   `evaluate_rule`; the rules in `src/cli/configure.c`): conditions
//!   separated by spaces are ORed, by commas ANDed (AND binds tighter), and
//!   empty ones are skipped. A condition is `KEY OP VALUE`; the key ends at
//!   the first of `<>=!`, the operator is the whole run of those characters
//!   and must be one of `=`, `!=`, `<`, `<=`, `>`, `>=`. Keys are `cuda`
//!   (the driver's CUDA version), `driver` (the driver's version), `arch`
//!   (the GPU's compute capability) and `brand` (the GPU's brand), matched
//!   without regard to case. An unknown key, an unknown operator or an
//!   empty value makes the whole expression invalid.
//! - Versions (`dsl_compare_version`): digits and dots only, compared part
//!   by part as numbers, missing parts as zeros (12.2 = 12.2.0 < 12.10).
//!   Brands compare without regard to case, with `=` and `!=` only
//!   (`dsl_compare_string`).
//! - A fact the checker does not know satisfies the condition
//!   (`check_cuda_version` and `check_driver_version` answer true without
//!   driver information; `check_device_arch` and `check_device_brand`
//!   without a device).
//!
//! Where gpuctl differs, and why:
//! - `==` is accepted as `=` (NVIDIA rejects it): people write it.
//! - Any run of ASCII whitespace separates alternatives, not only one space.
//! - Malformed versions (`12..2`, `.5`, more than [`VERSION_PARTS`] parts,
//!   a part above `u32::MAX`) and brands other than letters, digits, `-`
//!   and `_` are errors; NVIDIA's scanner lets some of them through.
//! - The newer Go evaluator of the toolkit (`internal/requirements`, used
//!   only for Jetson's CSV mode) skips unknown keys; the C one that Docker
//!   and Kubernetes containers go through refuses them, and so does this.
//! - Facts are an agent's, not a GPU's: agents report no brand and the
//!   master picks GPUs after it picks the agent, so `brand` and `arch` are
//!   unknown, hence satisfied, on both sides (the master's placement and
//!   the agent's check must agree, or a job would go back and forth between
//!   them). [`Facts`] has room for them.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Most bytes of one expression. NVIDIA's longest (CUDA 12 images list
/// every brand for each older driver branch) are about 2 KiB.
pub const MAX_EXPR_LEN: usize = 8192;
/// Most expressions a job carries (its own and its image's).
pub const MAX_EXPRS: usize = 16;
/// Most parts of a version (`535.129.03` has three).
pub const VERSION_PARTS: usize = 6;
/// Most bytes of a brand name.
const MAX_BRAND_LEN: usize = 64;

/// The environment variables an image's requirements are read from.
pub const REQUIRE_PREFIX: &str = "NVIDIA_REQUIRE_";
pub const REQUIRE_JETPACK_PREFIX: &str = "NVIDIA_REQUIRE_JETPACK";
pub const DISABLE_REQUIRE: &str = "NVIDIA_DISABLE_REQUIRE";
pub const REQUIRE_CUDA: &str = "NVIDIA_REQUIRE_CUDA";
pub const LEGACY_CUDA_VERSION: &str = "CUDA_VERSION";

/// Why an expression (or an image's requirements) cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequireError {
    #[error("longer than {MAX_EXPR_LEN} bytes")]
    TooLong,
    #[error("{condition:?} has no operator (one of =, !=, <, <=, >, >=)")]
    NoOperator { condition: String },
    #[error("{condition:?} has no key before its operator")]
    NoKey { condition: String },
    #[error("{condition:?}: unknown key {key:?} (cuda, driver, arch or brand)")]
    UnknownKey { condition: String, key: String },
    #[error("{condition:?}: unknown operator {op:?} (one of =, !=, <, <=, >, >=)")]
    UnknownOperator { condition: String, op: String },
    #[error("{condition:?} has no value after its operator")]
    NoValue { condition: String },
    #[error("{condition:?}: {value:?} is not a version (digits separated by dots, e.g. 12.2)")]
    BadVersion { condition: String, value: String },
    #[error("{condition:?}: {value:?} is not a brand (letters, digits, - and _)")]
    BadBrand { condition: String, value: String },
    #[error("{condition:?}: a brand compares only with = or !=")]
    BrandOperator { condition: String },
    /// In an image: which variable.
    #[error("{var}: {error}")]
    InVariable {
        var: String,
        error: Box<RequireError>,
    },
    #[error("{LEGACY_CUDA_VERSION}={0:?} is not a version")]
    LegacyCudaVersion(String),
    #[error("more than {MAX_EXPRS} requirements")]
    TooMany,
}

/// A version compared part by part as numbers, missing parts as zeros:
/// the parts are kept padded with zeros, so the derived order is right.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version([u32; VERSION_PARTS]);

impl Version {
    /// Digits separated by single dots (`12.2`, `535.129.03`); `None`
    /// otherwise.
    pub fn parse(s: &str) -> Option<Version> {
        let mut parts = [0u32; VERSION_PARTS];
        for (n, p) in s.split('.').enumerate() {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || n == VERSION_PARTS {
                return None;
            }
            parts[n] = p.parse().ok()?;
        }
        Some(Version(parts))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // At least MAJOR.MINOR, then what is not zero.
        let len = self.0.iter().rposition(|&p| p != 0).map_or(0, |i| i + 1);
        for (i, p) in self.0[..len.max(2)].iter().enumerate() {
            if i > 0 {
                f.write_str(".")?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// What a host offers, as far as it is known: `None` is unknown, which
/// satisfies every condition on it (see the module's doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// The driver's CUDA version (`12.2`).
    pub cuda: Option<Version>,
    /// The driver's version (`535.129.03`).
    pub driver: Option<Version>,
    /// The GPU's compute capability (`8.0`).
    pub arch: Option<Version>,
    /// The GPU's brand (`tesla`, `geforce`...), lower case.
    pub brand: Option<String>,
}

impl Facts {
    /// From what an agent reports (`driver_version`, `cuda_driver_version`);
    /// what does not parse as a version is unknown.
    pub fn reported(driver: Option<&str>, cuda: Option<&str>) -> Facts {
        Facts {
            driver: driver.and_then(|v| Version::parse(v.trim())),
            cuda: cuda.and_then(|v| Version::parse(v.trim())),
            ..Facts::default()
        }
    }

    /// `driver 535.129.03, CUDA 12.2`, for messages; `unknown` parts said so.
    pub fn words(driver: Option<&str>, cuda: Option<&str>) -> String {
        let show = |v: Option<&str>| match v.map(str::trim) {
            Some(v) if !v.is_empty() => v.to_string(),
            _ => "unknown".to_string(),
        };
        format!("driver {}, CUDA {}", show(driver), show(cuda))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Cuda,
    Driver,
    Arch,
    Brand,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Op {
    fn holds(self, o: std::cmp::Ordering) -> bool {
        use std::cmp::Ordering::*;
        match self {
            Op::Eq => o == Equal,
            Op::Ne => o != Equal,
            Op::Lt => o == Less,
            Op::Le => o != Greater,
            Op::Gt => o == Greater,
            Op::Ge => o != Less,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Value {
    Version(Version),
    /// Lower case.
    Brand(String),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Condition {
    key: Key,
    op: Op,
    value: Value,
}

impl Condition {
    fn parse(text: &str) -> Result<Condition, RequireError> {
        let condition = || text.to_string();
        let is_op = |c: char| matches!(c, '<' | '>' | '=' | '!');
        let start = text.find(is_op).ok_or_else(|| RequireError::NoOperator {
            condition: condition(),
        })?;
        let key = &text[..start];
        let rest = &text[start..];
        let end = rest.find(|c: char| !is_op(c)).unwrap_or(rest.len());
        let (op, value) = rest.split_at(end);
        if key.is_empty() {
            return Err(RequireError::NoKey {
                condition: condition(),
            });
        }
        let key = match key.to_ascii_lowercase().as_str() {
            "cuda" => Key::Cuda,
            "driver" => Key::Driver,
            "arch" => Key::Arch,
            "brand" => Key::Brand,
            _ => {
                return Err(RequireError::UnknownKey {
                    condition: condition(),
                    key: key.to_string(),
                })
            }
        };
        let op = match op {
            "=" | "==" => Op::Eq,
            "!=" => Op::Ne,
            "<" => Op::Lt,
            "<=" => Op::Le,
            ">" => Op::Gt,
            ">=" => Op::Ge,
            _ => {
                return Err(RequireError::UnknownOperator {
                    condition: condition(),
                    op: op.to_string(),
                })
            }
        };
        if value.is_empty() {
            return Err(RequireError::NoValue {
                condition: condition(),
            });
        }
        let value = if key == Key::Brand {
            if !matches!(op, Op::Eq | Op::Ne) {
                return Err(RequireError::BrandOperator {
                    condition: condition(),
                });
            }
            let ok = value.len() <= MAX_BRAND_LEN
                && value
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return Err(RequireError::BadBrand {
                    condition: condition(),
                    value: value.to_string(),
                });
            }
            Value::Brand(value.to_ascii_lowercase())
        } else {
            Value::Version(
                Version::parse(value).ok_or_else(|| RequireError::BadVersion {
                    condition: condition(),
                    value: value.to_string(),
                })?,
            )
        };
        Ok(Condition { key, op, value })
    }

    fn holds(&self, facts: &Facts) -> bool {
        match &self.value {
            Value::Version(want) => {
                let have = match self.key {
                    Key::Cuda => facts.cuda,
                    Key::Driver => facts.driver,
                    Key::Arch => facts.arch,
                    Key::Brand => None,
                };
                have.is_none_or(|have| self.op.holds(have.cmp(want)))
            }
            Value::Brand(want) => facts.brand.as_deref().is_none_or(|have| {
                let same = have.eq_ignore_ascii_case(want);
                if self.op == Op::Eq {
                    same
                } else {
                    !same
                }
            }),
        }
    }
}

/// One requirement (the value of one `NVIDIA_REQUIRE_*` variable, or a
/// job's `--require-cuda`): alternatives separated by spaces, each a list of
/// conditions separated by commas. Parsed once; kept with its text, which
/// is what it serializes as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expr {
    text: String,
    /// Alternatives, each all of its conditions. Empty: no condition.
    any: Vec<Vec<Condition>>,
}

impl Expr {
    /// Parses `text` (surrounding whitespace ignored). An expression with
    /// no condition at all is valid and always met.
    pub fn parse(text: &str) -> Result<Expr, RequireError> {
        if text.len() > MAX_EXPR_LEN {
            return Err(RequireError::TooLong);
        }
        let text = text.trim();
        let mut any = Vec::new();
        for alt in alternatives(text) {
            any.push(
                alt.split(',')
                    .filter(|c| !c.is_empty())
                    .map(Condition::parse)
                    .collect::<Result<Vec<_>, _>>()?,
            );
        }
        Ok(Expr {
            text: text.to_string(),
            any,
        })
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// It has no condition (always met).
    pub fn is_empty(&self) -> bool {
        self.any.is_empty()
    }

    /// Whether a host with these facts meets it.
    pub fn met_by(&self, facts: &Facts) -> bool {
        self.any.is_empty()
            || self
                .any
                .iter()
                .any(|all| all.iter().all(|c| c.holds(facts)))
    }

    /// The first alternative and how many others: as NVIDIA's own error
    /// names a requirement (`cuda>=12.2`); the rest of a CUDA image's are
    /// branches of older drivers with forward compatibility.
    pub fn short(&self) -> String {
        let first = alternatives(&self.text).next().unwrap_or("");
        match self.any.len() {
            0 | 1 => first.to_string(),
            n => format!("{first} (+{} alternative{})", n - 1, plural(n - 1)),
        }
    }
}

/// The alternatives of an expression's text: what whitespace separates,
/// without those that hold only commas.
fn alternatives(text: &str) -> impl Iterator<Item = &str> {
    text.split_ascii_whitespace()
        .filter(|alt| alt.split(',').any(|c| !c.is_empty()))
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl Serialize for Expr {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Expr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Expr, D::Error> {
        let text = String::deserialize(d)?;
        Expr::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// Whether a host with these facts meets all of them.
pub fn all_met<'a>(exprs: impl IntoIterator<Item = &'a Expr>, facts: &Facts) -> bool {
    exprs.into_iter().all(|e| e.met_by(facts))
}

/// What an image's environment (`KEY=value` strings, later ones winning as
/// in Docker) requires of the driver, as NVIDIA's toolkit reads it (see the
/// module's doc), with the variable each comes from: one expression per
/// `NVIDIA_REQUIRE_*` variable in the order of their names, then the legacy
/// one (from `CUDA_VERSION`); none with `NVIDIA_DISABLE_REQUIRE`. A
/// malformed one is an error naming its variable: the image cannot be
/// checked, and NVIDIA's hook refuses it too.
pub fn image_requirements<'a>(
    env: impl IntoIterator<Item = &'a str>,
) -> Result<Vec<(String, Expr)>, RequireError> {
    let mut vars: std::collections::BTreeMap<&str, &str> = std::collections::BTreeMap::new();
    for kv in env {
        if let Some((k, v)) = kv.split_once('=') {
            vars.insert(k, v);
        }
    }
    if vars
        .get(DISABLE_REQUIRE)
        .is_some_and(|v| matches!(*v, "1" | "t" | "T" | "true" | "TRUE" | "True"))
    {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for (var, value) in vars.range(REQUIRE_PREFIX..) {
        if !var.starts_with(REQUIRE_PREFIX) {
            break;
        }
        if var.starts_with(REQUIRE_JETPACK_PREFIX) {
            continue;
        }
        let e = Expr::parse(value).map_err(|error| RequireError::InVariable {
            var: var.to_string(),
            error: Box::new(error),
        })?;
        if !e.is_empty() {
            out.push((var.to_string(), e));
        }
    }
    let legacy = vars.get(LEGACY_CUDA_VERSION).filter(|v| !v.is_empty());
    let require_cuda = vars.get(REQUIRE_CUDA).filter(|v| !v.is_empty());
    if let (Some(v), None) = (legacy, require_cuda) {
        // MAJOR.MINOR of it, as the toolkit's `legacyVersion`.
        let version = v
            .split(['-', '+'])
            .next()
            .and_then(|core| {
                let mut parts = core.split('.');
                let major = parts.next().filter(|p| !p.is_empty())?;
                let minor = parts.next().unwrap_or("0");
                Version::parse(&format!("{major}.{minor}"))?;
                Some(format!("{major}.{minor}"))
            })
            .ok_or_else(|| RequireError::LegacyCudaVersion(v.to_string()))?;
        out.push((
            LEGACY_CUDA_VERSION.to_string(),
            Expr::parse(&format!("cuda>={version}"))?,
        ));
    }
    if out.len() > MAX_EXPRS {
        return Err(RequireError::TooMany);
    }
    Ok(out)
}

/// Real images' requirements, for tests and benchmarks.
#[doc(hidden)]
pub mod examples {
    /// `nvidia/cuda:12.2.0-base-ubuntu22.04`'s NVIDIA_REQUIRE_CUDA.
    pub const CUDA_12_2: &str = "cuda>=12.2 brand=tesla,driver>=470,driver<471 \
        brand=unknown,driver>=470,driver<471 brand=nvidia,driver>=470,driver<471 \
        brand=nvidiartx,driver>=470,driver<471 brand=geforce,driver>=470,driver<471 \
        brand=geforcertx,driver>=470,driver<471 brand=quadro,driver>=470,driver<471 \
        brand=quadrortx,driver>=470,driver<471 brand=titan,driver>=470,driver<471 \
        brand=titanrtx,driver>=470,driver<471 brand=tesla,driver>=525,driver<526 \
        brand=unknown,driver>=525,driver<526 brand=nvidia,driver>=525,driver<526 \
        brand=nvidiartx,driver>=525,driver<526 brand=geforce,driver>=525,driver<526 \
        brand=geforcertx,driver>=525,driver<526 brand=quadro,driver>=525,driver<526 \
        brand=quadrortx,driver>=525,driver<526 brand=titan,driver>=525,driver<526 \
        brand=titanrtx,driver>=525,driver<526";
}

#[cfg(test)]
mod tests {
    use super::*;

    use examples::CUDA_12_2;

    /// `nvidia/cuda:11.8.0-base-ubuntu22.04`'s.
    const CUDA_11_8: &str = "cuda>=11.8 brand=tesla,driver>=450,driver<451 \
        brand=tesla,driver>=470,driver<471 brand=unknown,driver>=470,driver<471 \
        brand=nvidia,driver>=470,driver<471 brand=geforce,driver>=470,driver<471 \
        brand=tesla,driver>=510,driver<511 brand=tesla,driver>=515,driver<516";

    fn v(s: &str) -> Version {
        Version::parse(s).unwrap()
    }

    fn facts(driver: &str, cuda: &str) -> Facts {
        Facts::reported(Some(driver), Some(cuda))
    }

    #[test]
    fn versions_compare_part_by_part_as_numbers() {
        let cases = [
            ("12.2", "12.10", std::cmp::Ordering::Less),
            ("12.2", "12.2.0", std::cmp::Ordering::Equal),
            ("12.2.0.0", "12.2", std::cmp::Ordering::Equal),
            ("535.129.03", "535.129.3", std::cmp::Ordering::Equal),
            ("535.129.03", "535.129.10", std::cmp::Ordering::Less),
            ("470", "470.57.02", std::cmp::Ordering::Less),
            ("9.9", "10", std::cmp::Ordering::Less),
            ("12.0.1", "12", std::cmp::Ordering::Greater),
        ];
        for (a, b, want) in cases {
            assert_eq!(v(a).cmp(&v(b)), want, "{a} vs {b}");
        }
        for bad in [
            "",
            ".",
            "12.",
            ".2",
            "12..2",
            "12.2a",
            "v12",
            "1.2.3.4.5.6.7",
            "99999999999",
            "-1",
            " 12",
        ] {
            assert_eq!(Version::parse(bad), None, "{bad:?}");
        }
        assert_eq!(v("12.2").to_string(), "12.2");
        assert_eq!(v("12").to_string(), "12.0");
        assert_eq!(v("535.129.03").to_string(), "535.129.3");
    }

    #[test]
    fn conditions_and_operators() {
        // (expression, driver, cuda, met)
        let cases: &[(&str, &str, &str, bool)] = &[
            ("cuda>=12.2", "535.129.03", "12.2", true),
            ("cuda>=12.2", "525.60.13", "12.0", false),
            ("cuda>12.2", "535.129.03", "12.2", false),
            ("cuda>12.2", "545.23.06", "12.3", true),
            ("cuda<12.2", "525.60.13", "12.0", true),
            ("cuda<=12.2", "535.129.03", "12.2", true),
            ("cuda=12.2", "535.129.03", "12.2.0", true),
            ("cuda==12.2", "535.129.03", "12.2", true),
            ("cuda!=12.2", "535.129.03", "12.2", false),
            ("cuda!=12.2", "545.23.06", "12.3", true),
            ("cuda>=12.2", "535.129.03", "12.10", true),
            ("driver>=535", "535.129.03", "12.2", true),
            ("driver>=535.129.04", "535.129.03", "12.2", false),
            ("driver>=470,driver<471", "470.57.02", "11.4", true),
            ("driver>=470,driver<471", "471.11", "11.4", false),
            ("CUDA>=12.2", "535.129.03", "12.2", true),
            ("Driver<500", "535.129.03", "12.2", false),
            // OR of ANDs: the first alternative that holds wins.
            (
                "cuda>=12.2 driver>=470,driver<471",
                "470.57.02",
                "11.4",
                true,
            ),
            (
                "cuda>=12.2 driver>=470,driver<471",
                "510.47.03",
                "11.6",
                false,
            ),
            // Whitespace runs and empty conditions are skipped.
            (
                "  cuda>=12.2 ,, \t driver>=535 ",
                "525.60.13",
                "12.0",
                false,
            ),
            ("cuda>=12.2,,", "535.129.03", "12.2", true),
            // No condition: always met.
            ("", "1", "1", true),
            (" , ", "1", "1", true),
        ];
        for &(e, driver, cuda, met) in cases {
            let expr = Expr::parse(e).unwrap_or_else(|err| panic!("{e:?}: {err}"));
            assert_eq!(
                expr.met_by(&facts(driver, cuda)),
                met,
                "{e:?} on {driver}/{cuda}"
            );
        }
    }

    #[test]
    fn unknown_facts_satisfy_their_conditions() {
        let unknown = Facts::default();
        for e in [
            "cuda>=99",
            "driver<1",
            "arch>=9.0",
            "brand=tesla",
            CUDA_12_2,
        ] {
            assert!(Expr::parse(e).unwrap().met_by(&unknown), "{e}");
        }
        // Known CUDA, unknown driver: only the CUDA condition decides.
        let cuda_only = Facts::reported(None, Some("11.4"));
        assert!(!Expr::parse("cuda>=12.2").unwrap().met_by(&cuda_only));
        assert!(Expr::parse("cuda>=11.4,driver>=999")
            .unwrap()
            .met_by(&cuda_only));
        // Unparsable reports are unknown.
        let garbage = Facts::reported(Some("n/a"), Some(""));
        assert_eq!(garbage, Facts::default());
    }

    #[test]
    fn brand_and_arch_when_known() {
        let mut f = facts("470.57.02", "11.4");
        f.brand = Some("tesla".into());
        f.arch = Some(v("8.0"));
        let met = |e: &str| Expr::parse(e).unwrap().met_by(&f);
        assert!(met("brand=Tesla,driver>=470"));
        assert!(!met("brand=geforce,driver>=470"));
        assert!(met("brand!=geforce"));
        assert!(met("arch>=7.0"));
        assert!(!met("arch>=9.0"));
        // The real string: forward compatibility on a datacenter GPU.
        assert!(met(CUDA_12_2));
        f.brand = Some("grid".into());
        assert!(!Expr::parse(CUDA_12_2).unwrap().met_by(&f));
    }

    #[test]
    fn real_cuda_image_requirements() {
        let e12 = Expr::parse(CUDA_12_2).unwrap();
        let e11 = Expr::parse(CUDA_11_8).unwrap();
        // (driver, cuda, 12.2 image, 11.8 image); brand unknown, so the
        // forward-compatibility branches count on driver alone.
        let cases = [
            ("535.129.03", "12.2", true, true),
            ("545.23.06", "12.3", true, true),
            ("525.60.13", "12.0", true, true),
            ("520.61.05", "11.8", false, true),
            ("515.65.01", "11.7", false, true),
            ("510.47.03", "11.6", false, true),
            ("470.57.02", "11.4", true, true),
            ("460.32.03", "11.2", false, false),
            ("450.80.02", "11.0", false, true),
        ];
        for (driver, cuda, want12, want11) in cases {
            let f = facts(driver, cuda);
            assert_eq!(e12.met_by(&f), want12, "12.2 image on {driver}/{cuda}");
            assert_eq!(e11.met_by(&f), want11, "11.8 image on {driver}/{cuda}");
        }
        assert_eq!(e12.short(), "cuda>=12.2 (+20 alternatives)");
        assert_eq!(Expr::parse("cuda>=12.2").unwrap().short(), "cuda>=12.2");
        assert_eq!(
            Expr::parse("cuda>=12.2 driver>=535").unwrap().short(),
            "cuda>=12.2 (+1 alternative)"
        );
        assert_eq!(e12.text(), CUDA_12_2);
    }

    #[test]
    fn malformed_expressions_name_the_problem() {
        use RequireError as E;
        let c = |s: &str| s.to_string();
        let cases: Vec<(&str, RequireError)> = vec![
            (
                "cuda",
                E::NoOperator {
                    condition: c("cuda"),
                },
            ),
            (
                ">=12.2",
                E::NoKey {
                    condition: c(">=12.2"),
                },
            ),
            (
                "cudnn>=8",
                E::UnknownKey {
                    condition: c("cudnn>=8"),
                    key: c("cudnn"),
                },
            ),
            (
                "cuda=>12.2",
                E::UnknownOperator {
                    condition: c("cuda=>12.2"),
                    op: c("=>"),
                },
            ),
            (
                "cuda!12",
                E::UnknownOperator {
                    condition: c("cuda!12"),
                    op: c("!"),
                },
            ),
            (
                "cuda>=",
                E::NoValue {
                    condition: c("cuda>="),
                },
            ),
            (
                "cuda>=12.x",
                E::BadVersion {
                    condition: c("cuda>=12.x"),
                    value: c("12.x"),
                },
            ),
            (
                "driver>=535..1",
                E::BadVersion {
                    condition: c("driver>=535..1"),
                    value: c("535..1"),
                },
            ),
            (
                "brand>tesla",
                E::BrandOperator {
                    condition: c("brand>tesla"),
                },
            ),
            (
                "brand=te/sla",
                E::BadBrand {
                    condition: c("brand=te/sla"),
                    value: c("te/sla"),
                },
            ),
            // One bad condition spoils the expression, wherever it is.
            (
                "cuda>=12.2 brand=tesla,drivr>=470",
                E::UnknownKey {
                    condition: c("drivr>=470"),
                    key: c("drivr"),
                },
            ),
        ];
        for (e, want) in cases {
            assert_eq!(Expr::parse(e), Err(want), "{e:?}");
        }
        assert_eq!(
            Expr::parse(&"cuda>=1 ".repeat(2000)),
            Err(RequireError::TooLong)
        );
        let msg = Expr::parse("cudnn>=8").unwrap_err().to_string();
        assert_eq!(
            msg,
            "\"cudnn>=8\": unknown key \"cudnn\" (cuda, driver, arch or brand)"
        );
    }

    #[test]
    fn serializes_as_its_text_and_parses_back() {
        let e = Expr::parse(CUDA_11_8).unwrap();
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(json, serde_json::to_string(CUDA_11_8).unwrap());
        let back: Expr = serde_json::from_str(&json).unwrap();
        assert_eq!(back, e);
        let bad: Result<Expr, _> = serde_json::from_str("\"cuda>>1\"");
        assert!(bad.is_err());
    }

    #[test]
    fn image_requirements_as_the_toolkit_reads_them() {
        let texts = |env: &[&str]| -> Vec<String> {
            image_requirements(env.iter().copied())
                .unwrap()
                .iter()
                .map(|(_, e)| e.text().to_string())
                .collect()
        };
        let none: Vec<String> = Vec::new();
        assert_eq!(texts(&["PATH=/bin"]), none);
        assert_eq!(
            texts(&["NVIDIA_REQUIRE_CUDA=cuda>=11.6"]),
            vec!["cuda>=11.6"]
        );
        // Every NVIDIA_REQUIRE_* but JETPACK, by name.
        assert_eq!(
            texts(&[
                "NVIDIA_REQUIRE_DRIVER=driver>=535",
                "NVIDIA_REQUIRE_CUDA=cuda>=11.6",
                "NVIDIA_REQUIRE_JETPACK=csv-mounts=all",
                "NVIDIA_REQUIRE_JETPACK_HOST_MOUNTS=base-only",
                "NVIDIA_REQUIRE_BRAND=brand=tesla",
            ]),
            vec!["brand=tesla", "cuda>=11.6", "driver>=535"]
        );
        // Legacy images: CUDA_VERSION without NVIDIA_REQUIRE_CUDA.
        assert_eq!(texts(&["CUDA_VERSION=10.0.130"]), vec!["cuda>=10.0"]);
        let vars: Vec<String> =
            image_requirements(["CUDA_VERSION=9.2", "NVIDIA_REQUIRE_X=driver>=1"])
                .unwrap()
                .into_iter()
                .map(|(var, _)| var)
                .collect();
        assert_eq!(vars, ["NVIDIA_REQUIRE_X", "CUDA_VERSION"]);
        assert_eq!(texts(&["CUDA_VERSION=11.6"]), vec!["cuda>=11.6"]);
        assert_eq!(
            texts(&["CUDA_VERSION=11.6", "NVIDIA_REQUIRE_CUDA="]),
            vec!["cuda>=11.6"]
        );
        assert_eq!(
            texts(&["CUDA_VERSION=12.2.0", "NVIDIA_REQUIRE_CUDA=cuda>=12.2"]),
            vec!["cuda>=12.2"]
        );
        // Disabled by a true value only; the last definition wins.
        for yes in ["1", "t", "T", "true", "TRUE", "True"] {
            let disable = format!("NVIDIA_DISABLE_REQUIRE={yes}");
            assert_eq!(
                texts(&["NVIDIA_REQUIRE_CUDA=cuda>=99", "CUDA_VERSION=9.0", &disable]),
                none,
                "{yes}"
            );
        }
        for no in ["0", "false", "yes", ""] {
            let disable = format!("NVIDIA_DISABLE_REQUIRE={no}");
            assert_eq!(
                texts(&["NVIDIA_REQUIRE_CUDA=cuda>=99", &disable]),
                vec!["cuda>=99"],
                "{no}"
            );
        }
        assert_eq!(
            texts(&["NVIDIA_REQUIRE_CUDA=cuda>=1", "NVIDIA_REQUIRE_CUDA=cuda>=2"]),
            vec!["cuda>=2"]
        );
        // Malformed: an error naming the variable.
        let err = image_requirements(["NVIDIA_REQUIRE_CUDA=cuda>=12.2 brand=tesla,drivr>=1"])
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "NVIDIA_REQUIRE_CUDA: \"drivr>=1\": unknown key \"drivr\" (cuda, driver, arch or brand)"
        );
        assert_eq!(
            image_requirements(["CUDA_VERSION=latest"]),
            Err(RequireError::LegacyCudaVersion("latest".into()))
        );
    }

    #[test]
    fn all_must_be_met() {
        let a = Expr::parse("cuda>=11.0").unwrap();
        let b = Expr::parse("driver>=535").unwrap();
        assert!(all_met([&a, &b], &facts("535.129.03", "12.2")));
        assert!(!all_met([&a, &b], &facts("525.60.13", "12.0")));
        assert!(all_met([], &facts("1", "1")));
    }
}
