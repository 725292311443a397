//! How the next token is drawn: one definition for every entry point (`run`, `serve`, the
//! coordinator's HTTP and gRPC APIs, both SDKs, the worker that samples for a cluster), so the
//! same request gives the same text wherever it is sent.
//!
//! The order and meaning are llama.cpp's: penalties (repetition, frequency, presence) over the
//! last `repeat_last_n` tokens, top-k, top-p, min-p, temperature, then a draw from a generator
//! seeded with `seed`. Temperature 0 (or below) is greedy.

use serde::{Deserialize, Serialize};

/// Sampling settings of one generation. [`Default`] is llama.cpp's defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 (or below) is greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// A seen token's logit is divided by it (multiplied when not positive); 1 disables.
    pub repeat_penalty: f32,
    /// How many of the last tokens (prompt included) the penalties look at; 0 disables them.
    pub repeat_last_n: usize,
    /// Subtracted from a token's logit once per time it occurs in the window (OpenAI's
    /// `frequency_penalty`); 0 disables.
    pub frequency_penalty: f32,
    /// Subtracted from a token's logit once if it occurs in the window at all (`presence_penalty`).
    pub presence_penalty: f32,
    /// The generator's seed: the same seed and settings give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 0,
        }
    }
}

/// The most alternatives a request may ask for per token (OpenAI's `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A generated token's log-probability, and the most likely alternatives', as OpenAI's
/// `logprobs` report them: natural logs of the model's own distribution at that step (the
/// softmax of its logits), whatever the sampling settings that then drew the token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// Natural log of the drawn id's probability (−∞ when the model gave it none).
    pub logprob: f32,
    /// The `n` most likely ids, most likely first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// The log-probability of `id` and the `top_n` most likely ids (at most
    /// [`MAX_TOP_LOGPROBS`]) under `softmax(logits)`. Logits that are not finite count as
    /// impossible (−∞); so does an id past the logits.
    pub fn of(logits: &[f32], id: u32, top_n: usize) -> TokenLogprob {
        let finite = || logits.iter().copied().filter(|l| l.is_finite());
        let max = finite().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return TokenLogprob { logprob: f32::NEG_INFINITY, top: Vec::new() };
        }
        // Neumaier's compensated sum in f64: the terms are at most 1 (the largest is exactly
        // 1), and a plain sum drops every term under 1e-16 once the 1 is in
        let (mut sum, mut carry) = (0.0f64, 0.0f64);
        for l in finite() {
            let x = ((l - max) as f64).exp();
            let t = sum + x;
            carry += if sum.abs() >= x.abs() { (sum - t) + x } else { (x - t) + sum };
            sum = t;
        }
        let log_z = max as f64 + (sum + carry).ln();
        let lp = |l: f32| if l.is_finite() { (l as f64 - log_z) as f32 } else { f32::NEG_INFINITY };
        let logprob = logits.get(id as usize).map_or(f32::NEG_INFINITY, |&l| lp(l));
        let n = top_n.min(MAX_TOP_LOGPROBS);
        // one pass keeping the n best (n is small)
        let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
        if n > 0 {
            for (i, &l) in logits.iter().enumerate() {
                if !l.is_finite() || (top.len() == n && l <= top[n - 1].1) {
                    continue;
                }
                let at = top.partition_point(|&(_, t)| t >= l);
                top.insert(at, (i as u32, l));
                top.truncate(n);
            }
        }
        TokenLogprob { logprob, top: top.into_iter().map(|(i, l)| (i, lp(l))).collect() }
    }
}

/// What a generation's tokens must spell (a JSON schema, a grammar): before each draw the
/// sampler's logits of the ids that cannot come next are set to −∞, and the id drawn is told
/// back. Implemented by `brigade-grammar` (llguidance); the engines that sample only see this.
pub trait TokenConstraint: Send {
    /// Sets to −∞ the logit of every id that may not come next (the end-of-generation id stays
    /// where the constraint is complete). An error ends the generation.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Takes `id` as the next token.
    fn commit(&mut self, id: u32) -> Result<(), String>;
    /// The constraint is complete and nothing may follow: the generation ends.
    fn is_done(&self) -> bool;
    /// An independent copy at the same point.
    fn boxed_clone(&self) -> Box<dyn TokenConstraint>;
}

/// A [`TokenConstraint`] carried in a request: cloning it copies its state.
pub struct Constraint(pub Box<dyn TokenConstraint>);

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Constraint(self.0.boxed_clone())
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// A sampling setting the sampler cannot use.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{field}` = {value}: {why}")]
pub struct SamplingError {
    /// The field's name as the APIs spell it (`top_p`, `repeat_penalty`, …).
    pub field: &'static str,
    /// The value the request gave.
    pub value: f32,
    /// What the value must be instead.
    pub why: &'static str,
}

