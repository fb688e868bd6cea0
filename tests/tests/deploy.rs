//! Checks of `deploy/`: the systemd units pass `systemd-analyze verify`, and
//! the example config files, as well as the units' command lines, are
//! accepted by the daemons' real option parsers.
//!
//! `systemd-analyze verify` insists that ExecStart's binary exists, so the
//! units are copied to a temporary directory with `/usr/local/bin/` rewritten
//! to the freshly built binaries. Without `systemd-analyze` that test says
//! "skipped", unless `GPUCTL_REQUIRE_DOCKER=1` (CI), where it fails.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

const UNITS: [&str; 2] = ["gpuctl-master.service", "gpuctl-agent.service"];
/// Where the units and the docs install the binaries and the config files.
const INSTALLED_BIN_DIR: &str = "/usr/local/bin/";
const INSTALLED_CONFIG_DIR: &str = "/etc/gpuctl/";

fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the workspace")
}

fn deploy_file(name: &str) -> PathBuf {
    workspace_root().join("deploy").join(name)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn require_tools() -> bool {
    std::env::var("GPUCTL_REQUIRE_DOCKER").is_ok_and(|v| v == "1")
}

/// The directory holding the freshly built daemons.
fn built_binaries() -> &'static Path {
    gpuctl_tests::bin_dir()
}

/// The words of the unit's `ExecStart=` line.
fn exec_start(unit: &str) -> Vec<String> {
    let text = read(&deploy_file(unit));
    let lines: Vec<&str> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("ExecStart="))
        .collect();
    assert_eq!(lines.len(), 1, "{unit}: exactly one ExecStart= line");
    lines[0].split_whitespace().map(String::from).collect()
}

