//! Control messages: every frame kind except [`Kind::Data`].

use super::frame::{FrameHeader, Kind, Limits, ProtoError};
use super::wire::{put_i32, put_i64, put_u16, put_u32, put_u64, WireReader};
use super::FRAME_HEADER_LEN;
use crate::layout::{KvKind, KvLayout, PageOrder};

/// Wire size of one [`BufferInfo`].
const BUFFER_INFO_LEN: usize = 32;
/// Wire size of a [`KvLayout`] after its presence byte: six u32 fields, then the order
/// and the kind (u8 each).
const LAYOUT_LEN: usize = 26;
/// Wire size of one [`QpInfo`]: qpn, psn, lid, gid, mtu, unpadded.
const QP_INFO_LEN: usize = 27;
/// Wire size of a `Transport` payload before its queue pairs: transport, three reserved
/// bytes, the count.
const TRANSPORT_FIXED_LEN: usize = 8;
/// Wire size of one digested run of a `Progress`: target, three reserved bytes, buffer,
/// first page, pages, byte length, offset in the page, digest.
const PROGRESS_RUN_LEN: usize = 28;
/// Wire size of a [`HostInfo`]: setting, device memory, two reserved bytes, boot id, the PID and
/// network namespaces, pid, uid, probe address and probe.
const HOST_INFO_LEN: usize = 68;
/// Wire size of one run of a `Copy`: its data header and source address.
const COPY_RUN_LEN: usize = super::DATA_HEADER_LEN + 8;
/// Name of the queue-pair list, as used in errors.
const QP_LIST: &str = "Transport.qps";
/// Name of the kv buffer list, as used in errors.
const KV_LIST: &str = "Registration.kv";
/// Name of the aux buffer list, as used in errors.
const AUX_LIST: &str = "Registration.aux";
/// Field names of a kv buffer, in wire order, as used in errors.
const KV_NAMES: [&str; 5] = [
    "Registration.kv[].len",
    "Registration.kv[].item_len",
    "Registration.kv[].addr",
    "Registration.kv[].layer_id",
    "Registration.kv[].rkey",
];
/// Field names of an aux buffer, in wire order, as used in errors.
const AUX_NAMES: [&str; 5] = [
    "Registration.aux[].len",
    "Registration.aux[].item_len",
    "Registration.aux[].addr",
    "Registration.aux[].layer_id",
    "Registration.aux[].rkey",
];

/// Which side of the transfer an engine is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Role {
    /// The sender of KV pages.
    Prefill = 1,
    /// The receiver of KV pages.
    Decode = 2,
}

impl TryFrom<u8> for Role {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::BadRole`].
    fn try_from(v: u8) -> Result<Role, ProtoError> {
        match v {
            1 => Ok(Role::Prefill),
            2 => Ok(Role::Decode),
            found => Err(ProtoError::BadRole { found }),
        }
    }
}

/// What a connection between two engines is used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ConnKind {
    /// Control messages.
    Control = 1,
    /// Data frames.
    Data = 2,
}

impl TryFrom<u8> for ConnKind {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::BadConnKind`].
    fn try_from(v: u8) -> Result<ConnKind, ProtoError> {
        match v {
            1 => Ok(ConnKind::Control),
            2 => Ok(ConnKind::Data),
            found => Err(ProtoError::BadConnKind { found }),
        }
    }
}

/// Which transport an engine moves data with, as announced in
/// [`Message::Transport`]. Unknown wire values are a decode error
/// ([`ProtoError::BadTransport`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum WireTransport {
    /// Data frames over the TCP data connections.
    Tcp = 1,
    /// RDMA writes over reliable-connected queue pairs.
    Rdma = 2,
}

