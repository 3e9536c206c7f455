//! The fixed-size header of a data frame.
//!
//! A data frame is `frame header | data header | byte_len data bytes`. The transport
//! reads the first two with [`read_frame_header`](super::read_frame_header) and
//! [`read_data_header`](super::read_data_header), checks the target against the room,
//! then reads the data bytes straight into destination memory.
//!
//! Data header layout ([`DATA_HEADER_LEN`] = 48 bytes, little-endian):
//!
//! | offset | size | field        |
//! |-------:|-----:|--------------|
//! | 0      | 8    | `room`       |
//! | 8      | 8    | `generation` |
//! | 16     | 4    | `buffer`     |
//! | 20     | 4    | `first_page` |
//! | 24     | 4    | `n_pages`    |
//! | 28     | 4    | `byte_len`   |
//! | 32     | 1    | `target` (0 = kv, 1 = aux) |
//! | 33     | 3    | reserved, must be 0 |
//! | 36     | 4    | `page_off`   |
//! | 40     | 4    | `digest`     |
//! | 44     | 4    | reserved, must be 0 |

use super::frame::{FrameHeader, Kind, Limits, ProtoError};
use super::{DATA_FRAME_PREFIX_LEN, DATA_HEADER_LEN, DATA_HEADER_LEN_U32, FRAME_HEADER_LEN};

/// Which registered buffer list a data frame writes into.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Target {
    /// A KV buffer (`Registration::kv`).
    Kv = 0,
    /// An aux buffer (`Registration::aux`); pages are aux slots.
    Aux = 1,
}

impl TryFrom<u8> for Target {
    type Error = ProtoError;

    /// Total conversion from the wire value; unknown values give
    /// [`ProtoError::BadTarget`].
    fn try_from(v: u8) -> Result<Target, ProtoError> {
        match v {
            0 => Ok(Target::Kv),
            1 => Ok(Target::Aux),
            found => Err(ProtoError::BadTarget { found }),
        }
    }
}

/// Describes the bytes of one data frame: `n_pages` consecutive pages starting at
/// `first_page` of buffer `buffer` in the `target` list, `byte_len` bytes in all; or,
/// between engines whose layouts differ (a head slice, a page of another size), the
/// `byte_len` bytes at `page_off` inside the one page `first_page`.
///
/// The codec checks only what the header alone can tell: `n_pages >= 1`, the page range
/// does not overflow u32, `page_off` only with one page, `byte_len` matches the frame
/// and is within [`Limits::max_data_bytes`]. Whether the room and generation are live, the buffer
/// exists, the pages were granted to the room, and `byte_len` equals
/// `n_pages * item_len` (or the head slice) is the engine's job, before any byte is
/// written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DataHeader {
    /// Room id.
    pub room: u64,
    /// Generation of the room id.
    pub generation: u64,
    /// KV or aux buffers.
    pub target: Target,
    /// Index of the buffer in its registered list.
    pub buffer: u32,
    /// First destination page (aux slot for [`Target::Aux`]).
    pub first_page: u32,
    /// Number of consecutive pages; at least 1.
    pub n_pages: u32,
    /// Data bytes following the header.
    pub byte_len: u32,
    /// Where in the page the bytes start; 0 for whole pages. Not 0 only with one page.
    pub page_off: u32,
    /// With `integrity=verify`: the CRC32C of this header (with `digest` 0) followed by
    /// the run's bytes ([`crate::integrity`]), which the decode engine recomputes over
    /// the bytes where they landed; 0 otherwise.
    pub digest: u32,
}

impl DataHeader {
    /// One past the last page: `first_page + n_pages`, or `None` on overflow.
    pub fn end_page(&self) -> Option<u32> {
        self.first_page.checked_add(self.n_pages)
    }

    /// The frame's `payload_len`: [`DATA_HEADER_LEN`] + `byte_len`, or `None` if that
    /// does not fit in u32.
    pub fn frame_payload_len(&self) -> Option<u32> {
        DATA_HEADER_LEN_U32.checked_add(self.byte_len)
    }

