//! `gpuctl jobs submit`'s flags: what each means, and the job file they
//! make ([`SubmitArgs::as_file`]), laid over `--file`'s.

use std::collections::BTreeMap;
use std::io;

use clap::Args;
use gpuctl_proto::pb;

use super::job_values::{
    parse_constraint, parse_cpus, parse_env_pair, parse_gpu_compute, parse_gpu_mem,
    parse_hang_timeout, parse_mount, parse_require_cuda, parse_restart_backoff,
    parse_restart_policy, parse_stop_grace,
};
use super::jobfile::{self, JobFile, Text};
use super::CliError;

/// `jobs submit`. Options without a default value here are `Option`s (and
/// booleans are false) when not given, so that a job file's value is used
/// then: flags given on the command line override the file. The defaults
/// are applied in [`SubmitArgs::spec_with`].
#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    /// Read the job from this YAML file ('-': standard input); flags given
    /// here override its values, a command after `--` its command. Keys:
    /// the flags' names with '_' for '-' (docs/cli.md, "Job files").
    #[arg(long, short = 'f', value_name = "FILE")]
    pub file: Option<std::path::PathBuf>,
    /// Job name: letters, digits, '.', '_', '-'.
    #[arg(long, required_unless_present = "file")]
    pub name: Option<String>,
    /// Container image; without it the command runs as a host process.
    #[arg(long)]
    pub image: Option<String>,
    /// Number of GPUs [default: 0].
    #[arg(long, value_name = "N")]
    pub gpus: Option<u32>,
    /// CPUs (fractions allowed) [default: 1].
    #[arg(long, value_name = "C", value_parser = parse_cpus, allow_negative_numbers = true)]
    pub cpus: Option<f64>,
    /// Memory limit in MiB; 0 means no limit [default: 0].
    #[arg(long, value_name = "MIB")]
    pub mem: Option<u64>,
    /// Host ports per task, from the agent's range, in GPUCTL_PORTS (rank
    /// 0's first is MASTER_PORT). A gang gets at least 1 [default: 0].
    #[arg(long, value_name = "N")]
    pub ports: Option<u32>,
    /// Environment variable for the job, repeatable.
    #[arg(long = "env", value_name = "K=V", value_parser = parse_env_pair)]
    pub env: Vec<(String, String)>,
    /// Like --env, but the value is secret: the task gets it, `jobs get`
    /// and every other answer of the API show `<secret>`. Repeatable.
    #[arg(long = "secret-env", value_name = "K=V", value_parser = parse_env_pair)]
    pub secret_env: Vec<(String, String)>,
    /// The tenant to charge the job to (admins only; others are charged
    /// to their token's tenant).
    #[arg(long, value_name = "TENANT")]
    pub tenant: Option<String>,
    /// Placement policy: bundle (fewest agents) or spread; default: the
    /// cluster's (`gpuctl-master --placement`).
    #[arg(long, value_name = "POLICY", value_parser = ["bundle", "spread"])]
    pub placement: Option<String>,
    /// Only GPUs whose model matches this glob, e.g. 'A100*' (case-insensitive).
    #[arg(long, value_name = "PATTERN")]
    pub gpu_model: Option<String>,
    /// Only GPUs with at least this much memory, in MiB [default: 0].
    #[arg(long, value_name = "MIB")]
    pub gpu_mem_min: Option<u64>,
    /// Each task gets one MIG device of this profile (e.g. 1g.10gb, as
    /// `gpuctl gpus` lists them) instead of whole GPUs; --gpus is then 1.
    /// --gpu-model is the parent GPU's, --gpu-mem-min the MIG device's.
    #[arg(long, value_name = "PROFILE")]
    pub mig: Option<String>,
    /// Each task gets this much memory of one GPU an admin marked
    /// shareable (`gpuctl gpus share`) instead of whole GPUs: MiB, or with
    /// a unit (10GiB, 512MiB); --gpus is then 0.
    #[arg(long, value_name = "SIZE", value_parser = parse_gpu_mem)]
    pub gpu_mem: Option<u64>,
    /// With --gpu-mem: this percent of that GPU's compute (25%, or 25).
    #[arg(long, value_name = "PCT", value_parser = parse_gpu_compute)]
    pub gpu_compute: Option<u32>,
    /// Only agents whose attribute KEY matches VALUE (a glob), repeatable,
    /// e.g. nvidia.com/cuda.driver-version.major=12 (see `gpuctl agents describe`).
    #[arg(long = "constraint", value_name = "KEY=VALUE", value_parser = parse_constraint)]
    pub constraints: Vec<(String, String)>,
    /// Only agents whose NVIDIA driver meets this, in the language of
    /// NVIDIA_REQUIRE_CUDA: e.g. 'cuda>=12.2' or 'driver>=535,cuda>=12.2'
    /// (commas: all must hold; spaces: alternatives; keys cuda, driver,
    /// arch, brand). Container images' own NVIDIA_REQUIRE_CUDA is checked
    /// without it.
    #[arg(long, value_name = "EXPR", value_parser = parse_require_cuda)]
    pub require_cuda: Option<String>,
    /// Priority: higher is placed first and may preempt running jobs of
    /// lower priority (negative allowed) [default: 0].
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub priority: Option<i32>,
    /// When preempted (or its agent is drained, or a GPU fails), end FAILED
    /// instead of going back to the queue.
    #[arg(long)]
    pub no_requeue: bool,
    /// Do not fence its tasks: an agent that loses the masters keeps them
    /// running, and the master never declares them LOST by timeout (they
    /// stay UNREACHABLE, holding their GPUs, until their agent comes back).
    #[arg(long)]
    pub no_fence: bool,
    /// Start R tasks of this spec all or nothing (a gang); each gets
    /// GPUCTL_RANK, GPUCTL_WORLD_SIZE and GPUCTL_PEERS [default: 1].
    /// MIN:MAX: an elastic gang, started with as many ranks as fit (at
    /// least MIN) and restarted with more as GPUs free, up to MAX.
    #[arg(long, value_name = "R|MIN:MAX", value_parser = gpuctl_core::convert::parse_replicas)]
    pub replicas: Option<(u32, u32)>,
    /// Run its tasks as this numeric user: UID or UID:GID (UID alone is
    /// UID:UID), within what your token allows (tokens create
    /// --allow-uids/--allow-gids). Default: a container runs as its
    /// image's user, a host process under a user of its own.
    #[arg(long, value_name = "UID[:GID]")]
    pub user: Option<String>,
    /// Bind-mount a host path into the container (image jobs only),
    /// read-only unless `:rw`; repeatable. Only agents whose
    /// allowed_mounts cover HOST take it.
    #[arg(long = "mount", value_name = "HOST:CONTAINER[:rw]", value_parser = parse_mount)]
    pub mounts: Vec<pb::HostMount>,
    /// Run a host-process job's tasks as root. Only agents started with
    /// --allow-root-tasks take it (and the cluster may refuse it).
    #[arg(long)]
    pub run_as_root: bool,
    /// Start a failed job (the whole gang) again, up to N times [default: 0].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(..=i64::from(gpuctl_core::convert::MAX_RETRIES)))]
    pub max_retries: Option<u32>,
    /// Time between SIGTERM and SIGKILL when the cluster stops the job's
    /// tasks (cancel, preemption, drain), e.g. 90s, 5m; at most the
    /// cluster's maximum (gpuctl-master --max-stop-grace-secs, default
    /// 5m). Before SIGTERM the task's $GPUCTL_STOP_NOTICE file says why.
    /// Default: the agent's kill grace.
    #[arg(long, value_name = "DURATION", value_parser = parse_stop_grace)]
    pub stop_grace: Option<u64>,
    /// An absolute host path each attempt of the job gets again, at the
    /// same path ($GPUCTL_CHECKPOINT_DIR; mounted read-write into a
    /// container), made if missing. Only agents whose allowed_mounts cover
    /// it take the job. The data is there on another agent only if the
    /// path is shared storage.
    #[arg(long, value_name = "PATH")]
    pub checkpoint_dir: Option<String>,
    /// Stop a task as hung (FAILED, reason HUNG; --max-retries starts the
    /// gang again) once it has gone this long with no output and no GPU
    /// activity, e.g. 10m, 1h; 1s to 7d. Default: never.
    #[arg(long, value_name = "DURATION", value_parser = parse_hang_timeout)]
    pub hang_timeout: Option<u64>,
    /// What a failed task leads to: gang (the whole gang is stopped and
    /// started again, up to --max-retries, after --restart-backoff) or
    /// never (the job fails; an elastic gang is not restarted to grow
    /// either) [default: gang].
    #[arg(long, value_name = "gang|never", value_parser = parse_restart_policy)]
    pub restart_policy: Option<String>,
    /// The pause before the first restart after a failure, doubling with
    /// each retry up to 5m, e.g. 10s; 0s to 1h [default: 1s].
    #[arg(long, value_name = "DURATION", value_parser = parse_restart_backoff)]
    pub restart_backoff: Option<u64>,
    /// Check each chosen GPU before the tasks start (health, an NVML
    /// probe, pending memory retirement, the agent's --preflight-command):
    /// a GPU that fails is withdrawn with the output and the gang is placed
    /// again, without using a retry.
    #[arg(long)]
    pub preflight: bool,
    /// Idempotency key (letters, digits, '.', '_', '-'): submits with the
    /// same KEY by the same token within 24 hours make one job, and each
    /// prints its id. Without it gpuctl makes one, kept across its own
    /// retries, and names it when the outcome is unknown.
    #[arg(long, value_name = "KEY", value_parser = super::parse_request_id)]
    pub request_id: Option<String>,
    /// Each task's options (`TaskOptions`: one struct is their flags,
    /// their job file keys and their JSON).
    #[command(flatten)]
    pub options: gpuctl_core::types::TaskOptions,
    /// The command and its arguments, after `--` (so that a mistyped
    /// flag is an error, not the job's command); overrides the job file's.
    #[arg(value_name = "CMD", required_unless_present = "file", num_args = 1.., last = true)]
    pub command: Vec<String>,
}

