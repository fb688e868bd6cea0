//! Which driver files go into the volume. PURE: names only, no I/O.
//!
//! The lists follow libnvidia-container's `nvc_info.c` (the source Mesos's
//! NvidiaVolume copied), grouped by the driver capability each serves, so
//! that a caller could one day mount only what a task asks for.

use std::fmt;
use std::path::Path;

/// A driver capability, as in `NVIDIA_DRIVER_CAPABILITIES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    /// nvidia-smi and NVML.
    Utility,
    /// CUDA and OpenCL.
    Compute,
    /// Video encode and decode.
    Video,
    /// OpenGL, EGL, Vulkan, OptiX.
    Graphics,
}

impl Capability {
    pub const ALL: [Capability; 4] = [
        Capability::Utility,
        Capability::Compute,
        Capability::Video,
        Capability::Graphics,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Utility => "utility",
            Capability::Compute => "compute",
            Capability::Video => "video",
            Capability::Graphics => "graphics",
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A driver library, by its unversioned name (`libcuda.so`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Library {
    pub name: &'static str,
    pub capability: Capability,
}

/// A driver program, by the name it is run as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binary {
    pub name: &'static str,
    pub capability: Capability,
}

const fn lib(name: &'static str, capability: Capability) -> Library {
    Library { name, capability }
}

const fn bin(name: &'static str, capability: Capability) -> Binary {
    Binary { name, capability }
}

use Capability::{Compute, Graphics, Utility, Video};

/// The driver's user-space libraries. Vendor-neutral loaders (libGL.so,
/// libEGL.so, libGLX.so) are left out: images bring their own GLVND, and a
/// host's copy may belong to Mesa rather than NVIDIA.
pub const LIBRARIES: &[Library] = &[
    lib("libnvidia-ml.so", Utility),
    lib("libnvidia-cfg.so", Utility),
    lib("libcuda.so", Compute),
    lib("libcudadebugger.so", Compute),
    lib("libnvidia-opencl.so", Compute),
    lib("libnvidia-ptxjitcompiler.so", Compute),
    lib("libnvidia-fatbinaryloader.so", Compute),
    lib("libnvidia-allocator.so", Compute),
    lib("libnvidia-compiler.so", Compute),
    lib("libnvidia-nvvm.so", Compute),
    lib("libnvidia-pkcs11.so", Compute),
    lib("libvdpau_nvidia.so", Video),
    lib("libnvidia-encode.so", Video),
    lib("libnvidia-opticalflow.so", Video),
    lib("libnvcuvid.so", Video),
    lib("libnvidia-eglcore.so", Graphics),
    lib("libnvidia-glcore.so", Graphics),
    lib("libnvidia-tls.so", Graphics),
    lib("libnvidia-glsi.so", Graphics),
    lib("libnvidia-fbc.so", Graphics),
    lib("libnvidia-ifr.so", Graphics),
    lib("libnvidia-rtcore.so", Graphics),
    lib("libnvoptix.so", Graphics),
    lib("libGLX_nvidia.so", Graphics),
    lib("libEGL_nvidia.so", Graphics),
    lib("libGLESv2_nvidia.so", Graphics),
    lib("libGLESv1_CM_nvidia.so", Graphics),
    lib("libnvidia-glvkspirv.so", Graphics),
    lib("libnvidia-cbl.so", Graphics),
];

/// The driver's programs. nvidia-modprobe, nvidia-settings and
/// nvidia-xconfig are host administration tools and stay out.
pub const BINARIES: &[Binary] = &[
    bin("nvidia-smi", Utility),
    bin("nvidia-debugdump", Utility),
    bin("nvidia-persistenced", Utility),
    bin("nvidia-cuda-mps-control", Compute),
    bin("nvidia-cuda-mps-server", Compute),
];

/// Libraries that get an unversioned `.so` link in the volume even when the
/// driver root has none: code that links with `-lcuda` at run time (Triton,
/// PyTorch's inductor, numba) needs `libcuda.so`, which the NVIDIA container
/// toolkit also creates.
pub const ALWAYS_UNVERSIONED: &[&str] = &["libcuda.so"];

/// The manifest library that an ld.so cache name belongs to: the name is the
/// library's unversioned name, alone or followed by `.` and a version
/// (`libnvidia-ml.so.1` is `libnvidia-ml.so`; `libnvidia-ml.so1` is nothing).
pub fn library_for(name: &str) -> Option<&'static Library> {
    LIBRARIES.iter().find(|l| {
        name.strip_prefix(l.name)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    })
}

/// The manifest binary with this name.
pub fn binary(name: &str) -> Option<&'static Binary> {
    BINARIES.iter().find(|b| b.name == name)
}

/// One ld.so cache entry that names a driver library.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selected<'a> {
    /// The cache's key: usually the soname (`libnvidia-ml.so.1`).
    pub name: &'a str,
    /// Where the cache says it is.
    pub path: &'a Path,
    pub library: &'static Library,
}

