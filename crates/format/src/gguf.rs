//! GGUF (v2, v3) header reader and writer.
//!
//! Written here rather than taken from `candle_core::quantized::gguf_file` because a model file is
//! outside input: candle's reader sizes allocations by the string, array and tensor counts it
//! reads (`vec![0; len]`) and panics on some malformed headers. This reader works on the mapped
//! bytes and checks every length against the bytes that remain before it allocates anything, and
//! bounds what arrays expand to (every element becomes a [`Value`], whatever its size in the
//! file: see [`MAX_EXPANSION`]), so a hostile header costs at most a few times the file's size in
//! memory, and every failure is a [`GgufError`] that names the problem. Tensor data is not read
//! here: [`TensorInfo`] gives the checked byte range of each tensor inside the file.

pub use crate::ggml::GgmlType;
use std::collections::HashMap;
use std::io::Write;

pub const MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: usize = 4;
const MAX_ARRAY_NESTING: usize = 2;
/// The smallest encoding of one tensor info: name length (8) + 1 byte of name + n_dims (4)
/// + one dim (8) + type (4) + offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 33;
/// The smallest encoding of one key/value: key length (8) + 1 byte of key + type (4) + 1 byte.
const MIN_KV_BYTES: u64 = 14;
/// The array elements of a header, materialised as [`Value`]s, take at most this many times the
/// file's size. A one-byte element (u8, i8, bool) becomes a whole `Value` (32 bytes on 64-bit
/// targets), so without this bound a file of byte arrays would expand 32-fold; the largest arrays
/// of real files (a vocabulary's strings, scores and types) stay far below it.
pub const MAX_EXPANSION: u64 = 8;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    // the bytes found stay out of the message: a path named by a remote caller (`deploy -m`)
    // must not echo the start of whatever file it is
    #[error("not a GGUF file: it does not begin with \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (brigade reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("GGUF file is truncated: {what} needs {need} bytes at offset {offset}, the file has {len}")]
    Truncated { what: String, offset: u64, need: u64, len: u64 },
    #[error("GGUF header claims {count} {what}, but only {remaining} bytes remain (at least {min_each} bytes each)")]
    AbsurdCount { what: &'static str, count: u64, remaining: u64, min_each: u64 },
    #[error("GGUF metadata key `{key}` has unknown value type {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("GGUF metadata key `{key}`: arrays nested deeper than {MAX_ARRAY_NESTING} levels")]
    TooDeep { key: String },
    #[error(
        "GGUF metadata key `{key}`: {elements} array elements in all would take {bytes} bytes in memory, \
         more than {MAX_EXPANSION} times the file's {len} bytes"
    )]
    ArraysTooLarge { key: String, elements: u64, bytes: u64, len: u64 },
    #[error("GGUF string at offset {offset} is not valid UTF-8")]
    BadUtf8 { offset: u64 },
    #[error("GGUF metadata key `{0}` appears twice")]
    DuplicateKey(String),
    #[error("GGUF tensor `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("tensor `{name}` has {n_dims} dimensions (at most {MAX_DIMS} are allowed)")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor `{name}` has invalid dimensions {dims:?}: {why}")]
    BadDims { name: String, dims: Vec<u64>, why: String },
    #[error("tensor `{name}` has unknown or unsupported type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor `{name}` data [{start}, {end}) lies past the end of the file ({len} bytes)")]
    DataPastEnd { name: String, start: u64, end: u64, len: u64 },
    #[error("tensor `{name}` data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { name: String, offset: u64, alignment: u64 },
    #[error("GGUF general.alignment is {0}: it must be a nonzero power of two")]
    BadAlignment(u64),
    #[error("io error writing GGUF: {0}")]
    Io(#[from] std::io::Error),
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value for a message: an array by its length, a long string cut (a hostile file's
    /// value may be megabytes).
    pub fn brief(&self) -> String {
        match self {
            Value::Array(a) => format!("an array of {} values", a.len()),
            Value::String(s) if s.len() > 64 => {
                let cut = (0..=64).rev().find(|&i| s.is_char_boundary(i)).unwrap_or(0);
                format!("{:?}… ({} bytes)", &s[..cut], s.len())
            }
            v => format!("{v:?}"),
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, whatever integer type the file used; `None` for
    /// negative numbers and non-integers.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v as i64),
            Value::I16(v) => Some(v as i64),
            Value::I32(v) => Some(v as i64),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => self.as_u64().map(|v| v != 0),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor of the file: its name, dims in GGUF order (`ne0` first: the row length), type, and
/// its checked absolute byte range in the file.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Elements of the tensor (the parser checked that the product does not overflow).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }
    /// The shape in candle order (outermost first): GGUF's `[ne0, ne1]` is candle's `(ne1, ne0)`.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed GGUF header.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    pub metadata: HashMap<String, Value>,
    /// Keys in file order (for listing).
    pub keys: Vec<String>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    pub alignment: u64,
    pub data_start: u64,
}

/// Bytes of `n_elements` of `dtype` in rows of `row_len` elements; `None` when a row is not a
/// whole number of blocks or the size overflows.
pub fn tensor_bytes(dtype: GgmlType, row_len: u64, n_elements: u64) -> Option<u64> {
    dtype.bytes(row_len, n_elements)
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    version: u32,
    /// Array elements materialised so far, against [`MAX_EXPANSION`].
    elements: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                need: n,
                len: self.buf.len() as u64,
            });
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, || what.to_string())?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length or count: u64 in v2/v3 (v1, with u32 counts, is refused at the start).
    fn len(&mut self, what: &str) -> Result<u64, GgufError> {
        debug_assert!(self.version >= 2);
        self.u64(what)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.len(what)?;
        let start = self.pos as u64;
        let bytes = self.take(len, || format!("{what} ({len} bytes)"))?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8 { offset: start })
    }

    /// `count` items of at least `min_each` bytes fit in the bytes that remain.
    fn fits(&self, what: &'static str, count: u64, min_each: u64) -> Result<(), GgufError> {
        let remaining = self.remaining();
        if count > remaining / min_each {
            return Err(GgufError::AbsurdCount { what, count, remaining, min_each });
        }
        Ok(())
    }

    /// Counts `count` more array elements against the expansion bound, before they are allocated.
    fn charge(&mut self, key: &str, count: u64) -> Result<(), GgufError> {
        let len = self.buf.len() as u64;
        let elements = self.elements.saturating_add(count);
        let bytes = elements.saturating_mul(std::mem::size_of::<Value>() as u64);
        if bytes > len.saturating_mul(MAX_EXPANSION) {
            return Err(GgufError::ArraysTooLarge { key: key.to_string(), elements, bytes, len });
        }
        self.elements = elements;
        Ok(())
    }

    fn value(&mut self, key: &str, type_id: u32, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("value of `{key}`");
        Ok(match type_id {
            0 => Value::U8(self.array::<1>(&what())?[0]),
            1 => Value::I8(self.array::<1>(&what())?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(&what())?)),
            3 => Value::I16(i16::from_le_bytes(self.array(&what())?)),
            4 => Value::U32(u32::from_le_bytes(self.array(&what())?)),
            5 => Value::I32(i32::from_le_bytes(self.array(&what())?)),
            6 => Value::F32(f32::from_le_bytes(self.array(&what())?)),
            7 => Value::Bool(self.array::<1>(&what())?[0] != 0),
            8 => Value::String(self.string(&what())?),
            9 => {
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::TooDeep { key: key.to_string() });
                }
                let elem_type = self.u32(&what())?;
                let min_each = match elem_type {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    t => return Err(GgufError::UnknownValueType { key: key.to_string(), type_id: t }),
                };
                let count = self.len(&what())?;
                self.fits("array elements", count, min_each)?;
                self.charge(key, count)?;
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(key, elem_type, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(&what())?)),
            11 => Value::I64(i64::from_le_bytes(self.array(&what())?)),
            12 => Value::F64(f64::from_le_bytes(self.array(&what())?)),
            t => return Err(GgufError::UnknownValueType { key: key.to_string(), type_id: t }),
        })
    }
}

