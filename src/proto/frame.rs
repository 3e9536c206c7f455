//! The fixed frame header, frame kinds, decoding limits and the codec's error type.

use std::fmt;

use super::{DATA_HEADER_LEN, DATA_HEADER_LEN_U32, FRAME_HEADER_LEN, FRAME_MAGIC, PROTO_VERSION};

/// What a frame carries. The numeric values are the wire encoding: explicit, and never
/// reused for another meaning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    /// Connection handshake ([`Message::Hello`](super::Message::Hello)).
    Hello = 1,
    /// Buffer registration exchange ([`Message::Registration`](super::Message::Registration)).
    Registration = 2,
    /// Decode → prefill: a room's destination pages ([`Message::Destination`](super::Message::Destination)).
    Destination = 3,
    /// Prefill → decode: page data, described by a [`DataHeader`](super::DataHeader).
    Data = 4,
    /// Prefill → decode: a room's transfer is complete ([`Message::Done`](super::Message::Done)).
    Done = 5,
    /// Either way: a room failed ([`Message::Abort`](super::Message::Abort)).
    Abort = 6,
    /// Acknowledges an abort once no write for the room can still land ([`Message::AbortAck`](super::Message::AbortAck)).
    AbortAck = 7,
    /// Liveness probe ([`Message::Heartbeat`](super::Message::Heartbeat)).
    Heartbeat = 8,
    /// Transport agreement and RDMA queue-pair data, once per peer right after
    /// `Registration` ([`Message::Transport`](super::Message::Transport)).
    Transport = 9,
    /// Prefill → decode over RDMA: writes of a room completed ([`Message::Progress`](super::Message::Progress)).
    Progress = 10,
    /// Initiator → responder, right after `Hello`: its authentication setting, key id
    /// and nonce ([`Message::AuthHello`](super::Message::AuthHello)).
    AuthHello = 11,
    /// Responder → initiator: its setting and, with authentication, its engine id and
    /// nonce ([`Message::AuthChallenge`](super::Message::AuthChallenge)).
    AuthChallenge = 12,
    /// Either way: an HMAC-SHA256 proof of the key ([`Message::AuthProof`](super::Message::AuthProof)).
    AuthProof = 13,
    /// Either way: the sender refuses the connection and closes it
    /// ([`Message::AuthRefused`](super::Message::AuthRefused)).
    AuthRefused = 14,
    /// Prefill → decode: several page runs of one room, their headers first, then their
    /// bytes ([`runs`](super::runs)).
    DataRuns = 15,
    /// Either way on the control connection, once per peer after `Transport`: the
    /// sender's host identity for the same-host path ([`Message::SameHost`](super::Message::SameHost)).
    SameHost = 16,
    /// Decode → prefill, and echoed back: the path the pairing takes
    /// ([`Message::PathChoice`](super::Message::PathChoice)).
    PathChoice = 17,
    /// Prefill → decode on a same-host data connection: page runs of one room for the
    /// decode engine to copy from the prefill's memory ([`Message::Copy`](super::Message::Copy)).
    Copy = 18,
    /// Decode → prefill on a same-host data connection: the runs of a `Copy` were copied
    /// ([`Message::Copied`](super::Message::Copied)).
    Copied = 19,
    /// Prefill → decode on the control connection, after its `SameHost`, when device
    /// memory is registered on either side: the CUDA IPC offer
    /// ([`Message::IpcOffer`](super::Message::IpcOffer)).
    IpcOffer = 20,
}

impl Kind {
    /// Every kind, in wire-value order.
    pub const ALL: [Kind; 20] = [
        Kind::Hello,
        Kind::Registration,
        Kind::Destination,
        Kind::Data,
        Kind::Done,
        Kind::Abort,
        Kind::AbortAck,
        Kind::Heartbeat,
        Kind::Transport,
        Kind::Progress,
        Kind::AuthHello,
        Kind::AuthChallenge,
        Kind::AuthProof,
        Kind::AuthRefused,
        Kind::DataRuns,
        Kind::SameHost,
        Kind::PathChoice,
        Kind::Copy,
        Kind::Copied,
        Kind::IpcOffer,
    ];

