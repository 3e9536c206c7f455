//! `kvxfer_kv_layout`: the layout of an engine's KV pages, as the host gives it to
//! `kvxfer_register_kv_layout`, and its conversion to [`KvLayout`].

use crate::err;
use crate::error::Result;
use crate::layout::{KvKind, KvLayout, PageOrder};

/// The order of one page's elements (values of `kvxfer_kv_layout.page_order`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_page_order {
    /// Heads-major: a page is `[head][token][dim]`.
    KVXFER_PAGE_HND = 0,
    /// Tokens-major: a page is `[token][head][dim]`.
    KVXFER_PAGE_NHD = 1,
}

/// What the KV buffers hold (values of `kvxfer_kv_layout.kind`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum kvxfer_kv_kind {
    /// MHA/GQA: K or V buffers, each rank holding `kv_heads / tp_size` of the model's KV
    /// heads (or, with fewer heads than ranks, a replica of head
    /// `tp_rank / (tp_size / kv_heads)`).
    KVXFER_KV_HEADS = 0,
    /// MLA: one latent per token (`kv_heads` 1, `head_dim` its width), the whole of it
    /// replicated on every rank.
    KVXFER_KV_LATENT = 1,
}

/// The layout of an engine's KV pages (`kvxfer_register_kv_layout`): the model's KV heads,
/// this engine's tensor-parallel rank, and how a page is laid out. Set `struct_size` to
/// `sizeof(kvxfer_kv_layout)`: fields are only ever appended, and the library refuses a
/// size it does not know.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct kvxfer_kv_layout {
    /// `sizeof(kvxfer_kv_layout)` as the caller compiled it.
    pub struct_size: usize,
    /// KV heads of the whole model (not per rank); 1 for `KVXFER_KV_LATENT`.
    pub kv_heads: u32,
    /// Elements per head (for a latent, its width, e.g. 576).
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16, 1 for fp8).
    pub dtype_bytes: u32,
    /// This engine's tensor-parallel rank, below `tp_size`.
    pub tp_rank: u32,
    /// Tensor-parallel ranks of this engine's side. With `KVXFER_KV_HEADS`, `kv_heads`
    /// must be a multiple of it, or (fewer heads than ranks) it a multiple of `kv_heads`.
    pub tp_size: u32,
    /// Tokens per page.
    pub page_tokens: u32,
    /// A `kvxfer_page_order` value.
    pub page_order: u32,
    /// A `kvxfer_kv_kind` value.
    pub kind: u32,
}

/// The sizes of `kvxfer_kv_layout` the library reads. One version so far.
const SIZES: [usize; 1] = [std::mem::size_of::<kvxfer_kv_layout>()];

