//! The activation frame codec, sans-IO: bytes in, frames out, and frames to bytes. No sockets,
//! no async, no clock.
//!
//! A frame on the wire is magic `BRGF`, the header length as u32 little-endian, the
//! [`FrameHeader`] protobuf, then exactly `payload_len` bytes (`proto/brigade/v1/frame.proto`).
//! Every length is checked before anything is allocated for it; a frame whose lengths lie is a
//! [`FrameError`] naming the numbers, and after one the [`Decoder`] stays failed: the carrier
//! must drop the connection, since the byte stream can no longer be trusted to be in step.

use brigade_proto::v1::{FrameHeader, FrameKind, SessionSpec, StageTrace, WireDtype};
use brigade_proto::PROTOCOL_VERSION;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::Message;

use crate::wire;

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"BRGF";
/// Magic plus the header length.
pub const PREFIX_LEN: usize = 8;
/// `flags`: the last chunk of a prompt, the last BULK frame of a probe, or the PONG answering it.
pub const FLAG_LAST: u32 = 1;
/// `flags`: on TOKENS back to the driver, the id ends the generation.
pub const FLAG_EOG: u32 = 2;
/// `flags`: on TOKENS back to the driver, the id completes the session's format: it is the
/// answer's last.
pub const FLAG_DONE: u32 = 4;
/// `flags`: on TOKENS or HIDDEN to a stage, the rows are a decode run (the last drawn id, then
/// a draft) of one session, each row a decode row of its own; the last stage draws along them
/// and sends back the ids up to the first that is not the draft's (speculative decoding).
pub const FLAG_DRAFT: u32 = 8;
/// On EXPERTS: the experts run with the decode rows' matmul (`MatMul::Rows`), not the prompt's.
pub const FLAG_ROWS: u32 = 16;
/// The largest header a receiver accepts (frame.proto: at most 4 KiB).
pub const MAX_HEADER: u32 = 4096;
/// The largest payload a receiver accepts unless told otherwise.
pub const DEFAULT_MAX_PAYLOAD: u64 = 256 << 20;
/// ERROR texts are cut to this many bytes so that the header always fits in [`MAX_HEADER`].
const MAX_TEXT: usize = 1024;

/// What a receiver accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_header: u32,
    pub max_payload: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self { max_header: MAX_HEADER, max_payload: DEFAULT_MAX_PAYLOAD }
    }
}

