//! Which frames a chunk becomes: for each destination, the data frames of its pages (a
//! byte copy of page runs, or the byte segments of head slices when the layouts differ)
//! and the aux rows, grouped into the batches a sender writes at a time.

use super::{Chunk, Dest};
use crate::proto::{DataHeader, Target};
use crate::slice::{self, Slicing};
use crate::transport::tcp::MAX_FRAME_BYTES;
use crate::transport::{coalesce, Memory};
use std::ops::Range;

/// The most frames written in one batch (two iovecs each on TCP, within IOV_MAX).
const BATCH_FRAMES: usize = 64;

/// One data frame to send: its header and the source page (or aux slot) it starts at,
/// and where in that page its bytes start (0 unless the layouts differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Planned {
    pub hdr: DataHeader,
    pub src: u32,
    pub src_off: u64,
}

/// Where a chunk goes in one destination: from destination page `start` on, page for
/// page (a byte copy), or `tokens` of the room through `slicing` (layouts that differ).
pub(crate) enum Place<'a> {
    Pages {
        start: usize,
    },
    Sliced {
        slicing: &'a Slicing,
        tokens: Range<u64>,
    },
}

/// The data frames of chunk `chunk` for destination `dest` in the order they are sent:
/// for a byte copy, for each run of pages consecutive on both sides, for each KV buffer,
/// frames of at most `MAX_FRAME_BYTES`; for layouts that differ, for each KV buffer, one
/// frame per byte segment of [`slice::plan`]; then, for the last chunk, one aux row per
/// aux buffer (when both sides give an aux slot).
pub(crate) fn plan(
    room: u64,
    chunk: &Chunk,
    dest: &Dest,
    place: Place<'_>,
    kv: &Memory,
    aux: Option<&Memory>,
) -> Vec<Planned> {
    let n = chunk.pages.len();
    let mut out = Vec::new();
    let start = match place {
        Place::Pages { start } => start,
        Place::Sliced { slicing, tokens } => {
            let mut segs = Vec::new();
            slice::plan(
                &slicing.prefill,
                &slicing.decode,
                slicing.heads(),
                tokens,
                &chunk.pages,
                &dest.pages,
                &mut segs,
            );
            for b in (0..kv.buffers().len()).filter(|&b| sends(chunk, b)) {
                out.extend(segs.iter().map(|s| Planned {
                    hdr: DataHeader {
                        room,
                        generation: dest.generation,
                        target: Target::Kv,
                        buffer: b as u32,
                        first_page: s.dst_page,
                        n_pages: 1,
                        byte_len: s.len as u32,
                        page_off: s.dst_off as u32,
                        digest: 0,
                    },
                    src: s.src_page,
                    src_off: s.src_off,
                }));
            }
            plan_aux(room, chunk, dest, aux, &mut out);
            return out;
        }
    };
    for run in coalesce(&chunk.pages, &dest.pages[start..start + n]) {
        for (b, desc) in kv
            .buffers()
            .iter()
            .enumerate()
            .filter(|&(b, _)| sends(chunk, b))
        {
            let per = (MAX_FRAME_BYTES / desc.item_len).max(1) as u32;
            let mut off = 0;
            while off < run.len {
                let k = per.min(run.len - off);
                out.push(Planned {
                    hdr: DataHeader {
                        room,
                        generation: dest.generation,
                        target: Target::Kv,
                        buffer: b as u32,
                        first_page: run.dst + off,
                        n_pages: k,
                        byte_len: (k as usize * desc.item_len) as u32,
                        page_off: 0,
                        digest: 0,
                    },
                    src: run.src + off,
                    src_off: 0,
                });
                off += k;
            }
        }
    }
    plan_aux(room, chunk, dest, aux, &mut out);
    out
}

/// Whether the chunk sends kv buffer `b` (all of them, or those of its layers).
fn sends(chunk: &Chunk, b: usize) -> bool {
    chunk.buffers.as_ref().is_none_or(|m| m[b])
}

