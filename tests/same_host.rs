//! The same-host path (DESIGN inv. 11): engines on one host move KV by a direct copy
//! between their processes, report the path they took, fall back to TCP only with a
//! warning and a count, and with `same_host=require` fail their rooms with the reason
//! instead. Between two processes (the test binary runs itself as the other engine) and
//! in one process (a process may read its own memory the same way).
//!
//! The byte-exact suites (transfer, hetero, layerwise, layers, two_process) run over
//! this path too in `make test`, with KVXFER_TEST_SAME_HOST=require.

mod common;

use std::io::{BufRead, Write};
use std::process::Command;
use std::sync::mpsc;
use std::time::Duration;

use common::{
    engine, first_unlike_source, plan, poisoned, source, terminal_within, wait_state,
    wait_terminal, wait_until, ChildPrefill, Log, Pair, BUFS, ITEM, PAGES,
};
use kvxfer::log::Level;
use kvxfer::{Cause, DataPath, Engine, RoomPeers, State};

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

/// The decode process of the tests that stop it, if KVXFER_CHILD_DECODE is set: prints
/// `ADDR`, then reads `big R ADDR` (room R pulling every page from the prefill at ADDR)
/// and `quit` from stdin.
#[test]
fn child_decode() {
    if std::env::var_os("KVXFER_CHILD_DECODE").is_none() {
        return;
    }
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine(
        "decode",
        &mem,
        &[("same_host", "require"), ("heartbeat_interval_ms", "100")],
    );
    println!("ADDR {}", d.address());
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        let line = line.unwrap();
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["big", r, addr] => {
                let r: u64 = r.parse().unwrap();
                d.room_create(r, RoomPeers::Prefills(vec![addr.to_string()]))
                    .unwrap();
                let all: Vec<u32> = (0..PAGES as u32).collect();
                d.room_set_destination(r, &all, None).unwrap();
            }
            ["quit"] => return,
            _ => panic!("bad command {line}"),
        }
    }
}

const REQUIRE: (&str, &str) = ("same_host", "require");
const AUTO: (&str, &str) = ("same_host", "auto");
const OFF: (&str, &str) = ("same_host", "off");
const NO_INTEGRITY: (&str, &str) = ("integrity", "off");

/// Moves `src` into `dst` as room `room` of `t`; both sides' outcome.
fn transfer(t: &Pair, room: u64, src: &[u32], dst: &[u32]) -> (State, State) {
    t.open(room, dst);
    t.send(room, src, 3);
    (wait_terminal(&t.p, room), wait_terminal(&t.d, room))
}

#[test]
fn engines_in_one_process_copy_directly_and_report_the_same_host_path() {
    let t = Pair::builder().config(&[REQUIRE]).build();
    let (src, dst) = ([3, 4, 5, 9, 200], [10, 11, 12, 100, 7]);
    t.open(1, &dst);
    t.p.enqueue_chunk(1, &src[..2], false, None).unwrap();
    t.p.enqueue_chunk(1, &src[2..], true, None).unwrap();
    assert_eq!(wait_terminal(&t.d, 1), State::Success);
    assert_eq!(wait_terminal(&t.p, 1), State::Success);
    t.assert_pages(&src, &dst);
    for e in [&t.p, &t.d] {
        assert_eq!(e.room_path(1).unwrap(), DataPath::SameHost);
        let m = e.metrics();
        assert_eq!((m.pairings_same_host, m.pairings_tcp), (1, 0));
        assert_eq!(m.same_host_fallbacks, 0);
    }
    assert!(t.d.room_drained(1).unwrap() && t.p.room_drained(1).unwrap());
}

