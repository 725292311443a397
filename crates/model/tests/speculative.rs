//! The verifying pass of speculative decoding: a session's run of tokens as decode rows of one
//! pass (`Pipeline::forward_runs`) gives, bit for bit, the logits of feeding them one at a time,
//! beside other sessions' runs, and a session cut back after a rejected draft goes on exactly as
//! one that never saw it — on the fused step and the op path, dense, windowed and MoE layers.
#![allow(clippy::unwrap_used)]

mod common;

use brigade_core::TokenLogprob;
use brigade_model::batch::{Batch, Job, JobId, Output};
use brigade_model::pipeline::StopReason;
use brigade_model::speculative::{DraftSource, Drafter, Speculation};
use brigade_model::synth::{write_gguf, Shape, SynthType};
use brigade_model::{GenerationStats, Logits, ModelFiles, Pipeline, Sampler, SamplingParams};
use common::{family_file, pipeline};
use std::collections::HashMap;
use std::sync::Arc;

const SHAPE: Shape =
    Shape { layers: 4, hidden: 256, ffn: 512, heads: 4, kv_heads: 2, vocab: 300, context: 512, rope_theta: 1e4 };

/// A random Q4_K model of `shape` (packed at load on a CPU with int8 kernels: the fused step).
fn q4k(dir: &tempfile::TempDir, seed: u64, shape: &Shape) -> ModelFiles {
    let path = dir.path().join(format!("q4k-{seed}-{}-{}.gguf", shape.layers, shape.vocab));
    write_gguf(&path, shape, SynthType::Q4K, seed, |_, _| {}).unwrap();
    ModelFiles::open(&path).unwrap()
}

fn ids(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 31 + salt * 17 + i * i * 7) % (vocab - 3)).collect()
}

/// Two sessions read their prompts, then take their streams in runs of 1 to 12 tokens (a run
/// past `DECODE_ROWS` is two groups of rows) together in one pass per step, each run followed
/// by up to five tokens that are cut off again (a rejected draft). Every kept row's logits equal
/// those of the same stream fed one token at a time.
fn check_runs(files: &ModelFiles, map: &str) {
    let p = pipeline(files, map, 256);
    let vocab = files.config.vocab as u32;
    let prompts = [ids(30, 1, vocab), ids(5, 2, vocab)];
    let streams = [ids(60, 3, vocab), ids(60, 4, vocab)];
    // alone, one token at a time
    let alone: Vec<Vec<Vec<f32>>> = prompts
        .iter()
        .zip(&streams)
        .map(|(prompt, stream)| {
            let mut s = p.new_session().unwrap();
            p.prefill(&mut s, prompt, 512).unwrap();
            stream
                .iter()
                .map(|&t| p.forward(&mut s, &[t], Logits::Last).unwrap().get(0).unwrap().to_vec1().unwrap())
                .collect()
        })
        .collect();
    let mut sessions: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let mut s = p.new_session().unwrap();
            p.prefill(&mut s, prompt, 512).unwrap();
            s
        })
        .collect();
    let (kept, junk) = ([1usize, 4, 9, 2, 7, 3, 12, 1, 5], [0usize, 2, 3, 0, 1, 5, 0, 4, 2]);
    let mut at = [0usize; 2];
    for step in 0..kept.len() {
        // session 1's runs are session 0's shifted by one step
        let shape = |k: usize| (kept[(step + k) % kept.len()], junk[(step + k) % junk.len()]);
        let runs: Vec<Vec<u32>> = (0..2)
            .map(|k| {
                let (n, j) = shape(k);
                let mut run = streams[k][at[k]..at[k] + n].to_vec();
                run.extend(ids(j, 9 + step as u32, vocab));
                run
            })
            .collect();
        let refs: Vec<&[u32]> = runs.iter().map(Vec::as_slice).collect();
        let before: Vec<usize> = sessions.iter().map(|s| s.len()).collect();
        let logits = {
            let mut batch: Vec<_> = sessions.iter_mut().collect();
            p.forward_runs(&mut batch, &refs).unwrap()
        };
        assert_eq!(logits.len(), runs.iter().map(Vec::len).sum::<usize>());
        let mut row = 0;
        for k in 0..2 {
            let (n, j) = shape(k);
            for r in 0..n {
                assert!(
                    logits[row + r] == alone[k][at[k] + r],
                    "{map}: session {k}, step {step}, row {r} of a run of {n}+{j}: logits differ"
                );
            }
            row += n + j;
            assert_eq!(sessions[k].len(), before[k] + n + j);
            // the draft's tail is rejected: the session goes back to what it kept
            assert_eq!(sessions[k].truncate(before[k] + n), before[k] + n, "{map}: session {k} cannot go back");
            at[k] += n;
        }
    }
    // and on, one token at a time, after the last cut
    for (k, s) in sessions.iter_mut().enumerate() {
        let l = p.forward(s, &[streams[k][at[k]]], Logits::Last).unwrap();
        assert!(l.get(0).unwrap().to_vec1::<f32>().unwrap() == alone[k][at[k]], "{map}: session {k} after the runs");
    }
}

