//! Engines that find each other through etcd (issue 39), against a real etcd (Debian's
//! `etcd-server`) that each test starts on free loopback ports with a data directory of
//! its own, and stops. Without the etcd binaries the tests say so and pass as skipped
//! (`make deps` installs them, so CI has them).
//!
//! Prefill engines that must die as a process (SIGKILL) or hang (SIGSTOP) run in a child
//! process: this test binary again, with its `discovery_child` test as main.

mod common;

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use common::etcd::{available, Etcd};
use common::*;
use kvxfer::{Cause, Engine, ErrorKind, KvKind, KvLayout, PageOrder, RoomPeers, State};

/// The cluster key of the tests' engines, in hex.
const KEY: &str = "6b7678666572206469736f766572792074657374206b65792033322062797465";
/// Another key: an engine of another cluster.
const OTHER_KEY: &str = "07e4000000000000000000000000000000000000000000000000000000000001";
const PREFIX: &str = "/kvxfer/";

#[test]
fn discovery_child() {
    common::etcd::discovery_child_main();
}

/// The discovery keys of rank `rank` of `ranks` of `instance`, with the test key.
fn keys(etcd: &Etcd, instance: &str, rank: u32, ranks: u32, ttl_ms: u64) -> Vec<(String, String)> {
    [
        ("discovery", etcd.url()),
        ("instance", instance.to_string()),
        ("rank", rank.to_string()),
        ("instance_ranks", ranks.to_string()),
        ("discovery_ttl_ms", ttl_ms.to_string()),
        ("auth_key", KEY.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

fn borrow(keys: &[(String, String)]) -> Vec<(&str, &str)> {
    keys.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// `keys` as the child's KVXFER_DISCOVERY_CHILD.
fn child_keys(keys: &[(String, String)]) -> String {
    keys.iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(";")
}

/// A prefill child process registered as `instance` rank 0 of 1.
fn child(etcd: &Etcd, instance: &str, ttl_ms: u64) -> ChildPrefill {
    spawn_child(&keys(etcd, instance, 0, 1, ttl_ms))
}

/// A child process with the discovery keys `keys`, once it says it has registered.
fn spawn_child(keys: &[(String, String)]) -> ChildPrefill {
    let k = child_keys(keys);
    let mut c = ChildPrefill::spawn("discovery_child", &[], &[("KVXFER_DISCOVERY_CHILD", &k)]);
    c.line_after("REGISTERED");
    c
}

/// A decode engine registered as `instance` rank 0 of 1 (TTL 2 s), with heartbeats
/// every `heartbeat.0` ms and `heartbeat.1` misses before a peer is lost, and its
/// (poisoned) memory; returned once it sees instance `prefill`.
fn decode_seeing(
    etcd: &Etcd,
    instance: &str,
    heartbeat: (&str, &str),
    prefill: &str,
) -> (Vec<Region>, Engine) {
    let k = keys(etcd, instance, 0, 1, 2000);
    let mut extra = borrow(&k);
    extra.extend([
        ("heartbeat_interval_ms", heartbeat.0),
        ("heartbeat_misses", heartbeat.1),
    ]);
    let mem = poisoned(BUFS, PAGES, ITEM);
    let d = engine("decode", &mem, &extra);
    wait_for_instance(&d, prefill);
    (mem, d)
}

/// A prefill engine registered as `prefill` and a decode engine registered as
/// `decode`, both rank 0 of 1 with a TTL of `ttl_ms`, each with its memory (the
/// prefill's the source pattern, the decode's poisoned); returned once the decode
/// engine sees the prefill.
fn pair_seeing(
    etcd: &Etcd,
    prefill: &str,
    decode: &str,
    ttl_ms: u64,
) -> (Vec<Region>, Engine, Vec<Region>, Engine) {
    let src_mem = source(BUFS, PAGES, ITEM);
    let kp = keys(etcd, prefill, 0, 1, ttl_ms);
    let p = engine("prefill", &src_mem, &borrow(&kp));
    let mem = poisoned(BUFS, PAGES, ITEM);
    let kd = keys(etcd, decode, 0, 1, ttl_ms);
    let d = engine("decode", &mem, &borrow(&kd));
    wait_for_instance(&d, prefill);
    (src_mem, p, mem, d)
}

fn wait_for_instance(d: &Engine, instance: &str) {
    wait_until_within(
        &format!("instance {instance} in the decode engine's registry"),
        Duration::from_secs(15),
        || d.lookup(instance).is_ok(),
    );
}

fn signal(c: &ChildPrefill, sig: &str) {
    let pid = c.child.id().to_string();
    assert!(Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// Head-sliced layouts: 2 KV heads of dim 4 in 2-byte elements over `tp` ranks, 4-token
/// pages (one head per rank: 32-byte pages).
fn layout(tp_rank: u32, tp_size: u32, head_dim: u32) -> KvLayout {
    KvLayout {
        kv_heads: 2,
        head_dim,
        dtype_bytes: 2,
        tp_rank,
        tp_size,
        page_tokens: 4,
        order: PageOrder::Hnd,
        kind: KvKind::Heads,
    }
}

const LBUFS: usize = 4;
const LPAGES: usize = 64;

#[test]
fn two_prefill_and_two_decode_ranks_register_and_rooms_by_instance_land_byte_exact() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    let mut prefills = Vec::new();
    let mut sources = Vec::new();
    for r in 0..2u32 {
        let mem: Vec<Region> = (0..LBUFS)
            .map(|b| {
                Region::new(LPAGES, 32, |i| {
                    ((i * 7 + r as usize * 101 + b * 13) % 251 + 1) as u8
                })
            })
            .collect();
        let k = keys(&etcd, "prefill-a", r, 2, 3000);
        let e = start("prefill", &borrow(&k), quiet());
        e.register_kv_layout(descs(&mem), None, layout(r, 2, 4))
            .unwrap();
        prefills.push(e);
        sources.push(mem);
    }
    let mut decodes = Vec::new();
    let mut dests = Vec::new();
    for r in 0..2u32 {
        let mem = poisoned(LBUFS, LPAGES, 32);
        let k = keys(&etcd, "decode-b", r, 2, 3000);
        let e = start("decode", &borrow(&k), quiet());
        e.register_kv_layout(descs(&mem), None, layout(r, 2, 4))
            .unwrap();
        decodes.push(e);
        dests.push(mem);
    }
    // Every engine's entry is in etcd, with its layout.
    for (instance, r) in [
        ("prefill-a", 0),
        ("prefill-a", 1),
        ("decode-b", 0),
        ("decode-b", 1),
    ] {
        let key = format!("{PREFIX}{instance}/{r}");
        wait_until_within(&key, Duration::from_secs(15), || etcd.get(&key).is_some());
        let v = etcd.get(&key).unwrap();
        for want in [
            format!("\"tp_rank\":{r}"),
            "\"tp_size\":2".into(),
            "hmac-sha256:".into(),
        ] {
            assert!(v.contains(&want), "{key} lacks {want}: {v}");
        }
    }
    for d in &decodes {
        wait_for_instance(d, "prefill-a");
        let addrs = d.lookup("prefill-a").unwrap();
        let want: Vec<String> = prefills.iter().map(|p| p.address().to_string()).collect();
        assert_eq!(addrs, want, "every rank, in rank order");
    }
    for room in 1..=6u64 {
        let n = 2 + room as usize;
        let src: Vec<u32> = (0..n as u32).map(|i| room as u32 * 3 + i).collect();
        let dst: Vec<u32> = (0..n as u32).map(|i| 63 - room as u32 * 5 - i).collect();
        for d in &decodes {
            d.room_create_from(room, "prefill-a").unwrap();
            d.room_set_destination(room, &dst, None).unwrap();
        }
        for p in &prefills {
            p.room_create(room, RoomPeers::Decoders(2)).unwrap();
            p.enqueue_chunk(room, &src, true, None).unwrap();
        }
        for (r, d) in decodes.iter().enumerate() {
            assert_eq!(
                wait_terminal(d, room),
                State::Success,
                "room {room} rank {r}: {:?}",
                d.room_failure(room).ok()
            );
            // Equal layouts rank by rank: decode rank r holds prefill rank r's pages.
            for b in 0..LBUFS {
                for (s, t) in src.iter().zip(&dst) {
                    assert_eq!(
                        dests[r][b].page(*t),
                        sources[r][b].page(*s),
                        "room {room} rank {r} buffer {b} page {t}"
                    );
                }
            }
        }
    }
    // A decode engine whose layout cannot meet the instance's is refused at creation,
    // naming the rank and the field.
    let k = keys(&etcd, "decode-c", 0, 1, 3000);
    let bad = start("decode", &borrow(&k), quiet());
    let mem = poisoned(LBUFS, LPAGES, 128);
    bad.register_kv_layout(descs(&mem), None, layout(0, 1, 8))
        .unwrap();
    wait_for_instance_or_refusal(&bad, "prefill-a");
    let e = bad.room_create_from(1, "prefill-a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert!(
        e.message().contains("head_dim") && e.message().contains("rank 0"),
        "{e}"
    );
    assert_eq!(bad.room_count(), 0);
    // An instance nobody registered is a clear error naming those known.
    let e = decodes[0].room_create_from(9, "prefill-zz").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    assert!(
        e.message().contains("prefill-zz") && e.message().contains("prefill-a"),
        "{e}"
    );
}

/// Waits until `d`'s cache holds `instance`: its lookup no longer says NotFound.
fn wait_for_instance_or_refusal(d: &Engine, instance: &str) {
    wait_until_within(instance, Duration::from_secs(15), || {
        d.lookup(instance)
            .map_or_else(|e| e.kind() != ErrorKind::NotFound, |_| true)
    });
}

#[test]
fn a_killed_prefill_leaves_the_registry_within_its_ttl_and_its_rooms_fail_before_heartbeats() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    let c = child(&etcd, "prefill-k", 2000);
    // Heartbeats would take 10 s.
    let (_mem, d) = decode_seeing(&etcd, "decode-k", ("2000", "5"), "prefill-k");
    assert_eq!(d.lookup("prefill-k").unwrap(), vec![c.addr.clone()]);
    rooms_waiting(&d, "prefill-k", 1..=4);
    let killed = Instant::now();
    drop(c); // SIGKILL
    for r in 1..=4u64 {
        assert_eq!(
            terminal_within(&d, r, Duration::from_secs(9)),
            State::Failed
        );
        assert_eq!(d.room_failure(r).unwrap().cause, Cause::PeerLost);
    }
    assert_within(killed, Duration::from_secs(10));
    // The entry goes with the lease: within the TTL (2 s), and etcd's lease checks.
    wait_until_within("the entry to expire", Duration::from_millis(4000), || {
        etcd.get(&format!("{PREFIX}prefill-k/0")).is_none()
    });
    wait_until_within("the cache to drop it", Duration::from_secs(2), || {
        d.lookup("prefill-k")
            .is_err_and(|e| e.kind() == ErrorKind::NotFound)
    });
    assert_eq!(
        d.room_create_from(9, "prefill-k").unwrap_err().kind(),
        ErrorKind::NotFound
    );
}

#[test]
fn a_hung_prefill_whose_lease_expires_fails_its_rooms_naming_the_registry_long_before_heartbeats() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    let c = child(&etcd, "prefill-h", 2000);
    let (_mem, d) = decode_seeing(&etcd, "decode-h", ("2000", "10"), "prefill-h");
    rooms_waiting(&d, "prefill-h", 1..=3);
    // SIGSTOP: its sockets stay open and say nothing; only its lease stops.
    signal(&c, "-STOP");
    let stopped = Instant::now();
    fail_peer_lost_naming(
        &d,
        1..=3,
        Duration::from_secs(8),
        &[
            "registry:",
            "prefill-h rank 0",
            "left the registry",
            "lease",
            &c.addr,
        ],
    );
    // The heartbeat deadline is 20 s away.
    assert_within(stopped, Duration::from_secs(8));
    assert_eq!(d.metrics().registry_departures, 1);
    signal(&c, "-CONT");
}

#[test]
fn with_etcd_stopped_rooms_with_known_peers_go_on_and_its_return_registers_everyone_again() {
    if !available() {
        return;
    }
    let mut etcd = Etcd::start();
    let (_src_mem, p, mem, d) = pair_seeing(&etcd, "prefill-o", "decode-o", 2000);
    let transfer = |r: u64, midway: &mut dyn FnMut()| {
        let (src, _) = plan(r);
        let dst: Vec<u32> = (0..src.len() as u32)
            .map(|i| (r as u32 * 20 + i) % PAGES as u32)
            .collect();
        d.room_create_from(r, "prefill-o").unwrap();
        d.room_set_destination(r, &dst, None).unwrap();
        p.room_create(r, RoomPeers::Decoders(1)).unwrap();
        let half = src.len() / 2;
        p.enqueue_chunk(r, &src[..half], false, None).unwrap();
        midway();
        p.enqueue_chunk(r, &src[half..], true, None).unwrap();
        assert_eq!(
            wait_terminal(&d, r),
            State::Success,
            "room {r}: {:?}",
            d.room_failure(r).ok()
        );
        assert_eq!(first_unlike_source(&mem, &src, &dst), None, "room {r}");
    };
    transfer(1, &mut || {});
    // A room under way when etcd goes, and rooms begun while it is away for longer than
    // every lease's TTL: the cache and the connections carry them.
    transfer(2, &mut || etcd.stop());
    std::thread::sleep(Duration::from_millis(3000));
    for r in 3..=5 {
        transfer(r, &mut || {});
    }
    for (name, e) in [("prefill", &p), ("decode", &d)] {
        let m = e.metrics();
        assert!(
            m.registry_outages >= 1,
            "{name}: outages {}",
            m.registry_outages
        );
        assert!(
            m.registry_errors >= 1,
            "{name}: errors {}",
            m.registry_errors
        );
    }
    // etcd back without its data (every lease lost): both engines register again.
    let before = p.metrics().registry_registrations;
    etcd.restart(true);
    for key in ["prefill-o/0", "decode-o/0"] {
        let key = format!("{PREFIX}{key}");
        wait_until_within(&key, Duration::from_secs(15), || etcd.get(&key).is_some());
    }
    assert!(p.metrics().registry_registrations > before);
    for r in 6..=7 {
        transfer(r, &mut || {});
    }
    // Nothing left the registry for good, so nobody was lost through it.
    std::thread::sleep(Duration::from_millis(2500));
    transfer(8, &mut || {});
    assert_eq!(d.metrics().registry_departures, 0);
    assert_eq!(d.metrics().peers_lost, 0);
}

#[test]
fn forged_entries_are_ignored_counted_and_never_connected_to() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    let (_src_mem, p, mem, d) = pair_seeing(&etcd, "prefill-a", "decode-a", 3000);
    // Where a forger would send the KV: a socket nobody may connect to.
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let trap_addr = trap.local_addr().unwrap().to_string();
    let real = etcd.get(&format!("{PREFIX}prefill-a/0")).unwrap();
    let (body, tag) = real.rsplit_once('\n').unwrap();
    let redirected = body.replace(p.address(), &trap_addr);
    // With etcd's own client: no signature; a signature that no longer fits; the same
    // over the real entry's name.
    etcd.put(
        &format!("{PREFIX}prefill-f/0"),
        &redirected.replace("prefill-a", "prefill-f"),
    );
    etcd.put(
        &format!("{PREFIX}prefill-g/0"),
        &format!("{}\n{tag}", redirected.replace("prefill-a", "prefill-g")),
    );
    etcd.put(
        &format!("{PREFIX}prefill-a/0"),
        &format!("{redirected}\n{tag}"),
    );
    // An engine of another cluster (another key) registering in the same prefix.
    let mut kw = keys(&etcd, "prefill-w", 0, 1, 3000);
    kw.retain(|(k, _)| k != "auth_key");
    kw.push(("auth_key".into(), OTHER_KEY.into()));
    let w = engine("prefill", &source(BUFS, PAGES, ITEM), &borrow(&kw));
    wait_until_within("four refusals", Duration::from_secs(15), || {
        d.metrics().registry_rejected >= 4
    });
    for name in ["prefill-f", "prefill-g", "prefill-w"] {
        let e = d.room_create_from(100, name).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NotFound, "{name}: {e}");
    }
    // The real instance is still where it was: a room by its name moves its bytes.
    assert_eq!(
        d.lookup("prefill-a").unwrap(),
        vec![p.address().to_string()]
    );
    let (src, _) = plan(3);
    let dst: Vec<u32> = (0..src.len() as u32).collect();
    d.room_create_from(3, "prefill-a").unwrap();
    d.room_set_destination(3, &dst, None).unwrap();
    p.room_create(3, RoomPeers::Decoders(1)).unwrap();
    p.enqueue_chunk(3, &src, true, None).unwrap();
    assert_eq!(wait_terminal(&d, 3), State::Success);
    assert_eq!(first_unlike_source(&mem, &src, &dst), None);
    // Nobody connected to the forged address.
    assert!(
        matches!(trap.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "a connection reached the forged address"
    );
    assert_eq!(d.metrics().registry_departures, 0);
    // The real engine puts its entry back over the forgery: an engine that reads the
    // registry only now finds it where it is.
    let real_key = format!("{PREFIX}prefill-a/0");
    let restored = |etcd: &Etcd| {
        etcd.get(&real_key)
            .is_some_and(|v| v.contains(p.address()) && !v.contains(&trap_addr))
    };
    wait_until_within("the real entry back", Duration::from_secs(10), || {
        restored(&etcd)
    });
    let kl = keys(&etcd, "decode-late", 0, 1, 3000);
    let late = engine("decode", &poisoned(BUFS, PAGES, ITEM), &borrow(&kl));
    wait_for_instance(&late, "prefill-a");
    assert_eq!(
        late.lookup("prefill-a").unwrap(),
        vec![p.address().to_string()]
    );
    // Deleted by hand, it is put back too; readers took the deletion for the engine
    // leaving (what a registry writer can do: see docs/SECURITY.md).
    etcd.ctl(&["del", &real_key]).unwrap();
    wait_until_within("a departure", Duration::from_secs(5), || {
        d.metrics().registry_departures == 1
    });
    wait_until_within("the real entry back", Duration::from_secs(10), || {
        restored(&etcd)
    });
    wait_for_instance(&d, "prefill-a");
    drop(w);
}

#[test]
fn a_new_incarnation_replaces_the_entry_and_the_rooms_of_the_old_one_fail_naming_it() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    // The old engine's lease would outlive the test: only the replacement can end it.
    let old = child(&etcd, "prefill-r", 30_000);
    let (mem, d) = decode_seeing(&etcd, "decode-r", ("5000", "6"), "prefill-r");
    rooms_waiting(&d, "prefill-r", 1..=3);
    // The old engine hangs (its connections stay open); a new one takes its place.
    signal(&old, "-STOP");
    let replaced = Instant::now();
    let mut new = child(&etcd, "prefill-r", 2000);
    fail_peer_lost_naming(
        &d,
        1..=3,
        Duration::from_secs(8),
        &[
            "registry:",
            "replaced by a new incarnation",
            &old.addr,
            &new.addr,
        ],
    );
    assert_within(replaced, Duration::from_secs(10));
    // Rooms by the instance's name now go to the new engine.
    wait_until_within("the new address", Duration::from_secs(5), || {
        d.lookup("prefill-r")
            .is_ok_and(|a| a == vec![new.addr.clone()])
    });
    let (src, _) = plan(4);
    let dst: Vec<u32> = (0..src.len() as u32).map(|i| 60 + i).collect();
    d.room_create_from(4, "prefill-r").unwrap();
    d.room_set_destination(4, &dst, None).unwrap();
    new.send("room 4");
    assert_eq!(wait_terminal(&d, 4), State::Success);
    assert_eq!(first_unlike_source(&mem, &src, &dst), None);
    drop(old);
}

#[test]
fn discovery_checks_its_keys_and_never_waits_for_an_unreachable_etcd() {
    let nowhere = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("etcd://{}", nowhere.local_addr().unwrap());
    drop(nowhere);
    let c = |extra: &[(&str, &str)]| {
        let mut c = config("decode", &[("discovery", &url)]);
        for (k, v) in extra {
            c.set(k, v).unwrap();
        }
        Engine::new(c, quiet())
    };
    let e = c(&[("instance", "x")]).err().unwrap();
    assert_eq!(e.kind(), ErrorKind::BadValue);
    assert!(e.message().contains("cluster key"), "{e}");
    let e = c(&[("auth_key", KEY)]).err().unwrap();
    assert!(e.message().contains("'instance'"), "{e}");
    let e = c(&[
        ("auth_key", KEY),
        ("instance", "x"),
        ("rank", "2"),
        ("instance_ranks", "2"),
    ])
    .err()
    .unwrap();
    assert!(e.message().contains("'rank'"), "{e}");
    // Nothing answers there: the engine starts at once all the same, and its scheduler
    // calls answer from the (empty) cache.
    let t = Instant::now();
    let d = c(&[("auth_key", KEY), ("instance", "x")]).unwrap();
    let mem = poisoned(2, 8, 64);
    d.register_kv(descs(&mem)).unwrap();
    let e = d.room_create_from(1, "prefill-a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.message().contains("not been read yet"), "{e}");
    assert_within(t, Duration::from_millis(500));
    wait_until_within("an outage to be counted", Duration::from_secs(5), || {
        d.metrics().registry_errors > 0
    });
    // Without discovery, or on a prefill engine, rooms by instance are refused.
    let plain = engine("decode", &mem, &[]);
    let e = plain.room_create_from(1, "prefill-a").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongState);
    assert!(e.message().contains("'discovery'"), "{e}");
    let p = engine("prefill", &source(2, 8, 64), &[]);
    assert_eq!(
        p.room_create_from(1, "prefill-a").unwrap_err().kind(),
        ErrorKind::WrongRole
    );
}

#[test]
fn a_hung_decode_engine_whose_lease_expires_fails_the_prefill_rooms_waiting_for_it() {
    if !available() {
        return;
    }
    let etcd = Etcd::start();
    let src_mem = source(BUFS, PAGES, ITEM);
    let kp = keys(&etcd, "prefill-d", 0, 1, 2000);
    let mut extra = borrow(&kp);
    extra.extend([
        ("heartbeat_interval_ms", "2000"),
        ("heartbeat_misses", "10"),
    ]);
    let p = engine("prefill", &src_mem, &extra);
    // The decode engine in a process of its own, registered as decode-d.
    let mut kd = keys(&etcd, "decode-d", 0, 1, 2000);
    kd.push(("role".into(), "decode".into()));
    let mut d = spawn_child(&kd);
    // The prefill engine knows the decode engine's entry before the decode side pulls.
    wait_until_within("the decode entry", Duration::from_secs(15), || {
        etcd.get(&format!("{PREFIX}decode-d/0")).is_some()
    });
    for r in 1..=2u64 {
        p.room_create(r, RoomPeers::Decoders(1)).unwrap();
    }
    d.send("from 1 prefill-d");
    d.send("from 2 prefill-d");
    wait_state(&p, 1, State::WaitingForInput);
    wait_state(&p, 2, State::WaitingForInput);
    // The decode engine hangs: its connections stay open, its lease runs out.
    signal(&d, "-STOP");
    let stopped = Instant::now();
    fail_peer_lost_naming(
        &p,
        1..=2,
        Duration::from_secs(8),
        &["registry:", "decode decode-d rank 0", "left the registry"],
    );
    assert_within(stopped, Duration::from_secs(8));
    assert_eq!(p.metrics().registry_departures, 1);
    signal(&d, "-CONT");
}
