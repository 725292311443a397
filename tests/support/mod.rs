//! Clusters of real processes for the end-to-end tests: a coordinator and workers started from
//! the built `brigade` binary, talking over loopback (or network namespaces) with TLS. Every wait
//! is bounded; every process is killed when the test ends, passes or fails.
#![allow(clippy::unwrap_used, dead_code)]

pub mod linearizable;
pub mod netns;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_brigade");

pub struct Proc {
    pub name: String,
    pub child: Child,
    pub log: PathBuf,
}

impl Proc {
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A port free on loopback right now (for a coordinator that must come back on the same one).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < timeout, "timed out after {timeout:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The command prefix a process of the given name runs under (empty: none).
pub type Wrap = Box<dyn Fn(&str) -> Vec<String> + Send + Sync>;

/// A coordinator replica of a group.
pub struct Replica {
    pub id: u64,
    pub host: String,
    pub port: u16,
    pub proc: Option<Proc>,
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub token: String,
    pub port: u16,
    pub coordinator: Option<Proc>,
    /// A raft group of replicas instead of one coordinator.
    pub replicas: Vec<Replica>,
    pub workers: Vec<Proc>,
    /// Prefix for every process (e.g. `ip netns exec ns`), by process name.
    pub wrap: Wrap,
    pub coord_host: String,
    /// The API key client commands present (a coordinator started with `--api-key`).
    pub api_key: Option<String>,
}

impl Cluster {
    pub fn new() -> Cluster {
        Cluster {
            dir: tempfile::tempdir().unwrap(),
            token: brigade_transport::join::new_join_token(),
            port: free_port(),
            coordinator: None,
            replicas: Vec::new(),
            workers: Vec::new(),
            wrap: Box::new(|_| Vec::new()),
            coord_host: "127.0.0.1".into(),
            api_key: None,
        }
    }

    pub fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// The coordinator's address, or every replica's, comma separated.
    pub fn addr(&self) -> String {
        if self.replicas.is_empty() {
            return format!("{}:{}", self.coord_host, self.port);
        }
        self.replicas.iter().map(|r| format!("{}:{}", r.host, r.port)).collect::<Vec<_>>().join(",")
    }

    pub fn ca(&self) -> PathBuf {
        if self.replicas.is_empty() {
            self.path("coordinator/ca.pem")
        } else {
            self.path("coordinator-1/ca.pem")
        }
    }

    /// A group of `n` replicas bootstrapped together (the CA made once and copied, as an
    /// operator does), with a short raft tick and node timeout so that failures act fast.
    pub fn start_group(&mut self, n: usize) {
        let hosts = vec![self.coord_host.clone(); n];
        self.start_group_at(&hosts);
    }

    /// A group with one replica on each host (network namespaces' addresses).
    pub fn start_group_at(&mut self, hosts: &[String]) {
        let n = hosts.len();
        let d1 = self.path("coordinator-1");
        let out = Command::new(BIN)
            .args(["coordinator", "init", "--data-dir", d1.to_str().unwrap(), "--join-token", &self.token])
            .output()
            .unwrap();
        assert!(out.status.success(), "coordinator init: {}", String::from_utf8_lossy(&out.stderr));
        for i in 2..=n {
            let d = self.path(&format!("coordinator-{i}"));
            std::fs::create_dir_all(&d).unwrap();
            for f in ["ca.pem", "ca.key", "token", "replica-token"] {
                std::fs::copy(d1.join(f), d.join(f)).unwrap();
            }
        }
        self.replicas = hosts
            .iter()
            .enumerate()
            .map(|(i, h)| Replica { id: i as u64 + 1, host: h.clone(), port: free_port(), proc: None })
            .collect();
        for id in 1..=n as u64 {
            self.start_replica(id);
        }
    }

    pub fn peers(&self) -> String {
        self.replicas.iter().map(|r| format!("{}={}:{}", r.id, r.host, r.port)).collect::<Vec<_>>().join(",")
    }

    pub fn start_replica(&mut self, id: u64) {
        let r = self.replicas.iter().find(|r| r.id == id).unwrap();
        let (host, port) = (r.host.clone(), r.port);
        let dir = self.path(&format!("coordinator-{id}"));
        let listen = format!("{host}:{port}");
        let (ids, peers) = (id.to_string(), self.peers());
        let p = self.spawn(
            &format!("coordinator-{id}"),
            &[
                "coordinator",
                "--id",
                &ids,
                "--peers",
                &peers,
                "--listen",
                &listen,
                "--data-dir",
                dir.to_str().unwrap(),
                "--node-timeout",
                "2",
                "--raft-tick-ms",
                "50",
            ],
        );
        self.replicas.iter_mut().find(|r| r.id == id).unwrap().proc = Some(p);
    }

    pub fn kill_replica(&mut self, id: u64) {
        if let Some(mut p) = self.replicas.iter_mut().find(|r| r.id == id).and_then(|r| r.proc.take()) {
            p.kill9();
        }
    }

