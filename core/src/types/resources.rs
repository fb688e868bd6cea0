//! Resources an agent has or a task asks for: CPUs, memory, GPUs, host ports.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Scalar resources of an agent or asked for by a task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    pub cpus: f64,
    pub mem_mib: u64,
    pub gpus: u32,
    /// Host ports (a count; the numbers come from the agent's range,
    /// [`AgentInfo::ports`], chosen by the master when a task launches).
    #[serde(default)]
    pub ports: u32,
}

impl Resources {
    /// True when `self` can hold `need`.
    pub fn fits(&self, need: &Resources) -> bool {
        // A small epsilon keeps 0.1 + 0.2 style sums from refusing an exact fit.
        need.cpus <= self.cpus + 1e-9
            && need.mem_mib <= self.mem_mib
            && need.gpus <= self.gpus
            && need.ports <= self.ports
    }

    pub fn saturating_sub(&self, other: &Resources) -> Resources {
        Resources {
            cpus: (self.cpus - other.cpus).max(0.0),
            mem_mib: self.mem_mib.saturating_sub(other.mem_mib),
            gpus: self.gpus.saturating_sub(other.gpus),
            ports: self.ports.saturating_sub(other.ports),
        }
    }

    pub fn add(&self, other: &Resources) -> Resources {
        Resources {
            cpus: self.cpus + other.cpus,
            mem_mib: self.mem_mib.saturating_add(other.mem_mib),
            gpus: self.gpus.saturating_add(other.gpus),
            ports: self.ports.saturating_add(other.ports),
        }
    }
}

/// An agent's host ports for tasks, `start..=end` (`--ports START-END`).
/// Tasks run on the host network, so a port is a host-wide resource: the
/// master gives each number to one live task at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRange {
    pub start: u16,
    pub end: u16,
}

impl PortRange {
    /// How many ports it holds.
    pub fn len(&self) -> u32 {
        (u32::from(self.end) + 1).saturating_sub(u32::from(self.start))
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn contains(&self, port: u16) -> bool {
        (self.start..=self.end).contains(&port)
    }

    /// Parses `START-END` (inclusive, 1..=65535, START <= END).
    pub fn parse(s: &str) -> Result<PortRange, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected START-END, e.g. 31000-32000"))?;
        let num = |v: &str| -> Result<u16, String> {
            match v.trim().parse::<u16>() {
                Ok(0) | Err(_) => Err(format!("{s:?}: {v:?} is not a port (1-65535)")),
                Ok(p) => Ok(p),
            }
        };
        let (start, end) = (num(a)?, num(b)?);
        if start > end {
            return Err(format!("{s:?}: the range is empty ({start} > {end})"));
        }
        Ok(PortRange { start, end })
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}
