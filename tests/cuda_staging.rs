//! Device pages over TCP through the pinned staging ring, end to end between two
//! engines, with the CUDA driver's test double (tests/fakecuda/fakecuda.c): "device"
//! memory is host memory the fake driver knows, and its async copies are synchronous
//! memcpys. This runs the engine's real CUDA code path (driver loading, pointer checks,
//! pinned slots, copies on a stream, events) and its pipelines byte-exact; it says
//! nothing about GPU behaviour or speed (scripts/gpu-check.sh does, on a GPU).

mod common;

use common::fakecuda::{fakecuda, with_env, Fake};
use common::{wait_state, wait_terminal, wait_until};
use kvxfer::{
    BufferDesc, DataPath, Engine, KvKind, KvLayout, MemKind, PageOrder, RoomPeers, State,
};

const PAGES: usize = 32;
const POISON: u8 = 0xA5;

/// One engine's fake device memory: `bufs` buffers of `PAGES` pages of `item` bytes,
/// the first one a VMM range of three physical allocations.
struct DevMem {
    fake: Fake,
    bases: Vec<usize>,
    item: usize,
}

impl DevMem {
    fn new(bufs: usize, item: usize, fill: impl Fn(usize, usize) -> u8) -> DevMem {
        let fake = Fake::open();
        let len = PAGES * item;
        let bases: Vec<usize> = (0..bufs)
            .map(|b| {
                if b == 0 && len % 3 == 0 {
                    fake.alloc_vmm(0, len / 3, 3)
                } else {
                    fake.alloc(0, len)
                }
            })
            .collect();
        let m = DevMem { fake, bases, item };
        for b in 0..bufs {
            for (i, x) in m.buf(b).iter_mut().enumerate() {
                *x = fill(b, i);
            }
        }
        m
    }

    /// The bytes of buffer `b`, as the test (not the engine) sees fake device memory.
    #[allow(clippy::mut_from_ref)]
    fn buf(&self, b: usize) -> &mut [u8] {
        // SAFETY: the fake's "device" memory is a host mapping of PAGES * item bytes,
        // alive until `drop`; the tests read it only while no room writes it (after
        // SUCCESS, or after room_drained).
        unsafe { std::slice::from_raw_parts_mut(self.bases[b] as *mut u8, PAGES * self.item) }
    }

    fn page(&self, b: usize, p: u32) -> &[u8] {
        &self.buf(b)[p as usize * self.item..(p as usize + 1) * self.item]
    }

    fn descs(&self) -> Vec<BufferDesc> {
        self.bases
            .iter()
            .map(|&base| BufferDesc {
                kind: MemKind::Cuda { device: 0 },
                ..BufferDesc::host(base, PAGES * self.item, self.item)
            })
            .collect()
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        for &b in &self.bases {
            self.fake.free(b);
        }
    }
}

fn source(b: usize, i: usize) -> u8 {
    (i as u8).wrapping_mul(13) ^ (b as u8).wrapping_mul(101) ^ ((i / 4096) as u8)
}

fn engine(role: &str, extra: &[(&str, &str)]) -> Engine {
    let mut keys = vec![("transport", "tcp"), ("same_host", "auto")];
    keys.extend_from_slice(extra);
    common::start(role, &keys, common::quiet())
}

/// A prefill and a decode engine, both on fake device memory.
struct Gpus {
    p: Engine,
    d: Engine,
    pmem: DevMem,
    dmem: DevMem,
}

impl Gpus {
    fn new(bufs: usize, item: usize) -> Gpus {
        let pmem = DevMem::new(bufs, item, source);
        let dmem = DevMem::new(bufs, item, |_, _| POISON);
        let p = engine("prefill", &[]);
        let d = engine("decode", &[]);
        p.register_kv(pmem.descs()).unwrap();
        d.register_kv(dmem.descs()).unwrap();
        Gpus { p, d, pmem, dmem }
    }

    fn open(&self, room: u64, dst: &[u32]) {
        self.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        self.d
            .room_create(room, RoomPeers::Prefills(vec![self.p.address().into()]))
            .unwrap();
        self.d.room_set_destination(room, dst, None).unwrap();
    }

    fn assert_pages(&self, src: &[u32], dst: &[u32]) {
        for b in 0..self.pmem.bases.len() {
            for (&s, &d) in src.iter().zip(dst) {
                assert!(
                    self.dmem.page(b, d) == self.pmem.page(b, s),
                    "buffer {b}: page {d} differs from source page {s}"
                );
            }
        }
    }

    fn assert_poisoned(&self, dst: &[u32]) {
        for b in 0..self.dmem.bases.len() {
            for &d in dst {
                assert!(
                    self.dmem.page(b, d).iter().all(|&x| x == POISON),
                    "page {d} of buffer {b} was written"
                );
            }
        }
    }
}

