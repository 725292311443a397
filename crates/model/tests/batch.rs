//! The batch engine: batch invariance (a row's logits are bit for bit those of the session alone,
//! whoever shares the step), jobs equal to `Pipeline::generate`, and the engine thread's
//! cancellation and queue limit.
#![allow(clippy::unwrap_used)]

mod common;

use brigade_model::batch::{Batch, Busy, Engine, EngineConfig, Job, JobId, Output, Sink};
use brigade_model::pipeline::StopReason;
use brigade_model::synth::{write_gguf, Shape, SynthType};
use brigade_model::{Logits, ModelFiles, Pipeline, Sampler, SamplingParams};
use common::pipeline;
use std::collections::HashMap;
use std::sync::Arc;

/// A small random Q4_K model: on a CPU with int8 kernels its weights are packed at load, one
/// kernel for every number of rows (10 sessions go through in one pass); where packing is off
/// or there are no int8 kernels, its prompt and decode kernels round differently. The SmolLM2
/// test (Q4_1, file layout: vec-dots up to `DECODE_ROWS`, lanes above) covers the other path.
fn q4k_model(dir: &tempfile::TempDir) -> ModelFiles {
    let path = dir.path().join("q4k.gguf");
    let shape =
        Shape { layers: 4, hidden: 256, ffn: 512, heads: 4, kv_heads: 2, vocab: 300, context: 512, rope_theta: 1e4 };
    write_gguf(&path, &shape, SynthType::Q4K, 7, |_, _| {}).unwrap();
    ModelFiles::open(&path).unwrap()
}

fn prompt(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|i| 3 + (i * 31 + salt * 17) % (vocab - 3)).collect()
}

/// A greedy job of `max_tokens` past end-of-generation tokens, unconstrained.
fn greedy_job(prompt: Vec<u32>, max_tokens: usize) -> Job {
    Job { prompt, max_tokens, sampler: SamplingParams::greedy(), ignore_eos: true, constraint: None, logprobs: None }
}

fn argmax(l: &[f32]) -> u32 {
    Sampler::new(SamplingParams::greedy()).sample(l, &[])
}

/// Ten sessions with prompts of different lengths join a decode batch at different steps and
/// leave at different steps; every row's logits at every step equal, bit for bit, the logits
/// of the same session decoded alone. On one stage and across two.
fn check_rows_invariant(files: &ModelFiles, map: &str) {
    let p = pipeline(files, map, 256);
    let vocab = files.config.vocab as u32;
    // (prompt length, joins at step, leaves after step)
    let plan = [
        (5usize, 0usize, 9usize),
        (17, 0, 4),
        (1, 1, 12),
        (40, 2, 11),
        (9, 3, 7),
        (23, 3, 11),
        (3, 1, 10),
        (12, 2, 9),
        (7, 4, 8),
        (30, 4, 6),
    ];
    // alone: each session prefilled, then decoded greedily one token at a time
    let alone: Vec<Vec<Vec<f32>>> = plan
        .iter()
        .enumerate()
        .map(|(k, &(len, join, leave))| {
            let mut s = p.new_session().unwrap();
            let mut l = p.prefill(&mut s, &prompt(len, k as u32, vocab), 512).unwrap();
            let mut out = Vec::new();
            for _ in join..=leave {
                let row = p.forward(&mut s, &[argmax(&l)], Logits::Last).unwrap();
                l = row.get(0).unwrap().to_vec1().unwrap();
                out.push(l.clone());
            }
            out
        })
        .collect();
    let mut sessions: Vec<_> = plan
        .iter()
        .enumerate()
        .map(|(k, &(len, _, _))| {
            let mut s = p.new_session().unwrap();
            let l = p.prefill(&mut s, &prompt(len, k as u32, vocab), 512).unwrap();
            (s, l)
        })
        .collect();
    let mut widths = Vec::new();
    for step in 0..=12 {
        let rows: Vec<usize> = (0..plan.len()).filter(|&k| plan[k].1 <= step && step <= plan[k].2).collect();
        widths.push(rows.len());
        let tokens: Vec<u32> = rows.iter().map(|&k| argmax(&sessions[k].1)).collect();
        let mut batch: Vec<_> =
            sessions.iter_mut().enumerate().filter(|(k, _)| rows.contains(k)).map(|(_, s)| &mut s.0).collect();
        let logits = p.forward_rows(&mut batch, &tokens).unwrap();
        for (&k, l) in rows.iter().zip(logits) {
            let want = &alone[k][step - plan[k].1];
            assert!(l == *want, "{map}: session {k} at step {step} ({} rows): logits differ", rows.len());
            sessions[k].1 = l;
        }
    }
    // the batch really was 1 to 10 rows wide: one row, several sharing a pass (rows in a
    // multi-row vec-dot), and past DECODE_ROWS, two passes
    let passes = |w: usize| w.div_ceil(brigade_model::cpu_matmul::DECODE_ROWS);
    assert_eq!(widths.iter().max(), Some(&10));
    assert!(widths.contains(&1) && widths.contains(&7) && passes(10) == 2);
}

