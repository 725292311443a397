//! An opened model: one GGUF file (or GGUF bytes) or a Hugging Face safetensors directory,
//! memory-mapped, with its configuration, tokenizer and the checked table of its tensors.
//! Tensors are addressed by llama.cpp's GGUF names (`blk.3.attn_q.weight`); safetensors names are
//! translated once, when the directory is opened. Only the headers (and `rope_freqs.weight`) are
//! read here, so a sparse copy holding the headers and one slice's tensors opens like the model.

use crate::config::ModelConfig;
use crate::gguf::Gguf;
use crate::tensors::{self, is_norm, shape_of, Dim, LayerTensor, OUTPUT, OUTPUT_NORM, ROPE_FREQS, TOKEN_EMBD};
use crate::tokenizer::Tokenizer;
use crate::{FormatError, GgmlType};
use std::collections::HashMap;
use std::io::Read;
use std::path::Path;
use std::sync::Arc;

/// The largest JSON file of a model directory brigade reads (tokenizers of large vocabularies
/// are tens of MB).
pub const MAX_JSON_BYTES: u64 = 256 << 20;

/// Bytes a model is read from: a memory map, bytes compiled into the binary, or bytes in memory.
pub enum Bytes {
    Mmap(memmap2::Mmap),
    Static(&'static [u8]),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mmap(m) => m,
            Bytes::Static(s) => s,
            Bytes::Owned(v) => v,
        }
    }
}

/// Opens a model file for reading: never blocks (a FIFO or a device named as a model would hold
/// the caller's thread for ever), and refuses anything but a regular file.
pub fn open_regular(path: &Path) -> Result<std::fs::File, FormatError> {
    let io = |e| FormatError::Io(path.to_path_buf(), e);
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    let f = options.open(path).map_err(io)?;
    if !f.metadata().map_err(io)?.is_file() {
        return Err(FormatError::Invalid(format!("{}: not a regular file", path.display())));
    }
    Ok(f)
}

fn map_file(path: &Path) -> Result<Bytes, FormatError> {
    let f = open_regular(path)?;
    let m = map_readonly(&f).map_err(|e| FormatError::Io(path.to_path_buf(), e))?;
    Ok(Bytes::Mmap(m))
}

/// A read-only memory map of `f`: this crate's one `unsafe`, which the coordinator uses too
/// (every other crate but the model runtime forbids `unsafe`).
#[allow(unsafe_code)]
pub fn map_readonly(f: &std::fs::File) -> std::io::Result<memmap2::Mmap> {
    // SAFETY: the map is read-only; a file truncated under us by another process is the one
    // hazard of any memory map, as in llama.cpp and candle.
    unsafe { memmap2::Mmap::map(f) }
}

/// A JSON file of a model directory, whole, refused past [`MAX_JSON_BYTES`].
fn read_json(path: &Path) -> Result<Vec<u8>, FormatError> {
    let io = |e| FormatError::Io(path.to_path_buf(), e);
    let f = open_regular(path)?;
    let len = f.metadata().map_err(io)?.len();
    if len > MAX_JSON_BYTES {
        return Err(FormatError::Invalid(format!("{}: {len} bytes, more than {MAX_JSON_BYTES}", path.display())));
    }
    let mut out = Vec::with_capacity(len as usize);
    f.take(MAX_JSON_BYTES).read_to_end(&mut out).map_err(io)?;
    Ok(out)
}

/// One file of a model.
pub struct ModelFile {
    name: String,
    bytes: Bytes,
    header_len: Option<u64>,
}

impl ModelFile {
    /// The path relative to the model: the file name of a GGUF, `config.json` or
    /// `model-00001-of-00002.safetensors` in a directory.
    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    pub fn len(&self) -> u64 {
        self.bytes.len() as u64
    }
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
    /// Bytes of the header that describes the file's tensors (GGUF: up to the aligned start of
    /// the data; safetensors: the length prefix and the JSON); `None` for a file without tensors
    /// (the JSON files of a directory), which is read whole.
    pub fn header_len(&self) -> Option<u64> {
        self.header_len
    }
}

