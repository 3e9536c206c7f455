//! Prefill and decode with different tensor-parallel sizes, page sizes and page orders
//! (issue 13): every rank an engine in this process, over the test transport (TCP on
//! the host, RDMA in the soft-RoCE guest). Each decode rank's room pulls from every
//! prefill rank of the instance; each prefill rank's room waits for every decode rank.
//!
//! The source pools hold, at each head of each token of the prompt, bytes that name the
//! buffer, token, head and byte ([`value`]), placed where each prefill rank's layout
//! puts them; each decode rank's pool must end up holding, at the place its own layout
//! gives, exactly its heads of every token moved, and POISON everywhere else.

mod common;

use std::ops::Range;

use common::{wait_terminal, Region, POISON};
use kvxfer::{BufferDesc, Cause, Engine, KvKind, KvLayout, PageOrder, RoomPeers, State};

/// Buffers per rank: K and V of two layers.
const BUFS: usize = 4;
/// Bytes of one head of one token (head dim 4 × dtype 2 bytes: small, so that the
/// byte-by-byte check stays quick).
const HEAD_BYTES: u32 = 8;
const HEAD_DIM: u32 = 4;
const DTYPE: u32 = 2;
/// Pages in every pool.
const POOL_PAGES: usize = 40;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Order {
    Hnd,
    Nhd,
}

/// One side of the deployment.
#[derive(Clone, Copy, Debug)]
struct Side {
    tp: u32,
    page_tokens: u32,
    order: Order,
}

/// The model: KV heads (1 with `latent`, MLA).
#[derive(Clone, Copy, Debug)]
struct Model {
    kv_heads: u32,
    latent: bool,
}

impl Model {
    /// The heads rank `r` of `tp` holds.
    fn heads(&self, r: u32, tp: u32) -> Range<u32> {
        if self.latent {
            0..1
        } else if self.kv_heads >= tp {
            let n = self.kv_heads / tp;
            r * n..(r + 1) * n
        } else {
            let h = r / (tp / self.kv_heads);
            h..h + 1
        }
    }

    fn page_bytes(&self, r: u32, s: Side) -> usize {
        (s.page_tokens * self.heads(r, s.tp).len() as u32 * HEAD_BYTES) as usize
    }

    /// The (slot, head, byte) at offset `off` of a page of rank `r`.
    fn locate(&self, r: u32, s: Side, off: usize) -> (u32, u32, u32) {
        let held = self.heads(r, s.tp);
        let (off, e) = (off as u32, HEAD_BYTES);
        let (slot, h) = match s.order {
            Order::Hnd => ((off / e) % s.page_tokens, off / (s.page_tokens * e)),
            Order::Nhd => (off / (held.len() as u32 * e), (off / e) % held.len() as u32),
        };
        (slot, held.start + h, off % e)
    }

    /// Where byte `k` of `head` of the token in `slot` lies in a page of rank `r`.
    fn offset(&self, r: u32, s: Side, slot: u32, head: u32, k: u32) -> usize {
        let held = self.heads(r, s.tp);
        let h = head - held.start;
        let n = held.len() as u32;
        (match s.order {
            Order::Hnd => (h * s.page_tokens + slot) * HEAD_BYTES + k,
            Order::Nhd => (slot * n + h) * HEAD_BYTES + k,
        }) as usize
    }
}

/// The byte at `k` of `head` of token `t` in buffer `b`: odd, so never POISON.
fn value(b: usize, t: u32, head: u32, k: u32) -> u8 {
    ((b as u32 * 131 + t * 31 + head * 7 + k * 3) as u8) | 1
}

/// Registers `bufs` on `e` with the layout of rank `r` of `side`.
fn register(e: &Engine, bufs: Vec<BufferDesc>, m: Model, r: u32, side: Side) {
    e.register_kv_layout(bufs, None, layout(m, r, side))
        .unwrap();
}

/// The layout of rank `r` of `side`.
fn layout(m: Model, r: u32, side: Side) -> KvLayout {
    KvLayout {
        kv_heads: m.kv_heads,
        head_dim: HEAD_DIM,
        dtype_bytes: DTYPE,
        tp_rank: r,
        tp_size: side.tp,
        page_tokens: side.page_tokens,
        order: match side.order {
            Order::Hnd => PageOrder::Hnd,
            Order::Nhd => PageOrder::Nhd,
        },
        kind: if m.latent {
            KvKind::Latent
        } else {
            KvKind::Heads
        },
    }
}