#[test]
fn decode_rows_are_batch_invariant_q4k() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    check_rows_invariant(&files, "cpu:4");
    check_rows_invariant(&files, "cpu:1,cpu:3");
}

#[test]
fn decode_rows_are_batch_invariant_smollm2() {
    let files = ModelFiles::open(&common::smollm2()).unwrap();
    check_rows_invariant(&files, "cpu:30");
    check_rows_invariant(&files, "cpu:12,cpu:10,cpu:8");
}

#[test]
fn decode_rows_are_batch_invariant_qwen3() {
    let files = ModelFiles::open(&common::family_file("qwen3", "qwen3-tiny-Q4_K_M.gguf")).unwrap();
    check_rows_invariant(&files, "cpu:3");
    check_rows_invariant(&files, "cpu:2,cpu:1");
}

#[test]
fn decode_rows_are_batch_invariant_phi3() {
    let files = ModelFiles::open(&common::family_file("phi3", "phi3-tiny-Q4_K_M.gguf")).unwrap();
    check_rows_invariant(&files, "cpu:1,cpu:2");
}

/// OLMoE (llama.cpp's Q4_K_M file): experts and q/k normed whole, rows decoded together.
#[test]
fn decode_rows_are_batch_invariant_olmoe() {
    let files = ModelFiles::open(&common::family_file("olmoe", "olmoe-tiny-Q4_K_M.gguf")).unwrap();
    check_rows_invariant(&files, "cpu:3");
    check_rows_invariant(&files, "cpu:1,cpu:2");
}

/// Experts (synth's Mixtral shape): each expert takes the rows that chose it together; Q4_K
/// (packed: any number of rows alone) and Q4_0 (the file's blocks: groups of `DECODE_ROWS`).
#[test]
fn decode_rows_are_batch_invariant_with_experts() {
    let dir = tempfile::tempdir().unwrap();
    for ty in [SynthType::Q4K, SynthType::Q4_0] {
        let path = dir.path().join(format!("moe-{ty:?}.gguf"));
        let shape = Shape {
            layers: 3,
            hidden: 256,
            ffn: 128,
            heads: 4,
            kv_heads: 2,
            vocab: 300,
            context: 512,
            rope_theta: 1e4,
        };
        let moe = brigade_model::synth::SynthMoe {
            experts: 8,
            used: 2,
            family: brigade_model::synth::SynthMoeFamily::Mixtral,
        };
        brigade_model::synth::write_gguf_with(&path, &shape, Some(moe), ty, 9, |_, _| {}).unwrap();
        let files = ModelFiles::open(&path).unwrap();
        check_rows_invariant(&files, "cpu:3");
        check_rows_invariant(&files, "cpu:2,cpu:1");
    }
}

/// Gemma 3 on the op path: windowed and global layers, two RoPE bases.
#[test]
fn decode_rows_are_batch_invariant_gemma3() {
    let files = ModelFiles::open(&common::family_file("gemma3", "gemma3-tiny-Q4_K_M.gguf")).unwrap();
    check_rows_invariant(&files, "cpu:4,cpu:2");
}

/// Gemma 2: soft-capped scores and logits on the rows path too.
#[test]
fn decode_rows_are_batch_invariant_gemma2() {
    let files = ModelFiles::open(&common::family_file("gemma2", "gemma2-tiny-Q4_K_M.gguf")).unwrap();
    check_rows_invariant(&files, "cpu:1,cpu:3");
}

#[test]
fn decode_rows_are_batch_invariant_in_a_sliding_window() {
    let files = ModelFiles::open(&common::family_file("mistral", "hf")).unwrap();
    check_rows_invariant(&files, "cpu:3");
}