    /// The raft status some replica answers with (any that answers).
    pub fn raft(&self) -> Option<serde_json::Value> {
        let out = self.brigade(&["status", "--json"]);
        out.status
            .success()
            .then(|| serde_json::from_slice::<serde_json::Value>(&out.stdout).ok())
            .flatten()
            .map(|v| v["raft"].clone())
    }

    /// The leader's id once a leader is known to a replica that answers.
    pub fn wait_leader(&self, timeout: Duration) -> u64 {
        let mut id = 0;
        wait_until("a coordinator leader", timeout, || {
            id = self.raft().and_then(|r| r["leader"].as_u64()).unwrap_or(0);
            id != 0
        });
        id
    }

    pub fn spawn(&self, name: &str, args: &[&str]) -> Proc {
        let log = self.path(&format!("{name}.log"));
        let out = std::fs::OpenOptions::new().create(true).append(true).open(&log).unwrap();
        let wrap = (self.wrap)(name);
        let mut cmd = if wrap.is_empty() {
            Command::new(BIN)
        } else {
            let mut c = Command::new(&wrap[0]);
            c.args(&wrap[1..]).arg(BIN);
            c
        };
        cmd.args(args)
            .env("RUST_LOG", "info")
            .env_remove("BRIGADE_CONFIG")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        let child = cmd.spawn().unwrap();
        Proc { name: name.into(), child, log }
    }

    pub fn start_coordinator(&mut self, extra: &[&str]) {
        let listen = format!("{}:{}", self.coord_host, self.port);
        let dir = self.path("coordinator");
        let _ = std::fs::remove_file(dir.join("coordinator.addr"));
        let mut args =
            vec!["coordinator", "--listen", &listen, "--data-dir", dir.to_str().unwrap(), "--join-token", &self.token];
        args.extend_from_slice(extra);
        let p = self.spawn("coordinator", &args);
        self.coordinator = Some(p);
        let addr_file = dir.join("coordinator.addr");
        let c = self.coordinator.as_mut().unwrap();
        wait_until("the coordinator to listen", Duration::from_secs(30), || {
            if let Some(st) = c.exited() {
                panic!("coordinator exited ({st}):\n{}", c.log_text());
            }
            addr_file.exists()
        });
    }

