//! Keeping serving through failures, with real processes: a raft group of three coordinator
//! replicas and three workers on loopback. Each fault test runs several times with different
//! timings (`BRIGADE_FAULT_RUNS`, default 3; the benchmark sets 20) and reports how many passed
//! and the time from the fault to the next streamed token.
#![allow(clippy::unwrap_used)]

mod support;

use brigade_sdk::{Client, ClientConfig, Event, GenerateParams};
use std::time::{Duration, Instant};
use support::*;

const TOKENS: usize = 120;

fn runs() -> usize {
    std::env::var("BRIGADE_FAULT_RUNS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

/// A model slow enough on one thread (about 10 ms a token) that a fault lands mid-stream.
fn slow_model(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("slow.gguf");
    synth_shape(&p, [6, 512, 1536, 8, 8, 512], "f32");
    p
}

/// Greedy ids of `brigade run` for the prompt, end-of-text ignored (a fixed length).
fn reference(model: &std::path::Path) -> Vec<u32> {
    let n = TOKENS.to_string();
    let m = model.display().to_string();
    let out = std::process::Command::new(BIN)
        .args(["run", "-m", &m, "-p", "Once upon a time", "-n", &n, "--temp", "0", "--ignore-eos", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    ids(&serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()["generated_ids"])
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len().max(1) - 1) as f64 * p).round() as usize).copied().unwrap_or(0.0)
}

/// A group of three, three workers, the model placed across the workers by hand.
fn cluster(model: &std::path::Path) -> Cluster {
    cluster_with(model, "w1:cpu:2,w2:cpu:2,w3:cpu:2")
}

/// [`cluster`] with the model placed by `map`.
fn cluster_with(model: &std::path::Path, map: &str) -> Cluster {
    let mut c = Cluster::new();
    c.start_group(3);
    c.wait_leader(Duration::from_secs(30));
    for w in ["w1", "w2", "w3"] {
        c.start_worker(w, &[]);
    }
    c.wait_up(3);
    let d = c.deploy(&["--name", "m", "-m", model.to_str().unwrap(), "--device-map", map, "--ctx", "256"]);
    assert_eq!(d["state"], "ready");
    c
}

/// Streams the generation through the SDK, endpoints in the given order, with stop strings
/// `stop`; `fault(tokens so far)` runs after each token and returns true once it has struck.
/// Returns the ids, the text and the seconds from the fault to the next token.
fn stream(
    c: &Cluster,
    endpoints: Vec<String>,
    stop: &[String],
    mut fault: impl FnMut(usize) -> bool,
) -> (Vec<u32>, String, f64) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ca_pem = std::fs::read_to_string(c.ca()).unwrap();
    rt.block_on(async move {
        let mut client = Client::connect(ClientConfig { endpoints, ca_pem, api_key: None }).await.unwrap();
        let mut p = GenerateParams::greedy(TOKENS as u32).with_stop(stop.iter().cloned());
        p.ignore_eos = true;
        let mut s = client.generate("m", "Once upon a time", p).await.unwrap();
        let mut got = Vec::new();
        let mut text = String::new();
        let mut struck: Option<Instant> = None;
        let mut gap = 0.0;
        let deadline = Instant::now() + Duration::from_secs(180);
        while let Some(ev) =
            tokio::time::timeout_at(deadline.into(), s.next()).await.expect("the stream stalled past 180 s")
        {
            match ev.unwrap() {
                Event::Token { id, index, text: piece, .. } => {
                    assert_eq!(index as usize, got.len(), "a gap or a repeat in the stream");
                    got.push(id);
                    text.push_str(&piece);
                    if let Some(t) = struck.take() {
                        gap = t.elapsed().as_secs_f64();
                    }
                    if gap == 0.0 && struck.is_none() && fault(got.len()) {
                        struck = Some(Instant::now());
                    }
                }
                Event::Done(d) => {
                    let stopped = d.stop == brigade_sdk::StopReason::Stop;
                    assert_eq!(stopped, !stop.is_empty(), "{d:?}");
                    text.push_str(&d.text_tail);
                    break;
                }
                Event::Prompt(_) => {}
            }
        }
        (got, text, gap)
    })
}

