//! The job file's values as they are read and written: text that may be
//! written as a number, mounts, replicas, and each flag's check run as its
//! key is read (so an error carries the key and its line).

use std::fmt;

use gpuctl_core::convert::{MAX_REPLICAS, MAX_RETRIES};
use serde::{de, Deserialize, Deserializer, Serialize};

use super::super::job_values::{
    parse_hang_timeout, parse_mount, parse_require_cuda, parse_restart_backoff,
    parse_restart_policy, parse_stop_grace,
};

/// A string value that may be written as a YAML number or boolean
/// (`EPOCHS: 3`, `user: 1000`): environment values and arguments are
/// text, and making people quote every number would only trip them up.
/// Floats are refused, since `1.0` would come out as `1`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, an integer or a boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Text, E> {
                Err(E::custom(format!(
                    "{v} is a floating-point number: quote it to keep its text exactly"
                )))
            }
        }
        d.deserialize_any(V)
    }
}

/// `kind`: what a file makes: a job (`gpuctl jobs submit -f`, the
/// default) or a service (`gpuctl services create -f`), whose `replicas`
/// is then its number of replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Job,
    Service,
}

/// One `mount` entry, checked like `--mount` when read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Mount(pub String);

impl<'de> Deserialize<'de> for Mount {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Checked(StrCheck(check_mount))).map(Mount)
    }
}

pub(super) fn check_mount(s: &str) -> Result<String, String> {
    parse_mount(s).map(|_| s.to_string())
}

// Values are checked inside the visitors: serde_yaml_ng gives an error the
// key's path and line only when it is raised while it reads the value, not
// once the value is returned.

/// A checked value of the job file: the visitor for its YAML scalar.
pub(super) trait Check {
    type Value;
    fn expecting(&self) -> &'static str;
    fn str(&self, _v: &str) -> Option<Result<Self::Value, String>> {
        None
    }
    fn u64(&self, _v: u64) -> Option<Result<Self::Value, String>> {
        None
    }
    fn i64(&self, v: i64) -> Option<Result<Self::Value, String>> {
        u64::try_from(v).ok().and_then(|v| self.u64(v))
    }
    fn f64(&self, _v: f64) -> Option<Result<Self::Value, String>> {
        None
    }
}

pub(super) struct Checked<C>(C);

impl<'de, C: Check> de::Visitor<'de> for Checked<C> {
    type Value = C::Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0.expecting())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<C::Value, E> {
        match self.0.str(v) {
            Some(r) => r.map_err(E::custom),
            None => Err(E::invalid_type(de::Unexpected::Str(v), &self)),
        }
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<C::Value, E> {
        match self.0.u64(v) {
            Some(r) => r.map_err(E::custom),
            None => Err(E::invalid_type(de::Unexpected::Unsigned(v), &self)),
        }
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<C::Value, E> {
        match self.0.i64(v) {
            Some(r) => r.map_err(E::custom),
            None => Err(E::invalid_type(de::Unexpected::Signed(v), &self)),
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<C::Value, E> {
        match self.0.f64(v) {
            Some(r) => r.map_err(E::custom),
            None => Err(E::invalid_type(de::Unexpected::Float(v), &self)),
        }
    }
}

/// `key: ~` is the same as no key.
pub(super) struct OrNull<C>(C);

impl<'de, C: Check> de::Visitor<'de> for OrNull<C> {
    type Value = Option<C::Value>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.0.expecting())
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(Checked(self.0)).map(Some)
    }
}

/// A string checked (and normalized) by a function.
pub(super) struct StrCheck(fn(&str) -> Result<String, String>);

impl Check for StrCheck {
    type Value = String;
    fn expecting(&self) -> &'static str {
        "a string"
    }
    fn str(&self, v: &str) -> Option<Result<String, String>> {
        Some((self.0)(v))
    }
}

/// A duration (`90s`, `5m`) or a number of seconds, as ms, checked by the
/// flag's own parser (`--stop-grace`, `--hang-timeout`).
pub(super) struct Millis {
    expecting: &'static str,
    parse: fn(&str) -> Result<u64, String>,
}

impl Check for Millis {
    type Value = u64;
    fn expecting(&self) -> &'static str {
        self.expecting
    }
    fn str(&self, v: &str) -> Option<Result<u64, String>> {
        Some((self.parse)(v))
    }
    fn u64(&self, v: u64) -> Option<Result<u64, String>> {
        Some((self.parse)(&v.to_string()))
    }
}

/// A gang's size: `N`, or `MIN:MAX` for an elastic gang (`--replicas`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicas(pub u32, pub u32);

