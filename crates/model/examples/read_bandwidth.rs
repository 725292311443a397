//! brigade's read bandwidth probe, as `bench` and the measured figures use it:
//! `cargo run -p brigade-model --example read_bandwidth -- [threads=2] [MiB] [passes=5]`
//! (scripts/compare-bandwidth.sh runs it beside a C reader).

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let threads = args.first().copied().unwrap_or(2).max(1);
    let bytes = args.get(1).map(|m| m << 20).unwrap_or_else(brigade_model::bandwidth::probe_bytes);
    let passes = args.get(2).copied().unwrap_or(5);
    let bw = brigade_model::bandwidth::read_bandwidth(bytes, threads, passes);
    println!(
        "{:.2} GB/s (brigade probe, {}, {threads} threads, {} MiB, best of {passes})",
        bw / 1e9,
        brigade_model::bandwidth::reader(),
        bytes >> 20
    );
}