    /// The wire value.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The kind with wire value `v`, if any.
    pub const fn from_u8(v: u8) -> Option<Kind> {
        match v {
            1 => Some(Kind::Hello),
            2 => Some(Kind::Registration),
            3 => Some(Kind::Destination),
            4 => Some(Kind::Data),
            5 => Some(Kind::Done),
            6 => Some(Kind::Abort),
            7 => Some(Kind::AbortAck),
            8 => Some(Kind::Heartbeat),
            9 => Some(Kind::Transport),
            10 => Some(Kind::Progress),
            11 => Some(Kind::AuthHello),
            12 => Some(Kind::AuthChallenge),
            13 => Some(Kind::AuthProof),
            14 => Some(Kind::AuthRefused),
            15 => Some(Kind::DataRuns),
            16 => Some(Kind::SameHost),
            17 => Some(Kind::PathChoice),
            18 => Some(Kind::Copy),
            19 => Some(Kind::Copied),
            20 => Some(Kind::IpcOffer),
            _ => None,
        }
    }

    /// True for every kind whose payload is a [`Message`](super::Message), i.e. every
    /// kind except the data frames, [`Kind::Data`] and [`Kind::DataRuns`].
    pub const fn is_control(self) -> bool {
        !matches!(self, Kind::Data | Kind::DataRuns)
    }

    /// True for the kinds of the authentication exchange, which follows `Hello` and
    /// precedes everything else on a connection.
    pub const fn is_auth(self) -> bool {
        matches!(
            self,
            Kind::AuthHello | Kind::AuthChallenge | Kind::AuthProof | Kind::AuthRefused
        )
    }

    /// The kind's name, as used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            Kind::Hello => "Hello",
            Kind::Registration => "Registration",
            Kind::Destination => "Destination",
            Kind::Data => "Data",
            Kind::Done => "Done",
            Kind::Abort => "Abort",
            Kind::AbortAck => "AbortAck",
            Kind::Heartbeat => "Heartbeat",
            Kind::Transport => "Transport",
            Kind::Progress => "Progress",
            Kind::AuthHello => "AuthHello",
            Kind::AuthChallenge => "AuthChallenge",
            Kind::AuthProof => "AuthProof",
            Kind::AuthRefused => "AuthRefused",
            Kind::DataRuns => "DataRuns",
            Kind::SameHost => "SameHost",
            Kind::PathChoice => "PathChoice",
            Kind::Copy => "Copy",
            Kind::Copied => "Copied",
            Kind::IpcOffer => "IpcOffer",
        }
    }
}

impl TryFrom<u8> for Kind {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::UnknownKind`].
    fn try_from(v: u8) -> Result<Kind, ProtoError> {
        Kind::from_u8(v).ok_or(ProtoError::UnknownKind { found: v })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Bounds applied while decoding, so that no frame can make the receiver allocate or
/// accept more than these. Both sides should use the same values; a sender can check a
/// message against them with [`Message::validate`](super::Message::validate) and
/// [`DataHeader::check`](super::DataHeader::check).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Largest payload of a control frame, in bytes. Default 4 MiB.
    pub max_control_payload: u32,
    /// Most pages in one `Destination`. Default `1 << 20`.
    pub max_pages: u32,
    /// Most buffers in each list (kv, aux) of a `Registration`. Default 4096.
    pub max_buffers: u32,
    /// Longest `Abort` reason, in bytes of UTF-8. Default 1024.
    pub max_reason_len: u32,
    /// Most data bytes in one data frame (excluding its data header). Default 64 MiB.
    pub max_data_bytes: u32,
    /// Most queue pairs in one `Transport` message. Default 512: one per prefill worker
    /// (`workers` is at most 256) plus the echo a replacement answer carries.
    pub max_qps: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_control_payload: 4 << 20,
            max_pages: 1 << 20,
            max_buffers: 4096,
            max_reason_len: 1024,
            max_data_bytes: 64 << 20,
            max_qps: 512,
        }
    }
}

impl Limits {
    /// The largest `payload_len` accepted for a frame of `kind`: `max_control_payload`
    /// for control kinds, [`DATA_HEADER_LEN`] + `max_data_bytes` for [`Kind::Data`], and
    /// the headers of [`MAX_RUNS`](super::MAX_RUNS) runs + `max_data_bytes` for
    /// [`Kind::DataRuns`].
    pub fn max_payload(&self, kind: Kind) -> u64 {
        match kind {
            Kind::Data => DATA_HEADER_LEN as u64 + u64::from(self.max_data_bytes),
            Kind::DataRuns => {
                super::runs::headers_len(super::MAX_RUNS) as u64 + u64::from(self.max_data_bytes)
            }
            _ => u64::from(self.max_control_payload),
        }
    }
}

/// A validated frame header. Magic, version, flags and reserved bits are implied: they
/// are checked by [`FrameHeader::decode`] and written by [`FrameHeader::encode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// What the payload carries.
    pub kind: Kind,
    /// Bytes of payload following the header.
    pub payload_len: u32,
}

