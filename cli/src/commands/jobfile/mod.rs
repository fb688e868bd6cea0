//! Job files: `gpuctl jobs submit -f job.yaml` and `gpuctl jobs get ID -o yaml`.
//!
//! A job file is YAML whose keys are the `jobs submit` flags' names with
//! `_` for `-` (`--gpu-mem-min` is `gpu_mem_min`), plus `command`. Flags
//! given on the command line override the file (docs/cli.md, "Job files").
//! Unknown keys and values of the wrong type are errors naming the key and
//! its line, as serde_yaml_ng reports them; values are checked by the same
//! rules as the flags' while the file is read, so those errors carry the
//! line too (`values.rs`: the values and their checks).

use std::collections::BTreeMap;

use gpuctl_proto::pb;
use serde::{Deserialize, Serialize};

use super::job_values::{parse_gpu_compute, parse_gpu_mem, parse_mount};
use super::CliError;

mod values;
use values::*;
pub use values::{Kind, Mount, Replicas, Text};

/// What `jobs get -o yaml` prints for a secret env value. Submitting it is
/// refused: the real value must come from the file or `--secret-env`.
pub const SECRET_PLACEHOLDER: &str = "<secret>";

/// The job file's schema. `None` and empty collections mean "not in the
/// file": the flag's value, else the flag's default, is used. The keys of
/// the options added since `TaskOptions` (core/src/types/options.rs) are
/// that struct's own, flattened in; a key neither knows is refused by
/// [`parse`].
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobFile {
    /// `job` (or no key) or `service` (`gpuctl services create -f`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<Kind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<Text>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<Text>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<Text>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_cpus"
    )]
    pub cpus: Option<f64>,
    /// MiB; 0: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<u64>,
    /// Host ports per task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<u32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, Text>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secret_env: BTreeMap<String, Text>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<Text>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_placement"
    )]
    pub placement: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_model: Option<Text>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mem_min: Option<u64>,
    /// `--mig PROFILE`: one MIG device of the profile per task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<Text>,
    /// `--gpu-mem SIZE`: a fraction of one shared GPU per task (`10GiB`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_mem: Option<Text>,
    /// `--gpu-compute PCT` (`25%`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_compute: Option<Text>,
    /// `--constraint KEY=VALUE`, as a map.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub constraint: BTreeMap<String, Text>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_require_cuda"
    )]
    pub require_cuda: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_requeue: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_fence: Option<bool>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_replicas"
    )]
    pub replicas: Option<Replicas>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_max_retries"
    )]
    pub max_retries: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<Text>,
    /// `--mount HOST:CONTAINER[:rw]`, one string per mount.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mount: Vec<Mount>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_root: Option<bool>,
    /// `--stop-grace DURATION` (`90s`, `5m`; a number is seconds), as ms.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_stop_grace",
        serialize_with = "ser_stop_grace"
    )]
    pub stop_grace: Option<u64>,
    /// `--checkpoint-dir PATH`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_dir: Option<Text>,
    /// `--hang-timeout DURATION` (`10m`; a number is seconds), as ms.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_hang_timeout",
        serialize_with = "ser_stop_grace"
    )]
    pub hang_timeout: Option<u64>,
    /// `--restart-policy gang|never`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_restart_policy"
    )]
    pub restart_policy: Option<String>,
    /// `--restart-backoff DURATION`, as ms.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_restart_backoff",
        serialize_with = "ser_stop_grace"
    )]
    pub restart_backoff: Option<u64>,
    /// `--preflight`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preflight: Option<bool>,
    /// `--request-id KEY`: submitting the file again within 24 hours gives
    /// the same job. Never written by `jobs get -o yaml`: a copy of a job
    /// is another job.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_request_id"
    )]
    pub request_id: Option<String>,
    /// Each task's options, under their own keys (`shm_size: 8GiB`).
    #[serde(flatten)]
    pub options: gpuctl_core::types::TaskOptions,
    /// Keys that are neither the fields above nor an option's, refused by
    /// [`parse`] (`deny_unknown_fields` does not work beside `flatten`).
    #[serde(flatten, skip_serializing)]
    pub unknown: BTreeMap<String, serde::de::IgnoredAny>,
}

/// How deep a job file may nest. Its schema needs 2 levels (its keys,
/// then their lists and maps); the YAML reader takes time quadratic in
/// the depth of flow collections.
pub const MAX_DEPTH: usize = 64;

