//! Chunks enqueued layer by layer (`kvxfer_enqueue_layers`): which buffers a range of
//! layers names, and which token chunk each call belongs to.
//!
//! A call names a chunk by its source pages: the first call with a page list opens a
//! chunk (it takes the next destination pages, as a whole chunk does), later calls with
//! the same list add layers to it until it has all of them. A layer enqueued twice for
//! one chunk, a page list that overlaps an open chunk's without being it, and a room
//! closed (`is_last`) while a chunk still misses a layer are refused with a reason that
//! names the chunk and the layer; the engine fails the room with it. The room state
//! machine does not change: each call is a chunk to plan, in order.
//!
//! Calls that wait to be planned join ([`join`]): while a room's earlier chunks are
//! being planned, or its batches are still queued for a sender, the layers that come are
//! planned together once a sender takes the room's queued batches down to one, so a link
//! that falls behind the compute gets whole batches, not one small job per layer. A layer
//! is never held for a later one: with (at most one batch) of its room queued, it is
//! planned at once.

use std::collections::VecDeque;
use std::sync::Arc;

use super::Chunk;
use crate::transport::Memory;

/// The kv buffers that layers `first .. first + count` name, as a mask over the
/// engine's buffers: with layer ids, every buffer of each of those ids (each must have
/// one); without, the buffers at those positions. Or why the range names none.
pub(crate) fn buffers_of(kv: &Memory, first: u32, count: u32) -> Result<Vec<bool>, String> {
    let n = kv.buffers().len();
    if count == 0 {
        return Err("layer_count is 0".into());
    }
    let end = first
        .checked_add(count)
        .ok_or_else(|| format!("layers {first} + {count} overflow"))?;
    let by_id = (0..n).any(|b| kv.layer(b).is_some());
    let mask: Vec<bool> = (0..n)
        .map(|b| {
            let l = if by_id { kv.layer(b) } else { Some(b as u32) };
            l.is_some_and(|l| (first..end).contains(&l))
        })
        .collect();
    if let Some(l) = (first..end).find(|&l| {
        !(0..n).any(|b| mask[b] && (if by_id { kv.layer(b) } else { Some(b as u32) }) == Some(l))
    }) {
        return Err(if by_id {
            format!("layer {l} has no kv buffer registered on this engine")
        } else {
            format!(
                "layer {l} is out of range: without layer ids a layer is a kv buffer's position, \
                 and this engine registered {n}"
            )
        });
    }
    Ok(mask)
}

/// The layer a buffer belongs to, for messages.
pub(crate) fn layer_of(kv: &Memory, buffer: usize) -> u32 {
    kv.layer(buffer).unwrap_or(buffer as u32)
}

/// Queues `chunk` behind those of `queue`, in order: a layer call of the chunk at the
/// back of the queue (the same source pages at the same place) joins it, as one call of
/// both calls' layers (the last call's `is_last`, aux slot and total with it). A whole
/// chunk, or layers of another chunk, go behind.
pub(crate) fn join(queue: &mut VecDeque<Chunk>, chunk: Chunk) {
    if let Some(back) = queue.back_mut() {
        if let (Some(a), Some(b)) = (&back.buffers, &chunk.buffers) {
            if back.pages == chunk.pages && back.start == chunk.start && !back.is_last {
                let both: Arc<[bool]> = a.iter().zip(b.iter()).map(|(x, y)| *x || *y).collect();
                back.buffers = Some(both);
                back.is_last = chunk.is_last;
                back.aux = chunk.aux.or(back.aux);
                back.total = chunk.total.or(back.total);
                return;
            }
        }
    }
    queue.push_back(chunk);
}

/// Where a call's chunk goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placed {
    /// The chunk's first position in the room's source pages (so in its destination).
    pub start: usize,
    /// On the call that closes the room: the source pages of the whole room.
    pub total: Option<usize>,
}

/// A chunk some of whose layers were enqueued.
#[derive(Debug)]
struct Open {
    /// Chunks are numbered from 0 in the order they opened.
    index: usize,
    pages: Vec<u32>,
    start: usize,
    /// Per kv buffer: enqueued.
    sent: Vec<bool>,
}

/// A prefill room's chunks, as the scheduler enqueued them.
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    opened: usize,
    /// Source pages of the chunks opened so far.
    pages: usize,
    open: Vec<Open>,
}

