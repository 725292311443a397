//! Every kernel on every instruction set this CPU has, against a scalar reference: the weight
//! dequantized by candle (independent code for each block layout) times the activations as the
//! kernels quantize them, summed in f64. Only float rounding may differ.

use super::acts::{Q8KRows, Q8Rows};
use super::*;
use candle_core::{Device, Tensor};
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const INT8_TYPES: [GgmlDType; 8] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Where a kernel runs: one of the instruction sets, or the AVX-VNNI kernels compiled with
/// AVX-512's encoding of the same instructions (to test them on CPUs without AVX-VNNI).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    Isa(Isa),
    Avx512Ymm,
}

impl Target {
    const ALL: [Target; 5] = [
        Target::Isa(Isa::Avx512Vnni),
        Target::Avx512Ymm,
        Target::Isa(Isa::AvxVnni),
        Target::Isa(Isa::Avx2),
        Target::Isa(Isa::Portable),
    ];

    fn name(self) -> &'static str {
        match self {
            Target::Isa(i) => i.name(),
            Target::Avx512Ymm => "AVX-VNNI kernels in AVX-512 VL encoding",
        }
    }

    fn available(self) -> bool {
        match self {
            Target::Isa(i) => i.available(),
            #[cfg(target_arch = "x86_64")]
            Target::Avx512Ymm => simd::Ymm::<{ simd::AVX512_YMM }>::new().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Target::Avx512Ymm => false,
        }
    }

    fn matmul(self, dt: GgmlDType, w: &[u8], mkn: (usize, usize, usize), lhs: &[f32], dst: &mut [f32]) {
        match self {
            Target::Isa(i) => {
                matmul(dt, w, mkn, lhs, dst, i).unwrap();
            }
            #[cfg(target_arch = "x86_64")]
            Target::Avx512Ymm => {
                check(dt, w, mkn, lhs, dst).unwrap();
                int8_on(simd::Ymm::<{ simd::AVX512_YMM }>::new().unwrap(), dt, w, mkn, lhs, dst).unwrap();
            }
            #[cfg(not(target_arch = "x86_64"))]
            Target::Avx512Ymm => unreachable!(),
        }
    }
}

/// The int8 targets this CPU has; says which ran and which could not.
fn int8_targets(test: &str) -> Vec<Target> {
    let (have, lack): (Vec<Target>, Vec<Target>) =
        Target::ALL.into_iter().filter(|t| *t != Target::Isa(Isa::Portable)).partition(|t| t.available());
    println!(
        "{test}: int8 kernels exercised on {:?}; not on this CPU: {:?}",
        have.iter().map(|t| t.name()).collect::<Vec<_>>(),
        lack.iter().map(|t| t.name()).collect::<Vec<_>>()
    );
    have
}

/// Weight blocks in storage aligned as candle keeps them (f16 words).
struct Weight {
    words: Vec<f16>,
    len: usize,
}

impl Weight {
    fn bytes(&self) -> &[u8] {
        &blocks::as_bytes(&self.words)[..self.len]
    }
}

/// The byte offsets of a block's f16 scales.
fn f16_fields(dt: GgmlDType) -> &'static [usize] {
    match dt {
        GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0 => &[0],
        GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K | GgmlDType::Q5K => &[0, 2],
        GgmlDType::Q6K => &[208],
        _ => &[],
    }
}

/// `n × k` weights of random bytes (every quant and scale pattern, −128 for Q8_0 included), with
/// finite f16 scales.
fn random_weight(dt: GgmlDType, (n, k): (usize, usize), rng: &mut ChaCha8Rng) -> Weight {
    let size = dt.type_size();
    let len = n * k / dt.block_size() * size;
    let mut words = vec![f16::ZERO; len.div_ceil(2)];
    let bytes = &mut blocks::as_bytes_mut(&mut words)[..len];
    rng.fill(&mut bytes[..]);
    for b in bytes.chunks_exact_mut(size) {
        for &at in f16_fields(dt) {
            let v = f16::from_f32(rng.random_range(-1.0f32..1.0));
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
    }
    Weight { words, len }
}

fn dequantize(dt: GgmlDType, w: &[u8], (n, k): (usize, usize)) -> Vec<f32> {
    let mut out = vec![0f32; n * k];
    with_block!(dt, T => T::to_float(blocks::cast::<T>(w).unwrap(), &mut out));
    out
}

/// Activations in about ±8, with a few outliers.
fn activations(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|i| rng.random_range(-8.0f32..8.0) * if i % 97 == 0 { 10.0 } else { 1.0 }).collect()
}

