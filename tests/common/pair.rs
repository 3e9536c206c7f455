//! A prefill and a decode engine in this process, over the transport and with the
//! config and buffers a test asks for, and the steps of a room between them.

use kvxfer::log::Level;
use kvxfer::{Engine, RoomPeers, State};

use super::engine::{config, descs, quiet, Log};
use super::memory::{all_filled, fill_pages, first_unlike_source, pattern, Region, POISON};
use super::wait::{wait_state, wait_terminal};

/// A prefill engine `p` whose buffers hold the source pattern and a decode engine `d`
/// whose buffers hold POISON, of the same shape. The engines come first, so that they
/// stop (and join their threads) before the memory they write is freed.
pub struct Pair {
    pub p: Engine,
    pub d: Engine,
    /// What each engine logged, if the pair was built with [`PairBuilder::log`].
    pub plog: Log,
    pub dlog: Log,
    pub pmem: Vec<Region>,
    pub dmem: Vec<Region>,
    /// The aux buffer of each side, if the pair was built with [`PairBuilder::aux`].
    pub paux: Vec<Region>,
    pub daux: Vec<Region>,
}

/// How to build a [`Pair`]: by default over the test transport, with no config beyond
/// the role, 2 KV buffers of 256 pages of 1 KiB, no aux buffer, logging only errors.
pub struct PairBuilder {
    both: Vec<(String, String)>,
    prefill: Vec<(String, String)>,
    decode: Vec<(String, String)>,
    bufs: usize,
    pages: usize,
    item: usize,
    aux: Option<(usize, usize)>,
    log: Option<Level>,
}

fn owned(kv: &[(&str, &str)]) -> Vec<(String, String)> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl PairBuilder {
    /// Both engines over `transport` instead of the test transport.
    pub fn transport(mut self, transport: &str) -> Self {
        self.both.push(("transport".into(), transport.into()));
        self
    }

    /// Config keys of both engines (before each side's own).
    pub fn config(mut self, kv: &[(&str, &str)]) -> Self {
        self.both.extend(owned(kv));
        self
    }

    /// Config keys of the prefill engine.
    pub fn prefill(mut self, kv: &[(&str, &str)]) -> Self {
        self.prefill.extend(owned(kv));
        self
    }

    /// Config keys of the decode engine.
    pub fn decode(mut self, kv: &[(&str, &str)]) -> Self {
        self.decode.extend(owned(kv));
        self
    }

    /// The number of KV buffers on each side.
    pub fn bufs(mut self, n: usize) -> Self {
        self.bufs = n;
        self
    }

    /// The number of pages of each KV buffer.
    pub fn pages(mut self, n: usize) -> Self {
        self.pages = n;
        self
    }

    /// The bytes of each page.
    pub fn item(mut self, n: usize) -> Self {
        self.item = n;
        self
    }

    /// One aux buffer on each side, of `slots` slots of `item` bytes.
    pub fn aux(mut self, slots: usize, item: usize) -> Self {
        self.aux = Some((slots, item));
        self
    }

    /// Both engines log at `level` and above into [`Pair::plog`] and [`Pair::dlog`].
    pub fn log(mut self, level: Level) -> Self {
        self.log = Some(level);
        self
    }

    pub fn build(self) -> Pair {
        let (bufs, pages, item) = (self.bufs, self.pages, self.item);
        let pmem = super::memory::source(bufs, pages, item);
        let dmem = super::memory::poisoned(bufs, pages, item);
        let aux = |fill: &dyn Fn(usize) -> u8| match self.aux {
            Some((slots, size)) => vec![Region::new(slots, size, fill)],
            None => Vec::new(),
        };
        let paux = aux(&|i| pattern(bufs, 0, i));
        let daux = aux(&|_| POISON);
        let (plog, dlog) = (Log::default(), Log::default());
        let start =
            |role: &str, own: &[(String, String)], log: &Log, kv: &[Region], aux: &[Region]| {
                let keys: Vec<(&str, &str)> = self
                    .both
                    .iter()
                    .chain(own)
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                let logger = match self.log {
                    Some(level) => log.logger(level),
                    None => quiet(),
                };
                let e = Engine::new(config(role, &keys), logger).unwrap();
                e.register_kv(descs(kv)).unwrap();
                if !aux.is_empty() {
                    e.register_aux(descs(aux)).unwrap();
                }
                e
            };
        let p = start("prefill", &self.prefill, &plog, &pmem, &paux);
        let d = start("decode", &self.decode, &dlog, &dmem, &daux);
        Pair {
            p,
            d,
            plog,
            dlog,
            pmem,
            dmem,
            paux,
            daux,
        }
    }
}

