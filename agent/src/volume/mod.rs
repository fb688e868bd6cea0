//! The consolidated NVIDIA driver volume, after Mesos's `NvidiaVolume` and
//! libnvidia-container.
//!
//! A CUDA image carries the CUDA runtime but not the driver: the driver's
//! user-space half (libcuda, NVML, nvidia-smi...) must match the host's
//! kernel module, so it comes from the host. The agent gathers those files
//! once per driver version into `<work_dir>/volumes/nvidia_<version>/`
//! (`bin`, `lib` for 32-bit, `lib64` for 64-bit) and mounts that directory
//! read-only at `/usr/local/nvidia` in GPU containers, with `PATH` and
//! `LD_LIBRARY_PATH` pointing into it. So any CUDA image runs on any driver.
//!
//! - [`manifest`] (PURE) says which libraries and programs are the driver's;
//! - [`ldcache`] reads the driver root's `/etc/ld.so.cache`, which says where
//!   they are (the same lookup the dynamic loader does);
//! - `build` resolves them inside the driver root, reads each library's ELF
//!   class, and hard-links (or copies) them into the volume. A volume only
//!   gains files, so running containers never see theirs change, and a new
//!   driver version gets a new directory beside the old one.
//!
//! See docs/driver-volume.md.

pub mod ldcache;
pub mod manifest;

mod build;

pub use build::{
    build, container_env, container_env_with, docker_bind, elf_class, resolve_in_root,
    validate_version, volume_path, DriverVolume, VolumeError, BIN_DIRS, CONTAINER_PATH,
    DEFAULT_PATH, IMAGE_LABEL,
};
pub use ldcache::ElfClass;
pub use manifest::Capability;
