//! What a task may do on this agent (docs/isolation.md, "What a task may
//! do"): the agent's policy (`task_user`, `allow_root_tasks`,
//! `allowed_mounts`) and what it makes of a task's `security` before a
//! runtime starts it. A task asking for more than the agent allows is
//! refused with a message naming the field or the option.

use std::path::{Path, PathBuf};

use gpuctl_core::types::{path_within, IdRanges, Runtime, TaskSpec, UserIds};

/// Capabilities a container keeps (everything else is dropped, and
/// `no-new-privileges` keeps a setuid program from getting more). Docker's
/// default set minus what matters on a shared GPU host whose containers use
/// the host's network: NET_RAW (forged packets on the host's interfaces),
/// NET_BIND_SERVICE (the host's ports below 1024), MKNOD (device nodes;
/// the cgroup would refuse opening them, but nothing needs them),
/// AUDIT_WRITE (the host's audit log) and SETFCAP (file capabilities).
/// What is kept lets an image's root manage its own files and drop to a
/// user of its own (package managers, `gosu`, `su-exec` entrypoints):
///
/// - CHOWN, DAC_OVERRIDE, FOWNER, FSETID: root's usual say over the
///   container's own files (`pip install`, `apt-get`, `chown` in an
///   entrypoint);
/// - SETUID, SETGID: switching to another user inside the container;
/// - SETPCAP: dropping capabilities from its own bounding set (sandboxing
///   its children);
/// - KILL: signalling its own processes that run as another user;
/// - SYS_CHROOT: `chroot` inside its own filesystem (build tools).
///
/// A container that runs as a non-root `user` has none of them in effect.
pub const CONTAINER_CAPABILITIES: [&str; 9] = [
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "SYS_CHROOT",
];

/// The option that lets a job's host-process tasks run as root.
const ROOT_OPTION: &str = "allow_root_tasks, --allow-root-tasks";
/// The option that lists the host paths a container may mount.
const MOUNTS_OPTION: &str = "allowed_mounts, --allowed-mounts";
/// The option that lists the ids a job may choose.
const USERS_OPTION: &str = "allowed_users, --allowed-users";

/// Default of `task_user`: nobody.
pub const DEFAULT_TASK_USER: UserIds = UserIds {
    uid: 65534,
    gid: 65534,
};

/// A host path a container gets, resolved and allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BindMount {
    /// With symlinks resolved: what was checked is what is mounted.
    pub host_path: PathBuf,
    pub container_path: String,
    pub read_only: bool,
}

impl BindMount {
    /// Docker's `Binds` syntax, `HOST:CONTAINER:ro|rw`.
    pub fn docker_bind(&self) -> String {
        format!(
            "{}:{}:{}",
            self.host_path.display(),
            self.container_path,
            if self.read_only { "ro" } else { "rw" }
        )
    }
}

/// What the policy asks of the host's file systems (faked in tests).
pub trait HostPaths {
    /// The path `p` names, symlinks resolved.
    fn resolve(&self, p: &Path) -> std::io::Result<PathBuf>;
    /// Mount points strictly below `p`.
    fn mounts_below(&self, p: &Path) -> Vec<PathBuf>;
}

/// The agent's own view: `canonicalize` and `/proc/self/mountinfo`.
#[derive(Debug, Clone, Copy)]
pub struct RealHost;

impl HostPaths for RealHost {
    fn resolve(&self, p: &Path) -> std::io::Result<PathBuf> {
        std::fs::canonicalize(p)
    }

    fn mounts_below(&self, p: &Path) -> Vec<PathBuf> {
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        mount_points(&text)
            .into_iter()
            .filter(|m| m != p && m.starts_with(p))
            .collect()
    }
}

/// Paths as a closure resolves them, with nothing mounted below any.
impl<F: Fn(&Path) -> std::io::Result<PathBuf>> HostPaths for F {
    fn resolve(&self, p: &Path) -> std::io::Result<PathBuf> {
        self(p)
    }

    fn mounts_below(&self, _p: &Path) -> Vec<PathBuf> {
        Vec::new()
    }
}