impl SubmitArgs {
    /// The spec from the flags alone (no job file).
    pub fn to_spec(&self) -> Result<pb::JobSpec, CliError> {
        self.spec_with(JobFile::default())
    }

    /// The spec to submit (the job file of `--file`, if any, under the
    /// flags) and its request id (`--request-id`, else the job
    /// file's `request_id`, else none: `submit` makes one).
    pub fn submission(&self) -> Result<(pb::JobSpec, Option<String>), CliError> {
        let Some(path) = &self.file else {
            return Ok((self.to_spec()?, self.request_id.clone()));
        };
        let (origin, file) = read_job_file(path)?;
        if file.kind == Some(jobfile::Kind::Service) {
            return Err(CliError::Usage(format!(
                "job file {origin} is a service (`kind: service`): use `gpuctl services create -f {origin}`"
            )));
        }
        let request_id = self.request_id.clone().or_else(|| file.request_id.clone());
        let spec = self.spec_with(file).map_err(|e| in_file(&origin, e))?;
        Ok((spec, request_id))
    }

    /// The flags over `file` ([`JobFile::overlay`]): a flag given wins;
    /// maps (`env`, `secret_env`, `constraint`) are merged key by key, the
    /// flag's value winning; lists (`mount`, the command) given as flags
    /// replace the file's.
    pub fn spec_with(&self, file: JobFile) -> Result<pb::JobSpec, CliError> {
        file.overlay(self.as_file())
            .map_err(CliError::Usage)?
            .into_spec()
    }

