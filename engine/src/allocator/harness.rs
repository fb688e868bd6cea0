//! A recorded-offer harness, after Nomad's scheduler harness: a simulated
//! cluster whose views are built as the leader builds them (free less held
//! less offered), cycles of `allocate` + `OfferBook::record`, and a log of
//! every offer made, for tests to read.

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::{GpuInfo, Resources};

use super::{
    allocate, refuse_until, AgentView, AllocatorConfig, Demand, Filters, FrameworkView, Offer,
    OfferBook, RoleConfig,
};

pub fn res(cpus: f64, mem_mib: u64, gpus: u32) -> Resources {
    Resources {
        cpus,
        mem_mib,
        gpus,
        ports: 0,
    }
}

pub fn gpu(uuid: &str, index: u32) -> GpuInfo {
    GpuInfo::new(uuid, index, "NVIDIA A100-SXM4-40GB", 40_960)
}

/// An agent view with `gpus` free GPUs named `<id>-gpu<i>`.
pub fn agent(id: &str, free: Resources, total: Resources) -> AgentView {
    AgentView {
        id: id.to_string(),
        hostname: format!("{id}.example"),
        free,
        free_gpus: (0..free.gpus)
            .map(|i| gpu(&format!("{id}-gpu{i}"), i))
            .collect(),
        total,
        attributes: BTreeMap::new(),
    }
}

/// An agent with everything free.
pub fn idle_agent(id: &str, total: Resources) -> AgentView {
    agent(id, total, total)
}

pub fn fw(id: &str, role: &str, gpu_capable: bool, allocated: Resources) -> FrameworkView {
    FrameworkView {
        id: id.to_string(),
        role: role.to_string(),
        gpu_capable,
        suppressed: false,
        allocated,
        demand: Demand::Whole,
    }
}

pub struct SimAgent {
    pub id: String,
    pub total: Resources,
    pub gpus: Vec<GpuInfo>,
    /// Held by launched tasks.
    pub used: Resources,
    pub held_gpus: BTreeSet<String>,
}

pub struct SimFramework {
    pub id: String,
    pub role: String,
    pub gpu_capable: bool,
    pub suppressed: bool,
    /// Held by its launched tasks.
    pub running: Resources,
    pub demand: Demand,
}

#[derive(Default)]
pub struct Harness {
    pub agents: Vec<SimAgent>,
    pub frameworks: Vec<SimFramework>,
    pub roles: BTreeMap<String, RoleConfig>,
    pub config: AllocatorConfig,
    pub filters: Filters,
    pub book: OfferBook,
    pub now_ms: u64,
    /// The offers of each cycle, in order.
    pub log: Vec<Vec<Offer>>,
}

impl Harness {
    pub fn new() -> Self {
        Harness::default()
    }

    pub fn add_agent(&mut self, id: &str, cpus: f64, mem_mib: u64, gpus: u32) -> &mut Self {
        self.agents.push(SimAgent {
            id: id.to_string(),
            total: res(cpus, mem_mib, gpus),
            gpus: (0..gpus).map(|i| gpu(&format!("{id}-gpu{i}"), i)).collect(),
            used: Resources::default(),
            held_gpus: BTreeSet::new(),
        });
        self
    }

    pub fn add_framework(&mut self, id: &str, role: &str, gpu_capable: bool) -> &mut Self {
        self.frameworks.push(SimFramework {
            id: id.to_string(),
            role: role.to_string(),
            gpu_capable,
            suppressed: false,
            running: Resources::default(),
            demand: Demand::Whole,
        });
        self
    }

    /// The views the leader would build from its state and the offer book.
    pub fn views(&self) -> (Vec<AgentView>, Vec<FrameworkView>) {
        assert!(self.book.index_agrees(), "the offer book's indexes drifted");
        let offered_gpus = self.book.offered_gpus();
        let by_agent = self.book.offered_by_agent();
        let by_fw = self.book.offered_by_framework();
        let agents = self
            .agents
            .iter()
            .map(|a| {
                let offered = by_agent.get(&a.id).copied().unwrap_or_default();
                AgentView {
                    id: a.id.clone(),
                    hostname: a.id.clone(),
                    free: a.total.saturating_sub(&a.used).saturating_sub(&offered),
                    free_gpus: a
                        .gpus
                        .iter()
                        .filter(|g| {
                            !a.held_gpus.contains(&g.uuid) && !offered_gpus.contains(&g.uuid)
                        })
                        .cloned()
                        .collect(),
                    total: a.total,
                    attributes: BTreeMap::new(),
                }
            })
            .collect();
        let frameworks = self
            .frameworks
            .iter()
            .map(|f| FrameworkView {
                id: f.id.clone(),
                role: f.role.clone(),
                gpu_capable: f.gpu_capable,
                suppressed: f.suppressed,
                demand: f.demand,
                allocated: f
                    .running
                    .add(&by_fw.get(&f.id).copied().unwrap_or_default()),
            })
            .collect();
        (agents, frameworks)
    }

    /// One allocation cycle at the current time; returns and logs its offers.
    pub fn cycle(&mut self) -> Vec<Offer> {
        self.filters.expire(self.now_ms);
        let (agents, frameworks) = self.views();
        let plans = allocate(
            &agents,
            &frameworks,
            &self.roles,
            &self.filters,
            &self.config,
            self.now_ms,
        );
        let offers = self.book.record(plans, self.now_ms);
        self.log.push(offers.clone());
        offers
    }

    pub fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
    }

    /// Declines offers with a filter of `refuse_seconds` (None: default).
    pub fn decline(
        &mut self,
        framework_id: &str,
        offer_ids: &[String],
        refuse_seconds: Option<f64>,
    ) {
        let taken = self
            .book
            .take(offer_ids, framework_id)
            .expect("decline takes outstanding offers");
        if let Some(until) = refuse_until(self.now_ms, refuse_seconds) {
            for o in taken {
                self.filters.add(framework_id, &o.agent_id, until);
            }
        }
    }

    /// Accepts an offer and launches one task on all of it.
    pub fn accept(&mut self, framework_id: &str, offer_id: &str) {
        let taken = self
            .book
            .take(&[offer_id], framework_id)
            .expect("accept takes an outstanding offer");
        for o in taken {
            let agent = self
                .agents
                .iter_mut()
                .find(|a| a.id == o.agent_id)
                .expect("offer of a known agent");
            agent.used = agent.used.add(&o.resources);
            agent.held_gpus.extend(o.gpu_uuids.iter().cloned());
            let f = self
                .frameworks
                .iter_mut()
                .find(|f| f.id == framework_id)
                .expect("known framework");
            f.running = f.running.add(&o.resources);
        }
    }
}
