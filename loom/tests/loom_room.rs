//! Model checking one room's state machine with loom: every interleaving of the threads
//! that touch one room, first under the real rule (the library's own
//! `transition` and `StateWord::apply`, running over loom's atomic byte), then under the
//! reference design's rule (status = max(current, new) as a plain load then store,
//! abort dropping the transfer metadata, a worker skipping a chunk whose metadata is
//! gone without writing any state). The real rule must pass every check in every
//! interleaving; under the reference rule the checker must find the silent pin, or the
//! checks could not tell the two apart and would prove nothing.
//!
//! Run with `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test --release
//! -p kvxfer-loom --test loom_room -- --nocapture` (`make loom`). The crate `kvxfer-loom`
//! compiles the library's `src/room/state.rs` and nothing else of it.
//!
//! The threads (DESIGN.md section 2, prefill side), all on one room:
//! - scheduler: abort, then clear (fail if live, then remove from the table);
//! - control thread: the destination arrives (Ready, which dispatches the chunks to the
//!   worker), then an abort from the peer (Fail);
//! - worker: a non-last chunk (Start, one guarded frame), then the last chunk (Start, one
//!   guarded frame, Complete);
//! - watchdog: one deadline scan (Fail if still live).
//!
//! Checked in every execution: the room is terminal once every thread finished and clear
//! ran; a terminal state, once written, is never overwritten with another state; every
//! skipped chunk leaves the room terminal (DESIGN.md invariant 4); a failed room has a
//! reason; clear leaves nothing in the table and nothing re-creates the room.

#![cfg(loom)]

use std::cell::RefCell;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex as StdMutex;
use std::time::Instant;

use kvxfer_loom::state::{AtomicByte, Event, Refusal, State, StateWord};
use loom::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize as LoomUsize};
use loom::sync::Arc;
use loom::thread;

/// Preemptions per execution. The silent pin of the reference rule needs three: the
/// worker between its metadata check and its status write, the control thread between
/// dispatching the worker and its own abort, the scheduler between its abort and its
/// poll; with two the checker finds resurrections but no pin. Both rules are checked at
/// the same bound. Override with `KVXFER_LOOM_PREEMPTIONS`.
const PREEMPTION_BOUND: usize = 3;

// ---------------------------------------------------------------------------------------
// Per-execution trace. loom runs the model's threads as coroutines on the calling OS
// thread and switches only at loom operations, so plain (non-loom) bookkeeping done right
// after an atomic operation happens atomically with it and in the execution's order,
// without adding scheduling points of its own.

#[derive(Default)]
struct Trace {
    /// Every value written into a room's state, in modification order: (word, state).
    writes: Vec<(usize, u8)>,
    /// How many state words exist (the reference rule can re-create a room).
    words: usize,
    /// What each thread did, in execution order (formatted only for a reported example).
    steps: Vec<Step>,
    /// Violations seen during this execution.
    violations: Vec<String>,
    /// The reason code of the `fail` call whose transition won, if one did.
    winner: Option<usize>,
}

thread_local! {
    static TRACE: RefCell<Trace> = RefCell::new(Trace::default());
}

/// One step of one thread: who, what, and the state it saw or left (`u8::MAX`: none).
#[derive(Clone, Copy)]
struct Step(&'static str, &'static str, u8);

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:9} {}", self.0, self.1)?;
        if self.2 != u8::MAX {
            write!(f, " -> {}", name(self.2).to_uppercase())?;
        }
        Ok(())
    }
}

fn step(who: &'static str, what: &'static str, state: Option<u8>) {
    TRACE.with(|t| {
        t.borrow_mut()
            .steps
            .push(Step(who, what, state.unwrap_or(u8::MAX)))
    });
}

/// The state a transition attempt left or found.
fn seen(r: &Result<(State, State), Refusal>) -> Option<u8> {
    Some(match r {
        Ok((_, to)) => *to as u8,
        Err(Refusal::Terminal(s)) => *s as u8,
        Err(Refusal::NotAllowed { from, .. }) => *from as u8,
        Err(Refusal::Moved(s)) => *s as u8,
    })
}

