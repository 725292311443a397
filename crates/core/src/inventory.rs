use crate::DeviceKind;
use serde::{Deserialize, Serialize};

/// A link: bandwidth in bytes per second, latency in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Bytes per second of a bulk transfer.
    pub bandwidth: f64,
    /// One-way seconds before the first byte arrives.
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
    /// CPU or CUDA: picks the KV cache's type and whether [`DeviceSpec::host_link`] applies.
    pub kind: DeviceKind,
    /// Bytes that may hold weights and KV cache.
    pub memory: u64,
    /// Memory read bandwidth in bytes/s: a layer's decode time is at least its bytes over it.
    pub mem_bandwidth: f64,
    /// Compute rate in flop/s: a layer's decode time is at least its flops over it.
    pub flops: f64,
    /// Power drawn while computing, in watts; needed by the energy objective and a watts cap,
    /// `None` where unknown.
    pub watts: Option<f64>,
    /// The path to the node's CPU (PCIe); CUDA devices only.
    pub host_link: Option<Link>,
}

/// One host of the cluster and its compute devices.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSpec {
    /// Unique within the inventory; links and the planner's driver name nodes by it.
    pub name: String,
    /// The node's devices, each named uniquely within it.
    pub devices: Vec<DeviceSpec>,
}

/// A network link between two nodes (undirected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// The name of one end's node.
    pub a: String,
    /// The name of the other end's node.
    pub b: String,
    /// Its speed, the same both ways.
    pub link: Link,
}

/// Every node, its devices, and the links between nodes. Nodes with no link between them cannot
/// be neighbours in a pipeline.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Inventory {
    /// Every node; the planner refers to a node by its index here.
    pub nodes: Vec<NodeSpec>,
    /// The network links between nodes, at most one per pair.
    pub links: Vec<LinkSpec>,
}

impl Inventory {
    /// Devices over all nodes.
    pub fn n_devices(&self) -> usize {
        self.nodes.iter().map(|n| n.devices.len()).sum()
    }

    /// The index in [`Inventory::nodes`] of the node named `name`, if any.
    pub fn node_index(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    /// The link between two nodes, if any.
    pub fn link(&self, a: &str, b: &str) -> Option<Link> {
        self.links.iter().find(|l| (l.a == a && l.b == b) || (l.a == b && l.b == a)).map(|l| l.link)
    }
}