/// `(Σ w·x, Σ |w·x|)` per output, in f64, over the activations as the int8 kernels quantize them.
fn reference(dt: GgmlDType, w: &[u8], (m, k, n): (usize, usize, usize), lhs: &[f32]) -> Vec<(f64, f64)> {
    let wd = dequantize(dt, w, (n, k));
    let xd: Vec<Vec<f32>> = if int8_family(dt) == Some(true) {
        let x = Q8KRows::new(lhs, (m, k), m);
        (0..m).map(|r| x.dequant_row(r, k)).collect()
    } else {
        let x = Q8Rows::new(lhs, (m, k), m, k / 32, 0);
        (0..m).map(|r| x.dequant_row(r, k)).collect()
    };
    let mut out = Vec::with_capacity(m * n);
    for x in &xd {
        for c in 0..n {
            let p = x.iter().zip(&wd[c * k..(c + 1) * k]).map(|(&a, &b)| a as f64 * b as f64);
            out.push(p.fold((0.0, 0.0), |(s, l), v| (s + v, l + v.abs())));
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[(f64, f64)], what: &str) {
    for (i, (&g, &(v, l1))) in got.iter().zip(want).enumerate() {
        assert!((g as f64 - v).abs() <= 1e-5 * l1 + 1e-6, "{what} output {i}: {g} vs {v} (Σ|w·x| = {l1})");
    }
}

/// Each int8 kernel (vec-dots of 1 to `DECODE_ROWS` rows, every tile shape, row and column remainders, an odd number of
/// 32-blocks for the 512-bit kernels, more rows than a prompt group) on each instruction set.
#[test]
fn int8_kernels_equal_scalar_reference() {
    let targets = int8_targets("int8_kernels_equal_scalar_reference");
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for dt in INT8_TYPES {
        // 37 columns: a whole block of the VNNI prompt kernels (32 columns on AVX-512) and a part
        let (n, k) = if int8_family(dt) == Some(true) { (37, 768) } else { (37, 160) };
        let w = random_weight(dt, (n, k), &mut rng);
        for m in [1usize, 2, 4, 5, 7, 8, 9, 20, 40, 70] {
            let lhs = activations(m * k, &mut rng);
            let want = reference(dt, w.bytes(), (m, k, n), &lhs);
            for &t in &targets {
                let mut got = vec![f32::NAN; m * n];
                t.matmul(dt, w.bytes(), (m, k, n), &lhs, &mut got);
                assert_close(&got, &want, &format!("{dt:?} m={m} on {}", t.name()));
            }
        }
    }
}

/// Up to `DECODE_ROWS` rows, each row's result is, bit for bit, what it is alone: the batch
/// engine decodes several sessions in one pass and promises each the numbers it gets alone.
#[test]
fn decode_rows_are_computed_as_alone() {
    let targets = int8_targets("decode_rows_are_computed_as_alone");
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dt in INT8_TYPES {
        let (n, k) = if int8_family(dt) == Some(true) { (9, 512) } else { (9, 96) };
        let w = random_weight(dt, (n, k), &mut rng);
        let lhs = activations(DECODE_ROWS * k, &mut rng);
        for &t in &targets {
            let alone: Vec<Vec<f32>> = lhs
                .chunks_exact(k)
                .map(|row| {
                    let mut d = vec![f32::NAN; n];
                    t.matmul(dt, w.bytes(), (1, k, n), row, &mut d);
                    d
                })
                .collect();
            for m in 2..=DECODE_ROWS {
                let mut got = vec![f32::NAN; m * n];
                t.matmul(dt, w.bytes(), (m, k, n), &lhs[..m * k], &mut got);
                for (r, want) in alone.iter().take(m).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got[r * n..(r + 1) * n]), bits(want), "{dt:?} row {r} of {m} on {}", t.name());
                }
            }
        }
    }
}

