//! The decode side, which drives a run: its engine and destination pool, the prefill
//! side (a child process, or a prefill bench on another host), the baselines, and the
//! decode scheduler loop that creates rooms, polls them, clears them and hands delivered
//! pages to the checker threads.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::{Engine, RoomPeers, State};

use crate::args::{Params, Role};
use crate::baseline::{self, Measured};
use crate::ctl::{room_id, room_plan, AbortAt, Ctl};
use crate::pool::Pool;
use crate::sys::{mono_ns, thread_cpu_ns, Cpu};
use crate::{make_engine, prefill};

/// Everything one run measured.
#[derive(Debug, Default)]
pub struct Report {
    pub kv: KvResult,
    pub tcp: Vec<Measured>,
    /// Prefill-side CPU of each TCP baseline.
    pub tcp_send_cpu: Vec<Cpu>,
    pub memcpy: Vec<Measured>,
    /// Both processes on one host: cross-process latencies are valid.
    pub same_host: bool,
    /// Each kvxfer phase on its own: (GB/s, rooms/s).
    pub kv_runs: Vec<(f64, f64)>,
    /// The 1-minute load average before and after the run (other work on the host).
    pub loadavg: (f64, f64),
    /// `--pool-pages`, and the share of the decode pool the kernel put on huge pages.
    pub pool_pages: &'static str,
    pub pool_huge_fraction: Option<f64>,
}

/// The 1-minute load average, NaN if unknown.
pub fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The kvxfer phase.
#[derive(Debug, Default)]
pub struct KvResult {
    /// Rooms started.
    pub rooms: u64,
    /// Rooms that reached SUCCESS on the decode side and whose pages checked.
    pub ok: u64,
    /// KV payload bytes of those rooms.
    pub bytes: u64,
    /// Bytes whose every word was checked (all of `bytes` with --verify full).
    pub bytes_checked: u64,
    pub secs: f64,
    /// Nanoseconds, successful rooms only: first enqueue (prefill) to decode SUCCESS.
    pub lat_e2e: Vec<u64>,
    /// set_destination to decode SUCCESS.
    pub lat_decode: Vec<u64>,
    /// First enqueue to prefill SUCCESS.
    pub lat_prefill: Vec<u64>,
    pub failed: BTreeMap<String, u64>,
    pub prefill_failed: BTreeMap<String, u64>,
    pub expected: u64,
    pub unexpected: u64,
    pub prefill_expected: u64,
    pub prefill_unexpected: u64,
    pub aborts_planned: u64,
    pub aborts_too_late: u64,
    /// Rooms the prefill side saw FAILED but the decode side SUCCESS (the two engines
    /// disagree: the decode side took data the prefill side had given up on).
    pub split_prefill_failed_decode_ok: u64,
    /// Rooms the prefill side saw SUCCESS but the decode side FAILED (expected when the
    /// decode side aborts after the prefill finished sending).
    pub split_prefill_ok_decode_failed: u64,
    pub cpu_decode: Cpu,
    pub cpu_prefill: Cpu,
    pub verify_cpu_s: f64,
    /// CPU seconds of the two scheduler loops (the benchmark's, not the engine's).
    pub driver_cpu_s: f64,
    pub prefill_driver_cpu_s: f64,
    /// The first few unexpected failures, verbatim.
    pub errors: Vec<String>,
}

impl KvResult {
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
    pub fn rooms_per_sec(&self) -> f64 {
        self.ok as f64 / self.secs
    }
    /// Adds another phase's figures to these.
    fn absorb(&mut self, o: KvResult) {
        self.rooms += o.rooms;
        self.ok += o.ok;
        self.bytes += o.bytes;
        self.bytes_checked += o.bytes_checked;
        self.secs += o.secs;
        self.lat_e2e.extend(o.lat_e2e);
        self.lat_decode.extend(o.lat_decode);
        self.lat_prefill.extend(o.lat_prefill);
        for (k, v) in o.failed {
            *self.failed.entry(k).or_default() += v;
        }
        for (k, v) in o.prefill_failed {
            *self.prefill_failed.entry(k).or_default() += v;
        }
        self.expected += o.expected;
        self.unexpected += o.unexpected;
        self.prefill_expected += o.prefill_expected;
        self.prefill_unexpected += o.prefill_unexpected;
        self.aborts_planned += o.aborts_planned;
        self.aborts_too_late += o.aborts_too_late;
        self.split_prefill_failed_decode_ok += o.split_prefill_failed_decode_ok;
        self.split_prefill_ok_decode_failed += o.split_prefill_ok_decode_failed;
        let add = |a: Cpu, b: Cpu| Cpu {
            user_us: a.user_us + b.user_us,
            sys_us: a.sys_us + b.sys_us,
        };
        self.cpu_decode = add(self.cpu_decode, o.cpu_decode);
        self.cpu_prefill = add(self.cpu_prefill, o.cpu_prefill);
        self.verify_cpu_s += o.verify_cpu_s;
        self.driver_cpu_s += o.driver_cpu_s;
        self.prefill_driver_cpu_s += o.prefill_driver_cpu_s;
        for e in o.errors {
            self.note(e);
        }
    }