impl Chunks {
    /// Admits a call that enqueues the buffers of `mask` (`None`: every buffer, a whole
    /// chunk, always a new one) of the chunk of source `pages`, closing the room if
    /// `is_last`; `layer` names a buffer's layer. Or why the room must fail.
    pub fn admit(
        &mut self,
        pages: &[u32],
        mask: Option<&[bool]>,
        is_last: bool,
        layer: impl Fn(usize) -> u32,
    ) -> Result<Placed, String> {
        let name = |index: usize, pages: &[u32]| {
            format!(
                "chunk {index} ({} pages from source page {})",
                pages.len(),
                pages.first().map_or("-".to_string(), |p| p.to_string())
            )
        };
        let start = match mask {
            Some(mask) if !pages.is_empty() => {
                if let Some(i) = self.open.iter().position(|o| o.pages == pages) {
                    let o = &mut self.open[i];
                    if let Some(b) = (0..mask.len()).find(|&b| mask[b] && o.sent[b]) {
                        return Err(format!(
                            "{}: layer {} was already enqueued",
                            name(o.index, &o.pages),
                            layer(b)
                        ));
                    }
                    for (s, &m) in o.sent.iter_mut().zip(mask) {
                        *s |= m;
                    }
                    let start = o.start;
                    if o.sent.iter().all(|&s| s) {
                        self.open.remove(i);
                    }
                    start
                } else {
                    if let Some(o) = self
                        .open
                        .iter()
                        .find(|o| o.pages.iter().any(|p| pages.contains(p)))
                    {
                        return Err(format!(
                            "source pages {pages:?} overlap those of {} without being them: \
                             the layers of one chunk are enqueued with the same page list",
                            name(o.index, &o.pages)
                        ));
                    }
                    let start = self.open_chunk(pages.len());
                    if !mask.iter().all(|&m| m) {
                        self.open.push(Open {
                            index: self.opened - 1,
                            pages: pages.to_vec(),
                            start,
                            sent: mask.to_vec(),
                        });
                    }
                    start
                }
            }
            _ => self.open_chunk(pages.len()),
        };
        if !is_last {
            return Ok(Placed { start, total: None });
        }
        if let Some(o) = self.open.first() {
            let missing = (0..o.sent.len()).find(|&b| !o.sent[b]).unwrap_or(0);
            return Err(format!(
                "the room was closed (is_last) while {} misses layer {}",
                name(o.index, &o.pages),
                layer(missing)
            ));
        }
        Ok(Placed {
            start,
            total: Some(self.pages),
        })
    }

