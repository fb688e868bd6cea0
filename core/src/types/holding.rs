//! What one task holds of its agent's GPUs: whole GPUs or MIG devices,
//! each its own alone, or a fraction of one shared GPU, which it does not
//! own (its GPU's fractions are counted, not given). The one place that
//! says how a task's GPU UUIDs and its fraction go together, for the
//! state machine (owners, accounting) and the agent (isolation, the
//! driver cap, MPS).

use super::GpuUuid;

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
