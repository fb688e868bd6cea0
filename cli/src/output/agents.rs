//! Agents and GPUs as gpuctl prints them: lists, `agents describe`, the topology matrix, MIG rows.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::*;

/// A GPU's model, marked when it is in MIG mode (or will be after a reset).
pub(super) fn model_label(g: &pb::Gpu) -> String {
    match &g.mig {
        Some(m) if m.enabled && m.pending == Some(false) => {
            format!("{} [MIG, off after reset]", g.model)
        }
        Some(m) if m.enabled => format!("{} [MIG]", g.model),
        Some(m) if m.pending == Some(true) => format!("{} [MIG after reset]", g.model),
        _ => g.model.clone(),
    }
}

/// The rows shown under a GPU in MIG mode, as (INDEX, UUID, MODEL,
/// MEMORY): one per MIG device (`└ gi2`, its uuid, `MIG 3g.20gb`, its
/// memory), then the profiles that still fit (`└ free`).
pub(super) fn mig_rows(g: &pb::Gpu) -> Vec<[String; 4]> {
    let Some(m) = g.mig.as_ref().filter(|m| m.enabled) else {
        return Vec::new();
    };
    let mut rows: Vec<[String; 4]> = m
        .devices
        .iter()
        .map(|d| {
            [
                format!("└ gi{}", d.gi_id),
                d.uuid.clone(),
                format!("MIG {}", d.profile),
                fmt_mib(d.memory_mib),
            ]
        })
        .collect();
    if !m.free.is_empty() {
        let free: Vec<String> = m
            .free
            .iter()
            .map(|c| format!("{} x{}", c.profile, c.count))
            .collect();
        rows.push([
            "└ free".into(),
            String::new(),
            free.join(", "),
            String::new(),
        ]);
    }
    rows
}

// ---------------------------------------------------------------- words

/// The STATE of `agents list`: ACTIVE, UNREACHABLE or LOST, and DRAINING
/// for a drained agent (`DRAINING` alone when it is ACTIVE).
pub fn agent_display_state(a: &pb::Agent) -> String {
    let state = agent_state_name(a.state);
    match (a.draining, state) {
        (false, _) => state.to_string(),
        (true, "ACTIVE") => "DRAINING".to_string(),
        (true, _) => format!("{state},DRAINING"),
    }
}

