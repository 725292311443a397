//! Property tests of the frame codec: round trips in any chunking, arbitrary bytes never
//! panic, truncated frames wait for more, lying lengths are refused with their numbers.

use brigade_proto::v1::{FrameHeader, FrameKind, StageTrace, WireDtype};
use brigade_transport::frame::{
    check_header, decode_exact, encode, Decoder, Frame, FrameError, Limits, MAGIC, MAX_HEADER,
};
use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;
use prost::Message;

fn dtype() -> impl Strategy<Value = WireDtype> {
    prop_oneof![Just(WireDtype::F32), Just(WireDtype::F16), Just(WireDtype::Bf16)]
}

/// Valid frames of every kind, with arbitrary routing fields and payloads.
fn frame() -> impl Strategy<Value = Frame> {
    let hidden = (0u32..4, 0u64..24, dtype()).prop_flat_map(|(rows, cols, dtype)| {
        let size = if dtype == WireDtype::F32 { 4 } else { 2 };
        let len = rows as usize * cols as usize * size;
        proptest::collection::vec(any::<u8>(), len).prop_map(move |payload| {
            Frame::hidden(1, 2, rows, cols, dtype, Bytes::from(payload))
                .unwrap_or_else(|e| Frame::error(&e.to_string()))
        })
    });
    let tokens = proptest::collection::vec(any::<u32>(), 0..16).prop_map(|ids| Frame::tokens(3, 4, &ids));
    let other = (
        prop_oneof![
            Just(FrameKind::Hello),
            Just(FrameKind::Open),
            Just(FrameKind::Close),
            Just(FrameKind::Error),
            Just(FrameKind::Ping),
            Just(FrameKind::Pong),
            Just(FrameKind::Bulk),
        ],
        proptest::collection::vec(any::<u8>(), 0..64),
        "[a-z0-9é ]{0,40}",
    )
        .prop_map(|(kind, payload, text)| {
            let mut frame = Frame::bulk(0, Bytes::from(payload), false);
            frame.header.kind = kind as i32;
            frame.header.text = text;
            frame
        });
    (
        prop_oneof![hidden, tokens, other],
        "[a-z-]{0,12}",
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        proptest::collection::vec((any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>()), 0..4),
    )
        .prop_map(|(frame, deployment, generation, session, step, flags, trace)| {
            let mut frame = frame.in_session(&deployment, generation, session).with_flags(flags);
            frame.header.step = step;
            for (stage, received_us, sent_us, compute_us) in trace {
                frame = frame.with_trace(StageTrace { stage, received_us, sent_us, compute_us });
            }
            frame
        })
}

fn encoded(frames: &[Frame]) -> Vec<u8> {
    let mut out = BytesMut::new();
    for frame in frames {
        assert_eq!(encode(frame, &mut out), Ok(()));
    }
    out.to_vec()
}

/// Raw bytes of a header and a payload, with no checks (what a lying peer sends).
fn raw(header: &FrameHeader, payload: &[u8]) -> Vec<u8> {
    let mut out = BytesMut::new();
    out.put_slice(&MAGIC);
    out.put_u32_le(header.encoded_len() as u32);
    out.extend_from_slice(&header.encode_to_vec());
    out.put_slice(payload);
    out.to_vec()
}

fn decode_all(decoder: &mut Decoder) -> Result<Vec<Frame>, FrameError> {
    let mut frames = Vec::new();
    while let Some(frame) = decoder.poll()? {
        frames.push(frame);
    }
    Ok(frames)
}