#[test]
fn runs_equal_one_token_at_a_time_q4k() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k(&dir, 7, &SHAPE);
    check_runs(&files, "cpu:4");
    check_runs(&files, "cpu:1,cpu:2,cpu:1");
}

/// F32 weights: no CPU kernel of brigade's takes them, so the rows go through candle's ops.
#[test]
fn runs_equal_one_token_at_a_time_on_the_op_path() {
    let files = common::stories_f32();
    let n = files.config.n_layers;
    check_runs(&files, &format!("cpu:{n}"));
}

/// Gemma 3: local sliding-window layers (window 8) with their own RoPE base; with passes of 12
/// tokens the windowed caches move their keys to the front every few steps, and cutting a draft
/// back never needs a key they let go of.
#[test]
fn runs_equal_one_token_at_a_time_with_sliding_windows() {
    let mut files = ModelFiles::open(&family_file("gemma3", "gemma3-tiny-Q4_K_M.gguf")).unwrap();
    files.set_window_pass(Some(12));
    check_runs(&files, "cpu:4,cpu:2");
    let mut files = ModelFiles::open(&family_file("mistral", "hf")).unwrap();
    files.set_window_pass(Some(12));
    check_runs(&files, "cpu:2,cpu:1");
}

#[test]
fn runs_equal_one_token_at_a_time_moe() {
    let files = ModelFiles::open(&family_file("olmoe", "olmoe-tiny-Q4_K_M.gguf")).unwrap();
    check_runs(&files, "cpu:3");
}

/// What `generate_with` gives: the tokens, the stop, and the stats' passes and drafts.
fn generate(
    p: &Pipeline,
    prompt: &[u32],
    n: usize,
    params: &SamplingParams,
    drafter: Option<&mut Drafter>,
) -> (Vec<u32>, StopReason, GenerationStats) {
    let mut s = p.new_session().unwrap();
    let mut ids = Vec::new();
    let stats = p
        .generate_with(
            &mut s,
            prompt,
            n,
            &mut Sampler::new(params.clone()),
            |_| false,
            true,
            drafter,
            |t| {
                ids.push(t);
                true
            },
        )
        .unwrap();
    // the session holds what was fed: the prompt, then every token but the last
    let mut fed = prompt.to_vec();
    fed.extend(&ids[..ids.len().saturating_sub(1)]);
    assert_eq!(s.tokens(), &fed[..]);
    (ids, stats.stop, stats)
}

fn lookup(n_max: usize) -> Arc<Speculation> {
    Arc::new(Speculation { source: DraftSource::Lookup { ngram: (1, 3) }, n_max })
}

