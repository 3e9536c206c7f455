//! The decode side, which drives a run: its engine and destination pool, the prefill
//! side (a child process, or a prefill bench on another host), the baselines, and the
//! decode scheduler loop that creates rooms, polls them, clears them and hands delivered
//! pages to the checker threads.

mod driver;

use std::process::{Child, Command, Stdio};

use kvxfer::Engine;

use crate::args::{Auth, SameHost};
use crate::baseline::{self, Measured};
use crate::ctl::{room_plan, Ctl, ToDecode, ToPrefill};
use crate::params::{Feed, Params};
use crate::pool::Pool;
use crate::results::{loadavg, KvResult, Report};
use crate::shape::Side;
use crate::sys::Usage;
use crate::{make_engine, prefill};
use driver::Rank;

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

/// The engines of one kind of phase: one per decode rank, each with the index of its
/// pool.
struct Set {
    ranks: Vec<(Engine, usize)>,
    /// Whether they authenticate.
    auth: bool,
    /// The TP phases' ranks (between layouts), not the equal-TP comparison's.
    tp: bool,
}

/// The run's parameters with the secrets it makes for itself: a cluster key with
/// `--auth`, certificates with `--tls`.
fn keyed(p: &Params) -> Result<Params, String> {
    let mut keyed = p.clone();
    if p.auth != Auth::Off && p.auth_key.is_none() {
        keyed.auth_key = Some(fresh_key()?);
    }
    if p.tls && p.tls_pem.is_none() {
        keyed.tls_pem = Some(crate::tls::TlsPem::fresh()?);
    }
    Ok(keyed)
}

/// The layouts of one side's pools: between layouts, one per rank and one for the
/// equal-TP comparison; else one (`None`: whole pages), shared by the --auth pairs.
fn pool_layouts(p: &Params, side: Side) -> Vec<Option<kvxfer::KvLayout>> {
    if p.layouts() {
        let mut v: Vec<_> = p.rank_layouts(side).into_iter().map(Some).collect();
        v.push(Some(p.equal_layout()));
        v
    } else {
        vec![None]
    }
}

/// Refuses a run whose pools (both sides' when `local`) would register more than
/// `--max-mem-gib`.
fn check_memory(p: &Params, (dslots, pslots): (usize, usize), local: bool) -> Result<(), String> {
    let side_bytes = |side: Side, slots: usize| -> f64 {
        pool_layouts(p, side)
            .iter()
            .map(|l| Pool::bytes(p, slots, l.as_ref()) as f64)
            .sum()
    };
    let mut mem = side_bytes(Side::Decode, dslots);
    if local {
        mem += side_bytes(Side::Prefill, pslots);
    }
    if mem / (1u64 << 30) as f64 <= p.max_mem_gib {
        return Ok(());
    }
    Err(format!(
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
    ))
}

/// The decode engines and their pools: between layouts, the TP phases' ranks, then the
/// equal-TP phases' one rank, each engine over its own pool; else one engine per --auth
/// setting over the same pool (their phases never overlap).
fn engines(p: &Params, slots: usize, listen: &str) -> Result<(Vec<Pool>, Vec<Set>), String> {
    let mut pools = Vec::new();
    let mut sets = Vec::new();
    if p.layouts() {
        let auth = p.auth.pairs()[0];
        let kinds = [
            (p.rank_layouts(Side::Decode), true),
            (vec![p.equal_layout()], false),
        ];
        for (set, tp) in kinds {
            let mut ranks = Vec::new();
            for l in set {
                let pool = Pool::with_layout(p, slots, p.dst_order, Some(l));
                let e = make_engine(p, "decode", listen, auth)?;
                pool.register(&e)?;
                pools.push(pool);
                ranks.push((e, pools.len() - 1));
            }
            sets.push(Set { ranks, auth, tp });
        }
    } else {
        let pool = Pool::new(p, slots, p.dst_order);
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
    Ok((pools, sets))
}

/// The prefill side: a child process of this one (`prefill_addr` None, kept in the
/// guard), or the prefill bench at `prefill_addr`.
fn start_prefill(prefill_addr: Option<&str>) -> Result<(ChildGuard, Ctl), String> {
    if let Some(addr) = prefill_addr {
        return Ok((ChildGuard(None), prefill::connect(addr)?));
    }
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
    Ok((ChildGuard(Some(child)), Ctl::new(r, w)))
}

/// Hands the prefill side the plan; the addresses of its engines (per set, one per
/// rank, `ranks` of them) and of its baseline listener.
fn handshake(
    ctl: &mut Ctl,
    p: &Params,
    ranks: &[usize],
) -> Result<(Vec<Vec<String>>, String), String> {
    ctl.send(&ToPrefill::Plan(Box::new(p.clone())))?;
    match ctl.recv()? {
        ToDecode::Ready {
            engines: e,
            baseline,
        } if e.iter().map(Vec::len).eq(ranks.iter().copied()) => Ok((e, baseline)),
        ToDecode::Error(e) => Err(format!("prefill side: {e}")),
        other => Err(format!("prefill side said {}", other.kind())),
    }
}

/// A run driven from here: with the prefill side in a child process (`prefill_addr`
/// None), or at `prefill_addr` on another host.
pub fn run(p: &Params, prefill_addr: Option<&str>) -> Result<Report, String> {
    let p = &keyed(p)?;
    let dslots = p.concurrency + p.verify_threads + 1;
    let local = prefill_addr.is_none();
    check_memory(p, (dslots, p.concurrency + 2), local)?;
    let listen = if local { "127.0.0.1:0" } else { "0.0.0.0:0" };
    let (pools, sets) = engines(p, dslots, listen)?;
    // The prefill ranks each set pulls from.
    let prefill_ranks: Vec<usize> = if p.layouts() {
        vec![p.prefill_tp, 1]
    } else {
        vec![1; sets.len()]
    };
    let (mut guard, mut ctl) = start_prefill(prefill_addr)?;
    let (engine_addrs, base_addr) = handshake(&mut ctl, p, &prefill_ranks)?;
    let mut report = Report {
        same_host: local,
        loadavg: (loadavg(), f64::NAN),
        pool_pages: p.pool_pages.name(),
        pool_huge_fraction: pools[0].huge_fraction,
        ..Default::default()
    };
    let run = Run {
        p,
        sets: &sets,
        pools: &pools,
        engine_addrs: &engine_addrs,
        base_addr: &base_addr,
        local,
    };
    run.phases(&mut ctl, &mut report)?;
    report.loadavg.1 = loadavg();
    ctl.send(&ToPrefill::Quit)?;
    if let Some(mut c) = guard.0.take() {
        let _ = c.wait();
    }
    Ok(report)
}

/// What the phases of a run share.
struct Run<'a> {
    p: &'a Params,
    sets: &'a [Set],
    pools: &'a [Pool],
    /// The prefill engines of each set, one per rank, and its baseline listener.
    engine_addrs: &'a [Vec<String>],
    base_addr: &'a str,
    local: bool,
}

