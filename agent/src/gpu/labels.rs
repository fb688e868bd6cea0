//! Agent attributes from its GPUs, named as NVIDIA's GPU feature discovery
//! names its node labels, so that constraints read the same as on
//! Kubernetes (`nvidia.com/gpu.product=NVIDIA-A100-SXM4-40GB`, ...).

use std::collections::{BTreeMap, BTreeSet};

use gpuctl_core::types::GpuInfo;

/// The architecture family of a compute capability, as GFD's `gpu.family`.
pub fn family(cc: (u32, u32)) -> &'static str {
    match cc {
        (1, _) => "tesla",
        (2, _) => "fermi",
        (3, _) => "kepler",
        (5, _) => "maxwell",
        (6, _) => "pascal",
        (7, 0) | (7, 2) => "volta",
        (7, 5) => "turing",
        (8, 9) => "ada-lovelace",
        (8, _) => "ampere",
        (9, _) => "hopper",
        (10, _) | (12, _) => "blackwell",
        _ => "undefined",
    }
}

fn product(model: &str) -> String {
    model.trim().replace(' ', "-")
}

/// Labels for a host's GPUs. On a host with several models, `gpu.product`
/// lists them comma separated and `gpu.memory` is the smallest memory, so a
/// constraint never promises more than every GPU has.
pub fn labels(
    gpus: &[GpuInfo],
    driver: Option<&str>,
    cuda: Option<&str>,
) -> BTreeMap<String, String> {
    let mut l = BTreeMap::new();
    let mut put = |k: &str, v: String| {
        l.insert(format!("nvidia.com/{k}"), v);
    };
    put("gpu.count", gpus.len().to_string());
    if !gpus.is_empty() {
        let products: BTreeSet<String> = gpus.iter().map(|g| product(&g.model)).collect();
        put(
            "gpu.product",
            products.into_iter().collect::<Vec<_>>().join(","),
        );
        if let Some(mem) = gpus.iter().map(|g| g.memory_mib).min() {
            put("gpu.memory", mem.to_string());
        }
        if let Some(cc) = gpus.iter().filter_map(|g| g.compute_capability).min() {
            put("gpu.compute.major", cc.0.to_string());
            put("gpu.compute.minor", cc.1.to_string());
            put("gpu.family", family(cc).to_string());
        }
    }
    if let Some(d) = driver {
        put("gpu.driver-version.full", d.to_string());
        let mut parts = d.split('.');
        if let Some(m) = parts.next() {
            put("gpu.driver-version.major", m.to_string());
        }
        if let Some(m) = parts.next() {
            put("gpu.driver-version.minor", m.to_string());
        }
        if let Some(r) = parts.next() {
            put("gpu.driver-version.revision", r.to_string());
        }
    }
    if let Some(c) = cuda {
        put("cuda.driver-version.full", c.to_string());
        if let Some((a, b)) = c.split_once('.') {
            put("cuda.driver-version.major", a.to_string());
            put("cuda.driver-version.minor", b.to_string());
        }
    }
    l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_of_a_homogeneous_host() {
        let mut g = GpuInfo::new("GPU-1", 0, "NVIDIA A100-SXM4-40GB", 40960);
        g.compute_capability = Some((8, 0));
        let l = labels(&[g.clone(), g], Some("535.129.03"), Some("12.2"));
        assert_eq!(l["nvidia.com/gpu.product"], "NVIDIA-A100-SXM4-40GB");
        assert_eq!(l["nvidia.com/gpu.count"], "2");
        assert_eq!(l["nvidia.com/gpu.memory"], "40960");
        assert_eq!(l["nvidia.com/gpu.family"], "ampere");
        assert_eq!(l["nvidia.com/gpu.compute.major"], "8");
        assert_eq!(l["nvidia.com/gpu.driver-version.major"], "535");
        assert_eq!(l["nvidia.com/gpu.driver-version.revision"], "03");
        assert_eq!(l["nvidia.com/cuda.driver-version.minor"], "2");
    }

    #[test]
    fn mixed_host_lists_products_and_smallest_memory() {
        let mut v = GpuInfo::new("GPU-1", 0, "Tesla V100-SXM2-16GB", 16384);
        v.compute_capability = Some((7, 0));
        let mut t = GpuInfo::new("GPU-2", 1, "Tesla T4", 15360);
        t.compute_capability = Some((7, 5));
        let l = labels(&[v, t], None, None);
        assert_eq!(l["nvidia.com/gpu.product"], "Tesla-T4,Tesla-V100-SXM2-16GB");
        assert_eq!(l["nvidia.com/gpu.memory"], "15360");
        assert_eq!(l["nvidia.com/gpu.family"], "volta");
        assert!(!l.contains_key("nvidia.com/gpu.driver-version.full"));
        assert_eq!(labels(&[], None, None)["nvidia.com/gpu.count"], "0");
    }

    #[test]
    fn families() {
        assert_eq!(family((9, 0)), "hopper");
        assert_eq!(family((8, 9)), "ada-lovelace");
        assert_eq!(family((7, 5)), "turing");
        assert_eq!(family((99, 0)), "undefined");
    }
}
