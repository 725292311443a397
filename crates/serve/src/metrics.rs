//! `/metrics` in Prometheus' text format (the `prometheus-client` crate, the Prometheus
//! project's own Rust client): what the server itself sees of requests (by endpoint and status,
//! tokens, time to first token, time between tokens), the backend's load, and the figures of
//! its [`Overview`] — per stage compute and per hop transfer seconds and bytes, KV cache and
//! weight bytes, node heartbeats, the planner's predicted decode time beside the measured one.
//! The dashboard renders the same [`Overview`], so the two always agree.

use crate::backend::Load;
use crate::overview::Overview;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;
use std::time::Duration;

/// Requests kept for the dashboard's "recent requests".
const RECENT: usize = 20;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StageLabels {
    deployment: String,
    stage: String,
    node: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HopLabels {
    deployment: String,
    /// The stage the hop leaves.
    stage: String,
    from: String,
    to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeploymentLabels {
    deployment: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeviceLabels {
    node: String,
    device: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LinkLabels {
    from: String,
    to: String,
}

type FGauge = Gauge<f64, AtomicU64>;
type FCounter = Counter<f64, AtomicU64>;

/// A finished completion, for the dashboard.
#[derive(Debug, Clone, Serialize)]
pub struct RecentRequest {
    /// Unix seconds at the end.
    pub at: u64,
    pub model: String,
    pub endpoint: String,
    pub prompt_tokens: usize,
    pub generated: usize,
    /// Seconds from the request to its first token (0: none came).
    pub ttft_s: f64,
    pub duration_s: f64,
    /// "stop", "length", or the error.
    pub outcome: String,
}

/// The server's own metrics, alive for its life.
pub struct ServerMetrics {
    requests: Family<RequestLabels, Counter>,
    tokens: Counter,
    ttft: Histogram,
    itl: Histogram,
    recent: Mutex<VecDeque<RecentRequest>>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            requests: Family::default(),
            tokens: Counter::default(),
            // 5 ms to ~164 s
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 16)),
            // 1 ms to ~33 s
            itl: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            recent: Mutex::new(VecDeque::new()),
        }
    }
}

impl ServerMetrics {
    /// One answered request; `endpoint` is a route of the API (anything else counts as "other").
    pub fn request(&self, endpoint: &str, status: u16) {
        let endpoint = match endpoint {
            "/v1/completions" | "/v1/chat/completions" | "/v1/models" => endpoint,
            e if e.starts_with("/v1/models/") => "/v1/models/{id}",
            _ => "other",
        };
        self.requests.get_or_create(&RequestLabels { endpoint: endpoint.into(), status: status.to_string() }).inc();
    }

    /// A generated token; `since_previous` is the gap from the one before (none for the first).
    pub fn token(&self, since_previous: Option<Duration>) {
        self.tokens.inc();
        if let Some(d) = since_previous {
            self.itl.observe(d.as_secs_f64());
        }
    }

    pub fn first_token(&self, after: Duration) {
        self.ttft.observe(after.as_secs_f64());
    }

    pub fn finished(&self, r: RecentRequest) {
        if let Ok(mut q) = self.recent.lock() {
            if q.len() == RECENT {
                q.pop_front();
            }
            q.push_back(r);
        }
    }

    /// The latest finished completions, newest first.
    pub fn recent(&self) -> Vec<RecentRequest> {
        self.recent.lock().map(|q| q.iter().rev().cloned().collect()).unwrap_or_default()
    }

    /// Everything in Prometheus' text format: this server's metrics, the backend's load, and the
    /// figures of its overview.
    pub fn encode(&self, load: Option<Load>, overview: Option<&Overview>) -> Result<String, std::fmt::Error> {
        let mut reg = Registry::with_prefix("brigade");
        reg.register("requests", "Requests answered, by endpoint and HTTP status", self.requests.clone());
        reg.register("generated_tokens", "Tokens generated for clients", self.tokens.clone());
        reg.register(
            "time_to_first_token_seconds",
            "From a completion request's arrival to its first token",
            self.ttft.clone(),
        );
        reg.register("inter_token_seconds", "Between consecutive tokens of a completion", self.itl.clone());
        if let Some(l) = load {
            let gauge = |v: usize| {
                let g: Gauge = Gauge::default();
                g.set(i64::try_from(v).unwrap_or(i64::MAX));
                g
            };
            reg.register("sessions_active", "Sessions being computed now", gauge(l.processing));
            reg.register("sessions_slots", "Sessions that can be computed at once", gauge(l.slots));
            reg.register("requests_waiting", "Requests queued for a free session", gauge(l.waiting));
        }
        if let Some(ov) = overview {
            register_overview(&mut reg, ov);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg)?;
        Ok(out)
    }
}