proptest! {
    #[test]
    fn frames_round_trip_in_any_chunking(
        frames in proptest::collection::vec(frame(), 1..6),
        cuts in proptest::collection::vec(1usize..300, 0..40),
    ) {
        let bytes = encoded(&frames);
        let mut decoder = Decoder::new(Limits::default());
        let mut got = Vec::new();
        let mut rest = &bytes[..];
        let mut cuts = cuts.into_iter();
        while !rest.is_empty() {
            let n = cuts.next().unwrap_or(rest.len()).min(rest.len());
            decoder.push(&rest[..n]);
            rest = &rest[n..];
            got.extend(decode_all(&mut decoder)?);
        }
        prop_assert_eq!(&got, &frames);
        prop_assert_eq!(decoder.buffered(), 0);
        // one frame per message, as gRPC carries them
        for frame in &frames {
            let one = Bytes::from(encoded(std::slice::from_ref(frame)));
            let decoded = decode_exact(one, &Limits::default());
            prop_assert_eq!(decoded.as_ref(), Ok(frame));
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        with_magic in any::<bool>(),
    ) {
        let mut input = if with_magic { MAGIC.to_vec() } else { Vec::new() };
        input.extend_from_slice(&bytes);
        let mut decoder = Decoder::new(Limits { max_header: MAX_HEADER, max_payload: 1 << 16 });
        decoder.push(&input);
        let result = decode_all(&mut decoder);
        // whatever came out, nothing beyond the input was allocated for a frame
        prop_assert!(decoder.buffered() <= input.len() + (1 << 16));
        if result.is_err() {
            prop_assert!(decoder.poll().is_err());
        }
        let _ = decode_exact(Bytes::from(input), &Limits::default());
    }

    #[test]
    fn truncated_frames_wait_for_more(frame in frame(), keep in 0.0f64..1.0) {
        let bytes = encoded(std::slice::from_ref(&frame));
        let n = ((bytes.len() as f64) * keep) as usize;
        prop_assume!(n < bytes.len());
        let mut decoder = Decoder::new(Limits::default());
        decoder.push(&bytes[..n]);
        prop_assert_eq!(decoder.poll(), Ok(None));
        decoder.push(&bytes[n..]);
        prop_assert_eq!(decoder.poll(), Ok(Some(frame)));
        let truncated = decode_exact(Bytes::copy_from_slice(&bytes[..n]), &Limits::default());
        prop_assert!(truncated.is_err());
    }

    #[test]
    fn lying_payload_lengths_are_refused_with_the_numbers(
        rows in 1u32..64, cols in 1u64..4096, dtype in dtype(), delta in 1u64..1_000_000, more in any::<bool>(),
    ) {
        let size = if dtype == WireDtype::F32 { 4 } else { 2 };
        let expected = u64::from(rows) * cols * size;
        let lie = if more { expected + delta } else { expected.saturating_sub(delta) };
        prop_assume!(lie != expected);
        let header = FrameHeader {
            protocol: 1,
            kind: FrameKind::Hidden as i32,
            rows,
            dtype: dtype as i32,
            shape: vec![u64::from(rows), cols],
            payload_len: lie,
            ..FrameHeader::default()
        };
        let mut decoder = Decoder::new(Limits::default());
        decoder.push(&raw(&header, &[]));
        let refused = decoder.poll();
        prop_assert_eq!(
            refused.clone(),
            Err(FrameError::PayloadMismatch { payload_len: lie, expected, shape: vec![u64::from(rows), cols], size })
        );
        let text = refused.err().map(|e| e.to_string()).unwrap_or_default();
        prop_assert!(text.contains(&lie.to_string()) && text.contains(&expected.to_string()), "{}", text);
    }

    #[test]
    fn huge_lengths_are_refused_before_allocation(
        header_len in (MAX_HEADER + 1)..u32::MAX, payload_len in (1u64 << 28) + 1..u64::MAX,
    ) {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&header_len.to_le_bytes());
        let mut decoder = Decoder::new(Limits::default());
        decoder.push(&bytes);
        prop_assert_eq!(decoder.poll(), Err(FrameError::HeaderTooLong { len: u64::from(header_len), max: MAX_HEADER }));

        let header = FrameHeader { protocol: 1, kind: FrameKind::Bulk as i32, payload_len, ..FrameHeader::default() };
        let mut decoder = Decoder::new(Limits::default());
        decoder.push(&raw(&header, &[]));
        prop_assert_eq!(decoder.poll(), Err(FrameError::PayloadTooLong { len: payload_len, max: 1 << 28 }));
        prop_assert_eq!(decoder.buffered(), 0);
    }

    #[test]
    fn overflowing_shapes_are_refused(rows in 1u32..u32::MAX, cols in (u64::MAX / 4)..u64::MAX) {
        let header = FrameHeader {
            protocol: 1,
            kind: FrameKind::Hidden as i32,
            rows,
            dtype: WireDtype::F32 as i32,
            shape: vec![u64::from(rows), cols],
            payload_len: 16,
            ..FrameHeader::default()
        };
        let checked = check_header(&header, &Limits::default());
        prop_assert!(
            matches!(checked, Err(FrameError::ShapeOverflow { .. }) | Err(FrameError::PayloadMismatch { .. })),
            "{:?}", checked
        );
    }
}

#[test]
fn rows_must_match_the_shape_and_tokens_must_be_u32() {
    let mut header = FrameHeader {
        protocol: 1,
        kind: FrameKind::Hidden as i32,
        rows: 2,
        dtype: WireDtype::F32 as i32,
        shape: vec![3, 4],
        payload_len: 48,
        ..FrameHeader::default()
    };
    assert_eq!(check_header(&header, &Limits::default()), Err(FrameError::RowsMismatch { rows: 2, shape: vec![3, 4] }));
    header.rows = 3;
    assert_eq!(check_header(&header, &Limits::default()), Ok(()));
    header.shape = vec![3];
    assert!(matches!(check_header(&header, &Limits::default()), Err(FrameError::BadShape { dims: 2, .. })));
    header.kind = FrameKind::Tokens as i32;
    assert!(matches!(check_header(&header, &Limits::default()), Err(FrameError::BadDtype { .. })));
    header.kind = 42;
    assert_eq!(check_header(&header, &Limits::default()), Err(FrameError::UnknownKind(42)));
    let mut decoder = Decoder::new(Limits::default());
    decoder.push(b"GET / HTTP/1.1");
    assert!(matches!(decoder.poll(), Err(FrameError::BadMagic { .. })));
}
