//! CUDA device memory at registration, on a machine without a GPU: the driver is loaded
//! at run time, so a missing library, a failing `cuInit` or no device give a clear error
//! (through the Rust API and the C ABI) and host memory is unaffected; with the driver's
//! test double (tests/fakecuda/fakecuda.c, "device" memory that is host memory the fake
//! driver knows), the engine's real driver code checks registered buffers against the
//! pointer attributes, walking VMM ranges of several allocations.
//!
//! The fake proves the engine's use of the driver API, not GPU behaviour: the GPU run is
//! scripts/gpu-check.sh.

mod common;

use std::ffi::c_void;

use common::fakecuda::{fakecuda, with_env, Fake};
use kvxfer::ffi::memory::{kvxfer_buffer_desc, kvxfer_register_kv_desc};
use kvxfer::ffi::status::kvxfer_status;
use kvxfer::{BufferDesc, ErrorKind, MemKind};

fn cuda(base: usize, len: usize, item: usize, device: u32) -> BufferDesc {
    BufferDesc {
        kind: MemKind::Cuda { device },
        ..BufferDesc::host(base, len, item)
    }
}

fn register_err(bufs: Vec<BufferDesc>) -> kvxfer::Error {
    let e = common::start("decode", &[], common::quiet());
    e.register_kv(bufs).unwrap_err()
}

#[test]
fn a_missing_driver_library_is_a_clear_transport_unavailable_and_host_memory_still_registers() {
    with_env("/nonexistent/libcuda-for-kvxfer-tests.so.1", &[], || {
        let err = register_err(vec![cuda(0x7000_0000, 4096, 1024, 0)]);
        assert_eq!(err.kind(), ErrorKind::TransportUnavailable, "{err}");
        let m = err.message();
        assert!(
            m.contains("/nonexistent/libcuda-for-kvxfer-tests.so.1")
                && m.contains("KVXFER_CUDA_LIBRARY")
                && m.contains("CUDA driver"),
            "{m}"
        );
        // Host memory never needs the driver.
        let mem = common::Region::new(4, 64, |_| 0);
        let e = common::start("prefill", &[], common::quiet());
        e.register_kv(vec![mem.desc()]).unwrap();
    });
}

#[test]
fn a_failing_cu_init_names_the_driver_and_its_error() {
    with_env(
        fakecuda().to_str().unwrap(),
        &[("FAKECUDA_INIT_ERROR", "100")],
        || {
            let err = register_err(vec![cuda(0x7000_0000, 4096, 1024, 0)]);
            assert_eq!(err.kind(), ErrorKind::TransportUnavailable, "{err}");
            assert!(
                err.message().contains("cuInit")
                    && err.message().contains("no CUDA-capable device is detected"),
                "{err}"
            );
        },
    );
}

#[test]
fn a_driver_without_devices_says_so_and_a_missing_ordinal_is_named() {
    with_env(
        fakecuda().to_str().unwrap(),
        &[("FAKECUDA_DEVICES", "0")],
        || {
            let err = register_err(vec![cuda(0x7000_0000, 4096, 1024, 0)]);
            assert_eq!(err.kind(), ErrorKind::TransportUnavailable, "{err}");
            assert!(err.message().contains("sees no CUDA device"), "{err}");
        },
    );
    with_env(
        fakecuda().to_str().unwrap(),
        &[("FAKECUDA_DEVICES", "2")],
        || {
            let err = register_err(vec![cuda(0x7000_0000, 4096, 1024, 5)]);
            assert_eq!(err.kind(), ErrorKind::InvalidArgument, "{err}");
            assert!(
                err.message().contains("CUDA device 5 does not exist"),
                "{err}"
            );
        },
    );
}

#[test]
fn device_buffers_are_checked_against_the_driver_including_vmm_ranges_of_several_allocations() {
    with_env(
        fakecuda().to_str().unwrap(),
        &[("FAKECUDA_DEVICES", "2")],
        || {
            let fake = Fake::open();
            let plain = fake.alloc(1, 64 << 10);
            let vmm = fake.alloc_vmm(1, 64 << 10, 3);
            let e = common::start("decode", &[], common::quiet());
            e.register_kv(vec![
                cuda(plain, 64 << 10, 4096, 1),
                cuda(vmm, 3 * (64 << 10), 4096, 1),
            ])
            .unwrap();

            // Registered on the wrong device.
            let err = register_err(vec![cuda(plain, 64 << 10, 4096, 0)]);
            assert!(
                err.message().contains("kv buffer 0")
                    && err
                        .message()
                        .contains("memory of CUDA device 1, not of device 0"),
                "{err}"
            );
            // Longer than the allocation: the byte past its end is named.
            let err = register_err(vec![cuda(plain, 128 << 10, 4096, 1)]);
            assert!(
                err.message().contains(&format!("byte {}", 64 << 10))
                    && err.message().contains("not memory the CUDA driver knows"),
                "{err}"
            );
            // Host memory said to be device memory.
            let host = common::Region::new(4, 4096, |_| 0);
            let err = register_err(vec![cuda(host.desc().base, 4 * 4096, 4096, 0)]);
            assert_eq!(err.kind(), ErrorKind::InvalidArgument);
            assert!(err.message().contains("byte 0"), "{err}");
            drop(e);
            fake.free(plain);
            fake.free(vmm);
        },
    );
}