/// Why bytes are not a valid frame (or values not a valid payload).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad frame magic `{found}`: expected `BRGF`")]
    BadMagic { found: String },
    #[error("frame header of {len} bytes exceeds the limit of {max}")]
    HeaderTooLong { len: u64, max: u32 },
    #[error("frame header does not decode: {0}")]
    BadHeader(String),
    #[error("frame payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLong { len: u64, max: u64 },
    #[error("unknown frame kind {0}")]
    UnknownKind(i32),
    #[error("{kind} frame has dtype {dtype}: expected {expected}")]
    BadDtype { kind: &'static str, dtype: i32, expected: &'static str },
    #[error("{kind} frame has shape {shape:?}: expected {dims} dimensions")]
    BadShape { kind: &'static str, shape: Vec<u64>, dims: usize },
    #[error("frame has {rows} rows but its shape {shape:?} starts with another number")]
    RowsMismatch { rows: u32, shape: Vec<u64> },
    #[error("frame shape {shape:?} of {size}-byte elements overflows 64 bits")]
    ShapeOverflow { shape: Vec<u64>, size: u64 },
    #[error("frame payload_len {payload_len} but shape {shape:?} of {size}-byte elements needs {expected}")]
    PayloadMismatch { payload_len: u64, expected: u64, shape: Vec<u64>, size: u64 },
    #[error("frame header says {header} payload bytes but {actual} are there")]
    PayloadLength { header: u64, actual: u64 },
    #[error("frame is truncated: {have} bytes, the frame needs {need}")]
    Truncated { have: u64, need: u64 },
    #[error("{len} bytes are not a whole number of {size}-byte {dtype} values")]
    Ragged { len: usize, size: usize, dtype: &'static str },
    #[error("{values} values do not make {rows} rows of {cols}")]
    ValueCount { values: usize, rows: u32, cols: u64 },
    #[error("expected a {expected} frame, got {got}")]
    WrongKind { expected: &'static str, got: String },
    #[error("session spec does not decode: {0}")]
    BadSpec(String),
    #[error("{kind} frame has no rows")]
    NoRows { kind: &'static str },
    #[error("HIDDEN frame of shape {shape:?}: this model's hidden size is {cols}")]
    Width { shape: Vec<u64>, cols: u64 },
    #[error("EXPERTS frame with {values} expert_rows values: expected (expert, rows) pairs")]
    ExpertPairs { values: usize },
    #[error("EXPERTS frame: expert {expert} called with no rows")]
    ExpertNoRows { expert: u32 },
    #[error("EXPERTS frame: its pairs add up to {sum} rows, the frame has {rows}")]
    ExpertRowSum { sum: u64, rows: u32 },
}

/// What an EXPERTS frame asks for ([`Frame::expert_calls`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertCall {
    /// The layer whose experts are called.
    pub layer: u32,
    /// (expert, rows) pairs, in the order of the rows.
    pub calls: Vec<(u32, usize)>,
    /// The calls' rows one after another, `hidden` values each.
    pub rows: Vec<f32>,
}

/// One activation frame: the header and exactly `header.payload_len` bytes of payload.
///
/// Build frames with the constructors, which fill `protocol`, `kind`, `payload_len` (and `dtype`,
/// `rows`, `shape` for tensors); add the session with [`Frame::in_session`].
#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub header: FrameHeader,
    pub payload: Bytes,
}

impl Frame {
    fn new(kind: FrameKind, payload: Bytes) -> Self {
        Self {
            header: FrameHeader {
                protocol: PROTOCOL_VERSION,
                kind: kind as i32,
                payload_len: payload.len() as u64,
                ..FrameHeader::default()
            },
            payload,
        }
    }

    /// The first frame each way on every link: the sender's node name.
    pub fn hello(node_name: &str) -> Self {
        let mut frame = Self::new(FrameKind::Hello, Bytes::new());
        frame.header.text = node_name.to_owned();
        frame
    }

    /// A session starts; the payload is the encoded [`SessionSpec`].
    pub fn open(spec: &SessionSpec) -> Self {
        Self::new(FrameKind::Open, Bytes::from(spec.encode_to_vec()))
    }

    /// Hidden states: `rows × cols` values of `dtype` (f32, f16 or bf16) already in wire bytes.
    pub fn hidden(
        step: u64,
        first_position: u64,
        rows: u32,
        cols: u64,
        dtype: WireDtype,
        payload: Bytes,
    ) -> Result<Self, FrameError> {
        let mut frame = Self::new(FrameKind::Hidden, payload);
        frame.header.step = step;
        frame.header.first_position = first_position;
        frame.header.rows = rows;
        frame.header.dtype = dtype as i32;
        frame.header.shape = vec![u64::from(rows), cols];
        check_header(&frame.header, &Limits::default())?;
        Ok(frame)
    }

    /// Hidden states from f32 values (row-major, `rows × cols`), converted to `dtype` on the wire.
    pub fn hidden_f32(
        step: u64,
        first_position: u64,
        rows: u32,
        cols: u64,
        values: &[f32],
        dtype: WireDtype,
    ) -> Result<Self, FrameError> {
        let expected = u64::from(rows).checked_mul(cols);
        if expected != Some(values.len() as u64) {
            return Err(FrameError::ValueCount { values: values.len(), rows, cols });
        }
        let payload = wire::f32_to_wire(values, dtype)?;
        Self::hidden(step, first_position, rows, cols, dtype, payload)
    }

    /// Token ids (u32 little-endian): prompt tokens into a first stage, or a sampled id back.
    pub fn tokens(step: u64, first_position: u64, ids: &[u32]) -> Self {
        let mut frame = Self::new(FrameKind::Tokens, wire::u32_to_wire(ids));
        frame.header.step = step;
        frame.header.first_position = first_position;
        // a frame of more than u32::MAX ids would exceed every payload limit; saturating keeps
        // the constructor infallible and the decoder refuses the frame
        frame.header.rows = u32::try_from(ids.len()).unwrap_or(u32::MAX);
        frame.header.dtype = WireDtype::U32 as i32;
        frame.header.shape = vec![ids.len() as u64];
        frame
    }

    /// The header of hidden rows handed to a stage in the same process (the hop between two
    /// stages of one node): a HIDDEN frame's header for `rows × cols` values with no payload —
    /// the rows travel beside it as the sender computed them. Never sent: it is not encodable
    /// (its payload is missing), so a link refuses it.
    pub fn handed_over(step: u64, first_position: u64, rows: u32, cols: u64) -> Self {
        let mut frame = Self::new(FrameKind::Hidden, Bytes::new());
        frame.header.step = step;
        frame.header.first_position = first_position;
        frame.header.rows = rows;
        frame.header.dtype = WireDtype::F32 as i32;
        frame.header.shape = vec![u64::from(rows), cols];
        frame
    }

    /// A call of layer `layer`'s experts held on another node: `calls` are (expert, rows) pairs,
    /// `xs` their rows one after another, `cols` wide, sent in f32 (the numbers the experts get
    /// are the caller's). `rows`: the decode rows' matmul ([`FLAG_ROWS`]).
    pub fn experts(layer: u32, calls: &[(u32, usize)], xs: &[f32], cols: u64, rows: bool) -> Result<Self, FrameError> {
        let n: usize = calls.iter().map(|c| c.1).sum();
        let n32 = u32::try_from(n).map_err(|_| FrameError::ValueCount { values: xs.len(), rows: u32::MAX, cols })?;
        let mut frame = Self::f32_rows(FrameKind::Experts, n32, cols, xs)?;
        frame.header.layer = layer;
        for &(e, m) in calls {
            let m = u32::try_from(m).map_err(|_| FrameError::ValueCount { values: xs.len(), rows: u32::MAX, cols })?;
            frame.header.expert_rows.extend([e, m]);
        }
        if rows {
            frame.header.flags |= FLAG_ROWS;
        }
        Ok(frame)
    }

    /// The answer to an EXPERTS frame: the outputs, `rows × cols` f32.
    pub fn experts_out(rows: u32, cols: u64, ys: &[f32]) -> Result<Self, FrameError> {
        Self::f32_rows(FrameKind::ExpertsOut, rows, cols, ys)
    }

    fn f32_rows(kind: FrameKind, rows: u32, cols: u64, values: &[f32]) -> Result<Self, FrameError> {
        if u64::from(rows).checked_mul(cols) != Some(values.len() as u64) {
            return Err(FrameError::ValueCount { values: values.len(), rows, cols });
        }
        let mut frame = Self::new(kind, wire::f32_to_wire(values, WireDtype::F32)?);
        frame.header.rows = rows;
        frame.header.dtype = WireDtype::F32 as i32;
        frame.header.shape = vec![u64::from(rows), cols];
        check_header(&frame.header, &Limits::default())?;
        Ok(frame)
    }

    /// An EXPERTS frame's layer, (expert, rows) pairs and rows ([`Frame::tensor`]'s checks, the
    /// width, and pairs of rows that add up to the frame's).
    pub fn expert_calls(&self, cols: usize) -> Result<ExpertCall, FrameError> {
        let xs = self.f32_values(FrameKind::Experts, cols)?;
        let pairs = &self.header.expert_rows;
        if !pairs.len().is_multiple_of(2) || pairs.is_empty() {
            return Err(FrameError::ExpertPairs { values: pairs.len() });
        }
        let calls: Vec<(u32, usize)> = pairs.chunks_exact(2).map(|p| (p[0], p[1] as usize)).collect();
        if let Some(&(expert, _)) = calls.iter().find(|c| c.1 == 0) {
            return Err(FrameError::ExpertNoRows { expert });
        }
        let sum: u64 = calls.iter().map(|c| c.1 as u64).sum();
        if sum != u64::from(self.header.rows) {
            return Err(FrameError::ExpertRowSum { sum, rows: self.header.rows });
        }
        Ok(ExpertCall { layer: self.header.layer, calls, rows: xs })
    }

    /// An EXPERTS_OUT frame's outputs ([`Frame::tensor`]'s checks and the width).
    pub fn expert_outputs(&self, cols: usize) -> Result<Vec<f32>, FrameError> {
        self.f32_values(FrameKind::ExpertsOut, cols)
    }

    /// The values of a `rows × cols` tensor frame of `kind` (HIDDEN, EXPERTS, EXPERTS_OUT) as f32,
    /// row-major: [`Frame::tensor`]'s checks, which include the dtypes the kind allows, and the
    /// width.
    fn f32_values(&self, kind: FrameKind, cols: usize) -> Result<Vec<f32>, FrameError> {
        self.tensor(kind)?;
        if self.header.shape.get(1) != Some(&(cols as u64)) {
            return Err(FrameError::Width { shape: self.header.shape.clone(), cols: cols as u64 });
        }
        let dtype = WireDtype::try_from(self.header.dtype).unwrap_or(WireDtype::Unspecified);
        wire::f32_from_wire(&self.payload, dtype)
    }

    /// A session ends.
    pub fn close() -> Self {
        Self::new(FrameKind::Close, Bytes::new())
    }

    /// A stage could not process a frame; `text` says why (cut to 1 KiB).
    pub fn error(text: &str) -> Self {
        let mut frame = Self::new(FrameKind::Error, Bytes::new());
        let mut end = text.len().min(MAX_TEXT);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        frame.header.text = text[..end].to_owned();
        frame
    }

    /// Link measurement: answered by a PONG with the same step.
    pub fn ping(step: u64) -> Self {
        let mut frame = Self::new(FrameKind::Ping, Bytes::new());
        frame.header.step = step;
        frame
    }

    /// The answer to a PING (or, with [`FLAG_LAST`], to the last BULK frame).
    pub fn pong(step: u64) -> Self {
        let mut frame = Self::new(FrameKind::Pong, Bytes::new());
        frame.header.step = step;
        frame
    }

    /// Link measurement: bytes to count; `last` asks for the PONG with the count.
    pub fn bulk(step: u64, payload: Bytes, last: bool) -> Self {
        let mut frame = Self::new(FrameKind::Bulk, payload);
        frame.header.step = step;
        if last {
            frame.header.flags |= FLAG_LAST;
        }
        frame
    }

    /// Addresses the frame to one session of one deployment generation.
    pub fn in_session(mut self, deployment: &str, generation: u64, session: u64) -> Self {
        deployment.clone_into(&mut self.header.deployment);
        self.header.generation = generation;
        self.header.session = session;
        self
    }

    /// Sets flags ([`FLAG_LAST`], [`FLAG_EOG`]) in addition to those already set.
    pub fn with_flags(mut self, flags: u32) -> Self {
        self.header.flags |= flags;
        self
    }

    /// Appends one stage's timing to the frame's trace.
    pub fn with_trace(mut self, trace: StageTrace) -> Self {
        self.header.trace.push(trace);
        self
    }

    /// The frame's kind, `None` for a number this build does not know.
    pub fn kind(&self) -> Option<FrameKind> {
        FrameKind::try_from(self.header.kind).ok()
    }

    pub fn has_flag(&self, flag: u32) -> bool {
        self.header.flags & flag == flag
    }

    /// The [`SessionSpec`] of an OPEN frame.
    pub fn spec(&self) -> Result<SessionSpec, FrameError> {
        self.expect(FrameKind::Open)?;
        SessionSpec::decode(self.payload.clone()).map_err(|e| FrameError::BadSpec(e.to_string()))
    }

    /// The values of a HIDDEN frame of `cols` columns as f32, row-major ([`Frame::tensor`]'s
    /// checks, and the width).
    pub fn hidden_values(&self, cols: usize) -> Result<Vec<f32>, FrameError> {
        self.f32_values(FrameKind::Hidden, cols)
    }

    /// The ids of a TOKENS frame ([`Frame::tensor`]'s checks).
    pub fn token_ids(&self) -> Result<Vec<u32>, FrameError> {
        self.tensor(FrameKind::Tokens)?;
        wire::u32_from_wire(&self.payload)
    }

    /// A tensor frame of `kind` held to what the codec holds a decoded one to ([`check_header`]:
    /// dtype, shape, rows, payload length by the header) and more: its payload is as long as its
    /// header says and it has a row at least. Frames built in process (a stage hands its rows
    /// to the next on the same node; a test) are checked here too.
    fn tensor(&self, kind: FrameKind) -> Result<(), FrameError> {
        self.expect(kind)?;
        check_header(&self.header, &Limits { max_header: MAX_HEADER, max_payload: u64::MAX })?;
        if self.payload.len() as u64 != self.header.payload_len {
            return Err(FrameError::PayloadLength {
                header: self.header.payload_len,
                actual: self.payload.len() as u64,
            });
        }
        if self.header.rows == 0 {
            return Err(FrameError::NoRows { kind: kind.as_str_name() });
        }
        Ok(())
    }

    fn expect(&self, kind: FrameKind) -> Result<(), FrameError> {
        if self.kind() == Some(kind) {
            Ok(())
        } else {
            Err(FrameError::WrongKind { expected: kind.as_str_name(), got: kind_name(self.header.kind) })
        }
    }
}

fn kind_name(kind: i32) -> String {
    FrameKind::try_from(kind).map(|k| k.as_str_name().to_owned()).unwrap_or_else(|_| format!("kind {kind}"))
}

/// Checks a header's numbers: payload within the limit, a known kind, and for HIDDEN and TOKENS
/// `payload_len == product(shape) × dtype size` with `rows == shape[0]` (checked arithmetic).
pub fn check_header(header: &FrameHeader, limits: &Limits) -> Result<(), FrameError> {
    if header.payload_len > limits.max_payload {
        return Err(FrameError::PayloadTooLong { len: header.payload_len, max: limits.max_payload });
    }
    let kind = FrameKind::try_from(header.kind).map_err(|_| FrameError::UnknownKind(header.kind))?;
    let (dims, allowed): (usize, &[WireDtype]) = match kind {
        FrameKind::Hidden => (2, &[WireDtype::F32, WireDtype::F16, WireDtype::Bf16]),
        FrameKind::Tokens => (1, &[WireDtype::U32]),
        FrameKind::Experts | FrameKind::ExpertsOut => (2, &[WireDtype::F32]),
        _ => return Ok(()),
    };
    let kind_str = kind.as_str_name();
    let dtype = WireDtype::try_from(header.dtype).ok().filter(|d| allowed.contains(d)).ok_or(FrameError::BadDtype {
        kind: kind_str,
        dtype: header.dtype,
        expected: if dims == 2 { "F32, F16 or BF16" } else { "U32" },
    })?;
    if header.shape.len() != dims {
        return Err(FrameError::BadShape { kind: kind_str, shape: header.shape.clone(), dims });
    }
    if header.shape.first() != Some(&u64::from(header.rows)) {
        return Err(FrameError::RowsMismatch { rows: header.rows, shape: header.shape.clone() });
    }
    let size = wire::dtype_size(dtype).unwrap_or(0) as u64;
    let expected = header
        .shape
        .iter()
        .try_fold(size, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| FrameError::ShapeOverflow { shape: header.shape.clone(), size })?;
    if expected != header.payload_len {
        return Err(FrameError::PayloadMismatch {
            payload_len: header.payload_len,
            expected,
            shape: header.shape.clone(),
            size,
        });
    }
    Ok(())
}

/// Appends the frame's magic, header length and header to `out` (not the payload): carriers that
/// can send the payload as its own buffer write it after this without copying it.
pub fn encode_head(frame: &Frame, out: &mut BytesMut) -> Result<(), FrameError> {
    let len32 = check_encodable(frame)?;
    out.reserve(PREFIX_LEN + len32 as usize);
    out.put_slice(&MAGIC);
    out.put_u32_le(len32);
    frame.header.encode(out).map_err(|e| FrameError::BadHeader(e.to_string()))
}

/// Whether `frame` can be sent as it is (the header's payload length true, the header valid and
/// at most [`MAX_HEADER`] bytes); returns the header's encoded length. Senders check before a
/// frame is queued on a shared link, so that a bad frame fails its own session, not the link.
pub fn check_encodable(frame: &Frame) -> Result<u32, FrameError> {
    let actual = frame.payload.len() as u64;
    if frame.header.payload_len != actual {
        return Err(FrameError::PayloadLength { header: frame.header.payload_len, actual });
    }
    check_header(&frame.header, &Limits::default())?;
    let len = frame.header.encoded_len();
    u32::try_from(len)
        .ok()
        .filter(|&l| l <= MAX_HEADER)
        .ok_or(FrameError::HeaderTooLong { len: len as u64, max: MAX_HEADER })
}

/// Appends the whole frame to `out`. Refuses frames a receiver with default [`Limits`] would
/// refuse, so a bug shows at the sender instead of dropping the peer's link.
pub fn encode(frame: &Frame, out: &mut BytesMut) -> Result<(), FrameError> {
    encode_head(frame, out)?;
    out.put_slice(&frame.payload);
    Ok(())
}

/// Reads the prefix and header at the start of `buf`: `Ok(None)` until they are all there, then
/// the checked header and the bytes it took.
fn parse_head(buf: &[u8], limits: &Limits) -> Result<Option<(FrameHeader, usize)>, FrameError> {
    let n = buf.len().min(MAGIC.len());
    if buf[..n] != MAGIC[..n] {
        return Err(FrameError::BadMagic { found: buf[..n].escape_ascii().to_string() });
    }
    let Some(len_bytes) = buf.get(4..PREFIX_LEN) else {
        return Ok(None);
    };
    let mut len_bytes = len_bytes;
    let header_len = len_bytes.get_u32_le();
    if header_len > limits.max_header {
        return Err(FrameError::HeaderTooLong { len: u64::from(header_len), max: limits.max_header });
    }
    let end = PREFIX_LEN + header_len as usize;
    let Some(header_bytes) = buf.get(PREFIX_LEN..end) else {
        return Ok(None);
    };
    let header = FrameHeader::decode(header_bytes).map_err(|e| FrameError::BadHeader(e.to_string()))?;
    check_header(&header, limits)?;
    Ok(Some((header, end)))
}

/// Decodes `bytes` that must hold exactly one frame (one gRPC `FrameBytes` message). The payload
/// is a slice of `bytes`, not a copy.
pub fn decode_exact(bytes: Bytes, limits: &Limits) -> Result<Frame, FrameError> {
    let Some((header, head_len)) = parse_head(&bytes, limits)? else {
        // parse_head has checked the header length against the limit when it is there
        let need = match bytes.get(4..PREFIX_LEN) {
            Some(mut len) => PREFIX_LEN as u64 + u64::from(len.get_u32_le()),
            None => PREFIX_LEN as u64,
        };
        return Err(FrameError::Truncated { have: bytes.len() as u64, need });
    };
    let actual = (bytes.len() - head_len) as u64;
    if actual != header.payload_len {
        return Err(FrameError::PayloadLength { header: header.payload_len, actual });
    }
    let payload = bytes.slice(head_len..);
    Ok(Frame { header, payload })
}

/// Turns a byte stream into frames.
///
/// Call [`Decoder::push`] with the bytes as they arrive, then [`Decoder::poll`] until it returns
/// `Ok(None)`. The buffer holds at most one frame's header and payload (bounded by [`Limits`])
/// plus one pushed chunk. After an error every `poll` returns that error again.
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    buf: BytesMut,
    /// The header of the frame whose payload is arriving (its prefix and header are consumed).
    pending: Option<FrameHeader>,
    failed: Option<FrameError>,
}

