//! Fake peer engines on raw sockets, speaking the wire protocol by hand, for tests that
//! must hold one side of a connection at an exact point (mid-handshake, mid-frame) or
//! send what a real engine never would. They authenticate as engines with `auth=off`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::proto::{
    self, AuthMode, BufferInfo, ConnKind, DataHeader, Limits, Message, ReadError, Registration,
    Role, Target, WireTransport, AUTH_KEY_ID_LEN, AUTH_NONCE_LEN, PROTO_VERSION,
};
use kvxfer::{Engine, RoomPeers};

/// How long a fake peer waits for any one frame.
pub const READ_LIMIT: Duration = Duration::from_secs(20);

/// `m` as the bytes of its frame.
pub fn encode(m: &Message) -> Vec<u8> {
    let mut f = Vec::new();
    m.encode(&mut f).unwrap();
    f
}

pub fn send_msg(s: &mut TcpStream, m: &Message) {
    s.write_all(&encode(m)).unwrap();
}

pub fn recv_msg(s: &mut TcpStream) -> Message {
    let l = Limits::default();
    let h = proto::read_frame_header(s, &l).unwrap();
    proto::read_control(s, &h, &l).unwrap()
}

/// The next control message that is not a heartbeat; fails the test if none came within
/// `READ_LIMIT` (heartbeats alone would keep a plain read waiting forever).
pub fn recv_past_heartbeats(s: &mut TcpStream) -> Message {
    let end = Instant::now() + READ_LIMIT;
    loop {
        match recv_msg(s) {
            Message::Heartbeat { .. } => {
                assert!(Instant::now() < end, "only heartbeats for {READ_LIMIT:?}")
            }
            m => return m,
        }
    }
}

/// The next control message within `within`, or `None` if none came (or the
/// connection ended).
pub fn recv_msg_within(s: &mut TcpStream, within: Duration) -> Option<Message> {
    s.set_read_timeout(Some(within)).unwrap();
    let l = Limits::default();
    let r = proto::read_frame_header(s, &l).and_then(|h| proto::read_control(s, &h, &l));
    s.set_read_timeout(Some(READ_LIMIT)).unwrap();
    match r {
        Ok(m) => Some(m),
        Err(ReadError::Closed | ReadError::Idle(_)) => None,
        Err(e) => panic!("a broken control frame: {e}"),
    }
}

/// Every control message that arrives within `window`.
pub fn drain_msgs(s: &mut TcpStream, window: Duration) -> Vec<Message> {
    let end = Instant::now() + window;
    let mut out = Vec::new();
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match recv_msg_within(s, left.max(Duration::from_millis(1))) {
            Some(m) => out.push(m),
            None => break,
        }
    }
    out
}

/// The control frames in `bytes`, which must all be whole.
pub fn frames(bytes: &[u8]) -> Vec<Message> {
    let mut r = bytes;
    let mut out = Vec::new();
    while !r.is_empty() {
        let h = proto::read_frame_header(&mut r, &Limits::default()).unwrap();
        out.push(proto::read_control(&mut r, &h, &Limits::default()).unwrap());
    }
    out
}

/// Reads until the engine closes the connection (EOF or a reset); returns what it sent.
/// Fails the test if the connection is still open after 15 s.
pub fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                panic!("the engine kept the connection open")
            }
            Err(_) => return got,
        }
    }
}

pub fn hello(role: Role, conn: ConnKind, engine_id: u64, conn_index: u16) -> Message {
    Message::Hello {
        proto_version: PROTO_VERSION,
        role,
        engine_id,
        conn,
        conn_index,
    }
}

/// The AuthHello of an engine with `auth=off`.
pub fn auth_off_hello() -> Message {
    Message::AuthHello {
        auth: AuthMode::Off,
        key_id: [0; AUTH_KEY_ID_LEN],
        nonce: [0; AUTH_NONCE_LEN],
    }
}

/// A fake decode engine's authentication step with `auth=off`, right after its Hello:
/// an AuthHello of zeros out, the prefill's AuthChallenge of zeros back.
pub fn auth_off_as_decode(s: &mut TcpStream) {
    send_msg(s, &auth_off_hello());
    match recv_msg(s) {
        Message::AuthChallenge {
            auth: AuthMode::Off,
            ..
        } => {}
        other => panic!("expected AuthChallenge(off), got {other:?}"),
    }
}

