//! `kvxfer-bench table`: the room table under the calls a scheduler makes.
//!
//! - `room_poll` latency through `Engine::room_poll` on a decode engine whose rooms are
//!   live (connected to a prefill engine in this process, waiting for input), at 1, 1,000,
//!   10,000 and 100,000 live rooms; and the bare `RoomTable::state` under the same ids. Polls run
//!   in batches of 1,000 timed together; the figure is the median batch time / 1,000.
//!   Three access orders: `hot` (one room again and again), `sweep` (every live room in
//!   creation order, as a scheduler polls its in-flight list), `random` (every live room
//!   in a shuffled order).
//! - create+clear: `room_create` then `room_clear` on a prefill engine, from 1 and 2
//!   threads; and `RoomTable::create` + `remove` bare.
//! - abort contention: T threads released together abort the same 20,000 live rooms
//!   (each room sees T aborts, exactly one of which may win), and T threads abort
//!   disjoint rooms; median of 5 rounds. Checks that every room ends FAILED, counted
//!   once, with one of the aborting threads' reasons.

use std::fmt::Write as _;
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvxfer::log::{Level, Logger};
use kvxfer::room::{RoomTable, NO_DEADLINE};
use kvxfer::{BufferDesc, Cause, Config, Engine, Role, RoomPeers, State};
use serde::Serialize;

use crate::args::Named;
use crate::params::Params;
use crate::pattern::mix;
use crate::preset::Preset;
use crate::sys::{thread_cpu_ns, Pages, Region};

const BATCH: usize = 1000;

fn engine(role: &str, mem: &Region) -> Result<Engine, String> {
    let mut c = Config::default();
    let mut set = |k: &str, v: &str| c.set(k, v).map_err(|e| e.to_string());
    set("role", role)?;
    set("transport", "tcp")?;
    set("same_host", "off")?;
    set("same_host", "off")?;
    // Nothing may time out while the rooms sit there being polled.
    for k in [
        "bootstrap_timeout_ms",
        "waiting_timeout_ms",
        "transfer_timeout_ms",
    ] {
        set(k, "86400000")?;
    }
    let e = Engine::new(c, Logger::new(Level::Error, None)).map_err(|e| e.to_string())?;
    e.register_kv(vec![BufferDesc::host(mem.addr(), mem.len(), 64)])
        .map_err(|e| e.to_string())?;
    Ok(e)
}

/// Median over `batches` batches of the time per call of `f` (called BATCH times a batch
/// with the call index), in nanoseconds.
fn median_ns(batches: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut t = Vec::with_capacity(batches);
    let mut i = 0usize;
    for _ in 0..batches {
        let s = Instant::now();
        for _ in 0..BATCH {
            f(i);
            i = i.wrapping_add(1);
        }
        t.push(s.elapsed().as_nanos() as f64 / BATCH as f64);
    }
    t.sort_by(|a, b| a.total_cmp(b));
    t[t.len() / 2]
}

#[derive(Serialize)]
struct PollRow {
    rooms: usize,
    hot: f64,
    sweep: f64,
    random: f64,
    table_hot: f64,
    table_sweep: f64,
}

#[derive(Serialize)]
struct AbortRow {
    threads: usize,
    #[serde(rename = "same_rooms_cpu_ns_per_call")]
    same_ns: f64,
    #[serde(rename = "same_rooms_calls_per_sec")]
    same_per_sec: f64,
    #[serde(rename = "disjoint_cpu_ns_per_call")]
    disjoint_ns: f64,
    #[serde(rename = "disjoint_calls_per_sec")]
    disjoint_per_sec: f64,
}

/// What `kvxfer-bench table` measured: the `--json` line is this object, and the human
/// table is written from it.
#[derive(Serialize)]
struct TableReport {
    preset: String,
    room_poll_median_ns_1: f64,
    room_poll_median_ns_max_rooms: f64,
    max_rooms: usize,
    room_poll_ns: Vec<PollRow>,
    create_clear_per_sec_1_thread: f64,
    create_clear_per_sec_2_threads: f64,
    table_create_remove_per_sec: f64,
    abort_contention: Vec<AbortRow>,
    checks_passed: bool,
    /// How the figures were taken, and the checks that failed (the table's, not the
    /// JSON line's).
    #[serde(skip)]
    sizes: Sizes,
    #[serde(skip)]
    notes: Vec<String>,
}