    fn note(&mut self, e: String) {
        if self.errors.len() < 8 {
            self.errors.push(e);
        }
    }
}

/// A local run's prefill child; killed if still there when dropped.
struct ChildGuard(Option<Child>);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn run(p: &Params) -> Result<Report, String> {
    let dslots = p.concurrency + p.verify_threads + 1;
    let pslots = p.concurrency + 2;
    let local = p.role == Role::Local;
    let mut mem = Pool::bytes(p, dslots) as f64;
    if local {
        mem += Pool::bytes(p, pslots) as f64;
    }
    if mem / (1u64 << 30) as f64 > p.max_mem_gib {
        return Err(format!(
            "the pools would register {:.1} GiB ({} + {} slots of {} pages x {} buffers x {} \
             bytes), more than --max-mem-gib {}; lower --concurrency or the prompt length",
            mem / (1u64 << 30) as f64,
            dslots,
            if local { pslots } else { 0 },
            p.max_pages(),
            p.n_buffers(),
            p.item_len(),
            p.max_mem_gib
        ));
    }
    let engine = make_engine(p, "decode", if local { "127.0.0.1:0" } else { "0.0.0.0:0" })?;
    let pool = Pool::new(p, dslots, p.dst_order);
    pool.register(&engine)?;

    let mut guard = ChildGuard(None);
    let mut ctl = if local {
        let exe = std::env::current_exe().map_err(|e| format!("cannot find myself: {e}"))?;
        let mut child = Command::new(exe)
            .args(["--role", "prefill", "--control", "stdio"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the prefill process: {e}"))?;
        let (r, w) = (
            child.stdout.take().expect("piped"),
            child.stdin.take().expect("piped"),
        );
        guard.0 = Some(child);
        Ctl::new(r, w)
    } else {
        prefill::connect(p.prefill_addr.as_deref().expect("validated"))?
    };
    ctl.send(&format!("plan {}", p.plan_args().join(" ")))?;
    let line = ctl.recv()?;
    let f: Vec<&str> = line.splitn(3, ' ').collect();
    let (engine_addr, base_addr) = match f.as_slice() {
        ["ready", e, b] => (e.to_string(), b.to_string()),
        ["error", ..] => return Err(format!("prefill side: {}", &line[6..])),
        _ => return Err(format!("prefill side said '{line}'")),
    };

    let mut report = Report {
        same_host: local,
        loadavg: (loadavg(), f64::NAN),
        pool_pages: p.pool_pages.name(),
        pool_huge_fraction: pool.huge_fraction,
        ..Default::default()
    };
    // The baselines move the volume a kvxfer phase is planned to move (or run as long
    // with --duration), adjacent to it on both sides: baselines, kvxfer, baselines,
    // kvxfer, ..., baselines (--repeat kvxfer phases).
    let volume: u64 = (0..p.rooms)
        .map(|i| room_plan(p, i).pages as u64 * p.page_bytes())
        .sum();
    let secs = p.duration.unwrap_or(0.0);
    let mut start = 0u64;
    for rep in 0..=p.repeat {
        if p.baselines {
            progress_note(p, "baseline tcp");
            let (m, c) = tcp_baseline(&mut ctl, &base_addr, p, volume, secs)?;
            report.tcp.push(m);
            report.tcp_send_cpu.push(c);
            progress_note(p, "baseline memcpy");
            report
                .memcpy
                .push(baseline::memcpy(volume, secs, p.pool_pages));
        }
        if rep == p.repeat {
            break;
        }
        progress_note(p, &format!("kvxfer, phase {} of {}", rep + 1, p.repeat));
        let kv = kvxfer_phase(p, &engine, &pool, &mut ctl, &engine_addr, local, start)?;
        start += kv.rooms;
        report.kv_runs.push((kv.gbps(), kv.rooms_per_sec()));
        report.kv.absorb(kv);
    }
    report.loadavg.1 = loadavg();
    ctl.send("quit")?;
    if let Some(mut c) = guard.0.take() {
        let _ = c.wait();
    }
    Ok(report)
}

fn progress_note(p: &Params, phase: &str) {
    eprintln!("kvxfer-bench [{}]: {phase}", p.preset);
}

fn tcp_baseline(
    ctl: &mut Ctl,
    addr: &str,
    p: &Params,
    bytes: u64,
    secs: f64,
) -> Result<(Measured, Cpu), String> {
    ctl.send(&format!("tcp {} {bytes} {secs}", p.conns))?;
    let m = baseline::tcp_receive(
        addr,
        p.conns,
        baseline::Buffers {
            mib: p.baseline_buf_mib,
            pages: p.pool_pages,
        },
        p.baseline_read_kib << 10,
        &mut || match ctl.recv()?.as_str() {
            "tcpready" => Ok(()),
            other => Err(format!("prefill side said '{other}' to tcp")),
        },
    )?;
    let line = ctl.recv()?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    match (line.starts_with("tcpdone "), f.as_slice()) {
        (true, [sent, user, sys]) => {
            if *sent != m.bytes {
                return Err(format!(
                    "baseline: prefill sent {sent} bytes, decode received {}",
                    m.bytes
                ));
            }
            Ok((
                m,
                Cpu {
                    user_us: *user,
                    sys_us: *sys,
                },
            ))
        }
        _ => Err(format!("prefill side said '{line}' after tcp")),
    }
}

struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    pages: usize,
    abort: Option<AbortAt>,
    aborted: bool,
}

#[derive(Clone, Default)]
struct Rec {
    t_dest: u64,
    t_done: u64,
    ok: bool,
    planned_abort: bool,
}

struct Job {
    idx: usize,
    id: u64,
    slot: usize,
    pages: usize,
}

struct Checked {
    idx: usize,
    slot: usize,
    result: Result<u64, String>,
}

/// The decode scheduler loop of one run.
fn kvxfer_phase(
    p: &Params,
    engine: &Engine,
    pool: &Pool,
    ctl: &mut Ctl,
    prefill_addr: &str,
    same_host: bool,
    start: u64,
) -> Result<KvResult, String> {
    std::thread::scope(|scope| {
        kvxfer_loop(p, engine, pool, ctl, prefill_addr, same_host, start, scope)
    })
}

#[allow(clippy::too_many_arguments)]
fn kvxfer_loop<'s>(
    p: &'s Params,
    engine: &Engine,
    pool: &'s Pool,
    ctl: &mut Ctl,
    prefill_addr: &str,
    same_host: bool,
    start: u64,
    scope: &'s std::thread::Scope<'s, '_>,
) -> Result<KvResult, String> {
    let mut out = KvResult::default();
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let (ret_tx, ret_rx) = mpsc::channel::<Checked>();
    let job_rx = Arc::new(Mutex::new(job_rx));
    let verify = p.verify;
    let verifiers: Vec<_> = (0..p.verify_threads)
        .map(|_| {
            let (rx, tx) = (job_rx.clone(), ret_tx.clone());
            scope.spawn(move || {
                let cpu0 = thread_cpu_ns();
                loop {
                    let job = match rx.lock().expect("job queue").recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    };
                    let result = pool.verify(job.slot, job.pages, job.id, verify);
                    let _ = tx.send(Checked {
                        idx: job.idx,
                        slot: job.slot,
                        result,
                    });
                }
                thread_cpu_ns() - cpu0
            })
        })
        .collect();
    drop(ret_tx);

    let mut free: Vec<usize> = (0..pool.slots).rev().collect();
    let mut live: Vec<Live> = Vec::with_capacity(p.concurrency);
    let mut draining: Vec<Live> = Vec::new();
    let mut recs: Vec<Rec> = Vec::new();
    let mut checking = 0usize;
    let total = if p.duration.is_some() {
        u64::MAX
    } else {
        p.rooms
    };
    let peers = RoomPeers::Prefills(vec![prefill_addr.to_string()]);
    let mut announced = 0u64;
    let mut ended = false;
    ctl.send(&format!("run {start}"))?;
    let cpu0 = Cpu::now();
    let driver0 = thread_cpu_ns();
    let t0 = Instant::now();
    let deadline = p.duration.map(|d| t0 + Duration::from_secs_f64(d));
    let mut next_progress = t0 + Duration::from_secs(1);
    let mut t_last = t0;
    loop {
        let mut progress = false;
        // Pages the checkers are done with.
        while let Ok(c) = ret_rx.try_recv() {
            progress = true;
            checking -= 1;
            free.push(c.slot);
            let plan = room_plan(p, start + c.idx as u64);
            match c.result {
                Ok(checked) => {
                    recs[c.idx].ok = true;
                    out.ok += 1;
                    out.bytes += plan.pages as u64 * p.page_bytes();
                    out.bytes_checked += checked;
                }
                Err(e) => {
                    *out.failed.entry("verify".into()).or_default() += 1;
                    out.unexpected += 1;
                    out.note(format!("room {}: delivered bytes differ: {e}", c.idx));
                }
            }
            t_last = Instant::now();
        }
        // New rooms, while there is a free slot and room in the window.
        let creating =
            !ended && (recs.len() as u64) < total && deadline.is_none_or(|d| Instant::now() < d);
        if creating {
            while live.len() < p.concurrency && (recs.len() as u64) < total {
                let Some(slot) = free.pop() else { break };
                progress = true;
                let idx = recs.len();
                let plan = room_plan(p, start + idx as u64);
                let id = room_id(p, start + idx as u64);
                let pages = pool.pages(slot, plan.pages);
                let aux = pool.aux.is_some().then_some(slot as u32);
                let t_dest = mono_ns();
                let r = engine
                    .room_create(id, peers.clone())
                    .and_then(|()| engine.room_set_destination(id, &pages, aux));
                recs.push(Rec {
                    t_dest,
                    planned_abort: plan.abort.is_some(),
                    ..Default::default()
                });
                if plan.abort.is_some() {
                    out.aborts_planned += 1;
                }
                let mut l = Live {
                    idx,
                    id,
                    slot,
                    pages: plan.pages,
                    abort: plan.abort,
                    aborted: false,
                };
                if let Err(e) = r {
                    // The room is still announced: the prefill side creates it and sees
                    // it fail, as it would in a server.
                    *out.failed.entry("create_error".into()).or_default() += 1;
                    out.unexpected += 1;
                    out.note(format!("room {idx}: {e}"));
                    let _ = engine.room_abort(id, "bench: setup failed");
                    draining.push(l);
                    continue;
                }
                if l.abort == Some(AbortAt::DecodeEarly) {
                    let _ = engine.room_abort(id, "bench: planned abort (decode, early)");
                    l.aborted = true;
                }
                live.push(l);
            }
        }
        if recs.len() as u64 > announced {
            announced = recs.len() as u64;
            ctl.send(&format!("upto {}", start + announced))?;
        }
        if !ended && !creating {
            ended = true;
            ctl.send(&format!("end {}", start + recs.len() as u64))?;
        }
        // Poll every room in flight, as a server's scheduler loop does.
        let mut i = 0;
        while i < live.len() {
            let l = &mut live[i];
            match engine.room_poll(l.id) {
                Ok(State::Success) => {
                    recs[l.idx].t_done = mono_ns();
                    if l.abort.is_some() {
                        out.aborts_too_late += 1;
                    }
                    let _ = engine.room_clear(l.id);
                    let l = live.swap_remove(i);
                    checking += 1;
                    job_tx
                        .send(Job {
                            idx: l.idx,
                            id: l.id,
                            slot: l.slot,
                            pages: l.pages,
                        })
                        .map_err(|_| "the checker threads stopped".to_string())?;
                    progress = true;
                    continue;
                }
                Ok(State::Failed) => {
                    recs[l.idx].t_done = mono_ns();
                    let (key, expected, msg) = match engine.room_failure(l.id) {
                        Ok(f) => (
                            f.cause.name().to_string(),
                            l.abort.is_some() && prefill::is_abort(f.cause.name()),
                            f.to_string(),
                        ),
                        Err(e) => ("unknown".into(), false, e.to_string()),
                    };
                    *out.failed.entry(key).or_default() += 1;
                    if expected {
                        out.expected += 1;
                    } else {
                        out.unexpected += 1;
                        out.note(format!("room {}: {msg}", l.idx));
                    }
                    draining.push(live.swap_remove(i));
                    progress = true;
                    continue;
                }
                Ok(State::Transferring) if l.abort == Some(AbortAt::DecodeMid) && !l.aborted => {
                    let _ = engine.room_abort(l.id, "bench: planned abort (decode, mid-transfer)");
                    l.aborted = true;
                    progress = true;
                }
                Ok(_) => {}
                Err(e) => {
                    *out.failed.entry("poll_error".into()).or_default() += 1;
                    out.unexpected += 1;
                    out.note(format!("room {}: poll: {e}", l.idx));
                    draining.push(live.swap_remove(i));
                    continue;
                }
            }
            i += 1;
        }
        // Failed rooms give their pages back once no write into them can still land.
        draining.retain(|l| {
            if engine.room_drained(l.id).unwrap_or(true) {
                let _ = engine.room_clear(l.id);
                free.push(l.slot);
                progress = true;
                false
            } else {
                true
            }
        });
        if ended && live.is_empty() && draining.is_empty() && checking == 0 {
            break;
        }
        let now = Instant::now();
        if now >= next_progress {
            next_progress += Duration::from_secs(1);
            let s = t0.elapsed().as_secs_f64();
            eprintln!(
                "kvxfer-bench [{}] {s:6.1}s: {} rooms ok, {} failed ({} expected), {} in flight, \
                 {:.2} GB/s verified, {:.0} rooms/s",
                p.preset,
                out.ok,
                out.expected + out.unexpected,
                out.expected,
                live.len() + checking,
                out.bytes as f64 / s / 1e9,
                out.ok as f64 / s
            );
        }
        if !progress {
            std::thread::sleep(Duration::from_micros(p.poll_us));
        }
    }
    out.secs = t_last
        .max(t0 + Duration::from_nanos(1))
        .duration_since(t0)
        .as_secs_f64();
    out.cpu_decode = Cpu::now().since(cpu0);
    out.driver_cpu_s = (thread_cpu_ns() - driver0) as f64 / 1e9;
    out.rooms = recs.len() as u64;
    drop(job_tx);
    for v in verifiers {
        out.verify_cpu_s += v.join().map_err(|_| "a checker thread panicked")? as f64 / 1e9;
    }

    // The prefill side's account of the same rooms.
    let mut n = 0usize;
    loop {
        let line = ctl.recv()?;
        let f: Vec<&str> = line.split_whitespace().collect();
        match f.as_slice() {
            ["prec", idx, t_enq, t_term, outcome] => {
                let idx = idx
                    .parse::<u64>()
                    .ok()
                    .and_then(|i| i.checked_sub(start))
                    .ok_or_else(|| format!("bad record '{line}'"))?
                    as usize;
                let t_enq: u64 = t_enq.parse().unwrap_or(0);
                let t_term: u64 = t_term.parse().unwrap_or(0);
                let Some(rec) = recs.get(idx) else {
                    return Err(format!("prefill reported room {idx}, never started"));
                };
                n += 1;
                if *outcome == "ok" && !rec.ok {
                    out.split_prefill_ok_decode_failed += 1;
                }
                if *outcome != "ok" && rec.ok {
                    out.split_prefill_failed_decode_ok += 1;
                    out.note(format!(
                        "room {idx}: SUCCESS on the decode side, {outcome} on the prefill side"
                    ));
                }
                if *outcome == "ok" {
                    out.lat_prefill.push(t_term.saturating_sub(t_enq));
                    if rec.ok {
                        if same_host {
                            out.lat_e2e.push(rec.t_done.saturating_sub(t_enq));
                        }
                        out.lat_decode.push(rec.t_done.saturating_sub(rec.t_dest));
                    }
                } else {
                    let cause = outcome.split(':').next().unwrap_or("unknown");
                    *out.prefill_failed.entry(cause.to_string()).or_default() += 1;
                    if rec.planned_abort && prefill::is_abort(cause) {
                        out.prefill_expected += 1;
                    } else {
                        out.prefill_unexpected += 1;
                        out.note(format!("prefill room {idx}: {outcome}"));
                    }
                }
            }
            ["pdone", user, sys, driver_ns] => {
                out.cpu_prefill = Cpu {
                    user_us: user.parse().unwrap_or(0),
                    sys_us: sys.parse().unwrap_or(0),
                };
                out.prefill_driver_cpu_s = driver_ns.parse::<f64>().unwrap_or(0.0) / 1e9;
                break;
            }
            _ => return Err(format!("prefill side said '{line}' after the run")),
        }
    }
    if n != recs.len() {
        return Err(format!(
            "the prefill side ran {n} rooms, the decode side {}",
            recs.len()
        ));
    }
    Ok(out)
}