struct Deployment {
    model: Model,
    p: Side,
    d: Side,
    prefills: Vec<(Engine, Vec<Region>)>,
    decodes: Vec<(Engine, Vec<Region>)>,
    /// The room's source pages (the same on every prefill rank) and destination pages.
    src: Vec<u32>,
    dst: Vec<u32>,
    prompt: u32,
}

impl Deployment {
    /// Starts the engines, fills the sources for a prompt of `prompt` tokens, and opens
    /// room `room` on every rank.
    fn new(model: Model, p: Side, d: Side, prompt: u32, room: u64) -> Deployment {
        let n_src = prompt.div_ceil(p.page_tokens);
        let n_dst = prompt.div_ceil(d.page_tokens);
        // Scattered and distinct pages, so that nothing lands right by accident.
        let src: Vec<u32> = (0..n_src)
            .map(|i| (7 * i + 3) % POOL_PAGES as u32)
            .collect();
        let dst: Vec<u32> = (0..n_dst).map(|j| POOL_PAGES as u32 - 1 - 2 * j).collect();
        let prefills: Vec<(Engine, Vec<Region>)> = (0..p.tp)
            .map(|r| {
                let pb = model.page_bytes(r, p);
                let mem: Vec<Region> = (0..BUFS)
                    .map(|b| {
                        let src = src.clone();
                        Region::new(POOL_PAGES, pb, move |at| {
                            let (page, off) = ((at / pb) as u32, at % pb);
                            let Some(i) = src.iter().position(|&s| s == page) else {
                                return 0x11;
                            };
                            let (slot, head, k) = model.locate(r, p, off);
                            value(b, i as u32 * p.page_tokens + slot, head, k)
                        })
                    })
                    .collect();
                let e = common::start("prefill", &[], common::quiet());
                register(&e, common::descs(&mem), model, r, p);
                (e, mem)
            })
            .collect();
        let decodes: Vec<(Engine, Vec<Region>)> = (0..d.tp)
            .map(|r| {
                let mem: Vec<Region> = (0..BUFS)
                    .map(|_| Region::new(POOL_PAGES, model.page_bytes(r, d), |_| POISON))
                    .collect();
                let e = common::start("decode", &[], common::quiet());
                register(&e, common::descs(&mem), model, r, d);
                (e, mem)
            })
            .collect();
        let addrs: Vec<String> = prefills
            .iter()
            .map(|(e, _)| e.address().to_string())
            .collect();
        for (e, _) in &decodes {
            e.room_create(room, RoomPeers::Prefills(addrs.clone()))
                .unwrap();
            e.room_set_destination(room, &dst, None).unwrap();
        }
        for (e, _) in &prefills {
            e.room_create(room, RoomPeers::Decoders(d.tp as usize))
                .unwrap();
        }
        Deployment {
            model,
            p,
            d,
            prefills,
            decodes,
            src,
            dst,
            prompt,
        }
    }

    /// Every prefill rank enqueues the room's pages in chunks of `per` pages.
    fn send(&self, room: u64, per: usize) {
        for (e, _) in &self.prefills {
            let chunks: Vec<&[u32]> = self.src.chunks(per).collect();
            for (i, c) in chunks.iter().enumerate() {
                e.enqueue_chunk(room, c, i + 1 == chunks.len(), None)
                    .unwrap();
            }
        }
    }

