use crate::CoreError;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The kind of a compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The host's CPU.
    Cpu,
    /// An NVIDIA GPU driven through CUDA.
    Cuda,
}

/// A compute device of one host: the CPU, or a CUDA device by ordinal.
///
/// Spelled `cpu` and `cuda0`, `cuda1`, … (`cuda:0` and `cuda` = `cuda0` are accepted too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceId {
    /// The host's CPU (`cpu`).
    Cpu,
    /// The CUDA device of this ordinal (`cuda0`, `cuda1`, …).
    Cuda(u32),
}

impl DeviceId {
    /// Whether this is the CPU or a CUDA device.
    pub fn kind(&self) -> DeviceKind {
        match self {
            DeviceId::Cpu => DeviceKind::Cpu,
            DeviceId::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Cpu => f.write_str("cpu"),
            DeviceId::Cuda(i) => write!(f, "cuda{i}"),
        }
    }
}

impl FromStr for DeviceId {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        if t == "cpu" {
            return Ok(DeviceId::Cpu);
        }
        if let Some(rest) = t.strip_prefix("cuda") {
            let rest = rest.strip_prefix(':').unwrap_or(rest);
            if rest.is_empty() {
                return Ok(DeviceId::Cuda(0));
            }
            if let Ok(i) = rest.parse::<u32>() {
                return Ok(DeviceId::Cuda(i));
            }
        }
        Err(CoreError::UnknownDevice(s.to_string()))
    }
}

impl Serialize for DeviceId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        assert_eq!("cpu".parse::<DeviceId>(), Ok(DeviceId::Cpu));
        assert_eq!("CUDA1".parse::<DeviceId>(), Ok(DeviceId::Cuda(1)));
        assert_eq!("cuda:2".parse::<DeviceId>(), Ok(DeviceId::Cuda(2)));
        assert_eq!("cuda".parse::<DeviceId>(), Ok(DeviceId::Cuda(0)));
        assert!("gpu0".parse::<DeviceId>().is_err());
        assert!("cuda-1".parse::<DeviceId>().is_err());
        assert_eq!(DeviceId::Cuda(3).to_string(), "cuda3");
        let j = serde_json::to_string(&DeviceId::Cuda(0)).unwrap();
        assert_eq!(j, "\"cuda0\"");
        assert_eq!(serde_json::from_str::<DeviceId>(&j).unwrap(), DeviceId::Cuda(0));
    }
}