/// What `Pipeline::generate` gives for a job alone.
fn generate_alone(p: &Pipeline, files: &ModelFiles, job: &Job) -> (Vec<u32>, StopReason) {
    let mut s = p.new_session().unwrap();
    let mut sampler = Sampler::new(job.sampler.clone());
    let mut ids = Vec::new();
    let tk = files.tokenizer.clone();
    let stats = p
        .generate(
            &mut s,
            &job.prompt,
            job.max_tokens,
            &mut sampler,
            |t| tk.is_eog(t),
            job.ignore_eos,
            |t| {
                ids.push(t);
                true
            },
        )
        .unwrap();
    (ids, stats.stop)
}

/// Runs jobs through a batch, submitting job `k` before step `at[k]`; returns each job's tokens
/// and stop reason, and the widest decode batch seen.
fn run_batch(b: &mut Batch, jobs: &[(usize, Job)]) -> HashMap<JobId, (Vec<u32>, StopReason)> {
    let mut out: HashMap<JobId, (Vec<u32>, Option<StopReason>)> = HashMap::new();
    let mut step = 0;
    loop {
        for (k, (at, job)) in jobs.iter().enumerate() {
            if *at == step {
                b.handle_submit(k as JobId, job.clone());
            }
        }
        if b.is_idle() && step > jobs.iter().map(|j| j.0).max().unwrap_or(0) {
            break;
        }
        for (id, o) in b.step() {
            let e = out.entry(id).or_default();
            match o {
                Output::Started { .. } => {}
                Output::Token(t, _) => e.0.push(t),
                Output::Done(st) => {
                    assert_eq!(st.generated, e.0.len());
                    e.1 = Some(st.stop);
                }
                Output::Error(err) => panic!("job {id}: {err}"),
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch never finished");
    }
    out.into_iter().map(|(k, (ids, stop))| (k, (ids, stop.unwrap()))).collect()
}

#[test]
fn batched_jobs_equal_generate_alone() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let p = Arc::new(pipeline(&files, "cpu:2,cpu:2", 256));
    let vocab = files.config.vocab as u32;
    let sampled = |seed| SamplingParams {
        temperature: 0.9,
        seed,
        repeat_penalty: 1.1,
        presence_penalty: 0.3,
        ..Default::default()
    };
    let job = |len, salt, max_tokens, sampler, ignore_eos| Job {
        prompt: prompt(len, salt, vocab),
        max_tokens,
        sampler,
        ignore_eos,
        constraint: None,
        logprobs: None,
    };
    let jobs = vec![
        (0, job(12, 1, 20, SamplingParams::greedy(), true)),
        (0, job(3, 2, 7, sampled(5), true)),
        (1, job(30, 3, 15, SamplingParams::greedy(), false)),
        (2, job(8, 4, 25, sampled(9), true)),
        (2, job(1, 5, 1, SamplingParams::greedy(), true)),
        (5, job(20, 6, 12, sampled(11), false)),
        (9, job(6, 7, 30, SamplingParams::greedy(), true)),
        (9, job(2, 8, 0, SamplingParams::greedy(), true)),
        // fills the context: stops there, as generate does
        (10, job(240, 9, 40, SamplingParams::greedy(), true)),
    ];
    // the end-of-generation rule generate_alone uses (with another, a job that samples an
    // end-of-text token stops alone and runs on in the batch: seen with the portable kernels)
    let tk = files.tokenizer.clone();
    let mut b = Batch::new(p.clone(), 5, move |t| tk.is_eog(t)).unwrap();
    let got = run_batch(&mut b, &jobs);
    assert_eq!(got.len(), jobs.len());
    for (k, (_, j)) in jobs.iter().enumerate() {
        let want = generate_alone(&p, &files, j);
        assert_eq!(got[&(k as JobId)], want, "job {k}");
    }
    assert_eq!(got[&8].1, StopReason::Context);
    assert_eq!(got[&7].0.len(), 0);
}

#[test]
fn long_prompts_are_read_a_chunk_per_step() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let p = Arc::new(pipeline(&files, "cpu:4", 256));
    let vocab = files.config.vocab as u32;
    let greedy = |len, salt, n| Job {
        prompt: prompt(len, salt, vocab),
        max_tokens: n,
        sampler: SamplingParams::greedy(),
        ignore_eos: true,
        constraint: None,
        logprobs: None,
    };
    // one decoding job, then a 100-token prompt read 8 tokens a step: the first job keeps
    // getting a token every step while the long prompt is read
    let mut b = Batch::new(p.clone(), 2, |_| false).unwrap().with_prefill_chunk(8);
    b.handle_submit(0, greedy(4, 1, 40));
    b.step();
    b.handle_submit(1, greedy(100, 2, 5));
    let mut first_of_long = None;
    let mut ids: HashMap<JobId, Vec<u32>> = HashMap::new();
    for step in 1..60 {
        let out = b.step();
        assert!(out.iter().any(|(id, o)| *id == 0 && matches!(o, Output::Token(..))), "step {step}: job 0 stalled");
        for (id, o) in out {
            if let Output::Token(t, _) = o {
                ids.entry(id).or_default().push(t);
                if id == 1 && first_of_long.is_none() {
                    first_of_long = Some(step);
                }
            }
        }
        if ids.get(&1).is_some_and(|v| v.len() == 5) {
            break;
        }
    }
    // 100 tokens in chunks of 8: 13 steps
    assert_eq!(first_of_long, Some(13));
    // and the answer is the one of a session prefilled in the same chunks alone
    let mut s = p.new_session().unwrap();
    let mut l = p.prefill(&mut s, &prompt(100, 2, vocab), 8).unwrap();
    let mut want = Vec::new();
    for _ in 0..5 {
        let t = argmax(&l);
        want.push(t);
        l = p.forward(&mut s, &[t], Logits::Last).unwrap().get(0).unwrap().to_vec1().unwrap();
    }
    assert_eq!(ids[&1], want);
}