/// The text each of `ids` (after the prompt) releases as a stream prints them, and the tail
/// still held at the end.
fn pieces(model: &std::path::Path, ids: &[u32]) -> (Vec<String>, String) {
    let bytes = std::fs::read(model).unwrap();
    let tk = brigade_model::Tokenizer::from_gguf(&brigade_model::gguf::Gguf::parse(&bytes).unwrap()).unwrap();
    let prompt = tk.encode("Once upon a time", true).unwrap();
    let mut s = tk.stream(prompt.last().copied());
    let out = ids.iter().map(|&id| s.push(id)).collect();
    (out, s.finish())
}

fn kill_pid(pid: u32) {
    unsafe {
        libc::kill(pid as i32, libc::SIGKILL);
    }
}

#[test]
fn the_leader_dies_during_a_stream_and_the_stream_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let want = reference(&model);
    let mut gaps = Vec::new();
    let mut elections = Vec::new();
    let n = runs();
    for run in 0..n {
        let mut c = cluster(&model);
        let leader = c.wait_leader(Duration::from_secs(10));
        let r = c.replicas.iter().find(|r| r.id == leader).unwrap();
        let leader_addr = format!("127.0.0.1:{}", r.port);
        let pid = r.proc.as_ref().unwrap().child.id();
        // the client talks to the leader first: its stream is the one that breaks
        let mut endpoints = vec![leader_addr.clone()];
        endpoints.extend(c.addr().split(',').filter(|a| *a != leader_addr).map(str::to_string));
        let kill_at = [3, 25, 60, 10, 45][run % 5];
        let mut killed_at = None;
        let (got, _, gap) = stream(&c, endpoints, &[], |k| {
            if k == kill_at {
                kill_pid(pid);
                killed_at = Some(Instant::now());
                return true;
            }
            false
        });
        assert_eq!(got, want, "run {run}: the ids differ from an undisturbed run\n{}", c.logs());
        let new = c.wait_leader(Duration::from_secs(20));
        assert_ne!(new, leader, "run {run}");
        if let Some(t) = killed_at {
            elections.push(t.elapsed().as_secs_f64());
        }
        gaps.push(gap);
        // nothing was lost: the deployment is there and serves
        let st = c.status();
        assert_eq!(st["deployments"][0]["name"], "m");
        c.kill_replica(leader);
        eprintln!(
            "run {run}: leader {leader} killed after {kill_at} tokens; next token {gap:.3} s later; new leader {new}"
        );
    }
    eprintln!(
        "leader killed mid-stream: {n}/{n} streams complete and identical; fault → next token p50 {:.3} s, p95 {:.3} s",
        pct(&mut gaps.clone(), 0.5),
        pct(&mut gaps, 0.95)
    );
}

#[test]
fn a_worker_dies_mid_generation_and_its_layers_move() {
    let dir = tempfile::tempdir().unwrap();
    let model = slow_model(dir.path());
    let want = reference(&model);
    let mut gaps = Vec::new();
    let n = runs();
    for run in 0..n {
        let mut c = cluster(&model);
        // the driver (w1) or a middle stage (w2)
        let victim = if run % 2 == 0 { "w2" } else { "w1" };
        let pid = c.worker(victim).child.id();
        let mut kill_at = [8, 30, 50][run % 3];
        // the second run also gives a stop string that begins in the text sent before the kill
        // and ends after it: the resumed driver must still find it, from the replayed ids
        let (texts, tail) = pieces(&model, &want);
        let whole = texts.concat();
        // five tokens from `i` as a stop string, if its text is found first where it starts
        let window = |i: usize| {
            let stop = texts[i..i + 5].concat();
            let before = texts[..i].concat();
            (!texts[i].is_empty() && whole.find(&stop) == Some(before.len())).then_some((stop, before))
        };
        let (stop, want_ids, want_text) = if run == 1 {
            // a random model repeats itself: the first window from token 20 on that is new
            let i =
                (20..TOKENS - 10).find(|&i| window(i).is_some()).expect("no stop string found first where it starts");
            let (stop, before) = window(i).unwrap();
            // killed once the stop's first token was sent: the driver dies before its end
            kill_at = i + 1;
            // the answer's last id is the one that released the stop's last byte
            let last = (i..i + 5).rev().find(|&j| !texts[j].is_empty()).unwrap();
            (vec![stop], want[..=last].to_vec(), before)
        } else {
            (vec![], want.clone(), whole.clone() + &tail)
        };
        let (got, text, gap) = stream(&c, c.addr().split(',').map(str::to_string).collect(), &stop, |k| {
            if k == kill_at {
                kill_pid(pid);
                return true;
            }
            false
        });
        assert_eq!(got, want_ids, "run {run}: killing {victim} changed the ids\n{}", c.logs());
        assert_eq!(text, want_text, "run {run}: killing {victim} changed the text (stop {stop:?})");
        gaps.push(gap);
        let st = c.status();
        let d = &st["deployments"][0];
        let nodes: Vec<&str> = d["stages"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()).collect();
        assert!(!nodes.contains(&victim), "run {run}: {victim}'s layers are still placed on it: {nodes:?}");
        assert_eq!(d["state"], "ready", "{d}");
        assert!(d["generation"].as_u64().unwrap() > 1, "re-placed: a new generation");
        eprintln!("run {run}: {victim} killed after {kill_at} tokens; next token {gap:.3} s later; now on {nodes:?}");
    }
    eprintln!(
        "worker killed mid-generation: {n}/{n} generations complete and identical; fault → next token p50 {:.3} s, p95 {:.3} s",
        pct(&mut gaps.clone(), 0.5),
        pct(&mut gaps, 0.95)
    );
}

