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

use crate::args::Params;
use crate::pattern::mix;
use crate::sys::{thread_cpu_ns, Pages, Region};

const BATCH: usize = 1000;

fn engine(role: &str, mem: &Region) -> Result<Engine, String> {
    let mut c = Config::default();
    let mut set = |k: &str, v: &str| c.set(k, v).map_err(|e| e.to_string());
    set("role", role)?;
    set("transport", "tcp")?;
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
    e.register_kv(vec![BufferDesc {
        base: mem.addr(),
        len: mem.len(),
        item_len: 64,
    }])
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

/// The `--json` line of `kvxfer-bench table`.
#[derive(Serialize)]
struct TableJson<'a> {
    preset: &'static str,
    room_poll_median_ns_1: f64,
    room_poll_median_ns_max_rooms: f64,
    max_rooms: usize,
    room_poll_ns: &'a [PollRow],
    create_clear_per_sec_1_thread: f64,
    create_clear_per_sec_2_threads: f64,
    table_create_remove_per_sec: f64,
    abort_contention: &'a [AbortRow],
    checks_passed: bool,
}

pub fn run(p: &Params) -> Result<(String, bool), String> {
    let big = if p.quick { 10_000 } else { 100_000 };
    let batches = if p.quick { 300 } else { 3000 };
    let mem_p = Region::new(64 * 16, Pages::Small);
    let mem_d = Region::new(64 * 16, Pages::Small);
    let pe = engine("prefill", &mem_p)?;
    let de = engine("decode", &mem_d)?;
    let peers = RoomPeers::Prefills(vec![pe.address().to_string()]);
    let mut ok = true;
    let mut notes: Vec<String> = Vec::new();

    // room_poll at growing numbers of live rooms.
    let id = |i: usize| mix(0xDEC0DE ^ i as u64);
    let table = RoomTable::<()>::new();
    let mut rows = Vec::new();
    let mut live = 0usize;
    let sizes: Vec<usize> = if p.quick {
        vec![1, 1000, big]
    } else {
        vec![1, 1000, 10_000, big]
    };
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
        let mut shuffled = ids.clone();
        for i in (1..shuffled.len()).rev() {
            shuffled.swap(i, (mix(i as u64) % (i as u64 + 1)) as usize);
        }
        let poll = |x: u64| {
            black_box(de.room_poll(black_box(x)).ok());
        };
        rows.push(PollRow {
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
        });
    }
    drop(de);

    // create + clear.
    eprintln!("kvxfer-bench [table]: create+clear");
    let m = if p.quick { 20_000 } else { 200_000 };
    let cc = |threads: usize| -> Result<f64, String> {
        let t = Instant::now();
        std::thread::scope(|s| -> Result<(), String> {
            let hs: Vec<_> = (0..threads)
                .map(|k| {
                    let pe = &pe;
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
    };
    let cc1 = cc(1)?;
    let cc2 = cc(2)?;
    let t = Instant::now();
    for i in 0..m {
        let x = mix(i as u64 ^ 0xABCD);
        let _ = black_box(table.create(x, Role::Prefill, NO_DEADLINE, ()));
        black_box(table.remove(x));
    }
    let cc_table = m as f64 / t.elapsed().as_secs_f64();

    // Abort contention.
    let r = if p.quick { 5_000 } else { 20_000 };
    let rounds = if p.quick { 3 } else { 5 };
    let mut aborts = Vec::new();
    let mut round = 0u64;
    for threads in [1usize, 2, 4, 8, 16, 32] {
        eprintln!("kvxfer-bench [table]: abort contention, {threads} threads");
        // One round: `threads` threads released together abort the rooms; returns (CPU ns
        // per call, calls per wall second).
        let mut one = |same: bool| -> Result<(f64, f64), String> {
            round += 1;
            let ids: Vec<u64> = (0..r)
                .map(|i| mix(0xAB0_0000 ^ (round << 32) ^ i as u64))
                .collect();
            for &x in &ids {
                pe.room_create(x, RoomPeers::Decoders(1))
                    .map_err(|e| e.to_string())?;
            }
            let before = pe.metrics().rooms_failed[0];
            let barrier = Arc::new(Barrier::new(threads));
            let calls = if same { r * threads } else { r };
            let (wall, cpu_ns) = std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|k| {
                        let (pe, ids, barrier) = (&pe, &ids, barrier.clone());
                        s.spawn(move || {
                            let mine: Vec<u64> = if same {
                                ids.clone()
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
                // Wall time: from the first thread starting to the last one finishing.
                let first = done.iter().map(|d| d.0).min();
                let last = done.iter().map(|d| d.1).max();
                let wall = match (first, last) {
                    (Some(a), Some(b)) => b.duration_since(a).as_secs_f64(),
                    _ => f64::NAN,
                };
                (wall, done.iter().map(|d| d.2).sum::<u64>())
            });
            let after = pe.metrics().rooms_failed[0];
            assert_eq!(Cause::ALL[0], Cause::Aborted);
            if after - before != r as u64 {
                ok = false;
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
                    ok = false;
                    notes.push(format!(
                        "{threads} threads: room {x} not failed by exactly one abort"
                    ));
                    break;
                }
                let _ = pe.room_clear(x);
            }
            Ok((cpu_ns as f64 / calls as f64, calls as f64 / wall))
        };
        let mut median = |same: bool| -> Result<(f64, f64), String> {
            let mut v = Vec::new();
            for _ in 0..rounds {
                v.push(one(same)?);
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
    drop(pe);

    let mut o = String::new();
    let _ = writeln!(
        o,
        "\nkvxfer-bench table  (median of {batches} batches of {BATCH} calls; ns per call)"
    );
    let _ = writeln!(
        o,
        "  {:>12}  {:>10} {:>10} {:>10}   {:>12} {:>12}",
        "live rooms", "poll hot", "sweep", "random", "table hot", "table sweep"
    );
    for r in &rows {
        let _ = writeln!(
            o,
            "  {:>12}  {:>10.1} {:>10.1} {:>10.1}   {:>12.1} {:>12.1}",
            r.rooms, r.hot, r.sweep, r.random, r.table_hot, r.table_sweep
        );
    }
    let _ = writeln!(
        o,
        "  create+clear (prefill engine): {cc1:.0}/s on 1 thread, {cc2:.0}/s on 2 threads; \
         bare RoomTable create+remove {cc_table:.0}/s"
    );
    let _ = writeln!(
        o,
        "  abort contention ({r} live rooms, median of {rounds} rounds; CPU ns per call, calls per \
         wall second)"
    );
    let _ = writeln!(
        o,
        "  {:>8}  {:>14} {:>14}   {:>14} {:>14}",
        "threads", "same CPU ns", "same calls/s", "disjoint CPU ns", "disjoint /s"
    );
    for a in &aborts {
        let _ = writeln!(
            o,
            "  {:>8}  {:>14.1} {:>14.0}   {:>14.1} {:>14.0}",
            a.threads, a.same_ns, a.same_per_sec, a.disjoint_ns, a.disjoint_per_sec
        );
    }
    for n in &notes {
        let _ = writeln!(o, "  FAILED CHECK: {n}");
    }
    if p.json {
        let j = TableJson {
            preset: "table",
            room_poll_median_ns_1: rows[0].sweep,
            room_poll_median_ns_max_rooms: rows[rows.len() - 1].sweep,
            max_rooms: rows[rows.len() - 1].rooms,
            room_poll_ns: &rows,
            create_clear_per_sec_1_thread: cc1,
            create_clear_per_sec_2_threads: cc2,
            table_create_remove_per_sec: cc_table,
            abort_contention: &aborts,
            checks_passed: ok,
        };
        o.push_str(&serde_json::to_string(&j).map_err(|e| e.to_string())?);
        o.push('\n');
    }
    Ok((o, ok))
}
