//! `brigade bench`'s report: the rows (JSON, also what a `-t` sweep's child processes hand back),
//! llama-bench's markdown table with a threads column and the predicted t/s beside the measured,
//! and CSV.

use crate::common::{human_bytes, human_params};
use anyhow::Result;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum OutFormat {
    Md,
    Csv,
    Json,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct DeviceBytes {
    pub name: String,
    pub layers: (usize, usize),
    pub bytes: u64,
    /// Split layers: the stage's experts held in RAM apart from the device.
    #[serde(default)]
    pub host_expert_bytes: u64,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Row {
    /// Compute threads of the process that ran the test.
    pub threads: usize,
    pub ngl: String,
    /// GPU layers actually used.
    pub n_gpu_layers: usize,
    /// Split layers: the routed experts of layers `[0, n_cpu_moe)` were in RAM (0: none).
    #[serde(default)]
    pub n_cpu_moe: usize,
    pub test: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    /// Tokens read before the test (`-d`), untimed.
    #[serde(default)]
    pub n_depth: usize,
    pub avg_ts: f64,
    pub stddev_ts: f64,
    pub samples_ts: Vec<f64>,
    pub load_ms: f64,
    pub devices: Vec<DeviceBytes>,
    /// Weight bytes read per generated token (the whole model but the embedding table).
    pub read_bytes_per_token: u64,
    /// The read bandwidth the bound uses (the best measured around this test).
    pub bandwidth_bytes_per_s: Option<f64>,
    pub bound_ts: Option<f64>,
    pub fraction_of_bound: Option<f64>,
    /// What the planner's cost model predicts for this placement with this machine's measured
    /// figures (prefill rate for pp rows, decode rate for tg rows).
    pub predicted_ts: Option<f64>,
    /// CUDA: bytes predicted on the GPU(s) before loading, and measured (free memory before the
    /// load minus free memory after a warm-up with one session alive).
    pub gpu_predicted_bytes: Option<u64>,
    pub gpu_measured_bytes: Option<u64>,
}

#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct Knee {
    pub threads: usize,
    pub ngl: String,
    pub n_gpu_layers: usize,
    pub tg_ts: f64,
    pub best_ts: f64,
}

/// The CPU's read bandwidth measured with a thread count.
#[derive(Serialize, Deserialize, Clone, Copy, Debug)]
pub struct BandwidthAt {
    pub threads: usize,
    pub bytes_per_s: f64,
}

#[derive(Serialize, Deserialize, Debug)]
pub struct BenchOut {
    pub model: String,
    pub model_bytes: u64,
    pub params: u64,
    pub cpu: String,
    pub bandwidth: Vec<BandwidthAt>,
    pub gpu_bandwidth_bytes_per_s: Option<f64>,
    pub rows: Vec<Row>,
    pub knees: Vec<Knee>,
    pub notes: Vec<String>,
}

impl BenchOut {
    /// Another thread count's report of the same benchmark, appended.
    pub fn merge(mut self, other: BenchOut) -> BenchOut {
        self.bandwidth.extend(other.bandwidth);
        self.gpu_bandwidth_bytes_per_s = self.gpu_bandwidth_bytes_per_s.or(other.gpu_bandwidth_bytes_per_s);
        self.rows.extend(other.rows);
        self.knees.extend(other.knees);
        for n in other.notes {
            if !self.notes.contains(&n) {
                self.notes.push(n);
            }
        }
        self
    }
}

pub fn print(out: &BenchOut, format: OutFormat) -> Result<()> {
    let text = match format {
        OutFormat::Json => format!("{}\n", serde_json::to_string_pretty(out)?),
        OutFormat::Csv => csv(out),
        OutFormat::Md => markdown(out),
    };
    crate::common::print_stdout(&text)
}

fn device_cols(r: &Row) -> String {
    r.devices
        .iter()
        .map(|d| {
            let host = match d.host_expert_bytes {
                0 => String::new(),
                b => format!(" + experts {} in RAM", human_bytes(b)),
            };
            format!("{} [{},{}) {}{host}", d.name, d.layers.0, d.layers.1, human_bytes(d.bytes))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn opt(x: Option<f64>) -> String {
    x.map(|b| format!("{b:.3}")).unwrap_or_default()
}

fn csv(o: &BenchOut) -> String {
    let mut s = String::from("model,model_bytes,params,threads,ngl,n_gpu_layers,n_cpu_moe,test,n_prompt,n_gen,n_depth,avg_ts,stddev_ts,predicted_ts,devices,read_bytes_per_token,bound_ts,fraction_of_bound,gpu_predicted_bytes,gpu_measured_bytes\n");
    for r in &o.rows {
        s.push_str(&format!(
            "\"{}\",{},{},{},{},{},{},{},{},{},{},{:.3},{:.3},{},\"{}\",{},{},{},{},{}\n",
            o.model,
            o.model_bytes,
            o.params,
            r.threads,
            r.ngl,
            r.n_gpu_layers,
            r.n_cpu_moe,
            r.test,
            r.n_prompt,
            r.n_gen,
            r.n_depth,
            r.avg_ts,
            r.stddev_ts,
            opt(r.predicted_ts),
            device_cols(r),
            r.read_bytes_per_token,
            opt(r.bound_ts),
            opt(r.fraction_of_bound),
            r.gpu_predicted_bytes.map(|b| b.to_string()).unwrap_or_default(),
            r.gpu_measured_bytes.map(|b| b.to_string()).unwrap_or_default()
        ));
    }
    s
}

/// The `ngl` column: the flag, the GPU layers it gave where they differ, and split layers.
fn ngl_cell(r: &Row) -> String {
    let ngl =
        if r.ngl == r.n_gpu_layers.to_string() { r.ngl.clone() } else { format!("{} ({})", r.ngl, r.n_gpu_layers) };
    match r.n_cpu_moe {
        0 => ngl,
        n => format!("{ngl}, n-cpu-moe {n}"),
    }
}

fn markdown(o: &BenchOut) -> String {
    let label = o.model.rsplit('/').next().unwrap_or(&o.model);
    let mut s = String::new();
    s.push_str("| model | size | params | threads | ngl | test | t/s | predicted t/s | devices |\n");
    s.push_str("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
    for r in &o.rows {
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.2} ± {:.2} | {} | {} |\n",
            label,
            human_bytes(o.model_bytes),
            human_params(o.params),
            r.threads,
            ngl_cell(r),
            r.test,
            r.avg_ts,
            r.stddev_ts,
            r.predicted_ts.map(|p| format!("{p:.2}")).unwrap_or_else(|| "–".into()),
            device_cols(r)
        ));
    }
    s.push('\n');
    s.push_str(&format!("CPU: {}\n", o.cpu));
    for b in &o.bandwidth {
        s.push_str(&format!("memory read bandwidth ({} threads): {:.1} GB/s\n", b.threads, b.bytes_per_s / 1e9));
    }
    if let Some(bw) = o.gpu_bandwidth_bytes_per_s {
        s.push_str(&format!("GPU memory bandwidth (device copy): {:.1} GB/s\n", bw / 1e9));
    }
    for r in o.rows.iter().filter(|r| r.n_gen > 0) {
        if let (Some(p), Some(m)) = (r.gpu_predicted_bytes, r.gpu_measured_bytes) {
            s.push_str(&format!(
                "-ngl {}: GPU bytes predicted {}, measured {} ({:+.1}%)\n",
                r.ngl,
                human_bytes(p),
                human_bytes(m),
                100.0 * (m as f64 - p as f64) / (p as f64).max(1.0)
            ));
        }
    }
    for r in &o.rows {
        if let (Some(b), Some(f)) = (r.bound_ts, r.fraction_of_bound) {
            s.push_str(&format!(
                "{} at -ngl {}, {} threads: {} of weights read per token at {:.1} GB/s -> bound {:.2} t/s; achieved {:.2} t/s = {:.2} of the bound\n",
                r.test,
                r.ngl,
                r.threads,
                human_bytes(r.read_bytes_per_token),
                r.bandwidth_bytes_per_s.unwrap_or(0.0) / 1e9,
                b,
                r.avg_ts,
                f
            ));
        }
    }
    for r in &o.rows {
        if let Some(p) = r.predicted_ts {
            s.push_str(&format!(
                "{} at -ngl {}, {} threads: measured {:.2} t/s, the cost model predicted {:.2} t/s (measured/predicted {:.2})\n",
                r.test,
                r.ngl,
                r.threads,
                r.avg_ts,
                p,
                r.avg_ts / p.max(1e-12)
            ));
        }
    }
    for k in &o.knees {
        s.push_str(&format!(
            "knee ({} threads): -ngl {} ({} GPU layers) is the smallest reaching 90% of the best tg ({:.2} of {:.2} t/s)\n",
            k.threads, k.ngl, k.n_gpu_layers, k.tg_ts, k.best_ts
        ));
    }
    for n in &o.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn row(threads: usize, test: &str, avg: f64, predicted: Option<f64>) -> Row {
        Row {
            threads,
            ngl: "0".into(),
            n_gpu_layers: 0,
            n_cpu_moe: 0,
            test: test.into(),
            n_prompt: 0,
            n_gen: 8,
            n_depth: 0,
            avg_ts: avg,
            stddev_ts: 0.0,
            samples_ts: vec![avg],
            load_ms: 1.0,
            devices: vec![DeviceBytes { name: "cpu".into(), layers: (0, 5), bytes: 1 << 20, host_expert_bytes: 0 }],
            read_bytes_per_token: 1 << 20,
            bandwidth_bytes_per_s: None,
            bound_ts: None,
            fraction_of_bound: None,
            predicted_ts: predicted,
            gpu_predicted_bytes: None,
            gpu_measured_bytes: None,
        }
    }

    fn out(threads: usize, notes: &[&str]) -> BenchOut {
        BenchOut {
            model: "/m/stories.gguf".into(),
            model_bytes: 1 << 20,
            params: 1000,
            cpu: "test cpu".into(),
            bandwidth: vec![BandwidthAt { threads, bytes_per_s: 2e10 }],
            gpu_bandwidth_bytes_per_s: None,
            rows: vec![row(threads, "tg8", 100.0 * threads as f64, Some(150.0))],
            knees: Vec::new(),
            notes: notes.iter().map(|n| n.to_string()).collect(),
        }
    }

    #[test]
    fn a_sweep_merges_and_prints_a_threads_column() {
        let m = out(1, &["a"]).merge(out(2, &["a", "b"]));
        assert_eq!(m.rows.iter().map(|r| r.threads).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(m.bandwidth.len(), 2);
        assert_eq!(m.notes, ["a", "b"]);
        let md = markdown(&m);
        assert!(md.contains("| threads |") && md.contains("| predicted t/s |"), "{md}");
        assert!(md.contains("| stories.gguf | 1.00 MiB | 1.00 K | 1 | 0 | tg8 | 100.00 ± 0.00 | 150.00 |"), "{md}");
        assert!(md.contains("| 2 | 0 | tg8 | 200.00 ± 0.00 | 150.00 |"), "{md}");
        assert!(md.contains("memory read bandwidth (2 threads): 20.0 GB/s"), "{md}");
        assert!(
            md.contains("measured 200.00 t/s, the cost model predicted 150.00 t/s (measured/predicted 1.33)"),
            "{md}"
        );
        let c = csv(&m);
        assert_eq!(c.lines().count(), 3);
        assert!(c.lines().nth(2).unwrap().contains(",2,0,0,0,tg8,0,8,0,200.000,0.000,150.000,"), "{c}");
        // the JSON a child process hands back reads back whole
        let back: BenchOut = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back.rows.len(), 2);
        assert_eq!(back.rows[1].predicted_ts, Some(150.0));
    }
}