/// The mount points of a `mountinfo` (the fifth field; spaces and other
/// bytes escaped as `\ooo`).
pub fn mount_points(mountinfo: &str) -> Vec<PathBuf> {
    use std::os::unix::ffi::OsStringExt;
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|field| {
            let b = field.as_bytes();
            let mut out = Vec::with_capacity(b.len());
            let mut i = 0;
            while i < b.len() {
                let octal = b.get(i + 1..i + 4).and_then(|d| {
                    std::str::from_utf8(d)
                        .ok()
                        .and_then(|d| u8::from_str_radix(d, 8).ok())
                });
                match (b[i], octal) {
                    (b'\\', Some(c)) => {
                        out.push(c);
                        i += 4;
                    }
                    (c, _) => {
                        out.push(c);
                        i += 1;
                    }
                }
            }
            PathBuf::from(std::ffi::OsString::from_vec(out))
        })
        .collect()
}

/// What a runtime applies to one task, decided by [`TaskPolicy::resolve`].
/// The default (no user, no mounts) runs a host process as the agent's own
/// user and a container as its image's user: what tests of the runtimes
/// themselves use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchSecurity {
    /// A host process switches to this user and group (supplementary
    /// groups dropped) before exec; a container runs as it (Docker's
    /// `User`). `None`: a host process stays the agent's user (root, for a
    /// job allowed to run as root), a container its image's.
    pub user: Option<UserIds>,
    /// The task gets a user of its own from the agent's `task_users`
    /// (leased by the executor, which then sets `user`).
    pub own_user: bool,
    /// A host process runs in PID, mount and IPC namespaces of its own,
    /// with private /tmp, /var/tmp and /dev/shm (`runtime::task_init`).
    pub namespaces: bool,
    /// A container's bind mounts beside the driver volume.
    pub mounts: Vec<BindMount>,
    /// Host paths a host process in namespaces of its own still sees where
    /// they are, below its private directories too (its notice directory,
    /// its checkpoint directory).
    pub keep_visible: Vec<PathBuf>,
    /// Supplementary groups a container gets (Docker's `GroupAdd`): the
    /// group of its own that may write its heartbeat directory.
    pub groups: Vec<u32>,
}

/// The agent's policy for what tasks may do.
#[derive(Debug, Clone)]
pub struct TaskPolicy {
    /// Host-process tasks run as this when their job names no user and
    /// `task_users` is none.
    pub task_user: UserIds,
    /// Host-process tasks whose job names no user each get a uid of their
    /// own from these (none: they run as `task_user`).
    pub task_users: IdRanges,
    /// The uids and gids a job may name.
    pub allowed_users: IdRanges,
    /// Jobs that ask may run host-process tasks as root.
    pub allow_root_tasks: bool,
    /// Host path prefixes a container may mount, as configured (and as
    /// the master is told).
    pub allowed_mounts: Vec<String>,
    /// The same with symlinks resolved, for resolved host paths.
    resolved_mounts: Vec<String>,
    /// The agent's own user and group.
    pub agent_ids: UserIds,
}

impl TaskPolicy {
    /// The policy of an agent running as `agent_ids`. Allowed mounts are
    /// also resolved (a prefix that is a symlink covers where it points);
    /// one that does not exist yet is kept as written.
    pub fn new(
        task_user: UserIds,
        allow_root_tasks: bool,
        allowed_mounts: Vec<String>,
        agent_ids: UserIds,
    ) -> TaskPolicy {
        let resolved_mounts = allowed_mounts
            .iter()
            .map(|p| {
                std::fs::canonicalize(p)
                    .ok()
                    .and_then(|r| r.to_str().map(str::to_string))
                    .unwrap_or_else(|| p.clone())
            })
            .collect();
        TaskPolicy {
            task_user,
            task_users: IdRanges::none(),
            allowed_users: IdRanges::all(),
            allow_root_tasks,
            allowed_mounts,
            resolved_mounts,
            agent_ids,
        }
    }

