//! Topology-aware choice of GPUs inside one node, scored like the NVIDIA
//! device plugin's `gpuallocator` "besteffort" policy.
//!
//! A pair of GPUs scores `100 * links` when NVLinked, else by PCIe path:
//! PIX 50 > PXB 40 > PHB 30 > NODE 20 > SYS 10 > unknown 0, plus
//! [`NUMA_BONUS`] when both sit on the same NUMA node. A set scores the sum of
//! its pairs. [`choose_gpus`] takes the set of `n` free GPUs with the highest
//! score; among ties (always for `n = 1`, where every set scores 0) the set
//! whose links to the free GPUs left over are weakest, so that NVLink pairs
//! and groups are not broken up when another choice is as good; then the
//! lowest indices. Without topology data every set ties and the lowest
//! indices win.

use gpuctl_core::types::GpuInfo;

/// Score of one NVLink link between two GPUs.
pub const NVLINK_SCORE: u64 = 100;
/// Bonus for two GPUs on the same NUMA node: less than the gap between two
/// PCIe levels, so it only breaks ties between equal paths.
pub const NUMA_BONUS: u64 = 5;
/// Sets to score exhaustively at most: C(16, 8). Beyond, a greedy choice.
pub const EXHAUSTIVE_LIMIT: u64 = 12_870;

/// Score of a PCIe path as `nvidia-smi topo -m` names it (case-insensitive).
pub fn pcie_score(path: &str) -> u64 {
    match path.to_ascii_uppercase().as_str() {
        "PIX" => 50,
        "PXB" => 40,
        "PHB" => 30,
        "NODE" => 20,
        "SYS" => 10,
        _ => 0,
    }
}

/// Score of the link between two GPUs of one node. Reads both GPUs' peer
/// lists and takes the better, so a link known from one side only counts.
pub fn pair_score(a: &GpuInfo, b: &GpuInfo) -> u64 {
    if a.uuid == b.uuid {
        return 0;
    }
    let peer = |x: &GpuInfo, y: &GpuInfo| {
        x.peers
            .iter()
            .filter(|p| p.uuid == y.uuid)
            .map(|p| (p.nvlinks, pcie_score(&p.pcie)))
            .max()
    };
    let (ab, ba) = (peer(a, b), peer(b, a));
    let nvlinks = ab.map_or(0, |l| l.0).max(ba.map_or(0, |l| l.0));
    let link = if nvlinks > 0 {
        NVLINK_SCORE * u64::from(nvlinks)
    } else {
        ab.map_or(0, |l| l.1).max(ba.map_or(0, |l| l.1))
    };
    let numa = match (a.numa_node, b.numa_node) {
        (Some(x), Some(y)) if x == y => NUMA_BONUS,
        _ => 0,
    };
    link + numa
}

/// Topology-aware choice of `n` GPUs among `free` (all on one node; `all` =
/// every GPU of the node: where a free GPU's entry in `all` carries more
/// topology, that entry is used). UUIDs in index order; `None` when fewer
/// than `n` distinct GPUs are free. Deterministic.
pub fn choose_gpus(free: &[&GpuInfo], all: &[GpuInfo], n: usize) -> Option<Vec<String>> {
    // Distinct candidates, by index then UUID; the richest description of each.
    let mut cands: Vec<&GpuInfo> = Vec::with_capacity(free.len());
    for &g in free {
        if cands.iter().any(|c| c.uuid == g.uuid) {
            continue;
        }
        let full = all
            .iter()
            .find(|a| a.uuid == g.uuid && a.peers.len() > g.peers.len())
            .unwrap_or(g);
        cands.push(full);
    }
    if cands.len() < n {
        return None;
    }
    cands.sort_by(|a, b| (a.index, &a.uuid).cmp(&(b.index, &b.uuid)));
    let k = cands.len();
    if n == 0 {
        return Some(Vec::new());
    }
    if n == k {
        return Some(cands.iter().map(|g| g.uuid.clone()).collect());
    }
    let mut score = vec![0u64; k * k];
    for i in 0..k {
        for j in i + 1..k {
            let s = pair_score(cands[i], cands[j]);
            score[i * k + j] = s;
            score[j * k + i] = s;
        }
    }
    // Sum of a GPU's links to every other free GPU: for a set, the links to
    // the GPUs left over are the sum of its members' row sums minus twice
    // its internal score.
    let rowsum: Vec<u64> = score.chunks(k).map(|row| row.iter().sum()).collect();

    let chosen = if binomial(k as u64, n as u64) <= EXHAUSTIVE_LIMIT {
        exhaustive(k, n, &score, &rowsum)
    } else {
        greedy(k, n, &score, &rowsum)
    };
    Some(chosen.into_iter().map(|i| cands[i].uuid.clone()).collect())
}