/// `n × k` Q8_0 weights in which every third byte is −128 (legal in the format, though ggml's
/// quantizer stops at −127).
fn q8_0_with_minus_128(n: usize, k: usize) -> Vec<blocks::Q8_0> {
    (0..n * k / 32)
        .map(|b| blocks::Q8_0 {
            d: f16::from_f32(0.5),
            qs: std::array::from_fn(|i| if (i + b) % 3 == 0 { -128 } else { i as i8 - 16 }),
        })
        .collect()
}

/// A Q8_0 weight byte of −128 (legal in the format, though ggml's quantizer stops at −127): the
/// AVX2 prompt tile moved the activation's sign onto the weight, and −(−128) overflows i8
/// (before the fix this gave −1174.7 where decode gave 233.2).
#[test]
fn q8_0_weight_of_minus_128() {
    let targets = int8_targets("q8_0_weight_of_minus_128");
    let (n, k) = (3usize, 64usize);
    let blocks = q8_0_with_minus_128(n, k);
    let w = blocks::as_bytes(&blocks);
    for m in [1usize, 5] {
        let lhs: Vec<f32> = (0..m * k).map(|i| if i % 2 == 0 { -1.0 } else { 0.75 }).collect();
        let want = reference(GgmlDType::Q8_0, w, (m, k, n), &lhs);
        for &t in &targets {
            let mut got = vec![0f32; m * n];
            t.matmul(GgmlDType::Q8_0, w, (m, k, n), &lhs, &mut got);
            assert_close(&got, &want, &format!("m={m} on {}", t.name()));
        }
    }
}

/// The safe entry checks every length before a kernel writes: an output one short (which the
/// AVX2 kernels used to write past) or one long, a short input, a weight of the wrong size, a
/// `k` off the block size, an instruction set this CPU lacks.
#[test]
fn lengths_and_instruction_sets_are_checked() {
    let w = random_weight(GgmlDType::Q8_0, (2, 64), &mut ChaCha8Rng::seed_from_u64(1));
    let lhs = vec![1f32; 64];
    for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
        let run = |w: &[u8], mkn, lhs: &[f32], dst: &mut [f32]| matmul(GgmlDType::Q8_0, w, mkn, lhs, dst, isa);
        assert!(matches!(
            run(w.bytes(), (1, 64, 2), &lhs, &mut [0.0; 1]),
            Err(KernelError::Shape { len: 1, want: 2, .. })
        ));
        assert!(matches!(run(w.bytes(), (1, 64, 2), &lhs, &mut [0.0; 3]), Err(KernelError::Shape { .. })));
        assert!(matches!(run(w.bytes(), (1, 64, 2), &lhs[1..], &mut [0.0; 2]), Err(KernelError::Shape { .. })));
        assert!(matches!(run(&w.bytes()[..34], (1, 64, 2), &lhs, &mut [0.0; 2]), Err(KernelError::Shape { .. })));
        assert!(matches!(run(w.bytes(), (1, 48, 2), &lhs[..48], &mut [0.0; 2]), Err(KernelError::BlockSize { .. })));
        assert!(run(w.bytes(), (1, 64, 2), &lhs, &mut [0.0; 2]).is_ok(), "{isa:?}");
    }
    for isa in Isa::ALL.into_iter().filter(|i| !i.available()) {
        let r = matmul(GgmlDType::Q8_0, w.bytes(), (1, 64, 2), &lhs, &mut [0.0; 2], isa);
        assert!(matches!(r, Err(KernelError::Unavailable(_))), "{isa:?}: {r:?}");
    }
}

#[test]
fn cast_takes_only_whole_aligned_blocks() {
    let words = [f16::ZERO; 36];
    let bytes = blocks::as_bytes(&words);
    assert_eq!(blocks::cast::<blocks::Q8_0>(&bytes[..68]).unwrap().len(), 2);
    assert!(matches!(
        blocks::cast::<blocks::Q8_0>(&bytes[..67]),
        Err(KernelError::Storage { bytes: 67, block: 34, .. })
    ));
    assert!(matches!(blocks::cast::<blocks::Q8_0>(&bytes[1..69]), Err(KernelError::Storage { align: 2, .. })));
}

