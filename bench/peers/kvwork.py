"""The work every engine of the peer comparison does, and how its bytes are checked.

This is kvxfer-bench's work (kvxfer-bench/src/pattern.rs and pool.rs) written again in
Python, word for word, so that NIXL and Mooncake move and check exactly what libkvxfer
moves and checks in `kvxfer-bench --layers 1 --layout mla ...`:

- one registered buffer per side, cut into slots of `slot_pages` pages of `page_bytes`;
  page k of the request in source slot s is page s*slot_pages + k (in order), and lands
  in page d*slot_pages + perm[k] of destination slot d, `perm` being kvxfer-bench's
  `--dst-order shuffled` permutation (the same for every slot);
- page k of the request with id `room` holds W = page_bytes/8 words:
  word 0 = stamp(room, 0, k), word j = body_base(0, k) + j*G, word W-1 = !stamp;
  the source bodies are written once before timing, the two stamps per page per request;
- `--verify sample`: the stamps of every page, and every word of the pages for which
  mix(stamp) & 15 == 0 (one in 16).
"""

import mmap

import numpy as np

M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_BODY = 0x6B767866_62656E63
HUGE = 2 << 20


def mix(z: int) -> int:
    """SplitMix64's finaliser (pattern.rs `mix`), on a Python int."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def mix_np(z: np.ndarray) -> np.ndarray:
    """`mix` over a uint64 array (numpy's uint64 products wrap, as the Rust ones do)."""
    z = (z ^ (z >> np.uint64(30))) * _C1
    z = (z ^ (z >> np.uint64(27))) * _C2
    return z ^ (z >> np.uint64(31))


def room_id(seed: int, idx: int) -> int:
    """ctl.rs `room_id`: the seed's high half, the request index in the low half."""
    return (mix(seed) & 0xFFFFFFFF00000000) | (idx & 0xFFFFFFFF)


def shuffled_perm(seed: int, n: int) -> np.ndarray:
    """pool.rs's `--dst-order shuffled` page order inside a slot."""
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        j = mix(seed ^ i) % (i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return np.array(perm, dtype=np.int64)


class Region:
    """Anonymous memory on 2 MiB transparent huge pages where the kernel has them
    (MADV_HUGEPAGE on a 2 MiB-aligned range before the first touch, as kvxfer-bench's
    `--pool-pages huge`), every page touched before timing."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes + HUGE)
        raw = np.frombuffer(self.map, dtype=np.uint8)
        head = (-raw.ctypes.data) % HUGE
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self.map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # no THP in this kernel: small pages, as asked for on such hosts
        self.bytes = raw[head : head + nbytes]
        self.bytes.reshape(-1, 4096)[:, 0] = 0
        self.addr = self.bytes.ctypes.data
        self.len = nbytes


class Pool:
    """One side's buffer: `slots` slots of `slot_pages` pages of `page_bytes`."""

    def __init__(self, page_bytes: int, slot_pages: int, slots: int, perm: np.ndarray | None):
        assert page_bytes % 8 == 0 and page_bytes >= 24
        self.page_bytes = page_bytes
        self.slot_pages = slot_pages
        self.slots = slots
        self.region = Region(page_bytes * slot_pages * slots)
        self.words = self.region.bytes.view(np.uint64).reshape(slots * slot_pages, page_bytes // 8)
        self.perm = perm if perm is not None else np.arange(slot_pages, dtype=np.int64)
        k = np.arange(slot_pages, dtype=np.uint64)
        # key(b = 0, k) = k: the one buffer is buffer 0.
        self._mixed_key = mix_np(k)
        self._body_base = mix_np(np.uint64(_BODY) ^ k)
        w = page_bytes // 8
        self._jg = np.arange(w, dtype=np.uint64) * np.uint64(G)

    def rows(self, slot: int) -> np.ndarray:
        """Page indices of the pages of `slot`, page k of a request first."""
        return slot * self.slot_pages + self.perm

    def page_addrs(self, slot: int) -> list[int]:
        base = self.region.addr
        return [base + int(r) * self.page_bytes for r in self.rows(slot)]

    def stamps(self, room: int) -> np.ndarray:
        return mix_np(np.uint64((room * G) & M64) ^ self._mixed_key)

    def fill_bodies(self):
        """Source side, before timing: the body of every page of every slot."""
        for slot in range(self.slots):
            rows = self.rows(slot)
            for k in range(self.slot_pages):
                page = self.words[rows[k]]
                np.add(self._jg, self._body_base[k], out=page)
                page[0] = 0
                page[-1] = 0

    def stamp(self, slot: int, room: int):
        """Source side: the two stamps of `room` in every page of `slot`."""
        s = self.stamps(room)
        rows = self.rows(slot)
        self.words[rows, 0] = s
        self.words[rows, -1] = ~s

    def verify(self, slot: int, room: int) -> tuple[int, str | None]:
        """Destination side, after the request landed: `--verify sample` of `slot`
        against `room`. Returns (bytes checked in full, None) or (0, what differs)."""
        s = self.stamps(room)
        rows = self.rows(slot)
        first = self.words[rows, 0]
        last = self.words[rows, -1]
        bad = np.nonzero((first != s) | (last != ~s))[0]
        if bad.size:
            k = int(bad[0])
            return 0, f"page {k} of room {room:#x}: a stamp differs (wrong room, or stale or torn page)"
        checked = 0
        for k in np.nonzero((mix_np(s) & np.uint64(15)) == 0)[0]:
            page = self.words[rows[k]]
            want = self._jg[1:-1] + self._body_base[k]
            if not np.array_equal(page[1:-1], want):
                j = int(np.nonzero(page[1:-1] != want)[0][0]) + 1
                return 0, f"page {int(k)} of room {room:#x}: word {j} differs in its body (wrong page or offset)"
            checked += self.page_bytes
        return checked, None