impl TryFrom<u8> for WireTransport {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::BadTransport`].
    fn try_from(v: u8) -> Result<WireTransport, ProtoError> {
        match v {
            1 => Ok(WireTransport::Tcp),
            2 => Ok(WireTransport::Rdma),
            found => Err(ProtoError::BadTransport { found }),
        }
    }
}

/// An engine's authentication setting, as announced in [`Message::AuthHello`],
/// [`Message::AuthChallenge`] and [`Message::AuthRefused`]. Unknown wire values are a
/// decode error ([`ProtoError::BadAuthMode`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AuthMode {
    /// The engine authenticates nobody and holds no key (config `auth=off`).
    Off = 1,
    /// Every connection must prove the cluster key (config `auth=required`).
    Required = 2,
}

impl AuthMode {
    /// The config value naming this setting: `off` or `required`.
    pub const fn name(self) -> &'static str {
        match self {
            AuthMode::Off => "off",
            AuthMode::Required => "required",
        }
    }

    fn decode(v: u8, field: &'static str) -> Result<AuthMode, ProtoError> {
        match v {
            1 => Ok(AuthMode::Off),
            2 => Ok(AuthMode::Required),
            found => Err(ProtoError::BadAuthMode { field, found }),
        }
    }
}

/// Why an engine refused a connection during authentication ([`Message::AuthRefused`]).
/// Unknown wire values are a decode error ([`ProtoError::BadAuthRefusal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum AuthRefusal {
    /// The two engines' `auth` settings differ (the message carries the sender's).
    Mismatch = 1,
    /// The key ids differ: the engines hold different cluster keys.
    WrongKey = 2,
    /// The proof does not verify.
    BadProof = 3,
    /// The handshake reuses the nonce of an earlier authenticated connection.
    Replay = 4,
    /// A data connection names no authenticated control session of its engine.
    NoSession = 5,
    /// Too many connections are waiting to authenticate; try again later.
    Busy = 6,
    /// One engine has TLS configured and the other not: sent in the clear by whichever
    /// side saw the other's first bytes in the wrong form.
    Tls = 7,
    /// The connection comes from another host, and the refusing engine has neither a
    /// key nor TLS and `auth` at `auto`, so it serves only engines on its own host:
    /// sent at once, before the `Hello` is read.
    NotLocal = 8,
}

impl AuthRefusal {
    /// Every reason, in wire-value order.
    pub const ALL: [AuthRefusal; 8] = [
        AuthRefusal::Mismatch,
        AuthRefusal::WrongKey,
        AuthRefusal::BadProof,
        AuthRefusal::Replay,
        AuthRefusal::NoSession,
        AuthRefusal::Busy,
        AuthRefusal::Tls,
        AuthRefusal::NotLocal,
    ];
}

impl TryFrom<u8> for AuthRefusal {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::BadAuthRefusal`].
    fn try_from(v: u8) -> Result<AuthRefusal, ProtoError> {
        AuthRefusal::ALL
            .into_iter()
            .find(|r| *r as u8 == v)
            .ok_or(ProtoError::BadAuthRefusal { found: v })
    }
}

/// Bytes of an authentication nonce.
pub const AUTH_NONCE_LEN: usize = 32;
/// Bytes of an authentication proof (an HMAC-SHA256 tag).
pub const AUTH_MAC_LEN: usize = 32;
/// Bytes of a key id (a fingerprint of the key, never the key).
pub const AUTH_KEY_ID_LEN: usize = 8;
/// Wire size of an `AuthHello` or `AuthChallenge` payload.
const AUTH_HELLO_LEN: u64 = 44;

/// Reads `N` bytes that must be all zeros when authentication is off.
fn auth_bytes<const N: usize>(
    r: &mut WireReader<'_>,
    field: &'static str,
    auth: AuthMode,
) -> Result<[u8; N], ProtoError> {
    let mut out = [0u8; N];
    out.copy_from_slice(r.take(N, field)?);
    if auth == AuthMode::Off && out != [0u8; N] {
        return Err(ProtoError::AuthDataWithAuthOff { field });
    }
    Ok(out)
}

/// Connection data of one RDMA RC queue pair, as announced in [`Message::Transport`].
///
/// Decoding guarantees `psn <= QpInfo::MAX_PSN` (24 bits) and `mtu` in
/// `QpInfo::MIN_MTU..=QpInfo::MAX_MTU` (`ibv_mtu`: 1 = 256 bytes ..= 5 = 4096 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct QpInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number; 24 bits.
    pub psn: u32,
    /// Port LID (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// Port GID (RoCE, or InfiniBand across subnets).
    pub gid: [u8; 16],
    /// Path MTU as an `ibv_mtu` value, 1..=5.
    pub mtu: u8,
}

impl QpInfo {
    /// Largest packet sequence number (PSNs are 24 bits).
    pub const MAX_PSN: u32 = (1 << 24) - 1;
    /// Smallest `ibv_mtu` value (`IBV_MTU_256`).
    pub const MIN_MTU: u8 = 1;
    /// Largest `ibv_mtu` value (`IBV_MTU_4096`).
    pub const MAX_MTU: u8 = 5;

    fn check(&self, index: usize) -> Result<(), ProtoError> {
        if self.psn > Self::MAX_PSN {
            return Err(ProtoError::BadPsn {
                index,
                found: self.psn,
            });
        }
        if !(Self::MIN_MTU..=Self::MAX_MTU).contains(&self.mtu) {
            return Err(ProtoError::BadMtu {
                index,
                found: self.mtu,
            });
        }
        Ok(())
    }

    fn encode(&self, out: &mut Vec<u8>) {
        put_u32(out, self.qpn);
        put_u32(out, self.psn);
        put_u16(out, self.lid);
        out.extend_from_slice(&self.gid);
        out.push(self.mtu);
    }

    fn decode(r: &mut WireReader<'_>, index: usize) -> Result<Self, ProtoError> {
        let qpn = r.u32("Transport.qps[].qpn")?;
        let psn = r.u32("Transport.qps[].psn")?;
        let lid = r.u16("Transport.qps[].lid")?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(r.take(16, "Transport.qps[].gid")?);
        let mtu = r.u8("Transport.qps[].mtu")?;
        let qp = QpInfo {
            qpn,
            psn,
            lid,
            gid,
            mtu,
        };
        qp.check(index)?;
        Ok(qp)
    }
}

/// One registered buffer, as announced to the peer.
///
/// Decoding guarantees `item_len > 0`, `len >= item_len` and `layer_id >= -1`.
/// `len` need not be a multiple of `item_len`: the buffer holds [`BufferInfo::pages`]
/// whole pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BufferInfo {
    /// Length of the buffer in bytes.
    pub len: u64,
    /// Bytes of one page in this buffer.
    pub item_len: u64,
    /// Model layer this buffer holds, or [`BufferInfo::NO_LAYER`] (-1) to pair buffers
    /// by position.
    pub layer_id: i32,
    /// Remote address for RDMA writes; 0 over TCP.
    pub addr: u64,
    /// RDMA remote key; 0 over TCP.
    pub rkey: u32,
}

impl BufferInfo {
    /// The `layer_id` meaning "no layer id; pair by position".
    pub const NO_LAYER: i32 = -1;

    /// Whole pages in the buffer: `len / item_len` (0 if `item_len` is 0, which a
    /// decoded buffer never has).
    pub fn pages(&self) -> u64 {
        self.len.checked_div(self.item_len).unwrap_or(0)
    }

    /// The layer id, or `None` for [`BufferInfo::NO_LAYER`] (or any negative value).
    pub fn layer(&self) -> Option<u32> {
        u32::try_from(self.layer_id).ok()
    }

    fn check(&self, field: &'static str, index: usize) -> Result<(), ProtoError> {
        if self.item_len == 0 {
            return Err(ProtoError::ZeroItemLen { field, index });
        }
        if self.len < self.item_len {
            return Err(ProtoError::BufferShorterThanItem {
                field,
                index,
                len: self.len,
                item_len: self.item_len,
            });
        }
        if self.layer_id < Self::NO_LAYER {
            return Err(ProtoError::BadLayerId {
                field,
                index,
                found: self.layer_id,
            });
        }
        Ok(())
    }

    fn encode(&self, out: &mut Vec<u8>) {
        put_u64(out, self.len);
        put_u64(out, self.item_len);
        put_u64(out, self.addr);
        put_i32(out, self.layer_id);
        put_u32(out, self.rkey);
    }

    fn decode(
        r: &mut WireReader<'_>,
        field: &'static str,
        index: usize,
    ) -> Result<Self, ProtoError> {
        let names = if field == KV_LIST {
            &KV_NAMES
        } else {
            &AUX_NAMES
        };
        let b = BufferInfo {
            len: r.u64(names[0])?,
            item_len: r.u64(names[1])?,
            addr: r.u64(names[2])?,
            layer_id: r.i32(names[3])?,
            rkey: r.u32(names[4])?,
        };
        b.check(field, index)?;
        Ok(b)
    }
}

/// An engine's registered memory, exchanged once per peer.
///
/// The codec checks each buffer on its own (see [`BufferInfo`]), the list sizes against
/// [`Limits::max_buffers`] and the layout on its own ([`KvLayout::check`]); pairing with
/// the local buffers and layout (count, `item_len`, layer ids, layouts that can meet) is
/// the engine's job.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Registration {
    /// KV buffers, in registration order.
    pub kv: Vec<BufferInfo>,
    /// Aux buffers, indexed by aux slot.
    pub aux: Vec<BufferInfo>,
    /// The layout of the KV pages, if the engine registered one
    /// (`kvxfer_register_kv_layout`); `None`: the buffers are copied byte for byte.
    pub layout: Option<KvLayout>,
    /// The sender's `integrity` setting: `true` for `verify` (every data run carries a
    /// digest, checked where it landed). Both engines of a pair must agree.
    pub integrity: bool,
}

/// An engine's `same_host` setting, as sent in [`HostInfo`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(u8)]
pub enum SameHostSetting {
    /// Never the same-host path.
    #[default]
    Off = 0,
    /// The same-host path when the peers share a host and may copy; TCP otherwise.
    Auto = 1,
    /// The same-host path, or no pairing at all.
    Require = 2,
}

impl TryFrom<u8> for SameHostSetting {
    type Error = ProtoError;

    fn try_from(v: u8) -> Result<SameHostSetting, ProtoError> {
        match v {
            0 => Ok(SameHostSetting::Off),
            1 => Ok(SameHostSetting::Auto),
            2 => Ok(SameHostSetting::Require),
            found => Err(ProtoError::BadBool {
                field: "SameHost.setting",
                found,
            }),
        }
    }
}

/// Who an engine's process is, for the same-host path ([`Message::SameHost`]): two
/// engines share a host when the boot id and the PID and network namespaces are equal,
/// and then `pid` names the process in both. The prefill also names a probe: 16 random
/// bytes at `probe_addr` in its memory, which the decode engine reads to prove it may
/// copy from that process (and that it is that process).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct HostInfo {
    pub setting: SameHostSetting,
    /// The sender registered CUDA device memory (KV or aux): the same-host copy, which
    /// moves host memory between the processes, cannot serve it.
    pub device_memory: bool,
    pub boot_id: [u8; 16],
    pub pid_ns: u64,
    pub net_ns: u64,
    pub pid: u32,
    pub uid: u32,
    pub probe_addr: u64,
    pub probe: [u8; 16],
}

/// A control message: the payload of every frame kind except [`Kind::Data`].
///
/// Rooms are identified by `room` plus `generation`; the codec does not check that a
/// room exists, is live, or belongs to the peer — the engine does.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Message {
    /// First message on every connection, in both directions.
    Hello {
        /// The protocol version the sender speaks.
        proto_version: u16,
        /// The sender's role.
        role: Role,
        /// The sender's engine id.
        engine_id: u64,
        /// What this connection is for.
        conn: ConnKind,
        /// Index of this connection among the sender's connections of that kind.
        conn_index: u16,
    },
    /// The sender's registered buffers.
    Registration(Registration),
    /// Decode → prefill: where a room's pages go.
    Destination {
        /// Room id.
        room: u64,
        /// Generation of the room id.
        generation: u64,
        /// Destination page indices, in the order chunks fill them. The codec bounds the
        /// count by [`Limits::max_pages`]; the engine checks the indices.
        pages: Vec<u32>,
        /// Aux slot for the room's metadata, if any (wire: i64, -1 = none).
        aux_slot: Option<u32>,
    },
    /// Prefill → decode: every page of the room was sent.
    ///
    /// On the wire the room id is sent twice (`room_echo`); decoding fails with
    /// [`ProtoError::RoomEchoMismatch`] when the copies differ.
    Done {
        /// Room id.
        room: u64,
        /// Generation of the room id.
        generation: u64,
        /// How many pages were sent for the room.
        pages_sent: u32,
        /// Whether the aux slot was sent.
        aux_sent: bool,
    },
    /// Prefill → decode over RDMA: RDMA WRITEs of the room completed (the decode side
    /// sees no data frames; this is its progress, counted as frames would be).
    Progress {
        /// Room id.
        room: u64,
        /// Generation of the room id.
        generation: u64,
        /// Aux rows completed.
        aux_rows: u32,
        /// Bytes those writes carried, aux rows included.
        bytes: u64,
        /// KV bytes written per KV buffer (the sender's index), as the decode side counts
        /// data frames' bytes. At most [`Limits::max_buffers`] entries.
        kv: Vec<(u32, u64)>,
        /// With `integrity=verify`: every run those writes carried, as its data header
        /// would be over TCP, with its digest ([`crate::integrity`]); empty otherwise.
        /// The room and generation of each are the message's. At most
        /// [`MAX_RUNS`](super::MAX_RUNS), each passing [`DataHeader::check`](super::DataHeader::check).
        runs: Vec<super::DataHeader>,
    },
    /// Either direction: the room failed; the peer must fail it too.
    Abort {
        /// Room id.
        room: u64,
        /// Generation of the room id.
        generation: u64,
        /// Why, in UTF-8, at most [`Limits::max_reason_len`] bytes (use
        /// [`Message::abort`] or [`truncate_reason`] to build it).
        reason: String,
    },
    /// Acknowledges an `Abort`: no write for the room can still land.
    AbortAck {
        /// Room id.
        room: u64,
        /// Generation of the room id.
        generation: u64,
    },
    /// Liveness probe; `seq` increases per connection.
    Heartbeat {
        /// Sequence number.
        seq: u64,
    },
    /// Sent once per peer on the control connection, right after `Registration`: the
    /// transport the sender moves data with and, for RDMA, its queue pairs.
    ///
    /// The codec requires `qps` to be empty for [`WireTransport::Tcp`] and bounds it by
    /// [`Limits::max_qps`] for [`WireTransport::Rdma`], each entry checked as described
    /// at [`QpInfo`]. Whether both sides agree, and how many queue pairs are needed, is
    /// the engine's check.
    Transport {
        /// The sender's transport.
        transport: WireTransport,
        /// The sender's queue pairs (RDMA only).
        qps: Vec<QpInfo>,
    },
    /// Initiator (the engine that connected) → responder, right after `Hello` on every
    /// connection: the initiator's `auth` setting and, with authentication, the id of the
    /// key this connection proves (the cluster key on a control connection, the control
    /// session's secret on a data connection) and a fresh nonce. Decoding requires
    /// `key_id` and `nonce` to be all zeros when `auth` is off.
    AuthHello {
        /// The sender's setting.
        auth: AuthMode,
        /// Fingerprint of the key; zeros when `auth` is off.
        key_id: [u8; AUTH_KEY_ID_LEN],
        /// Fresh random bytes; zeros when `auth` is off.
        nonce: [u8; AUTH_NONCE_LEN],
    },
    /// Responder → initiator, the answer to an `AuthHello` whose setting matches: with
    /// authentication, the responder's engine id and a fresh nonce; with it off, all
    /// zeros (decoding requires them), and `Hello` follows.
    AuthChallenge {
        /// The sender's setting.
        auth: AuthMode,
        /// The sender's engine id; 0 when `auth` is off.
        engine_id: u64,
        /// Fresh random bytes; zeros when `auth` is off.
        nonce: [u8; AUTH_NONCE_LEN],
    },
    /// Either way, once per side: HMAC-SHA256 under the connection's key of the
    /// handshake transcript (both engine ids and roles, the connection kind and index,
    /// both nonces, the protocol version), with the sender's role as purpose.
    AuthProof {
        /// The tag.
        mac: [u8; AUTH_MAC_LEN],
    },
    /// Either way: the sender refuses the connection and closes it.
    AuthRefused {
        /// Why.
        reason: AuthRefusal,
        /// The sender's setting, so that a mismatch can name both.
        auth: AuthMode,
    },
    /// Either way on the control connection after `Transport` (TCP only): the decode
    /// engine offers the same-host path with its identity, the prefill answers with its
    /// own and a probe.
    SameHost(HostInfo),
    /// Decode → prefill after `SameHost`, echoed back by the prefill once it applies it:
    /// whether the pairing takes the same-host path, and if not, why (at most
    /// [`Limits::max_reason_len`] bytes).
    PathChoice { same_host: bool, why: String },
    /// Prefill → decode on a same-host data connection: one room's runs, each with the
    /// address of its bytes in the prefill's memory; the decode engine copies them into
    /// the pages the headers name and answers `Copied`. At most
    /// [`MAX_RUNS`](super::MAX_RUNS) runs.
    Copy { runs: Vec<(super::DataHeader, u64)> },
    /// Decode → prefill: the runs of the last `Copy` of the room were copied (`whole`), or
    /// not all of them, the room having ended.
    Copied {
        room: u64,
        generation: u64,
        whole: bool,
    },
    /// Prefill → decode after its `SameHost`, when either engine registered device
    /// memory and the prefill does not have `same_host=off`: what the decode engine needs
    /// to copy the prefill's device pages through CUDA IPC, or, with `why` not empty
    /// (at most [`Limits::max_reason_len`] bytes), why the prefill cannot offer it.
    IpcOffer {
        /// The exported allocations, as [`crate::cuda::ipc::encode`] writes them (at most
        /// [`MAX_IPC_RANGES_LEN`] bytes; decoded and checked by the decode engine).
        ranges: Vec<u8>,
        /// The memory kind of each of the prefill's kv buffers, then each aux buffer:
        /// 0 host, 1 CUDA device (at most 2 × [`Limits::max_buffers`]).
        kinds: Vec<u8>,
        /// The abstract Unix socket name the VMM descriptors are taken from (at most
        /// [`MAX_IPC_SOCKET_LEN`] bytes).
        socket: Vec<u8>,
        /// The nonce the taker proves itself with.
        nonce: [u8; IPC_NONCE_LEN],
        why: String,
    },
}

/// Bytes of an `IpcOffer`'s nonce.
pub const IPC_NONCE_LEN: usize = 32;
/// The longest abstract socket name of an `IpcOffer` (`sun_path` less its NUL).
pub const MAX_IPC_SOCKET_LEN: usize = 107;
/// The most bytes of encoded ranges an `IpcOffer` carries.
pub const MAX_IPC_RANGES_LEN: usize = 4 + 65_536 * 101;

/// The checks of an `IpcOffer`'s fields, shared by [`Message::validate`] and decoding.
fn check_ipc_offer(
    ranges: usize,
    kinds: &[u8],
    socket: usize,
    why: usize,
    limits: &Limits,
) -> Result<(), ProtoError> {
    let long = |field, len: usize, max: u64| {
        if len as u64 > max {
            Err(ProtoError::StringTooLong {
                field,
                len: len as u64,
                max,
            })
        } else {
            Ok(())
        }
    };
    long("IpcOffer.ranges", ranges, MAX_IPC_RANGES_LEN as u64)?;
    long(
        "IpcOffer.kinds",
        kinds.len(),
        2 * u64::from(limits.max_buffers),
    )?;
    long("IpcOffer.socket", socket, MAX_IPC_SOCKET_LEN as u64)?;
    long("IpcOffer.why", why, u64::from(limits.max_reason_len))?;
    if let Some(&found) = kinds.iter().find(|&&k| k > 1) {
        return Err(ProtoError::BadBool {
            field: "IpcOffer.kinds",
            found,
        });
    }
    Ok(())
}

/// The longest prefix of `reason` that is at most `max_len` bytes and ends on a char
/// boundary.
pub fn truncate_reason(reason: &str, max_len: u32) -> &str {
    let max = usize::try_from(max_len).unwrap_or(usize::MAX);
    if reason.len() <= max {
        return reason;
    }
    let mut end = max;
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
}

impl Message {
    /// An `Abort` whose reason is `reason` truncated (at a char boundary) to
    /// `limits.max_reason_len` bytes.
    pub fn abort(room: u64, generation: u64, reason: &str, limits: &Limits) -> Message {
        Message::Abort {
            room,
            generation,
            reason: truncate_reason(reason, limits.max_reason_len).to_owned(),
        }
    }

    /// The frame kind carrying this message.
    pub fn kind(&self) -> Kind {
        match self {
            Message::Hello { .. } => Kind::Hello,
            Message::Registration(_) => Kind::Registration,
            Message::Destination { .. } => Kind::Destination,
            Message::Done { .. } => Kind::Done,
            Message::Abort { .. } => Kind::Abort,
            Message::AbortAck { .. } => Kind::AbortAck,
            Message::Heartbeat { .. } => Kind::Heartbeat,
            Message::Transport { .. } => Kind::Transport,
            Message::Progress { .. } => Kind::Progress,
            Message::AuthHello { .. } => Kind::AuthHello,
            Message::AuthChallenge { .. } => Kind::AuthChallenge,
            Message::AuthProof { .. } => Kind::AuthProof,
            Message::AuthRefused { .. } => Kind::AuthRefused,
            Message::SameHost(_) => Kind::SameHost,
            Message::PathChoice { .. } => Kind::PathChoice,
            Message::Copy { .. } => Kind::Copy,
            Message::Copied { .. } => Kind::Copied,
            Message::IpcOffer { .. } => Kind::IpcOffer,
        }
    }

    /// Length of the encoded payload (without the frame header), in bytes.
    pub fn payload_len(&self) -> u64 {
        let n = |len: usize, size: u64| (len as u64).saturating_mul(size);
        match self {
            Message::Hello { .. } => 14,
            Message::Registration(reg) => (1 + reg.layout.map_or(0, |_| LAYOUT_LEN as u64) + 8 + 1)
                .saturating_add(n(reg.kv.len(), BUFFER_INFO_LEN as u64))
                .saturating_add(n(reg.aux.len(), BUFFER_INFO_LEN as u64)),
            Message::Destination { pages, .. } => 28u64.saturating_add(n(pages.len(), 4)),
            Message::Done { .. } => 29,
            Message::Progress { kv, runs, .. } => 36u64
                .saturating_add(n(kv.len(), 12))
                .saturating_add(n(runs.len(), PROGRESS_RUN_LEN as u64)),
            Message::Abort { reason, .. } => 20u64.saturating_add(reason.len() as u64),
            Message::AbortAck { .. } => 16,
            Message::Heartbeat { .. } => 8,
            Message::Transport { qps, .. } => {
                (TRANSPORT_FIXED_LEN as u64).saturating_add(n(qps.len(), QP_INFO_LEN as u64))
            }
            Message::AuthHello { .. } | Message::AuthChallenge { .. } => AUTH_HELLO_LEN,
            Message::AuthProof { .. } => AUTH_MAC_LEN as u64,
            Message::AuthRefused { .. } => 2,
            Message::SameHost(_) => HOST_INFO_LEN as u64,
            Message::PathChoice { why, .. } => 8u64.saturating_add(why.len() as u64),
            Message::Copy { runs } => 4u64.saturating_add(n(runs.len(), COPY_RUN_LEN as u64)),
            Message::Copied { .. } => 17,
            Message::IpcOffer {
                ranges,
                kinds,
                socket,
                why,
                ..
            } => (IPC_NONCE_LEN as u64 + 16)
                .saturating_add(ranges.len() as u64)
                .saturating_add(kinds.len() as u64)
                .saturating_add(socket.len() as u64)
                .saturating_add(why.len() as u64),
        }
    }

    /// Checks that a peer using `limits` would accept this message: the same checks as
    /// [`Message::decode`] (payload size, counts, reason length, buffer and queue-pair
    /// fields). Use it
    /// before sending values that come from the local host.
    pub fn validate(&self, limits: &Limits) -> Result<(), ProtoError> {
        let kind = self.kind();
        let len = self.payload_len();
        let max = limits.max_payload(kind);
        if len > max {
            return Err(ProtoError::PayloadTooLarge { kind, len, max });
        }
        let count_ok = |field, count: usize, limit, max: u32| {
            if count as u64 > u64::from(max) {
                Err(ProtoError::CountOverLimit {
                    field,
                    count: count as u64,
                    limit,
                    max: u64::from(max),
                })
            } else {
                Ok(())
            }
        };
        match self {
            Message::Registration(reg) => {
                if let Some(layout) = &reg.layout {
                    check_layout(layout)?;
                }
                for (field, list) in [(KV_LIST, &reg.kv), (AUX_LIST, &reg.aux)] {
                    count_ok(field, list.len(), "max_buffers", limits.max_buffers)?;
                    for (i, b) in list.iter().enumerate() {
                        b.check(field, i)?;
                    }
                }
            }
            Message::Progress {
                room,
                generation,
                kv,
                runs,
                ..
            } => {
                count_ok("Progress.kv", kv.len(), "max_buffers", limits.max_buffers)?;
                count_ok("Progress.runs", runs.len(), "MAX_RUNS", super::MAX_RUNS)?;
                for h in runs {
                    if (h.room, h.generation) != (*room, *generation) {
                        return Err(ProtoError::RunsOfSeveralRooms {
                            first: (*room, *generation),
                            found: (h.room, h.generation),
                        });
                    }
                    h.check(limits)?;
                }
            }
            Message::Destination { pages, .. } => {
                count_ok(
                    "Destination.pages",
                    pages.len(),
                    "max_pages",
                    limits.max_pages,
                )?;
            }
            Message::Abort { reason, .. } => {
                if reason.len() as u64 > u64::from(limits.max_reason_len) {
                    return Err(ProtoError::StringTooLong {
                        field: "Abort.reason",
                        len: reason.len() as u64,
                        max: u64::from(limits.max_reason_len),
                    });
                }
            }
            Message::Transport { transport, qps } => match transport {
                WireTransport::Tcp if !qps.is_empty() => {
                    return Err(ProtoError::QpsOnTcp {
                        count: u32::try_from(qps.len()).unwrap_or(u32::MAX),
                    });
                }
                WireTransport::Tcp => {}
                WireTransport::Rdma => {
                    count_ok(QP_LIST, qps.len(), "max_qps", limits.max_qps)?;
                    for (i, qp) in qps.iter().enumerate() {
                        qp.check(i)?;
                    }
                }
            },
            Message::AuthHello {
                auth: AuthMode::Off,
                key_id,
                nonce,
            } => {
                if *key_id != [0; AUTH_KEY_ID_LEN] {
                    return Err(ProtoError::AuthDataWithAuthOff {
                        field: "AuthHello.key_id",
                    });
                }
                if *nonce != [0; AUTH_NONCE_LEN] {
                    return Err(ProtoError::AuthDataWithAuthOff {
                        field: "AuthHello.nonce",
                    });
                }
            }
            Message::AuthChallenge {
                auth: AuthMode::Off,
                engine_id,
                nonce,
            } => {
                if *engine_id != 0 {
                    return Err(ProtoError::AuthDataWithAuthOff {
                        field: "AuthChallenge.engine_id",
                    });
                }
                if *nonce != [0; AUTH_NONCE_LEN] {
                    return Err(ProtoError::AuthDataWithAuthOff {
                        field: "AuthChallenge.nonce",
                    });
                }
            }
            Message::PathChoice { why, .. } => {
                if why.len() as u64 > u64::from(limits.max_reason_len) {
                    return Err(ProtoError::StringTooLong {
                        field: "PathChoice.why",
                        len: why.len() as u64,
                        max: u64::from(limits.max_reason_len),
                    });
                }
            }
            Message::IpcOffer {
                ranges,
                kinds,
                socket,
                why,
                ..
            } => check_ipc_offer(ranges.len(), kinds, socket.len(), why.len(), limits)?,
            Message::Copy { runs } => {
                count_ok("Copy.runs", runs.len(), "MAX_RUNS", super::MAX_RUNS)?;
                for (h, _) in runs {
                    h.check(limits)?;
                }
            }
            Message::Hello { .. }
            | Message::SameHost(_)
            | Message::Copied { .. }
            | Message::Done { .. }
            | Message::AbortAck { .. }
            | Message::Heartbeat { .. }
            | Message::AuthHello { .. }
            | Message::AuthChallenge { .. }
            | Message::AuthProof { .. }
            | Message::AuthRefused { .. } => {}
        }
        Ok(())
    }

    /// Appends the whole frame (header and payload) to `out`.
    ///
    /// Fails only with [`ProtoError::EncodeTooLarge`] when the payload would exceed
    /// `u32::MAX` bytes; `out` is then left unchanged. Encoding does not apply
    /// [`Limits`]: call [`Message::validate`] first if the values are not known to be
    /// within them.
    pub fn encode(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let kind = self.kind();
        let len = self.payload_len();
        let len32 = u32::try_from(len).map_err(|_| ProtoError::EncodeTooLarge { kind, len })?;
        let total = FRAME_HEADER_LEN + len32 as usize;
        out.reserve(total);
        let start = out.len();
        out.extend_from_slice(&FrameHeader::new(kind, len32).encode());
        self.encode_payload(out);
        debug_assert_eq!(out.len() - start, total, "{kind} payload_len is wrong");
        Ok(())
    }

    /// Writes the payload. Every length fits in u32: `encode` checked the total.
    fn encode_payload(&self, out: &mut Vec<u8>) {
        let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        match self {
            Message::Hello {
                proto_version,
                role,
                engine_id,
                conn,
                conn_index,
            } => {
                put_u16(out, *proto_version);
                out.push(*role as u8);
                out.push(*conn as u8);
                put_u16(out, *conn_index);
                put_u64(out, *engine_id);
            }
            Message::Registration(reg) => {
                match &reg.layout {
                    None => out.push(0),
                    Some(l) => {
                        out.push(1);
                        for v in [
                            l.kv_heads,
                            l.head_dim,
                            l.dtype_bytes,
                            l.tp_rank,
                            l.tp_size,
                            l.page_tokens,
                        ] {
                            put_u32(out, v);
                        }
                        out.push(l.order.value() as u8);
                        out.push(l.kind.value() as u8);
                    }
                }
                for list in [&reg.kv, &reg.aux] {
                    put_u32(out, len32(list.len()));
                    for b in list {
                        b.encode(out);
                    }
                }
                out.push(u8::from(reg.integrity));
            }
            Message::Destination {
                room,
                generation,
                pages,
                aux_slot,
            } => {
                put_u64(out, *room);
                put_u64(out, *generation);
                put_i64(out, aux_slot.map_or(-1, i64::from));
                put_u32(out, len32(pages.len()));
                for p in pages {
                    put_u32(out, *p);
                }
            }
            Message::Done {
                room,
                generation,
                pages_sent,
                aux_sent,
            } => {
                put_u64(out, *room);
                put_u64(out, *generation);
                put_u64(out, *room);
                put_u32(out, *pages_sent);
                out.push(u8::from(*aux_sent));
            }
            Message::Progress {
                room,
                generation,
                aux_rows,
                bytes,
                kv,
                runs,
            } => {
                put_u64(out, *room);
                put_u64(out, *generation);
                put_u32(out, *aux_rows);
                put_u64(out, *bytes);
                put_u32(out, kv.len() as u32);
                for &(buffer, b) in kv {
                    put_u32(out, buffer);
                    put_u64(out, b);
                }
                put_u32(out, len32(runs.len()));
                for h in runs {
                    out.push(h.target as u8);
                    out.extend_from_slice(&[0; 3]);
                    for v in [
                        h.buffer,
                        h.first_page,
                        h.n_pages,
                        h.byte_len,
                        h.page_off,
                        h.digest,
                    ] {
                        put_u32(out, v);
                    }
                }
            }
            Message::Abort {
                room,
                generation,
                reason,
            } => {
                put_u64(out, *room);
                put_u64(out, *generation);
                put_u32(out, len32(reason.len()));
                out.extend_from_slice(reason.as_bytes());
            }
            Message::AbortAck { room, generation } => {
                put_u64(out, *room);
                put_u64(out, *generation);
            }
            Message::Heartbeat { seq } => put_u64(out, *seq),
            Message::Transport { transport, qps } => {
                out.push(*transport as u8);
                out.extend_from_slice(&[0; 3]);
                put_u32(out, len32(qps.len()));
                for qp in qps {
                    qp.encode(out);
                }
            }
            Message::AuthHello {
                auth,
                key_id,
                nonce,
            } => {
                out.push(*auth as u8);
                out.extend_from_slice(&[0; 3]);
                out.extend_from_slice(key_id);
                out.extend_from_slice(nonce);
            }
            Message::AuthChallenge {
                auth,
                engine_id,
                nonce,
            } => {
                out.push(*auth as u8);
                out.extend_from_slice(&[0; 3]);
                put_u64(out, *engine_id);
                out.extend_from_slice(nonce);
            }
            Message::AuthProof { mac } => out.extend_from_slice(mac),
            Message::AuthRefused { reason, auth } => {
                out.push(*reason as u8);
                out.push(*auth as u8);
            }
            Message::SameHost(h) => {
                out.push(h.setting as u8);
                out.push(u8::from(h.device_memory));
                out.extend_from_slice(&[0; 2]);
                out.extend_from_slice(&h.boot_id);
                put_u64(out, h.pid_ns);
                put_u64(out, h.net_ns);
                put_u32(out, h.pid);
                put_u32(out, h.uid);
                put_u64(out, h.probe_addr);
                out.extend_from_slice(&h.probe);
            }
            Message::PathChoice { same_host, why } => {
                out.push(u8::from(*same_host));
                out.extend_from_slice(&[0; 3]);
                put_u32(out, len32(why.len()));
                out.extend_from_slice(why.as_bytes());
            }
            Message::Copy { runs } => {
                put_u32(out, len32(runs.len()));
                for (h, src) in runs {
                    out.extend_from_slice(&h.encode());
                    put_u64(out, *src);
                }
            }
            Message::Copied {
                room,
                generation,
                whole,
            } => {
                put_u64(out, *room);
                put_u64(out, *generation);
                out.push(u8::from(*whole));
            }
            Message::IpcOffer {
                ranges,
                kinds,
                socket,
                nonce,
                why,
            } => {
                out.extend_from_slice(nonce);
                for field in [&ranges[..], &kinds[..], &socket[..], why.as_bytes()] {
                    put_u32(out, len32(field.len()));
                    out.extend_from_slice(field);
                }
            }
        }
    }

    /// Decodes the payload of a control frame of `kind`.
    ///
    /// Fails if `kind` is [`Kind::Data`], if the payload exceeds
    /// `limits.max_control_payload`, if any field is invalid or any count exceeds its
    /// limit or the bytes remaining, or if the payload is not consumed exactly. Nothing
    /// is allocated before the count that sizes it has passed both checks.
    pub fn decode(kind: Kind, payload: &[u8], limits: &Limits) -> Result<Message, ProtoError> {
        if !kind.is_control() {
            return Err(ProtoError::NotControlKind { kind });
        }
        let max = limits.max_payload(kind);
        if payload.len() as u64 > max {
            return Err(ProtoError::PayloadTooLarge {
                kind,
                len: payload.len() as u64,
                max,
            });
        }
        let mut r = WireReader::new(payload, kind);
        let msg = match kind {
            Kind::Hello => {
                let proto_version = r.u16("Hello.proto_version")?;
                let role = Role::try_from(r.u8("Hello.role")?)?;
                let conn = ConnKind::try_from(r.u8("Hello.conn")?)?;
                let conn_index = r.u16("Hello.conn_index")?;
                let engine_id = r.u64("Hello.engine_id")?;
                Message::Hello {
                    proto_version,
                    role,
                    engine_id,
                    conn,
                    conn_index,
                }
            }
            Kind::Registration => {
                let layout = match r.u8("Registration.layout")? {
                    0 => None,
                    1 => Some(decode_layout(&mut r)?),
                    found => {
                        return Err(ProtoError::BadBool {
                            field: "Registration.layout",
                            found,
                        })
                    }
                };
                let kv = decode_buffers(&mut r, KV_LIST, limits)?;
                let aux = decode_buffers(&mut r, AUX_LIST, limits)?;
                let integrity = r.bool("Registration.integrity")?;
                Message::Registration(Registration {
                    kv,
                    aux,
                    layout,
                    integrity,
                })
            }
            Kind::Destination => {
                let room = r.u64("Destination.room")?;
                let generation = r.u64("Destination.generation")?;
                let raw_slot = r.i64("Destination.aux_slot")?;
                let aux_slot = match raw_slot {
                    -1 => None,
                    v => Some(u32::try_from(v).map_err(|_| ProtoError::BadAuxSlot { found: v })?),
                };
                let n = r.count("Destination.pages", "max_pages", limits.max_pages, 4)?;
                let mut pages = Vec::with_capacity(n);
                for _ in 0..n {
                    pages.push(r.u32("Destination.pages")?);
                }
                Message::Destination {
                    room,
                    generation,
                    pages,
                    aux_slot,
                }
            }
            Kind::Done => {
                let room = r.u64("Done.room")?;
                let generation = r.u64("Done.generation")?;
                let room_echo = r.u64("Done.room_echo")?;
                let pages_sent = r.u32("Done.pages_sent")?;
                let aux_sent = r.bool("Done.aux_sent")?;
                if room_echo != room {
                    return Err(ProtoError::RoomEchoMismatch { room, room_echo });
                }
                Message::Done {
                    room,
                    generation,
                    pages_sent,
                    aux_sent,
                }
            }
            Kind::Progress => {
                let room = r.u64("Progress.room")?;
                let generation = r.u64("Progress.generation")?;
                let aux_rows = r.u32("Progress.aux_rows")?;
                let bytes = r.u64("Progress.bytes")?;
                let n = r.count("Progress.kv", "max_buffers", limits.max_buffers, 12)?;
                let mut kv = Vec::with_capacity(n);
                for _ in 0..n {
                    kv.push((r.u32("Progress.kv.buffer")?, r.u64("Progress.kv.bytes")?));
                }
                let n = r.count(
                    "Progress.runs",
                    "MAX_RUNS",
                    super::MAX_RUNS,
                    PROGRESS_RUN_LEN,
                )?;
                let mut runs = Vec::with_capacity(n);
                for _ in 0..n {
                    let target = super::Target::try_from(r.u8("Progress.runs[].target")?)?;
                    r.reserved(3, "Progress.runs[].reserved")?;
                    let h = super::DataHeader {
                        room,
                        generation,
                        target,
                        buffer: r.u32("Progress.runs[].buffer")?,
                        first_page: r.u32("Progress.runs[].first_page")?,
                        n_pages: r.u32("Progress.runs[].n_pages")?,
                        byte_len: r.u32("Progress.runs[].byte_len")?,
                        page_off: r.u32("Progress.runs[].page_off")?,
                        digest: r.u32("Progress.runs[].digest")?,
                    };
                    h.check(limits)?;
                    runs.push(h);
                }
                Message::Progress {
                    room,
                    generation,
                    aux_rows,
                    bytes,
                    kv,
                    runs,
                }
            }
            Kind::Abort => {
                let room = r.u64("Abort.room")?;
                let generation = r.u64("Abort.generation")?;
                let len = r.u32("Abort.reason_len")?;
                if len > limits.max_reason_len {
                    return Err(ProtoError::StringTooLong {
                        field: "Abort.reason",
                        len: u64::from(len),
                        max: u64::from(limits.max_reason_len),
                    });
                }
                let len = usize::try_from(len).unwrap_or(usize::MAX);
                let bytes = r.take(len, "Abort.reason")?;
                let reason = std::str::from_utf8(bytes)
                    .map_err(|e| ProtoError::InvalidUtf8 {
                        field: "Abort.reason",
                        valid_up_to: e.valid_up_to(),
                    })?
                    .to_owned();
                Message::Abort {
                    room,
                    generation,
                    reason,
                }
            }
            Kind::AbortAck => Message::AbortAck {
                room: r.u64("AbortAck.room")?,
                generation: r.u64("AbortAck.generation")?,
            },
            Kind::Heartbeat => Message::Heartbeat {
                seq: r.u64("Heartbeat.seq")?,
            },
            Kind::Transport => {
                let transport = WireTransport::try_from(r.u8("Transport.transport")?)?;
                r.reserved(3, "Transport.reserved")?;
                let qps = match transport {
                    WireTransport::Tcp => match r.u32(QP_LIST)? {
                        0 => Vec::new(),
                        count => return Err(ProtoError::QpsOnTcp { count }),
                    },
                    WireTransport::Rdma => {
                        let n = r.count(QP_LIST, "max_qps", limits.max_qps, QP_INFO_LEN)?;
                        let mut qps = Vec::with_capacity(n);
                        for index in 0..n {
                            qps.push(QpInfo::decode(&mut r, index)?);
                        }
                        qps
                    }
                };
                Message::Transport { transport, qps }
            }
            Kind::AuthHello => {
                let auth = AuthMode::decode(r.u8("AuthHello.auth")?, "AuthHello.auth")?;
                r.reserved(3, "AuthHello.reserved")?;
                let key_id = auth_bytes(&mut r, "AuthHello.key_id", auth)?;
                let nonce = auth_bytes(&mut r, "AuthHello.nonce", auth)?;
                Message::AuthHello {
                    auth,
                    key_id,
                    nonce,
                }
            }
            Kind::AuthChallenge => {
                let auth = AuthMode::decode(r.u8("AuthChallenge.auth")?, "AuthChallenge.auth")?;
                r.reserved(3, "AuthChallenge.reserved")?;
                let engine_id =
                    u64::from_le_bytes(auth_bytes(&mut r, "AuthChallenge.engine_id", auth)?);
                let nonce = auth_bytes(&mut r, "AuthChallenge.nonce", auth)?;
                Message::AuthChallenge {
                    auth,
                    engine_id,
                    nonce,
                }
            }
            Kind::AuthProof => {
                let mut mac = [0u8; AUTH_MAC_LEN];
                mac.copy_from_slice(r.take(AUTH_MAC_LEN, "AuthProof.mac")?);
                Message::AuthProof { mac }
            }
            Kind::AuthRefused => {
                let reason = AuthRefusal::try_from(r.u8("AuthRefused.reason")?)?;
                let auth = AuthMode::decode(r.u8("AuthRefused.auth")?, "AuthRefused.auth")?;
                Message::AuthRefused { reason, auth }
            }
            Kind::SameHost => {
                let setting = SameHostSetting::try_from(r.u8("SameHost.setting")?)?;
                let device_memory = r.bool("SameHost.device_memory")?;
                r.reserved(2, "SameHost.reserved")?;
                let mut boot_id = [0u8; 16];
                boot_id.copy_from_slice(r.take(16, "SameHost.boot_id")?);
                let pid_ns = r.u64("SameHost.pid_ns")?;
                let net_ns = r.u64("SameHost.net_ns")?;
                let pid = r.u32("SameHost.pid")?;
                let uid = r.u32("SameHost.uid")?;
                let probe_addr = r.u64("SameHost.probe_addr")?;
                let mut probe = [0u8; 16];
                probe.copy_from_slice(r.take(16, "SameHost.probe")?);
                Message::SameHost(HostInfo {
                    setting,
                    device_memory,
                    boot_id,
                    pid_ns,
                    net_ns,
                    pid,
                    uid,
                    probe_addr,
                    probe,
                })
            }
            Kind::PathChoice => {
                let same_host = r.bool("PathChoice.same_host")?;
                r.reserved(3, "PathChoice.reserved")?;
                let len = r.u32("PathChoice.why_len")?;
                if len > limits.max_reason_len {
                    return Err(ProtoError::StringTooLong {
                        field: "PathChoice.why",
                        len: u64::from(len),
                        max: u64::from(limits.max_reason_len),
                    });
                }
                let bytes = r.take(len as usize, "PathChoice.why")?;
                let why = std::str::from_utf8(bytes)
                    .map_err(|e| ProtoError::InvalidUtf8 {
                        field: "PathChoice.why",
                        valid_up_to: e.valid_up_to(),
                    })?
                    .to_owned();
                Message::PathChoice { same_host, why }
            }
            Kind::Copy => {
                let n = r.count("Copy.runs", "MAX_RUNS", super::MAX_RUNS, COPY_RUN_LEN)?;
                let mut runs: Vec<(super::DataHeader, u64)> = Vec::with_capacity(n);
                for _ in 0..n {
                    let mut b = [0u8; super::DATA_HEADER_LEN];
                    b.copy_from_slice(r.take(super::DATA_HEADER_LEN, "Copy.runs[].header")?);
                    let h = super::DataHeader::decode_fields(&b)?;
                    h.check(limits)?;
                    if let Some((first, _)) = runs.first() {
                        if (h.room, h.generation) != (first.room, first.generation) {
                            return Err(ProtoError::RunsOfSeveralRooms {
                                first: (first.room, first.generation),
                                found: (h.room, h.generation),
                            });
                        }
                    }
                    runs.push((h, r.u64("Copy.runs[].source")?));
                }
                if runs.is_empty() {
                    return Err(ProtoError::BadRunCount {
                        found: 0,
                        frame_payload_len: payload.len() as u32,
                    });
                }
                Message::Copy { runs }
            }
            Kind::Copied => {
                let room = r.u64("Copied.room")?;
                let generation = r.u64("Copied.generation")?;
                let whole = r.bool("Copied.whole")?;
                Message::Copied {
                    room,
                    generation,
                    whole,
                }
            }
            Kind::IpcOffer => {
                let mut nonce = [0u8; IPC_NONCE_LEN];
                nonce.copy_from_slice(r.take(IPC_NONCE_LEN, "IpcOffer.nonce")?);
                let mut field = |name| -> Result<Vec<u8>, ProtoError> {
                    let len = r.u32(name)?;
                    Ok(r.take(len as usize, name)?.to_vec())
                };
                let ranges = field("IpcOffer.ranges")?;
                let kinds = field("IpcOffer.kinds")?;
                let socket = field("IpcOffer.socket")?;
                let why = field("IpcOffer.why")?;
                check_ipc_offer(ranges.len(), &kinds, socket.len(), why.len(), limits)?;
                let why = String::from_utf8(why).map_err(|e| ProtoError::InvalidUtf8 {
                    field: "IpcOffer.why",
                    valid_up_to: e.utf8_error().valid_up_to(),
                })?;
                Message::IpcOffer {
                    ranges,
                    kinds,
                    socket,
                    nonce,
                    why,
                }
            }
            Kind::Data | Kind::DataRuns => return Err(ProtoError::NotControlKind { kind }),
        };
        r.finish()?;
        Ok(msg)
    }
}

/// Reads a layout after its presence byte: the fields, then the order and kind (each a
/// known value), then [`KvLayout::check`].
fn decode_layout(r: &mut WireReader<'_>) -> Result<KvLayout, ProtoError> {
    let kv_heads = r.u32("Registration.layout.kv_heads")?;
    let head_dim = r.u32("Registration.layout.head_dim")?;
    let dtype_bytes = r.u32("Registration.layout.dtype_bytes")?;
    let tp_rank = r.u32("Registration.layout.tp_rank")?;
    let tp_size = r.u32("Registration.layout.tp_size")?;
    let page_tokens = r.u32("Registration.layout.page_tokens")?;
    let order = r.u8("Registration.layout.order")?;
    let order =
        PageOrder::from_value(order.into()).ok_or(ProtoError::BadPageOrder { found: order })?;
    let kind = r.u8("Registration.layout.kind")?;
    let kind = KvKind::from_value(kind.into()).ok_or(ProtoError::BadKvKind { found: kind })?;
    let layout = KvLayout {
        kv_heads,
        head_dim,
        dtype_bytes,
        tp_rank,
        tp_size,
        page_tokens,
        order,
        kind,
    };
    check_layout(&layout)?;
    Ok(layout)
}

/// [`KvLayout::check`] as a codec error naming the wire field.
fn check_layout(layout: &KvLayout) -> Result<(), ProtoError> {
    layout.check().map_err(|error| ProtoError::BadLayout {
        field: match error.field() {
            "kv_heads" => "Registration.layout.kv_heads",
            "head_dim" => "Registration.layout.head_dim",
            "dtype_bytes" => "Registration.layout.dtype_bytes",
            "tp_rank" => "Registration.layout.tp_rank",
            "tp_size" => "Registration.layout.tp_size",
            "page_tokens" => "Registration.layout.page_tokens",
            _ => "Registration.layout",
        },
        error,
    })
}

fn decode_buffers(
    r: &mut WireReader<'_>,
    field: &'static str,
    limits: &Limits,
) -> Result<Vec<BufferInfo>, ProtoError> {
    let n = r.count(field, "max_buffers", limits.max_buffers, BUFFER_INFO_LEN)?;
    let mut list = Vec::with_capacity(n);
    for index in 0..n {
        list.push(BufferInfo::decode(r, field, index)?);
    }
    Ok(list)
}

/// A digested run of a `Progress`, for the samples.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
fn progress_run(
    room: u64,
    generation: u64,
    target: super::Target,
    buffer: u32,
    first_page: u32,
    n_pages: u32,
    byte_len: u32,
    page_off: u32,
    digest: u32,
) -> super::DataHeader {
    super::DataHeader {
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
}

/// Valid messages covering typical and edge values, shared by the codec's tests.
#[cfg(test)]
pub(super) fn sample_messages() -> Vec<Message> {
    let buf = |len, item_len, layer_id| BufferInfo {
        len,
        item_len,
        layer_id,
        addr: 0,
        rkey: 0,
    };
    vec![
        Message::Hello {
            proto_version: super::PROTO_VERSION,
            role: Role::Prefill,
            engine_id: 42,
            conn: ConnKind::Control,
            conn_index: 0,
        },
        Message::Hello {
            proto_version: u16::MAX,
            role: Role::Decode,
            engine_id: u64::MAX,
            conn: ConnKind::Data,
            conn_index: u16::MAX,
        },
        Message::Registration(Registration::default()),
        Message::Registration(Registration {
            kv: vec![
                buf(64 * 4096, 4096, 0),
                buf(64 * 4096 + 7, 4096, 1),
                buf(u64::MAX, 1, BufferInfo::NO_LAYER),
                BufferInfo {
                    len: 8192,
                    item_len: 8192,
                    layer_id: i32::MAX,
                    addr: 0x7f00_dead_0000,
                    rkey: u32::MAX,
                },
            ],
            aux: vec![buf(1024, 128, BufferInfo::NO_LAYER)],
            layout: Some(KvLayout {
                kv_heads: 8,
                head_dim: 128,
                dtype_bytes: 2,
                tp_rank: 1,
                tp_size: 4,
                page_tokens: 16,
                order: PageOrder::Hnd,
                kind: KvKind::Heads,
            }),
            integrity: false,
        }),
        Message::Destination {
            room: 7,
            generation: 1,
            pages: vec![3, 4, 5, 100, 0, u32::MAX],
            aux_slot: Some(9),
        },
        Message::Destination {
            room: u64::MAX,
            generation: u64::MAX,
            pages: vec![],
            aux_slot: None,
        },
        Message::Destination {
            room: 0,
            generation: 0,
            pages: vec![1],
            aux_slot: Some(u32::MAX),
        },
        Message::Done {
            room: 7,
            generation: 1,
            pages_sent: 6,
            aux_sent: true,
        },
        Message::Done {
            room: u64::MAX,
            generation: 0,
            pages_sent: 0,
            aux_sent: false,
        },
        Message::Progress {
            room: 7,
            generation: 3,
            aux_rows: 1,
            bytes: 64 * 4096 + 128,
            kv: vec![(0, 32 * 4096), (1, 32 * 4096)],
            runs: vec![],
        },
        Message::Progress {
            room: u64::MAX,
            generation: u64::MAX,
            aux_rows: 0,
            bytes: u64::MAX,
            kv: vec![(u32::MAX, u64::MAX)],
            runs: vec![],
        },
        Message::Progress {
            room: 1,
            generation: 1,
            aux_rows: 1,
            bytes: 128,
            kv: vec![],
            runs: vec![],
        },
        Message::Abort {
            room: 7,
            generation: 2,
            reason: "decode engine shut down".into(),
        },
        Message::Abort {
            room: 0,
            generation: 0,
            reason: String::new(),
        },
        Message::Abort {
            room: 1,
            generation: 1,
            reason: "délai dépassé — 超时 🚫".into(),
        },
        Message::AbortAck {
            room: 7,
            generation: 2,
        },
        Message::Heartbeat { seq: 0 },
        Message::Heartbeat { seq: u64::MAX },
        Message::AuthHello {
            auth: AuthMode::Off,
            key_id: [0; AUTH_KEY_ID_LEN],
            nonce: [0; AUTH_NONCE_LEN],
        },
        Message::AuthHello {
            auth: AuthMode::Required,
            key_id: [0xA5; AUTH_KEY_ID_LEN],
            nonce: std::array::from_fn(|i| i as u8),
        },
        Message::AuthChallenge {
            auth: AuthMode::Off,
            engine_id: 0,
            nonce: [0; AUTH_NONCE_LEN],
        },
        Message::AuthChallenge {
            auth: AuthMode::Required,
            engine_id: u64::MAX,
            nonce: [0xFF; AUTH_NONCE_LEN],
        },
        Message::AuthProof {
            mac: std::array::from_fn(|i| (i * 7) as u8),
        },
        Message::AuthRefused {
            reason: AuthRefusal::WrongKey,
            auth: AuthMode::Required,
        },
        Message::AuthRefused {
            reason: AuthRefusal::Busy,
            auth: AuthMode::Off,
        },
        Message::Transport {
            transport: WireTransport::Tcp,
            qps: vec![],
        },
        Message::Transport {
            transport: WireTransport::Rdma,
            qps: vec![],
        },
        Message::Transport {
            transport: WireTransport::Rdma,
            qps: vec![
                QpInfo {
                    qpn: 0x0123,
                    psn: 0x00ab_cdef,
                    lid: 7,
                    gid: [0; 16],
                    mtu: 5,
                },
                QpInfo {
                    qpn: u32::MAX,
                    psn: QpInfo::MAX_PSN,
                    lid: u16::MAX,
                    gid: [
                        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55,
                    ],
                    mtu: QpInfo::MIN_MTU,
                },
                QpInfo {
                    qpn: 0,
                    psn: 0,
                    lid: 0,
                    gid: [0xff; 16],
                    mtu: 3,
                },
            ],
        },
        // Appended here, so that the indices tests use above stay put.
        Message::Registration(Registration {
            kv: vec![buf(64 * 36_864, 36_864, BufferInfo::NO_LAYER)],
            aux: vec![],
            layout: Some(KvLayout {
                kv_heads: 1,
                head_dim: 576,
                dtype_bytes: 1,
                tp_rank: u32::MAX - 1,
                tp_size: u32::MAX,
                page_tokens: 64,
                order: PageOrder::Nhd,
                kind: KvKind::Latent,
            }),
            integrity: false,
        }),
        Message::Progress {
            room: 7,
            generation: 3,
            aux_rows: 1,
            bytes: 2 * 4096 + 128,
            kv: vec![(0, 4096), (1, 4096)],
            runs: vec![
                progress_run(7, 3, super::Target::Kv, 0, 40, 1, 4096, 0, 0x1234_5678),
                progress_run(7, 3, super::Target::Kv, 1, 41, 1, 2048, 2048, u32::MAX),
                progress_run(7, 3, super::Target::Aux, 0, 2, 1, 128, 0, 0),
            ],
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::super::{FrameHeader, FRAME_HEADER_LEN};
    use super::*;

    fn encode(m: &Message) -> Vec<u8> {
        let mut out = Vec::new();
        m.encode(&mut out).unwrap();
        out
    }

    fn payload(m: &Message) -> Vec<u8> {
        encode(m)[FRAME_HEADER_LEN..].to_vec()
    }

    fn decode_frame(bytes: &[u8], limits: &Limits) -> Result<Message, ProtoError> {
        let hdr: [u8; FRAME_HEADER_LEN] = bytes[..FRAME_HEADER_LEN].try_into().unwrap();
        let h = FrameHeader::decode(&hdr, limits)?;
        assert_eq!(h.payload_len as usize, bytes.len() - FRAME_HEADER_LEN);
        Message::decode(h.kind, &bytes[FRAME_HEADER_LEN..], limits)
    }

    #[test]
    fn an_ipc_offer_round_trips_and_bad_kinds_long_names_or_short_payloads_are_refused() {
        let limits = Limits::default();
        let offer = Message::IpcOffer {
            ranges: vec![1, 0, 0, 0, 9, 9],
            kinds: vec![1, 1, 0],
            socket: b"kvxfer-fd-1-abc".to_vec(),
            nonce: [7; IPC_NONCE_LEN],
            why: String::new(),
        };
        assert_eq!(offer.validate(&limits), Ok(()));
        let bytes = encode(&offer);
        assert_eq!(decode_frame(&bytes, &limits), Ok(offer.clone()));
        let refused = Message::IpcOffer {
            ranges: Vec::new(),
            kinds: vec![0],
            socket: Vec::new(),
            nonce: [0; IPC_NONCE_LEN],
            why: "CUDA IPC export failed".into(),
        };
        assert_eq!(decode_frame(&encode(&refused), &limits), Ok(refused));
        let Message::IpcOffer {
            ranges,
            socket,
            nonce,
            why,
            ..
        } = offer.clone()
        else {
            unreachable!()
        };
        let bad_kind = Message::IpcOffer {
            ranges: ranges.clone(),
            kinds: vec![1, 2],
            socket: socket.clone(),
            nonce,
            why: why.clone(),
        };
        assert!(matches!(
            bad_kind.validate(&limits),
            Err(ProtoError::BadBool { .. })
        ));
        assert!(matches!(
            Message::decode(Kind::IpcOffer, &payload(&bad_kind), &limits),
            Err(ProtoError::BadBool { .. })
        ));
        let long = Message::IpcOffer {
            ranges,
            kinds: vec![1],
            socket: vec![b'x'; MAX_IPC_SOCKET_LEN + 1],
            nonce,
            why,
        };
        assert!(matches!(
            Message::decode(Kind::IpcOffer, &payload(&long), &limits),
            Err(ProtoError::StringTooLong { .. })
        ));
        let p = payload(&offer);
        assert!(Message::decode(Kind::IpcOffer, &p[..p.len() - 1], &limits).is_err());
        let mut extra = p.clone();
        extra.push(0);
        assert!(Message::decode(Kind::IpcOffer, &extra, &limits).is_err());
    }

    #[test]
    fn progress_runs_of_another_room_or_too_many_do_not_validate() {
        let limits = Limits::default();
        let run = progress_run(7, 3, super::super::Target::Kv, 0, 1, 1, 64, 0, 9);
        let progress = |runs: Vec<super::super::DataHeader>| Message::Progress {
            room: 7,
            generation: 3,
            aux_rows: 0,
            bytes: 64,
            kv: vec![(0, 64)],
            runs,
        };
        assert_eq!(progress(vec![run]).validate(&limits), Ok(()));
        let other = super::super::DataHeader {
            generation: 2,
            ..run
        };
        assert!(matches!(
            progress(vec![run, other]).validate(&limits),
            Err(ProtoError::RunsOfSeveralRooms { .. })
        ));
        let many = vec![run; super::super::MAX_RUNS as usize + 1];
        assert!(matches!(
            progress(many).validate(&limits),
            Err(ProtoError::CountOverLimit { .. })
        ));
        // A run's own fields are checked as a data header's, on both sides.
        let empty = super::super::DataHeader { n_pages: 0, ..run };
        assert_eq!(
            progress(vec![empty]).validate(&limits),
            Err(ProtoError::ZeroPages)
        );
        let bytes = encode(&progress(vec![empty]));
        assert_eq!(decode_frame(&bytes, &limits), Err(ProtoError::ZeroPages));
    }

    #[test]
    fn every_sample_round_trips_and_validates() {
        let limits = Limits::default();
        for m in sample_messages() {
            let bytes = encode(&m);
            assert_eq!(
                bytes.len() as u64,
                FRAME_HEADER_LEN as u64 + m.payload_len()
            );
            assert_eq!(decode_frame(&bytes, &limits), Ok(m.clone()), "{m:?}");
            assert_eq!(m.validate(&limits), Ok(()), "{m:?}");
        }
    }

    #[test]
    fn encode_appends_after_existing_bytes() {
        let mut out = vec![0xAA; 3];
        let m = Message::Heartbeat { seq: 5 };
        m.encode(&mut out).unwrap();
        assert_eq!(&out[..3], &[0xAA; 3]);
        assert_eq!(decode_frame(&out[3..], &Limits::default()), Ok(m));
    }

    #[test]
    fn wire_layout_of_done_is_documented_one() {
        let m = Message::Done {
            room: 0x11,
            generation: 0x22,
            pages_sent: 0x33,
            aux_sent: true,
        };
        let mut want = Vec::new();
        want.extend_from_slice(&0x11u64.to_le_bytes());
        want.extend_from_slice(&0x22u64.to_le_bytes());
        want.extend_from_slice(&0x11u64.to_le_bytes());
        want.extend_from_slice(&0x33u32.to_le_bytes());
        want.push(1);
        assert_eq!(payload(&m), want);
    }

    #[test]
    fn data_kind_is_not_a_message() {
        assert_eq!(
            Message::decode(Kind::Data, &[0; 40], &Limits::default()),
            Err(ProtoError::NotControlKind { kind: Kind::Data })
        );
    }

    #[test]
    fn payload_over_control_limit_is_rejected_by_decode() {
        let limits = Limits {
            max_control_payload: 8,
            ..Limits::default()
        };
        let p = payload(&Message::AbortAck {
            room: 1,
            generation: 2,
        });
        assert_eq!(
            Message::decode(Kind::AbortAck, &p, &limits),
            Err(ProtoError::PayloadTooLarge {
                kind: Kind::AbortAck,
                len: 16,
                max: 8
            })
        );
    }

    #[test]
    fn trailing_bytes_are_rejected_for_every_kind() {
        for m in sample_messages() {
            let mut p = payload(&m);
            p.push(0);
            assert_eq!(
                Message::decode(m.kind(), &p, &Limits::default()),
                Err(ProtoError::TrailingBytes {
                    kind: m.kind(),
                    extra: 1
                }),
                "{m:?}"
            );
        }
    }

    #[test]
    fn bad_role_and_conn_kind_are_rejected() {
        let m = &sample_messages()[0];
        let mut p = payload(m);
        p[2] = 3;
        let e = Message::decode(Kind::Hello, &p, &Limits::default()).unwrap_err();
        assert_eq!(e, ProtoError::BadRole { found: 3 });
        assert!(e.to_string().contains("Hello.role 3"), "{e}");
        let mut p = payload(m);
        p[2] = 0;
        assert_eq!(
            Message::decode(Kind::Hello, &p, &Limits::default()),
            Err(ProtoError::BadRole { found: 0 })
        );
        let mut p = payload(m);
        p[3] = 9;
        assert_eq!(
            Message::decode(Kind::Hello, &p, &Limits::default()),
            Err(ProtoError::BadConnKind { found: 9 })
        );
    }

    fn registration(kv: Vec<BufferInfo>, aux: Vec<BufferInfo>) -> Message {
        Message::Registration(Registration {
            kv,
            aux,
            layout: None,
            integrity: false,
        })
    }

    const GOOD: BufferInfo = BufferInfo {
        len: 4096,
        item_len: 1024,
        layer_id: -1,
        addr: 0,
        rkey: 0,
    };

    #[test]
    fn buffer_counts_over_limit_are_rejected() {
        let limits = Limits {
            max_buffers: 2,
            ..Limits::default()
        };
        let m = registration(vec![GOOD; 3], vec![]);
        let want = ProtoError::CountOverLimit {
            field: "Registration.kv",
            count: 3,
            limit: "max_buffers",
            max: 2,
        };
        assert_eq!(m.validate(&limits), Err(want.clone()));
        assert_eq!(
            Message::decode(Kind::Registration, &payload(&m), &limits),
            Err(want)
        );
        let m = registration(vec![GOOD; 2], vec![GOOD; 3]);
        assert!(matches!(
            Message::decode(Kind::Registration, &payload(&m), &limits),
            Err(ProtoError::CountOverLimit {
                field: "Registration.aux",
                count: 3,
                ..
            })
        ));
    }

    #[test]
    fn buffer_count_beyond_payload_is_rejected_before_allocating() {
        let limits = Limits {
            max_buffers: u32::MAX,
            ..Limits::default()
        };
        let mut p = payload(&registration(vec![GOOD], vec![]));
        // After the presence byte of the (absent) layout.
        p[1..5].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Message::decode(Kind::Registration, &p, &limits),
            Err(ProtoError::CountExceedsPayload {
                field: "Registration.kv",
                count: u32::MAX,
                elem_size: 32,
                remaining: 37
            })
        );
    }

    #[test]
    fn invalid_buffers_are_rejected_with_their_index() {
        let limits = Limits::default();
        let cases = [
            (
                BufferInfo {
                    item_len: 0,
                    ..GOOD
                },
                ProtoError::ZeroItemLen {
                    field: "Registration.aux",
                    index: 1,
                },
            ),
            (
                BufferInfo { len: 1023, ..GOOD },
                ProtoError::BufferShorterThanItem {
                    field: "Registration.aux",
                    index: 1,
                    len: 1023,
                    item_len: 1024,
                },
            ),
            (
                BufferInfo {
                    layer_id: -2,
                    ..GOOD
                },
                ProtoError::BadLayerId {
                    field: "Registration.aux",
                    index: 1,
                    found: -2,
                },
            ),
        ];
        for (bad, want) in cases {
            let m = registration(vec![GOOD], vec![GOOD, bad]);
            assert_eq!(m.validate(&limits), Err(want.clone()));
            let e = Message::decode(Kind::Registration, &payload(&m), &limits).unwrap_err();
            assert_eq!(e, want);
            assert!(e.to_string().contains("Registration.aux[1]"), "{e}");
        }
    }

    #[test]
    fn buffer_len_need_not_be_a_multiple_of_item_len() {
        let b = BufferInfo { len: 4097, ..GOOD };
        assert_eq!(b.pages(), 4);
        assert_eq!(b.layer(), None);
        assert_eq!(BufferInfo { layer_id: 3, ..b }.layer(), Some(3));
        let m = registration(vec![b], vec![]);
        assert_eq!(
            Message::decode(Kind::Registration, &payload(&m), &Limits::default()),
            Ok(m)
        );
    }

    fn destination(pages: Vec<u32>, aux_slot: Option<u32>) -> Message {
        Message::Destination {
            room: 1,
            generation: 2,
            pages,
            aux_slot,
        }
    }

    #[test]
    fn page_count_over_limit_is_rejected() {
        let limits = Limits {
            max_pages: 4,
            ..Limits::default()
        };
        let m = destination(vec![0; 5], None);
        let want = ProtoError::CountOverLimit {
            field: "Destination.pages",
            count: 5,
            limit: "max_pages",
            max: 4,
        };
        assert_eq!(m.validate(&limits), Err(want.clone()));
        let e = Message::decode(Kind::Destination, &payload(&m), &limits).unwrap_err();
        assert_eq!(e, want);
        assert_eq!(
            e.to_string(),
            "Destination.pages count 5 exceeds max_pages = 4"
        );
        assert!(Message::decode(
            Kind::Destination,
            &payload(&destination(vec![0; 4], None)),
            &limits
        )
        .is_ok());
    }

    #[test]
    fn page_count_beyond_payload_is_rejected() {
        let mut p = payload(&destination(vec![1, 2], None));
        p[24..28].copy_from_slice(&1000u32.to_le_bytes());
        assert_eq!(
            Message::decode(Kind::Destination, &p, &Limits::default()),
            Err(ProtoError::CountExceedsPayload {
                field: "Destination.pages",
                count: 1000,
                elem_size: 4,
                remaining: 8
            })
        );
    }

    #[test]
    fn bad_aux_slots_are_rejected() {
        let base = payload(&destination(vec![], None));
        for bad in [-2i64, i64::MIN, u32::MAX as i64 + 1, i64::MAX] {
            let mut p = base.clone();
            p[16..24].copy_from_slice(&bad.to_le_bytes());
            let e = Message::decode(Kind::Destination, &p, &Limits::default()).unwrap_err();
            assert_eq!(e, ProtoError::BadAuxSlot { found: bad });
            assert!(e.to_string().contains(&bad.to_string()), "{e}");
        }
        assert_eq!(&base[16..24], &(-1i64).to_le_bytes());
    }

    #[test]
    fn done_with_mismatched_room_echo_is_rejected() {
        let m = &sample_messages()[7];
        let mut p = payload(m);
        p[16] ^= 0x40;
        let e = Message::decode(Kind::Done, &p, &Limits::default()).unwrap_err();
        assert_eq!(
            e,
            ProtoError::RoomEchoMismatch {
                room: 7,
                room_echo: 0x47
            }
        );
        assert!(e.to_string().contains("corrupt"), "{e}");
    }

    #[test]
    fn done_with_non_boolean_aux_sent_is_rejected() {
        let mut p = payload(&sample_messages()[7]);
        p[28] = 2;
        assert_eq!(
            Message::decode(Kind::Done, &p, &Limits::default()),
            Err(ProtoError::BadBool {
                field: "Done.aux_sent",
                found: 2
            })
        );
    }

    fn abort(reason: &str) -> Message {
        Message::Abort {
            room: 3,
            generation: 4,
            reason: reason.into(),
        }
    }

    #[test]
    fn invalid_utf8_reason_is_rejected() {
        let mut p = payload(&abort("abcd"));
        p[22] = 0xff;
        let e = Message::decode(Kind::Abort, &p, &Limits::default()).unwrap_err();
        assert_eq!(
            e,
            ProtoError::InvalidUtf8 {
                field: "Abort.reason",
                valid_up_to: 2
            }
        );
    }

    #[test]
    fn reason_over_limit_is_rejected() {
        let limits = Limits {
            max_reason_len: 3,
            ..Limits::default()
        };
        let m = abort("abcd");
        let want = ProtoError::StringTooLong {
            field: "Abort.reason",
            len: 4,
            max: 3,
        };
        assert_eq!(m.validate(&limits), Err(want.clone()));
        assert_eq!(
            Message::decode(Kind::Abort, &payload(&m), &limits),
            Err(want)
        );
    }

    #[test]
    fn reason_length_beyond_payload_is_rejected() {
        let limits = Limits {
            max_reason_len: u32::MAX,
            ..Limits::default()
        };
        let mut p = payload(&abort("ab"));
        p[16..20].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(Kind::Abort, &p, &limits),
            Err(ProtoError::Truncated {
                field: "Abort.reason",
                remaining: 2,
                ..
            })
        ));
    }

    #[test]
    fn truncate_reason_cuts_at_char_boundary() {
        assert_eq!(truncate_reason("hello", 10), "hello");
        assert_eq!(truncate_reason("hello", 5), "hello");
        assert_eq!(truncate_reason("hello", 3), "hel");
        assert_eq!(truncate_reason("hello", 0), "");
        // 'é' is 2 bytes, '超' is 3 bytes.
        assert_eq!(truncate_reason("aé", 2), "a");
        assert_eq!(truncate_reason("a超b", 3), "a");
        assert_eq!(truncate_reason("a超b", 4), "a超");
        let limits = Limits {
            max_reason_len: 3,
            ..Limits::default()
        };
        let m = Message::abort(1, 2, "ab🚫", &limits);
        assert_eq!(m, abort_with(1, 2, "ab"));
        assert_eq!(m.validate(&limits), Ok(()));
    }

    fn abort_with(room: u64, generation: u64, reason: &str) -> Message {
        Message::Abort {
            room,
            generation,
            reason: reason.into(),
        }
    }

    #[test]
    fn validate_rejects_payload_over_control_limit() {
        let limits = Limits {
            max_control_payload: 27,
            ..Limits::default()
        };
        assert_eq!(
            destination(vec![], None).validate(&limits),
            Err(ProtoError::PayloadTooLarge {
                kind: Kind::Destination,
                len: 28,
                max: 27
            })
        );
    }

    const QP: QpInfo = QpInfo {
        qpn: 0x11_2233,
        psn: 0x44_5566,
        lid: 0x7788,
        gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
        mtu: 4,
    };

    fn rdma(qps: Vec<QpInfo>) -> Message {
        Message::Transport {
            transport: WireTransport::Rdma,
            qps,
        }
    }

    #[test]
    fn wire_layout_of_transport_is_documented_one() {
        let m = rdma(vec![QP]);
        let mut want = vec![2, 0, 0, 0];
        want.extend_from_slice(&1u32.to_le_bytes());
        want.extend_from_slice(&0x11_2233u32.to_le_bytes());
        want.extend_from_slice(&0x44_5566u32.to_le_bytes());
        want.extend_from_slice(&0x7788u16.to_le_bytes());
        want.extend_from_slice(&QP.gid);
        want.push(4);
        assert_eq!(payload(&m), want);
        assert_eq!(m.payload_len(), 8 + 27);
        assert_eq!(m.kind(), Kind::Transport);
        let tcp = Message::Transport {
            transport: WireTransport::Tcp,
            qps: vec![],
        };
        assert_eq!(payload(&tcp), [1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(
            Message::decode(Kind::Transport, &payload(&m), &Limits::default()),
            Ok(m)
        );
    }

    /// GQA rank 1 of 4 over 8 heads of 128 fp16 elements, 16-token NHD pages.
    const LAYOUT: KvLayout = KvLayout {
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
        tp_rank: 1,
        tp_size: 4,
        page_tokens: 16,
        order: PageOrder::Nhd,
        kind: KvKind::Heads,
    };

    fn with_layout(layout: Option<KvLayout>) -> Message {
        Message::Registration(Registration {
            kv: vec![GOOD],
            aux: vec![],
            layout,
            integrity: false,
        })
    }

    #[test]
    fn wire_layout_of_registration_is_documented_one() {
        let mut buffer = Vec::new();
        buffer.extend_from_slice(&4096u64.to_le_bytes());
        buffer.extend_from_slice(&1024u64.to_le_bytes());
        buffer.extend_from_slice(&0u64.to_le_bytes());
        buffer.extend_from_slice(&(-1i32).to_le_bytes());
        buffer.extend_from_slice(&0u32.to_le_bytes());
        // The lists, then the integrity setting (off in these).
        let lists = |want: &mut Vec<u8>| {
            want.extend_from_slice(&1u32.to_le_bytes());
            want.extend_from_slice(&buffer);
            want.extend_from_slice(&0u32.to_le_bytes());
            want.push(0);
        };
        // Without a layout: its presence byte 0, then the lists.
        let mut want = vec![0];
        lists(&mut want);
        assert_eq!(payload(&with_layout(None)), want);
        assert_eq!(with_layout(None).payload_len(), 1 + 8 + 32 + 1);
        // With: 1, six u32 fields, the order and the kind.
        let mut want = vec![1];
        for v in [8u32, 128, 2, 1, 4, 16] {
            want.extend_from_slice(&v.to_le_bytes());
        }
        want.extend_from_slice(&[1, 0]);
        lists(&mut want);
        let m = with_layout(Some(LAYOUT));
        assert_eq!(payload(&m), want);
        assert_eq!(m.payload_len(), 1 + 26 + 8 + 32 + 1);
        assert_eq!(
            Message::decode(Kind::Registration, &want, &Limits::default()),
            Ok(m)
        );
    }

    #[test]
    fn every_layout_kind_and_order_round_trips() {
        for order in [PageOrder::Hnd, PageOrder::Nhd] {
            for kind in [KvKind::Heads, KvKind::Latent] {
                let kv_heads = if kind == KvKind::Latent { 1 } else { 8 };
                let l = KvLayout {
                    order,
                    kind,
                    kv_heads,
                    ..LAYOUT
                };
                let m = with_layout(Some(l));
                assert_eq!(
                    Message::decode(Kind::Registration, &payload(&m), &Limits::default()),
                    Ok(m)
                );
            }
        }
    }

    /// The payload of a registration with [`LAYOUT`], its layout byte `at` (0 = presence,
    /// 1.. the layout's) set to `value`.
    fn layout_decode_error(at: usize, value: &[u8]) -> ProtoError {
        let mut p = payload(&with_layout(Some(LAYOUT)));
        p[at..at + value.len()].copy_from_slice(value);
        Message::decode(Kind::Registration, &p, &Limits::default()).unwrap_err()
    }

    #[test]
    fn a_malformed_layout_is_a_decode_error_naming_the_field() {
        let e = layout_decode_error(0, &[2]);
        assert_eq!(
            e,
            ProtoError::BadBool {
                field: "Registration.layout",
                found: 2
            }
        );
        let e = layout_decode_error(25, &[7]);
        assert_eq!(e, ProtoError::BadPageOrder { found: 7 });
        assert_eq!(
            e.to_string(),
            "Registration.layout.order 7 is neither 0 (HND) nor 1 (NHD)"
        );
        let e = layout_decode_error(26, &[2]);
        assert_eq!(e, ProtoError::BadKvKind { found: 2 });
        assert_eq!(
            e.to_string(),
            "Registration.layout.kind 2 is neither 0 (heads) nor 1 (latent)"
        );
        // Fields that fail KvLayout::check, by offset: kv_heads, head_dim, dtype_bytes,
        // tp_rank, tp_size, page_tokens.
        let cases: [(usize, u32, &str, &str); 6] = [
            (1, 0, "kv_heads", "kv_heads is 0"),
            (5, 0, "head_dim", "head_dim is 0"),
            (9, 0, "dtype_bytes", "dtype_bytes is 0"),
            (13, 4, "tp_rank", "tp_rank 4 is not below tp_size 4"),
            (
                17,
                3,
                "kv_heads",
                "kv_heads 8 is not a multiple of tp_size 3",
            ),
            (21, 0, "page_tokens", "page_tokens is 0"),
        ];
        for (at, v, field, why) in cases {
            let e = layout_decode_error(at, &v.to_le_bytes());
            let ProtoError::BadLayout { field: f, error } = &e else {
                panic!("{e:?}");
            };
            assert_eq!(*f, format!("Registration.layout.{field}"));
            assert_eq!(error.field(), field);
            assert!(error.to_string().starts_with(why), "{e}");
            assert!(e
                .to_string()
                .starts_with(&format!("Registration.layout.{field}: ")));
        }
        // A latent of two heads.
        let mut p = payload(&with_layout(Some(LAYOUT)));
        p[26] = 1;
        let e = Message::decode(Kind::Registration, &p, &Limits::default()).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("Registration.layout.kv_heads: kv_heads 8 with kind latent"),
            "{e}"
        );
        // Cut inside the layout.
        let p = payload(&with_layout(Some(LAYOUT)));
        assert!(matches!(
            Message::decode(Kind::Registration, &p[..8], &Limits::default()),
            Err(ProtoError::Truncated {
                field: "Registration.layout.head_dim",
                ..
            })
        ));
    }

    #[test]
    fn validate_refuses_the_layouts_decode_refuses() {
        let bad = with_layout(Some(KvLayout {
            tp_rank: 9,
            ..LAYOUT
        }));
        let e = bad.validate(&Limits::default()).unwrap_err();
        assert_eq!(e, layout_decode_error(13, &9u32.to_le_bytes()));
        with_layout(Some(LAYOUT))
            .validate(&Limits::default())
            .unwrap();
    }

    #[test]
    fn bad_transport_values_are_rejected() {
        for bad in [0u8, 3, 0xff] {
            let mut p = payload(&rdma(vec![QP]));
            p[0] = bad;
            let e = Message::decode(Kind::Transport, &p, &Limits::default()).unwrap_err();
            assert_eq!(e, ProtoError::BadTransport { found: bad });
            assert!(
                e.to_string()
                    .contains(&format!("Transport.transport {bad} is not a transport")),
                "{e}"
            );
        }
        assert_eq!(WireTransport::try_from(1), Ok(WireTransport::Tcp));
        assert_eq!(WireTransport::try_from(2), Ok(WireTransport::Rdma));
    }

    #[test]
    fn nonzero_transport_reserved_bytes_are_rejected() {
        for (at, found) in [(1usize, 0x01u64), (2, 0x0100), (3, 0x01_0000)] {
            let mut p = payload(&rdma(vec![QP]));
            p[at] = 1;
            assert_eq!(
                Message::decode(Kind::Transport, &p, &Limits::default()),
                Err(ProtoError::NonzeroReserved {
                    field: "Transport.reserved",
                    found
                })
            );
        }
    }

    #[test]
    fn queue_pairs_on_tcp_are_rejected() {
        let m = Message::Transport {
            transport: WireTransport::Tcp,
            qps: vec![QP],
        };
        let want = ProtoError::QpsOnTcp { count: 1 };
        assert_eq!(m.validate(&Limits::default()), Err(want.clone()));
        let e = Message::decode(Kind::Transport, &payload(&m), &Limits::default()).unwrap_err();
        assert_eq!(e, want);
        assert!(e.to_string().contains("tcp"), "{e}");
        // A huge count on tcp fails on the count itself, whatever the payload holds.
        let mut p = payload(&m);
        p[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            Message::decode(Kind::Transport, &p, &Limits::default()),
            Err(ProtoError::QpsOnTcp { count: u32::MAX })
        );
    }

    #[test]
    fn qp_count_over_limit_is_rejected() {
        let limits = Limits {
            max_qps: 2,
            ..Limits::default()
        };
        let m = rdma(vec![QP; 3]);
        let want = ProtoError::CountOverLimit {
            field: "Transport.qps",
            count: 3,
            limit: "max_qps",
            max: 2,
        };
        assert_eq!(m.validate(&limits), Err(want.clone()));
        let e = Message::decode(Kind::Transport, &payload(&m), &limits).unwrap_err();
        assert_eq!(e, want);
        assert_eq!(e.to_string(), "Transport.qps count 3 exceeds max_qps = 2");
        let ok = rdma(vec![QP; 2]);
        assert_eq!(ok.validate(&limits), Ok(()));
        assert_eq!(
            Message::decode(Kind::Transport, &payload(&ok), &limits),
            Ok(ok)
        );
        assert_eq!(Limits::default().max_qps, 512);
    }

    #[test]
    fn qp_count_beyond_payload_is_rejected() {
        let limits = Limits {
            max_qps: u32::MAX,
            ..Limits::default()
        };
        let mut p = payload(&rdma(vec![QP, QP]));
        p[4..8].copy_from_slice(&3u32.to_le_bytes());
        assert_eq!(
            Message::decode(Kind::Transport, &p, &limits),
            Err(ProtoError::CountExceedsPayload {
                field: "Transport.qps",
                count: 3,
                elem_size: 27,
                remaining: 54
            })
        );
        p[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            Message::decode(Kind::Transport, &p, &limits),
            Err(ProtoError::CountExceedsPayload {
                field: "Transport.qps",
                count: u32::MAX,
                ..
            })
        ));
    }

    #[test]
    fn psn_over_24_bits_is_rejected_with_its_index() {
        let limits = Limits::default();
        for bad in [1u32 << 24, u32::MAX] {
            let m = rdma(vec![QP, QpInfo { psn: bad, ..QP }]);
            let want = ProtoError::BadPsn {
                index: 1,
                found: bad,
            };
            assert_eq!(m.validate(&limits), Err(want.clone()));
            let e = Message::decode(Kind::Transport, &payload(&m), &limits).unwrap_err();
            assert_eq!(e, want);
            assert!(e.to_string().contains("Transport.qps[1].psn"), "{e}");
        }
        let edge = rdma(vec![QpInfo {
            psn: QpInfo::MAX_PSN,
            ..QP
        }]);
        assert_eq!(
            Message::decode(Kind::Transport, &payload(&edge), &limits),
            Ok(edge)
        );
    }

    #[test]
    fn mtu_outside_ibv_mtu_is_rejected_with_its_index() {
        let limits = Limits::default();
        for bad in [0u8, 6, 0xff] {
            let m = rdma(vec![QpInfo { mtu: bad, ..QP }]);
            let want = ProtoError::BadMtu {
                index: 0,
                found: bad,
            };
            assert_eq!(m.validate(&limits), Err(want.clone()));
            let e = Message::decode(Kind::Transport, &payload(&m), &limits).unwrap_err();
            assert_eq!(e, want);
            assert!(e.to_string().contains("Transport.qps[0].mtu"), "{e}");
        }
        for mtu in QpInfo::MIN_MTU..=QpInfo::MAX_MTU {
            let m = rdma(vec![QpInfo { mtu, ..QP }]);
            assert_eq!(m.validate(&limits), Ok(()));
            assert_eq!(
                Message::decode(Kind::Transport, &payload(&m), &limits),
                Ok(m)
            );
        }
    }

    #[test]
    fn truncated_transport_payloads_name_the_field() {
        let p = payload(&rdma(vec![QP]));
        let cases = [
            (0, "Transport.transport", 1),
            (1, "Transport.reserved", 3),
            (6, "Transport.qps", 4),
            (8, "Transport.qps", 27),
        ];
        let limits = Limits::default();
        for (cut, field, needed) in cases {
            let e = Message::decode(Kind::Transport, &p[..cut], &limits).unwrap_err();
            match e {
                ProtoError::Truncated {
                    field: f,
                    needed: n,
                    ..
                } => assert_eq!((f, n), (field, needed), "cut at {cut}"),
                ProtoError::CountExceedsPayload { field: f, .. } => {
                    assert_eq!(f, field, "cut at {cut}")
                }
                other => panic!("cut at {cut}: {other}"),
            }
        }
        // Any cut inside the entries fails on the count, before a queue pair is read.
        for cut in 8..p.len() {
            assert_eq!(
                Message::decode(Kind::Transport, &p[..cut], &limits),
                Err(ProtoError::CountExceedsPayload {
                    field: "Transport.qps",
                    count: 1,
                    elem_size: 27,
                    remaining: cut - 8
                })
            );
        }
    }

    #[test]
    fn validate_rejects_transport_over_control_limit() {
        let limits = Limits {
            max_control_payload: 8 + 27,
            ..Limits::default()
        };
        assert_eq!(rdma(vec![QP]).validate(&limits), Ok(()));
        assert_eq!(
            rdma(vec![QP; 2]).validate(&limits),
            Err(ProtoError::PayloadTooLarge {
                kind: Kind::Transport,
                len: 8 + 54,
                max: 35
            })
        );
    }

    #[test]
    fn every_proper_prefix_of_every_payload_is_an_error() {
        let limits = Limits::default();
        for m in sample_messages() {
            let p = payload(&m);
            for cut in 0..p.len() {
                assert!(
                    Message::decode(m.kind(), &p[..cut], &limits).is_err(),
                    "{m:?} cut at {cut}"
                );
            }
        }
    }

    fn auth_hello(auth: AuthMode, key_id: u8, nonce: u8) -> Message {
        Message::AuthHello {
            auth,
            key_id: [key_id; AUTH_KEY_ID_LEN],
            nonce: [nonce; AUTH_NONCE_LEN],
        }
    }

    #[test]
    fn wire_layout_of_auth_messages_is_documented_one() {
        let p = payload(&auth_hello(AuthMode::Required, 0xAA, 0xBB));
        assert_eq!(p.len(), 44);
        assert_eq!(p[..4], [2, 0, 0, 0]);
        assert_eq!(p[4..12], [0xAA; 8]);
        assert_eq!(p[12..], [0xBB; 32]);
        let p = payload(&Message::AuthChallenge {
            auth: AuthMode::Required,
            engine_id: 0x0102_0304_0506_0708,
            nonce: [0xCC; AUTH_NONCE_LEN],
        });
        assert_eq!(p[..12], [2, 0, 0, 0, 8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(p[12..], [0xCC; 32]);
        let p = payload(&Message::AuthProof {
            mac: [9; AUTH_MAC_LEN],
        });
        assert_eq!(p, [9; 32]);
        let p = payload(&Message::AuthRefused {
            reason: AuthRefusal::Replay,
            auth: AuthMode::Off,
        });
        assert_eq!(p, [4, 1]);
    }

    #[test]
    fn bad_auth_settings_and_refusals_are_rejected() {
        let l = Limits::default();
        let mut p = payload(&auth_hello(AuthMode::Off, 0, 0));
        for bad in [0u8, 3, 0xff] {
            p[0] = bad;
            assert_eq!(
                Message::decode(Kind::AuthHello, &p, &l),
                Err(ProtoError::BadAuthMode {
                    field: "AuthHello.auth",
                    found: bad
                })
            );
        }
        let mut p = payload(&Message::AuthRefused {
            reason: AuthRefusal::Mismatch,
            auth: AuthMode::Required,
        });
        for bad in [0u8, 9, 0xff] {
            p[0] = bad;
            assert_eq!(
                Message::decode(Kind::AuthRefused, &p, &l),
                Err(ProtoError::BadAuthRefusal { found: bad })
            );
        }
        p[0] = 1;
        p[1] = 0;
        assert_eq!(
            Message::decode(Kind::AuthRefused, &p, &l),
            Err(ProtoError::BadAuthMode {
                field: "AuthRefused.auth",
                found: 0
            })
        );
        for r in AuthRefusal::ALL {
            assert_eq!(AuthRefusal::try_from(r as u8), Ok(r));
        }
    }

    #[test]
    fn auth_data_with_auth_off_is_rejected_by_decode_and_validate() {
        let l = Limits::default();
        for (m, field) in [
            (auth_hello(AuthMode::Off, 1, 0), "AuthHello.key_id"),
            (auth_hello(AuthMode::Off, 0, 1), "AuthHello.nonce"),
            (
                Message::AuthChallenge {
                    auth: AuthMode::Off,
                    engine_id: 5,
                    nonce: [0; AUTH_NONCE_LEN],
                },
                "AuthChallenge.engine_id",
            ),
            (
                Message::AuthChallenge {
                    auth: AuthMode::Off,
                    engine_id: 0,
                    nonce: [1; AUTH_NONCE_LEN],
                },
                "AuthChallenge.nonce",
            ),
        ] {
            let want = ProtoError::AuthDataWithAuthOff { field };
            assert_eq!(m.validate(&l), Err(want.clone()));
            assert_eq!(Message::decode(m.kind(), &payload(&m), &l), Err(want));
        }
        // The same bytes are fine with authentication on.
        assert!(auth_hello(AuthMode::Required, 1, 1).validate(&l).is_ok());
    }

    #[test]
    fn nonzero_auth_reserved_bytes_are_rejected() {
        let l = Limits::default();
        for (kind, m) in [
            (Kind::AuthHello, auth_hello(AuthMode::Required, 1, 1)),
            (
                Kind::AuthChallenge,
                Message::AuthChallenge {
                    auth: AuthMode::Required,
                    engine_id: 1,
                    nonce: [1; AUTH_NONCE_LEN],
                },
            ),
        ] {
            for i in 1..4 {
                let mut p = payload(&m);
                p[i] = 1;
                assert!(
                    matches!(
                        Message::decode(kind, &p, &l),
                        Err(ProtoError::NonzeroReserved { .. })
                    ),
                    "{kind} byte {i}"
                );
            }
        }
    }
}
