//! When a generation ends, one definition for every engine (one box's `Pipeline` and batch, a
//! cluster's session driver) and every API:
//! - [`StopReason`]: the one vocabulary of why it ended;
//! - [`StopRules`]: what a drawn id does to the answer (end-of-generation, a complete format,
//!   `max_tokens`, a full context);
//! - [`StopMatcher`]: stop strings over streamed text (OpenAI `stop`, gRPC
//!   `GenerateOptions.stop`, both SDKs): text is released only once no stop string can start in
//!   it, so a stop string split across tokens is found and never sent; the answer ends before
//!   the earliest stop string.

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    /// `max_tokens` reached.
    Length,
    /// An end-of-generation id (not part of the answer), or the answer's format is complete.
    Eos,
    /// The context is full.
    Context,
    /// The caller ended it (went away, or said so).
    Caller,
    /// One of the request's stop strings.
    Stop,
}

/// A generation's stop rules and its count of generated ids: the same decisions on one box
/// and through a cluster (whose last stage draws and whose driver judges).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopRules {
    /// Ids to generate at most (`usize::MAX`: no limit).
    pub max_tokens: usize,
    /// Tokens a session holds: the id drawn after a full context is its last.
    pub n_ctx: usize,
    /// Keep generating past end-of-generation ids (unless the format is complete).
    pub ignore_eos: bool,
    /// Ids of the answer so far (after a failover, those resumed count).
    pub generated: usize,
}

/// What a drawn id does to the answer ([`StopRules::judge`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It ends the answer and is not part of it (an end-of-generation id).
    Unsent,
    /// It is part of the answer, which goes on.
    Next,
    /// It is the answer's last id.
    Last(StopReason),
}

impl Verdict {
    /// Why the answer ends here, if it does.
    pub fn stop(self) -> Option<StopReason> {
        match self {
            Verdict::Unsent => Some(StopReason::Eos),
            Verdict::Next => None,
            Verdict::Last(r) => Some(r),
        }
    }
}

impl StopRules {
    /// Judges a drawn id: `eog` whether it is an end-of-generation id, `done` whether it
    /// completes the answer's format, `follows` how many tokens the logits it was drawn from
    /// follow. Counts it when it is part of the answer. In order: an end-of-generation id ends
    /// the answer unsent (unless `ignore_eos`, which a complete format overrides); a complete
    /// format, then `max_tokens`, then a full context make the id the last.
    pub fn judge(&mut self, eog: bool, done: bool, follows: usize) -> Verdict {
        if eog && (!self.ignore_eos || done) {
            return Verdict::Unsent;
        }
        self.generated += 1;
        if done {
            Verdict::Last(StopReason::Eos)
        } else if self.generated >= self.max_tokens {
            Verdict::Last(StopReason::Length)
        } else if follows + 1 > self.n_ctx {
            Verdict::Last(StopReason::Context)
        } else {
            Verdict::Next
        }
    }
}

/// Stop strings one request may give (OpenAI allows 4).
pub const MAX_STOPS: usize = 16;
/// Bytes of one stop string at most: the text held back is shorter than the longest.
pub const MAX_STOP_BYTES: usize = 256;

/// Stop strings a request may not give.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StopError {
    /// More than [`MAX_STOPS`] stop strings: how many were given.
    #[error("at most {MAX_STOPS} stop strings, got {0}")]
    TooMany(usize),
    /// A stop string longer than [`MAX_STOP_BYTES`].
    #[error("a stop string is at most {MAX_STOP_BYTES} bytes, stop string {index} is {len}")]
    TooLong {
        /// Its position in the request's list, from 0.
        index: usize,
        /// Its length in bytes.
        len: usize,
    },
}

/// Checks a request's stop strings against [`MAX_STOPS`] and [`MAX_STOP_BYTES`].
pub fn check_stops(stops: &[String]) -> Result<(), StopError> {
    if stops.len() > MAX_STOPS {
        return Err(StopError::TooMany(stops.len()));
    }
    match stops.iter().enumerate().find(|(_, s)| s.len() > MAX_STOP_BYTES) {
        Some((index, s)) => Err(StopError::TooLong { index, len: s.len() }),
        None => Ok(()),
    }
}

/// Holds back the tail of the text that could begin a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored. (Limits are the API's to check: [`check_stops`].)
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), ..Default::default() }
    }

    /// Whether a stop string was found (nothing more is released).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Appends `text`; returns what may be sent now. After a stop string, returns the text
    /// before it and then nothing.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            self.held.truncate(at);
            return std::mem::take(&mut self.held);
        }
        // the longest tail of the held text that is a proper prefix of a stop string; the held
        // text is shorter than the longest stop string, so this is bounded by the limits
        let keep = self.stops.iter().map(|s| held_prefix(&self.held, s)).max().unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        std::mem::replace(&mut self.held, rest)
    }

    /// The end of the stream: whatever is still held (it began no stop string after all).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest proper prefix of `stop` that `held` ends with.
