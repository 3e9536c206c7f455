//! Random, truncated and mutated frames, thrown at the frame decoders and at a live
//! prefill engine's socket (DESIGN.md invariant 8).
//!
//! Decoders: never a panic, only errors; a frame that decodes re-encodes to the bytes
//! it came from; and no allocation beyond the frame bound. The last is measured: this
//! test binary's global allocator records the largest single allocation made by the
//! current thread while a decode runs.
//!
//! Live socket: after a valid handshake as a fake decode engine with one room attached,
//! any frame the decoder rejects makes the engine close the connection and fail the
//! peer's room with a reason, and the engine then serves a fresh peer through a real
//! transfer. An engine that requires authentication refuses and counts every damaged or
//! forged handshake, and no room changes.

mod common;

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};

use common::fake::{self, destination, encode};
use common::{
    engine, first_unlike_source, poisoned, source, wait_state, wait_terminal, wait_until, Region,
};
use kvxfer::proto::{
    self, AuthMode, AuthRefusal, BufferInfo, ConnKind, DataHeader, Kind, Limits, Message,
    ProtoError, QpInfo, ReadError, Registration, Role, Target, WireTransport,
    DATA_FRAME_PREFIX_LEN, DATA_HEADER_LEN, FRAME_HEADER_LEN, PROTO_VERSION,
};
use kvxfer::{Cause, KvKind, KvLayout, PageOrder, RoomPeers, State};
use proptest::prelude::*;
use proptest::test_runner::{Config as PropConfig, TestRunner};

// ---------------------------------------------------------------------------------------
// The largest allocation of the current thread while tracking is on.

struct Tracking;

