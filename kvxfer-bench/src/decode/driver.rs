//! One kvxfer phase on the decode side: the scheduler loop as a driver ([`Driver`]) whose
//! steps create rooms, poll them, give failed rooms' pages back once drained, and hand
//! delivered pages to the checker threads ([`Checkers`]); then the prefill side's
//! account of the same rooms ([`account`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use kvxfer::{Engine, RoomPeers, State};

use crate::args::VerifyPriority;
use crate::ctl::ToPrefill;
use crate::ctl::{room_id, room_plan, AbortAt, Ctl, Outcome, PrefillRoom, RoomPlan, ToDecode};
use crate::params::{Feed, Params};
use crate::pool::Pool;
use crate::prefill;
use crate::results::KvResult;
use crate::sys::{mono_ns, HostMark, Usage};

/// One rank of a phase: its engine and its pool.
pub type Rank<'a> = (&'a Engine, &'a Pool);

/// Which phase to run: its first room's index and how the prefill side feeds its rooms;
/// the prefill ranks it pulls from and the index of their engine set.
pub struct Phase<'a> {
    pub start: u64,
    pub feed: Feed,
    pub prefill_addrs: &'a [String],
    pub prefill_set: usize,
    /// Both sides on one host (the two clocks compare).
    pub same_host: bool,
}

/// The decode scheduler loop of one phase, over every decode rank in `ranks`. With
/// several ranks, a thread per other rank wakes the loop (waiting in rank 0's engine)
/// when a room of its rank changes state.
pub fn run(
    p: &Params,
    ranks: &[Rank<'_>],
    ctl: &mut Ctl,
    phase: &Phase<'_>,
) -> Result<KvResult, String> {
    // Set once the loop returned, to end the forwarders (within one wait of 50 ms).
    // Relaxed: it publishes nothing else.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for &(e, _) in &ranks[1..] {
            let (stop, first) = (&stop, ranks[0].0);
            scope.spawn(move || {
                let mut seen = e.changes();
                while !stop.load(Ordering::Relaxed) {
                    let now = e.wait(seen, Duration::from_millis(50));
                    if now != seen {
                        seen = now;
                        first.wake();
                    }
                }
            });
        }
        let r = Driver::new(p, ranks, phase, scope).and_then(|d| d.run(ctl));
        stop.store(true, Ordering::Relaxed);
        r
    })
}

/// A room in flight.
struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    /// Tokens the room moves (every rank's pages hold them).
    tokens: u64,
    abort: Option<AbortAt>,
    aborted: bool,
}

/// What the decode side saw of one room.
#[derive(Clone, Default)]
pub(super) struct Rec {
    pub t_dest: u64,
    /// When a poll first saw the room TRANSFERRING (or SUCCESS, if none did).
    pub t_first: u64,
    /// Whether a poll saw it TRANSFERRING.
    pub seen_transferring: bool,
    pub t_done: u64,
    pub ok: bool,
    pub planned_abort: bool,
}

/// Pages of a delivered room, for a checker.
struct Job {
    idx: usize,
    id: u64,
    slot: usize,
    tokens: u64,
}

/// A checker's verdict on a room's pages: the words checked, or what differs.
struct Checked {
    idx: usize,
    slot: usize,
    result: Result<u64, String>,
}

/// The checker threads: each checks a delivered room's pages on every rank, then wakes
/// the scheduler loop (which may be waiting in the engine).
struct Checkers<'scope> {
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Checked>,
    threads: Vec<ScopedJoinHandle<'scope, Usage>>,
    /// The threads' kernel ids, to change their scheduling from the loop.
    tids: Vec<i32>,
    /// Under `--verify-priority idle`: the threads run as every other thread for now,
    /// the loop waiting for a check ([`Checkers::urgent`]).
    boosted: bool,
    /// Rooms handed to the checkers and not back yet.
    checking: usize,
}

