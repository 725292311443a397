//! Stop strings over streamed text (pure), one rule for every API (OpenAI `stop`, gRPC
//! `GenerateOptions.stop`, both SDKs): text is released only once no stop string can start in
//! it, so a stop string split across tokens is found and never sent; the answer ends before the
//! earliest stop string.

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
