//! A virtual network between numbered endpoints: every message is delivered at a tick of the
//! virtual clock chosen by a seeded generator — late, out of order, twice, or never — and cut
//! links (a partition) drop everything. Nothing here knows what the messages mean.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};

/// How the links misbehave now (the schedule changes it as it goes).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weather {
    /// The chance a message is lost.
    pub drop: f64,
    /// The chance a message arrives twice.
    pub duplicate: f64,
    /// A message arrives 0..=`max_delay` ticks after it was sent (uniformly), so later ones
    /// overtake earlier ones.
    pub max_delay: u64,
}

impl Weather {
    /// Every message arrives, in order, at the next tick.
    pub const CALM: Weather = Weather { drop: 0.0, duplicate: 0.0, max_delay: 0 };
}

/// One message in flight.
#[derive(Debug, Clone)]
pub struct Envelope<M> {
    pub from: u64,
    pub to: u64,
    pub message: M,
}

/// The network: what is in flight, and which directed links are cut.
pub struct Net<M> {
    /// (delivery tick, sequence number) → message: the sequence number keeps delivery order
    /// within a tick deterministic.
    flight: BTreeMap<(u64, u64), Envelope<M>>,
    seq: u64,
    cut: BTreeSet<(u64, u64)>,
    pub weather: Weather,
    /// Messages sent, lost (dropped or cut) and duplicated so far.
    pub sent: u64,
    pub lost: u64,
    pub duplicated: u64,
}

impl<M: Clone> Default for Net<M> {
    fn default() -> Self {
        Net {
            flight: BTreeMap::new(),
            seq: 0,
            cut: BTreeSet::new(),
            weather: Weather::CALM,
            sent: 0,
            lost: 0,
            duplicated: 0,
        }
    }
}

impl<M: Clone> Net<M> {
    /// Sends `message` at tick `now`; it arrives at `now + 1` at the earliest.
    pub fn send(&mut self, rng: &mut ChaCha8Rng, now: u64, from: u64, to: u64, message: M) {
        self.sent += 1;
        if self.cut.contains(&(from, to)) || rng.random_bool(self.weather.drop) {
            self.lost += 1;
            return;
        }
        let copies = if rng.random_bool(self.weather.duplicate) { 2 } else { 1 };
        self.duplicated += copies - 1;
        for _ in 0..copies {
            let at = now + 1 + rng.random_range(0..=self.weather.max_delay);
            self.seq += 1;
            self.flight.insert((at, self.seq), Envelope { from, to, message: message.clone() });
        }
    }

    /// The messages due at or before `now`, in delivery order (a cut made while one was in
    /// flight drops it too).
    pub fn due(&mut self, now: u64) -> Vec<Envelope<M>> {
        let later = self.flight.split_off(&(now + 1, 0));
        let due = std::mem::replace(&mut self.flight, later);
        let mut out = Vec::with_capacity(due.len());
        for (_, e) in due {
            if self.cut.contains(&(e.from, e.to)) {
                self.lost += 1;
            } else {
                out.push(e);
            }
        }
        out
    }

    /// Cuts every link between different sides (both directions); links within a side stay.
    pub fn partition(&mut self, sides: &[Vec<u64>]) {
        self.cut.clear();
        for (i, a) in sides.iter().enumerate() {
            for (j, b) in sides.iter().enumerate() {
                if i != j {
                    for x in a {
                        for y in b {
                            self.cut.insert((*x, *y));
                        }
                    }
                }
            }
        }
    }

    /// Cuts the one link `from → to` (the other direction stays).
    pub fn cut_one_way(&mut self, from: u64, to: u64) {
        self.cut.insert((from, to));
    }

    /// Every link works again.
    pub fn heal(&mut self) {
        self.cut.clear();
    }

    pub fn is_cut(&self, from: u64, to: u64) -> bool {
        self.cut.contains(&(from, to))
    }

    /// Messages in flight.
    pub fn in_flight(&self) -> usize {
        self.flight.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn calm_weather_delivers_everything_in_order_at_the_next_tick() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut net = Net::default();
        for i in 0..5u32 {
            net.send(&mut rng, 10, 1, 2, i);
        }
        assert!(net.due(10).is_empty(), "nothing arrives in the tick it was sent");
        let got: Vec<u32> = net.due(11).into_iter().map(|e| e.message).collect();
        assert_eq!(got, [0, 1, 2, 3, 4]);
        assert_eq!(net.in_flight(), 0);
    }

    #[test]
    fn a_partition_drops_across_sides_only_and_heals() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let mut net = Net::default();
        net.partition(&[vec![1, 2], vec![3]]);
        net.send(&mut rng, 0, 1, 2, "same side");
        net.send(&mut rng, 0, 1, 3, "across");
        net.send(&mut rng, 0, 3, 2, "across back");
        net.cut_one_way(2, 1);
        net.send(&mut rng, 0, 2, 1, "one way");
        let got: Vec<&str> = net.due(1).into_iter().map(|e| e.message).collect();
        assert_eq!(got, ["same side"]);
        assert_eq!(net.lost, 3);
        net.heal();
        net.send(&mut rng, 1, 1, 3, "healed");
        assert_eq!(net.due(2).len(), 1);
    }

    #[test]
    fn stormy_weather_loses_duplicates_and_reorders_reproducibly() {
        let run = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let mut net = Net { weather: Weather { drop: 0.2, duplicate: 0.2, max_delay: 5 }, ..Net::default() };
            for i in 0..200u32 {
                net.send(&mut rng, 0, 1, 2, i);
            }
            let got: Vec<u32> = net.due(100).into_iter().map(|e| e.message).collect();
            (got, net.lost, net.duplicated)
        };
        let (got, lost, dup) = run(3);
        assert!(lost > 10 && dup > 10, "lost {lost}, duplicated {dup} of 200");
        assert_eq!(got.len() as u64, 200 - lost + dup);
        assert!(got.windows(2).any(|w| w[0] > w[1]), "nothing was reordered");
        assert_eq!(run(3).0, got, "the same seed gives the same deliveries");
        assert_ne!(run(4).0, got);
    }
}
