//! The simulated prefill compute of a `--layerwise` phase ([`Forwards`]): the rooms'
//! forward passes one after another on the scheduler thread, layer by layer, each layer
//! enqueued as it is computed or each chunk after its last layer.

use std::collections::VecDeque;

use kvxfer::{Engine, State};

use crate::ctl::{Computed, PrefillRoom};
use crate::params::{Feed, Params};
use crate::sys::mono_ns;

/// A room waiting for, or in, its simulated forward pass.
struct Forward {
    idx: usize,
    id: u64,
    chunks: Vec<Vec<u32>>,
    aux: Option<u32>,
    /// When it was created (it can start no earlier).
    queued: u64,
    /// When its first layer's compute began (0: not yet).
    start: u64,
    /// Layers computed, over every chunk.
    done: usize,
    /// Whether one of its calls reached the engine.
    enqueued: bool,
    late: Vec<u64>,
}

/// The simulated prefill compute of a phase (`--layerwise`): one room at a time, each
/// chunk's layers in turn, `compute_us_per_layer` each, on a compute timeline of
/// absolute deadlines (a layer ends `compute_us_per_layer` after the previous one ended,
/// as on a GPU that runs the queued layers back to back; the scheduler thread sleeps
/// until that end and learns of it when it wakes). After each layer: layer-wise, its
/// buffers are enqueued at once (`enqueue_layers`); whole-chunk, after a chunk's last
/// layer, the chunk (`enqueue_chunk`).
pub(super) struct Forwards {
    feed: Feed,
    layers: usize,
    per_layer: usize,
    queue: VecDeque<Forward>,
    /// Where the compute timeline is free: the end of the last layer computed.
    free_at: u64,
}

impl Forwards {
    pub(super) fn new(p: &Params, feed: Feed) -> Forwards {
        Forwards {
            feed,
            layers: p.layers,
            per_layer: p.buffers_per_layer(),
            queue: VecDeque::new(),
            free_at: 0,
        }
    }

    /// Queues room `id` (record `idx`, created at `queued`) for its compute: its source
    /// pages in chunks, and its aux slot.
    pub(super) fn queue(
        &mut self,
        (idx, id): (usize, u64),
        chunks: Vec<Vec<u32>>,
        aux: Option<u32>,
        queued: u64,
    ) {
        self.queue.push_back(Forward {
            idx,
            id,
            chunks,
            aux,
            queued,
            start: 0,
            done: 0,
            enqueued: false,
            late: Vec::new(),
        });
    }

    /// Finishes every layer whose compute has ended: enqueues what it completes, and
    /// retires the room whose last layer it was (its record gets the compute). Returns
    /// whether anything happened, and the end of the layer being computed, if one is.
    pub(super) fn step(
        &mut self,
        engine: &Engine,
        recs: &mut [PrefillRoom],
    ) -> (bool, Option<u64>) {
        let per_layer_ns = self.feed.compute_us_per_layer * 1000;
        let mut progress = false;
        while let Some(f) = self.queue.front_mut() {
            if f.start == 0 {
                f.start = self.free_at.max(f.queued);
                progress = true;
            }
            let due = f.start + (f.done as u64 + 1) * per_layer_ns;
            let now = mono_ns();
            if now < due {
                return (progress, Some(due));
            }
            progress = true;
            f.late.push(now - due);
            let (chunk, layer) = (f.done / self.layers, f.done % self.layers);
            f.done += 1;
            let last = f.done == f.chunks.len() * self.layers;
            let aux = if last { f.aux } else { None };
            let pages = &f.chunks[chunk];
            let r = if self.feed.by_layer {
                let n = self.per_layer as u32;
                Some(engine.enqueue_layers(f.id, pages, layer as u32 * n, n, last, aux))
            } else if layer + 1 == self.layers {
                Some(engine.enqueue_chunk(f.id, pages, chunk + 1 == f.chunks.len(), aux))
            } else {
                None
            };
            if r.is_some() && !f.enqueued {
                // The room's first enqueue (`t_enq`): as the thread woke to make it.
                f.enqueued = true;
                recs[f.idx].t_enq = now;
            }
            let failed = match r {
                Some(Err(e)) => {
                    // The room failed (an abort) or the call was refused: the request is
                    // gone, its compute stops. A refusal fails the room with the reason;
                    // an error that did not, fails it here.
                    if engine.room_poll(f.id).ok() != Some(State::Failed) {
                        eprintln!("kvxfer-bench prefill: room {}: {e}", f.id);
                        let _ = engine.room_abort(f.id, &format!("bench: enqueue failed: {e}"));
                    }
                    true
                }
                _ => false,
            };
            if last || failed {
                self.free_at = due;
                let f = self.queue.pop_front().expect("the front");
                recs[f.idx].compute = Some(Computed {
                    start: f.start,
                    end: now,
                    late_ns: f.late,
                });
            }
        }
        (progress, None)
    }

    /// Room `id` ended before its compute did: the rest of its compute is dropped, as a
    /// server drops a finished request (the layer it was computing still runs to its
    /// end, and the timeline is free from there).
    pub(super) fn drop_room(&mut self, id: u64, recs: &mut [PrefillRoom]) {
        let Some(i) = self.queue.iter().position(|f| f.id == id) else {
            return;
        };
        let f = self.queue.remove(i).expect("found");
        if f.start != 0 {
            self.free_at = f.start + (f.done as u64 + 1) * self.feed.compute_us_per_layer * 1000;
            recs[f.idx].compute = Some(Computed {
                start: f.start,
                end: 0,
                late_ns: f.late,
            });
        }
    }
}