#[test]
fn scattered_device_pages_arrive_byte_exact_over_tcp_staging_and_the_path_says_tcp() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        // Pages of 192 KiB: runs longer than one 1 MiB slot, several slots per frame.
        let g = Gpus::new(2, 192 << 10);
        let src = [0u32, 1, 2, 3, 4, 5, 6, 9, 7, 20, 21, 30];
        let dst = [31u32, 30, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        g.open(1, &dst);
        g.p.enqueue_chunk(1, &src[..5], false, None).unwrap();
        g.p.enqueue_chunk(1, &src[5..], true, None).unwrap();
        assert_eq!(
            wait_terminal(&g.p, 1),
            State::Success,
            "{:?}",
            g.p.room_failure(1)
        );
        assert_eq!(wait_terminal(&g.d, 1), State::Success);
        g.assert_pages(&src, &dst);
        g.assert_poisoned(&[0, 11, 12, 29]);
        // Device memory never takes the same-host copy: TCP, with the reason logged.
        assert_eq!(g.d.room_path(1).unwrap(), DataPath::Tcp);
        let m = g.d.metrics();
        assert!(m.bytes_received >= (12 * 2 * (192 << 10)) as u64);
    });
}

#[test]
fn many_small_scattered_device_pages_share_slots_and_frames_byte_exact() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        // 4 KiB pages, every one a run of its own: several runs per slot when sending
        // and per DataRuns frame when receiving, with the integrity digests (the
        // default, verify) taken piece by piece in the slots.
        let g = Gpus::new(3, 4096);
        let src: Vec<u32> = (0..PAGES as u32).rev().step_by(2).collect();
        let dst: Vec<u32> = (0..src.len() as u32)
            .map(|i| (i * 7) % PAGES as u32)
            .collect();
        g.open(4, &dst);
        g.p.enqueue_chunk(4, &src, true, None).unwrap();
        assert_eq!(
            wait_terminal(&g.d, 4),
            State::Success,
            "{:?}",
            g.d.room_failure(4)
        );
        assert!(g.d.room_verified(4).unwrap(), "every run's digest matched");
        g.assert_pages(&src, &dst);
    });
}

#[test]
fn same_host_require_fails_the_room_with_the_reason_when_cuda_ipc_cannot_be_set_up() {
    // The prefill's export fails (the fake's knob): with same_host=require the room
    // fails naming it instead of falling back to TCP staging; with auto the pairing
    // falls back, and says so (the path is TCP, counted as a fallback).
    with_env(
        fakecuda().to_str().unwrap(),
        &[("FAKECUDA_EXPORT_ERROR", "2")],
        || {
            let pmem = DevMem::new(1, 4096, source);
            let dmem = DevMem::new(1, 4096, |_, _| POISON);
            let off = ("integrity", "off");
            let p = engine("prefill", &[off]);
            let d = engine("decode", &[("same_host", "require"), off]);
            p.register_kv(pmem.descs()).unwrap();
            d.register_kv(dmem.descs()).unwrap();
            d.room_create(1, RoomPeers::Prefills(vec![p.address().into()]))
                .unwrap();
            assert_eq!(wait_terminal(&d, 1), State::Failed);
            let why = d.room_failure(1).unwrap();
            assert!(
                why.message.contains("same_host=require")
                    && why.message.contains("CUDA IPC export failed")
                    && why.message.contains("cuIpcGetMemHandle"),
                "{why:?}"
            );
            assert!(dmem.buf(0).iter().all(|&x| x == POISON));

            let p = engine("prefill", &[off]);
            let d = engine("decode", &[off]);
            p.register_kv(pmem.descs()).unwrap();
            d.register_kv(dmem.descs()).unwrap();
            p.room_create(2, RoomPeers::Decoders(1)).unwrap();
            d.room_create(2, RoomPeers::Prefills(vec![p.address().into()]))
                .unwrap();
            d.room_set_destination(2, &[0], None).unwrap();
            p.enqueue_chunk(2, &[0], true, None).unwrap();
            assert_eq!(wait_terminal(&d, 2), State::Success);
            assert!(dmem.page(0, 0) == pmem.page(0, 0), "page 0 differs");
            assert_eq!(d.room_path(2).unwrap(), kvxfer::DataPath::Tcp);
            assert_eq!(d.metrics().same_host_fallbacks, 1);
            assert_eq!(d.metrics().pairings_cuda_ipc, 0);
        },
    );
}

