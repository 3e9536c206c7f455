//! A small deterministic generator for the random moments and shapes of a test.

/// xorshift64 (shifts 13, 7, 17): the same seed gives the same sequence.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Spins for a number of iterations below `n`: a random moment, shorter than a
    /// sleep can be.
    pub fn spin_below(&mut self, n: u64) {
        for _ in 0..self.below(n) {
            std::hint::spin_loop();
        }
    }
}
