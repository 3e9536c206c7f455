//! The wire protocol between two libkvxfer engines: a versioned, length-prefixed frame
//! codec in which every field is validated before anything is allocated.
//!
//! # Frames
//!
//! Every frame starts with a fixed [`FRAME_HEADER_LEN`]-byte header, little-endian
//! throughout:
//!
//! | offset | size | field         | rule                                                   |
//! |-------:|-----:|---------------|--------------------------------------------------------|
//! | 0      | 4    | `magic`       | u32 [`FRAME_MAGIC`] (`0x4B56_5846`; on the wire the bytes `46 58 56 4B`, i.e. `"FXVK"`) |
//! | 4      | 2    | `version`     | u16, must equal [`PROTO_VERSION`]                      |
//! | 6      | 1    | `kind`        | u8, a [`Kind`] (values are explicit and never reused)  |
//! | 7      | 1    | `flags`       | u8, must be 0 (reserved for future use)                |
//! | 8      | 4    | `payload_len` | u32, bytes following the header; bounded per kind by [`Limits`] |
//! | 12     | 4    | `reserved`    | u32, must be 0                                         |
//!
//! Control frames (every kind except [`Kind::Data`] and [`Kind::DataRuns`]) carry a
//! payload decoded by [`Message::decode`], which must consume the payload exactly. Data
//! frames carry a fixed [`DATA_HEADER_LEN`]-byte [`DataHeader`] followed by `byte_len` raw
//! bytes that the transport reads straight into destination memory; the codec never
//! touches them. A `DataRuns` frame carries several runs of one room: `count u32,
//! reserved u32 (0)`, `count` data headers, then each run's bytes in order
//! ([`read_runs`]; at most [`MAX_RUNS`] runs, no byte of a page written twice).
//!
//! # Control payloads (all integers little-endian)
//!
//! | kind           | payload                                                                  |
//! |----------------|--------------------------------------------------------------------------|
//! | `Hello`        | `proto_version u16, role u8, conn u8, conn_index u16, engine_id u64` (14 bytes) |
//! | `Registration` | `has_layout u8 (0/1)`; if 1, the kv layout `kv_heads u32, head_dim u32, dtype_bytes u32, tp_rank u32, tp_size u32, page_tokens u32, order u8 (0 = HND, 1 = NHD), kind u8 (0 = heads, 1 = latent)` (26 bytes, which must pass `KvLayout::check`); then `kv_count u32` + kv buffers, then `aux_count u32` + aux buffers; each buffer is `len u64, item_len u64, addr u64, layer_id i32, rkey u32` (32 bytes) |
//! | `Destination`  | `room u64, generation u64, aux_slot i64 (-1 = none), n_pages u32, pages u32 × n_pages` |
//! | `Done`         | `room u64, generation u64, room_echo u64 (= room), pages_sent u32, aux_sent u8 (0/1)` (29 bytes) |
//! | `Progress`     | `room u64, generation u64, aux_rows u32, bytes u64, n_kv u32`, then `n_kv` × `buffer u32, kv_bytes u64` (KV bytes per buffer; RDMA only), then `n_runs u32` (at most [`MAX_RUNS`]; 0 with `integrity=off`) and `n_runs` × `target u8, reserved u8 × 3 (0), buffer u32, first_page u32, n_pages u32, byte_len u32, page_off u32, digest u32` (28 bytes: each run the writes carried, as its data header would say, room and generation the message's) |
//! | `Abort`        | `room u64, generation u64, reason_len u32, reason UTF-8 bytes`           |
//! | `AbortAck`     | `room u64, generation u64` (16 bytes)                                    |
//! | `Heartbeat`    | `seq u64` (8 bytes)                                                      |
//! | `Transport`    | `transport u8 (1 = tcp, 2 = rdma), reserved u8 × 3 (0), n_qps u32`, then `n_qps` queue pairs, each `qpn u32, psn u32 (< 2^24), lid u16, gid [u8; 16], mtu u8 (ibv_mtu, 1..=5)` (27 bytes, unpadded); `n_qps` is 0 for tcp |
//! | `AuthHello`    | `auth u8 (1 = off, 2 = required), reserved u8 × 3 (0), key_id [u8; 8], nonce [u8; 32]` (44 bytes; key_id and nonce all zeros when auth is off) |
//! | `AuthChallenge`| `auth u8, reserved u8 × 3 (0), engine_id u64, nonce [u8; 32]` (44 bytes; engine_id and nonce all zeros when auth is off) |
//! | `AuthProof`    | `mac [u8; 32]` (HMAC-SHA256)                                             |
//! | `AuthRefused`  | `reason u8 (1 = mismatch, 2 = wrong key, 3 = bad proof, 4 = replay, 5 = no session, 6 = busy, 7 = TLS on one side only), auth u8` (2 bytes) |
//!
//! The encoding is canonical: a payload that decodes successfully re-encodes to the
//! same bytes.
//!
//! # Handshake
//!
//! With TLS configured (`crate::tls`), a control connection starts with a TLS 1.3
//! handshake and everything below travels inside it; data connections stay plain.
//! Every connection starts with the initiator's (decode engine's) `Hello` and
//! `AuthHello`. The responder answers `AuthRefused` (and closes) or `AuthChallenge`; with
//! authentication on, the initiator then sends its `AuthProof` and the responder, once it
//! verified it, its own (or `AuthRefused`). Only then does the responder send its `Hello`
//! and anything else; the accepting side decodes no other kind before that (see
//! `crate::auth` for the proof and the transcript it covers). On the control
//! connection each side then sends `Registration`, then one `Transport` naming the
//! transport it moves data with (and, for RDMA, its queue pairs); data connections carry
//! only the `Hello` before data frames. Whether the two sides' transports and
//! queue-pair counts fit together is the engine's check.
//!
//! # Validation
//!
//! Decoding checks magic, version, kind, flags, reserved bits, every length against
//! [`Limits`], every count against both its limit and the bytes actually remaining, every
//! enum value, UTF-8 and the exact consumption of the payload. A bad frame yields a
//! [`ProtoError`] naming the field and the bad value; the codec never panics and never
//! allocates from an unvalidated length. What the codec cannot know — whether a room,
//! generation, buffer index or page range was granted to this peer — is checked by the
//! engine (DESIGN.md invariant 8).
//!
//! # Reading from a stream
//!
//! [`read_frame_header`], then [`read_control`] or [`read_data_header`], serve a
//! blocking socket loop; see [`ReadError`] for how end of stream and timeouts are told
//! apart from protocol errors.