#[test]
fn replicas_catch_up_survive_another_loss_and_a_full_restart() {
    let mut c = Cluster::new();
    c.start_group(3);
    let leader = c.wait_leader(Duration::from_secs(30));
    c.start_worker("w1", &[]);
    c.wait_up(1);
    // a follower goes away; the group goes on without it
    let follower = [1, 2, 3].into_iter().find(|i| *i != leader).unwrap();
    c.kill_replica(follower);
    for i in 0..12 {
        c.deploy(&["--name", &format!("d{i}"), "--device-map", "w1:cpu:5", "--wait", "0"]);
        if i % 3 == 0 {
            let out = c.brigade(&["undeploy", &format!("d{i}")]);
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        }
    }
    let want = c.status()["deployments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_string())
        .collect::<Vec<_>>();
    assert_eq!(want.len(), 8);
    // it comes back and catches up from the others' log
    c.start_replica(follower);
    let port = c.replicas.iter().find(|r| r.id == follower).unwrap().port;
    let only = |c: &Cluster, port: u16| {
        let ca = c.ca();
        let out = std::process::Command::new(BIN)
            .args(["status", "--json", "--coordinator", &format!("127.0.0.1:{port}"), "--ca", ca.to_str().unwrap()])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()
    };
    wait_until("the restarted replica to catch up", Duration::from_secs(30), || {
        let st = only(&c, port);
        let names: Vec<String> = st["deployments"]
            .as_array()
            .map(|a| a.iter().map(|d| d["name"].as_str().unwrap_or("").to_string()).collect())
            .unwrap_or_default();
        names == want && st["raft"]["role"] == "follower"
    });
    // then another one dies: two of three still commit and serve
    let other = [1, 2, 3].into_iter().find(|i| *i != follower && *i != c.wait_leader(Duration::from_secs(10))).unwrap();
    c.kill_replica(other);
    c.deploy(&["--name", "after", "--device-map", "w1:cpu:5"]);
    let (_, ids_want) = run_ids(None, "Once upon a time", 16);
    assert_eq!(ids(&c.generate("after", "Once upon a time", 16)["generated_ids"]), ids_want);
    // every replica killed at once, then restarted: nothing acknowledged is lost
    let token = std::fs::read(c.path("coordinator-1/token")).unwrap();
    for id in 1..=3 {
        c.kill_replica(id);
    }
    for id in 1..=3 {
        c.start_replica(id);
    }
    c.wait_leader(Duration::from_secs(30));
    c.wait_up(1);
    wait_until("the deployments to serve again", Duration::from_secs(30), || {
        let st = c.status();
        st["deployments"].as_array().is_some_and(|a| a.len() == 9 && a.iter().all(|d| d["state"] == "ready"))
    });
    let st = c.status();
    assert_eq!(st["nodes"].as_array().unwrap().len(), 1);
    assert_eq!(std::fs::read(c.path("coordinator-1/token")).unwrap(), token);
    assert_eq!(ids(&c.generate("after", "Once upon a time", 16)["generated_ids"]), ids_want);
    // a new node can still join with the token
    c.start_worker("w2", &[]);
    c.wait_up(2);
}

use support::linearizable::{assert_linearizable, check, Event as HEvent, Op, Outcome};

/// The checker itself, on histories whose answer is known.
#[test]
fn the_checker_finds_what_is_and_is_not_linearizable() {
    let t = Instant::now();
    let at = |ms: u64| t + Duration::from_millis(ms);
    let ev = |op: Op, a: u64, b: Option<u64>| HEvent { op, call: at(a), ret: b.map(at), client: 0 };
    // sequential: deploy, read sees it, undeploy, read does not
    let ok = vec![
        ev(Op::Deploy("a".into(), Outcome::Ok), 0, Some(10)),
        ev(Op::Read(vec!["a".into()]), 20, Some(30)),
        ev(Op::Undeploy("a".into(), Outcome::Ok), 40, Some(50)),
        ev(Op::Read(vec![]), 60, Some(70)),
    ];
    assert!(check(&ok).is_ok());
    // a read after the deploy returned that does not see it: stale
    let stale = vec![ev(Op::Deploy("a".into(), Outcome::Ok), 0, Some(10)), ev(Op::Read(vec![]), 20, Some(30))];
    assert!(check(&stale).is_err());
    // concurrent with the deploy, either answer is fine
    let overlap = vec![ev(Op::Deploy("a".into(), Outcome::Ok), 0, Some(30)), ev(Op::Read(vec![]), 10, Some(20))];
    assert!(check(&overlap).is_ok());
    // two deploys of one name both acknowledged: impossible
    let twice = vec![
        ev(Op::Deploy("a".into(), Outcome::Ok), 0, Some(10)),
        ev(Op::Deploy("a".into(), Outcome::Ok), 20, Some(30)),
    ];
    assert!(check(&twice).is_err());
    // an unknown deploy may explain a later read, or not have happened
    let unknown =
        vec![ev(Op::Deploy("a".into(), Outcome::Unknown), 0, None), ev(Op::Read(vec!["a".into()]), 20, Some(30))];
    assert!(check(&unknown).is_ok());
    let unknown2 = vec![ev(Op::Deploy("a".into(), Outcome::Unknown), 0, None), ev(Op::Read(vec![]), 20, Some(30))];
    assert!(check(&unknown2).is_ok());
    // but a read seeing a name nobody deployed is not
    let ghost = vec![
        ev(Op::Read(vec!["a".into()]), 20, Some(30)),
        ev(Op::Undeploy("a".into(), Outcome::Missing), 40, Some(50)),
    ];
    assert!(check(&ghost).is_err());
}

#[test]
fn concurrent_deploys_undeploys_and_reads_under_replica_kills_are_linearizable() {
    use brigade_proto::v1::client_client::ClientClient;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let mut c = Cluster::new();
    c.start_group(3);
    c.wait_leader(Duration::from_secs(30));
    c.start_worker("w1", &[]);
    c.wait_up(1);
    let addrs: Vec<String> = c.addr().split(',').map(str::to_string).collect();
    let ca = std::fs::read_to_string(c.ca()).unwrap();
    let history: Arc<Mutex<Vec<HEvent>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let secs = std::env::var("BRIGADE_LIN_SECONDS").ok().and_then(|v| v.parse().ok()).unwrap_or(10u64);
    let clients: Vec<_> = (0..4)
        .map(|client| {
            let (addrs, ca, history, stop) = (addrs.clone(), ca.clone(), history.clone(), stop.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let mut n: u64 = client as u64 * 7919 + 1;
                    let mut next = || {
                        n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (n >> 33) as usize
                    };
                    while !stop.load(Ordering::Relaxed) {
                        let addr = &addrs[next() % addrs.len()];
                        let tls = tonic::transport::ClientTlsConfig::new()
                            .ca_certificate(tonic::transport::Certificate::from_pem(&ca))
                            .domain_name("coordinator.brigade");
                        let ep = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
                            .unwrap()
                            .tls_config(tls)
                            .unwrap()
                            .connect_timeout(Duration::from_millis(500));
                        let key = format!("k{}", next() % 3);
                        let kind = next() % 3;
                        let call = Instant::now();
                        let rpc = async {
                            let ch = ep.connect().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
                            let mut cl = ClientClient::with_interceptor(ch, brigade_proto::VersionInterceptor);
                            match kind {
                                0 => cl
                                    .deploy(brigade_proto::v1::DeployRequest {
                                        name: key.clone(),
                                        model: "embedded".into(),
                                        device_map: "w1:cpu:5".into(),
                                        sessions: 1,
                                        ctx: 64,
                                        ..Default::default()
                                    })
                                    .await
                                    .map(|_| vec![]),
                                1 => cl
                                    .undeploy(brigade_proto::v1::UndeployRequest { name: key.clone() })
                                    .await
                                    .map(|_| vec![]),
                                _ => cl
                                    .cluster_status(brigade_proto::v1::ClusterStatusRequest {})
                                    .await
                                    .map(|r| r.into_inner().deployments.into_iter().map(|d| d.name).collect()),
                            }
                        };
                        let r = tokio::time::timeout(Duration::from_secs(3), rpc).await;
                        let ret = Instant::now();
                        let outcome = |r: &Result<Result<Vec<String>, tonic::Status>, _>,
                                       refused: tonic::Code,
                                       o: Outcome| match r {
                            Ok(Ok(_)) => (Outcome::Ok, Some(ret)),
                            Ok(Err(s)) if s.code() == refused => (o, Some(ret)),
                            _ => (Outcome::Unknown, None),
                        };
                        let op = match kind {
                            0 => {
                                let (o, ret) = outcome(&r, tonic::Code::AlreadyExists, Outcome::Exists);
                                Some((Op::Deploy(key, o), ret))
                            }
                            1 => {
                                let (o, ret) = outcome(&r, tonic::Code::NotFound, Outcome::Missing);
                                Some((Op::Undeploy(key, o), ret))
                            }
                            _ => match r {
                                Ok(Ok(names)) => Some((Op::Read(names), Some(ret))),
                                _ => None, // a read that failed says nothing
                            },
                        };
                        if let Some((op, ret)) = op {
                            history.lock().unwrap().push(HEvent { op, call, ret, client });
                        }
                    }
                });
            })
        })
        .collect();
    // chaos: one replica at a time killed and brought back, at uneven intervals
    let t0 = Instant::now();
    let mut k = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        let victim = 1 + k % 3;
        std::thread::sleep(Duration::from_millis(700 + (k * 311) % 900));
        c.kill_replica(victim);
        std::thread::sleep(Duration::from_millis(400 + (k * 197) % 800));
        c.start_replica(victim);
        k += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for h in clients {
        h.join().unwrap();
    }
    let h = history.lock().unwrap();
    assert_linearizable(&h, &format!("{k} replica kills"), 10, || c.logs());
}

