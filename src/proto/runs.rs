//! The `DataRuns` frame: several page runs of one room in one data frame, their headers
//! first and then their bytes, so that a receiver reads the bytes of every run with one
//! vectored `recv` into the pages instead of one `recv` per run.
//!
//! ```text
//! frame header (kind DataRuns, payload_len)
//! count: u32 | reserved: u32 (0)          RUNS_COUNT_LEN bytes
//! count × data header                      DATA_HEADER_LEN bytes each (see data.rs)
//! the runs' bytes, in header order         Σ byte_len
//! ```
//!
//! Every run names the same room and generation; no two runs share a page of a buffer;
//! `count` is within `1..=MAX_RUNS`; each header passes [`DataHeader::check`], and
//! `payload_len` is exactly the headers plus Σ `byte_len`. As for a `Data` frame, where each run may land is the engine's check.

use std::io::Read;

use super::frame::{FrameHeader, Kind, Limits, ProtoError};
use super::stream::{fill, read_data_start, ReadError};
use super::{DataHeader, DATA_HEADER_LEN, FRAME_HEADER_LEN};

/// The most runs in one `DataRuns` frame (a receiver reads them with one vectored read,
/// within `IOV_MAX`).
pub const MAX_RUNS: u32 = 1000;

/// Bytes of the count and reserved fields.
const RUNS_COUNT_LEN: usize = 8;

/// Bytes of the payload before the runs' bytes, for `count` runs.
pub(super) const fn headers_len(count: u32) -> usize {
    RUNS_COUNT_LEN + count as usize * DATA_HEADER_LEN
}

