//! `kvxfer-bench`: drives a prefill and a decode engine through the public Rust API with
//! model-shaped traffic, checks every delivered byte, and reports the figures next to
//! baselines measured in the same run (a plain TCP stream, memcpy). `kvxfer-bench table`
//! is the room table microbenchmark. See docs/BENCHMARKS.md and `--help`.

mod args;
mod baseline;
mod ctl;
mod decode;
mod human;
mod params;
mod pattern;
mod pool;
mod prefill;
mod preset;
mod report;
mod results;
mod shape;
mod sweep;
mod sys;
mod table;
mod tls;

use std::process::ExitCode;

use clap::Parser;
use kvxfer::log::{Level, Logger};
use kvxfer::{Config, Engine};

use args::{Cli, Mode, Named};
use params::Params;

/// An engine configured from the benchmark's options; with `auth`, it requires the
/// run's cluster key (and with `--tls` also runs TLS and `encrypt_data`).
pub fn make_engine(p: &Params, role: &str, listen: &str, auth: bool) -> Result<Engine, String> {
    let mut c = Config::default();
    let mut set = |k: &str, v: &str| c.set(k, v).map_err(|e| e.to_string());
    set("role", role)?;
    // The certificate files live until the engine has read them.
    let mut _files = None;
    if auth {
        let key = p.auth_key.as_deref().ok_or("--auth needs the run's key")?;
        set("auth_key", key)?;
        set("auth", "required")?;
        if p.tls {
            let pem = p
                .tls_pem
                .as_ref()
                .ok_or("--tls needs the run's certificates")?;
            _files = Some(pem.configure(role, &mut set)?);
            set("encrypt_data", "true")?;
        }
    } else {
        set("auth", "off")?;
    }
    set("listen", listen)?;
    set("transport", &p.transport.name())?;
    set("same_host", &p.same_host.name())?;
    set("integrity", &p.integrity.name())?;
    if let Some(w) = p.workers {
        set("workers", &w.to_string())?;
    }
    set("connections_per_peer", &p.conns.to_string())?;
    set("log_level", &p.log_level.name())?;
    let level = Level::parse(&p.log_level.name()).unwrap_or(Level::Error);
    Engine::new(c, Logger::new(level, None))
        .map_err(|e| format!("cannot start the {role} engine: {e}"))
}

/// The JSON line of a run that could not be made.
#[derive(serde::Serialize)]
struct RunError<'a> {
    preset: String,
    transport: String,
    error: &'a str,
}

fn main() -> ExitCode {
    let (mode, p) = match Cli::parse().resolve() {
        Ok(x) => x,
        Err(e) => {
            eprintln!("kvxfer-bench: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match &mode {
        Mode::Prefill(listen) => prefill::serve(listen.as_deref()).map(|()| None),
        Mode::Table => table::run(&p).map(Some),
        Mode::Local | Mode::Decode(_) => {
            let prefill_addr = match &mode {
                Mode::Decode(a) => Some(a.as_str()),
                _ => None,
            };
            decode::run(&p, prefill_addr).map(|r| {
                let ok = r.kv.unexpected == 0 && r.kv.prefill_unexpected == 0;
                let model = report::Model::of(&p, &r);
                let mut out = human::write(&p, &model);
                if p.json {
                    out.push_str(&model.json());
                    out.push('\n');
                }
                Some((out, ok))
            })
        }
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
            if p.json && !matches!(mode, Mode::Prefill(_)) {
                let line = RunError {
                    preset: p.preset.name(),
                    transport: p.transport.name(),
                    error: &e,
                };
                println!("{}", serde_json::to_string(&line).expect("plain strings"));
            }
            ExitCode::from(2)
        }
    }
}
