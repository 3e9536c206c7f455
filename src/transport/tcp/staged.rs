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
/// memory; then tells the grant which landed whole. Consecutive runs into one device go
/// through the ring in one pass, so the copies of one overlap the reads of the next.
pub(super) fn data<G: Grant>(
    s: &mut DataStream,
    grant: G,
    runs: &[DataHeader],
    rings: &mut Rings,
) -> Result<(), String> {
    let mut complete = vec![false; runs.len()];
    let mut received = vec![None; runs.len()];
    let mut i = 0;
    while i < runs.len() {
        let Some((device, _)) = grant.device(i) else {
            let len = runs[i].byte_len as usize;
            let got = read_payload(s, grant.pages(i), &|| grant.enter())
                .map_err(|e| format!("data read failed: {e}"))?;
            if got < len {
                // The room ended: the rest of the run goes nowhere.
                discard(s, (len - got) as u64)?;
            }
            complete[i] = got == len;
            i += 1;
            continue;
        };
        // The runs from i on into the same device, their device ranges and where each
        // starts in the group's bytes.
        let mut pieces = Vec::new();
        let mut starts = Vec::new();
        let mut total = 0usize;
        let mut end = i;
        while let Some((d, addr)) = (end < runs.len()).then(|| grant.device(end)).flatten() {
            if d != device {
                break;
            }
            let len = runs[end].byte_len as usize;
            pieces.push((addr, len));
            starts.push(total);
            total += len;
            end += 1;
        }
        let ring = rings
            .get(device, 0)
            .map_err(|e| format!("staging for CUDA device {device}: {e}"))?;
        let mut digests: Vec<u32> = runs[i..end]
            .iter()
            .map(crate::integrity::digest_start)
            .collect();
        let mut consumed = 0usize;
        let mut read = |buf: &mut [u8]| {
            // The ring never lets a slot span two pieces: this chunk is one run's.
            let k = starts.partition_point(|&st| st <= consumed) - 1;
            let n = read_payload(s, buf, &|| grant.enter())?;
            digests[k] = crate::integrity::digest_more(digests[k], &buf[..n]);
            consumed += n;
            Ok(n == buf.len())
        };
        // SAFETY: the grant admitted these bytes of registered device memory to these
        // runs alone (`Grant::device`), and the room's guard from `enter` is held around
        // each copy into them.
        let landed = unsafe { ring.recv(&pieces, &mut read, &|| grant.enter()) }
            .map_err(|e| format!("data read or staging copy failed: {e}"))?;
        if consumed < total {
            // The room ended: the rest of these runs goes nowhere.
            discard(s, (total - consumed) as u64)?;
        }
        for (k, (st, (_, len))) in starts.iter().zip(&pieces).enumerate() {
            complete[i + k] = landed >= st + len;
            received[i + k] = Some(digests[k]);
        }
        i = end;
    }
    grant.finish_staged(&complete, &received);
    Ok(())
}