/// A fake prefill engine's authentication step with `auth=off`, right after it read the
/// decode engine's Hello: its AuthHello of zeros in, an AuthChallenge of zeros out.
pub fn auth_off_as_prefill(s: &mut TcpStream) {
    assert_eq!(recv_msg(s), auth_off_hello());
    send_msg(
        s,
        &Message::AuthChallenge {
            auth: AuthMode::Off,
            engine_id: 0,
            nonce: [0; AUTH_NONCE_LEN],
        },
    );
}

/// A registration of `bufs` KV buffers of `pages` pages of `item` bytes, no aux.
pub fn registration(bufs: usize, pages: usize, item: usize) -> Registration {
    let buf = BufferInfo {
        len: (pages * item) as u64,
        item_len: item as u64,
        layer_id: BufferInfo::NO_LAYER,
        addr: 0,
        rkey: 0,
    };
    Registration {
        kv: vec![buf; bufs],
        aux: vec![],
        layout: None,
        integrity: super::engine::test_integrity() == "verify",
    }
}

pub const TCP_TRANSPORT: Message = Message::Transport {
    transport: WireTransport::Tcp,
    qps: Vec::new(),
};

/// What a fake prefill engine was told of a decode room.
pub struct Destination {
    pub room: u64,
    pub generation: u64,
    pub pages: Vec<u32>,
}

/// A fake prefill engine: a listening socket a decode engine's rooms name as their
/// prefill, and the connections the decode engine opens to it.
pub struct FakePrefill {
    listener: TcpListener,
    /// The address decode rooms name.
    pub addr: String,
    pub ctrl: Option<TcpStream>,
    pub data: Vec<TcpStream>,
    /// The kv layout its registration carries (none unless a test sets one).
    pub layout: Option<kvxfer::KvLayout>,
}

impl FakePrefill {
    pub fn listen() -> FakePrefill {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        FakePrefill {
            listener,
            addr,
            ctrl: None,
            data: Vec::new(),
            layout: None,
        }
    }

    /// A fake prefill engine serving decode room `room` of `d`: the room is created
    /// naming it, the handshake done (as in [`FakePrefill::handshake`]), and the
    /// destination `dst` then set on `d` has reached it.
    pub fn serving(
        d: &Engine,
        room: u64,
        dst: &[u32],
        bufs: usize,
        pages: usize,
        item: usize,
        conns: usize,
    ) -> (FakePrefill, Destination) {
        let mut fp = FakePrefill::listen();
        d.room_create(room, RoomPeers::Prefills(vec![fp.addr.clone()]))
            .unwrap();
        fp.handshake(bufs, pages, item, conns);
        d.room_set_destination(room, dst, None).unwrap();
        let dest = fp.destination();
        assert_eq!(dest.room, room);
        (fp, dest)
    }

    /// Accepts the decode engine's control connection and answers its handshake
    /// (Hello, a registration of `bufs` x `pages` x `item`, TCP), then accepts `conns`
    /// data connections.
    pub fn handshake(&mut self, bufs: usize, pages: usize, item: usize, conns: usize) {
        assert!(self.handshake_paced(bufs, pages, item, conns, &|| true));
    }

