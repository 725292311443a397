//! Stop strings over streamed text (pure): text is released only once no stop string can start
//! in it, so a stop string split across tokens is found and never sent.

/// Holds back the tail of the text that could begin a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
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
        // the longest tail of the held text that is a proper prefix of a stop string
        let keep = self
            .stops
            .iter()
            .flat_map(|s| (1..s.len()).filter(move |&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        std::mem::replace(&mut self.held, rest)
    }

    /// The end of the stream: whatever is still held (it began no stop string after all).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
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
}