    pub fn worker_args(&self, name: &str) -> Vec<String> {
        let dir = self.path(name);
        vec![
            "worker".into(),
            "--coordinator".into(),
            self.addr(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--name".into(),
            name.into(),
            "--join-token".into(),
            self.token.clone(),
            "--data-dir".into(),
            dir.display().to_string(),
            "--models-dir".into(),
            dir.join("models").display().to_string(),
            "-t".into(),
            "1".into(),
            "--measure".into(),
            "quick".into(),
        ]
    }

    pub fn start_worker_with(&mut self, name: &str, args: Vec<String>) {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = self.spawn(name, &refs);
        self.workers.retain(|w| w.name != name);
        self.workers.push(p);
    }

    pub fn start_worker(&mut self, name: &str, extra: &[&str]) {
        let mut args = self.worker_args(name);
        args.extend(extra.iter().map(|s| s.to_string()));
        self.start_worker_with(name, args);
    }

    pub fn worker(&mut self, name: &str) -> &mut Proc {
        self.workers.iter_mut().find(|w| w.name == name).unwrap()
    }

    /// Runs a client command of the CLI against this cluster.
    pub fn brigade(&self, args: &[&str]) -> Output {
        let ca = self.ca();
        let mut all: Vec<&str> = args.to_vec();
        let addr = self.addr();
        all.extend_from_slice(&["--coordinator", &addr, "--ca", ca.to_str().unwrap()]);
        if let Some(k) = &self.api_key {
            all.extend_from_slice(&["--api-key", k]);
        }
        let wrap = (self.wrap)("client");
        let mut cmd = if wrap.is_empty() {
            Command::new(BIN)
        } else {
            let mut c = Command::new(&wrap[0]);
            c.args(&wrap[1..]).arg(BIN);
            c
        };
        cmd.args(&all).env_remove("BRIGADE_CONFIG").output().unwrap()
    }

    pub fn status(&self) -> serde_json::Value {
        let out = self.brigade(&["status", "--json"]);
        assert!(out.status.success(), "status: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn nodes_up(&self) -> usize {
        let out = self.brigade(&["status", "--json"]);
        if !out.status.success() {
            return 0;
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
        v["nodes"].as_array().map(|n| n.iter().filter(|n| n["state"] == "up").count()).unwrap_or(0)
    }

    pub fn wait_up(&mut self, n: usize) {
        let t0 = Instant::now();
        loop {
            if self.nodes_up() >= n {
                return;
            }
            for w in &mut self.workers {
                if let Some(st) = w.exited() {
                    panic!("{} exited ({st}):\n{}", w.name, w.log_text());
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(60), "{} of {n} workers up after 60 s", self.nodes_up());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Deploys and asserts it became ready; returns the deployment's JSON.
    pub fn deploy(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["deploy", "--json"];
        all.extend_from_slice(args);
        let out = self.brigade(&all);
        assert!(
            out.status.success(),
            "deploy {args:?}: {}\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            self.logs()
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// `generate --json` greedy; returns the output JSON.
    pub fn generate(&self, model: &str, prompt: &str, n: usize) -> serde_json::Value {
        let n = n.to_string();
        let out = self.brigade(&["generate", "--model", model, "-p", prompt, "-n", &n, "--temp", "0", "--json"]);
        assert!(out.status.success(), "generate: {}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    }

    pub fn logs(&self) -> String {
        let mut s = String::new();
        for p in self.coordinator.iter().chain(self.workers.iter()) {
            s.push_str(&format!("--- {} ---\n{}\n", p.name, p.log_text()));
        }
        // replicas' logs outlive their processes (a killed replica's tells what it saw last)
        for r in &self.replicas {
            let name = format!("coordinator-{}", r.id);
            let text = std::fs::read_to_string(self.path(&format!("{name}.log"))).unwrap_or_default();
            s.push_str(&format!("--- {name} ---\n{text}\n"));
        }
        s
    }
}

/// `brigade run` greedy in one process: (prompt ids, generated ids).
pub fn run_ids(model: Option<&Path>, prompt: &str, n: usize) -> (Vec<u32>, Vec<u32>) {
    let n = n.to_string();
    let mut args = vec!["run", "-p", prompt, "-n", &n, "--temp", "0", "--json"];
    let m;
    if let Some(p) = model {
        m = p.display().to_string();
        args.extend_from_slice(&["-m", &m]);
    }
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(out.status.success(), "run: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (ids(&v["prompt_ids"]), ids(&v["generated_ids"]))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// A random-weight Llama model of the given shape and type, written with `brigade synth`.
pub fn synth_shape(path: &Path, [layers, hidden, ffn, heads, kv_heads, vocab]: [usize; 6], ty: &str) {
    let s = |x: usize| x.to_string();
    let (l, h, f, n, k, v) = (s(layers), s(hidden), s(ffn), s(heads), s(kv_heads), s(vocab));
    let args =
        ["--layers", &l, "--hidden", &h, "--ffn", &f, "--heads", &n, "--kv-heads", &k, "--vocab", &v, "--type", ty];
    synth(path, &args);
}

/// A small random-weight model written with `brigade synth`.
pub fn synth(path: &Path, extra: &[&str]) {
    let p = path.display().to_string();
    let mut args = vec!["synth", "-o", &p];
    args.extend_from_slice(extra);
    let out = Command::new(BIN).args(&args).output().unwrap();
    assert!(out.status.success(), "synth: {}", String::from_utf8_lossy(&out.stderr));
}

/// The repository's root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The SmolLM2 GGUF: `BRIGADE_SMOLLM2`, or `target/models/` (tests/fetch-smollm2.sh fetches it
/// when missing).
pub fn smollm2() -> PathBuf {
    fetched("BRIGADE_SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf", "fetch-smollm2.sh")
}

/// Gemma 3 270M (Q4_K_M): `BRIGADE_GEMMA3_270M`, or `target/models/`
/// (tests/fetch-gemma3-270m.sh fetches it when missing).
pub fn gemma3_270m() -> PathBuf {
    fetched("BRIGADE_GEMMA3_270M", "gemma-3-270m-q4_k_m.gguf", "fetch-gemma3-270m.sh")
}

/// A model file: `$var` where set, else `target/models/file`, which `tests/script` fetches when
/// it is not there.
fn fetched(var: &str, file: &str, script: &str) -> PathBuf {
    if let Ok(p) = std::env::var(var) {
        return PathBuf::from(p);
    }
    let p = root().join("target/models").join(file);
    if !p.exists() {
        let st = Command::new("bash").arg(root().join("tests").join(script)).status().unwrap();
        assert!(st.success(), "tests/{script} failed");
    }
    p
}

/// A `brigade serve` process on a free port; killed on drop.
pub struct Server {
    pub proc: Proc,
    pub url: String,
    _dir: tempfile::TempDir,
}

pub fn serve(args: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let mut child = Command::new(BIN)
        .env_remove("BRIGADE_CONFIG")
        .args(["serve", "--port", "0"])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc { name: "serve".into(), child, log };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = rx.recv_timeout(Duration::from_secs(120)).unwrap_or_else(|_| panic!("no address: {}", proc.log_text()));
    let url = line.split("listening on ").nth(1).and_then(|r| r.split(' ').next()).unwrap().to_string();
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"), "{line}");
    Server { proc, url, _dir: dir }
}

/// One HTTP/1.0 exchange with the server at `base` (`http://host:port`): `method path` with an
/// optional JSON body; the answer's body, its status asserted to be 200.
pub fn http(base: &str, method: &str, path: &str, json_body: Option<&str>) -> String {
    use std::io::{Read, Write};
    let host = base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.0\r\nHost: {host}\r\n").unwrap();
    if let Some(b) = json_body {
        write!(s, "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{b}", b.len()).unwrap();
    } else {
        write!(s, "\r\n").unwrap();
    }
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "{method} {path}:\n{head}\n{body}");
    body.to_string()
}
