//! Applying the master's MIG layout changes on this host. The master asks
//! (its heartbeat answer lists the changes under way on our GPUs, each
//! named by a generation); the agent changes the GPU through NVML when no
//! task of its own holds the GPU or one of its MIG devices, reads the GPU
//! back, and reports what NVML holds (every heartbeat, until the master
//! has recorded it).
//!
//! A change survives the agent being killed part way: an intent file
//! (`<work-dir>/mig/<gpu-uuid>.json`: the target, and the layout found
//! before) is written before NVML is touched and removed once the GPU has
//! been read back. An agent that starts and finds one finishes the change,
//! or, when that fails, puts the old layout back; then it reports, like a
//! change it made in one go.
//!
//! A GPU whose MIG mode cannot change without a GPU reset (an A100) is
//! left as it was, with the reason: the agent never resets a GPU.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use gpuctl_core::types::GpuInfo;
use gpuctl_proto::pb;
use nvml_wrapper::{Device, Nvml};
use serde::{Deserialize, Serialize};

use super::mig::{self, CapsMinors};
use super::mig_layout::{self, Placed};

/// NVML_ERROR_RESET_REQUIRED, as `nvmlDeviceSetMigMode`'s activation status.
const RESET_REQUIRED: u32 = nvml_wrapper_sys::bindings::nvmlReturn_enum_NVML_ERROR_RESET_REQUIRED;

/// A change asked of one of our GPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Change {
    pub gpu_uuid: String,
    pub generation: u64,
    pub profiles: Vec<String>,
    pub disable: bool,
}

impl From<&pb::MigChange> for Change {
    fn from(c: &pb::MigChange) -> Self {
        Change {
            gpu_uuid: c.gpu_uuid.clone(),
            generation: c.generation,
            profiles: c.profiles.clone(),
            disable: c.disable,
        }
    }
}

/// What the agent writes before it touches a GPU.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Intent {
    change: Change,
    /// MIG mode and GPU instances before the change.
    was_enabled: bool,
    before: Vec<Placed>,
}

/// What a change came to: the GPU as NVML has it afterwards, and why it
/// failed, if it did.
#[derive(Debug, Clone)]
pub struct Applied {
    pub generation: u64,
    pub gpu: GpuInfo,
    pub error: Option<String>,
}

impl Applied {
    fn to_pb(&self) -> pb::MigResult {
        pb::MigResult {
            gpu_uuid: self.gpu.uuid.clone(),
            generation: self.generation,
            ok: self.error.is_none(),
            message: self.error.clone().unwrap_or_default(),
            gpu: Some(self.gpu.clone().into()),
        }
    }
}

/// Where NVML and the driver's files are.
#[derive(Debug, Clone)]
pub struct Nvidia {
    pub lib: Option<PathBuf>,
    pub proc_root: PathBuf,
}

impl Nvidia {
    fn open(&self) -> Result<Nvml, String> {
        match &self.lib {
            Some(p) => Nvml::builder().lib_path(p.as_os_str()).init(),
            None => Nvml::init(),
        }
        .map_err(|e| format!("NVML: {e}"))
    }
}

fn intent_path(dir: &Path, gpu_uuid: &str) -> PathBuf {
    dir.join(format!("{gpu_uuid}.json"))
}

/// Applies `change` to `gpu` (blocking): the intent first, then NVML, then
/// the GPU read back. `gpu` is returned as it was, with the error, when
/// NVML cannot be reached or the GPU read back.
pub fn apply(nv: &Nvidia, dir: &Path, gpu: &GpuInfo, change: &Change) -> Applied {
    let done = |gpu: GpuInfo, error: Option<String>| Applied {
        generation: change.generation,
        gpu,
        error,
    };
    let nvml = match nv.open() {
        Ok(n) => n,
        Err(e) => return done(gpu.clone(), Some(e)),
    };
    let dev = match nvml.device_by_uuid(gpu.uuid.as_str()) {
        Ok(d) => d,
        Err(e) => return done(gpu.clone(), Some(format!("GPU {}: {e}", gpu.uuid))),
    };
    let was_enabled = dev.mig_mode().is_ok_and(|m| m.current != 0);
    let before = if was_enabled {
        mig_layout::layout(&nvml, &dev).unwrap_or_default()
    } else {
        Vec::new()
    };
    let intent = Intent {
        change: change.clone(),
        was_enabled,
        before,
    };
    let path = intent_path(dir, &gpu.uuid);
    if let Err(e) = std::fs::create_dir_all(dir)
        .map_err(|e| e.to_string())
        .and_then(|()| crate::checkpoint::write_json(&path, &intent).map_err(|e| e.to_string()))
    {
        // Without the intent a crash part way could not be finished.
        return done(
            gpu.clone(),
            Some(format!("could not record the change: {e}")),
        );
    }
    let error = change_gpu(&nvml, &dev, &intent).err();
    let after = read_back(nv, &nvml, &dev, gpu);
    let _ = std::fs::remove_file(&path);
    done(after, error)
}