#[test]
fn kernel_choice_names_the_instruction_set() {
    for isa in Isa::ALL {
        for dt in INT8_TYPES {
            let (decode, prompt) = (Kernel::choose_for(dt, 1, isa), Kernel::choose_for(dt, DECODE_ROWS + 1, isa));
            assert_eq!(Kernel::choose_for(dt, DECODE_ROWS, isa), decode);
            if isa == Isa::Portable {
                assert_eq!((decode, prompt), (Kernel::CandleVecDot, Kernel::DequantGemm));
            } else {
                assert_eq!((decode, prompt), (Kernel::VecDot(isa), Kernel::Lanes(isa)));
                assert!(decode.describe(dt).starts_with(&format!("brigade {} int8 vec-dot", isa.name())));
                assert!(prompt.describe(dt).starts_with(&format!("brigade {} int8, 4 rows × ", isa.name())));
            }
        }
        for dt in INT8_TYPES {
            let packed = cfg!(target_arch = "x86_64")
                && match isa {
                    Isa::Avx512Vnni => PACKED_TYPES.contains(&dt),
                    Isa::AvxVnni | Isa::Avx2 => {
                        PACKED_TYPES.contains(&dt) && !matches!(dt, GgmlDType::Q6K | GgmlDType::Q8_0)
                    }
                    Isa::Portable => false,
                };
            assert_eq!(packs_on(dt, isa), packed, "{dt:?} on {isa:?}");
        }
        assert!(
            Kernel::Packed(isa)
                .describe(GgmlDType::Q4K)
                .starts_with(&format!("brigade {} int8, weights packed", isa.name()))
                || isa == Isa::Portable
        );
        assert_eq!(Kernel::choose_for(GgmlDType::Q3K, DECODE_ROWS, isa), Kernel::CandleVecDot);
        assert_eq!(Kernel::choose_for(GgmlDType::F16, DECODE_ROWS + 1, isa), Kernel::DequantGemm);
    }
    assert_eq!(Isa::parse("AVX2"), Ok(Some(Isa::Avx2)));
    assert_eq!(Isa::parse(" auto "), Ok(None));
    assert_eq!(Isa::parse("avx-512"), Ok(Some(Isa::Avx512Vnni)));
    assert!(Isa::parse("sse2").is_err());
    assert!(Isa::best().available());
}

/// Every type through the op on every instruction set this CPU has (the portable path
/// included), against a dense f32 matmul of the dequantized weight.
#[test]
fn matches_dequantized_matmul() {
    let (n, k) = (72usize, 512usize);
    let w = Tensor::randn(0f32, 1.0, (n, k), &Device::Cpu).unwrap();
    for dt in WEIGHT_TYPES {
        let q = QTensor::quantize(&w, dt).unwrap();
        let data = q.data().unwrap();
        let wd = q.dequantize(&Device::Cpu).unwrap();
        for m in [1usize, 3, 4, 5, 37, 70] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &Device::Cpu).unwrap();
            let want = x.matmul(&wd.t().unwrap()).unwrap();
            let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
            let lhs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            for isa in Isa::ALL.into_iter().filter(|i| i.available()) {
                let mut got = vec![0f32; m * n];
                let kernel = matmul(dt, &data, (m, k, n), &lhs, &mut got, isa).unwrap();
                let d = got.iter().zip(&want).fold(0f32, |a, (g, w)| a.max((g - w).abs()));
                // int8 kernels quantize the activations (16 bits for f16/bf16); gemm is exact f32
                let tol = if kernel == Kernel::DequantGemm || dt == GgmlDType::F32 { 1e-4 } else { 3e-2 };
                assert!(d <= tol * scale, "{dt:?} m={m} {kernel:?}: {d} of {scale}");
            }
        }
    }
    // and once through the candle op
    let q = Arc::new(QTensor::quantize(&w, GgmlDType::Q4K).unwrap());
    let x = Tensor::randn(0f32, 1.0, (1, 3, k), &Device::Cpu).unwrap();
    let got = x.apply_op1_no_bwd(&CpuMatMul(q.clone())).unwrap();
    assert_eq!(got.dims(), &[1, 3, n]);
}