impl<'scope> Checkers<'scope> {
    fn spawn<'env>(
        p: &'env Params,
        ranks: &'env [Rank<'env>],
        scope: &'scope Scope<'scope, 'env>,
    ) -> Checkers<'scope> {
        let (job_tx, job_rx) = mpsc::channel::<Job>();
        let (done_tx, done) = mpsc::channel::<Checked>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let (tid_tx, tid_rx) = mpsc::channel::<i32>();
        let threads = (0..p.verify_threads)
            .map(|_| {
                let (rx, tx, tid) = (job_rx.clone(), done_tx.clone(), tid_tx.clone());
                scope.spawn(move || {
                    if p.verify_priority == VerifyPriority::Idle {
                        crate::sys::sched_idle();
                    }
                    // Known to the loop only once idle, so that a boost is never undone.
                    let _ = tid.send(crate::sys::thread_id());
                    drop(tid);
                    check_loop(p, ranks, &rx, &tx)
                })
            })
            .collect();
        drop(tid_tx);
        Checkers {
            jobs: Some(job_tx),
            done,
            threads,
            tids: tid_rx.iter().collect(),
            boosted: false,
            checking: 0,
        }
    }

    /// Whether the loop waits for a check: a room may be created and no slot is free
    /// until a checker gives one back. Under `--verify-priority idle` the checkers then
    /// run as every other thread until it need not, so that how many rooms are in
    /// flight is never set by how much idle CPU the host has left (on a busy host an
    /// idle checker starved for hundreds of ms, and a phase ran one room at a time
    /// where its pair ran four).
    fn urgent(&mut self, p: &Params, waits: bool) {
        if p.verify_priority != VerifyPriority::Idle || self.boosted == waits {
            return;
        }
        for &tid in &self.tids {
            crate::sys::set_idle(tid, !waits);
        }
        self.boosted = waits;
    }

    fn check(&mut self, job: Job) -> Result<(), String> {
        self.checking += 1;
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or_else(|| "the checker threads stopped".to_string())
    }

    /// Stops the threads once they are done; their usage together.
    fn join(mut self) -> Result<Usage, String> {
        drop(self.jobs.take());
        let mut u = Usage::default();
        for t in self.threads {
            u = u + t.join().map_err(|_| "a checker thread panicked")?;
        }
        Ok(u)
    }
}

