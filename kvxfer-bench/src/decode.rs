//! The decode side, which drives a run: its engine and destination pool, the prefill
//! side (a child process, or a prefill bench on another host), the baselines, and the
//! decode scheduler loop that creates rooms, polls them, clears them and hands delivered
//! pages to the checker threads.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvxfer::{Engine, RoomPeers, State};

use crate::args::{Auth, Feed, Params, Side, VerifyPriority};
use crate::baseline::{self, Measured};
use crate::ctl::{room_id, room_plan, AbortAt, Ctl, Outcome, PrefillRoom, ToDecode, ToPrefill};
use crate::pool::Pool;
use crate::sys::{mono_ns, HostBusy, HostMark, Usage};
use crate::{make_engine, prefill};

/// Everything one run measured.
#[derive(Debug, Default)]
pub struct Report {
    /// Every kvxfer phase together.
    pub kv: KvResult,
    /// Each kvxfer phase on its own, in order.
    pub phases: Vec<KvResult>,
    /// Each TCP baseline, as the decode (receiving) side measured it.
    pub tcp: Vec<Measured>,
    /// The prefill (sending) side's usage over each TCP baseline.
    pub tcp_send: Vec<Usage>,
    pub memcpy: Vec<Measured>,
    /// With `--same-host`: memcpy of the pages, scattered, on `conns` threads.
    pub memcpy_pages: Vec<Measured>,
    /// Both processes on one host: cross-process latencies are valid.
    pub same_host: bool,
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

/// A kvxfer phase, or several added up.
#[derive(Debug, Clone, Default)]
pub struct KvResult {
    /// Whether the phase's engines authenticated (`--auth`; a sum: whether any did).
    pub auth: bool,
    /// A phase of the TP ranks (`--prefill-tp`, `--decode-tp`), not of the equal-TP
    /// comparison (a sum: whether any was).
    pub tp: bool,
    /// How the prefill side fed the phase's rooms (`--layerwise`: simulated compute,
    /// layer-wise or whole-chunk; not added up: a sum keeps its own).
    pub feed: Feed,
    /// Nanoseconds, successful rooms of a phase with simulated compute, one host only:
    /// time-to-first-token, the first layer's compute (prefill) to decode SUCCESS.
    pub ttft: Vec<u64>,
    /// The same rooms' compute alone: every layer of every chunk at
    /// `--compute-us-per-layer`.
    pub compute: Vec<u64>,
    /// Every layer computed in the phase: how late the prefill scheduler woke after the
    /// layer's end (its sleep's overshoot).
    pub late: Vec<u64>,
    /// The rooms of `ttft`: how late the scheduler woke after the last layer's end, so
    /// that TTFT = compute + this + what came after the last enqueue.
    pub last_late: Vec<u64>,
    /// Data runs the prefill engines wrote (`data_runs_sent`: TCP frames, RDMA writes).
    pub runs: u64,
    /// Pages of one buffer at the prefill's page size (every head of `page_tokens`
    /// tokens) times KV buffers, over the rooms that succeeded: what `runs` is counted
    /// per.
    pub buffer_pages: u64,
    /// Rooms started.
    pub rooms: u64,
    /// Rooms that reached SUCCESS on the decode side and whose pages checked.
    pub ok: u64,
    /// KV payload bytes of those rooms.
    pub bytes: u64,
    /// Bytes whose every word was checked (all of `bytes` with --verify full).
    pub bytes_checked: u64,
    pub secs: f64,
    /// The host's CPUs while the phase ran (the prefill process and the kernel's threads
    /// too, when both sides share the host).
    pub host: HostBusy,
    /// Nanoseconds, successful rooms only: first enqueue (prefill) to decode SUCCESS.
    pub lat_e2e: Vec<u64>,
    /// set_destination to decode SUCCESS.
    pub lat_decode: Vec<u64>,
    /// First enqueue to prefill SUCCESS.
    pub lat_prefill: Vec<u64>,
    /// First enqueue (prefill) to the decode side's first poll that saw the room
    /// TRANSFERRING (its first data had landed), or SUCCESS when no poll caught it
    /// transferring.
    pub lat_first: Vec<u64>,
    /// Rooms of `lat_first` first seen at SUCCESS.
    pub first_at_success: u64,
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
    /// Each process over the phase (engine and benchmark threads).
    pub decode: Usage,
    pub prefill: Usage,
    /// The benchmark's own threads: the decode checkers and the two scheduler loops.
    pub verify: Usage,
    pub driver: Usage,
    pub prefill_driver: Usage,
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
    /// Data runs (TCP frames, RDMA writes) per page of one buffer.
    pub fn runs_per_page(&self) -> f64 {
        self.runs as f64 / self.buffer_pages as f64
    }
    /// Payload GB delivered and verified.
    pub fn gb(&self) -> f64 {
        self.bytes as f64 / 1e9
    }
    /// The benchmark's own threads in the decode process.
    pub fn decode_bench(&self) -> Usage {
        self.verify + self.driver
    }
    /// Adds another phase's figures to these.
    pub fn absorb(&mut self, o: &KvResult) {
        self.auth |= o.auth;
        self.tp |= o.tp;
        self.ttft.extend(&o.ttft);
        self.compute.extend(&o.compute);
        self.late.extend(&o.late);
        self.last_late.extend(&o.last_late);
        self.runs += o.runs;
        self.buffer_pages += o.buffer_pages;
        self.rooms += o.rooms;
        self.ok += o.ok;
        self.bytes += o.bytes;
        self.bytes_checked += o.bytes_checked;
        self.secs += o.secs;
        self.lat_e2e.extend(&o.lat_e2e);
        self.lat_decode.extend(&o.lat_decode);
        self.lat_prefill.extend(&o.lat_prefill);
        self.lat_first.extend(&o.lat_first);
        self.first_at_success += o.first_at_success;
        for (k, v) in &o.failed {
            *self.failed.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &o.prefill_failed {
            *self.prefill_failed.entry(k.clone()).or_default() += v;
        }
        self.expected += o.expected;
        self.unexpected += o.unexpected;
        self.prefill_expected += o.prefill_expected;
        self.prefill_unexpected += o.prefill_unexpected;
        self.aborts_planned += o.aborts_planned;
        self.aborts_too_late += o.aborts_too_late;
        self.split_prefill_failed_decode_ok += o.split_prefill_failed_decode_ok;
        self.split_prefill_ok_decode_failed += o.split_prefill_ok_decode_failed;
        self.decode = self.decode + o.decode;
        self.host = self.host + o.host;
        self.prefill = self.prefill + o.prefill;
        self.verify = self.verify + o.verify;
        self.driver = self.driver + o.driver;
        self.prefill_driver = self.prefill_driver + o.prefill_driver;
        for e in &o.errors {
            self.note(e.clone());
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

/// A fresh cluster key for one run, in hex.
fn fresh_key() -> Result<String, String> {
    let mut k = [0u8; 32];
    getrandom::fill(&mut k).map_err(|e| format!("no random bytes for the run's key: {e}"))?;
    Ok(k.iter().map(|b| format!("{b:02x}")).collect())
}

/// A run driven from here: with the prefill side in a child process (`prefill_addr`
/// None), or at `prefill_addr` on another host.
pub fn run(p: &Params, prefill_addr: Option<&str>) -> Result<Report, String> {
    let mut keyed = p.clone();
    if p.auth != Auth::Off && p.auth_key.is_none() {
        keyed.auth_key = Some(fresh_key()?);
    }
    if p.tls && p.tls_pem.is_none() {
        keyed.tls_pem = Some(crate::tls::TlsPem::fresh()?);
    }
    let p = &keyed;
    let dslots = p.concurrency + p.verify_threads + 1;
    let pslots = p.concurrency + 2;
    let local = prefill_addr.is_none();
    // The pools of each side: between layouts, one per rank and one for the equal-TP
    // comparison; else one, shared by the --auth pairs.
    let layouts = |side: Side| -> Vec<Option<kvxfer::KvLayout>> {
        if p.layouts() {
            let mut v: Vec<_> = p.rank_layouts(side).into_iter().map(Some).collect();
            v.push(Some(p.equal_layout()));
            v
        } else {
            vec![None]
        }
    };
    let side_bytes = |side: Side, slots: usize| -> f64 {
        layouts(side)
            .iter()
            .map(|l| Pool::bytes(p, slots, l.as_ref()) as f64)
            .sum()
    };
    let mut mem = side_bytes(Side::Decode, dslots);
    if local {
        mem += side_bytes(Side::Prefill, pslots);
    }
    if mem / (1u64 << 30) as f64 > p.max_mem_gib {
        return Err(format!(
            "the pools would register {:.1} GiB ({} + {} slots of {} pages x {} buffers x {} \
             bytes{}), more than --max-mem-gib {}; lower --concurrency or the prompt length",
            mem / (1u64 << 30) as f64,
            dslots,
            if local { pslots } else { 0 },
            p.max_pages(),
            p.n_buffers(),
            p.item_len(),
            if p.layouts() {
                ", split among the ranks, plus the equal-TP comparison's"
            } else {
                ""
            },
            p.max_mem_gib
        ));
    }
    let listen = if local { "127.0.0.1:0" } else { "0.0.0.0:0" };
    let mut pools = Vec::new();
    let mut sets = Vec::new();
    if p.layouts() {
        // The TP phases' ranks, then the equal-TP phases' one rank, each engine over its
        // own pool.
        let auth = p.auth.pairs()[0];
        let kinds = [
            (p.rank_layouts(Side::Decode), true),
            (vec![p.equal_layout()], false),
        ];
        for (set, tp) in kinds {
            let mut ranks = Vec::new();
            for l in set {
                let pool = Pool::with_layout(p, dslots, p.dst_order, Some(l));
                let e = make_engine(p, "decode", listen, auth)?;
                pool.register(&e)?;
                pools.push(pool);
                ranks.push((e, pools.len() - 1));
            }
            sets.push(Set { ranks, auth, tp });
        }
    } else {
        // One engine per --auth setting, over the same pool (their phases never overlap).
        let pool = Pool::new(p, dslots, p.dst_order);
        for &auth in p.auth.pairs() {
            let e = make_engine(p, "decode", listen, auth)?;
            pool.register(&e)?;
            sets.push(Set {
                ranks: vec![(e, 0)],
                auth,
                tp: false,
            });
        }
        pools.push(pool);
    }
    // The prefill ranks each set pulls from.
    let prefill_ranks: Vec<usize> = if p.layouts() {
        vec![p.prefill_tp, 1]
    } else {
        vec![1; sets.len()]
    };

    let mut guard = ChildGuard(None);
    let mut ctl = if let Some(addr) = prefill_addr {
        prefill::connect(addr)?
    } else {
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
    };
    ctl.send(&ToPrefill::Plan(Box::new(p.clone())))?;
    // The prefill engines of each set, one per rank.
    let (engine_addrs, base_addr) = match ctl.recv()? {
        ToDecode::Ready {
            engines: e,
            baseline,
        } if e.iter().map(Vec::len).eq(prefill_ranks.iter().copied()) => (e, baseline),
        ToDecode::Error(e) => return Err(format!("prefill side: {e}")),
        other => return Err(format!("prefill side said {}", other.kind())),
    };

    let mut report = Report {
        same_host: local,
        loadavg: (loadavg(), f64::NAN),
        pool_pages: p.pool_pages.name(),
        pool_huge_fraction: pools[0].huge_fraction,
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
    // With --auth both, the pairs take turns, --repeat phases of each, in the order
    // off on, on off, off on, ...; between layouts, the TP ranks and the equal-TP
    // comparison the same way; with --layerwise, the ways of feeding the rooms (see
    // Params::phase_plan).
    let plan = p.phase_plan(sets.len());
    let phases = plan.len();
    // A round of baselines before each phase and after the last (`None`).
    let steps = plan.iter().copied().map(Some).chain([None]);
    for (rep, step) in steps.enumerate() {
        if p.baselines {
            progress_note(p, "baseline tcp");
            let (m, send) = tcp_baseline(&mut ctl, &base_addr, p, volume, secs)?;
            report.tcp.push(m);
            report.tcp_send.push(send);
            progress_note(p, "baseline memcpy");
            report
                .memcpy
                .push(baseline::memcpy(volume, secs, p.pool_pages));
            if p.same_host != "off" {
                progress_note(p, "baseline memcpy of the pages");
                report.memcpy_pages.push(baseline::memcpy_pages(
                    volume,
                    secs,
                    p.item_len(),
                    p.conns,
                    p.pool_pages,
                ));
            }
        }
        let Some((which, feed)) = step else {
            break;
        };
        let set = &sets[which];
        progress_note(
            p,
            &format!(
                "kvxfer, phase {} of {phases}, auth {}{}",
                rep + 1,
                match (set.auth, p.tls) {
                    (true, true) => "on, with TLS and encrypt_data",
                    (true, false) => "on",
                    (false, _) => "off",
                },
                match (p.layouts(), set.tp) {
                    (false, _) if feed.simulate => format!(", {}", feed.name()),
                    (false, _) => String::new(),
                    (true, true) => format!(", TP {} -> {}", p.prefill_tp, p.decode_tp),
                    (true, false) => ", TP 1 -> 1 (equal-TP comparison)".into(),
                }
            ),
        );
        let mut kv = kvxfer_phase(
            p,
            set,
            &pools,
            &mut ctl,
            (&engine_addrs[which], which),
            local,
            (start, feed),
        )?;
        kv.auth = set.auth;
        kv.tp = set.tp;
        start += kv.rooms;
        report.kv.absorb(&kv);
        report.phases.push(kv);
    }
    report.loadavg.1 = loadavg();
    ctl.send(&ToPrefill::Quit)?;
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
) -> Result<(Measured, Usage), String> {
    ctl.send(&ToPrefill::Tcp {
        conns: p.conns,
        bytes,
        secs,
    })?;
    let m = baseline::tcp_receive(
        addr,
        p.conns,
        baseline::Buffers {
            mib: p.baseline_buf_mib,
            pages: p.pool_pages,
        },
        p.baseline_read_kib << 10,
        &mut || match ctl.recv()? {
            ToDecode::TcpReady => Ok(()),
            other => Err(format!("prefill side said {} to tcp", other.kind())),
        },
    )?;
    match ctl.recv()? {
        ToDecode::TcpDone { bytes, usage } if bytes == m.bytes => Ok((m, usage)),
        ToDecode::TcpDone { bytes, .. } => Err(format!(
            "baseline: prefill sent {bytes} bytes, decode received {}",
            m.bytes
        )),
        other => Err(format!("prefill side said {} after tcp", other.kind())),
    }
}

struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    /// Tokens the room moves (every rank's pages hold them).
    tokens: u64,
    abort: Option<AbortAt>,
    aborted: bool,
}

#[derive(Clone, Default)]
struct Rec {
    t_dest: u64,
    /// When a poll first saw the room TRANSFERRING (or SUCCESS, if none did).
    t_first: u64,
    /// Whether a poll saw it TRANSFERRING.
    seen_transferring: bool,
    t_done: u64,
    ok: bool,
    planned_abort: bool,
}

/// Time-to-first-token of a room with simulated compute: its first layer's compute
/// (prefill) to decode SUCCESS, when the decode side took it whole and the two
/// timestamps share a clock (one host).
fn ttft(pr: &PrefillRoom, rec: &Rec, same_host: bool) -> Option<u64> {
    let c = pr.compute.as_ref()?;
    (same_host && rec.ok).then(|| c.ttft_ns(rec.t_done))
}

struct Job {
    idx: usize,
    id: u64,
    slot: usize,
    tokens: u64,
}

struct Checked {
    idx: usize,
    slot: usize,
    result: Result<u64, String>,
}

/// The engines of one kind of phase: one per decode rank, each with the index of its
/// pool.
struct Set {
    ranks: Vec<(Engine, usize)>,
    /// Whether they authenticate.
    auth: bool,
    /// The TP phases' ranks (between layouts), not the equal-TP comparison's.
    tp: bool,
}

/// One rank of a phase: its engine and its pool.
type Rank<'a> = (&'a Engine, &'a Pool);

/// The decode scheduler loop of one run, over every decode rank of `set`. With several
/// ranks, a thread per other rank wakes the loop (waiting in rank 0's engine) when a
/// room of its rank changes state.
fn kvxfer_phase(
    p: &Params,
    set: &Set,
    pools: &[Pool],
    ctl: &mut Ctl,
    prefill: (&[String], usize),
    same_host: bool,
    start: (u64, Feed),
) -> Result<KvResult, String> {
    let ranks: Vec<Rank<'_>> = set.ranks.iter().map(|(e, i)| (e, &pools[*i])).collect();
    let ranks = &ranks;
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
        let r = kvxfer_loop(p, ranks, ctl, prefill, same_host, start, scope);
        stop.store(true, Ordering::Relaxed);
        r
    })
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

#[allow(clippy::too_many_arguments)]
fn kvxfer_loop<'s>(
    p: &'s Params,
    ranks: &'s [Rank<'s>],
    ctl: &mut Ctl,
    (prefill_addrs, prefill_set): (&[String], usize),
    same_host: bool,
    (start, feed): (u64, Feed),
    scope: &'s std::thread::Scope<'s, '_>,
) -> Result<KvResult, String> {
    let mut out = KvResult {
        feed,
        ..Default::default()
    };
    let (job_tx, job_rx) = mpsc::channel::<Job>();
    let (ret_tx, ret_rx) = mpsc::channel::<Checked>();
    let job_rx = Arc::new(Mutex::new(job_rx));
    let verify = p.verify;
    // The loop waits in rank 0's engine.
    let engine = ranks[0].0;
    let slots = ranks[0].1.slots;
    let verifiers: Vec<_> = (0..p.verify_threads)
        .map(|_| {
            let (rx, tx) = (job_rx.clone(), ret_tx.clone());
            scope.spawn(move || {
                if p.verify_priority == VerifyPriority::Idle {
                    crate::sys::sched_idle();
                }
                let u0 = Usage::thread();
                loop {
                    let job = match rx.lock().expect("job queue").recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    };
                    let mut result = Ok(0);
                    for (rank, (_, pool)) in ranks.iter().enumerate() {
                        let pages = pool.pages_for(job.tokens as usize);
                        let r = pool.verify(job.slot, pages, job.tokens, job.id, verify);
                        result = match (result, r) {
                            (Ok(a), Ok(b)) => Ok(a + b),
                            (Err(e), _) => Err(e),
                            (_, Err(e)) if ranks.len() > 1 => {
                                Err(format!("decode rank {rank}: {e}"))
                            }
                            (_, Err(e)) => Err(e),
                        };
                    }
                    let _ = tx.send(Checked {
                        idx: job.idx,
                        slot: job.slot,
                        result,
                    });
                    // The scheduler loop may be waiting in the engine.
                    engine.wake();
                }
                Usage::thread().since(u0)
            })
        })
        .collect();
    drop(ret_tx);

