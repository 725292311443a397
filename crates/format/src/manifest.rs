//! A model's files as byte ranges with SHA-256 checksums: what a coordinator hands out and a
//! worker verifies. Each file's header (GGUF: up to the start of the tensor data; safetensors:
//! the length prefix and JSON), each small file whole (a directory's JSON files), and one range
//! per tensor — a stacked expert tensor (`ffn_*_exps`) as one range per expert, so a node that
//! holds some experts fetches only theirs. A worker that holds the headers, the small files and its slice's tensors at their
//! offsets in files of the full size (a sparse copy) opens the model like the original.

use crate::index::ModelIndex;
use crate::tensors::{slice_tensors, LayerTensor};
use crate::FormatError;
use brigade_core::cluster::RangeRecord;
use brigade_core::LayerRange;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The files of a model (path relative to the model, size) and the checksummed ranges of their
/// bytes, in file order and by offset within a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    files: Vec<(String, u64)>,
    ranges: Vec<RangeRecord>,
}

/// A range to hash: file index, offset, length, tensor name (empty for headers and whole files).
struct Planned {
    file: usize,
    offset: u64,
    length: u64,
    tensor: String,
}

/// Separates a stacked expert tensor's name from an expert's id in the name of a range that
/// holds one expert's bytes of it (`blk.3.ffn_up_exps.weight#5`).
pub const EXPERT_SEP: char = '#';

/// The tensor a range holds bytes of: its name without an expert's `#E`.
pub fn range_tensor(tensor: &str) -> &str {
    tensor.split(EXPERT_SEP).next().unwrap_or(tensor)
}

/// The layer and the expert whose bytes a range holds: one expert's bytes of a stacked tensor
/// (`blk.3.ffn_up_exps.weight#5`) or an expert's own tensor (`blk.3.ffn_up.5.weight`, as a
/// checkpoint stores it); `None` for any other range.
pub fn expert_of_range(tensor: &str) -> Option<(usize, u32)> {
    match tensor.split_once(EXPERT_SEP) {
        Some((name, e)) => {
            let (layer, t) = LayerTensor::parse(name)?;
            t.is_experts().then_some(())?;
            Some((layer, e.parse().ok()?))
        }
        None => LayerTensor::parse_piece(tensor).and_then(|(layer, _, e)| Some((layer, u32::try_from(e).ok()?))),
    }
}

/// The SHA-256 of `bytes` in lower-case hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `bytes` are the content of `range`.
pub fn range_matches(range: &RangeRecord, bytes: &[u8]) -> bool {
    bytes.len() as u64 == range.length && sha256_hex(bytes) == range.sha256
}

impl Manifest {
    /// Hashes every range of an opened model (on every available core: a 1 GB model takes about
    /// a second).
    pub fn build(index: &ModelIndex) -> Manifest {
        let mut plan = Vec::new();
        for (fi, f) in index.files().iter().enumerate() {
            let Some(header) = f.header_len() else {
                plan.push(Planned { file: fi, offset: 0, length: f.len(), tensor: String::new() });
                continue;
            };
            plan.push(Planned { file: fi, offset: 0, length: header, tensor: String::new() });
            let mut tensors: Vec<_> = index.tensor_names().filter(|(_, t)| t.file() == fi).collect();
            tensors.sort_by_key(|(name, t)| (t.start(), t.end(), name.as_str()));
            for (name, t) in tensors {
                // a stacked expert tensor: one range per expert (expert-major, equal parts)
                let experts = match LayerTensor::parse(name) {
                    Some((_, lt)) if lt.is_experts() => t.shape().first().copied().unwrap_or(1),
                    _ => 1,
                };
                if experts > 1 && t.n_bytes().is_multiple_of(experts as u64) {
                    let each = t.n_bytes() / experts as u64;
                    plan.extend((0..experts).map(|e| Planned {
                        file: fi,
                        offset: t.start() + e as u64 * each,
                        length: each,
                        tensor: format!("{name}{EXPERT_SEP}{e}"),
                    }));
                } else {
                    plan.push(Planned { file: fi, offset: t.start(), length: t.n_bytes(), tensor: name.clone() });
                }
            }
        }
        let digests = hash_all(index, &plan);
        let ranges = plan
            .into_iter()
            .zip(digests)
            .map(|(p, sha256)| RangeRecord {
                file: index.files()[p.file].name().to_string(),
                offset: p.offset,
                length: p.length,
                sha256,
                tensor: p.tensor,
            })
            .collect();
        let files = index.files().iter().map(|f| (f.name().to_string(), f.len())).collect();
        Manifest { files, ranges }
    }