#[test]
fn a_model_that_no_longer_fits_is_degraded_with_the_shortfall_until_its_node_returns() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m.gguf");
    synth_shape(&model, [8, 512, 1024, 8, 8, 512], "q8_0");
    let size = std::fs::metadata(&model).unwrap().len();
    let mut c = Cluster::new();
    c.start_coordinator(&["--node-timeout", "2"]);
    let memory = (size * 7 / 10).to_string();
    for w in ["w1", "w2"] {
        c.start_worker(w, &["--memory", &memory]);
    }
    c.wait_up(2);
    let d = c.deploy(&["--name", "m", "-m", model.to_str().unwrap(), "--ctx", "128", "--sessions", "1"]);
    assert_eq!(d["stages"].as_array().unwrap().len(), 2, "{}", d["plan"]);
    let (_, want) = run_ids(Some(&model), "Once upon a time", 12);
    c.worker("w2").kill9();
    wait_until("the deployment to be degraded", Duration::from_secs(30), || {
        let st = c.status();
        let d = &st["deployments"][0];
        d["state"] == "degraded" && d["error"].as_str().unwrap_or("").contains("short by")
    });
    // requests get a clear error, not a hang
    let out = c.brigade(&["generate", "--model", "m", "-p", "Once upon a time", "-n", "4", "--temp", "0"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("degraded") && err.contains("short by"), "{err}");
    // the node returns: the deployment serves again
    c.start_worker("w2", &["--memory", &memory]);
    wait_until("the deployment to serve again", Duration::from_secs(60), || {
        c.status()["deployments"][0]["state"] == "ready"
    });
    assert_eq!(ids(&c.generate("m", "Once upon a time", 12)["generated_ids"]), want);
}