fn violation(what: impl Into<String>) {
    TRACE.with(|t| t.borrow_mut().violations.push(what.into()));
}

/// A loom atomic byte that logs every value written into it (the [`AtomicByte`] the real
/// [`StateWord`] runs over here, and the reference design's status cell).
struct Traced {
    id: usize,
    byte: AtomicU8,
}

impl Traced {
    fn logged(&self, v: u8) {
        TRACE.with(|t| t.borrow_mut().writes.push((self.id, v)));
    }

    /// A plain store (the reference design's dict assignment), made as a swap: loom
    /// treats SeqCst as AcqRel and may order two plain stores of different threads
    /// against the order they ran in, which no sequentially consistent execution (the
    /// reference runs under Python's GIL) can do. Writes that are read-modify-writes are
    /// totally ordered in loom, so the log below is the modification order.
    fn store(&self, v: u8) {
        self.byte.swap(v, Ordering::SeqCst);
        self.logged(v);
    }
}

impl AtomicByte for Traced {
    fn new(v: u8) -> Self {
        let id = TRACE.with(|t| {
            let mut t = t.borrow_mut();
            t.words += 1;
            t.words - 1
        });
        let w = Traced {
            id,
            byte: AtomicU8::new(v),
        };
        w.logged(v);
        w
    }

    fn load(&self, order: Ordering) -> u8 {
        self.byte.load(order)
    }

    fn compare_exchange_weak(
        &self,
        current: u8,
        new: u8,
        success: Ordering,
        failure: Ordering,
    ) -> Result<u8, u8> {
        let r = self
            .byte
            .compare_exchange_weak(current, new, success, failure);
        if r.is_ok() {
            self.logged(new);
        }
        r
    }
}

fn name(v: u8) -> &'static str {
    match v {
        MISSING => "released",
        v => State::from_u8(v).map_or("invalid", State::name),
    }
}

fn terminal(v: u8) -> bool {
    State::from_u8(v).is_some_and(State::is_terminal)
}

/// What the checker found over all executions of one model.
#[derive(Default)]
struct Findings {
    executions: AtomicUsize,
    /// Executions with at least one violation.
    violating: AtomicUsize,
    /// Violations by kind (the text before the first ':').
    by_kind: StdMutex<std::collections::BTreeMap<String, usize>>,
    /// The first violating execution of each kind, step by step.
    examples: StdMutex<std::collections::BTreeMap<String, String>>,
}

