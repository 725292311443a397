//! `brigade bench --url URL`: aggregate generation speed and time to first token of a running
//! OpenAI-compatible server (brigade's or llama.cpp's `llama-server`), at several concurrency
//! levels: each client streams one completion of `-n` tokens after a distinct ~60-word prompt.
//! `--long-prompt N` adds the test of one N-token prompt arriving among `c - 1` decoding
//! streams (its time to first token, and the others' longest wait between two tokens).
//!
//! The HTTP client is hyper's (HTTP/1.1, one connection per request, as the official clients
//! make them under concurrency); the table is the one of `bench --coordinator`.

use crate::cluster::runtime;
use anyhow::{bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use serde::Serialize;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

#[derive(Args, Debug, Default)]
pub struct HttpArgs {
    /// Benchmark a running OpenAI-compatible server at this base URL (`-m` names the model;
    /// default: the first it lists).
    #[arg(long = "url")]
    pub url: Option<String>,
    /// With --url: also time one prompt of this many tokens arriving among decoding streams.
    #[arg(long = "long-prompt", default_value_t = 0)]
    pub long_prompt: usize,
}

pub struct HttpBench {
    pub url: String,
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub n_gen: usize,
    pub reps: usize,
    pub concurrency: Vec<usize>,
    pub long_prompt: usize,
    pub json: bool,
}

#[derive(Serialize, Clone)]
struct Row {
    test: String,
    concurrency: usize,
    avg_ts: f64,
    samples_ts: Vec<f64>,
    ttft_p50_ms: f64,
    ttft_p95_ms: f64,
    /// Long-prompt test: the decoding streams' longest pause between two tokens, ms (p95 over them).
    #[serde(skip_serializing_if = "Option::is_none")]
    others_gap_p95_ms: Option<f64>,
}

/// `host:port` and path prefix of a base URL like `http://127.0.0.1:8080` (plain HTTP only).
fn split_url(url: &str) -> Result<(String, String)> {
    let rest = url.strip_prefix("http://").context("--url: an http:// URL (put TLS in a proxy)")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, String::new()));
    let host = if host.contains(':') { host.to_string() } else { format!("{host}:80") };
    Ok((host, path.trim_end_matches('/').to_string()))
}

struct Target {
    host: String,
    prefix: String,
    key: Option<String>,
}

impl Target {
    /// Sends one request on a fresh connection; returns the response, the body left to read.
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> Result<hyper::Response<hyper::body::Incoming>> {
        let tcp =
            tokio::net::TcpStream::connect(&self.host).await.with_context(|| format!("connecting {}", self.host))?;
        tcp.set_nodelay(true)?;
        let (mut tx, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await?;
        tokio::spawn(conn);
        let mut req = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.prefix))
            .header("host", &self.host)
            .header("content-type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
        let resp = tx.send_request(req.body(Full::new(body))?).await?;
        if !resp.status().is_success() {
            let status = resp.status();
            let text = resp.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
            bail!("{method} {path}: {status}: {}", String::from_utf8_lossy(&text));
        }
        Ok(resp)
    }

    async fn first_model(&self) -> Result<String> {
        let body = self.send("GET", "/v1/models", None).await?.into_body().collect().await?.to_bytes();
        let j: Value = serde_json::from_slice(&body)?;
        j["data"][0]["id"].as_str().map(str::to_string).context("the server lists no model")
    }
}

