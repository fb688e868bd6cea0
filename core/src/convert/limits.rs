//! Every bound on the size of what a client or an agent sends, in one place
//! (documented in docs/cli.md and docs/framework-api.md). A job and a
//! framework's task are checked against the same limits when they enter the
//! cluster (SubmitJob, Accept). They are far above what a real training job
//! needs, and they keep one task's spec, as the master streams it to its
//! agent, well under 1 MiB: at most about 600 KiB, of which the env is
//! 256 KiB plus its 1024 names, the command 64 KiB, and GPUCTL_PEERS of a
//! 4096-task gang (hostnames of at most 64 bytes) 260 KiB. They also stay
//! within what Linux can exec: one env string under MAX_ARG_STRLEN (128 KiB),
//! command and env together far under ARG_MAX (2 MiB by default).

/// Ids and job names: 1 to 128 characters.
pub const MAX_NAME_LEN: usize = 128;
/// Most status updates in one `UpdateStatuses` call.
pub const MAX_STATUS_BATCH: usize = 1024;
/// A container image reference (`registry/name:tag@sha256:...`), bytes.
pub const MAX_IMAGE_LEN: usize = 512;
/// Arguments of a command (argv), the program included.
pub const MAX_COMMAND_ARGS: usize = 1024;
/// Bytes of all arguments of a command together.
pub const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Variables of a job's (or a framework task's) environment.
pub const MAX_ENV_VARS: usize = 1024;
/// Bytes of one environment variable's name.
pub const MAX_ENV_KEY_BYTES: usize = 256;
/// Bytes of one environment variable's value.
pub const MAX_ENV_VALUE_BYTES: usize = 32 * 1024;
/// Bytes of all names and values of an environment together.
pub const MAX_ENV_TOTAL_BYTES: usize = 256 * 1024;
/// CPUs of a task (or an agent).
pub const MAX_CPUS: f64 = 4096.0;
/// Memory of a task (or an agent), in MiB: 2^40 MiB is 1 EiB.
pub const MAX_MEM_MIB: u64 = 1 << 40;
/// GPUs of one task of a job.
pub const MAX_GPUS: u32 = 64;
/// Most host ports one task may ask for.
pub const MAX_TASK_PORTS: u32 = 256;
/// Most tasks in one gang.
pub const MAX_REPLICAS: u32 = 4096;
/// Most replicas of one service.
pub const MAX_SERVICE_REPLICAS: u32 = 1024;
/// Most retries of one job.
pub const MAX_RETRIES: u32 = 1000;
/// Constraints of one job.
pub const MAX_CONSTRAINTS: usize = 64;
/// A GPU model pattern, a constraint's key or value, an agent attribute's
/// key, a GPU's uuid, model, PCI bus id, serial; a driver version. Bytes.
pub const MAX_ATTR_LEN: usize = 256;
/// An agent attribute's value, bytes (GPU feature labels list models).
pub const MAX_ATTR_VALUE_LEN: usize = 1024;
/// Attributes of one agent.
pub const MAX_AGENT_ATTRIBUTES: usize = 256;
/// GPUs of one agent (as many as `--simulate-gpus` allows); each GPU lists
/// each other GPU at most once as a peer.
pub const MAX_AGENT_GPUS: usize = 64;
/// A GPU's UUID, bytes (NVML's are 40).
pub const MAX_GPU_UUID_LEN: usize = 128;
/// A peer's PCIe path (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`), bytes.
pub const MAX_PCIE_LEN: usize = 16;
/// Most MIG devices (and profiles) one GPU may report: an A100 or H100
/// has at most 7 GPU instances; room for future parts.
pub const MAX_MIG_DEVICES: usize = 16;
/// Longest MIG profile name ("1g.10gb+me" is 10).
pub const MAX_MIG_PROFILE_LEN: usize = 32;
/// Most `nvidia-caps` minors one MIG device may name.
pub const MAX_MIG_CAPS: usize = 8;
/// Runtimes an agent lists.
pub const MAX_AGENT_RUNTIMES: usize = 16;
/// Task ids an agent reports running when it registers.
pub const MAX_AGENT_TASKS: usize = 65536;
/// An agent's hostname, bytes: Linux's HOST_NAME_MAX. Every rank of a gang
/// gets all its ranks' hostnames in GPUCTL_PEERS, so this bounds that too.
pub const MAX_HOSTNAME_LEN: usize = 64;
/// An agent's address (`HOST:PORT`), bytes.
pub const MAX_ADDRESS_LEN: usize = 512;
/// A GPU's unhealthy reason, as an agent reports it, bytes.
pub const MAX_REASON_LEN: usize = 4096;
/// Tasks whose memory one GPU reading carries (`task_memory_used_mib`).
pub const MAX_SAMPLE_TASKS: usize = 256;
/// Host mounts of one job's containers.
pub const MAX_MOUNTS: usize = 16;
/// A mount's host or container path, an allowed mount prefix, bytes.
pub const MAX_PATH_LEN: usize = 1024;
/// A job's `security.user` (`UID:GID` is at most 21 bytes), bytes.
pub const MAX_USER_LEN: usize = 32;
/// Mount prefixes an agent allows.
pub const MAX_ALLOWED_MOUNTS: usize = 64;
/// An agent's `allowed_users` as text: at most `IdRanges::MAX_RANGES`
/// ranges of two 10-digit ids each, bytes.
pub const MAX_ID_RANGES_TEXT: usize = 32 * 22;
/// Longest stop grace a job may ask for anywhere, in ms (a day); each
/// master bounds it further (`--max-stop-grace-secs`).
pub const MAX_STOP_GRACE_MS: u64 = 24 * 3600 * 1000;
/// A job's hang timeout: at least a second, at most a week.
pub const MIN_HANG_TIMEOUT_MS: u64 = 1000;
pub const MAX_HANG_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;
/// The restart backoff's default and its doubling's cap are the job's
/// (`types/job.rs`, where `JobSpec::restart_backoff` uses them).
pub use crate::types::{DEFAULT_RESTART_BACKOFF_MS, MAX_RESTART_BACKOFF_MS};
/// The largest /dev/shm a container may ask for (`--shm-size`): 1 TiB.
pub const MAX_SHM_SIZE_MIB: u64 = 1024 * 1024;
/// The longest first restart backoff a job may name.
pub const MAX_FIRST_RESTART_BACKOFF_MS: u64 = 3600 * 1000;
/// Where GPU containers get the driver volume: no job mounts there.
pub const DRIVER_VOLUME_PATH: &str = "/usr/local/nvidia";
