//! The prefill side: an engine whose source pool holds every room's pattern, a scheduler
//! loop that creates the rooms the decode side announced and enqueues their chunks, and
//! the sending half of the TCP baseline. Driven over the control channel.
//!
//! Between layouts (`--prefill-tp`, `--decode-tp`) every prefill rank is an engine over
//! its own pool, with its own scheduler loop (a thread per rank during a phase), and the
//! equal-TP comparison is one more engine over a pool of the TP 1 layout.

use std::collections::VecDeque;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvxfer::{Cause, Engine, RoomPeers, State};

use crate::args::{DstOrder, Feed, Params, Side};
use crate::ctl::{
    self, room_id, room_plan, AbortAt, Computed, Ctl, Outcome, PrefillRoom, ToDecode, ToPrefill,
};
use crate::pool::Pool;
use crate::sys::{mono_ns, precise_sleeps, sleep_until_ns, Usage};
use crate::{baseline, make_engine};

/// Serves one run: over stdin/stdout (`listen` None, the child of a local run) or for
/// the first decode bench that connects to `listen`.
pub fn serve(listen: Option<&str>) -> Result<(), String> {
    let (mut ctl, host, local_ip) = match listen {
        None => (
            Ctl::new(std::io::stdin(), std::io::stdout()),
            "127.0.0.1".to_string(),
            None,
        ),
        Some(listen) => {
            let l =
                TcpListener::bind(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
            eprintln!(
                "kvxfer-bench prefill: waiting for the decode side on {}",
                l.local_addr().map_err(|e| e.to_string())?
            );
            let (s, from) = l.accept().map_err(|e| e.to_string())?;
            eprintln!("kvxfer-bench prefill: decode side connected from {from}");
            let ip = s.local_addr().map_err(|e| e.to_string())?.ip();
            let host = l.local_addr().map_err(|e| e.to_string())?.ip().to_string();
            let r = s.try_clone().map_err(|e| e.to_string())?;
            (Ctl::new(r, s), host, Some(ip))
        }
    };
    let p = match ctl.recv::<ToPrefill>()? {
        ToPrefill::Plan(p) => *p,
        other => return Err(format!("expected a plan, got {other:?}")),
    };
    if let Err(e) = p.validate() {
        let _ = ctl.send(&ToDecode::Error(format!("bad plan: {e}")));
        return Err(e);
    }
    let setup = || -> Result<(Vec<Set>, Vec<Pool>, TcpListener), String> {
        let listen = if host.contains(':') {
            format!("[{host}]:0")
        } else {
            format!("{host}:0")
        };
        let slots = p.concurrency + 2;
        let mut pools = Vec::new();
        let mut sets = Vec::new();
        if p.layouts() {
            // The TP phases' ranks, then the equal-TP phases' one rank, each engine over
            // its own pool.
            let auth = p.auth.pairs()[0];
            let layouts = [
                (p.rank_layouts(Side::Prefill), p.decode_tp),
                (vec![p.equal_layout()], 1),
            ];
            for (set, decoders) in layouts {
                let mut ranks = Vec::new();
                for l in set {
                    let pool = Pool::with_layout(&p, slots, DstOrder::Contiguous, Some(l));
                    pool.fill_bodies();
                    let e = make_engine(&p, "prefill", &listen, auth)?;
                    pool.register(&e)?;
                    pools.push(pool);
                    ranks.push((e, pools.len() - 1));
                }
                sets.push(Set { ranks, decoders });
            }
        } else {
            // One engine per --auth setting, over the same pool.
            let pool = Pool::new(&p, slots, DstOrder::Contiguous);
            pool.fill_bodies();
            for &auth in p.auth.pairs() {
                let e = make_engine(&p, "prefill", &listen, auth)?;
                pool.register(&e)?;
                sets.push(Set {
                    ranks: vec![(e, 0)],
                    decoders: 1,
                });
            }
            pools.push(pool);
        }
        let base = TcpListener::bind(&listen).map_err(|e| format!("baseline listener: {e}"))?;
        Ok((sets, pools, base))
    };
    let (engines, pools, base) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ctl.send(&ToDecode::Error(e.clone()));
            return Err(e);
        }
    };
    let reachable = |a: SocketAddr| -> SocketAddr {
        match local_ip {
            Some(ip) if a.ip().is_unspecified() => SocketAddr::new(ip, a.port()),
            _ => a,
        }
    };
    let mut addrs = Vec::with_capacity(engines.len());
    for set in &engines {
        let mut ranks = Vec::with_capacity(set.ranks.len());
        for (e, _) in &set.ranks {
            let a: SocketAddr = e
                .address()
                .parse()
                .map_err(|e| format!("engine address: {e}"))?;
            ranks.push(reachable(a).to_string());
        }
        addrs.push(ranks);
    }
    let base_addr = reachable(base.local_addr().map_err(|e| e.to_string())?);
    ctl.send(&ToDecode::Ready {
        engines: addrs,
        baseline: base_addr.to_string(),
    })?;

    // A reader thread takes the announcements of a phase in flight (`upto`, `end`) as
    // they come, and hands every other message to the loop below.
    // An announcement wakes the scheduler loop waiting in its engine (the engines are
    // reached through a weak reference, so that they still stop here, when this
    // function drops them).
    let (mut r, mut w) = ctl.split();
    let upto = Arc::new(AtomicU64::new(0));
    let end = Arc::new(AtomicU64::new(u64::MAX));
    let (tx, rx) = mpsc::channel::<Result<ToPrefill, String>>();
    let engines = Arc::new(engines);
    {
        let (upto, end) = (upto.clone(), end.clone());
        let engines = Arc::downgrade(&engines);
        let wake = move || {
            if let Some(sets) = engines.upgrade() {
                sets.iter()
                    .flat_map(|s| &s.ranks)
                    .for_each(|(e, _)| e.wake());
            }
        };
        std::thread::spawn(move || loop {
            match ctl::recv::<ToPrefill>(&mut r) {
                Ok(ToPrefill::Upto(n)) => {
                    upto.store(n, Ordering::Release);
                    wake();
                }
                Ok(ToPrefill::End(n)) => {
                    end.store(n, Ordering::Release);
                    wake();
                }
                m => {
                    let last = m.is_err();
                    if tx.send(m).is_err() || last {
                        break;
                    }
                }
            }
        });
    }
    for m in rx {
        match m? {
            ToPrefill::Tcp { conns, bytes, secs } => {
                let m = baseline::tcp_send(
                    &base,
                    conns,
                    bytes,
                    secs,
                    baseline::Buffers {
                        mib: p.baseline_buf_mib,
                        pages: p.pool_pages,
                    },
                    p.baseline_write_kib << 10,
                    &mut || ctl::send(&mut w, &ToDecode::TcpReady),
                )?;
                ctl::send(
                    &mut w,
                    &ToDecode::TcpDone {
                        bytes: m.bytes,
                        usage: m.usage,
                    },
                )?;
            }
            ToPrefill::Run {
                start,
                engine,
                feed,
            } => {
                let set = engines
                    .get(engine)
                    .ok_or_else(|| format!("run: no engine {engine}"))?;
                let runs = || -> u64 {
                    set.ranks
                        .iter()
                        .map(|(e, _)| e.metrics().data_runs_sent)
                        .sum()
                };
                let (u0, runs0) = (Usage::now(), runs());
                let (rooms, driver) = run_ranks(&p, set, &pools, (start, feed), &upto, &end)?;
                let usage = Usage::now().since(u0);
                ctl::send(
                    &mut w,
                    &ToDecode::PhaseDone {
                        rooms,
                        usage,
                        driver,
                        runs: runs() - runs0,
                    },
                )?;
            }
            ToPrefill::Quit => break,
            other => return Err(format!("unexpected control message {other:?}")),
        }
    }
    drop(engines);
    Ok(())
}