/// Reads a job file's text. `origin` names it in errors (its path, or
/// `stdin`). The message of serde_yaml_ng names the key (with its path,
/// e.g. `env.EPOCHS`) and the line and column. A file nested deeper than
/// [`MAX_DEPTH`] is refused before the YAML reader sees it.
pub fn parse(origin: &str, text: &str) -> Result<JobFile, String> {
    super::yaml_depth::check(text, MAX_DEPTH).map_err(|e| {
        format!("job file {origin}: {e} (a job file needs 2: its keys, then their lists and maps)")
    })?;
    // An empty file (or one of comments only) is an empty job file, not
    // an error: every value then comes from the flags.
    if text
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
    {
        return Ok(JobFile::default());
    }
    let file: JobFile = serde_yaml_ng::from_str(text).map_err(|e| {
        // A file that is not a map at all: say what it should be rather
        // than name our type.
        let msg = e.to_string().replace(
            "struct JobFile",
            "a map of keys (name:, command:, gpus:, ...)",
        );
        format!("job file {origin}: {msg}")
    })?;
    match file.unknown.keys().next() {
        None => Ok(file),
        Some(key) => Err(format!(
            "job file {origin}: unknown field `{key}`{} (keys: the flags of `gpuctl jobs submit` with '_' for '-', see docs/cli.md)",
            line_of_key(text, key)
                .map(|l| format!(" at line {l}"))
                .unwrap_or_default()
        )),
    }
}

/// The line (from 1) where `key` is written at the top level of `text`.
fn line_of_key(text: &str, key: &str) -> Option<usize> {
    text.lines()
        .position(|l| {
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
                || l.strip_prefix(&format!("\"{key}\""))
                    .is_some_and(|rest| rest.trim_start().starts_with(':'))
        })
        .map(|i| i + 1)
}

/// The job file that submits `spec` again, as `jobs get -o yaml` prints it:
/// resources always, the rest when not the default. Secret env values are
/// not known to the API: they are written as [`SECRET_PLACEHOLDER`].
pub fn from_spec(spec: &pb::JobSpec) -> JobFile {
    let some = |s: &str| (!s.is_empty()).then(|| s.to_string());
    let res = spec.resources.unwrap_or_default();
    let placement = spec.placement.clone().unwrap_or_default();
    let security = spec.security.clone().unwrap_or_default();
    let secret = |k: &String| spec.secret_env.contains(k);
    JobFile {
        kind: None,
        name: Some(Text(spec.name.clone())),
        image: some(&spec.image).map(Text),
        command: Some(spec.command.iter().cloned().map(Text).collect()),
        gpus: Some(res.gpus),
        cpus: Some(res.cpus),
        mem: Some(res.mem_mib),
        ports: (res.ports > 0).then_some(res.ports),
        env: spec
            .env
            .iter()
            .filter(|(k, _)| !secret(k))
            .map(|(k, v)| (k.clone(), Text(v.clone())))
            .collect(),
        secret_env: spec
            .secret_env
            .iter()
            .map(|k| (k.clone(), Text(SECRET_PLACEHOLDER.to_string())))
            .collect(),
        tenant: some(&spec.tenant).map(Text),
        placement: some(&placement.policy),
        gpu_model: some(&placement.gpu_model).map(Text),
        gpu_mem_min: (placement.gpu_mem_min_mib > 0).then_some(placement.gpu_mem_min_mib),
        mig: some(&placement.mig).map(Text),
        gpu_mem: (placement.gpu_mem_mib > 0).then(|| gpu_mem_text(placement.gpu_mem_mib)),
        gpu_compute: (placement.gpu_compute_pct > 0)
            .then(|| gpu_compute_text(placement.gpu_compute_pct)),
        constraint: placement
            .constraints
            .iter()
            .map(|(k, v)| (k.clone(), Text(v.clone())))
            .collect(),
        require_cuda: some(&spec.require_cuda),
        priority: (spec.priority != 0).then_some(spec.priority),
        no_requeue: spec.no_requeue.then_some(true),
        no_fence: spec.no_fence.then_some(true),
        // 0 is read as 1 by the master.
        replicas: (spec.replicas > 1).then(|| {
            let min = spec.min_replicas;
            Replicas(
                if min > 0 && min < spec.replicas {
                    min
                } else {
                    spec.replicas
                },
                spec.replicas,
            )
        }),
        max_retries: (spec.max_retries > 0).then_some(spec.max_retries),
        user: some(&security.user).map(Text),
        mount: security.mounts.iter().map(Mount::of).collect(),
        run_as_root: security.run_as_root.then_some(true),
        stop_grace: spec.stop_grace_ms,
        hang_timeout: spec.hang_timeout_ms,
        restart_policy: some(&spec.restart_policy),
        restart_backoff: spec.restart_backoff_ms,
        preflight: spec.preflight.then_some(true),
        checkpoint_dir: some(&spec.checkpoint_dir).map(Text),
        // A copy of a job is another job: resubmitting it must not be
        // answered with the original.
        request_id: None,
        options: gpuctl_core::convert::options_view(spec.options.as_ref()),
        unknown: BTreeMap::new(),
    }
}

