//! The registered memory of test engines, and the bytes the tests put in it: the source
//! pattern on prefill engines, POISON where nothing may land.
use kvxfer::BufferDesc;

/// What a decode page holds until a transfer writes it (and again once its room
/// drained, to see that nothing lands after).
pub const POISON: u8 = 0xEE;

/// Byte `i` of page `page` of KV buffer `b` of a source engine: odd, so never POISON,
/// and different per buffer, page and byte.
pub fn pattern(b: usize, page: usize, i: usize) -> u8 {
    (b * 131 + page * 17 + i * 3) as u8 | 1
}

/// Registered memory that a test reads and writes only through raw pointers, so that the
/// engine writing into it from its own threads never aliases a Rust reference.
pub struct Region {
    ptr: *mut u8,
    len: usize,
    item: usize,
}

// SAFETY: the region is plain bytes; the engine and the test touch it only through raw
// pointers, and the tests check it when no write may be landing (the claim under test).
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// `pages` pages of `item` bytes, byte `i` set to `fill(i)`.
    pub fn new(pages: usize, item: usize, fill: impl Fn(usize) -> u8) -> Region {
        let bytes: Box<[u8]> = (0..pages * item).map(fill).collect();
        let len = bytes.len();
        Region {
            ptr: Box::into_raw(bytes).cast::<u8>(),
            len,
            item,
        }
    }

    /// The region as one KV buffer of its pages.
    pub fn desc(&self) -> BufferDesc {
        BufferDesc::host(self.ptr as usize, self.len, self.item)
    }

    /// A copy of page `p`.
    pub fn page(&self, p: u32) -> Vec<u8> {
        let mut out = vec![0u8; self.item];
        assert!((p as usize + 1) * self.item <= self.len);
        // SAFETY: checked above: the page lies inside the allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(p as usize * self.item),
                out.as_mut_ptr(),
                self.item,
            )
        };
        out
    }

    /// Fills page `p` with `byte`.
    pub fn poison(&self, p: u32, byte: u8) {
        assert!((p as usize + 1) * self.item <= self.len);
        // SAFETY: as in `page`.
        unsafe { std::ptr::write_bytes(self.ptr.add(p as usize * self.item), byte, self.item) };
    }

    /// Whether every byte of the region is `byte`.
    pub fn holds_only(&self, byte: u8) -> bool {
        (0..(self.len / self.item) as u32).all(|p| self.page(p).iter().all(|&x| x == byte))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of `len` bytes.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// `bufs` KV buffers of `pages` pages of `item` bytes holding the source [`pattern`].
pub fn source(bufs: usize, pages: usize, item: usize) -> Vec<Region> {
    (0..bufs)
        .map(|b| Region::new(pages, item, move |i| pattern(b, i / item, i % item)))
        .collect()
}

/// `bufs` KV buffers of `pages` pages of `item` bytes, every byte POISON.
pub fn poisoned(bufs: usize, pages: usize, item: usize) -> Vec<Region> {
    (0..bufs)
        .map(|_| Region::new(pages, item, |_| POISON))
        .collect()
}

/// Whether page `p` of every buffer in `mem`, for every `p` in `pages`, holds only `byte`.
pub fn all_filled(mem: &[Region], pages: &[u32], byte: u8) -> bool {
    pages
        .iter()
        .all(|&p| mem.iter().all(|m| m.page(p).iter().all(|&x| x == byte)))
}

/// Fills page `p` of every buffer in `mem` with `byte`, for every `p` in `pages`.
pub fn fill_pages(mem: &[Region], pages: &[u32], byte: u8) {
    for &p in pages {
        for m in mem {
            m.poison(p, byte);
        }
    }
}

/// The first (buffer, source page, destination page) whose destination page in `mem`
/// does not hold the [`pattern`] of its source page, pairing `src` with `dst` page by
/// page.
pub fn first_unlike_source(mem: &[Region], src: &[u32], dst: &[u32]) -> Option<(usize, u32, u32)> {
    src.iter().zip(dst).find_map(|(&s, &d)| {
        mem.iter()
            .enumerate()
            .find(|(b, m)| {
                let page = m.page(d);
                page.iter()
                    .enumerate()
                    .any(|(i, &x)| x != pattern(*b, s as usize, i))
            })
            .map(|(b, _)| (b, s, d))
    })
}