/// Submits `job` alone and steps until it is done: its tokens and the prompt tokens it kept
/// from its slot's previous job.
fn run_alone(b: &mut Batch, id: JobId, job: Job) -> (Vec<u32>, usize) {
    b.handle_submit(id, job);
    let (mut ids, mut started) = (Vec::new(), None);
    for _ in 0..1000 {
        for (got, o) in b.step() {
            assert_eq!(got, id);
            match o {
                Output::Started { cached_tokens } => started = Some(cached_tokens),
                Output::Token(t, _) => {
                    assert!(started.is_some(), "job {id}: a token before Started");
                    ids.push(t)
                }
                Output::Done(st) => {
                    assert_eq!(started, Some(st.cached_tokens));
                    return (ids, st.cached_tokens);
                }
                Output::Error(e) => panic!("job {id}: {e}"),
            }
        }
    }
    panic!("job {id} never finished")
}

/// A follow-up whose prompt begins with the last one (a chat resending its conversation) keeps
/// the whole chunks that prompt was read in, and answers exactly as a batch that reads it all.
#[test]
fn a_follow_up_keeps_the_last_prompts_whole_chunks_and_answers_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let p = Arc::new(pipeline(&files, "cpu:4", 256));
    let vocab = files.config.vocab as u32;
    let greedy = |prompt: Vec<u32>| greedy_job(prompt, 6);
    let first = prompt(21, 3, vocab);
    let mut second = first.clone();
    second.extend(prompt(14, 4, vocab));
    let mut b = Batch::new(p.clone(), 2, |_| false).unwrap().with_prefill_chunk(8);
    assert_eq!(run_alone(&mut b, 0, greedy(first)).1, 0);
    // 21 tokens read in chunks of 8: the two whole chunks are kept, the rest read again
    let (got, kept) = run_alone(&mut b, 1, greedy(second.clone()));
    assert_eq!(kept, 16);
    let mut cold = Batch::new(p.clone(), 2, |_| false).unwrap().with_prefill_chunk(8);
    let (want, none) = run_alone(&mut cold, 0, greedy(second.clone()));
    assert_eq!((&got, none), (&want, 0));
    // an unrelated prompt keeps nothing and takes the other slot; `second` again keeps its
    // 4 whole chunks (32 of 35), not the tokens decoded after them
    assert_eq!(run_alone(&mut b, 2, greedy(prompt(30, 5, vocab))).1, 0);
    assert_eq!(run_alone(&mut b, 3, greedy(second)), (want, 32));
}