fn sampled(seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.9, seed, repeat_penalty: 1.1, presence_penalty: 0.2, ..Default::default() }
}

/// Prompt lookup on the embedded model (a real tiny story model, F32: the op path) and a random
/// Q4_K one (the fused step): the same tokens as plain decoding, greedy and sampled with
/// penalties, at every draft length; and where greedy text repeats, drafts are taken, so the
/// same text takes fewer passes.
#[test]
fn prompt_lookup_gives_the_text_of_plain_decoding() {
    let stories = common::stories_f32();
    let dir = tempfile::tempdir().unwrap();
    let q4k = q4k(&dir, 7, &SHAPE);
    for (name, files, map) in [("stories", &stories, "cpu:3,cpu:2"), ("q4k", &q4k, "cpu:4")] {
        let p = pipeline(files, map, 256);
        let prompt = files.tokenizer.encode("Once upon a time, there was a little", true).unwrap();
        for params in [SamplingParams::greedy(), sampled(3), sampled(11)] {
            let (want, want_stop, plain) = generate(&p, &prompt, 150, &params, None);
            assert_eq!((plain.drafted, plain.decode_steps), (0, 149));
            for n_max in [1, 3, 7, 16] {
                let mut d = Drafter::new(lookup(n_max), p.vocab()).unwrap();
                let (got, stop, stats) = generate(&p, &prompt, 150, &params, Some(&mut d));
                assert_eq!((&got, stop), (&want, want_stop), "{name}, {params:?}, drafts of {n_max}");
                assert_eq!(stats.decoded, 149);
                assert_eq!(stats.decode_steps + stats.accepted, 149, "{name}: a pass per token not drafted");
                if params.temperature == 0.0 {
                    assert!(stats.accepted >= 10, "{name}, drafts of {n_max}: {} of 149 drafted", stats.accepted);
                }
            }
        }
    }
}

/// A draft model: the target itself (every draft taken: a pass per n_max + 1 tokens) and
/// another random model of the same vocabulary (drafts mostly refused); the text is plain
/// decoding's either way. A draft model of another vocabulary is refused by name.
#[test]
fn a_draft_model_gives_the_text_of_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let (shape, model) = (SHAPE, |seed: u64, shape: &Shape| q4k(&dir, seed, shape));
    let target = Arc::new(pipeline(&model(7, &shape), "cpu:4", 256));
    let small = Shape { layers: 2, hidden: 128, ffn: 256, heads: 2, kv_heads: 1, ..shape };
    let prompt: Vec<u32> = ids(20, 5, 300);
    for (draft, all_taken) in [(target.clone(), true), (Arc::new(pipeline(&model(8, &small), "cpu:2", 256)), false)] {
        for params in [SamplingParams::greedy(), sampled(5)] {
            let spec = Arc::new(Speculation { source: DraftSource::Model(draft.clone()), n_max: 4 });
            spec.check(target.vocab()).unwrap();
            let (want, _, _) = generate(&target, &prompt, 60, &params, None);
            let mut d = Drafter::new(spec, target.vocab()).unwrap();
            let (got, _, stats) = generate(&target, &prompt, 60, &params, Some(&mut d));
            assert_eq!(got, want, "{params:?}");
            assert_eq!(stats.decode_steps + stats.accepted, 59);
            if all_taken && params.temperature == 0.0 {
                // every draft taken, and drafts grow to n_max: 59 tokens in 15 passes, not 59
                assert_eq!(stats.accepted, stats.drafted);
                assert!(stats.decode_steps <= 15, "{} passes", stats.decode_steps);
            }
        }
    }
    let other = Arc::new(pipeline(&model(9, &Shape { vocab: 320, ..small }), "cpu:2", 256));
    let other = Arc::new(Speculation { source: DraftSource::Model(other), n_max: 4 });
    let err = Drafter::new(other, target.vocab()).err().unwrap().to_string();
    assert!(err.contains("320") && err.contains("300"), "{err}");
}