#[test]
fn an_abort_after_the_first_chunk_lands_nothing_more_once_the_room_drained() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        for from_decode in [true, false] {
            let g = Gpus::new(2, 64 << 10);
            let dst: Vec<u32> = (0..16).collect();
            let src: Vec<u32> = (8..24).collect();
            g.open(7, &dst);
            wait_state(&g.p, 7, State::WaitingForInput);
            g.p.enqueue_chunk(7, &src[..8], false, None).unwrap();
            // The first chunk landed (the decode room counts its pages).
            wait_until("the first chunk to land", || {
                g.dmem.page(1, 7).iter().any(|&x| x != POISON)
                    && g.d.metrics().bytes_received >= (8 * 2 * (64 << 10)) as u64
            });
            let side = if from_decode { &g.d } else { &g.p };
            side.room_abort(7, "client went away").unwrap();
            assert_eq!(wait_terminal(&g.d, 7), State::Failed);
            assert_eq!(wait_terminal(&g.p, 7), State::Failed);
            let _ = g.p.enqueue_chunk(7, &src[8..], true, None);
            wait_until("the decode room to drain", || g.d.room_drained(7).unwrap());
            let why = g.d.room_failure(7).unwrap();
            assert!(why.message.contains("client went away"), "{why:?}");
            g.assert_pages(&src[..8], &dst[..8]);
            std::thread::sleep(std::time::Duration::from_millis(100));
            g.assert_poisoned(&dst[8..]);
        }
    });
}

/// Two prefill ranks (tensor-parallel 2, one KV head each) fill each decode page (one
/// rank, both heads) with head slices: each rank writes its head's half of the page.
#[test]
fn head_slices_from_two_prefill_ranks_fill_each_device_page_of_one_decode_rank() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let layout = |rank, tp| KvLayout {
            kv_heads: 2,
            head_dim: 64,
            dtype_bytes: 2,
            tp_rank: rank,
            tp_size: tp,
            page_tokens: 16,
            order: PageOrder::Hnd,
            kind: KvKind::Heads,
        };
        // Prefill pages: 1 head x 16 tokens x 64 x 2 = 2 KiB; decode pages 4 KiB.
        let pm: Vec<DevMem> = (0..2)
            .map(|r| DevMem::new(2, 2048, move |b, i| source(b + 2 * r, i)))
            .collect();
        let dmem = DevMem::new(2, 4096, |_, _| POISON);
        let ps: Vec<Engine> = (0..2u32)
            .map(|r| {
                let e = engine("prefill", &[]);
                e.register_kv_layout(pm[r as usize].descs(), None, layout(r, 2))
                    .unwrap();
                e
            })
            .collect();
        let d = engine("decode", &[]);
        d.register_kv_layout(dmem.descs(), None, layout(0, 1))
            .unwrap();
        let src = [3u32, 4, 10];
        let dst = [0u32, 5, 6];
        for p in &ps {
            p.room_create(2, RoomPeers::Decoders(1)).unwrap();
        }
        d.room_create(
            2,
            RoomPeers::Prefills(ps.iter().map(|p| p.address().to_string()).collect()),
        )
        .unwrap();
        d.room_set_destination(2, &dst, None).unwrap();
        for p in &ps {
            p.enqueue_chunk(2, &src, true, None).unwrap();
        }
        assert_eq!(
            wait_terminal(&d, 2),
            State::Success,
            "{:?}",
            d.room_failure(2)
        );
        for (b, _) in dmem.bases.iter().enumerate() {
            for (&s, &t) in src.iter().zip(&dst) {
                let page = dmem.page(b, t);
                for (r, m) in pm.iter().enumerate() {
                    // HND: head r is the r-th half of the decode page.
                    assert!(
                        page[r * 2048..(r + 1) * 2048] == *m.page(b, s),
                        "buffer {b} page {t}: head {r} differs from rank {r}'s page {s}"
                    );
                }
            }
        }
    });
}

#[test]
fn layer_wise_rooms_move_device_layers_as_they_are_enqueued() {
    with_env(fakecuda().to_str().unwrap(), &[], || {
        let pmem = DevMem::new(4, 8192, source);
        let dmem = DevMem::new(4, 8192, |_, _| POISON);
        let p = engine("prefill", &[]);
        let d = engine("decode", &[]);
        p.register_kv_layers(pmem.descs(), vec![0, 0, 1, 1])
            .unwrap();
        d.register_kv_layers(dmem.descs(), vec![0, 0, 1, 1])
            .unwrap();
        let (src, dst) = ([1u32, 2, 3], [10u32, 11, 12]);
        p.room_create(3, RoomPeers::Decoders(1)).unwrap();
        d.room_create(3, RoomPeers::Prefills(vec![p.address().into()]))
            .unwrap();
        d.room_set_destination(3, &dst, None).unwrap();
        p.enqueue_layers(3, &src, 0, 1, false, None).unwrap();
        wait_until("layer 0 to land", || d.room_layers_landed(3).unwrap() >= 1);
        // Layer 1 (buffers 2 and 3) is not sent yet.
        for b in 2..4 {
            for &t in &dst {
                assert!(dmem.page(b, t).iter().all(|&x| x == POISON));
            }
        }
        p.enqueue_layers(3, &src, 1, 1, true, None).unwrap();
        assert_eq!(
            wait_terminal(&d, 3),
            State::Success,
            "{:?}",
            d.room_failure(3)
        );
        for b in 0..4 {
            for (&s, &t) in src.iter().zip(&dst) {
                assert!(dmem.page(b, t) == pmem.page(b, s), "buffer {b} page {t}");
            }
        }
    });
}
