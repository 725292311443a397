//! Links of set bandwidth between separate hosts: each node in a network namespace of its own,
//! joined to every other by a point-to-point veth pair, the pair between w1 and w2 slowed with
//! `tc … tbf`. The workers must measure the slow link, `status` must show it, and the planner must
//! place the model so that no hop crosses it (a faster arrangement exists).
//!
//! Needs root (network namespaces); CI runs as root.
#![allow(clippy::unwrap_used)]

mod support;

use support::netns::Net;
use support::*;

#[test]
fn a_slow_link_is_measured_shown_and_avoided() {
    assert!(unsafe { libc::geteuid() } == 0, "this test builds network namespaces and needs root (CI runs as root)");
    let net = Net::new(&["c", "w1", "w2", "w3"]);
    for a in 0..4 {
        for b in a + 1..4 {
            // 8 Mbit/s between w1 and w2; the rest as fast as veth goes
            net.link(a, b, if (a, b) == (1, 2) { Some("8mbit") } else { None });
        }
    }
    let mut c = Cluster::new();
    let prefix = net.prefix.clone();
    c.wrap = Box::new(move |name| {
        let node = if name == "coordinator" || name == "client" { "c".to_string() } else { name.to_string() };
        vec!["ip".into(), "netns".into(), "exec".into(), format!("{prefix}{node}")]
    });
    c.coord_host = net.ip_of("c");
    c.port = 7070;
    c.start_coordinator(&[]);
    let model = c.path("m.gguf");
    synth_shape(&model, [8, 512, 1024, 8, 8, 512], "q8_0");
    let size = std::fs::metadata(&model).unwrap().len();
    // each node offers room for about 60% of the model: the plan needs two stages
    let memory = format!("{}", size * 6 / 10);
    // the three nodes compute alike (one CPU); they get the same measured figures, so that the
    // links alone decide the placement (three workers measuring at once on 2 cores would not
    // measure alike)
    for w in ["w1", "w2", "w3"] {
        let mut args = c.worker_args(w);
        let i = args.iter().position(|a| a == "--listen").unwrap();
        args[i + 1] = format!("{}:7071", net.ip_of(w));
        args.extend(["--memory".to_string(), memory.clone()]);
        if w != "w1" {
            std::fs::create_dir_all(c.path(w)).unwrap();
            std::fs::copy(c.path("w1/figures.json"), c.path(&format!("{w}/figures.json"))).unwrap();
        }
        c.start_worker_with(w, args);
        if w == "w1" {
            c.wait_up(1);
        }
    }
    c.wait_up(3);
    // the deploy waits for every pair's link to be measured, then plans on the figures
    let d = c.deploy(&["--name", "m", "-m", model.to_str().unwrap(), "--ctx", "128", "--sessions", "1"]);
    // every node measures its links to the others on its own schedule: wait (bounded) for both
    // directions of every pair to be reported
    let mut st = c.status();
    wait_until("all six directed links measured", std::time::Duration::from_secs(60), || {
        st = c.status();
        st["links"].as_array().is_some_and(|l| l.len() >= 6)
    });
    let link = |a: &str, b: &str| -> f64 {
        st["links"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["from"] == a && l["to"] == b)
            .unwrap_or_else(|| panic!("no link {a}→{b} in {}", st["links"]))["bandwidth_bytes_per_s"]
            .as_f64()
            .unwrap()
    };
    let slow = link("w1", "w2").min(link("w2", "w1"));
    let fast = link("w1", "w3").min(link("w3", "w2"));
    // tbf at 8 Mbit/s is 1 MB/s
    assert!(slow < 2.5e6 && slow > 2e5, "the slow link measured {slow} B/s\n{}", st["links"]);
    assert!(fast > 10e6, "a veth link measured {fast} B/s\n{}", st["links"]);
    eprintln!("links: slow {slow:.0} B/s, fast {fast:.0} B/s\nplan:\n{}", d["plan"].as_str().unwrap_or_default());
    let stages: Vec<String> =
        d["stages"].as_array().unwrap().iter().map(|s| s["node"].as_str().unwrap().to_string()).collect();
    assert!(stages.len() >= 2, "the model should not fit on one node: {stages:?}\n{}", d["plan"]);
    for w in stages.windows(2) {
        let pair = (w[0].as_str(), w[1].as_str());
        assert!(pair != ("w1", "w2") && pair != ("w2", "w1"), "a hop crosses the slow link: {stages:?}\n{}", d["plan"]);
    }
    let (_, want) = run_ids(Some(&model), "Once upon a time", 8);
    assert_eq!(ids(&c.generate("m", "Once upon a time", 8)["generated_ids"]), want, "{}", c.logs());
}
