//! The dashboard at `/`: one server-rendered HTML page (no script, no external resource; it
//! reloads itself every few seconds with a `<meta refresh>`), drawn from the same [`Overview`]
//! and request records as `/metrics`: nodes with their devices and measured figures, links,
//! each deployment's plan as the planner's SVG with the measured figures per stage and per hop,
//! and the latest requests.

use crate::backend::Load;
use crate::metrics::RecentRequest;
use crate::overview::{DeploymentView, DeviceView, Overview};
use std::fmt::Write;

/// Seconds between the page's reloads.
const REFRESH_S: u32 = 3;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

fn per_s(s: f64) -> f64 {
    if s > 0.0 {
        1.0 / s
    } else {
        0.0
    }
}

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em;color:#222}h1{font-size:1.4em}\
h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}table{border-collapse:collapse;margin:.5em 0}\
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:left;font-size:.9em}th{background:#f4f4f4}\
td.n{text-align:right;font-variant-numeric:tabular-nums}.down,.failed,.degraded{color:#b00}.ready,.up{color:#070}\
.svg{overflow-x:auto;margin:.5em 0}.muted{color:#777}";

/// The page. `models` are the API's model ids (what clients ask for).
pub fn render(ov: Option<&Overview>, load: Option<Load>, recent: &[RecentRequest], models: &[String]) -> String {
    let mut h = String::new();
    let _ = writeln!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"{REFRESH_S}\">\
<title>brigade</title><style>{STYLE}</style></head><body>\n<h1>brigade</h1>"
    );
    let source = ov.map(|o| o.source.as_str()).unwrap_or("");
    let _ = writeln!(
        h,
        "<p class=\"muted\">{} · models: {} · reloads every {REFRESH_S} s · the same figures as <a href=\"/metrics\">/metrics</a></p>",
        esc(source),
        esc(&models.join(", "))
    );
    if let Some(l) = load {
        let _ = writeln!(h, "<p id=\"load\">sessions: {} of {} busy, {} waiting</p>", l.processing, l.slots, l.waiting);
    }
    if let Some(ov) = ov {
        nodes(&mut h, ov);
        links(&mut h, ov);
        h.push_str("<h2>Deployments</h2>\n");
        if ov.deployments.is_empty() {
            h.push_str("<p>none</p>\n");
        }
        for d in &ov.deployments {
            deployment(&mut h, d);
        }
    }
    requests(&mut h, recent);
    h.push_str("</body></html>\n");
    h
}

fn nodes(h: &mut String, ov: &Overview) {
    h.push_str("<h2>Nodes</h2>\n<table id=\"nodes\"><tr><th>node</th><th>state</th><th>address</th><th>heartbeat</th><th>device</th><th>memory free / total</th><th>read bandwidth</th><th>compute</th><th>features</th></tr>\n");
    for n in &ov.nodes {
        let rows = n.devices.len().max(1);
        let _ = write!(
            h,
            "<tr class=\"node\" data-node=\"{0}\"><td rowspan=\"{rows}\">{0}</td><td rowspan=\"{rows}\" class=\"{1}\">{1}</td><td rowspan=\"{rows}\">{2}</td><td rowspan=\"{rows}\" class=\"n\">{3:.1} s ago</td>",
            esc(&n.name),
            esc(&n.state),
            esc(&n.address),
            n.heartbeat_age_s
        );
        if n.devices.is_empty() {
            h.push_str("<td colspan=\"5\" class=\"muted\">no devices reported</td></tr>\n");
        }
        for (i, d) in n.devices.iter().enumerate() {
            if i > 0 {
                h.push_str("<tr>");
            }
            let _ = writeln!(
                h,
                "<td>{} <span class=\"muted\">{}</span></td><td class=\"n\">{} / {}</td><td class=\"n\">{:.1} GB/s</td><td class=\"n\">{:.1} GFLOP/s</td><td class=\"muted\">{}{}</td></tr>",
                esc(&d.name),
                esc(&d.model),
                bytes(d.memory_free as f64),
                bytes(d.memory_total as f64),
                d.mem_bandwidth / 1e9,
                d.flops / 1e9,
                esc(&d.features),
                host_link(d)
            );
        }
    }
    h.push_str("</table>\n");
}

/// A GPU's measured link to host memory, after its features (nothing for a CPU).
fn host_link(d: &DeviceView) -> String {
    if d.host_link_bandwidth > 0.0 {
        format!("; host link {:.1} GB/s", d.host_link_bandwidth / 1e9)
    } else {
        String::new()
    }
}

fn links(h: &mut String, ov: &Overview) {
    if ov.links.is_empty() {
        return;
    }
    h.push_str(
        "<h2>Links</h2>\n<table id=\"links\"><tr><th>from</th><th>to</th><th>latency</th><th>bandwidth</th></tr>\n",
    );
    for l in &ov.links {
        let _ = writeln!(
            h,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{:.3} ms</td><td class=\"n\">{:.1} MB/s</td></tr>",
            esc(&l.from),
            esc(&l.to),
            l.latency_s * 1e3,
            l.bandwidth / 1e6
        );
    }
    h.push_str("</table>\n");
}

fn deployment(h: &mut String, d: &DeploymentView) {
    let _ = writeln!(
        h,
        "<h3 class=\"deployment\" data-deployment=\"{0}\">{0} — <span class=\"{1}\">{1}</span></h3>",
        esc(&d.name),
        esc(&d.state)
    );
    if !d.error.is_empty() {
        let _ = writeln!(h, "<p class=\"failed\">{}</p>", esc(&d.error));
    }
    let _ = writeln!(
        h,
        "<p>decode: measured <b class=\"tps\" data-tokens-per-s=\"{0:.3}\">{0:.2} tokens/s</b> ({1:.2} ms/token over {2} steps) · predicted {3:.2} tokens/s ({4:.2} ms/token) · {5} tokens generated</p>",
        d.tokens_per_s(),
        d.measured_decode_s * 1e3,
        d.decode_steps,
        per_s(d.predicted_decode_s),
        d.predicted_decode_s * 1e3,
        d.tokens_generated
    );
    if !d.svg.is_empty() {
        // the planner's own SVG document, inline (it escapes its own text)
        let svg = d.svg.trim_start_matches(|c| c != '<');
        let svg = svg.strip_prefix("<?xml version=\"1.0\" encoding=\"UTF-8\"?>").unwrap_or(svg);
        let _ = writeln!(h, "<div class=\"svg\">{svg}</div>");
    }
    h.push_str("<table class=\"stages\"><tr><th>stage</th><th>node / device</th><th>layers</th><th>state</th><th>weights</th><th>KV cache</th><th>compute ms/token</th><th>stage tokens/s</th><th>hop</th><th>hop ms/token</th><th>hop tokens/s</th><th>hop bytes/token</th><th>predicted ms/token</th></tr>\n");
    for (i, s) in d.stages.iter().enumerate() {
        let c = s.compute_s_per_token(d.decode_steps);
        let hop = s.hop_s_per_token(d.decode_steps);
        let hop_bytes = if d.decode_steps == 0 { 0.0 } else { s.hop_bytes_total / d.decode_steps as f64 };
        let to = d.stages.get(i + 1).map_or("driver", |n| n.node.as_str());
        // layers as `plan` shows them: inclusive
        let (first, last) = (s.layers.0, s.layers.1.saturating_sub(1));
        let _ = writeln!(
            h,
            "<tr class=\"stage\"><td>{index}</td><td>{node}/{device}</td><td>{first}–{last}</td><td class=\"{state}\">{state}</td>\
<td class=\"n\">{weights}</td><td class=\"n\">{kv}</td><td class=\"n\">{c_ms:.3}</td>\
<td class=\"n stage-tps\" data-tokens-per-s=\"{c_tps:.3}\">{c_tps:.1}</td><td>{node} → {to}</td><td class=\"n\">{hop_ms:.3}</td>\
<td class=\"n hop-tps\" data-tokens-per-s=\"{hop_tps:.3}\">{hop_tps:.1}</td><td class=\"n\">{hop_b}</td><td class=\"n\">{pred_ms:.3}</td></tr>",
            index = s.index,
            node = esc(&s.node),
            device = esc(&s.device),
            state = esc(&s.state),
            weights = bytes(s.weight_bytes as f64),
            kv = bytes(s.kv_bytes as f64),
            c_ms = c * 1e3,
            c_tps = per_s(c),
            to = esc(to),
            hop_ms = hop * 1e3,
            hop_tps = per_s(hop),
            hop_b = bytes(hop_bytes),
            pred_ms = s.predicted_s * 1e3,
        );
    }
    h.push_str("</table>\n");
}

fn requests(h: &mut String, recent: &[RecentRequest]) {
    h.push_str("<h2>Recent requests</h2>\n");
    if recent.is_empty() {
        h.push_str("<p id=\"requests\">none yet</p>\n");
        return;
    }
    h.push_str("<table id=\"requests\"><tr><th>at (unix s)</th><th>model</th><th>endpoint</th><th>prompt tokens</th><th>generated</th><th>first token</th><th>tokens/s end to end</th><th>outcome</th></tr>\n");
    for r in recent {
        // end to end, as a client sees it (tokens may arrive in bursts: a rate between the
        // first and the last token says little)
        let tps = if r.duration_s > 0.0 { r.generated as f64 / r.duration_s } else { 0.0 };
        let _ = writeln!(
            h,
            "<tr><td class=\"n\">{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{:.0} ms</td><td class=\"n\">{:.1}</td><td>{}</td></tr>",
            r.at,
            esc(&r.model),
            esc(&r.endpoint),
            r.prompt_tokens,
            r.generated,
            r.ttft_s * 1e3,
            tps,
            esc(&r.outcome)
        );
    }
    h.push_str("</table>\n");
}