    /// Checks the fields a receiver using `limits` would check: `n_pages >= 1`,
    /// `byte_len <= max_data_bytes`, `first_page + n_pages` fits in u32, and a
    /// `page_off` only with one page.
    pub fn check(&self, limits: &Limits) -> Result<(), ProtoError> {
        if self.n_pages == 0 {
            return Err(ProtoError::ZeroPages);
        }
        if self.page_off != 0 && self.n_pages != 1 {
            return Err(ProtoError::OffsetInSeveralPages {
                page_off: self.page_off,
                n_pages: self.n_pages,
            });
        }
        if self.byte_len > limits.max_data_bytes {
            return Err(ProtoError::DataTooLarge {
                byte_len: self.byte_len,
                max: limits.max_data_bytes,
            });
        }
        if self.end_page().is_none() {
            return Err(ProtoError::PageRangeOverflow {
                first_page: self.first_page,
                n_pages: self.n_pages,
            });
        }
        Ok(())
    }

    /// The data header's wire form (without the frame header).
    pub fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut out = [0u8; DATA_HEADER_LEN];
        out[0..8].copy_from_slice(&self.room.to_le_bytes());
        out[8..16].copy_from_slice(&self.generation.to_le_bytes());
        out[16..20].copy_from_slice(&self.buffer.to_le_bytes());
        out[20..24].copy_from_slice(&self.first_page.to_le_bytes());
        out[24..28].copy_from_slice(&self.n_pages.to_le_bytes());
        out[28..32].copy_from_slice(&self.byte_len.to_le_bytes());
        out[32] = self.target as u8;
        // out[33..36]: reserved, zero.
        out[36..40].copy_from_slice(&self.page_off.to_le_bytes());
        out[40..44].copy_from_slice(&self.digest.to_le_bytes());
        // out[44..48]: reserved, zero.
        out
    }

    /// Writes the frame header (kind [`Kind::Data`], `payload_len` =
    /// [`DATA_HEADER_LEN`] + `byte_len`) followed by the data header. The caller then
    /// sends `byte_len` data bytes.
    ///
    /// Fails only with [`ProtoError::EncodeTooLarge`] if the payload length overflows
    /// u32 (`out` is then untouched). Limits are not applied: call
    /// [`DataHeader::check`] first if the fields are not known to be within them.
    pub fn encode_frame(&self, out: &mut [u8; DATA_FRAME_PREFIX_LEN]) -> Result<(), ProtoError> {
        let payload_len = self.frame_payload_len().ok_or(ProtoError::EncodeTooLarge {
            kind: Kind::Data,
            len: DATA_HEADER_LEN as u64 + u64::from(self.byte_len),
        })?;
        out[..FRAME_HEADER_LEN]
            .copy_from_slice(&FrameHeader::new(Kind::Data, payload_len).encode());
        out[FRAME_HEADER_LEN..].copy_from_slice(&self.encode());
        Ok(())
    }

    /// Decodes and validates the data header of a data frame whose header announced
    /// `frame_payload_len`: target, reserved bytes, `byte_len == frame_payload_len -
    /// DATA_HEADER_LEN`, then [`DataHeader::check`].
    pub fn decode(
        buf: &[u8; DATA_HEADER_LEN],
        frame_payload_len: u32,
        limits: &Limits,
    ) -> Result<Self, ProtoError> {
        let Some(expected_len) = frame_payload_len.checked_sub(DATA_HEADER_LEN_U32) else {
            return Err(ProtoError::PayloadTooSmall {
                kind: Kind::Data,
                len: frame_payload_len,
                min: DATA_HEADER_LEN_U32,
            });
        };
        let h = DataHeader::decode_fields(buf)?;
        if h.byte_len != expected_len {
            return Err(ProtoError::DataLenMismatch {
                byte_len: h.byte_len,
                frame_payload_len,
            });
        }
        h.check(limits)?;
        Ok(h)
    }

    /// Decodes a data header's fields (target and reserved bytes checked, nothing else).
    pub(super) fn decode_fields(buf: &[u8; DATA_HEADER_LEN]) -> Result<Self, ProtoError> {
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&buf[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
        let target = Target::try_from(buf[32])?;
        let mut reserved = [0u8; 8];
        reserved[..3].copy_from_slice(&buf[33..36]);
        reserved[3..7].copy_from_slice(&buf[44..48]);
        let reserved = u64::from_le_bytes(reserved);
        if reserved != 0 {
            return Err(ProtoError::NonzeroReserved {
                field: "DataHeader.reserved",
                found: reserved,
            });
        }
        Ok(DataHeader {
            room: u64_at(0),
            generation: u64_at(8),
            target,
            buffer: u32_at(16),
            first_page: u32_at(20),
            n_pages: u32_at(24),
            byte_len: u32_at(28),
            page_off: u32_at(36),
            digest: u32_at(40),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> DataHeader {
        DataHeader {
            room: 0xABCD,
            generation: 3,
            target: Target::Kv,
            buffer: 17,
            first_page: 100,
            n_pages: 4,
            byte_len: 4 * 4096,
            page_off: 0,
            digest: 0,
        }
    }

    fn split(
        frame: &[u8; DATA_FRAME_PREFIX_LEN],
    ) -> ([u8; FRAME_HEADER_LEN], [u8; DATA_HEADER_LEN]) {
        let mut h = [0u8; FRAME_HEADER_LEN];
        let mut d = [0u8; DATA_HEADER_LEN];
        h.copy_from_slice(&frame[..FRAME_HEADER_LEN]);
        d.copy_from_slice(&frame[FRAME_HEADER_LEN..]);
        (h, d)
    }

    fn round_trip(d: &DataHeader, limits: &Limits) -> Result<DataHeader, ProtoError> {
        let mut frame = [0u8; DATA_FRAME_PREFIX_LEN];
        d.encode_frame(&mut frame)?;
        let (h, b) = split(&frame);
        let fh = FrameHeader::decode(&h, limits)?;
        assert_eq!(fh.kind, Kind::Data);
        DataHeader::decode(&b, fh.payload_len, limits)
    }

    #[test]
    fn data_header_round_trips_with_edge_values() {
        let limits = Limits {
            max_data_bytes: u32::MAX - DATA_HEADER_LEN_U32,
            ..Limits::default()
        };
        let cases = [
            sample(),
            DataHeader {
                room: u64::MAX,
                generation: u64::MAX,
                target: Target::Aux,
                buffer: u32::MAX,
                first_page: u32::MAX - 1,
                n_pages: 1,
                byte_len: u32::MAX - DATA_HEADER_LEN_U32,
                page_off: u32::MAX,
                digest: 0,
            },
            DataHeader {
                room: 0,
                generation: 0,
                target: Target::Kv,
                buffer: 0,
                first_page: 0,
                n_pages: u32::MAX,
                byte_len: 0,
                page_off: 0,
                digest: 0,
            },
        ];
        for d in cases {
            assert_eq!(round_trip(&d, &limits), Ok(d));
            assert_eq!(d.check(&limits), Ok(()));
        }
    }

    #[test]
    fn an_offset_into_a_page_goes_with_one_page_only() {
        let limits = Limits::default();
        let slice = DataHeader {
            n_pages: 1,
            byte_len: 512,
            page_off: 1024,
            digest: 0,
            ..sample()
        };
        assert_eq!(round_trip(&slice, &limits), Ok(slice));
        let several = DataHeader {
            n_pages: 2,
            ..slice
        };
        assert_eq!(
            round_trip(&several, &limits),
            Err(ProtoError::OffsetInSeveralPages {
                page_off: 1024,
                n_pages: 2
            })
        );
        // The bytes before page_off stay reserved.
        let mut frame = [0u8; DATA_FRAME_PREFIX_LEN];
        slice.encode_frame(&mut frame).unwrap();
        let (_, mut b) = split(&frame);
        b[35] = 1;
        assert!(matches!(
            DataHeader::decode(&b, 48 + 512, &limits),
            Err(ProtoError::NonzeroReserved { .. })
        ));
    }

    #[test]
    fn frame_header_announces_data_header_plus_bytes() {
        let mut frame = [0u8; DATA_FRAME_PREFIX_LEN];
        sample().encode_frame(&mut frame).unwrap();
        let (h, _) = split(&frame);
        let fh = FrameHeader::decode(&h, &Limits::default()).unwrap();
        assert_eq!(fh, FrameHeader::new(Kind::Data, 48 + 4 * 4096));
        assert_eq!(sample().end_page(), Some(104));
    }

    #[test]
    fn encode_frame_rejects_payload_overflow_and_leaves_buffer() {
        let d = DataHeader {
            byte_len: u32::MAX - DATA_HEADER_LEN_U32 + 1,
            ..sample()
        };
        let mut frame = [7u8; DATA_FRAME_PREFIX_LEN];
        assert_eq!(
            d.encode_frame(&mut frame),
            Err(ProtoError::EncodeTooLarge {
                kind: Kind::Data,
                len: u64::from(u32::MAX) + 1
            })
        );
        assert_eq!(frame, [7u8; DATA_FRAME_PREFIX_LEN]);
    }

    #[test]
    fn byte_len_must_match_frame_payload_len() {
        let b = sample().encode();
        let e = DataHeader::decode(&b, 48 + 4 * 4096 + 1, &Limits::default()).unwrap_err();
        assert_eq!(
            e,
            ProtoError::DataLenMismatch {
                byte_len: 4 * 4096,
                frame_payload_len: 48 + 4 * 4096 + 1
            }
        );
        assert!(e.to_string().contains("16384"), "{e}");
        assert_eq!(
            DataHeader::decode(&b, 47, &Limits::default()),
            Err(ProtoError::PayloadTooSmall {
                kind: Kind::Data,
                len: 47,
                min: 48
            })
        );
    }

    #[test]
    fn byte_len_over_limit_is_rejected() {
        let limits = Limits {
            max_data_bytes: 4096,
            ..Limits::default()
        };
        let d = sample();
        assert_eq!(
            DataHeader::decode(&d.encode(), 48 + d.byte_len, &limits),
            Err(ProtoError::DataTooLarge {
                byte_len: 4 * 4096,
                max: 4096
            })
        );
    }

    #[test]
    fn zero_pages_is_rejected() {
        let d = DataHeader {
            n_pages: 0,
            ..sample()
        };
        assert_eq!(
            round_trip(&d, &Limits::default()),
            Err(ProtoError::ZeroPages)
        );
    }

    #[test]
    fn page_range_overflow_is_rejected() {
        let d = DataHeader {
            first_page: u32::MAX,
            n_pages: 1,
            ..sample()
        };
        let e = round_trip(&d, &Limits::default()).unwrap_err();
        assert_eq!(
            e,
            ProtoError::PageRangeOverflow {
                first_page: u32::MAX,
                n_pages: 1
            }
        );
        assert!(e.to_string().contains("overflows"), "{e}");
    }

    #[test]
    fn bad_target_and_reserved_bytes_are_rejected() {
        let d = sample();
        let mut b = d.encode();
        b[32] = 2;
        assert_eq!(
            DataHeader::decode(&b, 48 + d.byte_len, &Limits::default()),
            Err(ProtoError::BadTarget { found: 2 })
        );
        let mut b = d.encode();
        b[35] = 1;
        assert_eq!(
            DataHeader::decode(&b, 48 + d.byte_len, &Limits::default()),
            Err(ProtoError::NonzeroReserved {
                field: "DataHeader.reserved",
                found: 1 << 16
            })
        );
    }
}
