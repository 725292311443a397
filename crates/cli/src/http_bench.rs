//! `brigade bench --url URL`: aggregate generation speed and time to first token of a running
//! OpenAI-compatible server (brigade's or llama.cpp's `llama-server`), at several concurrency
//! levels: each client streams one completion of `-n` tokens after a distinct ~60-word prompt
//! (`--prompt-words`), or after a distinct prompt of `--prompt-tokens N` token ids: the same
//! length on every tokenizer (a synthetic model's vocabulary splits those 60 words into ~240
//! tokens where a real one, SmolLM2's, gives 60). The table's note gives the prompts' length in
//! tokens as the server counted them (`usage.prompt_tokens`).
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
    /// Concurrency tests: each client's prompt is this many words, distinct per client (default 60).
    #[arg(long = "prompt-words", value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub prompt_words: Option<u32>,
    /// Concurrency tests: each client's prompt is this many token ids instead (distinct per
    /// client, inside the vocabulary the server's /v1/models gives as `meta.n_vocab`).
    #[arg(long = "prompt-tokens", conflicts_with = "prompt_words",
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub prompt_tokens: Option<u32>,
}

impl HttpArgs {
    /// The prompt the flags ask for.
    pub fn prompt(&self) -> Prompt {
        match self.prompt_tokens {
            Some(n) => Prompt::Tokens(n as usize),
            None => Prompt::Words(self.prompt_words.unwrap_or(60) as usize),
        }
    }

    /// Whether a flag of the HTTP concurrency tests was given (they need `--url` or a served
    /// model file).
    pub fn asked(&self) -> Option<&'static str> {
        if self.prompt_tokens.is_some() {
            Some("--prompt-tokens")
        } else if self.prompt_words.is_some() {
            Some("--prompt-words")
        } else if self.long_prompt > 0 {
            Some("--long-prompt")
        } else {
            None
        }
    }
}

/// Each client's prompt in the concurrency tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Prompt {
    Words(usize),
    Tokens(usize),
}

pub struct HttpBench {
    pub url: String,
    pub model: Option<String>,
    pub api_key: Option<String>,
    pub n_gen: usize,
    pub reps: usize,
    pub concurrency: Vec<usize>,
    pub long_prompt: usize,
    pub prompt: Prompt,
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
    /// The clients' prompts in tokens, as the server counted them (mean; absent where the
    /// server gave no `usage.prompt_tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_tokens_avg: Option<f64>,
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

    /// The model named `want` (or the first listed) and its vocabulary size where the server
    /// gives it (`meta.n_vocab`, as llama-server and brigade do).
    async fn model(&self, want: Option<&str>) -> Result<(String, Option<usize>)> {
        let listing = async {
            let body = self.send("GET", "/v1/models", None).await?.into_body().collect().await?.to_bytes();
            anyhow::Ok(serde_json::from_slice::<Value>(&body)?)
        };
        let j = match (listing.await, want) {
            (Ok(j), _) => j,
            // a named model needs no listing (only --prompt-tokens needs its vocabulary)
            (Err(_), Some(w)) => return Ok((w.to_string(), None)),
            (Err(e), None) => return Err(e.context("listing the server's models (or name one with -m)")),
        };
        let listed = j["data"].as_array().cloned().unwrap_or_default();
        let card = match want {
            Some(w) => listed.iter().find(|m| m["id"].as_str() == Some(w)),
            None => listed.first(),
        };
        let Some(card) = card else {
            return match want {
                // a server may answer for names it does not list
                Some(w) => Ok((w.to_string(), None)),
                None => bail!("the server lists no model"),
            };
        };
        let id = card["id"].as_str().context("a model without an id in /v1/models")?.to_string();
        // a vocabulary brigade can draw u32 ids from, with room for its middle three quarters
        let vocab =
            card["meta"]["n_vocab"].as_u64().filter(|v| (16..=u64::from(u32::MAX)).contains(v)).map(|v| v as usize);
        Ok((id, vocab))
    }
}

/// One streamed completion as the client saw it.
struct Streamed {
    /// Seconds to the first token.
    ttft: f64,
    /// Generated tokens.
    tokens: usize,
    /// Seconds from the request to each chunk with text.
    arrivals: Vec<f64>,
    /// The prompt's tokens, as the server counted them.
    prompt_tokens: Option<usize>,
}