#[test]
fn rooms_move_between_two_processes_byte_for_byte_over_the_same_host_path() {
    let mut child = ChildPrefill::start_in(&[], None, &[("KVXFER_TEST_SAME_HOST", "require")]);
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine("decode", &mem, &[REQUIRE]);
    for r in 1..=12u64 {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        let (src, _) = plan(r);
        let dst: Vec<u32> = (0..src.len())
            .map(|i| ((r as usize * 40 + i * 2) % PAGES) as u32)
            .collect();
        d.room_set_destination(r, &dst, None).unwrap();
        child.send(&format!("room {r}"));
        let s = wait_terminal(&d, r);
        assert_eq!(s, State::Success, "room {r}: {:?}", d.room_failure(r).ok());
        assert_eq!(d.room_path(r).unwrap(), DataPath::SameHost);
        if let Some((b, s, t)) = first_unlike_source(&mem, &src, &dst) {
            panic!("room {r}: page {t} of buffer {b} differs from source page {s}");
        }
        d.room_clear(r).unwrap();
    }
    assert_eq!(d.metrics().pairings_same_host, 1);
    child.send("quit");
}

#[test]
fn a_prefill_with_same_host_off_is_paired_over_tcp_with_a_warning_and_a_count() {
    let t = Pair::builder()
        .decode(&[AUTO])
        .prefill(&[OFF])
        .log(Level::Warn)
        .build();
    let (p, d) = transfer(&t, 1, &[1, 2, 3], &[4, 5, 6]);
    assert_eq!((p, d), (State::Success, State::Success));
    t.assert_pages(&[1, 2, 3], &[4, 5, 6]);
    assert_eq!(t.d.room_path(1).unwrap(), DataPath::Tcp);
    assert_eq!(t.p.room_path(1).unwrap(), DataPath::Tcp);
    let m = t.d.metrics();
    assert_eq!((m.pairings_tcp, m.same_host_fallbacks), (1, 1));
    let line = t.dlog.wait_for(&["pairing with", "tcp", "same_host=off"]);
    assert!(line.contains("not the same-host path"), "{line}");
}

#[test]
fn same_host_off_here_takes_tcp_without_a_warning() {
    let t = Pair::builder().decode(&[OFF]).log(Level::Warn).build();
    let (p, d) = transfer(&t, 1, &[1, 2], &[3, 4]);
    assert_eq!((p, d), (State::Success, State::Success));
    assert_eq!(t.d.room_path(1).unwrap(), DataPath::Tcp);
    assert_eq!(t.d.metrics().same_host_fallbacks, 0);
    assert!(t.dlog.lines(Level::Warn, "pairing").is_empty());
}

