//! `kvxfer-bench`: drives a prefill and a decode engine through the public Rust API with
//! model-shaped traffic, checks every delivered byte, and reports the figures next to
//! baselines measured in the same run (a plain TCP stream, memcpy). `kvxfer-bench table`
//! is the room table microbenchmark. See docs/BENCHMARKS.md and `--help`.

#[path = "kvxfer_bench/args.rs"]
mod args;
#[path = "kvxfer_bench/baseline.rs"]
mod baseline;
#[path = "kvxfer_bench/ctl.rs"]
mod ctl;
#[path = "kvxfer_bench/decode.rs"]
mod decode;
#[path = "kvxfer_bench/pattern.rs"]
mod pattern;
#[path = "kvxfer_bench/pool.rs"]
mod pool;
#[path = "kvxfer_bench/prefill.rs"]
mod prefill;
#[path = "kvxfer_bench/report.rs"]
mod report;
#[path = "kvxfer_bench/sys.rs"]
mod sys;
#[path = "kvxfer_bench/table.rs"]
mod table;

use std::process::ExitCode;

use kvxfer::log::{Level, Logger};
use kvxfer::{Config, Engine};

use args::{Params, Role};

/// An engine configured from the benchmark's options.
pub fn make_engine(p: &Params, role: &str, listen: &str) -> Result<Engine, String> {
    let mut c = Config::default();
    let mut set = |k: &str, v: &str| c.set(k, v).map_err(|e| e.to_string());
    set("role", role)?;
    set("listen", listen)?;
    set("transport", &p.transport)?;
    if let Some(w) = p.workers {
        set("workers", &w.to_string())?;
    }
    set("connections_per_peer", &p.conns.to_string())?;
    set("log_level", &p.log_level)?;
    let level = Level::parse(&p.log_level).unwrap_or(Level::Error);
    Engine::new(c, Logger::new(level, None))
        .map_err(|e| format!("cannot start the {role} engine: {e}"))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let p = match Params::parse(&args) {
        Ok(p) => p,
        Err(e) if e.is_empty() => {
            print!("{}", args::USAGE);
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kvxfer-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let r = if p.role == Role::Prefill {
        prefill::serve(&p).map(|()| None)
    } else if p.table {
        table::run(&p).map(Some)
    } else {
        decode::run(&p).map(|r| {
            let ok = r.kv.unexpected == 0 && r.kv.prefill_unexpected == 0;
            let mut out = report::human(&p, &r);
            if p.json {
                out.push_str(&report::json(&p, &r));
                out.push('\n');
            }
            Some((out, ok))
        })
    };
    match r {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some((out, ok))) => {
            print!("{out}");
            if ok {
                ExitCode::SUCCESS
            } else {
                eprintln!("kvxfer-bench: unexpected failures (see above)");
                ExitCode::from(1)
            }
        }
        Err(e) => {
            eprintln!("kvxfer-bench: {e}");
            if p.json && p.role != Role::Prefill {
                println!(
                    "{}",
                    report::J::obj(vec![
                        ("preset", report::J::Str(p.preset.clone())),
                        ("transport", report::J::Str(p.transport.clone())),
                        ("error", report::J::Str(e)),
                    ])
                    .to_line()
                );
            }
            ExitCode::from(2)
        }
    }
}
