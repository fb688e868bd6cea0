//! How the framework loop is configured (from the master's options).

use std::collections::BTreeMap;
use std::time::Duration;

use crate::allocator::{AllocatorConfig, RoleConfig};

use super::*;

#[derive(Debug, Clone)]
pub struct FrameworkSettings {
    pub roles: BTreeMap<String, RoleConfig>,
    pub allocator: AllocatorConfig,
    /// Outstanding offers older than this are rescinded.
    pub offer_timeout: Duration,
    /// Allocation runs in rounds at most this often, so that frameworks
    /// that come or call within one round share it; resources freed or
    /// added, and a Revive, start a round at once.
    pub allocation_interval: Duration,
    /// An update its framework has not acknowledged is sent again after
    /// this, then after twice as long each time, up to
    /// [`MAX_UPDATE_RESEND`] (Mesos' status update retry, 10 s to 10 min).
    pub update_resend_interval: Duration,
    /// Reclaim between frameworks (`allocator::reclaim`); `None`: off.
    pub reclaim: Option<ReclaimSettings>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimSettings {
    /// Tasks younger than this are not taken.
    pub min_runtime: Duration,
    /// Between the inverse offer and the kill.
    pub notice: Duration,
}

impl Default for FrameworkSettings {
    fn default() -> Self {
        FrameworkSettings {
            roles: BTreeMap::new(),
            allocator: AllocatorConfig::default(),
            offer_timeout: Duration::from_secs(30),
            allocation_interval: DEFAULT_ALLOCATION_INTERVAL,
            update_resend_interval: Duration::from_secs(10),
            reclaim: None,
        }
    }
}