#[test]
fn a_decode_engine_that_requires_the_path_fails_its_rooms_naming_why() {
    let t = Pair::builder().decode(&[REQUIRE]).prefill(&[OFF]).build();
    t.open(1, &[1]);
    assert_eq!(wait_terminal(&t.d, 1), State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(
        why.message.contains("same_host=require") && why.message.contains("same_host=off"),
        "{why}"
    );
    assert_eq!(t.d.metrics().pairings_same_host, 0);
}

#[test]
fn a_prefill_engine_that_requires_the_path_refuses_a_decode_that_does_not_offer_it() {
    let t = Pair::builder().decode(&[OFF]).prefill(&[REQUIRE]).build();
    t.open(1, &[1]);
    assert_eq!(wait_terminal(&t.d, 1), State::Failed);
    let why = t.d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(
        why.message.contains("same_host=require on the prefill"),
        "{why}"
    );
}

/// Clears CAP_SYS_PTRACE from the calling thread's effective capabilities (threads it
/// starts inherit that); the process keeps it in its permitted set.
fn drop_ptrace_capability() {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Default, Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    const CAP_SYS_PTRACE: u32 = 19;
    let mut h = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut d = [Data::default(); 2];
    // SAFETY: capget/capset read and write the two structs given, sized as version 3
    // asks (two data entries).
    unsafe {
        assert_eq!(
            libc::syscall(libc::SYS_capget, &mut h as *mut Header, d.as_mut_ptr()),
            0
        );
        d[0].effective &= !(1 << CAP_SYS_PTRACE);
        assert_eq!(
            libc::syscall(libc::SYS_capset, &mut h as *mut Header, d.as_ptr()),
            0
        );
    }
}

/// A prefill process that made itself not dumpable, and a decode engine whose threads
/// lack CAP_SYS_PTRACE (started from a thread that dropped it): the probe is refused.
/// Returned in the order they must be dropped last to first: the memory outlives the
/// engine that writes into it.
fn undumpable_prefill_and_decode(
    same_host: &'static str,
) -> (Vec<common::Region>, Log, Engine, ChildPrefill) {
    let child = ChildPrefill::start_in(
        &[],
        None,
        &[
            ("KVXFER_TEST_SAME_HOST", "auto"),
            ("KVXFER_TEST_UNDUMPABLE", "1"),
        ],
    );
    let mem = poisoned(BUFS, PAGES, ITEM);
    let log = Log::default();
    let (tx, rx) = mpsc::channel();
    let descs = common::descs(&mem);
    let logger = log.logger(Level::Warn);
    std::thread::spawn(move || {
        drop_ptrace_capability();
        let d = Engine::new(
            common::config("decode", &[("same_host", same_host)]),
            logger,
        )
        .unwrap();
        d.register_kv(descs).unwrap();
        tx.send(d).unwrap();
    })
    .join()
    .unwrap();
    (mem, log, rx.recv().unwrap(), child)
}

#[test]
fn a_prefill_process_that_cannot_be_read_falls_back_to_tcp_with_the_reason() {
    let (mem, log, d, mut child) = undumpable_prefill_and_decode("auto");
    // The room is created on a thread without CAP_SYS_PTRACE: its connector inherits
    // that.
    std::thread::scope(|s| {
        s.spawn(|| {
            drop_ptrace_capability();
            d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
                .unwrap();
        });
    });
    let (src, _) = plan(1);
    let dst: Vec<u32> = (0..src.len() as u32).collect();
    d.room_set_destination(1, &dst, None).unwrap();
    child.send("room 1");
    assert_eq!(wait_terminal(&d, 1), State::Success);
    assert!(first_unlike_source(&mem, &src, &dst).is_none());
    assert_eq!(d.room_path(1).unwrap(), DataPath::Tcp);
    assert_eq!(d.metrics().same_host_fallbacks, 1);
    let line = log.wait_for(&["pairing with", "ptrace denied"]);
    assert!(line.contains("not the same-host path"), "{line}");
    child.send("quit");
}

#[test]
fn a_prefill_process_that_cannot_be_read_fails_required_rooms_with_the_reason() {
    let (_mem, _log, d, child) = undumpable_prefill_and_decode("require");
    std::thread::scope(|s| {
        s.spawn(|| {
            drop_ptrace_capability();
            d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
                .unwrap();
        });
    });
    d.room_set_destination(1, &[1], None).unwrap();
    assert_eq!(wait_terminal(&d, 1), State::Failed);
    let why = d.room_failure(1).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    assert!(why.message.contains("ptrace denied"), "{why}");
}

/// Signals `sig` (`-STOP`, `-KILL`, `-CONT`) to process `pid`.
fn signal(sig: &str, pid: u32) {
    assert!(Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap()
        .success());
}

const ROOMS: u64 = 16;

#[test]
fn a_prefill_process_stopped_or_killed_mid_copy_fails_the_decode_rooms_in_bounded_time() {
    for sig in ["-STOP", "-KILL"] {
        // Every room takes every page (integrity off: live rooms share the pages).
        let mut child = ChildPrefill::start_in(
            &[],
            None,
            &[
                ("KVXFER_TEST_SAME_HOST", "require"),
                ("KVXFER_TEST_INTEGRITY", "off"),
            ],
        );
        let mem = poisoned(BUFS, PAGES, ITEM);
        let d = engine(
            "decode",
            &mem,
            &[
                REQUIRE,
                NO_INTEGRITY,
                ("heartbeat_interval_ms", "100"),
                ("heartbeat_misses", "5"),
            ],
        );
        let all: Vec<u32> = (0..PAGES as u32).collect();
        for r in 1..=ROOMS {
            d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
                .unwrap();
            d.room_set_destination(r, &all, None).unwrap();
        }
        wait_state(&d, 1, State::WaitingForInput);
        for r in 1..=ROOMS {
            child.send(&format!("big {r}"));
        }
        wait_until("the first room to move", || {
            d.room_poll(1).unwrap() != State::WaitingForInput
        });
        let pid = child.child.id();
        signal(sig, pid);
        let states: Vec<State> = (1..=ROOMS)
            .map(|r| terminal_within(&d, r, Duration::from_secs(10)))
            .collect();
        assert!(states.iter().all(|s| s.is_terminal()), "{sig}: {states:?}");
        assert!(
            states.contains(&State::Failed),
            "{sig}: every room finished before the signal; the test moved too little"
        );
        for r in 1..=ROOMS {
            if states[r as usize - 1] == State::Failed {
                let why = d.room_failure(r).unwrap();
                assert!(
                    matches!(why.cause, Cause::PeerLost | Cause::TransferTimeout),
                    "{sig}: {why}"
                );
            }
            wait_until("the room to drain", || d.room_drained(r).unwrap());
        }
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            drop(d);
            tx.send(()).unwrap();
        });
        assert!(
            rx.recv_timeout(Duration::from_secs(10)).is_ok(),
            "{sig}: freeing the decode engine hung"
        );
        if sig == "-STOP" {
            signal("-CONT", pid);
        }
    }
}