fn held_prefix(held: &str, stop: &str) -> usize {
    let longest = (stop.len() - 1).min(held.len());
    (1..=longest).rev().find(|&n| stop.is_char_boundary(n) && held.ends_with(&stop[..n])).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_judge_in_their_order() {
        let rules = StopRules { max_tokens: 3, n_ctx: 10, ignore_eos: false, generated: 0 };
        let mut r = rules.clone();
        assert_eq!(r.judge(true, false, 4), Verdict::Unsent);
        assert_eq!(r.generated, 0, "an unsent id is not counted");
        assert_eq!((r.judge(false, false, 4), r.judge(false, false, 5)), (Verdict::Next, Verdict::Next));
        assert_eq!(r.judge(false, false, 9), Verdict::Last(StopReason::Length), "length before context");
        // ignore_eos keeps an end-of-generation id, unless the format is complete
        let mut r = StopRules { ignore_eos: true, ..rules.clone() };
        assert_eq!(r.judge(true, false, 4), Verdict::Next);
        assert_eq!(r.judge(true, true, 5), Verdict::Unsent);
        assert_eq!(r.judge(false, true, 5), Verdict::Last(StopReason::Eos));
        // the id drawn after a full context is the last
        let mut r = StopRules { max_tokens: usize::MAX, ..rules };
        assert_eq!(r.judge(false, false, 8), Verdict::Next);
        assert_eq!(r.judge(false, false, 10), Verdict::Last(StopReason::Context));
        assert_eq!(Verdict::Unsent.stop(), Some(StopReason::Eos));
        assert_eq!(serde_json::to_string(&StopReason::Caller).unwrap(), "\"caller\"");
    }

    fn run(stops: &[&str], pieces: &[&str]) -> (Vec<String>, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out: Vec<String> = pieces.iter().map(|p| m.push(p)).collect();
        out.push(m.finish());
        (out, m.stopped())
    }

    #[test]
    fn a_stop_string_across_tokens_is_cut_and_not_sent() {
        let (out, stopped) = run(&["\nUser:"], &["Hello", " there\n", "Us", "er:", " more"]);
        assert!(stopped);
        assert_eq!(out.concat(), "Hello there");
        // "\n" was held back until it could no longer begin the stop string... which it did
        assert_eq!(out, ["Hello", " there", "", "", "", ""]);
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching() {
        let (out, stopped) = run(&["END"], &["the E", "nd", " EN", "D!"]);
        assert!(stopped);
        assert_eq!(out, ["the ", "End", " ", "", ""]);
        let (out, stopped) = run(&["END"], &["the E", "N"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "the EN");
        assert_eq!(out.last().map(String::as_str), Some("EN"));
    }

    #[test]
    fn earliest_of_several_and_multibyte_prefixes() {
        let (out, _) = run(&["cd", "b"], &["abcd"]);
        assert_eq!(out.concat(), "a");
        let (out, stopped) = run(&["éx"], &["café", "y"]);
        assert!(!stopped);
        assert_eq!(out, ["caf", "éy", ""]);
        let (out, stopped) = run(&["", "zz"], &["a", "b"]);
        assert!(!stopped);
        assert_eq!(out.concat(), "ab");
    }

    #[test]
    fn limits_are_checked_with_their_numbers() {
        let ok: Vec<String> = vec!["x".repeat(MAX_STOP_BYTES); MAX_STOPS];
        assert_eq!(check_stops(&ok), Ok(()));
        let many = vec!["a".to_string(); MAX_STOPS + 1];
        assert_eq!(check_stops(&many).unwrap_err().to_string(), "at most 16 stop strings, got 17");
        let long = vec!["a".into(), "b".repeat(MAX_STOP_BYTES + 1)];
        assert_eq!(check_stops(&long), Err(StopError::TooLong { index: 1, len: MAX_STOP_BYTES + 1 }));
    }

    #[test]
    fn the_held_text_stays_shorter_than_the_longest_stop() {
        let mut m = StopMatcher::new(vec!["a".repeat(40) + "!"]);
        let mut sent = String::new();
        for _ in 0..100 {
            sent.push_str(&m.push("a"));
            assert!(m.held.len() <= 40, "{}", m.held.len());
        }
        assert_eq!(sent.len(), 60, "all but the last 40 bytes, which may still begin the stop");
        // the stop is the held 40 and the "!": the 60 sent are exactly the text before it
        assert_eq!(m.push("!"), "");
        assert!(m.stopped());
    }
}
