//! Which kernels run: detected at run time, capped by `PAGEDRS_CPU_ISA`, or chosen by the caller.

use super::QuantType;

/// Which kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// The AVX2 kernels, with AVX-512 VNNI (on 256-bit vectors, AVX512VL) in the x8 ones.
    #[cfg(target_arch = "x86_64")]
    Avx512Vnni,
    /// aarch64 Advanced SIMD (baseline Armv8).
    #[cfg(target_arch = "aarch64")]
    Neon,
    /// Advanced SIMD with the Armv8.2 `dotprod` extension.
    #[cfg(target_arch = "aarch64")]
    NeonDot,
}

impl Isa {
    /// The best kernels this CPU runs.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        for isa in [Isa::Avx512Vnni, Isa::Avx2] {
            if isa.is_supported() {
                return isa;
            }
        }
        #[cfg(target_arch = "aarch64")]
        for isa in [Isa::NeonDot, Isa::Neon] {
            if isa.is_supported() {
                return isa;
            }
        }
        Isa::Portable
    }

    /// The kernels the matmuls run by default: `PAGEDRS_CPU_ISA` when it names kernels this CPU runs (a
    /// cap for comparisons, as oneDNN's `ONEDNN_MAX_CPU_ISA`: "avx2" on an AVX-512 VNNI CPU, or
    /// "portable"), else `detect()`. Read once per process.
    pub fn chosen() -> Isa {
        static CHOSEN: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *CHOSEN.get_or_init(|| {
            std::env::var("PAGEDRS_CPU_ISA")
                .ok()
                .and_then(|name| Isa::by_name(&name))
                .filter(|isa| isa.is_supported())
                .unwrap_or_else(Isa::detect)
        })
    }

    /// The kernel set called `name` (`Isa::name`) on this architecture.
    pub fn by_name(name: &str) -> Option<Isa> {
        Isa::ALL.iter().copied().find(|isa| isa.name() == name)
    }

    /// These kernels where this CPU runs them, else the nearest ones below that it runs (AVX-512 VNNI ->
    /// AVX2 -> portable; NEON dotprod -> NEON -> portable).
    pub fn or_supported(self) -> Isa {
        let below = match self {
            Isa::Portable => return Isa::Portable,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => Isa::Avx2,
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => Isa::Neon,
            #[allow(unreachable_patterns)]
            _ => Isa::Portable,
        };
        if self.is_supported() {
            self
        } else {
            below.or_supported()
        }
    }

    /// Whether this CPU runs the kernels.
    pub fn is_supported(self) -> bool {
        match self {
            Isa::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => {
                Isa::Avx2.is_supported()
                    && std::is_x86_feature_detected!("avx512vl")
                    && std::is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => {
                std::arch::is_aarch64_feature_detected!("neon")
                    && std::arch::is_aarch64_feature_detected!("dotprod")
            }
        }
    }

    /// Every kernel set of this architecture, from the portable one to the best.
    pub const ALL: &'static [Isa] = &[
        Isa::Portable,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni,
        #[cfg(target_arch = "aarch64")]
        Isa::Neon,
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDot,
    ];

    /// Every kernel set this CPU runs, the portable one first and the best last.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL
            .iter()
            .copied()
            .filter(|isa| isa.is_supported())
            .collect()
    }

    /// Whether the kernels take groups of 8 activation rows for `qt` (the AVX2 block-group kernels).
    pub(super) fn takes_eight_rows(self, qt: QuantType) -> bool {
        #[cfg(target_arch = "x86_64")]
        if self.is_x86() {
            return matches!(
                qt,
                QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q8_0 | QuantType::MXFP4
            );
        }
        let _ = qt;
        false
    }

    /// The AVX2 kernels (with or without VNNI in the x8 ones).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn is_x86(self) -> bool {
        matches!(self, Isa::Avx2 | Isa::Avx512Vnni)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vnni => "avx512-vnni",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "neon",
            #[cfg(target_arch = "aarch64")]
            Isa::NeonDot => "neon-dotprod",
        }
    }
}