fn desc(kind: u32, device: u32, base: usize) -> kvxfer_buffer_desc {
    kvxfer_buffer_desc {
        struct_size: std::mem::size_of::<kvxfer_buffer_desc>(),
        kind,
        device,
        base: base as *mut c_void,
        len: 4096,
        item_len: 1024,
    }
}

/// Through the C ABI: the status, the message, and the struct checks.
#[test]
fn the_c_abi_registration_checks_struct_size_and_kind_and_reports_a_missing_driver() {
    use kvxfer::ffi::config::{
        kvxfer_config, kvxfer_config_free, kvxfer_config_new, kvxfer_config_set,
    };
    use kvxfer::ffi::engine::{kvxfer_engine, kvxfer_engine_free, kvxfer_engine_new};
    with_env("/nonexistent/libcuda-abi.so", &[], || {
        let mut cfg: *mut kvxfer_config = std::ptr::null_mut();
        let mut e: *mut kvxfer_engine = std::ptr::null_mut();
        // SAFETY: the C ABI, used as its header says.
        unsafe {
            assert_eq!(kvxfer_config_new(&mut cfg), kvxfer_status::KVXFER_OK);
            for (k, v) in [("role", "decode\0"), ("listen", "127.0.0.1:0\0")] {
                let k = format!("{k}\0");
                assert_eq!(
                    kvxfer_config_set(cfg, k.as_ptr().cast(), v.as_ptr().cast()),
                    kvxfer_status::KVXFER_OK
                );
            }
            assert_eq!(kvxfer_engine_new(cfg, &mut e), kvxfer_status::KVXFER_OK);
            kvxfer_config_free(cfg);
        }
        let mut host = vec![0u8; 4096];
        let check = |d: kvxfer_buffer_desc, want: kvxfer_status, part: &str| {
            // SAFETY: one readable descriptor; no layer ids, no layout.
            let st =
                unsafe { kvxfer_register_kv_desc(e, &d, std::ptr::null(), 1, std::ptr::null()) };
            let msg = last_error();
            assert_eq!(st, want, "{msg}");
            assert!(msg.contains(part), "{msg}");
        };
        let mut bad = desc(0, 0, host.as_mut_ptr() as usize);
        bad.struct_size -= 8;
        check(
            bad,
            kvxfer_status::KVXFER_ERR_INVALID_ARGUMENT,
            "bufs[0].struct_size",
        );
        check(
            desc(7, 0, host.as_mut_ptr() as usize),
            kvxfer_status::KVXFER_ERR_INVALID_ARGUMENT,
            "bufs[0].kind 7 is neither",
        );
        check(
            desc(0, 3, host.as_mut_ptr() as usize),
            kvxfer_status::KVXFER_ERR_INVALID_ARGUMENT,
            "bufs[0].device is 3",
        );
        check(
            desc(1, 0, 0x7000_0000),
            kvxfer_status::KVXFER_ERR_TRANSPORT_UNAVAILABLE,
            "/nonexistent/libcuda-abi.so",
        );
        // SAFETY: one readable host descriptor.
        let st = unsafe {
            kvxfer_register_kv_desc(
                e,
                &desc(0, 0, host.as_mut_ptr() as usize),
                std::ptr::null(),
                1,
                std::ptr::null(),
            )
        };
        assert_eq!(st, kvxfer_status::KVXFER_OK, "{}", last_error());
        // SAFETY: a live engine, freed once.
        unsafe { kvxfer_engine_free(e) };
    });
}

fn last_error() -> String {
    let mut buf = vec![0u8; 1024];
    // SAFETY: buf holds its length.
    let n = unsafe { kvxfer::ffi::status::kvxfer_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    String::from_utf8_lossy(&buf[..n.min(buf.len() - 1)]).into_owned()
}
