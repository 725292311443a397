//! Conversions between the wire types and brigade's own (`brigade-core`), in one place.

use crate::v1;
use brigade_core::cluster::{
    ActDtype, CarrierKind, DeploymentState, DeviceFigures, KernelFigures, NodeState, StageState,
};
use brigade_core::stop::StopReason;
use brigade_core::{DeviceKind, Link, SamplingError, SamplingParams};

/// Unix time in milliseconds (0 if the clock is before 1970).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub fn device_to_proto(d: &DeviceFigures) -> v1::Device {
    v1::Device {
        name: d.name.clone(),
        kind: match d.kind {
            DeviceKind::Cpu => v1::DeviceKind::Cpu,
            DeviceKind::Cuda => v1::DeviceKind::Cuda,
        } as i32,
        model: d.model.clone(),
        memory_total: d.memory_total,
        memory_free: d.memory_free,
        mem_bandwidth: d.mem_bandwidth,
        flops: d.flops,
        kernels: d
            .kernels
            .iter()
            .map(|k| v1::KernelRate {
                weight_type: k.weight_type.clone(),
                decode_bytes_per_s: k.decode_bytes_per_s,
                prompt_flops: k.prompt_flops,
            })
            .collect(),
        threads: d.threads,
        features: d.features.clone(),
        host_link_bandwidth: d.host_link.map(|l| l.bandwidth).unwrap_or(0.0),
        host_link_latency_s: d.host_link.map(|l| l.latency).unwrap_or(0.0),
    }
}

/// A device as a worker reported it; `None` (with the reason) when a figure is not a number a
/// planner can use.
pub fn device_from_proto(d: &v1::Device) -> Result<DeviceFigures, String> {
    let kind = match v1::DeviceKind::try_from(d.kind) {
        Ok(v1::DeviceKind::Cpu) => DeviceKind::Cpu,
        Ok(v1::DeviceKind::Cuda) => DeviceKind::Cuda,
        _ => return Err(format!("device `{}` has no kind", d.name)),
    };
    let rate = |what: &str, x: f64| {
        if x.is_finite() && x > 0.0 {
            Ok(x)
        } else {
            Err(format!("device `{}`: {what} {x} is not a positive number", d.name))
        }
    };
    rate("read bandwidth", d.mem_bandwidth)?;
    rate("compute rate", d.flops)?;
    let mut kernels = Vec::with_capacity(d.kernels.len());
    for k in &d.kernels {
        rate(&format!("{} decode rate", k.weight_type), k.decode_bytes_per_s)?;
        rate(&format!("{} prompt rate", k.weight_type), k.prompt_flops)?;
        kernels.push(KernelFigures {
            weight_type: k.weight_type.clone(),
            decode_bytes_per_s: k.decode_bytes_per_s,
            prompt_flops: k.prompt_flops,
        });
    }
    let host_link = (d.host_link_bandwidth > 0.0 && d.host_link_bandwidth.is_finite())
        .then_some(Link { bandwidth: d.host_link_bandwidth, latency: d.host_link_latency_s.max(0.0) });
    Ok(DeviceFigures {
        name: d.name.clone(),
        kind,
        model: d.model.clone(),
        memory_total: d.memory_total,
        memory_free: d.memory_free,
        mem_bandwidth: d.mem_bandwidth,
        flops: d.flops,
        kernels,
        threads: d.threads,
        features: d.features.clone(),
        host_link,
    })
}

/// The wire's name of an activation type.
pub fn act_dtype_to_proto(d: ActDtype) -> v1::WireDtype {
    match d {
        ActDtype::F32 => v1::WireDtype::F32,
        ActDtype::F16 => v1::WireDtype::F16,
        ActDtype::Bf16 => v1::WireDtype::Bf16,
    }
}

/// The activation type a wire number names (unspecified: f32); `Err` with the number for one
/// that is not an activation type (unknown, or `u32`).
pub fn act_dtype_from_proto(n: i32) -> Result<ActDtype, i32> {
    match v1::WireDtype::try_from(n) {
        Ok(v1::WireDtype::Unspecified | v1::WireDtype::F32) => Ok(ActDtype::F32),
        Ok(v1::WireDtype::F16) => Ok(ActDtype::F16),
        Ok(v1::WireDtype::Bf16) => Ok(ActDtype::Bf16),
        _ => Err(n),
    }
}

