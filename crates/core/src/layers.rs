use crate::{CoreError, DeviceId};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A contiguous half-open range `[start, end)` of transformer layers; never empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "(usize, usize)", into = "(usize, usize)")]
pub struct LayerRange {
    start: usize,
    end: usize,
}

impl LayerRange {
    /// The layers `[start, end)`; [`CoreError::EmptyRange`] unless `start < end`.
    pub fn new(start: usize, end: usize) -> Result<Self, CoreError> {
        if start >= end {
            return Err(CoreError::EmptyRange { start, end });
        }
        Ok(Self { start, end })
    }
    /// The first layer of the range.
    pub fn start(&self) -> usize {
        self.start
    }
    /// One past the last layer of the range.
    pub fn end(&self) -> usize {
        self.end
    }
    /// Layers in the range (at least 1).
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    /// Always false: an empty range cannot be built. Present for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        false
    }
    /// Whether layer `layer` is in `[start, end)`.
    pub fn contains(&self, layer: usize) -> bool {
        (self.start..self.end).contains(&layer)
    }
    /// The layer indices of the range, in order.
    pub fn iter(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }
    /// Whether this range holds the embedding (the first layer of the model).
    pub fn is_first(&self) -> bool {
        self.start == 0
    }
    /// Whether this range holds the final norm and head of a model of `n_layers` layers.
    pub fn is_last(&self, n_layers: usize) -> bool {
        self.end == n_layers
    }
}

impl TryFrom<(usize, usize)> for LayerRange {
    type Error = CoreError;
    fn try_from((a, b): (usize, usize)) -> Result<Self, CoreError> {
        LayerRange::new(a, b)
    }
}

impl From<LayerRange> for (usize, usize) {
    fn from(r: LayerRange) -> Self {
        (r.start, r.end)
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}, {})", self.start, self.end)
    }
}

/// One stage of a pipeline on one box: a device and the layers it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    /// The device that runs the stage.
    pub device: DeviceId,
    /// The layers it holds.
    pub layers: LayerRange,
}

/// Consecutive layer counts placed on devices in order, as `--device-map cpu:10,cuda0:22` says.
///
/// Every layer of the model is placed exactly once and in order; a device may appear more than
/// once (`cpu:3,cpu:2` is two CPU stages, each with its own slice and KV cache).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceMap {
    entries: Vec<(DeviceId, usize)>,
}

impl DeviceMap {
    /// Parses `dev:count[,dev:count…]`. Counts are checked against the model later
    /// ([`DeviceMap::stages`]); here only the syntax and nonzero counts.
    pub fn parse(s: &str) -> Result<Self, CoreError> {
        let mut entries = Vec::new();
        for entry in s.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (dev, count) = entry.rsplit_once(':').ok_or_else(|| CoreError::BadDeviceMapEntry {
                entry: entry.to_string(),
                why: "expected DEVICE:LAYERS, for example cpu:10".into(),
            })?;
            let device: DeviceId = dev.parse()?;
            let count: usize = count.parse().map_err(|_| CoreError::BadDeviceMapEntry {
                entry: entry.to_string(),
                why: format!("`{count}` is not a layer count"),
            })?;
            if count == 0 {
                return Err(CoreError::BadDeviceMapEntry {
                    entry: entry.to_string(),
                    why: "a stage needs at least one layer".into(),
                });
            }
            entries.push((device, count));
        }
        if entries.is_empty() {
            return Err(CoreError::EmptyDeviceMap);
        }
        Ok(Self { entries })
    }

    /// Builds a map from explicit entries (counts must be nonzero).
    pub fn from_entries(entries: Vec<(DeviceId, usize)>) -> Result<Self, CoreError> {
        if entries.is_empty() {
            return Err(CoreError::EmptyDeviceMap);
        }
        if let Some((d, _)) = entries.iter().find(|(_, n)| *n == 0) {
            return Err(CoreError::BadDeviceMapEntry {
                entry: format!("{d}:0"),
                why: "a stage needs at least one layer".into(),
            });
        }
        Ok(Self { entries })
    }

    /// llama.cpp's `-ngl N`: the last `n_gpu` layers (and the head) on `gpu`, the rest on the CPU.
    /// `n_gpu` above `n_layers` is clamped, as llama.cpp does.
    pub fn n_gpu_layers(n_layers: usize, n_gpu: usize, gpu: DeviceId) -> Result<Self, CoreError> {
        let n_gpu = n_gpu.min(n_layers);
        let mut entries = Vec::new();
        if n_layers - n_gpu > 0 {
            entries.push((DeviceId::Cpu, n_layers - n_gpu));
        }
        if n_gpu > 0 {
            entries.push((gpu, n_gpu));
        }
        Self::from_entries(entries)
    }

    /// The (device, layer count) entries in pipeline order; every count is nonzero.
    pub fn entries(&self) -> &[(DeviceId, usize)] {
        &self.entries
    }

    /// The stages for a model of `n_layers` layers; an error unless the counts sum to it.
    pub fn stages(&self, n_layers: usize) -> Result<Vec<Stage>, CoreError> {
        let placed: usize = self.entries.iter().map(|(_, n)| n).sum();
        if placed != n_layers {
            return Err(CoreError::LayerCountMismatch { placed, n_layers });
        }
        let mut start = 0;
        let mut out = Vec::with_capacity(self.entries.len());
        for &(device, n) in &self.entries {
            out.push(Stage { device, layers: LayerRange::new(start, start + n)? });
            start += n;
        }
        Ok(out)
    }
}

impl fmt::Display for DeviceMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (d, n)) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}:{n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert!(LayerRange::new(3, 3).is_err());
        assert!(LayerRange::new(4, 3).is_err());
        let r = LayerRange::new(0, 5).unwrap();
        assert!(r.is_first() && r.is_last(5) && !r.is_last(6));
        assert_eq!(r.len(), 5);
        assert!(serde_json::from_str::<LayerRange>("[5,2]").is_err());
        assert_eq!(serde_json::to_string(&r).unwrap(), "[0,5]");
    }

    #[test]
    fn device_maps() {
        let m = DeviceMap::parse("cpu:3, cpu:2").unwrap();
        let s = m.stages(5).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[1].layers, LayerRange::new(3, 5).unwrap());
        assert_eq!(m.stages(6), Err(CoreError::LayerCountMismatch { placed: 5, n_layers: 6 }));
        assert!(DeviceMap::parse("cpu:0").is_err());
        assert!(DeviceMap::parse("cpu").is_err());
        assert!(DeviceMap::parse("tpu:3").is_err());
        assert!(DeviceMap::parse("").is_err());
        assert_eq!(DeviceMap::parse("cpu:10,cuda0:22").unwrap().to_string(), "cpu:10,cuda0:22");
    }

    #[test]
    fn ngl_shorthand() {
        let m = DeviceMap::n_gpu_layers(32, 8, DeviceId::Cuda(0)).unwrap();
        assert_eq!(m.to_string(), "cpu:24,cuda0:8");
        assert_eq!(DeviceMap::n_gpu_layers(32, 0, DeviceId::Cuda(0)).unwrap().to_string(), "cpu:32");
        assert_eq!(DeviceMap::n_gpu_layers(32, 99, DeviceId::Cuda(0)).unwrap().to_string(), "cuda0:32");
    }
}