    /// With users of their own for tasks from `task_users`, and jobs
    /// allowed to name only `allowed_users`.
    pub fn with_users(mut self, task_users: IdRanges, allowed_users: IdRanges) -> TaskPolicy {
        self.task_users = task_users;
        self.allowed_users = allowed_users;
        self
    }

    /// Only root can run a task as another user (or as root).
    pub fn agent_is_root(&self) -> bool {
        self.agent_ids.uid == 0
    }

    /// Whether root tasks run here, as the master is told: the option, on
    /// an agent that can honour it.
    pub fn runs_root_tasks(&self) -> bool {
        self.allow_root_tasks && self.agent_is_root()
    }

    /// One line for the agent's log at start.
    pub fn describe(&self) -> String {
        let users = if self.agent_is_root() {
            let default = if self.task_users.is_empty() {
                self.task_user.to_string()
            } else {
                format!("a user of their own from {}", self.task_users)
            };
            format!(
                "host-process tasks run in namespaces of their own, as {default} unless their job names a user (allowed: {}){}",
                self.allowed_users,
                if self.allow_root_tasks {
                    "; as root when their job asks (allow_root_tasks)"
                } else {
                    ""
                }
            )
        } else {
            format!(
                "the agent does not run as root: host-process tasks run as its own user {} (task_user and allow_root_tasks do not apply)",
                self.agent_ids
            )
        };
        let mounts = if self.allowed_mounts.is_empty() {
            "containers may mount no host path".to_string()
        } else {
            format!(
                "containers may mount under {}",
                self.allowed_mounts.join(", ")
            )
        };
        format!("{users}; {mounts}")
    }

    /// What the runtime applies to `task`, or why the task is refused.
    /// `host` resolves host paths and finds what is mounted below them
    /// ([`RealHost`] outside tests).
    pub fn resolve(&self, task: &TaskSpec, host: &dyn HostPaths) -> Result<LaunchSecurity, String> {
        let sec = &task.template.security;
        if sec.privileged {
            return Err("security.privileged: privileged containers are never allowed".into());
        }
        let user = sec
            .user
            .as_deref()
            .map(|u| {
                u.parse::<UserIds>()
                    .map_err(|e| format!("security.user: {e}"))
            })
            .transpose()?;
        if let Some(u) = user {
            self.check_allowed(u)?;
        }
        let runtime = if task.template.image.is_some() {
            Runtime::Docker
        } else {
            Runtime::Process
        };
        match runtime {
            Runtime::Process => self.resolve_host_process(sec, user),
            Runtime::Docker => self.resolve_container(sec, user, host),
        }
    }

    /// A host process's user and namespaces.
    fn resolve_host_process(
        &self,
        sec: &gpuctl_core::types::TaskSecurity,
        user: Option<UserIds>,
    ) -> Result<LaunchSecurity, String> {
        if !sec.mounts.is_empty() {
            return Err("security.mounts: host-process tasks take no mounts".into());
        }
        if sec.run_as_root {
            if !self.allow_root_tasks {
                return Err(format!(
                    "refused: the job asks to run as root (security.run_as_root) and this agent does not allow root tasks (agent option {ROOT_OPTION})"
                ));
            }
            if !self.agent_is_root() {
                return Err(format!(
                    "refused: the job asks to run as root (security.run_as_root) and this agent does not run as root (uid {})",
                    self.agent_ids.uid
                ));
            }
            if user.is_some() {
                return Err(
                    "security.run_as_root cannot be asked together with security.user".into(),
                );
            }
            return Ok(LaunchSecurity {
                namespaces: true,
                ..Default::default()
            });
        }
        if self.agent_is_root() && user.is_none() && !self.task_users.is_empty() {
            return Ok(LaunchSecurity {
                own_user: true,
                namespaces: true,
                ..Default::default()
            });
        }
        let user = user.unwrap_or(self.task_user);
        if user.is_root() {
            return Err(format!(
                "security.user: {user} is root; a host-process job asks for security.run_as_root instead"
            ));
        }
        if self.agent_is_root() {
            Ok(LaunchSecurity {
                user: Some(user),
                namespaces: true,
                ..Default::default()
            })
        } else if sec.user.is_none() || user == self.agent_ids {
            // A user agent (`gpuctl demo` on a laptop) runs its
            // tasks as itself: it has nothing more to give away.
            Ok(LaunchSecurity::default())
        } else {
            Err(format!(
                "refused: security.user {user}: this agent does not run as root (uid {}), so it cannot run a task as another user",
                self.agent_ids.uid
            ))
        }
    }

