//! Where a model's tensors live: one GGUF file or a Hugging Face safetensors directory, mapped
//! into memory. Tensors are addressed by llama.cpp's GGUF names (`blk.3.attn_q.weight`);
//! safetensors names are translated once, when the directory is opened. A slice asks only for its
//! own tensors, so only their pages are ever read.

use crate::config::ModelConfig;
use crate::gguf::{self, Gguf};
use crate::tokenizer::Tokenizer;
use crate::ModelError;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bytes a model is read from: a memory map, or bytes compiled into the binary.
pub enum Bytes {
    Mmap(memmap2::Mmap),
    Static(&'static [u8]),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Static(s) => s,
        }
    }
}

fn map_file(path: &Path) -> Result<Bytes, ModelError> {
    let f = std::fs::File::open(path).map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
    // SAFETY: the map is read-only; a file truncated under us by another process is the one
    // hazard of any memory map, as in llama.cpp and candle.
    let m = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| ModelError::Io(path.to_path_buf(), e))?;
    Ok(Bytes::Mmap(m))
}

/// The element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredType {
    Ggml(GgmlDType),
    F32,
    F16,
    BF16,
}

impl StoredType {
    pub fn name(&self) -> &'static str {
        match self {
            StoredType::Ggml(d) => gguf::dtype_name(*d),
            StoredType::F32 => "f32",
            StoredType::F16 => "f16",
            StoredType::BF16 => "bf16",
        }
    }
}

#[derive(Debug, Clone)]
pub struct StoredTensor {
    /// candle order: outermost first.
    pub shape: Vec<usize>,
    pub ty: StoredType,
    file: usize,
    start: usize,
    end: usize,
}

impl StoredTensor {
    pub fn n_bytes(&self) -> u64 {
        (self.end - self.start) as u64
    }

    /// The ggml type the bytes are, whatever the file format.
    pub fn ggml_type(&self) -> GgmlDType {
        match self.ty {
            StoredType::Ggml(d) => d,
            StoredType::F32 => GgmlDType::F32,
            StoredType::F16 => GgmlDType::F16,
            StoredType::BF16 => GgmlDType::BF16,
        }
    }

    pub fn is_float(&self) -> bool {
        matches!(self.ggml_type(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Safetensors,
}

/// An opened model: configuration, tokenizer, and the table of its tensors.
pub struct ModelFiles {
    pub format: Format,
    pub config: Arc<ModelConfig>,
    pub tokenizer: Arc<Tokenizer>,
    files: Vec<Bytes>,
    tensors: HashMap<String, StoredTensor>,
    pub source: String,
    /// GGUF header, when the model is a GGUF file.
    pub gguf: Option<Gguf>,
}

/// A matrix multiply by a stored weight `[out, in]`, quantized or dense, plus an optional bias.
#[derive(Debug, Clone)]
pub struct Linear {
    w: LinearWeight,
    bias: Option<Tensor>,
}

#[derive(Debug, Clone)]
enum LinearWeight {
    Quant(Arc<QTensor>),
    Dense(Tensor),
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            LinearWeight::Quant(q) if x.device().is_cpu() => {
                x.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&crate::cpu_matmul::CpuMatMul(q.clone()))?
            }
            LinearWeight::Quant(q) => match x.apply_op1_no_bwd(q.as_ref()) {
                Ok(y) => y,
                // candle's CUDA fast paths take bf16/f16 activations for most quant types; its
                // fallbacks take only f32
                Err(_) if x.dtype() != DType::F32 => {
                    x.to_dtype(DType::F32)?.apply_op1_no_bwd(q.as_ref())?.to_dtype(x.dtype())?
                }
                Err(e) => return Err(e),
            },
            LinearWeight::Dense(w) => x.broadcast_matmul(&w.t()?)?,
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    pub fn out_features(&self) -> usize {
        match &self.w {
            LinearWeight::Quant(q) => q.shape().dims()[0],
            LinearWeight::Dense(w) => w.dims()[0],
        }
    }

    pub fn storage_bytes(&self) -> u64 {
        let w = match &self.w {
            LinearWeight::Quant(q) => q.storage_size_in_bytes() as u64,
            LinearWeight::Dense(w) => (w.elem_count() * w.dtype().size_in_bytes()) as u64,
        };
        w + self.bias.as_ref().map(|b| (b.elem_count() * b.dtype().size_in_bytes()) as u64).unwrap_or(0)
    }

    pub(crate) fn from_embedding(e: &Embedding) -> Linear {
        match e {
            Embedding::Quant(q) => Linear { w: LinearWeight::Quant(q.clone()), bias: None },
            Embedding::Dense(t) => Linear { w: LinearWeight::Dense(t.clone()), bias: None },
        }
    }
}

/// The token embedding; quantized tables stay quantized and only looked-up rows are expanded.
#[derive(Debug, Clone)]
pub enum Embedding {
    Quant(Arc<QTensor>),
    Dense(Tensor),
}

impl Embedding {
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Embedding::Quant(q) => q.embedding(ids),
            Embedding::Dense(t) => {
                let mut dims = ids.dims().to_vec();
                dims.push(t.dim(1)?);
                t.index_select(&ids.flatten_all()?, 0)?.reshape(dims)
            }
        }
    }