/// The driver libraries among ld.so cache entries `(name, path)`, keeping
/// the cache's order (the loader's preference), restricted to the given
/// capabilities ([`Capability::ALL`] for the whole driver).
pub fn select_libraries<'a, I>(entries: I, capabilities: &[Capability]) -> Vec<Selected<'a>>
where
    I: IntoIterator<Item = (&'a str, &'a Path)>,
{
    entries
        .into_iter()
        .filter_map(|(name, path)| {
            let library = library_for(name)?;
            capabilities
                .contains(&library.capability)
                .then_some(Selected {
                    name,
                    path,
                    library,
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_only_the_library_or_a_dotted_version() {
        let cases: &[(&str, Option<&str>)] = &[
            ("libnvidia-ml.so.1", Some("libnvidia-ml.so")),
            ("libnvidia-ml.so.535.129.03", Some("libnvidia-ml.so")),
            ("libnvidia-ml.so", Some("libnvidia-ml.so")),
            ("libcuda.so", Some("libcuda.so")),
            ("libcuda.so.1", Some("libcuda.so")),
            ("libcudadebugger.so.1", Some("libcudadebugger.so")),
            ("libGLX_nvidia.so.0", Some("libGLX_nvidia.so")),
            (
                "libnvidia-glcore.so.535.129.03",
                Some("libnvidia-glcore.so"),
            ),
            ("libnvidia-glsi.so.535.129.03", Some("libnvidia-glsi.so")),
            ("libnvoptix.so.1", Some("libnvoptix.so")),
            // Look-alikes that are not the driver's.
            ("libnvidia-ml.so1", None),
            ("libcudart.so.12", None),
            ("libcuda.sox", None),
            ("libnvidia-gtk3.so.535.129.03", None),
            ("libGLX.so.0", None),
            ("libGL.so.1", None),
            ("libfoo.so.1", None),
            ("", None),
            ("libnvidia-ml", None),
        ];
        for (name, want) in cases {
            assert_eq!(library_for(name).map(|l| l.name), *want, "{name}");
        }
    }

    #[test]
    fn every_library_has_its_capability() {
        let cap = |n: &str| library_for(n).map(|l| l.capability);
        assert_eq!(cap("libnvidia-ml.so.1"), Some(Utility));
        assert_eq!(cap("libnvidia-cfg.so.1"), Some(Utility));
        assert_eq!(cap("libcuda.so.1"), Some(Compute));
        assert_eq!(cap("libnvidia-ptxjitcompiler.so.1"), Some(Compute));
        assert_eq!(cap("libnvcuvid.so.1"), Some(Video));
        assert_eq!(cap("libnvidia-encode.so.1"), Some(Video));
        assert_eq!(cap("libEGL_nvidia.so.0"), Some(Graphics));
        assert_eq!(cap("libnvidia-rtcore.so.535.129.03"), Some(Graphics));
        assert_eq!(LIBRARIES.len(), 29);
        assert_eq!(binary("nvidia-smi").map(|b| b.capability), Some(Utility));
        assert_eq!(
            binary("nvidia-cuda-mps-server").map(|b| b.capability),
            Some(Compute)
        );
        assert_eq!(binary("nvidia-settings"), None);
    }

    #[test]
    fn names_are_unique_and_no_name_shadows_another() {
        for (i, a) in LIBRARIES.iter().enumerate() {
            assert!(a.name.ends_with(".so"), "{}", a.name);
            for b in &LIBRARIES[i + 1..] {
                assert_ne!(a.name, b.name);
            }
            // Each name finds itself, not an earlier entry that is its prefix.
            assert_eq!(library_for(a.name), Some(a));
        }
        for (i, a) in BINARIES.iter().enumerate() {
            assert!(BINARIES[i + 1..].iter().all(|b| b.name != a.name));
        }
    }

    #[test]
    fn selection_keeps_cache_order_and_filters_by_capability() {
        let entries = [
            ("libfoo.so.1", Path::new("/usr/lib/libfoo.so.1")),
            (
                "libnvidia-ml.so.1",
                Path::new("/usr/lib64/libnvidia-ml.so.1"),
            ),
            ("libcuda.so.1", Path::new("/usr/lib64/libcuda.so.1")),
            ("libcuda.so.1", Path::new("/usr/lib/libcuda.so.1")),
            ("libcudart.so.12", Path::new("/usr/lib64/libcudart.so.12")),
            ("libnvcuvid.so.1", Path::new("/usr/lib64/libnvcuvid.so.1")),
        ];
        let all = select_libraries(entries, &Capability::ALL);
        let got: Vec<(&str, &Path)> = all.iter().map(|s| (s.name, s.path)).collect();
        assert_eq!(
            got,
            entries[1..4]
                .iter()
                .chain(&entries[5..])
                .copied()
                .collect::<Vec<_>>()
        );
        assert_eq!(all[0].library.name, "libnvidia-ml.so");

        let compute = select_libraries(entries, &[Compute]);
        let names: Vec<&str> = compute
            .iter()
            .map(|s| s.path.to_str().unwrap_or(""))
            .collect();
        assert_eq!(names, ["/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1"]);

        assert!(select_libraries(entries, &[]).is_empty());
    }
}
