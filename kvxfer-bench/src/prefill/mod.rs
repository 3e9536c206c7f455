//! The prefill side: an engine whose source pool holds every room's pattern, a scheduler
//! loop that creates the rooms the decode side announced and enqueues their chunks, and
//! the sending half of the TCP baseline. Driven over the control channel.
//!
//! Between layouts (`--prefill-tp`, `--decode-tp`) every prefill rank is an engine over
//! its own pool, with its own scheduler loop (a thread per rank during a phase), and the
//! equal-TP comparison is one more engine over a pool of the TP 1 layout.

mod driver;
mod forwards;

use std::io::{BufRead, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Weak};
use std::time::{Duration, Instant};

use kvxfer::{Cause, Engine};

use crate::args::DstOrder;
use crate::ctl::{self, Ctl, ToDecode, ToPrefill};
use crate::params::{Feed, Params};
use crate::pool::Pool;
use crate::shape::Side;
use crate::sys::Usage;
use crate::{baseline, make_engine};
use driver::Announced;

/// The engines of one kind of phase: one per rank, each with the index of its pool, and
/// the decode ranks each room waits for.
struct Set {
    ranks: Vec<(Engine, usize)>,
    decoders: usize,
}

/// The control channel to the decode side: over stdin/stdout (`listen` None, the child
/// of a local run), or the first decode bench that connects to `listen`. With it, the
/// host to listen on, and the address the decode side reached (to name in place of an
/// unspecified one).
fn accept(listen: Option<&str>) -> Result<(Ctl, String, Option<IpAddr>), String> {
    let Some(listen) = listen else {
        let ctl = Ctl::new(std::io::stdin(), std::io::stdout());
        return Ok((ctl, "127.0.0.1".to_string(), None));
    };
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
    Ok((Ctl::new(r, s), host, Some(ip)))
}

/// The run's plan, checked (a bad one is answered with the reason).
fn plan(ctl: &mut Ctl) -> Result<Params, String> {
    let p = match ctl.recv::<ToPrefill>()? {
        ToPrefill::Plan(p) => *p,
        other => return Err(format!("expected a plan, got {other:?}")),
    };
    if let Err(e) = p.validate() {
        let _ = ctl.send(&ToDecode::Error(format!("bad plan: {e}")));
        return Err(e);
    }
    Ok(p)
}