    /// Room `room`, whose first chunk went out, was aborted on one rank: every room on
    /// every rank of both sides ends FAILED with `reason`; once each decode room drained
    /// its pages are poisoned again, the prefill ranks' last chunks are refused, and
    /// nothing more lands.
    fn assert_failed_everywhere_and_quiet(&self, room: u64, reason: &str) {
        for (e, _) in self.decodes.iter().chain(&self.prefills) {
            assert_eq!(wait_terminal(e, room), State::Failed);
            let why = e.room_failure(room).unwrap();
            assert!(why.message.contains(reason), "{why}");
            // However many engines the reason crossed, it reads with one origin prefix.
            assert!(!why.message.contains("peer: "), "{why}");
        }
        for (e, mem) in &self.decodes {
            common::wait_until("the decode room to drain", || e.room_drained(room).unwrap());
            for region in mem {
                for &p in &self.dst {
                    region.poison(p, POISON);
                }
            }
        }
        for (e, _) in &self.prefills {
            assert!(e.enqueue_chunk(room, &self.src[2..], true, None).is_err());
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        for (_, mem) in &self.decodes {
            assert!(mem.iter().all(|r| r.holds_only(POISON)));
        }
    }

    /// Checks every byte of every decode rank's pool: its heads of every token moved at
    /// their place, POISON everywhere else.
    fn assert_delivered(&self) {
        let (m, p, d) = (self.model, self.p, self.d);
        let moved =
            (self.src.len() as u32 * p.page_tokens).min(self.dst.len() as u32 * d.page_tokens);
        assert!(moved >= self.prompt);
        for (r, (_, mem)) in self.decodes.iter().enumerate() {
            let r = r as u32;
            for (b, region) in mem.iter().enumerate() {
                for page in 0..POOL_PAGES as u32 {
                    let got = region.page(page);
                    let mut want = vec![POISON; got.len()];
                    if let Some(j) = self.dst.iter().position(|&x| x == page) {
                        for slot in 0..d.page_tokens {
                            let t = j as u32 * d.page_tokens + slot;
                            if t >= moved {
                                break;
                            }
                            for head in m.heads(r, d.tp) {
                                for k in 0..HEAD_BYTES {
                                    want[m.offset(r, d, slot, head, k)] = value(b, t, head, k);
                                }
                            }
                        }
                    }
                    if let Some(i) = got.iter().zip(&want).position(|(g, w)| g != w) {
                        panic!(
                            "{m:?} prefill {p:?} -> decode {d:?}: decode rank {r} buffer {b} \
                             page {page} byte {i}: {:#x}, expected {:#x}",
                            got[i], want[i]
                        );
                    }
                }
            }
        }
    }
}

/// One room through every rank of `p` → `d`, its bytes checked on every decode rank.
fn transfer(model: Model, p: Side, d: Side) {
    let t = Deployment::new(model, p, d, 100, 1);
    t.send(1, 3);
    for (e, _) in t.decodes.iter().chain(&t.prefills) {
        let state = wait_terminal(e, 1);
        let why = e.room_failure(1).map(|w| w.to_string()).unwrap_or_default();
        assert_eq!(state, State::Success, "{model:?} {p:?} -> {d:?}: {why}");
    }
    // Every head slice verified where it landed (integrity=verify, over any transport).
    let verifies = common::test_integrity() == "verify";
    for (e, _) in &t.decodes {
        assert_eq!(
            e.room_verified(1).unwrap(),
            verifies,
            "{model:?} {p:?} -> {d:?}"
        );
    }
    t.assert_delivered();
}

fn side(tp: u32, page_tokens: u32, order: Order) -> Side {
    Side {
        tp,
        page_tokens,
        order,
    }
}

const GQA8: Model = Model {
    kv_heads: 8,
    latent: false,
};
const GQA2: Model = Model {
    kv_heads: 2,
    latent: false,
};
const MLA: Model = Model {
    kv_heads: 1,
    latent: true,
};

/// The whole matrix: every TP pair, GQA with 8 heads and with 2 (replicated
/// when a side has more ranks), both page orders.
#[test]
fn every_tp_pair_with_8_and_2_kv_heads_in_both_orders_delivers_each_head_once() {
    for (p, d) in [(1, 1), (2, 1), (4, 2), (8, 2), (1, 2), (2, 4), (2, 8)] {
        for model in [GQA8, GQA2] {
            for order in [Order::Hnd, Order::Nhd] {
                transfer(model, side(p, 16, order), side(d, 16, order));
            }
        }
    }
}

#[test]
fn a_wider_prefill_fills_each_decode_page_from_several_ranks() {
    transfer(GQA8, side(4, 16, Order::Hnd), side(2, 16, Order::Hnd));
    transfer(GQA8, side(8, 16, Order::Nhd), side(2, 16, Order::Nhd));
    transfer(GQA2, side(4, 16, Order::Hnd), side(2, 16, Order::Hnd));
}

#[test]
fn a_narrower_prefill_feeds_several_decode_ranks_from_each_page() {
    transfer(GQA8, side(2, 16, Order::Hnd), side(4, 16, Order::Hnd));
    transfer(GQA2, side(2, 16, Order::Nhd), side(8, 16, Order::Nhd));
    transfer(GQA8, side(1, 16, Order::Nhd), side(2, 16, Order::Nhd));
}

/// At equal TP sizes each decode rank's room names every prefill rank: the one whose
/// layout equals its own copies whole pages, the others send it nothing. (The check that
/// each head comes from exactly one engine refused that as two writers of one buffer.)
#[test]
fn at_equal_tp_sizes_each_rank_copies_whole_pages_from_its_twin() {
    transfer(GQA8, side(2, 16, Order::Hnd), side(2, 16, Order::Hnd));
    transfer(GQA2, side(4, 16, Order::Nhd), side(4, 16, Order::Nhd));
    transfer(MLA, side(2, 16, Order::Nhd), side(2, 16, Order::Nhd));
}

#[test]
fn the_latent_reaches_each_decode_rank_once() {
    transfer(MLA, side(4, 16, Order::Nhd), side(2, 16, Order::Nhd));
    transfer(MLA, side(2, 16, Order::Nhd), side(4, 16, Order::Nhd));
}

#[test]
fn pages_of_other_sizes_and_orders_land_at_their_token_positions() {
    transfer(GQA8, side(2, 16, Order::Hnd), side(2, 64, Order::Hnd));
    transfer(GQA8, side(4, 64, Order::Nhd), side(2, 16, Order::Nhd));
    transfer(GQA8, side(2, 16, Order::Hnd), side(1, 32, Order::Nhd));
}

/// An abort on one prefill rank between two chunks fails every room on every rank with
/// the reason, and once the decode rooms drained nothing more lands in their pages.
#[test]
fn an_abort_on_one_rank_fails_the_room_on_every_rank_and_nothing_lands_after() {
    let t = Deployment::new(
        GQA8,
        side(4, 16, Order::Hnd),
        side(2, 16, Order::Hnd),
        96,
        2,
    );
    for (e, _) in &t.prefills {
        e.enqueue_chunk(2, &t.src[..2], false, None).unwrap();
    }
    t.prefills[1].0.room_abort(2, "client went away").unwrap();
    t.assert_failed_everywhere_and_quiet(2, "client went away");
}

/// An abort on one decode rank fails the room on every rank of both sides, with the
/// reason; nothing lands in any decode rank's pages once its room drained.
#[test]
fn an_abort_on_one_decode_rank_fails_the_room_everywhere() {
    let t = Deployment::new(
        GQA2,
        side(2, 16, Order::Nhd),
        side(4, 16, Order::Nhd),
        96,
        4,
    );
    for (e, _) in &t.prefills {
        e.enqueue_chunk(4, &t.src[..2], false, None).unwrap();
    }
    t.decodes[2]
        .0
        .room_abort(4, "decode rank preempted")
        .unwrap();
    t.assert_failed_everywhere_and_quiet(4, "decode rank preempted");
}

/// A prefill rank lost mid-room (its engine dropped) fails every decode room, with no
/// partial SUCCESS and with the reason.
#[test]
fn a_prefill_rank_lost_mid_room_fails_every_decode_room() {
    let mut t = Deployment::new(
        GQA8,
        side(2, 16, Order::Hnd),
        side(2, 16, Order::Hnd),
        96,
        3,
    );
    t.prefills[0]
        .0
        .enqueue_chunk(3, &t.src[..2], false, None)
        .unwrap();
    let lost = t.prefills[1].0.address().to_string();
    drop(t.prefills.remove(1));
    for (e, _) in &t.decodes {
        assert_eq!(wait_terminal(e, 3), State::Failed);
        // Each decode room learns of the loss in its own way: it loses the rank, or a
        // destination of it reaches a prefill rank (the dropped one as it shut down, or
        // the other, which another decode rank told first) after that rank's room
        // failed, and is answered with the reason.
        let why = e.room_failure(3).unwrap();
        let told = why.cause == Cause::Aborted
            && why.from_peer
            && (why.message.contains("engine shut down") || why.message.contains(&lost));
        assert!(why.cause == Cause::PeerLost || told, "{why}");
    }
}

/// A prefill engine that writes bytes of heads it does not send (here: heads 0-1 of a
/// decode page whose heads 2-3 are its own) loses its connection and fails the room
/// naming the heads; nothing of the frame lands. Its own heads land.
#[test]
fn a_peer_writing_outside_the_heads_it_sends_is_cut_off_and_nothing_lands() {
    use common::fake::{data_frame, runs_frame, FakePrefill};
    use kvxfer::proto::{DataHeader, Target};
    use std::io::Write;
    let d_side = side(2, 16, Order::Hnd);
    let p_side = side(4, 16, Order::Hnd);
    // Decode rank 0 holds heads 0..4 (512-byte pages); the fake is prefill rank 1 of 4,
    // sending heads 2..4: bytes 256..512 of each page.
    let page = GQA8.page_bytes(0, d_side);
    let mem: Vec<Region> = (0..BUFS)
        .map(|_| Region::new(POOL_PAGES, page, |_| POISON))
        .collect();
    // The fake speaks TCP data frames only.
    let tcp = [
        ("transport", "tcp"),
        ("connections_per_peer", "1"),
        ("same_host", "off"),
    ];
    let d = common::start("decode", &tcp, common::quiet());
    register(&d, common::descs(&mem), GQA8, 0, d_side);
    // Prefill rank 0 (heads 0..2) is a real engine; rank 1 the fake.
    let p0_mem: Vec<Region> = (0..BUFS)
        .map(|_| Region::new(POOL_PAGES, GQA8.page_bytes(0, p_side), |_| 0x11))
        .collect();
    let p0 = common::start("prefill", &tcp, common::quiet());
    register(&p0, common::descs(&p0_mem), GQA8, 0, p_side);
    p0.room_create(5, RoomPeers::Decoders(1)).unwrap();
    let mut f = FakePrefill::listen();
    f.layout = Some(layout(GQA8, 1, p_side));
    let addrs = vec![p0.address().to_string(), f.addr.clone()];
    d.room_create(5, RoomPeers::Prefills(addrs)).unwrap();
    f.handshake(BUFS, POOL_PAGES, GQA8.page_bytes(1, p_side), 1);
    d.room_set_destination(5, &[3, 4], None).unwrap();
    let dest = f.destination();
    let slice = |page_off: u32, first_page: u32| DataHeader {
        room: 5,
        generation: dest.generation,
        target: Target::Kv,
        buffer: 0,
        first_page,
        n_pages: 1,
        byte_len: 256,
        page_off,
        digest: 0,
    };
    // Its own heads of page 3 land.
    f.data[0]
        .write_all(&data_frame(&slice(256, 3), 0x41))
        .unwrap();
    common::wait_until("the slice to land", || {
        mem[0].page(3)[256..].iter().all(|&b| b == 0x41)
    });
    assert!(mem[0].page(3)[..256].iter().all(|&b| b == POISON));
    // A frame of its own heads of page 4 and of heads 0-1 of page 4: refused whole.
    let _ = f.data[0].write_all(&runs_frame(&[(slice(256, 4), 0x42), (slice(0, 4), 0x43)]));
    assert_eq!(wait_terminal(&d, 5), State::Failed);
    let why = d.room_failure(5).unwrap();
    assert_eq!(why.cause, Cause::Protocol);
    assert!(
        why.message.contains("bytes 0..256 of page 4") && why.message.contains("heads 2..4"),
        "{why}"
    );
    assert!(mem[0].page(4).iter().all(|&b| b == POISON));
}

/// Layer by layer across TP sizes: each decode rank counts a layer once every prefill
/// rank's heads of it landed.
#[test]
fn layers_sent_one_by_one_from_every_rank_are_counted_on_every_decode_rank() {
    let t = Deployment::new(
        GQA8,
        side(4, 16, Order::Hnd),
        side(2, 16, Order::Hnd),
        96,
        6,
    );
    for l in 0..BUFS as u32 {
        let last = l + 1 == BUFS as u32;
        for (e, _) in &t.prefills {
            e.enqueue_layers(6, &t.src, l, 1, last, None).unwrap();
        }
        if !last {
            for (e, _) in &t.decodes {
                common::wait_until("the layer to land on every decode rank", || {
                    e.room_layers_landed(6).unwrap() == l + 1
                });
            }
        }
    }
    for (e, _) in t.decodes.iter().chain(&t.prefills) {
        assert_eq!(wait_terminal(e, 6), State::Success);
    }
    t.assert_delivered();
}

/// A room closed by an empty last chunk after the page that reaches past the end of the
/// destination (64-token source pages into 16-token ones, a 100-token prompt).
#[test]
fn an_empty_last_chunk_closes_a_room_whose_last_page_reached_past_the_destination() {
    let t = Deployment::new(
        GQA8,
        side(2, 64, Order::Hnd),
        side(1, 16, Order::Hnd),
        100,
        7,
    );
    for (e, _) in &t.prefills {
        e.enqueue_chunk(7, &t.src, false, None).unwrap();
        e.enqueue_chunk(7, &[], true, None).unwrap();
    }
    for (e, _) in t.decodes.iter().chain(&t.prefills) {
        let state = wait_terminal(e, 7);
        let why = e.room_failure(7).map(|w| w.to_string()).unwrap_or_default();
        assert_eq!(state, State::Success, "{why}");
    }
    t.assert_delivered();
}

/// Review 2026-12-05 F4. With MLA from prefill TP 2 to decode TP 1, prefill rank 1 holds
/// no latent the decode rank takes from it, so its last chunk plans no frame, and the
/// thread that planned it (here the scheduler's `enqueue_chunk`) completed the room and
/// wrote Done on a data connection itself, which can wait on the network for as long as
/// a stalled peer allows. The Done goes to one of the engine's senders now: the enqueue
/// returns while that write is held at a pause point.
#[cfg(feature = "test-hooks")]
#[test]
fn the_scheduler_s_enqueue_never_writes_done_on_a_data_connection() {
    use kvxfer::testing;
    use std::sync::mpsc;
    use std::time::Duration;
    const POINT: &str = "prefill.write_done";
    let mla = Model {
        kv_heads: 1,
        latent: true,
    };
    let hnd = |tp| side(tp, 16, Order::Hnd);
    let t = Deployment::new(mla, hnd(2), hnd(1), 100, 7);
    let rank1 = &t.prefills[1].0;
    common::wait_state(rank1, 7, State::WaitingForInput);
    testing::pause_at(POINT, 7);
    let (tx, rx) = mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            rank1.enqueue_chunk(7, &t.src, true, None).unwrap();
            tx.send(()).unwrap();
        });
        let returned = rx.recv_timeout(Duration::from_secs(1)).is_ok();
        let parked = testing::wait_paused(POINT, 7, Duration::from_secs(10));
        testing::release(POINT, 7);
        assert!(
            returned,
            "enqueue_chunk waited while rank 1's Done was being written"
        );
        assert!(parked, "nobody wrote rank 1's Done");
    });
    t.prefills[0]
        .0
        .enqueue_chunk(7, &t.src, true, None)
        .unwrap();
    for (e, _) in t.decodes.iter().chain(&t.prefills) {
        let why = e.room_failure(7).map(|w| w.to_string()).unwrap_or_default();
        assert_eq!(wait_terminal(e, 7), State::Success, "{why}");
    }
    t.assert_delivered();
}

/// Inv. 10: a run written at a wrong offset inside the right page (here 8 bytes, one
/// head of one token, further into a decode page of 64 tokens that 16-token prefill
/// pages fill in parts) lands where its header says, and its digest, made for where it
/// should have gone, does not match there: the room fails as INTEGRITY.
#[cfg(feature = "test-hooks")]
#[test]
fn a_run_written_at_a_wrong_offset_inside_its_page_fails_as_integrity() {
    if common::test_integrity() != "verify" {
        return;
    }
    let t = Deployment::new(
        GQA8,
        side(2, 16, Order::Hnd),
        side(2, 64, Order::Hnd),
        100,
        9,
    );
    kvxfer::testing::inject_fault("integrity.wrong_offset", 9);
    t.send(9, 3);
    // The decode rank the run went to fails; the other may have finished first.
    let mut causes = Vec::new();
    for (e, _) in &t.decodes {
        if wait_terminal(e, 9) == State::Failed {
            let why = e.room_failure(9).unwrap();
            causes.push((why.cause, why.from_peer, why.message));
        }
    }
    assert!(
        causes
            .iter()
            .any(|(c, peer, m)| *c == Cause::Integrity && !peer && m.contains("digest")),
        "{causes:?}"
    );
}
