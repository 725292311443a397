//! Times batched decoding alone (no prompts to speak of, no HTTP): `cargo run --release -p
//! brigade-model --example batch_decode -- MODEL.gguf [sessions,…] [steps]`. For each number of
//! sessions, that many jobs of an 8-token prompt and `steps` tokens (end of text ignored) run
//! through one [`Batch`]; prints the mean decode step (after every prompt is read), the
//! aggregate generated tokens per second and its ratio to one session's — what the weights read
//! once per step for every session buys.

use brigade_core::DeviceMap;
use brigade_model::batch::{Batch, Job, Output};
use brigade_model::{ModelFiles, Pipeline, SamplingParams};
use std::sync::Arc;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let threads = brigade_model::threads::resolve(None)?;
    // SAFETY: first thing in main, no other thread yet (without it candle reads /proc/cpuinfo
    // on every parallel op)
    unsafe { brigade_model::threads::set_for_process(threads) };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().ok_or("usage: batch_decode MODEL.gguf [sessions,…] [steps]")?;
    let sessions: Vec<usize> =
        args.get(1).map_or("1,2,4,8", String::as_str).split(',').map(str::parse).collect::<Result<_, _>>()?;
    let steps: usize = args.get(2).map_or(Ok(64), |s| s.parse())?;
    let files = ModelFiles::open(std::path::Path::new(path))?;
    let stages = DeviceMap::parse(&format!("cpu:{}", files.config.n_layers))?.stages(files.config.n_layers)?;
    let p = Arc::new(Pipeline::load(&files, &stages, 256, |_, _| {})?);
    let vocab = files.config.vocab as u32;
    println!("{path}: {} threads", candle_core::utils::get_num_threads());
    let mut single = None;
    for &n in &sessions {
        let mut b = Batch::new(p.clone(), n, |_| false)?;
        for j in 0..n {
            let prompt = (0..8u32).map(|i| 3 + (i * 31 + j as u32 * 17) % (vocab - 3)).collect();
            let job = Job {
                prompt,
                max_tokens: steps,
                sampler: SamplingParams::greedy(),
                ignore_eos: true,
                constraint: None,
                logprobs: None,
            };
            b.handle_submit(j as u64, job);
        }
        // read every prompt (and take each session's first token) before timing
        let mut firsts = 0;
        while firsts < n {
            firsts += b.step().iter().filter(|(_, o)| matches!(o, Output::Token(..))).count();
        }
        let (t, mut tokens, mut timed) = (Instant::now(), 0usize, 0usize);
        while !b.is_idle() {
            tokens += b.step().iter().filter(|(_, o)| matches!(o, Output::Token(..))).count();
            timed += 1;
        }
        let secs = t.elapsed().as_secs_f64();
        let tps = tokens as f64 / secs;
        let base = *single.get_or_insert(tps);
        println!(
            "{n:>2} sessions: {:7.2} ms per step, {tps:7.2} t/s aggregate, {:.2}× one session",
            secs * 1e3 / timed as f64,
            tps / base
        );
    }
    Ok(())
}