impl JobFile {
    /// `over` laid over this file, one key at a time: a key `over` has
    /// wins; maps (`env`, `secret_env`, `constraint`) are merged key by
    /// key, `over`'s value winning; lists (`command`, `mount`) are
    /// replaced. Generic over the keys (through their serde form), so a
    /// new option needs nothing here.
    pub fn overlay(self, over: JobFile) -> Result<JobFile, String> {
        fn merge(base: &mut serde_json::Value, over: serde_json::Value) {
            match (base, over) {
                (serde_json::Value::Object(base), serde_json::Value::Object(over)) => {
                    for (k, v) in over {
                        match base.get_mut(&k) {
                            Some(b) if b.is_object() && v.is_object() => merge(b, v),
                            _ => {
                                base.insert(k, v);
                            }
                        }
                    }
                }
                (base, over) => *base = over,
            }
        }
        let encode = |f: &JobFile| {
            serde_json::to_value(f).map_err(|e| format!("encoding the job's keys: {e}"))
        };
        let mut merged = encode(&self)?;
        merge(&mut merged, encode(&over)?);
        serde_json::from_value(merged).map_err(|e| format!("merging the flags over the file: {e}"))
    }

    /// The spec it submits: the flags' defaults where it has no key, and
    /// the checks that need several keys at once. Then the master's own
    /// conversion, so that a refusal comes before any call.
    pub fn into_spec(self) -> Result<pb::JobSpec, CliError> {
        let usage = |m: String| CliError::Usage(m);
        let name = self
            .name
            .map(|t| t.0)
            .ok_or_else(|| usage("no job name: give --name or `name:` in the job file".into()))?;
        let command = texts(self.command.unwrap_or_default());
        if command.is_empty() {
            return Err(usage(
                "no command: give it after `--` or as `command:` in the job file".into(),
            ));
        }
        let plain = |m: BTreeMap<String, Text>| -> BTreeMap<String, String> {
            m.into_iter().map(|(k, v)| (k, v.0)).collect()
        };
        let env = plain(self.env);
        let secret_env = plain(self.secret_env);
        if let Some((k, _)) = secret_env.iter().find(|(_, v)| *v == SECRET_PLACEHOLDER) {
            return Err(usage(format!(
                "secret_env {k} is {SECRET_PLACEHOLDER:?} (how `jobs get -o yaml` hides a \
                 secret): give its value in the file or with --secret-env {k}=VALUE"
            )));
        }
        let constraints = plain(self.constraint);
        if let Some((k, v)) = constraints
            .iter()
            .find(|(k, v)| k.trim().is_empty() || v.is_empty())
        {
            return Err(usage(format!(
                "constraint {k:?}: {v:?}: key and value must not be empty"
            )));
        }
        let mounts = self
            .mount
            .iter()
            .map(|m| parse_mount(&m.0).map_err(|e| usage(format!("mount: {e}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let placement = placement_of(
            self.placement,
            self.gpu_model,
            self.gpu_mem_min,
            constraints,
            self.mig,
            self.gpu_mem,
            self.gpu_compute,
        )?;
        let gpus = gpus_of(&placement, self.gpus)?;
        let security = pb::TaskSecurity {
            user: self.user.map(|t| t.0).unwrap_or_default(),
            mounts,
            privileged: false,
            run_as_root: self.run_as_root.unwrap_or(false),
        };
        let replicas = self.replicas.map_or((1, 1), |r| (r.0, r.1));
        let spec = pb::JobSpec {
            placement: (placement != pb::Placement::default()).then_some(placement),
            name,
            image: self.image.map(|t| t.0).unwrap_or_default(),
            command,
            env: env
                .iter()
                .chain(&secret_env)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<std::collections::HashMap<_, _>>(),
            resources: Some(pb::Resources {
                cpus: self.cpus.unwrap_or(1.0),
                mem_mib: self.mem.unwrap_or(0),
                gpus,
                ports: self.ports.unwrap_or(0),
            }),
            priority: self.priority.unwrap_or(0),
            replicas: replicas.1,
            min_replicas: if replicas.0 < replicas.1 {
                replicas.0
            } else {
                0
            },
            max_retries: self.max_retries.unwrap_or(0),
            no_requeue: self.no_requeue.unwrap_or(false),
            no_fence: self.no_fence.unwrap_or(false),
            tenant: self.tenant.map(|t| t.0).unwrap_or_default(),
            secret_env: secret_env.into_keys().collect(),
            // `None` when nothing is asked (the defaults).
            security: (security != pb::TaskSecurity::default()).then_some(security),
            require_cuda: self.require_cuda.unwrap_or_default(),
            stop_grace_ms: self.stop_grace,
            hang_timeout_ms: self.hang_timeout,
            restart_policy: self.restart_policy.unwrap_or_default(),
            restart_backoff_ms: self.restart_backoff,
            preflight: self.preflight.unwrap_or(false),
            checkpoint_dir: self.checkpoint_dir.map(|t| t.0).unwrap_or_default(),
            options: gpuctl_core::convert::options_to_pb(self.options),
            // Set by the master for a service's replica only.
            service: String::new(),
        };
        // The master's own check (it converts the spec as sent, first):
        // refused here before any call, with its words and its exit code.
        gpuctl_core::types::JobSpec::try_from(spec.clone())
            .map_err(|e| CliError::Other(e.to_string()))?;
        Ok(spec)
    }
}

/// The placement a job file asks for, its fraction or MIG device checked
/// against each other.
fn placement_of(
    policy: Option<String>,
    gpu_model: Option<Text>,
    gpu_mem_min: Option<u64>,
    constraints: BTreeMap<String, String>,
    mig: Option<Text>,
    gpu_mem: Option<Text>,
    gpu_compute: Option<Text>,
) -> Result<pb::Placement, CliError> {
    let usage = |m: String| CliError::Usage(m);
    let placement = pb::Placement {
        policy: policy.unwrap_or_default(),
        gpu_model: gpu_model.map(|t| t.0).unwrap_or_default(),
        gpu_mem_min_mib: gpu_mem_min.unwrap_or(0),
        constraints: constraints.into_iter().collect(),
        mig: mig.map(|t| t.0).unwrap_or_default(),
        gpu_mem_mib: match &gpu_mem {
            Some(t) => parse_gpu_mem(&t.0).map_err(|e| usage(format!("gpu_mem: {e}")))?,
            None => 0,
        },
        gpu_compute_pct: match &gpu_compute {
            Some(t) => parse_gpu_compute(&t.0).map_err(|e| usage(format!("gpu_compute: {e}")))?,
            None => 0,
        },
    };
    if placement.gpu_compute_pct > 0 && placement.gpu_mem_mib == 0 {
        return Err(usage(
            "--gpu-compute asks a share of a GPU's compute: give its memory too (--gpu-mem)".into(),
        ));
    }
    if placement.gpu_mem_mib > 0 && !placement.mig.is_empty() {
        return Err(usage(
            "a task gets a MIG device (--mig) or a fraction of a shared GPU (--gpu-mem), not both"
                .into(),
        ));
    }
    Ok(placement)
}

/// Each task's GPUs: `gpus`, 1 for a MIG device, none for a fraction.
fn gpus_of(placement: &pb::Placement, gpus: Option<u32>) -> Result<u32, CliError> {
    let usage = |m: String| CliError::Usage(m);
    // A MIG task gets exactly one MIG device: --gpus defaults to it.
    let gpus = match (placement.mig.is_empty(), gpus) {
        // A fraction is a share of one GPU, not a device.
        (true, Some(n)) if placement.gpu_mem_mib > 0 && n != 0 => {
            return Err(usage(format!(
                "--gpu-mem gives each task a fraction of one shared GPU; --gpus {n} asks for whole GPUs (leave --gpus out)"
            )))
        }
        (true, g) => g.unwrap_or(0),
        (false, None | Some(1)) => 1,
        (false, Some(n)) => {
            return Err(usage(format!(
                "--mig {} gives each task one MIG device; --gpus {n} asks for {n} (leave --gpus out)",
                placement.mig
            )))
        }
    };
    Ok(gpus)
}

fn texts(v: Vec<Text>) -> Vec<String> {
    v.into_iter().map(|t| t.0).collect()
}

/// `--gpu-mem`'s value as a job file writes it.
pub fn gpu_mem_text(mib: u64) -> Text {
    Text(format!("{mib}MiB"))
}

/// `--gpu-compute`'s value as a job file writes it.
pub fn gpu_compute_text(pct: u32) -> Text {
    Text(format!("{pct}%"))
}

impl Mount {
    /// A parsed `--mount` as a job file writes it.
    pub fn of(m: &pb::HostMount) -> Mount {
        let rw = if m.read_write { ":rw" } else { "" };
        Mount(format!("{}:{}{rw}", m.host_path, m.container_path))
    }
}

/// `jobs get ID -o yaml`: a comment line naming the job, then its job file.
pub fn to_yaml(job: &pb::Job) -> Result<String, String> {
    let spec = job.spec.clone().unwrap_or_default();
    let file = from_spec(&spec);
    let body = serde_yaml_ng::to_string(&file).map_err(|e| format!("encoding YAML: {e}"))?;
    let mut out = format!(
        "# {} ({}): submit it again with `gpuctl jobs submit -f FILE`\n",
        job.id,
        gpuctl_core::convert::job_state_name(job.state)
    );
    if !spec.secret_env.is_empty() {
        out.push_str(&format!(
            "# secret_env values are not shown: give them in this file or with --secret-env {}=VALUE\n",
            spec.secret_env.first().map_or("K", String::as_str)
        ));
    }
    out.push_str(&body);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_key_names_the_key_and_line() {
        let err = parse("job.yaml", "name: t\ngpus: 2\ngpu: 1\ncommand: [true]\n").unwrap_err();
        assert!(err.contains("job.yaml"), "{err}");
        assert!(err.contains("unknown field `gpu`"), "{err}");
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn an_options_key_reads_in_its_own_form_and_a_bad_value_names_it() {
        let f = parse("j", "command: [x]\nshm_size: 8GiB\n").unwrap();
        assert_eq!(f.options.shm_size, Some(gpuctl_core::types::MiB(8192)));
        let f = parse("j", "command: [x]\nshm_size: 512\n").unwrap();
        assert_eq!(f.options.shm_size, Some(gpuctl_core::types::MiB(512)));
        let err = parse("j", "command: [x]\nshm_size: lots\n").unwrap_err();
        assert!(err.contains("lots"), "{err}");
        // Written back in the same form.
        let yaml = serde_yaml_ng::to_string(&parse("j", "shm_size: 2048\n").unwrap()).unwrap();
        assert_eq!(yaml, "shm_size: 2GiB\n");
        // A check is its text, with a bad one's words.
        let text = "port: [http]\nreadiness: http:http/healthz interval=2s\nliveness: 'timeout=5s exec:test -f /tmp/up'\n";
        let f = parse("j", text).unwrap();
        let c = f.options.readiness.clone().unwrap();
        assert_eq!(c.interval_ms, 2000);
        let yaml = serde_yaml_ng::to_string(&f).unwrap();
        assert_eq!(parse("j", &yaml).unwrap().options, f.options, "{yaml}");
        let err = parse("j", "readiness: gopher:x\n").unwrap_err();
        assert!(
            err.contains("readiness") && err.contains("http:PORT"),
            "{err}"
        );
    }

    #[test]
    fn wrong_types_name_the_field_and_line() {
        let err = parse("j", "name: t\ngpus: two\n").unwrap_err();
        assert!(err.contains("gpus") && err.contains("line 2"), "{err}");
        let err = parse("j", "name: t\nenv:\n  A: 1\n  B: [x]\n").unwrap_err();
        assert!(err.contains("env.B") && err.contains("line 4"), "{err}");
        let err = parse("j", "name: t\n\nreplicas: 0\n").unwrap_err();
        assert!(err.contains("replicas") && err.contains("line 3"), "{err}");
        let err = parse("j", "cpus: -1\n").unwrap_err();
        assert!(err.contains("cpus") && err.contains("line 1"), "{err}");
        let err = parse("j", "placement: pack\n").unwrap_err();
        assert!(err.contains("placement") && err.contains("bundle"), "{err}");
        let err = parse("j", "mount:\n  - /a:/b\n  - /a\n").unwrap_err();
        assert!(err.contains("mount[1]") && err.contains("line 3"), "{err}");
        let err = parse("j", "require_cuda: cudnn>=8\n").unwrap_err();
        assert!(err.contains("require_cuda"), "{err}");
        let err = parse("j", "env: {LR: 1.5}\n").unwrap_err();
        assert!(err.contains("env.LR") && err.contains("quote"), "{err}");
        let err = parse("j", "- a\n- b\n").unwrap_err();
        assert!(err.contains("expected a map of keys"), "{err}");
        // Not YAML at all: the reader's own error, with its line.
        let err = parse("j", "name: x\ngpus: 1\nimage: a: b\n").unwrap_err();
        assert!(err.contains("line 3"), "{err}");
    }

    #[test]
    fn numbers_and_booleans_are_text_where_text_is_expected() {
        let f = parse(
            "j",
            "env: {EPOCHS: 3, DEBUG: true, NAME: x}\ncommand: [sleep, 5]\nuser: 1000\n",
        )
        .unwrap();
        assert_eq!(f.env["EPOCHS"], Text("3".into()));
        assert_eq!(f.env["DEBUG"], Text("true".into()));
        assert_eq!(
            f.command,
            Some(vec![Text("sleep".into()), Text("5".into())])
        );
        assert_eq!(f.user, Some(Text("1000".into())));
        assert_eq!(
            parse("j", "name: 42\n").unwrap().name,
            Some(Text("42".into()))
        );
        // YAML 1.1 would read 1000:1000 as a base-60 number; ours is text.
        let f = parse(
            "j",
            "user: 1000:1000\nconstraint: {nvidia.com/cuda.driver-version.major: 12}\n",
        )
        .unwrap();
        assert_eq!(f.user, Some(Text("1000:1000".into())));
        assert_eq!(
            f.constraint["nvidia.com/cuda.driver-version.major"],
            Text("12".into())
        );
    }

    #[test]
    fn deep_files_are_refused_before_they_are_read() {
        // 30,000 levels took the YAML reader 4 to 8 s (a debug build);
        // refused at once, naming the file and the line.
        let deep = [
            format!(
                "name: x\ncommand: {}{}\n",
                "[".repeat(30_000),
                "]".repeat(30_000)
            ),
            format!(
                "name: x\nenv: {}b{}\n",
                "{a: ".repeat(30_000),
                "}".repeat(30_000)
            ),
            format!("name: x\ncommand:\n{}x\n", "- ".repeat(30_000)),
        ];
        for text in &deep {
            let t = std::time::Instant::now();
            let err = parse("deep.yaml", text).unwrap_err();
            eprintln!("refused in {:?}: {err}", t.elapsed());
            assert!(err.starts_with("job file deep.yaml: line "), "{err}");
            assert!(err.contains("more than 64 levels"), "{err}");
        }
        let indented: String = (1..100).map(|i| format!("{}a:\n", " ".repeat(i))).collect();
        let err = parse("j", &format!("env:\n{indented}")).unwrap_err();
        assert!(err.contains("line 65:"), "{err}");
    }

    #[test]
    fn scripts_with_brackets_are_not_deep() {
        let f = parse(
            "j",
            "name: t\ncommand:\n  - sh\n  - -c\n  - |\n    if [[ -f x ]]; then\n        echo {[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\n    fi\nenv:\n  A: echo [x\n  B: '{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{{'\n",
        )
        .unwrap();
        assert_eq!(f.env["A"], Text("echo [x".into()));
        let command = f.command.unwrap_or_default();
        assert!(command[2].0.contains("echo {[[[["), "{command:?}");
    }

    #[test]
    fn empty_file_is_empty() {
        assert_eq!(parse("j", "").unwrap(), JobFile::default());
        assert_eq!(parse("j", "# nothing\n\n").unwrap(), JobFile::default());
    }

    #[test]
    fn spec_to_yaml_and_back() {
        let spec = pb::JobSpec {
            name: "t".into(),
            image: "busybox".into(),
            command: vec!["sh".into(), "-c".into(), "echo 3 --gpus".into()],
            env: [("A", "1"), ("S", "<secret>"), ("E", "")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            resources: Some(pb::Resources {
                cpus: 0.5,
                mem_mib: 64,
                gpus: 2,
                ports: 0,
            }),
            placement: Some(pb::Placement {
                policy: "spread".into(),
                gpu_model: "A100*".into(),
                gpu_mem_min_mib: 1000,
                constraints: [("k".to_string(), "v*".to_string())].into(),
                mig: String::new(),
                gpu_mem_mib: 0,
                gpu_compute_pct: 0,
            }),
            priority: -3,
            replicas: 2,
            min_replicas: 1,
            restart_policy: "never".into(),
            restart_backoff_ms: Some(2_500),
            preflight: true,
            options: None,
            max_retries: 1,
            no_requeue: true,
            no_fence: true,
            tenant: "nlp".into(),
            secret_env: vec!["S".into()],
            security: Some(pb::TaskSecurity {
                user: "1000:1000".into(),
                mounts: vec![pb::HostMount {
                    host_path: "/d".into(),
                    container_path: "/e".into(),
                    read_write: true,
                }],
                privileged: false,
                run_as_root: false,
            }),
            require_cuda: "cuda>=12.2".into(),
            stop_grace_ms: Some(90_000),
            checkpoint_dir: "/ckpt/t".into(),
            hang_timeout_ms: Some(600_000),
            service: String::new(),
        };
        let job = pb::Job {
            id: "job-1".into(),
            spec: Some(spec.clone()),
            ..Default::default()
        };
        let yaml = to_yaml(&job).unwrap();
        // A copy of a job is another job: never its first submit's key.
        assert!(!yaml.contains("request_id"), "{yaml}");
        for line in [
            "replicas: 1:2\n",
            "restart_policy: never\n",
            "restart_backoff: 2500ms\n",
            "preflight: true\n",
        ] {
            assert!(yaml.contains(line), "{line}: {yaml}");
        }
        assert!(yaml.starts_with("# job-1 "), "{yaml}");
        let back = parse("out", &yaml).unwrap();
        assert_eq!(back, from_spec(&spec));
        assert_eq!(back.secret_env["S"], Text(SECRET_PLACEHOLDER.into()));
        assert!(!back.env.contains_key("S"), "{yaml}");
        assert_eq!(back.env["E"], Text(String::new()));
        assert_eq!(back.mount, vec![Mount("/d:/e:rw".into())]);
        assert!(yaml.contains("stop_grace: 90s\n"), "{yaml}");
        assert_eq!(back.stop_grace, Some(90_000));
        assert_eq!(back.checkpoint_dir, Some(Text("/ckpt/t".into())));
        assert!(yaml.contains("hang_timeout: 600s\n"), "{yaml}");
        assert_eq!(back.hang_timeout, Some(600_000));
    }

    #[test]
    fn hang_timeout_is_a_duration_within_bounds_and_named_when_wrong() {
        let f = parse("f", "command: [x]\nhang_timeout: 10m\n").unwrap();
        assert_eq!(f.hang_timeout, Some(600_000));
        let f = parse("f", "command: [x]\nhang_timeout: 30\n").unwrap();
        assert_eq!(f.hang_timeout, Some(30_000));
        for bad in ["soon", "500ms", "8d"] {
            let e = parse("f", &format!("command: [x]\nhang_timeout: {bad}\n")).unwrap_err();
            assert!(e.contains("hang_timeout"), "{bad}: {e}");
        }
    }

    #[test]
    fn stop_grace_is_a_duration_or_seconds_and_named_when_wrong() {
        let f = parse("f", "command: [x]\nstop_grace: 5m\ncheckpoint_dir: /c\n").unwrap();
        assert_eq!(f.stop_grace, Some(300_000));
        assert_eq!(f.checkpoint_dir, Some(Text("/c".into())));
        let f = parse("f", "command: [x]\nstop_grace: 20\n").unwrap();
        assert_eq!(f.stop_grace, Some(20_000));
        let f = parse("f", "command: [x]\nstop_grace: 1500ms\n").unwrap();
        assert_eq!(f.stop_grace, Some(1_500));
        for bad in ["soon", "2d", "-1s"] {
            let e = parse("f", &format!("command: [x]\nstop_grace: {bad}\n")).unwrap_err();
            assert!(e.contains("stop_grace"), "{bad}: {e}");
        }
    }
}