/// Every combination of `n` positions out of `k`, depth first in
/// lexicographic order with the sums kept along the way; the first one with
/// the best (internal score, fewest links left over) wins, so ties go to the
/// lowest indices.
fn exhaustive(k: usize, n: usize, score: &[u64], rowsum: &[u64]) -> Vec<usize> {
    struct Search<'s> {
        k: usize,
        n: usize,
        score: &'s [u64],
        rowsum: &'s [u64],
        set: Vec<usize>,
        best: Vec<usize>,
        best_key: Option<(u64, u64)>,
    }
    impl Search<'_> {
        fn go(&mut self, start: usize, internal: u64, rows: u64) {
            if self.set.len() == self.n {
                let outside = rows - 2 * internal;
                let better = match self.best_key {
                    None => true,
                    Some((bi, bo)) => internal > bi || (internal == bi && outside < bo),
                };
                if better {
                    self.best_key = Some((internal, outside));
                    self.best.clone_from(&self.set);
                }
                return;
            }
            let left = self.n - self.set.len();
            for i in start..=self.k - left {
                let row = &self.score[i * self.k..(i + 1) * self.k];
                let added: u64 = self.set.iter().map(|&j| row[j]).sum();
                self.set.push(i);
                self.go(i + 1, internal + added, rows + self.rowsum[i]);
                self.set.pop();
            }
        }
    }
    let mut search = Search {
        k,
        n,
        score,
        rowsum,
        set: Vec::with_capacity(n),
        best: (0..n).collect(),
        best_key: None,
    };
    search.go(0, 0, 0);
    search.best
}

/// Greedy fallback for nodes too large for the exhaustive search (more than
/// C(16, 8) candidate sets, i.e. more than 16 free GPUs): from each GPU as a
/// seed, add the GPU that adds most score (ties: weakest links to the rest,
/// then lowest index); keep the best of these sets by the same order as the
/// exhaustive search. Multi-start, so one group of NVLinked GPUs is found
/// whole even when another seed looks as good, but not optimal in general.
fn greedy(k: usize, n: usize, score: &[u64], rowsum: &[u64]) -> Vec<usize> {
    let s = |i: usize, j: usize| score[i * k + j];
    let mut best: Option<((u64, u64), Vec<usize>)> = None;
    let mut in_set = vec![false; k];
    for seed in 0..k {
        in_set.iter_mut().for_each(|x| *x = false);
        in_set[seed] = true;
        let mut set = vec![seed];
        let mut internal = 0u64;
        while set.len() < n {
            let mut pick: Option<(usize, u64, u64)> = None;
            for c in (0..k).filter(|&c| !in_set[c]) {
                let added: u64 = set.iter().map(|&m| s(c, m)).sum();
                // Links from c to the GPUs that stay outside.
                let rest = rowsum[c] - added;
                if pick.is_none_or(|(_, a, r)| added > a || (added == a && rest < r)) {
                    pick = Some((c, added, rest));
                }
            }
            let Some((c, added, _)) = pick else { break };
            in_set[c] = true;
            internal += added;
            set.push(c);
        }
        set.sort_unstable();
        let outside = set.iter().map(|&i| rowsum[i]).sum::<u64>() - 2 * internal;
        let better = match &best {
            None => true,
            Some(((bi, bo), bset)) => {
                internal > *bi
                    || (internal == *bi && (outside < *bo || (outside == *bo && set < *bset)))
            }
        };
        if better {
            best = Some(((internal, outside), set));
        }
    }
    best.map(|(_, set)| set).unwrap_or_default()
}

