"""`/metrics` of a cluster's coordinator (and of a worker) read by the official Prometheus text
parser (`prometheus_client.parser`), after generations went through the cluster.

    python metrics_check.py --coordinator URL [--worker URL] --stages N

Every check is an assert; prints `ok: N checks` at the end (the Rust side requires that line).
"""

import argparse
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from checks import check, run


def samples(url):
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        check(r.status == 200, f"{url}/metrics answers")
        check(r.headers.get("Content-Type", "").startswith("text/plain"), "the text format's content type")
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def coordinator(url, stages):
    m = samples(url)
    compute = m.get("brigade_stage_compute_seconds_total", [])
    check(len(compute) == stages, f"one compute series per stage: {compute}")
    check(all(s.value > 0 for s in compute), f"every stage computed: {compute}")
    hops = m.get("brigade_hop_transfer_seconds_total", [])
    check(len(hops) == stages and all(s.value > 0 for s in hops), f"every hop carried: {hops}")
    hop_bytes = m.get("brigade_hop_transfer_bytes_total", [])
    check(all(s.value > 0 for s in hop_bytes) and len(hop_bytes) == stages, f"hop bytes: {hop_bytes}")
    check({s.labels["to"] for s in hops} >= {"driver"}, "the ring closes through the driver")
    pred = m["brigade_deployment_predicted_decode_seconds_per_token"]
    meas = m["brigade_deployment_measured_decode_seconds_per_token"]
    check(all(s.value > 0 for s in pred) and all(s.value > 0 for s in meas), f"predicted {pred} and measured {meas}")
    ok = [s for s in m.get("brigade_requests_total", []) if s.labels.get("status") == "200"]
    check(sum(s.value for s in ok) > 0, "answered requests are counted")
    check(m["brigade_generated_tokens_total"][0].value > 0, "tokens are counted")
    check(m["brigade_time_to_first_token_seconds_count"][0].value > 0, "time to first token observed")
    check(m["brigade_inter_token_seconds_count"][0].value > 0, "time between tokens observed")
    ages = m.get("brigade_node_heartbeat_age_seconds", [])
    check(len(ages) >= 2 and all(0 <= s.value < 30 for s in ages), f"heartbeat ages: {ages}")
    kv = m.get("brigade_stage_kv_cache_bytes", [])
    check(len(kv) == stages and all(s.value > 0 for s in kv), f"KV cache bytes: {kv}")
    w = [s for s in m.get("brigade_device_weight_bytes", []) if s.value > 0]
    check(len(w) >= 2, f"weights on the devices: {w}")
    for s in meas:
        print(f"measured {s.labels['deployment']} {s.value}")


def worker(url):
    m = samples(url)
    compute = m.get("brigade_worker_stage_compute_seconds_total", [])
    check(len(compute) >= 1 and all(s.value > 0 for s in compute), f"the worker's stages computed: {compute}")
    rows = m.get("brigade_worker_stage_rows_total", [])
    check(all(s.value > 0 for s in rows), f"rows: {rows}")
    batched = m.get("brigade_worker_stage_batched_rows_total", [])
    print(f"worker rows {[s.value for s in rows]} batched {[s.value for s in batched]}")
    # 16 concurrent streams went through: decode steps waiting together were computed together
    # (and their texts equal `brigade run`'s: the openai cases checked that)
    check(sum(s.value for s in batched) > 0, f"no decode steps were batched: {batched}")
    sent = m.get("brigade_worker_hop_sent_bytes_total", [])
    check(all(s.value > 0 for s in sent), f"bytes sent: {sent}")
    age = m["brigade_worker_heartbeat_age_seconds"][0].value
    check(0 <= age < 30, f"heartbeat age {age}")
    check(all(s.value > 0 for s in m.get("brigade_worker_stage_weight_bytes", [])), "weights")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--worker")
    ap.add_argument("--stages", type=int, required=True)
    a = ap.parse_args()
    coordinator(a.coordinator, a.stages)
    if a.worker:
        worker(a.worker)


if __name__ == "__main__":
    run(main)