    fn open_chunk(&mut self, n: usize) -> usize {
        let start = self.pages;
        self.pages += n;
        self.opened += 1;
        start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::BufferDesc;

    /// Two layers of K and V: buffers 0-3, layer ids 0, 0, 1, 1 (or none).
    fn memory(ids: bool, backing: &mut Vec<u8>) -> Memory {
        *backing = vec![0u8; 4 * 64];
        let bufs = (0..4)
            .map(|b| BufferDesc::host(backing.as_ptr() as usize + b * 64, 64, 16))
            .collect();
        if ids {
            Memory::with_layers(bufs, vec![0, 0, 1, 1])
        } else {
            Memory::new(bufs)
        }
    }

    #[test]
    fn a_layer_range_names_the_buffers_of_its_layer_ids_or_positions() {
        let mut b = Vec::new();
        let kv = memory(true, &mut b);
        assert_eq!(buffers_of(&kv, 1, 1), Ok(vec![false, false, true, true]));
        assert_eq!(buffers_of(&kv, 0, 2), Ok(vec![true; 4]));
        assert!(buffers_of(&kv, 1, 2)
            .unwrap_err()
            .contains("layer 2 has no kv buffer"));
        assert!(buffers_of(&kv, 0, 0)
            .unwrap_err()
            .contains("layer_count is 0"));
        let kv = memory(false, &mut b);
        assert_eq!(buffers_of(&kv, 3, 1), Ok(vec![false, false, false, true]));
        assert!(buffers_of(&kv, 3, 2)
            .unwrap_err()
            .contains("layer 4 is out of range"));
        assert!(buffers_of(&kv, u32::MAX, 2).is_err());
    }

    fn mask(layers: &[usize]) -> Vec<bool> {
        (0..4).map(|b| layers.contains(&(b / 2))).collect()
    }

    #[test]
    fn layers_of_a_chunk_share_its_place_whatever_their_order_across_chunks() {
        let mut c = Chunks::default();
        let l = |b: usize| (b / 2) as u32;
        // Chunk 0 layer 1, chunk 1 layer 0, chunk 0 layer 0, chunk 1 layer 1 (last).
        assert_eq!(
            c.admit(&[4, 5], Some(&mask(&[1])), false, l),
            Ok(Placed {
                start: 0,
                total: None
            })
        );
        assert_eq!(
            c.admit(&[9], Some(&mask(&[0])), false, l),
            Ok(Placed {
                start: 2,
                total: None
            })
        );
        assert_eq!(
            c.admit(&[4, 5], Some(&mask(&[0])), false, l),
            Ok(Placed {
                start: 0,
                total: None
            })
        );
        assert_eq!(
            c.admit(&[9], Some(&mask(&[1])), true, l),
            Ok(Placed {
                start: 2,
                total: Some(3)
            })
        );
        // Whole chunks take the next pages, as enqueue_chunk always did.
        let mut c = Chunks::default();
        assert_eq!(c.admit(&[1, 2], None, false, l).unwrap().start, 0);
        assert_eq!(c.admit(&[1, 2], None, false, l).unwrap().start, 2);
        assert_eq!(
            c.admit(&[], None, true, l),
            Ok(Placed {
                start: 4,
                total: Some(4)
            })
        );
    }

    fn call(pages: &[u32], start: usize, layers: Option<&[usize]>, is_last: bool) -> Chunk {
        Chunk {
            pages: pages.to_vec(),
            is_last,
            aux: is_last.then_some(7),
            start,
            buffers: layers.map(|l| mask(l).into()),
            total: is_last.then_some(start + pages.len()),
        }
    }

    #[test]
    fn waiting_layers_of_one_chunk_join_and_anything_else_queues_behind_in_order() {
        let mut q = VecDeque::new();
        join(&mut q, call(&[4, 5], 0, Some(&[0]), false));
        join(&mut q, call(&[4, 5], 0, Some(&[1]), false));
        assert_eq!(q.len(), 1);
        assert_eq!(q[0].buffers.as_deref(), Some(&mask(&[0, 1])[..]));
        // Another chunk's layer, then a whole chunk, then layers of the first chunk's
        // pages at another place: each behind the one before.
        join(&mut q, call(&[6], 2, Some(&[0]), false));
        join(&mut q, call(&[4, 5], 0, Some(&[0]), false));
        join(&mut q, call(&[8], 3, None, false));
        join(&mut q, call(&[8], 3, None, false));
        assert_eq!(q.len(), 5);
        // The call that closes the room joins with its aux slot and total; nothing joins
        // a closed chunk.
        join(&mut q, call(&[6], 2, Some(&[1]), false));
        assert_eq!(q.len(), 6);
        let mut q = VecDeque::new();
        join(&mut q, call(&[6], 2, Some(&[0]), false));
        join(&mut q, call(&[6], 2, Some(&[1]), true));
        assert_eq!(q.len(), 1);
        let c = &q[0];
        assert!(c.is_last);
        assert_eq!((c.aux, c.total), (Some(7), Some(3)));
        assert_eq!(c.buffers.as_deref(), Some(&[true; 4][..]));
        join(&mut q, call(&[6], 2, Some(&[0]), false));
        assert_eq!(q.len(), 2);
    }

    #[test]
    fn a_repeated_layer_an_overlapping_page_list_or_a_missing_layer_names_chunk_and_layer() {
        let l = |b: usize| (b / 2) as u32;
        let mut c = Chunks::default();
        c.admit(&[4, 5], Some(&mask(&[0])), false, l).unwrap();
        let e = c
            .admit(&[4, 5], Some(&mask(&[0, 1])), false, l)
            .unwrap_err();
        assert_eq!(
            e,
            "chunk 0 (2 pages from source page 4): layer 0 was already enqueued"
        );
        let e = c.admit(&[5, 6], Some(&mask(&[1])), false, l).unwrap_err();
        assert!(e.contains("overlap those of chunk 0"), "{e}");
        c.admit(&[7], Some(&mask(&[0, 1])), false, l).unwrap();
        let e = c.admit(&[8], Some(&mask(&[0, 1])), true, l).unwrap_err();
        assert_eq!(
            e,
            "the room was closed (is_last) while chunk 0 (2 pages from source page 4) misses layer 1"
        );
        // Once complete, the same pages open a new chunk.
        let mut c = Chunks::default();
        c.admit(&[4], Some(&mask(&[0])), false, l).unwrap();
        c.admit(&[4], Some(&mask(&[1])), false, l).unwrap();
        assert_eq!(c.admit(&[4], Some(&mask(&[0])), false, l).unwrap().start, 1);
    }
}
