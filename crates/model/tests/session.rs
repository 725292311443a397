//! A session's tokens are what its caches hold: after `generate` (whose last token is sampled but
//! not fed) and after a forward pass that fails part-way through the stages. The cluster's replay
//! after a failure feeds a new stage `session.tokens()` and relies on this.

#![allow(clippy::unwrap_used)]
mod common;
use brigade_core::{DeviceId, LayerRange};
use brigade_model::{Logits, ModelError, Pipeline, Sampler, SamplingParams, Slice};
use candle_core::{DType, Device};
use common::*;

fn last_row(p: &Pipeline, s: &mut brigade_model::Session, ids: &[u32]) -> Vec<f32> {
    let l = p.forward(s, ids, Logits::Last).unwrap().to_vec2::<f32>().unwrap();
    l.last().unwrap().clone()
}

#[test]
fn generate_leaves_tokens_equal_to_the_caches() {
    let files = stories_f32();
    let p = pipeline(&files, "cpu:2,cpu:3", 64);
    let prompt = [1u32, 403, 407];
    for n in [1usize, 5] {
        let mut s = p.new_session().unwrap();
        let mut got = Vec::new();
        let stats = p
            .generate(
                &mut s,
                &prompt,
                n,
                &mut Sampler::new(SamplingParams::greedy()),
                |_| false,
                true,
                |t| {
                    got.push(t);
                    true
                },
            )
            .unwrap();
        assert_eq!(got.len(), n);
        // the prompt and every generated token but the last were fed
        assert_eq!(s.tokens(), [&prompt[..], &got[..n - 1]].concat().as_slice());
        assert_eq!(s.cache_lens(), vec![s.len(); 2]);
        assert_eq!(stats.unfed, got.last().copied());
        // continuing from the session equals a fresh session fed the whole history
        let unfed = stats.unfed.unwrap();
        let cont = last_row(&p, &mut s, &[unfed]);
        let mut fresh = p.new_session().unwrap();
        let whole = last_row(&p, &mut fresh, &[&prompt[..], &got[..]].concat());
        assert!(max_abs_diff(&[cont], &[whole]) < 1e-4);
        assert_eq!(s.tokens(), fresh.tokens());
    }
}

#[test]
fn generate_stopped_by_end_of_text_has_nothing_unfed() {
    let files = stories_f32();
    let p = pipeline(&files, "cpu:5", 64);
    let mut s = p.new_session().unwrap();
    // every token is an end of text: nothing is generated
    let stats =
        p.generate(&mut s, &[1], 4, &mut Sampler::new(SamplingParams::greedy()), |_| true, false, |_| true).unwrap();
    assert_eq!(stats.generated, 0);
    assert_eq!(stats.unfed, None);
    assert_eq!(s.tokens(), [1]);
}

/// Stage 2 holds 8 tokens, stage 1 holds 64: a chunk that passes stage 1 and overflows stage 2.
#[test]
fn a_stage_that_fails_leaves_every_cache_as_it_was() {
    let files = stories_f32();
    let load =
        |a, b, n_ctx| Slice::load(&files, LayerRange::new(a, b).unwrap(), &Device::Cpu, DType::F32, n_ctx).unwrap();
    let p = Pipeline::from_slices(vec![(DeviceId::Cpu, load(0, 2, 64)), (DeviceId::Cpu, load(2, 5, 8))]).unwrap();
    assert_eq!(p.n_ctx(), 8);
    let ids: Vec<u32> = (0..10).map(|i| 300 + i).collect();
    let mut s = p.new_session().unwrap();
    last_row(&p, &mut s, &ids[..6]);
    let e = p.forward(&mut s, &ids[6..], Logits::Last).unwrap_err();
    assert!(matches!(e, ModelError::ContextFull { need: 10, n_ctx: 8 }), "{e}");
    assert_eq!(s.tokens(), &ids[..6]);
    assert_eq!(s.cache_lens(), vec![6, 6], "the first stage's cache was rolled back");
    // the session goes on as if the failed call never happened
    let after = last_row(&p, &mut s, &ids[6..8]);
    let mut fresh = p.new_session().unwrap();
    let want = last_row(&p, &mut fresh, &ids[..8]);
    assert!(max_abs_diff(&[after], &[want]) < 1e-4);
    // a pipeline of slices must cover the model in order
    let e = Pipeline::from_slices(vec![(DeviceId::Cpu, load(0, 2, 8)), (DeviceId::Cpu, load(3, 5, 8))]).err().unwrap();
    assert!(e.to_string().contains("stage [3, 5) does not start where the previous one ended (2)"), "{e}");
    let e = Pipeline::from_slices(vec![(DeviceId::Cpu, load(0, 2, 8))]).err().unwrap();
    assert!(e.to_string().contains("stages cover 2 of 5 layers"), "{e}");
}