impl FrameHeader {
    /// A header for a frame of `kind` with `payload_len` payload bytes.
    pub const fn new(kind: Kind, payload_len: u32) -> Self {
        FrameHeader { kind, payload_len }
    }

    /// The header's wire form: magic, [`PROTO_VERSION`], kind, flags 0, payload_len,
    /// reserved 0.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut out = [0u8; FRAME_HEADER_LEN];
        out[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
        out[4..6].copy_from_slice(&PROTO_VERSION.to_le_bytes());
        out[6] = self.kind.as_u8();
        out[7] = 0;
        out[8..12].copy_from_slice(&self.payload_len.to_le_bytes());
        // out[12..16]: reserved, zero.
        out
    }

    /// Decodes and validates a header, in this order: magic, version, reserved, kind,
    /// flags, then `payload_len` against `limits` for that kind (see
    /// [`FrameHeader::check_payload_len`]). The version is checked before the kind so
    /// that a peer speaking a newer protocol gets [`ProtoError::UnsupportedVersion`].
    pub fn decode(buf: &[u8; FRAME_HEADER_LEN], limits: &Limits) -> Result<Self, ProtoError> {
        let magic = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
        if magic != FRAME_MAGIC {
            return Err(ProtoError::BadMagic { found: magic });
        }
        let version = u16::from_le_bytes([buf[4], buf[5]]);
        if version != PROTO_VERSION {
            return Err(ProtoError::UnsupportedVersion {
                found: version,
                supported: PROTO_VERSION,
            });
        }
        let reserved = u32::from_le_bytes([buf[12], buf[13], buf[14], buf[15]]);
        if reserved != 0 {
            return Err(ProtoError::NonzeroReserved {
                field: "FrameHeader.reserved",
                found: u64::from(reserved),
            });
        }
        let kind = Kind::try_from(buf[6])?;
        let flags = buf[7];
        if flags != 0 {
            return Err(ProtoError::NonzeroFlags { found: flags });
        }
        let payload_len = u32::from_le_bytes([buf[8], buf[9], buf[10], buf[11]]);
        let header = FrameHeader { kind, payload_len };
        header.check_payload_len(limits)?;
        Ok(header)
    }

    /// Checks `payload_len` against `limits` for this kind: at most
    /// [`Limits::max_payload`], and for data frames at least [`DATA_HEADER_LEN`].
    pub fn check_payload_len(&self, limits: &Limits) -> Result<(), ProtoError> {
        let len = u64::from(self.payload_len);
        let max = limits.max_payload(self.kind);
        if len > max {
            return Err(ProtoError::PayloadTooLarge {
                kind: self.kind,
                len,
                max,
            });
        }
        if !self.kind.is_control() && self.payload_len < DATA_HEADER_LEN_U32 {
            return Err(ProtoError::PayloadTooSmall {
                kind: self.kind,
                len: self.payload_len,
                min: DATA_HEADER_LEN_U32,
            });
        }
        Ok(())
    }
}