impl Gguf {
    /// Parses the header of a GGUF file held in `buf` (usually memory-mapped) and checks every
    /// tensor's byte range against `buf.len()`.
    pub fn parse(buf: &[u8]) -> Result<Gguf, GgufError> {
        let mut c = Cursor { buf, pos: 0, version: 3, elements: 0 };
        let magic: [u8; 4] = c.array("magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        c.version = version;
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        c.fits("metadata entries", n_kv, MIN_KV_BYTES)?;
        c.fits("tensors", n_tensors, MIN_TENSOR_INFO_BYTES)?;

        let mut metadata = HashMap::with_capacity(n_kv as usize);
        let mut keys = Vec::with_capacity(n_kv as usize);
        for _ in 0..n_kv {
            let key = c.string("metadata key")?;
            let type_id = c.u32("metadata value type")?;
            let value = c.value(&key, type_id, 0)?;
            if metadata.insert(key.clone(), value).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            keys.push(key);
        }

        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => {
                let a = v.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        // Tensor infos hold relative offsets; they are made absolute once the data start is known.
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut index = HashMap::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor dimension count")?;
            if n_dims == 0 || n_dims as usize > MAX_DIMS {
                return Err(GgufError::TooManyDims { name, n_dims });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dimension")?);
            }
            let type_id = c.u32("tensor type")?;
            let offset = c.u64("tensor offset")?;
            let dtype = GgmlType::from_id(type_id)
                .ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), type_id })?;
            if dims.contains(&0) {
                return Err(GgufError::BadDims { name, dims, why: "a dimension is zero".into() });
            }
            let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
            let Some(n_elements) = n_elements.filter(|&n| n <= i64::MAX as u64) else {
                return Err(GgufError::BadDims { name, dims, why: "the element count overflows".into() });
            };
            let Some(n_bytes) = tensor_bytes(dtype, dims[0], n_elements) else {
                let bs = dtype.block_size();
                return Err(GgufError::BadDims {
                    name,
                    dims,
                    why: format!("the row length is not a multiple of the {dtype} block size {bs}"),
                });
            };
            if offset % alignment != 0 {
                return Err(GgufError::Misaligned { name, offset, alignment });
            }
            if index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(name));
            }
            tensors.push(TensorInfo { name, dims, dtype, offset, n_bytes });
        }

        let header_end = c.pos as u64;
        let data_start = header_end.div_ceil(alignment) * alignment;
        let len = buf.len() as u64;
        for t in &mut tensors {
            let start = data_start.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(t.n_bytes));
            match (start, end) {
                (Some(start), Some(end)) if end <= len => t.offset = start,
                _ => {
                    return Err(GgufError::DataPastEnd {
                        name: t.name.clone(),
                        start: data_start.saturating_add(t.offset),
                        end: data_start.saturating_add(t.offset).saturating_add(t.n_bytes),
                        len,
                    })
                }
            }
        }

        Ok(Gguf { version, metadata, keys, tensors, index, alignment, data_start })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of a tensor inside `buf` (the same buffer [`Gguf::parse`] checked).
    pub fn tensor_data<'a>(&self, buf: &'a [u8], t: &TensorInfo) -> &'a [u8] {
        &buf[t.offset as usize..(t.offset + t.n_bytes) as usize]
    }
}