/// The wire's name of a carrier.
pub fn carrier_to_proto(c: CarrierKind) -> v1::Carrier {
    match c {
        CarrierKind::Quic => v1::Carrier::Quic,
        CarrierKind::Grpc => v1::Carrier::Grpc,
    }
}

/// The carrier a wire number names (unspecified: QUIC); `Err` with an unknown number.
pub fn carrier_from_proto(n: i32) -> Result<CarrierKind, i32> {
    match v1::Carrier::try_from(n) {
        Ok(v1::Carrier::Unspecified | v1::Carrier::Quic) => Ok(CarrierKind::Quic),
        Ok(v1::Carrier::Grpc) => Ok(CarrierKind::Grpc),
        Err(_) => Err(n),
    }
}

/// The wire's name of a node's state.
pub fn node_state_to_proto(s: NodeState) -> v1::NodeState {
    match s {
        NodeState::Up => v1::NodeState::Up,
        NodeState::Down => v1::NodeState::Down,
    }
}

/// The node state a wire number names (`None`: unspecified or unknown).
pub fn node_state_from_proto(n: i32) -> Option<NodeState> {
    match v1::NodeState::try_from(n) {
        Ok(v1::NodeState::Up) => Some(NodeState::Up),
        Ok(v1::NodeState::Down) => Some(NodeState::Down),
        _ => None,
    }
}

/// The wire's name of a stage's state (a failure's text travels in the message's `error`).
pub fn stage_state_to_proto(s: &StageState) -> v1::StageState {
    match s {
        StageState::Pending => v1::StageState::Pending,
        StageState::Loading => v1::StageState::Loading,
        StageState::Ready => v1::StageState::Ready,
        StageState::Failed(_) => v1::StageState::Failed,
    }
}

/// The stage state a wire number names, a failure with the text `error`; `Err` with the number
/// where it names none (unspecified or unknown).
pub fn stage_state_from_proto(n: i32, error: &str) -> Result<StageState, i32> {
    match v1::StageState::try_from(n) {
        Ok(v1::StageState::Pending) => Ok(StageState::Pending),
        Ok(v1::StageState::Loading) => Ok(StageState::Loading),
        Ok(v1::StageState::Ready) => Ok(StageState::Ready),
        Ok(v1::StageState::Failed) => Ok(StageState::Failed(error.to_string())),
        _ => Err(n),
    }
}

/// The wire's name of a deployment's state.
pub fn deployment_state_to_proto(s: DeploymentState) -> v1::DeploymentState {
    match s {
        DeploymentState::Loading => v1::DeploymentState::Loading,
        DeploymentState::Replacing => v1::DeploymentState::Replacing,
        DeploymentState::Ready => v1::DeploymentState::Ready,
        DeploymentState::Failed => v1::DeploymentState::Failed,
        DeploymentState::Degraded => v1::DeploymentState::Degraded,
    }
}

/// The deployment state a wire number names (`None`: unspecified or unknown).
pub fn deployment_state_from_proto(n: i32) -> Option<DeploymentState> {
    match v1::DeploymentState::try_from(n) {
        Ok(v1::DeploymentState::Loading) => Some(DeploymentState::Loading),
        Ok(v1::DeploymentState::Replacing) => Some(DeploymentState::Replacing),
        Ok(v1::DeploymentState::Ready) => Some(DeploymentState::Ready),
        Ok(v1::DeploymentState::Failed) => Some(DeploymentState::Failed),
        Ok(v1::DeploymentState::Degraded) => Some(DeploymentState::Degraded),
        _ => None,
    }
}

