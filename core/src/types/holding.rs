//! What one task holds of its agent's GPUs: whole GPUs or MIG devices,
//! each its own alone, or a fraction of one shared GPU, which it does not
//! own (its GPU's fractions are counted, not given). The one place that
//! says how a task's GPU UUIDs and its fraction go together, for the
//! state machine (owners, accounting) and the agent (isolation, the
//! driver cap, MPS); and, as [`Wants`], what a job asks to hold, for
//! placement, preemption and the launch check.

use super::{GpuFraction, GpuUuid, PlacementSpec};

/// What each task of a job asks to hold: the request side of [`Holding`].
/// A job asks one of the three; its `resources.gpus` says how many
/// devices (none for a fraction, which is not a device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wants<'a> {
    /// Whole GPUs (none for a CPU-only task).
    Whole,
    /// MIG devices of this profile (`1g.10gb`).
    Mig(&'a str),
    /// A fraction of one shared GPU.
    Fraction(GpuFraction),
}

impl<'a> Wants<'a> {
    /// From a placement's `mig` and `fraction`, which the wire check lets
    /// no job give both of (a fraction would win).
    pub fn of(mig: Option<&'a str>, fraction: Option<GpuFraction>) -> Wants<'a> {
        match (fraction, mig) {
            (Some(f), _) => Wants::Fraction(f),
            (None, Some(p)) => Wants::Mig(p),
            (None, None) => Wants::Whole,
        }
    }

    /// The MIG profile, when it asks for MIG devices.
    pub fn mig(self) -> Option<&'a str> {
        match self {
            Wants::Mig(p) => Some(p),
            Wants::Whole | Wants::Fraction(_) => None,
        }
    }

    /// The fraction, when it asks for one.
    pub fn fraction(self) -> Option<GpuFraction> {
        match self {
            Wants::Fraction(f) => Some(f),
            Wants::Whole | Wants::Mig(_) => None,
        }
    }

    /// GPUs or MIG devices a task needs on one node, given its
    /// `resources.gpus`: a fraction needs one shared GPU.
    pub fn devices(self, gpus: u32) -> usize {
        match self {
            Wants::Fraction(_) => 1,
            Wants::Whole | Wants::Mig(_) => gpus as usize,
        }
    }
}

impl PlacementSpec {
    /// What each of the job's tasks asks to hold.
    pub fn wants(&self) -> Wants<'_> {
        Wants::of(self.mig.as_deref(), self.fraction)
    }
}

/// `S`: what a fraction carries where it is read (the state's
/// `GpuFraction`, an agent's `TaskShare`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Holding<'a, S> {
    /// No GPU.
    Nothing,
    /// Whole GPUs or MIG devices, one UUID each, held by this task alone.
    Devices(&'a [GpuUuid]),
    /// A fraction of one shared GPU.
    Fraction { gpu: &'a GpuUuid, share: &'a S },
}

impl<'a, S> Holding<'a, S> {
    /// A task's holding from its GPU UUIDs and its fraction, if any (a
    /// fraction names its one GPU; without one it holds nothing).
    pub fn of(gpu_uuids: &'a [GpuUuid], share: Option<&'a S>) -> Holding<'a, S> {
        match (share, gpu_uuids.first()) {
            (Some(share), Some(gpu)) => Holding::Fraction { gpu, share },
            (Some(_), None) => Holding::Nothing,
            (None, _) if gpu_uuids.is_empty() => Holding::Nothing,
            (None, _) => Holding::Devices(gpu_uuids),
        }
    }

    /// The GPUs and MIG devices the task holds alone: none for a fraction.
    pub fn owned(&self) -> &'a [GpuUuid] {
        match self {
            Holding::Devices(d) => d,
            Holding::Nothing | Holding::Fraction { .. } => &[],
        }
    }

    /// The shared GPU and the fraction of it, for a fraction.
    pub fn fraction(&self) -> Option<(&'a GpuUuid, &'a S)> {
        match self {
            Holding::Fraction { gpu, share } => Some((gpu, share)),
            Holding::Nothing | Holding::Devices(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_asks_one_of_whole_mig_or_fraction() {
        let f = GpuFraction {
            mem_mib: 10_240,
            compute_pct: 25,
        };
        assert_eq!(Wants::of(None, None), Wants::Whole);
        assert_eq!(Wants::of(Some("1g.10gb"), None), Wants::Mig("1g.10gb"));
        assert_eq!(Wants::of(None, Some(f)), Wants::Fraction(f));
        assert_eq!(Wants::of(Some("1g.10gb"), Some(f)), Wants::Fraction(f));
        assert_eq!(Wants::Mig("1g.10gb").mig(), Some("1g.10gb"));
        assert_eq!(Wants::Fraction(f).mig(), None);
        assert_eq!(Wants::Fraction(f).fraction(), Some(f));
        assert_eq!(Wants::Whole.fraction(), None);
        assert_eq!(Wants::Whole.devices(4), 4);
        assert_eq!(Wants::Mig("1g.10gb").devices(2), 2);
        assert_eq!(Wants::Fraction(f).devices(0), 1);
    }

    #[test]
    fn a_fraction_owns_nothing_and_devices_are_owned_whole() {
        let gpus = vec!["GPU-0".to_string(), "GPU-1".to_string()];
        let one = vec!["GPU-0".to_string()];
        let whole: Holding<'_, u64> = Holding::of(&gpus, None);
        assert_eq!(whole.owned(), &gpus[..]);
        assert_eq!(whole.fraction(), None);
        let share = 10_240u64;
        let f = Holding::of(&one, Some(&share));
        assert!(f.owned().is_empty());
        assert_eq!(f.fraction(), Some((&one[0], &share)));
        assert_eq!(Holding::<u64>::of(&[], None), Holding::Nothing);
        assert_eq!(Holding::of(&[], Some(&share)), Holding::Nothing);
    }
}