/// The engines of one kind of phase: one per rank, each with the index of its pool, and
/// the decode ranks each room waits for.
struct Set {
    ranks: Vec<(Engine, usize)>,
    decoders: usize,
}

/// One phase on every rank of `set`, each rank's scheduler loop on a thread of its own
/// (as each rank of a server has its own): every room's record, every rank's together,
/// and the loops' usage.
fn run_ranks(
    p: &Params,
    set: &Set,
    pools: &[Pool],
    (start, feed): (u64, Feed),
    upto: &AtomicU64,
    end: &AtomicU64,
) -> Result<(Vec<PrefillRoom>, Usage), String> {
    let per_rank: Vec<Result<(Vec<PrefillRoom>, Usage), String>> = std::thread::scope(|scope| {
        let loops: Vec<_> = set
            .ranks
            .iter()
            .enumerate()
            .map(|(rank, (engine, pool))| {
                let pool = &pools[*pool];
                scope.spawn(move || {
                    let u0 = Usage::thread();
                    // A planned prefill abort comes from rank 0; the engines fail the
                    // room on every other rank.
                    let rooms = run_rooms(
                        p,
                        engine,
                        pool,
                        (start, feed),
                        upto,
                        end,
                        (set.decoders, rank == 0),
                    )?;
                    Ok((rooms, Usage::thread().since(u0)))
                })
            })
            .collect();
        loops
            .into_iter()
            .map(|l| {
                l.join()
                    .unwrap_or_else(|_| Err("a prefill loop panicked".into()))
            })
            .collect()
    });
    // Every rank saw the end: the next phase's announcements start afresh.
    end.store(u64::MAX, Ordering::Release);
    let mut driver = Usage::default();
    let mut ranks = Vec::with_capacity(per_rank.len());
    for r in per_rank {
        let (rooms, u) = r?;
        driver = driver + u;
        ranks.push(rooms);
    }
    let n = ranks.iter().map(Vec::len).min().unwrap_or(0);
    if ranks.iter().any(|r| r.len() != n) {
        return Err("the prefill ranks ran different numbers of rooms".into());
    }
    let rooms = (0..n)
        .map(|i| PrefillRoom::merge(&ranks.iter().map(|r| r[i].clone()).collect::<Vec<_>>()))
        .collect();
    Ok((rooms, driver))
}

struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    abort: bool,
    aborted: bool,
}

/// A room waiting for, or in, its simulated forward pass.
struct Forward {
    idx: usize,
    id: u64,
    chunks: Vec<Vec<u32>>,
    aux: Option<u32>,
    /// When it was created (it can start no earlier).
    queued: u64,
    /// When its first layer's compute began (0: not yet).
    start: u64,
    /// Layers computed, over every chunk.
    done: usize,
    /// Whether one of its calls reached the engine.
    enqueued: bool,
    late: Vec<u64>,
}

/// The simulated prefill compute of a phase (`--layerwise`): one room at a time, each
/// chunk's layers in turn, `compute_us_per_layer` each, on a compute timeline of
/// absolute deadlines (a layer ends `compute_us_per_layer` after the previous one ended,
/// as on a GPU that runs the queued layers back to back; the scheduler thread sleeps
/// until that end and learns of it when it wakes). After each layer: layer-wise, its
/// buffers are enqueued at once (`enqueue_layers`); whole-chunk, after a chunk's last
/// layer, the chunk (`enqueue_chunk`).
struct Forwards {
    feed: Feed,
    layers: usize,
    per_layer: usize,
    queue: VecDeque<Forward>,
    /// Where the compute timeline is free: the end of the last layer computed.
    free_at: u64,
}

impl Forwards {
    fn new(p: &Params, feed: Feed) -> Forwards {
        Forwards {
            feed,
            layers: p.layers,
            per_layer: p.buffers_per_layer(),
            queue: VecDeque::new(),
            free_at: 0,
        }
    }

