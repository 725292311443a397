//! Link measurement over a [`Link`]: latency and clock offset from PING/PONG round trips,
//! bandwidth from a burst of BULK frames. The answering side is [`Responder`], a pure function
//! of the frame and the time; [`measure`] drives the asking side and owns the clock.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use brigade_proto::v1::{FrameKind, StageTrace};
use bytes::Bytes;

use crate::error::{Result, TransportError};
use crate::frame::{Frame, FLAG_LAST};
use crate::link::Link;

/// Round trips measured for latency and clock offset.
pub const PINGS: u64 = 20;
/// Bytes per BULK frame.
pub const BULK_CHUNK: usize = 1 << 20;
/// The bandwidth burst stops after this long or [`BULK_BYTES`], whichever comes first.
pub const BULK_TIME: Duration = Duration::from_millis(100);
/// Bytes of the first bulk round.
pub const BULK_FIRST_ROUND: u64 = 64 << 10;
/// Rounds of the final size: the figure is the fastest of them. One round is one sample, and a
/// stall anywhere on its path (the measuring process descheduled on a busy machine, a
/// retransmission) lowers it as if the link were slow: a veth link once measured 2.67 MB/s
/// beside links of 320–344 MB/s on a 2-core CI machine. A stall rarely hits two rounds in a
/// row; a slow link is slow in both.
pub const BULK_FINAL_ROUNDS: usize = 2;
pub const BULK_BYTES: u64 = 64 << 20;
/// The longest wait for one answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`measure`] found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkFigures {
    /// One-way latency: the median round trip over two, seconds.
    pub latency_s: f64,
    /// Throughput of the bulk burst, bytes per second (as `LinkFigures.bandwidth` on the wire).
    pub bandwidth_bps: f64,
    /// The peer's clock minus this node's, microseconds (NTP's estimate from the ping with the
    /// shortest round trip).
    pub clock_offset_us: i64,
}

/// Microseconds since the unix epoch by this machine's clock (0 if the clock is before 1970).
pub fn unix_now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)).unwrap_or(0)
}

/// The answering side of a probe. Feed it every frame the link delivers; send what it returns.
#[derive(Debug, Default)]
pub struct Responder {
    bulk_bytes: u64,
}

impl Responder {
    /// PING → PONG with the same step and this clock's time (`trace[0]`, received = sent =
    /// `now_us`); BULK → counted, and the one with [`FLAG_LAST`] → PONG with [`FLAG_LAST`] and
    /// the bytes counted in `step`. Other frames: `None`.
    pub fn respond(&mut self, frame: &Frame, now_us: u64) -> Option<Frame> {
        match frame.kind()? {
            FrameKind::Ping => Some(Frame::pong(frame.header.step).with_trace(StageTrace {
                stage: 0,
                received_us: now_us,
                sent_us: now_us,
                compute_us: 0,
            })),
            FrameKind::Bulk => {
                self.bulk_bytes = self.bulk_bytes.saturating_add(frame.payload.len() as u64);
                frame.has_flag(FLAG_LAST).then(|| {
                    let counted = std::mem::take(&mut self.bulk_bytes);
                    Frame::pong(counted).with_flags(FLAG_LAST)
                })
            }
            _ => None,
        }
    }
}

/// Measures a link whose peer answers with a [`Responder`]. The link must carry nothing else
/// meanwhile.
pub async fn measure(link: &mut Link) -> Result<LinkFigures> {
    let mut rtts = Vec::with_capacity(PINGS as usize);
    let mut best: Option<(Duration, i64)> = None;
    for step in 0..PINGS {
        let t0 = unix_now_us();
        let sent = Instant::now();
        link.send(Frame::ping(step)).await?;
        let pong = answer(link).await?;
        let rtt = sent.elapsed();
        let t3 = unix_now_us();
        if pong.header.step != step {
            return Err(TransportError::Probe(format!("pong for step {} while waiting for {step}", pong.header.step)));
        }
        let trace =
            pong.header.trace.first().ok_or_else(|| TransportError::Probe(format!("pong {step} carries no time")))?;
        // NTP: ((t1 - t0) + (t2 - t3)) / 2, in i128 so no clock value overflows
        let offset =
            ((i128::from(trace.received_us) - i128::from(t0)) + (i128::from(trace.sent_us) - i128::from(t3))) / 2;
        let offset = i64::try_from(offset).unwrap_or(if offset < 0 { i64::MIN } else { i64::MAX });
        if best.is_none_or(|(b, _)| rtt < b) {
            best = Some((rtt, offset));
        }
        rtts.push(rtt);
    }
    rtts.sort();
    let median = rtts.get(rtts.len() / 2).copied().unwrap_or_default();

    // Bulk rounds of growing size, each answered before the next starts: the bytes in flight
    // never exceed one round, so a slow link is not flooded (a single burst timed by the sender
    // would fill every buffer on the way and then wait for them to drain).
    let mut bulk = Bulk { chunk: Bytes::from(vec![0u8; BULK_CHUNK]), rtt: median.as_secs_f64(), step: 0 };
    let mut size = BULK_FIRST_ROUND;
    let mut total: u64 = 0;
    let mut bandwidth = loop {
        let (bandwidth, elapsed) = bulk.round(link, size).await?;
        total += size;
        if elapsed >= BULK_TIME.as_secs_f64() || total + size * 4 > BULK_BYTES {
            break bandwidth;
        }
        // aim the next round at about the target time
        let scale = (BULK_TIME.as_secs_f64() * 1.5 / elapsed.max(1e-6)).clamp(2.0, 16.0);
        size = ((size as f64 * scale) as u64).min(BULK_BYTES - total);
    };
    // the final size again, within the byte budget: the fastest round is the link's figure
    for _ in 1..BULK_FINAL_ROUNDS {
        if total + size > BULK_BYTES {
            break;
        }
        bandwidth = bandwidth.max(bulk.round(link, size).await?.0);
        total += size;
    }
    Ok(LinkFigures {
        latency_s: median.as_secs_f64() / 2.0,
        bandwidth_bps: bandwidth,
        clock_offset_us: best.map(|(_, offset)| offset).unwrap_or(0),
    })
}