    /// The next connection to the fake engine, within `READ_LIMIT`.
    fn accept(&self) -> TcpStream {
        self.listener.set_nonblocking(true).unwrap();
        let end = Instant::now() + READ_LIMIT;
        loop {
            match self.listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false).unwrap();
                    return s;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    assert!(Instant::now() < end, "no connection came");
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// As [`FakePrefill::handshake`], calling `pause` before each answer; stops (and
    /// returns false) as soon as `pause` returns false.
    pub fn handshake_paced(
        &mut self,
        bufs: usize,
        pages: usize,
        item: usize,
        conns: usize,
        pause: &dyn Fn() -> bool,
    ) -> bool {
        let mut ctrl = self.accept();
        ctrl.set_read_timeout(Some(READ_LIMIT)).unwrap();
        assert!(matches!(
            recv_msg(&mut ctrl),
            Message::Hello {
                role: Role::Decode,
                conn: ConnKind::Control,
                ..
            }
        ));
        auth_off_as_prefill(&mut ctrl);
        if !pause() {
            return false;
        }
        send_msg(
            &mut ctrl,
            &hello(Role::Prefill, ConnKind::Control, 0xFEED, 0),
        );
        assert!(matches!(recv_msg(&mut ctrl), Message::Registration(_)));
        if !pause() {
            return false;
        }
        send_msg(
            &mut ctrl,
            &Message::Registration(Registration {
                layout: self.layout,
                ..registration(bufs, pages, item)
            }),
        );
        assert!(matches!(
            recv_msg(&mut ctrl),
            Message::Transport {
                transport: WireTransport::Tcp,
                ..
            }
        ));
        if !pause() {
            return false;
        }
        send_msg(&mut ctrl, &TCP_TRANSPORT);
        for i in 0..conns {
            let mut data = self.accept();
            data.set_read_timeout(Some(READ_LIMIT)).unwrap();
            assert!(matches!(
                recv_msg(&mut data),
                Message::Hello {
                    role: Role::Decode,
                    conn: ConnKind::Data,
                    ..
                }
            ));
            auth_off_as_prefill(&mut data);
            if !pause() {
                return false;
            }
            send_msg(
                &mut data,
                &hello(Role::Prefill, ConnKind::Data, 0xFEED, i as u16),
            );
            self.data.push(data);
        }
        self.ctrl = Some(ctrl);
        true
    }

    pub fn ctrl(&mut self) -> &mut TcpStream {
        self.ctrl.as_mut().expect("handshake first")
    }

    /// The next Destination on the control connection; heartbeats are passed over, any
    /// other message fails the test.
    pub fn destination(&mut self) -> Destination {
        match recv_past_heartbeats(self.ctrl()) {
            Message::Destination {
                room,
                generation,
                pages,
                ..
            } => Destination {
                room,
                generation,
                pages,
            },
            m => panic!("unexpected {m:?}"),
        }
    }

    /// Sends Done for `room` of `generation` on the first data connection, claiming
    /// `pages_sent` pages.
    pub fn done(&mut self, room: u64, generation: u64, pages_sent: u32) {
        send_msg(
            &mut self.data[0],
            &Message::Done {
                room,
                generation,
                pages_sent,
                aux_sent: false,
            },
        );
    }
}

/// Two fake prefill engines serving decode engine `d`, each for a room of its own:
/// `ours` (destination page 1) pulls from A only, and its destination reached A;
/// `other` pulls from B only and is waiting for input. Returns A, B and the
/// generation of `ours`, for tests of what B may not do to it.
pub fn two_prefills(
    d: &Engine,
    ours: u64,
    other: u64,
    (bufs, pages, item): (usize, usize, usize),
) -> (FakePrefill, FakePrefill, u64) {
    let (mut a, mut b) = (FakePrefill::listen(), FakePrefill::listen());
    d.room_create(ours, RoomPeers::Prefills(vec![a.addr.clone()]))
        .unwrap();
    d.room_set_destination(ours, &[1], None).unwrap();
    a.handshake(bufs, pages, item, 1);
    let generation = a.destination().generation;
    d.room_create(other, RoomPeers::Prefills(vec![b.addr.clone()]))
        .unwrap();
    b.handshake(bufs, pages, item, 1);
    super::wait::wait_state(d, other, kvxfer::State::WaitingForInput);
    (a, b, generation)
}

/// A fake decode engine's control connection to prefill engine `addr`, handshake
/// done, registering `bufs` x `pages` x `item`.
pub fn decode_ctrl(addr: &str, id: u64, bufs: usize, pages: usize, item: usize) -> TcpStream {
    let mut ctrl = TcpStream::connect(addr).unwrap();
    ctrl.set_read_timeout(Some(READ_LIMIT)).unwrap();
    send_msg(&mut ctrl, &hello(Role::Decode, ConnKind::Control, id, 0));
    auth_off_as_decode(&mut ctrl);
    assert!(matches!(
        recv_msg(&mut ctrl),
        Message::Hello {
            role: Role::Prefill,
            ..
        }
    ));
    assert!(matches!(recv_msg(&mut ctrl), Message::Registration(_)));
    send_msg(
        &mut ctrl,
        &Message::Registration(registration(bufs, pages, item)),
    );
    send_msg(&mut ctrl, &TCP_TRANSPORT);
    assert!(matches!(
        recv_msg(&mut ctrl),
        Message::Transport {
            transport: WireTransport::Tcp,
            ..
        }
    ));
    ctrl
}

/// The fake decode engine's data connection `index` to prefill engine `addr`.
pub fn decode_data(addr: &str, id: u64, index: u16) -> TcpStream {
    let mut data = TcpStream::connect(addr).unwrap();
    data.set_read_timeout(Some(READ_LIMIT)).unwrap();
    send_msg(&mut data, &hello(Role::Decode, ConnKind::Data, id, index));
    auth_off_as_decode(&mut data);
    assert!(matches!(recv_msg(&mut data), Message::Hello { .. }));
    data
}

/// A fake decode engine connected to prefill engine `addr`: its control connection
/// ([`decode_ctrl`]) and its data connection 0 ([`decode_data`]).
pub fn decode(
    addr: &str,
    id: u64,
    bufs: usize,
    pages: usize,
    item: usize,
) -> (TcpStream, TcpStream) {
    let ctrl = decode_ctrl(addr, id, bufs, pages, item);
    (ctrl, decode_data(addr, id, 0))
}

/// A decode engine's destination `pages` for `room` of `generation`, no aux slot.
pub fn destination(room: u64, generation: u64, pages: Vec<u32>) -> Message {
    Message::Destination {
        room,
        generation,
        pages,
        aux_slot: None,
    }
}

/// The header of a data frame of `n` pages of `item` bytes into KV buffer `buffer`,
/// from page `first_page`.
pub fn kv_header(
    room: u64,
    generation: u64,
    buffer: u32,
    first_page: u32,
    n: u32,
    item: usize,
) -> DataHeader {
    DataHeader {
        room,
        generation,
        target: Target::Kv,
        buffer,
        first_page,
        n_pages: n,
        byte_len: n * item as u32,
        page_off: 0,
        digest: 0,
    }
}

/// The prefix of the data frame of `h`: its frame and data headers.
pub fn frame_prefix(h: &DataHeader) -> Vec<u8> {
    let mut prefix = [0u8; proto::DATA_FRAME_PREFIX_LEN];
    h.encode_frame(&mut prefix).unwrap();
    prefix.to_vec()
}

/// `h` with the digest of a payload of `byte` repeated, as an engine with
/// `integrity=verify` sends it (the fake engines register with `integrity` on).
pub fn digested(h: &DataHeader, byte: u8) -> DataHeader {
    let payload = vec![byte; h.byte_len as usize];
    DataHeader {
        digest: kvxfer::integrity::digest(h, &payload),
        ..*h
    }
}

/// The whole data frame of `h`, its payload `byte` repeated, with its digest.
pub fn data_frame(h: &DataHeader, byte: u8) -> Vec<u8> {
    let mut f = frame_prefix(&digested(h, byte));
    f.extend(std::iter::repeat_n(byte, h.byte_len as usize));
    f
}

/// A whole `DataRuns` frame of `runs`, each run's payload its `byte` repeated, each with
/// its digest.
pub fn runs_frame(runs: &[(DataHeader, u8)]) -> Vec<u8> {
    let hdrs: Vec<DataHeader> = runs.iter().map(|(h, b)| digested(h, *b)).collect();
    let mut f = Vec::new();
    proto::encode_runs_prefix(&hdrs, &mut f).unwrap();
    for (h, byte) in runs {
        f.extend(std::iter::repeat_n(*byte, h.byte_len as usize));
    }
    f
}

/// Heartbeats on a fake engine's control connection every 20 ms until dropped, so that
/// a test's short heartbeat deadline loses the fake engine only when the test wants
/// (however loaded the host). Other messages go through [`KeepAlive::send`], so that
/// frames never interleave.
pub struct KeepAlive {
    stream: Arc<Mutex<TcpStream>>,
    stop: Arc<AtomicBool>,
    beats: Option<std::thread::JoinHandle<()>>,
}

impl KeepAlive {
    pub fn on(ctrl: &TcpStream) -> KeepAlive {
        let stream = Arc::new(Mutex::new(ctrl.try_clone().unwrap()));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, flag) = (stream.clone(), stop.clone());
        let beats = std::thread::spawn(move || {
            let mut seq = 0;
            while !flag.load(Ordering::Relaxed) {
                if s.lock()
                    .unwrap()
                    .write_all(&encode(&Message::Heartbeat { seq }))
                    .is_err()
                {
                    return;
                }
                seq += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        KeepAlive {
            stream,
            stop,
            beats: Some(beats),
        }
    }

    /// Sends `m` on the control connection, between two heartbeats.
    pub fn send(&self, m: &Message) {
        send_msg(&mut self.stream.lock().unwrap(), m);
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(b) = self.beats.take() {
            let _ = b.join();
        }
    }
}
