//! When a prefill room is complete: its last chunk was planned and every batch planned
//! for it ended (written, skipped or failed); then the Done of each destination goes
//! out, once. Pure: the engine's senders and planners apply it (`send.rs`,
//! `sender.rs`), and the simulator drives it too (`src/engine/sim/`).

/// A room's batches and its Done frames (`F`: one per destination).
pub(crate) struct Completion<F> {
    /// Batches planned and not yet ended, all chunks.
    outstanding: usize,
    /// The last chunk was planned: the room completes when `outstanding` reaches 0.
    sealed: bool,
    /// The Done of each destination, taken by whoever completes the room, so that only
    /// one does.
    finishes: Vec<F>,
}

impl<F> Default for Completion<F> {
    fn default() -> Self {
        Completion {
            outstanding: 0,
            sealed: false,
            finishes: Vec::new(),
        }
    }
}

impl<F> Completion<F> {
    /// `n` batches of a chunk were planned; with `last`, it is the room's last chunk and
    /// these are the Dones of its destinations.
    pub fn planned(&mut self, n: usize, last: Option<Vec<F>>) {
        self.outstanding += n;
        if let Some(finishes) = last {
            self.sealed = true;
            self.finishes = finishes;
        }
    }

    /// One batch ended.
    pub fn ended(&mut self) {
        self.outstanding -= 1;
    }

    /// The Dones to send if the room is complete now; taken, so that the next caller
    /// gets none.
    pub fn due(&mut self) -> Option<Vec<F>> {
        if !self.sealed || self.outstanding > 0 || self.finishes.is_empty() {
            return None;
        }
        Some(std::mem::take(&mut self.finishes))
    }
}

#[cfg(test)]
mod tests {
    use super::Completion;

    #[test]
    fn a_room_completes_once_after_its_last_chunk_and_every_batch() {
        let mut c = Completion::default();
        c.planned(2, None);
        c.ended();
        c.ended();
        // Every batch ended, but the last chunk is still to come.
        assert_eq!(c.due(), None);
        c.planned(1, Some(vec!["done to d0", "done to d1"]));
        assert_eq!(c.due(), None);
        c.ended();
        assert_eq!(c.due(), Some(vec!["done to d0", "done to d1"]));
        assert_eq!(c.due(), None, "only one caller sends the Dones");
    }

    #[test]
    fn a_last_chunk_with_no_batch_completes_at_once() {
        let mut c = Completion::default();
        c.planned(0, Some(vec![1]));
        assert_eq!(c.due(), Some(vec![1]));
    }
}