/// The prefill engines over their pools, every pool's bodies filled, and the baseline's
/// listener, all on `host`: between layouts, the TP phases' ranks, then the equal-TP
/// phases' one rank, each engine over its own pool; else one engine per --auth setting
/// over the same pool.
fn setup(p: &Params, host: &str) -> Result<(Vec<Set>, Vec<Pool>, TcpListener), String> {
    let listen = if host.contains(':') {
        format!("[{host}]:0")
    } else {
        format!("{host}:0")
    };
    let slots = p.concurrency + 2;
    let mut pools = Vec::new();
    let mut sets = Vec::new();
    if p.layouts() {
        let auth = p.auth.pairs()[0];
        let layouts = [
            (p.rank_layouts(Side::Prefill), p.decode_tp),
            (vec![p.equal_layout()], 1),
        ];
        for (set, decoders) in layouts {
            let mut ranks = Vec::new();
            for l in set {
                let pool = Pool::with_layout(p, slots, DstOrder::Contiguous, Some(l));
                pool.fill_bodies();
                let e = make_engine(p, "prefill", &listen, auth)?;
                pool.register(&e)?;
                pools.push(pool);
                ranks.push((e, pools.len() - 1));
            }
            sets.push(Set { ranks, decoders });
        }
    } else {
        let pool = Pool::new(p, slots, DstOrder::Contiguous);
        pool.fill_bodies();
        for &auth in p.auth.pairs() {
            let e = make_engine(p, "prefill", &listen, auth)?;
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
}

/// The decode side's message that the engines and the baseline listener are ready:
/// their addresses, as the decode side reaches them.
fn ready(sets: &[Set], base: &TcpListener, local_ip: Option<IpAddr>) -> Result<ToDecode, String> {
    let reachable = |a: SocketAddr| -> SocketAddr {
        match local_ip {
            Some(ip) if a.ip().is_unspecified() => SocketAddr::new(ip, a.port()),
            _ => a,
        }
    };
    let mut engines = Vec::with_capacity(sets.len());
    for set in sets {
        let mut ranks = Vec::with_capacity(set.ranks.len());
        for (e, _) in &set.ranks {
            let a: SocketAddr = e
                .address()
                .parse()
                .map_err(|e| format!("engine address: {e}"))?;
            ranks.push(reachable(a).to_string());
        }
        engines.push(ranks);
    }
    let base = reachable(base.local_addr().map_err(|e| e.to_string())?);
    Ok(ToDecode::Ready {
        engines,
        baseline: base.to_string(),
    })
}

/// A reader thread: takes the announcements of a phase in flight (`Upto`, `End`) as
/// they come, each waking the scheduler loops waiting in their engines, and hands every
/// other message to the returned channel. The engines are reached through a weak
/// reference, so that they still stop when [`serve`] drops them.
fn read_control(
    mut r: Box<dyn BufRead + Send>,
    (upto, end): (Arc<AtomicU64>, Arc<AtomicU64>),
    sets: Weak<Vec<Set>>,
) -> mpsc::Receiver<Result<ToPrefill, String>> {
    let (tx, rx) = mpsc::channel();
    let wake = move || {
        if let Some(sets) = sets.upgrade() {
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
    rx
}

/// Serves one run: over stdin/stdout (`listen` None, the child of a local run) or for
/// the first decode bench that connects to `listen`.
pub fn serve(listen: Option<&str>) -> Result<(), String> {
    let (mut ctl, host, local_ip) = accept(listen)?;
    let p = plan(&mut ctl)?;
    let (sets, pools, base) = match setup(&p, &host) {
        Ok(x) => x,
        Err(e) => {
            let _ = ctl.send(&ToDecode::Error(e.clone()));
            return Err(e);
        }
    };
    ctl.send(&ready(&sets, &base, local_ip)?)?;
    let (r, mut w) = ctl.split();
    let upto = Arc::new(AtomicU64::new(0));
    let end = Arc::new(AtomicU64::new(u64::MAX));
    let sets = Arc::new(sets);
    let rx = read_control(r, (upto.clone(), end.clone()), Arc::downgrade(&sets));
    let announced = Announced {
        upto: &upto,
        end: &end,
    };
    for m in rx {
        match m? {
            ToPrefill::Tcp { conns, bytes, secs } => {
                tcp_send(&p, &base, &mut w, (conns, bytes, secs))?;
            }
            ToPrefill::Run {
                start,
                engine,
                feed,
            } => {
                let set = sets
                    .get(engine)
                    .ok_or_else(|| format!("run: no engine {engine}"))?;
                run_phase(&p, set, &pools, (start, feed), &announced, &mut w)?;
            }
            ToPrefill::Quit => break,
            other => return Err(format!("unexpected control message {other:?}")),
        }
    }
    drop(sets);
    Ok(())
}

/// The sending half of one TCP baseline.
fn tcp_send(
    p: &Params,
    base: &TcpListener,
    w: &mut Box<dyn Write + Send>,
    (conns, bytes, secs): (usize, u64, f64),
) -> Result<(), String> {
    let m = baseline::tcp_send(
        base,
        conns,
        bytes,
        secs,
        baseline::Buffers {
            mib: p.baseline_buf_mib,
            pages: p.pool_pages,
        },
        p.baseline_write_kib << 10,
        &mut || ctl::send(w, &ToDecode::TcpReady),
    )?;
    ctl::send(
        w,
        &ToDecode::TcpDone {
            bytes: m.bytes,
            usage: m.usage,
        },
    )
}

/// One kvxfer phase on the ranks of `set`, then its account to the decode side.
fn run_phase(
    p: &Params,
    set: &Set,
    pools: &[Pool],
    (start, feed): (u64, Feed),
    announced: &Announced<'_>,
    w: &mut Box<dyn Write + Send>,
) -> Result<(), String> {
    let runs = || -> u64 {
        set.ranks
            .iter()
            .map(|(e, _)| e.metrics().data_runs_sent)
            .sum()
    };
    let (u0, runs0) = (Usage::now(), runs());
    let (rooms, driver) = driver::run_ranks(p, set, pools, (start, feed), announced)?;
    let usage = Usage::now().since(u0);
    ctl::send(
        w,
        &ToDecode::PhaseDone {
            rooms,
            usage,
            driver,
            runs: runs() - runs0,
        },
    )
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