/// Gemma 3's windowed layers read at most a pass of tokens at a time: drafts are cut to it,
/// and the text is plain decoding's.
#[test]
fn drafts_fit_a_sliding_window_pass() {
    let mut files = ModelFiles::open(&family_file("gemma3", "gemma3-tiny-Q4_K_M.gguf")).unwrap();
    files.set_window_pass(Some(3));
    let p = pipeline(&files, "cpu:4,cpu:2", 256);
    assert_eq!(p.max_run(), 3);
    let prompt = ids(12, 1, files.config.vocab as u32);
    let (want, _, _) = generate(&p, &prompt, 80, &SamplingParams::greedy(), None);
    let mut d = Drafter::new(lookup(8), p.vocab()).unwrap();
    let (got, _, _) = generate(&p, &prompt, 80, &SamplingParams::greedy(), Some(&mut d));
    assert_eq!(got, want);
}

/// A job's tokens with their log-probabilities, and its stop.
type Outputs = (Vec<(u32, Option<TokenLogprob>)>, Option<StopReason>);

/// Jobs in a batch with prompt lookup: each job's tokens and stop are those it gets alone
/// without drafts — greedy and sampled, joining and leaving at different steps, one filling the
/// context — and drafts were taken.
#[test]
fn batched_jobs_with_drafts_equal_plain_decoding() {
    let files = common::stories_f32();
    let p = Arc::new(pipeline(&files, "cpu:5", 256));
    let tk = files.tokenizer.clone();
    let text = |s: &str| tk.encode(s, true).unwrap();
    let job = |prompt: Vec<u32>, max_tokens, sampler| Job {
        prompt,
        max_tokens,
        sampler,
        ignore_eos: false,
        constraint: None,
        logprobs: Some(2),
    };
    let jobs = [
        (0, job(text("Once upon a time"), 120, SamplingParams::greedy())),
        (0, job(text("The cat sat"), 40, sampled(5))),
        (2, job(text("Lily and Tom went to the park. Lily and Tom"), 90, SamplingParams::greedy())),
        (3, job(text("One day"), 1, SamplingParams::greedy())),
        (4, job(text("A big dog"), 60, sampled(9))),
        // fills the context
        (6, job(text("Once upon a time there was a girl").repeat(20)[..200].to_vec(), 100, SamplingParams::greedy())),
    ];
    let run = |b: &mut Batch| {
        let mut out: HashMap<JobId, Outputs> = HashMap::new();
        let mut step = 0;
        while step <= 6 || !b.is_idle() {
            for (k, (at, j)) in jobs.iter().enumerate() {
                if *at == step {
                    b.handle_submit(k as JobId, j.clone());
                }
            }
            for (id, o) in b.step() {
                let e = out.entry(id).or_default();
                match o {
                    Output::Started { .. } => {}
                    Output::Token(t, lp) => e.0.push((t, lp)),
                    Output::Done(st) => e.1 = Some(st.stop),
                    Output::Error(err) => panic!("job {id}: {err}"),
                }
            }
            step += 1;
            assert!(step < 10_000);
        }
        out
    };
    let eog = |tk: Arc<brigade_model::Tokenizer>| move |t| tk.is_eog(t);
    let want = run(&mut Batch::new(p.clone(), 3, eog(tk.clone())).unwrap());
    let mut b = Batch::new(p.clone(), 3, eog(tk.clone())).unwrap().with_speculation(lookup(8)).unwrap();
    let got = run(&mut b);
    assert_eq!(got.len(), jobs.len());
    for k in 0..jobs.len() as JobId {
        assert_eq!(got[&k], want[&k], "job {k}");
    }
    assert_eq!(got[&5].1, Some(StopReason::Context));
    let (drafted, accepted) = b.drafts();
    assert!(accepted >= 5 && drafted >= accepted, "{accepted} of {drafted} drafted tokens taken");
}
