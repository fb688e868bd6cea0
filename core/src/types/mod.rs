//! Domain types. Serializable (the master's replicated log and snapshots carry
//! them), plain data, no I/O.

mod agent;
mod check;
mod framework;
mod gpu;
mod holding;
mod job;
mod lifecycle;
mod options;
mod resources;
mod security;
mod service;
mod status;
mod task;
mod tenant;

pub use agent::*;
pub use check::*;
pub use framework::*;
pub use gpu::*;
pub use holding::*;
pub use job::*;
pub use lifecycle::*;
pub use options::*;
pub use resources::*;
pub use security::*;
pub use service::*;
pub use status::*;
pub use task::*;
pub use tenant::*;

pub type AgentId = String;
pub type JobId = String;
pub type TaskId = String;
pub type GpuUuid = String;
pub type FrameworkId = String;

/// Orders ids as people read them: runs of digits by their value, so
/// `fw-2` < `fw-10`; the rest byte by byte. Ties (`fw-01`, `fw-1`) fall
/// back to the plain byte order, so the order is total.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (x, y) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < x.len() && j < y.len() {
        if x[i].is_ascii_digit() && y[j].is_ascii_digit() {
            let (si, sj) = (i, j);
            while i < x.len() && x[i].is_ascii_digit() {
                i += 1;
            }
            while j < y.len() && y[j].is_ascii_digit() {
                j += 1;
            }
            // Compare values without parsing: strip leading zeros, then
            // the longer run is larger, then digit by digit.
            let strip = |d: &[u8]| {
                let z = d.iter().take_while(|&&c| c == b'0').count();
                d[z..].to_vec()
            };
            let (p, q) = (strip(&x[si..i]), strip(&y[sj..j]));
            let o = p.len().cmp(&q.len()).then_with(|| p.cmp(&q));
            if o != Ordering::Equal {
                return o;
            }
        } else {
            let o = x[i].cmp(&y[j]);
            if o != Ordering::Equal {
                return o;
            }
            i += 1;
            j += 1;
        }
    }
    (x.len() - i).cmp(&(y.len() - j)).then_with(|| a.cmp(b))
}