/// C(k, n), saturating at `u64::MAX`.
fn binomial(k: u64, n: u64) -> u64 {
    let n = n.min(k - n.min(k));
    let mut r: u64 = 1;
    for i in 0..n {
        // r * (k - i) / (i + 1) stays exact: r * (k - i) is divisible by i + 1.
        r = match r.checked_mul(k - i) {
            Some(v) => v / (i + 1),
            None => return u64::MAX,
        };
    }
    r
}

// Named so that `cargo test placement` runs these too.
#[cfg(test)]
pub(crate) mod placement_tests {
    use super::*;
    use gpuctl_core::types::GpuPeer;

    /// GPUs 0..n named "g0".. with no topology.
    fn gpus(n: u32) -> Vec<GpuInfo> {
        (0..n)
            .map(|i| GpuInfo::new(format!("g{i}"), i, "A100", 40960))
            .collect()
    }

    /// Symmetric link between GPUs `a` and `b`.
    pub(crate) fn link(g: &mut [GpuInfo], a: usize, b: usize, nvlinks: u32, pcie: &str) {
        let (ua, ub) = (g[a].uuid.clone(), g[b].uuid.clone());
        g[a].peers.retain(|p| p.uuid != ub);
        g[b].peers.retain(|p| p.uuid != ua);
        g[a].peers.push(GpuPeer {
            uuid: ub,
            nvlinks,
            pcie: pcie.into(),
        });
        g[b].peers.push(GpuPeer {
            uuid: ua,
            nvlinks,
            pcie: pcie.into(),
        });
    }

    /// Every pair linked by `pcie`, no NVLink.
    fn pcie_mesh(g: &mut [GpuInfo], pcie: &str) {
        for a in 0..g.len() {
            for b in a + 1..g.len() {
                link(g, a, b, 0, pcie);
            }
        }
    }

