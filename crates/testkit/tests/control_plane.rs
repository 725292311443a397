//! The coordinator's control plane under a thousand seeded fault schedules: raft replicas (the
//! production code, logs on disk) are killed and restarted, paused, partitioned and flooded with
//! loss, duplication and delay while clients write and read, and worker nodes die, come back and
//! are cut off while the leader's recovery loop (the production reconciler) re-places the
//! deployment they serve. The history clients saw must be linearizable, every acknowledged write
//! must survive, no replica may see the deployment's generation go back, and once the faults
//! heal the group must elect a leader, take a write at every replica, converge on one state,
//! know which workers are up and serve the deployment from them (or say why it cannot).
//!
//! `BRIGADE_SEED=N` runs one seed (a failure prints its seed); `BRIGADE_SEEDS=N` sets how many.
#![allow(clippy::unwrap_used)]

use brigade_testkit::control::{run, Config, Report};

fn seeds() -> Vec<u64> {
    if let Some(s) = std::env::var("BRIGADE_SEED").ok().and_then(|s| s.parse().ok()) {
        return vec![s];
    }
    let n = std::env::var("BRIGADE_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(1000u64);
    (0..n).collect()
}

/// Runs the seeds on every core; the reports, or every failing seed's violation.
fn run_all(cfg_of: impl Fn(u64) -> Config + Sync) -> Vec<Report> {
    let seeds = seeds();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1).min(8);
    let results: Vec<Result<Report, String>> = std::thread::scope(|s| {
        let chunks: Vec<Vec<u64>> =
            (0..threads).map(|t| seeds.iter().copied().skip(t).step_by(threads).collect()).collect();
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|chunk| {
                let cfg_of = &cfg_of;
                s.spawn(move || chunk.into_iter().map(|seed| run(seed, &cfg_of(seed))).collect::<Vec<_>>())
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} schedules failed (rerun one with BRIGADE_SEED=N):\n{}",
        failures.len(),
        results.len(),
        failures.iter().map(|f| f.as_str()).collect::<Vec<_>>().join("\n")
    );
    results.into_iter().map(Result::unwrap).collect()
}

#[test]
fn a_thousand_fault_schedules_keep_the_control_plane_linearizable_and_live() {
    // three replicas mostly, five in every fourth schedule
    let reports = run_all(|seed| Config { replicas: if seed % 4 == 3 { 5 } else { 3 }, ..Config::default() });
    let sum = |f: fn(&Report) -> u64| reports.iter().map(f).sum::<u64>();
    eprintln!(
        "{} schedules: {} writes acknowledged, {} reads answered, {} refused, {} unanswered; {} kills, {} pauses, {} partitions, {} messages lost; terms up to {}; {} worker kills; at the end {} workers down, {} deployments re-placed, {} degraded",
        reports.len(),
        sum(|r| r.writes_acked),
        sum(|r| r.reads_answered),
        sum(|r| r.refused),
        sum(|r| r.unanswered),
        sum(|r| r.kills),
        sum(|r| r.pauses),
        sum(|r| r.partitions),
        sum(|r| r.messages_lost),
        reports.iter().map(|r| r.max_term).max().unwrap_or(0),
        sum(|r| r.worker_kills),
        sum(|r| r.workers_down),
        reports.iter().filter(|r| r.generation > 1).count(),
        reports.iter().filter(|r| r.degraded).count(),
    );
    // the schedules did what they are for: faults happened, and clients got answers through them
    let n = reports.len() as u64;
    assert!(sum(|r| r.writes_acked) >= 10 * n, "too few writes acknowledged: {reports:?}");
    assert!(sum(|r| r.reads_answered) >= 5 * n, "too few reads answered");
    if n >= 100 {
        assert!(sum(|r| r.kills) >= n, "too few kills");
        assert!(sum(|r| r.partitions) >= n, "too few partitions");
        assert!(reports.iter().filter(|r| r.max_term >= 4).count() as u64 >= n / 4, "too few elections");
        assert!(sum(|r| r.worker_kills) >= n / 2, "too few workers killed");
        assert!(reports.iter().filter(|r| r.generation > 1).count() as u64 >= n / 4, "too few re-placements");
        assert!(reports.iter().any(|r| r.degraded), "no deployment was ever left without the workers to hold it");
    }
}

#[test]
fn a_run_is_a_function_of_its_seed() {
    let cfg = Config::default();
    let a = run(42, &cfg).unwrap();
    assert_eq!(run(42, &cfg).unwrap(), a);
    assert_ne!(run(43, &cfg).unwrap(), a, "two seeds, one schedule");
}