/// The sizes of a run: batches per median, rooms per create+clear run, live rooms and
/// rounds of the abort contention.
#[derive(Clone, Copy)]
struct Sizes {
    batches: usize,
    big: usize,
    create_clear: usize,
    abort_rooms: usize,
    rounds: usize,
}

impl Sizes {
    fn of(p: &Params) -> Sizes {
        if p.quick {
            Sizes {
                batches: 300,
                big: 10_000,
                create_clear: 20_000,
                abort_rooms: 5_000,
                rounds: 3,
            }
        } else {
            Sizes {
                batches: 3000,
                big: 100_000,
                create_clear: 200_000,
                abort_rooms: 20_000,
                rounds: 5,
            }
        }
    }
}

pub fn run(p: &Params) -> Result<(String, bool), String> {
    let z = Sizes::of(p);
    let mem_p = Region::new(64 * 16, Pages::Small);
    let mem_d = Region::new(64 * 16, Pages::Small);
    let pe = engine("prefill", &mem_p)?;
    let table = RoomTable::<()>::new();
    let rows = {
        let de = engine("decode", &mem_d)?;
        let peers = RoomPeers::Prefills(vec![pe.address().to_string()]);
        poll_rows(p, z, &de, &peers, &table)?
    };
    eprintln!("kvxfer-bench [table]: create+clear");
    let cc1 = create_clear(&pe, z.create_clear, 1)?;
    let cc2 = create_clear(&pe, z.create_clear, 2)?;
    let cc_table = table_create_remove(&table, z.create_clear);
    let mut notes = Vec::new();
    let aborts = abort_contention(&pe, z, &mut notes)?;
    drop(pe);
    let last = rows.last().expect("at least one size");
    let r = TableReport {
        preset: Preset::Table.name(),
        room_poll_median_ns_1: rows[0].sweep,
        room_poll_median_ns_max_rooms: last.sweep,
        max_rooms: last.rooms,
        create_clear_per_sec_1_thread: cc1,
        create_clear_per_sec_2_threads: cc2,
        table_create_remove_per_sec: cc_table,
        abort_contention: aborts,
        checks_passed: notes.is_empty(),
        room_poll_ns: rows,
        sizes: z,
        notes,
    };
    let mut o = human(&r);
    if p.json {
        o.push_str(&serde_json::to_string(&r).map_err(|e| e.to_string())?);
        o.push('\n');
    }
    Ok((o, r.checks_passed))
}

/// `room_poll` at growing numbers of live rooms on decode engine `de` (and the bare
/// table's `state` under the same ids).
fn poll_rows(
    p: &Params,
    z: Sizes,
    de: &Engine,
    peers: &RoomPeers,
    table: &RoomTable<()>,
) -> Result<Vec<PollRow>, String> {
    let id = |i: usize| mix(0xDEC0DE ^ i as u64);
    let sizes: Vec<usize> = if p.quick {
        vec![1, 1000, z.big]
    } else {
        vec![1, 1000, 10_000, z.big]
    };
    let mut rows = Vec::new();
    let mut live = 0usize;
    for n in sizes {
        eprintln!("kvxfer-bench [table]: room_poll with {n} live rooms");
        while live < n {
            de.room_create(id(live), peers.clone())
                .map_err(|e| format!("room_create: {e}"))?;
            table
                .create(id(live), Role::Decode, NO_DEADLINE, ())
                .map_err(|e| e.to_string())?;
            live += 1;
        }
        let t = Instant::now();
        while de.room_poll(id(n - 1)).ok() != Some(State::WaitingForInput) {
            if t.elapsed() > Duration::from_secs(30) {
                return Err("decode rooms never became ready".into());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let ids: Vec<u64> = (0..n).map(id).collect();
        rows.push(poll_row(z.batches, de, table, &ids));
    }
    Ok(rows)
}

/// The poll figures over the live rooms `ids`.
fn poll_row(batches: usize, de: &Engine, table: &RoomTable<()>, ids: &[u64]) -> PollRow {
    let n = ids.len();
    let mut shuffled = ids.to_vec();
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, (mix(i as u64) % (i as u64 + 1)) as usize);
    }
    let poll = |x: u64| {
        black_box(de.room_poll(black_box(x)).ok());
    };
    PollRow {
        rooms: n,
        hot: median_ns(batches, |_| poll(ids[0])),
        sweep: median_ns(batches, |i| poll(ids[i % n])),
        random: median_ns(batches, |i| poll(shuffled[i % n])),
        table_hot: median_ns(batches, |_| {
            black_box(table.state(black_box(ids[0])));
        }),
        table_sweep: median_ns(batches, |i| {
            black_box(table.state(black_box(ids[i % n])));
        }),
    }
}

