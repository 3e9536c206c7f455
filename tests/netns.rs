//! Prefill and decode as two hosts: the prefill process runs in a network namespace of
//! its own, joined to this one by a veth pair with private test addresses, so the link
//! between them can be cut and healed. Needs root and iproute2, so the tests are
//! `#[ignore]`d in a plain `cargo test`; `make test` runs them with `--ignored`.
//!
//! The namespace and the veth pair are created by the test and deleted when it ends,
//! also when it fails. Both engines authenticate with one cluster key (a key file),
//! as a deployment across hosts would.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kvxfer::{Cause, RoomPeers, State};

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace with one end of a veth pair (`10.99.N.1`), the other end here
/// (`10.99.N.2`).
struct Host {
    ns: String,
    here: String,
    inside: String,
    addr: String,
}

impl Host {
    fn new(tag: &str) -> Host {
        let n = (std::process::id() % 200) as u8 + 20;
        let ns = format!("kvx-{tag}-{}", std::process::id());
        let here = format!("kvx{tag}h{n}");
        let inside = format!("kvx{tag}i{n}");
        let _ = Command::new("ip").args(["netns", "del", &ns]).status();
        let _ = Command::new("ip").args(["link", "del", &here]).status();
        ip(&["netns", "add", &ns]);
        let h = Host {
            ns,
            here,
            inside,
            addr: format!("10.99.{n}.1"),
        };
        ip(&[
            "link", "add", &h.here, "type", "veth", "peer", "name", &h.inside,
        ]);
        ip(&["link", "set", &h.inside, "netns", &h.ns]);
        ip(&["addr", "add", &format!("10.99.{n}.2/24"), "dev", &h.here]);
        ip(&["link", "set", &h.here, "up"]);
        ip(&[
            "-n",
            &h.ns,
            "addr",
            "add",
            &format!("{}/24", h.addr),
            "dev",
            &h.inside,
        ]);
        ip(&["-n", &h.ns, "link", "set", &h.inside, "up"]);
        ip(&["-n", &h.ns, "link", "set", "lo", "up"]);
        h
    }

    fn link(&self, up: bool) {
        ip(&[
            "-n",
            &self.ns,
            "link",
            "set",
            &self.inside,
            if up { "up" } else { "down" },
        ]);
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.here])
            .status();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).status();
    }
}

#[test]
#[ignore = "needs root and iproute2: run by make test (cargo test --test netns -- --ignored)"]
fn a_transfer_crosses_hosts_and_a_cut_link_fails_rooms_then_heals() {
    let host = Host::new("p");
    let listen = format!("{}:0", host.addr);
    // A cluster key of 32 bytes.
    let seed = std::process::id() as u64 ^ 0x9E37_79B9_7F4A_7C15;
    let key: Vec<u8> = (0..32u64)
        .map(|i| (seed.wrapping_mul(i + 1) >> 17) as u8)
        .collect();
    let key = KeyFile::new("netns", &key);
    let mut child = ChildPrefill::start_in(
        &["ip", "netns", "exec", &host.ns],
        Some(&listen),
        &[
            ("KVXFER_TEST_AUTH_KEY_FILE", &key.path),
            ("KVXFER_TEST_SAME_HOST", "auto"),
        ],
    );
    assert!(child.addr.starts_with(&host.addr), "{}", child.addr);
    // A fresh veth pair takes a moment to carry traffic: wait until a plain TCP connect
    // to the prefill's address goes through.
    let sock: std::net::SocketAddr = child.addr.parse().unwrap();
    wait_until_within("the veth link to come up", Duration::from_secs(10), || {
        std::net::TcpStream::connect_timeout(&sock, Duration::from_millis(200)).is_ok()
    });
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine(
        "decode",
        &mem,
        &[
            ("heartbeat_interval_ms", "100"),
            ("heartbeat_misses", "5"),
            ("auth_key_file", &key.path),
            // Both engines would take the same-host path if they could: another host
            // (network namespace) must never pick it.
            ("same_host", "auto"),
        ],
    );

    // 1. A transfer between the hosts, verified byte for byte.
    let (src, _) = plan(1);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 100 + i).collect();
    d.room_create(1, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(1, &dst, None).unwrap();
    child.send("room 1");
    assert_eq!(wait_terminal(&d, 1), State::Success);
    assert_eq!(first_unlike_source(&mem, &src, &dst), None);
    assert_eq!(d.room_path(1).unwrap(), kvxfer::DataPath::Tcp);
    assert_eq!(
        (
            d.metrics().pairings_same_host,
            d.metrics().same_host_fallbacks
        ),
        (0, 0)
    );

    // 2. Cut the link while rooms wait: no RST, no FIN; the heartbeat deadline fails them.
    for r in 2..=4u64 {
        d.room_create(r, RoomPeers::Prefills(vec![child.addr.clone()]))
            .unwrap();
        d.room_set_destination(r, &[r as u32], None).unwrap();
    }
    wait_state(&d, 4, State::WaitingForInput);
    host.link(false);
    let cut = Instant::now();
    for r in 2..=4u64 {
        assert_eq!(wait_terminal(&d, r), State::Failed);
        let why = d.room_failure(r).unwrap();
        assert_eq!(why.cause, Cause::PeerLost, "{why}");
        assert!(why.message.contains(&child.addr), "{why}");
    }
    assert!(
        cut.elapsed() < Duration::from_secs(5),
        "took {:?}",
        cut.elapsed()
    );

    // 3. Heal: the next room to that address reconnects and completes.
    host.link(true);
    let (src, _) = plan(5);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 150 + i).collect();
    d.room_create(5, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    d.room_set_destination(5, &dst, None).unwrap();
    child.send("room 5");
    assert_eq!(wait_terminal(&d, 5), State::Success);
    // Every connection, the reconnection after the heal included, authenticated.
    assert_eq!(d.metrics().auth_failures, 0);
    child.send("quit");
}