/// The aux rows of the last chunk: one per aux buffer, when both sides give a slot.
fn plan_aux(room: u64, chunk: &Chunk, dest: &Dest, aux: Option<&Memory>, out: &mut Vec<Planned>) {
    if let (true, Some(src), Some(dst), Some(aux)) = (chunk.is_last, chunk.aux, dest.aux, aux) {
        for (b, desc) in aux.buffers().iter().enumerate() {
            out.push(Planned {
                hdr: DataHeader {
                    room,
                    generation: dest.generation,
                    target: Target::Aux,
                    buffer: b as u32,
                    first_page: dst,
                    n_pages: 1,
                    byte_len: desc.item_len as u32,
                    page_off: 0,
                    digest: 0,
                },
                src,
                src_off: 0,
            });
        }
    }
}

/// The frames of one batch and their payload bytes.
pub(super) type Grouped = (Vec<Planned>, usize);

/// Groups a destination's planned frames into batches: at most `BATCH_FRAMES` frames or
/// `MAX_FRAME_BYTES` of payload each.
pub(super) fn batches(frames: Vec<Planned>) -> Vec<Grouped> {
    let mut out: Vec<Grouped> = Vec::new();
    for f in frames {
        let len = f.hdr.byte_len as usize;
        match out.last_mut() {
            Some((b, bytes)) if b.len() < BATCH_FRAMES && *bytes < MAX_FRAME_BYTES => {
                b.push(f);
                *bytes += len;
            }
            _ => out.push((vec![f], len)),
        }
    }
    out
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::BufferDesc;

    fn memory(bufs: usize, pages: usize, item: usize, backing: &mut Vec<Vec<u8>>) -> Memory {
        *backing = (0..bufs).map(|_| vec![0u8; pages * item]).collect();
        Memory::new(
            backing
                .iter_mut()
                .map(|b| BufferDesc::host(b.as_mut_ptr() as usize, b.len(), item))
                .collect(),
        )
    }

    fn dest(pages: &[u32], aux: Option<u32>) -> Dest {
        Dest {
            peer: crate::control::Peer::new(
                "k".into(),
                "peer".into(),
                0,
                crate::log::Logger::new(crate::log::Level::Error, None),
            ),
            generation: 9,
            pages: pages.into(),
            aux,
        }
    }

    /// Runs consecutive on both sides become one frame per buffer; breaks start new
    /// frames; every frame of a buffer comes in page order, then the aux rows.
    #[test]
    fn a_chunk_plans_one_frame_per_run_per_buffer_then_the_aux_rows() {
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let kv = memory(2, 64, 1024, &mut kvb);
        let aux = memory(3, 4, 32, &mut auxb);
        let d = dest(&[10, 11, 12, 20, 21], Some(2));
        let chunk = Chunk {
            pages: vec![0, 1, 2, 7, 8],
            is_last: true,
            aux: Some(1),
            start: 0,
            buffers: None,
            total: None,
        };
        let p = plan(5, &chunk, &d, Place::Pages { start: 0 }, &kv, Some(&aux));
        let kv_frames: Vec<(u32, u32, u32, u32)> = p
            .iter()
            .filter(|f| f.hdr.target == Target::Kv)
            .map(|f| (f.hdr.buffer, f.hdr.first_page, f.hdr.n_pages, f.src))
            .collect();
        assert_eq!(
            kv_frames,
            vec![(0, 10, 3, 0), (1, 10, 3, 0), (0, 20, 2, 7), (1, 20, 2, 7)]
        );
        let aux_frames: Vec<(u32, u32, u32)> = p
            .iter()
            .filter(|f| f.hdr.target == Target::Aux)
            .map(|f| (f.hdr.buffer, f.hdr.first_page, f.src))
            .collect();
        assert_eq!(aux_frames, vec![(0, 2, 1), (1, 2, 1), (2, 2, 1)]);
        assert!(p.iter().all(|f| f.hdr.room == 5 && f.hdr.generation == 9));
        assert!(p.iter().all(|f| f.hdr.byte_len as usize
            == f.hdr.n_pages as usize * if f.hdr.target == Target::Kv { 1024 } else { 32 }));
    }

    /// Some layers of a chunk: only their buffers' frames (the aux rows still go with
    /// the call that closes the room).
    #[test]
    fn a_chunk_of_some_layers_plans_only_their_buffers() {
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let kv = memory(3, 16, 64, &mut kvb);
        let aux = memory(1, 4, 32, &mut auxb);
        let d = dest(&[10, 11], Some(2));
        let chunk = Chunk {
            pages: vec![3, 4],
            is_last: true,
            aux: Some(1),
            start: 0,
            buffers: Some(vec![false, true, false].into()),
            total: Some(2),
        };
        let p = plan(5, &chunk, &d, Place::Pages { start: 0 }, &kv, Some(&aux));
        let frames: Vec<(Target, u32, u32)> = p
            .iter()
            .map(|f| (f.hdr.target, f.hdr.buffer, f.hdr.first_page))
            .collect();
        assert_eq!(frames, vec![(Target::Kv, 1, 10), (Target::Aux, 0, 2)]);
    }

    /// A run longer than a frame is split into frames of at most MAX_FRAME_BYTES; a
    /// non-last chunk (or one without an aux slot on either side) plans no aux row.
    #[test]
    fn long_runs_split_at_the_frame_limit_and_only_the_last_chunk_carries_aux() {
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let item = 1 << 20;
        let kv = memory(1, 10, item, &mut kvb);
        let aux = memory(1, 4, 32, &mut auxb);
        let d = dest(&(0..10).collect::<Vec<u32>>(), Some(0));
        let chunk = Chunk {
            pages: (0..10).collect(),
            is_last: false,
            aux: None,
            start: 0,
            buffers: None,
            total: None,
        };
        let p = plan(1, &chunk, &d, Place::Pages { start: 0 }, &kv, Some(&aux));
        let per = (MAX_FRAME_BYTES / item) as u32;
        assert!(p.iter().all(|f| f.hdr.n_pages <= per));
        assert_eq!(p.iter().map(|f| f.hdr.n_pages).sum::<u32>(), 10);
        assert!(p.iter().all(|f| f.hdr.target == Target::Kv));
        let last = Chunk {
            pages: vec![],
            is_last: true,
            aux: None,
            start: 0,
            buffers: None,
            total: None,
        };
        assert!(plan(
            1,
            &last,
            &dest(&[], Some(0)),
            Place::Pages { start: 0 },
            &kv,
            Some(&aux)
        )
        .is_empty());
    }

    /// Layouts that differ: each KV buffer gets one frame per segment, at its offset in
    /// the destination page and from its offset in the source page; aux rows as ever.
    #[test]
    fn a_sliced_chunk_plans_a_frame_per_segment_at_its_offsets() {
        use crate::layout::{KvKind, KvLayout, PageOrder};
        let shape = |tp_rank, tp_size| KvLayout {
            kv_heads: 8,
            head_dim: 2,
            dtype_bytes: 2,
            tp_rank,
            tp_size,
            page_tokens: 16,
            order: PageOrder::Hnd,
            kind: KvKind::Heads,
        };
        // Prefill rank 1 of TP 4 (heads 2-3, 128-byte pages) into decode rank 0 of TP 2
        // (heads 0-3, 256-byte pages): the second half of each decode page.
        let slicing = Slicing {
            prefill: shape(1, 4),
            decode: shape(0, 2),
        };
        let (mut kvb, mut auxb) = (Vec::new(), Vec::new());
        let kv = memory(2, 8, 128, &mut kvb);
        let aux = memory(1, 4, 32, &mut auxb);
        let d = dest(&[30, 31, 32], Some(3));
        let chunk = Chunk {
            pages: vec![5, 6],
            is_last: true,
            aux: Some(2),
            start: 0,
            buffers: None,
            total: None,
        };
        let tokens = slice::chunk_tokens(16, 16, 1, 2, 3, true).unwrap();
        let place = Place::Sliced {
            slicing: &slicing,
            tokens,
        };
        let p = plan(4, &chunk, &d, place, &kv, Some(&aux));
        let frames: Vec<_> = p
            .iter()
            .map(|f| {
                let h = f.hdr;
                (
                    h.target,
                    h.buffer,
                    h.first_page,
                    h.page_off,
                    h.byte_len,
                    f.src,
                    f.src_off,
                )
            })
            .collect();
        assert_eq!(
            frames,
            vec![
                (Target::Kv, 0, 31, 128, 128, 5, 0),
                (Target::Kv, 0, 32, 128, 128, 6, 0),
                (Target::Kv, 1, 31, 128, 128, 5, 0),
                (Target::Kv, 1, 32, 128, 128, 6, 0),
                (Target::Aux, 0, 3, 0, 32, 2, 0),
            ]
        );
    }
}
