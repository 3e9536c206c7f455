//! The simulator's own tests: seeds pass, each bug put back is found, failures replay.

use super::*;

/// Runs seeds `from..to` (no bug); panics with the first failure, shrunk.
fn seeds_pass(from: u64, to: u64) {
    for seed in from..to {
        let config = Config {
            seed,
            requests: 24,
            bug: None,
            skip: 0,
        };
        let r = run(config, false);
        if r.violation.is_some() {
            let small = shrink(config).expect("it failed");
            panic!("{}", report(&small));
        }
    }
}

#[test]
fn two_thousand_seeds_keep_every_invariant() {
    seeds_pass(0, 2_000);
}

#[test]
fn a_run_is_a_function_of_its_seed() {
    let config = Config {
        seed: 7,
        requests: 24,
        bug: None,
        skip: 0,
    };
    let (a, b) = (run(config, true), run(config, true));
    assert_eq!(a.trace, b.trace);
    assert!(a.steps > 100, "a run of 24 requests took {} steps", a.steps);
}

/// The first seed below 10,000 with which `bug` breaks an invariant, and the run.
fn find(bug: Bug) -> Option<Run> {
    (0..10_000).find_map(|seed| {
        let config = Config {
            seed,
            requests: 24,
            bug: Some(bug),
            skip: 0,
        };
        let r = run(config, false);
        r.violation.is_some().then_some(r)
    })
}

#[test]
fn every_bug_put_back_is_found_within_ten_thousand_seeds() {
    use check::Invariant::*;
    let bugs = [
        (Bug::MaxRule, vec![Sticky]),
        (Bug::AckWithWritesInFlight, vec![GivenBack]),
        (Bug::AckTheOrigin, vec![OneAck]),
        (Bug::TombstoneAnyGeneration, vec![LateMessage]),
        (Bug::DestinationAfterFailure, vec![GivenBack]),
        (Bug::CountsBytes, vec![TrueSuccess]),
        (Bug::AnyPrefillAborts, vec![Stranger]),
        (Bug::HandOnPastWaiting, vec![InOrder]),
    ];
    let mut found = Vec::new();
    for (bug, expected) in bugs {
        let r = find(bug).unwrap_or_else(|| panic!("{bug:?} not found in 10,000 seeds"));
        let v = r.violation.as_ref().expect("a violation");
        eprintln!(
            "{bug:?}: seed {} broke {:?}: {}",
            r.config.seed, v.invariant, v.detail
        );
        assert!(
            expected.contains(&v.invariant),
            "{bug:?} broke {:?}, not {expected:?}:\n{}",
            v.invariant,
            report(&shrink(r.config).expect("it fails"))
        );
        found.push(bug);
    }
    assert_eq!(found.len(), 8);
}

/// `make sim-soak`: seeds from `SIM_SEED` (default: from the clock) for `SIM_SECS`
/// seconds (default 60); prints seeds per second and how often each invariant was
/// checked, and the first failure, shrunk, with its schedule.
#[test]
#[ignore = "runs for SIM_SECS; make sim-soak"]
fn soak() {
    let var = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let secs = var("SIM_SECS").unwrap_or(60);
    let first = var("SIM_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        t.map_or(0, |d| d.as_secs()) << 20
    });
    let started = std::time::Instant::now();
    let mut checked: HashMap<check::Invariant, u64> = HashMap::new();
    let (mut seeds, mut steps) = (0u64, 0u64);
    while started.elapsed().as_secs() < secs {
        let config = Config {
            seed: first + seeds,
            requests: 24,
            bug: None,
            skip: 0,
        };
        let r = run(config, false);
        seeds += 1;
        steps += r.steps;
        for (inv, n) in r.checked {
            *checked.entry(inv).or_default() += n;
        }
        if r.violation.is_some() {
            panic!("{}", report(&shrink(config).expect("it failed")));
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "sim-soak: seeds {first}..{}: {seeds} seeds ({:.0} per second, {steps} steps), no \
         invariant broken",
        first + seeds,
        seeds as f64 / secs
    );
    let mut checked: Vec<_> = checked.into_iter().collect();
    checked.sort_by_key(|(inv, _)| format!("{inv:?}"));
    for (inv, n) in checked {
        println!("  {inv:?}: checked {n} times");
    }
}

/// `SIM_REPLAY=seed[,requests[,skip]]` (skip as a failure report prints it, `0x..`):
/// prints that run's schedule (a debugging aid).
#[test]
#[ignore = "prints one run; SIM_REPLAY=seed,requests,skip"]
fn replay() {
    let spec = std::env::var("SIM_REPLAY").unwrap_or_default();
    let num = |v: &str| {
        let v = v.trim();
        match v.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap_or(0),
            None => v.parse().unwrap_or(0),
        }
    };
    let mut it = spec.split(',').map(num);
    let seed = it.next().unwrap_or(0);
    let requests = it.next().filter(|&n| n > 0).unwrap_or(24) as usize;
    let skip = it.next().unwrap_or(0);
    let r = run(
        Config {
            seed,
            requests,
            bug: None,
            skip,
        },
        true,
    );
    match r.violation {
        Some(_) => println!("{}", report(&r)),
        None => println!("seed {seed}: no invariant broken\n{}", r.trace.join("\n")),
    }
}

/// `SIM_FIND=text`: prints the first seed below 5,000 whose schedule says `text`, and
/// its schedule (a debugging aid: how does the simulator reach such a step?).
#[test]
#[ignore = "a debugging aid; SIM_FIND=text"]
fn find_text() {
    let text = std::env::var("SIM_FIND").unwrap_or_default();
    for seed in 0..5_000 {
        let r = run(
            Config {
                seed,
                requests: 24,
                bug: None,
                skip: 0,
            },
            true,
        );
        if r.trace.iter().any(|l| l.contains(&text)) {
            println!("seed {seed}");
            for l in &r.trace {
                println!("{l}");
            }
            return;
        }
    }
}

#[test]
fn a_failure_shrinks_to_a_shorter_schedule_that_replays_and_breaks_the_same_invariant() {
    for bug in [
        Bug::AckTheOrigin,
        Bug::TombstoneAnyGeneration,
        Bug::CountsBytes,
    ] {
        let full = find(bug).expect("found");
        let full = run(full.config, true);
        let small = shrink(full.config).expect("it fails");
        let (a, b) = (&full.violation, &small.violation);
        assert_eq!(
            a.as_ref().map(|v| v.invariant),
            b.as_ref().map(|v| v.invariant)
        );
        let left = small.config.requests - small.config.skip.count_ones() as usize;
        assert!(
            small.steps <= full.steps && left < full.config.requests,
            "{bug:?}: {} steps of {} requests, shrunk to {} steps of {left}",
            full.steps,
            full.config.requests,
            small.steps
        );
        eprintln!(
            "{bug:?}: {} steps ({} lines) of {} requests, shrunk to {} steps ({} lines) of {left}",
            full.steps,
            full.trace.len(),
            full.config.requests,
            small.steps,
            small.trace.len()
        );
        assert_eq!(
            run(small.config, true).trace,
            small.trace,
            "the replay differs"
        );
    }
}