    /// Files (path relative to the model, size in bytes).
    pub fn files(&self) -> &[(String, u64)] {
        &self.files
    }

    pub fn ranges(&self) -> &[RangeRecord] {
        &self.ranges
    }

    /// A content id: the SHA-256 (hex) of the files' names and sizes and every range's place,
    /// tensor and checksum. Equal models have equal ids whatever their paths.
    pub fn id(&self) -> String {
        let mut h = Sha256::new();
        let mut field = |bytes: &[u8]| {
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        field(b"brigade manifest v1");
        for (name, size) in &self.files {
            field(name.as_bytes());
            field(&size.to_le_bytes());
        }
        for r in &self.ranges {
            for part in [r.file.as_bytes(), &r.offset.to_le_bytes(), &r.length.to_le_bytes(), r.sha256.as_bytes()] {
                field(part);
            }
            field(r.tensor.as_bytes());
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The ranges a holder of `tensors` needs: every header and small file, and those tensors.
    pub fn ranges_for(&self, tensors: &[String]) -> Result<Vec<RangeRecord>, FormatError> {
        let known: HashSet<&str> =
            self.ranges.iter().map(|r| range_tensor(&r.tensor)).filter(|t| !t.is_empty()).collect();
        if let Some(missing) = tensors.iter().find(|t| !known.contains(t.as_str())) {
            return Err(FormatError::MissingTensor(missing.clone()));
        }
        let wanted: HashSet<&str> = tensors.iter().map(String::as_str).collect();
        Ok(self
            .ranges
            .iter()
            .filter(|r| r.tensor.is_empty() || wanted.contains(range_tensor(&r.tensor)))
            .cloned()
            .collect())
    }

    /// The ranges a slice of `layers` needs ([`slice_tensors`] plus headers and small files).
    /// `index` is the model this manifest was built from.
    pub fn slice_ranges(&self, index: &ModelIndex, layers: LayerRange) -> Result<Vec<RangeRecord>, FormatError> {
        self.ranges_for(&slice_tensors(index, layers)?)
    }
}

/// Below this many bytes a model is hashed on the calling thread.
const PARALLEL_FROM_BYTES: u64 = 16 << 20;

/// The digests of `plan`, in order, hashed by as many threads as there are cores (ranges are
/// handed out one at a time, so a large tensor does not hold up the others).
fn hash_all(index: &ModelIndex, plan: &[Planned]) -> Vec<String> {
    let bytes = |p: &Planned| -> &[u8] {
        let file = index.files()[p.file].bytes();
        // the index checked every range against its file
        let range = usize::try_from(p.offset).ok().zip(usize::try_from(p.offset + p.length).ok());
        range.and_then(|(s, e)| file.get(s..e)).unwrap_or_default()
    };
    let total = plan.iter().fold(0u64, |t, p| t.saturating_add(p.length));
    if total < PARALLEL_FROM_BYTES {
        return plan.iter().map(|p| sha256_hex(bytes(p))).collect();
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, plan.len().max(1));
    let next = AtomicUsize::new(0);
    let mut out = vec![String::new(); plan.len()];
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(p) = plan.get(i) else { break done };
                        done.push((i, sha256_hex(bytes(p))));
                    }
                })
            })
            .collect();
        for w in workers {
            match w.join() {
                Ok(done) => done.into_iter().for_each(|(i, d)| out[i] = d),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    out
}