/// Milliseconds since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ` (UTC). Pure:
/// the state machine writes it into messages.
pub fn utc_timestamp(ms: u64) -> String {
    let secs = ms / 1000;
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day); Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_gpu_in_mig_mode_gives_its_mig_devices_never_itself() {
        use super::*;
        let dev = |uuid: &str, profile: &str| MigDevice {
            uuid: uuid.into(),
            profile: profile.into(),
            memory_mib: 9984,
            gpu_slices: 1,
            compute_slices: 1,
            gi_id: 7,
            ci_id: 0,
            caps_minors: vec![66, 67],
        };
        let mut split = GpuInfo::new("GPU-a", 0, "H100", 81920);
        split.mig.enabled = true;
        split.mig.devices = vec![dev("MIG-1", "1g.10gb"), dev("MIG-2", "2g.20gb")];
        let whole = GpuInfo::new("GPU-b", 1, "H100", 81920);
        // MIG mode off: its listed devices (none should be) are not given.
        let mut off = GpuInfo::new("GPU-c", 2, "H100", 81920);
        off.mig.devices = vec![dev("MIG-3", "1g.10gb")];
        let gpus = vec![split, whole, off];
        let uuids: Vec<&str> = devices(&gpus).map(|d| d.uuid()).collect();
        assert_eq!(uuids, ["MIG-1", "MIG-2", "GPU-b", "GPU-c"]);
        assert_eq!(device_count(&gpus), 4);
        let d = find_device(&gpus, "MIG-2").unwrap();
        assert_eq!(
            (d.gpu().uuid.as_str(), d.mig_profile()),
            ("GPU-a", Some("2g.20gb"))
        );
        assert!(find_device(&gpus, "MIG-3").is_none());
        // As an offer's entry: the parent narrowed to the device.
        let g = d.to_gpu();
        assert_eq!((g.uuid.as_str(), g.index, g.memory_mib), ("MIG-2", 0, 9984));
        assert_eq!(g.mig.devices.len(), 1);
        // An offer's GPUs: the parent with only the offered device.
        let offered = gpus_of_devices(&gpus, &["MIG-1".into(), "GPU-b".into()]);
        let names: Vec<(&str, usize)> = offered
            .iter()
            .map(|g| (g.uuid.as_str(), g.mig.devices.len()))
            .collect();
        assert_eq!(names, [("GPU-a", 1), ("GPU-b", 0)]);
        assert_eq!(offered[0].mig.devices[0].uuid, "MIG-1");
    }

    #[test]
    fn port_ranges_parse_inclusive_and_refuse_nonsense() {
        use super::{PortRange, Resources};
        let r = PortRange::parse("31000-32000").unwrap();
        assert_eq!((r.start, r.end, r.len()), (31000, 32000, 1001));
        assert!(r.contains(31000) && r.contains(32000) && !r.contains(32001));
        assert_eq!(r.to_string(), "31000-32000");
        assert_eq!(PortRange::parse(" 7 - 7 ").unwrap().len(), 1);
        assert_eq!(PortRange::parse("1-65535").unwrap().len(), 65535);
        for bad in ["", "31000", "0-10", "10-5", "1-65536", "a-b", "-5"] {
            assert!(PortRange::parse(bad).is_err(), "{bad:?}");
        }
        // Ports count like the other scalars.
        let free = Resources {
            ports: 2,
            ..Default::default()
        };
        let three = Resources {
            ports: 3,
            ..Default::default()
        };
        assert!(!free.fits(&three));
        assert_eq!(free.add(&three).saturating_sub(&free).ports, 3);
    }

    #[test]
    fn ids_are_ordered_by_their_numbers() {
        use super::natural_cmp;
        let mut ids = vec![
            "fw-10",
            "fw-2",
            "fw-1",
            "gpuctl-jobs",
            "fw-02",
            "fw-1a",
            "fw",
        ];
        ids.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            ids,
            [
                "fw",
                "fw-1",
                "fw-1a",
                "fw-02",
                "fw-2",
                "fw-10",
                "gpuctl-jobs"
            ]
        );
        assert_eq!(
            natural_cmp("a99999999999999999999", "a100000000000000000000"),
            std::cmp::Ordering::Less
        );
    }
    use super::*;

    #[test]
    fn id_ranges_parse_merge_and_show() {
        let r = IdRanges::parse("2000-2999, 1000-1999,5000,3000-3100").unwrap();
        assert_eq!(r.ranges(), &[(1000, 3100), (5000, 5000)]);
        assert_eq!(r.to_string(), "1000-3100,5000");
        assert_eq!(IdRanges::parse(&r.to_string()).unwrap(), r);
        assert_eq!(r.count(), 2102);
        assert!(r.contains(1000) && r.contains(3100) && r.contains(5000));
        assert!(!r.contains(999) && !r.contains(3101) && !r.contains(4999));
        assert!(IdRanges::parse("none").unwrap().is_empty());
        assert!(IdRanges::parse("").unwrap().is_empty());
        assert_eq!(IdRanges::none().to_string(), "none");
        for bad in [
            "0",
            "0-10",
            "5-4294967295",
            "10-5",
            "a",
            "1-",
            "-1",
            "1,,2",
            "1-2-3",
            "99999999999",
        ] {
            assert!(IdRanges::parse(bad).is_err(), "{bad:?}");
        }
        let many = (1..=33).map(|i| (i * 10).to_string()).collect::<Vec<_>>();
        let err = IdRanges::parse(&many.join(",")).unwrap_err();
        assert!(err.contains("at most 32"), "{err}");
        let a = IdRanges::parse("100-200").unwrap();
        assert!(a.overlaps(&IdRanges::parse("200-300").unwrap()));
        assert!(a.overlaps(&IdRanges::parse("1-100").unwrap()));
        assert!(!a.overlaps(&IdRanges::parse("201-300,1-99").unwrap()));
        assert!(!a.overlaps(&IdRanges::none()));
    }

    #[test]
    fn id_ranges_are_walked_round_robin() {
        let r = IdRanges::parse("10-12,20-21").unwrap();
        let from = |n| r.ids_from(n).collect::<Vec<_>>();
        assert_eq!(from(0), [10, 11, 12, 20, 21]);
        assert_eq!(from(11), [11, 12, 20, 21, 10]);
        assert_eq!(from(15), [20, 21, 10, 11, 12]);
        assert_eq!(from(21), [21, 10, 11, 12, 20]);
        assert_eq!(from(99), [10, 11, 12, 20, 21]);
        assert_eq!(IdRanges::none().ids_from(5).count(), 0);
    }

    #[test]
    fn user_ids_parse() {
        assert_eq!(
            "1234".parse(),
            Ok(UserIds {
                uid: 1234,
                gid: 1234
            })
        );
        assert_eq!("1234:5".parse(), Ok(UserIds { uid: 1234, gid: 5 }));
        assert_eq!(
            "65534:65534".parse::<UserIds>().unwrap().to_string(),
            "65534:65534"
        );
        for bad in [
            "",
            ":",
            "1:",
            ":1",
            "a",
            "1:b",
            "-1",
            "+1",
            "1 ",
            "1:2:3",
            "4294967295",
            "99999999999",
        ] {
            assert!(bad.parse::<UserIds>().is_err(), "{bad:?}");
        }
        assert!("0:5".parse::<UserIds>().unwrap().is_root());
        assert!("5:0".parse::<UserIds>().unwrap().is_root());
        assert!(!"5".parse::<UserIds>().unwrap().is_root());
    }

    #[test]
    fn paths_are_within_prefixes_by_whole_components() {
        let allowed = ["/data", "/scratch/"];
        assert!(path_within(&allowed, "/data"));
        assert!(path_within(&allowed, "/data/x/y"));
        assert!(path_within(&allowed, "/scratch"));
        assert!(path_within(&allowed, "/scratch/a"));
        assert!(!path_within(&allowed, "/database"));
        assert!(!path_within(&allowed, "/"));
        assert!(!path_within(&allowed, "/etc"));
        assert!(path_within(&["/"], "/etc/shadow"));
        assert!(!path_within::<&str>(&[], "/data"));
    }

    #[test]
    fn utc_timestamps() {
        assert_eq!(utc_timestamp(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_timestamp(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_timestamp(1_700_000_000_999), "2023-11-14T22:13:20Z");
    }
}