/// With window-sized caches (Mistral's window of 16, passes of 3: caches of 18 positions) a
/// follow-up keeps what the caches still hold: after a 40-token prompt and 6 decoded tokens the
/// keys of the first chunks are gone, so a follow-up that resends the conversation reads it all
/// again, and answers as a cold batch; with caches of the whole context (passes of 512) it keeps
/// the whole chunks, and answers the same.
#[test]
fn a_follow_up_keeps_only_what_window_sized_caches_hold() {
    let mut files = ModelFiles::open(&common::family_file("mistral", "hf")).unwrap();
    let vocab = files.config.vocab as u32;
    let greedy = |prompt: Vec<u32>| greedy_job(prompt, 6);
    let first = prompt(40, 3, vocab);
    let mut second = first.clone();
    second.extend(prompt(9, 4, vocab));
    let mut answers = Vec::new();
    for (pass, kept) in [(3, 0), (512, 40)] {
        files.set_window_pass(Some(pass));
        let p = Arc::new(pipeline(&files, "cpu:2,cpu:1", 128));
        let mut b = Batch::new(p.clone(), 1, |_| false).unwrap().with_prefill_chunk(8);
        assert_eq!(run_alone(&mut b, 0, greedy(first.clone())).1, 0);
        let (got, k) = run_alone(&mut b, 1, greedy(second.clone()));
        assert_eq!(k, kept, "passes of {pass}");
        let mut cold = Batch::new(p, 1, |_| false).unwrap().with_prefill_chunk(8);
        let (want, none) = run_alone(&mut cold, 0, greedy(second.clone()));
        assert_eq!((&got, none), (&want, 0), "passes of {pass}");
        answers.push(got);
    }
    // transformers' windowed attention either way: the cache's size does not change the answer
    assert_eq!(answers[0], answers[1]);
}

/// A sink over a std channel whose receiver the test drops to disconnect.
struct ChanSink(std::sync::mpsc::Sender<Output>, Arc<std::sync::atomic::AtomicBool>);

impl Sink for ChanSink {
    fn deliver(&mut self, out: Output) -> bool {
        self.0.send(out).is_ok()
    }
    fn is_closed(&self) -> bool {
        self.1.load(std::sync::atomic::Ordering::Acquire)
    }
}