    pub fn storage_bytes(&self) -> u64 {
        match self {
            Embedding::Quant(q) => q.storage_size_in_bytes() as u64,
            Embedding::Dense(t) => (t.elem_count() * t.dtype().size_in_bytes()) as u64,
        }
    }
}

/// Runs `f` on `data` placed at an 8-byte-aligned address: candle's quantized storage
/// reinterprets the bytes as blocks (f16/f32 fields) and asserts their alignment, which a GGUF
/// with a small `general.alignment` or bytes compiled into the binary need not have.
fn with_aligned<R>(data: &[u8], f: impl FnOnce(&[u8]) -> R) -> R {
    if (data.as_ptr() as usize).is_multiple_of(8) {
        return f(data);
    }
    let mut v = vec![0u64; data.len().div_ceil(8)];
    // SAFETY: the u64 buffer is viewed as bytes within its own length.
    let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, data.len()) };
    bytes.copy_from_slice(data);
    f(bytes)
}

impl ModelFiles {
    /// Opens a GGUF file or a Hugging Face directory (with `config.json`, `tokenizer.json` and
    /// `*.safetensors`).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        if path.is_dir() {
            return Self::open_safetensors_dir(path);
        }
        let bytes = map_file(path)?;
        Self::from_gguf_bytes(bytes, path.display().to_string())
    }

    /// Opens a GGUF held in memory (the model compiled into the binary).
    pub fn from_static_gguf(bytes: &'static [u8], name: &str) -> Result<Self, ModelError> {
        Self::from_gguf_bytes(Bytes::Static(bytes), name.to_string())
    }

    fn from_gguf_bytes(bytes: Bytes, source: String) -> Result<Self, ModelError> {
        let g = Gguf::parse(&bytes)?;
        let mut tensors = HashMap::with_capacity(g.tensors.len());
        for t in &g.tensors {
            tensors.insert(
                t.name.clone(),
                StoredTensor {
                    shape: t.shape(),
                    ty: StoredType::Ggml(t.dtype),
                    file: 0,
                    start: t.offset as usize,
                    end: (t.offset + t.n_bytes) as usize,
                },
            );
        }
        let rope_freqs = match g.tensor("rope_freqs.weight") {
            Some(t) if t.dtype == GgmlDType::F32 => {
                let d = g.tensor_data(&bytes, t);
                Some(d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            Some(t) => {
                return Err(ModelError::BadTensor {
                    name: t.name.clone(),
                    why: format!("rope_freqs must be f32, found {}", gguf::dtype_name(t.dtype)),
                })
            }
            None => None,
        };
        let config = ModelConfig::from_gguf(&g, rope_freqs)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let files = vec![bytes];
        let mf = ModelFiles {
            format: Format::Gguf,
            config: Arc::new(config),
            tokenizer: Arc::new(tokenizer),
            files,
            tensors,
            source,
            gguf: Some(g),
        };
        mf.check_tensors()?;
        Ok(mf)
    }

    fn open_safetensors_dir(dir: &Path) -> Result<Self, ModelError> {
        let read = |name: &str| -> Result<String, ModelError> {
            let p = dir.join(name);
            std::fs::read_to_string(&p).map_err(|e| ModelError::Io(p, e))
        };
        let config_text = read("config.json")?;
        let config = ModelConfig::from_hf_json(&config_text)?;
        let tok_path = dir.join("tokenizer.json");
        let tok_bytes = std::fs::read(&tok_path).map_err(|e| ModelError::Io(tok_path.clone(), e))?;
        let tok_config = read("tokenizer_config.json").ok();
        let tokenizer = Tokenizer::from_hf(&tok_bytes, tok_config.as_deref(), Some(&config_text))?;

        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io(dir.to_path_buf(), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(ModelError::Format(format!("{}: no *.safetensors files", dir.display())));
        }
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        for (fi, p) in paths.iter().enumerate() {
            let bytes = map_file(p)?;
            let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes)
                .map_err(|e| ModelError::Format(format!("{}: {e}", p.display())))?;
            let base = 8 + n;
            for (name, info) in meta.tensors() {
                let ty = match info.dtype {
                    safetensors::Dtype::F32 => StoredType::F32,
                    safetensors::Dtype::F16 => StoredType::F16,
                    safetensors::Dtype::BF16 => StoredType::BF16,
                    other => {
                        return Err(ModelError::BadTensor {
                            name,
                            why: format!("dtype {other:?} is not supported (F32, F16, BF16 are)"),
                        })
                    }
                };
                let Some(gname) = hf_to_gguf_name(&name) else {
                    continue;
                };
                let (s, e) = info.data_offsets;
                tensors.insert(
                    gname,
                    StoredTensor { shape: info.shape.clone(), ty, file: fi, start: base + s, end: base + e },
                );
            }
            files.push(bytes);
        }
        let mf = ModelFiles {
            format: Format::Safetensors,
            config: Arc::new(config),
            tokenizer: Arc::new(tokenizer),
            files,
            tensors,
            source: dir.display().to_string(),
            gguf: None,
        };
        mf.check_tensors()?;
        Ok(mf)
    }

    /// Every tensor a full model needs is present with the shape the configuration implies.
    fn check_tensors(&self) -> Result<(), ModelError> {
        let c = &self.config;
        let (h, q, kv, f, v) = (c.hidden, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim, c.ffn, c.vocab);
        let mut expect: Vec<(String, Vec<usize>)> =
            vec![("token_embd.weight".into(), vec![v, h]), ("output_norm.weight".into(), vec![h])];
        if self.tensors.contains_key("output.weight") {
            expect.push(("output.weight".into(), vec![v, h]));
        }
        for i in 0..c.n_layers {
            let b = |n: &str| format!("blk.{i}.{n}");
            expect.extend([
                (b("attn_norm.weight"), vec![h]),
                (b("attn_q.weight"), vec![q, h]),
                (b("attn_k.weight"), vec![kv, h]),
                (b("attn_v.weight"), vec![kv, h]),
                (b("attn_output.weight"), vec![h, q]),
                (b("ffn_norm.weight"), vec![h]),
                (b("ffn_gate.weight"), vec![f, h]),
                (b("ffn_up.weight"), vec![f, h]),
                (b("ffn_down.weight"), vec![h, f]),
            ]);
            if c.qkv_bias {
                expect.extend([
                    (b("attn_q.bias"), vec![q]),
                    (b("attn_k.bias"), vec![kv]),
                    (b("attn_v.bias"), vec![kv]),
                ]);
            }
        }
        for (name, shape) in expect {
            let t = self.tensors.get(&name).ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
            if t.shape != shape {
                return Err(ModelError::BadTensor {
                    name,
                    why: format!("shape {:?}, the configuration implies {:?}", t.shape, shape),
                });
            }
        }
        Ok(())
    }

    pub fn tensor_info(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = (&String, &StoredTensor)> {
        self.tensors.iter()
    }

    fn data(&self, t: &StoredTensor) -> &[u8] {
        &self.files[t.file][t.start..t.end]
    }

    fn stored(&self, name: &str) -> Result<&StoredTensor, ModelError> {
        self.tensors.get(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// A dense tensor in `dtype` on `device` (any stored type is converted).
    pub fn dense(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor, ModelError> {
        let t = self.stored(name)?;
        let data = self.data(t);
        let cpu = match t.ty {
            StoredType::F32 => Tensor::from_raw_buffer(data, DType::F32, &t.shape, &Device::Cpu)?,
            StoredType::F16 => Tensor::from_raw_buffer(data, DType::F16, &t.shape, &Device::Cpu)?,
            StoredType::BF16 => Tensor::from_raw_buffer(data, DType::BF16, &t.shape, &Device::Cpu)?,
            StoredType::Ggml(GgmlDType::F32) => Tensor::from_raw_buffer(data, DType::F32, &t.shape, &Device::Cpu)?,
            StoredType::Ggml(GgmlDType::F16) => Tensor::from_raw_buffer(data, DType::F16, &t.shape, &Device::Cpu)?,
            StoredType::Ggml(GgmlDType::BF16) => Tensor::from_raw_buffer(data, DType::BF16, &t.shape, &Device::Cpu)?,
            StoredType::Ggml(_) => self.qtensor(name, &Device::Cpu)?.dequantize(&Device::Cpu)?,
        };
        Ok(cpu.to_dtype(dtype)?.to_device(device)?)
    }

    fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor, ModelError> {
        let t = self.stored(name)?;
        let storage = with_aligned(self.data(t), |d| QStorage::from_data(Cow::Borrowed(d), device, t.ggml_type()))?;
        Ok(QTensor::new(storage, t.shape.as_slice())?)
    }

    /// Whether a tensor stays in its stored form on a device: always on the CPU (brigade's own
    /// matmul reads every ggml type, see [`crate::cpu_matmul`]); on a GPU when quantized (float
    /// weights there become dense tensors in the activation type for cuBLAS).
    fn keeps_stored_form(t: &StoredTensor, on_cpu: bool) -> bool {
        on_cpu || !t.is_float()
    }

    /// A weight `[out, in]` for matrix multiplies, in the form [`ModelFiles::keeps_stored_form`]
    /// says; plus its bias (dense).
    pub fn linear(&self, name: &str, bias: Option<&str>, device: &Device, dtype: DType) -> Result<Linear, ModelError> {
        let t = self.stored(name)?;
        let w = if Self::keeps_stored_form(t, device.is_cpu()) {
            LinearWeight::Quant(Arc::new(self.qtensor(name, device)?))
        } else {
            LinearWeight::Dense(self.dense(name, device, dtype)?)
        };
        let bias = match bias {
            Some(b) => Some(self.dense(b, device, dtype)?),
            None => None,
        };
        Ok(Linear { w, bias })
    }

    /// Several weights with the same input, stacked into one `[Σ out, in]` matmul (q/k/v, or
    /// gate/up): one kernel launch and one pass over the activations instead of several. `None`
    /// when their stored types differ (llama.cpp's Q4_K_M stores v as q6_k), so they cannot
    /// share one quantized tensor.
    pub fn linear_stacked(
        &self,
        names: &[&str],
        biases: Option<&[&str]>,
        device: &Device,
        dtype: DType,
    ) -> Result<Option<Linear>, ModelError> {
        let parts: Vec<&StoredTensor> = names.iter().map(|n| self.stored(n)).collect::<Result<_, _>>()?;
        let ty = parts[0].ty;
        let cols = parts[0].shape.get(1).copied();
        if parts.iter().any(|t| t.ty != ty || t.shape.len() != 2 || t.shape.get(1).copied() != cols) {
            return Ok(None);
        }
        let rows: usize = parts.iter().map(|t| t.shape[0]).sum();
        let cols = cols.unwrap_or(0);
        let w = if Self::keeps_stored_form(parts[0], device.is_cpu()) {
            // rows are contiguous in every ggml type: stacking is concatenating the bytes
            let mut bytes = Vec::with_capacity(parts.iter().map(|t| t.end - t.start).sum());
            for t in &parts {
                bytes.extend_from_slice(self.data(t));
            }
            let storage =
                with_aligned(&bytes, |b| QStorage::from_data(Cow::Borrowed(b), device, parts[0].ggml_type()))?;
            LinearWeight::Quant(Arc::new(QTensor::new(storage, (rows, cols))?))
        } else {
            let ts = names.iter().map(|n| self.dense(n, device, dtype)).collect::<Result<Vec<_>, _>>()?;
            LinearWeight::Dense(Tensor::cat(&ts, 0)?)
        };
        let bias = match biases {
            Some(bs) => {
                let ts = bs.iter().map(|n| self.dense(n, device, dtype)).collect::<Result<Vec<_>, _>>()?;
                Some(Tensor::cat(&ts, 0)?)
            }
            None => None,
        };
        Ok(Some(Linear { w, bias }))
    }

    pub fn embedding(&self, name: &str, device: &Device, dtype: DType) -> Result<Embedding, ModelError> {
        let t = self.stored(name)?;
        Ok(if Self::keeps_stored_form(t, device.is_cpu()) {
            Embedding::Quant(Arc::new(self.qtensor(name, device)?))
        } else {
            Embedding::Dense(self.dense(name, device, dtype)?)
        })
    }

    /// Bytes tensor `name` will take on a device kind once loaded (activations in `dtype`): its
    /// stored size where it keeps its stored form, else elements × `dtype`. Zero if absent.
    pub fn device_bytes(&self, name: &str, on_cpu: bool, dtype: DType) -> u64 {
        match self.tensors.get(name) {
            None => 0,
            Some(t) if Self::keeps_stored_form(t, on_cpu) => t.n_bytes(),
            Some(t) => t.shape.iter().product::<usize>() as u64 * dtype.size_in_bytes() as u64,
        }
    }

    /// The float type of the model's layer matrices, when they are stored as floats (None when
    /// they are quantized): the dtype a GPU computes such a model in.
    pub fn dense_dtype(&self) -> Option<DType> {
        let t = self.tensors.get("blk.0.attn_q.weight")?;
        match t.ty {
            StoredType::F32 | StoredType::Ggml(GgmlDType::F32) => Some(DType::F32),
            StoredType::F16 | StoredType::Ggml(GgmlDType::F16) => Some(DType::F16),
            StoredType::BF16 | StoredType::Ggml(GgmlDType::BF16) => Some(DType::BF16),
            StoredType::Ggml(_) => None,
        }
    }

    /// The distinct stored types of the matrices of the transformer layers, with their bytes.
    pub fn weight_types(&self) -> Vec<(StoredType, u64)> {
        let mut m: Vec<(StoredType, u64)> = Vec::new();
        for (name, t) in &self.tensors {
            if !name.starts_with("blk.") || t.shape.len() != 2 {
                continue;
            }
            match m.iter_mut().find(|(ty, _)| *ty == t.ty) {
                Some(e) => e.1 += t.n_bytes(),
                None => m.push((t.ty, t.n_bytes())),
            }
        }
        m.sort_by_key(|e| std::cmp::Reverse(e.1));
        m
    }

    /// The planner's view of this model, from the tensor table alone: stored bytes and 2 × params
    /// flops per layer, the head (the embedding when tied) and the embedding, and a KV cache of
    /// `kv_elem_bytes` per element.
    pub fn profile(&self, kv_elem_bytes: u64) -> brigade_core::ModelProfile {
        self.profile_with(kv_elem_bytes, |t| t.n_bytes())
    }

    /// Like [`ModelFiles::profile`], with bytes as a device kind will hold them (see
    /// [`ModelFiles::device_bytes`]).
    pub fn device_profile(&self, kv_elem_bytes: u64, on_cpu: bool, dtype: DType) -> brigade_core::ModelProfile {
        self.profile_with(kv_elem_bytes, |t| {
            if Self::keeps_stored_form(t, on_cpu) {
                t.n_bytes()
            } else {
                t.shape.iter().product::<usize>() as u64 * dtype.size_in_bytes() as u64
            }
        })
    }

    fn profile_with(&self, kv_elem_bytes: u64, bytes: impl Fn(&StoredTensor) -> u64) -> brigade_core::ModelProfile {
        let c = &self.config;
        let mut layer_bytes = vec![0u64; c.n_layers];
        let mut layer_flops = vec![0f64; c.n_layers];
        for (name, t) in &self.tensors {
            let Some(rest) = name.strip_prefix("blk.") else {
                continue;
            };
            let Some(i) = rest.split('.').next().and_then(|i| i.parse::<usize>().ok()) else {
                continue;
            };
            if i >= c.n_layers {
                continue;
            }
            layer_bytes[i] += bytes(t);
            if t.shape.len() == 2 {
                layer_flops[i] += 2.0 * t.shape.iter().product::<usize>() as f64;
            }
        }
        let get = |n: &str| self.tensors.get(n).map(&bytes).unwrap_or(0);
        let embed = get("token_embd.weight");
        let tied = !self.tensors.contains_key("output.weight");
        let head = if tied { embed } else { get("output.weight") } + get("output_norm.weight");
        brigade_core::ModelProfile {
            name: self.source.rsplit('/').next().unwrap_or(&self.source).to_string(),
            layer_bytes,
            layer_flops,
            head_bytes: head,
            head_flops: 2.0 * (c.hidden * c.vocab) as f64,
            embed_bytes: embed,
            tied,
            kv_bytes_per_token: c.kv_bytes_per_token_layer(kv_elem_bytes as usize),
            hidden: c.hidden,
            vocab: c.vocab,
        }
    }

    /// Total bytes of all tensors in the file(s).
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(StoredTensor::n_bytes).sum()
    }

    /// Parameters (elements) of all tensors.
    pub fn n_params(&self) -> u64 {
        self.tensors.values().map(|t| t.shape.iter().product::<usize>() as u64).sum()
    }
}

/// Hugging Face Llama/Mistral/Qwen2 tensor names to llama.cpp's GGUF names.
fn hf_to_gguf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (i, rest) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let short = match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{i}.{short}"))
}

/// llama.cpp's GGUF names to Hugging Face names (for writing safetensors).
pub fn gguf_to_hf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (i, rest) = rest.split_once('.')?;
    let long = match rest {
        "attn_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "attn_q.bias" => "self_attn.q_proj.bias",
        "attn_k.bias" => "self_attn.k_proj.bias",
        "attn_v.bias" => "self_attn.v_proj.bias",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{i}.{long}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for n in ["token_embd.weight", "output.weight", "blk.12.attn_q.bias", "blk.3.ffn_down.weight"] {
            assert_eq!(hf_to_gguf_name(&gguf_to_hf_name(n).unwrap()).as_deref(), Some(n));
        }
        assert!(hf_to_gguf_name("model.layers.x.mlp.up_proj.weight").is_none());
    }
}