    /// A container's user and bind mounts.
    fn resolve_container(
        &self,
        sec: &gpuctl_core::types::TaskSecurity,
        user: Option<UserIds>,
        host: &dyn HostPaths,
    ) -> Result<LaunchSecurity, String> {
        if sec.run_as_root {
            return Err(
                "security.run_as_root: only for host-process jobs (a container runs as its image's user or security.user)"
                    .into(),
            );
        }
        let mut mounts = Vec::with_capacity(sec.mounts.len());
        for (i, m) in sec.mounts.iter().enumerate() {
            mounts.push(self.bind_mount(i, m, host)?);
        }
        Ok(LaunchSecurity {
            user,
            mounts,
            ..Default::default()
        })
    }

    /// Mount `i` of a container, resolved on this host and under an
    /// allowed mount, or why it is refused.
    fn bind_mount(
        &self,
        i: usize,
        m: &gpuctl_core::types::HostMount,
        host: &dyn HostPaths,
    ) -> Result<BindMount, String> {
        let field = format!("security.mounts[{i}].host_path");
        let resolved = host
            .resolve(Path::new(&m.host_path))
            .map_err(|e| format!("{field}: {}: {e}", m.host_path))?;
        let Some(r) = resolved.to_str().filter(|r| !r.contains([':', ','])) else {
            return Err(format!(
                "{field}: {} resolves to {}, which Docker cannot bind-mount (':' or ',')",
                m.host_path,
                resolved.display()
            ));
        };
        if !path_within(&self.resolved_mounts, r) {
            let via = if r == m.host_path {
                String::new()
            } else {
                format!(" (it resolves to {r})")
            };
            let allowed = if self.allowed_mounts.is_empty() {
                "none".to_string()
            } else {
                self.allowed_mounts.join(", ")
            };
            return Err(format!(
                "refused: {field}: {}{via} is not under any allowed mount of this agent ({allowed}; agent option {MOUNTS_OPTION})",
                m.host_path
            ));
        }
        // Docker (before 25, and with the API we speak) makes
        // only the top of a read-only bind read-only: file
        // systems mounted below it would stay writable.
        if m.read_only {
            if let Some(below) = host.mounts_below(&resolved).first() {
                return Err(format!(
                        "refused: {field}: {} has a file system mounted below it ({}), which a read-only mount would leave writable; mount that path itself, or read-write",
                        m.host_path,
                        below.display()
                    ));
            }
        }
        Ok(BindMount {
            host_path: resolved,
            container_path: m.container_path.clone(),
            read_only: m.read_only,
        })
    }

