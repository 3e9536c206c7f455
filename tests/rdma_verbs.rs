//! The RDMA verbs layer (src/transport/rdma/verbs.rs) on a real device.
//!
//! With `KVXFER_RDMA_DEV` or `RXE_DEV` naming a device (scripts/rdma-vm.sh boots a guest
//! with soft-RoCE `rxe0` and sets `RXE_DEV`), the tests connect two RC endpoints in this
//! process and move bytes between registered buffers. Without one they do not pretend:
//! each checks instead that this host has no usable device (`Device::open` gives
//! `Ok(None)`), which is what `transport=auto` relies on to fall back to TCP.
//!
//! Run in the guest:
//! `cargo test --no-run --test rdma_verbs` then
//! `scripts/rdma-vm.sh -t 300 . -- target/debug/deps/rdma_verbs-HASH --test-threads=1`.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Rng;
use kvxfer::transport::rdma::verbs::{
    Access, Device, Domain, Endpoint, EndpointInfo, Region, WriteOp,
};

/// The device the environment names, if any.
fn dev_name() -> Option<String> {
    ["KVXFER_RDMA_DEV", "RXE_DEV"]
        .iter()
        .find_map(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
}

/// The named device, opened; or None after checking that the host has no device at all.
fn device(test: &str) -> Option<Arc<Device>> {
    match dev_name() {
        Some(name) => {
            let dev = Device::open(std::slice::from_ref(&name))
                .unwrap_or_else(|e| panic!("opening {name}: {e}"))
                .unwrap_or_else(|| panic!("{name} is named but not usable"));
            Some(dev)
        }
        None => {
            let found = Device::open(&[]).expect("no RDMA on this host: open is not an error");
            assert!(
                found.is_none(),
                "no device was named, yet one is usable: {found:?}"
            );
            eprintln!("{test}: no RXE_DEV/KVXFER_RDMA_DEV; checked that the host has no device");
            None
        }
    }
}

/// Heap bytes handed to the device: only ever read through raw pointers, so the test
/// never holds a reference the NIC's writes could invalidate.
struct Buf {
    ptr: *mut u8,
    len: usize,
}

impl Buf {
    fn new(len: usize, fill: impl Fn(usize) -> u8) -> Buf {
        let b: Box<[u8]> = (0..len).map(fill).collect();
        Buf {
            ptr: Box::into_raw(b).cast(),
            len,
        }
    }

    fn addr(&self) -> usize {
        self.ptr as usize
    }

    fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        // SAFETY: `ptr..ptr+len` is our live allocation; called only when no write is
        // outstanding (after `write` returned).
        unsafe { std::ptr::copy_nonoverlapping(self.ptr, out.as_mut_ptr(), self.len) };
        out
    }

    /// Registered for remote writes in the device's own protection domain.
    fn register(&self, dev: &Device) -> Region {
        self.register_as(dev, Access::RemoteWrite)
    }

    fn register_as(&self, dev: &Device, access: Access) -> Region {
        // SAFETY: every test drops its regions before the buffers (declared after them).
        unsafe { dev.register(self.addr(), self.len, access) }.expect("ibv_reg_mr")
    }

    fn register_in(&self, domain: &Domain) -> Region {
        // SAFETY: as register_as.
        unsafe { domain.register(self.addr(), self.len, Access::RemoteWrite) }.expect("ibv_reg_mr")
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: built from a Box<[u8]> of exactly `len` bytes in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// Two endpoints on `dev`, connected to each other.
fn pair(dev: &Arc<Device>, depth: u32) -> (Endpoint, Endpoint) {
    let mut a = dev
        .endpoint(depth, Access::RemoteWrite)
        .expect("endpoint a");
    let mut b = dev
        .endpoint(depth, Access::RemoteWrite)
        .expect("endpoint b");
    let (ia, ib) = (a.info(), b.info());
    a.connect(&ib).expect("connect a to b");
    b.connect(&ia).expect("connect b to a");
    (a, b)
}

const STALL: Duration = Duration::from_secs(20);

#[test]
fn verbs_types_can_cross_threads() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<Device>();
    sync::<Device>();
    send::<Region>();
    sync::<Region>();
    send::<Endpoint>();
}

#[test]
fn unknown_device_names_find_nothing() {
    assert!(matches!(Device::open(&["nosuch".to_string()]), Ok(None)));
    assert!(matches!(
        Device::open(&["nosuch".to_string(), "nosuch2".to_string()]),
        Ok(None)
    ));
}

#[test]
fn device_opens_by_name_and_by_default_with_a_routable_gid() {
    let Some(dev) = device("device_opens_by_name_and_by_default_with_a_routable_gid") else {
        return;
    };
    let name = dev_name().unwrap();
    assert_eq!(dev.name(), name);
    let d = dev.describe();
    eprintln!("device: {d}");
    assert!(d.starts_with(&format!("{name} port ")), "{d}");
    if name.starts_with("rxe") {
        // soft-RoCE on an IPv4 netdev: the IPv4-mapped RoCE v2 GID.
        assert!(d.contains(" ::ffff:") && d.contains("RoCEv2"), "{d}");
    }
    let any = Device::open(&[]).unwrap().expect("some device is usable");
    assert!(!any.name().is_empty());
    // Unknown names before a real one are skipped.
    let named = Device::open(&["nosuch".into(), name.clone()])
        .unwrap()
        .unwrap();
    assert_eq!(named.name(), name);

    let ep = dev.endpoint(8, Access::Local).unwrap();
    let info: EndpointInfo = ep.info();
    assert!(info.psn <= 0x00ff_ffff);
    assert!((1..=5).contains(&info.mtu));
    assert_ne!(info.gid, [0; 16]);
    assert!(!ep.is_broken());
}

#[test]
fn scattered_runs_split_into_many_chains_arrive_byte_exact() {
    let Some(dev) = device("scattered_runs_split_into_many_chains_arrive_byte_exact") else {
        return;
    };
    const LEN: usize = 4 << 20;
    let src = Buf::new(LEN, |i| (i * 7 + i / 4093) as u8);
    let dst = Buf::new(LEN, |_| 0xee);
    let (sr, dr) = (src.register(&dev), dst.register(&dev));
    assert_eq!((sr.base(), sr.len()), (src.addr(), LEN));
    let (mut a, _b) = pair(&dev, 32);

    // Runs of 1 byte .. 24 KiB from random source offsets into disjoint destination
    // slots (in shuffled order), about half of the destination.
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let slot = 32 << 10;
    let mut slots: Vec<usize> = (0..LEN / slot).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut expect = vec![0xeeu8; LEN];
    let want = src.snapshot();
    let mut ops = Vec::new();
    for &s in &slots {
        let len = 1 + rng.below(24 << 10) as usize;
        let from = rng.below((LEN - len) as u64) as usize;
        let to = s * slot + rng.below((slot - len) as u64) as usize;
        expect[to..to + len].copy_from_slice(&want[from..from + len]);
        ops.push(WriteOp {
            addr: src.addr() + from,
            len,
            lkey: sr.lkey(),
            remote_addr: (dst.addr() + to) as u64,
            rkey: dr.rkey(),
        });
    }
    let t = Instant::now();
    // 4 KiB slices: hundreds of work requests, many chains of a 32-deep window.
    a.write(&ops, 4096, STALL).expect("scattered write");
    let bytes: usize = ops.iter().map(|o| o.len).sum();
    eprintln!("{} runs, {} bytes in {:?}", ops.len(), bytes, t.elapsed());
    assert!(
        dst.snapshot() == expect,
        "destination differs from the expected bytes"
    );
    assert!(!a.is_broken());

    // The endpoint stays usable: a second batch (whole buffer, no slicing) lands too.
    let whole = [WriteOp {
        addr: src.addr(),
        len: LEN,
        lkey: sr.lkey(),
        remote_addr: dst.addr() as u64,
        rkey: dr.rkey(),
    }];
    a.write(&whole, 0, STALL).expect("whole-buffer write");
    assert!(dst.snapshot() == want);
    drop((sr, dr));
}

#[test]
fn many_small_writes_beyond_the_depth_all_land() {
    let Some(dev) = device("many_small_writes_beyond_the_depth_all_land") else {
        return;
    };
    const N: usize = 6000;
    const SZ: usize = 64;
    let src = Buf::new(N * SZ, |i| (i % 251) as u8);
    let dst = Buf::new(N * SZ, |_| 0);
    let (sr, dr) = (src.register(&dev), dst.register(&dev));
    let (mut a, _b) = pair(&dev, 16);
    assert!(a.depth() <= 16);
    // Reverse order, so each write lands somewhere new; 6000 WRs through a 16-deep QP
    // (posting more than its send queue holds would fail with ENOMEM).
    let ops: Vec<WriteOp> = (0..N)
        .rev()
        .map(|i| WriteOp {
            addr: src.addr() + i * SZ,
            len: SZ,
            lkey: sr.lkey(),
            remote_addr: (dst.addr() + i * SZ) as u64,
            rkey: dr.rkey(),
        })
        .collect();
    let t = Instant::now();
    a.write(&ops, 4096, STALL).expect("many small writes");
    eprintln!("{N} writes of {SZ} bytes in {:?}", t.elapsed());
    assert!(dst.snapshot() == src.snapshot());
    // Again, on the same endpoint: nothing was left outstanding by the first call.
    a.write(&ops[..100], 16, STALL).expect("second call");
    drop((sr, dr));
}

/// Good writes, one bad one in the middle, good writes: the call fails with the remote
/// access error, the endpoint is broken for good, and a fresh pair still works.
fn bad_write_breaks_only_its_endpoint(test: &str, corrupt: impl Fn(&mut WriteOp, &Region)) {
    let Some(dev) = device(test) else {
        return;
    };
    const LEN: usize = 1 << 20;
    let src = Buf::new(LEN, |i| (i / 3) as u8);
    let dst = Buf::new(LEN, |_| 0);
    let (sr, dr) = (src.register(&dev), dst.register(&dev));
    let op = |off: usize, len: usize| WriteOp {
        addr: src.addr() + off,
        len,
        lkey: sr.lkey(),
        remote_addr: (dst.addr() + off) as u64,
        rkey: dr.rkey(),
    };
    let (mut a, _b) = pair(&dev, 16);
    a.write(&[op(0, 4096)], 1024, STALL)
        .expect("a good write first");

    let mut ops: Vec<WriteOp> = (1..40).map(|i| op(i * 8192, 8192)).collect();
    corrupt(&mut ops[20], &dr);
    let t = Instant::now();
    let err = a
        .write(&ops, 1024, STALL)
        .expect_err("a write outside the peer's region must fail");
    let msg = err.to_string();
    eprintln!("{test}: {msg} (after {:?})", t.elapsed());
    assert!(
        msg.contains("remote access error") && msg.contains("IBV_WC_REM_ACCESS_ERR"),
        "{msg}"
    );
    assert!(a.is_broken());
    let again = a
        .write(&[op(0, 4096)], 1024, STALL)
        .expect_err("a broken endpoint refuses writes");
    assert!(again.to_string().contains("broken"), "{again}");

    // Everything else still works: a new pair on the same device and regions.
    let (mut c, _d) = pair(&dev, 16);
    c.write(&[op(0, LEN)], 64 << 10, STALL)
        .expect("a fresh endpoint writes");
    assert!(dst.snapshot() == src.snapshot());
    drop((sr, dr));
}

#[test]
fn bad_rkey_fails_with_remote_access_error_and_breaks_only_that_endpoint() {
    bad_write_breaks_only_its_endpoint(
        "bad_rkey_fails_with_remote_access_error_and_breaks_only_that_endpoint",
        |op, _| op.rkey ^= 0xffff,
    );
}

#[test]
fn remote_address_past_the_region_fails_with_remote_access_error() {
    bad_write_breaks_only_its_endpoint(
        "remote_address_past_the_region_fails_with_remote_access_error",
        |op, dr| op.remote_addr = (dr.base() + dr.len() - 100) as u64,
    );
}

#[test]
fn writes_to_a_shut_peer_fail_and_leave_nothing_outstanding() {
    let Some(dev) = device("writes_to_a_shut_peer_fail_and_leave_nothing_outstanding") else {
        return;
    };
    let src = Buf::new(1 << 16, |i| i as u8);
    let dst = Buf::new(1 << 16, |_| 0);
    let (sr, dr) = (src.register(&dev), dst.register(&dev));
    let ops = [WriteOp {
        addr: src.addr(),
        len: 1 << 16,
        lkey: sr.lkey(),
        remote_addr: dst.addr() as u64,
        rkey: dr.rkey(),
    }];

    // The peer's QP is in ERR and answers nothing, so the writer gives up after the stall
    // limit (or on the transport's retry limit, whichever comes first; soft-RoCE on the
    // guest's 6.1 kernel never reported IBV_WC_RETRY_EXC_ERR here, even after 60 s, so the
    // stall limit is what ends such a write).
    let (mut a, mut b) = pair(&dev, 8);
    b.shut();
    b.shut();
    assert!(b.is_broken());
    let t = Instant::now();
    let err = a
        .write(&ops, 4096, Duration::from_millis(200))
        .expect_err("peer is shut");
    let msg = err.to_string();
    eprintln!("shut peer, stall 200 ms: {msg} (after {:?})", t.elapsed());
    assert!(
        msg.contains("no completion for 200 ms") || msg.contains("IBV_WC_RETRY_EXC_ERR"),
        "{msg}"
    );
    assert!(a.is_broken());
    assert!(!msg.contains("outstanding"), "{msg}");

    // Our own shut: nothing more goes out.
    let (mut a, _b) = pair(&dev, 8);
    a.shut();
    let err = a.write(&ops, 4096, STALL).expect_err("shut endpoint");
    assert!(err.to_string().contains("shut"), "{err}");
    drop((sr, dr));
}

#[test]
fn an_endpoint_refuses_writes_before_connect_and_a_second_connect() {
    let Some(dev) = device("an_endpoint_refuses_writes_before_connect_and_a_second_connect") else {
        return;
    };
    let mut a = dev.endpoint(4, Access::RemoteWrite).unwrap();
    let err = a.write(&[], 0, STALL);
    assert!(err.is_err(), "write before connect");
    let (mut a, b) = pair(&dev, 4);
    assert!(a.write(&[], 0, STALL).is_ok(), "an empty batch is a no-op");
    assert!(a.connect(&b.info()).is_err(), "second connect");
    let bad_mtu = EndpointInfo { mtu: 9, ..b.info() };
    let mut c = dev.endpoint(4, Access::RemoteWrite).unwrap();
    assert!(c.connect(&bad_mtu).is_err());
}

/// Writes `src` into `dst`'s region through `a` (connected to the endpoint that owns
/// `dst`'s side); the error, if the target device refused it.
fn try_write(a: &mut Endpoint, src: &Buf, sr: &Region, dst: &Buf, rkey: u32) -> Result<(), String> {
    let op = WriteOp {
        addr: src.addr(),
        len: 4096,
        lkey: sr.lkey(),
        remote_addr: dst.addr() as u64,
        rkey,
    };
    a.write(&[op], 4096, STALL).map_err(|e| e.to_string())
}

/// The target device refused the write: a remote access error (the region or key does
/// not allow it), or a remote invalid request (the queue pair allows no RDMA WRITE).
fn assert_refused(r: Result<(), String>, what: &str) {
    let msg = r.expect_err(what);
    assert!(
        msg.contains("IBV_WC_REM_ACCESS_ERR") || msg.contains("IBV_WC_REM_INV_REQ_ERR"),
        "{what}: {msg}"
    );
}

/// Review F4: a prefill engine's memory is never written into, so it is registered,
/// and its queue pairs set up, for local access only: a peer's RDMA WRITE into it fails
/// at the device, whether through a queue pair that allows remote writes into a
/// local-only region, or one that allows none.
#[test]
fn local_only_regions_and_queue_pairs_refuse_remote_writes() {
    let Some(dev) = device("local_only_regions_and_queue_pairs_refuse_remote_writes") else {
        return;
    };
    let src = Buf::new(4096, |i| i as u8 | 1);
    let dst = Buf::new(4096, |_| 0);
    let sr = src.register(&dev);
    let local = dst.register_as(&dev, Access::Local);
    let (mut a, _b) = pair(&dev, 4);
    assert_refused(
        try_write(&mut a, &src, &sr, &dst, local.rkey()),
        "a write into a local-only region",
    );
    // A writable region behind a queue pair that allows no remote access.
    let writable = dst.register(&dev);
    let mut c = dev.endpoint(4, Access::RemoteWrite).unwrap();
    let mut d = dev.endpoint(4, Access::Local).unwrap();
    let (ic, id) = (c.info(), d.info());
    c.connect(&id).unwrap();
    d.connect(&ic).unwrap();
    assert_refused(
        try_write(&mut c, &src, &sr, &dst, writable.rkey()),
        "a write through a local-only queue pair",
    );
    assert!(dst.snapshot().iter().all(|&x| x == 0), "bytes landed");
    // The control: a writable region behind a writable queue pair takes the write.
    let (mut e, _f) = pair(&dev, 4);
    try_write(&mut e, &src, &sr, &dst, writable.rkey()).expect("a permitted write");
    assert!(dst.snapshot() == src.snapshot());
    drop((sr, local, writable));
}

/// Review F4: a decode engine registers its memory for each prefill engine in a
/// protection domain of that engine's own, so one engine's keys are refused through
/// another engine's queue pair, and deregistering an engine's regions (when it is
/// lost) revokes its keys.
#[test]
fn keys_of_one_peer_s_domain_are_refused_through_another_s_queue_pair_and_after_revocation() {
    let Some(dev) = device("keys_of_one_peer_s_domain_are_refused") else {
        return;
    };
    let src = Buf::new(4096, |i| i as u8 | 1);
    let dst = Buf::new(4096, |_| 0);
    let sr = src.register_as(&dev, Access::Local);
    let (one, two) = (dev.domain().unwrap(), dev.domain().unwrap());
    let r1 = dst.register_in(&one);
    // Peer 2's queue pair, in domain two, connected to a prefill endpoint.
    let connect = |domain: &Domain| {
        let mut p = dev.endpoint(4, Access::Local).unwrap();
        let mut d = domain.endpoint(4, Access::RemoteWrite).unwrap();
        let (ip, id) = (p.info(), d.info());
        p.connect(&id).unwrap();
        d.connect(&ip).unwrap();
        (p, d)
    };
    let (mut p2, _d2) = connect(&two);
    assert_refused(
        try_write(&mut p2, &src, &sr, &dst, r1.rkey()),
        "peer two using peer one's key",
    );
    assert!(dst.snapshot().iter().all(|&x| x == 0), "bytes landed");
    let (mut p1, _d1) = connect(&one);
    try_write(&mut p1, &src, &sr, &dst, r1.rkey()).expect("peer one with its own key");
    assert!(dst.snapshot() == src.snapshot());
    // Revoked: the same write through a fresh queue pair of the same domain now fails.
    let rkey = r1.rkey();
    drop(r1);
    let (mut p3, _d3) = connect(&one);
    assert_refused(
        try_write(&mut p3, &src, &sr, &dst, rkey),
        "a key used after its region was deregistered",
    );
    drop(sr);
}
