//! One engine's entry in the registry: who it is (engine id, incarnation, role, instance
//! and rank), where it listens, how it moves data, and its KV registration (buffers and
//! layout, as the registration exchange carries them, without RDMA keys), signed with
//! the cluster key.
//!
//! Stored under `<prefix><instance>/<rank>` as the entry's JSON body, a newline, and
//! `hmac-sha256:` with the hex tag of the body bound to that key name
//! ([`Key::sign_entry`]). A reader takes an entry only when the tag verifies and the
//! body's instance and rank are the ones its name says.

use serde_json::{json, Value};

use crate::auth::{hex, Key};
use crate::config::{valid_instance, Role};
use crate::layout::{KvKind, KvLayout, PageOrder};
use crate::proto::{BufferInfo, Registration};

/// The format version of a body.
const VERSION: u64 = 1;
const TAG: &str = "hmac-sha256:";

/// An engine as its registry entry describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub engine_id: u64,
    /// Changes on every start of an engine (its start time in µs since the epoch, with
    /// random low bits): a newer entry for the same name has a larger one.
    pub incarnation: u64,
    pub role: Role,
    pub instance: String,
    pub rank: u32,
    /// Ranks of the instance: an instance is whole when ranks `0..ranks` are present.
    pub ranks: u32,
    /// `host:port` its peers connect to.
    pub address: String,
    /// `tcp` or `rdma`: what the engine moves data over.
    pub transport: String,
    /// Its lease's TTL.
    pub ttl_ms: u64,
    /// Its KV and aux buffers and KV layout (addresses and RDMA keys zero).
    pub registration: Registration,
}

impl Entry {
    /// The etcd key of the entry under `prefix`.
    pub fn key(&self, prefix: &str) -> String {
        format!("{prefix}{}/{}", self.instance, self.rank)
    }

    fn body(&self) -> String {
        let r = &self.registration;
        let layout = r.layout.map(|l| {
            json!({
                "kv_heads": l.kv_heads, "head_dim": l.head_dim, "dtype_bytes": l.dtype_bytes,
                "tp_rank": l.tp_rank, "tp_size": l.tp_size, "page_tokens": l.page_tokens,
                "page_order": l.order.value(), "kind": l.kind.value(),
            })
        });
        json!({
            "v": VERSION,
            "engine_id": format!("{:016x}", self.engine_id),
            "incarnation": self.incarnation,
            "role": self.role.to_string(),
            "instance": self.instance,
            "rank": self.rank,
            "ranks": self.ranks,
            "address": self.address,
            "transport": self.transport,
            "ttl_ms": self.ttl_ms,
            "integrity": r.integrity,
            "layout": layout,
            "kv": r.kv.iter().map(|b| json!([b.len, b.item_len, b.layer_id])).collect::<Vec<_>>(),
            "aux": r.aux.iter().map(|b| json!([b.len, b.item_len])).collect::<Vec<_>>(),
        })
        .to_string()
    }

    /// The value stored under [`Entry::key`]: the body and its tag under `key`.
    pub fn sign(&self, prefix: &str, key: &Key) -> Vec<u8> {
        let body = self.body();
        let tag = key.sign_entry(self.key(prefix).as_bytes(), body.as_bytes());
        format!("{body}\n{TAG}{}", hex(&tag)).into_bytes()
    }

    /// The entry stored as `value` under etcd key `name` (below `prefix`), if its tag
    /// verifies under `key` and its body is well formed and matches its name; why not
    /// otherwise.
    pub fn verify(prefix: &str, name: &[u8], value: &[u8], key: &Key) -> Result<Entry, String> {
        let text = std::str::from_utf8(value).map_err(|_| "the value is not text")?;
        let (body, tag) = text
            .rsplit_once('\n')
            .ok_or("no signature (an unsigned value)")?;
        let tag = tag
            .strip_prefix(TAG)
            .and_then(unhex)
            .ok_or("the signature line is malformed")?;
        if !key.verify_entry(name, body.as_bytes(), &tag) {
            return Err("the signature does not verify under the cluster key".into());
        }
        let e = parse(body)?;
        if e.key(prefix).as_bytes() != name {
            return Err(format!(
                "signed for instance {} rank {}, stored under another name",
                e.instance, e.rank
            ));
        }
        Ok(e)
    }
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn parse(body: &str) -> Result<Entry, String> {
    let v: Value = serde_json::from_str(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let u = |f: &str| {
        v.get(f)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("field '{f}' missing or not a number"))
    };
    let s = |f: &str| {
        v.get(f)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("field '{f}' missing or not text"))
    };
    let u32_of =
        |f: &str| u(f).and_then(|n| u32::try_from(n).map_err(|_| format!("'{f}' too large")));
    if u("v")? != VERSION {
        return Err(format!(
            "entry format {} (this build reads {VERSION})",
            u("v")?
        ));
    }
    let engine_id = u64::from_str_radix(s("engine_id")?, 16).map_err(|_| "bad engine_id")?;
    let role = match s("role")? {
        "prefill" => Role::Prefill,
        "decode" => Role::Decode,
        other => return Err(format!("unknown role '{other}'")),
    };
    let instance = s("instance")?.to_string();
    if !valid_instance(&instance) {
        return Err(format!("bad instance name {instance:?}"));
    }
    let (rank, ranks) = (u32_of("rank")?, u32_of("ranks")?);
    if rank >= ranks {
        return Err(format!("rank {rank} of {ranks}"));
    }
    let address = s("address")?.to_string();
    crate::config::parse_host_port(&address).map_err(|e| format!("bad address: {e}"))?;
    let layout = match v.get("layout") {
        None | Some(Value::Null) => None,
        Some(l) => Some(parse_layout(l)?),
    };
    let buffers = |f: &str, with_layer: bool| -> Result<Vec<BufferInfo>, String> {
        let list = v
            .get(f)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("field '{f}' missing"))?;
        if list.len() > crate::node::MAX_BUFFERS {
            return Err(format!("{} {f} buffers", list.len()));
        }
        list.iter()
            .map(|b| {
                let n = |i: usize| b.get(i).and_then(Value::as_u64);
                let layer = if with_layer {
                    b.get(2)
                        .and_then(Value::as_i64)
                        .and_then(|l| i32::try_from(l).ok())
                } else {
                    Some(BufferInfo::NO_LAYER)
                };
                match (n(0), n(1), layer) {
                    (Some(len), Some(item_len), Some(layer_id)) if item_len > 0 => Ok(BufferInfo {
                        len,
                        item_len,
                        layer_id,
                        addr: 0,
                        rkey: 0,
                    }),
                    _ => Err(format!("a malformed {f} buffer: {b}")),
                }
            })
            .collect()
    };
    Ok(Entry {
        engine_id,
        incarnation: u("incarnation")?,
        role,
        instance,
        rank,
        ranks,
        address,
        transport: s("transport")?.to_string(),
        ttl_ms: u("ttl_ms")?,
        registration: Registration {
            kv: buffers("kv", true)?,
            aux: buffers("aux", false)?,
            layout,
            integrity: v.get("integrity").and_then(Value::as_bool).unwrap_or(false),
        },
    })
}

