//! Prefill and decode as two hosts: the prefill process runs in a network namespace of
//! its own, joined to this one by a veth pair with private test addresses, so the link
//! between them can be cut and healed. Needs root and iproute2, so the tests are
//! `#[ignore]`d in a plain `cargo test`; `make test` runs them with `--ignored`.
//!
//! The namespace and the veth pair are created by the test and deleted when it ends,
//! also when it fails. Both engines authenticate with one cluster key (a key file),
//! as a deployment across hosts would; without one, an engine serves only its own host
//! unless `auth=off` says otherwise, which the last test checks from both sides.

mod common;

use std::io::Read;
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use kvxfer::log::Level;
use kvxfer::proto::{AuthMode, AuthRefusal, Message};
use kvxfer::{Cause, RoomPeers, State};

#[test]
fn child_prefill() {
    common::child_prefill_main();
}

#[test]
fn discovery_child() {
    common::etcd::discovery_child_main();
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
    /// The namespace's address.
    addr: String,
    /// This side's address (not loopback, on this host).
    near: String,
}

impl Host {
    /// Host `slot` (0, 1 or 2) of this process: each test of the file has its own
    /// subnet, since they run at once.
    fn new(tag: &str, slot: u8) -> Host {
        let n = (std::process::id() % 110) as u8 * 2 + 20 + slot;
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
            near: format!("10.99.{n}.2"),
        };
        ip(&[
            "link", "add", &h.here, "type", "veth", "peer", "name", &h.inside,
        ]);
        ip(&["link", "set", &h.inside, "netns", &h.ns]);
        ip(&["addr", "add", &format!("{}/24", h.near), "dev", &h.here]);
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
    let host = Host::new("p", 0);
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

/// A TCP connection to `to` from `from`, an address of this host (any port).
fn connect_from(from: Ipv4Addr, to: SocketAddrV4) -> TcpStream {
    use std::os::fd::FromRawFd;
    let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a new socket, owned by the TcpStream from here on.
    let s = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        TcpStream::from_raw_fd(fd)
    };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&s);
    let (a, b) = (sin(from, 0), sin(*to.ip(), to.port()));
    // SAFETY: `fd` is open; each address is a local sockaddr_in of `len` bytes.
    unsafe {
        let bound = libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len);
        assert_eq!(bound, 0, "bind {from}: {}", std::io::Error::last_os_error());
        let connected = libc::connect(fd, (&b as *const libc::sockaddr_in).cast(), len);
        assert_eq!(
            connected,
            0,
            "connect {to}: {}",
            std::io::Error::last_os_error()
        );
    }
    s
}

#[test]
#[ignore = "needs root and iproute2: run by make test (cargo test --test netns -- --ignored)"]
fn without_a_key_engines_serve_only_their_own_host_unless_auth_is_off() {
    let host = Host::new("l", 1);
    // 1. A keyless prefill engine here, on loopback: a connection to it from this host's
    //    non-loopback address (as another host's would look) is told why and closed,
    //    before anything of it is read, and counted; one from loopback is served.
    let log = Log::default();
    let pmem = source(BUFS, PAGES, ITEM);
    let p = start("prefill", &[], log.logger(Level::Info));
    p.register_kv(descs(&pmem)).unwrap();
    let to: SocketAddrV4 = p.address().parse().unwrap();
    let mut s = connect_from(host.near.parse().unwrap(), to);
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert_eq!(
        fake::frames(&got),
        vec![Message::AuthRefused {
            reason: AuthRefusal::NotLocal,
            auth: AuthMode::Off
        }]
    );
    wait_until("the refusal to be counted", || {
        p.metrics().auth_failures == 1
    });
    let line = log.wait_for(&["refused connection from", "not on this host"]);
    assert!(
        line.contains(&host.near) && line.contains("'auth'"),
        "{line}"
    );
    let dmem = poisoned(BUFS, PAGES, ITEM);
    let d = engine("decode", &dmem, &[]);
    p.room_create(1, RoomPeers::Decoders(1)).unwrap();
    d.room_create(1, RoomPeers::Prefills(vec![p.address().to_string()]))
        .unwrap();
    d.room_set_destination(1, &[7], None).unwrap();
    p.enqueue_chunk(1, &[3], true, None).unwrap();
    assert_eq!(wait_terminal(&d, 1), State::Success);
    assert_eq!(first_unlike_source(&dmem, &[3], &[7]), None);
    assert_eq!(p.metrics().auth_failures, 1);

    // 2. A prefill engine on the other host that turned authentication off explicitly:
    //    the keyless decode engine here does not connect to it (another host), its room
    //    fails at once naming the setting; with auth=off on the decode side too, the
    //    pages cross.
    let mut child = ChildPrefill::start_in(
        &["ip", "netns", "exec", &host.ns],
        Some(&format!("{}:0", host.addr)),
        &[("KVXFER_TEST_AUTH", "off")],
    );
    let sock: std::net::SocketAddr = child.addr.parse().unwrap();
    wait_until_within("the veth link to come up", Duration::from_secs(10), || {
        TcpStream::connect_timeout(&sock, Duration::from_millis(200)).is_ok()
    });
    d.room_create(2, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    assert_eq!(wait_terminal(&d, 2), State::Failed);
    let why = d.room_failure(2).unwrap();
    assert_eq!(why.cause, Cause::Mismatch, "{why}");
    for part in ["not on this host", child.addr.as_str(), "'auth'", "'off'"] {
        assert!(why.message.contains(part), "{part}: {why}");
    }
    assert_eq!(d.metrics().auth_failures, 1);
    let omem = poisoned(BUFS, PAGES, ITEM);
    let open = engine(
        "decode",
        &omem,
        &[("auth", "off"), ("heartbeat_interval_ms", "100")],
    );
    let (src, _) = plan(3);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 100 + i).collect();
    open.room_create(3, RoomPeers::Prefills(vec![child.addr.clone()]))
        .unwrap();
    open.room_set_destination(3, &dst, None).unwrap();
    child.send("room 3");
    assert_eq!(wait_terminal(&open, 3), State::Success);
    assert_eq!(first_unlike_source(&omem, &src, &dst), None);
    assert_eq!(open.metrics().auth_failures, 0);
    child.send("quit");
}