thread_local! {
    static TRACK: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // try_with: the allocator also runs while thread-locals are torn down.
    let _ = TRACK.try_with(|t| {
        if t.get() {
            let _ = LARGEST.try_with(|m| m.set(m.get().max(size)));
        }
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping
// only touches const-initialised thread-local cells and never allocates.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: forwarded with the caller's layout, under the caller's contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: AllocLayout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: `ptr` came from this allocator, that is from System, with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: AllocLayout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as for dealloc.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

/// Runs `f` and returns its result with the largest allocation it made on this thread.
fn largest_alloc<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.with(|m| m.set(0));
    TRACK.with(|t| t.set(true));
    let r = f();
    TRACK.with(|t| t.set(false));
    (r, LARGEST.with(Cell::get))
}

// ---------------------------------------------------------------------------------------
// Frames.

fn data_frame(h: DataHeader) -> Vec<u8> {
    let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
    h.encode_frame(&mut prefix).unwrap();
    let mut f = prefix.to_vec();
    f.extend((0..h.byte_len).map(|i| i as u8));
    f
}

fn runs_frame(runs: &[DataHeader]) -> Vec<u8> {
    let mut f = Vec::new();
    proto::encode_runs_prefix(runs, &mut f).unwrap();
    let bytes: u32 = runs.iter().map(|h| h.byte_len).sum();
    f.extend((0..bytes).map(|i| i as u8));
    f
}

fn buffer(len: u64, item_len: u64) -> BufferInfo {
    BufferInfo {
        len,
        item_len,
        layer_id: BufferInfo::NO_LAYER,
        addr: 0,
        rkey: 0,
    }
}

fn qp(qpn: u32, psn: u32, mtu: u8) -> QpInfo {
    QpInfo {
        qpn,
        psn,
        lid: 0x1234,
        gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        mtu,
    }
}

/// One valid frame of every kind, the seeds of every mutation.
fn seeds() -> Vec<Vec<u8>> {
    vec![
        encode(&Message::Hello {
            proto_version: PROTO_VERSION,
            role: Role::Decode,
            engine_id: 7,
            conn: ConnKind::Control,
            conn_index: 0,
        }),
        encode(&Message::Registration(Registration {
            kv: vec![buffer(4096, 1024), buffer(8192, 1024)],
            aux: vec![buffer(64, 64)],
            layout: Some(KvLayout {
                kv_heads: 8,
                head_dim: 128,
                dtype_bytes: 2,
                tp_rank: 1,
                tp_size: 2,
                page_tokens: 16,
                order: PageOrder::Nhd,
                kind: KvKind::Heads,
            }),
            integrity: true,
        })),
        encode(&Message::Registration(Registration {
            kv: vec![buffer(4096, 1024)],
            aux: vec![],
            layout: None,
            integrity: false,
        })),
        encode(&Message::Destination {
            room: 1,
            generation: 2,
            pages: vec![3, 4, 5, 9],
            aux_slot: Some(1),
        }),
        encode(&Message::Done {
            room: 1,
            generation: 2,
            pages_sent: 4,
            aux_sent: true,
        }),
        encode(&Message::Abort {
            room: 1,
            generation: 2,
            reason: "client went away".into(),
        }),
        encode(&Message::AbortAck {
            room: 1,
            generation: 2,
        }),
        encode(&Message::Heartbeat { seq: 99 }),
        encode(&Message::Transport {
            transport: WireTransport::Tcp,
            qps: vec![],
        }),
        encode(&Message::Transport {
            transport: WireTransport::Rdma,
            qps: vec![qp(0x11, 0xab_cdef, 5), qp(0x12, 7, 1)],
        }),
        data_frame(DataHeader {
            room: 1,
            generation: 2,
            target: Target::Kv,
            buffer: 1,
            first_page: 3,
            n_pages: 2,
            byte_len: 32,
            page_off: 0,
            // A digest (integrity=verify): any value passes the codec.
            digest: 0xDEAD_BEEF,
        }),
        runs_frame(&[
            DataHeader {
                room: 1,
                generation: 2,
                target: Target::Kv,
                buffer: 0,
                first_page: 7,
                n_pages: 1,
                byte_len: 16,
                // A slice of the page (layouts that differ).
                page_off: 8,
                digest: 0x0102_0304,
            },
            DataHeader {
                room: 1,
                generation: 2,
                target: Target::Aux,
                buffer: 0,
                first_page: 1,
                n_pages: 1,
                byte_len: 8,
                page_off: 0,
                digest: 0,
            },
        ]),
        // RDMA progress with the digested runs of integrity=verify.
        encode(&Message::Progress {
            room: 1,
            generation: 2,
            aux_rows: 1,
            bytes: 40,
            kv: vec![(0, 32)],
            runs: vec![
                DataHeader {
                    room: 1,
                    generation: 2,
                    target: Target::Kv,
                    buffer: 0,
                    first_page: 7,
                    n_pages: 2,
                    byte_len: 32,
                    page_off: 0,
                    digest: 0x0A0B_0C0D,
                },
                DataHeader {
                    room: 1,
                    generation: 2,
                    target: Target::Aux,
                    buffer: 0,
                    first_page: 1,
                    n_pages: 1,
                    byte_len: 8,
                    page_off: 0,
                    digest: 0xFFFF_FFFF,
                },
            ],
        }),
    ]
    .into_iter()
    .chain(auth_seeds())
    .collect()
}

/// One valid frame of every authentication kind (and setting).
fn auth_seeds() -> Vec<Vec<u8>> {
    vec![
        encode(&fake::auth_off_hello()),
        encode(&Message::AuthHello {
            auth: AuthMode::Required,
            key_id: [3; 8],
            nonce: [0x5a; 32],
        }),
        encode(&Message::AuthChallenge {
            auth: AuthMode::Required,
            engine_id: 77,
            nonce: [0xa5; 32],
        }),
        encode(&Message::AuthChallenge {
            auth: AuthMode::Off,
            engine_id: 0,
            nonce: [0; 32],
        }),
        encode(&Message::AuthProof { mac: [0x11; 32] }),
        encode(&Message::AuthRefused {
            reason: AuthRefusal::BadProof,
            auth: AuthMode::Required,
        }),
    ]
}

/// Any authentication message, valid or not: either setting, with zero or random key
/// ids, nonces and engine ids (nonzero ones are invalid with auth off).
fn arb_auth() -> impl Strategy<Value = Message> {
    let mode = prop_oneof![Just(AuthMode::Off), Just(AuthMode::Required)];
    let bytes32 = prop_oneof![Just([0u8; 32]), any::<[u8; 32]>()];
    prop_oneof![
        (
            mode.clone(),
            prop_oneof![Just([0u8; 8]), any::<[u8; 8]>()],
            bytes32.clone()
        )
            .prop_map(|(auth, key_id, nonce)| Message::AuthHello {
                auth,
                key_id,
                nonce
            }),
        (
            mode.clone(),
            prop_oneof![Just(0u64), any::<u64>()],
            bytes32.clone()
        )
            .prop_map(|(auth, engine_id, nonce)| Message::AuthChallenge {
                auth,
                engine_id,
                nonce
            }),
        bytes32.prop_map(|mac| Message::AuthProof { mac }),
        (prop::sample::select(AuthRefusal::ALL.to_vec()), mode)
            .prop_map(|(reason, auth)| Message::AuthRefused { reason, auth }),
    ]
}

/// How to damage a frame.
#[derive(Debug, Clone)]
enum Edit {
    /// XOR one bit.
    Flip(usize, u8),
    /// Overwrite one byte.
    Set(usize, u8),
    /// Overwrite four bytes with a little-endian u32 (lengths and counts).
    SetU32(usize, u32),
    /// Insert a byte.
    Insert(usize, u8),
    /// Remove a byte.
    Remove(usize),
    /// Cut the frame.
    Truncate(usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(i, b)| Edit::Flip(i, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Edit::Set(i, v)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u32),
                Just(1),
                Just(u32::MAX),
                Just(1 << 20),
                Just(1 << 31),
                any::<u32>()
            ]
        )
            .prop_map(|(i, v)| Edit::SetU32(i, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, v)| Edit::Insert(i, v)),
        any::<usize>().prop_map(Edit::Remove),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn apply(frame: &mut Vec<u8>, e: &Edit) {
    let n = frame.len().max(1);
    match *e {
        Edit::Flip(i, b) if !frame.is_empty() => frame[i % n] ^= 1 << b,
        Edit::Set(i, v) if !frame.is_empty() => frame[i % n] = v,
        Edit::SetU32(i, v) if frame.len() >= 4 => {
            let at = i % (frame.len() - 3);
            frame[at..at + 4].copy_from_slice(&v.to_le_bytes());
        }
        Edit::Insert(i, v) => frame.insert(i % (frame.len() + 1), v),
        Edit::Remove(i) if !frame.is_empty() => {
            frame.remove(i % n);
        }
        Edit::Truncate(i) => frame.truncate(i % (frame.len() + 1)),
        _ => {}
    }
}

/// A seed frame with edits applied, or random bytes.
fn damaged() -> impl Strategy<Value = Vec<u8>> {
    let n = seeds().len();
    prop_oneof![
        4 => (0..n, prop::collection::vec(edit(), 1..5)).prop_map(|(i, edits)| {
            let mut f = seeds()[i].clone();
            for e in &edits {
                apply(&mut f, e);
            }
            f
        }),
        1 => prop::collection::vec(any::<u8>(), 0..96),
    ]
}

/// Small limits, so that the bound on allocations is tight and reachable.
fn small_limits() -> Limits {
    Limits {
        max_control_payload: 256,
        max_pages: 16,
        max_buffers: 4,
        max_reason_len: 32,
        max_data_bytes: 64,
        max_qps: 2,
    }
}

/// Any `QpInfo`, valid or not: psn and mtu are drawn around their bounds.
fn arb_qp() -> impl Strategy<Value = QpInfo> {
    (
        any::<u32>(),
        prop_oneof![
            3 => 0..=QpInfo::MAX_PSN,
            1 => Just(QpInfo::MAX_PSN + 1),
            1 => any::<u32>(),
        ],
        any::<u16>(),
        any::<[u8; 16]>(),
        prop_oneof![6 => QpInfo::MIN_MTU..=QpInfo::MAX_MTU, 1 => any::<u8>()],
    )
        .prop_map(|(qpn, psn, lid, gid, mtu)| QpInfo {
            qpn,
            psn,
            lid,
            gid,
            mtu,
        })
}

/// Any `Transport` message, valid or not: either transport with 0..=6 queue pairs.
fn arb_transport() -> impl Strategy<Value = Message> {
    (
        prop_oneof![Just(WireTransport::Tcp), Just(WireTransport::Rdma)],
        prop_oneof![
            1 => Just(Vec::new()),
            3 => prop::collection::vec(arb_qp(), 0..=6),
        ],
    )
        .prop_map(|(transport, qps)| Message::Transport { transport, qps })
}

/// Any RDMA `Progress`, valid or not: 0..=5 KV counts and 0..=6 digested runs of its
/// room, each field drawn around the bounds `DataHeader::check` enforces.
fn arb_progress() -> impl Strategy<Value = Message> {
    let run = (
        prop_oneof![Just(Target::Kv), Just(Target::Aux)],
        0u32..4,
        prop_oneof![3 => 0u32..64, 1 => Just(u32::MAX), 1 => any::<u32>()],
        prop_oneof![1 => Just(0u32), 6 => 1u32..=3, 1 => any::<u32>()],
        prop_oneof![4 => 0u32..=64, 1 => 65u32..=128, 1 => any::<u32>()],
        prop_oneof![3 => Just(0u32), 1 => Just(8u32)],
        any::<u32>(),
    );
    (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u64>(),
        prop::collection::vec((any::<u32>(), any::<u64>()), 0..=5),
        prop::collection::vec(run, 0..=6),
    )
        .prop_map(|(room, generation, aux_rows, bytes, kv, runs)| {
            let runs = runs
                .into_iter()
                .map(
                    |(target, buffer, first_page, n_pages, byte_len, page_off, digest)| {
                        DataHeader {
                            room,
                            generation,
                            target,
                            buffer,
                            first_page,
                            n_pages,
                            byte_len,
                            page_off,
                            digest,
                        }
                    },
                )
                .collect();
            Message::Progress {
                room,
                generation,
                aux_rows,
                bytes,
                kv,
                runs,
            }
        })
}

/// Any kv layout, valid or not: each field drawn around the bounds `KvLayout::check`
/// enforces (0, small values that do or do not divide, anything).
fn arb_layout() -> impl Strategy<Value = KvLayout> {
    let field = || prop_oneof![1 => Just(0u32), 6 => 1u32..=9, 1 => any::<u32>()];
    (
        [field(), field(), field(), field(), field(), field()],
        prop_oneof![Just(PageOrder::Hnd), Just(PageOrder::Nhd)],
        prop_oneof![Just(KvKind::Heads), Just(KvKind::Latent)],
    )
        .prop_map(
            |([kv_heads, head_dim, dtype_bytes, tp_rank, tp_size, page_tokens], order, kind)| {
                KvLayout {
                    kv_heads,
                    head_dim,
                    dtype_bytes,
                    tp_rank,
                    tp_size,
                    page_tokens,
                    order,
                    kind,
                }
            },
        )
}

/// Any `Registration` of one buffer, with no layout or any layout.
fn arb_registration() -> impl Strategy<Value = Message> {
    prop::option::weighted(0.9, arb_layout()).prop_map(|layout| {
        Message::Registration(Registration {
            kv: vec![buffer(4096, 1024)],
            aux: vec![],
            layout,
            integrity: false,
        })
    })
}

/// What a receive loop does with one frame: header, then control payload or data
/// header and data bytes.
fn read_frame(r: &mut &[u8], limits: &Limits) -> Result<Vec<u8>, ReadError> {
    let hdr = proto::read_frame_header(r, limits)?;
    if hdr.kind.is_control() {
        let m = proto::read_control(r, &hdr, limits)?;
        return Ok(encode(&m));
    }
    if hdr.kind == Kind::DataRuns {
        let runs = proto::read_runs(r, &hdr, limits)?;
        let n: usize = runs.iter().map(|h| h.byte_len as usize).sum();
        let mut bytes = vec![0u8; n];
        r.read_exact(&mut bytes).map_err(ReadError::Io)?;
        let mut out = Vec::new();
        proto::encode_runs_prefix(&runs, &mut out).unwrap();
        out.extend(bytes);
        return Ok(out);
    }
    let d = proto::read_data_header(r, &hdr, limits)?;
    let mut bytes = vec![0u8; d.byte_len as usize];
    r.read_exact(&mut bytes).map_err(ReadError::Io)?;
    let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
    d.encode_frame(&mut prefix).unwrap();
    let mut out = prefix.to_vec();
    out.extend(bytes);
    Ok(out)
}

/// Whether the decoder accepts `frame` as one whole control frame (the engine's
/// control reader would then act on it instead of closing the connection).
fn is_valid_control_frame(frame: &[u8], limits: &Limits) -> bool {
    let mut r = frame;
    match proto::read_frame_header(&mut r, limits) {
        Ok(h) if h.kind.is_control() => {
            proto::read_control(&mut r, &h, limits).is_ok() && r.is_empty()
        }
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------
// Decoders.

proptest! {
    #![proptest_config(PropConfig { cases: 6000, failure_persistence: None, ..PropConfig::default() })]

    /// A damaged frame read the way a receive loop reads it: an error or a frame that
    /// re-encodes to exactly the bytes consumed, and no allocation beyond the bound.
    #[test]
    fn damaged_frames_decode_to_errors_or_canonical_frames(frame in damaged(), small in any::<bool>()) {
        let limits = if small { small_limits() } else { Limits::default() };
        let mut r = frame.as_slice();
        let (res, largest) = largest_alloc(|| read_frame(&mut r, &limits));
        match res {
            Ok(bytes) => {
                let consumed = frame.len() - r.len();
                prop_assert_eq!(&bytes[..], &frame[..consumed]);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        // The bound: one payload buffer of at most max_control_payload, or a data frame's
        // bytes (at most max_data_bytes), plus the re-encoding of what was accepted.
        let bound = limits.max_control_payload.max(limits.max_data_bytes) as usize
            + DATA_FRAME_PREFIX_LEN;
        prop_assert!(largest <= bound.max(2 * frame.len() + 64), "allocated {} bytes", largest);
    }

    /// A Transport message, valid or not: `validate` and a decode of its encoding agree
    /// (same error, or the same message back, under small and default limits), and the
    /// decode allocates at most the queue-pair list (count checked before allocating).
    #[test]
    fn transport_messages_round_trip_or_fail_like_validate(m in arb_transport(), small in any::<bool>()) {
        let limits = if small { small_limits() } else { Limits::default() };
        let frame = encode(&m);
        prop_assert_eq!(frame.len() as u64, FRAME_HEADER_LEN as u64 + m.payload_len());
        let mut r = frame.as_slice();
        let (res, largest) = largest_alloc(|| read_frame(&mut r, &limits));
        match (m.validate(&limits), res) {
            (Ok(()), Ok(bytes)) => {
                prop_assert_eq!(&bytes, &frame);
                prop_assert!(r.is_empty());
                let back = Message::decode(Kind::Transport, &frame[FRAME_HEADER_LEN..], &limits);
                prop_assert_eq!(back, Ok(m.clone()));
            }
            (Err(want), Err(ReadError::Proto(got))) => {
                prop_assert_eq!(got, want);
            }
            (v, d) => prop_assert!(false, "validate {:?} but decode {:?}", v, d.map(|_| ())),
        }
        // One payload buffer plus the queue-pair list and, if accepted, its re-encoding.
        let qps = match &m {
            Message::Transport { qps, .. } => qps.len(),
            _ => unreachable!(),
        };
        let bound = frame.len() + qps * std::mem::size_of::<QpInfo>();
        prop_assert!(largest <= bound.max(64), "allocated {} bytes for {:?}", largest, m);
    }

    /// An RDMA Progress with any digested runs, valid or not: `validate` and a decode of
    /// its encoding agree (the same error, or the same message back, under small and
    /// default limits), and the decode allocates at most its lists (counts checked
    /// before allocating).
    #[test]
    fn progress_messages_round_trip_or_fail_like_validate(m in arb_progress(), small in any::<bool>()) {
        let limits = if small { small_limits() } else { Limits::default() };
        let frame = encode(&m);
        prop_assert_eq!(frame.len() as u64, FRAME_HEADER_LEN as u64 + m.payload_len());
        let mut r = frame.as_slice();
        let (res, largest) = largest_alloc(|| read_frame(&mut r, &limits));
        match (m.validate(&limits), res) {
            (Ok(()), Ok(bytes)) => {
                prop_assert_eq!(&bytes, &frame);
                let back = Message::decode(Kind::Progress, &frame[FRAME_HEADER_LEN..], &limits);
                prop_assert_eq!(back, Ok(m.clone()));
            }
            (Err(want), Err(ReadError::Proto(got))) => prop_assert_eq!(got, want),
            (v, d) => prop_assert!(false, "validate {:?} but decode {:?}", v, d.map(|_| ())),
        }
        let (kv, runs) = match &m {
            Message::Progress { kv, runs, .. } => (kv.len(), runs.len()),
            _ => unreachable!(),
        };
        let bound = frame.len()
            + kv * std::mem::size_of::<(u32, u64)>()
            + runs * std::mem::size_of::<DataHeader>();
        prop_assert!(largest <= bound.max(64), "allocated {} bytes for {:?}", largest, m);
    }

    /// A Registration with any layout, valid or not: `validate` and a decode of its
    /// encoding agree (the same error naming the layout field, or the same message back).
    #[test]
    fn registration_layouts_round_trip_or_fail_like_validate(m in arb_registration()) {
        let limits = Limits::default();
        let frame = encode(&m);
        prop_assert_eq!(frame.len() as u64, FRAME_HEADER_LEN as u64 + m.payload_len());
        let back = Message::decode(Kind::Registration, &frame[FRAME_HEADER_LEN..], &limits);
        match (m.validate(&limits), back) {
            (Ok(()), Ok(back)) => prop_assert_eq!(back, m),
            (Err(want), Err(got)) => {
                prop_assert!(
                    matches!(&got, ProtoError::BadLayout { field, .. }
                        if field.starts_with("Registration.layout.")),
                    "{:?}", got
                );
                prop_assert_eq!(got, want);
            }
            (v, d) => prop_assert!(false, "validate {:?} but decode {:?}", v, d),
        }
    }

    /// An authentication message, valid or not: `validate` and a decode of its encoding
    /// agree, and decoding allocates nothing (every field is fixed-size).
    #[test]
    fn auth_messages_round_trip_or_fail_like_validate(m in arb_auth()) {
        let limits = Limits::default();
        let frame = encode(&m);
        prop_assert_eq!(frame.len() as u64, FRAME_HEADER_LEN as u64 + m.payload_len());
        prop_assert!(m.payload_len() <= 44);
        let payload = &frame[FRAME_HEADER_LEN..];
        let (res, largest) = largest_alloc(|| Message::decode(m.kind(), payload, &limits));
        match (m.validate(&limits), res) {
            (Ok(()), Ok(back)) => prop_assert_eq!(back, m),
            (Err(want), Err(got)) => prop_assert_eq!(got, want),
            (v, d) => prop_assert!(false, "validate {:?} but decode {:?}", v, d),
        }
        prop_assert_eq!(largest, 0);
    }

    /// Message::decode on random payloads of every kind allocates at most the payload's
    /// length (every count is checked against the bytes that remain before allocating).
    #[test]
    fn random_payloads_allocate_no_more_than_their_length(
        payload in prop::collection::vec(any::<u8>(), 0..200),
        count in prop_oneof![Just(u32::MAX), Just(1u32 << 20), any::<u32>()],
        at in 0usize..64,
    ) {
        let mut payload = payload;
        // Plant a large count somewhere, where lengths and counts live.
        if payload.len() >= at + 4 {
            payload[at..at + 4].copy_from_slice(&count.to_le_bytes());
        }
        for kind in Kind::ALL {
            let (res, largest) = largest_alloc(|| Message::decode(kind, &payload, &Limits::default()));
            if res.is_err() {
                prop_assert!(largest <= payload.len(), "{kind:?}: {largest} bytes for a {} byte payload", payload.len());
            }
            let mut dh = [0u8; DATA_HEADER_LEN];
            for (i, b) in payload.iter().take(DATA_HEADER_LEN).enumerate() {
                dh[i] = *b;
            }
            let (_, largest) = largest_alloc(|| DataHeader::decode(&dh, count, &Limits::default()));
            prop_assert_eq!(largest, 0);
        }
    }
}

#[test]
fn a_frame_claiming_a_huge_count_fails_before_allocating() {
    let limits = Limits::default();
    // The tracking sees allocations: a valid Destination allocates its page list.
    let ok = encode(&destination(1, 2, (0..64).collect()));
    let (r, largest) = largest_alloc(|| Message::decode(Kind::Destination, &ok[16..], &limits));
    assert!(r.is_ok());
    assert!(largest >= 64 * 4, "{largest}");
    // Destination claiming 2^20 pages (the limit) with four bytes of them.
    let mut p = Vec::new();
    p.extend(1u64.to_le_bytes());
    p.extend(2u64.to_le_bytes());
    p.extend((-1i64).to_le_bytes());
    p.extend((1u32 << 20).to_le_bytes());
    p.extend(7u32.to_le_bytes());
    let (r, largest) = largest_alloc(|| Message::decode(Kind::Destination, &p, &limits));
    assert!(r.unwrap_err().to_string().contains("Destination.pages"));
    assert_eq!(largest, 0, "allocated before checking the count");
    // Registration claiming u32::MAX kv buffers.
    let mut p = vec![0u8; 16];
    p.extend(u32::MAX.to_le_bytes());
    let (r, largest) = largest_alloc(|| Message::decode(Kind::Registration, &p, &limits));
    assert!(r.is_err());
    assert_eq!(largest, 0);
    // An Abort claiming a reason of u32::MAX bytes.
    let mut p = vec![0u8; 16];
    p.extend(u32::MAX.to_le_bytes());
    let (r, largest) = largest_alloc(|| Message::decode(Kind::Abort, &p, &limits));
    assert!(r.is_err());
    assert_eq!(largest, 0);
    // A Transport claiming max_qps RDMA queue pairs with one entry's bytes, u32::MAX
    // of them, or any on TCP.
    let mut one = encode(&Message::Transport {
        transport: WireTransport::Rdma,
        qps: vec![qp(1, 2, 3)],
    })[FRAME_HEADER_LEN..]
        .to_vec();
    for count in [limits.max_qps, u32::MAX] {
        one[4..8].copy_from_slice(&count.to_le_bytes());
        let (r, largest) = largest_alloc(|| Message::decode(Kind::Transport, &one, &limits));
        assert!(r.unwrap_err().to_string().contains("Transport.qps"));
        assert_eq!(largest, 0, "allocated before checking the count");
    }
    one[0] = WireTransport::Tcp as u8;
    one[4..8].copy_from_slice(&1u32.to_le_bytes());
    let (r, largest) = largest_alloc(|| Message::decode(Kind::Transport, &one, &limits));
    assert_eq!(r, Err(ProtoError::QpsOnTcp { count: 1 }));
    assert_eq!(largest, 0);
    // A frame header claiming a payload over the bound is refused before the payload
    // buffer exists.
    let mut f = encode(&Message::Heartbeat { seq: 1 });
    f[8..12].copy_from_slice(&(limits.max_control_payload + 1).to_le_bytes());
    let (r, largest) = largest_alloc(|| proto::read_frame_header(&mut f.as_slice(), &limits));
    assert!(r.is_err());
    assert_eq!(largest, 0);
    // Within the bound, a control payload buffer is sized by the header: at most
    // max_control_payload, even when the stream then ends.
    let small = small_limits();
    f[8..12].copy_from_slice(&small.max_control_payload.to_le_bytes());
    let mut r = f.as_slice();
    let h = proto::read_frame_header(&mut r, &small).unwrap();
    let (res, largest) = largest_alloc(|| proto::read_control(&mut r, &h, &small));
    assert!(res.is_err());
    assert!(largest <= small.max_control_payload as usize, "{largest}");
}

// ---------------------------------------------------------------------------------------
// A live prefill engine.

const ITEM: usize = 256;
const PAGES: usize = 16;

/// Every engine of this file has one data connection per peer.
const ONE_CONN: (&str, &str) = ("connections_per_peer", "1");

#[test]
fn damaged_frames_on_a_live_socket_close_it_and_fail_the_peers_room() {
    let pmem = source(1, PAGES, ITEM);
    let p = engine("prefill", &pmem, &[ONE_CONN]);
    let limits = Limits::default();
    let mut runner = TestRunner::new(PropConfig {
        cases: 96,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let next_room = std::cell::Cell::new(1000u64);
    let malformed = std::cell::Cell::new(0u32);
    runner
        .run(&damaged(), |frame| {
            let room = next_room.get() + 1;
            next_room.set(room);
            let mut s = fake::decode_ctrl(p.address(), room, 1, PAGES, ITEM);
            p.room_create(room, RoomPeers::Decoders(1)).unwrap();
            fake::send_msg(&mut s, &destination(room, 1, vec![2, 3]));
            wait_state(&p, room, State::WaitingForInput);
            let errors = p.metrics().protocol_errors;
            let bad = !is_valid_control_frame(&frame, &limits);
            // The engine may close the connection before it has read it all (a bad
            // header): then these fail, as they should.
            let _ = s.write_all(&frame);
            // End the stream: a truncated frame then ends mid-frame, a whole one at a
            // boundary; either way the peer is gone and so is its room.
            let _ = s.shutdown(Shutdown::Write);
            fake::read_until_closed(&mut s);
            prop_assert_eq!(wait_terminal(&p, room), State::Failed);
            let why = p.room_failure(room).unwrap();
            prop_assert!(!why.message.is_empty());
            if bad {
                malformed.set(malformed.get() + 1);
                prop_assert_eq!(why.cause, Cause::PeerLost, "{}", why);
                if !frame.is_empty() {
                    prop_assert!(
                        p.metrics().protocol_errors > errors
                            || why.message.contains("control read failed")
                            || why.message.contains("closed"),
                        "{}",
                        why
                    );
                }
            }
            Ok(())
        })
        .unwrap();
    let malformed = malformed.get();
    assert!(malformed > 10, "only {malformed} malformed frames");

    // The engine lives on and serves a fresh, real decode engine end to end. (An id no
    // random frame names: a random frame can be a well-formed Abort for a small id, and
    // an abort for a room not created yet fails the next room created with that id.)
    let id = 0x5EED_F00D_0000_0001;
    let dmem = poisoned(1, PAGES, ITEM);
    let d = engine("decode", &dmem, &[ONE_CONN]);
    p.room_create(id, RoomPeers::Decoders(1)).unwrap();
    d.room_create(id, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    d.room_set_destination(id, &[5, 6], None).unwrap();
    p.enqueue_chunk(id, &[1, 2], true, None).unwrap();
    assert_eq!(wait_terminal(&d, id), State::Success);
    assert_eq!(wait_terminal(&p, id), State::Success);
    drop(d);
    assert_eq!(first_unlike_source(&dmem, &[1, 2], &[5, 6]), None);
}

/// A decode engine's first frames as a stranger would send them: a valid Hello, then
/// one authentication frame (maybe damaged), or a damaged Hello alone.
fn stranger_handshake() -> impl Strategy<Value = Vec<u8>> {
    let hello = encode(&Message::Hello {
        proto_version: PROTO_VERSION,
        role: Role::Decode,
        engine_id: 0x57,
        conn: ConnKind::Control,
        conn_index: 0,
    });
    let n = auth_seeds().len();
    let h = hello.clone();
    prop_oneof![
        // Hello, then an authentication frame with edits (or none).
        3 => (0..n, prop::collection::vec(edit(), 0..4)).prop_map(move |(i, edits)| {
            let mut f = auth_seeds()[i].clone();
            for e in &edits {
                apply(&mut f, e);
            }
            let mut all = h.clone();
            all.extend(f);
            all
        }),
        // A damaged Hello.
        1 => prop::collection::vec(edit(), 1..4).prop_map(move |edits| {
            let mut f = hello.clone();
            for e in &edits {
                apply(&mut f, e);
            }
            f
        }),
    ]
}

#[test]
fn damaged_or_forged_handshakes_are_refused_counted_and_change_no_room() {
    let pmem = vec![Region::new(PAGES, ITEM, |_| 0x33)];
    let key = "7e".repeat(32);
    let p = engine(
        "prefill",
        &pmem,
        &[
            ONE_CONN,
            ("auth_key", &key),
            ("bootstrap_timeout_ms", "60000"),
        ],
    );
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    let mut runner = TestRunner::new(PropConfig {
        cases: 64,
        failure_persistence: None,
        ..PropConfig::default()
    });
    let cases = std::cell::Cell::new(0u64);
    runner
        .run(&stranger_handshake(), |bytes| {
            let before = p.metrics().auth_failures;
            let mut s = TcpStream::connect(p.address()).unwrap();
            let _ = s.write_all(&bytes);
            // The stranger has no key: whatever it sent ends the connection once it
            // stops sending, without the prefill's Hello or Registration.
            let _ = s.shutdown(Shutdown::Write);
            for m in fake::frames(&fake::read_until_closed(&mut s)) {
                prop_assert!(m.kind().is_auth(), "a {} frame to a stranger", m.kind());
            }
            wait_until("the refusal to be counted", || {
                p.metrics().auth_failures > before
            });
            prop_assert_eq!(p.room_poll(1).unwrap(), State::Bootstrapping);
            cases.set(cases.get() + 1);
            Ok(())
        })
        .unwrap();
    assert_eq!(p.metrics().auth_failures, cases.get());
    assert!(pmem[0].holds_only(0x33));
    assert_eq!(p.metrics().protocol_errors, 0);
}