fn parse_layout(l: &Value) -> Result<KvLayout, String> {
    let f = |name: &str| {
        l.get(name)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("layout field '{name}' missing or malformed"))
    };
    let layout = KvLayout {
        kv_heads: f("kv_heads")?,
        head_dim: f("head_dim")?,
        dtype_bytes: f("dtype_bytes")?,
        tp_rank: f("tp_rank")?,
        tp_size: f("tp_size")?,
        page_tokens: f("page_tokens")?,
        order: PageOrder::from_value(f("page_order")?).ok_or("bad layout page_order")?,
        kind: KvKind::from_value(f("kind")?).ok_or("bad layout kind")?,
    };
    layout.check().map_err(|e| format!("bad layout: {e}"))?;
    Ok(layout)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> Key {
        Key::new(vec![b; 32]).unwrap()
    }

    pub(crate) fn entry() -> Entry {
        Entry {
            engine_id: 0x0123_4567_89ab_cdef,
            incarnation: 1_700_000_000_000_123,
            role: Role::Prefill,
            instance: "prefill-a".into(),
            rank: 1,
            ranks: 2,
            address: "10.0.0.7:4000".into(),
            transport: "tcp".into(),
            ttl_ms: 3000,
            registration: Registration {
                kv: vec![BufferInfo {
                    len: 4096,
                    item_len: 1024,
                    layer_id: 3,
                    addr: 0,
                    rkey: 0,
                }],
                aux: vec![BufferInfo {
                    len: 64,
                    item_len: 8,
                    layer_id: BufferInfo::NO_LAYER,
                    addr: 0,
                    rkey: 0,
                }],
                layout: Some(crate::layout::tests::gqa(2, 1)),
                integrity: true,
            },
        }
    }

    #[test]
    fn a_signed_entry_verifies_whole_under_its_own_name_only() {
        let e = entry();
        let value = e.sign("/kvxfer/", &key(1));
        let name = b"/kvxfer/prefill-a/1";
        assert_eq!(Entry::verify("/kvxfer/", name, &value, &key(1)).unwrap(), e);
        let wrong = Entry::verify("/kvxfer/", name, &value, &key(2)).unwrap_err();
        assert!(wrong.contains("does not verify"), "{wrong}");
        // The same value copied under another rank's name.
        let moved = Entry::verify("/kvxfer/", b"/kvxfer/prefill-a/0", &value, &key(1));
        assert!(moved.unwrap_err().contains("does not verify"));
    }

    #[test]
    fn a_changed_byte_or_a_missing_tag_is_refused() {
        let e = entry();
        let value = e.sign("/kvxfer/", &key(1));
        let name = b"/kvxfer/prefill-a/1";
        let text = String::from_utf8(value.clone()).unwrap();
        let forged = text.replace("10.0.0.7:4000", "10.6.6.6:4000");
        assert!(Entry::verify("/kvxfer/", name, forged.as_bytes(), &key(1)).is_err());
        let body = text.rsplit_once('\n').unwrap().0;
        let unsigned = Entry::verify("/kvxfer/", name, body.as_bytes(), &key(1));
        assert!(unsigned.unwrap_err().contains("no signature"));
        assert!(Entry::verify("/kvxfer/", name, b"", &key(1)).is_err());
    }

    #[test]
    fn instance_names_are_plain() {
        assert!(valid_instance("prefill-a.0_x"));
        for bad in ["", "a/b", "a b", &"x".repeat(129)] {
            assert!(!valid_instance(bad), "{bad:?}");
        }
    }
}
