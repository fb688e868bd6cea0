//! `--simulate-gpus`: `COUNTxMODEL[:MEMORY]`, several groups separated by
//! commas, e.g. `4xA100-SXM4-40GB` or `2xV100-SXM2-16GB,2xT4:16GiB`.
//! Memory is taken from the spec, else from a `<N>GB` suffix of the model,
//! else from a table of common models.

use gpuctl_core::types::GpuInfo;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimSpec {
    pub count: u32,
    pub model: String,
    pub memory_mib: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid --simulate-gpus {spec:?}: {reason}")]
pub struct SimulateError {
    pub spec: String,
    pub reason: String,
}

const KNOWN_MEMORY_GIB: &[(&str, u64)] = &[
    ("H200", 141),
    ("H100", 80),
    ("A100", 40),
    ("A10", 24),
    ("L40", 48),
    ("L4", 24),
    ("V100", 16),
    ("T4", 16),
    ("P100", 16),
];

const MAX_SIMULATED: u32 = 64;

fn parse_memory(s: &str) -> Option<u64> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("GiB").or_else(|| s.strip_suffix("GB")) {
        (n, 1024)
    } else if let Some(n) = s.strip_suffix("MiB").or_else(|| s.strip_suffix("MB")) {
        (n, 1)
    } else {
        (s, 1) // plain MiB
    };
    num.trim()
        .parse::<u64>()
        .ok()
        .filter(|v| *v > 0)
        .map(|v| v * mult)
}

fn implied_memory(model: &str) -> Option<u64> {
    // "A100-SXM4-40GB" -> 40 GiB
    if let Some(last) = model.rsplit(['-', '_', ' ']).next() {
        if let Some(n) = last.strip_suffix("GB") {
            if let Ok(v) = n.parse::<u64>() {
                return Some(v * 1024);
            }
        }
    }
    let upper = model.to_ascii_uppercase();
    KNOWN_MEMORY_GIB
        .iter()
        .find(|(m, _)| upper.split(['-', ' ', '_']).any(|part| part == *m))
        .map(|(_, g)| g * 1024)
}

pub fn parse_spec(spec: &str) -> Result<Vec<SimSpec>, SimulateError> {
    let err = |reason: String| SimulateError {
        spec: spec.to_string(),
        reason,
    };
    let mut out = Vec::new();
    let mut total = 0u32;
    for group in spec.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let (count, rest) = group
            .split_once(['x', 'X'])
            .ok_or_else(|| err(format!("{group:?} is not COUNTxMODEL[:MEMORY]")))?;
        let count: u32 = count
            .trim()
            .parse()
            .map_err(|_| err(format!("count {count:?} is not a number")))?;
        let (model, memory) = match rest.split_once(':') {
            Some((m, mem)) => (
                m.trim(),
                Some(parse_memory(mem).ok_or_else(|| {
                    err(format!(
                        "memory {mem:?} is not like 40GiB, 16GB or 16384 (MiB)"
                    ))
                })?),
            ),
            None => (rest.trim(), None),
        };
        if model.is_empty() || model.contains(|c: char| c.is_control()) {
            return Err(err(format!("model in {group:?} is empty or invalid")));
        }
        let memory_mib = memory.or_else(|| implied_memory(model)).ok_or_else(|| {
            err(format!(
                "memory of {model} is unknown; give it as {count}x{model}:<MEMORY>, e.g. :16GiB"
            ))
        })?;
        total = total.saturating_add(count);
        out.push(SimSpec {
            count,
            model: model.to_string(),
            memory_mib,
        });
    }
    if out.is_empty() {
        return Err(err("no GPUs given".into()));
    }
    if total == 0 || total > MAX_SIMULATED {
        return Err(err(format!("total count must be 1..={MAX_SIMULATED}")));
    }
    Ok(out)
}

/// FNV-1a then a splitmix64 finaliser: stable, well-spread simulated UUIDs
/// without a hashing dependency.
fn fnv(data: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in data {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The simulated GPUs of agent `agent_id`. UUIDs are stable for an agent id
/// and distinct between agents, so several simulated agents on one host
/// never claim the same GPU.
pub fn simulated_gpus(specs: &[SimSpec], agent_id: &str) -> Vec<GpuInfo> {
    let mut out = Vec::new();
    let mut index = 0u32;
    for s in specs {
        for _ in 0..s.count {
            let key = format!("{agent_id}/{index}");
            let u = uuid::Uuid::from_u64_pair(fnv(key.as_bytes(), 1), fnv(key.as_bytes(), 2));
            let model = if s.model.starts_with("NVIDIA") || s.model.starts_with("Tesla") {
                s.model.clone()
            } else {
                format!("NVIDIA {}", s.model)
            };
            let mut g = GpuInfo::new(format!("GPU-{u}"), index, model, s.memory_mib);
            g.pci_bus_id = format!("00000000:{:02X}:00.0", 0x10 + index);
            out.push(g);
            index += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_count_model_and_implied_memory() {
        let s = parse_spec("4xA100-SXM4-40GB").unwrap();
        assert_eq!(
            s,
            vec![SimSpec {
                count: 4,
                model: "A100-SXM4-40GB".into(),
                memory_mib: 40 * 1024
            }]
        );
        let s = parse_spec("2xV100-SXM2-16GB, 2xT4").unwrap();
        assert_eq!(s[1].memory_mib, 16 * 1024);
        assert_eq!(parse_spec("1xH100").unwrap()[0].memory_mib, 80 * 1024);
        assert_eq!(parse_spec("1xFoo:512").unwrap()[0].memory_mib, 512);
        assert_eq!(parse_spec("1xFoo:2GiB").unwrap()[0].memory_mib, 2048);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (spec, needle) in [
            ("", "no GPUs"),
            ("A100", "COUNTxMODEL"),
            ("fourxA100", "not a number"),
            ("2xMystery", "unknown"),
            ("2xA100:lots", "memory"),
            ("0xA100", "1..="),
            ("100xA100", "1..="),
        ] {
            let e = parse_spec(spec).unwrap_err().to_string();
            assert!(e.contains(needle), "{spec}: {e}");
        }
    }

    #[test]
    fn uuids_are_stable_per_agent_and_distinct_between_agents() {
        let s = parse_spec("2xT4").unwrap();
        let a = simulated_gpus(&s, "agent-a");
        assert_eq!(a, simulated_gpus(&s, "agent-a"));
        let b = simulated_gpus(&s, "agent-b");
        assert_ne!(a[0].uuid, b[0].uuid);
        assert_ne!(a[0].uuid, a[1].uuid);
        assert!(a[0].uuid.starts_with("GPU-"));
        assert_eq!(a[1].index, 1);
        assert_eq!(a[0].model, "NVIDIA T4");
    }
}
