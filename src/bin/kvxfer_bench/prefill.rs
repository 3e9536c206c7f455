//! The prefill side: an engine whose source pool holds every room's pattern, a scheduler
//! loop that creates the rooms the decode side announced and enqueues their chunks, and
//! the sending half of the TCP baseline. Driven over the control channel.

use std::io::{BufRead, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use kvxfer::{Cause, Engine, RoomPeers, State};

use crate::args::{DstOrder, Params};
use crate::ctl::{room_id, room_plan, AbortAt, Ctl};
use crate::pool::Pool;
use crate::sys::{mono_ns, thread_cpu_ns, Cpu};
use crate::{baseline, make_engine};

/// Serves one run: over stdin/stdout (`--control stdio`, the child of a local run) or
/// for the first decode bench that connects to `--listen`.
pub fn serve(cli: &Params) -> Result<(), String> {
    let (mut ctl, host, local_ip) = if cli.control_stdio {
        (
            Ctl::new(std::io::stdin(), std::io::stdout()),
            "127.0.0.1".to_string(),
            None,
        )
    } else {
        let listen = cli.listen.as_deref().expect("validated");
        let l = TcpListener::bind(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
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
    };
    let line = ctl.recv()?;
    let Some(args) = line.strip_prefix("plan ") else {
        return Err(format!("expected a plan, got '{line}'"));
    };
    let args: Vec<String> = args.split_whitespace().map(String::from).collect();
    let p = match Params::parse(&args) {
        Ok(p) => p,
        Err(e) => {
            let _ = ctl.send(&format!("error bad plan: {e}"));
            return Err(e);
        }
    };
    let setup = || -> Result<(Engine, Pool, TcpListener), String> {
        let listen = if host.contains(':') {
            format!("[{host}]:0")
        } else {
            format!("{host}:0")
        };
        let engine = make_engine(&p, "prefill", &listen)?;
        let pool = Pool::new(&p, p.concurrency + 2, DstOrder::Contiguous);
        pool.fill_bodies();
        pool.register(&engine)?;
        let base = TcpListener::bind(&listen).map_err(|e| format!("baseline listener: {e}"))?;
        Ok((engine, pool, base))
    };
    let (engine, pool, base) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ctl.send(&format!("error {e}"));
            return Err(e);
        }
    };
    let reachable = |a: SocketAddr| -> SocketAddr {
        match local_ip {
            Some(ip) if a.ip().is_unspecified() => SocketAddr::new(ip, a.port()),
            _ => a,
        }
    };
    let engine_addr = reachable(
        engine
            .address()
            .parse()
            .map_err(|e| format!("engine address: {e}"))?,
    );
    let base_addr = reachable(base.local_addr().map_err(|e| e.to_string())?);
    ctl.send(&format!("ready {engine_addr} {base_addr}"))?;

    let (r, mut w) = ctl.split();
    let upto = Arc::new(AtomicU64::new(0));
    let end = Arc::new(AtomicU64::new(u64::MAX));
    let (tx, rx) = mpsc::channel::<String>();
    {
        let (upto, end) = (upto.clone(), end.clone());
        std::thread::spawn(move || {
            for line in r.lines() {
                let Ok(line) = line else { break };
                let mut f = line.split_whitespace();
                match (f.next(), f.next().and_then(|n| n.parse::<u64>().ok())) {
                    (Some("upto"), Some(n)) => upto.store(n, Ordering::Release),
                    (Some("end"), Some(n)) => end.store(n, Ordering::Release),
                    _ => {
                        if tx.send(line).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = tx.send("quit".into());
        });
    }
    let mut send = |line: &str| -> Result<(), String> {
        writeln!(w, "{line}")
            .and_then(|_| w.flush())
            .map_err(|e| format!("control channel write failed: {e}"))
    };
    for cmd in rx {
        let f: Vec<&str> = cmd.split_whitespace().collect();
        match f.as_slice() {
            ["tcp", conns, bytes, secs] => {
                let parse = |s: &str| s.parse::<f64>().map_err(|e| format!("{cmd}: {e}"));
                let m = baseline::tcp_send(
                    &base,
                    parse(conns)? as usize,
                    parse(bytes)? as u64,
                    parse(secs)?,
                    baseline::Buffers {
                        mib: p.baseline_buf_mib,
                        pages: p.pool_pages,
                    },
                    p.baseline_write_kib << 10,
                    &mut || send("tcpready"),
                )?;
                send(&format!(
                    "tcpdone {} {} {}",
                    m.bytes, m.cpu.user_us, m.cpu.sys_us
                ))?;
            }
            ["run", start] => {
                let start: u64 = start.parse().map_err(|e| format!("{cmd}: {e}"))?;
                let cpu0 = Cpu::now();
                let driver0 = thread_cpu_ns();
                let out = run_rooms(&p, &engine, &pool, start, &upto, &end)?;
                let driver = thread_cpu_ns() - driver0;
                let cpu = Cpu::now().since(cpu0);
                let mut text = String::with_capacity(out.len() * 48);
                for (idx, r) in out.iter().enumerate() {
                    use std::fmt::Write as _;
                    let idx = start + idx as u64;
                    let _ = writeln!(text, "prec {idx} {} {} {}", r.t_enq, r.t_term, r.outcome);
                }
                text.push_str(&format!("pdone {} {} {driver}", cpu.user_us, cpu.sys_us));
                send(&text)?;
            }
            ["quit"] => break,
            _ => return Err(format!("unknown command '{cmd}'")),
        }
    }
    drop(engine);
    Ok(())
}

/// What happened to one room on the prefill side.
struct Rec {
    /// CLOCK_MONOTONIC ns of the first enqueue.
    t_enq: u64,
    /// When the scheduler saw the room terminal.
    t_term: u64,
    /// `ok`, or `CAUSE:local|peer` (`create_error:local` when the engine refused it).
    outcome: String,
}

struct Live {
    idx: usize,
    id: u64,
    slot: usize,
    abort: bool,
    aborted: bool,
}

/// The prefill scheduler loop of one run.
fn run_rooms(
    p: &Params,
    engine: &Engine,
    pool: &Pool,
    start: u64,
    upto: &AtomicU64,
    end: &AtomicU64,
) -> Result<Vec<Rec>, String> {
    let mut free: Vec<usize> = (0..pool.slots).rev().collect();
    let mut live: Vec<Live> = Vec::with_capacity(pool.slots);
    let mut recs: Vec<Rec> = Vec::new();
    let chunk = p.chunk_pages();
    loop {
        let mut progress = false;
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
                .room_create(id, RoomPeers::Decoders(1))
                .and_then(|()| {
                    let pages = pool.pages(slot, plan.pages);
                    let parts: Vec<&[u32]> = pages.chunks(chunk).collect();
                    for (i, part) in parts.iter().enumerate() {
                        let last = i + 1 == parts.len();
                        let aux = (last && pool.aux.is_some()).then_some(slot as u32);
                        engine.enqueue_chunk(id, part, last, aux)?;
                    }
                    Ok(())
                });
            recs.push(Rec {
                t_enq,
                t_term: 0,
                outcome: String::new(),
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
                    abort: plan.abort == Some(AbortAt::PrefillMid),
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
                    recs[idx].outcome = "create_error:local".into();
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
                        Ok(State::Success) => "ok".to_string(),
                        Ok(_) => match engine.room_failure(r.id) {
                            Ok(f) => format!(
                                "{}:{}",
                                f.cause.name(),
                                if f.from_peer { "peer" } else { "local" }
                            ),
                            Err(_) => "unknown:local".into(),
                        },
                        Err(_) => "poll_error:local".into(),
                    };
                    // The slot is reused at once, as a server frees a finished request's
                    // pages. After a failure a worker may still be inside one frame write
                    // from it; those bytes belong to a failed room, which the decode side
                    // refuses, so the new room's stamps cannot reach a checked page.
                    let _ = engine.room_clear(r.id);
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
            end.store(u64::MAX, Ordering::Release);
            return Ok(recs);
        }
        if !progress {
            std::thread::sleep(Duration::from_micros(p.poll_us));
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