impl Serialize for Replicas {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if self.0 == self.1 {
            s.serialize_u32(self.1)
        } else {
            s.serialize_str(&format!("{}:{}", self.0, self.1))
        }
    }
}

pub(super) struct ReplicasCheck;

impl Check for ReplicasCheck {
    type Value = Replicas;
    fn expecting(&self) -> &'static str {
        "a number of replicas (4) or MIN:MAX (2:4)"
    }
    fn str(&self, v: &str) -> Option<Result<Replicas, String>> {
        Some(gpuctl_core::convert::parse_replicas(v).map(|(a, b)| Replicas(a, b)))
    }
    fn u64(&self, v: u64) -> Option<Result<Replicas, String>> {
        Some(Range(1, MAX_REPLICAS).u64(v)?.map(|n| Replicas(n, n)))
    }
    fn i64(&self, v: i64) -> Option<Result<Replicas, String>> {
        Some(Range(1, MAX_REPLICAS).i64(v)?.map(|n| Replicas(n, n)))
    }
}

/// A whole number in `min..=max`.
pub(super) struct Range(u32, u32);

impl Check for Range {
    type Value = u32;
    fn expecting(&self) -> &'static str {
        "a whole number"
    }
    fn u64(&self, v: u64) -> Option<Result<u32, String>> {
        let (min, max) = (self.0, self.1);
        Some(
            u32::try_from(v)
                .ok()
                .filter(|n| (min..=max).contains(n))
                .ok_or_else(|| format!("{v} is not in {min}..={max}")),
        )
    }
    fn i64(&self, v: i64) -> Option<Result<u32, String>> {
        match u64::try_from(v) {
            Ok(v) => self.u64(v),
            Err(_) => Some(Err(format!("{v} is not in {}..={}", self.0, self.1))),
        }
    }
}

/// A number of CPUs, fractions allowed.
pub(super) struct Cpus;

impl Check for Cpus {
    type Value = f64;
    fn expecting(&self) -> &'static str {
        "a number of CPUs"
    }
    fn f64(&self, v: f64) -> Option<Result<f64, String>> {
        Some(if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(format!("{v} is not a number of CPUs >= 0"))
        })
    }
    fn u64(&self, v: u64) -> Option<Result<f64, String>> {
        self.f64(v as f64)
    }
    fn i64(&self, v: i64) -> Option<Result<f64, String>> {
        self.f64(v as f64)
    }
}

pub(super) fn check_placement(s: &str) -> Result<String, String> {
    match s {
        "bundle" | "spread" => Ok(s.to_string()),
        _ => Err(format!(
            "{s:?} is not a placement policy (bundle or spread)"
        )),
    }
}

pub(super) fn de_cpus<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_option(OrNull(Cpus))
}

pub(super) fn de_placement<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_option(OrNull(StrCheck(check_placement)))
}

pub(super) fn de_restart_policy<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<String>, D::Error> {
    d.deserialize_option(OrNull(StrCheck(parse_restart_policy)))
}

pub(super) fn de_restart_backoff<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_option(OrNull(Millis {
        expecting: "a duration (10s, 1m) or a number of seconds",
        parse: parse_restart_backoff,
    }))
}

pub(super) fn de_require_cuda<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_option(OrNull(StrCheck(parse_require_cuda)))
}

pub(super) fn de_request_id<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_option(OrNull(StrCheck(super::super::parse_request_id)))
}

pub(super) fn de_replicas<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Replicas>, D::Error> {
    d.deserialize_option(OrNull(ReplicasCheck))
}

pub(super) fn de_max_retries<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    d.deserialize_option(OrNull(Range(0, MAX_RETRIES)))
}

pub(super) fn de_stop_grace<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_option(OrNull(Millis {
        expecting: "a duration (90s, 5m) or a number of seconds",
        parse: parse_stop_grace,
    }))
}

pub(super) fn de_hang_timeout<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    d.deserialize_option(OrNull(Millis {
        expecting: "a duration (10m, 1h) or a number of seconds",
        parse: parse_hang_timeout,
    }))
}

/// Written back as a duration (`90s`, `1500ms`), as it is read.
pub(super) fn ser_stop_grace<S: serde::Serializer>(
    ms: &Option<u64>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match ms {
        Some(ms) if ms % 1000 == 0 => s.serialize_str(&format!("{}s", ms / 1000)),
        Some(ms) => s.serialize_str(&format!("{ms}ms")),
        None => s.serialize_none(),
    }
}