impl Findings {
    /// Runs `body` as a loom model with the preemption bound, checking the trace of every
    /// execution; returns the wall time taken.
    fn run(self: &std::sync::Arc<Self>, body: fn()) -> std::time::Duration {
        let bound = std::env::var("KVXFER_LOOM_PREEMPTIONS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(PREEMPTION_BOUND);
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(bound);
        let me = self.clone();
        let start = Instant::now();
        b.check(move || {
            TRACE.with(|t| *t.borrow_mut() = Trace::default());
            body();
            check_history();
            let t = TRACE.with(|t| std::mem::take(&mut *t.borrow_mut()));
            me.executions.fetch_add(1, Ordering::Relaxed);
            if t.violations.is_empty() {
                return;
            }
            me.violating.fetch_add(1, Ordering::Relaxed);
            let mut kinds = me.by_kind.lock().unwrap();
            let mut examples = me.examples.lock().unwrap();
            for v in &t.violations {
                let kind = v.split(':').next().unwrap_or(v).to_string();
                *kinds.entry(kind.clone()).or_default() += 1;
                examples.entry(kind).or_insert_with(|| {
                    let mut s = String::new();
                    for (i, st) in t.steps.iter().enumerate() {
                        let _ = writeln!(s, "      {:2}. {st}", i + 1);
                    }
                    let writes: Vec<&str> = t.writes.iter().map(|&(_, v)| name(v)).collect();
                    let _ = writeln!(s, "      writes, in order: {}", writes.join(", "));
                    let _ = writeln!(s, "      => {v}");
                    s
                });
            }
        });
        start.elapsed()
    }

    fn report(&self, rule: &str, took: std::time::Duration) -> String {
        let mut s = format!(
            "{rule}: {} interleavings explored (preemption bound {}), {} with a violation, {:.1} s",
            self.executions.load(Ordering::Relaxed),
            std::env::var("KVXFER_LOOM_PREEMPTIONS").unwrap_or(PREEMPTION_BOUND.to_string()),
            self.violating.load(Ordering::Relaxed),
            took.as_secs_f64()
        );
        let examples = self.examples.lock().unwrap();
        for (k, n) in self.by_kind.lock().unwrap().iter() {
            let _ = write!(s, "\n    {n:7} x {k}");
            if let Some(ex) = examples.get(k) {
                let _ = write!(s, "; first seen in:\n{ex}");
            }
        }
        s
    }
}

/// Terminal states are sticky: after the first terminal value written into a word, every
/// later write into it must write that same value.
fn check_history() {
    let writes = TRACE.with(|t| t.borrow().writes.clone());
    let words = TRACE.with(|t| t.borrow().words);
    for w in 0..words {
        let mut latched: Option<u8> = None;
        for &(_, v) in writes.iter().filter(|(id, _)| *id == w) {
            if v == MISSING {
                // Released from the table: what comes after is another life of the id.
                latched = None;
                continue;
            }
            match latched {
                Some(t) if v != t => violation(format!(
                    "terminal state overwritten: a {} room was made {}",
                    name(t).to_uppercase(),
                    name(v).to_uppercase()
                )),
                Some(_) => {}
                None if terminal(v) => latched = Some(v),
                None => {}
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// The real rule: kvxfer's StateWord over loom's atomic, with the engine's code paths
// (src/room/mod.rs Room::fail, src/engine/prefill/sender.rs send_chunk, src/engine/mod.rs
// room_abort/room_clear, src/engine/watchdog.rs scan) reduced to their state operations.
// Every other shared access is one loom atomic, so that the interleavings explored are
// those of the state word.

struct Room {
    word: StateWord<Traced>,
    /// Room::fail's OnceLock: the reason of the call that won the transition (0 = none),
    /// recorded right after its CAS.
    reason: LoomUsize,
    /// Model dc64da3's `Room::fail` instead: the first reason set wins, set before the
    /// CAS, so a call that then loses the CAS can leave its reason on a room another call
    /// failed.
    reason_first: bool,
}

/// The reasons, by code (index + 1).
const REASONS: [&str; 7] = [
    "aborted by the scheduler",
    "cleared while live",
    "aborted by the peer",
    "room ended while sending",
    "deadline",
    "lost the peer",
    "a protocol error",
];

impl Room {
    fn new(reason_first: bool) -> Room {
        Room {
            word: StateWord::with_atomic(State::Bootstrapping),
            reason: LoomUsize::new(0),
            reason_first,
        }
    }

    /// Room::fail: the CAS to FAILED; its winner records its reason.
    fn fail(&self, who: &'static str, why: &'static str) -> bool {
        let code = REASONS.iter().position(|r| *r == why).expect("known") + 1;
        if self.reason_first {
            let s = self.word.load();
            if s.is_terminal() {
                step(who, why, Some(s as u8));
                return false;
            }
            let _ = self
                .reason
                .compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst);
        }
        let r = self.word.apply(Event::Fail);
        step(who, why, seen(&r));
        if r.is_ok() {
            TRACE.with(|t| t.borrow_mut().winner = Some(code));
            if !self.reason_first {
                self.reason.store(code, Ordering::SeqCst);
            }
        }
        r.is_ok()
    }

    /// The end-of-execution checks on the reason (DESIGN.md invariant 3).
    fn check_reason(&self) {
        if self.word.load() != State::Failed {
            return;
        }
        let code = self.reason.load(Ordering::SeqCst);
        if code == 0 {
            return violation("FAILED without a reason");
        }
        let winner = TRACE.with(|t| t.borrow().winner);
        if winner != Some(code) {
            violation(format!(
                "reason of a call that lost the transition: '{}' recorded, '{}' failed the room",
                REASONS[code - 1],
                winner.map_or("nobody", |w| REASONS[w - 1])
            ));
        }
    }
}

/// The room table with one slot: `present` says whether the room is in it.
struct Table {
    present: AtomicBool,
    room: Arc<Room>,
}

impl Table {
    fn lookup(&self) -> Option<Arc<Room>> {
        self.present
            .load(Ordering::SeqCst)
            .then(|| self.room.clone())
    }
}

/// What a worker did with one chunk.
enum Chunk {
    Sent,
    /// Dropped: the room was found terminal (or Start was refused).
    Skipped(State),
    /// Sending failed; the worker fails the room with this reason.
    Failed(&'static str),
}

/// prefill.rs send_chunk, reduced to its state operations.
fn send_chunk(room: &Room, is_last: bool) -> Chunk {
    let s = room.word.load();
    if s.is_terminal() {
        return Chunk::Skipped(s);
    }
    match room.word.apply(Event::Start) {
        Ok(_) => {}
        // The engine returns Ok(()) on any refusal of Start: a skip.
        Err(Refusal::Terminal(s)) => return Chunk::Skipped(s),
        Err(Refusal::NotAllowed { from, .. }) => return Chunk::Skipped(from),
        Err(Refusal::Moved(s)) => return Chunk::Skipped(s),
    }
    step(
        "worker",
        if is_last {
            "start last chunk"
        } else {
            "start chunk 0"
        },
        None,
    );
    // The write window: every frame is sent only while the room is live.
    if room.word.load().is_terminal() {
        return Chunk::Failed("room ended while sending");
    }
    step("worker", "frame written", None);
    if is_last {
        let r = room.word.apply(Event::Complete);
        step("worker", "complete", seen(&r));
        if let Err(r @ Refusal::NotAllowed { .. }) = r {
            violation(format!(
                "Complete refused on a live room: {r} (the worker drops it silently)"
            ));
        }
    }
    Chunk::Sent
}

fn real_worker(room: Arc<Room>) {
    for is_last in [false, true] {
        match send_chunk(&room, is_last) {
            Chunk::Sent => continue,
            Chunk::Skipped(seen) => {
                step(
                    "worker",
                    if is_last {
                        "skip last chunk"
                    } else {
                        "skip chunk 0"
                    },
                    Some(seen as u8),
                );
            }
            Chunk::Failed(why) => {
                room.fail("worker", why);
            }
        }
        // Invariant 4: a chunk that was not sent leaves no live room behind.
        let s = room.word.load();
        if !s.is_terminal() {
            violation(format!("skipped chunk left the room live: {s}"));
        }
    }
}

fn real_rule_execution() {
    let room = Arc::new(Room::new(false));
    let table = Arc::new(Table {
        present: AtomicBool::new(true),
        room: room.clone(),
    });

    let scheduler = {
        let table = table.clone();
        thread::spawn(move || {
            if let Some(r) = table.lookup() {
                r.fail("scheduler", "aborted by the scheduler");
            }
            // room_clear: fail if live, then remove the room.
            if let Some(r) = table.lookup() {
                r.fail("scheduler", "cleared while live");
                table.present.swap(false, Ordering::SeqCst);
                step("scheduler", "cleared", None);
            }
        })
    };
    let control = {
        let table = table.clone();
        thread::spawn(move || {
            let mut worker = None;
            if let Some(r) = table.lookup() {
                let ready = r.word.apply(Event::Ready);
                step("control", "destination arrived", seen(&ready));
                if ready.is_ok() {
                    // attach(): the held chunks go to the room's worker.
                    worker = Some(thread::spawn(move || real_worker(r)));
                }
            }
            if let Some(r) = table.lookup() {
                r.fail("control", "aborted by the peer");
            }
            worker
        })
    };
    let watchdog = {
        let table = table.clone();
        thread::spawn(move || {
            if let Some(r) = table.lookup() {
                if !r.word.load().is_terminal() {
                    r.fail("watchdog", "deadline");
                }
            }
        })
    };
    scheduler.join().unwrap();
    watchdog.join().unwrap();
    if let Some(w) = control.join().unwrap() {
        w.join().unwrap();
    }

    let end = room.word.load();
    if !end.is_terminal() {
        violation(format!("pinned: the room ended {end} after clear"));
    }
    room.check_reason();
    if table.present.load(Ordering::SeqCst) {
        violation("clear left state behind: the table still holds the room");
    }
}

/// Two failures racing on a live room (a peer's loss and a protocol error), with
/// `Room::fail` as it is or as it was at dc64da3 (`reason_first`).
fn fail_race_execution(reason_first: bool) {
    let room = Arc::new(Room::new(reason_first));
    room.word.apply(Event::Ready).expect("live");
    let a = {
        let r = room.clone();
        thread::spawn(move || {
            r.fail("control", "lost the peer");
        })
    };
    let b = {
        let r = room.clone();
        thread::spawn(move || {
            r.fail("receiver", "a protocol error");
        })
    };
    a.join().unwrap();
    b.join().unwrap();
    room.check_reason();
}

// ---------------------------------------------------------------------------------------
// The reference design's rule (DESIGN.md section 1): a status table where every update
// but FAILED is max(current, new) as a separate load and store, FAILED a plain store; an
// update for a room missing from the table inserts it; abort drops the transfer
// metadata; a worker that finds the metadata gone skips the chunk without writing any
// state; the scheduler releases a room only once it polls terminal. The reference is
// Python: one dict operation is atomic, two are not; here each is one loom atomic
// operation, so an update costs what the real rule's `apply` costs (a load, then a
// store where the real rule has a compare-and-swap).

/// The room's entry in the status table: a state, or [`MISSING`] once released.
const MISSING: u8 = u8::MAX - 1;

/// What each status update asked for, by the new state's value.
const STATUS_WRITE: [&str; 5] = [
    "status = FAILED",
    "status = max(cur, BOOTSTRAPPING)",
    "status = max(cur, WAITING_FOR_INPUT)",
    "status = max(cur, TRANSFERRING)",
    "status = max(cur, SUCCESS)",
];

struct Reference {
    /// `request_status[room]`.
    status: Traced,
    /// `room in transfer_infos`: the room's transfer metadata (destination) is present.
    meta: AtomicBool,
}

impl Reference {
    fn update_status(&self, who: &'static str, new: State) {
        let v = if new == State::Failed {
            State::Failed as u8
        } else {
            match self.status.load(Ordering::SeqCst) {
                // `if room not in request_status: request_status[room] = status`
                MISSING => new as u8,
                // The window: another thread may write between this load and the store.
                cur => cur.max(new as u8),
            }
        };
        self.status.store(v);
        step(who, STATUS_WRITE[new as usize], Some(v));
    }

    fn abort(&self, who: &'static str) {
        self.update_status(who, State::Failed);
        self.meta.swap(false, Ordering::SeqCst);
        step(who, "abort: metadata dropped", None);
    }
}

fn reference_worker(r: Arc<Reference>) {
    for is_last in [false, true] {
        if !r.meta.load(Ordering::SeqCst) {
            // The reference skip path: no state written.
            let s = r.status.load(Ordering::SeqCst);
            step(
                "worker",
                if is_last {
                    "metadata gone: skip last chunk"
                } else {
                    "metadata gone: skip chunk 0"
                },
                Some(s),
            );
            if s != MISSING && !terminal(s) {
                violation(format!("skipped chunk left the room live: {}", name(s)));
            }
            continue;
        }
        r.update_status("worker", State::Transferring);
        if is_last {
            r.update_status("worker", State::Success);
        }
    }
}

fn reference_rule_execution() {
    let r = Arc::new(Reference {
        status: Traced::new(State::Bootstrapping as u8),
        meta: AtomicBool::new(false),
    });

    let scheduler = {
        let r = r.clone();
        thread::spawn(move || {
            r.abort("scheduler");
            // The scheduler releases the room only once it polls terminal; otherwise it
            // stays in the inflight queue, polled forever.
            let s = r.status.load(Ordering::SeqCst);
            if terminal(s) {
                r.status.store(MISSING);
                step("scheduler", "poll: terminal, released", Some(s));
            } else {
                step("scheduler", "poll: not terminal, kept in flight", Some(s));
            }
        })
    };
    let control = {
        let r = r.clone();
        thread::spawn(move || {
            r.meta.swap(true, Ordering::SeqCst);
            r.update_status("control", State::WaitingForInput);
            let worker = {
                let r = r.clone();
                thread::spawn(move || reference_worker(r))
            };
            r.abort("control");
            worker
        })
    };
    let watchdog = {
        let r = r.clone();
        thread::spawn(move || {
            let s = r.status.load(Ordering::SeqCst);
            if s != MISSING && !terminal(s) {
                r.update_status("watchdog", State::Failed);
            }
        })
    };
    scheduler.join().unwrap();
    watchdog.join().unwrap();
    control.join().unwrap().join().unwrap();

    let end = r.status.load(Ordering::SeqCst);
    let released = TRACE.with(|t| t.borrow().writes.iter().any(|&(_, v)| v == MISSING));
    if end == MISSING {
        return;
    }
    if released {
        violation(format!(
            "clear left state behind: a late update re-created the released room as {}",
            name(end).to_uppercase()
        ));
    } else if !terminal(end) {
        // Still in flight and never terminal: the scheduler polls it forever.
        violation(format!(
            "pinned: the room ended {} and is never released",
            name(end).to_uppercase()
        ));
    }
}

// ---------------------------------------------------------------------------------------

#[test]
fn the_real_rule_holds_in_every_interleaving() {
    let f = std::sync::Arc::new(Findings::default());
    let took = f.run(real_rule_execution);
    let report = f.report("real rule (kvxfer StateWord::apply)", took);
    println!("{report}");
    assert!(f.executions.load(Ordering::Relaxed) > 1000, "{report}");
    assert_eq!(f.violating.load(Ordering::Relaxed), 0, "{report}");
}

#[test]
fn the_recorded_reason_is_always_the_winning_failure_s() {
    let f = std::sync::Arc::new(Findings::default());
    let took = f.run(|| fail_race_execution(false));
    let report = f.report("Room::fail, reason recorded by the CAS winner", took);
    println!("{report}");
    assert!(f.executions.load(Ordering::Relaxed) > 1, "{report}");
    assert_eq!(f.violating.load(Ordering::Relaxed), 0, "{report}");
}

/// The checker tells the two orders apart: with the reason set before the CAS, a call
/// that loses the CAS can leave its reason on the room.
#[test]
fn setting_the_reason_before_the_cas_is_caught_reporting_a_loser_s_reason() {
    let f = std::sync::Arc::new(Findings::default());
    let took = f.run(|| fail_race_execution(true));
    let report = f.report("Room::fail as of dc64da3, reason set before the CAS", took);
    println!("{report}");
    let kinds = f.by_kind.lock().unwrap().clone();
    assert!(
        kinds
            .get("reason of a call that lost the transition")
            .copied()
            .unwrap_or(0)
            > 0,
        "{report}"
    );
}

#[test]
fn the_reference_rule_is_caught_pinning_a_room() {
    let f = std::sync::Arc::new(Findings::default());
    let took = f.run(reference_rule_execution);
    let report = f.report(
        "reference rule (max() over FAILED=0, skip without a write)",
        took,
    );
    println!("{report}");
    let kinds = f.by_kind.lock().unwrap().clone();
    // The silent pin itself: a room left non-terminal for good, reached through a FAILED
    // room resurrected by a late TRANSFERRING write and a silent skip of its last chunk.
    assert!(kinds.get("pinned").copied().unwrap_or(0) > 0, "{report}");
    assert!(
        kinds
            .get("terminal state overwritten")
            .copied()
            .unwrap_or(0)
            > 0,
        "{report}"
    );
    assert!(
        kinds
            .get("skipped chunk left the room live")
            .copied()
            .unwrap_or(0)
            > 0,
        "{report}"
    );
}