/// `key=value` settings of a unit file (comments and sections left out).
fn unit_setting(unit: &str, key: &str) -> Option<String> {
    read(&deploy_file(unit)).lines().find_map(|l| {
        let (k, v) = l.trim().split_once('=')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let probe = Command::new("systemd-analyze").arg("--version").output();
    if probe.is_err() {
        assert!(
            !require_tools(),
            "systemd-analyze is not installed (apt-get install systemd) and GPUCTL_REQUIRE_DOCKER=1"
        );
        eprintln!("skipped: systemd-analyze is not installed (apt-get install systemd)");
        return;
    }

    let bin_dir = built_binaries();
    let dir = gpuctl_tests::test_dir();
    let mut paths = Vec::new();
    for unit in UNITS {
        let text = read(&deploy_file(unit));
        assert!(
            text.contains(INSTALLED_BIN_DIR),
            "{unit}: ExecStart should run the binary from {INSTALLED_BIN_DIR}"
        );
        let bin = format!("{}/", bin_dir.display());
        let path = dir.path().join(unit);
        std::fs::write(&path, text.replace(INSTALLED_BIN_DIR, &bin)).expect("write unit");
        paths.push(path);
    }

    let out = Command::new("systemd-analyze")
        .arg("verify")
        .args(&paths)
        .output()
        .expect("run systemd-analyze verify");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed ({}):\n{stdout}{stderr}",
        out.status
    );
    // Unknown keys and bad values are only warnings (exit status 0); any
    // message about our units is a failure. Messages about other units (the
    // host's docker.service, say) are not ours to judge.
    let ours: Vec<&str> = stdout
        .lines()
        .chain(stderr.lines())
        .filter(|l| l.contains("gpuctl-"))
        .collect();
    assert!(
        ours.is_empty(),
        "systemd-analyze verify complained:\n{}",
        ours.join("\n")
    );
}

/// The ExecStart= arguments with the installed config path replaced by the
/// example in deploy/, which must be what the unit points at.
fn unit_args_with_example_config(unit: &str, bin: &str, config: &str) -> Vec<String> {
    let args = exec_start(unit);
    assert_eq!(
        args.first().map(String::as_str),
        Some(format!("{INSTALLED_BIN_DIR}{bin}").as_str()),
        "{unit}: ExecStart binary"
    );
    let installed = format!("{INSTALLED_CONFIG_DIR}{config}");
    assert!(
        args.windows(2)
            .any(|w| w[0] == "--config" && w[1] == installed),
        "{unit}: ExecStart should pass --config {installed}: {args:?}"
    );
    let example = deploy_file(config).display().to_string();
    args.into_iter()
        .map(|a| if a == installed { example.clone() } else { a })
        .collect()
}

/// A copy of a TOML example with its optional `#key = value` settings
/// enabled, so that their names and types are checked as well.
fn with_examples_enabled(name: &str, dir: &Path) -> PathBuf {
    let text: String = read(&deploy_file(name))
        .lines()
        .map(|l| match l.strip_prefix('#') {
            Some(rest)
                if rest.split_once(" = ").is_some_and(|(k, _)| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
                }) =>
            {
                rest
            }
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write TOML");
    path
}

#[test]
fn master_example_config_is_accepted_and_shows_the_defaults() {
    use gpuctl_master::config::Options;

    let args =
        unit_args_with_example_config("gpuctl-master.service", "gpuctl-master", "master.toml");
    let file = Options::load_from(&args)
        .unwrap_or_else(|e| panic!("master.toml: {e}"))
        .to_config()
        .unwrap_or_else(|e| panic!("master.toml: {e}"));
    // master.toml says its values are the defaults.
    let default = Options::load_from(["gpuctl-master"])
        .expect("defaults")
        .to_config()
        .expect("defaults");
    // With TLS (tls_dir) the master listens on every interface; without it
    // on loopback only.
    let security = file.security.as_ref().expect("master.toml turns TLS on");
    assert_eq!(security.tls.ca, Path::new("/etc/gpuctl/tls/ca.crt"));
    assert_eq!(file.listen.to_string(), "0.0.0.0:7050");
    assert!(default.security.is_none());
    assert_eq!(default.listen.to_string(), "127.0.0.1:7050");
    assert_eq!(file.data_dir, default.data_dir);
    assert_eq!(file.node_id, default.node_id);
    assert_eq!(file.heartbeat_interval, default.heartbeat_interval);
    assert_eq!(file.agent_timeout, default.agent_timeout);
    assert_eq!(file.agent_fence_timeout, default.agent_fence_timeout);
    assert_eq!(file.agent_lost_timeout, default.agent_lost_timeout);
    assert_eq!(file.retention, default.retention);
    let (f, d) = (&file.frameworks, &default.frameworks);
    assert_eq!(f.offer_timeout, d.offer_timeout);
    assert_eq!(f.allocation_interval, d.allocation_interval);
    assert_eq!(f.update_resend_interval, d.update_resend_interval);
    assert_eq!(f.allocator.gpu_reserve, d.allocator.gpu_reserve);
    assert_eq!(
        unit_setting("gpuctl-master.service", "StateDirectory").as_deref(),
        Some("gpuctl/master"),
        "the unit creates the default data_dir"
    );
    assert_eq!(file.data_dir, Path::new("/var/lib/gpuctl/master"));

    let dir = gpuctl_tests::test_dir();
    let all = with_examples_enabled("master.toml", dir.path());
    Options::load_from([
        OsStr::new("gpuctl-master"),
        OsStr::new("--config"),
        all.as_os_str(),
    ])
    .and_then(|o| o.to_config())
    .unwrap_or_else(|e| panic!("master.toml with the examples enabled: {e}"));
}

#[test]
fn agent_example_config_is_accepted_and_shows_the_defaults() {
    use gpuctl_agent::config::Options;

    let args = unit_args_with_example_config("gpuctl-agent.service", "gpuctl-agent", "agent.toml");
    let file = Options::load_from(&args)
        .unwrap_or_else(|e| panic!("agent.toml: {e}"))
        .to_config()
        .unwrap_or_else(|e| panic!("agent.toml: {e}"));
    // The settings agent.toml leaves enabled are the defaults.
    let default = Options::load_from(["gpuctl-agent"])
        .expect("defaults")
        .to_config()
        .expect("defaults");
    assert_eq!(file.masters, default.masters);
    assert_eq!(file.work_dir, default.work_dir);
    assert!(file.security.is_some(), "agent.toml turns TLS on");
    assert_eq!(file.listen.to_string(), "0.0.0.0:7051");
    assert_eq!(default.listen.to_string(), "127.0.0.1:7051");
    assert_eq!(file.kill_grace, default.kill_grace);
    assert_eq!(file.task_retention, default.task_retention);
    assert_eq!(file.task_user, default.task_user);
    assert_eq!(file.task_users, default.task_users);
    assert_eq!(file.allowed_users, default.allowed_users);
    assert_eq!(file.task_pids_max, default.task_pids_max);
    assert_eq!(file.allow_root_tasks, default.allow_root_tasks);
    assert_eq!(file.allowed_mounts, default.allowed_mounts);
    assert_eq!(file.cdi_dir, default.cdi_dir);
    assert_eq!(
        unit_setting("gpuctl-agent.service", "StateDirectory").as_deref(),
        Some("gpuctl/agent"),
        "the unit creates the default work_dir"
    );
    assert_eq!(file.work_dir, Path::new("/var/lib/gpuctl/agent"));

    let dir = gpuctl_tests::test_dir();
    let all = with_examples_enabled("agent.toml", dir.path());
    let c = Options::load_from([
        OsStr::new("gpuctl-agent"),
        OsStr::new("--config"),
        all.as_os_str(),
    ])
    .and_then(|o| o.to_config())
    .unwrap_or_else(|e| panic!("agent.toml with the examples enabled: {e}"));
    // Make sure the examples were found and enabled.
    assert!(c.advertise.is_some() && c.simulate_gpus.is_some() && c.runtimes.is_some());
    assert!(c.nvml_lib.is_some() && c.cpus.is_some() && c.mem_mib.is_some());
    assert_eq!(c.allowed_mounts, ["/datasets", "/scratch"]);
    assert_eq!(c.cdi_dir, None, "the no_cdi example");
}

/// The agent stops its tasks on SIGTERM, waiting up to kill_grace_secs for
/// each; systemd must not SIGKILL the agent before that.
#[test]
fn agent_kill_grace_fits_in_the_stop_timeout() {
    let table: toml::Table = read(&deploy_file("agent.toml"))
        .parse()
        .expect("agent.toml is TOML");
    let grace = match table.get("kill_grace_secs") {
        Some(toml::Value::Integer(i)) => *i as f64,
        Some(toml::Value::Float(f)) => *f,
        other => panic!("agent.toml: kill_grace_secs should be a number, got {other:?}"),
    };
    let stop: f64 = unit_setting("gpuctl-agent.service", "TimeoutStopSec")
        .expect("gpuctl-agent.service sets TimeoutStopSec")
        .parse()
        .expect("TimeoutStopSec in plain seconds");
    assert!(
        grace + 5.0 <= stop,
        "kill_grace_secs {grace} leaves too little of TimeoutStopSec {stop}"
    );
}
