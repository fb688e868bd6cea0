//! Agents: GPUs and their MIG devices, runtimes, registration, MIG
//! layouts asked of a GPU, and masters' addresses.

use std::collections::BTreeMap;

use super::*;
use crate::pb;
use crate::types::*;

/// A layout asked of a GPU: at most 16 MIG devices (NVML's most is 7),
/// each a profile name; none with `disable`.
pub fn check_mig_layout(profiles: &[String], disable: bool) -> Result<()> {
    if disable && !profiles.is_empty() {
        return Err(ConvertError::new(
            "profiles",
            "MIG mode off leaves no MIG devices: name no profile with disable",
        ));
    }
    if profiles.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            "profiles",
            format!(
                "names {} MIG devices, at most {MAX_MIG_DEVICES}",
                profiles.len()
            ),
        ));
    }
    for (i, p) in profiles.iter().enumerate() {
        check_mig_profile(&format!("profiles[{i}]"), p)?;
    }
    Ok(())
}

/// A MIG profile's name as NVML gives it: `[<C>c.]<G>g.<M>gb`, then
/// optional suffixes such as `+me`, `-me`, `+gfx` (`1g.10gb`, `1g.10gb+me`,
/// `1c.3g.40gb`).
pub(super) fn check_mig_profile(field: &str, name: &str) -> Result<()> {
    check_text(field, name, MAX_MIG_PROFILE_LEN, false)?;
    fn number_then<'a>(s: &'a str, unit: &str) -> Option<&'a str> {
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        (digits > 0).then(|| s[digits..].strip_prefix(unit))?
    }
    let core = name.split(['+', '-']).next().unwrap_or("");
    let suffix = &name[core.len()..];
    let body = number_then(core, "c.").unwrap_or(core);
    let ok = number_then(body, "g.")
        .and_then(|m| number_then(m, "gb"))
        .is_some_and(str::is_empty)
        && suffix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'-' || b == b'.');
    if !ok {
        return Err(ConvertError::new(
            field,
            format!(
                "{:?} is not a MIG profile (one like 1g.10gb or 3g.40gb)",
                cut(name, 64)
            ),
        ));
    }
    Ok(())
}

impl TryFrom<pb::Gpu> for GpuInfo {
    type Error = ConvertError;
    fn try_from(g: pb::Gpu) -> Result<Self> {
        gpu_from_pb("gpu", g)
    }
}

/// A GPU as its agent describes it, its fields named under `field`
/// (`gpus[2]` gives `gpus[2].model`).
pub fn gpu_from_pb(field: &str, g: pb::Gpu) -> Result<GpuInfo> {
    if g.uuid.is_empty() {
        return Err(ConvertError::new(
            format!("{field}.uuid"),
            "must not be empty",
        ));
    }
    check_text(&format!("{field}.uuid"), &g.uuid, MAX_GPU_UUID_LEN, false)?;
    check_printable(&format!("{field}.model"), &g.model, true)?;
    check_printable(&format!("{field}.pci_bus_id"), &g.pci_bus_id, true)?;
    check_printable(&format!("{field}.serial"), &g.serial, true)?;
    check_text(
        &format!("{field}.unhealthy_reason"),
        &g.unhealthy_reason,
        MAX_REASON_LEN,
        true,
    )?;
    let compute_capability = if g.compute_capability.is_empty() {
        None
    } else {
        let parsed = g
            .compute_capability
            .split_once('.')
            .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
        Some(parsed.ok_or_else(|| {
            ConvertError::new(
                format!("{field}.compute_capability"),
                format!("{:?} is not MAJOR.MINOR", cut(&g.compute_capability, 64)),
            )
        })?)
    };
    if g.peers.len() > MAX_AGENT_GPUS {
        return Err(ConvertError::new(
            format!("{field}.peers"),
            format!("has {} peers, at most {MAX_AGENT_GPUS}", g.peers.len()),
        ));
    }
    let mut peers = Vec::with_capacity(g.peers.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, p) in g.peers.into_iter().enumerate() {
        let uuid_field = format!("{field}.peers[{i}].uuid");
        if p.uuid.is_empty() {
            return Err(ConvertError::new(uuid_field, "must not be empty"));
        }
        check_text(&uuid_field, &p.uuid, MAX_GPU_UUID_LEN, false)?;
        if p.uuid == g.uuid {
            return Err(ConvertError::new(uuid_field, "a GPU is not its own peer"));
        }
        if !seen.insert(p.uuid.clone()) {
            return Err(ConvertError::new(
                uuid_field,
                format!("{} listed twice", p.uuid),
            ));
        }
        check_text(
            &format!("{field}.peers[{i}].pcie"),
            &p.pcie,
            MAX_PCIE_LEN,
            false,
        )?;
        peers.push(GpuPeer {
            uuid: p.uuid,
            nvlinks: p.nvlinks,
            pcie: p.pcie,
        });
    }
    let mig = match g.mig {
        Some(m) => mig_from_pb(&format!("{field}.mig"), &g.uuid, m)?,
        None => MigInfo::default(),
    };
    Ok(GpuInfo {
        uuid: g.uuid,
        index: g.index,
        minor: g.minor,
        model: g.model,
        memory_mib: g.memory_mib,
        healthy: g.healthy,
        pci_bus_id: g.pci_bus_id,
        serial: g.serial,
        numa_node: g.numa_node,
        compute_capability,
        peers,
        unhealthy_reason: g.unhealthy_reason,
        mig,
    })
}