/// Finishes the changes an earlier agent process left part way (their
/// intent files), or puts the old layout back when finishing fails; each
/// GPU of `gpus` concerned is updated to what NVML holds afterwards.
/// Returns what each came to, to report.
pub fn recover(nv: &Nvidia, dir: &Path, gpus: &mut [GpuInfo]) -> Vec<Applied> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(intent) = serde_json::from_str::<Intent>(&text) else {
            tracing::warn!(path = %path.display(), "unreadable MIG intent file removed");
            let _ = std::fs::remove_file(&path);
            continue;
        };
        let Some(gpu) = gpus.iter_mut().find(|g| g.uuid == intent.change.gpu_uuid) else {
            let _ = std::fs::remove_file(&path);
            continue;
        };
        tracing::warn!(gpu = %gpu.uuid, generation = intent.change.generation, "a MIG layout change was interrupted: finishing it");
        let applied = match nv.open().and_then(|nvml| {
            let dev = nvml
                .device_by_uuid(gpu.uuid.as_str())
                .map_err(|e| format!("GPU {}: {e}", gpu.uuid))?;
            let error = match change_gpu(&nvml, &dev, &intent) {
                Ok(()) => None,
                Err(e) => Some(match put_back(&dev, &nvml, &intent) {
                    Ok(()) => format!(
                        "{e} (after the agent was interrupted); the previous layout was put back"
                    ),
                    Err(r) => format!("{e} (after the agent was interrupted); putting the previous layout back failed too: {r}"),
                }),
            };
            Ok((read_back(nv, &nvml, &dev, gpu), error))
        }) {
            Ok((after, error)) => Applied {
                generation: intent.change.generation,
                gpu: after,
                error,
            },
            Err(e) => Applied {
                generation: intent.change.generation,
                gpu: gpu.clone(),
                error: Some(e),
            },
        };
        *gpu = applied.gpu.clone();
        let _ = std::fs::remove_file(&path);
        out.push(applied);
    }
    out
}

/// The change itself: MIG mode, then the GPU instances.
fn change_gpu(nvml: &Nvml, dev: &Device, intent: &Intent) -> Result<(), String> {
    let change = &intent.change;
    let mode = dev.mig_mode().map_err(|e| format!("MIG mode: {e}"))?;
    if change.disable {
        if mode.current == 0 {
            return Ok(());
        }
        mig_layout::set_layout(nvml, dev, &[]).map_err(|e| e.to_string())?;
        let status = dev
            .set_mig_mode(false)
            .map_err(|e| format!("MIG mode off: {e}"))?;
        if status == RESET_REQUIRED {
            // Leave it as it was: in MIG mode, its devices back.
            let _ = dev.set_mig_mode(true);
            let _ = mig_layout::restore(nvml, dev, &intent.before);
            return Err(needs_reset(false));
        }
        return Ok(());
    }
    if mode.current == 0 {
        let status = dev
            .set_mig_mode(true)
            .map_err(|e| format!("MIG mode on: {e}"))?;
        if status == RESET_REQUIRED {
            let _ = dev.set_mig_mode(false);
            return Err(needs_reset(true));
        }
    }
    mig_layout::set_layout(nvml, dev, &change.profiles).map_err(|e| e.to_string())
}

/// The old layout and mode back, after a change that could not finish.
fn put_back(dev: &Device, nvml: &Nvml, intent: &Intent) -> Result<(), String> {
    if intent.was_enabled {
        if dev.mig_mode().is_ok_and(|m| m.current == 0) {
            let _ = dev.set_mig_mode(true);
        }
        mig_layout::restore(nvml, dev, &intent.before).map_err(|e| e.to_string())
    } else {
        mig_layout::set_layout(nvml, dev, &[]).map_err(|e| e.to_string())?;
        dev.set_mig_mode(false)
            .map(|_| ())
            .map_err(|e| format!("MIG mode off: {e}"))
    }
}

fn needs_reset(on: bool) -> String {
    format!(
        "this GPU changes MIG mode only after a GPU reset, which gpuctl never does: MIG mode left {}; to change it, drain the agent, run `nvidia-smi -i <index> -mig {}` and reset the GPU (`nvidia-smi -r`), then start the agent again",
        if on { "off" } else { "on" },
        u8::from(on)
    )
}

/// `gpu` with the MIG state NVML reports now (as it was, if that cannot
/// be read).
fn read_back(nv: &Nvidia, nvml: &Nvml, dev: &Device, gpu: &GpuInfo) -> GpuInfo {
    let caps = CapsMinors::read(&nv.proc_root);
    let mut out = gpu.clone();
    match mig::read(nvml, dev, gpu.minor, &caps) {
        Ok(m) => out.mig = m,
        Err(e) => {
            tracing::warn!(gpu = %gpu.uuid, error = %e, "could not read the GPU's MIG state back");
        }
    }
    out
}