/// Why a frame was rejected (or could not be encoded). Every variant names the field and
/// the offending value; `Display` gives a one-line message suitable for a room's failure
/// reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProtoError {
    /// The frame did not start with [`FRAME_MAGIC`].
    BadMagic {
        /// The u32 found instead.
        found: u32,
    },
    /// The peer speaks a protocol version this build does not.
    UnsupportedVersion {
        /// The peer's version.
        found: u16,
        /// The version this build speaks ([`PROTO_VERSION`]).
        supported: u16,
    },
    /// The frame kind byte is not a known [`Kind`].
    UnknownKind {
        /// The byte found.
        found: u8,
    },
    /// The frame header's flags byte is not 0.
    NonzeroFlags {
        /// The flags found.
        found: u8,
    },
    /// A reserved field is not 0.
    NonzeroReserved {
        /// Which field, e.g. `"FrameHeader.reserved"`.
        field: &'static str,
        /// The value found.
        found: u64,
    },
    /// A payload is longer than the limit for its kind.
    PayloadTooLarge {
        /// The frame kind.
        kind: Kind,
        /// The payload length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A payload is shorter than the minimum for its kind (data frames).
    PayloadTooSmall {
        /// The frame kind.
        kind: Kind,
        /// The payload length.
        len: u32,
        /// The minimum.
        min: u32,
    },
    /// [`Message::decode`](super::Message::decode) or
    /// [`read_control`](super::read_control) was given a frame that is not a control
    /// frame.
    NotControlKind {
        /// The kind given.
        kind: Kind,
    },
    /// [`read_data_header`](super::read_data_header) was given a control frame header.
    NotDataKind {
        /// The kind given.
        kind: Kind,
    },
    /// The payload ended while reading a field.
    Truncated {
        /// The field being read, e.g. `"Hello.engine_id"`.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes that were left.
        remaining: usize,
    },
    /// The payload continued after the message ended.
    TrailingBytes {
        /// The frame kind.
        kind: Kind,
        /// How many bytes were left over.
        extra: usize,
    },
    /// An element count exceeds its limit.
    CountOverLimit {
        /// The counted field, e.g. `"Destination.pages"`.
        field: &'static str,
        /// The count.
        count: u64,
        /// The [`Limits`] field that bounds it, e.g. `"max_pages"`.
        limit: &'static str,
        /// The limit's value.
        max: u64,
    },
    /// An element count needs more bytes than remain in the payload.
    CountExceedsPayload {
        /// The counted field.
        field: &'static str,
        /// The count.
        count: u32,
        /// Wire size of one element.
        elem_size: usize,
        /// Bytes remaining in the payload.
        remaining: usize,
    },
    /// A string is longer than its limit.
    StringTooLong {
        /// The field, e.g. `"Abort.reason"`.
        field: &'static str,
        /// Its length in bytes.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// A string is not valid UTF-8.
    InvalidUtf8 {
        /// The field.
        field: &'static str,
        /// Length of the longest valid UTF-8 prefix.
        valid_up_to: usize,
    },
    /// `Hello.role` is not a [`Role`](super::Role).
    BadRole {
        /// The byte found.
        found: u8,
    },
    /// `Hello.conn` is not a [`ConnKind`](super::ConnKind).
    BadConnKind {
        /// The byte found.
        found: u8,
    },
    /// `DataHeader.target` is not a [`Target`](super::Target).
    BadTarget {
        /// The byte found.
        found: u8,
    },
    /// A boolean byte is neither 0 nor 1.
    BadBool {
        /// The field, e.g. `"Done.aux_sent"`.
        field: &'static str,
        /// The byte found.
        found: u8,
    },
    /// `Destination.aux_slot` is neither -1 (none) nor in `0..=u32::MAX`.
    BadAuxSlot {
        /// The value found.
        found: i64,
    },
    /// A registered buffer has `item_len` 0.
    ZeroItemLen {
        /// The list, `"Registration.kv"` or `"Registration.aux"`.
        field: &'static str,
        /// Index of the buffer in its list.
        index: usize,
    },
    /// A registered buffer is shorter than one item.
    BufferShorterThanItem {
        /// The list, `"Registration.kv"` or `"Registration.aux"`.
        field: &'static str,
        /// Index of the buffer in its list.
        index: usize,
        /// The buffer's `len`.
        len: u64,
        /// The buffer's `item_len`.
        item_len: u64,
    },
    /// A registered buffer's `layer_id` is negative but not -1 (none).
    BadLayerId {
        /// The list, `"Registration.kv"` or `"Registration.aux"`.
        field: &'static str,
        /// Index of the buffer in its list.
        index: usize,
        /// The value found.
        found: i32,
    },
    /// `Registration.layout.order` is not a [`PageOrder`](crate::layout::PageOrder)
    /// value (0 = HND, 1 = NHD).
    BadPageOrder {
        /// The byte found.
        found: u8,
    },
    /// `Registration.layout.kind` is not a [`KvKind`](crate::layout::KvKind) value
    /// (0 = heads, 1 = latent).
    BadKvKind {
        /// The byte found.
        found: u8,
    },
    /// `Registration.layout` fails [`KvLayout::check`](crate::layout::KvLayout::check).
    BadLayout {
        /// The field, e.g. `"Registration.layout.tp_rank"`.
        field: &'static str,
        /// What is wrong with it (its `Display` names the values).
        error: crate::layout::LayoutError,
    },
    /// `Done.room_echo` differs from `Done.room`: the frame is corrupt.
    RoomEchoMismatch {
        /// `Done.room`.
        room: u64,
        /// `Done.room_echo`.
        room_echo: u64,
    },
    /// A data header's `byte_len` disagrees with its frame's `payload_len`.
    DataLenMismatch {
        /// `DataHeader.byte_len`.
        byte_len: u32,
        /// The frame's `payload_len`, which must be [`DATA_HEADER_LEN`] + `byte_len`.
        frame_payload_len: u32,
    },
    /// A `DataRuns` frame's run count is 0 or above [`MAX_RUNS`](super::MAX_RUNS), or
    /// its headers do not fit in its payload.
    BadRunCount {
        /// The count found.
        found: u32,
        /// The frame's `payload_len`.
        frame_payload_len: u32,
    },
    /// The runs of a `DataRuns` frame name more than one room (or generation).
    RunsOfSeveralRooms {
        /// The first run's room and generation.
        first: (u64, u64),
        /// Another run's.
        found: (u64, u64),
    },
    /// Two runs of a `DataRuns` frame write the same page of a buffer.
    RunsOverlap {
        /// The buffer (as the sender numbers it).
        buffer: u32,
        /// A page both write.
        page: u32,
    },
    /// The runs' `byte_len`s of a `DataRuns` frame do not add up to the bytes after its
    /// headers.
    RunsLenMismatch {
        /// The sum of the runs' `byte_len`.
        sum: u64,
        /// The frame's `payload_len`.
        frame_payload_len: u32,
    },
    /// A data header's `byte_len` exceeds `max_data_bytes`.
    DataTooLarge {
        /// `DataHeader.byte_len`.
        byte_len: u32,
        /// `Limits::max_data_bytes`.
        max: u32,
    },
    /// A data header's `n_pages` is 0.
    ZeroPages,
    /// A data header gives a `page_off` with more than one page.
    OffsetInSeveralPages {
        /// `DataHeader.page_off`.
        page_off: u32,
        /// `DataHeader.n_pages`.
        n_pages: u32,
    },
    /// A data header's `first_page + n_pages` overflows u32.
    PageRangeOverflow {
        /// `DataHeader.first_page`.
        first_page: u32,
        /// `DataHeader.n_pages`.
        n_pages: u32,
    },
    /// `Transport.transport` is not a [`WireTransport`](super::WireTransport).
    BadTransport {
        /// The byte found.
        found: u8,
    },
    /// A `Transport` message for TCP lists queue pairs (it must list none).
    QpsOnTcp {
        /// The number of queue pairs listed.
        count: u32,
    },
    /// A queue pair's `psn` does not fit in 24 bits.
    BadPsn {
        /// Index of the queue pair in `Transport.qps`.
        index: usize,
        /// The value found.
        found: u32,
    },
    /// A queue pair's `mtu` is not an `ibv_mtu` value (1 = 256 bytes ..= 5 = 4096 bytes).
    BadMtu {
        /// Index of the queue pair in `Transport.qps`.
        index: usize,
        /// The value found.
        found: u8,
    },
    /// An authentication setting byte is not an [`AuthMode`](super::AuthMode).
    BadAuthMode {
        /// The field, e.g. `"AuthHello.auth"`.
        field: &'static str,
        /// The byte found.
        found: u8,
    },
    /// `AuthRefused.reason` is not an [`AuthRefusal`](super::AuthRefusal).
    BadAuthRefusal {
        /// The byte found.
        found: u8,
    },
    /// A field that only authentication uses is not all zeros although the message says
    /// authentication is off.
    AuthDataWithAuthOff {
        /// The field, e.g. `"AuthHello.nonce"`.
        field: &'static str,
    },
    /// Encoding: the payload would not fit the u32 `payload_len` field.
    EncodeTooLarge {
        /// The frame kind.
        kind: Kind,
        /// The payload length it would have.
        len: u64,
    },
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ProtoError::*;
        match self {
            BadMagic { found } => write!(
                f,
                "bad frame magic {found:#010x} (expected {FRAME_MAGIC:#010x})"
            ),
            UnsupportedVersion { found, supported } => write!(
                f,
                "unsupported protocol version {found} (this side speaks version {supported})"
            ),
            UnknownKind { found } => write!(f, "unknown frame kind {found}"),
            NonzeroFlags { found } => write!(f, "frame flags must be 0, got {found:#04x}"),
            NonzeroReserved { field, found } => {
                write!(f, "{field} must be 0, got {found:#x}")
            }
            PayloadTooLarge { kind, len, max } => write!(
                f,
                "{kind} frame payload_len {len} exceeds the limit of {max} bytes"
            ),
            PayloadTooSmall { kind, len, min } => write!(
                f,
                "{kind} frame payload_len {len} is below the minimum of {min} bytes"
            ),
            NotControlKind { kind } => write!(f, "{kind} frame is not a control message"),
            NotDataKind { kind } => write!(f, "{kind} frame is not a data frame"),
            Truncated {
                field,
                needed,
                remaining,
            } => write!(
                f,
                "payload truncated at {field}: needs {needed} bytes, {remaining} remain"
            ),
            TrailingBytes { kind, extra } => {
                write!(f, "{kind} payload has {extra} trailing bytes")
            }
            CountOverLimit {
                field,
                count,
                limit,
                max,
            } => write!(f, "{field} count {count} exceeds {limit} = {max}"),
            CountExceedsPayload {
                field,
                count,
                elem_size,
                remaining,
            } => write!(
                f,
                "{field} count {count} needs {count} x {elem_size} bytes but only {remaining} remain in the payload"
            ),
            StringTooLong { field, len, max } => {
                write!(f, "{field} is {len} bytes, longer than the limit of {max}")
            }
            InvalidUtf8 { field, valid_up_to } => write!(
                f,
                "{field} is not valid UTF-8 (invalid after byte {valid_up_to})"
            ),
            BadRole { found } => write!(
                f,
                "Hello.role {found} is not a role (1 = prefill, 2 = decode)"
            ),
            BadConnKind { found } => write!(
                f,
                "Hello.conn {found} is not a connection kind (1 = control, 2 = data)"
            ),
            BadTarget { found } => write!(
                f,
                "DataHeader.target {found} is not a target (0 = kv, 1 = aux)"
            ),
            BadBool { field, found } => write!(f, "{field} must be 0 or 1, got {found}"),
            BadPageOrder { found } => write!(
                f,
                "Registration.layout.order {found} is neither 0 (HND) nor 1 (NHD)"
            ),
            BadKvKind { found } => write!(
                f,
                "Registration.layout.kind {found} is neither 0 (heads) nor 1 (latent)"
            ),
            BadLayout { field, error } => write!(f, "{field}: {error}"),
            BadAuxSlot { found } => write!(
                f,
                "Destination.aux_slot {found} is invalid (-1 = none, else 0..=4294967295)"
            ),
            ZeroItemLen { field, index } => write!(f, "{field}[{index}].item_len is 0"),
            BufferShorterThanItem {
                field,
                index,
                len,
                item_len,
            } => write!(
                f,
                "{field}[{index}].len {len} is shorter than its item_len {item_len}"
            ),
            BadLayerId {
                field,
                index,
                found,
            } => write!(
                f,
                "{field}[{index}].layer_id {found} is invalid (-1 = none, else >= 0)"
            ),
            RoomEchoMismatch { room, room_echo } => write!(
                f,
                "Done.room_echo {room_echo:#x} does not match Done.room {room:#x} (corrupt frame)"
            ),
            DataLenMismatch {
                byte_len,
                frame_payload_len,
            } => write!(
                f,
                "DataHeader.byte_len {byte_len} does not match frame payload_len {frame_payload_len} - {DATA_HEADER_LEN}"
            ),
            BadRunCount {
                found,
                frame_payload_len,
            } => write!(
                f,
                "DataRuns.count {found} is not within 1..={} or does not fit in payload_len {frame_payload_len}",
                super::MAX_RUNS
            ),
            RunsOfSeveralRooms { first, found } => write!(
                f,
                "a DataRuns frame names room {} generation {} and room {} generation {}",
                first.0, first.1, found.0, found.1
            ),
            RunsOverlap { buffer, page } => write!(
                f,
                "two runs of a DataRuns frame write page {page} of buffer {buffer}"
            ),
            RunsLenMismatch {
                sum,
                frame_payload_len,
            } => write!(
                f,
                "DataRuns byte_len total {sum} does not match the {frame_payload_len}-byte payload after its headers"
            ),
            DataTooLarge { byte_len, max } => write!(
                f,
                "DataHeader.byte_len {byte_len} exceeds max_data_bytes = {max}"
            ),
            ZeroPages => f.write_str("DataHeader.n_pages is 0"),
            OffsetInSeveralPages { page_off, n_pages } => write!(
                f,
                "DataHeader.page_off {page_off} is given with {n_pages} pages (only one page \
                 may start at an offset)"
            ),
            PageRangeOverflow {
                first_page,
                n_pages,
            } => write!(
                f,
                "DataHeader.first_page {first_page} + n_pages {n_pages} overflows u32"
            ),
            BadTransport { found } => write!(
                f,
                "Transport.transport {found} is not a transport (1 = tcp, 2 = rdma)"
            ),
            QpsOnTcp { count } => write!(
                f,
                "Transport.qps has {count} queue pairs but the transport is tcp (must be 0)"
            ),
            BadPsn { index, found } => write!(
                f,
                "Transport.qps[{index}].psn {found:#x} does not fit in 24 bits"
            ),
            BadMtu { index, found } => write!(
                f,
                "Transport.qps[{index}].mtu {found} is not an ibv_mtu (1..=5)"
            ),
            BadAuthMode { field, found } => write!(
                f,
                "{field} {found} is not an authentication setting (1 = off, 2 = required)"
            ),
            BadAuthRefusal { found } => write!(
                f,
                "AuthRefused.reason {found} is not a refusal reason (1..=6)"
            ),
            AuthDataWithAuthOff { field } => {
                write!(f, "{field} must be all zeros when authentication is off")
            }
            EncodeTooLarge { kind, len } => write!(
                f,
                "cannot encode {kind} frame: payload of {len} bytes does not fit in u32"
            ),
        }
    }
}