/// The wire's name of why a generation ended (the caller's end is `CANCELLED`).
pub fn stop_to_proto(s: StopReason) -> v1::StopReason {
    match s {
        StopReason::Length => v1::StopReason::Length,
        StopReason::Eos => v1::StopReason::Eos,
        StopReason::Context => v1::StopReason::Context,
        StopReason::Caller => v1::StopReason::Cancelled,
        StopReason::Stop => v1::StopReason::Stop,
    }
}

/// Why a generation ended, as a wire number names it (`None`: unspecified or unknown).
pub fn stop_from_proto(n: i32) -> Option<StopReason> {
    match v1::StopReason::try_from(n) {
        Ok(v1::StopReason::Length) => Some(StopReason::Length),
        Ok(v1::StopReason::Eos) => Some(StopReason::Eos),
        Ok(v1::StopReason::Context) => Some(StopReason::Context),
        Ok(v1::StopReason::Cancelled) => Some(StopReason::Caller),
        Ok(v1::StopReason::Stop) => Some(StopReason::Stop),
        _ => None,
    }
}

/// The lower-case names of the states a wire number names, as the APIs and the dashboard show
/// them (`unknown` for an unspecified or unknown number).
pub fn node_state_name(n: i32) -> &'static str {
    node_state_from_proto(n).map_or("unknown", NodeState::name)
}

/// See [`node_state_name`].
pub fn stage_state_name(n: i32) -> &'static str {
    stage_state_from_proto(n, "").map_or("unknown", |s| s.name())
}

/// See [`node_state_name`].
pub fn deployment_state_name(n: i32) -> &'static str {
    deployment_state_from_proto(n).map_or("unknown", |s| s.name())
}

/// Every field set: the receiver samples exactly as the sender asked.
pub fn sampling_to_proto(p: &SamplingParams) -> v1::Sampling {
    v1::Sampling {
        temperature: Some(p.temperature),
        top_k: Some(u32::try_from(p.top_k).unwrap_or(u32::MAX)),
        top_p: Some(p.top_p),
        min_p: Some(p.min_p),
        repeat_penalty: Some(p.repeat_penalty),
        repeat_last_n: Some(u32::try_from(p.repeat_last_n).unwrap_or(u32::MAX)),
        seed: Some(p.seed),
        presence_penalty: Some(p.presence_penalty),
        frequency_penalty: Some(p.frequency_penalty),
    }
}