/// A GPU's MIG state, its fields named under `field`: bounded lists,
/// non-empty distinct device uuids (never the parent's), printable names.
pub(super) fn mig_from_pb(field: &str, parent: &str, m: pb::MigInfo) -> Result<MigInfo> {
    if m.devices.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.devices"),
            format!("has {} devices, at most {MAX_MIG_DEVICES}", m.devices.len()),
        ));
    }
    if m.free.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.free"),
            format!("has {} profiles, at most {MAX_MIG_DEVICES}", m.free.len()),
        ));
    }
    if !m.enabled && !m.devices.is_empty() {
        return Err(ConvertError::new(
            format!("{field}.devices"),
            "MIG devices on a GPU whose MIG mode is off",
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut devices = Vec::with_capacity(m.devices.len());
    for (i, d) in m.devices.into_iter().enumerate() {
        let f = format!("{field}.devices[{i}]");
        if d.uuid.is_empty() {
            return Err(ConvertError::new(format!("{f}.uuid"), "must not be empty"));
        }
        check_text(&format!("{f}.uuid"), &d.uuid, MAX_GPU_UUID_LEN, false)?;
        if d.uuid == parent || !seen.insert(d.uuid.clone()) {
            return Err(ConvertError::new(
                format!("{f}.uuid"),
                format!("{} is not unique on its GPU", d.uuid),
            ));
        }
        check_text(
            &format!("{f}.profile"),
            &d.profile,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        if d.caps_minors.len() > MAX_MIG_CAPS {
            return Err(ConvertError::new(
                format!("{f}.caps_minors"),
                format!("has {} minors, at most {MAX_MIG_CAPS}", d.caps_minors.len()),
            ));
        }
        devices.push(MigDevice {
            uuid: d.uuid,
            profile: d.profile,
            memory_mib: d.memory_mib,
            gpu_slices: d.gpu_slices,
            compute_slices: d.compute_slices,
            gi_id: d.gi_id,
            ci_id: d.ci_id,
            caps_minors: d.caps_minors,
        });
    }
    let mut free = Vec::with_capacity(m.free.len());
    for (i, c) in m.free.into_iter().enumerate() {
        check_text(
            &format!("{field}.free[{i}].profile"),
            &c.profile,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        free.push(MigCapacity {
            profile: c.profile,
            count: c.count,
        });
    }
    if m.profiles.len() > MAX_MIG_DEVICES {
        return Err(ConvertError::new(
            format!("{field}.profiles"),
            format!(
                "has {} profiles, at most {MAX_MIG_DEVICES}",
                m.profiles.len()
            ),
        ));
    }
    let mut profiles = Vec::with_capacity(m.profiles.len());
    for (i, p) in m.profiles.into_iter().enumerate() {
        check_text(
            &format!("{field}.profiles[{i}].name"),
            &p.name,
            MAX_MIG_PROFILE_LEN,
            false,
        )?;
        profiles.push(MigProfile {
            name: p.name,
            gpu_slices: p.gpu_slices,
            memory_mib: p.memory_mib,
            max_count: p.max_count,
        });
    }
    Ok(MigInfo {
        enabled: m.enabled,
        pending: m.pending,
        devices,
        free,
        capable: m.capable || m.enabled || m.pending.is_some(),
        profiles,
    })
}

impl From<MigInfo> for pb::MigInfo {
    fn from(m: MigInfo) -> Self {
        pb::MigInfo {
            enabled: m.enabled,
            pending: m.pending,
            devices: m
                .devices
                .into_iter()
                .map(|d| pb::MigDevice {
                    uuid: d.uuid,
                    profile: d.profile,
                    memory_mib: d.memory_mib,
                    gpu_slices: d.gpu_slices,
                    compute_slices: d.compute_slices,
                    gi_id: d.gi_id,
                    ci_id: d.ci_id,
                    caps_minors: d.caps_minors,
                })
                .collect(),
            free: m
                .free
                .into_iter()
                .map(|c| pb::MigCapacity {
                    profile: c.profile,
                    count: c.count,
                })
                .collect(),
            capable: m.capable,
            profiles: m
                .profiles
                .into_iter()
                .map(|p| pb::MigProfile {
                    name: p.name,
                    gpu_slices: p.gpu_slices,
                    memory_mib: p.memory_mib,
                    max_count: p.max_count,
                })
                .collect(),
        }
    }
}

impl From<GpuInfo> for pb::Gpu {
    fn from(g: GpuInfo) -> Self {
        pb::Gpu {
            uuid: g.uuid,
            index: g.index,
            minor: g.minor,
            model: g.model,
            memory_mib: g.memory_mib,
            healthy: g.healthy,
            pci_bus_id: g.pci_bus_id,
            serial: g.serial,
            numa_node: g.numa_node,
            compute_capability: g
                .compute_capability
                .map(|(a, b)| format!("{a}.{b}"))
                .unwrap_or_default(),
            peers: g
                .peers
                .into_iter()
                .map(|p| pb::GpuPeer {
                    uuid: p.uuid,
                    nvlinks: p.nvlinks,
                    pcie: p.pcie,
                })
                .collect(),
            unhealthy_reason: g.unhealthy_reason,
            mig: (!g.mig.is_off()).then(|| g.mig.into()),
        }
    }
}

pub fn runtime_from_pb(field: &str, v: i32) -> Result<Runtime> {
    match pb::Runtime::try_from(v) {
        Ok(pb::Runtime::Docker) => Ok(Runtime::Docker),
        Ok(pb::Runtime::Process) => Ok(Runtime::Process),
        _ => Err(ConvertError::new(field, format!("unknown runtime {v}"))),
    }
}

impl From<Runtime> for pb::Runtime {
    fn from(r: Runtime) -> Self {
        match r {
            Runtime::Docker => pb::Runtime::Docker,
            Runtime::Process => pb::Runtime::Process,
        }
    }
}

/// The registration of an agent; the agent adds what is not its info
/// (`running_task_ids`, `kill_grace_ms`).
impl From<AgentInfo> for pb::RegisterRequest {
    fn from(a: AgentInfo) -> Self {
        pb::RegisterRequest {
            agent_id: a.id,
            hostname: a.hostname,
            address: a.address,
            total: Some(a.total.into()),
            gpus: a.gpus.into_iter().map(Into::into).collect(),
            runtimes: a
                .runtimes
                .into_iter()
                .map(|r| pb::Runtime::from(r) as i32)
                .collect(),
            simulated_gpus: a.simulated_gpus,
            attributes: a.attributes.into_iter().collect(),
            driver_version: a.driver_version.unwrap_or_default(),
            cuda_driver_version: a.cuda_driver_version.unwrap_or_default(),
            running_task_ids: Vec::new(),
            kill_grace_ms: 0,
            allow_root_tasks: a.allow_root_tasks,
            allowed_mounts: a.allowed_mounts,
            ports: a.ports.map(Into::into),
            share_gpus: a.share_gpus.map(|m| m.to_string()).unwrap_or_default(),
            allowed_users: a.allowed_users.map(|r| r.to_string()).unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::RegisterRequest> for AgentInfo {
    type Error = ConvertError;
    fn try_from(r: pb::RegisterRequest) -> Result<Self> {
        check_id("agent_id", &r.agent_id)?;
        if r.hostname.is_empty() {
            return Err(ConvertError::new("hostname", "must not be empty"));
        }
        check_text("hostname", &r.hostname, MAX_HOSTNAME_LEN, false)?;
        if r.hostname.contains(',') {
            // GPUCTL_PEERS lists hostnames comma separated.
            return Err(ConvertError::new("hostname", "contains ','"));
        }
        check_text("address", &r.address, MAX_ADDRESS_LEN, false)?;
        check_printable("driver_version", &r.driver_version, true)?;
        check_printable("cuda_driver_version", &r.cuda_driver_version, true)?;
        let total = resources_from_pb("total", r.total)?;
        let gpus = agent_gpus_from_pb(r.gpus)?;
        check_device_total(total.gpus, &gpus)?;
        if r.runtimes.len() > MAX_AGENT_RUNTIMES {
            return Err(ConvertError::new(
                "runtimes",
                format!(
                    "has {} entries, at most {MAX_AGENT_RUNTIMES}",
                    r.runtimes.len()
                ),
            ));
        }
        let runtimes = r
            .runtimes
            .iter()
            .map(|v| runtime_from_pb("runtimes", *v))
            .collect::<Result<Vec<_>>>()?;
        check_gpu_peers(&gpus)?;
        let attributes = attributes_from_pb(r.attributes)?;
        check_running_task_ids(&r.running_task_ids)?;
        if r.allowed_mounts.len() > MAX_ALLOWED_MOUNTS {
            return Err(ConvertError::new(
                "allowed_mounts",
                format!(
                    "has {} entries, at most {MAX_ALLOWED_MOUNTS}",
                    r.allowed_mounts.len()
                ),
            ));
        }
        for (i, p) in r.allowed_mounts.iter().enumerate() {
            check_abs_path(&format!("allowed_mounts[{i}]"), p)?;
        }
        let ports = port_range_from_pb(r.ports, total.ports)?;
        let share_gpus = if r.share_gpus.is_empty() {
            None
        } else {
            Some(
                r.share_gpus
                    .parse()
                    .map_err(|e| ConvertError::new("share_gpus", e))?,
            )
        };
        let allowed_users = allowed_users_from_pb(&r.allowed_users)?;
        let opt = |s: String| (!s.is_empty()).then_some(s);
        Ok(AgentInfo {
            allowed_users,
            share_gpus,
            id: r.agent_id,
            hostname: r.hostname,
            address: r.address,
            total,
            gpus,
            runtimes,
            simulated_gpus: r.simulated_gpus,
            attributes,
            driver_version: opt(r.driver_version),
            cuda_driver_version: opt(r.cuda_driver_version),
            allow_root_tasks: r.allow_root_tasks,
            allowed_mounts: r.allowed_mounts,
            ports,
        })
    }
}

/// An agent's GPUs: at most [`MAX_AGENT_GPUS`], each checked, no UUID (of
/// a GPU or a MIG device) listed twice.
fn agent_gpus_from_pb(list: Vec<pb::Gpu>) -> Result<Vec<GpuInfo>> {
    if list.len() > MAX_AGENT_GPUS {
        return Err(ConvertError::new(
            "gpus",
            format!("has {} GPUs, at most {MAX_AGENT_GPUS}", list.len()),
        ));
    }
    let mut gpus = Vec::with_capacity(list.len());
    let mut seen = std::collections::BTreeSet::new();
    for (i, g) in list.into_iter().enumerate() {
        let field = format!("gpus[{i}]");
        let g = gpu_from_pb(&field, g)?;
        if !seen.insert(g.uuid.clone()) {
            return Err(ConvertError::new(
                format!("{field}.uuid"),
                format!("{} listed twice", g.uuid),
            ));
        }
        gpus.push(g);
    }
    let mut mig_seen = std::collections::BTreeSet::new();
    for (i, g) in gpus.iter().enumerate() {
        for (j, d) in g.mig.devices.iter().enumerate() {
            if seen.contains(&d.uuid) || !mig_seen.insert(d.uuid.as_str()) {
                return Err(ConvertError::new(
                    format!("gpus[{i}].mig.devices[{j}].uuid"),
                    format!("{} is listed twice on the agent", d.uuid),
                ));
            }
        }
    }
    Ok(gpus)
}

/// `total.gpus` counts devices: a GPU in MIG mode counts as its MIG
/// devices.
fn check_device_total(total_gpus: u32, gpus: &[GpuInfo]) -> Result<()> {
    // Devices, not GPUs: a GPU in MIG mode counts as its MIG devices.
    let devices = crate::types::device_count(gpus);
    if total_gpus != devices {
        return Err(ConvertError::new(
            "total.gpus",
            format!(
                "is {} but the GPUs listed give {devices} devices (GPUs not in MIG mode and MIG devices)",
                total_gpus
            ),
        ));
    }
    Ok(())
}

/// Each GPU's NVLink peers are GPUs of the same agent.
fn check_gpu_peers(gpus: &[GpuInfo]) -> Result<()> {
    let known: std::collections::BTreeSet<&str> = gpus.iter().map(|g| g.uuid.as_str()).collect();
    for (i, g) in gpus.iter().enumerate() {
        if let Some((j, p)) = g
            .peers
            .iter()
            .enumerate()
            .find(|(_, p)| !known.contains(p.uuid.as_str()))
        {
            return Err(ConvertError::new(
                format!("gpus[{i}].peers[{j}].uuid"),
                format!("{} is not a GPU of this agent", p.uuid),
            ));
        }
    }
    Ok(())
}

/// The agent's attributes: at most [`MAX_AGENT_ATTRIBUTES`], keys and
/// values bounded.
fn attributes_from_pb(
    list: std::collections::HashMap<String, String>,
) -> Result<BTreeMap<String, String>> {
    if list.len() > MAX_AGENT_ATTRIBUTES {
        return Err(ConvertError::new(
            "attributes",
            format!(
                "has {} attributes, at most {MAX_AGENT_ATTRIBUTES}",
                list.len()
            ),
        ));
    }
    let attributes: BTreeMap<String, String> = list.into_iter().collect();
    for (k, v) in &attributes {
        if k.is_empty() || k.len() > MAX_ATTR_LEN {
            return Err(ConvertError::new(
                "attributes",
                format!("key {:?} must be 1..={MAX_ATTR_LEN} bytes", cut(k, 64)),
            ));
        }
        check_text(
            &format!("attributes[{:?}]", cut(k, 64)),
            v,
            MAX_ATTR_VALUE_LEN,
            true,
        )?;
    }
    Ok(attributes)
}

/// The tasks an agent says it runs: at most [`MAX_AGENT_TASKS`] ids of a
/// task id's length.
fn check_running_task_ids(ids: &[String]) -> Result<()> {
    if ids.len() > MAX_AGENT_TASKS {
        return Err(ConvertError::new(
            "running_task_ids",
            format!("has {} ids, at most {MAX_AGENT_TASKS}", ids.len()),
        ));
    }
    // A task id is `job-N.R` or `<framework-id>.<its own id>`.
    if let Some(i) = ids.iter().position(|t| t.len() > 2 * MAX_NAME_LEN + 1) {
        return Err(ConvertError::new(
            format!("running_task_ids[{i}]"),
            format!("longer than {} bytes", 2 * MAX_NAME_LEN + 1),
        ));
    }
    Ok(())
}

/// The users jobs may name on the agent; `None` from an agent that does
/// not say.
fn allowed_users_from_pb(text: &str) -> Result<Option<IdRanges>> {
    Ok(if text.is_empty() {
        None
    } else {
        if text.len() > MAX_ID_RANGES_TEXT {
            return Err(ConvertError::new(
                "allowed_users",
                format!("longer than {MAX_ID_RANGES_TEXT} bytes"),
            ));
        }
        Some(IdRanges::parse(text).map_err(|e| ConvertError::new("allowed_users", e))?)
    })
}

/// Checks a master's `HOST:PORT` (a bracketed IPv6 host is fine).
pub fn check_host_port(field: &str, addr: &str) -> Result<()> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Err(ConvertError::new(
            field,
            format!("{addr:?} is not HOST:PORT"),
        ));
    };
    if host.is_empty() || (host.contains(':') && !(host.starts_with('[') && host.ends_with(']'))) {
        return Err(ConvertError::new(
            field,
            format!("{addr:?} has no valid host"),
        ));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(ConvertError::new(
            field,
            format!("{addr:?} has no valid port"),
        )),
    }
}