/// A tensor to be written: name, GGUF dims (`ne0` first) and type. Its bytes come from the
/// callback given to [`write_gguf`].
#[derive(Debug, Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
}

impl TensorSpec {
    /// Bytes of the tensor; 0 for dims that give no whole number of blocks (the writer then
    /// refuses the bytes its callback produces).
    pub fn n_bytes(&self) -> u64 {
        let n = self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        match (n, self.dims.first()) {
            (Some(n), Some(&row)) => tensor_bytes(self.dtype, row, n).unwrap_or(0),
            _ => 0,
        }
    }
}

fn write_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn write_value(w: &mut impl Write, v: &Value) -> std::io::Result<()> {
    match v {
        Value::U8(x) => w.write_all(&[*x]),
        Value::I8(x) => w.write_all(&x.to_le_bytes()),
        Value::U16(x) => w.write_all(&x.to_le_bytes()),
        Value::I16(x) => w.write_all(&x.to_le_bytes()),
        Value::U32(x) => w.write_all(&x.to_le_bytes()),
        Value::I32(x) => w.write_all(&x.to_le_bytes()),
        Value::F32(x) => w.write_all(&x.to_le_bytes()),
        Value::Bool(x) => w.write_all(&[*x as u8]),
        Value::String(s) => write_str(w, s),
        Value::Array(items) => {
            let elem = items.first().map(Value::type_id).unwrap_or(4);
            w.write_all(&elem.to_le_bytes())?;
            w.write_all(&(items.len() as u64).to_le_bytes())?;
            for it in items {
                write_value(w, it)?;
            }
            Ok(())
        }
        Value::U64(x) => w.write_all(&x.to_le_bytes()),
        Value::I64(x) => w.write_all(&x.to_le_bytes()),
        Value::F64(x) => w.write_all(&x.to_le_bytes()),
    }
}

