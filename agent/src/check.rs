//! `gpuctl-agent check [--json] [--no-docker] [--busybox-image]`: what this
//! host offers an agent (GPUs through NVML, the driver, Docker), found by
//! the agent's own discovery code, without starting an agent. Operators use
//! it to see a node before they enable the service; `gpuctl demo` reads its
//! JSON ([`HostCheck`]) to choose real or simulated GPUs and a runtime.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use gpuctl_core::host::{DockerCheck, HostCheck, HostGpu};

use crate::runtime::{image, DockerRuntime};

const DOCKER_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);
const IMAGE_TIMEOUT: Duration = Duration::from_secs(180);

#[derive(Debug, Parser)]
#[command(
    name = "gpuctl-agent check",
    about = "What this host offers an agent: GPUs (NVML), driver, Docker"
)]
struct CheckArgs {
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// Do not look for Docker.
    #[arg(long)]
    no_docker: bool,
    /// Also import the local busybox image (gpuctl/busybox:local, from the
    /// host's static busybox) into Docker if it is missing.
    #[arg(long)]
    busybox_image: bool,
    /// Path of libnvidia-ml to load (default: the system's).
    #[arg(long, env = "GPUCTL_AGENT_NVML_LIB")]
    nvml_lib: Option<PathBuf>,
}

/// Runs the check when the first argument is `check`.
pub fn main_if_requested() -> Option<ExitCode> {
    let mut argv = std::env::args_os();
    argv.next()?;
    if argv.next().as_deref() != Some(std::ffi::OsStr::new("check")) {
        return None;
    }
    // Usage and errors name the command as typed.
    let rest: Vec<OsString> = std::iter::once("gpuctl-agent check".into())
        .chain(argv)
        .collect();
    let args = match CheckArgs::try_parse_from(rest) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return Some(ExitCode::from(if e.use_stderr() { 2 } else { 0 }));
        }
    };
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuctl-agent check: start the async runtime: {e}");
            return Some(ExitCode::from(1));
        }
    };
    let report = rt.block_on(check(&args));
    if args.json {
        match serde_json::to_string(&report) {
            Ok(s) => println!("{s}"),
            Err(e) => {
                eprintln!("gpuctl-agent check: encode the report: {e}");
                return Some(ExitCode::from(1));
            }
        }
    } else {
        print!("{}", render(&report));
    }
    Some(ExitCode::SUCCESS)
}

async fn check(args: &CheckArgs) -> HostCheck {
    let nvml_lib = args.nvml_lib.clone();
    let discovery = tokio::task::spawn_blocking(move || {
        crate::gpu::discover(nvml_lib.as_deref(), Path::new("/proc"))
    })
    .await;
    let mut report = match discovery {
        Ok(d) => HostCheck {
            gpus: d
                .gpus
                .iter()
                .map(|g| HostGpu {
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    healthy: g.healthy,
                })
                .collect(),
            driver_version: d.driver_version,
            nvml_error: d.error,
            docker: None,
        },
        Err(e) => HostCheck {
            nvml_error: Some(format!("GPU discovery failed: {e}")),
            ..HostCheck::default()
        },
    };
    if !args.no_docker {
        report.docker = Some(check_docker(args.busybox_image).await);
    }
    report
}

async fn check_docker(busybox_image: bool) -> DockerCheck {
    let unavailable = |error: String| DockerCheck {
        error: Some(error),
        ..DockerCheck::default()
    };
    let docker = match tokio::time::timeout(DOCKER_CONNECT_TIMEOUT, DockerRuntime::connect()).await
    {
        Ok(Ok(d)) => d,
        Ok(Err(e)) => return unavailable(e.to_string()),
        Err(_) => {
            return unavailable(format!(
                "the daemon did not answer within {}s",
                DOCKER_CONNECT_TIMEOUT.as_secs()
            ))
        }
    };
    let client = match docker.client() {
        Ok(c) => c,
        Err(e) => return unavailable(e.to_string()),
    };
    let mut found = DockerCheck::default();
    if busybox_image {
        match tokio::time::timeout(IMAGE_TIMEOUT, image::ensure_busybox_image(&client)).await {
            Ok(Ok(name)) => found.image = Some(name),
            Ok(Err(e)) => found.image_error = Some(e.to_string()),
            Err(_) => {
                found.image_error = Some(format!(
                    "preparing it took more than {}s",
                    IMAGE_TIMEOUT.as_secs()
                ))
            }
        }
    }
    found
}

/// The report for a person: one line per subject.
fn render(r: &HostCheck) -> String {
    let mut out = String::new();
    let gpus = match (&r.nvml_error, r.gpus.len()) {
        (Some(e), _) => format!("none usable ({e})"),
        (None, 0) => "none (NVML reports no GPU)".to_string(),
        (None, n) => {
            let mut models: Vec<&str> = r.gpus.iter().map(|g| g.model.as_str()).collect();
            models.dedup();
            format!(
                "{n} found, {} healthy: {}",
                r.healthy_gpus(),
                models.join(", ")
            )
        }
    };
    out.push_str(&format!("GPUs (NVML): {gpus}\n"));
    if let Some(v) = &r.driver_version {
        out.push_str(&format!("Driver:      {v}\n"));
    }
    match &r.docker {
        None => out.push_str("Docker:      not checked (--no-docker)\n"),
        Some(DockerCheck { error: Some(e), .. }) => {
            out.push_str(&format!("Docker:      not available ({e})\n"))
        }
        Some(d) => {
            out.push_str("Docker:      answers\n");
            match (&d.image, &d.image_error) {
                (Some(i), _) => out.push_str(&format!("Image:       {i} ready\n")),
                (None, Some(e)) => out.push_str(&format!("Image:       not prepared ({e})\n")),
                (None, None) => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_each_subject_and_why_one_is_missing() {
        let r = HostCheck {
            gpus: vec![
                HostGpu {
                    uuid: "GPU-1".into(),
                    model: "NVIDIA H100".into(),
                    healthy: true,
                },
                HostGpu {
                    uuid: "GPU-1".into(),
                    model: "NVIDIA H100".into(),
                    healthy: false,
                },
            ],
            driver_version: Some("550.54".into()),
            nvml_error: None,
            docker: Some(DockerCheck {
                error: None,
                image: None,
                image_error: Some("no /bin/busybox".into()),
            }),
        };
        let text = render(&r);
        assert!(text.contains("2 found, 1 healthy: NVIDIA H100\n"), "{text}");
        assert!(text.contains("550.54"), "{text}");
        assert!(text.contains("not prepared (no /bin/busybox)"), "{text}");

        let none = HostCheck {
            nvml_error: Some("NVML unavailable (libnvidia-ml.so.1): not found".into()),
            ..HostCheck::default()
        };
        let text = render(&none);
        assert!(text.contains("none usable (NVML unavailable"), "{text}");
        assert!(text.contains("not checked"), "{text}");
    }

    #[test]
    fn the_json_report_reads_back_as_it_was_written() {
        let r = HostCheck {
            gpus: vec![HostGpu {
                uuid: "GPU-1".into(),
                model: "A100".into(),
                healthy: true,
            }],
            driver_version: None,
            nvml_error: None,
            docker: Some(DockerCheck {
                error: Some("no socket".into()),
                ..DockerCheck::default()
            }),
        };
        let back: HostCheck = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
