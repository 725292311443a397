//! Models the coordinator serves: opened from its own disk (or the model compiled into brigade),
//! read only through `brigade-format` (headers, tensor table, tokenizer — never candle), hashed
//! once into a manifest of checksummed ranges, and served range by range to workers that fetch
//! their slice.

use crate::CoordError;
use brigade_core::cluster::{ExpertIds, ModelRecord, RangeRecord};
use brigade_core::LayerRange;
use brigade_format::manifest::{expert_of_range, range_tensor, Manifest};
use brigade_format::ModelIndex;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The name a deploy request uses for the model compiled into brigade.
pub const EMBEDDED: &str = "embedded";

/// Bytes of the files of one model, mapped.
struct Mapped {
    files: HashMap<String, memmap2::Mmap>,
}

#[derive(Default)]
pub struct Models {
    /// Where `deploy -m` may read (canonical); `None`: anywhere this process may read.
    root: Option<PathBuf>,
    /// Manifests made in this process, by (canonical path, size, mtime): a model is hashed once.
    made: Mutex<HashMap<(PathBuf, u64, i64), ModelRecord>>,
    mapped: Mutex<HashMap<String, Arc<Mapped>>>,
}

/// The planner's profile of a model for a cluster of CPUs and GPUs: weights as a CPU stage holds
/// them (quantized tensors as stored; on a GPU a float file's layers may take less), and the KV
/// cache in the type each kind of device allocates it in, as the worker does: f32 on a CPU; on a
/// GPU the model's float type, or bf16 for a quantized model (`brigade_model::device`'s rule).
pub fn cluster_profile(index: &ModelIndex) -> brigade_core::ModelProfile {
    let cfg = index.config();
    let gpu_elem = index.dense_type().map_or(2, |t| t.type_size() as u64);
    let mut p = index.device_profile(4, true, 4);
    p.kv_bytes_per_token = cfg.kv_bytes_per_token_layer(gpu_elem);
    p.cpu_kv_bytes_per_token = Some(cfg.kv_bytes_per_token_layer(4));
    p
}

fn record(index: &ModelIndex, manifest: &Manifest, id: String, name: String, source: String) -> ModelRecord {
    let cfg = index.config();
    ModelRecord {
        id,
        name,
        source,
        files: manifest.files().to_vec(),
        ranges: manifest.ranges().to_vec(),
        n_layers: cfg.n_layers,
        context_length: cfg.context_length,
        profile: cluster_profile(index),
        weight_types: index.weight_types().into_iter().map(|(t, b)| (t.name().to_string(), b)).collect(),
        experts: cfg.moe.map_or(0, |m| m.experts),
    }
}

impl Models {
    /// Models read only from under `root` (`--models-dir`), when given.
    pub fn new(root: Option<&Path>) -> Result<Self, CoordError> {
        let root = root
            .map(|r| {
                std::fs::canonicalize(r)
                    .map_err(|e| CoordError::BadRequest(format!("--models-dir {}: {e}", r.display())))
            })
            .transpose()?;
        Ok(Self { root, ..Self::default() })
    }