#[test]
fn engine_cancels_gone_receivers_and_refuses_past_the_queue() {
    let files = common::stories_f32();
    let p = Arc::new(pipeline(&files, "cpu:5", 256));
    let engine = Engine::start(p, EngineConfig { parallel: 1, queue: 1 }, |_| false).unwrap();
    let long = Job {
        prompt: vec![1, 2, 3],
        max_tokens: 250,
        sampler: SamplingParams::greedy(),
        ignore_eos: true,
        constraint: None,
        logprobs: None,
    };
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    engine.submit(long.clone(), Box::new(ChanSink(tx, closed.clone()))).unwrap();
    assert_eq!(rx.recv().unwrap(), Output::Started { cached_tokens: 0 });
    assert!(matches!(rx.recv().unwrap(), Output::Token(..)));
    // one waits, the next is refused
    let (tx2, rx2) = std::sync::mpsc::channel();
    let short = Job { max_tokens: 3, ..long.clone() };
    engine.submit(short.clone(), Box::new(ChanSink(tx2, Default::default()))).unwrap();
    let (tx3, _rx3) = std::sync::mpsc::channel();
    let refused = engine.submit(short.clone(), Box::new(ChanSink(tx3, Default::default())));
    assert_eq!(refused, Err(Busy { parallel: 1, queue: 1 }));
    assert_eq!(engine.load().parallel, 1);
    // the first client goes away: its slot goes to the waiting job, which finishes long before
    // the 250 tokens the first one asked for could have been made
    closed.store(true, std::sync::atomic::Ordering::Release);
    drop(rx);
    let mut n = 0;
    loop {
        match rx2.recv_timeout(std::time::Duration::from_secs(30)).unwrap() {
            Output::Started { .. } => {}
            Output::Token(..) => n += 1,
            Output::Done(st) => {
                assert_eq!((st.generated, st.stop), (3, StopReason::Length));
                break;
            }
            Output::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(n, 3);
    let t0 = std::time::Instant::now();
    while engine.load().active + engine.load().waiting > 0 {
        assert!(t0.elapsed().as_secs() < 10, "load never drained: {:?}", engine.load());
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// A constraint that allows one id at each step (`script`), then is done; past its script's
/// end (`at` beyond it), a constraint that fails.
#[derive(Clone)]
struct Forced {
    script: Vec<u32>,
    at: usize,
}

impl brigade_core::TokenConstraint for Forced {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let Some(&want) = self.script.get(self.at) else { return Err("nothing allowed".into()) };
        for (i, l) in logits.iter_mut().enumerate() {
            if i as u32 != want {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn commit(&mut self, id: u32) -> Result<(), String> {
        assert_eq!(Some(&id), self.script.get(self.at), "the sampler drew an id the mask hid");
        self.at += 1;
        Ok(())
    }
    fn is_done(&self) -> bool {
        self.at == self.script.len()
    }
    fn boxed_clone(&self) -> Box<dyn brigade_core::TokenConstraint> {
        Box::new(self.clone())
    }
}

/// A job's constraint masks every draw (greedy and at temperature 1.5), ends the job where it
/// is done (before `max_tokens`, past `ignore_eos`), and a constraint that fails fails its job
/// only: the engine goes on serving.
#[test]
fn a_constraint_decides_the_tokens_and_where_the_answer_ends() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let p = Arc::new(pipeline(&files, "cpu:2,cpu:2", 256));
    let mut b = Batch::new(p, 2, |_| false).unwrap();
    let hot = SamplingParams { temperature: 1.5, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 9, ..Default::default() };
    for (id, sampler) in [(0, SamplingParams::greedy()), (1, hot)] {
        let job = Job {
            prompt: prompt(9, 1, 300),
            max_tokens: 50,
            sampler,
            ignore_eos: true,
            constraint: Some(brigade_core::Constraint(Box::new(Forced { script: vec![17, 250, 3], at: 0 }))),
            logprobs: None,
        };
        let (ids, _) = run_alone(&mut b, id, job);
        assert_eq!(ids, [17, 250, 3]);
    }
    let failing = Job {
        prompt: prompt(5, 2, 300),
        max_tokens: 5,
        sampler: SamplingParams::greedy(),
        ignore_eos: true,
        constraint: Some(brigade_core::Constraint(Box::new(Forced { script: vec![], at: 1 }))),
        logprobs: None,
    };
    b.handle_submit(2, failing);
    let mut error = None;
    for _ in 0..20 {
        for (_, o) in b.step() {
            if let Output::Error(e) = o {
                error = Some(e);
            }
        }
    }
    assert!(error.as_deref().is_some_and(|e| e.contains("nothing allowed")), "{error:?}");
    let free = greedy_job(prompt(5, 2, 300), 4);
    assert_eq!(run_alone(&mut b, 3, free).0.len(), 4);
}

/// Each token's log-probabilities, when a job asks: the greedy choice is the most likely id,
/// alternatives come most likely first, a constraint's forced token is scored by the model's
/// own distribution (not the mask's), and the figures do not depend on the neighbours a job is
/// batched with.
#[test]
fn logprobs_name_the_greedy_choice_and_do_not_depend_on_neighbours() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let p = Arc::new(pipeline(&files, "cpu:2,cpu:2", 256));
    let mut b = Batch::new(p, 2, |_| false).unwrap();
    let collect = |b: &mut Batch, jobs: Vec<(JobId, Job)>| {
        let mut got: HashMap<JobId, Vec<(u32, brigade_core::TokenLogprob)>> = HashMap::new();
        let n = jobs.len();
        for (id, job) in jobs {
            b.handle_submit(id, job);
        }
        let mut done = 0;
        for _ in 0..1000 {
            for (id, o) in b.step() {
                match o {
                    Output::Token(t, lp) => got.entry(id).or_default().push((t, lp.expect("asked for logprobs"))),
                    Output::Done(_) => done += 1,
                    Output::Error(e) => panic!("job {id}: {e}"),
                    Output::Started { .. } => {}
                }
            }
            if done == n {
                return got;
            }
        }
        panic!("never finished")
    };
    let job = |seed: u32, logprobs| Job { logprobs, ..greedy_job(prompt(12, seed, 300), 12) };
    let alone = collect(&mut b, vec![(0, job(1, Some(5)))]).remove(&0).unwrap();
    assert_eq!(alone.len(), 12);
    for (t, lp) in &alone {
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0], (*t, lp.logprob), "the greedy id is the most likely");
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let mass: f32 = lp.top.iter().map(|x| x.1.exp()).sum();
        assert!(lp.logprob <= 0.0 && mass <= 1.0 + 1e-5, "{lp:?}");
    }
    // beside another job (with a different prompt length), the same figures, bit for bit
    let mut with = collect(&mut b, vec![(1, job(1, Some(5))), (2, job(7, Some(0)))]);
    assert_eq!(with.remove(&1).unwrap(), alone);
    assert!(with[&2].iter().all(|(_, lp)| lp.top.is_empty() && lp.logprob.is_finite()));
    // a forced token: its own probability under the model
    let forced = Job {
        constraint: Some(brigade_core::Constraint(Box::new(Forced { script: vec![17, 250, 3], at: 0 }))),
        ..job(1, Some(1))
    };
    let got = collect(&mut b, vec![(3, forced)]).remove(&3).unwrap();
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [17, 250, 3]);
    assert_eq!(got[0].1.top[0].0, alone[0].0, "the model's favourite, not the mask's");
    assert!(got.iter().all(|(t, lp)| lp.logprob <= lp.top[0].1 && (lp.top[0].0 != *t || lp.logprob == lp.top[0].1)));
}

/// Prompts that arrive together are read together: where every weight computes its rows alone
/// (packed, f32 on the CPU) the step reads the next chunks of the waiting prompts in one pass
/// while they fit in its budget (one chunk's worth) — three jobs of 20, 30 and 100 tokens in
/// chunks of 64 have their first tokens after 1, 1 and 3 steps instead of round robin's 1, 2
/// and 4 — and the logits and ids of each are, bit for bit, those it gets alone, over one stage
/// and over two.
#[test]
fn prompts_arriving_together_are_read_in_one_pass_and_answer_as_alone() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let vocab = files.config.vocab as u32;
    for map in ["cpu:4", "cpu:1,cpu:3"] {
        let p = Arc::new(pipeline(&files, map, 256));
        let together = p.reads_prompts_together();
        // (Q4_K is packed wherever there are int8 kernels: AVX2, AVX-VNNI, AVX-512)
        let packed = brigade_model::cpu_matmul::packs_on(
            candle_core::quantized::GgmlDType::Q4K,
            brigade_model::cpu_matmul::Isa::best(),
        );
        assert_eq!(together, packed, "{map}");
        // the pipeline's pass: each session's logits as alone
        if together {
            let chunks = [prompt(30, 1, vocab), prompt(64, 2, vocab), prompt(1, 3, vocab)];
            let mut sessions: Vec<_> = (0..3).map(|_| p.new_session().unwrap()).collect();
            let mut refs: Vec<&mut brigade_model::Session> = sessions.iter_mut().collect();
            let chunk_refs: Vec<&[u32]> = chunks.iter().map(Vec::as_slice).collect();
            let got = p.forward_ragged(&mut refs, &chunk_refs).unwrap();
            for (k, c) in chunks.iter().enumerate() {
                let mut alone = p.new_session().unwrap();
                let l = p.forward(&mut alone, c, brigade_model::Logits::Last).unwrap();
                let want: Vec<f32> = l.get(l.dim(0).unwrap() - 1).unwrap().to_vec1().unwrap();
                assert_eq!(got[k], want, "{map}: session {k}'s logits");
                assert_eq!(sessions[k].tokens(), c.as_slice());
            }
            // sessions already at different positions, one of them taking a single token: the
            // pass gives each its logits alone, and its caches then hold what they would alone
            // (the next decode step's logits agree too)
            let prefixes = [prompt(64, 4, vocab), prompt(5, 5, vocab), prompt(100, 6, vocab)];
            let next = [prompt(30, 7, vocab), prompt(1, 8, vocab), prompt(64, 9, vocab)];
            let mut a: Vec<_> = (0..3).map(|_| p.new_session().unwrap()).collect();
            let mut b: Vec<_> = (0..3).map(|_| p.new_session().unwrap()).collect();
            for k in 0..3 {
                p.forward(&mut a[k], &prefixes[k], brigade_model::Logits::Last).unwrap();
                p.forward(&mut b[k], &prefixes[k], brigade_model::Logits::Last).unwrap();
            }
            let mut refs: Vec<&mut brigade_model::Session> = a.iter_mut().collect();
            let next_refs: Vec<&[u32]> = next.iter().map(Vec::as_slice).collect();
            let got = p.forward_ragged(&mut refs, &next_refs).unwrap();
            let last =
                |l: candle_core::Tensor| -> Vec<f32> { l.get(l.dim(0).unwrap() - 1).unwrap().to_vec1().unwrap() };
            for k in 0..3 {
                let want = last(p.forward(&mut b[k], &next[k], brigade_model::Logits::Last).unwrap());
                assert_eq!(got[k], want, "{map}: session {k} at position {}", prefixes[k].len());
                let step_a = last(p.forward(&mut a[k], &[3], brigade_model::Logits::Last).unwrap());
                let step_b = last(p.forward(&mut b[k], &[3], brigade_model::Logits::Last).unwrap());
                assert_eq!(step_a, step_b, "{map}: session {k}'s caches after the pass");
            }
        }
        let lens = [20usize, 30, 100];
        let job = |k: usize| greedy_job(prompt(lens[k], k as u32 + 1, vocab), 6);
        let mut b = Batch::new(p.clone(), 3, |_| false).unwrap().with_prefill_chunk(64);
        for k in 0..3 {
            b.handle_submit(k as JobId, job(k));
        }
        let mut first: HashMap<JobId, usize> = HashMap::new();
        let mut ids: HashMap<JobId, Vec<u32>> = HashMap::new();
        for step in 1..60 {
            for (id, o) in b.step() {
                if let Output::Token(t, _) = o {
                    first.entry(id).or_insert(step);
                    ids.entry(id).or_default().push(t);
                }
            }
            if b.is_idle() {
                break;
            }
        }
        let firsts: Vec<usize> = (0..3).map(|k| first[&(k as JobId)]).collect();
        assert_eq!(firsts, if together { [1, 1, 3] } else { [1, 2, 4] }, "{map}: steps to each first token");
        for k in 0..3 {
            let mut alone = Batch::new(p.clone(), 1, |_| false).unwrap().with_prefill_chunk(64);
            let (want, _) = run_alone(&mut alone, 9, job(k));
            assert_eq!(ids[&(k as JobId)], want, "{map}: job {k}");
        }
    }
    // an id past the vocabulary fails its own job at admission, never the pass it would share
    let p = Arc::new(pipeline(&files, "cpu:4", 256));
    let mut b = Batch::new(p.clone(), 2, |_| false).unwrap().with_prefill_chunk(64);
    b.handle_submit(0, greedy_job(vec![5, vocab + 7, 9], 3));
    b.handle_submit(1, greedy_job(prompt(20, 1, vocab), 3));
    let mut outcome: HashMap<JobId, String> = HashMap::new();
    for _ in 0..20 {
        for (id, o) in b.step() {
            match o {
                Output::Error(e) => drop(outcome.insert(id, e)),
                Output::Done(_) => drop(outcome.insert(id, "done".into())),
                _ => {}
            }
        }
    }
    assert!(outcome[&0].contains("outside the vocabulary"), "{outcome:?}");
    assert_eq!(outcome[&1], "done");
    // weights whose kernels round by the number of rows keep one prompt per step
    let f32_path = dir.path().join("f32.gguf");
    let shape =
        Shape { layers: 2, hidden: 64, ffn: 128, heads: 4, kv_heads: 2, vocab: 300, context: 256, rope_theta: 1e4 };
    write_gguf(&f32_path, &shape, SynthType::F32, 3, |_, _| {}).unwrap();
    let f32_files = ModelFiles::open(&f32_path).unwrap();
    assert!(!pipeline(&f32_files, "cpu:2", 64).reads_prompts_together());
}