/// Unset fields (or no message at all) take llama.cpp's defaults; the result is checked
/// ([`SamplingParams::validate`]).
pub fn sampling_from_proto(s: Option<&v1::Sampling>) -> Result<SamplingParams, SamplingError> {
    let d = SamplingParams::default();
    let Some(s) = s else { return Ok(d) };
    let p = SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_k: s.top_k.map_or(d.top_k, |k| k as usize),
        top_p: s.top_p.unwrap_or(d.top_p),
        min_p: s.min_p.unwrap_or(d.min_p),
        repeat_penalty: s.repeat_penalty.unwrap_or(d.repeat_penalty),
        repeat_last_n: s.repeat_last_n.map_or(d.repeat_last_n, |n| n as usize),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        seed: s.seed.unwrap_or(d.seed),
    };
    p.validate()?;
    Ok(p)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn activation_types_and_carriers_round_trip_and_unknown_numbers_are_named() {
        for d in [ActDtype::F32, ActDtype::F16, ActDtype::Bf16] {
            assert_eq!(act_dtype_from_proto(act_dtype_to_proto(d) as i32), Ok(d));
        }
        for c in [CarrierKind::Quic, CarrierKind::Grpc] {
            assert_eq!(carrier_from_proto(carrier_to_proto(c) as i32), Ok(c));
        }
        assert_eq!(act_dtype_from_proto(v1::WireDtype::Unspecified as i32), Ok(ActDtype::F32));
        assert_eq!(act_dtype_from_proto(v1::WireDtype::U32 as i32), Err(v1::WireDtype::U32 as i32));
        assert_eq!(act_dtype_from_proto(77), Err(77));
        assert_eq!(carrier_from_proto(v1::Carrier::Unspecified as i32), Ok(CarrierKind::Quic));
        assert_eq!(carrier_from_proto(9), Err(9));
    }

    #[test]
    fn states_round_trip_and_unspecified_or_unknown_numbers_name_none() {
        for s in [NodeState::Up, NodeState::Down] {
            assert_eq!(node_state_from_proto(node_state_to_proto(s) as i32), Some(s));
        }
        let failed = StageState::Failed("out of memory".into());
        for s in [StageState::Pending, StageState::Loading, StageState::Ready, failed] {
            let error = if let StageState::Failed(e) = &s { e.clone() } else { String::new() };
            assert_eq!(stage_state_from_proto(stage_state_to_proto(&s) as i32, &error), Ok(s));
        }
        use DeploymentState as D;
        for s in [D::Loading, D::Replacing, D::Ready, D::Failed, D::Degraded] {
            assert_eq!(deployment_state_from_proto(deployment_state_to_proto(s) as i32), Some(s));
        }
        assert_eq!(node_state_from_proto(0), None);
        assert_eq!(node_state_from_proto(9), None);
        assert_eq!(stage_state_from_proto(0, ""), Err(0));
        assert_eq!(stage_state_from_proto(-3, ""), Err(-3));
        assert_eq!(deployment_state_from_proto(6), None);
        assert_eq!(deployment_state_name(v1::DeploymentState::Replacing as i32), "re-placing");
        assert_eq!(stage_state_name(v1::StageState::Failed as i32), "failed");
        assert_eq!((node_state_name(v1::NodeState::Down as i32), node_state_name(0)), ("down", "unknown"));
    }

    #[test]
    fn stop_reasons_round_trip_and_unknown_numbers_are_none() {
        use StopReason::*;
        for s in [Length, Eos, Context, Caller, Stop] {
            assert_eq!(stop_from_proto(stop_to_proto(s) as i32), Some(s));
        }
        assert_eq!((stop_from_proto(0), stop_from_proto(99)), (None, None));
    }

    #[test]
    fn devices_round_trip_and_bad_figures_are_refused() {
        let d = DeviceFigures {
            name: "cpu".into(),
            kind: DeviceKind::Cpu,
            model: "EPYC".into(),
            memory_total: 10,
            memory_free: 5,
            mem_bandwidth: 2e10,
            flops: 1e11,
            kernels: vec![KernelFigures { weight_type: "q4_k".into(), decode_bytes_per_s: 1e10, prompt_flops: 5e10 }],
            threads: 2,
            features: "avx2".into(),
            host_link: None,
        };
        assert_eq!(device_from_proto(&device_to_proto(&d)).unwrap(), d);
        let mut p = device_to_proto(&d);
        p.mem_bandwidth = f64::NAN;
        assert!(device_from_proto(&p).unwrap_err().contains("read bandwidth"));
        let mut p = device_to_proto(&d);
        p.kernels[0].decode_bytes_per_s = -1.0;
        assert!(device_from_proto(&p).unwrap_err().contains("q4_k"));
        let mut p = device_to_proto(&d);
        p.kind = 0;
        assert!(device_from_proto(&p).is_err());
    }

    #[test]
    fn sampling_round_trips_unset_fields_are_defaults_and_bad_ones_are_refused() {
        let p = SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 0.0,
            min_p: 0.0,
            repeat_penalty: 1.3,
            repeat_last_n: 0,
            frequency_penalty: -0.5,
            presence_penalty: 0.7,
            seed: u64::MAX,
        };
        // zeros are values, not "unset": top_p 0 stays 0
        assert_eq!(sampling_from_proto(Some(&sampling_to_proto(&p))).unwrap(), p);
        assert_eq!(sampling_from_proto(None).unwrap(), SamplingParams::default());
        let only = v1::Sampling { presence_penalty: Some(0.25), ..Default::default() };
        assert_eq!(
            sampling_from_proto(Some(&only)).unwrap(),
            SamplingParams { presence_penalty: 0.25, ..Default::default() }
        );
        let bad = v1::Sampling { repeat_penalty: Some(0.0), ..Default::default() };
        assert_eq!(sampling_from_proto(Some(&bad)).unwrap_err().field, "repeat_penalty");
    }
}
