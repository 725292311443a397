//! The candle side of an opened model: [`ModelFiles`] wraps a [`ModelIndex`] (files, tensor
//! table, configuration, tokenizer, all read by `brigade-format`) and builds the tensors a slice
//! asks for, so only their pages are ever read. It also maps brigade's [`GgmlType`] to candle's
//! `GgmlDType`.

use crate::config::ModelConfig;
use crate::tokenizer::Tokenizer;
use crate::ModelError;
use brigade_format::{GgmlType, ModelIndex};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

pub use brigade_format::index::{Bytes, Format, StoredTensor, StoredType};
pub use brigade_format::tensors::{gguf_to_hf_name, hf_to_gguf_name};

/// candle's name for a ggml type.
pub fn ggml_dtype(t: GgmlType) -> GgmlDType {
    match t {
        GgmlType::F32 => GgmlDType::F32,
        GgmlType::F16 => GgmlDType::F16,
        GgmlType::BF16 => GgmlDType::BF16,
        GgmlType::Q4_0 => GgmlDType::Q4_0,
        GgmlType::Q4_1 => GgmlDType::Q4_1,
        GgmlType::Q5_0 => GgmlDType::Q5_0,
        GgmlType::Q5_1 => GgmlDType::Q5_1,
        GgmlType::Q8_0 => GgmlDType::Q8_0,
        GgmlType::Q8_1 => GgmlDType::Q8_1,
        GgmlType::Q2K => GgmlDType::Q2K,
        GgmlType::Q3K => GgmlDType::Q3K,
        GgmlType::Q4K => GgmlDType::Q4K,
        GgmlType::Q5K => GgmlDType::Q5K,
        GgmlType::Q6K => GgmlDType::Q6K,
        GgmlType::Q8K => GgmlDType::Q8K,
    }
}

/// brigade's name for a candle ggml type.
pub fn ggml_type(d: GgmlDType) -> GgmlType {
    match d {
        GgmlDType::F32 => GgmlType::F32,
        GgmlDType::F16 => GgmlType::F16,
        GgmlDType::BF16 => GgmlType::BF16,
        GgmlDType::Q4_0 => GgmlType::Q4_0,
        GgmlDType::Q4_1 => GgmlType::Q4_1,
        GgmlDType::Q5_0 => GgmlType::Q5_0,
        GgmlDType::Q5_1 => GgmlType::Q5_1,
        GgmlDType::Q8_0 => GgmlType::Q8_0,
        GgmlDType::Q8_1 => GgmlType::Q8_1,
        GgmlDType::Q2K => GgmlType::Q2K,
        GgmlDType::Q3K => GgmlType::Q3K,
        GgmlDType::Q4K => GgmlType::Q4K,
        GgmlDType::Q5K => GgmlType::Q5K,
        GgmlDType::Q6K => GgmlType::Q6K,
        GgmlDType::Q8K => GgmlType::Q8K,
    }
}