/// Who holds a device of a GPU among this agent's tasks, for a change
/// that must not touch a GPU with running work.
pub type InUse = Box<dyn Fn() -> BTreeSet<String> + Send + Sync>;

/// Called with the GPUs as they are after a change, to bring what depends
/// on them (task grants, the CDI spec) up to date.
pub type OnChange = Box<dyn Fn(&[GpuInfo]) + Send + Sync>;

/// The agent's side of layout changes: the GPUs as they are now (what a
/// registration reports), the results to report, the changes running.
pub struct Applier {
    nv: Nvidia,
    dir: PathBuf,
    gpus: Mutex<Vec<GpuInfo>>,
    results: Mutex<BTreeMap<String, Applied>>,
    running: Mutex<BTreeSet<String>>,
    in_use: InUse,
    on_change: OnChange,
}

impl Applier {
    /// `recovered`: what [`recover`] found, reported first.
    pub fn new(
        nv: Nvidia,
        dir: PathBuf,
        gpus: Vec<GpuInfo>,
        recovered: Vec<Applied>,
        in_use: InUse,
        on_change: OnChange,
    ) -> Arc<Applier> {
        Arc::new(Applier {
            nv,
            dir,
            gpus: Mutex::new(gpus),
            results: Mutex::new(
                recovered
                    .into_iter()
                    .map(|a| (a.gpu.uuid.clone(), a))
                    .collect(),
            ),
            running: Mutex::new(BTreeSet::new()),
            in_use,
            on_change,
        })
    }

    /// The GPUs as they are now.
    pub fn gpus(&self) -> Vec<GpuInfo> {
        lock(&self.gpus).clone()
    }

    /// The results the master has not recorded yet.
    pub fn results(&self) -> Vec<pb::MigResult> {
        lock(&self.results).values().map(Applied::to_pb).collect()
    }

    /// The master's changes under way on our GPUs (a heartbeat answer):
    /// results it no longer lists are recorded (forgotten here); a change
    /// neither running nor done starts, on a blocking thread.
    pub fn on_changes(self: &Arc<Self>, changes: &[pb::MigChange]) {
        let listed = |uuid: &str, generation: u64| {
            changes
                .iter()
                .any(|c| c.gpu_uuid == uuid && c.generation == generation)
        };
        lock(&self.results).retain(|uuid, a| listed(uuid, a.generation));
        for c in changes {
            let done = lock(&self.results)
                .get(&c.gpu_uuid)
                .is_some_and(|a| a.generation == c.generation);
            if done || !lock(&self.running).insert(c.gpu_uuid.clone()) {
                continue;
            }
            let me = self.clone();
            let change = Change::from(c);
            tokio::task::spawn_blocking(move || me.run(change));
        }
    }

    fn run(&self, change: Change) {
        let gpu = lock(&self.gpus)
            .iter()
            .find(|g| g.uuid == change.gpu_uuid)
            .cloned();
        let applied = match gpu {
            None => None,
            Some(gpu) => {
                let used = (self.in_use)();
                let holder = std::iter::once(&gpu.uuid)
                    .chain(gpu.mig.devices.iter().map(|d| &d.uuid))
                    .find(|u| used.contains(*u));
                Some(match holder {
                    // The master refuses a change of a GPU it knows held;
                    // this agent may know better (a task it still runs).
                    Some(u) => Applied {
                        generation: change.generation,
                        error: Some(format!(
                            "{u} is still in use by a task on the agent: the GPU was not changed"
                        )),
                        gpu,
                    },
                    None => {
                        tracing::info!(gpu = %gpu.uuid, generation = change.generation, profiles = ?change.profiles, disable = change.disable, "changing the GPU's MIG layout");
                        apply(&self.nv, &self.dir, &gpu, &change)
                    }
                })
            }
        };
        if let Some(a) = applied {
            match &a.error {
                None => {
                    tracing::info!(gpu = %a.gpu.uuid, devices = a.gpu.mig.devices.len(), "MIG layout changed")
                }
                Some(e) => {
                    tracing::warn!(gpu = %a.gpu.uuid, error = %e, "MIG layout change failed")
                }
            }
            let gpus = {
                let mut gpus = lock(&self.gpus);
                if let Some(g) = gpus.iter_mut().find(|g| g.uuid == a.gpu.uuid) {
                    g.mig = a.gpu.mig.clone();
                }
                gpus.clone()
            };
            (self.on_change)(&gpus);
            lock(&self.results).insert(a.gpu.uuid.clone(), a);
        }
        lock(&self.running).remove(&change.gpu_uuid);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
