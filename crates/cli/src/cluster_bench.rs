//! `brigade bench --coordinator ADDR -m DEPLOYMENT`: prompt and generation speed of a deployed
//! model, measured end to end through the cluster, with the per-token split of compute per stage
//! and transfer per hop (as distributed-llama prints it), and aggregate throughput at several
//! concurrency levels.

use crate::cluster::{runtime, Connect};
use anyhow::{bail, Result};
use brigade_sdk::{Event, GenerateParams, Timings};
use serde::Serialize;
use std::time::Instant;

#[derive(Serialize, Clone)]
pub struct HopRow {
    pub stage: u32,
    pub node: String,
    pub device: String,
    pub compute_ms: f64,
    pub transfer_ms: f64,
}

#[derive(Serialize, Clone)]
pub struct ClusterRow {
    pub test: String,
    pub concurrency: usize,
    pub avg_ts: f64,
    pub samples_ts: Vec<f64>,
    /// Time to first token over the requests of the test: median and 95th percentile, ms.
    pub ttft_p50_ms: f64,
    pub ttft_p95_ms: f64,
    pub hops: Vec<HopRow>,
}

/// Prompt ids every vocabulary has (llama's byte tokens start at 3; BPE vocabularies are larger).
fn prompt_ids(n: usize, salt: usize) -> Vec<u32> {
    (0..n).map(|i| 3 + ((i * 7 + salt * 13) % 250) as u32).collect()
}

async fn one(c: &Connect, model: &str, prompt: Vec<u32>, max_tokens: u32) -> Result<(Timings, f64)> {
    let mut client = c.client().await?;
    let t0 = Instant::now();
    let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(max_tokens) };
    let mut s = client.generate_ids(model, &prompt, params).await?;
    let mut ttft = None;
    while let Some(ev) = s.next().await {
        match ev? {
            Event::Token { .. } if ttft.is_none() => ttft = Some(t0.elapsed().as_secs_f64()),
            Event::Done(d) => return Ok((d.timings.unwrap_or_default(), ttft.unwrap_or_default())),
            _ => {}
        }
    }
    bail!("the stream ended without timings")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub struct ClusterBench {
    pub connect: Connect,
    pub model: String,
    pub n_prompt: Vec<usize>,
    pub n_gen: Vec<usize>,
    pub reps: usize,
    pub concurrency: Vec<usize>,
    pub json: bool,
}

pub fn bench(b: ClusterBench) -> Result<()> {
    let rt = runtime()?;
    let rows = rt.block_on(async {
        let mut rows = Vec::new();
        // a warm-up: connections made, caches touched
        one(&b.connect, &b.model, prompt_ids(8, 0), 2).await?;
        for &conc in &b.concurrency {
            let tests = b.n_prompt.iter().filter(|&&p| p > 0).map(|&p| (format!("pp{p}"), p, 1usize));
            let tests = tests.chain(b.n_gen.iter().filter(|&&n| n > 0).map(|&n| (format!("tg{n}"), 4, n)));
            for (test, p, n) in tests.collect::<Vec<_>>() {
                let pp = test.starts_with("pp");
                let mut samples = Vec::new();
                let mut ttfts = Vec::new();
                let mut hops: Vec<HopRow> = Vec::new();
                for r in 0..b.reps {
                    let t0 = Instant::now();
                    let tasks: Vec<_> = (0..conc)
                        .map(|k| {
                            let c = b.connect.clone();
                            let m = b.model.clone();
                            tokio::spawn(async move { one(&c, &m, prompt_ids(p, r * 31 + k), n as u32).await })
                        })
                        .collect();
                    let mut counted = 0usize;
                    let mut decode = Vec::new();
                    for t in tasks {
                        let (tm, ttft) = t.await??;
                        counted += if pp { tm.prompt_tokens } else { tm.generated_tokens } as usize;
                        ttfts.push(ttft * 1e3);
                        decode.push(tm.generate_tokens_per_s);
                        if hops.is_empty() && !pp {
                            hops = tm
                                .hops
                                .iter()
                                .map(|h| HopRow {
                                    stage: h.stage,
                                    node: h.node.clone(),
                                    device: h.device.clone(),
                                    compute_ms: h.compute_s * 1e3,
                                    transfer_ms: h.transfer_s * 1e3,
                                })
                                .collect();
                        }
                    }
                    // tg of one stream: its own decode rate (the prompt excluded, as llama-bench's
                    // tg); otherwise every token counted over the wall time
                    let wall = counted as f64 / t0.elapsed().as_secs_f64();
                    samples.push(if !pp && conc == 1 { decode[0] } else { wall });
                }
                let avg = samples.iter().sum::<f64>() / samples.len() as f64;
                rows.push(ClusterRow {
                    test,
                    concurrency: conc,
                    avg_ts: avg,
                    samples_ts: samples,
                    ttft_p50_ms: pct(&mut ttfts.clone(), 0.5),
                    ttft_p95_ms: pct(&mut ttfts, 0.95),
                    hops,
                });
            }
        }
        anyhow::Ok(rows)
    })?;
    if b.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    print_table(
        &b.model,
        rows.iter().map(|r| (r.test.as_str(), r.concurrency, &r.samples_ts[..], r.ttft_p50_ms, r.ttft_p95_ms)),
    );
    if let Some(r) = rows.iter().find(|r| !r.hops.is_empty() && r.concurrency == 1) {
        println!("\nper decoded token ({}):", r.test);
        for h in &r.hops {
            println!(
                "  stage {} {}/{}: compute {:.3} ms, transfer to next {:.3} ms",
                h.stage, h.node, h.device, h.compute_ms, h.transfer_ms
            );
        }
    }
    Ok(())
}

/// The table of concurrency benchmarks (also `bench --url`'s): per row the test, clients, the
/// samples of aggregate tokens/s (none: "-"), TTFT p50 and p95 in ms.
pub fn print_table<'a>(name: &str, rows: impl Iterator<Item = (&'a str, usize, &'a [f64], f64, f64)>) {
    println!("| deployment | test | clients | t/s | TTFT p50 ms | TTFT p95 ms |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    for (test, clients, samples, p50, p95) in rows {
        let ts = if samples.is_empty() {
            "-".to_string()
        } else {
            format!("{:.2} ± {:.2}", samples.iter().sum::<f64>() / samples.len() as f64, stddev(samples))
        };
        println!("| {name} | {test} | {clients} | {ts} | {p50:.1} | {p95:.1} |");
    }
}

fn stddev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = v.iter().sum::<f64>() / v.len() as f64;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}