/// A checker thread: checks rooms until the queue closes; its usage.
fn check_loop(
    p: &Params,
    ranks: &[Rank<'_>],
    jobs: &Mutex<mpsc::Receiver<Job>>,
    done: &mpsc::Sender<Checked>,
) -> Usage {
    let u0 = Usage::thread();
    loop {
        let job = match jobs.lock().expect("job queue").recv() {
            Ok(j) => j,
            Err(_) => break,
        };
        let mut result = Ok(0);
        for (rank, (_, pool)) in ranks.iter().enumerate() {
            let pages = pool.pages_for(job.tokens as usize);
            let r = pool.verify(job.slot, pages, job.tokens, job.id, p.verify);
            result = match (result, r) {
                (Ok(a), Ok(b)) => Ok(a + b),
                (Err(e), _) => Err(e),
                (_, Err(e)) if ranks.len() > 1 => Err(format!("decode rank {rank}: {e}")),
                (_, Err(e)) => Err(e),
            };
        }
        let _ = done.send(Checked {
            idx: job.idx,
            slot: job.slot,
            result,
        });
        // The scheduler loop may be waiting in the engine.
        ranks[0].0.wake();
    }
    Usage::thread().since(u0)
}

/// A room's state over every rank ([`poll_all`], an error if one rank's poll failed):
/// whether every rank is SUCCESS, the first rank FAILED, whether every rank is
/// terminal, and whether any rank is transferring.
struct Polled {
    success: bool,
    failed: Option<usize>,
    terminal: bool,
    transferring: bool,
}

fn poll_all(ranks: &[Rank<'_>], id: u64) -> kvxfer::Result<Polled> {
    let mut st = Polled {
        success: true,
        failed: None,
        terminal: true,
        transferring: false,
    };
    for (i, (e, _)) in ranks.iter().enumerate() {
        let s = e.room_poll(id)?;
        st.success &= s == State::Success;
        st.terminal &= s.is_terminal();
        st.transferring |= s == State::Transferring;
        if s == State::Failed && st.failed.is_none() {
            st.failed = Some(i);
        }
    }
    Ok(st)
}

/// The clocks of a phase.
struct Clock {
    t0: Instant,
    /// `--duration`: when no more rooms are created.
    deadline: Option<Instant>,
    /// The next progress line.
    next_progress: Instant,
    /// When the last room was checked: the phase's end.
    t_last: Instant,
    usage: Usage,
    driver: Usage,
    host: HostMark,
}

impl Clock {
    /// A phase starts now.
    fn start(p: &Params) -> Clock {
        let t0 = Instant::now();
        Clock {
            t0,
            deadline: p.duration.map(|d| t0 + Duration::from_secs_f64(d)),
            next_progress: t0 + Duration::from_secs(1),
            t_last: t0,
            usage: Usage::now(),
            driver: Usage::thread(),
            host: HostMark::now(),
        }
    }
}

/// The decode scheduler loop of one phase: its state, and the steps of one turn.
struct Driver<'a, 'scope> {
    p: &'a Params,
    ranks: &'a [Rank<'a>],
    phase: &'a Phase<'a>,
    peers: RoomPeers,
    checkers: Checkers<'scope>,
    out: KvResult,
    free: Vec<usize>,
    live: Vec<Live>,
    /// Failed rooms whose pages a write may still reach.
    draining: Vec<Live>,
    recs: Vec<Rec>,
    /// Rooms to run (`u64::MAX` with `--duration`).
    total: u64,
    announced: u64,
    ended: bool,
    clock: Clock,
}

impl<'a, 'scope> Driver<'a, 'scope> {
    fn new(
        p: &'a Params,
        ranks: &'a [Rank<'a>],
        phase: &'a Phase<'a>,
        scope: &'scope Scope<'scope, 'a>,
    ) -> Result<Self, String> {
        Ok(Driver {
            p,
            ranks,
            phase,
            peers: RoomPeers::Prefills(phase.prefill_addrs.to_vec()),
            checkers: Checkers::spawn(p, ranks, scope),
            out: KvResult {
                feed: phase.feed,
                ..Default::default()
            },
            free: (0..ranks[0].1.slots).rev().collect(),
            live: Vec::with_capacity(p.concurrency),
            draining: Vec::new(),
            recs: Vec::new(),
            total: if p.duration.is_some() {
                u64::MAX
            } else {
                p.rooms
            },
            announced: 0,
            ended: false,
            clock: Clock::start(p),
        })
    }

    /// The loop waits in rank 0's engine.
    fn engine(&self) -> &'a Engine {
        self.ranks[0].0
    }

    /// Runs the phase: the prefill side is told to start, the loop turns until every
    /// room ended and was checked, then the prefill side's account is merged in.
    fn run(mut self, ctl: &mut Ctl) -> Result<KvResult, String> {
        ctl.send(&ToPrefill::Run {
            start: self.phase.start,
            engine: self.phase.prefill_set,
            feed: self.phase.feed,
        })?;
        self.clock = Clock::start(self.p);
        while !self.turn(ctl)? {}
        let (p, phase) = (self.p, self.phase);
        let (mut out, recs) = self.finish()?;
        account(p, phase, &mut out, &recs, ctl)?;
        Ok(out)
    }

    /// One turn of the loop, as a server's scheduler makes it; whether the phase is over.
    fn turn(&mut self, ctl: &mut Ctl) -> Result<bool, String> {
        let seen = self.engine().changes();
        let mut progress = self.collect_checked();
        let creating = self.creating();
        if creating {
            progress |= self.admit();
        }
        let waits = creating
            && self.free.is_empty()
            && self.live.len() < self.p.concurrency
            && self.checkers.checking > 0;
        self.checkers.urgent(self.p, waits);
        self.announce(ctl, creating)?;
        progress |= self.poll_live()?;
        progress |= self.drain();
        let rooms_left = !self.live.is_empty() || !self.draining.is_empty();
        if self.ended && !rooms_left && self.checkers.checking == 0 {
            return Ok(true);
        }
        self.progress_line();
        if !progress {
            self.idle(seen);
        }
        Ok(false)
    }

    /// Takes the rooms the checkers are done with: their slots are free again.
    fn collect_checked(&mut self) -> bool {
        let mut progress = false;
        while let Ok(c) = self.checkers.done.try_recv() {
            progress = true;
            self.checkers.checking -= 1;
            self.free.push(c.slot);
            let plan = room_plan(self.p, self.phase.start + c.idx as u64);
            match c.result {
                Ok(checked) => {
                    self.recs[c.idx].ok = true;
                    let tokens = self.moved(&plan);
                    let bytes = self
                        .ranks
                        .iter()
                        .map(|(_, pool)| pool.room_bytes(pool.pages_for(plan.tokens), tokens))
                        .sum::<u64>();
                    let out = &mut self.out;
                    out.ok += 1;
                    out.bytes += bytes;
                    out.bytes_checked += checked;
                    out.buffer_pages += (plan.pages * self.p.n_buffers()) as u64;
                }
                Err(e) => {
                    *self.out.failed.entry("verify".into()).or_default() += 1;
                    self.out.unexpected += 1;
                    self.out
                        .note(format!("room {}: delivered bytes differ: {e}", c.idx));
                }
            }
            self.clock.t_last = Instant::now();
        }
        progress
    }

    /// Tokens a room moves: the prefill's pages' tokens, at most the decode pages'.
    fn moved(&self, plan: &RoomPlan) -> u64 {
        let pool = self.ranks[0].1;
        let dst = pool.pages_for(plan.tokens) * pool.page_tokens;
        (plan.pages * self.p.page_tokens).min(dst) as u64
    }

    /// Whether rooms are still to be created.
    fn creating(&self) -> bool {
        !self.ended
            && (self.recs.len() as u64) < self.total
            && self.clock.deadline.is_none_or(|d| Instant::now() < d)
    }

    /// New rooms, while there is a free slot and room in the window.
    fn admit(&mut self) -> bool {
        let mut progress = false;
        while self.live.len() < self.p.concurrency && (self.recs.len() as u64) < self.total {
            let Some(slot) = self.free.pop() else { break };
            progress = true;
            self.create(slot);
        }
        progress
    }

    /// Creates the next room in `slot` on every rank, with its destination.
    fn create(&mut self, slot: usize) {
        let (p, ranks) = (self.p, self.ranks);
        let idx = self.recs.len();
        let plan = room_plan(p, self.phase.start + idx as u64);
        let id = room_id(p, self.phase.start + idx as u64);
        let aux = ranks[0].1.aux.is_some().then_some(slot as u32);
        let t_dest = mono_ns();
        let r = ranks.iter().try_for_each(|(e, pool)| {
            let pages = pool.pages(slot, pool.pages_for(plan.tokens));
            e.room_create(id, self.peers.clone())
                .and_then(|()| e.room_set_destination(id, &pages, aux))
        });
        self.recs.push(Rec {
            t_dest,
            planned_abort: plan.abort.is_some(),
            ..Default::default()
        });
        if plan.abort.is_some() {
            self.out.aborts_planned += 1;
        }
        let mut l = Live {
            idx,
            id,
            slot,
            tokens: self.moved(&plan),
            abort: plan.abort,
            aborted: false,
        };
        if let Err(e) = r {
            // The room is still announced: the prefill side creates it and sees it fail,
            // as it would in a server.
            *self.out.failed.entry("create_error".into()).or_default() += 1;
            self.out.unexpected += 1;
            self.out.note(format!("room {idx}: {e}"));
            for (e, _) in ranks {
                let _ = e.room_abort(id, "bench: setup failed");
            }
            self.draining.push(l);
            return;
        }
        // A planned decode abort comes from rank 0; the engines fail the room on every
        // other rank.
        if l.abort == Some(AbortAt::DecodeEarly) {
            let _ = self
                .engine()
                .room_abort(id, "bench: planned abort (decode, early)");
            l.aborted = true;
        }
        self.live.push(l);
    }

    /// Tells the prefill side which rooms exist (`Upto`), and once no more will (`End`).
    fn announce(&mut self, ctl: &mut Ctl, creating: bool) -> Result<(), String> {
        let start = self.phase.start;
        if self.recs.len() as u64 > self.announced {
            self.announced = self.recs.len() as u64;
            ctl.send(&ToPrefill::Upto(start + self.announced))?;
        }
        if !self.ended && !creating {
            self.ended = true;
            ctl.send(&ToPrefill::End(start + self.recs.len() as u64))?;
        }
        Ok(())
    }

    /// Polls every room in flight on every rank, as a server's scheduler loop does.
    fn poll_live(&mut self) -> Result<bool, String> {
        let mut progress = false;
        let mut i = 0;
        while i < self.live.len() {
            let id = self.live[i].id;
            let ended = match poll_all(self.ranks, id) {
                Ok(Polled { success: true, .. }) => self.succeeded(i)?,
                Ok(Polled {
                    failed: Some(rank),
                    terminal,
                    ..
                }) => self.failed(i, rank, terminal),
                Ok(Polled { transferring, .. }) => {
                    progress |= self.in_flight(i, transferring);
                    false
                }
                Err(e) => self.poll_failed(i, e),
            };
            if ended {
                progress = true;
            } else {
                i += 1;
            }
        }
        Ok(progress)
    }

    /// Room `live[i]` reached SUCCESS on every rank: cleared, its pages to a checker.
    fn succeeded(&mut self, i: usize) -> Result<bool, String> {
        let l = self.live.swap_remove(i);
        let rec = &mut self.recs[l.idx];
        rec.t_done = mono_ns();
        if !rec.seen_transferring {
            rec.t_first = rec.t_done;
        }
        if l.abort.is_some() {
            self.out.aborts_too_late += 1;
        }
        for (e, _) in self.ranks {
            let _ = e.room_clear(l.id);
        }
        self.checkers.check(Job {
            idx: l.idx,
            id: l.id,
            slot: l.slot,
            tokens: l.tokens,
        })?;
        Ok(true)
    }

    /// Room `live[i]` FAILED on rank `rank`: counted, expected or not, and drained.
    fn failed(&mut self, i: usize, rank: usize, terminal: bool) -> bool {
        let l = self.live.swap_remove(i);
        self.recs[l.idx].t_done = mono_ns();
        let (key, expected, msg) = match self.ranks[rank].0.room_failure(l.id) {
            Ok(f) => (
                f.cause.name().to_string(),
                l.abort.is_some() && prefill::is_abort(f.cause.name()),
                f.to_string(),
            ),
            Err(e) => ("unknown".into(), false, e.to_string()),
        };
        *self.out.failed.entry(key).or_default() += 1;
        if expected {
            self.out.expected += 1;
        } else {
            self.out.unexpected += 1;
            let on = if self.ranks.len() > 1 {
                format!(" (decode rank {rank})")
            } else {
                String::new()
            };
            self.out.note(format!("room {}{on}: {msg}", l.idx));
        }
        // The request is gone: a rank still live gives up too (the engines would fail it
        // through the prefill ranks; this does not wait).
        if !terminal {
            for (e, _) in self.ranks {
                let _ = e.room_abort(l.id, "bench: another decode rank failed");
            }
        }
        self.draining.push(l);
        true
    }

    /// Room `live[i]` is still in flight: its first byte is noted, and a planned
    /// mid-transfer abort made. Whether that abort was made (a poll alone is not
    /// progress: the loop sleeps as it did before it looked).
    fn in_flight(&mut self, i: usize, transferring: bool) -> bool {
        let l = &mut self.live[i];
        let rec = &mut self.recs[l.idx];
        if transferring && !rec.seen_transferring {
            rec.seen_transferring = true;
            rec.t_first = mono_ns();
        }
        if transferring && l.abort == Some(AbortAt::DecodeMid) && !l.aborted {
            let _ = self.ranks[0]
                .0
                .room_abort(l.id, "bench: planned abort (decode, mid-transfer)");
            l.aborted = true;
            return true;
        }
        false
    }

    /// Room `live[i]` could not be polled: counted as unexpected, aborted and drained.
    fn poll_failed(&mut self, i: usize, e: kvxfer::Error) -> bool {
        let l = self.live.swap_remove(i);
        *self.out.failed.entry("poll_error".into()).or_default() += 1;
        self.out.unexpected += 1;
        self.out.note(format!("room {}: poll: {e}", l.idx));
        for (e, _) in self.ranks {
            let _ = e.room_abort(l.id, "bench: poll failed");
        }
        self.draining.push(l);
        true
    }

    /// Failed rooms give their pages back once no write into them can still land, on
    /// any rank.
    fn drain(&mut self) -> bool {
        let ranks = self.ranks;
        let mut freed = Vec::new();
        self.draining.retain(|l| {
            let drained = ranks
                .iter()
                .all(|(e, _)| e.room_drained(l.id).unwrap_or(true));
            if drained {
                for (e, _) in ranks {
                    let _ = e.room_clear(l.id);
                }
                freed.push(l.slot);
            }
            !drained
        });
        let progress = !freed.is_empty();
        self.free.extend(freed);
        progress
    }

    /// The running totals, once a second on stderr.
    fn progress_line(&mut self) {
        if Instant::now() < self.clock.next_progress {
            return;
        }
        self.clock.next_progress += Duration::from_secs(1);
        let s = self.clock.t0.elapsed().as_secs_f64();
        let out = &self.out;
        eprintln!(
            "kvxfer-bench [{}] {s:6.1}s: {} rooms ok, {} failed ({} expected), {} in flight, \
             {:.2} GB/s verified, {:.0} rooms/s",
            self.p.preset,
            out.ok,
            out.expected + out.unexpected,
            out.expected,
            self.live.len() + self.checkers.checking,
            out.bytes as f64 / s / 1e9,
            out.ok as f64 / s
        );
    }

    /// Nothing to do: a room's change of state and a checked room wake the wait; a
    /// failed room draining does not, so it is looked at every --poll-us; the progress
    /// line and the run's deadline bound the rest.
    fn idle(&self, seen: u64) {
        let now = Instant::now();
        let mut longest = self.clock.next_progress.saturating_duration_since(now);
        if let Some(d) = self.clock.deadline {
            longest = longest.min(d.saturating_duration_since(now));
        }
        if !self.draining.is_empty() {
            longest = longest.min(Duration::from_micros(self.p.poll_us));
        }
        crate::ctl::idle(self.p, self.engine(), seen, longest);
    }

    /// The phase is over: its duration and usage; the checkers stop.
    fn finish(mut self) -> Result<(KvResult, Vec<Rec>), String> {
        let c = &self.clock;
        self.out.secs = c
            .t_last
            .max(c.t0 + Duration::from_nanos(1))
            .duration_since(c.t0)
            .as_secs_f64();
        self.out.decode = Usage::now().since(c.usage);
        self.out.host = c.host.since();
        self.out.driver = Usage::thread().since(c.driver);
        self.out.rooms = self.recs.len() as u64;
        self.out.verify = self.checkers.join()?;
        Ok((self.out, self.recs))
    }
}