/// The candle dtype of a float ggml type; `None` for quantized types.
pub fn float_dtype(t: GgmlType) -> Option<DType> {
    match t {
        GgmlType::F32 => Some(DType::F32),
        GgmlType::F16 => Some(DType::F16),
        GgmlType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// An opened model, as [`ModelIndex`] reads it (everything it offers is available through
/// `Deref`), plus the candle tensors built from it.
///
/// `format`, `config`, `tokenizer` and `source` are copies of the index's (the configuration and
/// tokenizer shared, not cloned) kept as fields for the callers that read them so; the runtime
/// builds from the index's own, checked values.
pub struct ModelFiles {
    index: ModelIndex,
    pub format: Format,
    pub config: Arc<ModelConfig>,
    pub tokenizer: Arc<Tokenizer>,
    pub source: String,
}

impl std::ops::Deref for ModelFiles {
    type Target = ModelIndex;
    fn deref(&self) -> &ModelIndex {
        &self.index
    }
}

impl ModelFiles {
    /// Sets [`ModelConfig::window_pass`] in the index the runtime builds from and in `config`.
    pub fn set_window_pass(&mut self, pass: Option<usize>) {
        self.index.set_window_pass(pass);
        self.config = self.index.config().clone();
    }
}

impl From<ModelIndex> for ModelFiles {
    fn from(index: ModelIndex) -> Self {
        ModelFiles {
            format: index.format(),
            config: index.config().clone(),
            tokenizer: index.tokenizer().clone(),
            source: index.source().to_string(),
            index,
        }
    }
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
    /// On the CPU, a Q4_K/Q6_K/Q8_0 weight repacked at load for brigade's int8 kernels (the
    /// file's bytes, columns regrouped; see [`crate::cpu_matmul::Packed`]).
    Packed(Arc<crate::cpu_matmul::Packed>),
    Dense(Tensor),
}

impl Linear {
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.w {
            // brigade's CPU matmul computes in f32 (and takes f32 activations); its result goes
            // back to the activations' type (a no-op in f32, brigade's CPU type)
            LinearWeight::Quant(q) if x.device().is_cpu() => x
                .to_dtype(DType::F32)?
                .contiguous()?
                .apply_op1_no_bwd(&crate::cpu_matmul::CpuMatMul(q.clone()))?
                .to_dtype(x.dtype())?,
            LinearWeight::Packed(p) => x
                .to_dtype(DType::F32)?
                .contiguous()?
                .apply_op1_no_bwd(&crate::cpu_matmul::PackedMatMul(p.clone()))?
                .to_dtype(x.dtype())?,
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

    /// [`Linear::forward`] for the decode rows of several sessions, `x: (rows, 1, in)`, such that
    /// each row's result is, bit for bit, the one a call with that row alone gives. On the CPU
    /// the matmul picks its kernel by the number of rows, and only the decode kernels (up to
    /// [`crate::cpu_matmul::DECODE_ROWS`] rows: vec-dots that unpack each weight block once for
    /// all the rows and give each row the arithmetic it has alone) compute a row independently
    /// of the others; the prompt kernels round differently. So rows go in groups of at most that
    /// many, each a pass over the weight. Elsewhere (a GPU) the rows go in one call.
    /// A packed weight computes every row as alone at any number of rows: one call.
    pub fn forward_rows(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let per_call = crate::cpu_matmul::DECODE_ROWS;
        let rows = x.dim(0)?;
        if !x.device().is_cpu() || rows <= per_call || matches!(self.w, LinearWeight::Packed(_)) {
            return self.forward(x);
        }
        let parts = (0..rows)
            .step_by(per_call)
            .map(|r| self.forward(&x.narrow(0, r, per_call.min(rows - r))?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)
    }

    /// Whether every row of [`Linear::forward`]'s result is, bit for bit, what that row alone
    /// gives at any number of rows: a packed weight (brigade's int8 kernels compute each row
    /// alone). Other kernels pick their arithmetic by the number of rows.
    pub(crate) fn rows_independent(&self) -> bool {
        matches!(self.w, LinearWeight::Packed(_)) && self.bias.as_ref().is_none_or(|b| b.device().is_cpu())
    }

    /// Whether [`Linear::cpu_rows`] takes this weight: one held for brigade's CPU kernels (packed
    /// or in the file's blocks, on the CPU), with no bias or an f32 one.
    pub(crate) fn runs_on_slices(&self) -> bool {
        let w = match &self.w {
            LinearWeight::Packed(_) => true,
            LinearWeight::Quant(q) => q.device().is_cpu(),
            LinearWeight::Dense(_) => false,
        };
        w && self.bias.as_ref().is_none_or(|b| b.device().is_cpu() && b.dtype() == DType::F32)
    }

    /// `dst[m, out] = lhs[m, in] @ wᵀ (+ bias)` straight from slices of f32, for a weight that
    /// [`Linear::runs_on_slices`]: the kernels and the grouping of rows of
    /// [`Linear::forward_rows`], so each row's numbers are, bit for bit, those `forward_rows`
    /// (and `forward` of that row alone) gives. The decode step of `llama::fused` calls it
    /// without building a tensor per matmul.
    pub(crate) fn cpu_rows(&self, m: usize, lhs: &[f32], dst: &mut [f32]) -> candle_core::Result<()> {
        use crate::cpu_matmul::{matmul, matmul_packed, Isa, DECODE_ROWS};
        let n = self.out_features();
        let k = lhs.len().checked_div(m).unwrap_or(0);
        if m.checked_mul(k) != Some(lhs.len()) || m.checked_mul(n) != Some(dst.len()) {
            candle_core::bail!("{m} rows: {} inputs and {} outputs for a weight of {n} outputs", lhs.len(), dst.len())
        }
        match &self.w {
            LinearWeight::Packed(p) => {
                matmul_packed(p, m, lhs, dst, Isa::selected()).map_err(candle_core::Error::wrap)?;
            }
            LinearWeight::Quant(q) if q.device().is_cpu() => {
                let data = q.data()?;
                // groups of at most DECODE_ROWS rows, as `forward_rows` calls `forward`
                for r in (0..m).step_by(DECODE_ROWS) {
                    let g = DECODE_ROWS.min(m - r);
                    let (x, y) = (&lhs[r * k..(r + g) * k], &mut dst[r * n..(r + g) * n]);
                    matmul(q.dtype(), &data, (g, k, n), x, y, Isa::selected()).map_err(candle_core::Error::wrap)?;
                }
            }
            _ => candle_core::bail!("this weight is not held for the CPU's kernels"),
        }
        if let Some(b) = &self.bias {
            let view = View::of(b)?;
            let b = view.get();
            if b.len() != n {
                candle_core::bail!("a bias of {} values for a weight of {n} outputs", b.len())
            }
            for row in dst.chunks_exact_mut(n) {
                // `broadcast_add`'s sum, element by element
                row.iter_mut().zip(b).for_each(|(y, b)| *y += *b);
            }
        }
        Ok(())
    }

    /// The weight packed for the CPU's kernels, where it is and has no bias.
    pub(crate) fn packed(&self) -> Option<&crate::cpu_matmul::Packed> {
        match (&self.w, &self.bias) {
            (LinearWeight::Packed(p), None) => Some(p),
            _ => None,
        }
    }

    pub fn out_features(&self) -> usize {
        match &self.w {
            LinearWeight::Quant(q) => q.shape().dims()[0],
            LinearWeight::Packed(p) => p.shape().0,
            LinearWeight::Dense(w) => w.dims()[0],
        }
    }

    pub fn storage_bytes(&self) -> u64 {
        let w = match &self.w {
            LinearWeight::Quant(q) => q.storage_size_in_bytes() as u64,
            LinearWeight::Packed(p) => p.storage_bytes() as u64,
            LinearWeight::Dense(w) => (w.elem_count() * w.dtype().size_in_bytes()) as u64,
        };
        w + self.bias.as_ref().map(|b| (b.elem_count() * b.dtype().size_in_bytes()) as u64).unwrap_or(0)
    }

    /// A dense weight (unit tests of the modules that hold weights).
    #[cfg(test)]
    pub(crate) fn dense_for_tests(w: Tensor) -> Linear {
        Linear { w: LinearWeight::Dense(w), bias: None }
    }

    pub(crate) fn from_embedding(e: &Embedding) -> Linear {
        match e {
            Embedding::Quant(q) => Linear { w: LinearWeight::Quant(q.clone()), bias: None },
            Embedding::Packed(p) => Linear { w: LinearWeight::Packed(p.clone()), bias: None },
            Embedding::Dense(t) => Linear { w: LinearWeight::Dense(t.clone()), bias: None },
        }
    }
}

/// The f32 values of a contiguous CPU tensor, read-locked for as long as the view lives (the
/// fused decode step's norms, rotary tables and caches; a bias on slices).
pub(crate) struct View<'a> {
    guard: candle_core::StorageRef<'a>,
    range: std::ops::Range<usize>,
}

impl<'a> View<'a> {
    pub(crate) fn of(t: &'a Tensor) -> candle_core::Result<Self> {
        use candle_core::{CpuStorage, Storage};
        let (guard, layout) = t.storage_and_layout();
        let Some((a, b)) = layout.contiguous_offsets() else {
            candle_core::bail!("expected a contiguous tensor, not one of strides {:?}", layout.stride())
        };
        if !matches!(&*guard, Storage::Cpu(CpuStorage::F32(_))) {
            candle_core::bail!("expected an f32 tensor on the CPU, not {:?} on {:?}", t.dtype(), t.device())
        }
        Ok(View { guard, range: a..b })
    }

    pub(crate) fn get(&self) -> &[f32] {
        match &*self.guard {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => &v[self.range.clone()],
            // checked in `of`
            _ => &[],
        }
    }
}

/// The token embedding; quantized tables stay quantized and only looked-up rows are expanded.
#[derive(Debug, Clone)]
pub enum Embedding {
    Quant(Arc<QTensor>),
    /// A table that is also the output head, on the CPU: packed for the head's int8 kernels (the
    /// file's bytes regrouped, no second copy), its rows dequantized from the packed records.
    Packed(Arc<crate::cpu_matmul::Packed>),
    Dense(Tensor),
}

impl Embedding {
    pub fn forward(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Embedding::Quant(q) => q.embedding(ids),
            Embedding::Packed(p) => {
                let (rows, k) = p.shape();
                let ids_flat = ids.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
                let mut out = vec![0f32; ids_flat.len() * k];
                for (&id, row) in ids_flat.iter().zip(out.chunks_exact_mut(k.max(1))) {
                    if id as usize >= rows {
                        candle_core::bail!("token id {id} is outside the embedding's {rows} rows")
                    }
                    p.dequantize_row(id as usize, row).map_err(candle_core::Error::wrap)?;
                }
                let mut dims = ids.dims().to_vec();
                dims.push(k);
                Tensor::from_vec(out, dims, ids.device())
            }
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
            Embedding::Packed(p) => p.storage_bytes() as u64,
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
    let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut v)[..data.len()];
    bytes.copy_from_slice(data);
    f(bytes)
}

/// A CPU weight of a type brigade's int8 kernels read packed, packed from the file's bytes;
/// `None` where it keeps the file's layout (another type, a GPU, no int8 kernels).
fn packed(t: GgmlType, bytes: &[u8], shape: &[usize], device: &Device) -> Result<Option<LinearWeight>, ModelError> {
    let &[n, k] = shape else { return Ok(None) };
    if !device.is_cpu() {
        return Ok(None);
    }
    let p = crate::cpu_matmul::pack(ggml_dtype(t), bytes, (n, k)).map_err(candle_core::Error::wrap)?;
    Ok(p.map(|p| LinearWeight::Packed(Arc::new(p))))
}

impl ModelFiles {
    /// Opens a GGUF file or a Hugging Face directory (with `config.json`, `tokenizer.json` and
    /// `*.safetensors`).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        Ok(ModelIndex::open(path)?.into())
    }

    /// Opens a GGUF held in memory (the model compiled into the binary).
    pub fn from_static_gguf(bytes: &'static [u8], name: &str) -> Result<Self, ModelError> {
        Ok(ModelIndex::from_static_gguf(bytes, name)?.into())
    }

    /// The index the tensors are built from.
    pub fn index(&self) -> &ModelIndex {
        &self.index
    }

    fn stored(&self, name: &str) -> Result<&StoredTensor, ModelError> {
        self.index.tensor_info(name).ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// An RMSNorm weight in `dtype` on `device`, with the configuration's `norm_offset` added
    /// (Gemma's checkpoints store `w` of `x̂ · (1 + w)`), in f32 before the conversion.
    pub fn norm(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor, ModelError> {
        let offset = self.config().norm_offset;
        if offset == 0.0 {
            return self.dense(name, device, dtype);
        }
        let w = (self.dense(name, &Device::Cpu, DType::F32)? + offset as f64)?;
        Ok(w.to_dtype(dtype)?.to_device(device)?)
    }

    /// A dense tensor in `dtype` on `device` (any stored type is converted).
    pub fn dense(&self, name: &str, device: &Device, dtype: DType) -> Result<Tensor, ModelError> {
        let t = self.stored(name)?;
        let data = self.index.tensor_data(name)?;
        let cpu = match float_dtype(t.ggml_type()) {
            Some(dt) => Tensor::from_raw_buffer(data, dt, t.shape(), &Device::Cpu)?,
            None => self.qtensor(name, &Device::Cpu)?.dequantize(&Device::Cpu)?,
        };
        Ok(cpu.to_dtype(dtype)?.to_device(device)?)
    }

    fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor, ModelError> {
        let t = self.stored(name)?;
        let dtype = ggml_dtype(t.ggml_type());
        let storage =
            with_aligned(self.index.tensor_data(name)?, |d| QStorage::from_data(Cow::Borrowed(d), device, dtype))?;
        Ok(QTensor::new(storage, t.shape())?)
    }

    /// A weight `[out, in]` for matrix multiplies, in the form [`ModelIndex::keeps_stored_form`]
    /// says (on the CPU brigade's own matmul reads every ggml type, see [`crate::cpu_matmul`]; a
    /// GPU's float weights become dense tensors for cuBLAS); plus its bias (dense).
    pub fn linear(&self, name: &str, bias: Option<&str>, device: &Device, dtype: DType) -> Result<Linear, ModelError> {
        let t = self.stored(name)?;
        let w = self.linear_from(t.ty(), self.index.tensor_data(name)?, t.shape(), device, dtype)?;
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
        let parts = names
            .iter()
            .map(|n| Ok((self.stored(n)?.ty(), self.stored(n)?.shape(), self.index.tensor_data(n)?)))
            .collect::<Result<Vec<_>, ModelError>>()?;
        let Some(w) = self.stacked_from(&parts, device, dtype)? else {
            return Ok(None);
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

    /// Matrices `[out_i, in]` of one stored type as one `[Σ out_i, in]` weight: rows are
    /// contiguous in every ggml type, so stacking is concatenating the bytes. `None` when the
    /// types or the input widths differ.
    fn stacked_from(
        &self,
        parts: &[(StoredType, &[usize], &[u8])],
        device: &Device,
        dtype: DType,
    ) -> Result<Option<LinearWeight>, ModelError> {
        let Some(&(ty, first, _)) = parts.first() else {
            return Ok(None);
        };
        if parts.iter().any(|(t, s, _)| *t != ty || s.len() != 2 || s[1] != first[1]) {
            return Ok(None);
        }
        let rows: usize = parts.iter().map(|(_, s, _)| s[0]).sum();
        let mut bytes = Vec::with_capacity(parts.iter().map(|(_, _, b)| b.len()).sum());
        for (_, _, b) in parts {
            bytes.extend_from_slice(b);
        }
        Ok(Some(self.linear_from(ty, &bytes, &[rows, first[1]], device, dtype)?))
    }

    /// A weight from stored bytes of type `ty` and shape `[out, in]`, in the form
    /// [`ModelIndex::keeps_stored_form`] says: packed for brigade's CPU kernels where they read
    /// it, else the file's blocks; a GPU's float weight a dense tensor in `dtype`.
    fn linear_from(
        &self,
        ty: StoredType,
        bytes: &[u8],
        shape: &[usize],
        device: &Device,
        dtype: DType,
    ) -> Result<LinearWeight, ModelError> {
        if device.is_cpu() || !ty.ggml_type().is_float() {
            if let Some(p) = packed(ty.ggml_type(), bytes, shape, device)? {
                return Ok(p);
            }
            let q = ggml_dtype(ty.ggml_type());
            let storage = with_aligned(bytes, |b| QStorage::from_data(Cow::Borrowed(b), device, q))?;
            return Ok(LinearWeight::Quant(Arc::new(QTensor::new(storage, shape)?)));
        }
        let dt = float_dtype(ty.ggml_type()).unwrap_or(DType::F32);
        let t = with_aligned(bytes, |b| Tensor::from_raw_buffer(b, dt, shape, &Device::Cpu))?;
        Ok(LinearWeight::Dense(t.to_dtype(dtype)?.to_device(device)?))
    }

    /// Expert `e`'s matrix of layer `layer`'s stacked expert tensor `t` as a weight of its own,
    /// from its range of the stacked tensor's bytes (or its own tensor in a checkpoint): memory
    /// is the file's, no expert is copied per token.
    pub fn expert(
        &self,
        layer: usize,
        t: brigade_format::tensors::LayerTensor,
        e: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Linear, ModelError> {
        let (ty, shape, bytes) = self.index.expert_data(layer, t, e)?;
        Ok(Linear { w: self.linear_from(ty, bytes, &shape, device, dtype)?, bias: None })
    }

    /// Whether every routed expert of the model would be held packed on this CPU, so that its
    /// kernels compute each row alone: what a slice that leaves its experts to a node running
    /// this build on a CPU like this one can promise of them ([`crate::RemoteExperts`]).
    pub fn experts_pack_here(&self) -> bool {
        use brigade_format::tensors::LayerTensor as T;
        let isa = crate::cpu_matmul::Isa::selected();
        let Some(moe) = self.config().moe else { return false };
        moe.experts > 0
            && (0..self.config().n_layers).all(|l| {
                [T::FfnGateExps, T::FfnUpExps, T::FfnDownExps].into_iter().all(|t| {
                    self.index.expert_data(l, t, 0).is_ok_and(|(ty, shape, _)| {
                        shape.len() == 2 && crate::cpu_matmul::packs_on(ggml_dtype(ty.ggml_type()), isa)
                    })
                })
            })
    }

    /// Expert `e`'s gate and up matrices of layer `layer` stacked into one `[2 × ffn, in]`
    /// matmul where their types match (`None` otherwise), as [`ModelFiles::linear_stacked`].
    pub fn expert_gate_up(
        &self,
        layer: usize,
        e: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Option<Linear>, ModelError> {
        use brigade_format::tensors::LayerTensor as T;
        let (gt, gs, gb) = self.index.expert_data(layer, T::FfnGateExps, e)?;
        let (ut, us, ub) = self.index.expert_data(layer, T::FfnUpExps, e)?;
        let w = self.stacked_from(&[(gt, &gs, gb), (ut, &us, ub)], device, dtype)?;
        Ok(w.map(|w| Linear { w, bias: None }))
    }

    pub fn embedding(&self, name: &str, device: &Device, dtype: DType) -> Result<Embedding, ModelError> {
        let t = self.stored(name)?;
        if self.tied_head() && name == brigade_format::tensors::TOKEN_EMBD {
            // the output head too: packed where the head's kernels read it packed
            if let Some(LinearWeight::Packed(p)) =
                packed(t.ggml_type(), self.index.tensor_data(name)?, t.shape(), device)?
            {
                return Ok(Embedding::Packed(p));
            }
        }
        Ok(if ModelIndex::keeps_stored_form(t, device.is_cpu()) {
            Embedding::Quant(Arc::new(self.qtensor(name, device)?))
        } else {
            Embedding::Dense(self.dense(name, device, dtype)?)
        })
    }

    /// Bytes tensor `name` will take on a device kind once loaded (activations in `dtype`), as
    /// [`ModelIndex::device_bytes`] counts them.
    pub fn device_bytes(&self, name: &str, on_cpu: bool, dtype: DType) -> u64 {
        self.index.device_bytes(name, on_cpu, dtype.size_in_bytes() as u64)
    }

    /// The float type of the model's layer matrices, when they are stored as floats (None when
    /// they are quantized): the dtype a GPU computes such a model in.
    pub fn dense_dtype(&self) -> Option<DType> {
        self.index.dense_type().and_then(float_dtype)
    }

    /// [`ModelIndex::device_profile`] with dense tensors in `dtype`.
    pub fn device_profile(&self, kv_elem_bytes: u64, on_cpu: bool, dtype: DType) -> brigade_core::ModelProfile {
        self.index.device_profile(kv_elem_bytes, on_cpu, dtype.size_in_bytes() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_types_map_to_candles_one_to_one() {
        for t in GgmlType::ALL {
            let d = ggml_dtype(t);
            assert_eq!(ggml_type(d), t);
            assert_eq!((d.block_size(), d.type_size()), (t.block_size(), t.type_size()), "{t}");
            assert_eq!(float_dtype(t).is_some(), t.is_float());
        }
    }
}