const PACKED_TYPES: [GgmlDType; 8] = [
    GgmlDType::Q4K,
    GgmlDType::Q6K,
    GgmlDType::Q8_0,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q5K,
];

#[cfg(target_arch = "x86_64")]
impl Target {
    /// The packed kernels of this target.
    fn matmul_packed(self, w: &Packed, m: usize, lhs: &[f32], dst: &mut [f32]) {
        match self {
            Target::Isa(i) => {
                assert_eq!(matmul_packed(w, m, lhs, dst, i).unwrap(), Kernel::Packed(i));
            }
            // SAFETY: the token checks the instructions; the lengths are the test's
            Target::Avx512Ymm => unsafe {
                assert!(lhs.len() == m * w.shape().1 && dst.len() == m * w.shape().0);
                let out = tiles::Out { ptr: dst.as_mut_ptr() as usize, m, n: w.shape().0 };
                packed::matmul(simd::Ymm::<{ simd::AVX512_YMM }>::new().unwrap(), w, m, lhs, out)
            },
        }
    }
}

/// The packed kernels (every tile height, row remainders, a part block of columns and a part
/// vector of them) on each instruction set, against the scalar reference on the file's blocks.
#[cfg(target_arch = "x86_64")]
#[test]
fn packed_kernels_equal_scalar_reference() {
    let targets = int8_targets("packed_kernels_equal_scalar_reference");
    let mut rng = ChaCha8Rng::seed_from_u64(17);
    for dt in PACKED_TYPES {
        for n in [37usize, 70] {
            let k = if dt.block_size() == 32 { 160 } else { 768 };
            let w = random_weight(dt, (n, k), &mut rng);
            let p = Packed::new(dt, w.bytes(), (n, k)).unwrap();
            assert_eq!(p.storage_bytes(), n.div_ceil(32) * 32 * k / dt.block_size() * dt.type_size());
            for m in [1usize, 2, 3, 4, 5, 7, 8, 9, 20] {
                let lhs = activations(m * k, &mut rng);
                let want = reference(dt, w.bytes(), (m, k, n), &lhs);
                for &t in &targets {
                    let mut got = vec![f32::NAN; m * n];
                    t.matmul_packed(&p, m, &lhs, &mut got);
                    assert_close(&got, &want, &format!("packed {dt:?} n={n} m={m} on {}", t.name()));
                }
            }
        }
    }
}

/// Packed, every row's result is, bit for bit, what it is alone, whatever the number of rows
/// (decode of up to 16 sessions and prompts alike). Q4_K and Q6_K go to 37 rows: where the CPU
/// has AMX, from 32 rows groups of 16 rows take the tile unit (`amx`) and the rest the AVX-512 kernel, a
/// row alone only the latter, so this is also AMX against AVX-512, bit for bit (and a part
/// block of columns: 70 = 2·32 + 6).
#[cfg(target_arch = "x86_64")]
#[test]
fn packed_rows_are_computed_as_alone() {
    let targets = int8_targets("packed_rows_are_computed_as_alone");
    #[cfg(target_os = "linux")]
    println!(
        "packed_rows_are_computed_as_alone: AMX {}",
        if amx::available() { "exercised" } else { "not on this CPU" }
    );
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    for dt in PACKED_TYPES {
        let (n, k) = if dt.block_size() == 32 { (40, 96) } else { (70, 512) };
        let w = random_weight(dt, (n, k), &mut rng);
        let p = Packed::new(dt, w.bytes(), (n, k)).unwrap();
        let rows = if dt.block_size() == 32 { 13 } else { 37 };
        let lhs = activations(rows * k, &mut rng);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for &t in &targets {
            let alone: Vec<Vec<f32>> = lhs
                .chunks_exact(k)
                .map(|row| {
                    let mut d = vec![f32::NAN; n];
                    t.matmul_packed(&p, 1, row, &mut d);
                    d
                })
                .collect();
            for m in 2..=rows {
                let mut got = vec![f32::NAN; m * n];
                t.matmul_packed(&p, m, &lhs[..m * k], &mut got);
                for (r, want) in alone.iter().take(m).enumerate() {
                    assert_eq!(bits(&got[r * n..(r + 1) * n]), bits(want), "{dt:?} row {r} of {m} on {}", t.name());
                }
                // into a vector never zeroed: the same values (every one stored; `got` began NaN)
                if let Target::Isa(i) = t {
                    let new = matmul_packed_new(&p, m, &lhs[..m * k], i).unwrap();
                    assert_eq!(bits(&new), bits(&got), "{dt:?} {m} rows into a new vector on {}", t.name());
                }
            }
        }
    }
}