    /// The task's checkpoint directory on this host, if its job names one:
    /// the path with symlinks resolved as far as it exists (what is made
    /// and mounted is what was checked), under one of `allowed_mounts`, as
    /// a container's mounts are; or why it is refused.
    pub fn checkpoint_dir(
        &self,
        task: &TaskSpec,
        host: &dyn HostPaths,
    ) -> Result<Option<PathBuf>, String> {
        const FIELD: &str = "checkpoint_dir";
        let Some(asked) = task.template.checkpoint_dir.as_deref() else {
            return Ok(None);
        };
        // The nearest ancestor that exists, resolved, and the rest as
        // asked (convert refused '..' and '.').
        let mut base = Path::new(asked);
        let mut rest = Vec::new();
        let resolved = loop {
            match host.resolve(base) {
                Ok(r) => break r,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    let (Some(parent), Some(name)) = (base.parent(), base.file_name()) else {
                        return Err(format!("{FIELD}: {asked}: {e}"));
                    };
                    rest.push(name);
                    base = parent;
                }
                Err(e) => return Err(format!("{FIELD}: {asked}: {e}")),
            }
        };
        let full = rest.iter().rev().fold(resolved, |p, n| p.join(n));
        let Some(r) = full.to_str().filter(|r| !r.contains([':', ','])) else {
            return Err(format!(
                "{FIELD}: {asked} resolves to {}, which cannot be bind-mounted (':' or ',')",
                full.display()
            ));
        };
        if !path_within(&self.resolved_mounts, r) {
            let via = if r == asked {
                String::new()
            } else {
                format!(" (it resolves to {r})")
            };
            let allowed = if self.allowed_mounts.is_empty() {
                "none".to_string()
            } else {
                self.allowed_mounts.join(", ")
            };
            return Err(format!(
                "refused: {FIELD}: {asked}{via} is not under any allowed mount of this agent ({allowed}; agent option {MOUNTS_OPTION})"
            ));
        }
        Ok(Some(full))
    }

    /// A user a job names must lie within `allowed_users`, uid and gid
    /// each, whatever the master allowed: a master bug cannot run a task as
    /// a system account or as another task's own user.
    fn check_allowed(&self, u: UserIds) -> Result<(), String> {
        for (kind, id) in [("uid", u.uid), ("gid", u.gid)] {
            if id != 0 && !self.allowed_users.contains(id) {
                let own = if self.task_users.contains(id) {
                    " (it is one of the ids this agent gives tasks of their own)"
                } else {
                    ""
                };
                return Err(format!(
                    "refused: security.user {u}: {kind} {id} is outside the ids this agent lets jobs choose ({}; agent option {USERS_OPTION}){own}",
                    self.allowed_users
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuctl_core::types::{HostMount, TaskSecurity};

    const ROOT: UserIds = UserIds { uid: 0, gid: 0 };

    fn policy(allow_root: bool, mounts: &[&str], agent: UserIds) -> TaskPolicy {
        TaskPolicy::new(
            DEFAULT_TASK_USER,
            allow_root,
            mounts.iter().map(|s| s.to_string()).collect(),
            agent,
        )
    }

    fn task(image: Option<&str>, security: TaskSecurity) -> TaskSpec {
        TaskSpec {
            share: None,
            task_id: "job-1.0".into(),
            job_id: "job-1".into(),
            framework_id: String::new(),
            gpu_uuids: vec![],
            template: gpuctl_core::types::TaskTemplate {
                stop_grace_ms: None,
                checkpoint_dir: None,
                image: image.map(str::to_string),
                command: vec!["true".into()],
                env: Default::default(),
                resources: Default::default(),
                no_fence: false,
                security,
                hang_timeout_ms: None,
                preflight: false,
                options: Default::default(),
            },
        }
    }

    /// Paths as written (no symlinks in these tests).
    fn as_is(p: &Path) -> std::io::Result<PathBuf> {
        Ok(p.to_path_buf())
    }

    fn ids(uid: u32, gid: u32) -> UserIds {
        UserIds { uid, gid }
    }

    #[test]
    fn checkpoint_dirs_resolve_as_far_as_they_exist_and_need_an_allowed_mount() {
        let p = policy(false, &["/ckpt"], ROOT);
        // /ckpt exists (a link to /mnt/ckpt, itself allowed as written);
        // /ckpt/job-1/run below it does not yet.
        let host = |q: &Path| -> std::io::Result<PathBuf> {
            match q.to_str() {
                Some("/ckpt") => Ok(PathBuf::from("/ckpt")),
                Some("/link") => Ok(PathBuf::from("/ckpt/real")),
                Some("/") | Some("/data") => Ok(q.to_path_buf()),
                _ => Err(std::io::ErrorKind::NotFound.into()),
            }
        };
        let mut t = task(None, TaskSecurity::default());
        assert_eq!(p.checkpoint_dir(&t, &host).unwrap(), None, "none asked");
        for runtime in [None, Some("busybox")] {
            t.template.image = runtime.map(str::to_string);
            t.template.checkpoint_dir = Some("/ckpt/job-1/run".into());
            assert_eq!(
                p.checkpoint_dir(&t, &host).unwrap(),
                Some(PathBuf::from("/ckpt/job-1/run"))
            );
            t.template.checkpoint_dir = Some("/link/x".into());
            assert_eq!(
                p.checkpoint_dir(&t, &host).unwrap(),
                Some(PathBuf::from("/ckpt/real/x")),
                "what is made is what was checked"
            );
            t.template.checkpoint_dir = Some("/data/x".into());
            let err = p.checkpoint_dir(&t, &host).unwrap_err();
            assert!(
                err.contains("checkpoint_dir: /data/x is not under any allowed mount"),
                "{err}"
            );
            assert!(err.contains("allowed_mounts"), "{err}");
        }
        let none = policy(false, &[], ROOT);
        let err = none.checkpoint_dir(&t, &host).unwrap_err();
        assert!(err.contains("(none; agent option allowed_mounts"), "{err}");
    }

    #[test]
    fn host_tasks_get_users_of_their_own_and_namespaces() {
        let p = policy(false, &[], ROOT).with_users(
            IdRanges::parse("80000-89999").unwrap(),
            IdRanges::parse("1000-59999").unwrap(),
        );
        let got = p.resolve(&task(None, TaskSecurity::default()), &as_is);
        assert_eq!(
            got.unwrap(),
            LaunchSecurity {
                own_user: true,
                namespaces: true,
                ..Default::default()
            }
        );
        let named = |u: &str, image: Option<&str>| {
            let sec = TaskSecurity {
                user: Some(u.into()),
                ..Default::default()
            };
            p.resolve(&task(image, sec), &as_is)
        };
        let got = named("2001:2002", None).unwrap();
        assert_eq!(
            (got.user, got.own_user, got.namespaces),
            (Some(ids(2001, 2002)), false, true)
        );
        // Defence in depth: what the master should never have let through.
        for (u, image, what) in [
            ("65534:42", None, "uid 65534"),
            ("3000:42", None, "gid 42"),
            ("2001:42", Some("img"), "gid 42"),
            ("999", None, "uid 999"),
            ("80001", None, "uid 80001"),
            ("2001:80001", Some("img"), "gid 80001"),
        ] {
            let err = named(u, image).unwrap_err();
            assert!(
                err.contains(what) && err.contains("allowed_users"),
                "{u}: {err}"
            );
            assert!(err.contains("1000-59999"), "{u}: {err}");
        }
        let err = named("80001", None).unwrap_err();
        assert!(err.contains("gives tasks of their own"), "{err}");
        // Root asked for: namespaces, no user switch.
        let root = TaskSecurity {
            run_as_root: true,
            ..Default::default()
        };
        let mut p = p.clone();
        p.allow_root_tasks = true;
        let got = p.resolve(&task(None, root), &as_is).unwrap();
        assert_eq!(
            (got.user, got.own_user, got.namespaces),
            (None, false, true)
        );
        // Containers keep Docker's namespaces and their image's user.
        let got = p.resolve(&task(Some("img"), TaskSecurity::default()), &as_is);
        assert_eq!(got.unwrap(), LaunchSecurity::default());
        // A user agent has no users to give: its tasks run as itself.
        let me = ids(1000, 1000);
        let user_agent = policy(false, &[], me).with_users(
            IdRanges::parse("80000-89999").unwrap(),
            IdRanges::parse("1000-59999").unwrap(),
        );
        let got = user_agent.resolve(&task(None, TaskSecurity::default()), &as_is);
        assert_eq!(got.unwrap(), LaunchSecurity::default());
    }

    #[test]
    fn host_tasks_run_as_the_task_user_unless_their_job_names_one() {
        let p = policy(false, &[], ROOT);
        let got = p.resolve(&task(None, TaskSecurity::default()), &as_is);
        assert_eq!(got.unwrap().user, Some(DEFAULT_TASK_USER));
        let sec = TaskSecurity {
            user: Some("1234".into()),
            ..Default::default()
        };
        let got = p.resolve(&task(None, sec), &as_is).unwrap();
        assert_eq!(got.user, Some(ids(1234, 1234)));
        // A framework's task (default security) too.
        let mut t = task(None, TaskSecurity::default());
        t.job_id.clear();
        t.framework_id = "fw-1".into();
        assert_eq!(p.resolve(&t, &as_is).unwrap().user, Some(DEFAULT_TASK_USER));
    }

    #[test]
    fn root_host_tasks_need_the_option_and_a_root_agent() {
        let root = TaskSecurity {
            run_as_root: true,
            ..Default::default()
        };
        let err = policy(false, &[], ROOT)
            .resolve(&task(None, root.clone()), &as_is)
            .unwrap_err();
        assert!(err.contains("allow_root_tasks"), "{err}");
        assert!(err.contains("security.run_as_root"), "{err}");
        let ok = policy(true, &[], ROOT)
            .resolve(&task(None, root.clone()), &as_is)
            .unwrap();
        assert_eq!((ok.user, ok.own_user), (None, false), "stays root");
        let err = policy(true, &[], ids(1000, 1000))
            .resolve(&task(None, root), &as_is)
            .unwrap_err();
        assert!(err.contains("does not run as root"), "{err}");
        assert!(!policy(true, &[], ids(1000, 1000)).runs_root_tasks());
        assert!(policy(true, &[], ROOT).runs_root_tasks());
        assert!(!policy(false, &[], ROOT).runs_root_tasks());
        // Root by another name is refused too, whatever the option.
        for user in ["0", "0:0", "1000:0", "0:1000"] {
            let sec = TaskSecurity {
                user: Some(user.into()),
                ..Default::default()
            };
            let err = policy(true, &[], ROOT)
                .resolve(&task(None, sec), &as_is)
                .unwrap_err();
            assert!(err.contains("security.user"), "{user}: {err}");
        }
    }

    #[test]
    fn a_user_agent_runs_tasks_as_itself_only() {
        let me = ids(1000, 1000);
        let p = policy(false, &[], me);
        let got = p.resolve(&task(None, TaskSecurity::default()), &as_is);
        assert_eq!(got.unwrap(), LaunchSecurity::default());
        let named = |u: &str| {
            task(
                None,
                TaskSecurity {
                    user: Some(u.into()),
                    ..Default::default()
                },
            )
        };
        assert_eq!(p.resolve(&named("1000"), &as_is).unwrap().user, None);
        let err = p.resolve(&named("1234"), &as_is).unwrap_err();
        assert!(err.contains("does not run as root"), "{err}");
    }

    #[test]
    fn containers_get_their_user_and_only_allowed_mounts() {
        let p = policy(false, &["/data", "/scratch"], ROOT);
        let mount = |h: &str, c: &str, ro: bool| HostMount {
            host_path: h.into(),
            container_path: c.into(),
            read_only: ro,
        };
        let sec = TaskSecurity {
            user: Some("1234:5".into()),
            mounts: vec![
                mount("/data/sets", "/in", true),
                mount("/scratch", "/out", false),
            ],
            ..Default::default()
        };
        let got = p.resolve(&task(Some("img"), sec), &as_is).unwrap();
        assert_eq!(got.user, Some(ids(1234, 5)));
        let binds: Vec<String> = got.mounts.iter().map(BindMount::docker_bind).collect();
        assert_eq!(binds, ["/data/sets:/in:ro", "/scratch:/out:rw"]);
        // No user: the image's.
        let got = p.resolve(&task(Some("img"), TaskSecurity::default()), &as_is);
        assert_eq!(got.unwrap(), LaunchSecurity::default());

        let refused = |p: &TaskPolicy, host: &str| {
            let sec = TaskSecurity {
                mounts: vec![mount("/data", "/a", true), mount(host, "/b", true)],
                ..Default::default()
            };
            p.resolve(&task(Some("img"), sec), &as_is).unwrap_err()
        };
        let err = refused(&p, "/database");
        assert!(err.contains("security.mounts[1].host_path"), "{err}");
        assert!(err.contains("allowed_mounts"), "{err}");
        assert!(err.contains("/data, /scratch"), "{err}");
        let err = refused(&policy(false, &[], ROOT), "/data");
        assert!(err.contains("security.mounts[0]"), "{err}");
        assert!(err.contains("(none;"), "{err}");
        // A symlink under an allowed prefix that leads out of it.
        let via_link = |path: &Path| {
            Ok(if path == Path::new("/data/link") {
                PathBuf::from("/etc")
            } else {
                path.to_path_buf()
            })
        };
        let sec = TaskSecurity {
            mounts: vec![mount("/data/link", "/b", true)],
            ..Default::default()
        };
        let err = p.resolve(&task(Some("img"), sec), &via_link).unwrap_err();
        assert!(err.contains("resolves to /etc"), "{err}");
        // A path that does not exist is refused, not created by Docker.
        let sec = TaskSecurity {
            mounts: vec![mount("/data/missing", "/b", true)],
            ..Default::default()
        };
        let err = p
            .resolve(&task(Some("img"), sec), &|_: &Path| {
                Err(std::io::Error::from(std::io::ErrorKind::NotFound))
            })
            .unwrap_err();
        assert!(
            err.contains("security.mounts[0].host_path: /data/missing"),
            "{err}"
        );
    }

    /// A read-only mount with a file system mounted below it is refused:
    /// Docker would leave that one writable.
    #[test]
    fn read_only_mounts_with_file_systems_below_are_refused() {
        struct Host;
        impl HostPaths for Host {
            fn resolve(&self, p: &Path) -> std::io::Result<PathBuf> {
                Ok(p.to_path_buf())
            }
            fn mounts_below(&self, p: &Path) -> Vec<PathBuf> {
                let m = PathBuf::from("/data/nfs");
                if m != p && m.starts_with(p) {
                    vec![m]
                } else {
                    Vec::new()
                }
            }
        }
        let p = policy(false, &["/data"], ROOT);
        let ask = |host: &str, read_only: bool| {
            let sec = TaskSecurity {
                mounts: vec![HostMount {
                    host_path: host.into(),
                    container_path: "/in".into(),
                    read_only,
                }],
                ..Default::default()
            };
            p.resolve(&task(Some("img"), sec), &Host)
        };
        let err = ask("/data", true).unwrap_err();
        assert!(err.contains("mounted below it (/data/nfs)"), "{err}");
        assert!(ask("/data", false).is_ok(), "read-write: writable anyway");
        assert!(ask("/data/nfs", true).is_ok(), "the mount itself");
        assert!(ask("/data/sets", true).is_ok());
    }

    #[test]
    fn mountinfo_mount_points_are_unescaped() {
        let text = "36 35 98:0 /mnt1 /mnt/parent rw,noatime master:1 - ext3 /dev/root rw\n\
                    37 36 0:5 / /mnt/with\\040space rw - tmpfs tmpfs rw\n\
                    38 36 0:6 / /a\\134b rw - tmpfs tmpfs rw\n";
        assert_eq!(
            mount_points(text),
            [
                PathBuf::from("/mnt/parent"),
                PathBuf::from("/mnt/with space"),
                PathBuf::from("/a\\b")
            ]
        );
        // This process's own view has at least the root.
        let mine = mount_points(&std::fs::read_to_string("/proc/self/mountinfo").unwrap());
        assert!(mine.contains(&PathBuf::from("/")), "{mine:?}");
        let below = RealHost.mounts_below(Path::new("/"));
        assert!(!below.contains(&PathBuf::from("/")));
    }

    #[test]
    fn privileged_is_never_allowed() {
        let sec = TaskSecurity {
            privileged: true,
            ..Default::default()
        };
        for image in [None, Some("img")] {
            let err = policy(true, &["/"], ROOT)
                .resolve(&task(image, sec.clone()), &as_is)
                .unwrap_err();
            assert!(err.contains("never allowed"), "{err}");
        }
    }
}
