//! The pods' sizes: the openb trace's GPU pods as a gpumem user would ask for them
//! (`gpumem::sim::realistic`, shared with `gpumem simulate --mix realistic`), offered in an endless
//! seeded order.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_pcg::Pcg64Mcg;

pub use gpumem::sim::realistic::{Kind, OPENB_GPU_MIB, Size, read};

/// An endless sequence of the trace's sizes in a seeded random order: each pass over the trace is a
/// new shuffle of it.
pub struct Sampler {
    sizes: Vec<Size>,
    next: usize,
    rng: Pcg64Mcg,
}

impl Sampler {
    pub fn new(sizes: Vec<Size>, seed: u64) -> Self {
        let mut rng = Pcg64Mcg::seed_from_u64(seed);
        let mut sizes = sizes;
        sizes.shuffle(&mut rng);
        Self { sizes, next: 0, rng }
    }

    pub fn next_size(&mut self) -> Size {
        if self.next == self.sizes.len() {
            self.sizes.shuffle(&mut self.rng);
            self.next = 0;
        }
        self.next += 1;
        self.sizes[self.next - 1]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_is_seeded_and_covers_each_pass() {
        let sizes: Vec<Size> = (1..=10).map(|mib| Size::Share { mib }).collect();
        let take = |seed| {
            let mut s = Sampler::new(sizes.clone(), seed);
            (0..20).map(|_| s.next_size()).collect::<Vec<_>>()
        };
        let a = take(7);
        assert_eq!(a, take(7));
        assert_ne!(a, take(8));
        let mut first: Vec<Size> = a[..10].to_vec();
        first.sort_by_key(|s| s.label());
        let mut all = sizes.clone();
        all.sort_by_key(|s| s.label());
        assert_eq!(first, all);
    }
}
