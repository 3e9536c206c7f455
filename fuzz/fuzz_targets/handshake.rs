//! Fuzzes the authentication handshake (`kvxfer::auth`) over a real loopback socket:
//! the input is everything the other side sends, on either side of the exchange
//! (accepting: what follows the initiator's Hello; connecting: what the responder
//! answers), on a control connection or a data connection of an authenticated session.
//!
//! Never a panic, never a hang past the deadline, and never a success with
//! `auth=required`: without the key no input can authenticate. With `auth=off` on
//! both sides the only accepted inputs are the exact zero-filled AuthHello /
//! AuthChallenge. The first input byte picks the side, the connection kind and the
//! setting.

#![no_main]

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvxfer::auth::{self, Key, Local, NonceCache, PeerHello, SessionSecret};
use kvxfer::proto::{AuthMode, ConnKind, Message, Role, AUTH_KEY_ID_LEN, AUTH_NONCE_LEN};
use libfuzzer_sys::fuzz_target;

struct Fixture {
    listener: TcpListener,
    key: Key,
    /// The secret of a real control session between the two fixture engines.
    session: SessionSecret,
    seen: NonceCache,
}

const DECODE_ID: u64 = 0xD;
const PREFILL_ID: u64 = 0xF;

fn local(key: &Key, role: Role, mode: AuthMode) -> Local<'_> {
    Local {
        mode,
        key: (mode == AuthMode::Required).then_some(key),
        role,
        engine_id: if role == Role::Decode { DECODE_ID } else { PREFILL_ID },
    }
}

fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(2)
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let key = Key::new(vec![0x5a; 32]).unwrap();
        let seen = NonceCache::new(1024);
        let (mut c, mut s) = pair(&listener);
        let hello = PeerHello {
            role: Role::Decode,
            engine_id: DECODE_ID,
            conn: ConnKind::Control,
            conn_index: 0,
        };
        let d = local(&key, Role::Decode, AuthMode::Required);
        let p = local(&key, Role::Prefill, AuthMode::Required);
        let session = std::thread::scope(|sc| {
            let r = sc.spawn(|| auth::respond(&mut s, &p, &hello, |_| None, &seen, soon()));
            let i = auth::initiate(&mut c, &d, ConnKind::Control, 0, None, soon());
            let _ = r.join().unwrap().unwrap();
            i.unwrap().unwrap()
        });
        Fixture {
            listener,
            key,
            session,
            seen,
        }
    })
}

fn encoded(m: &Message) -> Vec<u8> {
    let mut out = Vec::new();
    m.encode(&mut out).unwrap();
    out
}

fuzz_target!(|input: &[u8]| {
    let Some((&pick, data)) = input.split_first() else {
        return;
    };
    let f = fixture();
    let accepting = pick & 1 == 0;
    let conn = if pick & 2 == 0 {
        ConnKind::Control
    } else {
        ConnKind::Data
    };
    let mode = if pick & 4 == 0 {
        AuthMode::Required
    } else {
        AuthMode::Off
    };
    let (mut ours, mut theirs) = pair(&f.listener);
    // Everything the other side says, then the end of its stream.
    theirs.write_all(data).unwrap();
    theirs.shutdown(Shutdown::Write).unwrap();
    let result = if accepting {
        let me = local(&f.key, Role::Prefill, mode);
        let hello = PeerHello {
            role: Role::Decode,
            engine_id: DECODE_ID,
            conn,
            conn_index: 1,
        };
        auth::respond(
            &mut ours,
            &me,
            &hello,
            |_| Some(f.session.clone()),
            &f.seen,
            soon(),
        )
    } else {
        let me = local(&f.key, Role::Decode, mode);
        auth::initiate(&mut ours, &me, conn, 1, Some(&f.session), soon())
    };
    match (mode, result) {
        (AuthMode::Required, Ok(_)) => panic!("authenticated without the key"),
        (AuthMode::Off, Ok(secret)) => {
            assert!(secret.is_none());
            let want = if accepting {
                Message::AuthHello {
                    auth: AuthMode::Off,
                    key_id: [0; AUTH_KEY_ID_LEN],
                    nonce: [0; AUTH_NONCE_LEN],
                }
            } else {
                Message::AuthChallenge {
                    auth: AuthMode::Off,
                    engine_id: 0,
                    nonce: [0; AUTH_NONCE_LEN],
                }
            };
            let want = encoded(&want);
            assert!(data.starts_with(&want), "accepted {data:?}");
        }
        (_, Err(e)) => assert!(!e.to_string().is_empty()),
    }
});