fn register_overview(reg: &mut Registry, ov: &Overview) {
    let stage_compute = Family::<StageLabels, FCounter>::default();
    let stage_kv = Family::<StageLabels, FGauge>::default();
    let stage_weights = Family::<StageLabels, FGauge>::default();
    let stage_predicted = Family::<StageLabels, FGauge>::default();
    let hop_seconds = Family::<HopLabels, FCounter>::default();
    let hop_bytes = Family::<HopLabels, FCounter>::default();
    let predicted = Family::<DeploymentLabels, FGauge>::default();
    let measured = Family::<DeploymentLabels, FGauge>::default();
    let dep_tokens = Family::<DeploymentLabels, FCounter>::default();
    let drafted = Family::<DeploymentLabels, FCounter>::default();
    let accepted = Family::<DeploymentLabels, FCounter>::default();
    let ready = Family::<DeploymentLabels, FGauge>::default();
    let heartbeat = Family::<NodeLabels, FGauge>::default();
    let up = Family::<NodeLabels, FGauge>::default();
    let dev_weights = Family::<DeviceLabels, FGauge>::default();
    let dev_total = Family::<DeviceLabels, FGauge>::default();
    let dev_free = Family::<DeviceLabels, FGauge>::default();
    let dev_bw = Family::<DeviceLabels, FGauge>::default();
    let link_bw = Family::<LinkLabels, FGauge>::default();
    let link_lat = Family::<LinkLabels, FGauge>::default();
    for n in &ov.nodes {
        let l = NodeLabels { node: n.name.clone() };
        heartbeat.get_or_create(&l).set(n.heartbeat_age_s);
        up.get_or_create(&l).set(if n.state == "up" { 1.0 } else { 0.0 });
        for d in &n.devices {
            let l = DeviceLabels { node: n.name.clone(), device: d.name.clone() };
            dev_total.get_or_create(&l).set(d.memory_total as f64);
            dev_free.get_or_create(&l).set(d.memory_free as f64);
            dev_bw.get_or_create(&l).set(d.mem_bandwidth);
            // every device appears, with 0 where nothing is loaded
            let _ = dev_weights.get_or_create(&l);
        }
    }
    for k in &ov.links {
        let l = LinkLabels { from: k.from.clone(), to: k.to.clone() };
        link_bw.get_or_create(&l).set(k.bandwidth);
        link_lat.get_or_create(&l).set(k.latency_s);
    }
    for d in &ov.deployments {
        let dl = DeploymentLabels { deployment: d.name.clone() };
        predicted.get_or_create(&dl).set(d.predicted_decode_s);
        measured.get_or_create(&dl).set(d.measured_decode_s);
        dep_tokens.get_or_create(&dl).inc_by(d.tokens_generated as f64);
        drafted.get_or_create(&dl).inc_by(d.drafted_tokens as f64);
        accepted.get_or_create(&dl).inc_by(d.accepted_tokens as f64);
        ready.get_or_create(&dl).set(if d.state == "ready" { 1.0 } else { 0.0 });
        for (i, s) in d.stages.iter().enumerate() {
            let l = StageLabels {
                deployment: d.name.clone(),
                stage: s.index.to_string(),
                node: s.node.clone(),
                device: s.device.clone(),
            };
            stage_compute.get_or_create(&l).inc_by(s.compute_s_total);
            stage_kv.get_or_create(&l).set(s.kv_bytes as f64);
            stage_weights.get_or_create(&l).set(s.weight_bytes as f64);
            stage_predicted.get_or_create(&l).set(s.predicted_s);
            let to = d.stages.get(i + 1).map_or_else(|| "driver".to_string(), |n| n.node.clone());
            let h = HopLabels { deployment: d.name.clone(), stage: s.index.to_string(), from: s.node.clone(), to };
            hop_seconds.get_or_create(&h).inc_by(s.hop_s_total);
            hop_bytes.get_or_create(&h).inc_by(s.hop_bytes_total);
            let dev = dev_weights.get_or_create(&DeviceLabels { node: s.node.clone(), device: s.device.clone() });
            dev.inc_by(s.weight_bytes as f64);
        }
    }
    reg.register("stage_compute_seconds", "Compute seconds of a stage, summed over decode steps", stage_compute);
    reg.register(
        "hop_transfer_seconds",
        "Seconds from a stage to the next (the last: to the driver), transfer and queueing, summed over decode steps",
        hop_seconds,
    );
    reg.register("hop_transfer_bytes", "Bytes sent from a stage to the next, summed over decode steps", hop_bytes);
    reg.register("stage_kv_cache_bytes", "KV cache bytes a stage holds", stage_kv);
    reg.register("stage_weight_bytes", "Weight bytes a stage holds", stage_weights);
    reg.register(
        "stage_predicted_seconds_per_token",
        "The planner's predicted seconds per token of a stage and its hop",
        stage_predicted,
    );
    reg.register("device_weight_bytes", "Weight bytes loaded on a device, over every deployment", dev_weights);
    reg.register("device_memory_total_bytes", "A device's memory", dev_total);
    reg.register("device_memory_free_bytes", "A device's memory free for weights and caches", dev_free);
    reg.register("device_read_bandwidth_bytes_per_second", "A device's measured read bandwidth", dev_bw);
    reg.register("link_bandwidth_bytes_per_second", "A link's measured bandwidth", link_bw);
    reg.register("link_latency_seconds", "A link's measured one-way latency", link_lat);
    reg.register("node_heartbeat_age_seconds", "Seconds since a node's last heartbeat", heartbeat);
    reg.register("node_up", "1 when a node is up", up);
    reg.register(
        "deployment_predicted_decode_seconds_per_token",
        "The planner's predicted decode seconds per token",
        predicted,
    );
    reg.register(
        "deployment_measured_decode_seconds_per_token",
        "Measured decode seconds per token, mean over the sessions so far (0 before any)",
        measured,
    );
    reg.register("deployment_tokens_generated", "Tokens a deployment generated", dep_tokens);
    reg.register("deployment_draft_tokens", "Drafted tokens fed (speculative decoding)", drafted);
    reg.register(
        "deployment_draft_tokens_accepted",
        "Drafted tokens the model's own draws took (speculative decoding)",
        accepted,
    );
    reg.register("deployment_ready", "1 when a deployment serves", ready);
}
