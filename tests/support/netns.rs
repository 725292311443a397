//! Hosts of their own for tests: network namespaces joined by point-to-point veth pairs (one
//! per pair of nodes, so that a link can be slowed with `tc tbf` or cut alone). Needs root.
#![allow(clippy::unwrap_used, dead_code)]

use std::process::Command;

pub fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(out.status.success(), "{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
}

/// Namespaces named `<prefix><node>`, each with the address `10.<net>.0.<i+1>` on its loopback.
pub struct Net {
    pub prefix: String,
    pub net: u32,
    pub nodes: Vec<String>,
}

impl Net {
    pub fn new(nodes: &[&str]) -> Net {
        // unique per Net: tests of one binary run at once
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let n = Net {
            prefix: format!("brg{}x{k}", pid % 100_000),
            net: 200 + (pid + 7 * k) % 50,
            nodes: nodes.iter().map(|s| s.to_string()).collect(),
        };
        for (i, node) in nodes.iter().enumerate() {
            let ns = n.ns(node);
            let _ = Command::new("ip").args(["netns", "del", &ns]).output();
            sh(&["ip", "netns", "add", &ns]);
            sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
            sh(&["ip", "-n", &ns, "addr", "add", &format!("{}/32", n.ip(i)), "dev", "lo"]);
        }
        n
    }

    pub fn ns(&self, node: &str) -> String {
        format!("{}{node}", self.prefix)
    }

    pub fn ip(&self, i: usize) -> String {
        format!("10.{}.0.{}", self.net, i + 1)
    }

    pub fn ip_of(&self, node: &str) -> String {
        self.ip(self.nodes.iter().position(|n| n == node).unwrap())
    }

    /// A point-to-point link between two nodes; `rate` slows it (both directions) with tbf.
    pub fn link(&self, a: usize, b: usize, rate: Option<&str>) {
        let (na, nb) = (self.ns(&self.nodes[a]), self.ns(&self.nodes[b]));
        let (ia, ib) = (format!("v{a}{b}"), format!("v{b}{a}"));
        sh(&["ip", "link", "add", &ia, "netns", &na, "type", "veth", "peer", "name", &ib, "netns", &nb]);
        for (ns, dev, peer) in [(&na, &ia, b), (&nb, &ib, a)] {
            sh(&["ip", "-n", ns, "link", "set", dev, "up"]);
            sh(&["ip", "-n", ns, "route", "add", &format!("{}/32", self.ip(peer)), "dev", dev]);
            if let Some(r) = rate {
                sh(&[
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", r, "burst",
                    "32kbit", "latency", "400ms",
                ]);
            }
        }
    }

    /// Takes the link between two nodes down (a partition) or up again.
    pub fn set_link(&self, a: usize, b: usize, up: bool) {
        let state = if up { "up" } else { "down" };
        sh(&["ip", "-n", &self.ns(&self.nodes[a]), "link", "set", &format!("v{a}{b}"), state]);
        sh(&["ip", "-n", &self.ns(&self.nodes[b]), "link", "set", &format!("v{b}{a}"), state]);
        if up {
            // the routes went with the links
            for (x, y) in [(a, b), (b, a)] {
                let _ = Command::new("ip")
                    .args([
                        "-n",
                        &self.ns(&self.nodes[x]),
                        "route",
                        "replace",
                        &format!("{}/32", self.ip(y)),
                        "dev",
                        &format!("v{x}{y}"),
                    ])
                    .output();
            }
        }
    }

    /// The prefix that runs a command in a node's namespace.
    pub fn exec(&self, node: &str) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), self.ns(node)]
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for n in &self.nodes {
            let _ = Command::new("ip").args(["netns", "del", &self.ns(n)]).output();
        }
    }
}