impl Run<'_> {
    /// Every phase of the plan, with a round of baselines before each and after the
    /// last. The baselines move the volume a kvxfer phase is planned to move (or run as
    /// long with --duration), adjacent to it on both sides. With --auth both, the pairs
    /// take turns, --repeat phases of each, in the order off on, on off, off on, ...;
    /// between layouts, the TP ranks and the equal-TP comparison the same way; with
    /// --layerwise, the ways of feeding the rooms (see Params::phase_plan). Every phase
    /// follows a round of baselines: a phase that followed another phase directly ran
    /// its link a few % faster than one that followed the baselines (issue 38), which
    /// would favour the second way of a pair.
    fn phases(&self, ctl: &mut Ctl, report: &mut Report) -> Result<(), String> {
        let p = self.p;
        let volume: u64 = (0..p.rooms)
            .map(|i| room_plan(p, i).pages as u64 * p.page_bytes())
            .sum();
        let secs = p.duration.unwrap_or(0.0);
        let plan = p.phase_plan(self.sets.len());
        let mut start = 0u64;
        let steps = plan.iter().copied().map(Some).chain([None]);
        for (i, step) in steps.enumerate() {
            if p.baselines {
                progress_note(p, "baseline tcp");
                let (m, send) = tcp_baseline(ctl, self.base_addr, p, volume, secs)?;
                report.tcp.push(m);
                report.tcp_send.push(send);
                progress_note(p, "baseline memcpy");
                report
                    .memcpy
                    .push(baseline::memcpy(volume, secs, p.pool_pages));
                if p.same_host != SameHost::Off {
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
            progress_note(p, &self.phase_note(i, plan.len(), which, feed));
            let mut kv = self.phase(ctl, which, start, feed)?;
            kv.auth = self.sets[which].auth;
            kv.tp = self.sets[which].tp;
            start += kv.rooms;
            report.kv.absorb(&kv);
            report.phases.push(kv);
        }
        Ok(())
    }

    /// One kvxfer phase on engine set `which`, its rooms from index `start`.
    fn phase(
        &self,
        ctl: &mut Ctl,
        which: usize,
        start: u64,
        feed: Feed,
    ) -> Result<KvResult, String> {
        let ranks: Vec<Rank<'_>> = self.sets[which]
            .ranks
            .iter()
            .map(|(e, i)| (e, &self.pools[*i]))
            .collect();
        let phase = driver::Phase {
            start,
            feed,
            prefill_addrs: &self.engine_addrs[which],
            prefill_set: which,
            same_host: self.local,
        };
        driver::run(self.p, &ranks, ctl, &phase)
    }

    /// The progress line that opens phase `i` of `n`.
    fn phase_note(&self, i: usize, n: usize, which: usize, feed: Feed) -> String {
        let (p, set) = (self.p, &self.sets[which]);
        format!(
            "kvxfer, phase {} of {n}, auth {}{}",
            i + 1,
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
        )
    }
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