    /// Finishes every layer whose compute has ended: enqueues what it completes, and
    /// retires the room whose last layer it was (its record gets the compute). Returns
    /// whether anything happened, and the end of the layer being computed, if one is.
    fn step(&mut self, engine: &Engine, recs: &mut [PrefillRoom]) -> (bool, Option<u64>) {
        let per_layer_ns = self.feed.compute_us_per_layer * 1000;
        let mut progress = false;
        while let Some(f) = self.queue.front_mut() {
            if f.start == 0 {
                f.start = self.free_at.max(f.queued);
                progress = true;
            }
            let due = f.start + (f.done as u64 + 1) * per_layer_ns;
            let now = mono_ns();
            if now < due {
                return (progress, Some(due));
            }
            progress = true;
            f.late.push(now - due);
            let (chunk, layer) = (f.done / self.layers, f.done % self.layers);
            f.done += 1;
            let last = f.done == f.chunks.len() * self.layers;
            let aux = if last { f.aux } else { None };
            let pages = &f.chunks[chunk];
            let r = if self.feed.by_layer {
                let n = self.per_layer as u32;
                Some(engine.enqueue_layers(f.id, pages, layer as u32 * n, n, last, aux))
            } else if layer + 1 == self.layers {
                Some(engine.enqueue_chunk(f.id, pages, chunk + 1 == f.chunks.len(), aux))
            } else {
                None
            };
            if r.is_some() && !f.enqueued {
                // The room's first enqueue (`t_enq`): as the thread woke to make it.
                f.enqueued = true;
                recs[f.idx].t_enq = now;
            }
            let failed = match r {
                Some(Err(e)) => {
                    // The room failed (an abort) or the call was refused: the request is
                    // gone, its compute stops. A refusal fails the room with the reason;
                    // an error that did not, fails it here.
                    if engine.room_poll(f.id).ok() != Some(State::Failed) {
                        eprintln!("kvxfer-bench prefill: room {}: {e}", f.id);
                        let _ = engine.room_abort(f.id, &format!("bench: enqueue failed: {e}"));
                    }
                    true
                }
                _ => false,
            };
            if last || failed {
                self.free_at = due;
                let f = self.queue.pop_front().expect("the front");
                recs[f.idx].compute = Some(Computed {
                    start: f.start,
                    end: now,
                    late_ns: f.late,
                });
            }
        }
        (progress, None)
    }

    /// Room `id` ended before its compute did: the rest of its compute is dropped, as a
    /// server drops a finished request (the layer it was computing still runs to its
    /// end, and the timeline is free from there).
    fn drop_room(&mut self, id: u64, recs: &mut [PrefillRoom]) {
        let Some(i) = self.queue.iter().position(|f| f.id == id) else {
            return;
        };
        let f = self.queue.remove(i).expect("found");
        if f.start != 0 {
            self.free_at = f.start + (f.done as u64 + 1) * self.feed.compute_us_per_layer * 1000;
            recs[f.idx].compute = Some(Computed {
                start: f.start,
                end: 0,
                late_ns: f.late,
            });
        }
    }
}