/// Time-to-first-token of a room with simulated compute: its first layer's compute
/// (prefill) to decode SUCCESS, when the decode side took it whole and the two
/// timestamps share a clock (one host).
pub(super) fn ttft(pr: &PrefillRoom, rec: &Rec, same_host: bool) -> Option<u64> {
    let c = pr.compute.as_ref()?;
    (same_host && rec.ok).then(|| c.ttft_ns(rec.t_done))
}

/// The prefill side's account of the phase's rooms, merged into `out`: its usage, and
/// each room's outcome and latencies against what the decode side saw (`recs`).
fn account(
    p: &Params,
    phase: &Phase<'_>,
    out: &mut KvResult,
    recs: &[Rec],
    ctl: &mut Ctl,
) -> Result<(), String> {
    let (prooms, usage, driver, runs) = match ctl.recv()? {
        ToDecode::PhaseDone {
            rooms,
            usage,
            driver,
            runs,
        } => (rooms, usage, driver, runs),
        other => return Err(format!("prefill side said {} after the run", other.kind())),
    };
    if prooms.len() != recs.len() {
        return Err(format!(
            "the prefill side ran {} rooms, the decode side {}",
            prooms.len(),
            recs.len()
        ));
    }
    out.prefill = usage;
    out.prefill_driver = driver;
    out.runs = runs;
    if let Some(path) = &p.room_log {
        log_rooms(path, phase, &prooms, recs)?;
    }
    for (idx, (pr, rec)) in prooms.iter().zip(recs).enumerate() {
        if let Some(c) = &pr.compute {
            out.late.extend(&c.late_ns);
        }
        if let (Some(t), true) = (ttft(pr, rec, phase.same_host), pr.outcome == Outcome::Ok) {
            out.ttft.push(t);
            let pages = room_plan(p, phase.start + idx as u64).pages;
            out.compute.push(p.compute_ns(phase.feed, pages));
            let last = pr.compute.as_ref().and_then(|c| c.late_ns.last());
            out.last_late.push(last.copied().unwrap_or(0));
        }
        outcome(out, idx, pr, rec, phase.same_host);
    }
    if phase.same_host {
        out.room_link = room_link(&prooms, recs);
    }
    Ok(())
}