async fn stream(t: &Target, model: &str, prompt: Value, n: usize) -> Result<Streamed> {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": true,
                      "ignore_eos": true, "stream_options": {"include_usage": true}});
    let t0 = Instant::now();
    let mut resp = t.send("POST", "/v1/completions", Some(body)).await?.into_body();
    let mut buf = Vec::new();
    let mut arrivals = Vec::new();
    let (mut usage, mut prompt_tokens) = (None, None);
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
            if let Some(n) = j["usage"]["prompt_tokens"].as_u64() {
                prompt_tokens = Some(n as usize);
            }
            if j["choices"][0]["text"].as_str().is_some_and(|s| !s.is_empty()) {
                arrivals.push(t0.elapsed().as_secs_f64());
            }
        }
    }
    let ttft = *arrivals.first().context("the stream carried no text")?;
    Ok(Streamed { ttft, tokens: usage.unwrap_or(arrivals.len()), arrivals, prompt_tokens })
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

/// A distinct prompt of `n` token ids for client `k`, from the middle three quarters of a
/// `vocab`-token vocabulary (the special tokens of the vocabularies brigade reads sit at its
/// ends).
fn ids_prompt(n: usize, vocab: usize, k: usize) -> Vec<u32> {
    let (lo, span) = (vocab / 8, (vocab / 4 * 3).max(1));
    let mix = |i: usize| {
        i.wrapping_mul(7919)
            .wrapping_add(k.wrapping_mul(104_729))
            .wrapping_add(i.wrapping_mul(i).wrapping_mul(k.wrapping_add(1)))
    };
    (0..n).map(|i| (lo + mix(i) % span) as u32).collect()
}