impl Pair {
    pub fn builder() -> PairBuilder {
        PairBuilder {
            both: Vec::new(),
            prefill: Vec::new(),
            decode: Vec::new(),
            bufs: 2,
            pages: 256,
            item: 1024,
            aux: None,
            log: None,
        }
    }

    /// The engine an abort comes from: the decode one if `from_decode`.
    pub fn side(&self, from_decode: bool) -> &Engine {
        if from_decode {
            &self.d
        } else {
            &self.p
        }
    }

    /// Creates `room` on both sides, the decode room pulling from the prefill engine.
    pub fn create(&self, room: u64) {
        self.p.room_create(room, RoomPeers::Decoders(1)).unwrap();
        self.d
            .room_create(room, RoomPeers::Prefills(vec![self.p.address().into()]))
            .unwrap();
    }

    /// Creates `room` on both sides and sets its destination `dst` on the decode side.
    pub fn open(&self, room: u64, dst: &[u32]) {
        self.create(room);
        self.d.room_set_destination(room, dst, None).unwrap();
    }

    /// As [`Pair::open`], then waits until the prefill room has its destination.
    pub fn ready(&self, room: u64, dst: &[u32]) {
        self.open(room, dst);
        wait_state(&self.p, room, State::WaitingForInput);
    }

    /// Enqueues source pages `src` of `room` in chunks of `per` pages, the last one last.
    pub fn send(&self, room: u64, src: &[u32], per: usize) {
        let parts: Vec<&[u32]> = src.chunks(per.max(1)).collect();
        for (i, part) in parts.iter().enumerate() {
            self.p
                .enqueue_chunk(room, part, i + 1 == parts.len(), None)
                .unwrap();
        }
    }

    /// Moves source pages `src` into `dst` as one chunk of a new `room`; how the room
    /// ended on the prefill and on the decode side.
    pub fn transfer(&self, room: u64, src: &[u32], dst: &[u32]) -> (State, State) {
        self.open(room, dst);
        self.p.enqueue_chunk(room, src, true, None).unwrap();
        (wait_terminal(&self.p, room), wait_terminal(&self.d, room))
    }

    /// Runs a one-chunk room to SUCCESS on both sides, its pages delivered. With one
    /// worker, once it is done every chunk queued before it has been handled.
    pub fn marker(&self, room: u64, src: &[u32], dst: &[u32]) {
        self.ready(room, dst);
        self.p.enqueue_chunk(room, src, true, None).unwrap();
        assert_eq!(wait_terminal(&self.p, room), State::Success, "marker");
        assert_eq!(wait_terminal(&self.d, room), State::Success, "marker");
        assert!(self.delivered(src, dst));
    }

    /// Whether decode pages `dst` hold source pages `src`, page by page, in every buffer.
    pub fn delivered(&self, src: &[u32], dst: &[u32]) -> bool {
        first_unlike_source(&self.dmem, src, dst).is_none()
    }

    /// As [`Pair::delivered`], failing the test at the first page that differs.
    pub fn assert_pages(&self, src: &[u32], dst: &[u32]) {
        if let Some((b, s, d)) = first_unlike_source(&self.dmem, src, dst) {
            panic!("buffer {b}: page {d} differs from source page {s}");
        }
    }

    /// Whether decode pages `dst` hold only POISON in every buffer.
    pub fn poisoned(&self, dst: &[u32]) -> bool {
        all_filled(&self.dmem, dst, POISON)
    }

    /// As [`Pair::poisoned`], failing the test at the first page written.
    pub fn assert_poisoned(&self, dst: &[u32]) {
        for &d in dst {
            for (b, m) in self.dmem.iter().enumerate() {
                assert!(
                    m.page(d).iter().all(|&x| x == POISON),
                    "page {d} of buffer {b} was written"
                );
            }
        }
    }

    /// Fills decode pages `dst` with POISON again.
    pub fn repoison(&self, dst: &[u32]) {
        fill_pages(&self.dmem, dst, POISON)
    }
}