/// `room_create` then `room_clear` of `m` rooms on prefill engine `pe` from `threads`
/// threads: calls of each per second.
fn create_clear(pe: &Engine, m: usize, threads: usize) -> Result<f64, String> {
    let t = Instant::now();
    std::thread::scope(|s| -> Result<(), String> {
        let hs: Vec<_> = (0..threads)
            .map(|k| {
                s.spawn(move || -> Result<(), String> {
                    for i in 0..m / threads {
                        let x = mix(((k as u64) << 40) | i as u64);
                        pe.room_create(x, RoomPeers::Decoders(1))
                            .map_err(|e| e.to_string())?;
                        pe.room_clear(x).map_err(|e| e.to_string())?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "create+clear thread panicked")??;
        }
        Ok(())
    })?;
    Ok(m as f64 / t.elapsed().as_secs_f64())
}

/// The bare table's `create` then `remove` of `m` rooms, per second.
fn table_create_remove(table: &RoomTable<()>, m: usize) -> f64 {
    let t = Instant::now();
    for i in 0..m {
        let x = mix(i as u64 ^ 0xABCD);
        let _ = black_box(table.create(x, Role::Prefill, NO_DEADLINE, ()));
        black_box(table.remove(x));
    }
    m as f64 / t.elapsed().as_secs_f64()
}

/// T threads released together abort the same live rooms, and disjoint ones: the median
/// of the rounds at each T; a check that fails is noted in `notes`.
fn abort_contention(
    pe: &Engine,
    z: Sizes,
    notes: &mut Vec<String>,
) -> Result<Vec<AbortRow>, String> {
    let mut aborts = Vec::new();
    let mut round = 0u64;
    for threads in [1usize, 2, 4, 8, 16, 32] {
        eprintln!("kvxfer-bench [table]: abort contention, {threads} threads");
        let mut median = |same: bool| -> Result<(f64, f64), String> {
            let mut v = Vec::new();
            for _ in 0..z.rounds {
                round += 1;
                v.push(abort_round(
                    pe,
                    z.abort_rooms,
                    (threads, same),
                    round,
                    notes,
                )?);
            }
            v.sort_by(|a, b| a.1.total_cmp(&b.1));
            Ok(v[v.len() / 2])
        };
        let (same_ns, same_per_sec) = median(true)?;
        let (disjoint_ns, disjoint_per_sec) = median(false)?;
        aborts.push(AbortRow {
            threads,
            same_ns,
            same_per_sec,
            disjoint_ns,
            disjoint_per_sec,
        });
    }
    Ok(aborts)
}

/// One round: `threads` threads released together abort `r` fresh rooms (each thread
/// every room when `same`, else a share); CPU ns per call and calls per wall second.
/// Checks that every room ends FAILED, counted once, with one of the threads' reasons.
fn abort_round(
    pe: &Engine,
    r: usize,
    (threads, same): (usize, bool),
    round: u64,
    notes: &mut Vec<String>,
) -> Result<(f64, f64), String> {
    let ids: Vec<u64> = (0..r)
        .map(|i| mix(0xAB0_0000 ^ (round << 32) ^ i as u64))
        .collect();
    for &x in &ids {
        pe.room_create(x, RoomPeers::Decoders(1))
            .map_err(|e| e.to_string())?;
    }
    let before = pe.metrics().rooms_failed[0];
    let calls = if same { r * threads } else { r };
    let (wall, cpu_ns) = abort_threads(pe, &ids, threads, same);
    let after = pe.metrics().rooms_failed[0];
    assert_eq!(Cause::ALL[0], Cause::Aborted);
    if after - before != r as u64 {
        notes.push(format!(
            "{threads} threads: {} aborts counted for {r} rooms",
            after - before
        ));
    }
    for &x in &ids {
        let good = pe.room_poll(x).ok() == Some(State::Failed)
            && pe
                .room_failure(x)
                .is_ok_and(|f| f.cause == Cause::Aborted && f.message.contains("thread "));
        if !good {
            notes.push(format!(
                "{threads} threads: room {x} not failed by exactly one abort"
            ));
            break;
        }
        let _ = pe.room_clear(x);
    }
    Ok((cpu_ns as f64 / calls as f64, calls as f64 / wall))
}

/// The aborting threads of one round: wall seconds from the first thread starting to
/// the last one finishing, and their CPU ns together.
fn abort_threads(pe: &Engine, ids: &[u64], threads: usize, same: bool) -> (f64, u64) {
    let barrier = Arc::new(Barrier::new(threads));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|k| {
                let barrier = barrier.clone();
                s.spawn(move || {
                    let mine: Vec<u64> = if same {
                        ids.to_vec()
                    } else {
                        ids.iter().skip(k).step_by(threads).copied().collect()
                    };
                    let reason = format!("thread {k}");
                    barrier.wait();
                    let (t, c) = (Instant::now(), thread_cpu_ns());
                    for x in mine {
                        let _ = pe.room_abort(x, &reason);
                    }
                    (t, Instant::now(), thread_cpu_ns() - c)
                })
            })
            .collect();
        let done: Vec<(Instant, Instant, u64)> =
            hs.into_iter().filter_map(|h| h.join().ok()).collect();
        let first = done.iter().map(|d| d.0).min();
        let last = done.iter().map(|d| d.1).max();
        let wall = match (first, last) {
            (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
            _ => f64::NAN,
        };
        (wall, done.iter().map(|d| d.2).sum::<u64>())
    })
}

/// The human table of `r`.
fn human(r: &TableReport) -> String {
    let z = r.sizes;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nkvxfer-bench table  (median of {} batches of {BATCH} calls; ns per call)",
        z.batches
    );
    let _ = writeln!(
        o,
        "  {:>12}  {:>10} {:>10} {:>10}   {:>12} {:>12}",
        "live rooms", "poll hot", "sweep", "random", "table hot", "table sweep"
    );
    for r in &r.room_poll_ns {
        let _ = writeln!(
            o,
            "  {:>12}  {:>10.1} {:>10.1} {:>10.1}   {:>12.1} {:>12.1}",
            r.rooms, r.hot, r.sweep, r.random, r.table_hot, r.table_sweep
        );
    }
    let _ = writeln!(
        o,
        "  create+clear (prefill engine): {:.0}/s on 1 thread, {:.0}/s on 2 threads; \
         bare RoomTable create+remove {:.0}/s",
        r.create_clear_per_sec_1_thread,
        r.create_clear_per_sec_2_threads,
        r.table_create_remove_per_sec
    );
    let _ = writeln!(
        o,
        "  abort contention ({} live rooms, median of {} rounds; CPU ns per call, calls per \
         wall second)",
        z.abort_rooms, z.rounds
    );
    let _ = writeln!(
        o,
        "  {:>8}  {:>14} {:>14}   {:>14} {:>14}",
        "threads", "same CPU ns", "same calls/s", "disjoint CPU ns", "disjoint /s"
    );
    for a in &r.abort_contention {
        let _ = writeln!(
            o,
            "  {:>8}  {:>14.1} {:>14.0}   {:>14.1} {:>14.0}",
            a.threads, a.same_ns, a.same_per_sec, a.disjoint_ns, a.disjoint_per_sec
        );
    }
    for n in &r.notes {
        let _ = writeln!(o, "  FAILED CHECK: {n}");
    }
    o
}