/// Client `k`'s prompt as the request's `prompt` field.
fn prompt_of(p: Prompt, vocab: Option<usize>, k: usize) -> Result<Value> {
    Ok(match p {
        Prompt::Words(w) => json!(words_prompt(w, k)),
        Prompt::Tokens(n) => {
            let v = vocab.context(
                "--prompt-tokens: no vocabulary size to pick ids from (the server's /v1/models lists no \
                 meta.n_vocab of 16 to 2^32 for this model)",
            )?;
            json!(ids_prompt(n, v, k))
        }
    })
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// One streaming completion of `n` tokens per prompt, all at once.
fn spawn_streams(
    t: &std::sync::Arc<Target>,
    model: &str,
    prompts: Vec<Value>,
    n: usize,
) -> Vec<tokio::task::JoinHandle<Result<Streamed>>> {
    prompts
        .into_iter()
        .map(|p| {
            let (t, m) = (t.clone(), model.to_string());
            tokio::spawn(async move { stream(&t, &m, p, n).await })
        })
        .collect()
}

/// One level of `c` clients: (aggregate t/s, TTFTs in ms, the prompts' token counts the server gave).
async fn level(
    t: &std::sync::Arc<Target>,
    (model, vocab): (&str, Option<usize>),
    prompt: Prompt,
    (c, n, rep): (usize, usize, usize),
) -> Result<(f64, Vec<f64>, Vec<usize>)> {
    // distinct for every client, repetition and level: a server that caches prompts
    // (llama-server keeps each slot's last prompt) gets no head start from earlier ones
    let prompts = (0..c).map(|k| prompt_of(prompt, vocab, c * 1009 + rep * 131 + k + 1)).collect::<Result<Vec<_>>>()?;
    let t0 = Instant::now();
    let tasks = spawn_streams(t, model, prompts, n);
    let (mut tokens, mut ttfts, mut lens) = (0, Vec::new(), Vec::new());
    for task in tasks {
        let s = task.await??;
        tokens += s.tokens;
        ttfts.push(s.ttft * 1e3);
        lens.extend(s.prompt_tokens);
    }
    Ok((tokens as f64 / t0.elapsed().as_secs_f64(), ttfts, lens))
}

/// `c - 1` streams decoding, then one prompt of `len` token ids: its TTFT, and the others'
/// longest gaps between tokens.
async fn long_prompt(
    t: &std::sync::Arc<Target>,
    (model, vocab): (&str, Option<usize>),
    prompt: Prompt,
    (c, len, n, rep): (usize, usize, usize, usize),
) -> Result<(f64, Vec<f64>)> {
    let prompts = (0..c.saturating_sub(1)).map(|k| prompt_of(prompt, vocab, 1000 + k)).collect::<Result<Vec<_>>>()?;
    let others = spawn_streams(t, model, prompts, n);
    // let the others get going first
    tokio::time::sleep(Duration::from_secs(2)).await;
    // ids inside the vocabulary where the server gives its size; else ids below 20 100, which
    // every vocabulary of a model worth a long-prompt test has (the middle three quarters of
    // 22 968 ids are 2 871..20 097); distinct per repetition: a server's prompt cache must not
    // serve a repeat
    let ids = ids_prompt(len, vocab.unwrap_or(22_968), 7 + rep);
    let ttft = stream(t, model, json!(ids), 4).await?.ttft;
    let mut gaps = Vec::new();
    for o in others {
        let arrivals = o.await??.arrivals;
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
        let (model, vocab) = target.model(b.model.as_deref()).await?;
        let m = (model.as_str(), vocab);
        // warm-up: a connection made, the server's first request served
        stream(&target, &model, json!(words_prompt(8, 0)), 2).await?;
        let mut rows = Vec::new();
        for &c in &b.concurrency {
            let (mut samples, mut ttfts, mut lens) = (Vec::new(), Vec::new(), Vec::new());
            for r in 0..b.reps {
                let (ts, mut tt, mut l) = level(&target, m, b.prompt, (c, b.n_gen, r)).await?;
                samples.push(ts);
                ttfts.append(&mut tt);
                lens.append(&mut l);
            }
            rows.push(Row {
                test: format!("tg{}", b.n_gen),
                concurrency: c,
                avg_ts: samples.iter().sum::<f64>() / samples.len() as f64,
                samples_ts: samples,
                ttft_p50_ms: pct(&mut ttfts.clone(), 0.5),
                ttft_p95_ms: pct(&mut ttfts, 0.95),
                others_gap_p95_ms: None,
                prompt_tokens_avg: (!lens.is_empty()).then(|| lens.iter().sum::<usize>() as f64 / lens.len() as f64),
            });
        }
        if b.long_prompt > 0 {
            let c = b.concurrency.iter().copied().max().unwrap_or(1).max(2);
            let (mut ttfts, mut gaps) = (Vec::new(), Vec::new());
            for rep in 0..b.reps {
                let (ttft, mut g) = long_prompt(&target, m, b.prompt, (c, b.long_prompt, b.n_gen.max(64), rep)).await?;
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
                prompt_tokens_avg: None,
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
    let lens: Vec<f64> = rows.iter().filter_map(|r| r.prompt_tokens_avg).collect();
    let what = match b.prompt {
        Prompt::Words(w) => format!("{w} words"),
        Prompt::Tokens(n) => format!("{n} token ids"),
    };
    match (lens.iter().copied().reduce(f64::min), lens.iter().copied().reduce(f64::max)) {
        (Some(lo), Some(hi)) if hi - lo < 0.5 => {
            println!("\neach client's prompt: {what}, {lo:.0} tokens (the server's count)")
        }
        (Some(lo), Some(hi)) => {
            println!("\neach client's prompt: {what}, {lo:.1} to {hi:.1} tokens (the server's count)")
        }
        _ => println!("\neach client's prompt: {what} (the server gave no prompt token counts)"),
    }
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
        // token prompts: the length asked, distinct per client, inside the vocabulary's middle
        for vocab in [16, 512, 22_968, 32000, 128_256] {
            let (a, b) = (ids_prompt(60, vocab, 1), ids_prompt(60, vocab, 2));
            assert_eq!(a.len(), 60);
            assert_ne!(a, b, "vocab {vocab}");
            assert!(a.iter().chain(&b).all(|&i| (vocab / 8..vocab - vocab / 8).contains(&(i as usize))), "{vocab}");
        }
        assert!(prompt_of(Prompt::Tokens(4), None, 0).unwrap_err().to_string().contains("n_vocab"));
        assert_eq!(prompt_of(Prompt::Tokens(4), Some(512), 0).unwrap().as_array().unwrap().len(), 4);
    }
}