    /// The flags given, as job-file keys (nothing for a flag left out).
    pub fn as_file(&self) -> JobFile {
        let pairs = |v: &[(String, String)]| -> BTreeMap<String, Text> {
            v.iter()
                .map(|(k, v)| (k.clone(), Text(v.clone())))
                .collect()
        };
        let text = |v: &Option<String>| v.clone().map(Text);
        JobFile {
            kind: None,
            name: text(&self.name),
            image: text(&self.image),
            command: (!self.command.is_empty())
                .then(|| self.command.iter().cloned().map(Text).collect()),
            gpus: self.gpus,
            cpus: self.cpus,
            mem: self.mem,
            ports: self.ports,
            env: pairs(&self.env),
            secret_env: pairs(&self.secret_env),
            tenant: text(&self.tenant),
            placement: self.placement.clone(),
            gpu_model: text(&self.gpu_model),
            gpu_mem_min: self.gpu_mem_min,
            mig: text(&self.mig),
            gpu_mem: self.gpu_mem.map(jobfile::gpu_mem_text),
            gpu_compute: self.gpu_compute.map(jobfile::gpu_compute_text),
            constraint: pairs(&self.constraints),
            require_cuda: self.require_cuda.clone(),
            priority: self.priority,
            no_requeue: self.no_requeue.then_some(true),
            no_fence: self.no_fence.then_some(true),
            replicas: self.replicas.map(|(min, max)| jobfile::Replicas(min, max)),
            max_retries: self.max_retries,
            user: text(&self.user),
            mount: self.mounts.iter().map(jobfile::Mount::of).collect(),
            run_as_root: self.run_as_root.then_some(true),
            stop_grace: self.stop_grace,
            checkpoint_dir: text(&self.checkpoint_dir),
            hang_timeout: self.hang_timeout,
            restart_policy: self.restart_policy.clone(),
            restart_backoff: self.restart_backoff,
            preflight: self.preflight.then_some(true),
            request_id: self.request_id.clone(),
            options: self.options.clone(),
            unknown: BTreeMap::new(),
        }
    }
}

/// Reads the job file `--file` names ('-': standard input): where it came
/// from, for errors (its path, or `stdin`), and its keys. Errors are usage
/// errors naming the file.
pub fn read_job_file(path: &std::path::Path) -> Result<(String, JobFile), CliError> {
    let (origin, text) = if path.as_os_str() == "-" {
        let mut text = String::new();
        io::Read::read_to_string(&mut io::stdin(), &mut text)
            .map_err(|e| CliError::Usage(format!("cannot read the job file from stdin: {e}")))?;
        ("stdin".to_string(), text)
    } else {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::Usage(format!("cannot read job file {origin}: {e}")))?;
        (origin, text)
    };
    let file = jobfile::parse(&origin, &text).map_err(CliError::Usage)?;
    Ok((origin, file))
}

/// A usage error about a job file's contents, naming the file.
pub fn in_file(origin: &str, e: CliError) -> CliError {
    match e {
        CliError::Usage(m) => CliError::Usage(format!("job file {origin}: {m}")),
        other => other,
    }
}