/// Each successful room's time on the link ([`KvResult::room_link`]), ns.
fn room_link(prooms: &[PrefillRoom], recs: &[Rec]) -> Vec<u64> {
    let mut ends: Vec<(u64, u64)> = prooms
        .iter()
        .zip(recs)
        .filter(|(pr, rec)| rec.ok && pr.outcome == Outcome::Ok)
        .map(|(pr, rec)| (rec.t_done, pr.t_enq))
        .collect();
    ends.sort_unstable();
    ends.windows(2)
        .map(|w| w[1].0.saturating_sub(w[0].0.max(w[1].1)))
        .collect()
}

/// `--room-log`: one JSON line per room of the phase appended to `path`, its times on
/// both sides (CLOCK_MONOTONIC ns, comparable on one host; 0: did not happen, and
/// SUCCESS only for a room whose pages checked).
fn log_rooms(
    path: &str,
    phase: &Phase<'_>,
    prooms: &[PrefillRoom],
    recs: &[Rec],
) -> Result<(), String> {
    use std::io::Write as _;
    let mut text = String::new();
    for (idx, (pr, rec)) in prooms.iter().zip(recs).enumerate() {
        let c = pr.compute.clone().unwrap_or_default();
        let line = serde_json::json!({
            "room": phase.start + idx as u64,
            "layerwise": phase.feed.simulate.then_some(phase.feed.by_layer),
            "compute_us_per_layer": phase.feed.compute_us_per_layer,
            "decode_dest_ns": rec.t_dest,
            "prefill_first_enqueue_ns": pr.t_enq,
            "compute_start_ns": c.start,
            "compute_end_ns": c.end,
            "decode_transferring_ns": rec.t_first,
            "decode_success_ns": if rec.ok { rec.t_done } else { 0 },
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|e| format!("--room-log {path}: {e}"))
}

/// Room `idx`'s outcome on both sides: the latencies of a room both took, the split
/// outcomes, and the prefill side's failures.
fn outcome(out: &mut KvResult, idx: usize, pr: &PrefillRoom, rec: &Rec, same_host: bool) {
    match &pr.outcome {
        Outcome::Ok => {
            if !rec.ok {
                out.split_prefill_ok_decode_failed += 1;
            }
            out.lat_prefill.push(pr.t_term.saturating_sub(pr.t_enq));
            if rec.ok {
                if same_host {
                    out.lat_e2e.push(rec.t_done.saturating_sub(pr.t_enq));
                    out.lat_first.push(rec.t_first.saturating_sub(pr.t_enq));
                    out.first_at_success += u64::from(!rec.seen_transferring);
                }
                out.lat_decode.push(rec.t_done.saturating_sub(rec.t_dest));
            }
        }
        Outcome::Failed { cause, .. } => {
            if rec.ok {
                out.split_prefill_failed_decode_ok += 1;
                out.note(format!(
                    "room {idx}: SUCCESS on the decode side, {} on the prefill side",
                    pr.outcome
                ));
            }
            *out.prefill_failed.entry(cause.clone()).or_default() += 1;
            if rec.planned_abort && prefill::is_abort(cause) {
                out.prefill_expected += 1;
            } else {
                out.prefill_unexpected += 1;
                out.note(format!("prefill room {idx}: {}", pr.outcome));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctl::Computed;

    fn prefill_room(compute: Option<Computed>) -> PrefillRoom {
        PrefillRoom {
            t_enq: 1_500,
            t_term: 9_000,
            outcome: Outcome::Ok,
            compute,
        }
    }

    #[test]
    fn ttft_runs_from_the_first_layers_compute_to_decode_success_on_one_host_only() {
        let computed = Computed {
            start: 1_000,
            end: 5_200,
            late_ns: vec![100, 200],
        };
        let rec = Rec {
            t_dest: 400,
            t_done: 7_000,
            ok: true,
            ..Default::default()
        };
        let pr = prefill_room(Some(computed.clone()));
        // From the compute's start, not from the first enqueue (1_500).
        assert_eq!(ttft(&pr, &rec, true), Some(6_000));
        // Across hosts the clocks differ; a room not delivered whole has no TTFT; a
        // phase without simulated compute neither.
        assert_eq!(ttft(&pr, &rec, false), None);
        let lost = Rec {
            ok: false,
            ..rec.clone()
        };
        assert_eq!(ttft(&pr, &lost, true), None);
        assert_eq!(ttft(&prefill_room(None), &rec, true), None);
        // A SUCCESS stamped before the compute began (it cannot be) is not negative.
        assert_eq!(computed.ttft_ns(500), 0);
    }

    /// Rooms queued behind each other each count from the previous one's SUCCESS; a
    /// room enqueued after the link went idle, from its enqueue; a failed room not at
    /// all, and rooms are taken in the order they succeeded.
    #[test]
    fn a_rooms_time_on_the_link_starts_at_the_previous_success_or_its_own_enqueue() {
        let room = |t_enq: u64, t_done: u64, ok: bool| {
            let pr = PrefillRoom {
                t_enq,
                ..prefill_room(None)
            };
            let rec = Rec {
                t_done,
                ok,
                ..Default::default()
            };
            (pr, rec)
        };
        let (prooms, recs): (Vec<_>, Vec<_>) = [
            room(0, 100, true),
            room(0, 300, true),
            room(0, 250, false),
            room(500, 560, true),
            room(0, 170, true),
        ]
        .into_iter()
        .unzip();
        // In order of SUCCESS: 100, 170 (70 after 100), 300 (130), 560 (enqueued at 500).
        assert_eq!(room_link(&prooms, &recs), vec![70, 130, 60]);
    }
}
