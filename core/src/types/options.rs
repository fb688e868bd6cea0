//! A task's options: each field is at once the domain's (in the Raft log
//! and the agent's state), `gpuctl jobs submit`'s flag (clap, feature
//! `clap`), the job file's key and `jobs get --json`'s field (serde), with
//! one form and one default everywhere. The wire carries them in one
//! message, `TaskOptions` (common.proto), the same in a job's spec and in
//! each task; `convert/options.rs` checks them.
//!
//! A new per-task option is a field here, its field in that message, its
//! check and copy in `convert/options.rs`, and the code that acts on it.
//! (The options older than this struct keep their own fields, flags and
//! keys: `TaskTemplate`, `SubmitArgs`, `JobFile`, for compatibility.)

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Check;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::Args))]
pub struct TaskOptions {
    /// Size of a container's /dev/shm: MiB, or with a unit (8GiB,
    /// 512MiB). Docker's default, 64 MiB, is too small for PyTorch's
    /// DataLoader workers and NCCL. Container jobs only (--image); it
    /// counts against the container's memory as it is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "clap", arg(long, value_name = "SIZE"))]
    pub shm_size: Option<MiB>,
    /// A name for one of the task's host ports (repeat for more): the
    /// first name is its first port's, and so on, and `--ports` is at
    /// least their number. The task gets `GPUCTL_PORT_<NAME>` (upper case,
    /// '-' as '_'); a service's checks and gateway name its ports so.
    /// 1 to 15 of a-z, 0-9 and '-', starting with a letter.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "clap", arg(long = "port", value_name = "NAME"))]
    pub port: Vec<String>,
    /// A readiness check (docs/services.md): until it passes, the task is
    /// running but not ready, and a service's gateway sends it nothing.
    /// `http:PORT[/PATH]`, `tcp:PORT` or `exec:COMMAND`, PORT one of its
    /// `--port` names, with options `start=`, `interval=`, `timeout=`,
    /// `failures=`, `successes=` (e.g. `http:http/healthz interval=2s`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "readiness"
    )]
    #[cfg_attr(feature = "clap", arg(long, value_name = "CHECK"))]
    pub readiness: Option<Check>,
    /// A liveness check, in the same form: once it fails `failures=` times
    /// in a row (after `start=`), its agent stops the task (FAILED, reason
    /// LIVENESS_FAILED), and its job's retries or its service restart it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "liveness"
    )]
    #[cfg_attr(feature = "clap", arg(long, value_name = "CHECK"))]
    pub liveness: Option<Check>,
}

// A check's error names its key: inside a job file's flattened options
// serde would not.
fn readiness<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Check>, D::Error> {
    named_check(d, "readiness")
}

fn liveness<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Check>, D::Error> {
    named_check(d, "liveness")
}

fn named_check<'de, D: Deserializer<'de>>(d: D, key: &str) -> Result<Option<Check>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(text) => text
            .parse()
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("{key}: {e}"))),
    }
}

impl TaskOptions {
    pub fn is_default(&self) -> bool {
        *self == TaskOptions::default()
    }
}

/// A size in MiB, written with the largest unit that divides it (`8GiB`,
/// `512MiB`) and read from that, another unit, or a bare number of MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct MiB(pub u64);

impl fmt::Display for MiB {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const GIB: u64 = 1024;
        const TIB: u64 = 1024 * 1024;
        match self.0 {
            n if n != 0 && n % TIB == 0 => write!(f, "{}TiB", n / TIB),
            n if n != 0 && n % GIB == 0 => write!(f, "{}GiB", n / GIB),
            n => write!(f, "{n}MiB"),
        }
    }
}

impl FromStr for MiB {
    type Err = String;
    fn from_str(s: &str) -> Result<MiB, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (e.g. 10GiB, 512MiB)"))?;
        let mib = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "m" | "mi" | "mib" => Some(n),
            "g" | "gi" | "gib" => n.checked_mul(1024),
            "t" | "ti" | "tib" => n.checked_mul(1024 * 1024),
            _ => return Err(format!("{s:?}: unknown unit (MiB, GiB, TiB)")),
        };
        mib.map(MiB).ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl Serialize for MiB {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for MiB {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<MiB, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Form {
            Number(u64),
            Text(String),
        }
        match Form::deserialize(d)? {
            Form::Number(n) => Ok(MiB(n)),
            Form::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_reads_and_writes_one_form() {
        for (text, mib, shown) in [
            ("512", 512, "512MiB"),
            ("512MiB", 512, "512MiB"),
            ("8g", 8192, "8GiB"),
            ("8GiB", 8192, "8GiB"),
            ("1536MiB", 1536, "1536MiB"),
            ("2TiB", 2 * 1024 * 1024, "2TiB"),
        ] {
            let m: MiB = text.parse().unwrap();
            assert_eq!(m, MiB(mib), "{text}");
            assert_eq!(m.to_string(), shown, "{text}");
        }
        for bad in ["", "lots", "8 parsecs", "-1", "99999999999999999999TiB"] {
            assert!(bad.parse::<MiB>().is_err(), "{bad}");
        }
    }

    #[test]
    fn options_serialize_as_written_and_read_numbers_too() {
        let o = TaskOptions {
            shm_size: Some(MiB(8192)),
            ..Default::default()
        };
        let json = serde_json::to_string(&o).unwrap();
        assert_eq!(json, r#"{"shm_size":"8GiB"}"#);
        assert_eq!(serde_json::from_str::<TaskOptions>(&json).unwrap(), o);
        let n: TaskOptions = serde_json::from_str(r#"{"shm_size":8192}"#).unwrap();
        assert_eq!(n, o);
        // Unset options are absent, so older logs and files read the same.
        assert_eq!(
            serde_json::to_string(&TaskOptions::default()).unwrap(),
            "{}"
        );
        assert!(serde_json::from_str::<TaskOptions>(r#"{"shm_size":"lots"}"#).is_err());
    }
}