/// A prompt's numbers do not depend on the chunks it is read in — one pass, chunks of 64, 7, 4
/// or one token at a time give the same logits, bit for bit — where the weights are packed (the
/// same kernel for any number of rows) and the attention of a prompt row is a decode step's:
/// so a cluster's 64-token chunks give `serve`'s numbers, and a session resumed after a failover
/// (its prompt and answer read again) goes on as the uninterrupted one.
#[test]
fn a_prompts_numbers_do_not_depend_on_its_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let files = q4k_model(&dir);
    let packed = brigade_model::cpu_matmul::packs_on(
        candle_core::quantized::GgmlDType::Q4K,
        brigade_model::cpu_matmul::Isa::best(),
    );
    let layers = brigade_core::LayerRange::new(0, files.config.n_layers).unwrap();
    let slice =
        brigade_model::Slice::load(&files, layers, &candle_core::Device::Cpu, candle_core::DType::F32, 512).unwrap();
    let vocab = files.config.vocab as u32;
    for len in [5usize, 70, 200] {
        let p = prompt(len, len as u32, vocab);
        let read = |chunk: usize| -> Vec<f32> {
            let mut cache = slice.new_cache().unwrap();
            let mut last = None;
            for c in p.chunks(chunk) {
                last = Some(slice.forward(&mut cache, brigade_model::StageInput::Tokens(c), Logits::Last).unwrap());
            }
            brigade_model::rows::logits_row(&last.unwrap()).unwrap()
        };
        let whole = read(len);
        for chunk in [64, 7, 4, 1] {
            let got = read(chunk);
            let worst = whole.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            if packed {
                assert_eq!(worst, 0.0, "{len} tokens in chunks of {chunk}: logits differ by {worst}");
            } else {
                // (file-layout prompt kernels round unlike the decode kernels: close, not equal)
                assert!(worst < 1e-2, "{len} tokens in chunks of {chunk}: logits differ by {worst}");
            }
        }
    }
}
