//! Cluster files (TOML) → [`Inventory`]. The text is parsed here; reading the file is the caller's.
//!
//! ```toml
//! [[node]]
//! name = "gateway"
//! [[node.device]]
//! name = "cuda0"          # unique within the node; "cpu" for the host
//! kind = "cuda"           # cuda | cpu
//! memory = "24 GiB"       # what may hold weights + KV
//! mem_bandwidth = "936 GB/s"
//! flops = "71 TFLOPS"
//! watts = 350             # optional, for the energy objective
//! host_link = { bandwidth = "25 GB/s", latency = "10 us" }   # cuda only; this is the default
//! [[link]]
//! a = "gateway"
//! b = "edge-1"
//! bandwidth = "1 Gbit/s"
//! latency = "0.5 ms"
//! ```

use crate::units;
use crate::PlanError;
use brigade_core::{DeviceKind, DeviceSpec, Inventory, Link, LinkSpec, NodeSpec};
use serde::Deserialize;
use std::collections::HashSet;

/// PCIe 4.0 x16 as practitioners measure it: the host link of a CUDA device that names none.
pub const DEFAULT_HOST_LINK: Link = Link { bandwidth: 25e9, latency: 10e-6 };

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCluster {
    #[serde(default)]
    node: Vec<RawNode>,
    #[serde(default)]
    link: Vec<RawLink>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    #[serde(default)]
    device: Vec<RawDevice>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: String,
    kind: String,
    memory: String,
    mem_bandwidth: String,
    flops: String,
    watts: Option<f64>,
    host_link: Option<RawLinkSpeed>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLinkSpeed {
    bandwidth: String,
    latency: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLink {
    a: String,
    b: String,
    bandwidth: String,
    latency: String,
}

fn link(what: &str, bw: &str, lat: &str) -> Result<Link, PlanError> {
    Ok(Link {
        bandwidth: units::bandwidth(&format!("{what} bandwidth"), bw)?,
        latency: units::seconds(&format!("{what} latency"), lat)?,
    })
}

/// Parses and validates a cluster file's text.
pub fn parse_cluster(text: &str) -> Result<Inventory, PlanError> {
    let raw: RawCluster = toml::from_str(text).map_err(|e| PlanError::BadCluster(e.to_string()))?;
    if raw.node.is_empty() {
        return Err(PlanError::BadCluster("no [[node]] entries".into()));
    }
    let mut nodes = Vec::with_capacity(raw.node.len());
    let mut names = HashSet::new();
    for n in raw.node {
        if n.name.trim().is_empty() {
            return Err(PlanError::BadCluster("a node has an empty name".into()));
        }
        if !names.insert(n.name.clone()) {
            return Err(PlanError::BadCluster(format!("node `{}` appears twice", n.name)));
        }
        if n.device.is_empty() {
            return Err(PlanError::BadCluster(format!("node `{}` has no [[node.device]]", n.name)));
        }
        let mut devs = Vec::with_capacity(n.device.len());
        let mut dnames = HashSet::new();
        for d in n.device {
            let what = format!("node `{}` device `{}`", n.name, d.name);
            if !dnames.insert(d.name.clone()) {
                return Err(PlanError::BadCluster(format!("device `{}` appears twice on node `{}`", d.name, n.name)));
            }
            let kind = match d.kind.as_str() {
                "cuda" => DeviceKind::Cuda,
                "cpu" => DeviceKind::Cpu,
                k => return Err(PlanError::BadCluster(format!("{what}: kind `{k}` (cuda or cpu)"))),
            };
            let host_link = match (kind, d.host_link) {
                (DeviceKind::Cpu, Some(_)) => {
                    return Err(PlanError::BadCluster(format!("{what}: host_link is for cuda devices")))
                }
                (DeviceKind::Cpu, None) => None,
                (DeviceKind::Cuda, Some(h)) => Some(link(&format!("{what} host_link"), &h.bandwidth, &h.latency)?),
                (DeviceKind::Cuda, None) => Some(DEFAULT_HOST_LINK),
            };
            if let Some(w) = d.watts {
                if !(w.is_finite() && w > 0.0) {
                    return Err(PlanError::BadValue {
                        what: format!("{what} watts"),
                        value: w.to_string(),
                        why: "must be positive".into(),
                    });
                }
            }
            devs.push(DeviceSpec {
                name: d.name,
                kind,
                memory: units::bytes(&format!("{what} memory"), &d.memory)?,
                mem_bandwidth: units::bandwidth(&format!("{what} mem_bandwidth"), &d.mem_bandwidth)?,
                flops: units::flops(&format!("{what} flops"), &d.flops)?,
                watts: d.watts,
                host_link,
            });
        }
        nodes.push(NodeSpec { name: n.name, devices: devs });
    }
    let mut links = Vec::with_capacity(raw.link.len());
    let mut seen = HashSet::new();
    for l in raw.link {
        for end in [&l.a, &l.b] {
            if !names.contains(end) {
                return Err(PlanError::BadCluster(format!("link {} – {} names unknown node `{end}`", l.a, l.b)));
            }
        }
        if l.a == l.b {
            return Err(PlanError::BadCluster(format!("link from `{}` to itself", l.a)));
        }
        let key = if l.a < l.b { (l.a.clone(), l.b.clone()) } else { (l.b.clone(), l.a.clone()) };
        if !seen.insert(key) {
            return Err(PlanError::BadCluster(format!("link {} – {} appears twice", l.a, l.b)));
        }
        let sp = link(&format!("link {} – {}", l.a, l.b), &l.bandwidth, &l.latency)?;
        links.push(LinkSpec { a: l.a, b: l.b, link: sp });
    }
    Ok(Inventory { nodes, links })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"
[[node]]
name = "gateway"
[[node.device]]
name = "cuda0"
kind = "cuda"
memory = "24 GiB"
mem_bandwidth = "936 GB/s"
flops = "71 TFLOPS"
watts = 350
[[node.device]]
name = "cpu"
kind = "cpu"
memory = "64 GiB"
mem_bandwidth = "50 GB/s"
flops = "1 TFLOPS"
[[node]]
name = "edge-1"
[[node.device]]
name = "cpu"
kind = "cpu"
memory = "16 GiB"
mem_bandwidth = "20 GB/s"
flops = "300 GFLOPS"
[[link]]
a = "gateway"
b = "edge-1"
bandwidth = "1 Gbit/s"
latency = "0.5 ms"
"#;

    #[test]
    fn parses_a_cluster() {
        let inv = parse_cluster(OK).unwrap();
        assert_eq!(inv.nodes.len(), 2);
        assert_eq!(inv.n_devices(), 3);
        assert_eq!(inv.nodes[0].devices[0].host_link, Some(DEFAULT_HOST_LINK));
        let l = inv.link("edge-1", "gateway").unwrap();
        assert!((l.bandwidth - 125e6).abs() < 1e-6 && (l.latency - 5e-4).abs() < 1e-12);
    }

    #[test]
    fn rejects_bad_clusters() {
        let cases = [
            (OK.replace("\"24 GiB\"", "\"24 gigs\""), "24 gigs"),
            (OK.replace("\"1 Gbit/s\"", "\"0 Gbit/s\""), "positive"),
            (OK.replace("\"1 Gbit/s\"", "\"-1 Gbit/s\""), "positive"),
            (OK.replace("name = \"edge-1\"", "name = \"gateway\""), "appears twice"),
            (OK.replace("b = \"edge-1\"", "b = \"edge-9\""), "unknown node `edge-9`"),
            (
                OK.replace(
                    "name = \"cpu\"\nkind = \"cpu\"\nmemory = \"64 GiB\"",
                    "name = \"cuda0\"\nkind = \"cpu\"\nmemory = \"64 GiB\"",
                ),
                "appears twice",
            ),
            (OK.replace("kind = \"cuda\"", "kind = \"tpu\""), "tpu"),
            (OK.replace("watts = 350", "watts = -5"), "positive"),
            (OK.replace("flops = \"71 TFLOPS\"", "flops = \"71 TOPS\""), "TOPS"),
            (OK.replace("latency = \"0.5 ms\"", "latency = \"0.5 parsecs\""), "parsecs"),
            (OK.replace("memory = \"24 GiB\"", "memory = \"24 GiB\"\ncolor = \"red\""), "color"),
            (String::from("this is not toml ["), ""),
            (String::new(), "no [[node]]"),
        ];
        for (text, needle) in cases {
            let e = parse_cluster(&text).expect_err(needle).to_string();
            assert!(e.contains(needle), "`{needle}` not in: {e}");
        }
    }
}
