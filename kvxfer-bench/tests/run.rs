//! The benchmark end to end, small: two processes over loopback (and the two-host mode on
//! one host), checked for what each run must report, not for how fast it was.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use serde_json::Value;

const BENCH: &str = env!("CARGO_BIN_EXE_kvxfer-bench");

/// Small enough for a debug build on a loaded host.
const SMALL: &[&str] = &[
    "--preset",
    "single-page",
    "--rooms",
    "200",
    "--concurrency",
    "8",
    "--baseline-buf-mib",
    "4",
    "--baseline-write-kib",
    "1024",
    "--baseline-read-kib",
    "1024",
    "--json",
];

/// Runs the decode side with `args`: the table it printed, and its last line parsed.
fn run(args: &[&str]) -> (String, Value) {
    let out = Command::new(BENCH)
        .args(SMALL)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .expect("kvxfer-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{:?}\n{stdout}", out.status);
    let last = stdout.lines().last().expect("output");
    let j = serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {last}"));
    (stdout.to_string(), j)
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[test]
fn a_local_run_reports_each_phases_first_byte_cpu_and_switches_for_both_processes() {
    let (table, j) = run(&["--repeat", "2"]);
    assert!(table.contains("kvxfer, phase 2 "), "{table}");
    assert!(
        table.contains("latency first enqueue -> decode TRANSFERRING"),
        "{table}"
    );
    assert_eq!(j["rooms_ok"], 400, "{j}");
    assert_eq!(j["unexpected_failures"], 0);
    let phases = j["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    // Every delivered room has a first byte, which comes before its SUCCESS.
    let firsts: u64 = phases
        .iter()
        .map(|p| p["first_byte_ms"]["n"].as_u64().unwrap())
        .sum();
    assert_eq!(firsts, 400);
    assert_eq!(j["first_byte_ms"]["n"], 400);
    assert!(f(&j["first_byte_ms"]["p50"]) > 0.0);
    for q in ["p50", "p99", "max"] {
        assert!(
            f(&j["first_byte_ms"][q]) <= f(&j["latency_ms"][q]),
            "{q}: {j}"
        );
    }
    assert!(j["first_byte_seen_at_success"].as_u64().unwrap() <= 400);
    for p in phases {
        assert!(f(&p["first_byte_ms"]["p50"]) <= f(&p["first_byte_ms"]["p99"]));
        for side in ["decode", "prefill"] {
            let s = &p[side];
            // Both processes worked and slept (the scheduler loops sleep when idle).
            assert!(f(&s["cpu_s_per_gb"]) > 0.0, "{side}: {p}");
            assert!(f(&s["voluntary_switches_per_gb"]) > 0.0, "{side}: {p}");
            assert!(f(&s["involuntary_switches_per_gb"]) >= 0.0, "{side}: {p}");
            assert!(f(&s["bench_threads"]["voluntary_switches_per_gb"]) > 0.0);
        }
        // The prefill scheduler loop is measured inside its process's window.
        let pre = &p["prefill"];
        assert!(
            f(&pre["bench_threads"]["voluntary_switches_per_gb"])
                <= f(&pre["voluntary_switches_per_gb"])
        );
        assert!(f(&pre["bench_threads"]["cpu_s_per_gb"]) <= f(&pre["cpu_s_per_gb"]) + 1e-9);
    }
    // A stream before, between and after the phases, each with both sides' figures.
    let tcp = j["baseline_tcp_runs"].as_array().unwrap();
    assert_eq!(tcp.len(), 3);
    for t in tcp {
        assert!(f(&t["gb"]) > 0.0);
        for side in ["decode", "prefill"] {
            assert!(f(&t[side]["cpu_s_per_gb"]) > 0.0, "{side}: {t}");
            assert!(
                f(&t[side]["voluntary_switches_per_gb"]) >= 0.0,
                "{side}: {t}"
            );
        }
    }
    assert!(f(&j["switches_per_gb"]["decode_voluntary"]) > 0.0);
    assert!(f(&j["switches_per_gb"]["prefill_voluntary"]) > 0.0);
}

#[test]
fn across_hosts_no_cross_process_latency_is_computed() {
    let mut prefill = Command::new(BENCH)
        .args(["--role", "prefill", "--listen", "127.0.0.1:0"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvxfer-bench runs");
    let mut err = BufReader::new(prefill.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .rsplit(' ')
        .next()
        .expect("the prefill side says where it waits")
        .to_string();
    let (table, j) = run(&[
        "--role",
        "decode",
        "--prefill-addr",
        &addr,
        "--repeat",
        "1",
        "--no-baselines",
    ]);
    assert!(prefill.wait().unwrap().success());
    assert_eq!(j["rooms_ok"], 200, "{j}");
    assert_eq!(
        j["latency_basis"],
        "decode set_destination to decode SUCCESS"
    );
    assert_eq!(j["first_byte_ms"]["n"], 0);
    assert!(j["first_byte_ms"]["p50"].is_null());
    assert!(
        !table.contains("first byte") && !table.contains("NaN"),
        "{table}"
    );
    assert!(f(&j["phases"][0]["prefill"]["cpu_s_per_gb"]) > 0.0);
}

#[test]
fn a_tp_run_alternates_with_equal_tp_and_counts_the_runs_it_needed() {
    // 2 KV heads of 64 values: each of the 2 prefill ranks holds one, the decode rank
    // both; a planned abort now and then fails a room on every rank.
    let (table, j) = run(&[
        "--prefill-tp",
        "2",
        "--decode-tp",
        "1",
        "--repeat",
        "1",
        "--no-baselines",
        "--abort-rate",
        "0.1",
    ]);
    assert_eq!(j["unexpected_failures"], 0, "{j}");
    assert_eq!(j["prefill_unexpected_failures"], 0, "{j}");
    assert!(j["rooms_ok"].as_u64().unwrap() > 300, "{j}");
    assert_eq!(
        (j["prefill_tp"].clone(), j["decode_tp"].clone()),
        (2.into(), 1.into())
    );
    let phases = j["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 2);
    assert_eq!(
        (phases[0]["tp"].clone(), phases[1]["tp"].clone()),
        (true.into(), false.into())
    );
    let t = &j["tp_vs_equal"];
    // A single-page room: one page in each of 4 buffers and an aux row, 5 runs (1.25
    // per page) at 1 -> 1; TP 2 -> 1 in HND order: as many from each rank (the runs of
    // aborted rooms count too, their pages do not).
    let (tp, eq) = (f(&t["tp_runs_per_page"]), f(&t["equal_runs_per_page"]));
    assert!((1.25..1.6).contains(&eq), "{t}");
    assert!((1.8..2.3).contains(&(tp / eq)), "{t}");
    assert_eq!(t["tp_bytes_per_room"], t["equal_bytes_per_room"]);
    assert!(f(&t["gbps_ratio"]) > 0.0);
    assert!(table.contains("kvxfer, TP 2->1 / 1->1"), "{table}");
}

/// Each phase says how much other work the host had, each pair both of its phases', and
/// --room-log has every room's times.
#[test]
fn a_layerwise_runs_phases_show_the_hosts_other_work_and_the_room_log_every_room() {
    let log = std::env::temp_dir().join(format!("kvxfer-bench-rooms-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&log);
    let (table, j) = run(&[
        "--layerwise",
        "--compute-us-per-layer",
        "100",
        "--repeat",
        "1",
        "--room-log",
        log.to_str().unwrap(),
    ]);
    assert_eq!(j["unexpected_failures"], 0, "{j}");
    // --room-log: every room of every phase, in order, its compute inside its TTFT.
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    let rooms: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rooms.len(), 4 * 200);
    for (i, r) in rooms.iter().enumerate() {
        assert_eq!(r["room"], i as u64, "{r}");
        let ns = |k: &str| r[k].as_u64().unwrap();
        if r["compute_us_per_layer"] == 100 && ns("decode_success_ns") > 0 {
            assert!(ns("compute_start_ns") <= ns("compute_end_ns"), "{r}");
            assert!(ns("compute_start_ns") < ns("decode_success_ns"), "{r}");
        }
    }
    let phases = j["phases"].as_array().unwrap();
    assert_eq!(phases.len(), 4);
    // tcp | LW | tcp | WC | tcp | LW | tcp | WC | tcp
    assert_eq!(j["baseline_tcp_runs"].as_array().unwrap().len(), 5, "{j}");
    assert_eq!(j["ratio_vs_tcp_per_phase"].as_array().unwrap().len(), 4);
    for p in phases {
        assert!(f(&p["others_cores"]) >= 0.0, "{p}");
    }
    for s in j["layerwise"]["sweep"].as_array().unwrap() {
        let pairs = s["others_cores_per_pair"].as_array().unwrap();
        assert_eq!(pairs.len(), 1, "{s}");
        assert!(pairs[0].as_array().unwrap().iter().all(|c| f(c) >= 0.0));
        assert!(f(&s["room_link_ratio_median"]) > 0.0, "{s}");
        assert!(f(&s["layerwise_room_link_ms"]) > 0.0, "{s}");
    }
    assert!(
        table.contains("other work on this host, cores during LW / WC"),
        "{table}"
    );
}

#[test]
fn a_layerwise_run_alternates_both_ways_of_sending_with_and_without_compute() {
    // single-page: 2 layers, K and V, one page a room; 100 us of compute per layer.
    let (table, j) = run(&[
        "--layerwise",
        "--compute-us-per-layer",
        "100",
        "--repeat",
        "1",
        "--no-baselines",
        "--abort-rate",
        "0.05",
    ]);
    assert_eq!(j["unexpected_failures"], 0, "{j}");
    assert_eq!(j["prefill_unexpected_failures"], 0, "{j}");
    let phases = j["phases"].as_array().unwrap();
    let kinds: Vec<(bool, u64)> = phases
        .iter()
        .map(|p| {
            (
                p["layerwise"].as_bool().unwrap(),
                p["compute_us_per_layer"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(kinds, [(true, 100), (false, 100), (true, 0), (false, 0)]);
    let l = &j["layerwise"];
    let (lw, bulk) = (&l["sweep"][0], &l["sweep"][1]);
    assert_eq!(lw["compute_us_per_layer"], 100);
    assert_eq!(lw["compute_ms"], 0.2);
    // Every room delivered whole in a phase with compute has a TTFT, and none comes
    // before its compute ended.
    let ok = |i: usize| {
        let rooms_per_sec = f(&phases[i]["rooms_per_sec"]);
        assert!(rooms_per_sec > 0.0);
        phases[i]["ttft_ms"]["n"].as_u64().unwrap()
    };
    assert!(ok(0) > 150 && ok(1) > 150, "{j}");
    assert_eq!(lw["layerwise_ttft_ms"]["n"].as_u64(), Some(ok(0)));
    assert!(f(&lw["layerwise_over_compute_p50"]) >= 1.0, "{l}");
    assert!(f(&lw["whole_chunk_over_compute_p50"]) >= 1.0, "{l}");
    assert_eq!(lw["ttft_ratio_p50_per_pair"].as_array().unwrap().len(), 1);
    assert!(f(&lw["ttft_ratio_p50_median"]) > 0.0, "{l}");
    assert_eq!(bulk["compute_us_per_layer"], 0);
    assert!(f(&bulk["gbps_ratio"]) > 0.0, "{l}");
    // Every layer computed woke the scheduler once: 2 per room of the compute phases
    // (fewer for the rooms an abort ended early).
    let n = l["compute_late_us"]["n"].as_u64().unwrap();
    assert!(n > 2 * 300 && n <= 2 * 400, "{l}");
    assert!(table.contains("layer by layer: 2 layers"), "{table}");
    assert!(
        table.contains("kvxfer, phase 2, whole-chunk, 100 us/layer"),
        "{table}"
    );
}