impl std::error::Error for ProtoError {}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_bytes(kind: u8, payload_len: u32) -> [u8; FRAME_HEADER_LEN] {
        let mut b = FrameHeader::new(Kind::Hello, payload_len).encode();
        b[6] = kind;
        b
    }

    #[test]
    fn header_round_trips_for_every_kind() {
        let limits = Limits::default();
        for kind in Kind::ALL {
            for len in [DATA_HEADER_LEN_U32, 1000, limits.max_control_payload] {
                let h = FrameHeader::new(kind, len);
                assert_eq!(FrameHeader::decode(&h.encode(), &limits), Ok(h));
            }
        }
    }

    #[test]
    fn header_wire_layout_is_documented_one() {
        let b = FrameHeader::new(Kind::Abort, 0x0102_0304).encode();
        assert_eq!(
            b,
            [b'F', b'X', b'V', b'K', 8, 0, 6, 0, 4, 3, 2, 1, 0, 0, 0, 0]
        );
    }

    #[test]
    fn kind_values_are_fixed() {
        let values: Vec<u8> = Kind::ALL.iter().map(|k| k.as_u8()).collect();
        assert_eq!(
            values,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
        );
        for v in 0..=u8::MAX {
            match Kind::try_from(v) {
                Ok(k) => assert_eq!(k.as_u8(), v),
                Err(e) => assert_eq!(e, ProtoError::UnknownKind { found: v }),
            }
        }
        assert!(!Kind::Data.is_control() && !Kind::DataRuns.is_control());
        assert!(Kind::Heartbeat.is_control());
        assert!(Kind::Transport.is_control());
        assert_eq!(Kind::Transport.name(), "Transport");
        assert_eq!(Kind::try_from(9), Ok(Kind::Transport));
        assert!(Kind::AuthHello.is_control() && Kind::AuthRefused.is_auth());
        assert!(!Kind::Hello.is_auth() && !Kind::Data.is_auth());
        assert_eq!(Kind::try_from(13), Ok(Kind::AuthProof));
        for k in Kind::ALL {
            assert_eq!(Kind::from_u8(k.as_u8()), Some(k));
            assert_eq!(k.to_string(), k.name());
        }
    }

    #[test]
    fn bad_magic_is_rejected() {
        let mut b = header_bytes(1, 0);
        b[0] = b'G';
        let e = FrameHeader::decode(&b, &Limits::default()).unwrap_err();
        assert_eq!(e, ProtoError::BadMagic { found: 0x4B56_5847 });
        assert!(e.to_string().contains("0x4b565847"), "{e}");
    }

    #[test]
    fn unknown_version_reports_both_versions() {
        for old_or_new in [PROTO_VERSION - 1, PROTO_VERSION + 1] {
            let mut b = header_bytes(1, 0);
            b[4..6].copy_from_slice(&old_or_new.to_le_bytes());
            let e = FrameHeader::decode(&b, &Limits::default()).unwrap_err();
            assert_eq!(
                e,
                ProtoError::UnsupportedVersion {
                    found: old_or_new,
                    supported: PROTO_VERSION
                }
            );
            assert!(
                e.to_string().contains(&format!("version {old_or_new}")),
                "{e}"
            );
        }
    }

    #[test]
    fn version_is_checked_before_kind() {
        let mut b = header_bytes(200, 0);
        b[4] = 9;
        assert!(matches!(
            FrameHeader::decode(&b, &Limits::default()),
            Err(ProtoError::UnsupportedVersion { found: 9, .. })
        ));
    }

    #[test]
    fn unknown_kinds_are_rejected() {
        for k in [0u8, 21, 0xff] {
            assert_eq!(
                FrameHeader::decode(&header_bytes(k, 0), &Limits::default()),
                Err(ProtoError::UnknownKind { found: k })
            );
        }
    }

    #[test]
    fn nonzero_flags_are_rejected() {
        let mut b = header_bytes(1, 0);
        b[7] = 0x80;
        assert_eq!(
            FrameHeader::decode(&b, &Limits::default()),
            Err(ProtoError::NonzeroFlags { found: 0x80 })
        );
    }

    #[test]
    fn nonzero_reserved_is_rejected() {
        let mut b = header_bytes(1, 0);
        b[15] = 1;
        assert_eq!(
            FrameHeader::decode(&b, &Limits::default()),
            Err(ProtoError::NonzeroReserved {
                field: "FrameHeader.reserved",
                found: 0x0100_0000
            })
        );
    }

    #[test]
    fn oversize_control_payload_is_rejected() {
        let limits = Limits::default();
        let max = limits.max_control_payload;
        assert!(FrameHeader::decode(&header_bytes(3, max), &limits).is_ok());
        let e = FrameHeader::decode(&header_bytes(3, max + 1), &limits).unwrap_err();
        assert_eq!(
            e,
            ProtoError::PayloadTooLarge {
                kind: Kind::Destination,
                len: u64::from(max) + 1,
                max: u64::from(max)
            }
        );
        assert!(e.to_string().contains("Destination"), "{e}");
    }

    #[test]
    fn data_payload_is_bounded_by_data_limit_plus_header() {
        let limits = Limits {
            max_data_bytes: 100,
            max_control_payload: 10,
            ..Limits::default()
        };
        let ok = DATA_HEADER_LEN_U32 + 100;
        assert!(FrameHeader::decode(&header_bytes(4, ok), &limits).is_ok());
        assert!(matches!(
            FrameHeader::decode(&header_bytes(4, ok + 1), &limits),
            Err(ProtoError::PayloadTooLarge {
                kind: Kind::Data,
                ..
            })
        ));
        assert_eq!(
            FrameHeader::decode(&header_bytes(4, DATA_HEADER_LEN_U32 - 1), &limits),
            Err(ProtoError::PayloadTooSmall {
                kind: Kind::Data,
                len: DATA_HEADER_LEN_U32 - 1,
                min: DATA_HEADER_LEN_U32
            })
        );
    }

    #[test]
    fn max_limits_do_not_overflow() {
        let limits = Limits {
            max_control_payload: u32::MAX,
            max_data_bytes: u32::MAX,
            ..Limits::default()
        };
        for kind in Kind::ALL {
            let h = FrameHeader::new(kind, u32::MAX);
            assert_eq!(FrameHeader::decode(&h.encode(), &limits), Ok(h));
        }
    }

    #[test]
    fn every_error_message_is_nonempty_and_single_line() {
        let samples = [
            ProtoError::ZeroPages,
            ProtoError::OffsetInSeveralPages {
                page_off: 8,
                n_pages: 2,
            },
            ProtoError::BadPageOrder { found: 2 },
            ProtoError::BadKvKind { found: 9 },
            ProtoError::BadLayout {
                field: "Registration.layout.tp_rank",
                error: crate::layout::LayoutError::RankNotBelowSize {
                    tp_rank: 4,
                    tp_size: 4,
                },
            },
            ProtoError::BadAuxSlot { found: -2 },
            ProtoError::BadTransport { found: 0 },
            ProtoError::QpsOnTcp { count: 3 },
            ProtoError::BadPsn {
                index: 1,
                found: 1 << 24,
            },
            ProtoError::BadMtu { index: 0, found: 6 },
            ProtoError::BadAuthMode {
                field: "AuthHello.auth",
                found: 0,
            },
            ProtoError::BadAuthRefusal { found: 9 },
            ProtoError::AuthDataWithAuthOff {
                field: "AuthChallenge.nonce",
            },
            ProtoError::EncodeTooLarge {
                kind: Kind::Abort,
                len: 1 << 33,
            },
        ];
        for e in samples {
            let s = e.to_string();
            assert!(!s.is_empty() && !s.contains('\n'), "{s}");
        }
    }
}