impl Decoder {
    pub fn new(limits: Limits) -> Self {
        Self { limits, buf: BytesMut::new(), pending: None, failed: None }
    }

    /// Adds received bytes. Ignored once the decoder has failed.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed, or the error that ended the
    /// stream.
    pub fn poll(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(error) = &self.failed {
            return Err(error.clone());
        }
        self.step().inspect_err(|error| {
            self.failed = Some(error.clone());
            self.buf = BytesMut::new();
            self.pending = None;
        })
    }

    /// Whether an error ended the stream.
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    /// Bytes received and not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    fn step(&mut self) -> Result<Option<Frame>, FrameError> {
        let header = match self.pending.take() {
            Some(header) => header,
            None => {
                let Some((header, head_len)) = parse_head(&self.buf, &self.limits)? else {
                    return Ok(None);
                };
                self.buf.advance(head_len);
                // checked against `max_payload` by parse_head, so this reservation is bounded
                let len = header.payload_len as usize;
                self.buf.reserve(len.saturating_sub(self.buf.len()));
                header
            }
        };
        let len = header.payload_len as usize;
        if self.buf.len() < len {
            self.pending = Some(header);
            return Ok(None);
        }
        let payload = self.buf.split_to(len).freeze();
        Ok(Some(Frame { header, payload }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(frame: &Frame) -> Vec<u8> {
        let mut out = BytesMut::new();
        assert_eq!(encode(frame, &mut out), Ok(()));
        out.to_vec()
    }

    #[test]
    fn hidden_frame_round_trips_through_the_decoder_byte_by_byte() {
        let values: Vec<f32> = (0..6).map(|i| i as f32 * 0.5).collect();
        let frame = Frame::hidden_f32(3, 10, 2, 3, &values, WireDtype::F32).map(|f| f.in_session("llama", 7, 42));
        let Ok(frame) = frame else {
            panic!("constructor refused a valid frame: {frame:?}");
        };
        let bytes = encoded(&frame);
        let mut decoder = Decoder::new(Limits::default());
        let mut out = Vec::new();
        for byte in &bytes {
            decoder.push(std::slice::from_ref(byte));
            while let Ok(Some(f)) = decoder.poll() {
                out.push(f);
            }
        }
        assert_eq!(out, vec![frame.clone()]);
        assert_eq!(decoder.buffered(), 0);
        assert_eq!(out[0].hidden_values(3), Ok(values));
        assert_eq!(decode_exact(Bytes::from(bytes), &Limits::default()), Ok(frame));
    }

    #[test]
    fn rows_handed_over_in_process_are_never_encoded() {
        let f = Frame::handed_over(1, 4, 2, 64).in_session("d", 1, 9);
        assert_eq!(f.header.shape, vec![2, 64]);
        assert_eq!(f.header.kind, FrameKind::Hidden as i32);
        assert!(check_encodable(&f).is_err(), "a header whose rows travel beside it must not reach a link");
        let mut out = BytesMut::new();
        assert!(encode(&f, &mut out).is_err());
    }

    #[test]
    fn lying_payload_len_is_refused_with_the_numbers_and_the_decoder_stays_failed() {
        let mut frame = Frame::tokens(0, 0, &[1, 2, 3]);
        frame.header.payload_len = 100;
        frame.payload = Bytes::from(vec![0u8; 100]);
        let mut out = BytesMut::new();
        let refused = encode(&frame, &mut out);
        assert!(matches!(refused, Err(FrameError::PayloadMismatch { payload_len: 100, expected: 12, .. })));
        // write it raw, as a lying peer would
        let mut raw = BytesMut::new();
        raw.put_slice(&MAGIC);
        raw.put_u32_le(frame.header.encoded_len() as u32);
        assert!(frame.header.encode(&mut raw).is_ok());
        let mut decoder = Decoder::new(Limits::default());
        decoder.push(&raw);
        let error = decoder.poll();
        assert!(matches!(error, Err(FrameError::PayloadMismatch { payload_len: 100, expected: 12, .. })));
        assert!(error.is_err_and(|e| e.to_string().contains("100") && e.to_string().contains("12")));
        decoder.push(&encoded(&Frame::close()));
        assert!(decoder.poll().is_err());
        assert!(decoder.is_failed());
    }

    #[test]
    fn a_truncated_message_says_how_much_it_needs() {
        let frame = Frame::tokens(0, 0, &[7, 8]);
        let bytes = Bytes::from(encoded(&frame));
        let head = (PREFIX_LEN + frame.header.encoded_len()) as u64;
        assert_eq!(
            decode_exact(bytes.slice(..10), &Limits::default()),
            Err(FrameError::Truncated { have: 10, need: head })
        );
        assert_eq!(decode_exact(bytes.slice(..3), &Limits::default()), Err(FrameError::Truncated { have: 3, need: 8 }));
        assert_eq!(
            decode_exact(bytes.slice(..bytes.len() - 1), &Limits::default()),
            Err(FrameError::PayloadLength { header: 8, actual: 7 })
        );
    }

    #[test]
    fn error_text_is_cut_at_a_char_boundary() {
        let text = "é".repeat(MAX_TEXT);
        let frame = Frame::error(&text);
        assert!(frame.header.text.len() <= MAX_TEXT);
        assert!(frame.header.text.len() >= MAX_TEXT - 1);
        assert_eq!(encoded(&frame).len(), PREFIX_LEN + frame.header.encoded_len());
    }

    #[test]
    fn helpers_refuse_the_wrong_kind_and_count() {
        assert!(matches!(Frame::close().token_ids(), Err(FrameError::WrongKind { expected: "TOKENS", .. })));
        assert_eq!(
            Frame::hidden_f32(0, 0, 2, 3, &[0.0; 5], WireDtype::F16),
            Err(FrameError::ValueCount { values: 5, rows: 2, cols: 3 })
        );
        let spec = SessionSpec { max_tokens: 9, prompt_ids: vec![1, 2], ..SessionSpec::default() };
        assert_eq!(Frame::open(&spec).spec(), Ok(spec));
    }

    /// A frame built in process (not through the decoder) is held to the decoder's checks when
    /// its ids or values are read, and to a row at least and the model's width.
    #[test]
    fn reading_a_tensor_checks_its_header_and_payload() {
        let good = Frame::tokens(0, 0, &[7, 8]);
        assert_eq!(good.token_ids(), Ok(vec![7, 8]));
        let mut f = good.clone();
        f.header.rows = 3;
        assert!(matches!(f.token_ids(), Err(FrameError::RowsMismatch { rows: 3, .. })));
        let mut f = good.clone();
        f.payload = f.payload.slice(..4);
        assert_eq!(f.token_ids(), Err(FrameError::PayloadLength { header: 8, actual: 4 }));
        let mut f = good.clone();
        f.header.dtype = WireDtype::F32 as i32;
        assert!(matches!(f.token_ids(), Err(FrameError::BadDtype { .. })));
        assert_eq!(Frame::tokens(0, 0, &[]).token_ids(), Err(FrameError::NoRows { kind: "TOKENS" }));
        let h = Frame::hidden_f32(0, 0, 2, 3, &[0.5; 6], WireDtype::Bf16).unwrap();
        assert_eq!(h.hidden_values(3), Ok(vec![0.5; 6]));
        assert_eq!(h.hidden_values(4), Err(FrameError::Width { shape: vec![2, 3], cols: 4 }));
    }

    #[test]
    fn expert_calls_round_trip_and_malformed_ones_are_refused() {
        let xs: Vec<f32> = (0..3 * 4).map(|i| i as f32 / 3.0).collect();
        let f = Frame::experts(5, &[(2, 1), (7, 2)], &xs, 4, true).unwrap().in_session("d", 3, 99);
        let mut buf = BytesMut::new();
        encode(&f, &mut buf).unwrap();
        let back = decode_exact(buf.freeze(), &Limits::default()).unwrap();
        assert!(back.has_flag(FLAG_ROWS));
        let want = ExpertCall { layer: 5, calls: vec![(2, 1), (7, 2)], rows: xs.clone() };
        assert_eq!(back.expert_calls(4), Ok(want));
        assert_eq!(back.expert_calls(3), Err(FrameError::Width { shape: vec![3, 4], cols: 3 }));
        assert!(matches!(Frame::experts(5, &[(2, 2)], &xs, 4, false), Err(FrameError::ValueCount { .. })));
        let bad = |edit: fn(&mut Frame)| {
            let mut g = f.clone();
            edit(&mut g);
            g.expert_calls(4)
        };
        assert_eq!(
            bad(|g| g.header.expert_rows.pop().map(drop).unwrap_or(())),
            Err(FrameError::ExpertPairs { values: 3 })
        );
        assert_eq!(bad(|g| g.header.expert_rows.clear()), Err(FrameError::ExpertPairs { values: 0 }));
        assert_eq!(bad(|g| g.header.expert_rows = vec![2, 0, 7, 3]), Err(FrameError::ExpertNoRows { expert: 2 }));
        assert_eq!(bad(|g| g.header.expert_rows = vec![2, 1, 7, 1]), Err(FrameError::ExpertRowSum { sum: 2, rows: 3 }));
        assert!(matches!(bad(|g| g.header.dtype = WireDtype::F16 as i32), Err(FrameError::BadDtype { .. })));
        assert!(matches!(bad(|g| g.header.kind = FrameKind::Hidden as i32), Err(FrameError::WrongKind { .. })));
        let out = Frame::experts_out(3, 4, &xs).unwrap();
        assert_eq!(out.expert_outputs(4), Ok(xs.clone()));
        assert!(matches!(out.expert_calls(4), Err(FrameError::WrongKind { .. })));
    }
}
