//! A session's relay between a client and the driver of its pipeline, without IO: which of the
//! driver's events go to the client, and — when the pipeline fails under the session (a node
//! died, the deployment was re-placed) — whether to resume it and with what request.
//!
//! A resumed attempt is the first request with every id the client already has as
//! `resume_ids`: the driver reads prompt and those ids again and goes on, so the client's stream
//! continues with no gap and no repeat. The coordinator drives this core over gRPC
//! (`brigade-coordinator`'s `relay_session`); the worker's seeded fault tests drive the same core
//! against stage cores on a virtual network.

use crate::v1::{generate_event, DriveRequest, GenerateEvent};
use tonic::{Code, Status};

/// Resumptions of one session in a row, each without a new token, before it fails. A long
/// generation may be resumed any number of times as long as each attempt gets somewhere.
pub const MAX_RESUMES: u32 = 8;

/// One session's relay state.
#[derive(Debug, Clone)]
pub struct Relay {
    drive: DriveRequest,
    /// The ids streamed to the client by this relay (after the request's own `resume_ids`).
    sent: Vec<u32>,
    resumes: u32,
    /// Resumptions since the last new token.
    fruitless: u32,
}

/// What to do with an event of the driver's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Relayed {
    /// Send it to the client.
    Forward(GenerateEvent),
    /// Drop it: a resumed attempt's prompt ids, which the client has had.
    Skip,
    /// Send it to the client: it is the session's final event (its `generated_tokens` count every
    /// attempt's ids).
    Done(GenerateEvent),
}

/// What to do when the driver's stream fails.
#[derive(Debug, Clone)]
pub enum Failed {
    /// Resume: open this request on the deployment once it serves again.
    Resume(Box<DriveRequest>),
    /// The session ends with this error (the request's own fault, or too many resumptions).
    Fail(Status),
}

/// Whether a failure of the pipeline (not of the request) ended the driver's stream.
pub fn resumable(s: &Status) -> bool {
    !matches!(
        s.code(),
        Code::InvalidArgument
            | Code::NotFound
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::ResourceExhausted
            | Code::FailedPrecondition
    )
}

impl Relay {
    /// The relay of a session opened with `drive`.
    pub fn new(drive: DriveRequest) -> Self {
        Relay { drive, sent: Vec::new(), resumes: 0, fruitless: 0 }
    }

    /// The ids streamed to the client so far (over every attempt, after the request's own
    /// `resume_ids`).
    pub fn sent(&self) -> &[u32] {
        &self.sent
    }

    /// Resumptions so far, and of them those since the last new token.
    pub fn resumes(&self) -> (u32, u32) {
        (self.resumes, self.fruitless)
    }

    /// An event of the current attempt's stream.
    pub fn on_event(&mut self, mut ev: GenerateEvent) -> Relayed {
        match &mut ev.event {
            Some(generate_event::Event::Prompt(_)) if self.resumes > 0 => Relayed::Skip,
            Some(generate_event::Event::Token(t)) => {
                self.sent.push(t.id);
                self.fruitless = 0;
                Relayed::Forward(ev)
            }
            Some(generate_event::Event::Done(done)) => {
                if let Some(t) = &mut done.timings {
                    t.generated_tokens = u32::try_from(self.sent.len()).unwrap_or(u32::MAX);
                }
                Relayed::Done(ev)
            }
            _ => Relayed::Forward(ev),
        }
    }

    /// The current attempt's stream ended with `failure` (or without a final event: the caller
    /// says so with an `UNAVAILABLE` status).
    pub fn on_failure(&mut self, failure: Status) -> Failed {
        if !resumable(&failure) {
            return Failed::Fail(failure);
        }
        if self.fruitless >= MAX_RESUMES {
            return Failed::Fail(Status::new(
                failure.code(),
                format!(
                    "{} (the session was resumed {} times in a row without a new token)",
                    failure.message(),
                    self.fruitless
                ),
            ));
        }
        self.resumes += 1;
        self.fruitless += 1;
        let mut again = self.drive.clone();
        again.resume_ids.extend_from_slice(&self.sent);
        Failed::Resume(Box::new(again))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{Done, PromptIds, Timings, Token};

    fn token(id: u32) -> GenerateEvent {
        GenerateEvent { event: Some(generate_event::Event::Token(Token { id, ..Default::default() })) }
    }

    fn prompt() -> GenerateEvent {
        GenerateEvent { event: Some(generate_event::Event::Prompt(PromptIds { ids: vec![1, 2] })) }
    }

    #[test]
    fn a_resumed_session_asks_for_what_the_client_has_and_skips_its_prompt() {
        let first = DriveRequest { prompt_ids: vec![1, 2], resume_ids: vec![9], max_tokens: 6, ..Default::default() };
        let mut r = Relay::new(first.clone());
        assert_eq!(r.on_event(prompt()), Relayed::Forward(prompt()));
        assert_eq!(r.on_event(token(5)), Relayed::Forward(token(5)));
        r.on_event(token(6));
        let Failed::Resume(again) = r.on_failure(Status::unavailable("a stage died")) else { panic!() };
        assert_eq!(again.resume_ids, [9, 5, 6], "the request's own resumed ids, then those sent");
        assert_eq!(DriveRequest { resume_ids: first.resume_ids.clone(), ..(*again).clone() }, first);
        assert_eq!(r.on_event(prompt()), Relayed::Skip);
        r.on_event(token(7));
        let done = GenerateEvent {
            event: Some(generate_event::Event::Done(Done {
                timings: Some(Timings { generated_tokens: 1, ..Default::default() }),
                ..Default::default()
            })),
        };
        let Relayed::Done(ev) = r.on_event(done) else { panic!() };
        let Some(generate_event::Event::Done(d)) = ev.event else { panic!() };
        assert_eq!(d.timings.map(|t| t.generated_tokens), Some(3), "every attempt's ids count");
        assert_eq!(r.sent(), [5, 6, 7]);
    }

    #[test]
    fn the_requests_own_errors_end_it_and_fruitless_resumptions_are_bounded() {
        let mut r = Relay::new(DriveRequest::default());
        let bad = r.on_failure(Status::invalid_argument("the prompt is too long"));
        assert!(matches!(bad, Failed::Fail(s) if s.code() == Code::InvalidArgument));
        assert_eq!(r.resumes(), (0, 0));
        // resumptions that each got a token further go on for as long as it takes
        for id in 0..3 * MAX_RESUMES {
            assert!(matches!(r.on_failure(Status::aborted("re-placed")), Failed::Resume(_)));
            r.on_event(token(id));
        }
        for _ in 0..MAX_RESUMES {
            assert!(matches!(r.on_failure(Status::aborted("re-placed")), Failed::Resume(_)));
        }
        let Failed::Fail(s) = r.on_failure(Status::unavailable("a stage died")) else { panic!() };
        assert_eq!(s.code(), Code::Unavailable);
        assert!(s.message().contains("resumed 8 times in a row"), "{}", s.message());
        assert_eq!(r.resumes(), (4 * MAX_RESUMES, MAX_RESUMES));
    }
}