/// One streamed completion: (seconds to the first token, generated tokens, arrival times).
async fn stream(t: &Target, model: &str, prompt: Value, n: usize) -> Result<(f64, usize, Vec<f64>)> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true,
                      "ignore_eos": true, "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let mut resp = t.send("POST", "/v1/completions", Some(body)).await?.into_body();
    let mut buf = Vec::new();
    let mut arrivals = Vec::new();
    let mut usage = None;
    while let Some(frame) = resp.frame().await {
        let Ok(data) = frame?.into_data() else { continue };
        buf.extend_from_slice(&data);
        // complete SSE lines only
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let Some(d) = std::str::from_utf8(&line).ok().and_then(|l| l.trim_end().strip_prefix("data: ")) else {
                continue;
            };
            if d == "[DONE]" {
                break;
            }
            let j: Value = serde_json::from_str(d).with_context(|| format!("a stream chunk: {d}"))?;
            if let Some(n) = j["usage"]["completion_tokens"].as_u64() {
                usage = Some(n as usize);
            }
            if j["choices"][0]["text"].as_str().is_some_and(|s| !s.is_empty()) {
                arrivals.push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let ttft = *arrivals.first().context("the stream carried no text")?;
    Ok((ttft, usage.unwrap_or(arrivals.len()), arrivals))
}

const WORDS: &[&str] = &[
    "the", "river", "winter", "quiet", "garden", "machine", "silver", "morning", "lantern", "harbor", "forest",
    "engine", "paper", "mountain", "signal", "window", "orchard", "copper", "thunder", "meadow", "violet", "station",
    "ember", "canyon",
];

/// A distinct prompt of `words` words for client `k`.
fn words_prompt(words: usize, k: usize) -> String {
    (0..words).map(|i| WORDS[(i * 7 + k * 13 + i * i * k) % WORDS.len()]).collect::<Vec<_>>().join(" ")
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn level(t: &std::sync::Arc<Target>, model: &str, c: usize, n: usize, rep: usize) -> Result<(f64, Vec<f64>)> {
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|k| {
            let (t, m) = (t.clone(), model.to_string());
            // distinct for every client, repetition and level: a server that caches prompts
            // (llama-server keeps each slot's last prompt) gets no head start from earlier ones
            let p = json!(words_prompt(60, c * 1009 + rep * 131 + k + 1));
            tokio::spawn(async move { stream(&t, &m, p, n).await })
        })
        .collect();
    let (mut tokens, mut ttfts) = (0, Vec::new());
    for task in tasks {
        let (ttft, got, _) = task.await??;
        tokens += got;
        ttfts.push(ttft * 1e3);
    }
    Ok((tokens as f64 / t0.elapsed().as_secs_f64(), ttfts))
}

/// `c - 1` streams decoding, then one prompt of `len` token ids: its TTFT, and the others'
/// longest gaps between tokens.
async fn long_prompt(
    t: &std::sync::Arc<Target>,
    model: &str,
    c: usize,
    len: usize,
    n: usize,
) -> Result<(f64, Vec<f64>)> {
    let others: Vec<_> = (0..c.saturating_sub(1))
        .map(|k| {
            let (t, m) = (t.clone(), model.to_string());
            let p = json!(words_prompt(60, 1000 + k));
            tokio::spawn(async move { stream(&t, &m, p, n).await })
        })
        .collect();
    // let the others get going first
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: Vec<u32> = (0..len).map(|i| 100 + ((i * 7919) % 20000) as u32).collect();
    let (ttft, _, _) = stream(t, model, json!(ids), 4).await?;
    let mut gaps = Vec::new();
    for o in others {
        let (_, _, arrivals) = o.await??;
        let gap = arrivals.windows(2).map(|w| w[1] - w[0]).fold(0.0, f64::max);
        gaps.push(gap * 1e3);
    }
    Ok((ttft * 1e3, gaps))
}

pub fn bench(b: HttpBench) -> Result<()> {
    let (host, prefix) = split_url(&b.url)?;
    let target = std::sync::Arc::new(Target { host, prefix, key: b.api_key.clone() });
    let rt = runtime()?;
    let rows = rt.block_on(async {
        let model = match &b.model {
            Some(m) => m.clone(),
            None => target.first_model().await?,
        };
        // warm-up: a connection made, the server's first request served
        stream(&target, &model, json!(words_prompt(8, 0)), 2).await?;
        let mut rows = Vec::new();
        for &c in &b.concurrency {
            let (mut samples, mut ttfts) = (Vec::new(), Vec::new());
            for r in 0..b.reps {
                let (ts, mut tt) = level(&target, &model, c, b.n_gen, r).await?;
                samples.push(ts);
                ttfts.append(&mut tt);
            }
            rows.push(Row {
                test: format!("tg{}", b.n_gen),
                concurrency: c,
                avg_ts: samples.iter().sum::<f64>() / samples.len() as f64,
                samples_ts: samples,
                ttft_p50_ms: pct(&mut ttfts.clone(), 0.5),
                ttft_p95_ms: pct(&mut ttfts, 0.95),
                others_gap_p95_ms: None,
            });
        }
        if b.long_prompt > 0 {
            let c = b.concurrency.iter().copied().max().unwrap_or(1).max(2);
            let (mut ttfts, mut gaps) = (Vec::new(), Vec::new());
            for _ in 0..b.reps {
                let (ttft, mut g) = long_prompt(&target, &model, c, b.long_prompt, b.n_gen.max(64)).await?;
                ttfts.push(ttft);
                gaps.append(&mut g);
            }
            rows.push(Row {
                test: format!("pp{} among {} streams", b.long_prompt, c - 1),
                concurrency: c,
                avg_ts: 0.0,
                samples_ts: Vec::new(),
                ttft_p50_ms: pct(&mut ttfts.clone(), 0.5),
                ttft_p95_ms: pct(&mut ttfts, 0.95),
                others_gap_p95_ms: Some(pct(&mut gaps, 0.95)),
            });
        }
        anyhow::Ok((model, rows))
    });
    let (model, rows) = rows?;
    if b.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let table = rows.iter().map(|r| (r.test.as_str(), r.concurrency, &r.samples_ts[..], r.ttft_p50_ms, r.ttft_p95_ms));
    crate::cluster_bench::print_table(&model, table);
    if let Some(r) = rows.iter().find(|r| r.others_gap_p95_ms.is_some()) {
        println!(
            "\nwhile the {} ran, the decoding streams' longest pause between two tokens: p95 {:.1} ms",
            r.test,
            r.others_gap_p95_ms.unwrap_or_default()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_prompts() {
        assert_eq!(split_url("http://127.0.0.1:8080").unwrap(), ("127.0.0.1:8080".into(), String::new()));
        assert_eq!(split_url("http://h/api/").unwrap(), ("h:80".into(), "/api".into()));
        assert!(split_url("https://h").is_err());
        let (a, b) = (words_prompt(60, 1), words_prompt(60, 2));
        assert_ne!(a, b);
        assert_eq!(a.split(' ').count(), 60);
    }
}
