use crate::DeviceKind;
use serde::{Deserialize, Serialize};

/// A link: bandwidth in bytes per second, latency in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub bandwidth: f64,
    pub latency: f64,
}

impl Link {
    /// Seconds to move `bytes` over this link.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }
}

/// One compute device of a node, in base units (bytes, bytes/s, flop/s, watts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// Unique within its node; `cpu` for the host.
    pub name: String,
    pub kind: DeviceKind,
    /// Bytes that may hold weights and KV cache.
    pub memory: u64,
    pub mem_bandwidth: f64,
    pub flops: f64,
    pub watts: Option<f64>,
    /// The path to the node's CPU (PCIe); CUDA devices only.
    pub host_link: Option<Link>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    pub name: String,
    pub devices: Vec<DeviceSpec>,
}

/// A network link between two nodes (undirected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    pub a: String,
    pub b: String,
    pub link: Link,
}

/// Every node, its devices, and the links between nodes. Nodes with no link between them cannot
/// be neighbours in a pipeline.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Inventory {
    pub nodes: Vec<NodeSpec>,
    pub links: Vec<LinkSpec>,
}

impl Inventory {
    pub fn n_devices(&self) -> usize {
        self.nodes.iter().map(|n| n.devices.len()).sum()
    }

    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The link between two nodes, if any.
    pub fn link(&self, a: &str, b: &str) -> Option<Link> {
        self.links.iter().find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)).map(|l| l.link)
    }
}