/// Several packed matmuls in one dispatch (a token's experts: weights of several types and
/// shapes, one to a few rows each, and a job big enough for AMX among them) give each job, bit
/// for bit, what it gives alone; a job of the wrong length is refused before any is computed.
#[cfg(target_arch = "x86_64")]
#[test]
fn a_group_of_packed_matmuls_computes_each_as_alone() {
    let mut rng = ChaCha8Rng::seed_from_u64(23);
    let shapes =
        [(GgmlDType::Q4K, 70, 512), (GgmlDType::Q8_0, 40, 96), (GgmlDType::Q6K, 33, 256), (GgmlDType::Q4K, 9, 256)];
    let weights: Vec<(Packed, usize)> = shapes
        .iter()
        .map(|&(dt, n, k)| (Packed::new(dt, random_weight(dt, (n, k), &mut rng).bytes(), (n, k)).unwrap(), k))
        .collect();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for isa in [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2].into_iter().filter(|i| i.available()) {
        for rows in [[1usize, 1, 1, 1], [3, 1, 2, 5], [1, 2, 1, amx::MIN_ROWS]] {
            let lhs: Vec<Vec<f32>> = weights.iter().zip(rows).map(|((_, k), m)| activations(m * k, &mut rng)).collect();
            let alone: Vec<Vec<f32>> = weights
                .iter()
                .zip(rows)
                .zip(&lhs)
                .map(|(((p, _), m), x)| {
                    let mut d = vec![f32::NAN; m * p.shape().0];
                    matmul_packed(p, m, x, &mut d, isa).unwrap();
                    d
                })
                .collect();
            let mut outs: Vec<Vec<f32>> = alone.iter().map(|a| vec![f32::NAN; a.len()]).collect();
            let mut jobs: Vec<PackedJob<'_>> = weights
                .iter()
                .zip(rows)
                .zip(&lhs)
                .zip(outs.iter_mut())
                .map(|((((w, _), m), lhs), dst)| PackedJob { w, m, lhs, dst })
                .collect();
            assert_eq!(matmul_packed_group(&mut jobs, isa).unwrap(), Kernel::Packed(isa));
            for (j, (got, want)) in outs.iter().zip(&alone).enumerate() {
                assert_eq!(bits(got), bits(want), "job {j} of rows {rows:?} on {isa:?}");
            }
        }
        let (p, k) = &weights[0];
        let (x, mut short) = (vec![0.5; *k], vec![0.0; p.shape().0 - 1]);
        let mut fine = vec![f32::NAN; p.shape().0];
        let mut jobs =
            vec![PackedJob { w: p, m: 1, lhs: &x, dst: &mut fine }, PackedJob { w: p, m: 1, lhs: &x, dst: &mut short }];
        assert!(matches!(matmul_packed_group(&mut jobs, isa), Err(KernelError::Shape { what: "the output", .. })));
        assert!(fine.iter().all(|v| v.is_nan()), "nothing computed");
    }
}

