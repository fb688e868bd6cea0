//! A container's configuration from a launch, and the facts it is checked
//! against (the daemon's CDI support, the image's driver requirements, the
//! cgroup driver): pure, no call to the daemon.

use std::collections::HashMap;
use std::path::PathBuf;

use bollard::container::Config;
use bollard::models::{DeviceMapping, DeviceRequest, HostConfig};
use gpuctl_core::cuda_req;

use crate::runtime::{
    HostDriver, LaunchSpec, RuntimeError, LABEL_AGENT_ID, LABEL_JOB_ID, LABEL_TASK_ID,
};

/// What the daemon said of itself that the containers' driver cap needs.
/// Whether a container has a cgroup v2 of its own to cap (a v2 host, or a
/// hybrid one where runc also makes one on the unified hierarchy) is found
/// per container, by its hook.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CapFacts {
    /// The OCI runtimes registered with the daemon (`--add-runtime`).
    pub runtimes: Vec<String>,
}
impl CapFacts {
    /// Whether containers can be created with runtime `name`.
    pub fn check(&self, name: &str) -> Result<(), String> {
        if !self.runtimes.iter().any(|r| r == name) {
            return Err(format!(
                "the Docker daemon has no runtime {name:?} (dockerd --add-runtime {name}=/usr/lib/gpuctl/gpuctl-runc)"
            ));
        }
        Ok(())
    }
}
/// Docker's cgroup driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}
/// The slice task containers go into under the systemd driver, so they can
/// be told apart from other containers and limited together.
pub const SYSTEMD_SLICE: &str = "gpuctl.slice";
/// What the container's configuration takes from its image.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageFacts {
    /// The image's PATH, which the driver volume's bin is put in front of.
    pub path: Option<String>,
    /// The image's LD_LIBRARY_PATH, kept ahead of the volume's (CUDA
    /// images put their forward-compatibility libraries there).
    pub ld_library_path: Option<String>,
    /// `com.nvidia.volumes.needed=nvidia_driver`.
    pub wants_driver_volume: bool,
    /// Its environment (`KEY=value`), where NVIDIA's images say what they
    /// require of the driver (`NVIDIA_REQUIRE_CUDA`...).
    pub env: Vec<String>,
}
/// Whether this host's driver meets what the container requires: the
/// NVIDIA_REQUIRE_* of its environment, the image's overridden by the
/// task's (`env`), as NVIDIA's hook reads the container's (so a job may
/// set NVIDIA_DISABLE_REQUIRE as with `docker run -e`). Requirements that
/// cannot be read cannot be checked: refused, naming the variable
/// (NVIDIA's hook refuses them too).
pub(super) fn check_driver(
    image: &str,
    facts: &ImageFacts,
    env: &std::collections::BTreeMap<String, String>,
    host: &HostDriver,
) -> Result<(), RuntimeError> {
    let task_env: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let requires =
        cuda_req::image_requirements(facts.env.iter().chain(&task_env).map(String::as_str))
            .map_err(|e| RuntimeError::Image {
                image: image.to_string(),
                reason: format!("what it requires of the NVIDIA driver cannot be read: {e}"),
            })?;
    let have = host.facts();
    let unmet: Vec<String> = requires
        .iter()
        .filter(|(_, e)| !e.met_by(&have))
        .map(|(var, e)| format!("{var}={}", e.short()))
        .collect();
    if unmet.is_empty() {
        return Ok(());
    }
    Err(RuntimeError::DriverRequirement {
        image: image.to_string(),
        unmet: unmet.join(" and "),
        host: host.words(),
        requires: requires.iter().map(|(_, e)| e.text().to_string()).collect(),
    })
}
impl From<&bollard::models::ImageInspect> for ImageFacts {
    fn from(info: &bollard::models::ImageInspect) -> Self {
        let config = info.config.as_ref();
        let var = |name: &str| {
            let prefix = format!("{name}=");
            config
                .and_then(|c| c.env.as_ref())
                .and_then(|env| env.iter().find_map(|e| e.strip_prefix(prefix.as_str())))
                .map(str::to_string)
        };
        let (path, ld_library_path) = (var("PATH"), var("LD_LIBRARY_PATH"));
        let wants_driver_volume = config
            .and_then(|c| c.labels.as_ref())
            .and_then(|l| l.get(crate::volume::IMAGE_LABEL))
            .is_some_and(|v| v == "nvidia_driver");
        let env = config.and_then(|c| c.env.as_deref()).unwrap_or_default();
        ImageFacts {
            path,
            ld_library_path,
            wants_driver_volume,
            env: env.to_vec(),
        }
    }
}
/// What a daemon says of its CDI support.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DaemonCdi {
    /// Its API version, e.g. `1.47` (the newest it speaks, whatever the
    /// version gpuctl speaks to it).
    pub api_version: String,
    /// `CDISpecDirs` of `/info`, symlinks resolved: where its CDI registry
    /// reads specs; empty when CDI is off.
    pub spec_dirs: Vec<PathBuf>,
}
/// Docker takes CDI device requests from API 1.44 (Docker 25).
pub const CDI_MIN_API: (u32, u32) = (1, 44);
/// Whether an API version (`1.47`) is at least `min`.
pub fn api_at_least(version: &str, min: (u32, u32)) -> bool {
    let mut parts = version.trim().split('.').map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= min,
        _ => false,
    }
}
/// The CDI device request for these devices (`HostConfig.DeviceRequests`,
/// driver `cdi`), or why the daemon cannot take it: an API before 1.44, CDI
/// not enabled, or a spec in a directory its registry does not read. PURE.
pub fn cdi_device_request(
    daemon: &DaemonCdi,
    devices: &[crate::cdi::CdiDevice],
) -> Result<DeviceRequest, String> {
    if devices.is_empty() {
        return Err("no CDI names for the task's GPUs".into());
    }
    if !api_at_least(&daemon.api_version, CDI_MIN_API) {
        return Err(format!(
            "Docker API {:?} is older than {}.{} (CDI needs Docker 25 or later)",
            daemon.api_version, CDI_MIN_API.0, CDI_MIN_API.1
        ));
    }
    if daemon.spec_dirs.is_empty() {
        return Err(
            "CDI is not enabled in Docker (no CDISpecDirs; the daemon's `cdi` feature)".into(),
        );
    }
    if let Some(d) = devices
        .iter()
        .find(|d| !daemon.spec_dirs.contains(&d.spec_dir))
    {
        return Err(format!(
            "Docker does not read CDI specs from {} ({}); its CDISpecDirs are {:?}",
            d.spec_dir.display(),
            d.name,
            daemon.spec_dirs
        ));
    }
    Ok(DeviceRequest {
        driver: Some("cdi".to_string()),
        device_ids: Some(devices.iter().map(|d| d.name.clone()).collect()),
        ..Default::default()
    })
}
/// A node a CDI device adds: a GPU's `/dev/nvidia<N>` or a MIG device's
/// `/dev/nvidia-caps/nvidia-cap<N>`, as opposed to a control node.
pub(super) fn is_cdi_device_node(container_path: &str) -> bool {
    let numbered = |prefix: &str| {
        container_path
            .strip_prefix(prefix)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    numbered("/dev/nvidia") || numbered("/dev/nvidia-caps/nvidia-cap")
}
pub(super) fn container_config(
    spec: &LaunchSpec,
    image: &str,
    facts: &ImageFacts,
    driver: CgroupDriver,
    cdi: Option<&DeviceRequest>,
) -> Config<String> {
    let res = &spec.task.template.resources;
    let labels = HashMap::from([
        (LABEL_TASK_ID.to_string(), spec.task.task_id.clone()),
        (LABEL_JOB_ID.to_string(), spec.task.job_id.clone()),
        (LABEL_AGENT_ID.to_string(), spec.agent_id.clone()),
    ]);
    let iso = &spec.isolation;
    let volume = iso
        .driver_volume
        .as_ref()
        .filter(|_| iso.gpu_task || facts.wants_driver_volume);
    let host_config = HostConfig {
        network_mode: Some("host".to_string()),
        memory: (res.mem_mib > 0)
            .then(|| i64::try_from(res.mem_mib.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX)),
        nano_cpus: (res.cpus > 0.0).then(|| (res.cpus * 1e9).round() as i64),
        // --shm-size; unset: Docker's 64 MiB.
        shm_size: spec
            .task
            .template
            .options
            .shm_size
            .map(|m| i64::try_from(m.0.saturating_mul(1024 * 1024)).unwrap_or(i64::MAX)),
        // The agent's task_pids_max, whichever cgroup Docker puts it in.
        pids_limit: iso.pids_max.map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
        init: Some(true),
        // The task's GPUs (a MIG device's parent and caps) and the control
        // devices, nothing else: Docker creates these nodes and allows them
        // in the container's cgroup. With CDI the GPUs and MIG devices come
        // from the request; the control nodes are passed here as well, so
        // that one that appeared since the spec was written is there (CDI
        // replaces a node passed twice).
        devices: Some(
            iso.devices
                .iter()
                .filter(|d| cdi.is_none() || !is_cdi_device_node(&d.container_path))
                .map(|d| DeviceMapping {
                    path_on_host: Some(d.host_path.display().to_string()),
                    path_in_container: Some(d.container_path.clone()),
                    cgroup_permissions: Some("rwm".to_string()),
                })
                .collect(),
        ),
        device_requests: cdi.map(|r| vec![r.clone()]),
        // cgroupfs: inside the task's cgroup, whose device rules deny the
        // other GPUs. systemd: gpuctl's slice (it takes only slices).
        cgroup_parent: match driver {
            CgroupDriver::Cgroupfs => iso.cgroup_parent.clone(),
            CgroupDriver::Systemd => Some(SYSTEMD_SLICE.to_string()),
        },
        // The driver volume and the allowed mounts: no other host path.
        binds: Some(
            volume
                .map(|v| crate::volume::docker_bind(v))
                .into_iter()
                .chain(spec.security.mounts.iter().map(|m| m.docker_bind()))
                .collect(),
        ),
        privileged: Some(false),
        cap_drop: Some(vec!["ALL".to_string()]),
        cap_add: Some(
            crate::security::CONTAINER_CAPABILITIES
                .iter()
                .map(|c| c.to_string())
                .collect(),
        ),
        security_opt: Some(vec!["no-new-privileges".to_string()]),
        runtime: iso.oci_runtime.clone(),
        group_add: (!spec.security.groups.is_empty())
            .then(|| spec.security.groups.iter().map(u32::to_string).collect()),
        ..Default::default()
    };
    let mut env = spec.env.clone();
    if volume.is_some() {
        env.extend(crate::volume::container_env_with(
            facts.path.as_deref(),
            facts.ld_library_path.as_deref(),
        ));
    }
    Config {
        image: Some(image.to_string()),
        // Empty: the image's own CMD.
        cmd: (!spec.task.template.command.is_empty()).then(|| spec.task.template.command.clone()),
        // Set explicitly, so the image's own NVIDIA_VISIBLE_DEVICES (often
        // "all") can never widen what the task was given.
        env: Some(env.iter().map(|(k, v)| format!("{k}={v}")).collect()),
        labels: Some(labels),
        // `None`: the image's user, with no more than the capabilities above.
        user: spec.security.user.map(|u| u.to_string()),
        stop_timeout: i64::try_from(spec.kill_grace.as_secs()).ok(),
        host_config: Some(host_config),
        ..Default::default()
    }
}
