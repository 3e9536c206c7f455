//! CUDA device memory: the driver, loaded at run time ([`driver`]), and the check of a
//! buffer the host registers as device memory against the driver's own pointer
//! attributes.
//!
//! A registered device buffer may span several physical allocations (CUDA VMM:
//! `cuMemCreate` + `cuMemMap` of several chunks into one reserved range, as PyTorch's
//! `expandable_segments` does): the check walks the buffer allocation range by
//! allocation range (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` / `RANGE_SIZE`), and every
//! byte must be device memory of the device named.

pub mod copy;
pub mod driver;
pub mod ipc;

use crate::err;
use crate::error::Result;
use crate::transport::{BufferDesc, MemKind};
use driver::{
    Driver, ATTR_DEVICE_ORDINAL, ATTR_MEMORY_TYPE, ATTR_RANGE_SIZE, ATTR_RANGE_START_ADDR,
    MEMORYTYPE_DEVICE,
};

/// Checks every device buffer of `bufs` (named `what` buffer `i` in errors) against the
/// driver, loading it on first use. Host buffers pass untouched, and a list without
/// device buffers never loads the driver.
pub fn check_buffers(bufs: &[BufferDesc], what: &str) -> Result<()> {
    if bufs.iter().all(|b| b.kind.is_host()) {
        return Ok(());
    }
    let d = driver::load()?;
    for (i, b) in bufs.iter().enumerate() {
        if let MemKind::Cuda { device } = b.kind {
            let ctx = d.primary_context(device)?;
            d.with_context(ctx, || check_ranges(d, b.base as u64, b.len as u64, device))?
                .map_err(|e| err!(InvalidArgument, "{what} buffer {i}: {e}"))?;
        }
    }
    Ok(())
}

/// Walks `base..base+len` allocation by allocation: each must be device memory of
/// `device`. Returns how many allocations the range spans.
fn check_ranges(d: &Driver, base: u64, len: u64, device: u32) -> std::result::Result<u32, String> {
    let end = base
        .checked_add(len)
        .ok_or_else(|| "base + len overflows".to_string())?;
    let mut at = base;
    let mut ranges = 0u32;
    while at < end {
        let unknown = |r| {
            format!(
                "byte {} (address {at:#x}) is not memory the CUDA driver knows: {}",
                at - base,
                d.describe(r)
            )
        };
        let ty: u32 = d.pointer_attribute(ATTR_MEMORY_TYPE, at).map_err(unknown)?;
        if ty != MEMORYTYPE_DEVICE {
            return Err(format!(
                "byte {} (address {at:#x}) is CUDA memory of type {ty}, not device memory \
                 (CU_MEMORYTYPE_DEVICE); register host memory with kind KVXFER_MEMORY_HOST",
                at - base
            ));
        }
        let ordinal: i32 = d
            .pointer_attribute(ATTR_DEVICE_ORDINAL, at)
            .map_err(unknown)?;
        if ordinal != device as i32 {
            return Err(format!(
                "byte {} (address {at:#x}) is memory of CUDA device {ordinal}, not of \
                 device {device} as registered",
                at - base
            ));
        }
        let start: u64 = d
            .pointer_attribute(ATTR_RANGE_START_ADDR, at)
            .map_err(unknown)?;
        let size: usize = d.pointer_attribute(ATTR_RANGE_SIZE, at).map_err(unknown)?;
        let next = start.saturating_add(size as u64);
        if start > at || next <= at {
            return Err(format!(
                "the driver gives address {at:#x} the allocation {start:#x}+{size}, which \
                 does not hold it"
            ));
        }
        at = next;
        ranges += 1;
    }
    Ok(ranges)
}