/// The element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredType {
    Ggml(GgmlType),
    F32,
    F16,
    BF16,
}

impl StoredType {
    pub fn name(&self) -> &'static str {
        self.ggml_type().name()
    }

    /// The ggml type the bytes are, whatever the file format.
    pub fn ggml_type(&self) -> GgmlType {
        match self {
            StoredType::Ggml(d) => *d,
            StoredType::F32 => GgmlType::F32,
            StoredType::F16 => GgmlType::F16,
            StoredType::BF16 => GgmlType::BF16,
        }
    }
}

/// One tensor of the model: shape (candle order, outermost first), type, and the checked byte
/// range `[start, end)` of file `file` that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    shape: Vec<usize>,
    ty: StoredType,
    file: usize,
    start: u64,
    end: u64,
}

impl StoredTensor {
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn ty(&self) -> StoredType {
        self.ty
    }
    /// Index of the file in [`ModelIndex::files`].
    pub fn file(&self) -> usize {
        self.file
    }
    pub fn start(&self) -> u64 {
        self.start
    }
    pub fn end(&self) -> u64 {
        self.end
    }
    pub fn n_bytes(&self) -> u64 {
        self.end - self.start
    }
    /// Elements (the readers checked that the product does not overflow).
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(d as u64))
    }
    pub fn ggml_type(&self) -> GgmlType {
        self.ty.ggml_type()
    }
    pub fn is_float(&self) -> bool {
        self.ggml_type().is_float()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Gguf,
    Safetensors,
}

/// An opened model: configuration, tokenizer, and the table of its tensors, all checked when it
/// is opened and read-only after.
pub struct ModelIndex {
    format: Format,
    config: Arc<ModelConfig>,
    tokenizer: Arc<Tokenizer>,
    files: Vec<ModelFile>,
    tensors: HashMap<String, StoredTensor>,
    source: String,
    gguf: Option<Gguf>,
}

/// The shared expert's gate is one row of `hidden` weights: a linear layer of one output
/// `[1, hidden]` in a checkpoint and in llama.cpp's files, a vector in the layer table.
fn squeezed_gate(name: &str, mut shape: Vec<usize>) -> Vec<usize> {
    if name.ends_with(LayerTensor::FfnGateInpShexp.suffix()) && shape.len() == 2 && shape[0] == 1 {
        shape.remove(0);
    }
    shape
}

/// The file name a label gives: `stories260K.gguf (embedded)` is the file `stories260K.gguf`.
fn file_name_of(label: &str) -> String {
    let path = label.split(" (").next().unwrap_or(label);
    path.rsplit('/').next().unwrap_or(path).to_string()
}

