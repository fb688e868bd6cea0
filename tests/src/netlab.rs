//! Test hosts in network namespaces, joined by one bridge, with links an
//! operator's network could have: cut (one way or both), lossy, slow.
//!
//! Each host is a namespace with one interface (`eth0`, 10.99.0.N/24) whose
//! veth peer sits on a bridge in a namespace of its own, so a lab touches
//! nothing of the machine's network and two labs never meet. Faults are
//! iptables rules in the sending host's OUTPUT chain: a DROP for a cut, a
//! `statistic` random DROP for loss, and NFQUEUE to `net-delay` (a packet
//! held in user space; this kernel has no `netem`) for delay. A fault set
//! on both hosts of a pair affects both directions: 200 ms each way is a
//! 400 ms round trip.
//!
//! Needs root (`root_or_skip`). Programs run in a host with
//! [`NetLab::spawn`] (a [`Daemon`]) or [`NetLab::command`], in the host's
//! network namespace only (same mounts, cgroups and processes).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Daemon;

pub struct NetLab {
    prefix: String,
    hosts: Vec<String>,
    /// One `net-delay` per host that delays something.
    delays: std::collections::BTreeMap<String, Daemon>,
    net_delay: PathBuf,
    log_dir: PathBuf,
}

fn run(args: &[&str]) {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", args.join(" ")));
    assert!(
        out.status.success(),
        "{}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl NetLab {
    /// Creates one namespace per name in `hosts` (10.99.0.1 for the first,
    /// and so on) and the bridge joining them. `net_delay` is the
    /// `net-delay` binary; daemons' logs go to `log_dir`.
    pub fn new(hosts: &[&str], net_delay: &Path, log_dir: &Path) -> NetLab {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        // Short: interface names are at most 15 bytes.
        let prefix = format!(
            "gl{:x}{}",
            std::process::id() % 0xfff,
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let lab = NetLab {
            prefix: prefix.clone(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            delays: Default::default(),
            net_delay: net_delay.to_path_buf(),
            log_dir: log_dir.to_path_buf(),
        };
        let br = lab.bridge_ns();
        run(&["ip", "netns", "add", &br]);
        run(&["ip", "-n", &br, "link", "set", "lo", "up"]);
        run(&["ip", "-n", &br, "link", "add", "br0", "type", "bridge"]);
        run(&["ip", "-n", &br, "link", "set", "br0", "up"]);
        for (i, h) in hosts.iter().enumerate() {
            let ns = lab.ns(h);
            let (a, b) = (format!("{prefix}{i}a"), format!("{prefix}{i}b"));
            run(&["ip", "netns", "add", &ns]);
            run(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b]);
            run(&["ip", "link", "set", &a, "netns", &ns]);
            run(&["ip", "link", "set", &b, "netns", &br]);
            run(&["ip", "-n", &ns, "link", "set", &a, "name", "eth0"]);
            let cidr = format!("{}/24", lab.ip(h));
            run(&["ip", "-n", &ns, "addr", "add", &cidr, "dev", "eth0"]);
            run(&["ip", "-n", &ns, "link", "set", "eth0", "up"]);
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
            run(&["ip", "-n", &br, "link", "set", &b, "master", "br0"]);
            run(&["ip", "-n", &br, "link", "set", &b, "up"]);
        }
        lab
    }

    fn bridge_ns(&self) -> String {
        format!("{}-br", self.prefix)
    }

    fn index(&self, host: &str) -> usize {
        self.hosts
            .iter()
            .position(|h| h == host)
            .unwrap_or_else(|| panic!("no host {host} in the lab"))
    }

    /// The namespace of `host`.
    pub fn ns(&self, host: &str) -> String {
        format!("{}-{}", self.prefix, host)
    }

    /// The address of `host`.
    pub fn ip(&self, host: &str) -> String {
        format!("10.99.0.{}", self.index(host) + 1)
    }

    /// `program` to be run in `host`: `nsenter --net`, which execs it (the
    /// child's pid is the program's, so signals reach it) and, unlike `ip
    /// netns exec`, leaves the mounts alone (that one remounts /sys, and
    /// the cgroup hierarchies under it with it).
    pub fn command(&self, host: &str, program: &Path) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(self.net_arg(host)).arg(program);
        c
    }

    fn net_arg(&self, host: &str) -> String {
        format!("--net=/var/run/netns/{}", self.ns(host))
    }

    /// Runs `program args` in `host` and waits for it.
    pub fn output(&self, host: &str, program: &Path, args: &[&str]) -> Output {
        self.command(host, program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("{} in {host}: {e}", program.display()))
    }

    /// Starts a daemon in `host`, its output in `log`.
    pub fn spawn(
        &self,
        host: &str,
        name: &str,
        program: &Path,
        args: &[String],
        env: &[(String, String)],
        log: PathBuf,
    ) -> Daemon {
        let mut all = vec![self.net_arg(host), program.display().to_string()];
        all.extend(args.iter().cloned());
        Daemon::spawn(name, Path::new("/usr/bin/nsenter"), &all, env, log)
    }

    fn iptables(&self, host: &str, rule: &[&str]) {
        let ns = self.ns(host);
        let mut args = vec!["ip", "netns", "exec", &ns, "iptables", "-w"];
        args.extend_from_slice(rule);
        run(&args);
    }

    /// Drops everything `from` sends to `to` (a one-way cut: `to`'s
    /// packets still reach `from`).
    pub fn cut(&self, from: &str, to: &str) {
        let ip = self.ip(to);
        self.iptables(from, &["-I", "OUTPUT", "-d", &ip, "-j", "DROP"]);
    }

    /// Cuts both ways between `a` and `b`.
    pub fn partition(&self, a: &str, b: &str) {
        self.cut(a, b);
        self.cut(b, a);
    }

    /// What `from` sends to `to` is lost with probability `loss` and, when
    /// `delay_ms` > 0, arrives `delay_ms` late.
    pub fn degrade(&mut self, from: &str, to: &str, loss: f64, delay_ms: u64) {
        let ip = self.ip(to);
        let to_peer = ["-A", "OUTPUT", "-d", ip.as_str()];
        if loss > 0.0 {
            let p = format!("{loss}");
            let drop = ["-m", "statistic", "--mode", "random", "--probability", &p];
            self.iptables(from, &[&to_peer[..], &drop, &["-j", "DROP"]].concat());
        }
        if delay_ms > 0 {
            self.start_delay(from, delay_ms);
            let queue = ["-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"];
            self.iptables(from, &[&to_peer[..], &queue].concat());
        }
    }

    /// Degrades every link between the `hosts` both ways.
    pub fn degrade_mesh(&mut self, hosts: &[&str], loss: f64, delay_ms: u64) {
        for a in hosts {
            for b in hosts {
                if a != b {
                    self.degrade(a, b, loss, delay_ms);
                }
            }
        }
    }

    fn start_delay(&mut self, host: &str, delay_ms: u64) {
        if self.delays.contains_key(host) {
            return;
        }
        let log = self.log_dir.join(format!("net-delay-{host}.log"));
        let d = self.spawn(
            host,
            &format!("net-delay-{host}"),
            &self.net_delay.clone(),
            &[
                "--queue".into(),
                "0".into(),
                "--delay-ms".into(),
                delay_ms.to_string(),
            ],
            &[],
            log.clone(),
        );
        // Bound before the rule sends it anything (until then
        // --queue-bypass lets packets through undelayed).
        let ok = crate::try_wait_for(std::time::Duration::from_secs(10), || {
            std::fs::read_to_string(&log).is_ok_and(|s| s.contains("holding packets"))
        });
        assert!(
            ok,
            "net-delay did not start in {host}: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        self.delays.insert(host.to_string(), d);
    }

    /// Removes every fault (rules and delays): the network is whole again.
    pub fn heal(&mut self) {
        for h in self.hosts.clone() {
            self.iptables(&h, &["-F", "OUTPUT"]);
        }
        // Packets still held are let go as the daemons stop.
        self.delays.clear();
    }
}

impl Drop for NetLab {
    fn drop(&mut self) {
        self.delays.clear();
        for h in &self.hosts {
            let _ = Command::new("ip")
                .args(["netns", "del", &self.ns(h)])
                .status();
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.bridge_ns()])
            .status();
    }
}