    /// The record of the model a deploy request names: `embedded`, or a path on this machine —
    /// under the models directory when there is one (a relative path is taken from it), and a
    /// GGUF file or a model directory, opened without blocking. Errors never quote the file.
    pub fn resolve(&self, model: &str) -> Result<ModelRecord, CoordError> {
        if model == EMBEDDED || model.is_empty() {
            let index = ModelIndex::embedded()?;
            let manifest = Manifest::build(&index);
            return Ok(record(&index, &manifest, EMBEDDED.into(), "stories260K".into(), EMBEDDED.into()));
        }
        let named = match &self.root {
            Some(root) => root.join(model),
            None => PathBuf::from(model),
        };
        let path = std::fs::canonicalize(&named).map_err(|e| {
            CoordError::BadRequest(format!("model `{model}`: {e} (the path is read on the coordinator's machine)"))
        })?;
        if let Some(root) = &self.root {
            if !path.starts_with(root) {
                return Err(CoordError::PermissionDenied(format!(
                    "model `{model}` is outside the models directory {} (--models-dir)",
                    root.display()
                )));
            }
        }
        let meta = std::fs::metadata(&path).map_err(|e| CoordError::io(&path, e))?;
        if !meta.is_file() && !meta.is_dir() {
            return Err(CoordError::BadRequest(format!(
                "model `{model}` is neither a regular file nor a model directory"
            )));
        }
        let mtime = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs() as i64)
            .unwrap_or(0);
        let key = (path.clone(), meta.len(), mtime);
        if let Some(r) = self.made.lock().ok().and_then(|m| m.get(&key).cloned()) {
            return Ok(r);
        }
        let t0 = std::time::Instant::now();
        let index = ModelIndex::open(&path)?;
        let manifest = Manifest::build(&index);
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| model.to_string());
        let r = record(&index, &manifest, manifest.id(), name, path.display().to_string());
        tracing::info!(
            "model {} hashed in {:.2}s: {} ranges, id {}",
            path.display(),
            t0.elapsed().as_secs_f64(),
            r.ranges.len(),
            &r.id[..12.min(r.id.len())]
        );
        if let Ok(mut m) = self.made.lock() {
            m.insert(key, r.clone());
        }
        Ok(r)
    }

    fn mapped(&self, m: &ModelRecord) -> Result<Arc<Mapped>, CoordError> {
        if let Some(x) = self.mapped.lock().ok().and_then(|x| x.get(&m.id).cloned()) {
            return Ok(x);
        }
        let src = Path::new(&m.source);
        let mut files = HashMap::new();
        for (name, size) in &m.files {
            // a GGUF's source is the file itself; a directory's, its folder
            let p = if src.is_dir() { src.join(name) } else { src.to_path_buf() };
            let f = std::fs::File::open(&p).map_err(|e| CoordError::io(&p, e))?;
            let len = f.metadata().map_err(|e| CoordError::io(&p, e))?.len();
            if len != *size {
                return Err(CoordError::FailedPrecondition(format!(
                    "{} is {len} bytes now, {size} when it was deployed: redeploy it",
                    p.display()
                )));
            }
            let map = brigade_format::index::map_readonly(&f).map_err(|e| CoordError::io(&p, e))?;
            files.insert(name.clone(), map);
        }
        let x = Arc::new(Mapped { files });
        if let Ok(mut all) = self.mapped.lock() {
            all.insert(m.id.clone(), x.clone());
        }
        Ok(x)
    }

    /// Bytes `[offset, offset + length)` of a model file, if they are one of the model's ranges (a
    /// worker may read what its manifest lists, and nothing else of this machine's disk).
    pub fn read(&self, m: &ModelRecord, file: &str, offset: u64, length: u64) -> Result<Vec<u8>, CoordError> {
        if !m.ranges.iter().any(|r| r.file == file && r.offset == offset && r.length == length) {
            return Err(CoordError::PermissionDenied(format!(
                "{file} bytes {offset}+{length} are not a range of model {}",
                m.name
            )));
        }
        if m.source == EMBEDDED {
            let b = brigade_format::embedded_model();
            return Ok(b[offset as usize..(offset + length) as usize].to_vec());
        }
        let x = self.mapped(m)?;
        let map =
            x.files.get(file).ok_or_else(|| CoordError::NotFound(format!("model {} has no file {file}", m.name)))?;
        let end = offset.checked_add(length).filter(|e| *e <= map.len() as u64).ok_or_else(|| {
            CoordError::FailedPrecondition(format!("{file} is shorter than the manifest says: redeploy it"))
        })?;
        Ok(map[offset as usize..end as usize].to_vec())
    }
}

/// The ranges a slice needs of a model: headers and small files, and the slice's tensors.
/// The ranges an expert stage holding experts `ids` of `layers` fetches: the headers and those
/// experts' bytes.
pub fn expert_ranges(m: &ModelRecord, layers: LayerRange, ids: ExpertIds) -> Vec<RangeRecord> {
    let held = |t: &str| expert_of_range(t).is_some_and(|(l, e)| layers.contains(l) && ids.range().contains(&e));
    m.ranges.iter().filter(|r| r.tensor.is_empty() || held(&r.tensor)).cloned().collect()
}

/// Bytes of the routed experts `ids` of `layers`.
pub fn expert_bytes(m: &ModelRecord, layers: LayerRange, ids: ExpertIds) -> u64 {
    let held = |t: &str| expert_of_range(t).is_some_and(|(l, e)| layers.contains(l) && ids.range().contains(&e));
    m.ranges.iter().filter(|r| held(&r.tensor)).map(|r| r.length).sum()
}

/// The ranges a stage of `layers` fetches: the headers and its layers' tensors, less the experts
/// `elsewhere` holds (the expert stages of those layers).
pub fn slice_ranges(m: &ModelRecord, layers: LayerRange, elsewhere: &[(LayerRange, ExpertIds)]) -> Vec<RangeRecord> {
    let names = m.ranges.iter().filter(|r| !r.tensor.is_empty()).map(|r| range_tensor(&r.tensor));
    let want: std::collections::HashSet<String> =
        brigade_format::slice_tensor_names(names, m.n_layers, layers).unwrap_or_default().into_iter().collect();
    let away = |t: &str| {
        expert_of_range(t)
            .is_some_and(|(l, e)| elsewhere.iter().any(|(ls, ids)| ls.contains(l) && ids.range().contains(&e)))
    };
    m.ranges
        .iter()
        .filter(|r| r.tensor.is_empty() || (want.contains(range_tensor(&r.tensor)) && !away(&r.tensor)))
        .cloned()
        .collect()
}
