//! The agent's CDI spec consumed by a real CDI runtime: Podman (4.3 on
//! Debian 12). Fake NVIDIA nodes are made with mknod in a temp dev root
//! (major 195, no driver behind them: a node a container may open gives
//! ENXIO, one its device cgroup denies EPERM); the spec is generated from
//! them and written to a temp dir, which each podman run sees as /run/cdi
//! in a mount namespace of its own, with an empty /etc/cdi (Podman 4.3 has
//! no option for another spec directory): a spec of another agent on this
//! machine (a demo, a cluster) neither conflicts with the test's nor sees
//! it. Each
//! `podman run --device gpuctl.io/gpu=NAME` must see its GPU and the control
//! nodes, not the other GPU, the spec's environment and the read-only
//! driver volume; a MIG device's name its parent's node and its two caps
//! nodes, not the other MIG device's. Needs root and podman; skipped without them unless
//! GPUCTL_REQUIRE_DOCKER=1.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use gpuctl_agent::cdi::{self, spec, SpecGpu};
use gpuctl_agent::isolation::devices;

const ENXIO: &str = "No such device or address";
const EPERM: &str = "Operation not permitted";
const IMAGE: &str = "localhost/gpuctl/busybox:cdi-test";
const UUID0: &str = "GPU-0a0a0a0a-0000-4000-8000-000000000000";
const UUID1: &str = "GPU-1b1b1b1b-0000-4000-8000-000000000001";
/// GPU 1's two MIG devices, and their caps nodes' major (dynamic on a real
/// host; one no driver has here).
const MIG_A: &str = "MIG-aaaaaaaa-0000-4000-8000-000000000000";
const MIG_B: &str = "MIG-bbbbbbbb-0000-4000-8000-000000000000";
const CAPS_MAJOR: u64 = 238;

fn podman_or_skip(test: &str) -> bool {
    let why = if !nix::unistd::Uid::effective().is_root() {
        Some("not running as root".to_string())
    } else {
        match Command::new("podman").arg("--version").output() {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(format!(
                "podman --version failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => Some(format!("podman not found: {e} (apt-get install podman)")),
        }
    };
    match why {
        None => true,
        Some(why) if std::env::var("GPUCTL_REQUIRE_DOCKER").as_deref() == Ok("1") => {
            panic!("{test}: podman is required (GPUCTL_REQUIRE_DOCKER=1) but {why}")
        }
        Some(why) => {
            eprintln!("skipped: {test}: needs root and podman ({why})");
            false
        }
    }
}

fn mknod(dir: &Path, name: &str, major: u64, minor: u64) {
    use nix::sys::stat::{makedev, Mode, SFlag};
    nix::sys::stat::mknod(
        &dir.join(name),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        makedev(major, minor),
    )
    .unwrap_or_else(|e| panic!("mknod {name}: {e}"));
}

/// Runs podman with the sandbox's settings, in a mount namespace of its
/// own where `cdi` is /run/cdi and /etc/cdi is empty: the only CDI specs
/// it sees are the test's. CONTAINERS_CONF: this sandbox refuses raising
/// RLIMIT_NOFILE, which Podman does for every container unless
/// `default_ulimits` is empty. `--cgroup-manager cgroupfs`: no systemd to
/// ask for cgroups; `--events-backend file`: no journald.
fn podman(conf: &Path, cdi: &Path, args: &[&str]) -> std::process::Output {
    // The mount points, made once on the host (empty directories are what
    // CDI's own packages leave there too).
    for d in ["/etc/cdi", "/run/cdi"] {
        std::fs::create_dir_all(d).unwrap_or_else(|e| panic!("mkdir {d}: {e}"));
    }
    let script = r#"mount --bind "$0" /run/cdi && mount -t tmpfs gpuctl-test-cdi /etc/cdi &&
exec podman --cgroup-manager cgroupfs --events-backend file "$@""#;
    Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            script,
        ])
        .arg(cdi)
        .args(args)
        .env("CONTAINERS_CONF", conf)
        .output()
        .unwrap()
}

