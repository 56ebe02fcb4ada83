//! How a node's device configuration turns a GPU's physical size into the size the scheduler
//! shares out (HAMi's `deviceMemoryScaling` and `deviceCoreScaling`, applied by the device plugin
//! when it registers the GPU). The scheduler never sees the physical size: a scaling of 1.5 on an
//! 80 GiB GPU lets reservations add up to 120 GiB there, and HAMi-core pages the excess to host
//! memory. MIG GPUs are never scaled.

/// The memory a GPU of `total_mib` is published with: the product truncated to whole MiB, as
/// HAMi's `int32(float64(MiB) × scaling)`.
pub fn memory(total_mib: u64, scaling: f64, mig: bool) -> u64 {
    if mig || scaling == 1.0 {
        return total_mib;
    }
    (total_mib as f64 * scaling) as u64
}

/// The cores a GPU is published with: 100 × the scaling, truncated (100 for MIG).
pub fn cores(scaling: f64, mig: bool) -> u32 {
    if mig {
        return 100;
    }
    (100.0 * scaling) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncates_like_hami_and_leaves_mig_alone() {
        assert_eq!(memory(81920, 1.0, false), 81920);
        assert_eq!(memory(15360, 1.5, false), 23040);
        assert_eq!(memory(1001, 1.5, false), 1501);
        assert_eq!(memory(1001, 0.5, false), 500);
        assert_eq!(memory(15360, 1.5, true), 15360);
        assert_eq!(
            (cores(2.0, false), cores(0.333, false), cores(2.0, true)),
            (200, 33, 100)
        );
    }
}
