//! Receiving runs into device memory: the payload goes from the socket into a slot of the
//! connection's pinned staging ring and from there to the device with a host-to-device
//! copy, the socket reading the next slot while the copies before it run
//! ([`crate::transport::staging::Ring::recv`]). A copy is issued only while the room is
//! live, and counted on the room until it completed; once the room ended, the rest of
//! the payload is read and dropped. Runs into host memory in the same frame are read
//! straight into their pages as elsewhere.
//!
//! With `integrity=verify`, a run into device memory is digested as it passes through
//! the slots (the CPU never reads device memory): the check covers the sender and the
//! wire, not the host-to-device copy, whose failure the driver reports instead.

use super::recv::{discard, read_payload, DataStream, Grant};
use crate::cuda::copy::Rings;
use crate::proto::DataHeader;

/// Reads the payloads of `runs`, admitted together in `grant`, some of them into device
/// memory; then tells the grant which landed whole.
pub(super) fn data<G: Grant>(
    s: &mut DataStream,
    grant: G,
    runs: &[DataHeader],
    rings: &mut Rings,
) -> Result<(), String> {
    let mut complete = Vec::with_capacity(runs.len());
    let mut received = Vec::with_capacity(runs.len());
    for (i, h) in runs.iter().enumerate() {
        let mut crc = None;
        let len = h.byte_len as usize;
        let (landed, consumed) = match grant.device(i) {
            Some((device, addr)) => {
                let ring = rings
                    .get(device, 0)
                    .map_err(|e| format!("staging for CUDA device {device}: {e}"))?;
                let mut consumed = 0usize;
                let mut digest = crate::integrity::digest_start(h);
                let mut read = |buf: &mut [u8]| {
                    let n = read_payload(s, buf, &|| grant.enter())?;
                    consumed += n;
                    digest = crate::integrity::digest_more(digest, &buf[..n]);
                    Ok(n == buf.len())
                };
                // SAFETY: the grant admitted these bytes of registered device memory to
                // this run alone (`Grant::device`), and the room's guard from `enter` is
                // held around each copy into them.
                let landed = unsafe { ring.recv(&[(addr, len)], &mut read, &|| grant.enter()) }
                    .map_err(|e| format!("data read or staging copy failed: {e}"))?;
                crc = Some(digest);
                (landed, consumed)
            }
            None => {
                let got = read_payload(s, grant.pages(i), &|| grant.enter())
                    .map_err(|e| format!("data read failed: {e}"))?;
                (got, got)
            }
        };
        if consumed < len {
            // The room ended: the rest of the run goes nowhere.
            discard(s, (len - consumed) as u64)?;
        }
        complete.push(landed == len);
        received.push(crc);
    }
    grant.finish_staged(&complete, &received);
    Ok(())
}