/// Packed Q8_0 with weight bytes of −128, and the packed entry's checks: lengths, a weight of
/// the wrong size, `k` off the block, an instruction set this CPU lacks, a type not packed.
#[cfg(target_arch = "x86_64")]
#[test]
fn packed_q8_0_minus_128_and_checks() {
    let targets = int8_targets("packed_q8_0_minus_128_and_checks");
    let (n, k) = (3usize, 64usize);
    let blocks = q8_0_with_minus_128(n, k);
    let w = blocks::as_bytes(&blocks);
    let p = Packed::new(GgmlDType::Q8_0, w, (n, k)).unwrap();
    for m in [1usize, 5] {
        let lhs: Vec<f32> = (0..m * k).map(|i| if i % 2 == 0 { -1.0 } else { 0.75 }).collect();
        let want = reference(GgmlDType::Q8_0, w, (m, k, n), &lhs);
        for &t in &targets {
            let mut got = vec![0f32; m * n];
            t.matmul_packed(&p, m, &lhs, &mut got);
            assert_close(&got, &want, &format!("packed m={m} on {}", t.name()));
        }
    }
    let lhs = vec![1f32; 64];
    for isa in Isa::ALL.into_iter().filter(|i| i.available() && *i != Isa::Portable) {
        let r = matmul_packed(&p, 1, &lhs, &mut [0.0; 2], isa);
        assert!(matches!(r, Err(KernelError::Shape { len: 2, want: 3, .. })), "{r:?}");
        let r = matmul_packed(&p, 1, &lhs[1..], &mut [0.0; 3], isa);
        assert!(matches!(r, Err(KernelError::Shape { len: 63, want: 64, .. })), "{r:?}");
        let r = matmul_packed_new(&p, 1, &lhs[1..], isa);
        assert!(matches!(r, Err(KernelError::Shape { len: 63, want: 64, .. })), "{r:?}");
    }
    for isa in Isa::ALL.into_iter().filter(|i| !i.available() || *i == Isa::Portable) {
        let r = matmul_packed(&p, 1, &lhs, &mut [0.0; 3], isa);
        assert!(matches!(r, Err(KernelError::Unavailable(_))), "{isa:?}: {r:?}");
        let r = matmul_packed_new(&p, 1, &lhs, isa);
        assert!(matches!(r, Err(KernelError::Unavailable(_))), "{isa:?}: {r:?}");
    }
    let r = Packed::new(GgmlDType::Q8_0, &w[..w.len() - 1], (n, k));
    assert!(matches!(r, Err(KernelError::Shape { want: 204, .. })), "{r:?}");
    let r = Packed::new(GgmlDType::Q8_0, w, (n, 48));
    assert!(matches!(r, Err(KernelError::BlockSize { k: 48, block: 32 })), "{r:?}");
    let r = Packed::new(GgmlDType::Q3K, w, (n, k));
    assert!(r.is_err_and(|e| e.to_string().contains("Q3K weights are not packed")));
}

/// A packed weight's rows read back (a tied head's embedding lookups) are the file's rows
/// dequantized, bit for bit, for every packed type, at every column of a record and in a part
/// record; a row past the weight or a wrong length is refused.
#[test]
fn packed_rows_dequantize_as_the_files() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for dt in PACKED_TYPES {
        let (n, k) = (45usize, 512usize);
        let w = random_weight(dt, (n, k), &mut rng);
        let want = dequantize(dt, w.bytes(), (n, k));
        let p = Packed::new(dt, w.bytes(), (n, k)).unwrap();
        let mut row = vec![0f32; k];
        for r in 0..n {
            p.dequantize_row(r, &mut row).unwrap();
            let same = row.iter().zip(&want[r * k..][..k]).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dt:?} row {r}");
        }
        let e = p.dequantize_row(n, &mut row).unwrap_err().to_string();
        assert!(e.contains(&format!("row {n} of a weight of {n} rows")), "{e}");
        assert!(p.dequantize_row(0, &mut row[1..]).is_err());
    }
}

/// The fifth bits' regrouping for the packed Q5 kernels goes back to the file's `qh` exactly.
#[test]
fn fifth_words_go_back_to_the_files_bits() {
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for _ in 0..1000 {
        let qh: [u8; 4] = rng.random();
        assert_eq!(packed::file_qh(packed::fifth_word(qh)), qh);
    }
    // weight 8u + 4p + j at bit 8j + 2u + p
    assert_eq!(packed::fifth_word(1u32.to_le_bytes()), 1);
    assert_eq!(packed::fifth_word((1u32 << 31).to_le_bytes()), 1 << (8 * 3 + 2 * 3 + 1));
}