/// This process's prefill engine and a decode engine in a child process that is then
/// stopped while it copies: the prefill's rooms fail within the stall, drain (no copy
/// of theirs is answered any more), and the engine frees.
#[test]
fn a_decode_process_stopped_mid_copy_fails_the_prefill_rooms_in_bounded_time() {
    let mem = source(BUFS, PAGES, ITEM);
    // Every room takes every page (integrity off: live rooms share the pages).
    let p = engine(
        "prefill",
        &mem,
        &[
            REQUIRE,
            NO_INTEGRITY,
            ("heartbeat_interval_ms", "100"),
            ("heartbeat_misses", "5"),
        ],
    );
    let mut child = ChildPrefill::spawn(
        "child_decode",
        &[],
        &[
            ("KVXFER_CHILD_DECODE", "1"),
            ("KVXFER_TEST_SAME_HOST", "require"),
            ("KVXFER_TEST_INTEGRITY", "off"),
        ],
    );
    for r in 1..=ROOMS {
        p.room_create(r, RoomPeers::Decoders(1)).unwrap();
        child.send(&format!("big {r} {}", p.address()));
    }
    for r in 1..=ROOMS {
        wait_state(&p, r, State::WaitingForInput);
        assert_eq!(p.room_path(r).unwrap(), DataPath::SameHost);
    }
    for r in 1..=ROOMS {
        for page in 0..PAGES as u32 {
            p.enqueue_chunk(r, &[page], page + 1 == PAGES as u32, None)
                .unwrap();
        }
    }
    wait_until("the first room to move", || {
        p.room_poll(1).unwrap() != State::WaitingForInput
    });
    let pid = child.child.id();
    signal("-STOP", pid);
    let states: Vec<State> = (1..=ROOMS)
        .map(|r| terminal_within(&p, r, Duration::from_secs(10)))
        .collect();
    assert!(states.iter().all(|s| s.is_terminal()), "{states:?}");
    assert!(
        states.contains(&State::Failed),
        "every room finished before the stop; the test moved too little"
    );
    for r in 1..=ROOMS {
        wait_until("the prefill room to drain", || p.room_drained(r).unwrap());
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        drop(p);
        tx.send(()).unwrap();
    });
    let freed = rx.recv_timeout(Duration::from_secs(10)).is_ok();
    signal("-CONT", pid);
    if !freed {
        std::mem::forget(mem);
        panic!("freeing the prefill engine hung");
    }
}