    let mut free: Vec<usize> = (0..slots).rev().collect();
    let mut live: Vec<Live> = Vec::with_capacity(p.concurrency);
    let mut draining: Vec<Live> = Vec::new();
    let mut recs: Vec<Rec> = Vec::new();
    let mut checking = 0usize;
    let total = if p.duration.is_some() {
        u64::MAX
    } else {
        p.rooms
    };
    let peers = RoomPeers::Prefills(prefill_addrs.to_vec());
    let mut announced = 0u64;
    let mut ended = false;
    ctl.send(&ToPrefill::Run {
        start,
        engine: prefill_set,
        feed,
    })?;
    let (u0, driver0, h0) = (Usage::now(), Usage::thread(), HostMark::now());
    let t0 = Instant::now();
    let deadline = p.duration.map(|d| t0 + Duration::from_secs_f64(d));
    let mut next_progress = t0 + Duration::from_secs(1);
    let mut t_last = t0;
    // Tokens each room moves: the prefill's pages' tokens, at most the decode pages'.
    let moved = |plan: &crate::ctl::RoomPlan| -> u64 {
        let dst = ranks[0].1.pages_for(plan.tokens) * ranks[0].1.page_tokens;
        (plan.pages * p.page_tokens).min(dst) as u64
    };
    loop {
        let mut progress = false;
        let seen = engine.changes();
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
                    out.bytes += ranks
                        .iter()
                        .map(|(_, pool)| pool.room_bytes(pool.pages_for(plan.tokens), moved(&plan)))
                        .sum::<u64>();
                    out.bytes_checked += checked;
                    out.buffer_pages += (plan.pages * p.n_buffers()) as u64;
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
                let aux = ranks[0].1.aux.is_some().then_some(slot as u32);
                let t_dest = mono_ns();
                let r = ranks.iter().try_for_each(|(e, pool)| {
                    let pages = pool.pages(slot, pool.pages_for(plan.tokens));
                    e.room_create(id, peers.clone())
                        .and_then(|()| e.room_set_destination(id, &pages, aux))
                });
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
                    tokens: moved(&plan),
                    abort: plan.abort,
                    aborted: false,
                };
                if let Err(e) = r {
                    // The room is still announced: the prefill side creates it and sees
                    // it fail, as it would in a server.
                    *out.failed.entry("create_error".into()).or_default() += 1;
                    out.unexpected += 1;
                    out.note(format!("room {idx}: {e}"));
                    for (e, _) in ranks {
                        let _ = e.room_abort(id, "bench: setup failed");
                    }
                    draining.push(l);
                    continue;
                }
                // A planned decode abort comes from rank 0; the engines fail the room on
                // every other rank.
                if l.abort == Some(AbortAt::DecodeEarly) {
                    let _ = engine.room_abort(id, "bench: planned abort (decode, early)");
                    l.aborted = true;
                }
                live.push(l);
            }
        }
        if recs.len() as u64 > announced {
            announced = recs.len() as u64;
            ctl.send(&ToPrefill::Upto(start + announced))?;
        }
        if !ended && !creating {
            ended = true;
            ctl.send(&ToPrefill::End(start + recs.len() as u64))?;
        }
        // Poll every room in flight on every rank, as a server's scheduler loop does.
        let mut i = 0;
        while i < live.len() {
            let l = &mut live[i];
            match poll_all(ranks, l.id) {
                Ok(Polled { success: true, .. }) => {
                    let rec = &mut recs[l.idx];
                    rec.t_done = mono_ns();
                    if !rec.seen_transferring {
                        rec.t_first = rec.t_done;
                    }
                    if l.abort.is_some() {
                        out.aborts_too_late += 1;
                    }
                    for (e, _) in ranks {
                        let _ = e.room_clear(l.id);
                    }
                    let l = live.swap_remove(i);
                    checking += 1;
                    job_tx
                        .send(Job {
                            idx: l.idx,
                            id: l.id,
                            slot: l.slot,
                            tokens: l.tokens,
                        })
                        .map_err(|_| "the checker threads stopped".to_string())?;
                    progress = true;
                    continue;
                }
                Ok(Polled {
                    failed: Some(rank),
                    terminal,
                    ..
                }) => {
                    recs[l.idx].t_done = mono_ns();
                    let failed = ranks[rank].0;
                    let (key, expected, msg) = match failed.room_failure(l.id) {
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
                        let on = if ranks.len() > 1 {
                            format!(" (decode rank {rank})")
                        } else {
                            String::new()
                        };
                        out.note(format!("room {}{on}: {msg}", l.idx));
                    }
                    // The request is gone: a rank still live gives up too (the engines
                    // would fail it through the prefill ranks; this does not wait).
                    if !terminal {
                        for (e, _) in ranks {
                            let _ = e.room_abort(l.id, "bench: another decode rank failed");
                        }
                    }
                    draining.push(live.swap_remove(i));
                    progress = true;
                    continue;
                }
                Ok(Polled { transferring, .. }) => {
                    let rec = &mut recs[l.idx];
                    // Not progress: the loop sleeps as it did before it looked.
                    if transferring && !rec.seen_transferring {
                        rec.seen_transferring = true;
                        rec.t_first = mono_ns();
                    }
                    if transferring && l.abort == Some(AbortAt::DecodeMid) && !l.aborted {
                        let _ =
                            engine.room_abort(l.id, "bench: planned abort (decode, mid-transfer)");
                        l.aborted = true;
                        progress = true;
                    }
                }
                Err(e) => {
                    *out.failed.entry("poll_error".into()).or_default() += 1;
                    out.unexpected += 1;
                    out.note(format!("room {}: poll: {e}", l.idx));
                    for (e, _) in ranks {
                        let _ = e.room_abort(l.id, "bench: poll failed");
                    }
                    draining.push(live.swap_remove(i));
                    continue;
                }
            }
            i += 1;
        }
        // Failed rooms give their pages back once no write into them can still land, on
        // any rank.
        draining.retain(|l| {
            let drained = ranks
                .iter()
                .all(|(e, _)| e.room_drained(l.id).unwrap_or(true));
            if drained {
                for (e, _) in ranks {
                    let _ = e.room_clear(l.id);
                }
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
            // A room's change of state and a checked room wake the wait; a failed room
            // draining does not, so it is looked at every --poll-us; the progress line
            // and the run's deadline bound the rest.
            let mut longest = next_progress.saturating_duration_since(Instant::now());
            if let Some(d) = deadline {
                longest = longest.min(d.saturating_duration_since(Instant::now()));
            }
            if !draining.is_empty() {
                longest = longest.min(Duration::from_micros(p.poll_us));
            }
            crate::ctl::idle(p, engine, seen, longest);
        }
    }
    out.secs = t_last
        .max(t0 + Duration::from_nanos(1))
        .duration_since(t0)
        .as_secs_f64();
    out.decode = Usage::now().since(u0);
    out.host = h0.since();
    out.driver = Usage::thread().since(driver0);
    out.rooms = recs.len() as u64;
    drop(job_tx);
    for v in verifiers {
        out.verify = out.verify + v.join().map_err(|_| "a checker thread panicked")?;
    }

    // The prefill side's account of the same rooms.
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
    for (idx, (pr, rec)) in prooms.iter().zip(&recs).enumerate() {
        if let Some(c) = &pr.compute {
            out.late.extend(&c.late_ns);
        }
        if let (Some(t), true) = (ttft(pr, rec, same_host), pr.outcome == Outcome::Ok) {
            out.ttft.push(t);
            let pages = room_plan(p, start + idx as u64).pages;
            out.compute.push(p.compute_ns(feed, pages));
            let last = pr.compute.as_ref().and_then(|c| c.late_ns.last());
            out.last_late.push(last.copied().unwrap_or(0));
        }
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
    Ok(out)
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

    #[test]
    fn results_added_up_keep_every_rooms_ttft_compute_and_lateness() {
        let feed = Feed {
            simulate: true,
            by_layer: true,
            compute_us_per_layer: 10,
        };
        let a = KvResult {
            feed,
            ttft: vec![3, 4],
            compute: vec![2, 2],
            late: vec![7],
            last_late: vec![1, 2],
            ..Default::default()
        };
        let mut t = KvResult::default();
        t.absorb(&a);
        t.absorb(&a);
        assert_eq!(t.ttft, [3, 4, 3, 4]);
        assert_eq!(t.compute.len(), 4);
        assert_eq!(t.late, [7, 7]);
        assert_eq!(t.last_late, [1, 2, 1, 2]);
    }
}