/// The runtimes of an agent with their health: `docker (down: <why>)` for
/// one its last heartbeat said is not available.
pub fn agent_runtimes(a: &pb::Agent) -> String {
    a.runtimes
        .iter()
        .map(|r| {
            let name = runtime_name(*r);
            match a.runtime_status.iter().find(|s| s.runtime == *r) {
                Some(s) if !s.available && s.message.is_empty() => format!("{name} (down)"),
                Some(s) if !s.available => {
                    format!("{name} (down: {})", s.message.replace(['\n', '\r'], " "))
                }
                _ => name,
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

// ---------------------------------------------------------------- tables

/// `agents list`: ID, HOSTNAME, STATE, GPUS, CPUS, MEM, RUNTIMES. GPUS,
/// CPUS and MEM are `free/total`.
pub fn agents_table(agents: &[pb::Agent]) -> Table {
    let mut t = Table::new(&["ID", "HOSTNAME", "STATE", "GPUS", "CPUS", "MEM", "RUNTIMES"]);
    for a in agents {
        let total = a.total.unwrap_or_default();
        let alloc = a.allocated.unwrap_or_default();
        let free_cpus = (total.cpus - alloc.cpus).max(0.0);
        t.row(vec![
            a.id.clone(),
            a.hostname.clone(),
            agent_display_state(a),
            format!("{}/{}", total.gpus.saturating_sub(alloc.gpus), total.gpus),
            format!("{}/{}", fmt_cpus(free_cpus), fmt_cpus(total.cpus)),
            format!(
                "{}/{}",
                fmt_mib(total.mem_mib.saturating_sub(alloc.mem_mib)),
                fmt_mib(total.mem_mib)
            ),
            agent_runtimes(a),
        ]);
    }
    t
}

/// The matrix of `agents describe`, read like `nvidia-smi topo -m`: NV<n>
/// for n NVLink links, else the PCIe path; X on the diagonal.
pub fn topology_matrix(gpus: &[pb::Gpu]) -> String {
    let mut gpus: Vec<&pb::Gpu> = gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    // A space, not "": an empty cell renders as "-".
    let mut headers: Vec<String> = vec![" ".to_string()];
    headers.extend(gpus.iter().map(|g| format!("GPU{}", g.index)));
    headers.push("NUMA".into());
    let header_refs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let mut t = Table::new(&header_refs);
    for a in &gpus {
        let mut row = vec![format!("GPU{}", a.index)];
        for b in &gpus {
            let cell = if a.uuid == b.uuid {
                "X".to_string()
            } else {
                match a.peers.iter().find(|p| p.uuid == b.uuid) {
                    Some(p) if p.nvlinks > 0 => format!("NV{}", p.nvlinks),
                    Some(p) if !p.pcie.is_empty() => p.pcie.clone(),
                    _ => "?".to_string(),
                }
            };
            row.push(cell);
        }
        row.push(
            a.numa_node
                .map_or_else(|| "?".to_string(), |n| n.to_string()),
        );
        t.row(row);
    }
    let mut out = t.render();
    out.push_str(
        "\nNV#  = connected by # NVLink links\nPIX  = through one PCIe switch\nPXB  = through several PCIe switches\nPHB  = through a PCIe host bridge\nNODE = across host bridges within a NUMA node\nSYS  = across NUMA nodes (SMP interconnect)\n?    = unknown\n",
    );
    out
}

/// `agents describe`: the host, its GPUs (with the task holding each), the
/// topology matrix and the attributes.
pub fn agent_detail(a: &pb::Agent, holders: &BTreeMap<String, String>) -> String {
    let total = a.total.unwrap_or_default();
    let alloc = a.allocated.unwrap_or_default();
    let mut s = String::new();
    let dash = |v: &str| {
        if v.is_empty() {
            "-".to_string()
        } else {
            v.to_string()
        }
    };
    let _ = writeln!(s, "ID:          {}", a.id);
    let _ = writeln!(s, "Hostname:    {}", a.hostname);
    let _ = writeln!(s, "Address:     {}", a.address);
    let _ = writeln!(s, "State:       {}", agent_display_state(a));
    if a.unreachable_since_ms != 0 {
        let _ = writeln!(s, "Silent since: {}", fmt_timestamp(a.unreachable_since_ms));
    }
    if a.draining {
        let _ = writeln!(
            s,
            "Drain:       no new tasks; {}",
            if a.drain_deadline_ms == 0 {
                "running tasks run until they end".to_string()
            } else {
                format!(
                    "running tasks killed at {}",
                    fmt_timestamp(a.drain_deadline_ms)
                )
            }
        );
    }
    let _ = writeln!(s, "Runtimes:    {}", agent_runtimes(a));
    let _ = writeln!(s, "Driver:      {}", dash(&a.driver_version));
    let _ = writeln!(s, "CUDA:        {}", dash(&a.cuda_driver_version));
    let _ = writeln!(
        s,
        "Root tasks:  {}",
        if a.allow_root_tasks {
            "allowed (allow_root_tasks)"
        } else {
            "no"
        }
    );
    let _ = writeln!(s, "Mounts:      {}", dash(&a.allowed_mounts.join(", ")));
    let _ = writeln!(
        s,
        "GPUs:        {} free of {}{}",
        total.gpus.saturating_sub(alloc.gpus),
        total.gpus,
        if a.simulated_gpus { " (simulated)" } else { "" }
    );
    let _ = writeln!(
        s,
        "CPUs:        {} free of {}",
        fmt_cpus((total.cpus - alloc.cpus).max(0.0)),
        fmt_cpus(total.cpus)
    );
    let _ = writeln!(
        s,
        "Memory:      {} free of {}",
        fmt_mib(total.mem_mib.saturating_sub(alloc.mem_mib)),
        fmt_mib(total.mem_mib)
    );
    let _ = writeln!(
        s,
        "Ports:       {}",
        match &a.ports {
            Some(r) => format!(
                "{} free of {}-{}",
                total.ports.saturating_sub(alloc.ports),
                r.start,
                r.end
            ),
            None => "none".to_string(),
        }
    );
    if !a.gpus.is_empty() {
        let t = agent_gpus_table(a, holders);
        let _ = write!(s, "\nGPUs:\n{}", t.render());
        let _ = write!(s, "\nTopology:\n{}", topology_matrix(&a.gpus));
    }
    if !a.attributes.is_empty() {
        let _ = writeln!(s, "\nAttributes:");
        let mut attrs: Vec<(&String, &String)> = a.attributes.iter().collect();
        attrs.sort();
        for (k, v) in attrs {
            let _ = writeln!(s, "  {k}={v}");
        }
    }
    s
}

/// `agents describe`'s GPUs, each MIG device under its GPU, with the
/// task holding each.
fn agent_gpus_table(a: &pb::Agent, holders: &BTreeMap<String, String>) -> Table {
    let mut t = Table::new(&[
        "INDEX", "UUID", "MODEL", "MEMORY", "MINOR", "PCI", "NUMA", "CC", "HEALTH", "TASK",
    ]);
    let mut gpus: Vec<&pb::Gpu> = a.gpus.iter().collect();
    gpus.sort_by_key(|g| g.index);
    for g in &gpus {
        let health = if g.healthy {
            "healthy".to_string()
        } else {
            format!("UNHEALTHY: {}", g.unhealthy_reason)
        };
        t.row(vec![
            g.index.to_string(),
            g.uuid.clone(),
            model_label(g),
            fmt_mib(g.memory_mib),
            g.minor.to_string(),
            g.pci_bus_id.clone(),
            g.numa_node.map(|n| n.to_string()).unwrap_or_default(),
            g.compute_capability.clone(),
            health.clone(),
            holders.get(&g.uuid).cloned().unwrap_or_default(),
        ]);
        for [index, uuid, model, memory] in mig_rows(g) {
            let mig_health = if uuid.is_empty() {
                String::new()
            } else {
                health.clone()
            };
            let task = holders.get(&uuid).cloned().unwrap_or_default();
            t.row(vec![
                index,
                uuid,
                model,
                memory,
                String::new(),
                String::new(),
                String::new(),
                String::new(),
                mig_health,
                task,
            ]);
        }
    }
    t
}

/// `gpus`: AGENT, INDEX, UUID, MODEL, MEMORY, HEALTH, TASK.
pub fn gpus_table(gpus: &[pb::GpuStatus]) -> Table {
    let mut t = Table::new(&[
        "AGENT", "INDEX", "UUID", "MODEL", "MEMORY", "HEALTH", "TASK",
    ]);
    for s in gpus {
        let g = s.gpu.clone().unwrap_or_default();
        let mut health = match (g.healthy, s.cordoned) {
            (true, false) => "healthy".to_string(),
            (true, true) => "CORDONED".to_string(),
            (false, false) => "UNHEALTHY".to_string(),
            (false, true) => "UNHEALTHY,CORDONED".to_string(),
        };
        if !s.share_mode.is_empty() {
            health.push_str(&format!(",SHARED ({})", s.share_mode));
        }
        if s.mig_change.is_some() {
            health.push_str(",REPARTITIONING");
        } else if !s.mig_error.is_empty() {
            health.push_str(",MIG CHANGE FAILED");
        }
        t.row(vec![
            s.agent_id.clone(),
            g.index.to_string(),
            g.uuid.clone(),
            model_label(&g),
            fmt_mib(g.memory_mib),
            health.clone(),
            s.task_id.clone(),
        ]);
        // A shared GPU: a row per fraction held, with its task.
        for h in &s.shares {
            let compute = if h.compute_pct > 0 {
                format!(", {}%", h.compute_pct)
            } else {
                String::new()
            };
            t.row(vec![
                String::new(),
                "└ share".into(),
                String::new(),
                format!("fraction{compute}"),
                fmt_mib(h.mem_mib),
                String::new(),
                h.task_id.clone(),
            ]);
        }
        for [index, uuid, model, memory] in mig_rows(&g) {
            let mig_health = if uuid.is_empty() {
                String::new()
            } else {
                health.clone()
            };
            let task = s.mig_tasks.get(&uuid).cloned().unwrap_or_default();
            t.row(vec![
                String::new(),
                index,
                uuid,
                model,
                memory,
                mig_health,
                task,
            ]);
        }
    }
    t
}

// ---------------------------------------------------------------- formatting
