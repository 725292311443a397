//! A plan as a picture: one bar per device filled by its weights and KV cache against its budget,
//! its layer range and time, and arrows for the hops labelled with their milliseconds.

use crate::explain::{human, Plan};

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// Renders `plan` as a standalone SVG document.
pub fn render(plan: &Plan) -> String {
    const BOX_W: f64 = 190.0;
    const GAP: f64 = 90.0;
    const TOP: f64 = 70.0;
    const BAR_H: f64 = 150.0;
    let n = plan.stages.len() as f64;
    let width = 40.0 + n * BOX_W + (n - 1.0).max(0.0) * GAP + 40.0;
    let height = TOP + BAR_H + 150.0 + if plan.host_expert_bytes > 0 { 20.0 } else { 0.0 };
    let mut s = String::new();
    s.push_str(&format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" viewBox=\"0 0 {width:.0} {height:.0}\" font-family=\"sans-serif\" font-size=\"12\">\n"
    ));
    s.push_str("<defs><marker id=\"arrow\" viewBox=\"0 0 10 10\" refX=\"9\" refY=\"5\" markerWidth=\"8\" markerHeight=\"8\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"#444\"/></marker></defs>\n");
    s.push_str(&format!("<rect width=\"{width:.0}\" height=\"{height:.0}\" fill=\"#fff\"/>\n"));
    s.push_str(&format!(
        "<text x=\"20\" y=\"24\" font-size=\"15\" font-weight=\"bold\">{}</text>\n",
        esc(&format!(
            "{} — {} — {:.2} tokens/s, {:.3} ms/token",
            plan.model, plan.objective, plan.tokens_per_s, plan.decode_ms_per_token
        ))
    ));
    s.push_str(&format!(
        "<text x=\"20\" y=\"44\" fill=\"#444\">{}</text>\n",
        esc(&format!("bottleneck: {}", plan.bottleneck))
    ));
    for (i, st) in plan.stages.iter().enumerate() {
        let x = 40.0 + i as f64 * (BOX_W + GAP);
        let budget = st.budget_bytes.max(1) as f64;
        let wh = (st.weight_bytes as f64 / budget).min(1.0) * BAR_H;
        let kh = (st.kv_bytes as f64 / budget).min(1.0 - wh / BAR_H).max(0.0) * BAR_H;
        let bx = x + 20.0;
        let bw = 60.0;
        let base = TOP + BAR_H;
        s.push_str(&format!(
            "<rect x=\"{bx:.1}\" y=\"{TOP:.1}\" width=\"{bw}\" height=\"{BAR_H}\" fill=\"#f2f2f2\" stroke=\"#888\"/>\n"
        ));
        s.push_str(&format!(
            "<rect x=\"{bx:.1}\" y=\"{:.1}\" width=\"{bw}\" height=\"{wh:.1}\" fill=\"{}\"/>\n",
            base - wh,
            if st.kind == brigade_core::DeviceKind::Cuda { "#5b8def" } else { "#e39b3b" }
        ));
        s.push_str(&format!(
            "<rect x=\"{bx:.1}\" y=\"{:.1}\" width=\"{bw}\" height=\"{kh:.1}\" fill=\"#9fd49b\"/>\n",
            base - wh - kh
        ));
        let tx = bx + bw + 10.0;
        let mut lines = vec![
            format!("{}/{}", st.node, st.device),
            format!("layers {}–{}", st.layers.0, st.layers.1 - 1),
            format!("{:.3} ms/token", st.compute_ms),
            format!("weights {}", human(st.weight_bytes)),
            format!("KV {}", human(st.kv_bytes)),
            format!("of {}", human(st.budget_bytes)),
        ];
        // split layers: the experts this stage leaves in the host's RAM
        if let Some((a, b)) = st.host_layers {
            lines.push(format!("experts {a}–{} in RAM", b - 1));
            lines.push(format!("({})", human(st.host_expert_bytes)));
        }
        for (j, line) in lines.iter().enumerate() {
            let weight = if j == 0 { " font-weight=\"bold\"" } else { "" };
            s.push_str(&format!(
                "<text x=\"{tx:.1}\" y=\"{:.1}\"{weight}>{}</text>\n",
                TOP + 14.0 + 18.0 * j as f64,
                esc(line)
            ));
        }
        if i + 1 < plan.stages.len() {
            let ax0 = x + BOX_W + 5.0;
            let ax1 = x + BOX_W + GAP - 5.0;
            let ay = TOP + BAR_H + 30.0;
            s.push_str(&format!("<line x1=\"{ax0:.1}\" y1=\"{ay:.1}\" x2=\"{ax1:.1}\" y2=\"{ay:.1}\" stroke=\"#444\" stroke-width=\"1.5\" marker-end=\"url(#arrow)\"/>\n"));
            if let Some(h) = plan.hops.get(i) {
                s.push_str(&format!(
                    "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{:.3} ms</text>\n",
                    (ax0 + ax1) / 2.0,
                    ay - 6.0,
                    h.ms
                ));
            }
        }
    }
    let ly = TOP + BAR_H + 70.0;
    s.push_str(&format!("<rect x=\"40\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"#5b8def\"/><text x=\"58\" y=\"{:.1}\">GPU weights</text>\n", ly - 10.0, ly));
    s.push_str(&format!("<rect x=\"150\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"#e39b3b\"/><text x=\"168\" y=\"{:.1}\">CPU weights</text>\n", ly - 10.0, ly));
    s.push_str(&format!("<rect x=\"260\" y=\"{:.1}\" width=\"12\" height=\"12\" fill=\"#9fd49b\"/><text x=\"278\" y=\"{:.1}\">KV cache</text>\n", ly - 10.0, ly));
    s.push_str(&format!(
        "<text x=\"40\" y=\"{:.1}\" fill=\"#444\">{}</text>\n",
        ly + 24.0,
        esc(&format!(
            "prefill 512 tokens: {:.1} ms ({:.1} tokens/s); bars: memory used of each device's budget",
            plan.prefill_ms_512, plan.prefill_tokens_per_s
        ))
    ));
    if let Some(host) = plan.host_device.as_ref().filter(|_| plan.host_expert_bytes > 0) {
        s.push_str(&format!(
            "<text x=\"40\" y=\"{:.1}\" fill=\"#444\">{}</text>\n",
            ly + 44.0,
            esc(&format!(
                "split layers (--n-cpu-moe {}): {} of experts in {}",
                plan.cpu_moe,
                human(plan.host_expert_bytes),
                match host.contains(", ") {
                    false => format!("{host}'s RAM, computed by its CPU"),
                    true => format!("the RAM of {host}, computed by their CPUs"),
                }
            ))
        ));
    }
    s.push_str("</svg>\n");
    s
}
