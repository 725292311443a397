//! The cluster state on disk: `state.json` in the data dir, rewritten atomically (temporary file,
//! fsync, rename, fsync of the directory) after every applied command, before the caller is
//! answered. A coordinator killed at any instant restarts with every acknowledged change.
//!
//! A single replica's store; the replicated coordinator replaces it with a raft log whose entries
//! are the same [`Command`]s.

use crate::CoordError;
use brigade_core::cluster::{Applied, ClusterState, Command};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Refuse state files larger than this (the state is a few MB even with many large models).
const MAX_STATE_BYTES: u64 = 512 << 20;

pub struct Store {
    path: PathBuf,
    state: ClusterState,
}

impl Store {
    /// Opens the state in `dir` (an empty state when there is none yet).
    pub fn open(dir: &Path) -> Result<Self, CoordError> {
        let path = dir.join("state.json");
        let state = match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => ClusterState::new(),
            Err(e) => return Err(CoordError::io(&path, e)),
            Ok(m) if m.len() > MAX_STATE_BYTES => {
                return Err(CoordError::Corrupt(format!("{}: {} bytes is not a state file", path.display(), m.len())))
            }
            Ok(_) => {
                let text = std::fs::read_to_string(&path).map_err(|e| CoordError::io(&path, e))?;
                serde_json::from_str(&text).map_err(|e| CoordError::Corrupt(format!("{}: {e}", path.display())))?
            }
        };
        Ok(Store { path, state })
    }

    pub fn state(&self) -> &ClusterState {
        &self.state
    }

    /// Applies `cmd`; when it applies, the new state is on disk before this returns. A command
    /// that does not apply changes nothing, in memory or on disk.
    pub fn apply(&mut self, cmd: Command) -> Result<Applied, CoordError> {
        let mut next = self.state.clone();
        let out = next.apply(cmd)?;
        write_atomic(
            &self.path,
            serde_json::to_vec_pretty(&next).map_err(|e| CoordError::Internal(e.to_string()))?.as_slice(),
        )?;
        self.state = next;
        Ok(out)
    }
}

/// Writes `bytes` to `path` so that a crash leaves either the old or the new content.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CoordError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::fs::File::create(&tmp).map_err(|e| CoordError::io(&tmp, e))?;
        f.write_all(bytes).map_err(|e| CoordError::io(&tmp, e))?;
        f.sync_all().map_err(|e| CoordError::io(&tmp, e))?;
    }
    std::fs::rename(&tmp, path).map_err(|e| CoordError::io(path, e))?;
    if let Ok(d) = std::fs::File::open(dir) {
        // the rename is durable once the directory entry is
        let _ = d.sync_all();
    }
    Ok(())
}

/// Writes a secret file readable by its owner only (0600 from creation, never wider).
pub fn write_secret(path: &Path, bytes: &[u8]) -> Result<(), CoordError> {
    brigade_transport::tls::write_private(path, bytes).map_err(|e| CoordError::io(path, e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use brigade_core::cluster::{ModelRecord, NodeState};

    #[test]
    fn survives_reopen_and_refuses_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Store::open(dir.path()).unwrap();
        let model = ModelRecord {
            id: "x".into(),
            name: "x".into(),
            source: "embedded".into(),
            files: vec![],
            ranges: vec![],
            n_layers: 2,
            context_length: 8,
            profile: brigade_core::ModelProfile::from_shape(
                "x",
                &brigade_core::LlamaShape::preset("llama-1b").unwrap(),
                4.5,
                4,
            ),
            weight_types: vec![],
        };
        s.apply(Command::AddModel { model }).unwrap();
        // a command that fails leaves the file as it was
        assert!(s.apply(Command::SetNodeState { name: "nope".into(), state: NodeState::Down }).is_err());
        let again = Store::open(dir.path()).unwrap();
        assert_eq!(again.state(), s.state());
        assert_eq!(again.state().applied, 1);
        std::fs::write(dir.path().join("state.json"), b"{not json").unwrap();
        assert!(matches!(Store::open(dir.path()), Err(CoordError::Corrupt(_))));
    }

    #[test]
    fn secrets_are_owner_only() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("token");
        write_secret(&p, b"abc").unwrap();
        write_secret(&p, b"def").unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"def");
    }
}