    fn refs<'a>(g: &'a [GpuInfo], idx: &[usize]) -> Vec<&'a GpuInfo> {
        idx.iter().map(|&i| &g[i]).collect()
    }

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// DGX-like: two quads, every pair inside a quad NVLinked twice, SYS
    /// between quads; NUMA 0 and 1.
    fn two_quads() -> Vec<GpuInfo> {
        let mut g = gpus(8);
        pcie_mesh(&mut g, "SYS");
        for q in [0usize, 4] {
            for a in q..q + 4 {
                g[a].numa_node = Some((q / 4) as u32);
                for b in a + 1..q + 4 {
                    link(&mut g, a, b, 2, "NODE");
                }
            }
        }
        g
    }

    #[test]
    fn pair_scores() {
        let mut g = gpus(3);
        link(&mut g, 0, 1, 2, "SYS");
        link(&mut g, 0, 2, 0, "pxb");
        assert_eq!(pair_score(&g[0], &g[1]), 200);
        assert_eq!(pair_score(&g[0], &g[2]), 40);
        assert_eq!(pair_score(&g[1], &g[2]), 0);
        assert_eq!(pair_score(&g[0], &g[0]), 0);
        g[1].numa_node = Some(1);
        g[2].numa_node = Some(1);
        assert_eq!(pair_score(&g[1], &g[2]), NUMA_BONUS);
        // A link listed on one side only still counts.
        g[1].peers.clear();
        assert_eq!(pair_score(&g[1], &g[0]), 200);
        for (p, s) in [
            ("PIX", 50),
            ("PXB", 40),
            ("PHB", 30),
            ("NODE", 20),
            ("SYS", 10),
            ("", 0),
        ] {
            assert_eq!(pcie_score(p), s);
        }
    }

    #[test]
    fn nvlink_pair_beats_a_pcie_pair() {
        // 0-1 share a PCIe switch (PIX); 2-3 are NVLinked across sockets.
        let mut g = gpus(4);
        pcie_mesh(&mut g, "SYS");
        link(&mut g, 0, 1, 0, "PIX");
        link(&mut g, 2, 3, 1, "SYS");
        let free = refs(&g, &[0, 1, 2, 3]);
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g2", "g3"])));
    }

    #[test]
    fn one_gpu_does_not_break_an_nvlink_pair() {
        // 0-1 NVLinked, 2-3 NVLinked but 3 is busy: a 1-GPU task takes 2.
        let mut g = gpus(4);
        pcie_mesh(&mut g, "PHB");
        link(&mut g, 0, 1, 4, "PHB");
        link(&mut g, 2, 3, 4, "PHB");
        let free = refs(&g, &[0, 1, 2]);
        assert_eq!(choose_gpus(&free, &g, 1), Some(names(&["g2"])));
        // All four free: nothing to spare, lowest index.
        let free = refs(&g, &[0, 1, 2, 3]);
        assert_eq!(choose_gpus(&free, &g, 1), Some(names(&["g0"])));
        // The same for a pair: 2 GPUs out of 0,1,2 take the NVLink pair.
        let free = refs(&g, &[0, 1, 2]);
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g0", "g1"])));
    }

    #[test]
    fn four_of_eight_take_one_quad() {
        let g = two_quads();
        let all: Vec<&GpuInfo> = g.iter().collect();
        assert_eq!(
            choose_gpus(&all, &g, 4),
            Some(names(&["g0", "g1", "g2", "g3"]))
        );
        // GPU 1 busy: the intact quad.
        let free = refs(&g, &[0, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            choose_gpus(&free, &g, 4),
            Some(names(&["g4", "g5", "g6", "g7"]))
        );
        // 2 GPUs with 1 busy: take from the broken quad, keep the other whole.
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g0", "g2"])));
        // 1 GPU with quad 0 holding three free: the broken quad again.
        assert_eq!(choose_gpus(&free, &g, 1), Some(names(&["g0"])));
        let free = refs(&g, &[0, 1, 2, 3, 4, 5]);
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g4", "g5"])));
    }

    #[test]
    fn no_topology_means_lowest_indices() {
        let g = gpus(6);
        let free = refs(&g, &[5, 3, 1, 4]);
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g1", "g3"])));
        assert_eq!(choose_gpus(&free, &g, 0), Some(vec![]));
        assert_eq!(choose_gpus(&free, &g, 4).map(|v| v.len()), Some(4));
        assert_eq!(choose_gpus(&free, &g, 5), None);
        // Duplicates count once.
        let free = refs(&g, &[1, 1]);
        assert_eq!(choose_gpus(&free, &g, 2), None);
    }

    #[test]
    fn peers_known_only_from_all() {
        // The free list's copies carry no topology; `all` does.
        let mut g = gpus(4);
        link(&mut g, 1, 3, 2, "SYS");
        let bare = gpus(4);
        let free = refs(&bare, &[0, 1, 2, 3]);
        assert_eq!(choose_gpus(&free, &g, 2), Some(names(&["g1", "g3"])));
    }

    #[test]
    fn greedy_beyond_the_exhaustive_limit() {
        // 32 GPUs in 4 NVLinked octets, 8 wanted: C(32, 8) sets is too many.
        let mut g = gpus(32);
        pcie_mesh(&mut g, "SYS");
        for o in 0..4 {
            for a in o * 8..o * 8 + 8 {
                for b in a + 1..o * 8 + 8 {
                    link(&mut g, a, b, 1, "NODE");
                }
            }
        }
        assert!(binomial(32, 8) > EXHAUSTIVE_LIMIT);
        let free: Vec<&GpuInfo> = g.iter().filter(|x| x.index != 3).collect();
        let got = choose_gpus(&free, &g, 8).unwrap();
        let want: Vec<String> = (8..16).map(|i| format!("g{i}")).collect();
        assert_eq!(got, want);
        assert_eq!(choose_gpus(&free, &g, 1), Some(names(&["g0"])));
    }

    #[test]
    fn binomials() {
        assert_eq!(binomial(16, 8), 12_870);
        assert_eq!(binomial(5, 0), 1);
        assert_eq!(binomial(5, 5), 1);
        assert_eq!(binomial(40, 20), 137_846_528_820);
        assert_eq!(binomial(200, 100), u64::MAX);
    }
}