impl ModelIndex {
    /// Opens a GGUF file or a Hugging Face directory (with `config.json`, `tokenizer.json` and
    /// `*.safetensors`).
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        if path.is_dir() {
            return Self::open_safetensors_dir(path);
        }
        let bytes = map_file(path)?;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Self::from_gguf_bytes(bytes, name, path.display().to_string())
    }

    /// Opens a GGUF held in memory (the model compiled into the binary); `label` names it in
    /// messages, and its first part (before ` (`) is the file name in the manifest.
    pub fn from_static_gguf(bytes: &'static [u8], label: &str) -> Result<Self, FormatError> {
        Self::from_gguf_bytes(Bytes::Static(bytes), file_name_of(label), label.to_string())
    }

    /// Opens GGUF bytes owned by the index (bytes received or generated, not mapped).
    pub fn from_gguf_vec(bytes: Vec<u8>, label: &str) -> Result<Self, FormatError> {
        Self::from_gguf_bytes(Bytes::Owned(bytes), file_name_of(label), label.to_string())
    }

    /// The model compiled into the binary ([`crate::embedded_model`]).
    pub fn embedded() -> Result<Self, FormatError> {
        Self::from_static_gguf(crate::embedded_model(), crate::EMBEDDED_MODEL_NAME)
    }

    fn from_gguf_bytes(bytes: Bytes, name: String, source: String) -> Result<Self, FormatError> {
        let g = Gguf::parse(&bytes)?;
        let tensors: HashMap<String, StoredTensor> = g
            .tensors
            .iter()
            .map(|t| {
                let shape = squeezed_gate(&t.name, t.shape());
                let st = StoredTensor {
                    shape,
                    ty: StoredType::Ggml(t.dtype),
                    file: 0,
                    start: t.offset,
                    end: t.offset + t.n_bytes,
                };
                (t.name.clone(), st)
            })
            .collect();
        let rope_freqs = match g.tensor(ROPE_FREQS) {
            Some(t) if t.dtype == GgmlType::F32 => {
                let d = g.tensor_data(&bytes, t);
                Some(d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
            }
            Some(t) => {
                return Err(FormatError::BadTensor {
                    name: t.name.clone(),
                    why: format!("rope_freqs must be f32, found {}", t.dtype),
                })
            }
            None => None,
        };
        let config = ModelConfig::from_gguf(&g, rope_freqs)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let header_len = Some(g.data_start.min(bytes.len() as u64));
        let index = ModelIndex {
            format: Format::Gguf,
            config: Arc::new(config),
            tokenizer: Arc::new(tokenizer),
            files: vec![ModelFile { name, bytes, header_len }],
            tensors,
            source,
            gguf: Some(g),
        };
        index.check_tensors()?;
        Ok(index)
    }

    fn open_safetensors_dir(dir: &Path) -> Result<Self, FormatError> {
        let text = |name: &str, bytes: Vec<u8>| {
            String::from_utf8(bytes).map_err(|_| FormatError::Invalid(format!("{name} is not UTF-8 text")))
        };
        let config_bytes = read_json(&dir.join("config.json"))?;
        let config_text = text("config.json", config_bytes.clone())?;
        let config = ModelConfig::from_hf_json(&config_text)?;
        let tok_bytes = read_json(&dir.join("tokenizer.json"))?;
        let tok_config = read_json(&dir.join("tokenizer_config.json")).ok();
        let tok_config_text = tok_config.clone().and_then(|b| text("tokenizer_config.json", b).ok());
        let tokenizer = Tokenizer::from_hf(&tok_bytes, tok_config_text.as_deref(), Some(&config_text))?;
        let small =
            |name: &str, bytes: Vec<u8>| ModelFile { name: name.into(), bytes: Bytes::Owned(bytes), header_len: None };
        let mut files = vec![small("config.json", config_bytes), small("tokenizer.json", tok_bytes)];
        if let (Some(b), Some(_)) = (tok_config, &tok_config_text) {
            files.push(small("tokenizer_config.json", b));
        }

        let mut paths: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| FormatError::Io(dir.to_path_buf(), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        paths.sort();
        if paths.is_empty() {
            return Err(FormatError::Invalid(format!("{}: no *.safetensors files", dir.display())));
        }
        let mut tensors = HashMap::new();
        for p in &paths {
            let bytes = map_file(p)?;
            // validates the JSON header, every offset against the file and every shape × dtype
            // against its range
            let (n, meta) = safetensors::SafeTensors::read_metadata(&bytes)
                .map_err(|e| FormatError::Invalid(format!("{}: {e}", p.display())))?;
            let base = 8 + n as u64;
            let fi = files.len();
            for (name, info) in meta.tensors() {
                let ty = match info.dtype {
                    safetensors::Dtype::F32 => StoredType::F32,
                    safetensors::Dtype::F16 => StoredType::F16,
                    safetensors::Dtype::BF16 => StoredType::BF16,
                    other => {
                        return Err(FormatError::BadTensor {
                            name,
                            why: format!("dtype {other:?} is not supported (F32, F16, BF16 are)"),
                        })
                    }
                };
                let Some(gname) = tensors::hf_to_gguf_name_in(&name, &config) else {
                    continue;
                };
                if gname == OUTPUT && config.tie_word_embeddings == Some(true) {
                    // transformers ties the head to the embedding and ignores a stored copy
                    tracing::debug!(tensor = %name, "tie_word_embeddings: the stored head is not used");
                    continue;
                }
                let (s, e) = info.data_offsets;
                let shape = squeezed_gate(&gname, info.shape.clone());
                let st = StoredTensor { shape, ty, file: fi, start: base + s as u64, end: base + e as u64 };
                if tensors.insert(gname.clone(), st).is_some() {
                    return Err(FormatError::Invalid(format!("tensor `{gname}` appears in two files")));
                }
            }
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            files.push(ModelFile { name, bytes, header_len: Some(base) });
        }
        let index = ModelIndex {
            format: Format::Safetensors,
            config: Arc::new(config),
            tokenizer: Arc::new(tokenizer),
            files,
            tensors,
            source: dir.display().to_string(),
            gguf: None,
        };
        index.check_tensors()?;
        Ok(index)
    }

    /// Every tensor a full model needs is present with the shape the configuration implies, and
    /// no layer has a tensor the configuration says it lacks (a bias nothing would read).
    pub fn check_tensors(&self) -> Result<(), FormatError> {
        let c = &self.config;
        let head_required = c.tie_word_embeddings == Some(false);
        let globals: [(&str, &[Dim], bool); 3] = [
            (TOKEN_EMBD, &[Dim::Vocab, Dim::Hidden], true),
            (OUTPUT_NORM, &[Dim::Hidden], true),
            (OUTPUT, &[Dim::Vocab, Dim::Hidden], head_required),
        ];
        for (name, dims, required) in globals {
            self.check_one(name, None, required, || shape_of(dims, c))?;
        }
        for i in 0..c.n_layers {
            for t in LayerTensor::ALL {
                let name = t.name(i);
                if !t.required(c) && self.tensors.contains_key(&name) {
                    return Err(FormatError::BadTensor { name, why: t.unwanted_because(c).into() });
                }
                if t.is_experts() && t.required(c) && !self.tensors.contains_key(&name) {
                    self.check_pieces(i, t)?;
                    continue;
                }
                self.check_one(&name, Some(t), t.required(c), || t.shape(c))?;
            }
        }
        // an expert's piece of a layer the model does not have, or past its experts, would
        // never be read: a file that has one is not what its configuration says
        for name in self.tensors.keys() {
            if let Some((i, t, e)) = LayerTensor::parse_piece(name) {
                let experts = c.moe.map_or(0, |m| m.experts);
                if i >= c.n_layers || e >= experts || self.tensors.contains_key(&t.name(i)) {
                    return Err(FormatError::BadTensor {
                        name: name.clone(),
                        why: format!(
                            "an expert's matrix, but the configuration has {experts} experts and {} layers{}",
                            c.n_layers,
                            if self.tensors.contains_key(&t.name(i)) { ", and the stacked tensor too" } else { "" }
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// A stacked expert tensor stored one expert at a time: every piece present, of the piece's
    /// shape, all of one type.
    fn check_pieces(&self, layer: usize, t: LayerTensor) -> Result<(), FormatError> {
        let c = &self.config;
        let experts = c.moe.map_or(0, |m| m.experts);
        let mut ty = None;
        for e in 0..experts {
            let Some(name) = t.piece_name(layer, e) else { continue };
            let Some(st) = self.tensors.get(&name) else {
                return Err(FormatError::MissingTensor(if e == 0 { t.name(layer) } else { name }));
            };
            self.check_one(&name, Some(t), true, || t.piece_shape(c))?;
            if *ty.get_or_insert(st.ty) != st.ty {
                return Err(FormatError::BadTensor {
                    name,
                    why: format!("stored as {}, expert 0's as {}", st.ty.name(), ty.map_or("", |t| t.name())),
                });
            }
        }
        Ok(())
    }

    /// The stored form of expert `e`'s matrix of layer `layer`'s stacked tensor `t`: its type,
    /// shape and bytes, a range of the stacked tensor's bytes (rows are whole blocks in every
    /// ggml type, so each expert's matrix is contiguous) or the expert's own tensor.
    pub fn expert_data(
        &self,
        layer: usize,
        t: LayerTensor,
        e: usize,
    ) -> Result<(StoredType, Vec<usize>, &[u8]), FormatError> {
        let name = t.name(layer);
        let Some(st) = self.tensors.get(&name) else {
            let piece = t.piece_name(layer, e).ok_or_else(|| FormatError::MissingTensor(name.clone()))?;
            let st = self.tensors.get(&piece).ok_or_else(|| FormatError::MissingTensor(piece.clone()))?;
            return Ok((st.ty, st.shape.clone(), self.tensor_data(&piece)?));
        };
        let experts = st.shape.first().copied().unwrap_or(0);
        let bytes = self.tensor_data(&name)?;
        if e >= experts || experts == 0 || !bytes.len().is_multiple_of(experts) {
            return Err(FormatError::BadTensor {
                name,
                why: format!("expert {e} of {experts} in {} bytes", bytes.len()),
            });
        }
        let each = bytes.len() / experts;
        Ok((st.ty, st.shape[1..].to_vec(), &bytes[e * each..(e + 1) * each]))
    }

    /// Where an expert tensor's width came from, for a message about its shape: keys a file may
    /// leave out (empty for other tensors).
    fn width_source(&self, t: LayerTensor) -> String {
        use LayerTensor as T;
        match (self.config.moe, t) {
            (Some(m), T::FfnGateShexp | T::FfnUpShexp | T::FfnDownShexp) => format!(
                " (the shared expert's width {}: expert_shared_feed_forward_length, \
                 shared_expert_intermediate_size, or the feed-forward length where absent)",
                m.shared_ffn.unwrap_or(0)
            ),
            (Some(m), T::FfnGateExps | T::FfnUpExps | T::FfnDownExps) => format!(
                " (each expert's width {}: expert_feed_forward_length, moe_intermediate_size, or \
                 where absent the feed-forward length, divided by the experts used for Qwen MoE)",
                m.ffn
            ),
            _ => String::new(),
        }
    }

    /// `name` (of the layer tensor `layer`, or a global one) present where `required`, and of
    /// `shape`.
    fn check_one(
        &self,
        name: &str,
        layer: Option<LayerTensor>,
        required: bool,
        shape: impl FnOnce() -> Result<Vec<usize>, FormatError>,
    ) -> Result<(), FormatError> {
        match self.tensors.get(name) {
            None if required => Err(FormatError::MissingTensor(name.to_string())),
            None => Ok(()),
            Some(t) => {
                let want = shape()?;
                if t.shape != want {
                    let width = layer.map_or(String::new(), |lt| self.width_source(lt));
                    return Err(FormatError::BadTensor {
                        name: name.to_string(),
                        why: format!("shape {:?}, the configuration implies {want:?}{width}", t.shape),
                    });
                }
                Ok(())
            }
        }
    }

    pub fn format(&self) -> Format {
        self.format
    }
    pub fn config(&self) -> &Arc<ModelConfig> {
        &self.config
    }
    /// Sets [`ModelConfig::window_pass`]: the tokens one forward pass of a model with
    /// sliding-window layers takes, hence the size of those layers' caches.
    pub fn set_window_pass(&mut self, pass: Option<usize>) {
        Arc::make_mut(&mut self.config).window_pass = pass;
    }
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }
    /// Where the model was opened from (a path, or the label of bytes in memory).
    pub fn source(&self) -> &str {
        &self.source
    }
    /// The GGUF header, when the model is a GGUF.
    pub fn gguf(&self) -> Option<&Gguf> {
        self.gguf.as_ref()
    }
    /// The model's files: the GGUF, or a directory's JSON files then its safetensors files.
    pub fn files(&self) -> &[ModelFile] {
        &self.files
    }

    pub fn tensor_info(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = (&String, &StoredTensor)> {
        self.tensors.iter()
    }

    /// The stored bytes of a tensor.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], FormatError> {
        let t = self.tensors.get(name).ok_or_else(|| FormatError::MissingTensor(name.to_string()))?;
        let range = usize::try_from(t.start).ok().zip(usize::try_from(t.end).ok());
        range.and_then(|(s, e)| self.files.get(t.file)?.bytes.get(s..e)).ok_or_else(|| FormatError::BadTensor {
            name: name.to_string(),
            why: "its bytes lie outside its file".into(),
        })
    }

    /// Whether the output head is the embedding matrix (no `output.weight`).
    pub fn tied_head(&self) -> bool {
        !self.tensors.contains_key(OUTPUT)
    }

    /// Whether a tensor stays in its stored form on a device kind: always on the CPU (brigade's
    /// matmul reads every ggml type); on a GPU when quantized (float weights there become dense
    /// tensors in the activation type).
    pub fn keeps_stored_form(t: &StoredTensor, on_cpu: bool) -> bool {
        on_cpu || !t.is_float()
    }

    /// Bytes tensor `name` takes on a device kind once loaded, dense tensors holding
    /// `dense_elem_bytes` per element: norms are always dense; other tensors keep their stored
    /// size where they keep their stored form. Zero if absent.
    pub fn device_bytes(&self, name: &str, on_cpu: bool, dense_elem_bytes: u64) -> u64 {
        self.tensors.get(name).map_or(0, |t| Self::bytes_on(name, t, on_cpu, dense_elem_bytes))
    }

    fn bytes_on(name: &str, t: &StoredTensor, on_cpu: bool, dense_elem_bytes: u64) -> u64 {
        let router = |t: LayerTensor| name.ends_with(t.suffix()) && name.starts_with("blk.");
        if router(LayerTensor::FfnGateInp) || router(LayerTensor::FfnGateInpShexp) {
            // a MoE layer's routing runs on the host in f32, whatever the device
            return t.n_elements().saturating_mul(4);
        }
        if is_norm(name) || !Self::keeps_stored_form(t, on_cpu) {
            t.n_elements().saturating_mul(dense_elem_bytes)
        } else {
            t.n_bytes()
        }
    }

    /// The float type of the model's layer matrices when they are stored as floats (`None` when
    /// quantized): the type a GPU computes such a model in.
    pub fn dense_type(&self) -> Option<GgmlType> {
        let t = self.tensors.get(&LayerTensor::AttnQ.name(0))?;
        Some(t.ggml_type()).filter(|g| g.is_float())
    }

    /// The distinct stored types of the matrices of the transformer layers, with their bytes,
    /// most bytes first.
    pub fn weight_types(&self) -> Vec<(StoredType, u64)> {
        let mut m: Vec<(StoredType, u64)> = Vec::new();
        for (name, t) in &self.tensors {
            if !name.starts_with("blk.") || !(2..=3).contains(&t.shape.len()) {
                continue;
            }
            match m.iter_mut().find(|(ty, _)| *ty == t.ty) {
                Some(e) => e.1 = e.1.saturating_add(t.n_bytes()),
                None => m.push((t.ty, t.n_bytes())),
            }
        }
        m.sort_by_key(|e| (std::cmp::Reverse(e.1), e.0.name()));
        m
    }

    /// The planner's view of this model, from the tensor table alone: stored bytes and 2 × params
    /// flops per layer, the head (the embedding when tied) and the embedding, and a KV cache of
    /// `kv_elem_bytes` per element.
    pub fn profile(&self, kv_elem_bytes: u64) -> brigade_core::ModelProfile {
        self.profile_with(kv_elem_bytes, |_, t| t.n_bytes())
    }

    /// Like [`ModelIndex::profile`], with bytes as a device kind will hold them (see
    /// [`ModelIndex::device_bytes`]).
    pub fn device_profile(
        &self,
        kv_elem_bytes: u64,
        on_cpu: bool,
        dense_elem_bytes: u64,
    ) -> brigade_core::ModelProfile {
        self.profile_with(kv_elem_bytes, |name, t| Self::bytes_on(name, t, on_cpu, dense_elem_bytes))
    }

    fn profile_with(
        &self,
        kv_elem_bytes: u64,
        bytes: impl Fn(&str, &StoredTensor) -> u64,
    ) -> brigade_core::ModelProfile {
        let c = &self.config;
        let get = |n: &str| self.tensors.get(n).map_or(0, |t| bytes(n, t));
        let mut layer_bytes = vec![0u64; c.n_layers];
        let mut layer_flops = vec![0f64; c.n_layers];
        let mut expert_bytes = vec![0u64; c.n_layers];
        let mut expert_flops = vec![0f64; c.n_layers];
        // a token computes `used` of a layer's experts
        let share = c.moe.map_or(1.0, |m| m.used as f64 / m.experts as f64);
        for i in 0..c.n_layers {
            for t in LayerTensor::required_in(c) {
                for name in t.stored_names(i, c, |n| self.tensors.contains_key(n)) {
                    let bytes = get(&name);
                    layer_bytes[i] = layer_bytes[i].saturating_add(bytes);
                    if t.is_experts() {
                        expert_bytes[i] = expert_bytes[i].saturating_add(bytes);
                    }
                    // matrices, stacked experts (3-D) or each expert's own (2-D)
                    match self.tensors.get(&name) {
                        Some(st) if (2..=3).contains(&st.shape.len()) => {
                            let n = 2.0 * st.n_elements() as f64;
                            layer_flops[i] += if t.is_experts() { n * share } else { n };
                            if t.is_experts() {
                                expert_flops[i] += n * share;
                            }
                        }
                        _ => {}
                    }
                }
            }
        }
        let embed = get(TOKEN_EMBD);
        let tied = self.tied_head();
        let head = if tied { embed } else { get(OUTPUT) }.saturating_add(get(OUTPUT_NORM));
        brigade_core::ModelProfile {
            name: self.source.rsplit('/').next().unwrap_or(&self.source).to_string(),
            layer_bytes,
            layer_flops,
            head_bytes: head,
            head_flops: 2.0 * c.hidden as f64 * c.vocab as f64,
            embed_bytes: embed,
            tied,
            kv_bytes_per_token: c.kv_bytes_per_token_layer(kv_elem_bytes),
            cpu_kv_bytes_per_token: None,
            // a sliding-window layer holds its window and one pass (the runtime's rule)
            kv_positions_max: match c.pass() {
                Some(_) => (0..c.n_layers).map(|l| c.window(l).map(|_| c.kv_positions(l, usize::MAX) as u64)).collect(),
                None => Vec::new(),
            },
            rope_bytes_per_position: c.rope_table_bytes(0..c.n_layers, 1, 4),
            context_length: Some(c.context_length as u64),
            hidden: c.hidden,
            vocab: c.vocab,
            moe: c.moe.map(|m| brigade_core::MoeProfile {
                expert_bytes,
                experts: m.experts,
                used: m.used,
                expert_flops,
            }),
        }
    }

    /// Total bytes of all tensors in the file(s).
    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().fold(0u64, |s, t| s.saturating_add(t.n_bytes()))
    }

    /// Parameters (elements) of all tensors.
    pub fn n_params(&self) -> u64 {
        self.tensors.values().fold(0u64, |s, t| s.saturating_add(t.n_elements()))
    }
}
