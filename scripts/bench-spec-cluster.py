#!/usr/bin/env python3
"""Speculative decoding across a 3-stage cluster on slow links: plain decoding against prompt lookup.

Needs root (network namespaces). A coordinator and three workers each get a namespace; every pair
is joined by a veth link slowed with `tc tbf` (RATE, both directions). `tc netem` is missing on
the machines this was written on, so the link's latency comes from a relay in each worker's
namespace that holds every UDP datagram and TCP chunk for DELAY ms before passing it on, both
ways (the worker advertises the relay's port): every hop between nodes costs DELAY one way.

The model is deployed over the three workers, the workers are started plainly and then with
`--spec-type ngram-simple`, and the same chat (a prompt whose answer copies code from it, greedy)
is generated RUNS times each way. Prints tokens/s, decode passes and drafts of each run, checks
that the text is the same, and the ratio of the medians.

    sudo scripts/bench-spec-cluster.py --bin target/debug/brigade -m target/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import asyncio
import base64
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# the function tests/serve/openai_client.py asks to copy too
MERGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "prompts", "merge_sorted.py")
PROMPT = "Copy this Python function exactly, then add a docstring to it:\n\n" + open(MERGE).read()

NODES = ["c", "w1", "w2", "w3"]


def sh(*args, check=True):
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.stderr}")
    return r


class Net:
    def __init__(self, rate):
        self.prefix = f"bsp{os.getpid() % 100000}"
        self.net = 100 + os.getpid() % 50
        for i, n in enumerate(NODES):
            ns = self.ns(n)
            sh("ip", "netns", "del", ns, check=False)
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "addr", "add", f"{self.ip(i)}/32", "dev", "lo")
        for a in range(len(NODES)):
            for b in range(a + 1, len(NODES)):
                na, nb = self.ns(NODES[a]), self.ns(NODES[b])
                ia, ib = f"v{a}{b}", f"v{b}{a}"
                sh("ip", "link", "add", ia, "netns", na, "type", "veth", "peer", "name", ib, "netns", nb)
                for ns, dev, peer in [(na, ia, b), (nb, ib, a)]:
                    sh("ip", "-n", ns, "link", "set", dev, "up")
                    sh("ip", "-n", ns, "route", "add", f"{self.ip(peer)}/32", "dev", dev)
                    sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                       "burst", "32kbit", "latency", "400ms")

    def ns(self, node):
        return f"{self.prefix}{node}"

    def ip(self, i):
        return f"10.{self.net}.0.{i + 1}"

    def ip_of(self, node):
        return self.ip(NODES.index(node))

    def close(self):
        for n in NODES:
            sh("ip", "netns", "del", self.ns(n), check=False)


RELAY = r'''
import asyncio, sys
listen_ip, listen_port, target_port, delay = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) / 1e3
target = (listen_ip, target_port)

class Up(asyncio.DatagramProtocol):
    def __init__(self, down, client):
        self.down, self.client = down, client
    def connection_made(self, t):
        self.t = t
    def datagram_received(self, data, _):
        loop.call_later(delay, self.down.sendto, data, self.client)

class Down(asyncio.DatagramProtocol):
    def __init__(self):
        self.ups = {}
    def connection_made(self, t):
        self.t = t
    def datagram_received(self, data, client):
        up = self.ups.get(client)
        if up is None:
            up = self.ups[client] = asyncio.ensure_future(
                loop.create_datagram_endpoint(lambda: Up(self.t, client), remote_addr=target))
        def send():
            if up.done():
                up.result()[0].sendto(data)
            else:
                up.add_done_callback(lambda f: f.result()[0].sendto(data))
        loop.call_later(delay, send)

async def pump(r, w):
    try:
        while data := await r.read(65536):
            loop.call_later(delay, w.write, data)
    finally:
        loop.call_later(delay, w.close)

async def tcp(r, w):
    try:
        ur, uw = await asyncio.open_connection(*target)
    except OSError:
        w.close()
        return
    await asyncio.gather(pump(r, uw), pump(ur, w), return_exceptions=True)

async def main():
    await loop.create_datagram_endpoint(Down, local_addr=(listen_ip, listen_port))
    server = await asyncio.start_server(tcp, listen_ip, listen_port)
    await server.serve_forever()

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
'''


class Cluster:
    def __init__(self, args, net, tmp):
        self.args, self.net, self.tmp = args, net, tmp
        self.token = "brg1-" + base64.b32encode(os.urandom(32)).decode().rstrip("=").lower()
        self.procs = {}
        self.coord = f"{net.ip_of('c')}:7000"

    def spawn(self, name, node, argv):
        log = open(os.path.join(self.tmp, f"{name}.log"), "a")
        p = subprocess.Popen(["ip", "netns", "exec", self.net.ns(node), *argv], stdout=log, stderr=log,
                             stdin=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "info"})
        self.procs[name] = p
        return p

    def kill(self, name):
        p = self.procs.pop(name, None)
        if p:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()

    def brigade(self, *argv):
        r = subprocess.run(["ip", "netns", "exec", self.net.ns("c"), self.args.bin, *argv, "--coordinator", self.coord,
                            "--ca", os.path.join(self.tmp, "coordinator", "ca.pem")], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"brigade {' '.join(argv)}: {r.stderr}\n{self.logs()}")
        return r.stdout

    def logs(self):
        return "".join(f"--- {f} ---\n{open(os.path.join(self.tmp, f)).read()[-3000:]}\n"
                       for f in sorted(os.listdir(self.tmp)) if f.endswith(".log"))

    def start_coordinator(self):
        d = os.path.join(self.tmp, "coordinator")
        self.spawn("coordinator", "c", [self.args.bin, "coordinator", "--listen", self.coord, "--data-dir", d,
                                        "--join-token", self.token])
        wait(lambda: os.path.exists(os.path.join(d, "coordinator.addr")), "the coordinator")

    def start_worker(self, w, extra):
        ip = self.net.ip_of(w)
        d = os.path.join(self.tmp, w)
        self.spawn(w, w, [self.args.bin, "worker", "--coordinator", self.coord, "--listen", f"{ip}:7101",
                          "--advertise", f"{ip}:7100", "--name", w, "--join-token", self.token, "--data-dir", d,
                          "--models-dir", os.path.join(d, "models"), "-t", "1", "--measure", "quick", *extra])

    def nodes_up(self):
        st = json.loads(self.brigade("status", "--json"))
        return sum(1 for n in st["nodes"] if n.get("state") == "up")


def wait(f, what, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if f():
                return
        except Exception:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"timed out waiting for {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rate", default="100mbit")
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("-n", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device-map", default="w1:cpu:10,w2:cpu:10,w3:cpu:10")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    tmp = tempfile.mkdtemp(prefix="bench-spec-")
    net = Net(args.rate)
    c = Cluster(args, net, tmp)
    relays = []
    try:
        for w in ["w1", "w2", "w3"]:
            relays.append(subprocess.Popen(["ip", "netns", "exec", net.ns(w), sys.executable, "-c", RELAY,
                                            net.ip_of(w), "7100", "7101", str(args.delay_ms)]))
        c.start_coordinator()
        results = {}
        for mode, extra in [("plain", []), ("ngram-simple", ["--spec-type", "ngram-simple"])]:
            for w in ["w1", "w2", "w3"]:
                c.start_worker(w, extra)
            wait(lambda: c.nodes_up() == 3, "three workers up")
            if mode == "plain":
                c.brigade("deploy", "--json", "--name", "m", "-m", os.path.abspath(args.model), "--device-map",
                          args.device_map)
            wait(lambda: any(d["state"] == "ready" for d in json.loads(c.brigade("status", "--json"))["deployments"]),
                 "the deployment ready", timeout=300)
            runs = []
            for _ in range(args.runs + 1):
                out = json.loads(c.brigade("generate", "--model", "m", "--chat", "-p", PROMPT, "-n", str(args.n),
                                           "--temp", "0", "--json"))
                t = out["timings"]
                runs.append((t["generation_tokens_per_s"], t["generated_tokens"], t["decode_passes"],
                             t["drafted_tokens"], t["accepted_tokens"], out["generated_ids"]))
            runs = runs[1:]  # the first warms the caches and connections
            for r in runs:
                print(f"{mode:13} {r[0]:7.1f} tokens/s  {r[1]} tokens in {r[2]} passes, "
                      f"{r[4]} of {r[3]} drafted taken", flush=True)
            results[mode] = runs
            for w in ["w1", "w2", "w3"]:
                c.kill(w)
            wait(lambda: c.nodes_up() == 0, "the workers down", timeout=60)
        same = all(r[5] == results["plain"][0][5] for rs in results.values() for r in rs)
        ratio = statistics.median(r[0] for r in results["ngram-simple"]) / statistics.median(
            r[0] for r in results["plain"])
        print(f"same text: {same}; prompt lookup / plain: {ratio:.2f}x "
              f"({args.rate} links, {args.delay_ms} ms one way per hop)")
        if not same:
            sys.exit(1)
    finally:
        for name in list(c.procs):
            c.kill(name)
        for r in relays:
            r.kill()
        net.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