mod data;
mod frame;
mod message;
mod runs;
mod stream;
mod wire;

pub use data::{DataHeader, Target};
pub use frame::{FrameHeader, Kind, Limits, ProtoError};
pub use message::{
    truncate_reason, AuthMode, AuthRefusal, BufferInfo, ConnKind, HostInfo, Message, QpInfo,
    Registration, Role, SameHostSetting, WireTransport, AUTH_KEY_ID_LEN, AUTH_MAC_LEN,
    AUTH_NONCE_LEN, IPC_NONCE_LEN, MAX_IPC_RANGES_LEN, MAX_IPC_SOCKET_LEN,
};
pub use runs::{encode_runs_prefix, read_run_headers, read_runs, read_runs_count, MAX_RUNS};
pub use stream::{read_control, read_data_header, read_frame_header, ReadError};

/// The frame magic, `0x4B56_5846`. Encoded little-endian, so the first four bytes of
/// every frame are `46 58 56 4B` (`"FXVK"` in ASCII).
pub const FRAME_MAGIC: u32 = 0x4B56_5846;

/// The protocol version this build speaks and accepts (frame header and `Hello`).
///
/// Version 2 added [`Kind::Transport`] to the control handshake and [`Kind::Progress`]
/// for RDMA transfers. Version 3 added the authentication exchange that follows `Hello`
/// on every connection ([`Kind::AuthHello`] .. [`Kind::AuthRefused`]). Version 4 added
/// [`Kind::DataRuns`], several page runs of one room in one data frame. Version 5
/// replaced the unused fixed layout of `Registration` by an optional kv layout
/// ([`KvLayout`](crate::layout::KvLayout)) that the registration exchange checks, lets a
/// data header write at an offset inside one page (`DataHeader::page_off`, for layouts
/// that differ) and counts RDMA progress in KV bytes per buffer (`Progress::kv`); 6 added
/// the same-host path (`SameHost`, `PathChoice`, `Copy`, `Copied`); 7 added the digested
/// runs of `Progress` (verified bytes over RDMA) and says in `SameHost` whether the sender
/// registered CUDA device memory (a reserved byte before), which the same-host copy cannot
/// move; 8 added the CUDA IPC offer (`IpcOffer`), which a prefill engine sends after its
/// `SameHost` when either engine registered device memory.
pub const PROTO_VERSION: u16 = 8;

/// Length in bytes of the fixed frame header that starts every frame.
pub const FRAME_HEADER_LEN: usize = 16;

/// Length in bytes of the fixed [`DataHeader`] that starts every data frame's payload.
pub const DATA_HEADER_LEN: usize = 48;

/// Length in bytes of a data frame's prefix: frame header plus data header. The frame's
/// `byte_len` data bytes follow it.
pub const DATA_FRAME_PREFIX_LEN: usize = FRAME_HEADER_LEN + DATA_HEADER_LEN;

/// [`DATA_HEADER_LEN`] as a `u32`, for arithmetic on wire lengths.
const DATA_HEADER_LEN_U32: u32 = DATA_HEADER_LEN as u32;