/// Appends the frame header, count and run headers of a `DataRuns` frame carrying
/// `runs` to `out`; the runs' bytes follow them on the wire.
pub fn encode_runs_prefix(runs: &[DataHeader], out: &mut Vec<u8>) -> Result<(), ProtoError> {
    let count = u32::try_from(runs.len())
        .ok()
        .filter(|n| (1..=MAX_RUNS).contains(n))
        .ok_or(ProtoError::BadRunCount {
            found: runs.len().min(u32::MAX as usize) as u32,
            frame_payload_len: 0,
        })?;
    let bytes: u64 = runs.iter().map(|r| u64::from(r.byte_len)).sum();
    let len = headers_len(count) as u64 + bytes;
    let payload_len = u32::try_from(len).map_err(|_| ProtoError::EncodeTooLarge {
        kind: Kind::DataRuns,
        len,
    })?;
    out.reserve(FRAME_HEADER_LEN + headers_len(count));
    out.extend_from_slice(&FrameHeader::new(Kind::DataRuns, payload_len).encode());
    out.extend_from_slice(&count.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    for r in runs {
        out.extend_from_slice(&r.encode());
    }
    Ok(())
}

/// Reads the count of the `DataRuns` frame whose header is `hdr` and checks it against
/// the frame's length. The stream is then at the run headers ([`read_run_headers`]).
pub fn read_runs_count<R: Read>(
    r: &mut R,
    hdr: &FrameHeader,
    limits: &Limits,
) -> Result<u32, ReadError> {
    let buf: [u8; RUNS_COUNT_LEN] =
        read_data_start(r, hdr, Kind::DataRuns, limits, "DataRuns count")?;
    let count = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    let reserved = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if reserved != 0 {
        return Err(ProtoError::NonzeroReserved {
            field: "DataRuns.reserved",
            found: u64::from(reserved),
        }
        .into());
    }
    if !(1..=MAX_RUNS).contains(&count) || headers_len(count) > hdr.payload_len as usize {
        return Err(ProtoError::BadRunCount {
            found: count,
            frame_payload_len: hdr.payload_len,
        }
        .into());
    }
    Ok(count)
}

/// Reads and checks the `count` run headers of the `DataRuns` frame whose header is
/// `hdr` (see the module's rules). The stream is then at the runs' bytes, which the
/// caller must read (or discard) before the next frame.
pub fn read_run_headers<R: Read>(
    r: &mut R,
    hdr: &FrameHeader,
    count: u32,
    limits: &Limits,
) -> Result<Vec<DataHeader>, ReadError> {
    // One header at a time: memory grows with the bytes that arrived, not with a count
    // the peer claims.
    let mut runs: Vec<DataHeader> = Vec::new();
    let mut sum = 0u64;
    for _ in 0..count {
        let mut b = [0u8; DATA_HEADER_LEN];
        fill(r, &mut b, "DataRuns header", false)?;
        let h = DataHeader::decode_fields(&b)?;
        h.check(limits)?;
        if let Some(first) = runs.first() {
            if (h.room, h.generation) != (first.room, first.generation) {
                return Err(ProtoError::RunsOfSeveralRooms {
                    first: (first.room, first.generation),
                    found: (h.room, h.generation),
                }
                .into());
            }
        }
        sum += u64::from(h.byte_len);
        runs.push(h);
    }
    // Each run as a span of (page, offset) positions: whole pages from (first, 0) to
    // (end, 0); one page from (page, page_off) to (page, page_off + byte_len), since
    // the codec does not know the page size. No two spans of a buffer may meet.
    let mut spans: Vec<_> = runs
        .iter()
        .map(|h| {
            let (start, end) = if h.n_pages == 1 {
                (
                    (h.first_page, u64::from(h.page_off)),
                    (h.first_page, u64::from(h.page_off) + u64::from(h.byte_len)),
                )
            } else {
                ((h.first_page, 0), (h.first_page + h.n_pages, 0))
            };
            (h.target as u8, h.buffer, start, end)
        })
        .collect();
    spans.sort_unstable();
    if let Some(w) = spans
        .windows(2)
        .find(|w| (w[0].0, w[0].1) == (w[1].0, w[1].1) && w[1].2 < w[0].3)
    {
        return Err(ProtoError::RunsOverlap {
            buffer: w[1].1,
            page: w[1].2 .0,
        }
        .into());
    }
    if headers_len(count) as u64 + sum != u64::from(hdr.payload_len) {
        return Err(ProtoError::RunsLenMismatch {
            sum,
            frame_payload_len: hdr.payload_len,
        }
        .into());
    }
    Ok(runs)
}

/// Reads a whole `DataRuns` frame's headers ([`read_runs_count`], then
/// [`read_run_headers`]).
pub fn read_runs<R: Read>(
    r: &mut R,
    hdr: &FrameHeader,
    limits: &Limits,
) -> Result<Vec<DataHeader>, ReadError> {
    let count = read_runs_count(r, hdr, limits)?;
    read_run_headers(r, hdr, count, limits)
}

#[cfg(test)]
mod tests {
    use super::super::{read_frame_header, Target};
    use super::*;

    fn run(room: u64, first_page: u32, n_pages: u32) -> DataHeader {
        DataHeader {
            room,
            generation: 2,
            target: Target::Kv,
            buffer: 1,
            first_page,
            n_pages,
            byte_len: n_pages * 4096,
            page_off: 0,
            digest: 0,
        }
    }

    fn frame(runs: &[DataHeader]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_runs_prefix(runs, &mut out).unwrap();
        out
    }

    fn decode(bytes: &[u8]) -> Result<Vec<DataHeader>, ReadError> {
        let limits = Limits::default();
        let mut r = bytes;
        let hdr = read_frame_header(&mut r, &limits)?;
        read_runs(&mut r, &hdr, &limits)
    }

    #[test]
    fn runs_round_trip_and_leave_the_stream_at_their_bytes() {
        let runs = [run(7, 10, 1), run(7, 3, 2), run(7, 40, 1)];
        let mut bytes = frame(&runs);
        assert_eq!(bytes.len(), FRAME_HEADER_LEN + headers_len(3));
        bytes.extend_from_slice(&[9u8; 4 * 4096]);
        let limits = Limits::default();
        let mut r = &bytes[..];
        let hdr = read_frame_header(&mut r, &limits).unwrap();
        assert_eq!(hdr.kind, Kind::DataRuns);
        assert_eq!(hdr.payload_len as usize, headers_len(3) + 4 * 4096);
        assert_eq!(read_runs(&mut r, &hdr, &limits).unwrap(), runs);
        assert_eq!(r.len(), 4 * 4096);
    }

    fn slice(page: u32, page_off: u32, byte_len: u32) -> DataHeader {
        DataHeader {
            byte_len,
            page_off,
            ..run(7, page, 1)
        }
    }

    #[test]
    fn slices_of_one_page_may_share_it_but_not_its_bytes() {
        // Two heads' slices of page 5 and the whole page 6.
        let runs = [slice(5, 0, 512), slice(5, 1024, 512), run(7, 6, 1)];
        let mut bytes = frame(&runs);
        bytes.extend_from_slice(&[0u8; 1024 + 4096]);
        assert_eq!(decode(&bytes).unwrap(), runs);
        // Slices that overlap, or a slice inside a whole page of the frame.
        for second in [slice(5, 256, 512), slice(6, 4000, 8)] {
            let runs = [slice(5, 0, 512), run(7, 6, 1), second];
            let mut bytes = frame(&runs);
            let n: u32 = runs.iter().map(|r| r.byte_len).sum();
            bytes.extend(std::iter::repeat_n(0u8, n as usize));
            assert!(
                matches!(
                    decode(&bytes),
                    Err(ReadError::Proto(ProtoError::RunsOverlap { .. }))
                ),
                "{second:?}"
            );
        }
    }

    #[test]
    fn runs_of_two_rooms_or_generations_are_refused() {
        let mut other_gen = run(7, 1, 1);
        other_gen.generation = 3;
        for second in [run(8, 1, 1), other_gen] {
            let mut bytes = frame(&[run(7, 0, 1), second]);
            bytes.extend_from_slice(&[0u8; 2 * 4096]);
            assert!(matches!(
                decode(&bytes),
                Err(ReadError::Proto(ProtoError::RunsOfSeveralRooms { .. }))
            ));
        }
    }

    #[test]
    fn counts_and_lengths_that_do_not_fit_are_refused() {
        // Count 0, count over the limit, and a count whose headers overrun the payload.
        for (count, payload_len) in [(0u32, 8u32 + 40), (MAX_RUNS + 1, 8 + 40), (5, 8 + 2 * 40)] {
            let mut bytes = FrameHeader::new(Kind::DataRuns, payload_len)
                .encode()
                .to_vec();
            bytes.extend_from_slice(&count.to_le_bytes());
            bytes.extend_from_slice(&[0u8; 4]);
            bytes.resize(FRAME_HEADER_LEN + payload_len as usize, 0);
            assert!(
                matches!(
                    decode(&bytes),
                    Err(ReadError::Proto(ProtoError::BadRunCount { .. }))
                ),
                "count {count}"
            );
        }
        // Byte lengths that do not add up to the payload.
        let mut bytes = frame(&[run(7, 0, 1), run(7, 1, 1)]);
        let len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) + 1;
        bytes[8..12].copy_from_slice(&len.to_le_bytes());
        assert!(matches!(
            decode(&bytes),
            Err(ReadError::Proto(ProtoError::RunsLenMismatch { .. }))
        ));
        // A bad run header (zero pages) is refused as it would be in a Data frame.
        let mut zero = run(7, 1, 1);
        zero.n_pages = 0;
        zero.byte_len = 0;
        assert!(matches!(
            decode(&frame(&[run(7, 0, 1), zero])),
            Err(ReadError::Proto(ProtoError::ZeroPages))
        ));
        // Two runs writing one page.
        let mut bytes = frame(&[run(7, 0, 2), run(7, 5, 1), run(7, 1, 1)]);
        bytes.extend_from_slice(&[0u8; 4 * 4096]);
        assert!(matches!(
            decode(&bytes),
            Err(ReadError::Proto(ProtoError::RunsOverlap {
                buffer: 1,
                page: 1
            }))
        ));
        // Reserved bits.
        let mut bytes = frame(&[run(7, 0, 1)]);
        bytes[FRAME_HEADER_LEN + 4] = 1;
        assert!(matches!(
            decode(&bytes),
            Err(ReadError::Proto(ProtoError::NonzeroReserved { .. }))
        ));
    }

    #[test]
    fn nothing_is_encoded_for_no_runs() {
        let mut out = Vec::new();
        assert!(encode_runs_prefix(&[], &mut out).is_err());
        assert!(out.is_empty());
    }
}