impl SamplingParams {
    /// llama.cpp's defaults at temperature 0.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Whether the penalties change any logit.
    pub fn penalises(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repeat_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0)
    }

    /// Refuses what the sampler cannot use: non-finite numbers, a nucleus or min-p outside
    /// [0, 1], a repeat penalty that is not above 0. (API-specific ranges, such as OpenAI's
    /// temperature at most 2, are the API's to check.)
    pub fn validate(&self) -> Result<(), SamplingError> {
        let fields = [
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("min_p", self.min_p),
            ("repeat_penalty", self.repeat_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ];
        for (field, value) in fields {
            if !value.is_finite() {
                return Err(SamplingError { field, value, why: "not a finite number" });
            }
        }
        for (field, value) in [("top_p", self.top_p), ("min_p", self.min_p)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(SamplingError { field, value, why: "must be between 0 and 1" });
            }
        }
        if self.repeat_penalty <= 0.0 {
            return Err(SamplingError {
                field: "repeat_penalty",
                value: self.repeat_penalty,
                why: "must be above 0 (1 disables it)",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_softmax_of_the_logits() {
        let logits = [1.0f32, 3.0, f32::NEG_INFINITY, 3.0, -2.0, f32::NAN];
        let lp = TokenLogprob::of(&logits, 1, 3);
        let z: f64 = [1.0f64, 3.0, 3.0, -2.0].iter().map(|l| l.exp()).sum();
        assert!((lp.logprob as f64 - (3.0 - z.ln())).abs() < 1e-6, "{lp:?}");
        // most likely first, ties by id, impossible ids never listed
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3, 0]);
        assert_eq!(lp.top[0].1, lp.logprob);
        let total: f64 = (0..logits.len() as u32)
            .map(|i| TokenLogprob::of(&logits, i, 0).logprob as f64)
            .filter(|l| l.is_finite())
            .map(f64::exp)
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(TokenLogprob::of(&logits, 2, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(TokenLogprob::of(&logits, 99, 0).logprob, f32::NEG_INFINITY);
        assert_eq!(TokenLogprob::of(&logits, 0, 50).top.len(), 4);
        assert!(TokenLogprob::of(&[f32::NEG_INFINITY; 3], 0, 2).top.is_empty());
        // a large vocabulary: the sum does not drown the small terms
        let mut big = vec![-30.0f32; 150_000];
        big[7] = 10.0;
        let lp = TokenLogprob::of(&big, 7, 1);
        assert!(lp.logprob < 0.0 && lp.logprob > -1e-6, "{lp:?}");
    }

    #[test]
    fn defaults_are_llama_cpps_and_validate() {
        let d = SamplingParams::default();
        assert_eq!((d.temperature, d.top_k, d.top_p, d.min_p, d.repeat_last_n), (0.8, 40, 0.95, 0.05, 64));
        assert!(d.validate().is_ok() && !d.penalises());
        assert!(SamplingParams { presence_penalty: 0.5, ..d.clone() }.penalises());
        assert!(!SamplingParams { presence_penalty: 0.5, repeat_last_n: 0, ..d.clone() }.penalises());
        assert_eq!(SamplingParams::greedy().temperature, 0.0);
    }

    #[test]
    fn what_the_sampler_cannot_use_is_refused_by_name() {
        let bad = [
            (SamplingParams { top_p: 1.5, ..Default::default() }, "top_p"),
            (SamplingParams { min_p: -0.1, ..Default::default() }, "min_p"),
            (SamplingParams { repeat_penalty: 0.0, ..Default::default() }, "repeat_penalty"),
            (SamplingParams { temperature: f32::NAN, ..Default::default() }, "temperature"),
            (SamplingParams { presence_penalty: f32::INFINITY, ..Default::default() }, "presence_penalty"),
        ];
        for (p, field) in bad {
            let e = p.validate().unwrap_err();
            assert_eq!(e.field, field);
            assert!(e.to_string().starts_with(&format!("`{field}` = ")), "{e}");
        }
    }

    #[test]
    fn missing_fields_in_json_take_the_defaults() {
        let p: SamplingParams = serde_json::from_str(r#"{"temperature": 0, "presence_penalty": 0.5}"#).unwrap();
        assert_eq!(p, SamplingParams { temperature: 0.0, presence_penalty: 0.5, ..Default::default() });
    }
}
