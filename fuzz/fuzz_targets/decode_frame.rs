//! Fuzzes the frame decoder the way a receive loop uses it: back-to-back frames read
//! from a byte stream (header, then control payload, data header and data bytes, or a
//! `DataRuns` frame's run headers and bytes),
//! plus `Message::decode` and `DataHeader::decode` on the raw input.
//!
//! Never a panic; every accepted frame re-encodes to exactly the bytes it was read from.
//! The first input byte picks the limits (default, or small ones that make the bounds
//! reachable).

#![no_main]

use std::io::Read;

use kvxfer::proto::{
    self, DataHeader, Kind, Limits, Message, ReadError, DATA_FRAME_PREFIX_LEN, DATA_HEADER_LEN,
};
use libfuzzer_sys::fuzz_target;

fn read_frame(r: &mut &[u8], limits: &Limits) -> Result<Vec<u8>, ReadError> {
    let hdr = proto::read_frame_header(r, limits)?;
    if hdr.kind.is_control() {
        let m = proto::read_control(r, &hdr, limits)?;
        let mut out = Vec::new();
        m.encode(&mut out).expect("a decoded message encodes");
        return Ok(out);
    }
    if hdr.kind == Kind::DataRuns {
        let runs = proto::read_runs(r, &hdr, limits)?;
        let mut out = Vec::new();
        proto::encode_runs_prefix(&runs, &mut out).expect("decoded runs encode");
        let n: usize = runs.iter().map(|h| h.byte_len as usize).sum();
        let mut bytes = vec![0u8; n];
        r.read_exact(&mut bytes).map_err(ReadError::Io)?;
        out.extend(bytes);
        return Ok(out);
    }
    let d = proto::read_data_header(r, &hdr, limits)?;
    let mut bytes = vec![0u8; d.byte_len as usize];
    r.read_exact(&mut bytes).map_err(ReadError::Io)?;
    let mut prefix = [0u8; DATA_FRAME_PREFIX_LEN];
    d.encode_frame(&mut prefix)
        .expect("a decoded data header encodes");
    let mut out = prefix.to_vec();
    out.extend(bytes);
    Ok(out)
}

fuzz_target!(|input: &[u8]| {
    let Some((&pick, data)) = input.split_first() else {
        return;
    };
    let limits = if pick & 1 == 0 {
        Limits::default()
    } else {
        Limits {
            max_control_payload: 256,
            max_pages: 16,
            max_buffers: 4,
            max_reason_len: 32,
            max_data_bytes: 64,
            max_qps: 2,
        }
    };
    let mut r = data;
    for _ in 0..32 {
        let before = r;
        match read_frame(&mut r, &limits) {
            Ok(bytes) => {
                let consumed = before.len() - r.len();
                assert_eq!(&bytes[..], &before[..consumed], "not canonical");
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                break;
            }
        }
    }
    for kind in Kind::ALL {
        if let Ok(m) = Message::decode(kind, data, &limits) {
            let mut out = Vec::new();
            m.encode(&mut out).expect("a decoded message encodes");
            assert_eq!(&out[proto::FRAME_HEADER_LEN..], data, "not canonical");
        }
    }
    if data.len() >= DATA_HEADER_LEN {
        let mut h = [0u8; DATA_HEADER_LEN];
        h.copy_from_slice(&data[..DATA_HEADER_LEN]);
        let len = u32::from_le_bytes([pick, pick, 0, 0]);
        let _ = DataHeader::decode(&h, len, &limits);
    }
});