/// The asking side's state across bulk rounds.
struct Bulk {
    chunk: Bytes,
    /// The median round trip, seconds.
    rtt: f64,
    /// The next BULK frame's step.
    step: u64,
}

impl Bulk {
    /// Sends `size` bytes of BULK frames, the last flagged, and waits for the peer's count:
    /// returns the round's throughput (bytes per second, less the answer's trip back, a round
    /// trip that carried no data) and its seconds.
    async fn round(&mut self, link: &mut Link, size: u64) -> Result<(f64, f64)> {
        let start = Instant::now();
        let mut sent: u64 = 0;
        while sent < size {
            let n = (size - sent).min(BULK_CHUNK as u64);
            let last = sent + n >= size;
            link.send(Frame::bulk(self.step, self.chunk.slice(..n as usize), last)).await?;
            sent += n;
            self.step += 1;
        }
        let pong = answer(link).await?;
        let elapsed = start.elapsed().as_secs_f64();
        if !pong.has_flag(FLAG_LAST) || pong.header.step != sent {
            return Err(TransportError::Probe(format!("peer counted {} bulk bytes of {sent} sent", pong.header.step)));
        }
        Ok((sent as f64 / (elapsed - self.rtt).max(elapsed / 2.0).max(1e-9), elapsed))
    }
}

async fn answer(link: &mut Link) -> Result<Frame> {
    let frame = link.recv_within(ANSWER_TIMEOUT, "a probe answer").await?;
    if frame.kind() == Some(FrameKind::Pong) {
        Ok(frame)
    } else {
        Err(TransportError::UnexpectedFrame {
            peer: link.peer.clone(),
            expected: "PONG",
            got: format!("kind {}", frame.header.kind),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn responder_answers_pings_and_counts_bulk() {
        let mut responder = Responder::default();
        let pong = responder.respond(&Frame::ping(7), 1_000);
        assert!(pong.as_ref().is_some_and(|p| p.kind() == Some(FrameKind::Pong)
            && p.header.step == 7
            && p.header.trace.first().is_some_and(|t| t.received_us == 1_000)));
        let chunk = Bytes::from_static(&[0; 10]);
        assert_eq!(responder.respond(&Frame::bulk(0, chunk.clone(), false), 0), None);
        let done = responder.respond(&Frame::bulk(1, chunk, true), 0);
        assert!(done.is_some_and(|p| p.header.step == 20 && p.has_flag(FLAG_LAST)));
        assert_eq!(responder.respond(&Frame::close(), 0), None);
    }

    #[tokio::test]
    async fn measure_over_an_in_memory_pair() {
        let (mut a, mut b) = Link::pair("a", "b");
        let echo = tokio::spawn(async move {
            let mut responder = Responder::default();
            while let Some(frame) = b.recv().await {
                if let Some(reply) = responder.respond(&frame, unix_now_us()) {
                    if b.send(reply).await.is_err() {
                        break;
                    }
                }
            }
        });
        let figures = tokio::time::timeout(Duration::from_secs(30), measure(&mut a)).await;
        let Ok(Ok(figures)) = figures else {
            panic!("measure failed: {figures:?}");
        };
        assert!(figures.latency_s >= 0.0 && figures.latency_s < 0.1, "{figures:?}");
        assert!(figures.bandwidth_bps > 1e6, "{figures:?}");
        // one clock: the offset is within the round trip
        assert!(figures.clock_offset_us.abs() < 100_000, "{figures:?}");
        drop(a);
        assert!(tokio::time::timeout(Duration::from_secs(5), echo).await.is_ok());
    }

    /// A stall in one round (the peer answers the first round of 16 MiB or more 400 ms late, as
    /// a descheduled process would) does not make the figure: the round after it at the same
    /// size does.
    #[tokio::test]
    async fn one_stalled_round_does_not_make_the_figure() {
        let (mut a, mut b) = Link::pair("a", "b");
        let echo = tokio::spawn(async move {
            let (mut responder, mut stalled) = (Responder::default(), false);
            while let Some(frame) = b.recv().await {
                if let Some(reply) = responder.respond(&frame, unix_now_us()) {
                    if reply.has_flag(FLAG_LAST) && reply.header.step >= 16 << 20 && !stalled {
                        stalled = true;
                        tokio::time::sleep(Duration::from_millis(400)).await;
                    }
                    if b.send(reply).await.is_err() {
                        break;
                    }
                }
            }
            stalled
        });
        let figures = tokio::time::timeout(Duration::from_secs(30), measure(&mut a)).await;
        let Ok(Ok(figures)) = figures else {
            panic!("measure failed: {figures:?}");
        };
        drop(a);
        let stalled = tokio::time::timeout(Duration::from_secs(5), echo).await.unwrap().unwrap();
        assert!(stalled, "no round reached 16 MiB: the test stalled nothing");
        // the stalled round alone: at most 16 MiB / 0.4 s = 42 MB/s
        assert!(figures.bandwidth_bps > 100e6, "{figures:?}");
    }
}
