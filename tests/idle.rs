//! An engine with nothing to do sleeps: none of its threads wakes on a timer faster than
//! its watchdog's scan. Alone in its own test binary, so that the threads counted are
//! this test's engines' only.

mod common;

use std::time::Duration;

use common::engine::{quiet, start};

/// (thread id, name, voluntary + involuntary context switches) of every `kvxfer-`
/// thread of this process.
fn library_threads() -> Vec<(String, String, u64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap() {
        let dir = task.unwrap().path();
        let Ok(name) = std::fs::read_to_string(dir.join("comm")) else {
            continue; // ended meanwhile
        };
        let name = name.trim().to_string();
        if !name.starts_with("kvxfer-") {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue;
        };
        let switches = status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum();
        let tid = dir.file_name().unwrap().to_string_lossy().into_owned();
        out.push((tid, name, switches));
    }
    out
}

/// A prefill engine (listening, workers, watchdog) and a decode engine, neither with
/// anything to do, for 600 ms: their threads together wake about as often as the two
/// watchdogs' scans (every 100 ms with the default timeouts), not every few
/// milliseconds. The acceptor used to poll its listener every 5 ms (120 wakeups here).
#[test]
fn idle_engines_do_not_wake_on_a_timer() {
    let prefill = start("prefill", &[("transport", "tcp")], quiet());
    let decode = start("decode", &[("transport", "tcp")], quiet());
    // Past their start-up.
    std::thread::sleep(Duration::from_millis(200));
    let before = library_threads();
    assert!(
        before.iter().any(|(_, n, _)| n == "kvxfer-accept"),
        "the prefill engine's acceptor is running: {before:?}"
    );
    std::thread::sleep(Duration::from_millis(600));
    let after = library_threads();
    let woke: u64 = after
        .iter()
        .map(|(tid, _, s)| {
            let was = before
                .iter()
                .find(|(t, _, _)| t == tid)
                .map_or(0, |(_, _, s0)| *s0);
            s.saturating_sub(was)
        })
        .sum();
    // Two watchdogs at 100 ms: about 12 wakeups; twice that is the bound.
    assert!(
        woke <= 24,
        "idle engines' threads switched {woke} times in 600 ms: {before:?} -> {after:?}"
    );
    drop(prefill);
    drop(decode);
}