/// The prefill scheduler loop of one rank over one phase; `aborts`: this rank makes the
/// planned prefill aborts.
fn run_rooms(
    p: &Params,
    engine: &Engine,
    pool: &Pool,
    (start, feed): (u64, Feed),
    upto: &AtomicU64,
    end: &AtomicU64,
    (decoders, aborts): (usize, bool),
) -> Result<Vec<PrefillRoom>, String> {
    let mut free: Vec<usize> = (0..pool.slots).rev().collect();
    let mut live: Vec<Live> = Vec::with_capacity(pool.slots);
    let mut recs: Vec<PrefillRoom> = Vec::new();
    let chunk = p.chunk_pages();
    let mut forwards = feed.simulate.then(|| Forwards::new(p, feed));
    if forwards.is_some() {
        // The layers' ends are sleeps of this thread: let them end on time.
        precise_sleeps();
    }
    loop {
        let mut progress = false;
        let seen = engine.changes();
        // The compute first, so that a layer is enqueued as soon as the thread wakes at
        // its end.
        let mut next_layer_end = None;
        if let Some(fw) = forwards.as_mut() {
            let (p, next) = fw.step(engine, &mut recs);
            progress |= p;
            next_layer_end = next;
        }
        let limit = upto
            .load(Ordering::Acquire)
            .min(end.load(Ordering::Acquire));
        while start + (recs.len() as u64) < limit {
            let Some(slot) = free.pop() else { break };
            progress = true;
            let idx = recs.len();
            let plan = room_plan(p, start + idx as u64);
            let id = room_id(p, start + idx as u64);
            pool.stamp(slot, plan.pages, id);
            let t_enq = mono_ns();
            let r = engine
                .room_create(id, RoomPeers::Decoders(decoders))
                .and_then(|()| {
                    if let Some(fw) = forwards.as_mut() {
                        // Enqueued as its layers are computed.
                        let pages = pool.pages(slot, plan.pages);
                        fw.queue.push_back(Forward {
                            idx,
                            id,
                            chunks: pages.chunks(chunk).map(<[u32]>::to_vec).collect(),
                            aux: pool.aux.is_some().then_some(slot as u32),
                            queued: t_enq,
                            start: 0,
                            done: 0,
                            enqueued: false,
                            late: Vec::new(),
                        });
                        return Ok(());
                    }
                    let pages = pool.pages(slot, plan.pages);
                    let parts: Vec<&[u32]> = pages.chunks(chunk).collect();
                    for (i, part) in parts.iter().enumerate() {
                        let last = i + 1 == parts.len();
                        let aux = (last && pool.aux.is_some()).then_some(slot as u32);
                        engine.enqueue_chunk(id, part, last, aux)?;
                    }
                    Ok(())
                });
            recs.push(PrefillRoom {
                t_enq,
                t_term: 0,
                outcome: Outcome::local("unknown"),
                compute: None,
            });
            // A room the decode side aborted before it was created here is failed at
            // creation (the early abort was held for it): enqueueing into it is refused
            // and its reason is collected by the poll below like any other.
            let failed_at_birth = r.is_err() && engine.room_poll(id).ok() == Some(State::Failed);
            match r {
                Ok(()) => live.push(Live {
                    idx,
                    id,
                    slot,
                    abort: aborts && plan.abort == Some(AbortAt::PrefillMid),
                    aborted: false,
                }),
                Err(_) if failed_at_birth => live.push(Live {
                    idx,
                    id,
                    slot,
                    abort: false,
                    aborted: false,
                }),
                Err(e) => {
                    eprintln!("kvxfer-bench prefill: room {id}: {e}");
                    let _ = engine.room_abort(id, "bench: setup failed");
                    let _ = engine.room_clear(id);
                    recs[idx].outcome = Outcome::local("create_error");
                    recs[idx].t_term = mono_ns();
                    free.push(slot);
                }
            }
        }
        let mut i = 0;
        while i < live.len() {
            let r = &mut live[i];
            let state = engine.room_poll(r.id);
            match state {
                Ok(State::Success) | Ok(State::Failed) | Err(_) => {
                    let now = mono_ns();
                    let outcome = match state {
                        Ok(State::Success) => Outcome::Ok,
                        Ok(_) => match engine.room_failure(r.id) {
                            Ok(f) => Outcome::Failed {
                                cause: f.cause.name().into(),
                                from_peer: f.from_peer,
                            },
                            Err(_) => Outcome::local("unknown"),
                        },
                        Err(_) => Outcome::local("poll_error"),
                    };
                    // The slot is reused at once, as a server frees a finished request's
                    // pages. After a failure a worker may still be inside one frame write
                    // from it; those bytes belong to a failed room, which the decode side
                    // refuses, so the new room's stamps cannot reach a checked page.
                    let _ = engine.room_clear(r.id);
                    if let Some(fw) = forwards.as_mut() {
                        fw.drop_room(r.id, &mut recs);
                    }
                    free.push(r.slot);
                    recs[r.idx].t_term = now;
                    recs[r.idx].outcome = outcome;
                    live.swap_remove(i);
                    progress = true;
                    continue;
                }
                Ok(State::WaitingForInput) | Ok(State::Transferring) if r.abort && !r.aborted => {
                    let _ = engine.room_abort(r.id, "bench: planned abort (prefill)");
                    r.aborted = true;
                    progress = true;
                }
                Ok(_) => {}
            }
            i += 1;
        }
        if start + recs.len() as u64 >= end.load(Ordering::Acquire) && live.is_empty() {
            return Ok(recs);
        }
        if !progress {
            match next_layer_end {
                // Computing: the thread sleeps until the layer's end (what happens
                // meanwhile waits for the next layer's end).
                Some(t) => sleep_until_ns(t),
                // Everything that gives this loop work wakes the wait: a room's change
                // of state, an announcement. The bound is a safety net, not a poll.
                None => ctl::idle(p, engine, seen, Duration::from_millis(100)),
            }
        }
    }
}

/// The decode side of a two-host run connects here (retrying while the prefill starts).
pub fn connect(addr: &str) -> Result<Ctl, String> {
    let t = Instant::now();
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => {
                let r = s.try_clone().map_err(|e| e.to_string())?;
                return Ok(Ctl::new(r, s));
            }
            Err(e) if t.elapsed() < Duration::from_secs(30) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("cannot reach the prefill bench at {addr}: {e}")),
        }
    }
}

/// Whether `cause` is what a planned abort produces.
pub fn is_abort(cause: &str) -> bool {
    cause == Cause::Aborted.name()
}
