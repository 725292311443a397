//! A coordinator replica cut off from the others (network namespaces; the links between it and
//! the other replicas taken down) cannot commit and answers no read that promises the current
//! state; the majority goes on; when the links come back the cut-off replica follows the
//! majority's log. The cut-off replica is the leader at the time of the cut: the hardest case
//! (it believes it leads until it misses a quorum).
//!
//! Needs root (network namespaces); CI runs as root.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};
use support::netns::Net;
use support::*;

fn status_via(c: &Cluster, net: &Net, addr: &str, timeout: u64) -> Result<serde_json::Value, String> {
    let ca = c.ca();
    let mut cmd = std::process::Command::new("timeout");
    cmd.arg(timeout.to_string()).args(net.exec("c")).arg(BIN);
    cmd.args(["status", "--json", "--coordinator", addr, "--ca", ca.to_str().unwrap()]);
    let out = cmd.output().unwrap();
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn names(v: &serde_json::Value) -> Vec<String> {
    v["deployments"]
        .as_array()
        .map(|a| a.iter().map(|d| d["name"].as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// Three replicas r1 r2 r3 and a node c (the clients and worker w1, up) in network namespaces,
/// every pair linked; the cluster's processes run in their namespaces.
fn group_in_namespaces() -> (Net, Cluster) {
    assert!(unsafe { libc::geteuid() } == 0, "this test builds network namespaces and needs root (CI runs as root)");
    let net = Net::new(&["r1", "r2", "r3", "c"]);
    for a in 0..4 {
        for b in a + 1..4 {
            net.link(a, b, None);
        }
    }
    let mut c = Cluster::new();
    let prefix = net.prefix.clone();
    c.wrap = Box::new(move |name| {
        let node = match name.strip_prefix("coordinator-") {
            Some(id) => format!("r{id}"),
            None => "c".to_string(),
        };
        vec!["ip".into(), "netns".into(), "exec".into(), format!("{prefix}{node}")]
    });
    let hosts: Vec<String> = (0..3).map(|i| net.ip(i)).collect();
    c.start_group_at(&hosts);
    c.wait_leader(Duration::from_secs(30));
    let mut args = c.worker_args("w1");
    let i = args.iter().position(|a| a == "--listen").unwrap();
    args[i + 1] = format!("{}:7071", net.ip(3));
    c.start_worker_with("w1", args);
    c.wait_up(1);
    (net, c)
}

#[test]
fn a_cut_off_replica_cannot_commit_and_follows_the_majority_when_it_returns() {
    let (net, c) = group_in_namespaces();
    let leader = c.wait_leader(Duration::from_secs(30));
    c.deploy(&["--name", "before", "--device-map", "w1:cpu:5", "--ctx", "64", "--sessions", "1"]);
    let addr = |id: u64| {
        let r = c.replicas.iter().find(|r| r.id == id).unwrap();
        format!("{}:{}", r.host, r.port)
    };
    let cut = leader;
    let others: Vec<u64> = (1..=3).filter(|i| *i != cut).collect();
    let majority = format!("{},{}", addr(others[0]), addr(others[1]));

    // the cut: the leader loses both links to the other replicas (the client still reaches it)
    let t_cut = Instant::now();
    for o in &others {
        net.set_link((cut - 1) as usize, (*o - 1) as usize, false);
    }
    // a write through the cut-off replica does not commit
    let ca = c.ca();
    let mut deploy = std::process::Command::new("timeout");
    deploy.arg("8").args(net.exec("c")).arg(BIN);
    deploy.args([
        "deploy",
        "--name",
        "minority",
        "--device-map",
        "w1:cpu:5",
        "--wait",
        "0",
        "--coordinator",
        &addr(cut),
        "--ca",
        ca.to_str().unwrap(),
    ]);
    let out = deploy.output().unwrap();
    assert!(
        !out.status.success(),
        "a write through the cut-off replica succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    // nor does it answer a read that promises the current state
    if let Ok(v) = status_via(&c, &net, &addr(cut), 8) {
        panic!("the cut-off replica answered a current read: {:?} raft {}\n{}", names(&v), v["raft"], c.logs());
    }
    // the majority elects a leader among itself and commits
    let mut new_leader = 0;
    wait_until("the majority to elect a leader", Duration::from_secs(30), || {
        new_leader = status_via(&c, &net, &majority, 5).ok().and_then(|v| v["raft"]["leader"].as_u64()).unwrap_or(0);
        new_leader != 0 && new_leader != cut
    });
    eprintln!(
        "leader {cut} cut off; replica {new_leader} leads the majority {:.1} s after the cut",
        t_cut.elapsed().as_secs_f64()
    );
    let cmd = |args: &[&str]| {
        let mut k = std::process::Command::new("timeout");
        k.arg("30").args(net.exec("c")).arg(BIN).args(args).args([
            "--coordinator",
            &majority,
            "--ca",
            ca.to_str().unwrap(),
        ]);
        let out = k.output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    cmd(&["deploy", "--name", "after", "--device-map", "w1:cpu:5", "--ctx", "64", "--sessions", "1"]);
    cmd(&["undeploy", "before"]);
    // and still no current read through the cut-off replica shows the old state
    if let Ok(v) = status_via(&c, &net, &addr(cut), 6) {
        panic!("the cut-off replica answered a current read with {:?}", names(&v));
    }

    // the links return: the cut-off replica follows the majority's log (its uncommitted write is gone)
    for o in &others {
        net.set_link((cut - 1) as usize, (*o - 1) as usize, true);
    }
    wait_until("the returning replica to follow the majority", Duration::from_secs(60), || {
        status_via(&c, &net, &addr(cut), 10).is_ok_and(|v| names(&v) == ["after"] && v["raft"]["role"] == "follower")
    });
    for id in 1..=3 {
        let v = status_via(&c, &net, &addr(id), 10).unwrap();
        assert_eq!(names(&v), ["after"], "replica {id}");
    }
}

/// As etcd and TiKV are tested: clients deploy, undeploy and read the cluster state through
/// every replica (the CLI in the clients' namespace) while replicas are cut off from the others
/// at uneven intervals — the leader most often — and the recorded history is checked for
/// linearizability (no acknowledged change lost, no stale current read).
#[test]
fn concurrent_changes_and_reads_under_partitions_are_linearizable() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use support::linearizable::{assert_linearizable, Event, Op, Outcome};
    let (net, c) = group_in_namespaces();
    let net = Arc::new(net);
    let addrs: Vec<String> = c.replicas.iter().map(|r| format!("{}:{}", r.host, r.port)).collect();
    let ca = c.ca().display().to_string();
    let history: Arc<Mutex<Vec<Event>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let secs = std::env::var("BRIGADE_LIN_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(12u64);
    let clients: Vec<_> =
        (0..3)
            .map(|client| {
                let (addrs, ca, history, stop, net) =
                    (addrs.clone(), ca.clone(), history.clone(), stop.clone(), net.clone());
                std::thread::spawn(move || {
                    let mut n: u64 = client as u64 * 7919 + 17;
                    let mut next = || {
                        n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (n >> 33) as usize
                    };
                    while !stop.load(Ordering::Relaxed) {
                        let addr = addrs[next() % addrs.len()].clone();
                        let key = format!("k{}", next() % 3);
                        let kind = next() % 3;
                        let mut cmd = std::process::Command::new("timeout");
                        cmd.arg("4").args(net.exec("c")).arg(BIN);
                        match kind {
                            0 => cmd
                                .args(["deploy", "--name", &key, "--device-map", "w1:cpu:5", "--ctx", "64"])
                                .args(["--sessions", "1", "--wait", "0"]),
                            1 => cmd.args(["undeploy", &key]),
                            _ => cmd.args(["status", "--json"]),
                        };
                        cmd.args(["--coordinator", &addr, "--ca", &ca]).env_remove("BRIGADE_CONFIG");
                        let call = Instant::now();
                        let out = cmd.output().unwrap();
                        let ret = Instant::now();
                        let err = String::from_utf8_lossy(&out.stderr);
                        let known = |refused: &str, o: Outcome| {
                            if out.status.success() {
                                (Outcome::Ok, Some(ret))
                            } else if err.contains(refused) {
                                (o, Some(ret))
                            } else {
                                (Outcome::Unknown, None)
                            }
                        };
                        let ev = match kind {
                            0 => {
                                let (o, r) = known("error: already exists", Outcome::Exists);
                                Some(Event { op: Op::Deploy(key, o), call, ret: r, client })
                            }
                            1 => {
                                let (o, r) = known("error: not found: no deployment", Outcome::Missing);
                                Some(Event { op: Op::Undeploy(key, o), call, ret: r, client })
                            }
                            // a read that failed says nothing
                            _ => out.status.success().then(|| {
                                let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                                Event { op: Op::Read(names(&v)), call, ret: Some(ret), client }
                            }),
                        };
                        if let Some(e) = ev {
                            history.lock().unwrap().push(e);
                        }
                    }
                })
            })
            .collect();
    // chaos: a replica cut off from the other two (the client still reaches it), then healed;
    // the leader two times in three
    let t0 = Instant::now();
    let mut k = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        std::thread::sleep(Duration::from_millis(500 + (k * 313) % 900));
        let leader = c.raft().and_then(|r| r["leader"].as_u64()).filter(|l| (1..=3).contains(l));
        let victim = match leader {
            Some(l) if k % 3 != 2 => l,
            _ => 1 + k % 3,
        };
        let others: Vec<u64> = (1..=3).filter(|i| *i != victim).collect();
        for o in &others {
            net.set_link((victim - 1) as usize, (*o - 1) as usize, false);
        }
        std::thread::sleep(Duration::from_millis(900 + (k * 197) % 1200));
        for o in &others {
            net.set_link((victim - 1) as usize, (*o - 1) as usize, true);
        }
        k += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for h in clients {
        h.join().unwrap();
    }
    let h = history.lock().unwrap();
    assert_linearizable(&h, &format!("{k} partitions"), 5, || c.logs());
}
