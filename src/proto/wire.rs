//! Bounds-checked little-endian cursor over a payload, and encoding helpers.
//!
//! Every read checks the remaining length first and reports the field it was reading,
//! so a truncated payload yields [`ProtoError::Truncated`] naming the field.

use super::frame::{Kind, ProtoError};

/// A read cursor over one frame payload.
pub(super) struct WireReader<'a> {
    rest: &'a [u8],
    kind: Kind,
}

impl<'a> WireReader<'a> {
    /// A cursor over `payload`, which belongs to a frame of `kind`.
    pub(super) fn new(payload: &'a [u8], kind: Kind) -> Self {
        WireReader {
            rest: payload,
            kind,
        }
    }

    /// Bytes not yet consumed.
    pub(super) fn remaining(&self) -> usize {
        self.rest.len()
    }

    /// Consumes exactly `n` bytes, or fails naming `field` without consuming anything.
    pub(super) fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtoError> {
        if self.rest.len() < n {
            return Err(ProtoError::Truncated {
                field,
                needed: n,
                remaining: self.rest.len(),
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ProtoError> {
        let bytes = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub(super) fn u8(&mut self, field: &'static str) -> Result<u8, ProtoError> {
        Ok(self.array::<1>(field)?[0])
    }

    /// A byte that must be 0 (false) or 1 (true).
    pub(super) fn bool(&mut self, field: &'static str) -> Result<bool, ProtoError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            found => Err(ProtoError::BadBool { field, found }),
        }
    }

    /// `n` (at most 8) reserved bytes, which must be zero; the error carries them as a
    /// little-endian number.
    pub(super) fn reserved(&mut self, n: usize, field: &'static str) -> Result<(), ProtoError> {
        debug_assert!(n <= 8);
        let b = self.take(n, field)?;
        if b.iter().all(|&x| x == 0) {
            return Ok(());
        }
        let mut le = [0u8; 8];
        le[..n].copy_from_slice(b);
        Err(ProtoError::NonzeroReserved {
            field,
            found: u64::from_le_bytes(le),
        })
    }

    pub(super) fn u16(&mut self, field: &'static str) -> Result<u16, ProtoError> {
        self.array(field).map(u16::from_le_bytes)
    }

    pub(super) fn u32(&mut self, field: &'static str) -> Result<u32, ProtoError> {
        self.array(field).map(u32::from_le_bytes)
    }

    pub(super) fn u64(&mut self, field: &'static str) -> Result<u64, ProtoError> {
        self.array(field).map(u64::from_le_bytes)
    }

    pub(super) fn i32(&mut self, field: &'static str) -> Result<i32, ProtoError> {
        self.array(field).map(i32::from_le_bytes)
    }

    pub(super) fn i64(&mut self, field: &'static str) -> Result<i64, ProtoError> {
        self.array(field).map(i64::from_le_bytes)
    }

    /// Reads a u32 element count and checks it against `max` (the limit called
    /// `limit_name`) and against the bytes remaining for `elem_size`-byte elements, so
    /// the caller may allocate `count` elements.
    pub(super) fn count(
        &mut self,
        field: &'static str,
        limit_name: &'static str,
        max: u32,
        elem_size: usize,
    ) -> Result<usize, ProtoError> {
        let count = self.u32(field)?;
        if count > max {
            return Err(ProtoError::CountOverLimit {
                field,
                count: u64::from(count),
                limit: limit_name,
                max: u64::from(max),
            });
        }
        let remaining = self.remaining();
        let fits = (elem_size as u64)
            .checked_mul(u64::from(count))
            .is_some_and(|needed| needed <= remaining as u64);
        match usize::try_from(count) {
            Ok(n) if fits => Ok(n),
            _ => Err(ProtoError::CountExceedsPayload {
                field,
                count,
                elem_size,
                remaining,
            }),
        }
    }

    /// Succeeds only if the whole payload was consumed.
    pub(super) fn finish(self) -> Result<(), ProtoError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(ProtoError::TrailingBytes {
                kind: self.kind,
                extra: self.rest.len(),
            })
        }
    }
}

/// Appends `v` little-endian.
pub(super) fn put_u16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` little-endian.
pub(super) fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` little-endian.
pub(super) fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` little-endian.
pub(super) fn put_i32(out: &mut Vec<u8>, v: i32) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// Appends `v` little-endian.
pub(super) fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_fields_in_order() {
        let bytes = [
            1, 0x34, 0x12, 0x78, 0x56, 0x34, 0x12, 0xff, 0xff, 0xff, 0xff,
        ];
        let mut r = WireReader::new(&bytes, Kind::Hello);
        assert_eq!(r.u8("a").unwrap(), 1);
        assert_eq!(r.u16("b").unwrap(), 0x1234);
        assert_eq!(r.u32("c").unwrap(), 0x1234_5678);
        assert_eq!(r.i32("d").unwrap(), -1);
        r.finish().unwrap();
    }

    #[test]
    fn short_read_names_field_and_consumes_nothing() {
        let bytes = [1, 2, 3];
        let mut r = WireReader::new(&bytes, Kind::Hello);
        assert_eq!(
            r.u64("Hello.engine_id"),
            Err(ProtoError::Truncated {
                field: "Hello.engine_id",
                needed: 8,
                remaining: 3
            })
        );
        assert_eq!(r.remaining(), 3);
    }

    #[test]
    fn count_is_checked_against_limit_then_remaining_bytes() {
        let mut bytes = 5u32.to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 19]);
        let mut r = WireReader::new(&bytes, Kind::Destination);
        assert!(matches!(
            r.count("f", "max_pages", 4, 4),
            Err(ProtoError::CountOverLimit {
                count: 5,
                max: 4,
                ..
            })
        ));
        let mut r = WireReader::new(&bytes, Kind::Destination);
        assert!(matches!(
            r.count("f", "max_pages", 10, 4),
            Err(ProtoError::CountExceedsPayload {
                count: 5,
                remaining: 19,
                ..
            })
        ));
        let mut r = WireReader::new(&bytes, Kind::Destination);
        assert_eq!(r.count("f", "max_pages", 10, 3), Ok(5));
    }

    #[test]
    fn huge_count_with_huge_element_does_not_overflow() {
        let bytes = u32::MAX.to_le_bytes();
        let mut r = WireReader::new(&bytes, Kind::Registration);
        assert!(matches!(
            r.count("f", "max_buffers", u32::MAX, usize::MAX),
            Err(ProtoError::CountExceedsPayload { .. })
        ));
    }

    #[test]
    fn unconsumed_bytes_are_trailing_bytes() {
        let bytes = [0u8; 9];
        let mut r = WireReader::new(&bytes, Kind::Heartbeat);
        r.u64("Heartbeat.seq").unwrap();
        assert_eq!(
            r.finish(),
            Err(ProtoError::TrailingBytes {
                kind: Kind::Heartbeat,
                extra: 1
            })
        );
    }
}