/// The figures a worker measured, rewritten as if its kernels were `factor` times faster (the
/// measurement cache is what a worker reports on its next start).
fn faster(figures: &std::path::Path, factor: f64) {
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(figures).unwrap()).unwrap();
    for e in v["entries"].as_array_mut().unwrap() {
        let d = &mut e["device"];
        for k in d["kernels"].as_array_mut().unwrap() {
            for f in ["decode_bytes_per_s", "prompt_flops"] {
                k[f] = serde_json::json!(k[f].as_f64().unwrap() * factor);
            }
        }
        for f in ["mem_bandwidth", "flops"] {
            d[f] = serde_json::json!(d[f].as_f64().unwrap() * factor);
        }
    }
    std::fs::write(figures, serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn a_much_faster_node_takes_a_planned_deployment_once_its_sessions_drain_and_nothing_flaps() {
    let mut c = Cluster::new();
    c.start_coordinator(&[]);
    c.start_worker("w1", &[]);
    c.wait_up(1);
    let d = c.deploy(&["--name", "s", "--ctx", "64", "--sessions", "1"]);
    assert_eq!(d["generation"], 1);
    // a node like w1 joins (the same figures: measurements of one CPU under load differ): no
    // faster placement, no move
    std::fs::create_dir_all(c.path("w2")).unwrap();
    std::fs::copy(c.path("w1/figures.json"), c.path("w2/figures.json")).unwrap();
    c.start_worker("w2", &[]);
    c.wait_up(2);
    std::thread::sleep(Duration::from_secs(7));
    assert_eq!(c.status()["deployments"][0]["generation"], 1, "re-placed for no gain");
    // a node ten times faster joins (its figures say so): the deployment moves to it
    std::fs::create_dir_all(c.path("w3")).unwrap();
    std::fs::copy(c.path("w1/figures.json"), c.path("w3/figures.json")).unwrap();
    faster(&c.path("w3/figures.json"), 10.0);
    c.start_worker("w3", &[]);
    c.wait_up(3);
    wait_until("the deployment to move to w3", Duration::from_secs(30), || {
        let st = c.status();
        let d = &st["deployments"][0];
        d["state"] == "ready" && d["stages"].as_array().unwrap().iter().all(|s| s["node"] == "w3")
    });
    let (_, want) = run_ids(None, "Once upon a time", 12);
    assert_eq!(ids(&c.generate("s", "Once upon a time", 12)["generated_ids"]), want);
}

#[test]
fn replicas_join_and_leave_at_run_time() {
    let mut c = Cluster::new();
    c.start_group(3);
    c.wait_leader(Duration::from_secs(30));
    c.start_worker("w1", &[]);
    c.wait_up(1);
    c.deploy(&["--name", "s", "--device-map", "w1:cpu:5"]);
    // the workers' join token (every worker holds it) admits no replica: the forged joiner
    // stops with the reason, receives no CA key, and the group stays as it was
    let forged = c.path("worker-token");
    std::fs::write(&forged, &c.token).unwrap();
    let fdir = c.path("coordinator-forged");
    let flisten = format!("127.0.0.1:{}", free_port());
    let fvia = format!("127.0.0.1:{}", c.replicas[0].port);
    let mut f = c.spawn(
        "coordinator-forged",
        &[
            "coordinator",
            "join",
            "--via",
            &fvia,
            "--id",
            "9",
            "--listen",
            &flisten,
            "--data-dir",
            fdir.to_str().unwrap(),
            "--replica-token-file",
            forged.to_str().unwrap(),
        ],
    );
    wait_until("the forged joiner to give up", Duration::from_secs(30), || f.exited().is_some());
    assert!(!f.exited().unwrap().success());
    let log = f.log_text();
    assert!(log.contains("replica secret"), "{log}");
    assert!(!fdir.join("ca.key").exists() && !fdir.join("token").exists());
    let st = c.raft().unwrap();
    assert_eq!(st["replicas"].as_array().unwrap().len(), 3, "{st}");
    assert_eq!(st["voters"], serde_json::json!([1, 2, 3]), "{st}");
    // a fourth replica joins through replica 1 with the replica secret
    let port = free_port();
    let d4 = c.path("coordinator-4");
    let listen = format!("127.0.0.1:{port}");
    let via = format!("127.0.0.1:{}", c.replicas[0].port);
    let secret = c.path("coordinator-1/replica-token");
    let p = c.spawn(
        "coordinator-4",
        &[
            "coordinator",
            "join",
            "--via",
            &via,
            "--id",
            "4",
            "--listen",
            &listen,
            "--data-dir",
            d4.to_str().unwrap(),
            "--replica-token-file",
            secret.to_str().unwrap(),
            "--raft-tick-ms",
            "50",
        ],
    );
    c.replicas.push(Replica { id: 4, host: "127.0.0.1".into(), port, proc: Some(p) });
    let only = |c: &Cluster, port: u16| {
        let ca = c.ca();
        let out = std::process::Command::new(BIN)
            .args(["status", "--json", "--coordinator", &format!("127.0.0.1:{port}"), "--ca", ca.to_str().unwrap()])
            .output()
            .unwrap();
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()
    };
    // it holds the group's configuration, not one it pieced together from the log's later
    // changes (a configuration of itself alone elected itself once replica 1 went away)
    let voters = |st: &serde_json::Value| -> Vec<u64> {
        st["raft"]["voters"].as_array().map(|v| v.iter().filter_map(|x| x.as_u64()).collect()).unwrap_or_default()
    };
    // it joins as a learner and votes once the leader has seen it catch up
    let t0 = Instant::now();
    loop {
        let st = only(&c, port);
        if st["deployments"][0]["name"] == "s"
            && st["raft"]["replicas"].as_array().is_some_and(|r| r.len() == 4)
            && voters(&st).len() == 4
        {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "replica 4 did not follow: {st}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(voters(&only(&c, port)), [1, 2, 3, 4], "{}", c.logs());
    // replica 1 leaves; three remain and commit
    let out = c.brigade(&["coordinator", "leave", "--id", "1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    c.kill_replica(1);
    c.deploy(&["--name", "t", "--device-map", "w1:cpu:5"]);
    // a current read through replica 4 (one may be refused while the group elects a leader
    // without replica 1)
    let t0 = Instant::now();
    let st = loop {
        let st = only(&c, port);
        if st["raft"]["replicas"].is_array() {
            break st;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "replica 4 answers no current read\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(200));
    };
    let ids_now: Vec<u64> =
        st["raft"]["replicas"].as_array().unwrap().iter().map(|r| r["id"].as_u64().unwrap()).collect();
    assert_eq!(ids_now, [2, 3, 4]);
    assert_eq!(voters(&st), [2, 3, 4], "{st}");
    assert_eq!(st["deployments"].as_array().unwrap().len(), 2, "{st}\n{}", c.logs());
}

/// A mixture whose experts live on two other workers than its layers: the worker holding half
/// the experts dies mid-generation; the deployment is placed again on the nodes left and the
/// stream goes on with the same ids.
#[test]
fn an_expert_node_dies_mid_generation_and_its_experts_move() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("moe.gguf");
    let shape = ["--layers", "4", "--hidden", "512", "--ffn", "1024", "--heads", "8", "--kv-heads", "8"];
    let experts = ["--vocab", "512", "--experts", "8", "--experts-used", "2", "--moe-family", "qwen3moe"];
    synth(&model, &[&shape[..], &experts[..], &["--type", "f32"]].concat());
    let want = reference(&model);
    let mut gaps = Vec::new();
    let n = runs().min(2);
    for run in 0..n {
        let mut c = cluster_with(&model, "w1:cpu:4,w2:cpu:experts=0..4,w3:cpu:experts=4..8");
        let victim = ["w3", "w2"][run % 2];
        let pid = c.worker(victim).child.id();
        let kill_at = [30, 60][run % 2];
        let (got, _, gap) = stream(&c, c.addr().split(',').map(str::to_string).collect(), &[], |k| {
            if k == kill_at {
                kill_pid(pid);
                return true;
            }
            false
        });
        assert_eq!(got, want, "run {run}: killing {victim}, which held experts, changed the ids\n{}", c.logs());
        gaps.push(gap);
        let st = c.status();
        let d = &st["deployments"][0];
        let nodes: Vec<&str> = ["stages", "expert_stages"]
            .iter()
            .flat_map(|k| d[k].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap()))
            .collect();
        assert!(!nodes.contains(&victim), "run {run}: still placed on {victim}: {nodes:?}");
        assert_eq!(d["state"], "ready", "{d}");
        eprintln!("run {run}: {victim} (experts) killed after {kill_at} tokens; next token {gap:.3} s later; now on {nodes:?}");
    }
    eprintln!(
        "expert node killed mid-generation: {n}/{n} generations complete and identical; fault → next token p50 {:.3} s",
        pct(&mut gaps, 0.5)
    );
}