/// What a container given `device` finds: each node opened (or absent), a
/// node made for the other GPU, the environment and the driver volume.
fn run_with(conf: &Path, cdi: &Path, device: &str) -> (bool, String) {
    let script = r#"for n in nvidia0 nvidia1 nvidiactl nvidia-uvm; do
  if [ ! -e /dev/$n ]; then echo "$n absent"
  elif cat /dev/$n 2>/tmp/e; then echo "$n opened"
  else echo "$n $(cat /tmp/e)"; fi
done
for m in 0 1; do
  busybox mknod /tmp/made$m c 195 $m
  if cat /tmp/made$m 2>/tmp/e; then echo "made$m opened"; else echo "made$m $(cat /tmp/e)"; fi
done
echo "visible=$NVIDIA_VISIBLE_DEVICES"
echo "path=$PATH"
cat /usr/local/nvidia/bin/nvidia-smi
if touch /usr/local/nvidia/x 2>/tmp/e; then echo "volume writable"; else echo "volume $(cat /tmp/e)"; fi
"#;
    // No network: none is needed, and none has to be set up in a sandbox.
    let out = podman(
        conf,
        cdi,
        &[
            "run",
            "--rm",
            "--network",
            "none",
            "--device",
            device,
            IMAGE,
            "sh",
            "-c",
            script,
        ],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// What a container given the MIG device `device` finds of each caps node
/// (opened or absent), and of one made for each.
fn run_mig(conf: &Path, cdi: &Path, device: &str) -> (bool, String) {
    let script = format!(
        r#"for n in 30 31 39 40; do
  c=/dev/nvidia-caps/nvidia-cap$n
  if [ ! -e $c ]; then echo "cap$n absent"
  elif cat $c 2>/tmp/e; then echo "cap$n opened"
  else echo "cap$n $(cat /tmp/e)"; fi
  busybox mknod /tmp/made$n c {CAPS_MAJOR} $n
  if cat /tmp/made$n 2>/tmp/e; then echo "madecap$n opened"; else echo "madecap$n $(cat /tmp/e)"; fi
done
for n in nvidia0 nvidia1; do
  if [ ! -e /dev/$n ]; then echo "$n absent"; else echo "$n $(cat /dev/$n 2>&1)"; fi
done
"#
    );
    let out = podman(
        conf,
        cdi,
        &[
            "run",
            "--rm",
            "--network",
            "none",
            "--device",
            device,
            IMAGE,
            "sh",
            "-c",
            &script,
        ],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn line<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{out}"))
}

#[test]
fn podman_gives_a_container_exactly_the_gpu_it_names() {
    if !podman_or_skip("podman_gives_a_container_exactly_the_gpu_it_names") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let dev = t.path().join("dev");
    std::fs::create_dir_all(&dev).unwrap();
    mknod(&dev, "nvidia0", 195, 0);
    mknod(&dev, "nvidia1", 195, 1);
    mknod(&dev, "nvidiactl", 195, 255);
    // uvm's major is dynamic; one no driver has here.
    mknod(&dev, "nvidia-uvm", 240, 0);
    std::fs::create_dir_all(dev.join("nvidia-caps")).unwrap();
    for n in [30, 31, 39, 40] {
        mknod(&dev, &format!("nvidia-caps/nvidia-cap{n}"), CAPS_MAJOR, n);
    }
    let volume = t.path().join("volumes/nvidia_535.129.03");
    std::fs::create_dir_all(volume.join("bin")).unwrap();
    std::fs::write(volume.join("bin/nvidia-smi"), "fake nvidia-smi\n").unwrap();

    // The spec as the agent makes it, from the nodes it scans.
    let mut gpus = [SpecGpu::whole(0, UUID0, 0), SpecGpu::whole(1, UUID1, 1)];
    gpus[1].mig = vec![
        cdi::SpecMig {
            uuid: MIG_A.into(),
            caps: vec![30, 31],
        },
        cdi::SpecMig {
            uuid: MIG_B.into(),
            caps: vec![39, 40],
        },
    ];
    let host = devices::scan(&dev).unwrap();
    let generated = spec::generate(&gpus, &host, Some(&volume)).unwrap();
    assert!(generated.skipped.is_empty(), "{:?}", generated.skipped);
    let cdi_dir = t.path().join("cdi");
    std::fs::create_dir_all(&cdi_dir).unwrap();
    assert!(cdi::write_spec(&cdi_dir, "gpuctl.json", &spec::to_json(&generated.spec)).unwrap());

    let conf = t.path().join("containers.conf");
    std::fs::write(&conf, "[containers]\ndefault_ulimits = []\n").unwrap();
    let exists = podman(&conf, &cdi_dir, &["image", "exists", IMAGE])
        .status
        .success();
    if !exists {
        let tar = t.path().join("rootfs.tar");
        std::fs::write(
            &tar,
            gpuctl_agent::runtime::image::busybox_rootfs().unwrap(),
        )
        .unwrap();
        let out = podman(&conf, &cdi_dir, &["import", tar.to_str().unwrap(), IMAGE]);
        assert!(out.status.success(), "podman import: {out:?}");
    }

    for (device, mine, other) in [
        ("gpuctl.io/gpu=0", 0, 1),
        (&*format!("gpuctl.io/gpu={UUID1}"), 1, 0),
    ] {
        let (ok, out) = run_with(&conf, &cdi_dir, device);
        assert!(ok, "{device}:\n{out}");
        assert!(
            line(&out, &format!("nvidia{mine} ")).contains(ENXIO),
            "{device}: its GPU opens (no driver behind it):\n{out}"
        );
        assert_eq!(
            line(&out, &format!("nvidia{other} ")),
            format!("nvidia{other} absent"),
            "{device}: the other GPU is not there:\n{out}"
        );
        assert!(
            line(&out, &format!("made{other} ")).contains(EPERM),
            "{device}: a node made for the other GPU is refused:\n{out}"
        );
        assert!(line(&out, &format!("made{mine} ")).contains(ENXIO), "{out}");
        assert!(line(&out, "nvidiactl ").contains(ENXIO), "{out}");
        assert!(line(&out, "nvidia-uvm ").contains(ENXIO), "{out}");
        assert_eq!(line(&out, "visible="), "visible=void", "{out}");
        // The spec leaves the image's PATH alone (busybox sets none: Podman's default).
        assert!(!line(&out, "path=").contains("nvidia"), "{out}");
        assert!(out.contains("fake nvidia-smi"), "{out}");
        assert!(
            line(&out, "volume ").contains("Read-only file system"),
            "{out}"
        );
    }

    let (ok, out) = run_with(&conf, &cdi_dir, "gpuctl.io/gpu=all");
    assert!(ok, "all:\n{out}");
    for n in ["nvidia0", "nvidia1", "nvidiactl"] {
        assert!(
            line(&out, &format!("{n} ")).contains(ENXIO),
            "all: {n}:\n{out}"
        );
    }

    // A MIG device, by its place (GPU 1's first) or by its UUID: its
    // parent's node and its own caps open; the other MIG device's caps are
    // not there, and a node made for one is refused.
    for (device, mine, other) in [
        ("gpuctl.io/gpu=1:0", [30, 31], [39, 40]),
        (&*format!("gpuctl.io/gpu={MIG_B}"), [39, 40], [30, 31]),
    ] {
        let (ok, out) = run_mig(&conf, &cdi_dir, device);
        assert!(ok, "{device}:\n{out}");
        for n in mine {
            assert!(
                line(&out, &format!("cap{n} ")).contains(ENXIO),
                "{device}: cap{n}:\n{out}"
            );
            assert!(
                line(&out, &format!("madecap{n} ")).contains(ENXIO),
                "{device}:\n{out}"
            );
        }
        for n in other {
            assert_eq!(
                line(&out, &format!("cap{n} ")),
                format!("cap{n} absent"),
                "{device}:\n{out}"
            );
            assert!(
                line(&out, &format!("madecap{n} ")).contains(EPERM),
                "{device}: made cap{n}:\n{out}"
            );
        }
        assert!(
            line(&out, "nvidia1 ").contains(ENXIO),
            "{device}: its parent:\n{out}"
        );
        assert_eq!(line(&out, "nvidia0 "), "nvidia0 absent", "{out}");
    }

    // A name the spec does not define is refused, not ignored.
    let (ok, out) = run_with(&conf, &cdi_dir, "gpuctl.io/gpu=7");
    assert!(!ok, "{out}");
    assert!(out.contains("gpuctl.io/gpu=7"), "{out}");
}