/// Reads the caller's layout: its `struct_size` first, then (if it is one the library
/// knows) the whole struct, converting the enums (unknown values are an error naming the
/// field). The layout's own rules are checked where it is registered.
///
/// # Safety
/// A non-NULL `p` must point to a readable `kvxfer_kv_layout` of at least
/// `(*p).struct_size` bytes (and at least its `struct_size` field).
pub(crate) unsafe fn read(p: *const kvxfer_kv_layout) -> Result<KvLayout> {
    if p.is_null() {
        return Err(err!(NullPointer, "argument 'layout' is NULL"));
    }
    if !p.is_aligned() {
        return Err(err!(InvalidArgument, "argument 'layout' is misaligned"));
    }
    // SAFETY: non-NULL and aligned; every version of the struct starts with struct_size,
    // which the caller guarantees readable. No reference to the whole struct is made.
    let size = unsafe { std::ptr::addr_of!((*p).struct_size).read() };
    let ours = std::mem::size_of::<kvxfer_kv_layout>();
    if !SIZES.contains(&size) {
        let hint = if size > ours {
            format!(
                "larger than this library's ({}): the caller was built against a newer \
                 kvxfer.h",
                crate::VERSION
            )
        } else {
            "set it to sizeof(kvxfer_kv_layout)".to_string()
        };
        return Err(err!(
            InvalidArgument,
            "layout.struct_size is {size}, not sizeof(kvxfer_kv_layout) = {ours}; {hint}"
        ));
    }
    // SAFETY: the caller guarantees `size` readable bytes, and `size` is the full size.
    let c = unsafe { p.read() };
    let order = PageOrder::from_value(c.page_order).ok_or_else(|| {
        err!(
            InvalidArgument,
            "layout.page_order {} is neither KVXFER_PAGE_HND (0) nor KVXFER_PAGE_NHD (1)",
            c.page_order
        )
    })?;
    let kind = KvKind::from_value(c.kind).ok_or_else(|| {
        err!(
            InvalidArgument,
            "layout.kind {} is neither KVXFER_KV_HEADS (0) nor KVXFER_KV_LATENT (1)",
            c.kind
        )
    })?;
    Ok(KvLayout {
        kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        dtype_bytes: c.dtype_bytes,
        tp_rank: c.tp_rank,
        tp_size: c.tp_size,
        page_tokens: c.page_tokens,
        order,
        kind,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    fn good() -> kvxfer_kv_layout {
        kvxfer_kv_layout {
            struct_size: std::mem::size_of::<kvxfer_kv_layout>(),
            kv_heads: 8,
            head_dim: 128,
            dtype_bytes: 2,
            tp_rank: 1,
            tp_size: 2,
            page_tokens: 16,
            page_order: kvxfer_page_order::KVXFER_PAGE_NHD as u32,
            kind: kvxfer_kv_kind::KVXFER_KV_HEADS as u32,
        }
    }

    fn read_of(c: kvxfer_kv_layout) -> Result<KvLayout> {
        // SAFETY: a local of the full size.
        unsafe { read(&c) }
    }

    #[test]
    fn the_c_values_are_the_layout_values() {
        assert_eq!(
            PageOrder::from_value(kvxfer_page_order::KVXFER_PAGE_HND as u32),
            Some(PageOrder::Hnd)
        );
        assert_eq!(
            PageOrder::from_value(kvxfer_page_order::KVXFER_PAGE_NHD as u32),
            Some(PageOrder::Nhd)
        );
        assert_eq!(
            KvKind::from_value(kvxfer_kv_kind::KVXFER_KV_HEADS as u32),
            Some(KvKind::Heads)
        );
        assert_eq!(
            KvKind::from_value(kvxfer_kv_kind::KVXFER_KV_LATENT as u32),
            Some(KvKind::Latent)
        );
    }

    #[test]
    fn a_full_struct_converts_field_by_field() {
        let l = read_of(good()).unwrap();
        assert_eq!(
            l,
            KvLayout {
                kv_heads: 8,
                head_dim: 128,
                dtype_bytes: 2,
                tp_rank: 1,
                tp_size: 2,
                page_tokens: 16,
                order: PageOrder::Nhd,
                kind: KvKind::Heads,
            }
        );
    }

    #[test]
    fn null_sizes_it_does_not_know_and_unknown_enums_are_refused() {
        // SAFETY: NULL is checked first.
        let e = unsafe { read(std::ptr::null()) }.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::NullPointer);
        for size in [0, 8, 39, 41, 64] {
            let e = read_of(kvxfer_kv_layout {
                struct_size: size,
                ..good()
            })
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument);
            assert!(
                e.message()
                    .contains(&format!("layout.struct_size is {size}, not sizeof")),
                "{e}"
            );
        }
        let e = read_of(kvxfer_kv_layout {
            page_order: 2,
            ..good()
        })
        .unwrap_err();
        assert!(
            e.message().contains("layout.page_order 2 is neither"),
            "{e}"
        );
        let e = read_of(kvxfer_kv_layout { kind: 7, ..good() }).unwrap_err();
        assert!(e.message().contains("layout.kind 7 is neither"), "{e}");
    }
}