/// Discovery across hosts (issue 39): etcd runs on this host, the prefill engine on the
/// other, and the decode engine here finds it by its instance name. Then the other host
/// goes away while rooms wait on it (its namespace is deleted: no FIN or RST ever reaches
/// this side, and heartbeats are far apart) and comes back with the same address, where
/// a new engine starts: the new incarnation's entry replaces the old one, and the rooms
/// of the old engine fail at once, naming the registry.
#[test]
#[ignore = "needs root and iproute2: run by make test (cargo test --test netns -- --ignored)"]
fn rooms_by_instance_cross_hosts_and_a_restart_at_the_same_address_fails_the_old_rooms() {
    if !common::etcd::available() {
        return;
    }
    let host = Host::new("e", 2);
    // On this host's end of the veth pair for the prefill, and on loopback for the
    // decode engine, whose connections must not depend on that pair.
    let etcd = common::etcd::Etcd::start_on(&host.near);
    let key = "6e65746e7320646973636f76657279206b657920666f722074657374696e6721";
    let listen = format!("{}:7411", host.addr);
    let spawn = |host: &Host, ttl_ms: u64| {
        let k = [
            ("discovery", etcd.url()),
            ("instance", "prefill-n".to_string()),
            ("discovery_ttl_ms", ttl_ms.to_string()),
            ("auth_key", key.to_string()),
            ("listen", listen.clone()),
        ]
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";");
        let in_ns = ["ip", "netns", "exec", host.ns.as_str()];
        let mut c =
            ChildPrefill::spawn("discovery_child", &in_ns, &[("KVXFER_DISCOVERY_CHILD", &k)]);
        c.line_after("REGISTERED");
        assert_eq!(c.addr, listen);
        c
    };
    // The old engine's lease would outlast the test: only its replacement ends it.
    let mut old = spawn(&host, 30_000);
    let mem = poisoned(BUFS, PAGES, ITEM);
    let url = etcd.local_url();
    let d = engine(
        "decode",
        &mem,
        &[
            ("discovery", &url),
            ("instance", "decode-n"),
            ("auth_key", key),
            ("discovery_ttl_ms", "2000"),
            // Heartbeats far apart: the registry, not a heartbeat, must tell.
            ("heartbeat_interval_ms", "30000"),
            ("heartbeat_misses", "2"),
        ],
    );
    wait_until_within(
        "the instance in the registry",
        Duration::from_secs(15),
        || d.lookup("prefill-n").is_ok(),
    );
    assert_eq!(d.lookup("prefill-n").unwrap(), vec![listen.clone()]);

    // 1. A room by instance name crosses the hosts, byte for byte.
    let (src, _) = plan(1);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 100 + i).collect();
    d.room_create_from(1, "prefill-n").unwrap();
    d.room_set_destination(1, &dst, None).unwrap();
    old.send("room 1");
    assert_eq!(wait_terminal(&d, 1), State::Success);
    assert_eq!(first_unlike_source(&mem, &src, &dst), None);

    // 2. Rooms wait on the old engine; its host goes, unheard (link down, process
    //    killed, namespace deleted with every socket in it), and comes back with the
    //    same address and a new engine.
    rooms_waiting(&d, "prefill-n", 2..=3);
    // What is in flight between the hosts lands first (the destinations, their
    // acknowledgements, the heartbeats), so that nothing of the old host is left to say.
    std::thread::sleep(Duration::from_millis(1000));
    host.link(false);
    drop(old); // SIGKILL
    drop(host);
    let host = Host::new("e", 2);
    let back = Instant::now();
    let mut new = spawn(&host, 2000);
    fail_peer_lost_naming(
        &d,
        2..=3,
        Duration::from_secs(10),
        &["registry:", "replaced by a new incarnation", &listen],
    );
    assert_within(back, Duration::from_secs(20));
    assert_eq!(d.metrics().registry_departures, 1);

    // 3. Rooms by the instance's name now reach the new engine at the same address.
    let (src, _) = plan(4);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 150 + i).collect();
    d.room_create_from(4, "prefill-n").unwrap();
    d.room_set_destination(4, &dst, None).unwrap();
    new.send("room 4");
    assert_eq!(wait_terminal(&d, 4), State::Success);
    assert_eq!(first_unlike_source(&mem, &src, &dst), None);
    new.send("quit");
}
