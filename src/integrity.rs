//! Verified bytes (DESIGN inv. 10): with `integrity=verify` on both engines, the prefill
//! puts in each data run's header a digest of the header itself (room, generation,
//! buffer, pages, offset, length, with the digest field 0) followed by the run's bytes,
//! and the decode engine recomputes it over the bytes where they landed, in its own
//! pages, before it counts them. A run corrupted on the way or on either host, written
//! at another place than its header says, or carrying the bytes of an earlier use of the
//! room id cannot match; a mismatch fails the room as [`Cause::Integrity`] with a reason
//! naming the engine, buffer, page and byte range. That every byte of the destination
//! was written exactly once is the admission ledger's job (`DecodeRoom::take_grants`)
//! together with the byte counts of Done.
//!
//! The digest is CRC32C, with the CPU's instruction where there is one (the `crc32c`
//! crate: SSE 4.2 on x86-64, the CRC extension on Arm, a table otherwise).
//!
//! [`Cause::Integrity`]: crate::room::Cause::Integrity

use crate::proto::DataHeader;
use crate::room::Cause;

/// What the reason of a room failed by a digest that did not match starts with, on the
/// decode side and, told in its Abort, on the prefill side: the prefill takes an Abort
/// whose reason starts with it for a failure of cause `Integrity` ([`peer_cause`]).
pub const REASON_PREFIX: &str = "integrity check failed: ";

/// The cause of a failure a peer reported with `reason` in its Abort.
pub fn peer_cause(reason: &str) -> Cause {
    if reason.starts_with(REASON_PREFIX) {
        Cause::Integrity
    } else {
        Cause::Aborted
    }
}

/// The digest of run `h` carrying `bytes` (its `digest` field is ignored).
pub fn digest(h: &DataHeader, bytes: &[u8]) -> u32 {
    digest_more(digest_start(h), bytes)
}

/// The digest of run `h` before any of its bytes: [`digest_more`] then takes them in
/// order, piece by piece (the staging ring's slots of a run into device memory).
pub fn digest_start(h: &DataHeader) -> u32 {
    let bound = DataHeader { digest: 0, ..*h };
    crc32c::crc32c(&bound.encode())
}

/// `crc` (from [`digest_start`]) with the next `bytes` of the run.
pub fn digest_more(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Target;

    fn run() -> DataHeader {
        DataHeader {
            room: 9,
            generation: 2,
            target: Target::Kv,
            buffer: 1,
            first_page: 40,
            n_pages: 1,
            byte_len: 8,
            page_off: 16,
            digest: 0,
        }
    }

    #[test]
    fn a_digest_taken_piece_by_piece_is_the_digest_of_the_whole() {
        let bytes: Vec<u8> = (0..100u8).collect();
        let mut crc = digest_start(&run());
        for piece in bytes.chunks(7) {
            crc = digest_more(crc, piece);
        }
        assert_eq!(crc, digest(&run(), &bytes));
    }

    #[test]
    fn the_digest_binds_the_bytes_to_every_field_of_their_header() {
        let bytes = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let d = digest(&run(), &bytes);
        assert_eq!(
            digest(
                &DataHeader {
                    digest: 77,
                    ..run()
                },
                &bytes
            ),
            d
        );
        let mut flipped = bytes;
        flipped[3] ^= 0x10;
        assert_ne!(digest(&run(), &flipped), d);
        for other in [
            DataHeader { room: 10, ..run() },
            DataHeader {
                generation: 1,
                ..run()
            },
            DataHeader { buffer: 0, ..run() },
            DataHeader {
                first_page: 41,
                ..run()
            },
            DataHeader {
                page_off: 24,
                ..run()
            },
            DataHeader {
                target: Target::Aux,
                ..run()
            },
        ] {
            assert_ne!(digest(&other, &bytes), d, "{other:?}");
        }
    }
}