/// Writes a GGUF v3 file: the metadata, the tensor table, then each tensor's bytes as produced by
/// `fill(index, &mut buf)` (which must produce exactly `spec.n_bytes()` bytes), aligned to 32.
pub fn write_gguf<W: Write>(
    w: &mut W,
    metadata: &[(String, Value)],
    tensors: &[TensorSpec],
    mut fill: impl FnMut(usize, &mut Vec<u8>) -> std::io::Result<()>,
) -> Result<(), GgufError> {
    let mut header = Vec::new();
    header.extend_from_slice(&MAGIC);
    header.extend_from_slice(&3u32.to_le_bytes());
    header.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata {
        write_str(&mut header, k)?;
        header.extend_from_slice(&v.type_id().to_le_bytes());
        write_value(&mut header, v)?;
    }
    let mut offset = 0u64;
    for t in tensors {
        write_str(&mut header, &t.name)?;
        header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            header.extend_from_slice(&d.to_le_bytes());
        }
        header.extend_from_slice(&t.dtype.id().to_le_bytes());
        header.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + t.n_bytes()).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
    }
    let pad = (header.len() as u64).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT - header.len() as u64;
    header.resize(header.len() + pad as usize, 0);
    w.write_all(&header)?;
    let mut buf = Vec::new();
    for (i, t) in tensors.iter().enumerate() {
        buf.clear();
        fill(i, &mut buf)?;
        if buf.len() as u64 != t.n_bytes() {
            return Err(GgufError::Io(std::io::Error::other(format!(
                "tensor `{}`: produced {} bytes, expected {}",
                t.name,
                buf.len(),
                t.n_bytes()
            ))));
        }
        w.write_all(&buf)?;
        let padded = (t.n_bytes()).div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        w.write_all(&vec![0u8; (padded - t.n_bytes()) as usize])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_file() -> Vec<u8> {
        let md = vec![
            ("general.architecture".to_string(), Value::String("llama".into())),
            ("x.arr".to_string(), Value::Array(vec![Value::U32(1), Value::U32(2)])),
        ];
        let tensors = vec![
            TensorSpec { name: "a".into(), dims: vec![32, 2], dtype: GgmlType::F32 },
            TensorSpec { name: "b".into(), dims: vec![32], dtype: GgmlType::Q8_0 },
        ];
        let mut out = Vec::new();
        write_gguf(&mut out, &md, &tensors, |i, b| {
            b.resize(tensors[i].n_bytes() as usize, 7);
            Ok(())
        })
        .unwrap();
        out
    }

    #[test]
    fn roundtrip() {
        let f = small_file();
        let g = Gguf::parse(&f).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.get("general.architecture").and_then(Value::as_str), Some("llama"));
        let a = g.tensor("a").unwrap();
        assert_eq!(a.n_bytes, 256);
        assert_eq!(a.shape(), vec![2, 32]);
        let b = g.tensor("b").unwrap();
        assert_eq!(b.n_bytes, 34);
        assert_eq!(b.offset % 32, 0);
        assert!(g.tensor_data(&f, b).iter().all(|&x| x == 7));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let f = small_file();
        for n in 0..f.len() {
            // A cut inside the padding after the last tensor can still be a valid file.
            if let Ok(g) = Gguf::parse(&f[..n]) {
                let end = g.tensors.iter().map(|t| t.offset + t.n_bytes).max().unwrap();
                assert!(end <= n as u64);
            }
        }
        assert!(matches!(Gguf::parse(&f[..10]), Err(GgufError::Truncated { .. })));
    }

    #[test]
    fn hostile_counts() {
        let mut f = small_file();
        f[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(Gguf::parse(&f), Err(GgufError::AbsurdCount { what: "tensors", .. })));
        let mut f = small_file();
        f[16..24].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert!(matches!(Gguf::parse(&f), Err(GgufError::AbsurdCount { .. })));
        // the first key's length
        let mut f = small_file();
        f[24..32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(Gguf::parse(&f), Err(GgufError::Truncated { .. })));
        let mut f = small_file();
        f[0] = b'X';
        assert!(matches!(Gguf::parse(&f), Err(GgufError::BadMagic { .. })));
        let mut f = small_file();
        f[4] = 9;
        assert!(matches!(Gguf::parse(&f), Err(GgufError::UnsupportedVersion(9))));
    }

    #[test]
    fn tensor_specs_of_impossible_sizes_write_nothing() {
        let spec = |dims: Vec<u64>| TensorSpec { name: "t".into(), dims, dtype: GgmlType::F32 };
        // no dimensions, an element count past u64, a row of partial q8_0 blocks
        for s in [spec(vec![]), spec(vec![1 << 40, 1 << 40]), TensorSpec { dtype: GgmlType::Q8_0, ..spec(vec![33]) }] {
            assert_eq!(s.n_bytes(), 0, "{:?}", s.dims);
            let mut out = Vec::new();
            let e = write_gguf(&mut out, &[], std::slice::from_ref(&s), |_, b| {
                b.push(0);
                Ok(())
            });
            assert!(e.is_err(), "{:?}", s.dims);
        }
        assert_eq!(spec(vec![3, 2]).n_bytes(), 24);
    }

    /// A header with one key holding an array of `count` elements of type `elem` (`size` bytes each).
    fn one_array(elem: u32, size: usize, count: u64) -> Vec<u8> {
        let mut f = MAGIC.to_vec();
        f.extend(3u32.to_le_bytes());
        f.extend(0u64.to_le_bytes());
        f.extend(1u64.to_le_bytes());
        f.extend(1u64.to_le_bytes());
        f.push(b'a');
        f.extend(9u32.to_le_bytes());
        f.extend(elem.to_le_bytes());
        f.extend(count.to_le_bytes());
        f.resize(f.len() + size * count as usize, 1);
        f
    }

    #[test]
    fn arrays_expand_a_bounded_number_of_times() {
        // 64 Ki one-byte elements: 64 KiB in the file, 2 MiB as values (32-fold)
        for elem in [0, 1, 7] {
            let e = Gguf::parse(&one_array(elem, 1, 1 << 16)).err();
            assert!(matches!(e, Some(GgufError::ArraysTooLarge { elements: 65536, .. })), "{e:?}");
        }
        // u64 elements expand 4-fold: accepted
        let g = Gguf::parse(&one_array(10, 8, 1 << 16)).unwrap();
        assert_eq!(g.get("a").and_then(Value::as_array).map(<[Value]>::len), Some(1 << 16));
        // a short byte array in a larger file is fine too
        let mut f = one_array(0, 1, 100);
        f.resize(f.len() + 4096, 0);
        assert!(Gguf::parse(&f).is_ok());
    }
}
